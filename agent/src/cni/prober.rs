//! Finds and runs CNI plugin binaries with `CNI_COMMAND=VERSION`, bounded in time, output
//! and reach, exactly as libcni v1.3 asks them (`pkg/invoke/exec.go` `GetVersionInfo`).
//!
//! In: a plugin type (a plain file name: anything else is refused before any lookup) and
//! the verification's deadline. Out: a `ProbeOutcome` for `meshgate_core::cni::verify`.
//!
//! - Lookup follows libcni's `FindInPath`: the first *regular file* (after following
//!   symlinks) named `<bin dir>/<type>`, in bin-dir order; entries that cannot be stat'ed or
//!   are not regular are passed over. A non-regular file of that name is reported only when
//!   nothing else is found.
//! - The plugin gets libcni's VERSION call: stdin `{"cniVersion":"1.1.0"}` (libcni sends
//!   `version.Current()`, never the config's version), `CNI_COMMAND=VERSION`,
//!   `CNI_NETNS`/`CNI_IFNAME`/`CNI_PATH` = `dummy`, empty `CNI_CONTAINERID`/`CNI_ARGS`.
//!   Stdin is written by its own thread after the timer starts, so a plugin that never
//!   reads cannot block the caller.
//! - Time: each run gets the smaller of `--probe-timeout` and what is left of the
//!   verification's overall deadline; nothing runs once the deadline has passed.
//! - Reach: the plugin runs as PID 1 of a fresh PID namespace (on a short-lived thread that
//!   `unshare(CLONE_NEWPID)`s, so nothing else is affected). When it exits or is killed the
//!   kernel SIGKILLs every process left in that namespace, including grandchildren that
//!   called `setsid` or double-forked: nothing it started survives, ever. Without
//!   `CAP_SYS_ADMIN` (a non-root `check`) it falls back to its own process group, killed
//!   always, plus a sweep that SIGKILLs any process still holding its stdout/stderr pipes.
//! - Output is capped (64 KiB stdout, 4 KiB stderr) and only lengths reach messages.
//! - Answers are cached by (path, device, inode, size, mtime, ctime, mode): an unchanged
//!   binary is not run again; any rewrite, replace or chmod is re-probed. Failures to start
//!   and timeouts are not cached, since they may be transient.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};

use meshgate_core::cni::probe::{
    VERSION_STDIN, decode_error_reply, decode_version_reply, is_plain_name,
    is_unknown_version_command,
};
use meshgate_core::cni::{Broken, ProbeOutcome};

/// Largest VERSION reply kept; real replies are well under 1 KiB.
const MAX_STDOUT: usize = 64 * 1024;
/// Largest stderr kept (only its length is ever reported).
const MAX_STDERR: usize = 4 * 1024;
/// How long pipes may stay open after the plugin is gone before their holders are hunted.
const PIPE_GRACE: Duration = Duration::from_millis(100);

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct CacheKey {
    path: PathBuf,
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    mode: u32,
}

/// Runs plugin binaries' VERSION command, with a cache of their answers.
#[derive(Debug)]
pub struct Prober {
    bin_dirs: Vec<PathBuf>,
    timeout: Duration,
    cache: Mutex<HashMap<CacheKey, ProbeOutcome>>,
}

/// How one run ended.
struct Run {
    status: Option<ExitStatus>,
    stdout: Vec<u8>,
    stderr_len: usize,
}

impl Prober {
    /// A prober searching `bin_dirs` in order and killing a binary after `timeout`.
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

    /// Looks up `plugin_type` and asks it for VERSION, finishing by `deadline`.
    pub fn probe(&self, plugin_type: &str, deadline: Instant) -> ProbeOutcome {
        if !is_plain_name(plugin_type) {
            // The core never asks for these; refusing here too keeps any future caller
            // from turning a config into "run this path as root".
            return ProbeOutcome::Broken {
                path: String::new(),
                why: Broken::CannotStart("refused: the type is not a plain file name".into()),
            };
        }
        let mut fallback: Option<(PathBuf, Broken)> = None;
        for dir in &self.bin_dirs {
            let path = dir.join(plugin_type);
            match std::fs::metadata(&path) {
                Ok(meta) if meta.is_file() => return self.probe_file(path, &meta, deadline),
                Ok(_) => {
                    fallback.get_or_insert((path, Broken::NotRegularFile));
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                // A dangling symlink, a loop, EACCES: FindInPath passes over it too.
                Err(e) => {
                    fallback
                        .get_or_insert((path, Broken::CannotStart(format!("cannot stat: {e}"))));
                }
            }
        }
        match fallback {
            Some((path, why)) => ProbeOutcome::Broken {
                path: path.display().to_string(),
                why,
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
        deadline: Instant,
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
        };
        if let Some(hit) = self.cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
            return hit;
        }
        let (outcome, cacheable) = match self.run_version(&path, deadline) {
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
    fn run_version(&self, path: &Path, deadline: Instant) -> Result<Vec<String>, (Broken, bool)> {
        let now = Instant::now();
        let allowed = self.timeout.min(deadline.saturating_duration_since(now));
        let after_ms = allowed.as_millis() as u64;
        if allowed.is_zero() {
            return Err((Broken::TimedOut { after_ms }, false));
        }
        let run = run_isolated(path, now + allowed)?;
        let Some(status) = run.status else {
            return Err((Broken::TimedOut { after_ms }, false));
        };
        if status.success() {
            return decode_version_reply(&run.stdout).map_err(|why| {
                (
                    Broken::BadReply {
                        why,
                        len: run.stdout.len(),
                    },
                    true,
                )
            });
        }
        // libcni GetVersionInfo: an old plugin that does not know VERSION supports 0.1.0.
        if is_unknown_version_command(&run.stdout) {
            return Ok(vec!["0.1.0".to_string()]);
        }
        Err((
            Broken::Failed {
                status: status.to_string(),
                cni_code: decode_error_reply(&run.stdout).map(|(code, _)| code),
                stdout_len: run.stdout.len(),
                stderr_len: run.stderr_len,
            },
            true,
        ))
    }
}

/// Spawns the plugin from a short-lived thread that first moves its future children into a
/// new PID namespace: only that thread's children are affected, and it exits right after
/// the spawn (a thread whose children go to another PID namespace cannot create threads,
/// so everything else happens here). Returns the child and whether it is isolated.
fn spawn_isolated(path: &Path) -> Result<(std::process::Child, bool), (Broken, bool)> {
    let path = path.to_path_buf();
    let worker = std::thread::Builder::new()
        .name("cni-probe-spawn".into())
        .spawn(move || {
            let isolated = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWPID).is_ok();
            spawn(&path).map(|c| (c, isolated))
        });
    match worker.map(|h| h.join()) {
        Ok(Ok(r)) => r,
        Ok(Err(_)) | Err(_) => Err((
            Broken::CannotStart("the probe could not start a thread".into()),
            false,
        )),
    }
}

/// The plugin as libcni runs it for VERSION, in its own process group.
fn spawn(path: &Path) -> Result<std::process::Child, (Broken, bool)> {
    Command::new(path)
        .env_clear()
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .env("CNI_COMMAND", "VERSION")
        .env("CNI_CONTAINERID", "")
        .env("CNI_NETNS", "dummy")
        .env("CNI_ARGS", "")
        .env("CNI_IFNAME", "dummy")
        .env("CNI_PATH", "dummy")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group too: the fallback when no PID namespace is available.
        .process_group(0)
        .spawn()
        .map_err(|e| {
            let cacheable = e.raw_os_error() == Some(libc::ENOEXEC);
            (Broken::CannotStart(e.to_string()), cacheable)
        })
}

/// Runs the plugin (PID 1 of a new PID namespace when possible), feeds stdin, collects
/// output until `deadline`, and leaves nothing it started alive.
fn run_isolated(path: &Path, deadline: Instant) -> Result<Run, (Broken, bool)> {
    let (mut child, isolated) = spawn_isolated(path)?;
    let pid = child.id() as i32;
    let pipes: Vec<u64> = [
        child.stdout.as_ref().map(pipe_inode),
        child.stderr.as_ref().map(pipe_inode),
    ]
    .into_iter()
    .flatten()
    .flatten()
    .collect();
    // Stdin on its own thread, after the timer started: never blocks us, whatever the plugin does.
    if let Some(mut stdin) = child.stdin.take() {
        std::thread::spawn(move || {
            let _ = stdin.write_all(VERSION_STDIN);
        });
    }
    let stdout = capture(child.stdout.take(), MAX_STDOUT);
    let stderr = capture(child.stderr.take(), MAX_STDERR);

    let status = wait_until(&mut child, deadline);
    // Always: kill the plugin (PID 1 of its namespace: the kernel then kills the rest) and
    // its process group, whether it exited, hung or forked.
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    let _ = child.wait();

    let mut out = stdout.recv_timeout(PIPE_GRACE).ok();
    let mut err = stderr.recv_timeout(PIPE_GRACE).ok();
    if out.is_none() || err.is_none() {
        // Something outside the group (a setsid'd grandchild without a PID namespace) still
        // holds our pipes: find it by the pipes themselves and kill it.
        if !isolated {
            kill_pipe_holders(&pipes);
        }
        out = out.or_else(|| stdout.recv_timeout(Duration::from_millis(500)).ok());
        err = err.or_else(|| stderr.recv_timeout(Duration::from_millis(500)).ok());
    }
    Ok(Run {
        status,
        stdout: out.unwrap_or_default(),
        stderr_len: err.map(|e| e.len()).unwrap_or(0),
    })
}

/// The inode of a pipe end (`pipe:[N]` in /proc/*/fd).
fn pipe_inode(f: &impl std::os::fd::AsFd) -> Option<u64> {
    nix::sys::stat::fstat(f.as_fd()).ok().map(|s| s.st_ino)
}

/// SIGKILLs every process with an fd on one of `pipes` (other than this process).
fn kill_pipe_holders(pipes: &[u64]) {
    if pipes.is_empty() {
        return;
    }
    let me = std::process::id();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|l| {
                let l = l.to_string_lossy();
                pipes.iter().any(|ino| l == format!("pipe:[{ino}]"))
            })
        });
        if holds {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
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
    } else {
        let _ = tx.send(Vec::new());
    }
    rx
}

/// Polls the child until it exits or the deadline passes (1–10 ms steps; a VERSION call
/// normally ends within a few milliseconds). `None` when it did not exit in time.
fn wait_until(child: &mut std::process::Child, deadline: Instant) -> Option<ExitStatus> {
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
