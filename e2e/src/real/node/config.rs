//! The configuration files of a real node's daemons: containerd's `config.toml` and the
//! kubelet's `KubeletConfiguration`, every path inside the node's run dir.
//!
//! In: a [`RealNode`]'s dir, binaries and addresses. Out: the files' text.

use super::*;

impl RealNode {
    pub(super) fn containerd_config(&self) -> String {
        let d = |sub: &str| toml_str(&self.dir.join(sub).display().to_string());
        let runc = toml_str(&self.bins.runc.display().to_string());
        format!(
            r#"# The real node's containerd: everything under one run directory (see e2e/src/real/node).
version = 3
root = {root}
state = {state}

[plugins.'io.containerd.server.v1.grpc']
  address = {socket}

[plugins.'io.containerd.server.v1.ttrpc']
  address = {ttrpc}

[plugins.'io.containerd.internal.v1.opt']
  path = {opt}

[plugins.'io.containerd.nri.v1.nri']
  disable = true

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{pause}"

[plugins.'io.containerd.cri.v1.runtime']
  # This VM refuses a negative oom_score_adj; without this runc fails with
  # "can't get final child's PID from pipe".
  restrict_oom_score_adj = true
  # Pod namespaces are pinned under /var/run/netns, the run dir's netns/ in the node's mount
  # namespace: where the agent's manifest mounts them from (HostToContainer).
  netns_mounts_under_state_dir = false
  enable_cdi = false
  # On a host with AppArmor, containerd would load its default profile into the kernel, for
  # the whole machine: the node keeps to its namespaces instead.
  disable_apparmor = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = {runc}
        Root = {runc_root}
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = [{cni_bin}]
    conf_dir = {cni_conf}
    max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"#,
            root = d("containerd/root"),
            state = d("containerd/state"),
            socket = d("containerd.sock"),
            ttrpc = d("containerd.sock.ttrpc"),
            opt = d("containerd/opt"),
            pause = PAUSE_IMAGE,
            runc = runc,
            runc_root = d("containerd/state/runc"),
            cni_bin = d("cni/bin"),
            cni_conf = d("cni/conf"),
        )
    }

    /// The node's pod network: a /24 in 10.200.0.0/16 no other network on the host uses.
    pub(super) fn pod_subnet(&self) -> String {
        format!("{}/24", self.net.pod_net)
    }

    pub(super) fn kubelet_config(&self, ca: &Path, port: u16, healthz: u16) -> String {
        let q = |s: &str| serde_json::Value::String(s.to_owned()).to_string();
        format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {ca}
authorization:
  mode: Webhook
containerRuntimeEndpoint: {endpoint}
# This machine kind runs cgroup v1 in hybrid mode and has no systemd.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: {cgroup_root}
failSwapOn: false
podLogsDir: {pod_logs}
# The disk may be fuller than the default eviction thresholds allow, and an evicted or
# garbage-collected image cannot be pulled again here.
evictionHard:
  memory.available: "50Mi"
  nodefs.available: "1%"
  imagefs.available: "1%"
  nodefs.inodesFree: "1%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
nodeStatusUpdateFrequency: 2s
syncFrequency: 5s
serializeImagePulls: false
clusterDomain: cluster.local
resolvConf: {resolv_conf}
"#,
            ca = q(&ca.display().to_string()),
            endpoint = q(&format!("unix://{}", self.containerd_socket().display())),
            cgroup_root = q(&self.fp.cgroup_root),
            pod_logs = q(&self.dir.join("kubelet/pod-logs").display().to_string()),
            resolv_conf = q(&self.dir.join(mounts::RESOLV_CONF).display().to_string()),
        )
    }
}

pub(super) fn write_file(path: &Path, text: &str) -> Result<(), Error> {
    std::fs::write(path, text).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

pub(super) fn toml_str(s: &str) -> String {
    // TOML basic strings share JSON's escapes for everything a path can hold.
    serde_json::Value::String(s.to_owned()).to_string()
}
