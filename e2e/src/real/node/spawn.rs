//! How a real node's daemons are started: from a thread that lives as long as the node (their
//! parent for `PR_SET_PDEATHSIG`), inside the node's network namespace and its own mount
//! namespace (containerd) or containerd's (the kubelet, kube-proxy).
//!
//! In: a daemon's binary, arguments and environment. Out: a tracked [`Proc`].

use super::*;

impl RealNode {
    /// Spawns a daemon from the spawner thread (its parent for PDEATHSIG) and records it.
    pub(super) fn spawn(
        &self,
        name: &'static str,
        ns: Ns,
        bin: &Path,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> Result<Proc, Error> {
        let log = self.dir.join("logs").join(format!("{name}.log"));
        // nsenter, unshare and sh all exec, so the pid recorded is the daemon's, and the
        // death signal set before the first exec stays with it.
        let mut argv = vec![format!("--net={}", self.fp.netns_pin.display())];
        if let Ns::Join(pid) = ns {
            argv.push(format!("--mount=/proc/{pid}/ns/mnt"));
        }
        argv.push("--".into());
        if ns == Ns::NewMount {
            argv.extend([
                self.bins.unshare.display().to_string(),
                "--mount".into(),
                "--propagation=slave".into(),
                "--".into(),
                "/bin/sh".into(),
                "-ec".into(),
                mounts::script(&self.dir)?,
                "node-mounts".into(),
            ]);
        }
        argv.push(bin.display().to_string());
        argv.extend(args);
        let (bin, args) = (self.bins.nsenter.clone(), argv);
        let spawner = self.spawner.lock().unwrap_or_else(|p| p.into_inner());
        let spawner = spawner.as_ref().ok_or_else(spawner_gone)?;
        let proc_ = spawner
            .run(move || process::spawn_env(name, &bin, &args, &env, &log, Mode::Attached))??;
        self.procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(proc_.clone());
        Ok(proc_)
    }
}

/// Where a daemon of the node runs: containerd in a new mount namespace, the others in
/// containerd's (by its pid); all in the node's network namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ns {
    NewMount,
    Join(i32),
}

pub(super) type Job = Box<dyn FnOnce() + Send>;

pub(super) fn spawner_gone() -> Error {
    Error::RealNode {
        part: "the node's spawner thread",
        detail: "it is gone (the node was stopped, or the thread panicked)".into(),
    }
}

/// A thread that lives as long as the node and spawns its daemons: PDEATHSIG fires when the
/// *thread* that forked a child exits, so the daemons must not be forked from a test's
/// short-lived runtime thread.
pub(super) struct Spawner {
    tx: mpsc::Sender<Job>,
    thread: std::thread::JoinHandle<()>,
}

impl Spawner {
    pub(super) fn start() -> Result<Self, Error> {
        let (tx, rx) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("meshgate-node".into())
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .map_err(|e| Error::io("spawning the real node's thread", e))?;
        Ok(Self { tx, thread })
    }

    pub(super) fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Error> {
        let (rtx, rrx) = mpsc::channel();
        self.tx
            .send(Box::new(move || {
                let _ = rtx.send(f());
            }))
            .map_err(|_| spawner_gone())?;
        rrx.recv().map_err(|_| spawner_gone())
    }

    pub(super) fn shutdown(self) {
        drop(self.tx);
        let _ = self.thread.join();
    }
}
