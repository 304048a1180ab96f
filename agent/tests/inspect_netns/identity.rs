//! Namespace identity: what the survey found is what is read and what an eviction acts on

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use meshgate_agent::daemon::pods::sweep::{Inspected, Job, inspect_one};
use meshgate_agent::netns::{self, NetnsError};
use meshgate_core::rules::RedirectVerdict;
use meshgate_e2e::sim::netns as netns_sim;

use super::{TOOLS, profile};

fn run(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Asserts the verdict of `got`'s first inspection, and that its message contains `needle`.
fn assert_first(got: &Inspected, verdict: RedirectVerdict, needle: &str) {
    let first = &got.inspections[0];
    assert_eq!(first.verdict, verdict, "{got:?}");
    assert!(first.message.contains(needle), "{got:?}");
}

fn pod_ip() -> IpAddr {
    let [a, b, c] = netns_sim::private_subnet();
    IpAddr::V4(Ipv4Addr::new(a, b, c, 7))
}

/// `ip netns add NAME` with `ip` on its loopback, as a CNI plugin leaves a sandbox.
fn add_named(name: &str, ip: IpAddr) {
    run(&["ip", "netns", "add", name]);
    run(&["ip", "-n", name, "link", "set", "lo", "up"]);
    run(&[
        "ip",
        "-n",
        name,
        "addr",
        "add",
        &format!("{ip}/32"),
        "dev",
        "lo",
    ]);
}

/// A sandbox as a CNI plugin leaves it: `ip netns add mg-<tag>-<pid>` with the pod IP on
/// its loopback, deleted when the guard drops. Fails (never skips) without the tools.
fn sandbox(tag: &str) -> (IpAddr, Named) {
    netns_sim::require_tools(TOOLS).unwrap_or_else(|e| panic!("{e:#}"));
    let ip = pod_ip();
    let guard = Named(format!("mg-{tag}-{}", std::process::id()));
    add_named(&guard.0, ip);
    (ip, guard)
}

struct Named(String);
impl Drop for Named {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn job(ip: IpAddr) -> Job {
    Job {
        uid: "00000000-0000-0000-0000-000000000000".into(),
        ips: vec![ip],
        annotations: BTreeMap::new(),
        profiles: vec![profile("linkerd")],
        node_proxy: None,
    }
}

fn dirs() -> Vec<PathBuf> {
    vec![PathBuf::from(netns::DEFAULT_NETNS_DIR)]
}

/// The daemon's path (survey → `inspect_one`) judges a pod by what its mesh writes for
/// its annotations: an Istio pod with `includeOutboundIPRanges: ""` has no outbound
/// capture, and the job's annotations are what keeps it from being `missing`.
#[test]
fn the_daemon_judges_a_pod_by_the_rules_its_annotations_ask_for() {
    let (ip, guard) = sandbox("optout");
    let name = guard.0.clone();
    let rules = std::env::temp_dir().join(format!("{name}.rules"));
    std::fs::write(
        &rules,
        format!("{}\n", crate::meshes::ISTIO_INBOUND_WILDCARD),
    )
    .unwrap();
    super::Netns::sh_in(
        &name,
        &format!("iptables-nft-restore -w < {}", rules.display()),
    );
    let _ = std::fs::remove_file(&rules);

    let (facts, _) = netns::survey(&dirs()).expect("survey");
    let istio = |annotations: &[(&str, &str)]| Job {
        profiles: vec![profile("istio")],
        annotations: annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..job(ip)
    };
    let bare = inspect_one(&facts, &istio(&[]));
    assert_first(&bare, RedirectVerdict::Missing, "");
    let opted = inspect_one(&facts, &istio(&[(crate::meshes::OUT_RANGES, "")]));
    assert_first(&opted, RedirectVerdict::Redirected, "");
    assert!(opted.pinned.is_none(), "nothing to act on");
}

/// A pod's sandbox is deleted and a new sandbox (another pod's) is created under the
/// same netns name, holding the same IP. The inspection of the old one must never be
/// acted on through the new one, and a stale survey must never read the new one as the
/// old one.
#[test]
fn a_netns_recreated_under_its_name_with_the_pods_ip_is_not_the_one_inspected() {
    let (ip, guard) = sandbox("reuse");
    let name = guard.0.clone();

    let (facts, _) = netns::survey(&dirs()).expect("survey");
    let got = inspect_one(&facts, &job(ip));
    assert_first(&got, RedirectVerdict::Missing, "");
    let pinned = got.pinned.expect("a missing verdict keeps its namespace");
    pinned.confirm(&[ip]).expect("nothing changed yet");

    // The sandbox dies; a new one takes its name and its IP (with the rules in place).
    run(&["ip", "netns", "del", &name]);
    add_named(&name, ip);
    super::Netns::sh_in(&name, &super::linkerd_rules("iptables-nft", 4143));

    match pinned.confirm(&[ip]) {
        Err(NetnsError::Replaced {
            inode, now_inode, ..
        }) => assert_ne!(inode, now_inode),
        other => panic!("the re-created namespace passed for the inspected one: {other:?}"),
    }
    // The survey taken before the switch: the new namespace is not read in its place.
    let stale = inspect_one(&facts, &job(ip));
    assert_first(
        &stale,
        RedirectVerdict::Unknown,
        "no longer the one surveyed",
    );
    // A fresh survey reads the new namespace for what it is.
    let (fresh, _) = netns::survey(&dirs()).expect("survey");
    let now = inspect_one(&fresh, &job(ip));
    assert_first(&now, RedirectVerdict::Redirected, "");
    assert!(
        now.pinned.is_none(),
        "nothing to act on: no descriptor kept"
    );

    // Gone altogether: not confirmed either.
    drop(guard);
    assert!(matches!(
        pinned.confirm(&[ip]),
        Err(NetnsError::Open { .. })
    ));
}

/// The pod IP left the namespace between inspection and eviction (the sandbox is being
/// torn down, the IP moved): not confirmed, and a stale survey reads it as unknown.
#[test]
fn a_namespace_that_no_longer_holds_the_pod_ip_is_not_acted_on() {
    let (ip, guard) = sandbox("ipgone");
    let name = guard.0.clone();
    let (facts, _) = netns::survey(&dirs()).expect("survey");
    let pinned = inspect_one(&facts, &job(ip))
        .pinned
        .expect("missing keeps it");
    run(&[
        "ip",
        "-n",
        &name,
        "addr",
        "del",
        &format!("{ip}/32"),
        "dev",
        "lo",
    ]);
    match pinned.confirm(&[ip]) {
        Err(NetnsError::PodIpGone { ip: gone, .. }) => assert_eq!(gone, ip),
        other => panic!("confirmed without the pod IP: {other:?}"),
    }
    let stale = inspect_one(&facts, &job(ip));
    assert_first(&stale, RedirectVerdict::Unknown, "no longer holds pod IP");
}

/// Waits until `/proc/<pid>/ns/net` is the namespace with inode `want`.
fn wait_in(pid: u32, want: u64) -> bool {
    for _ in 0..200 {
        if std::fs::metadata(format!("/proc/{pid}/ns/net")).is_ok_and(|m| m.ino() == want) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// A namespace reachable only through its process (`/proc/<pid>/ns/net`, as with
/// runtimes that do not bind-mount it): the process exits and its pid is handed to a
/// process of another pod's namespace holding the same IP (forced with
/// `/proc/sys/kernel/ns_last_pid`, a real pid recycle). The pinned descriptor tells them
/// apart; the path alone would not.
#[test]
fn a_recycled_pid_never_gets_the_wrong_namespace_acted_on() {
    netns_sim::require_tools(TOOLS).unwrap_or_else(|e| panic!("{e:#}"));
    netns_sim::require_tools(&["unshare", "nsenter"]).unwrap_or_else(|e| panic!("{e:#}"));
    // The other tests of this binary fork too, and one of their long-lived processes can
    // take the freed pid first: then the scenario starts over with a new pid.
    assert!(
        (0..5).any(|_| recycled_pid_round()),
        "the freed pid was taken by another process in 5 rounds out of 5"
    );
}

/// One round of the scenario above; `false` when the pid could not be recycled.
fn recycled_pid_round() -> bool {
    let ip = pod_ip();
    let (mut first, pid) = unshared_sandbox(ip);

    let (facts, _) = netns::survey(&dirs()).expect("survey");
    let got = inspect_one(&facts, &job(ip));
    assert_eq!(
        got.netns,
        Some(PathBuf::from(format!("/proc/{pid}/ns/net"))),
        "{got:?}"
    );
    assert_first(&got, RedirectVerdict::Missing, "");
    let pinned = got.pinned.expect("missing keeps it");
    pinned.confirm(&[ip]).expect("nothing changed yet");

    // The pod's sandbox dies; another pod's sandbox gets the same IP and, in it, a
    // process gets the same pid.
    let _ = first.0.kill();
    let _ = first.0.wait();
    let other = super::Netns::new("recycled");
    other.sh(&format!("ip addr add {ip}/32 dev lo"));
    let other_ino = std::fs::metadata(other.path()).expect("stat").ino();
    let Some(_recycled) = recycle_pid_into(pid, &other) else {
        return false;
    };
    assert!(
        wait_in(pid, other_ino),
        "the recycled pid never entered the other namespace"
    );

    // Through the path, this is now the other pod's namespace, with the pod's IP.
    match pinned.confirm(&[ip]) {
        Err(NetnsError::Replaced { .. }) => {}
        other => panic!("the recycled pid's namespace passed for the inspected one: {other:?}"),
    }
    let stale = inspect_one(&facts, &job(ip));
    assert_first(&stale, RedirectVerdict::Unknown, "");
    true
}

/// A process in a network namespace of its own (as a pod sandbox), with `ip` on its
/// loopback: the process and its pid.
fn unshared_sandbox(ip: IpAddr) -> (Killed, u32) {
    let first = Killed(
        Command::new("unshare")
            .args(["--net", "sleep", "infinity"])
            .stdin(Stdio::null())
            .spawn()
            .expect("unshare"),
    );
    let pid = first.0.id();
    let own = std::fs::metadata("/proc/self/ns/net").expect("stat").ino();
    for _ in 0..200 {
        if std::fs::metadata(format!("/proc/{pid}/ns/net")).is_ok_and(|m| m.ino() != own) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let target = pid.to_string();
    run(&[
        "nsenter", "-t", &target, "-n", "ip", "link", "set", "lo", "up",
    ]);
    run(&[
        "nsenter",
        "-t",
        &target,
        "-n",
        "ip",
        "addr",
        "add",
        &format!("{ip}/32"),
        "dev",
        "lo",
    ]);
    (first, pid)
}

/// Starts a process in `other`'s namespace with the freed `pid`, through `ns_last_pid`;
/// `None` when another process kept taking it.
fn recycle_pid_into(pid: u32, other: &super::Netns) -> Option<Killed> {
    for _ in 0..200 {
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            // Someone else's process holds it for now.
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string())
            .expect("ns_last_pid (needs root)");
        let child = Command::new("nsenter")
            .arg(format!("--net={}", other.path().display()))
            .args(["sleep", "infinity"])
            .stdin(Stdio::null())
            .spawn()
            .expect("nsenter");
        let c = Killed(child);
        if c.0.id() == pid {
            return Some(c);
        }
    }
    None
}
