//! Network namespaces for the e2e tests, the benchmarks and the agent's privileged
//! tests: real `ip netns` namespaces, and pod namespaces whose loopback holds the pod's IP,
//! with or without linkerd proxy-init's real redirect rules.
//!
//! In: a name tag, scripts to run inside (addresses, iptables, `nft -f`); for a pod, an IPv4
//! address and the rules to install. Out: a [`Netns`] (its path, a process inside it on
//! request) or a [`PodNetns`] that the agent finds by address, deleted on drop.
//! Loopback only, unless a script adds more: nothing routes anywhere, no traffic leaves.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Context, bail, ensure};

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

/// Fails (never skips) when this machine cannot create pod namespaces and their rules.
pub fn require_privileges() -> anyhow::Result<()> {
    require_tools(&["ip", "iptables-nft", "iptables-legacy"])
}

/// Fails (never skips) unless this runs as root with every one of `tools` on PATH.
pub fn require_tools(tools: &[&str]) -> anyhow::Result<()> {
    ensure!(
        nix::unistd::geteuid().is_root(),
        "network namespaces and netfilter rules need root (e.g. `sudo -E cargo test ...`)"
    );
    let path = std::env::var_os("PATH").unwrap_or_default();
    let missing: Vec<&str> = tools
        .iter()
        .copied()
        .filter(|t| !std::env::split_paths(&path).any(|d| d.join(t).is_file()))
        .collect();
    ensure!(
        missing.is_empty(),
        "missing tools {missing:?}: install iproute2, iptables and nftables (e2e/install-deps.sh)"
    );
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

/// A named network namespace with its loopback up; deleted on drop (also when a test fails),
/// after the process [`Netns::spawn_sleeper`] started in it, if any.
#[derive(Debug)]
pub struct Netns {
    /// The `ip netns` name.
    pub name: String,
    sleeper: Option<Child>,
}

impl Netns {
    /// Creates `mg-<tag>-<pid>-<n>`: unique in this process, and across concurrent runs.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "mg-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        sh(&["ip", "netns", "add", &name])?;
        let ns = Self {
            name,
            sleeper: None,
        };
        ns.exec("ip link set lo up")?;
        Ok(ns)
    }

    /// Its bind mount under `/var/run/netns`: what the agent opens.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/var/run/netns/{}", self.name))
    }

    /// Runs a shell script inside the namespace (`sh -e`: every line must succeed); its stdout.
    pub fn exec(&self, script: &str) -> anyhow::Result<String> {
        sh(&["ip", "netns", "exec", &self.name, "sh", "-ec", script])
    }

    /// Loads an nftables script inside the namespace with `nft -f`.
    pub fn nft(&self, script: &str) -> anyhow::Result<()> {
        self.exec(&format!(
            "nft -f - <<'MESHGATE_NFT'\n{script}\nMESHGATE_NFT"
        ))
        .with_context(|| format!("nft -f in {}:\n{script}", self.name))?;
        Ok(())
    }

    /// Starts a sleep inside the namespace and returns its pid once the process is in it
    /// (`ip netns exec` switches namespaces, then execs in place). It sleeps until killed
    /// (`sleep infinity`), so the pid stays valid however long a test runs; killed on drop.
    /// Called again, it kills and reaps the previous sleeper first (one per namespace).
    pub fn spawn_sleeper(&mut self) -> anyhow::Result<u32> {
        use std::os::unix::fs::MetadataExt;
        if let Some(mut old) = self.sleeper.take() {
            let _ = old.kill();
            old.wait().context("reaping the previous sleeper")?;
        }
        let child = Command::new("ip")
            .args(["netns", "exec", &self.name, "sleep", "infinity"])
            .stdin(Stdio::null())
            .spawn()
            .context("spawning a process in the namespace")?;
        let pid = child.id();
        self.sleeper = Some(child);
        let want = std::fs::metadata(self.path())?.ino();
        for _ in 0..200 {
            if std::fs::metadata(format!("/proc/{pid}/ns/net")).is_ok_and(|m| m.ino() == want) {
                return Ok(pid);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        bail!("process {pid} never entered {}", self.name)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Some(mut c) = self.sleeper.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// A pod's network namespace: its loopback holds the pod's /32 (scope global, like a pod
/// IP), with the rules asked for; deleted on drop.
#[derive(Debug)]
pub struct PodNetns {
    netns: Netns,
    /// The pod IP it holds.
    pub ip: Ipv4Addr,
}

impl PodNetns {
    /// Creates the namespace with `ip` and `rules`.
    pub fn new(ip: Ipv4Addr, rules: Rules) -> anyhow::Result<Self> {
        let ns = Self {
            netns: Netns::new("pod")?,
            ip,
        };
        ns.exec(&format!("ip addr add {ip}/32 dev lo"))?;
        if let Rules::Linkerd(ipt) = rules {
            ns.exec(&linkerd_rules(ipt))?;
        }
        Ok(ns)
    }
}

impl std::ops::Deref for PodNetns {
    type Target = Netns;

    fn deref(&self) -> &Netns {
        &self.netns
    }
}
