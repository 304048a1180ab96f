//! Finds and runs CNI plugin binaries with `CNI_COMMAND=VERSION`, bounded in time and output.
//!
//! In: a plugin type and the config's cniVersion. Out: a `ProbeOutcome` for
//! `meshgate_core::cni::verify`.
//!
//! - Lookup follows libcni's `FindInPath`: the first *regular file* of that name in bin-dir
//!   order. A non-regular file of that name is reported only when nothing else is found.
//! - Only VERSION is ever run (never ADD/DEL/GC), in its own process group, with a fixed
//!   environment. On timeout the whole group is killed, so a plugin that forks cannot keep
//!   its pipes open and stall the agent. Output is capped, so a flooding plugin costs
//!   bounded memory.
//! - Answers are cached by (path, device, inode, size, mtime, ctime, mode, cniVersion): an
//!   unchanged binary is not run again, and any rewrite, replace or chmod is re-probed.
//!   Failures to start and timeouts are not cached, since they may be transient.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};

use meshgate_core::cni::probe::decode_version_reply;
use meshgate_core::cni::{Broken, ProbeOutcome};

/// Largest VERSION reply kept; real replies are well under 1 KiB.
const MAX_STDOUT: usize = 64 * 1024;
/// Largest stderr excerpt kept for messages.
const MAX_STDERR: usize = 4 * 1024;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct CacheKey {
    path: PathBuf,
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    mode: u32,
    cni_version: String,
}

/// Runs plugin binaries' VERSION command, with a cache of their answers.
#[derive(Debug)]
pub struct Prober {
    bin_dirs: Vec<PathBuf>,
    timeout: Duration,
    cache: Mutex<HashMap<CacheKey, ProbeOutcome>>,
}

impl Prober {
    /// A prober searching `bin_dirs` in order and killing binaries after `timeout`.
    pub fn new(bin_dirs: Vec<PathBuf>, timeout: Duration) -> Self {
        Self {
            bin_dirs,
            timeout,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// How many answers are cached (for tests and debugging).
    pub fn cached(&self) -> usize {
        self.cache.lock().map(|c| c.len()).unwrap_or(0)
    }

    /// Looks up `plugin_type` and asks it for VERSION with `cni_version` on stdin.
    pub fn probe(&self, plugin_type: &str, cni_version: &str) -> ProbeOutcome {
        let mut non_regular = None;
        for dir in &self.bin_dirs {
            let path = dir.join(plugin_type);
            match std::fs::metadata(&path) {
                Ok(meta) if meta.is_file() => return self.probe_file(path, &meta, cni_version),
                Ok(_) => {
                    non_regular.get_or_insert(path);
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    // A dangling symlink, a symlink loop, EACCES: a file is there but unusable.
                    return ProbeOutcome::Broken {
                        path: path.display().to_string(),
                        why: Broken::Failed(format!("cannot stat: {e}")),
                    };
                }
            }
        }
        match non_regular {
            Some(path) => ProbeOutcome::Broken {
                path: path.display().to_string(),
                why: Broken::NotRegularFile,
            },
            None => ProbeOutcome::Missing {
                searched: self
                    .bin_dirs
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect(),
            },
        }
    }

    fn probe_file(
        &self,
        path: PathBuf,
        meta: &std::fs::Metadata,
        cni_version: &str,
    ) -> ProbeOutcome {
        let shown = path.display().to_string();
        let broken = |why| ProbeOutcome::Broken {
            path: shown.clone(),
            why,
        };
        if meta.permissions().mode() & 0o111 == 0 {
            return broken(Broken::NotExecutable);
        }
        if meta.len() == 0 {
            return broken(Broken::Empty);
        }
        let key = CacheKey {
            path: path.clone(),
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.len(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
            ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
            mode: meta.mode(),
            cni_version: cni_version.to_string(),
        };
        if let Some(hit) = self.cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
            return hit;
        }
        let (outcome, cacheable) = match self.run_version(&path, cni_version) {
            Ok(supported) => (
                ProbeOutcome::Answered {
                    path: shown.clone(),
                    supported,
                },
                true,
            ),
            Err((why, cacheable)) => (broken(why), cacheable),
        };
        if cacheable && let Ok(mut cache) = self.cache.lock() {
            // Drop answers for older versions of this same file, so the cache stays bounded
            // by the number of binaries rather than by their rewrites.
            cache.retain(|k, _| k.path != key.path);
            cache.insert(key, outcome.clone());
        }
        outcome
    }

    /// Runs `path` with VERSION. `Err((why, cacheable))` on failure.
    fn run_version(&self, path: &Path, cni_version: &str) -> Result<Vec<String>, (Broken, bool)> {
        let cni_path: OsString = std::env::join_paths(&self.bin_dirs).unwrap_or_default();
        let mut child = Command::new(path)
            .env_clear()
            .env("CNI_COMMAND", "VERSION")
            .env("CNI_PATH", cni_path)
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group, so a timeout kills everything it started.
            .process_group(0)
            .spawn()
            .map_err(|e| {
                let cacheable = e.raw_os_error() == Some(libc::ENOEXEC);
                (
                    Broken::Failed(format!("cannot be executed: {e}")),
                    cacheable,
                )
            })?;

        if let Some(mut stdin) = child.stdin.take() {
            // A plugin that exits without reading gives EPIPE here; its exit status says more.
            let _ = stdin.write_all(format!("{{\"cniVersion\":\"{cni_version}\"}}").as_bytes());
        }
        let stdout = capture(child.stdout.take(), MAX_STDOUT);
        let stderr = capture(child.stderr.take(), MAX_STDERR);

        let status = match wait_with_deadline(&mut child, self.timeout) {
            Some(status) => status,
            None => {
                kill_group(&child);
                let _ = child.wait();
                return Err((
                    Broken::TimedOut {
                        after_ms: self.timeout.as_millis() as u64,
                    },
                    false,
                ));
            }
        };
        // The pipes close when the plugin exits; a grandchild that escaped the process group
        // could hold them open, so collect output with a short bound rather than forever.
        let grace = Duration::from_millis(500);
        let out = stdout.recv_timeout(grace).unwrap_or_default();
        let err = stderr.recv_timeout(grace).unwrap_or_default();
        if status.success() {
            return decode_version_reply(&out).map_err(|why| (why, true));
        }
        // A CNI error reply on stdout explains a non-zero exit better than the status.
        if let Err(why @ Broken::Failed(_)) = decode_version_reply(&out) {
            return Err((why, true));
        }
        let err = String::from_utf8_lossy(&err);
        let err = err.trim();
        let mut why = format!("exited with {status}");
        if !err.is_empty() {
            why.push_str(&format!(": {}", err.chars().take(300).collect::<String>()));
        }
        Err((Broken::Failed(why), true))
    }
}

/// Reads a pipe to its end on a thread, keeping at most `cap` bytes and discarding the rest
/// (so a flooding child never blocks on a full pipe), and sends what it kept.
fn capture(pipe: Option<impl Read + Send + 'static>, cap: usize) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    if let Some(mut pipe) = pipe {
        std::thread::spawn(move || {
            let mut kept = Vec::new();
            let mut buf = [0u8; 8192];
            loop {
                match pipe.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        let room = cap.saturating_sub(kept.len());
                        kept.extend_from_slice(&buf[..n.min(room)]);
                    }
                }
            }
            let _ = tx.send(kept);
        });
    }
    rx
}

/// Polls the child until it exits or the deadline passes. Polling (1–10 ms) keeps this free
/// of signals and extra threads; a VERSION call normally ends within a few milliseconds.
fn wait_with_deadline(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(1);
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) => {}
            Err(_) => return None,
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(10));
    }
}

fn kill_group(child: &Child) {
    let pgid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
}
