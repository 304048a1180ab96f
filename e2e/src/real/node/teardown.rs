//! A real node's teardown, and the sweep after runs whose test binary died without one.
//!
//! In: a [`RealNode`] (or a dead run's directory). Out: its pods drained through the API,
//! its daemons stopped, containerd's containers, shims and mounts removed, its cgroups, the Node
//! object and the directory gone. Everything by pid or by path under the run dir.

use super::*;

impl RealNode {
    /// Tears the node down: pods first (through the kubelet, so the CNI DEL runs), then the
    /// kubelet, any containers and tasks left, containerd and its shims, the mounts under the
    /// run dir, the bridge, the cgroups, the Node object and the directory. Idempotent;
    /// blocking (it runs its API calls on a runtime of its own, so it also works in drop).
    pub fn stop(&self) {
        {
            let mut stopped = self.stopped.lock().unwrap_or_else(|p| p.into_inner());
            if *stopped {
                return;
            }
            *stopped = true;
        }
        let admin = self.admin.clone();
        let name = self.name.clone();
        let kubelet_alive = self
            .procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|p| p.name == "kubelet" && p.alive());
        // 1. Pods, through the kubelet, which stops them and runs the CNI DEL.
        if kubelet_alive {
            run_blocking(drain_pods(admin.clone(), name.clone()));
        }
        // 2. The kubelet and kube-proxy.
        self.stop_component("kubelet");
        self.stop_component("kube-proxy");
        // 3. Containers and tasks the kubelet left (a failed drain), while containerd runs.
        if self
            .procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|p| p.name == "containerd" && p.alive())
        {
            run_blocking(remove_containers(
                self.bins.ctr.clone(),
                self.containerd_socket(),
            ));
        }
        // 4. containerd; 5.-9. whatever is left on the host (processes in the node's
        // cgroups, shims, mounts, the bridge, the cgroups, the directory).
        self.stop_component("containerd");
        self.fp.clean();
        // 10. The Node object.
        run_blocking(delete_node(admin, name));
        if let Some(spawner) = self
            .spawner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            spawner.shutdown();
        }
        // 11. Host paths the daemons create whatever their configuration says.
        host_paths_release();
    }

    pub(super) fn stop_component(&self, name: &str) {
        let procs: Vec<Proc> = {
            let mut all = self.procs.lock().unwrap_or_else(|p| p.into_inner());
            let (these, rest) = std::mem::take(&mut *all)
                .into_iter()
                .partition(|p| p.name == name);
            *all = rest;
            these
        };
        process::stop_all(&procs, STOP_GRACE);
    }
}

/// Kills and removes every task and container containerd still holds in the CRI namespace.
pub(super) async fn remove_containers(ctr: PathBuf, socket: PathBuf) {
    let run = |args: Vec<&'static str>, id: Option<String>| {
        let (ctr, socket) = (ctr.clone(), socket.clone());
        async move {
            let mut all: Vec<&str> = args;
            if let Some(id) = id.as_deref() {
                all.push(id);
            }
            ctr_at(&ctr, &socket, &all).await
        }
    };
    if let Ok(tasks) = run(vec!["-n", K8S_NS, "tasks", "ls", "-q"], None).await {
        for id in tasks.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let id = Some(id.to_owned());
            let _ = run(
                vec!["-n", K8S_NS, "tasks", "kill", "-s", "SIGKILL"],
                id.clone(),
            )
            .await;
            let _ = run(vec!["-n", K8S_NS, "tasks", "delete", "-f"], id).await;
        }
    }
    if let Ok(containers) = run(vec!["-n", K8S_NS, "containers", "ls", "-q"], None).await {
        for id in containers.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let _ = run(vec!["-n", K8S_NS, "containers", "rm"], Some(id.to_owned())).await;
        }
    }
}

/// Runs `ctr --address socket args...` (30 s bound); stdout, or stderr as the error.
pub(super) async fn ctr_at(ctr: &Path, socket: &Path, args: &[&str]) -> Result<String, String> {
    let mut cmd = tokio::process::Command::new(ctr);
    cmd.arg("--address").arg(socket).args(args);
    let what = format!("ctr {}", args.join(" "));
    match wait::command_output(&what, Duration::from_secs(30), &mut cmd).await {
        Err(e) => Err(e.to_string()),
        Ok(out) if out.status.success() => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        Ok(out) => Err(format!(
            "{what}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

/// Drains `node` as `kubectl drain` would: cordons it (so a Deployment's replacements land
/// elsewhere), deletes every pod bound to it, and waits (bounded) until the kubelet has
/// stopped those pods and the apiserver has removed them. Only the pods present at the start
/// are waited for: a DaemonSet's controller recreates its pod at once (it tolerates the
/// cordon), and the containerd cleanup after the kubelet stops takes that one.
pub(super) async fn drain_pods(admin: kube::config::Kubeconfig, node: String) {
    let Ok(client) = client_from(admin, "admin") else {
        return;
    };
    let nodes: Api<Node> = Api::all(client.clone());
    let cordon = serde_json::json!({"spec": {"unschedulable": true}});
    let _ = tokio::time::timeout(
        wait::API_TIMEOUT,
        nodes.patch(
            &node,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&cordon),
        ),
    )
    .await;
    let pods: Api<Pod> = Api::all(client.clone());
    let selector = ListParams::default().fields(&format!("spec.nodeName={node}"));
    let Ok(Ok(list)) = tokio::time::timeout(wait::API_TIMEOUT, pods.list(&selector)).await else {
        return;
    };
    let uids: Vec<String> = list
        .items
        .iter()
        .filter_map(|p| p.metadata.uid.clone())
        .collect();
    for pod in &list.items {
        let (Some(ns), Some(name)) = (&pod.metadata.namespace, &pod.metadata.name) else {
            continue;
        };
        let api: Api<Pod> = Api::namespaced(client.clone(), ns);
        let _ = tokio::time::timeout(
            wait::API_TIMEOUT,
            api.delete(name, &DeleteParams::default().grace_period(1)),
        )
        .await;
    }
    let _ = wait::poll_until(
        &format!("pods of {node} gone"),
        Duration::from_secs(60),
        || async {
            let left = pods.list(&selector).await?;
            let any_left = left
                .items
                .iter()
                .any(|p| p.metadata.uid.as_ref().is_some_and(|u| uids.contains(u)));
            Ok::<_, kube::Error>((!any_left).then_some(()))
        },
    )
    .await;
}

pub(super) async fn delete_node(admin: kube::config::Kubeconfig, node: String) {
    let Ok(client) = client_from(admin, "admin") else {
        return;
    };
    let nodes: Api<Node> = Api::all(client);
    let _ = tokio::time::timeout(
        wait::API_TIMEOUT,
        nodes.delete(&node, &DeleteParams::default()),
    )
    .await;
}

/// Runs `fut` to completion on a fresh runtime in a thread of its own, so teardown works from
/// inside a test's runtime and from drop.
pub(super) fn run_blocking<F>(fut: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let _ = std::thread::Builder::new()
        .name("meshgate-node-stop".into())
        .spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                rt.block_on(fut);
            }
        })
        .map(|t| t.join());
}

/// Pids of the shims serving containerd at `socket`: the socket path is unique to the run and
/// is on every such shim's command line (`-address <socket>`).
pub(super) fn shim_pids(socket: &Path) -> Vec<i32> {
    let socket = socket.display().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let is_shim = args
            .first()
            .is_some_and(|a| a.ends_with(b"containerd-shim-runc-v2"));
        let serves_us = args
            .windows(2)
            .any(|w| w[0] == b"-address" && w[1] == socket.as_bytes());
        if is_shim && serves_us {
            pids.push(pid);
        }
    }
    pids
}

/// Kills, by pid, the shims serving containerd at `socket` (see [`shim_pids`]).
pub(super) fn kill_shims(socket: &Path) {
    for pid in shim_pids(socket) {
        tracing::warn!(pid, "killing a containerd shim left behind");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// Mount points at or under `dir`, deepest first.
pub(super) fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut mounts: Vec<PathBuf> = text
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mount_path)
        .filter(|p| p.starts_with(dir))
        .collect();
    mounts.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    mounts.dedup();
    mounts
}

/// mountinfo escapes space, tab, newline and backslash as octal.
pub(super) fn unescape_mount_path(s: &str) -> PathBuf {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            let code: String = chars.by_ref().take(3).collect();
            match u8::from_str_radix(&code, 8) {
                Ok(b) => out.push(b as char),
                Err(_) => {
                    out.push('\\');
                    out.push_str(&code);
                }
            }
        } else {
            out.push(c);
        }
    }
    PathBuf::from(out)
}

pub(super) fn unmount_under(dir: &Path) {
    // Stacked mounts show up once per layer; a few rounds take them all.
    for _ in 0..5 {
        let mounts = mounts_under(dir);
        if mounts.is_empty() {
            return;
        }
        for m in mounts {
            if let Err(e) = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH) {
                tracing::debug!(mount = %m.display(), error = %e, "umount");
            }
        }
    }
}

/// The cgroup hierarchies the kubelet creates cgroups in: on cgroup v1 and hybrid machines
/// (this one) every controller mount under `/sys/fs/cgroup` and the `unified` one; on a pure
/// v2 machine `/sys/fs/cgroup` itself, whose subdirectories are cgroups, not hierarchies.
pub(super) fn cgroup_hierarchies() -> Vec<PathBuf> {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.controllers").exists() {
        return vec![root.to_owned()];
    }
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("cgroup.procs").exists())
        .collect();
    out.sort();
    out
}

/// Removes a cgroup directory tree bottom-up (cgroupfs allows rmdir of empty cgroups only).
pub(super) fn remove_cgroup_tree(path: &Path) {
    if let Ok(entries) = std::fs::read_dir(path) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup_tree(&e.path());
            }
        }
    }
    if path.exists()
        && let Err(e) = std::fs::remove_dir(path)
    {
        tracing::warn!(cgroup = %path.display(), error = %e, "cannot remove a cgroup");
    }
}

/// Removes real-node directories of dead test runs that hold no mounts. A SIGKILLed test
/// binary loses containerd and the kubelet to PDEATHSIG but cannot clean up after them.
pub(super) fn sweep_stale(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if !entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(DIR_PREFIX))
        {
            continue;
        }
        let Ok(owner) = std::fs::read_to_string(path.join("owner")) else {
            continue;
        };
        let mut fields = owner.split_whitespace().map(str::parse::<u64>);
        let (Some(Ok(pid)), Some(Ok(start))) = (fields.next(), fields.next()) else {
            continue;
        };
        let alive = i32::try_from(pid)
            .ok()
            .and_then(process::start_time)
            .is_some_and(|t| t == start);
        if alive {
            continue;
        }
        tracing::info!(dir = %path.display(), "cleaning up after a dead real-node run");
        Footprint::of(&path).clean();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a SIGKILLed test run leaves (its daemons died by PDEATHSIG, its pods and mounts
    /// did not) is removed by the next run's sweep: the process in the node's cgroups, the
    /// mount, the bridge, the node's network namespace and veth, the cgroups and the
    /// directory. Needs root, like every real-node test.
    #[test]
    fn a_dead_runs_leftovers_are_swept() {
        crate::harness::paths::require_root().expect("the real-node sweep test needs root");
        let base = tempfile::tempdir_in("/dev/shm").unwrap();
        let dir = dead_runs_dir(base.path());
        let fp = Footprint::of(&dir);
        let (hierarchy, reaper) = pod_in_the_nodes_cgroups(&fp);
        let mnt = mount_and_bridge(&dir, &fp);
        // The node's network: its namespace pinned in the run dir, the veth and the route.
        let net = fp.add_network().unwrap();
        // Each kind of leftover is there before the sweep, so its absence after it counts.
        assert!(
            pod_route(&net).contains(&fp.veth),
            "no pod route: {:?}",
            pod_route(&net)
        );
        let before = fp.residue();
        for want in [
            format!("directory {}", dir.display()),
            format!("mount {}", mnt.display()),
            format!("mount {}", fp.netns_pin.display()),
            format!("bridge {}", fp.bridge),
            format!("veth {}", fp.veth),
            format!(
                "cgroup {}",
                hierarchy
                    .join(fp.cgroup_root.trim_start_matches('/'))
                    .display()
            ),
        ] {
            assert!(before.contains(&want), "{want} missing from {before:?}");
        }

        sweep_stale(base.path());

        assert_eq!(fp.residue(), Vec::<String>::new());
        assert_eq!(pod_route(&net), "", "the pod route outlived its veth");
        let status = reaper.join().unwrap().unwrap();
        assert!(
            !status.success(),
            "the pod's process was killed: {status:?}"
        );
    }

    /// A run directory under `base` whose owner is a process that has exited, recorded with
    /// its start time while it lived.
    fn dead_runs_dir(base: &Path) -> PathBuf {
        let dir = tempfile::Builder::new()
            .prefix(DIR_PREFIX)
            .tempdir_in(base)
            .unwrap()
            .keep();
        let mut owner = std::process::Command::new("/bin/sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let owner_pid = owner.id() as i32;
        let owner_start = process::start_time(owner_pid).unwrap();
        owner.kill().unwrap();
        owner.wait().unwrap();
        std::fs::write(dir.join("owner"), format!("{owner_pid} {owner_start}\n")).unwrap();
        dir
    }

    /// A pod's process in the node's cgroups (one hierarchy is enough), reaped by a thread:
    /// the hierarchy and the reaper.
    fn pod_in_the_nodes_cgroups(
        fp: &Footprint,
    ) -> (
        PathBuf,
        std::thread::JoinHandle<std::io::Result<std::process::ExitStatus>>,
    ) {
        let hierarchies = cgroup_hierarchies();
        let hierarchy = hierarchies
            .iter()
            .find(|h| h.ends_with("pids"))
            .or(hierarchies.first())
            .expect("a cgroup hierarchy")
            .clone();
        let cg = hierarchy
            .join(fp.cgroup_root.trim_start_matches('/'))
            .join("kubepods");
        std::fs::create_dir_all(&cg).unwrap();
        let mut pod = std::process::Command::new("/bin/sleep")
            .arg("300")
            .spawn()
            .unwrap();
        std::fs::write(cg.join("cgroup.procs"), pod.id().to_string()).unwrap();
        let reaper = std::thread::spawn(move || pod.wait());
        (hierarchy, reaper)
    }

    /// A mount (a rootfs or netns left mounted) and the bridge; returns the mount point.
    fn mount_and_bridge(dir: &Path, fp: &Footprint) -> PathBuf {
        let mnt = dir.join("containerd/state/mnt");
        std::fs::create_dir_all(&mnt).unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            &mnt,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .unwrap();
        let added = std::process::Command::new("ip")
            .args(["link", "add", &fp.bridge, "type", "bridge"])
            .status()
            .unwrap();
        assert!(added.success());
        mnt
    }

    /// The host's route to the node's pod network, empty when there is none.
    fn pod_route(net: &NodeNet) -> String {
        let out = std::process::Command::new("ip")
            .args(["route", "show", &format!("{}/24", net.pod_net)])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    #[test]
    fn mount_paths_are_unescaped() {
        assert_eq!(unescape_mount_path("/a\\040b/c"), PathBuf::from("/a b/c"));
    }
}
