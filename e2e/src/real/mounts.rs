//! The real node's mount namespace: what containerd, the kubelet and kube-proxy see as `/`.
//!
//! In: the node's run dir. Out: the directories the namespace binds from ([`prepare`]), and the
//! shell script `unshare --mount --propagation=slave` runs before it execs containerd
//! ([`script`]). The script makes the namespace's mounts shared, as systemd makes a host's at
//! boot, whatever the host's own propagation is: containerd refuses a `HostToContainer` volume
//! (the agent's `/run/netns`) whose source is neither shared nor slave, and on a host without
//! systemd every mount is private. The namespace starts as a slave of the host's, so the shared
//! peer groups it then gets are its own: host mounts still propagate in, nothing propagates out.
//! Then `/etc`, `/opt`, `/var/lib`, `/var/log` and `/run` are covered by overlays whose upper
//! layers live in the run dir, the standard node paths the manifests mount as hostPaths are
//! bound to the run dir's, and the host-wide sysctls the kubelet writes are covered by files of
//! the run dir ([`KERNEL_TUNABLES`]).

use std::path::{Path, PathBuf};

use crate::Error;

/// The directories the node covers with overlays (upper layers in the run dir), so whatever a
/// daemon writes there (the kubelet's device-plugin dir and `/var/log/containers` links,
/// libcni's cache, the shims' sockets) never reaches the host.
const OVERLAID: [&str; 5] = ["/etc", "/opt", "/var/lib", "/var/log", "/run"];

/// The standard node paths, bound to the run dir's (run-dir path, node path): the paths the
/// manifests mount as hostPaths, so the agent sees the very files containerd loads.
pub(crate) const BINDS: [(&str, &str); 9] = [
    ("cni/conf", "/etc/cni/net.d"),
    ("cni/bin", "/opt/cni/bin"),
    ("kubelet/root", "/var/lib/kubelet"),
    ("cni/cache", "/var/lib/cni"),
    ("kubelet/pod-logs", "/var/log/pods"),
    ("containers-logs", "/var/log/containers"),
    // containerd pins pod network namespaces here (`netns_mounts_under_state_dir = false`),
    // where the agent's manifest mounts them from (HostToContainer).
    ("netns", "/run/netns"),
    ("meshgate", "/run/meshgate"),
    ("run-containerd", "/run/containerd"),
];

/// The sysctls the kubelet's container manager sets at start (`setupKernelTunables`, with
/// `protectKernelDefaults` unset): host-wide ones, with no per-namespace copy. The node's mount
/// namespace binds a file of the run dir over each (`sysctl/<name>`, holding the host's value
/// when the node started), so the kubelet reads and writes the node's copy and the host's
/// values never change; `real::node::host_residue` checks. (`protectKernelDefaults: true` is no
/// way out: the kubelet then refuses to start unless the host already holds its values, and
/// `kernel.panic_on_oops=1` with `kernel.panic=10` would reboot the shared machine on any oops.)
pub(crate) const KERNEL_TUNABLES: &[&str] = &[
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
];

/// The node's resolver config, in the run dir: the kubelet hands it to pods, and the host's
/// `/etc/resolv.conf` may be missing or point at a resolver the node cannot reach. No pod of the
/// tests resolves a name.
pub(crate) const RESOLV_CONF: &str = "resolv.conf";

/// `/proc/sys/...` of a dotted sysctl name.
pub(crate) fn sysctl_path(name: &str) -> PathBuf {
    Path::new("/proc/sys").join(name.replace('.', "/"))
}

/// The host's value of a sysctl, trimmed; `None` when this kernel has no such entry.
pub(crate) fn host_sysctl(name: &str) -> Option<String> {
    std::fs::read_to_string(sysctl_path(name))
        .ok()
        .map(|v| v.trim().to_owned())
}

/// The node's copy of a host-wide sysctl (see [`KERNEL_TUNABLES`]).
fn sysctl_copy(dir: &Path, name: &str) -> PathBuf {
    dir.join("sysctl").join(name)
}

/// Creates what [`script`] mounts from: the bind sources, the overlays' dirs, the node's copies
/// of the host-wide sysctls (the host's values now; only for the entries this kernel has) and
/// its resolver config.
pub(crate) fn prepare(dir: &Path) -> Result<(), Error> {
    let mkdir = |path: PathBuf| {
        std::fs::create_dir_all(&path)
            .map_err(|e| Error::io(format!("creating {}", path.display()), e))
    };
    for (from, _) in BINDS {
        mkdir(dir.join(from))?;
    }
    for i in 0..OVERLAID.len() {
        mkdir(dir.join(format!("overlay/{i}/upper")))?;
        mkdir(dir.join(format!("overlay/{i}/work")))?;
    }
    mkdir(dir.join("sysctl"))?;
    let write = |path: PathBuf, text: String| {
        std::fs::write(&path, text).map_err(|e| Error::io(format!("writing {}", path.display()), e))
    };
    for name in KERNEL_TUNABLES {
        if let Some(value) = host_sysctl(name) {
            write(sysctl_copy(dir, name), format!("{value}\n"))?;
        }
    }
    write(
        dir.join(RESOLV_CONF),
        "# The real node's resolver config (e2e/src/real/mounts.rs); no test pod resolves names.\n\
         nameserver 127.0.0.1\n"
            .into(),
    )
}

/// The script that lays out the node's mount namespace, then execs its arguments. Run by
/// `unshare --mount --propagation=slave`; [`prepare`] must have run.
pub(crate) fn script(dir: &Path) -> Result<String, Error> {
    // An overlay hides what is below it: the run dir must stay where it is.
    if OVERLAID
        .iter()
        .chain(["/var/run"].iter())
        .any(|d| dir.starts_with(d))
    {
        return Err(Error::RealNode {
            part: "the node's mount namespace",
            detail: format!(
                "the run dir {} is under a directory the node overlays ({OVERLAID:?}); set {} elsewhere",
                dir.display(),
                crate::harness::control_plane::TMPDIR_ENV
            ),
        });
    }
    let q = |p: &Path| shell_quote(&p.display().to_string());
    // Shared, as on a systemd host: mounts made below (overlays, binds, containerd's netns
    // pins) are shared too, so they reach the containers' HostToContainer copies.
    let mut script = String::from("set -e\nmount --make-rshared /\n");
    for (i, target) in OVERLAID.iter().enumerate() {
        script.push_str(&format!(
            "mount -t overlay overlay -o lowerdir={target},upperdir={u},workdir={w} {target}\n",
            u = q(&dir.join(format!("overlay/{i}/upper"))),
            w = q(&dir.join(format!("overlay/{i}/work"))),
        ));
    }
    for (from, to) in BINDS {
        script.push_str(&format!(
            "mkdir -p {to}\nmount --bind {} {to}\n",
            q(&dir.join(from))
        ));
    }
    // A file over a /proc/sys entry: the kubelet's sysctl writes land in the run dir.
    for name in KERNEL_TUNABLES {
        let copy = sysctl_copy(dir, name);
        if copy.exists() {
            script.push_str(&format!(
                "mount --bind {} {}\n",
                q(&copy),
                q(&sysctl_path(name))
            ));
        }
    }
    script.push_str("exec \"$@\"\n");
    Ok(script)
}

pub(crate) fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a check of the node's namespace saw, in the order [`CHECK`] writes it.
    #[derive(Debug, PartialEq)]
    struct Seen {
        /// `findmnt`'s PROPAGATION of `/run/netns` in the node's namespace.
        node_run_netns: String,
        /// How many times a netns pin the node made after a container started shows in the
        /// container's `/run/netns` (its HostToContainer copy).
        in_container: String,
        /// ... and in the mount namespace the node was started from (the "host").
        in_host_ns: String,
        /// ... and in the machine's own mount namespace (pid 1's).
        in_pid1_ns: String,
    }

    /// The node's side: a container's mount namespace cloned from the node's with
    /// `/run/netns` made rslave (what runc does for a HostToContainer volume), then a netns
    /// pinned under the node's `/run/netns` as containerd pins a pod's; it waits until the
    /// outside has looked. Every wait is bounded (200 × 50 ms).
    const NODE: &str = r#"set -e
d=$1
wait_for() { i=0; while [ ! -e "$1" ]; do i=$((i+1)); [ $i -le 200 ] || exit 9; sleep 0.05; done; }
# The last mount on /run/netns, the one the path resolves to: a host's own (`ip netns add`)
# lies hidden below it.
findmnt -no PROPAGATION /run/netns | tail -n 1 > "$d/seen.node"
unshare --mount --propagation=unchanged -- sh -ec '
  mount --make-rslave /run/netns
  touch "$1/container.ready"
  i=0; while [ ! -e "$1/pinned" ]; do i=$((i+1)); [ $i -le 200 ] || exit 9; sleep 0.05; done
  grep -c " /run/netns/probe " /proc/self/mountinfo > "$1/seen.container" || true
' container "$d" &
wait_for "$d/container.ready"
touch /run/netns/probe
mount --bind /proc/self/ns/net /run/netns/probe
touch "$d/pinned"
wait
touch "$d/node.ready"
wait_for "$d/outside.done"
"#;

    /// The "host": a private mount namespace, as on a machine without systemd, that starts the
    /// node's namespace as `real::node` does and looks for the pin while the node holds it.
    const CHECK: &str = r#"set -e
d=$1
unshare --mount --propagation=slave -- sh -ec "$(cat "$d/node-mounts.sh")" node-mounts sh -ec "$(cat "$d/node.sh")" node "$d" &
i=0; while [ ! -e "$d/node.ready" ]; do i=$((i+1)); [ $i -le 400 ] || exit 9; sleep 0.05; done
grep -c "/netns/probe " /proc/self/mountinfo > "$d/seen.host" || true
grep -c "/netns/probe " /proc/1/mountinfo > "$d/seen.pid1" || true
touch "$d/outside.done"
wait
"#;

    fn run_check(dir: &Path) -> Seen {
        prepare(dir).unwrap();
        std::fs::write(dir.join("node-mounts.sh"), script(dir).unwrap()).unwrap();
        std::fs::write(dir.join("node.sh"), NODE).unwrap();
        let out = std::process::Command::new("unshare")
            .args(["--mount", "--propagation=private", "--", "sh", "-ec", CHECK])
            .arg("check")
            .arg(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "the check failed: {:?}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let read = |f: &str| {
            std::fs::read_to_string(dir.join(f))
                .unwrap_or_else(|e| panic!("{f}: {e}"))
                .trim()
                .to_owned()
        };
        Seen {
            node_run_netns: read("seen.node"),
            in_container: read("seen.container"),
            in_host_ns: read("seen.host"),
            in_pid1_ns: read("seen.pid1"),
        }
    }

    /// On a host whose mounts are private (no systemd), the node's `/run/netns` is shared, so
    /// containerd accepts the agent's HostToContainer volume and a pod netns pinned after the
    /// agent started reaches the agent's container; and the pin stays in the node's namespace.
    /// Without `mount --make-rshared /` in [`script`], `/run/netns` is `private` and the pin
    /// never reaches the container. Needs root, like every real-node test.
    #[test]
    fn the_nodes_mounts_are_a_systemd_hosts_whatever_the_host() {
        crate::harness::paths::require_root().expect("the node mount namespace test needs root");
        let dir = tempfile::Builder::new()
            .prefix("meshgate-mounts-")
            .tempdir_in("/dev/shm")
            .unwrap();
        assert_eq!(
            run_check(dir.path()),
            Seen {
                node_run_netns: "shared".into(),
                in_container: "1".into(),
                in_host_ns: "0".into(),
                in_pid1_ns: "0".into(),
            }
        );
    }

    #[test]
    fn a_run_dir_under_an_overlaid_path_is_refused() {
        let err = script(Path::new("/run/meshgate-node-x")).unwrap_err();
        assert!(err.to_string().contains("overlays"), "{err}");
    }

    #[test]
    fn the_script_makes_the_namespace_shared_before_it_mounts() {
        let s = script(Path::new("/dev/shm/meshgate-node-x")).unwrap();
        let shared = s.find("mount --make-rshared /\n").expect("rshared");
        let first_mount = s.find("mount -t overlay").expect("an overlay");
        assert!(shared < first_mount, "{s}");
        assert!(s.ends_with("exec \"$@\"\n"), "{s}");
    }
}
