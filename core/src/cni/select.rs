//! Which config file the container runtime really loads: the *effective* config.
//!
//! In: a [`ConfSource`] over the config directory, the runtime's semantics and, for CRI-O,
//! a validation closure (ocicni runs libcni's `ValidateNetworkList` on every list). Out: a
//! [`Selection`]: the effective file loaded into a [`NetConfList`] (drop-in plugins
//! appended), or why there is none. Messages name files and positions, never content.
//!
//! Files are read lazily, in sorted order, and only as far as the runtime would get:
//! - Candidates (libcni `ConfFiles`): entries whose dirent is not a directory (a symlink to
//!   a directory *is* a candidate, and fails to load with `EISDIR`) and whose
//!   `filepath.Ext` is `.conf`, `.conflist` or `.json`, sorted bytewise (`sort.Strings`).
//! - containerd (go-cni `loadFromConfDir` with containerd's default `max_conf_num = 1`):
//!   the first candidate is loaded; if it fails, loading fails; if it loads, the loop
//!   breaks (`i == max`), so no second file is ever read.
//! - CRI-O (ocicni `loadNetworks`): candidates that fail to load, have no plugins, or fail
//!   `ValidateNetworkList` are skipped; the first one left is the default network.
//! - `.conflist` (libcni `NetworkConfFromFile`): unless `loadOnlyInlinedPlugins`, the
//!   `.conf` files of `filepath.Join(confDir, name)` are appended in name order
//!   (`NetworkPluginConfsFromFiles`): a missing directory adds nothing, an empty name makes
//!   it the config directory itself, and any other listing error (a regular file there:
//!   `ENOTDIR`) fails the whole list. No plugins at all fails it too.
//! - `.conf` / `.json`: `ConfFromFile` + `ConfListFromConf`; never extended by drop-ins.

use super::config::{NetConfList, PluginConf};
use super::listing::{ConfSource, Dirent, SourceError, display, ext, is_config_name, join_clean};
use super::verdict::Reason;

/// The container runtime whose loading semantics are applied.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Runtime {
    /// containerd (go-cni): the first file wins; an invalid first file is fatal.
    #[default]
    Containerd,
    /// CRI-O (ocicni): files that fail to load or validate are skipped.
    Crio,
}

impl Runtime {
    /// The name used in flags and JSON output.
    pub fn as_str(self) -> &'static str {
        match self {
            Runtime::Containerd => "containerd",
            Runtime::Crio => "crio",
        }
    }
}

/// What ocicni's `ValidateNetworkList` concluded about a loaded list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Validation {
    /// Every chain plugin's binary exists and supports the list's cniVersion.
    Valid,
    /// It fails: the reason the verdict would give, and a message without file content.
    Fails(Reason, String),
    /// meshgate cannot tell (a plugin ran out of time).
    Undecidable(Reason, String),
}

/// A candidate CRI-O skipped, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    /// Its raw file name.
    pub file: Vec<u8>,
    /// `ConfigInvalid` for a load failure, or the binary reason for a validation failure.
    pub reason: Reason,
    /// Why, without file content.
    pub why: String,
}

/// The config the runtime loads, with how it was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EffectiveConfig {
    /// Raw file name of the effective config in the config directory.
    pub file: Vec<u8>,
    /// The loaded chain, drop-in plugins included.
    pub list: NetConfList,
    /// Drop-in plugin file names appended to the chain, in order.
    pub drop_ins: Vec<Vec<u8>>,
    /// Files sorting before the effective one that CRI-O skipped.
    pub skipped: Vec<Skipped>,
}

/// The outcome of effective-config selection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selection {
    /// The runtime loads this config.
    Found(EffectiveConfig),
    /// No candidate file at all (or no config directory).
    NoConfig,
    /// The config directory itself cannot be listed.
    Unlistable(String),
    /// containerd: the first candidate does not load, so nothing loads.
    Invalid {
        /// The offending file name.
        file: Vec<u8>,
        /// Why it cannot be loaded.
        why: String,
    },
    /// CRI-O: every candidate was skipped.
    NoneValid {
        /// Each candidate and why it was skipped, in name order.
        skipped: Vec<Skipped>,
    },
    /// meshgate cannot tell what the runtime does with this file (byte budget, a FIFO, a
    /// plugin that ran out of time during CRI-O's validation).
    Undecidable {
        /// The file at which it stopped.
        file: Vec<u8>,
        /// The reason to report.
        reason: Reason,
        /// Why.
        why: String,
    },
}

enum LoadFail {
    Error(String),
    Undecidable(String),
}

fn from_source(e: SourceError) -> LoadFail {
    match e {
        SourceError::Undecidable(why) => LoadFail::Undecidable(why),
        other => LoadFail::Error(other.to_string()),
    }
}

/// Selects the effective config. `validate` is called only for CRI-O, on lists that load.
pub fn select_effective(
    src: &mut dyn ConfSource,
    runtime: Runtime,
    validate: &mut dyn FnMut(&NetConfList) -> Validation,
) -> Selection {
    let entries = match src.list(b"") {
        Ok(e) => e,
        Err(SourceError::NotFound) => return Selection::NoConfig,
        Err(e) => return Selection::Unlistable(e.to_string()),
    };
    let mut candidates: Vec<Dirent> = entries
        .into_iter()
        .filter(|e| !e.is_dir && is_config_name(&e.name))
        .collect();
    // Go's sort.Strings compares bytes; so does Vec<u8>'s Ord.
    candidates.sort_by(|a, b| a.name.cmp(&b.name));
    if candidates.is_empty() {
        return Selection::NoConfig;
    }

    let mut skipped = Vec::new();
    for c in candidates {
        let file = c.name;
        match load(src, &file) {
            Ok((list, drop_ins)) => {
                if runtime == Runtime::Crio {
                    match validate(&list) {
                        Validation::Valid => {}
                        Validation::Fails(reason, why) => {
                            skipped.push(Skipped { file, reason, why });
                            continue;
                        }
                        Validation::Undecidable(reason, why) => {
                            return Selection::Undecidable { file, reason, why };
                        }
                    }
                }
                return Selection::Found(EffectiveConfig {
                    file,
                    list,
                    drop_ins,
                    skipped,
                });
            }
            Err(LoadFail::Undecidable(why)) => {
                return Selection::Undecidable {
                    file,
                    reason: Reason::ConfigInvalid,
                    why,
                };
            }
            Err(LoadFail::Error(why)) => match runtime {
                Runtime::Containerd => return Selection::Invalid { file, why },
                Runtime::Crio => skipped.push(Skipped {
                    file,
                    reason: Reason::ConfigInvalid,
                    why,
                }),
            },
        }
    }
    Selection::NoneValid { skipped }
}

/// Loads one candidate as go-cni / ocicni would, drop-ins included.
fn load(src: &mut dyn ConfSource, file: &[u8]) -> Result<(NetConfList, Vec<Vec<u8>>), LoadFail> {
    let bytes = src.read(file).map_err(from_source)?;
    if ext(file) != b".conflist" {
        let list =
            NetConfList::from_conf_bytes(&bytes).map_err(|e| LoadFail::Error(e.to_string()))?;
        return Ok((list, Vec::new()));
    }
    let mut list =
        NetConfList::from_conflist_bytes(&bytes).map_err(|e| LoadFail::Error(e.to_string()))?;
    drop(bytes);
    let mut drop_ins = Vec::new();
    if !list.load_only_inlined_plugins {
        let dir = join_clean(b"", list.name.as_bytes());
        let entries = match src.list(&dir) {
            Ok(e) => e,
            Err(SourceError::NotFound) => Vec::new(),
            Err(SourceError::Undecidable(why)) => return Err(LoadFail::Undecidable(why)),
            Err(SourceError::Io(why)) => {
                return Err(LoadFail::Error(format!(
                    "names a network whose drop-in plugin directory cannot be listed ({why}), so the list fails to load"
                )));
            }
        };
        for (k, f) in entries
            .into_iter()
            .filter(|f| !f.is_dir && ext(&f.name) == b".conf")
            .enumerate()
        {
            let path = join_clean(&dir, &f.name);
            let shown = display(&f.name);
            let plugin = src
                .read(&path)
                .map_err(|e| match e {
                    SourceError::Undecidable(why) => LoadFail::Undecidable(why),
                    other => {
                        LoadFail::Error(format!("drop-in plugin file #{} ({shown}) {other}", k + 1))
                    }
                })
                .and_then(|b| {
                    PluginConf::from_bytes(&b).map_err(|e| {
                        LoadFail::Error(format!("drop-in plugin file #{} ({shown}) {e}", k + 1))
                    })
                })?;
            list.plugins.push(plugin);
            drop_ins.push(f.name);
        }
    }
    if list.plugins.is_empty() {
        return Err(LoadFail::Error(
            "has no plugins (none inline and none in its drop-in directory)".into(),
        ));
    }
    Ok((list, drop_ins))
}
