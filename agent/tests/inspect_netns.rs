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

use std::collections::BTreeMap;

use meshgate_agent::netns;
use meshgate_core::profile::MeshProfile;
use meshgate_core::rules::locate::{Located, locate};
use meshgate_core::rules::{Inspection, IpFamily, RedirectVerdict};
use meshgate_e2e::sim::netns as netns_sim;

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

    /// Loads an `iptables-save`-format script with `tool` (`iptables-nft-restore`, ...),
    /// through a file: a large script does not fit in an argument list.
    fn restore(&self, tool: &str, script: &str) {
        let file = std::env::temp_dir().join(format!("{}-{tool}.rules", self.name()));
        std::fs::write(&file, format!("{script}\n")).expect("write rules file");
        self.sh(&format!("{tool} -w < {}", file.display()));
        let _ = std::fs::remove_file(&file);
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
    meshgate_core::meshes::builtin_named(name).expect("built-in profile")
}

fn inspect(ns: &Netns, p: &str) -> Inspection {
    netns::check_pod(&ns.path(), &profile(p), &BTreeMap::new())
        .unwrap_or_else(|e| panic!("inspect {}: {e}", ns.name()))
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
    assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
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

/// The built-in profile, configured dual-stack (Linkerd `disableIPv6: false`, Istio
/// `ISTIO_DUAL_STACK`): IPv6 rules are then required for dual-stack pods.
fn dual_stack(name: &str) -> MeshProfile {
    let mut p = profile(name);
    p.dual_stack = true;
    p
}

#[test]
fn linkerd_iptables_nft_dual_stack() {
    let ns = Netns::new("lnft");
    ns.addr("10.244.1.5/24");
    ns.addr("fd00:10:244:1::5/64");
    ns.sh(&linkerd_rules("iptables-nft", 4143));
    // IPv4 rules only, on a dual-stack pod: what Linkerd writes on its default
    // (`disableIPv6`), so redirected. Missing for IPv6 only when the mesh is dual-stack.
    let default = inspect(&ns, "linkerd");
    assert_eq!(
        default.verdict,
        RedirectVerdict::Redirected,
        "{}",
        default.message
    );
    let half =
        netns::check_pod(&ns.path(), &dual_stack("linkerd"), &BTreeMap::new()).expect("inspect");
    assert_eq!(half.verdict, RedirectVerdict::Missing, "{}", half.message);
    assert!(half.message.contains("IPv6"), "{}", half.message);
    ns.sh(&linkerd_rules("ip6tables-nft", 4143));
    assert_linkerd_redirected_in_both_families(&ns, "iptables-nft");
    let both =
        netns::check_pod(&ns.path(), &dual_stack("linkerd"), &BTreeMap::new()).expect("inspect");
    assert_eq!(
        both.verdict,
        RedirectVerdict::Redirected,
        "{}",
        both.message
    );
    // Istio's ports are elsewhere.
    assert_eq!(inspect(&ns, "istio").verdict, RedirectVerdict::Missing);
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
        assert_eq!(
            got.verdict,
            RedirectVerdict::Redirected,
            "{ipt}: {}",
            got.message
        );
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
        assert_eq!(linkerd.verdict, RedirectVerdict::Missing);
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
        assert_eq!(
            got.verdict,
            RedirectVerdict::Redirected,
            "{p}: {}",
            got.message
        );
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
    assert_eq!(got.verdict, RedirectVerdict::Missing);
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
    assert_eq!(got.verdict, RedirectVerdict::Missing);
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
    assert_eq!(got.verdict, RedirectVerdict::Missing);
    ns.nft(ISTIO_NFT);
    ns.sh("nft add table inet istio-proxy-nat '{ flags dormant; }'");
    assert_eq!(inspect(&ns, "istio").verdict, RedirectVerdict::Missing);
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
    assert_eq!(inspect(&ns, "istio").verdict, RedirectVerdict::Redirected);
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

/// A process of the pod's namespace (root, so `CAP_NET_ADMIN` there) cannot slip a forged
/// answer (here an early end of dump) into the agent's netlink sockets: they are connected to
/// the kernel, which refuses datagrams from any other socket.
#[test]
fn forged_netlink_answers_from_the_pod_are_refused() {
    use meshgate_agent::netlink::{Bus, Socket};
    use netlink_sys::{Socket as RawSocket, SocketAddr, protocols};
    let ns = Netns::new("forge");
    let (victims, forgers) = netns::with_netns(&ns.path(), || {
        let victims = [Bus::Route, Bus::Netfilter].map(|b| Socket::open(b).expect("open"));
        let forgers = [protocols::NETLINK_ROUTE, protocols::NETLINK_NETFILTER].map(|p| {
            let mut s = RawSocket::new(p).expect("forger socket");
            s.bind_auto().expect("bind");
            s
        });
        (victims, forgers)
    })
    .expect("enter");
    let mut done = [0u8; 20];
    done[0..4].copy_from_slice(&20u32.to_ne_bytes());
    done[4..6].copy_from_slice(&(libc::NLMSG_DONE as u16).to_ne_bytes());
    for (victim, forger) in victims.iter().zip(&forgers) {
        let to = SocketAddr::new(victim.portid(), 0);
        let e = forger
            .send_to(&done, &to, 0)
            .expect_err("a forged datagram was accepted");
        assert_eq!(e.raw_os_error(), Some(libc::ECONNREFUSED), "{e}");
    }
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
        let got = meshgate_core::rules::check_pod(&rs, &profile("istio"), &[], &BTreeMap::new());
        assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
        reads += 1;
    }
    writer.join().expect("writer");
    assert!(reads > 0);
}

fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn inspect_pod(ns: &Netns, p: &MeshProfile, ann: &[(&str, &str)]) -> Inspection {
    netns::check_pod(&ns.path(), p, &annotations(ann))
        .unwrap_or_else(|e| panic!("inspect {}: {e}", ns.name()))
}

/// istio-iptables in `TPROXY` mode, IPv4: its golden `tproxy.golden` (tools/istio-iptables/
/// pkg/capture/testdata; config: interceptionMode TPROXY, includeInboundPorts "*",
/// outbound include 9.9.0.0/16 exclude 1.1.0.0/16, DNS capture, exclude nic), in
/// `iptables-save` form. Inbound is intercepted in mangle only: nat PREROUTING has no jump.
const ISTIO_TPROXY_V4: &str = "*mangle
-N ISTIO_DIVERT
-N ISTIO_TPROXY
-N ISTIO_INBOUND
-A PREROUTING -i not-istio-nic -j RETURN
-A OUTPUT -o not-istio-nic -j RETURN
-A ISTIO_DIVERT -j MARK --set-mark 1337
-A ISTIO_DIVERT -j ACCEPT
-A ISTIO_TPROXY ! -d 127.0.0.1/32 -p tcp -j TPROXY --tproxy-mark 1337/0xffffffff --on-port 15006
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT
-A ISTIO_INBOUND -p tcp -j ISTIO_TPROXY
-A PREROUTING -p tcp -m mark --mark 1337 -j CONNMARK --save-mark
-A OUTPUT -p tcp -o lo -m mark --mark 1337 -j RETURN
-A OUTPUT ! -d 127.0.0.1/32 -p tcp -o lo -m owner --uid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT ! -d 127.0.0.1/32 -p tcp -o lo -m owner --gid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT -p tcp -m connmark --mark 1337 -j CONNMARK --restore-mark
-I ISTIO_INBOUND 1 -p tcp -m mark --mark 1337 -j RETURN
-I ISTIO_INBOUND 2 -p tcp -s 127.0.0.6/32 -i lo -j RETURN
-I ISTIO_INBOUND 3 -p tcp -i lo -m mark ! --mark 1338 -j RETURN
COMMIT
*nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
-N ISTIO_OUTPUT_DNS
-A PREROUTING -i not-istio-nic -j RETURN
-A OUTPUT -o not-istio-nic -j RETURN
-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp -m multiport ! --dports 53,15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_OUTPUT_DNS
-A ISTIO_OUTPUT_DNS -p tcp --dport 53 -d 127.0.0.53/32 -j REDIRECT --to-ports 15053
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d 127.0.0.53/32 -j REDIRECT --to-port 15053
-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN
-A ISTIO_OUTPUT -d 1.1.0.0/16 -j RETURN
-A ISTIO_OUTPUT -d 9.9.0.0/16 -j ISTIO_REDIRECT
COMMIT
*raw
-N ISTIO_OUTPUT_DNS
-N ISTIO_INBOUND
-A OUTPUT -j ISTIO_OUTPUT_DNS
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --uid-owner 1337 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp --sport 15053 -m owner --uid-owner 1337 -j CT --zone 2
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --gid-owner 1337 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp --sport 15053 -m owner --gid-owner 1337 -j CT --zone 2
-A PREROUTING -j ISTIO_INBOUND
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d 127.0.0.53/32 -j CT --zone 2
-A ISTIO_INBOUND -p udp --sport 53 -s 127.0.0.53/32 -j CT --zone 1
COMMIT";

/// The same golden's IPv6 half (written because that golden sets `EnableIPv6`).
const ISTIO_TPROXY_V6: &str = "*mangle
-N ISTIO_DIVERT
-N ISTIO_TPROXY
-N ISTIO_INBOUND
-A PREROUTING -i not-istio-nic -j RETURN
-A OUTPUT -o not-istio-nic -j RETURN
-A ISTIO_DIVERT -j MARK --set-mark 1337
-A ISTIO_DIVERT -j ACCEPT
-A ISTIO_TPROXY ! -d ::1/128 -p tcp -j TPROXY --tproxy-mark 1337/0xffffffff --on-port 15006
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT
-A ISTIO_INBOUND -p tcp -j ISTIO_TPROXY
-A PREROUTING -p tcp -m mark --mark 1337 -j CONNMARK --save-mark
-A OUTPUT -p tcp -o lo -m mark --mark 1337 -j RETURN
-A OUTPUT ! -d ::1/128 -p tcp -o lo -m owner --uid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT -p tcp -m connmark --mark 1337 -j CONNMARK --restore-mark
-I ISTIO_INBOUND 1 -p tcp -m mark --mark 1337 -j RETURN
-I ISTIO_INBOUND 2 -p tcp -s ::6/128 -i lo -j RETURN
-I ISTIO_INBOUND 3 -p tcp -i lo -m mark ! --mark 1338 -j RETURN
COMMIT
*nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
-A PREROUTING -i not-istio-nic -j RETURN
-A OUTPUT -o not-istio-nic -j RETURN
-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -o lo -s ::6/128 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -d ::1/128 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_REDIRECT
COMMIT";

#[test]
fn istio_tproxy_mode_is_redirected_with_both_backends() {
    for (backend, v4, v6) in [
        (
            "iptables-nft",
            "iptables-nft-restore",
            "ip6tables-nft-restore",
        ),
        (
            "iptables-legacy",
            "iptables-legacy-restore",
            "ip6tables-legacy-restore",
        ),
    ] {
        let ns = Netns::new("tproxy");
        ns.addr("10.244.10.17/24");
        ns.addr("fd00:10:244:10::17/64");
        ns.restore(v4, ISTIO_TPROXY_V4);
        ns.restore(v6, ISTIO_TPROXY_V6);
        // The policy routing istio-iptables adds in TPROXY mode (not required by meshgate:
        // inbound traffic is for the pod's own, local address).
        ns.sh("ip -4 rule add fwmark 1337 lookup 133
               ip -4 route add local default dev lo table 133
               ip -6 rule add fwmark 1337 lookup 133
               ip -6 route add local default dev lo table 133");
        let got =
            netns::check_pod(&ns.path(), &dual_stack("istio"), &BTreeMap::new()).expect("inspect");
        assert_eq!(
            got.verdict,
            RedirectVerdict::Redirected,
            "{backend}: {}",
            got.message
        );
        assert_eq!(
            got.inbound.via,
            Some(format!(
                "ip mangle PREROUTING -> ISTIO_INBOUND -> ISTIO_TPROXY ({backend}); \
                 ip6 mangle PREROUTING -> ISTIO_INBOUND -> ISTIO_TPROXY ({backend})"
            ))
        );
        assert_eq!(
            got.outbound.via,
            Some(format!(
                "ip nat OUTPUT -> ISTIO_OUTPUT -> ISTIO_REDIRECT ({backend}); \
                 ip6 nat OUTPUT -> ISTIO_OUTPUT -> ISTIO_REDIRECT ({backend})"
            ))
        );
        // Control: without the TPROXY rule nothing intercepts inbound traffic.
        let ipt = if backend == "iptables-nft" {
            "iptables-nft"
        } else {
            "iptables-legacy"
        };
        ns.sh(&format!("{ipt} -w -t mangle -F ISTIO_TPROXY"));
        let got = inspect(&ns, "istio");
        assert_eq!(
            got.verdict,
            RedirectVerdict::Missing,
            "{backend}: {}",
            got.message
        );
        assert!(!got.inbound.found && got.outbound.found);
    }
}

#[test]
fn native_nft_tproxy_is_redirected() {
    let ns = Netns::new("nfttp");
    ns.addr("10.244.11.18/24");
    ns.nft(
        "table inet istio-proxy-mangle {
            chain prerouting {
                type filter hook prerouting priority mangle; policy accept;
                meta l4proto tcp jump istio-inbound
            }
            chain istio-inbound {
                tcp dport 15008 return
                meta l4proto tcp jump istio-tproxy
            }
            chain istio-tproxy {
                meta l4proto tcp tproxy ip to :15006 meta mark set 0x539 accept
                meta l4proto tcp tproxy ip6 to :15006 meta mark set 0x539 accept
            }
        }
        table inet istio-proxy-nat {
            chain output {
                type nat hook output priority -100; policy accept;
                meta skuid 1337 return
                meta l4proto tcp redirect to :15001
            }
        }",
    );
    let got = inspect(&ns, "istio");
    assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
    assert_eq!(
        got.inbound.via.as_deref(),
        Some("inet istio-proxy-mangle prerouting -> istio-inbound -> istio-tproxy (nftables)")
    );
    // `tproxy ip` and `tproxy ip6` each intercept their own family only.
    ns.addr("fd00:10:244:11::18/64");
    let dual =
        netns::check_pod(&ns.path(), &dual_stack("istio"), &BTreeMap::new()).expect("inspect");
    assert_eq!(
        dual.verdict,
        RedirectVerdict::Redirected,
        "{}",
        dual.message
    );
    ns.sh("nft flush chain inet istio-proxy-mangle istio-tproxy
           nft add rule inet istio-proxy-mangle istio-tproxy meta l4proto tcp tproxy ip to :15006 meta mark set 0x539 accept");
    let dual =
        netns::check_pod(&ns.path(), &dual_stack("istio"), &BTreeMap::new()).expect("inspect");
    assert_eq!(dual.verdict, RedirectVerdict::Missing, "{}", dual.message);
    assert_eq!(dual.inbound.missing_families, [IpFamily::V6]);
}

#[test]
fn dual_stack_pods_on_the_meshes_defaults_need_ipv4_rules_only() {
    // Istio without ISTIO_DUAL_STACK writes iptables only (golden `inbound-ports-wildcard`
    // has no ip6tables half); Linkerd with disableIPv6 likewise.
    let ns = Netns::new("dsist");
    ns.addr("10.244.12.19/24");
    ns.addr("fd00:10:244:12::19/64");
    ns.sh(&istio_rules("iptables-nft"));
    let got = inspect(&ns, "istio");
    assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
    // Configured dual-stack, the absent ip6tables rules are missing.
    let dual =
        netns::check_pod(&ns.path(), &dual_stack("istio"), &BTreeMap::new()).expect("inspect");
    assert_eq!(dual.verdict, RedirectVerdict::Missing, "{}", dual.message);
    assert!(dual.message.contains("IPv6"), "{}", dual.message);

    let ns = Netns::new("dslnk");
    ns.addr("10.244.12.20/24");
    ns.addr("fd00:10:244:12::20/64");
    ns.sh(&linkerd_rules("iptables-legacy", 4143));
    assert_eq!(inspect(&ns, "linkerd").verdict, RedirectVerdict::Redirected);
    // An IPv6-only pod still needs IPv6 rules.
    let v6 = Netns::new("v6only");
    v6.addr("fd00:10:244:12::21/64");
    v6.sh(&linkerd_rules("iptables-nft", 4143));
    assert_eq!(inspect(&v6, "linkerd").verdict, RedirectVerdict::Missing);
}

/// istio-iptables with an empty config (golden `empty.golden`: includeInboundPorts "" and
/// includeOutboundIPRanges ""), IPv4, as its dry-run prints it.
const ISTIO_EMPTY: &str = "
iptables -t nat -N ISTIO_INBOUND
iptables -t nat -N ISTIO_REDIRECT
iptables -t nat -N ISTIO_IN_REDIRECT
iptables -t nat -N ISTIO_OUTPUT
iptables -t nat -A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN
iptables -t nat -A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
iptables -t nat -A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
iptables -t nat -A OUTPUT -p tcp -j ISTIO_OUTPUT
iptables -t nat -A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN
iptables -t nat -A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
iptables -t nat -A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 1337 -j RETURN
iptables -t nat -A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
iptables -t nat -A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
iptables -t nat -A ISTIO_OUTPUT -o lo -m owner ! --gid-owner 1337 -j RETURN
iptables -t nat -A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
iptables -t nat -A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN";

/// Golden `ipv6-outbound-ports` (includeInboundPorts "", includeOutboundPorts
/// "32000,31000"), IPv4 half: the empty layout plus two per-port outbound redirects.
const ISTIO_OUTBOUND_PORTS_EXTRA: &str = "
iptables -t nat -A ISTIO_OUTPUT -p tcp --dport 32000 -j ISTIO_REDIRECT
iptables -t nat -A ISTIO_OUTPUT -p tcp --dport 31000 -j ISTIO_REDIRECT";

/// Golden `inbound-ports-wildcard` (includeInboundPorts "*", includeOutboundIPRanges "").
const ISTIO_INBOUND_WILDCARD: &str = "*nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN
COMMIT";

const IN_PORTS: &str = "traffic.sidecar.istio.io/includeInboundPorts";
const OUT_RANGES: &str = "traffic.sidecar.istio.io/includeOutboundIPRanges";
const OUT_PORTS: &str = "traffic.sidecar.istio.io/includeOutboundPorts";

#[test]
fn istio_opt_out_pods_match_what_istio_writes_for_their_annotations() {
    let istio = profile("istio");
    for ipt in ["iptables-nft", "iptables-legacy"] {
        // Both directions opted out.
        let ns = Netns::new("optall");
        ns.addr("10.244.13.22/24");
        ns.sh(&ISTIO_EMPTY.replace("iptables ", &format!("{ipt} -w ")));
        assert_eq!(inspect(&ns, "istio").verdict, RedirectVerdict::Missing);
        let got = inspect_pod(&ns, &istio, &[(IN_PORTS, ""), (OUT_RANGES, "")]);
        assert_eq!(
            got.verdict,
            RedirectVerdict::Redirected,
            "{ipt}: {}",
            got.message
        );
        assert!(!got.inbound.expected && !got.outbound.expected);
        // Only inbound opted out: outbound must still be there, and is not.
        let got = inspect_pod(&ns, &istio, &[(IN_PORTS, "")]);
        assert_eq!(
            got.verdict,
            RedirectVerdict::Missing,
            "{ipt}: {}",
            got.message
        );
        assert!(!got.outbound.found);

        // Inbound opted out, outbound limited to two ports.
        ns.sh(&ISTIO_OUTBOUND_PORTS_EXTRA.replace("iptables ", &format!("{ipt} -w ")));
        let got = inspect_pod(
            &ns,
            &istio,
            &[(IN_PORTS, ""), (OUT_RANGES, ""), (OUT_PORTS, "32000,31000")],
        );
        assert_eq!(
            got.verdict,
            RedirectVerdict::Redirected,
            "{ipt}: {}",
            got.message
        );
        assert_eq!(
            got.outbound.via,
            Some(format!(
                "ip nat OUTPUT -> ISTIO_OUTPUT -> ISTIO_REDIRECT ({ipt})"
            ))
        );
    }

    // Outbound opted out (includeOutboundIPRanges ""), inbound for every port.
    let ns = Netns::new("optout");
    ns.addr("10.244.13.23/24");
    ns.restore("iptables-nft-restore", ISTIO_INBOUND_WILDCARD);
    assert_eq!(inspect(&ns, "istio").verdict, RedirectVerdict::Missing);
    let got = inspect_pod(&ns, &istio, &[(OUT_RANGES, "")]);
    assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
    assert!(got.inbound.found && !got.outbound.expected);
}

#[test]
fn linkerd_opt_out_pods_match_what_proxy_init_writes() {
    // proxy-init with --subnets-to-ignore 0.0.0.0/0 (config.linkerd.io/skip-subnets): an
    // unconditional RETURN ahead of the inbound redirect.
    let ns = Netns::new("lskip");
    ns.addr("10.244.14.24/24");
    ns.sh(&linkerd_rules("iptables-nft", 4143).replace(
        "-A PROXY_INIT_REDIRECT -p tcp -j REDIRECT",
        "-A PROXY_INIT_REDIRECT -p all -j RETURN -s 0.0.0.0/0 -m comment --comment proxy-init/ignore-subnet-0.0.0.0/0\n\
         iptables-nft -w -t nat -A PROXY_INIT_REDIRECT -p tcp -j REDIRECT",
    ));
    let linkerd = profile("linkerd");
    let bare = inspect(&ns, "linkerd");
    assert_eq!(bare.verdict, RedirectVerdict::Missing, "{}", bare.message);
    assert!(!bare.inbound.found && bare.outbound.found);
    let got = inspect_pod(
        &ns,
        &linkerd,
        &[("config.linkerd.io/skip-subnets", "0.0.0.0/0")],
    );
    assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);

    // skip-inbound-ports covering every port: proxy-init still writes the redirect behind a
    // multiport RETURN, which the matcher reads as conditional.
    let ns = Netns::new("lports");
    ns.addr("10.244.14.25/24");
    ns.sh(&linkerd_rules("iptables-legacy", 4143).replace("4190,4191,4567,4568", "1:65535"));
    assert_eq!(inspect(&ns, "linkerd").verdict, RedirectVerdict::Redirected);
    let got = inspect_pod(
        &ns,
        &linkerd,
        &[("config.linkerd.io/skip-inbound-ports", "1-65535")],
    );
    assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
    assert!(!got.inbound.expected);
}

#[test]
fn inspect_binary_takes_the_pods_annotations() {
    let ns = Netns::new("binann");
    ns.addr("10.244.15.26/24");
    ns.restore("iptables-nft-restore", ISTIO_INBOUND_WILDCARD);
    let path = ns.path();
    let path = path.to_str().expect("utf-8 path");
    let (code, out, err) = binary(&["inspect", "--netns", path, "--profile", "istio"]);
    assert_eq!(code, 1, "stdout: {out}\nstderr: {err}");
    let (code, out, err) = binary(&[
        "inspect",
        "--netns",
        path,
        "--profile",
        "istio",
        "--annotation",
        &format!("{OUT_RANGES}="),
        "--output",
        "json",
    ]);
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
    assert_eq!(v["verdict"], "redirected");
    assert_eq!(v["outbound"]["expected"], false);
    assert!(v["inbound"].get("expected").is_none());
    let (code, out, err) = binary(&[
        "inspect",
        "--netns",
        path,
        "--profile",
        "istio",
        "--pod-annotations-json",
        &format!("{{\"{OUT_RANGES}\":\"\",\"app\":\"web\"}}"),
    ]);
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    assert!(out.contains("not expected"), "{out}");
    let (code, _, err) = binary(&[
        "inspect",
        "--netns",
        path,
        "--profile",
        "istio",
        "--annotation",
        "no-equals-sign",
    ]);
    assert_eq!(code, 2, "{err}");
}

#[test]
fn termination_across_base_chains_follows_the_kernel() {
    let ns = Netns::new("order");
    ns.addr("10.244.16.27/24");
    ns.sh(&linkerd_rules("iptables-nft", 4143));
    assert_eq!(inspect(&ns, "linkerd").verdict, RedirectVerdict::Redirected);

    // A filter chain ahead of nat PREROUTING that accepts every TCP packet: the next base
    // chain still runs.
    ns.nft(
        "table inet fw {
            chain pre { type filter hook prerouting priority -200; policy accept; meta l4proto tcp accept; }
        }",
    );
    assert_eq!(inspect(&ns, "linkerd").verdict, RedirectVerdict::Redirected);
    // One that drops every TCP packet: nothing after it runs.
    ns.sh("nft flush chain inet fw pre; nft add rule inet fw pre meta l4proto tcp drop");
    let got = inspect(&ns, "linkerd");
    assert_eq!(got.verdict, RedirectVerdict::Missing, "{}", got.message);
    assert!(
        got.message.contains("dropped in inet fw pre"),
        "{}",
        got.message
    );
    // A base chain with `policy drop` and nothing else drops every packet too; one that
    // accepts a port first lets that port through, so it hides nothing.
    ns.sh("nft delete table inet fw");
    ns.nft(
        "table inet fw {
            chain pre { type filter hook prerouting priority -200; policy drop; }
        }",
    );
    assert_eq!(inspect(&ns, "linkerd").verdict, RedirectVerdict::Missing);
    ns.sh("nft add rule inet fw pre tcp dport 8080 accept");
    assert_eq!(inspect(&ns, "linkerd").verdict, RedirectVerdict::Redirected);
    ns.sh("nft delete table inet fw");

    // A native nat chain at -150 that DNATs every TCP connection binds it first: iptables'
    // nat PREROUTING redirect (-100) is never reached.
    ns.nft(
        "table ip kube {
            chain pre { type nat hook prerouting priority -150; policy accept; meta l4proto tcp dnat to 10.96.0.10; }
        }",
    );
    let got = inspect(&ns, "linkerd");
    assert_eq!(got.verdict, RedirectVerdict::Missing, "{}", got.message);
    assert!(
        got.message.contains("NAT binding in ip kube pre"),
        "{}",
        got.message
    );
    assert!(got.outbound.found);
    // Limited to one port, it binds only those connections.
    ns.sh("nft flush chain ip kube pre; nft add rule ip kube pre tcp dport 53 dnat to 10.96.0.10");
    assert_eq!(inspect(&ns, "linkerd").verdict, RedirectVerdict::Redirected);
}

#[test]
fn oversized_rule_dumps_are_unknown_never_missing() {
    // 5000 empty chains: past the chain cap (4096).
    let ns = Netns::new("bigchains");
    ns.addr("10.244.17.28/24");
    let mut script = String::from("table ip big {\n");
    for i in 0..5000 {
        script.push_str(&format!("chain c{i} {{ }}\n"));
    }
    script.push('}');
    let file = std::env::temp_dir().join(format!("{}.nft", ns.name()));
    std::fs::write(&file, &script).expect("write nft file");
    ns.sh(&format!("nft -f {}", file.display()));
    let _ = std::fs::remove_file(&file);
    let got = inspect(&ns, "linkerd");
    assert_eq!(got.verdict, RedirectVerdict::Unknown, "{}", got.message);
    let path = ns.path();
    let (code, out, err) = binary(&[
        "inspect",
        "--netns",
        path.to_str().expect("utf-8"),
        "--profile",
        "linkerd",
        "--output",
        "json",
    ]);
    assert_eq!(code, 2, "stdout: {out}\nstderr: {err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
    assert_eq!(v["verdict"], "unknown");
    assert!(
        v["message"]
            .as_str()
            .is_some_and(|m| m.contains("too large")),
        "{v}"
    );

    // 17000 legacy rules: past the rule cap (16384), also through the legacy reader.
    let ns = Netns::new("bigrules");
    ns.addr("10.244.17.29/24");
    let mut script = String::from("*filter\n-N FILL\n");
    for i in 0..17_000u32 {
        script.push_str(&format!(
            "-A FILL -s 10.{}.{}.0/24 -j RETURN\n",
            i / 256,
            i % 256
        ));
    }
    script.push_str("COMMIT");
    ns.restore("iptables-legacy-restore", &script);
    ns.sh(&linkerd_rules("iptables-legacy", 4143));
    let got = inspect(&ns, "linkerd");
    assert_eq!(got.verdict, RedirectVerdict::Unknown, "{}", got.message);
}

/// Listeners inside a namespace that answer every connection with their name, until dropped.
struct Answerers {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Answerers {
    fn start(ns: &Netns, ports: &[(u16, &'static str)]) -> Self {
        use std::io::Write as _;
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut threads = Vec::new();
        for &(port, name) in ports {
            // A socket belongs to the namespace it was created in, whichever thread uses it.
            let listener = netns::with_netns(&ns.path(), || {
                std::net::TcpListener::bind(("0.0.0.0", port))
            })
            .expect("enter")
            .expect("bind");
            listener.set_nonblocking(true).expect("nonblocking");
            let stop = stop.clone();
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((mut c, _)) => {
                            let _ = c.write_all(name.as_bytes());
                        }
                        Err(_) => std::thread::sleep(std::time::Duration::from_millis(5)),
                    }
                }
            }));
        }
        Self { stop, threads }
    }
}

impl Drop for Answerers {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Connects from inside the namespace to a remote address and returns who answered, or
/// `None` when nobody did (dropped, or sent out unNATed to an address nobody holds).
fn who_answers(ns: &Netns, to: &str) -> Option<String> {
    use std::io::Read as _;
    let to: std::net::SocketAddr = to.parse().expect("address");
    netns::with_netns(&ns.path(), || {
        let mut c =
            std::net::TcpStream::connect_timeout(&to, std::time::Duration::from_millis(700))
                .ok()?;
        c.set_read_timeout(Some(std::time::Duration::from_millis(700)))
            .ok()?;
        let mut s = String::new();
        c.read_to_string(&mut s).ok()?;
        Some(s)
    })
    .expect("enter")
}

/// The kernel decides: a real outbound connection from inside the namespace, under Linkerd's
/// iptables-nft rules plus one competing chain, reaches the proxy port exactly when the
/// matcher says the outbound redirect is reachable. This pins the order semantics (the first
/// NAT binding wins, nat chains run at the nf_nat hook priority whatever their own, accept in
/// one base chain does not stop the next, drop does) to what the kernel does.
#[test]
fn the_matcher_agrees_with_the_kernel_on_real_connections() {
    let ns = Netns::new("kernel");
    ns.addr("10.244.18.30/24");
    ns.sh("ip addr add 10.250.0.1/32 dev lo");
    ns.sh(&linkerd_rules("iptables-nft", 4143));
    let _answer = Answerers::start(&ns, &[(4140, "proxy"), (9000, "other")]);
    let dest = "10.244.18.99:80";
    let cases: &[(&str, &str, bool)] = &[
        ("proxy-init alone", "", true),
        (
            "nat chain at -150 DNATs every TCP connection first",
            "table ip compete {
                chain c { type nat hook output priority -150; policy accept; meta l4proto tcp dnat to 10.250.0.1:9000; }
            }",
            false,
        ),
        (
            "the same DNAT at -50 comes after proxy-init's binding",
            "table ip compete {
                chain c { type nat hook output priority -50; policy accept; meta l4proto tcp dnat to 10.250.0.1:9000; }
            }",
            true,
        ),
        (
            "a redirect elsewhere at -150 binds first too",
            "table ip compete {
                chain c { type nat hook output priority -150; policy accept; meta l4proto tcp redirect to :9000; }
            }",
            false,
        ),
        (
            "accept in a nat chain sets no binding: the next nat chain runs",
            "table ip compete {
                chain c { type nat hook output priority -150; policy accept; meta l4proto tcp accept; }
            }",
            true,
        ),
        (
            "accept in a filter chain ahead: the next base chain runs",
            "table ip compete {
                chain c { type filter hook output priority -200; policy accept; meta l4proto tcp accept; }
            }",
            true,
        ),
        (
            "drop in a filter chain ahead: nothing after runs",
            "table ip compete {
                chain c { type filter hook output priority -150; policy accept; meta l4proto tcp drop; }
            }",
            false,
        ),
        (
            "a nat chain declared at priority 10 still runs inside the nat hook, after -100",
            "table ip compete {
                chain c { type nat hook output priority 10; policy accept; meta l4proto tcp redirect to :9000; }
            }",
            true,
        ),
    ];
    for (what, script, reaches_proxy) in cases {
        if !script.is_empty() {
            ns.nft(script);
        }
        let kernel = who_answers(&ns, dest);
        assert_eq!(
            kernel.as_deref() == Some("proxy"),
            *reaches_proxy,
            "{what}: the kernel sent the connection to {kernel:?}"
        );
        let got = inspect(&ns, "linkerd");
        assert_eq!(
            got.outbound.found, *reaches_proxy,
            "{what}: matcher disagrees with the kernel: {}",
            got.message
        );
        if !script.is_empty() {
            ns.sh("nft delete table ip compete");
        }
    }
}

/// A listener on `0.0.0.0:port` with `IP_TRANSPARENT`, as Envoy's 15006 listener in TPROXY
/// mode: TPROXY only hands connections to transparent sockets.
fn transparent_listener(ns: &Netns, port: u16) -> std::net::TcpListener {
    use std::os::fd::FromRawFd as _;
    netns::with_netns(&ns.path(), || {
        // SAFETY: plain socket(2)/setsockopt(2)/bind(2)/listen(2) on a fresh descriptor that
        // the TcpListener owns from here on; every pointer outlives its call.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0, "socket");
            let listener = std::net::TcpListener::from_raw_fd(fd);
            let one: libc::c_int = 1;
            for (level, opt) in [
                (libc::SOL_SOCKET, libc::SO_REUSEADDR),
                (libc::SOL_IP, libc::IP_TRANSPARENT),
            ] {
                let rc = libc::setsockopt(
                    fd,
                    level,
                    opt,
                    (&one as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
                assert_eq!(rc, 0, "setsockopt {opt}");
            }
            let addr = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: port.to_be(),
                sin_addr: libc::in_addr { s_addr: 0 },
                sin_zero: [0; 8],
            };
            let rc = libc::bind(
                fd,
                (&addr as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            );
            assert_eq!(rc, 0, "bind");
            assert_eq!(libc::listen(fd, 16), 0, "listen");
            listener
        }
    })
    .expect("enter")
}

/// Why meshgate does not require istio-iptables' fwmark `ip rule`: a client in another
/// namespace connects to the pod's own IP under Istio's TPROXY rules, and the kernel hands the
/// connection to the transparent 15006 listener with and without the policy routing (the
/// `local` table already delivers the pod's address locally). The verdict is `redirected` in
/// both cases, and `missing` once the TPROXY rule is gone (then nothing answers).
#[test]
fn tproxy_delivers_without_the_fwmark_rule_and_the_verdict_follows() {
    use std::io::Read as _;
    let pod = Netns::new("tppod");
    let client = Netns::new("tpcli");
    let (a, b) = (
        format!("tpa{}", std::process::id() % 100_000),
        format!("tpb{}", std::process::id() % 100_000),
    );
    let out = Command::new("ip")
        .args([
            "link",
            "add",
            &a,
            "netns",
            pod.name(),
            "type",
            "veth",
            "peer",
            "name",
            &b,
            "netns",
            client.name(),
        ])
        .output()
        .expect("ip link add");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    pod.sh(&format!(
        "ip link set {a} up; ip addr add 10.252.0.2/24 dev {a}"
    ));
    client.sh(&format!(
        "ip link set {b} up; ip addr add 10.252.0.1/24 dev {b}"
    ));
    pod.restore("iptables-nft-restore", ISTIO_TPROXY_V4);
    let listener = transparent_listener(&pod, 15006);
    listener.set_nonblocking(true).expect("nonblocking");

    let connect = || -> Option<String> {
        let connected = netns::with_netns(&client.path(), || {
            std::net::TcpStream::connect_timeout(
                &"10.252.0.2:8080".parse().expect("addr"),
                std::time::Duration::from_millis(700),
            )
        })
        .expect("enter");
        let mut c = connected.ok()?;
        // Accept on this thread: the connection is queued on the transparent listener.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        let (mut s, _) = loop {
            match listener.accept() {
                Ok(x) => break x,
                Err(_) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(5))
                }
                Err(_) => return None,
            }
        };
        // The proxy sees the original destination, as Envoy's inbound listener does.
        let local = s.local_addr().ok()?;
        std::io::Write::write_all(&mut s, b"proxy").ok()?;
        drop(s);
        let mut got = String::new();
        c.set_read_timeout(Some(std::time::Duration::from_millis(700)))
            .ok()?;
        c.read_to_string(&mut got).ok()?;
        Some(format!("{got} at {local}"))
    };

    assert_eq!(
        connect().as_deref(),
        Some("proxy at 10.252.0.2:8080"),
        "without the ip rule"
    );
    assert_eq!(inspect(&pod, "istio").verdict, RedirectVerdict::Redirected);
    pod.sh("ip rule add fwmark 1337 lookup 133; ip route add local default dev lo table 133");
    assert_eq!(
        connect().as_deref(),
        Some("proxy at 10.252.0.2:8080"),
        "with the ip rule"
    );
    assert_eq!(inspect(&pod, "istio").verdict, RedirectVerdict::Redirected);
    pod.sh("iptables-nft -w -t mangle -F ISTIO_TPROXY");
    assert_eq!(
        connect(),
        None,
        "nothing intercepts without the TPROXY rule"
    );
    assert_eq!(inspect(&pod, "istio").verdict, RedirectVerdict::Missing);
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

    use meshgate_agent::daemon::pods::sweep::{Job, inspect_one};
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
        netns_sim::require_tools(TOOLS).unwrap_or_else(|e| panic!("{e:#}"));
        let ip = pod_ip();
        let name = format!("mg-optout-{}", std::process::id());
        let _guard = Named(name.clone());
        add_named(&name, ip);
        let rules = std::env::temp_dir().join(format!("{name}.rules"));
        std::fs::write(&rules, format!("{}\n", super::ISTIO_INBOUND_WILDCARD)).unwrap();
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
        assert_eq!(
            bare.inspections[0].verdict,
            RedirectVerdict::Missing,
            "{bare:?}"
        );
        let opted = inspect_one(&facts, &istio(&[(super::OUT_RANGES, "")]));
        assert_eq!(
            opted.inspections[0].verdict,
            RedirectVerdict::Redirected,
            "{opted:?}"
        );
        assert!(opted.pinned.is_none(), "nothing to act on");
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
        assert_eq!(
            got.inspections[0].verdict,
            RedirectVerdict::Missing,
            "{got:?}"
        );
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
        assert_eq!(
            stale.inspections[0].verdict,
            RedirectVerdict::Unknown,
            "{stale:?}"
        );
        assert!(
            stale.inspections[0]
                .message
                .contains("no longer the one surveyed"),
            "{stale:?}"
        );
        // A fresh survey reads the new namespace for what it is.
        let (fresh, _) = netns::survey(&dirs()).expect("survey");
        let now = inspect_one(&fresh, &job(ip));
        assert_eq!(
            now.inspections[0].verdict,
            RedirectVerdict::Redirected,
            "{now:?}"
        );
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
        assert_eq!(
            stale.inspections[0].verdict,
            RedirectVerdict::Unknown,
            "{stale:?}"
        );
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
        assert_eq!(
            got.inspections[0].verdict,
            RedirectVerdict::Missing,
            "{got:?}"
        );
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
                recycled = Some(c);
                break;
            }
        }
        let Some(_recycled) = recycled else {
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
        assert_eq!(
            stale.inspections[0].verdict,
            RedirectVerdict::Unknown,
            "{stale:?}"
        );
        true
    }
}

/// The pod-level half of a node proxy on real namespaces, through the daemon's path (survey
/// → `inspect_one`): an ambient pod whose rules are in place is `redirected` only once
/// ztunnel's listeners (15008, 15006, 15001) are bound inside its netns.
mod node_proxy_listeners {
    use std::collections::BTreeMap;
    use std::net::{IpAddr, Ipv4Addr, TcpListener};
    use std::path::PathBuf;

    use meshgate_agent::daemon::pods::sweep::{Job, ProxyCheck, inspect_one};
    use meshgate_agent::netns;
    use meshgate_core::node_proxy::ztunnel;
    use meshgate_core::rules::RedirectVerdict;
    use meshgate_e2e::sim::netns as netns_sim;

    use super::{ISTIO_NFT, Netns, profile};

    fn job(ip: IpAddr, ready: bool) -> Job {
        Job {
            uid: "00000000-0000-0000-0000-000000000000".into(),
            ips: vec![ip],
            annotations: BTreeMap::new(),
            profiles: vec![profile("istio-ambient")],
            node_proxy: Some(ProxyCheck {
                profile: "istio-ambient".into(),
                proxy: ztunnel(),
                ready,
                pods: Vec::new(),
            }),
        }
    }

    fn inspect(ip: IpAddr, ready: bool) -> (RedirectVerdict, String) {
        let dirs = vec![PathBuf::from(netns::DEFAULT_NETNS_DIR)];
        let (facts, _) = netns::survey(&dirs).expect("survey");
        let got = inspect_one(&facts, &job(ip, ready));
        let i = &got.inspections[0];
        // Held from eviction exactly when listeners are missing while ztunnel is not ready.
        let held = i.verdict == RedirectVerdict::Missing && !ready;
        assert_eq!(got.held.is_some(), held, "{got:?}");
        (i.verdict, i.message.clone())
    }

    #[test]
    fn ztunnels_listeners_in_the_pods_netns_make_an_ambient_pod_redirected() {
        let [a, b, c] = netns_sim::private_subnet();
        let ip = IpAddr::V4(Ipv4Addr::new(a, b, c, 9));
        let ns = Netns::new("ztl");
        ns.addr(&format!("{ip}/24"));
        ns.nft(ISTIO_NFT);

        // istio-cni's rules, but ztunnel has not taken the pod.
        let (v, why) = inspect(ip, true);
        assert_eq!(v, RedirectVerdict::Missing, "{why}");
        assert_eq!(
            why,
            "ztunnel has not taken this pod: no listener on 15008, 15006, 15001 in its netns"
        );
        // ...while ztunnel is not ready on the node: reported missing, held from eviction.
        let (v, why) = inspect(ip, false);
        assert_eq!(v, RedirectVerdict::Missing, "{why}");
        assert!(
            why.ends_with("not evicted while ztunnel is not ready on this node"),
            "{why}"
        );

        // ztunnel opens its listeners inside the pod's netns (one of them IPv6-only: both
        // families are read). The sockets stay in the namespace after the thread returns.
        let bind = |addr: &str| TcpListener::bind(addr).expect("bind in the pod's netns");
        let some = netns::with_netns(&ns.path(), || bind("0.0.0.0:15006")).expect("enter");
        let (v, why) = inspect(ip, true);
        assert_eq!(v, RedirectVerdict::Missing, "{why}");
        assert!(why.contains("no listener on 15008, 15001 in"), "{why}");

        let rest = netns::with_netns(&ns.path(), || (bind("0.0.0.0:15008"), bind("[::]:15001")))
            .expect("enter");
        let (v, why) = inspect(ip, true);
        assert_eq!(v, RedirectVerdict::Redirected, "{why}");
        drop((some, rest));
        let (v, why) = inspect(ip, true);
        assert_eq!(v, RedirectVerdict::Missing, "listeners closed: {why}");
    }
}

/// Where a node proxy's connection shows: the kernel creates the listener's accepted end in
/// the network namespace of the socket that connected. A listener in the agent's namespace
/// (istio-cni's node agent, host network) and a client connecting from a pod's namespace
/// (ztunnel): the agent's own dump sees no connection, the pod namespace's dump does.
mod node_proxy_connection {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::fs::MetadataExt;
    use std::time::{Duration, Instant};

    use meshgate_agent::netns;
    use meshgate_agent::sock_diag::unix::{Bound, connections};
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockType, UnixAddr, accept4, bind, connect, listen,
        socket,
    };

    use super::Netns;

    fn seqpacket() -> OwnedFd {
        socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap()
    }

    #[test]
    fn a_proxy_in_its_own_pod_network_holds_both_ends_of_its_connection() {
        let ns = Netns::new("ztc");
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("ztunnel.sock");
        let listener = seqpacket();
        bind(listener.as_raw_fd(), &UnixAddr::new(&path).unwrap()).unwrap();
        listen(&listener, Backlog::new(8).unwrap()).unwrap();
        let m = std::fs::symlink_metadata(&path).unwrap();
        let bound = Bound {
            path: &path,
            ino: m.ino(),
        };
        let count = |sock: &meshgate_agent::netlink::Socket| {
            connections(sock, &bound, Instant::now() + Duration::from_secs(2)).unwrap()
        };
        let here = meshgate_agent::sock_diag::open().unwrap();
        let (dev, ino) = {
            let m = std::fs::metadata(ns.path()).unwrap();
            (m.dev(), m.ino())
        };
        let r = netns::discover(&[std::path::PathBuf::from(netns::DEFAULT_NETNS_DIR)])
            .unwrap()
            .into_iter()
            .find(|r| (r.dev, r.inode) == (dev, ino))
            .expect("the test's namespace is discovered");
        let pod = r.pin().unwrap().sock_diag().unwrap().unwrap();
        assert_eq!((count(&here), count(&pod)), (0, 0));

        // ztunnel connects from inside its pod's namespace; the node agent accepts.
        let client = netns::with_netns(&ns.path(), || {
            let c = seqpacket();
            connect(c.as_raw_fd(), &UnixAddr::new(&path).unwrap()).unwrap();
            c
        })
        .unwrap();
        let fd = accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC).unwrap();
        // SAFETY: accept4(2) just returned this descriptor; nothing else owns it.
        let accepted = unsafe { OwnedFd::from_raw_fd(fd) };
        assert_eq!(
            (count(&here), count(&pod)),
            (0, 1),
            "the accepted end lives in the connecting socket's namespace"
        );
        drop((client, accepted));
        assert_eq!(count(&pod), 0);
    }
}
