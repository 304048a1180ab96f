//! What a real node puts on the host, and the checks that it left nothing.
//!
//! In: a run dir. Out: [`Footprint`] (the node's netns pin, veth, routes, cgroups and dir; its
//! network added and cleaned), and [`host_residue`]: the standard node paths, kube-proxy
//! tables and host-wide sysctls that changed on the host since the first node started.

use super::*;

/// The node's addresses: a veth pair between the host and the node's network namespace, and
/// the pod network behind it, routed from the host.
#[derive(Debug, Clone, Copy)]
pub(super) struct NodeNet {
    /// The host side of the veth (the node's default gateway).
    pub(super) host_ip: Ipv4Addr,
    /// The node side (`eth0` in its namespace): the kubelet's `--node-ip`.
    pub(super) node_ip: Ipv4Addr,
    /// Base of the node's pod /24 (the bridge's), routed from the host via `node_ip`.
    pub(super) pod_net: Ipv4Addr,
}

/// What a real node puts on the host besides API objects, derived from its run directory's
/// name alone, so a later run can clean up after a killed one (see `RealNode::start`).
#[derive(Debug, Clone)]
pub struct Footprint {
    /// The run directory.
    pub dir: PathBuf,
    /// The CNI bridge (`mg` + the directory's suffix; IFNAMSIZ is 16).
    pub bridge: String,
    /// The kubelet's `cgroupRoot`, present in every cgroup hierarchy.
    pub cgroup_root: String,
    /// The host side of the node's veth pair (`mgv` + the run dir's hash: the suffix's case,
    /// which the bridge's name loses, cannot make two runs' names collide). Deleting it
    /// deletes the pair, its address and the route to the node's pods.
    pub veth: String,
    /// The node's network namespace, bind-mounted on a file in the run dir.
    pub netns_pin: PathBuf,
}

impl Footprint {
    pub(super) fn of(dir: &Path) -> Self {
        let suffix = dir
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix(DIR_PREFIX))
            .unwrap_or("0")
            .to_ascii_lowercase();
        Self {
            dir: dir.to_owned(),
            bridge: format!("mg{}", &suffix[..suffix.len().min(10)]),
            cgroup_root: format!("/{DIR_PREFIX}{suffix}"),
            veth: format!("mgv{:08x}", hostnet::seed(dir)),
            netns_pin: dir.join("netns.pin"),
        }
    }

    /// The node's network: a namespace pinned in the run dir, a veth pair (`eth0` inside, the
    /// node's address; [`Footprint::veth`] outside, its gateway) on an unused /30 in
    /// 10.202.0.0/16, `lo` up, forwarding on inside (the bridge's pods reach the apiserver
    /// through it), and a host route to the node's pod /24 via the node, so the apiserver
    /// reaches webhook pods (nodes reaching each other's pods also needs the host's forwarding).
    pub(super) fn add_network(&self) -> Result<NodeNet, Error> {
        const PART: &str = "the node's network namespace";
        let seed = hostnet::seed(&self.dir);
        std::fs::write(&self.netns_pin, "")
            .map_err(|e| Error::io(format!("creating {}", self.netns_pin.display()), e))?;
        let pin = format!("--net={}", self.netns_pin.display());
        hostnet::run(PART, &self.unshare_bin(), &[&pin, "true"])?;
        let link = hostnet::unused_net(seed, 30, |n| {
            Ipv4Addr::new(10, 202, (n >> 6) as u8, ((n & 63) << 2) as u8)
        })?;
        let host_ip = Ipv4Addr::from(u32::from(link) + 1);
        let node_ip = Ipv4Addr::from(u32::from(link) + 2);
        let pod_net =
            hostnet::unused_net(seed, 24, |n| Ipv4Addr::new(10, 200, (n % 250) as u8, 0))?;
        let ours = std::process::id().to_string();
        let pin = &self.netns_pin;
        hostnet::ip_in(
            PART,
            pin,
            &[
                "link", "add", "eth0", "type", "veth", "peer", "name", &self.veth, "netns", &ours,
            ],
        )?;
        hostnet::ip(
            PART,
            &["addr", "add", &format!("{host_ip}/30"), "dev", &self.veth],
        )?;
        hostnet::ip(PART, &["link", "set", &self.veth, "up"])?;
        hostnet::ip_in(
            PART,
            pin,
            &["addr", "add", &format!("{node_ip}/30"), "dev", "eth0"],
        )?;
        hostnet::ip_in(PART, pin, &["link", "set", "eth0", "up"])?;
        hostnet::ip_in(PART, pin, &["link", "set", "lo", "up"])?;
        hostnet::ip_in(
            PART,
            pin,
            &["route", "add", "default", "via", &host_ip.to_string()],
        )?;
        let net_arg = format!("--net={}", pin.display());
        hostnet::run(
            PART,
            "nsenter",
            &[&net_arg, "--", "sysctl", "-qw", "net.ipv4.ip_forward=1"],
        )?;
        hostnet::ip(
            PART,
            &[
                "route",
                "add",
                &format!("{pod_net}/24"),
                "via",
                &node_ip.to_string(),
                "dev",
                &self.veth,
            ],
        )?;
        Ok(NodeNet {
            host_ip,
            node_ip,
            pod_net,
        })
    }

    pub(super) fn unshare_bin(&self) -> String {
        find_on_path("unshare")
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "unshare".into())
    }

    pub(super) fn socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }

    pub(super) fn cgroups(&self) -> Vec<PathBuf> {
        cgroup_hierarchies()
            .into_iter()
            .map(|h| h.join(self.cgroup_root.trim_start_matches('/')))
            .filter(|p| p.exists())
            .collect()
    }

    /// Kills what still runs in the node's cgroups and the shims serving its containerd, then
    /// removes the mounts under the run dir, the bridge, the cgroups and the run dir.
    pub(super) fn clean(&self) {
        for cg in self.cgroups() {
            kill_cgroup_tree(&cg);
        }
        kill_shims(&self.socket());
        // The killed processes exit asynchronously; a cgroup can be removed once empty.
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.cgroups().iter().any(|cg| cgroup_tree_busy(cg)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        // The pin's unmount frees the node's network namespace once its processes are gone
        // (its bridge and pod veths go with it); the veth's host side goes explicitly.
        unmount_under(&self.dir);
        hostnet::delete_link(&self.veth);
        // Runs from before the node had a namespace of its own put the bridge on the host.
        hostnet::delete_link(&self.bridge);
        for cg in self.cgroups() {
            remove_cgroup_tree(&cg);
        }
        // Never delete through a mount that could not be removed.
        if mounts_under(&self.dir).is_empty() {
            if let Err(e) = std::fs::remove_dir_all(&self.dir)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot remove the real node's directory");
            }
        } else {
            tracing::warn!(dir = %self.dir.display(), "mounts remain; leaving the directory");
        }
    }

    /// What is still on the host: one line per leftover, empty when clean.
    pub fn residue(&self) -> Vec<String> {
        let mut left = Vec::new();
        if self.dir.exists() {
            left.push(format!("directory {}", self.dir.display()));
        }
        for m in mounts_under(&self.dir) {
            left.push(format!("mount {}", m.display()));
        }
        if hostnet::link_exists(&self.bridge) {
            left.push(format!("bridge {}", self.bridge));
        }
        if hostnet::link_exists(&self.veth) {
            left.push(format!("veth {}", self.veth));
        }
        for cg in self.cgroups() {
            left.push(format!("cgroup {}", cg.display()));
        }
        for pid in shim_pids(&self.socket()) {
            left.push(format!("containerd shim pid {pid}"));
        }
        left
    }
}

/// SIGKILLs every process in a cgroup tree (the node's pods: pause, workloads).
pub(super) fn kill_cgroup_tree(path: &Path) {
    if let Ok(entries) = std::fs::read_dir(path) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                kill_cgroup_tree(&e.path());
            }
        }
    }
    let procs = std::fs::read_to_string(path.join("cgroup.procs")).unwrap_or_default();
    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
        tracing::warn!(pid, cgroup = %path.display(), "killing a process left in the real node's cgroups");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

pub(super) fn cgroup_tree_busy(path: &Path) -> bool {
    let here =
        std::fs::read_to_string(path.join("cgroup.procs")).is_ok_and(|p| !p.trim().is_empty());
    here || std::fs::read_dir(path).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_type().is_ok_and(|t| t.is_dir()) && cgroup_tree_busy(&e.path()))
    })
}

/// Standard node paths a kubelet, containerd, libcni or a CNI plugin writes whatever its
/// configuration says (the kubelet's device-plugin dir and `/var/log/containers` links,
/// libcni's cache, the shims' sockets) or the manifests mount as hostPaths. The node's mount
/// namespace covers them all with overlays and binds to the run dir, so none may appear on
/// the host: [`host_residue`] checks.
pub(super) const HOST_PATHS: &[&str] = &[
    "/var/lib/kubelet",
    "/var/log/containers",
    "/var/log/pods",
    "/var/lib/cni",
    "/run/containerd",
    "/etc/cni",
    "/opt/cni",
    "/run/meshgate",
];

/// What the host held before the first real node of this process started.
pub(super) struct HostBefore {
    /// The [`HOST_PATHS`] that existed (a host's own kubelet or containerd may have them).
    pub(super) paths: Vec<PathBuf>,
    /// Its kube-proxy nftables tables (a host that is itself a node may have them).
    pub(super) tables: Vec<String>,
    /// Its values of the [`KERNEL_TUNABLES`] (`None`: no such entry on this kernel).
    pub(super) sysctls: Vec<(&'static str, Option<String>)>,
}

/// The host's values of the [`KERNEL_TUNABLES`], in their order.
pub(super) fn host_sysctls() -> Vec<(&'static str, Option<String>)> {
    KERNEL_TUNABLES
        .iter()
        .map(|name| (*name, host_sysctl(name)))
        .collect()
}

/// Real nodes alive in this process, and what the host held before the first of them.
pub(super) static HOST: Mutex<(usize, Option<HostBefore>)> = Mutex::new((0, None));

pub(super) fn host_paths_acquire() {
    let mut host = HOST.lock().unwrap_or_else(|p| p.into_inner());
    if host.1.is_none() {
        host.1 = Some(HostBefore {
            paths: HOST_PATHS
                .iter()
                .map(PathBuf::from)
                .filter(|p| p.exists())
                .collect(),
            tables: host_kube_proxy_tables(),
            sysctls: host_sysctls(),
        });
    }
    host.0 += 1;
}

pub(super) fn host_paths_release() {
    let mut host = HOST.lock().unwrap_or_else(|p| p.into_inner());
    host.0 = host.0.saturating_sub(1);
}

/// The host's nftables tables named `kube-proxy` (`table ip kube-proxy`, `table ip6
/// kube-proxy`): kube-proxy's nftables mode writes only those, so a kube-proxy that escaped
/// its node's network namespace would show here.
pub(super) fn host_kube_proxy_tables() -> Vec<String> {
    std::process::Command::new("nft")
        .args(["list", "tables"])
        .output()
        .map(|out| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.trim_end().ends_with(" kube-proxy"))
                .map(|l| l.trim().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Standard node paths and kube-proxy tables that appeared on the host, and host-wide sysctls
/// the kubelet sets (`KERNEL_TUNABLES`) that changed, since the first real node of this
/// process started; empty when the nodes kept to their namespaces. While a real
/// node runs, that is reported as the first line: the check means something only once every
/// node stopped.
pub fn host_residue() -> Vec<String> {
    let host = HOST.lock().unwrap_or_else(|p| p.into_inner());
    if host.0 > 0 {
        return vec![format!(
            "{} real node(s) still running in this process",
            host.0
        )];
    }
    let Some(before) = host.1.as_ref() else {
        return Vec::new();
    };
    let mut left: Vec<String> = HOST_PATHS
        .iter()
        .map(PathBuf::from)
        .filter(|p| p.exists() && !before.paths.contains(p))
        .map(|p| format!("host path {}", p.display()))
        .collect();
    left.extend(
        host_kube_proxy_tables()
            .into_iter()
            .filter(|t| !before.tables.contains(t))
            .map(|t| format!("host nftables {t}")),
    );
    let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "(none)".into());
    left.extend(
        before
            .sysctls
            .iter()
            .zip(host_sysctls())
            .filter(|((_, was), (_, now))| was != now)
            .map(|((name, was), (_, now))| {
                format!("sysctl {name}: {} → {}", show(was), show(&now))
            }),
    );
    left
}
