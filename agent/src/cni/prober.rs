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
//!   `CNI_NETNS`/`CNI_IFNAME`/`CNI_PATH` = `dummy`, empty `CNI_CONTAINERID`/`CNI_ARGS`; and,
//!   for speed, `GOGC=off` with `GOMEMLIMIT` (`GO_MEMORY_LIMIT`): most plugins are Go
//!   programs, and garbage collections during their package initialisation are a fifth of
//!   a large plugin's VERSION time. The answer does not depend on them.
//!   Stdin is written by its own thread after the timer starts, so a plugin that never
//!   reads cannot block the caller.
//! - Time: each run gets the smaller of `--probe-timeout` and what is left of the
//!   verification's overall deadline; nothing runs once the deadline has passed.
//! - End and reach: the plugin runs under a minimal init that is PID 1 of a fresh PID
//!   namespace (spawned from a short-lived thread that `unshare(CLONE_NEWPID)`s, so nothing
//!   else is affected). The run ends as Go's `cmd.Run` ends, when the plugin has exited and
//!   its stdout and stderr reached EOF (a process it left holding them makes it
//!   `HeldOutput`), or at the deadline. Then the init is SIGKILLed and the kernel SIGKILLs
//!   every process left in the namespace, including grandchildren that called `setsid` or
//!   double-forked: nothing it started survives, ever. Without `CAP_SYS_ADMIN` (a non-root
//!   `check`) there is no namespace, but the init is the child subreaper of everything the
//!   plugin starts, so orphans (a `setsid`'d daemon included) stay in its subtree: at the
//!   end of every run, finished or not, that subtree is SIGKILLed from `/proc` in rounds
//!   before the init and the process group. The init dies with the agent's spawning thread
//!   (`PR_SET_PDEATHSIG`), the plugin with the init, so an agent killed mid-probe leaves
//!   no namespace behind either.
//! - Output is capped (64 KiB stdout, 4 KiB stderr) and only lengths reach messages.
//! - Answers are cached by (path, device, inode, size, mtime, ctime, mode) ([`super::answers`]):
//!   an unchanged binary is not run again; any rewrite, replace or chmod is re-probed, and an
//!   answer is kept only if the file still has the key it had before the run. Failures to
//!   start and timeouts are not cached, since they may be transient. A caller asking for a
//!   binary whose probe is in flight waits for that probe (up to its own deadline) instead of
//!   running it again; at most `MAX_RUNS` binaries run at once, whoever asked.
//! - [`Prober::probe_many`] probes a verification's planned types in parallel
//!   ([`PARALLEL_PROBES`]); [`Prober::preprobe`] probes a binary ahead of any verification,
//!   when it appears or changes in a bin dir ([`super::preprobe`]).

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};

use meshgate_core::cni::probe::{
    VERSION_STDIN, decode_error_reply, decode_version_reply, is_plain_name,
    is_unknown_version_command,
};
use meshgate_core::cni::{Broken, ProbeOutcome};
use nix::sys::signal::Signal;
use nix::unistd::Pid;

use super::answers::{Answers, Claim, Key, MAX_RUNS, ProbeCounters};

/// Largest VERSION reply kept; real replies are well under 1 KiB.
const MAX_STDOUT: usize = 64 * 1024;
/// Largest stderr kept (only its length is ever reported).
const MAX_STDERR: usize = 4 * 1024;
/// How long the pipes may stay open once everything the plugin started is dead.
const PIPE_GRACE: Duration = Duration::from_millis(100);
/// The heap a Go plugin may reach before its first collection (`GOGC=off` leaves the soft
/// limit as the only trigger). Three runs at once stay within the agent's memory limit.
const GO_MEMORY_LIMIT: &str = "32MiB";
/// Retries of a spawn that failed with ETXTBSY, and the pause before each.
const TXTBSY_RETRIES: usize = 10;
const TXTBSY_PAUSE: Duration = Duration::from_millis(10);
/// Scans of the process tree when killing what a plugin left without a PID namespace.
const KILL_ROUNDS: usize = 50;

/// Who asks: a verification counts its lookups; a pre-probe counts what it did.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Caller {
    Verification,
    Ahead,
}

/// Plugin types probed in parallel by one verification (each run also takes one of the
/// prober's [`MAX_RUNS`] slots).
pub const PARALLEL_PROBES: usize = MAX_RUNS;
/// Plugin names a pre-probe may run: the required plugins and the types verifications asked
/// about, at most this many.
const MAX_CANDIDATES: usize = 256;

/// Runs plugin binaries' VERSION command, with a cache of their answers.
#[derive(Debug)]
pub struct Prober {
    bin_dirs: Vec<PathBuf>,
    timeout: Duration,
    answers: Answers,
    counters: ProbeCounters,
    /// The names a binary must have to be probed ahead of a verification (see
    /// [`Prober::preprobe`]).
    candidates: Mutex<HashSet<String>>,
}

/// How one run ended.
struct Run {
    /// The plugin's own wait status, once it exited.
    status: Option<ExitStatus>,
    /// True when the plugin exited but something it started kept stdout/stderr open until
    /// the deadline (libcni's exec would still be waiting for EOF).
    held_output: bool,
    stdout: Vec<u8>,
    stderr_len: usize,
}

impl Prober {
    /// A prober searching `bin_dirs` in order and killing a binary after `timeout`.
    pub fn new(bin_dirs: Vec<PathBuf>, timeout: Duration) -> Self {
        Self {
            bin_dirs,
            timeout,
            answers: Answers::default(),
            counters: ProbeCounters::default(),
            candidates: Mutex::new(HashSet::new()),
        }
    }

    /// The same prober, counting into `counters` (the daemon's registered ones).
    pub fn with_counters(mut self, counters: ProbeCounters) -> Self {
        self.counters = counters;
        self
    }

    /// What it counted.
    pub fn counters(&self) -> &ProbeCounters {
        &self.counters
    }

    /// The bin dirs, in search order.
    pub fn bin_dirs(&self) -> &[PathBuf] {
        &self.bin_dirs
    }

    /// How many answers are cached (for tests and debugging).
    pub fn cached(&self) -> usize {
        self.answers.cached()
    }

    /// Lets pre-probes run binaries named `names` (the required plugins, the types a
    /// verification asked about): a binary nothing names is never run just because it
    /// appeared in a bin dir.
    pub fn allow(&self, names: impl IntoIterator<Item = impl AsRef<str>>) {
        let mut c = self.candidates.lock().unwrap_or_else(|e| e.into_inner());
        for n in names {
            let n = n.as_ref();
            if c.len() < MAX_CANDIDATES && is_plain_name(n) {
                c.insert(n.to_string());
            }
        }
    }

    /// Looks up `plugin_type` and asks it for VERSION, finishing by `deadline`.
    pub fn probe(&self, plugin_type: &str, deadline: Instant) -> ProbeOutcome {
        match self.find(plugin_type) {
            Ok((path, meta)) => self.probe_file(path, &meta, deadline, Caller::Verification),
            Err(outcome) => outcome,
        }
    }

    /// Probes those of `types` (deduplicated) not answered yet, with up to
    /// [`PARALLEL_PROBES`] at once, all by the one `deadline`; their answers by type. The
    /// types already answered are left to [`Prober::probe`] (a cache hit, on the caller's
    /// thread): no thread is started when everything is cached.
    pub fn probe_many(&self, types: &[String], deadline: Instant) -> HashMap<String, ProbeOutcome> {
        let mut todo: Vec<&str> = Vec::new();
        for t in types {
            if !todo.contains(&t.as_str()) && !self.answered(t) {
                todo.push(t);
            }
        }
        let next = AtomicUsize::new(0);
        let found = Mutex::new(HashMap::new());
        let work = || {
            while let Some(t) = todo.get(next.fetch_add(1, Ordering::Relaxed)) {
                let outcome = self.probe(t, deadline);
                found
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert((*t).to_string(), outcome);
            }
        };
        let helpers = PARALLEL_PROBES.min(todo.len()).saturating_sub(1);
        std::thread::scope(|s| {
            for _ in 0..helpers {
                // A thread that cannot start leaves its share to the others.
                let _ = std::thread::Builder::new()
                    .name("cni-probe".into())
                    .spawn_scoped(s, work);
            }
            work();
        });
        found.into_inner().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `plugin_type`'s binary, as it is now, has a cached answer.
    fn answered(&self, plugin_type: &str) -> bool {
        self.find(plugin_type)
            .is_ok_and(|(path, meta)| self.answers.has(&Key::of(&path, &meta)))
    }

    /// Probes `name` ahead of any verification, so the one that needs it finds the answer
    /// cached: only a name pre-probes may run ([`Prober::allow`]), only when the lookup's
    /// winner is itself a regular executable file in a bin dir (a symlink is left to the
    /// verification, which follows it as libcni does), within `--probe-timeout`.
    pub fn preprobe(&self, name: &str) {
        let allowed = self
            .candidates
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(name);
        if !allowed {
            return;
        }
        let Ok((path, meta)) = self.find(name) else {
            return;
        };
        let plain = std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_file());
        if !plain || meta.permissions().mode() & 0o111 == 0 || meta.len() == 0 {
            return;
        }
        self.probe_file(path, &meta, Instant::now() + self.timeout, Caller::Ahead);
    }

    /// libcni's `FindInPath`: the first regular file (following symlinks) named
    /// `plugin_type` in bin-dir order, or the outcome that says why there is none.
    fn find(&self, plugin_type: &str) -> Result<(PathBuf, std::fs::Metadata), ProbeOutcome> {
        if !is_plain_name(plugin_type) {
            // The core never asks for these; refusing here too keeps any future caller
            // from turning a config into "run this path as root".
            return Err(ProbeOutcome::Broken {
                path: String::new(),
                why: Broken::CannotStart("refused: the type is not a plain file name".into()),
            });
        }
        let mut fallback: Option<(PathBuf, Broken)> = None;
        for dir in &self.bin_dirs {
            let path = dir.join(plugin_type);
            match std::fs::metadata(&path) {
                Ok(meta) if meta.is_file() => return Ok((path, meta)),
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
        Err(match fallback {
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
        })
    }

    fn probe_file(
        &self,
        path: PathBuf,
        meta: &std::fs::Metadata,
        deadline: Instant,
        caller: Caller,
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
        let key = Key::of(&path, meta);
        let started = Instant::now();
        let ticket = match self.answers.claim(&key, deadline) {
            Claim::Cached { outcome, waited } => {
                match caller {
                    Caller::Verification if waited => self.counters.lookup("inflight"),
                    Caller::Verification => self.counters.lookup("hit"),
                    Caller::Ahead => self.counters.preprobe("cached"),
                }
                return outcome;
            }
            Claim::Expired => {
                let after_ms = started.elapsed().as_millis() as u64;
                return broken(Broken::TimedOut { after_ms });
            }
            Claim::Run(ticket) => ticket,
        };
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
        // The file ran as it was when the key was read only if it still has that key: one
        // replaced during the run is not trusted under either key.
        let unchanged = Key::now(&path).as_ref() == Some(&key);
        ticket.finish((cacheable && unchanged).then(|| outcome.clone()));
        match caller {
            Caller::Verification => self.counters.lookup("miss"),
            Caller::Ahead => self.counters.preprobe("ran"),
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
        if run.held_output {
            return Err((Broken::HeldOutput { after_ms }, false));
        }
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
        // A death by signal (the OOM killer in the agent's cgroup) or the shell's "cannot
        // execute" / "not found" codes (a shared library or interpreter that lands a moment
        // later) can pass without the binary changing, so the cache must not keep them.
        let lasting = status.code().is_some_and(|c| c != 126 && c != 127);
        Err((
            Broken::Failed {
                status: status.to_string(),
                cni_code: decode_error_reply(&run.stdout).map(|(code, _)| code),
                stdout_len: run.stdout.len(),
                stderr_len: run.stderr_len,
            },
            lasting,
        ))
    }
}

/// Spawns the plugin from a thread of its own that first moves its future children into a
/// new PID namespace: only that thread's children are affected (a thread whose children go
/// to another PID namespace cannot create threads, so everything else happens on the
/// caller's thread). The thread then waits, as the init's parent, until the returned
/// [`Holder`] is dropped: the init's parent-death signal fires when its parent *thread*
/// ends, so the init, and with it the namespace, dies with the run or with the agent.
/// Returns the child (the namespace's init, see [`spawn`]) and whether it is isolated.
fn spawn_isolated(path: &Path, status_w: OwnedFd) -> Result<(Child, bool, Holder), (Broken, bool)> {
    let path = path.to_path_buf();
    let (ready_tx, ready_rx) = mpsc::channel();
    let (hold_tx, hold_rx) = mpsc::channel::<()>();
    let worker = std::thread::Builder::new()
        .name("cni-probe-spawn".into())
        .spawn(move || {
            let isolated = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWPID).is_ok();
            let spawned = spawn(&path, status_w).map(|c| (c, isolated));
            let ok = spawned.is_ok();
            if ready_tx.send(spawned).is_ok() && ok {
                // Returns once the Holder is dropped (Err: the sender is gone).
                let _ = hold_rx.recv();
            }
        });
    let failed = || {
        (
            Broken::CannotStart("the probe could not start a thread".into()),
            false,
        )
    };
    worker.map_err(|_| failed())?;
    let (child, isolated) = ready_rx.recv().map_err(|_| failed())??;
    Ok((child, isolated, Holder(hold_tx)))
}

/// Keeps the spawning thread, the init's parent, alive until dropped.
struct Holder(#[allow(dead_code)] mpsc::Sender<()>);

/// Starts a minimal init that starts the plugin as libcni runs it for VERSION.
///
/// The direct child forks once more (in `pre_exec`, async-signal-safe calls only): the
/// grandchild execs the plugin; the child stays as PID 1 of the new namespace (and, with or
/// without one, the child subreaper of everything the plugin starts, so no descendant can
/// leave its subtree; it gets SIGKILL when its parent thread ends, the plugin when it ends), drops every
/// fd but `status_w` (so it holds neither the plugin's pipes nor std's exec-error pipe),
/// writes the plugin's raw wait status to `status_w` when the plugin exits, then reaps the
/// plugin's orphans (which the kernel hands to the namespace's init). The caller decides
/// when the run is over (plugin exited *and* its output reached EOF, as Go's `cmd.Run`
/// waits for), and then kills the init: the kernel kills everything left in the namespace.
fn spawn(path: &Path, status_w: OwnedFd) -> Result<Child, (Broken, bool)> {
    let status_fd = status_w.as_raw_fd();
    let agent = std::process::id() as libc::pid_t;
    let mut cmd = Command::new(path);
    cmd.env_clear()
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
        .env("GOGC", "off")
        .env("GOMEMLIMIT", GO_MEMORY_LIMIT)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group too: the fallback when no PID namespace is available.
        .process_group(0);
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe system calls (prctl, getppid, fork, dup2, close_range/close, waitpid,
    // write, _exit); it allocates nothing and touches no lock.
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1);
            // The agent died before the death signal was armed (in a new PID namespace the
            // parent is outside it and shows as 0 either way).
            let parent = libc::getppid();
            if parent != agent && parent != 0 {
                libc::_exit(1);
            }
            let init = libc::getpid();
            let plugin = libc::fork();
            if plugin < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if plugin == 0 {
                // The plugin dies with the init; status_w is O_CLOEXEC, so exec drops it.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if libc::getppid() != init {
                    libc::_exit(1);
                }
                return Ok(());
            }
            init_loop(plugin, status_fd)
        });
    }
    let mut child = cmd.spawn();
    // ETXTBSY: the binary was opened for writing by someone, often only a process forked
    // while an installer (or another thread here) had it open, which holds that descriptor
    // until its own exec. It passes within milliseconds: retried, bounded.
    for _ in 0..TXTBSY_RETRIES {
        match &child {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                std::thread::sleep(TXTBSY_PAUSE);
                child = cmd.spawn();
            }
            _ => break,
        }
    }
    let child = child.map_err(|e| {
        let cacheable = e.raw_os_error() == Some(libc::ENOEXEC);
        (Broken::CannotStart(e.to_string()), cacheable)
    });
    // Only the init keeps a write end: EOF on the read end means the init is gone.
    drop(status_w);
    child
}

/// The init's whole life (in the forked child; async-signal-safe calls only). Never returns.
fn init_loop(plugin: libc::pid_t, status_fd: libc::c_int) -> ! {
    // SAFETY: plain system calls on integers this process owns; see `spawn`.
    unsafe {
        // fd 0 becomes the status pipe; everything else (the plugin's pipes, std's
        // exec-error pipe, which would otherwise block `spawn` until we exit) is closed.
        libc::dup2(status_fd, 0);
        if libc::syscall(libc::SYS_close_range, 1u32, u32::MAX, 0u32) != 0 {
            for fd in 1..4096 {
                libc::close(fd);
            }
        }
        let mut status: libc::c_int = 0;
        loop {
            let r = libc::waitpid(plugin, &mut status, 0);
            if r == plugin {
                break;
            }
            if r < 0 && *libc::__errno_location() != libc::EINTR {
                status = -1;
                break;
            }
        }
        let bytes = status.to_ne_bytes();
        libc::write(0, bytes.as_ptr().cast(), bytes.len());
        // Reap the plugin's orphans until none is left (none at all without a namespace).
        loop {
            let r = libc::waitpid(-1, std::ptr::null_mut(), 0);
            if r < 0 && *libc::__errno_location() != libc::EINTR {
                break;
            }
        }
        libc::_exit(0)
    }
}

/// Runs the plugin (in a new PID namespace when possible), feeds stdin, collects output, and
/// ends as Go's `cmd.Run` would (the plugin exited and both pipes reached EOF) or at
/// `deadline`; either way nothing it started survives.
fn run_isolated(path: &Path, deadline: Instant) -> Result<Run, (Broken, bool)> {
    let (status_r, status_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| {
        (
            Broken::CannotStart(format!("cannot create a pipe: {e}")),
            false,
        )
    })?;
    let (mut child, isolated, holder) = spawn_isolated(path, status_w)?;
    let init = child.id() as i32;
    // Stdin on its own thread, after the timer started: never blocks us, whatever the plugin does.
    if let Some(mut stdin) = child.stdin.take() {
        std::thread::spawn(move || {
            let _ = stdin.write_all(VERSION_STDIN);
        });
    }
    // One channel for the three ends, so the run is seen to end the moment the last arrives.
    let (tx, rx) = mpsc::channel();
    capture(child.stdout.take(), MAX_STDOUT, tx.clone(), Piece::Stdout);
    capture(child.stderr.take(), MAX_STDERR, tx.clone(), Piece::Stderr);
    read_status(std::fs::File::from(status_r), tx);

    let mut got = Pieces::default();
    let finished = loop {
        if got.status.is_some() && got.out.is_some() && got.err.is_some() {
            break true;
        }
        let now = Instant::now();
        if now >= deadline {
            break false;
        }
        match rx.recv_timeout(deadline - now) {
            Ok(piece) => got.take(piece),
            // Every sender sends before it ends, so this is only the deadline.
            Err(_) => break false,
        }
    };
    // Always, whether the plugin exited, hung or forked: without a namespace, kill every
    // descendant of the init first (it is their subreaper, so none has left its subtree);
    // then the init (with a namespace, the kernel kills everything left in it) and the
    // process group.
    if !isolated {
        kill_tree(init);
    }
    let _ = nix::sys::signal::kill(Pid::from_raw(init), Signal::SIGKILL);
    let _ = nix::sys::signal::killpg(Pid::from_raw(init), Signal::SIGKILL);
    let _ = child.wait();
    drop(holder);
    // The status as it was at the end: the init may still report the plugin's death by our
    // kill, which is no exit of its own.
    let status = got.status.take();
    // Once everything is dead the pipes close: what they held arrives within the grace.
    let grace = Instant::now() + PIPE_GRACE;
    while got.out.is_none() || got.err.is_none() {
        let left = grace.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(piece) => got.take(piece),
            Err(_) => break,
        }
    }
    let held_output = !finished && status.is_some();
    let (status, out, err) = (status.flatten(), got.out, got.err);
    Ok(Run {
        status: if finished { status } else { None },
        held_output,
        stdout: out.unwrap_or_default(),
        stderr_len: err.map(|e| e.len()).unwrap_or(0),
    })
}

/// What the threads watching a run send, each once.
enum Piece {
    /// The init's report of the plugin's wait status; `None` when the init died without one.
    Status(Option<ExitStatus>),
    /// Everything the plugin wrote to stdout (capped), at EOF.
    Stdout(Vec<u8>),
    /// The same for stderr.
    Stderr(Vec<u8>),
}

/// The pieces of a run received so far.
#[derive(Default)]
struct Pieces {
    status: Option<Option<ExitStatus>>,
    out: Option<Vec<u8>>,
    err: Option<Vec<u8>>,
}

impl Pieces {
    fn take(&mut self, piece: Piece) {
        match piece {
            Piece::Status(s) => self.status = Some(s),
            Piece::Stdout(b) => self.out = Some(b),
            Piece::Stderr(b) => self.err = Some(b),
        }
    }
}

/// Reads the init's report of the plugin's wait status on a thread of its own and sends it
/// as [`Piece::Status`].
fn read_status(mut r: std::fs::File, tx: mpsc::Sender<Piece>) {
    std::thread::spawn(move || {
        let mut b = [0u8; 4];
        let status = match r.read_exact(&mut b) {
            Ok(()) => match i32::from_ne_bytes(b) {
                -1 => None,
                raw => Some(ExitStatus::from_raw(raw)),
            },
            Err(_) => None,
        };
        let _ = tx.send(Piece::Status(status));
    });
}

/// SIGKILLs every descendant of `root` (not `root` itself), in rounds until none is left
/// alive or [`KILL_ROUNDS`] have passed: a process forked between a scan and the kills is
/// caught by the next scan. `root` must be their child subreaper and still alive, so that
/// orphans stay in its subtree (and it reaps the zombies).
fn kill_tree(root: i32) {
    for _ in 0..KILL_ROUNDS {
        let alive = descendants(root);
        if alive.is_empty() {
            return;
        }
        for pid in alive {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    tracing::warn!(
        root,
        rounds = KILL_ROUNDS,
        "plugin processes still alive after the kill rounds"
    );
}

/// The living (non-zombie) descendants of `root`, from each process's parent in
/// `/proc/<pid>/stat`.
fn descendants(root: i32) -> Vec<i32> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut children: HashMap<i32, Vec<(i32, bool)>> = HashMap::new();
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may hold anything, so split after the last ')'.
        let mut rest = stat
            .rsplit_once(')')
            .map(|(_, r)| r)
            .unwrap_or("")
            .split_whitespace();
        let zombie = rest.next() == Some("Z");
        if let Some(ppid) = rest.next().and_then(|s| s.parse::<i32>().ok()) {
            children.entry(ppid).or_default().push((pid, zombie));
        }
    }
    let mut found = Vec::new();
    let mut todo = vec![root];
    // The scan is not atomic: a reused pid could make a loop, so each pid is visited once.
    let mut seen = std::collections::HashSet::from([root]);
    while let Some(parent) = todo.pop() {
        for &(pid, zombie) in children.get(&parent).into_iter().flatten() {
            if !seen.insert(pid) {
                continue;
            }
            todo.push(pid);
            if !zombie {
                found.push(pid);
            }
        }
    }
    found
}

/// Reads `pipe` to EOF on a thread of its own, keeping at most `cap` bytes, and sends them
/// wrapped by `piece` (at once, empty, without a pipe).
fn capture(
    pipe: Option<impl Read + Send + 'static>,
    cap: usize,
    tx: mpsc::Sender<Piece>,
    piece: fn(Vec<u8>) -> Piece,
) {
    let Some(mut pipe) = pipe else {
        let _ = tx.send(piece(Vec::new()));
        return;
    };
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
        let _ = tx.send(piece(kept));
    });
}

#[cfg(test)]
mod tests;
