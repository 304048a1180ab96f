//! A running control plane's lifecycle: stop, the apiserver frozen, stopped and started again
//! (outage tests), detach for `meshgate-e2e up`, and `down` from the state file.
//!
//! In: a [`ControlPlane`] or a directory `up` wrote. Out: processes signalled by pid (start
//! time checked), the directory removed.

use super::*;

impl ControlPlane {
    /// Stops every process (SIGTERM, then SIGKILL), reaps them, and removes a temporary
    /// directory. Idempotent; blocks for up to a few seconds per component.
    pub fn stop(&self) {
        let procs = std::mem::take(&mut *self.procs.lock().unwrap_or_else(|p| p.into_inner()));
        if !procs.is_empty() {
            tracing::debug!(dir = %self.dir.display(), "stopping the control plane");
        }
        process::stop_all(&procs, STOP_GRACE);
        self.background.shutdown();
        if let Some(link) = &self.link {
            hostnet::delete_link(link);
        }
        if self.remove_dir.swap(false, Ordering::SeqCst) {
            keep_logs(&self.dir);
            if let Err(e) = std::fs::remove_dir_all(&self.dir) {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot remove the control plane directory");
            }
        }
    }

    /// Freezes (`true`) or thaws (`false`) kube-apiserver with SIGSTOP / SIGCONT, to play an
    /// API server that stops answering: connections hang instead of being refused, which is
    /// the harder case for a client. Signals the recorded pid only, after checking it is
    /// still the process the harness started.
    pub fn freeze_apiserver(&self, frozen: bool) -> Result<(), Error> {
        self.freeze_component("kube-apiserver", frozen)
    }

    /// The pid of a running component (`kube-apiserver`, `etcd`, ...), for /proc readings.
    pub fn component_pid(&self, component: &str) -> Option<i32> {
        let procs = self.procs.lock().unwrap_or_else(|p| p.into_inner());
        procs
            .iter()
            .find(|p| p.name == component && p.alive())
            .map(|p| p.pid)
    }

    /// Freezes (`true`) or thaws (`false`) one component (`etcd`, `kube-apiserver`,
    /// `kube-controller-manager`, `kube-scheduler`) with SIGSTOP / SIGCONT. The benchmarks
    /// freeze the controller manager while they measure something it has no part in, so its
    /// work on thousands of kubelet-less Nodes does not share the CPUs with the measurement.
    pub fn freeze_component(&self, component: &str, frozen: bool) -> Result<(), Error> {
        let procs = self.procs.lock().unwrap_or_else(|p| p.into_inner());
        let proc_ = procs
            .iter()
            .find(|p| p.name == component && p.alive())
            .ok_or_else(|| {
                Error::io(
                    format!("signalling {component}"),
                    std::io::Error::other("not running"),
                )
            })?;
        let signal = if frozen {
            nix::sys::signal::Signal::SIGSTOP
        } else {
            nix::sys::signal::Signal::SIGCONT
        };
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(proc_.pid), signal)
            .map_err(|e| Error::io(format!("signalling {component}"), std::io::Error::from(e)))
    }

    /// Stops kube-apiserver (SIGTERM, then SIGKILL), leaving etcd and the other components
    /// running: clients then get "connection refused", as during an apiserver restart.
    pub fn stop_apiserver(&self) {
        let stopped: Vec<Proc> = {
            let mut procs = self.procs.lock().unwrap_or_else(|p| p.into_inner());
            let (apiserver, rest): (Vec<Proc>, Vec<Proc>) = std::mem::take(&mut *procs)
                .into_iter()
                .partition(|p| p.name == "kube-apiserver");
            *procs = rest;
            apiserver
        };
        process::stop_all(&stopped, STOP_GRACE);
    }

    /// Starts kube-apiserver again with the same flags and port, and returns once `/readyz`
    /// answers. The process is spawned from the background thread, like the first one.
    pub async fn start_apiserver(&self) -> Result<(), Error> {
        let (bin, args, mode) = (
            self.binaries.kube_apiserver.clone(),
            self.apiserver_args.clone(),
            self.mode,
        );
        let log = self.dir.join("logs").join("kube-apiserver.log");
        let proc_ = self
            .background
            .handle
            .spawn(async move { process::spawn("kube-apiserver", &bin, &args, &log, mode) })
            .await
            .map_err(|_| Error::StartPanicked)??;
        self.procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(proc_.clone());
        let admin = client_from(self.admin_kubeconfig.clone(), "admin")?;
        wait_healthy(&proc_, Instant::now() + Duration::from_secs(60), || {
            get_text(&admin, "/readyz")
        })
        .await
    }

    /// Leaves the processes running (for `up`): this handle forgets them, and its drop will
    /// neither stop them nor remove the directory.
    pub fn detach(self) {
        self.procs.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.remove_dir.store(false, Ordering::SeqCst);
    }

    /// Stops the control plane that `up` started in `dir` (pids from its state file) and
    /// removes everything `up` created there.
    pub fn down(dir: &Path) -> Result<(), Error> {
        let state_path = dir.join(STATE_FILE);
        let text = match std::fs::read_to_string(&state_path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::NotStateDir {
                    dir: dir.to_owned(),
                });
            }
            Err(e) => return Err(Error::io(format!("reading {}", state_path.display()), e)),
        };
        let state: State = serde_json::from_str(&text).map_err(|source| Error::State {
            path: state_path,
            source,
        })?;
        process::stop_all(&state.procs, STOP_GRACE);
        remove_layout(dir);
        // Removes the directory only if `up` left nothing else there (it may be the user's).
        let _ = std::fs::remove_dir(dir);
        Ok(())
    }

    pub(super) fn write_state(&self) -> Result<(), Error> {
        let state = State {
            procs: self.procs.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            ports: self.ports,
            kubeconfig: self.admin_kubeconfig_path.clone(),
        };
        let path = self.dir.join(STATE_FILE);
        let text = serde_json::to_string_pretty(&state).map_err(|source| Error::State {
            path: path.clone(),
            source,
        })?;
        write_private(&path, &text)
    }
}
