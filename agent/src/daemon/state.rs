//! The agent's node-local state file: what must survive an agent restart but not a reboot.
//!
//! In: the file path and the current boot id (`/proc/sys/kernel/random/boot_id`). Out: the
//! [`State`] to start from, and atomic writes of it.
//!
//! - The file lives on tmpfs (`/var/run/meshgate/state.json` by default), so a reboot clears
//!   it; the boot id inside covers hosts where `/var/run` is not tmpfs.
//! - A missing file, or one from another boot, means a fresh boot: start empty, re-verify
//!   everything. That is not an error.
//! - A file with an unknown format version is refused loudly and replaced: guessing at a
//!   format could repeat evictions or trust a stale verdict.
//! - Writes go to a temporary file in the same directory, are fsynced, then renamed over the
//!   old file, so a crash leaves either the old or the new state, never half of one.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use meshgate_core::evict::History;
use serde::{Deserialize, Serialize};

/// The only format version this agent reads and writes.
pub const FORMAT_VERSION: u32 = 1;

/// Where the kernel publishes this boot's id.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// The persisted state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    /// Format version; see [`FORMAT_VERSION`].
    pub version: u32,
    /// The boot this state belongs to.
    pub boot_id: String,
    /// The last verdict written to the Node: reason and whether it was verified.
    #[serde(default)]
    pub last_verdict: Option<LastVerdict>,
    /// Pod sandboxes evicted (pod UID + sandbox identity), so a restart does not repeat an
    /// eviction. Pruned to the pods still on the node after each full pod list.
    #[serde(default)]
    pub evicted: History,
}

/// The verdict last applied to the Node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastVerdict {
    /// The contract reason.
    pub reason: String,
    /// True when verified.
    pub verified: bool,
}

/// Why the state file could not be used or written.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The file exists but could not be read.
    #[error("cannot read state file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid JSON of the expected shape.
    #[error("state file {path} is corrupt: {source}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// The file has a format version this agent does not know.
    #[error("state file {path} has format version {found}, this agent only knows {FORMAT_VERSION}")]
    UnknownVersion {
        /// The file.
        path: PathBuf,
        /// The version found.
        found: u32,
    },
    /// The new state could not be written.
    #[error("cannot write state file {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// How the previous state was found at start.
#[derive(Debug)]
pub enum Loaded {
    /// Same boot: the agent restarted. The state carries over.
    Restarted(State),
    /// No file, or a file from another boot: a fresh boot.
    FreshBoot {
        /// The boot id of the old file, if there was one.
        previous_boot: Option<String>,
    },
    /// The file was unusable: refused, and the agent starts fresh.
    Refused(StateError),
}

/// Decides what an existing file's bytes mean for this boot. Pure, for tests.
pub fn interpret(path: &Path, bytes: &[u8], boot_id: &str) -> Loaded {
    #[derive(Deserialize)]
    struct VersionOnly {
        version: u32,
    }
    // Read the version first, so a future format that no longer parses as `State` is still
    // reported as an unknown version, not as corruption.
    let version = match serde_json::from_slice::<VersionOnly>(bytes) {
        Ok(v) => v.version,
        Err(source) => {
            return Loaded::Refused(StateError::Corrupt {
                path: path.into(),
                source,
            });
        }
    };
    if version != FORMAT_VERSION {
        return Loaded::Refused(StateError::UnknownVersion {
            path: path.into(),
            found: version,
        });
    }
    match serde_json::from_slice::<State>(bytes) {
        Err(source) => Loaded::Refused(StateError::Corrupt {
            path: path.into(),
            source,
        }),
        Ok(state) if state.boot_id == boot_id => Loaded::Restarted(state),
        Ok(state) => Loaded::FreshBoot {
            previous_boot: Some(state.boot_id),
        },
    }
}

/// Loads the state file at `path` for boot `boot_id`.
pub fn load(path: &Path, boot_id: &str) -> Loaded {
    match std::fs::read(path) {
        Ok(bytes) => interpret(path, &bytes, boot_id),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Loaded::FreshBoot {
            previous_boot: None,
        },
        Err(source) => Loaded::Refused(StateError::Read {
            path: path.into(),
            source,
        }),
    }
}

/// Writes `state` to `path` atomically (temp file, fsync, rename).
pub fn save(path: &Path, state: &State) -> Result<(), StateError> {
    let err = |source| StateError::Write {
        path: path.into(),
        source,
    };
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(err)?;
    let bytes = serde_json::to_vec_pretty(state).map_err(|e| err(std::io::Error::other(e)))?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(err)?;
    tmp.write_all(&bytes).map_err(err)?;
    tmp.as_file().sync_all().map_err(err)?;
    tmp.persist(path).map_err(|e| err(e.error))?;
    Ok(())
}

/// The state as the daemon's tasks share it: the verdict loop writes `last_verdict`, the pod
/// inspector writes `evicted`. One lock orders the writers, and every change is saved
/// atomically before the lock is released, so the file never goes back in time.
#[derive(Debug)]
pub struct Shared {
    path: PathBuf,
    state: Mutex<State>,
}

impl Shared {
    /// Shares `state`, saved to `path`.
    pub fn new(path: PathBuf, state: State) -> Self {
        Self {
            path,
            state: Mutex::new(state),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave a half-applied change worth refusing:
        // every update is a plain field assignment.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the state.
    pub fn read<T>(&self, f: impl FnOnce(&State) -> T) -> T {
        f(&self.lock())
    }

    /// Applies `f`, and saves when it returns true (it changed something). Blocking: the
    /// save writes and fsyncs a small file. On a failed save the change stays in memory and
    /// goes to disk with the next successful one.
    pub fn update(&self, f: impl FnOnce(&mut State) -> bool) -> Result<bool, StateError> {
        let mut state = self.lock();
        if !f(&mut state) {
            return Ok(false);
        }
        save(&self.path, &state)?;
        Ok(true)
    }

    /// Saves the current state.
    pub fn save(&self) -> Result<(), StateError> {
        save(&self.path, &self.lock())
    }
}

/// Reads this boot's id.
pub fn boot_id() -> std::io::Result<String> {
    Ok(std::fs::read_to_string(BOOT_ID_PATH)?.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(boot: &str) -> State {
        State {
            version: FORMAT_VERSION,
            boot_id: boot.into(),
            last_verdict: Some(LastVerdict {
                reason: "Verified".into(),
                verified: true,
            }),
            evicted: {
                let mut h = History::default();
                h.record(meshgate_core::evict::SandboxKey {
                    pod_uid: "uid-1".into(),
                    sandbox: "10.0.0.1#0".into(),
                });
                h
            },
        }
    }

    #[test]
    fn same_boot_restores_other_boot_is_fresh() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/state.json");
        assert!(matches!(
            load(&path, "b1"),
            Loaded::FreshBoot {
                previous_boot: None
            }
        ));
        save(&path, &state("b1")).unwrap();
        assert!(matches!(load(&path, "b1"), Loaded::Restarted(s) if s == state("b1")));
        assert!(
            matches!(load(&path, "b2"), Loaded::FreshBoot { previous_boot: Some(b) } if b == "b1")
        );
        // No temp files are left beside it.
        assert_eq!(
            std::fs::read_dir(path.parent().unwrap()).unwrap().count(),
            1
        );
    }

    #[test]
    fn shared_updates_save_only_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let shared = Shared::new(path.clone(), state("b1"));
        assert!(!shared.update(|_| false).unwrap());
        assert!(!path.exists(), "nothing changed, nothing written");
        let key = meshgate_core::evict::SandboxKey {
            pod_uid: "uid-2".into(),
            sandbox: "10.0.0.2#1".into(),
        };
        assert!(
            shared
                .update(|s| {
                    s.evicted.record(key.clone());
                    true
                })
                .unwrap()
        );
        match load(&path, "b1") {
            Loaded::Restarted(s) => {
                assert!(s.evicted.contains(&key));
                assert_eq!(s.evicted.len(), 2);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(shared.read(|s| s.evicted.len()), 2);
    }

    #[test]
    fn unknown_version_and_corruption_are_refused() {
        let p = Path::new("/x");
        assert!(matches!(
            interpret(p, br#"{"version":2,"boot_id":"b1","whatever":[]}"#, "b1"),
            Loaded::Refused(StateError::UnknownVersion { found: 2, .. })
        ));
        assert!(matches!(
            interpret(p, b"{\"version\":1,", "b1"),
            Loaded::Refused(StateError::Corrupt { .. })
        ));
        assert!(matches!(
            interpret(p, b"", "b1"),
            Loaded::Refused(StateError::Corrupt { .. })
        ));
    }
}
