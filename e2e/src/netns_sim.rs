//! Pod network namespaces for the e2e tests and the demo: real `ip netns` namespaces whose
//! loopback holds the pod's IP, with or without linkerd proxy-init's real redirect rules.
//!
//! In: an IPv4 address and the rules to install. Out: a [`PodNetns`] that the agent finds by
//! address, deleted on drop. Loopback only: nothing routes anywhere, no traffic leaves.

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, ensure};

/// What a namespace's NAT table holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rules {
    /// linkerd proxy-init's redirects, written by this iptables binary
    /// (`iptables-legacy`, linkerd's default, or `iptables-nft`).
    Linkerd(&'static str),
    /// Nothing: the pod's sandbox was created before the mesh's CNI plugin was chained.
    None,
}

/// Runs a command; its stdout, or an error with its stderr.
pub fn sh(args: &[&str]) -> anyhow::Result<String> {
    let (cmd, rest) = args.split_first().context("empty command")?;
    let out = Command::new(cmd)
        .args(rest)
        .output()
        .with_context(|| format!("cannot run {cmd}"))?;
    ensure!(
        out.status.success(),
        "`{}` failed ({}): {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Fails (never skips) when this machine cannot create namespaces and rules.
pub fn require_privileges() -> anyhow::Result<()> {
    ensure!(
        nix::unistd::geteuid().is_root(),
        "pod network namespaces need root"
    );
    for tool in ["ip", "iptables-nft", "iptables-legacy"] {
        ensure!(
            std::env::var_os("PATH")
                .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file())),
            "{tool} is missing: install iproute2 and iptables (e2e/install-deps.sh)"
        );
    }
    Ok(())
}

/// A private /24 that no other user in this process (and, very likely, no concurrent run)
/// takes: `10.<100 + pid % 100>.<counter>.0/24`. The agent matches pods to namespaces by IP
/// across the whole machine, so a collision would make both namespaces ambiguous.
pub fn private_subnet() -> [u8; 3] {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    [
        10,
        100 + (std::process::id() % 100) as u8,
        (n % 250) as u8 + 1,
    ]
}

/// linkerd proxy-init's NAT rules: inbound to 4143 from PREROUTING, outbound to 4140 from
/// OUTPUT, through its own chains.
pub fn linkerd_rules(ipt: &str) -> String {
    format!(
        "{ipt} -w -t nat -N PROXY_INIT_REDIRECT
         {ipt} -w -t nat -A PROXY_INIT_REDIRECT -p tcp --match multiport --dports 4190,4191 -j RETURN
         {ipt} -w -t nat -A PROXY_INIT_REDIRECT -p tcp -j REDIRECT --to-port 4143
         {ipt} -w -t nat -A PREROUTING -j PROXY_INIT_REDIRECT
         {ipt} -w -t nat -N PROXY_INIT_OUTPUT
         {ipt} -w -t nat -A PROXY_INIT_OUTPUT -m owner --uid-owner 2102 -j RETURN
         {ipt} -w -t nat -A PROXY_INIT_OUTPUT -o lo -j RETURN
         {ipt} -w -t nat -A PROXY_INIT_OUTPUT -p tcp -j REDIRECT --to-port 4140
         {ipt} -w -t nat -A OUTPUT -j PROXY_INIT_OUTPUT"
    )
}

/// A named network namespace whose loopback holds the pod's /32 (scope global, like a pod
/// IP); deleted on drop, also when a test fails.
#[derive(Debug)]
pub struct PodNetns {
    /// The `ip netns` name.
    pub name: String,
    /// The pod IP it holds.
    pub ip: Ipv4Addr,
}

impl PodNetns {
    /// Creates the namespace with `ip` and `rules`.
    pub fn new(ip: Ipv4Addr, rules: Rules) -> anyhow::Result<Self> {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "mgp-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        sh(&["ip", "netns", "add", &name])?;
        let ns = Self { name, ip };
        ns.exec(&format!("ip link set lo up\nip addr add {ip}/32 dev lo"))?;
        if let Rules::Linkerd(ipt) = rules {
            ns.exec(&linkerd_rules(ipt))?;
        }
        Ok(ns)
    }

    /// Runs a shell script inside the namespace.
    pub fn exec(&self, script: &str) -> anyhow::Result<String> {
        sh(&["ip", "netns", "exec", &self.name, "sh", "-ec", script])
    }
}

impl Drop for PodNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}
