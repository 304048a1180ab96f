//! Privileged integration tests of pod inspection: real network namespaces (`ip netns add`
//! through the e2e harness's `netns_sim`, a veth pair, addresses), real rules written by `iptables-nft`, `iptables-legacy`,
//! `ip6tables-*` and `nft -f`, read back by the library and by the built `inspect` binary.
//!
//! These tests need root and the `ip`, `iptables-*`, `ip6tables-*` and `nft` tools
//! (`e2e/install-deps.sh` installs them). Without them they fail with a message saying
//! what is missing: they never skip silently.
//!
//! One file per concern: [`meshes`] (each mesh's rules through each backend, per pod),
//! [`ambient_overrides`] (istio-cni's own ambient rules for each pod-level override),
//! [`binary`] (the `inspect` command), [`reading`] (how a namespace is read, and what a
//! hostile or busy one cannot do to the reader), [`kernel`] (the matcher against real
//! connections), [`identity`] (what the survey found is what is read and acted on), and the
//! node proxy's [`node_proxy_listeners`] and [`node_proxy_connection`]. Here: the namespace
//! fixture and the shared helpers; the Istio goldens that `binary`, `kernel` and `identity`
//! load too are in `meshes`.

mod ambient_overrides;
mod binary;
mod identity;
mod kernel;
mod meshes;
mod node_proxy_connection;
mod node_proxy_listeners;
mod reading;

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
        self.run_file(&format!("{tool} -w <"), "rules", &format!("{script}\n"));
    }

    /// Runs `command FILE` inside the namespace, `script` written to FILE (`name.ext`): a
    /// large script does not fit in an argument list.
    fn run_file(&self, command: &str, ext: &str, script: &str) {
        let file = std::env::temp_dir().join(format!("{}.{ext}", self.name()));
        std::fs::write(&file, script).expect("write script file");
        self.sh(&format!("{command} {}", file.display()));
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

/// Polls `done` every 10 ms for up to 2 s; whether it became true. For what closing a socket
/// must end in the kernel: a process another test forks at that moment holds copies of our
/// descriptors until its exec closes them (they are `CLOEXEC`), so a socket can outlive its
/// drop by that long.
fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while !done() {
        if std::time::Instant::now() >= end {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    true
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
