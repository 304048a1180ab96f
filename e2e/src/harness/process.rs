//! Starting and stopping the control-plane processes, by process id only.
//!
//! In: a binary, its arguments, a log file, and whether the process belongs to this one
//! (`Attached`, for tests) or outlives it (`Detached`, for `meshgate-e2e up`). Out: a [`Proc`]
//! record (name, pid, kernel start time) that is enough to stop the process later, even from
//! another process (`down`), without ever signalling a recycled pid or anything by name.
//!
//! Attached children get `PR_SET_PDEATHSIG(SIGKILL)`. The kernel sends it when the *thread*
//! that forked the child exits, not the process, so the caller must spawn from a thread that
//! lives as long as the control plane (the control plane's background thread does).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use crate::Error;

/// How a spawned process relates to the harness process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Killed by the kernel if the spawning thread dies (tests).
    Attached,
    /// A new session, no death signal: survives the harness (`meshgate-e2e up`).
    Detached,
}

/// A process the harness started.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Proc {
    /// Component name, e.g. `etcd`.
    pub name: String,
    /// Process id.
    pub pid: i32,
    /// Start time in clock ticks since boot (field 22 of `/proc/PID/stat`): with the pid, it
    /// identifies the process, so a recycled pid is never signalled.
    pub start_time: u64,
    /// Where its stdout and stderr go.
    pub log: PathBuf,
}

/// Spawns `bin args...` with stdout and stderr appended to `log`.
pub(crate) fn spawn(
    name: &str,
    bin: &Path,
    args: &[String],
    log: &Path,
    mode: Mode,
) -> Result<Proc, Error> {
    spawn_env(name, bin, args, &[], log, mode)
}

/// [`spawn`] with extra environment variables (set on top of the inherited environment): the
/// real node's containerd needs its own `PATH`, which its shims and CNI plugins inherit.
pub(crate) fn spawn_env(
    name: &str,
    bin: &Path,
    args: &[String],
    env: &[(String, String)],
    log: &Path,
    mode: Mode,
) -> Result<Proc, Error> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| Error::io(format!("opening {}", log.display()), e))?;
    let err = out
        .try_clone()
        .map_err(|e| Error::io(format!("duplicating {}", log.display()), e))?;
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    let parent = std::process::id();
    // SAFETY: the closure runs between fork and exec and only calls async-signal-safe
    // functions (prctl, getppid, setsid, raise); it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            match mode {
                Mode::Attached => {
                    if libc::prctl(
                        libc::PR_SET_PDEATHSIG,
                        libc::SIGKILL as libc::c_ulong,
                        0,
                        0,
                        0,
                    ) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                    // The parent may have died between fork and prctl: then no signal will come.
                    if libc::getppid() as u32 != parent {
                        libc::raise(libc::SIGKILL);
                    }
                }
                Mode::Detached => {
                    if libc::setsid() < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
            }
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .map_err(|e| Error::io(format!("starting {name} ({})", bin.display()), e))?;
    // The Child handle is dropped without waiting: std neither kills nor reaps on drop, and the
    // pid is reaped explicitly by `stop` (or by init once a detached `up` exits).
    let pid = i32::try_from(child.id()).map_err(|_| {
        Error::io(
            format!("{name} pid"),
            std::io::ErrorKind::InvalidData.into(),
        )
    })?;
    let start_time = start_time(pid).unwrap_or(0);
    tracing::debug!(component = name, pid, log = %log.display(), "started");
    Ok(Proc {
        name: name.to_owned(),
        pid,
        start_time,
        log: log.to_owned(),
    })
}

/// Field 22 (starttime) of `/proc/PID/stat`, or `None` when the process is gone or a zombie.
pub(crate) fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces: split after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    // `rest` starts at field 3 (state), so starttime (field 22) is the 20th item.
    fields.nth(18)?.parse().ok()
}

impl Proc {
    /// True while the process runs and is still the one the harness started.
    pub fn alive(&self) -> bool {
        match start_time(self.pid) {
            Some(t) => self.start_time == 0 || t == self.start_time,
            None => false,
        }
    }

    /// If the process has exited (and is our child), reaps it and describes its status.
    pub fn exit_status(&self) -> Option<String> {
        match waitpid(Pid::from_raw(self.pid), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(_, code)) => Some(format!("exit code {code}")),
            Ok(WaitStatus::Signaled(_, sig, _)) => Some(format!("killed by {sig}")),
            Ok(_) => None,
            // Not our child (or already reaped): fall back to /proc.
            Err(_) => (!self.alive()).then(|| "exited".to_owned()),
        }
    }

    /// The last `lines` lines of its log, for error messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

/// Stops `procs` in reverse start order: SIGTERM, up to `grace` to exit, then SIGKILL.
/// Our own children are reaped; others (after a detached `up`) are reaped by init.
pub(crate) fn stop_all(procs: &[Proc], grace: Duration) {
    for p in procs.iter().rev() {
        stop_one(p, grace);
    }
}

fn stop_one(p: &Proc, grace: Duration) {
    let pid = Pid::from_raw(p.pid);
    if !p.alive() {
        reap(pid);
        return;
    }
    tracing::debug!(component = %p.name, pid = p.pid, "stopping");
    for (signal, wait) in [
        (Signal::SIGTERM, grace),
        (Signal::SIGKILL, Duration::from_secs(10)),
    ] {
        if p.alive() {
            match kill(pid, signal) {
                Ok(()) | Err(Errno::ESRCH) => {}
                Err(e) => {
                    tracing::warn!(component = %p.name, pid = p.pid, error = %e, "cannot signal")
                }
            }
        }
        let deadline = Instant::now() + wait;
        loop {
            reap(pid);
            if !p.alive() {
                return;
            }
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    tracing::warn!(component = %p.name, pid = p.pid, "still running after SIGKILL");
}

fn reap(pid: Pid) {
    // ECHILD (not our child) is expected after a detached `up`.
    let _ = waitpid(pid, Some(WaitPidFlag::WNOHANG));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spawned_process_is_identified_stopped_and_reaped() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("sleep.log");
        let p = spawn(
            "sleep",
            Path::new("/bin/sleep"),
            &["30".into()],
            &log,
            Mode::Attached,
        )
        .unwrap();
        assert!(p.alive());
        assert!(p.start_time > 0);
        assert_eq!(p.exit_status(), None);
        stop_all(std::slice::from_ref(&p), Duration::from_secs(5));
        assert!(!p.alive());
        // Reaped: no zombie left behind, so /proc/PID is gone (or recycled, with another start time).
        assert!(start_time(p.pid).is_none_or(|t| t != p.start_time));
    }

    #[test]
    fn a_recycled_pid_is_not_ours() {
        let me = std::process::id() as i32;
        let other = Proc {
            name: "x".into(),
            pid: me,
            start_time: 1,
            log: PathBuf::new(),
        };
        assert!(
            !other.alive(),
            "a different start time means a different process"
        );
    }

    #[test]
    fn early_exit_is_reported_with_its_code() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("false.log");
        let p = spawn("false", Path::new("/bin/false"), &[], &log, Mode::Attached).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let status = loop {
            if let Some(s) = p.exit_status() {
                break s;
            }
            assert!(Instant::now() < deadline, "false did not exit");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(status, "exit code 1");
    }
}
