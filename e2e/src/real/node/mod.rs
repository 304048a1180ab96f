//! A real Kubernetes node beside the control plane: containerd (with runc and the reference CNI
//! plugins) and a kubelet built from the pinned Kubernetes module, registered against a
//! [`ControlPlane`]'s kube-apiserver under its own node identity.
//!
//! In: the binaries and images `e2e/install-deps.sh` put in the cache ([`NodeBinaries`]), a
//! running [`ControlPlane`], root. Out: a [`RealNode`] whose Node is `Ready`, the paths a test
//! needs (CNI conf and bin dirs, containerd's socket), the pid of a pod's container, the CNI
//! config containerd really loaded ([`RealNode::cri_cni_status`]), the config list a pod
//! sandbox really ran (libcni's result cache, [`RealNode::pod_attachments`] and
//! [`CachedAttachment`]), Istio's CNI installed and removed the way its installer does it
//! ([`RealNode::install_istio_cni`]), and a teardown that leaves nothing behind
//! ([`RealNode::stop`], also on drop, so a failing test cleans up as well).
//!
//! Like a kind node, each real node has network and mount namespaces of its own. Its network
//! namespace (pinned in the run dir) is joined to the host by a veth pair on an unused /30 in
//! 10.202.0.0/16, and the host routes the node's pod /24 to it; containerd, the kubelet and
//! kube-proxy (nftables mode) run inside, so their rules, bridge and ports never touch the
//! host's, and two nodes' hostNetwork pods do not collide. The control plane must be routable
//! ([`start_control_plane`]). containerd starts in a mount namespace of the node's own
//! (`crate::real::mounts`): shared inside, as on a systemd host, whatever the host's
//! propagation; overlays over `/etc`, `/opt`, `/var/lib`, `/var/log` and `/run` with their upper
//! layers in the run dir; the standard node paths bound to the run dir's; the host-wide sysctls
//! the kubelet sets covered by files of the run dir. The kubelet and kube-proxy join it. So the
//! manifests' hostPaths resolve to the run's files, and nothing touches the host's `/etc`,
//! `/opt`, `/var`, `/run` or mounts. What the node still needs of the host is checked before it
//! starts ([`crate::harness::host_check`]). Facts of this machine kind,
//! each found by trying (see docs/testing.md): cgroup v1 in hybrid mode (so the kubelet runs
//! with `failCgroupV1: false` and the `cgroupfs` driver), a VM that refuses a negative
//! `oom_score_adj` (so containerd runs with `restrict_oom_score_adj`), runc rather than crun
//! (crun refuses hybrid cgroups), and no systemd (so the harness starts and supervises both
//! daemons itself, as it does the control plane).

use crate::Error;
use crate::harness::control_plane::{
    ControlPlane, cert_kubeconfig_yaml, client_from, tmp_base, unique_name, write_owner,
    write_private,
};
use crate::harness::paths::{env_var, find_on_path, is_executable};
use crate::harness::process::{Mode, Proc};
use crate::harness::{hostnet, paths, process, wait};
use crate::real::mounts;
use crate::real::mounts::{KERNEL_TUNABLES, host_sysctl};
use boot::*;
use config::*;
use footprint::*;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams};
use spawn::*;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};
use teardown::*;

mod ambient;
mod binaries;
mod boot;
mod cni;
mod config;
mod footprint;
mod spawn;
mod teardown;

pub use ambient::{INSTALL_CNI_IMAGE, NODE_PROC, UnixSocket, ZTUNNEL_STANDIN_IMAGE};
pub use binaries::{CNI_PLUGINS_ENV, NodeBinaries};
pub use cni::{CachedAttachment, istio_cni_entry};
pub use footprint::{Footprint, host_residue};

/// The pause image containerd runs every pod sandbox with (see `e2e/images/pause.c`).
pub const PAUSE_IMAGE: &str = "localhost/meshgate-e2e/pause:1";
/// The workload image: Debian's static busybox.
pub const BUSYBOX_IMAGE: &str = "localhost/meshgate-e2e/busybox:1";
/// meshgate's own image, release binaries (`e2e/images/build-meshgate-image.sh`; the real
/// node's chart values, `e2e/chart/real-node-values.yaml`, point the chart at it).
pub const MESHGATE_IMAGE: &str = "localhost/meshgate/meshgate:e2e";
/// Env var naming meshgate's image tarball (default: `<target>/meshgate-image/meshgate.tar`,
/// beside the profile dir the tests run from, where `make` writes it).
pub const MESHGATE_IMAGE_ENV: &str = "MESHGATE_IMAGE_TAR";
/// Prefix of real-node run directories.
const DIR_PREFIX: &str = "meshgate-node-";
/// The containerd namespace the CRI plugin keeps Kubernetes' images and containers in.
const K8S_NS: &str = "k8s.io";
/// How long a daemon gets between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// Upper bound for the Node to register and go Ready.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// Name of the primary CNI config, as a CNI provider's installer would write it.
pub const CONFLIST: &str = "10-meshgate-e2e-bridge.conflist";

/// How long the node took to come up, for docs/testing.md.
#[derive(Debug, Clone, Copy)]
pub struct NodeTimes {
    /// containerd spawned → its socket answered.
    pub containerd: Duration,
    /// Images imported into containerd.
    pub images: Duration,
    /// kubelet spawned → Node object created (registration).
    pub registered: Duration,
    /// Node created → `Ready=True`.
    pub ready_after_registration: Duration,
    /// `Ready=True` → kube-proxy's rules send the `kubernetes` Service to the apiserver.
    pub kube_proxy_after_ready: Duration,
}

/// A running real node. Stopped (pods, containers, shims, mounts, bridge, cgroups, Node
/// object, directory) by [`RealNode::stop`] or on drop.
pub struct RealNode {
    name: String,
    dir: PathBuf,
    bins: NodeBinaries,
    fp: Footprint,
    admin: kube::config::Kubeconfig,
    net: NodeNet,
    procs: Mutex<Vec<Proc>>,
    spawner: Mutex<Option<Spawner>>,
    times: NodeTimes,
    stopped: Mutex<bool>,
}

impl std::fmt::Debug for RealNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealNode")
            .field("name", &self.name)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl RealNode {
    /// Starts containerd and the kubelet for a new node of `cp` and returns once the Node is
    /// `Ready`. Any part that does not come up fails the start with [`Error::RealNode`] naming
    /// it; whatever was started is torn down first. Before it starts anything, it cleans up
    /// after real-node runs whose test binary died without a teardown (their [`Footprint`]).
    pub async fn start(cp: &ControlPlane) -> Result<Self, Error> {
        paths::require_root()?;
        crate::harness::host_check::check()?;
        let bins = NodeBinaries::locate()?;
        let base = tmp_base();
        sweep_stale(&base);
        let dir = tempfile::Builder::new()
            .prefix(DIR_PREFIX)
            .tempdir_in(&base)
            .map_err(|e| Error::io(format!("creating a directory in {}", base.display()), e))?
            .keep();
        write_owner(&dir)?;
        let name = unique_name("real-node");
        let fp = Footprint::of(&dir);
        let apiserver = std::net::SocketAddr::from((cp.address(), cp.ports().apiserver));
        let net = match cp_reachable(cp)
            .and_then(|()| fp.add_network())
            .and_then(|net| {
                hostnet::reaches_from("the node's network namespace", &fp.netns_pin, apiserver)
                    .map(|()| net)
            }) {
            Ok(net) => net,
            Err(e) => {
                fp.clean();
                return Err(e);
            }
        };
        // The network is up: a failed start must take it down (and the dir) now, as a later
        // sweep would only find it once this process is gone.
        let spawner = match Spawner::start() {
            Ok(spawner) => spawner,
            Err(e) => {
                fp.clean();
                return Err(e);
            }
        };
        host_paths_acquire();
        // On a failed boot `node` is dropped, which tears down whatever was started.
        let mut node = RealNode {
            fp,
            net,
            name,
            dir,
            bins,
            admin: cp.admin_kubeconfig().clone(),
            procs: Mutex::new(Vec::new()),
            spawner: Mutex::new(Some(spawner)),
            times: NodeTimes {
                containerd: Duration::ZERO,
                images: Duration::ZERO,
                registered: Duration::ZERO,
                ready_after_registration: Duration::ZERO,
                kube_proxy_after_ready: Duration::ZERO,
            },
            stopped: Mutex::new(false),
        };
        node.times = node.boot(cp).await?;
        tracing::info!(
            node = %node.name,
            dir = %node.dir.display(),
            node_ip = %node.net.node_ip,
            gateway = %node.net.host_ip,
            pod_net = %node.net.pod_net,
            containerd_ms = node.times.containerd.as_millis() as u64,
            images_ms = node.times.images.as_millis() as u64,
            registered_ms = node.times.registered.as_millis() as u64,
            ready_ms = node.times.ready_after_registration.as_millis() as u64,
            "real node Ready"
        );
        Ok(node)
    }

    /// The Node's name (also the kubelet's `system:node:<name>` identity).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The run directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How long the node took to start.
    pub fn times(&self) -> NodeTimes {
        self.times
    }

    /// containerd's CNI conf dir (the node's `/etc/cni/net.d`).
    pub fn cni_conf_dir(&self) -> PathBuf {
        self.dir.join("cni/conf")
    }

    /// containerd's CNI bin dir (the node's `/opt/cni/bin`).
    pub fn cni_bin_dir(&self) -> PathBuf {
        self.dir.join("cni/bin")
    }

    /// The primary conflist, the one containerd loads.
    pub fn conflist_path(&self) -> PathBuf {
        self.cni_conf_dir().join(CONFLIST)
    }

    /// istio-cni's run dir (Istio's `/var/run/istio-cni`): its kubeconfig and log.
    pub fn istio_cni_run_dir(&self) -> PathBuf {
        self.dir.join("istio-cni")
    }

    /// libcni's result cache: containerd's CRI (through go-cni, which sets no cache dir of its
    /// own) has libcni keep one result per attachment in libcni's default `/var/lib/cni`,
    /// which in the node's mount namespace is this run-dir path.
    pub fn cni_cache_dir(&self) -> PathBuf {
        self.dir.join("cni/cache")
    }

    /// The node's address (its veth's, inside its network namespace): the Node's InternalIP.
    pub fn node_ip(&self) -> Ipv4Addr {
        self.net.node_ip
    }

    /// The node's network namespace, pinned in the run dir (for `nsenter --net=`).
    pub fn netns_pin(&self) -> &Path {
        &self.fp.netns_pin
    }

    /// The ends of the container logs of `ns`'s pods on this node, from the kubelet's pod-logs
    /// dir (the apiserver cannot reach the kubelet's port in the node's namespace), for failure
    /// messages.
    pub fn pod_logs(&self, ns: &str) -> String {
        let mut out = String::new();
        let Ok(pods) = std::fs::read_dir(self.dir.join("kubelet/pod-logs")) else {
            return out;
        };
        let prefix = format!("{ns}_");
        for pod in pods.flatten() {
            if !pod.file_name().to_string_lossy().starts_with(&prefix) {
                continue;
            }
            let containers = std::fs::read_dir(pod.path())
                .into_iter()
                .flatten()
                .flatten();
            for container in containers {
                for log in std::fs::read_dir(container.path())
                    .into_iter()
                    .flatten()
                    .flatten()
                {
                    let text = std::fs::read_to_string(log.path()).unwrap_or_default();
                    let lines: Vec<&str> = text.lines().collect();
                    out.push_str(&format!(
                        "--- {}\n{}\n",
                        log.path().display(),
                        lines[lines.len().saturating_sub(15)..].join("\n")
                    ));
                }
            }
        }
        out
    }

    /// containerd's socket.
    pub fn containerd_socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }

    /// The pid of the init process of a container (`containerd://<id>` or `<id>`, as in a
    /// pod's `containerStatuses[].containerID`), from containerd's task list.
    pub async fn container_pid(&self, container_id: &str) -> Result<i32, Error> {
        let id = container_id
            .strip_prefix("containerd://")
            .unwrap_or(container_id);
        let out = self
            .ctr(&["-n", K8S_NS, "tasks", "ls"])
            .await
            .map_err(|detail| Error::RealNode {
                part: "containerd",
                detail,
            })?;
        parse_task_pid(&out, id).ok_or_else(|| Error::RealNode {
            part: "containerd",
            detail: format!("no running task {id} in `ctr tasks ls`:\n{out}"),
        })
    }

    /// The end of a component's log (`containerd`, `kubelet`), for failure messages.
    pub fn log_tail(&self, component: &str, lines: usize) -> String {
        self.procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|p| p.name == component)
            .map(|p| p.log_tail(lines))
            .unwrap_or_default()
    }

    /// What this node left on the host, described; empty after [`RealNode::stop`].
    pub fn footprint(&self) -> &Footprint {
        &self.fp
    }

    /// Runs ctr against this node's containerd (30 s bound); stdout, or stderr as the error.
    async fn ctr(&self, args: &[&str]) -> Result<String, String> {
        ctr_at(&self.bins.ctr, &self.containerd_socket(), args).await
    }
}

/// A control plane real nodes can join: its apiserver on a routable address of its own
/// ([`crate::Options::routable`]). Each real-node test starts one and drops it after its nodes.
pub async fn start_control_plane() -> Result<ControlPlane, Error> {
    ControlPlane::start(crate::Options {
        routable: true,
        ..crate::Options::default()
    })
    .await
}

impl Drop for RealNode {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `ctr tasks ls` prints `TASK PID STATUS` rows.
fn parse_task_pid(out: &str, id: &str) -> Option<i32> {
    out.lines().skip(1).find_map(|line| {
        let mut f = line.split_whitespace();
        (f.next()? == id).then_some(())?;
        f.next()?.parse().ok().filter(|pid| *pid > 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_pid_is_read_from_ctr_tasks_ls() {
        let out = "TASK                                                                PID      STATUS    \n\
                   4f1c2d0e9b                                                          12345    RUNNING\n\
                   9a8b7c                                                              0        STOPPED\n";
        assert_eq!(parse_task_pid(out, "4f1c2d0e9b"), Some(12345));
        assert_eq!(parse_task_pid(out, "9a8b7c"), None);
        assert_eq!(parse_task_pid(out, "4f1c"), None);
    }
}
