//! Privileged integration tests of pod inspection: real network namespaces (`ip netns add`
//! through the e2e harness's `netns_sim`, a veth pair, addresses), real rules written by `iptables-nft`, `iptables-legacy`,
//! `ip6tables-*` and `nft -f`, read back by the library and by the built `inspect` binary.
//!
//! These tests need root and the `ip`, `iptables-*`, `ip6tables-*` and `nft` tools
//! (`e2e/install-deps.sh` installs them). Without them they fail with a message saying
//! what is missing: they never skip silently.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use meshgate_agent::inspect::inspect_netns;
use meshgate_agent::netns;
use meshgate_core::profile::{MeshProfile, ProfileSet};
use meshgate_core::rules::locate::{Located, locate};
use meshgate_core::rules::{Inspection, Verdict};
use meshgate_e2e::netns_sim;

const TOOLS: &[&str] = &[
    "ip",
    "iptables-nft",
    "ip6tables-nft",
    "iptables-legacy",
    "ip6tables-legacy",
    "nft",
];

/// A pod-like namespace for these tests: the harness's [`netns_sim::Netns`] (loopback up,
/// deleted on drop) plus a veth pair (eth0 ↔ peer0) to hold addresses. Every step panics
/// with the tool's error, so the tests read as plain steps.
struct Netns(netns_sim::Netns);

impl Netns {
    /// A fresh namespace; fails (never skips) without root or one of [`TOOLS`].
    fn new(tag: &str) -> Self {
        netns_sim::require_tools(TOOLS).unwrap_or_else(|e| panic!("{e:#}"));
        let ns = Self(netns_sim::Netns::new(tag).unwrap_or_else(|e| panic!("{e:#}")));
        ns.sh("ip link add eth0 type veth peer name peer0
               ip link set eth0 up
               ip link set peer0 up");
        ns
    }

    fn name(&self) -> &str {
        &self.0.name
    }

    fn path(&self) -> PathBuf {
        self.0.path()
    }

    /// Runs a shell script inside the namespace; every line must succeed.
    fn sh(&self, script: &str) -> String {
        self.0
            .exec(script)
            .unwrap_or_else(|e| panic!("in {}: {e:#}", self.name()))
    }

    fn addr(&self, cidr: &str) {
        // nodad: an IPv6 address is usable (and listed as global) right away.
        let extra = if cidr.contains(':') { " nodad" } else { "" };
        self.sh(&format!("ip addr add {cidr} dev eth0{extra}"));
    }

    /// Loads an nft script with `nft -f`.
    fn nft(&self, script: &str) {
        self.0.nft(script).unwrap_or_else(|e| panic!("{e:#}"));
    }

    /// Runs a shell script inside the named namespace `name`; every line must succeed.
    fn sh_in(name: &str, script: &str) -> String {
        netns_sim::sh(&["ip", "netns", "exec", name, "sh", "-ec", script])
            .unwrap_or_else(|e| panic!("in {name}: {e:#}"))
    }

    /// Starts a process inside the namespace and returns its pid.
    fn spawn_sleeper(&mut self) -> u32 {
        self.0.spawn_sleeper().unwrap_or_else(|e| panic!("{e:#}"))
    }
}

fn profile(name: &str) -> MeshProfile {
    ProfileSet::all_builtin()
        .get(name)
        .cloned()
        .expect("built-in profile")
}

fn inspect(ns: &Netns, p: &str) -> Inspection {
    inspect_netns(&ns.path(), &profile(p)).unwrap_or_else(|e| panic!("inspect {}: {e}", ns.name()))
}

/// linkerd proxy-init's rules, as its iptables mode writes them.
fn linkerd_rules(ipt: &str, inbound: u16) -> String {
    format!(
        "{ipt} -w -t nat -N PROXY_INIT_REDIRECT
         {ipt} -w -t nat -A PROXY_INIT_REDIRECT -p tcp --match multiport --dports 4190,4191,4567,4568 -j RETURN -m comment --comment proxy-init/ignore-port
         {ipt} -w -t nat -A PROXY_INIT_REDIRECT -p tcp -j REDIRECT --to-port {inbound} -m comment --comment proxy-init/redirect-all-incoming-to-proxy-port
         {ipt} -w -t nat -A PREROUTING -j PROXY_INIT_REDIRECT -m comment --comment proxy-init/install-proxy-init-prerouting
         {ipt} -w -t nat -N PROXY_INIT_OUTPUT
         {ipt} -w -t nat -A PROXY_INIT_OUTPUT -m owner --uid-owner 2102 -j RETURN
         {ipt} -w -t nat -A PROXY_INIT_OUTPUT -o lo -j RETURN
         {ipt} -w -t nat -A PROXY_INIT_OUTPUT -p tcp --match multiport --dports 443 -j RETURN
         {ipt} -w -t nat -A PROXY_INIT_OUTPUT -p tcp -j REDIRECT --to-port 4140
         {ipt} -w -t nat -A OUTPUT -j PROXY_INIT_OUTPUT -m comment --comment proxy-init/install-proxy-init-output
        "
    )
}

/// istio-iptables' sidecar rules (IPv4).
fn istio_rules(ipt: &str) -> String {
    format!(
        "{ipt} -w -t nat -N ISTIO_INBOUND
         {ipt} -w -t nat -N ISTIO_IN_REDIRECT
         {ipt} -w -t nat -N ISTIO_OUTPUT
         {ipt} -w -t nat -N ISTIO_REDIRECT
         {ipt} -w -t nat -A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN
         {ipt} -w -t nat -A ISTIO_INBOUND -p tcp --dport 15090 -j RETURN
         {ipt} -w -t nat -A ISTIO_INBOUND -p tcp --dport 15021 -j RETURN
         {ipt} -w -t nat -A ISTIO_INBOUND -p tcp --dport 15020 -j RETURN
         {ipt} -w -t nat -A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT
         {ipt} -w -t nat -A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
         {ipt} -w -t nat -A ISTIO_OUTPUT -s 127.0.0.6/32 -o lo -j RETURN
         {ipt} -w -t nat -A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
         {ipt} -w -t nat -A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 1337 -j RETURN
         {ipt} -w -t nat -A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
         {ipt} -w -t nat -A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN
         {ipt} -w -t nat -A ISTIO_OUTPUT -j ISTIO_REDIRECT
         {ipt} -w -t nat -A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
         {ipt} -w -t nat -A PREROUTING -p tcp -j ISTIO_INBOUND
         {ipt} -w -t nat -A OUTPUT -p tcp -j ISTIO_OUTPUT
        "
    )
}

/// Istio's native nftables layout (`inet istio-proxy-nat`).
const ISTIO_NFT: &str = "
table inet istio-proxy-nat {
    chain prerouting {
        type nat hook prerouting priority dstnat; policy accept;
        meta l4proto tcp jump istio-inbound
    }
    chain output {
        type nat hook output priority -100; policy accept;
        meta l4proto tcp jump istio-output
    }
    chain istio-inbound {
        tcp dport { 15008, 15090, 15021, 15020 } return
        meta l4proto tcp jump istio-in-redirect
    }
    chain istio-in-redirect {
        meta l4proto tcp redirect to :15006
    }
    chain istio-output {
        meta skuid 1337 return
        ip daddr 127.0.0.1 return
        ip6 daddr ::1 return
        goto istio-redirect
    }
    chain istio-redirect {
        meta l4proto tcp redirect to :15001
    }
}
";

/// linkerd's rules are found for IPv4 and IPv6, through proxy-init's chains as `backend`
/// (`iptables-nft`, `iptables-legacy`) wrote them.
fn assert_linkerd_redirected_in_both_families(ns: &Netns, backend: &str) {
    let got = inspect(ns, "linkerd");
    assert_eq!(got.verdict, Verdict::Redirected, "{}", got.message);
    assert_eq!(
        got.inbound.via,
        Some(format!(
            "ip nat PREROUTING -> PROXY_INIT_REDIRECT ({backend}); \
             ip6 nat PREROUTING -> PROXY_INIT_REDIRECT ({backend})"
        ))
    );
    assert_eq!(
        got.outbound.via,
        Some(format!(
            "ip nat OUTPUT -> PROXY_INIT_OUTPUT ({backend}); \
             ip6 nat OUTPUT -> PROXY_INIT_OUTPUT ({backend})"
        ))
    );
}

#[test]
fn linkerd_iptables_nft_dual_stack() {
    let ns = Netns::new("lnft");
    ns.addr("10.244.1.5/24");
    ns.addr("fd00:10:244:1::5/64");
    ns.sh(&linkerd_rules("iptables-nft", 4143));
    // IPv4 rules only, on a dual-stack pod: missing for IPv6.
    let half = inspect(&ns, "linkerd");
    assert_eq!(half.verdict, Verdict::Missing, "{}", half.message);
    assert!(half.message.contains("IPv6"), "{}", half.message);
    ns.sh(&linkerd_rules("ip6tables-nft", 4143));
    assert_linkerd_redirected_in_both_families(&ns, "iptables-nft");
    // Istio's ports are elsewhere.
    assert_eq!(inspect(&ns, "istio").verdict, Verdict::Missing);
}

#[test]
fn linkerd_iptables_legacy_dual_stack() {
    let ns = Netns::new("lleg");
    ns.addr("10.244.1.6/24");
    ns.addr("fd00:10:244:1::6/64");
    ns.sh(&linkerd_rules("iptables-legacy", 4143));
    ns.sh(&linkerd_rules("ip6tables-legacy", 4143));
    assert_linkerd_redirected_in_both_families(&ns, "iptables-legacy");
}

#[test]
fn istio_iptables_layout_both_backends() {
    for ipt in ["iptables-nft", "iptables-legacy"] {
        let ns = Netns::new("istio");
        ns.addr("10.244.2.7/24");
        ns.sh(&istio_rules(ipt));
        let got = inspect(&ns, "istio");
        assert_eq!(got.verdict, Verdict::Redirected, "{ipt}: {}", got.message);
        assert_eq!(
            got.inbound.via,
            Some(format!(
                "ip nat PREROUTING -> ISTIO_INBOUND -> ISTIO_IN_REDIRECT ({ipt})"
            ))
        );
        assert_eq!(
            got.outbound.via,
            Some(format!(
                "ip nat OUTPUT -> ISTIO_OUTPUT -> ISTIO_REDIRECT ({ipt})"
            ))
        );
        let linkerd = inspect(&ns, "linkerd");
        assert_eq!(linkerd.verdict, Verdict::Missing);
        assert!(!linkerd.inbound.found && !linkerd.outbound.found);
    }
}

#[test]
fn istio_native_nftables_inet_table() {
    let ns = Netns::new("nft");
    ns.addr("10.244.3.8/24");
    ns.addr("fd00:10:244:3::8/64");
    ns.nft(ISTIO_NFT);
    for p in ["istio", "istio-ambient"] {
        let got = inspect(&ns, p);
        assert_eq!(got.verdict, Verdict::Redirected, "{p}: {}", got.message);
        assert_eq!(
            got.inbound.via.as_deref(),
            Some(
                "inet istio-proxy-nat prerouting -> istio-inbound -> istio-in-redirect (nftables)"
            )
        );
        assert_eq!(
            got.outbound.via.as_deref(),
            Some("inet istio-proxy-nat output -> istio-output -> istio-redirect (nftables)")
        );
    }
}

#[test]
fn wrong_port_and_unreachable_chain_are_missing() {
    let ns = Netns::new("wrong");
    ns.addr("10.244.4.9/24");
    ns.sh(&linkerd_rules("iptables-nft", 4144));
    let got = inspect(&ns, "linkerd");
    assert_eq!(got.verdict, Verdict::Missing);
    assert!(!got.inbound.found, "redirect to 4144 must not count");
    assert!(got.outbound.found);

    let ns = Netns::new("unreach");
    ns.addr("10.244.4.10/24");
    ns.nft(
        "table inet istio-proxy-nat {
            chain istio-in-redirect { meta l4proto tcp redirect to :15006; }
            chain istio-output { meta l4proto tcp redirect to :15001; }
            chain prerouting { type nat hook prerouting priority dstnat; policy accept; }
            chain output { type nat hook output priority -100; policy accept; jump istio-output; }
        }",
    );
    let got = inspect(&ns, "istio");
    assert_eq!(got.verdict, Verdict::Missing);
    assert!(
        !got.inbound.found,
        "a chain nothing jumps to must not count"
    );
    assert!(got.outbound.found);
    assert!(got.message.contains("15006"), "{}", got.message);
}

#[test]
fn empty_namespace_is_missing_and_a_redirect_in_a_dormant_table_does_not_count() {
    let ns = Netns::new("empty");
    ns.addr("10.244.5.11/24");
    let got = inspect(&ns, "istio");
    assert_eq!(got.verdict, Verdict::Missing);
    ns.nft(ISTIO_NFT);
    ns.sh("nft add table inet istio-proxy-nat '{ flags dormant; }'");
    assert_eq!(inspect(&ns, "istio").verdict, Verdict::Missing);
}

fn binary(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_meshgate-agent"))
        .args(args)
        .output()
        .expect("run meshgate-agent");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn inspect_binary_text_json_and_exit_codes() {
    let mut ns = Netns::new("bin");
    ns.addr("10.244.6.12/24");
    ns.sh(&linkerd_rules("iptables-nft", 4143));
    let path = ns.path();
    let path = path.to_str().expect("utf-8 path");

    let (code, out, err) = binary(&["inspect", "--netns", path, "--profile", "linkerd"]);
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    assert!(out.contains("REDIRECTED"), "{out}");
    assert!(
        out.contains("via ip nat PREROUTING -> PROXY_INIT_REDIRECT (iptables-nft)"),
        "{out}"
    );

    let (code, out, err) = binary(&[
        "inspect",
        "--netns",
        path,
        "--profile",
        "istio",
        "--output",
        "json",
    ]);
    assert_eq!(code, 1, "stdout: {out}\nstderr: {err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert_eq!(v["verdict"], "missing");
    assert_eq!(v["profile"], "istio");
    assert_eq!(v["netns"], path);
    assert_eq!(v["inbound"]["port"], 15006);
    assert_eq!(v["inbound"]["found"], false);
    assert_eq!(v["outbound"]["port"], 15001);
    assert!(v["message"].as_str().is_some_and(|m| m.contains("15006")));

    // --pid reads the same namespace through a process inside it.
    let pid = ns.spawn_sleeper().to_string();
    let (code, out, err) = binary(&[
        "inspect",
        "--pid",
        &pid,
        "--profile",
        "linkerd",
        "--output",
        "json",
    ]);
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
    assert_eq!(v["verdict"], "redirected");
    assert_eq!(
        v["outbound"]["via"],
        "ip nat OUTPUT -> PROXY_INIT_OUTPUT (iptables-nft)"
    );
    assert_eq!(v["netns"], format!("/proc/{pid}/ns/net"));

    // Usage and I/O errors exit 2.
    let (code, _, err) = binary(&["inspect", "--netns", path, "--profile", "consul"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("consul"), "{err}");
    let (code, _, err) = binary(&[
        "inspect",
        "--netns",
        "/nonexistent/netns",
        "--profile",
        "istio",
    ]);
    assert_eq!(code, 2, "{err}");
    let (code, _, _) = binary(&["inspect", "--profile", "istio"]);
    assert_eq!(code, 2);

    // A custom profile from --profile-file.
    let file = std::env::temp_dir().join(format!("{}-profiles.json", ns.name()));
    std::fs::write(
        &file,
        r#"[{"name":"custom","selector":{"labels":{"mesh":"custom"}},"pluginType":"custom-cni","inboundPort":4143,"outboundPort":4140}]"#,
    )
    .expect("write profile file");
    let (code, out, err) = binary(&[
        "inspect",
        "--netns",
        path,
        "--profile",
        "custom",
        "--profile-file",
        file.to_str().expect("utf-8"),
    ]);
    let _ = std::fs::remove_file(&file);
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
}

fn legacy_names(pid: u32) -> (String, String) {
    let read =
        |f: &str| std::fs::read_to_string(format!("/proc/{pid}/net/{f}")).unwrap_or_default();
    (read("ip_tables_names"), read("ip6_tables_names"))
}

#[test]
fn reading_never_creates_legacy_tables() {
    let mut ns = Netns::new("pitfall");
    ns.addr("10.244.7.13/24");
    ns.addr("fd00:10:244:7::13/64");
    ns.nft(ISTIO_NFT);
    let pid = ns.spawn_sleeper();
    assert_eq!(legacy_names(pid), (String::new(), String::new()));

    // Library reader, then the binary, by path and by pid.
    assert_eq!(inspect(&ns, "istio").verdict, Verdict::Redirected);
    let path = ns.path();
    let (code, _, err) = binary(&[
        "inspect",
        "--netns",
        path.to_str().expect("utf-8"),
        "--profile",
        "istio",
    ]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = binary(&["inspect", "--pid", &pid.to_string(), "--profile", "linkerd"]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(
        legacy_names(pid),
        (String::new(), String::new()),
        "inspection created legacy tables in the pod's namespace"
    );

    // Control: the names files do show tables once something queries them, so the check
    // above can fail.
    ns.sh("iptables-legacy -w -t nat -S >/dev/null; ip6tables-legacy -w -t mangle -S >/dev/null");
    let (v4, v6) = legacy_names(pid);
    assert!(v4.lines().any(|l| l == "nat"), "{v4:?}");
    assert!(v6.lines().any(|l| l == "mangle"), "{v6:?}");
    // And now that they exist, the reader reads exactly those (empty) tables.
    let opened = netns::open(&ns.path(), true).expect("open");
    let sockets = opened.rule_sockets().expect("rules requested");
    let names = sockets.legacy_tables();
    assert!(
        names.iter().any(|(_, t)| t.iter().any(|n| n == "nat")),
        "{names:?}"
    );
    assert!(
        names.iter().any(|(_, t)| t.iter().any(|n| n == "mangle")),
        "{names:?}"
    );
    let rs = opened.ruleset().expect("ruleset");
    assert!(rs.tables.iter().any(|t| t.name == "mangle"));
    assert_eq!(legacy_names(pid).0.lines().count(), 1, "still only nat");
}

#[test]
fn discovery_finds_named_and_process_namespaces_once() {
    let mut ns = Netns::new("disc");
    ns.addr("10.244.8.14/24");
    ns.addr("fd00:10:244:8::14/64");
    let pid = ns.spawn_sleeper();
    let other = Netns::new("disc2");
    other.addr("10.244.8.15/24");

    let dirs = vec![PathBuf::from(netns::DEFAULT_NETNS_DIR)];
    let found = netns::discover(&dirs).expect("discover");
    let inode =
        |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).expect("stat"));
    let me = found
        .iter()
        .filter(|r| r.inode == inode(&ns.path()))
        .collect::<Vec<_>>();
    assert_eq!(me.len(), 1, "deduplicated by inode: {found:?}");
    assert_eq!(me[0].path, ns.path(), "the named path is preferred");
    assert!(me[0].pids.contains(&pid), "{:?}", me[0]);
    let host = inode(Path::new("/proc/self/ns/net"));
    assert!(
        found.iter().all(|r| r.inode != host),
        "the host namespace is excluded"
    );

    let (facts, _errors) = netns::survey(&dirs).expect("survey");
    let ip: IpAddr = "fd00:10:244:8::14".parse().expect("ip");
    match locate(&facts, &[ip], Some("00000000-0000-0000-0000-000000000000")) {
        Located::Found(r) => assert_eq!(r.inode, inode(&ns.path())),
        Located::Unknown(why) => panic!("not located: {why}"),
    }
    let other_ip: IpAddr = "10.244.8.15".parse().expect("ip");
    match locate(&facts, &[other_ip], None) {
        Located::Found(r) => assert_eq!(r.path, other.path()),
        Located::Unknown(why) => panic!("not located: {why}"),
    }
    let nowhere: IpAddr = "10.255.255.1".parse().expect("ip");
    assert!(matches!(
        locate(&facts, &[nowhere], None),
        Located::Unknown(_)
    ));
}

#[test]
fn the_thread_returns_to_its_own_namespace() {
    let ns = Netns::new("ret");
    let here = || {
        std::fs::metadata("/proc/thread-self/ns/net")
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
            .expect("stat own netns")
    };
    let before = here();
    let inside = netns::with_netns(&ns.path(), here).expect("enter");
    let target = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(ns.path()).expect("stat"));
    assert_eq!(inside, target);
    assert_eq!(here(), before);
    // Also when the closure panics.
    let path = ns.path();
    let caught = std::panic::catch_unwind(move || {
        let _ = netns::with_netns(&path, || panic!("boom"));
    });
    assert!(caught.is_err());
    assert_eq!(here(), before);
}

#[test]
fn concurrent_rule_changes_never_yield_a_torn_read() {
    let ns = Netns::new("churn");
    ns.addr("10.244.9.16/24");
    ns.nft(ISTIO_NFT);
    let name = ns.name().to_owned();
    // A writer adds and flushes a table in a loop while the reader reads.
    let writer = std::thread::spawn(move || {
        for i in 0..40 {
            let script = format!(
                "nft add table ip churn{i}; nft add chain ip churn{i} c; \
                 nft add rule ip churn{i} c counter; nft delete table ip churn{i}"
            );
            let _ = Command::new("ip")
                .args(["netns", "exec", &name, "sh", "-c", &script])
                .output();
        }
    });
    let opened = netns::open(&ns.path(), true).expect("open");
    let mut reads = 0;
    while !writer.is_finished() {
        let rs = opened
            .ruleset()
            .expect("a consistent read (interrupted dumps are retried)");
        let got = meshgate_core::rules::check(&rs, &profile("istio"), &[]);
        assert_eq!(got.verdict, Verdict::Redirected, "{}", got.message);
        reads += 1;
    }
    writer.join().expect("writer");
    assert!(reads > 0);
}

// ---------------------------------------------------------------------------------------
// Namespace identity: what the survey found is what is read and what an eviction acts on
// ---------------------------------------------------------------------------------------

mod identity {
    use std::collections::BTreeMap;
    use std::net::{IpAddr, Ipv4Addr};
    use std::os::unix::fs::MetadataExt;
    use std::path::PathBuf;
    use std::process::{Child, Command, Stdio};
    use std::time::Duration;

    use meshgate_agent::daemon::pods::inspect::{Job, inspect_one};
    use meshgate_agent::netns::{self, NetnsError};
    use meshgate_core::rules::Verdict;
    use meshgate_e2e::netns_sim;

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
        }
    }

    fn dirs() -> Vec<PathBuf> {
        vec![PathBuf::from(netns::DEFAULT_NETNS_DIR)]
    }

    /// A pod's sandbox is deleted and a new sandbox (another pod's) is created under the
    /// same netns name, holding the same IP. The inspection of the old one must never be
    /// acted on through the new one, and a stale survey must never read the new one as the
    /// old one.
    #[test]
    fn a_netns_recreated_under_its_name_with_the_pods_ip_is_not_the_one_inspected() {
        netns_sim::require_tools(TOOLS).unwrap_or_else(|e| panic!("{e:#}"));
        let ip = pod_ip();
        let name = format!("mg-reuse-{}", std::process::id());
        let guard = Named(name.clone());
        add_named(&name, ip);

        let (facts, _) = netns::survey(&dirs()).expect("survey");
        let got = inspect_one(&facts, &job(ip));
        assert_eq!(got.inspections[0].verdict, Verdict::Missing, "{got:?}");
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
        assert_eq!(stale.inspections[0].verdict, Verdict::Unknown, "{stale:?}");
        assert!(
            stale.inspections[0]
                .message
                .contains("no longer the one surveyed"),
            "{stale:?}"
        );
        // A fresh survey reads the new namespace for what it is.
        let (fresh, _) = netns::survey(&dirs()).expect("survey");
        let now = inspect_one(&fresh, &job(ip));
        assert_eq!(now.inspections[0].verdict, Verdict::Redirected, "{now:?}");
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
        netns_sim::require_tools(TOOLS).unwrap_or_else(|e| panic!("{e:#}"));
        let ip = pod_ip();
        let name = format!("mg-ipgone-{}", std::process::id());
        let _guard = Named(name.clone());
        add_named(&name, ip);
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
        assert_eq!(stale.inspections[0].verdict, Verdict::Unknown, "{stale:?}");
        assert!(
            stale.inspections[0]
                .message
                .contains("no longer holds pod IP"),
            "{stale:?}"
        );
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
        let ip = pod_ip();
        let mut first = Killed(
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

        let (facts, _) = netns::survey(&dirs()).expect("survey");
        let got = inspect_one(&facts, &job(ip));
        assert_eq!(
            got.netns,
            Some(PathBuf::from(format!("/proc/{pid}/ns/net"))),
            "{got:?}"
        );
        assert_eq!(got.inspections[0].verdict, Verdict::Missing, "{got:?}");
        let pinned = got.pinned.expect("missing keeps it");
        pinned.confirm(&[ip]).expect("nothing changed yet");

        // The pod's sandbox dies; another pod's sandbox gets the same IP and, in it, a
        // process gets the same pid.
        let _ = first.0.kill();
        let _ = first.0.wait();
        let other = super::Netns::new("recycled");
        other.sh(&format!("ip addr add {ip}/32 dev lo"));
        let other_ino = std::fs::metadata(other.path()).expect("stat").ino();
        let mut recycled = None;
        for _ in 0..200 {
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
                recycled = Some(c);
                break;
            }
        }
        let _recycled = recycled.unwrap_or_else(|| panic!("pid {pid} was never handed out again"));
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
        assert_eq!(stale.inspections[0].verdict, Verdict::Unknown, "{stale:?}");
    }
}
