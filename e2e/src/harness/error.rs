//! The harness's one error type.
//!
//! In: failures from the filesystem, process management, certificate generation, kubeconfig
//! loading and the Kubernetes API. Out: one variant per failure, each with a message that tells
//! the reader what to do next (most often: run `e2e/install-deps.sh` or look at a log file).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Everything that can go wrong while starting, using or stopping a local control plane.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The harness runs as a regular user; the e2e tests need root (network namespaces).
    #[error(
        "the meshgate e2e control plane must run as root (its tests create network namespaces \
         and nftables rules): run `make test`, or `sudo -E env MESHGATE_K8S_BIN_DIR=... cargo test -p meshgate-e2e --test e2e`"
    )]
    NotRoot,

    /// A binary the control plane needs is not where the harness looked.
    #[error(
        "{binary} not found at {} — run `e2e/install-deps.sh` (or `make test`, which runs it) to \
         install etcd and build Kubernetes {version}, or set {hint}",
        path.display()
    )]
    MissingBinary {
        /// Binary name, e.g. `kube-apiserver`.
        binary: String,
        /// Where it was looked for.
        path: PathBuf,
        /// The pinned Kubernetes version.
        version: String,
        /// Which environment variable overrides the location.
        hint: &'static str,
    },

    /// The workspace Cargo.toml does not pin a Kubernetes version.
    #[error(
        "no `kubernetes-version = \"vX.Y.Z\"` under [workspace.metadata.meshgate] in the workspace Cargo.toml"
    )]
    NoPinnedVersion,

    /// Neither `MESHGATE_K8S_BIN_DIR`, `MESHGATE_CACHE_DIR`, `XDG_CACHE_HOME` nor `HOME` is set.
    #[error(
        "cannot locate the binary cache: set MESHGATE_K8S_BIN_DIR or MESHGATE_CACHE_DIR (HOME is unset)"
    )]
    NoCacheDir,

    /// A filesystem or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What the harness was doing.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },

    /// rcgen could not generate a key or certificate.
    #[error("generating {what}: {source}")]
    Cert {
        /// Which key or certificate.
        what: String,
        /// rcgen's error.
        #[source]
        source: rcgen::Error,
    },

    /// A component exited while the harness waited for it to become healthy.
    #[error("{component} exited during startup ({status}); the end of {}:\n{tail}", log.display())]
    Exited {
        /// Component name, e.g. `kube-apiserver`.
        component: String,
        /// Its exit status, as text.
        status: String,
        /// Its log file.
        log: PathBuf,
        /// The last lines of that log.
        tail: String,
    },

    /// A component kept running but did not report healthy in time.
    #[error("{component} was not healthy after {timeout:?} (last answer: {last}); see {}", log.display())]
    Unhealthy {
        /// Component name.
        component: String,
        /// How long the harness waited.
        timeout: Duration,
        /// The last health answer or error.
        last: String,
        /// Its log file.
        log: PathBuf,
    },

    /// A kubeconfig could not be turned into a client configuration.
    #[error("loading kubeconfig {what}: {source}")]
    Kubeconfig {
        /// Which kubeconfig.
        what: String,
        /// kube's error.
        #[source]
        source: kube::config::KubeconfigError,
    },

    /// A Kubernetes API call (or building a client) failed.
    #[error("{what}: {source}")]
    Kube {
        /// What the harness was doing.
        what: String,
        /// kube's error.
        #[source]
        source: kube::Error,
    },

    /// A bounded wait or API call ran out of time.
    #[error("timed out after {timeout:?} waiting for {what} (last: {last})")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The bound.
        timeout: Duration,
        /// The last observation or error, for the reader.
        last: String,
    },

    /// A pod given to the kubelet stand-in is not bound to a node yet.
    #[error("pod {namespace}/{name} is not bound to a node")]
    NotBound {
        /// Pod namespace.
        namespace: String,
        /// Pod name.
        name: String,
    },

    /// The TokenRequest API answered without a token.
    #[error("{what}: the TokenRequest answer carried no token")]
    EmptyToken {
        /// Which request.
        what: String,
    },

    /// `down` was pointed at a directory `up` did not create.
    #[error("{} holds no meshgate-e2e state file ({}); was it created by `meshgate-e2e up`?", dir.display(), crate::harness::control_plane::STATE_FILE)]
    NotStateDir {
        /// The directory.
        dir: PathBuf,
    },

    /// `up` was pointed at a directory that already holds a control plane.
    #[error("{} already holds a control plane started by `up`; run `meshgate-e2e down --dir {}` first", dir.display(), dir.display())]
    AlreadyUp {
        /// The directory.
        dir: PathBuf,
    },

    /// The state file written by `up` cannot be read back.
    #[error("state file {}: {source}", path.display())]
    State {
        /// The state file.
        path: PathBuf,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },

    /// `kubectl` ran but failed.
    #[error("kubectl {args} failed ({status}): {stderr}")]
    Kubectl {
        /// The arguments, space separated.
        args: String,
        /// Its exit status.
        status: String,
        /// Its stderr.
        stderr: String,
    },

    /// helm, which installs meshgate's chart, is not where the harness looked.
    #[error(
        "helm not found at {} — run `e2e/install-deps.sh` (or `make test`, which runs it) to build \
         helm {version}, or set MESHGATE_HELM",
        path.display()
    )]
    MissingHelm {
        /// Where it was looked for.
        path: PathBuf,
        /// The pinned helm version.
        version: String,
    },

    /// `helm` ran but failed.
    #[error("helm {args} failed ({status}): {stderr}")]
    Helm {
        /// The arguments, space separated.
        args: String,
        /// Its exit status.
        status: String,
        /// Its stderr.
        stderr: String,
    },

    /// The process-wide shared control plane failed to start (the first caller's error).
    #[error("the shared e2e control plane failed to start: {0}")]
    Shared(#[source] Arc<Error>),

    /// The thread starting the shared control plane died without an answer.
    #[error("the thread starting the shared e2e control plane panicked")]
    StartPanicked,

    /// One part of the real node (containerd, the images, the CNI config, kubelet, ...) did
    /// not start or answer. Never a reason to skip: the real-node tests fail with it.
    #[error("real node: {part} did not start: {detail}")]
    RealNode {
        /// Which part, e.g. `containerd` or `kubelet`.
        part: &'static str,
        /// What went wrong, with the end of the part's log where there is one.
        detail: String,
    },

    /// The host lacks what a real node needs of it (see `host_check`); each line names one
    /// need, what was found and how to meet it.
    #[error("this host cannot run real nodes yet:\n{unmet}")]
    HostNotReady {
        /// One line per unmet need.
        unmet: String,
    },

    /// An entry of libcni's result cache (`<cache dir>/results/*`) is not what libcni writes.
    #[error("libcni's result cache, {what}: {detail}")]
    CniCache {
        /// Which entry (its file, when it was read from one).
        what: String,
        /// What is wrong with it.
        detail: String,
    },
}

impl Error {
    /// Wraps an I/O error with what the harness was doing.
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            what: what.into(),
            source,
        }
    }

    /// Wraps a kube error with what the harness was doing.
    pub(crate) fn kube(what: impl Into<String>, source: kube::Error) -> Self {
        Error::Kube {
            what: what.into(),
            source,
        }
    }

    /// The HTTP status code when this is an API error answered by the apiserver.
    pub fn api_code(&self) -> Option<u16> {
        match self {
            Error::Kube {
                source: kube::Error::Api(status),
                ..
            } => Some(status.code),
            _ => None,
        }
    }
}
