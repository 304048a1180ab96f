//! Bench: discovery and inspection of a node with 250 pod network namespaces.
//!
//! Builds a "node" namespace holding the host ends of 250 veth pairs, one namespace per pod
//! with an IPv4 and an IPv6 address, a process inside it, and a mix of rules: linkerd via
//! iptables-nft and via iptables-legacy (both IPv4 + IPv6), Istio native nftables, and none.
//! Then it measures, on one thread as the daemon's blocking pool would run it:
//! - discovery: `/proc` + `/var/run/netns` scan, addresses of every namespace, pod UIDs;
//! - per-pod inspection: enter once, read addresses and rules, match (p50 / p99 / max);
//! - the full sweep: discovery, then locate and inspect every pod by its IP.
//!
//! It prints figures and checks the verdicts; it asserts nothing about timing. Needs root.
//! Every namespace and process it creates is removed at the end, also on panic.
//!
//! `cargo bench -p meshgate-agent --bench inspect_sweep` (MESHGATE_BENCH_PODS=N to resize).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use meshgate_agent::netns;
use meshgate_core::profile::{MeshProfile, ProfileSet};
use meshgate_core::rules::RedirectVerdict;
use meshgate_core::rules::locate::{Located, NetnsFacts, locate};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    LinkerdNft,
    LinkerdLegacy,
    IstioNft,
    Bare,
}

impl Kind {
    fn of(i: usize) -> Self {
        match i % 4 {
            0 => Kind::LinkerdNft,
            1 => Kind::LinkerdLegacy,
            2 => Kind::IstioNft,
            _ => Kind::Bare,
        }
    }
    fn profile(self) -> &'static str {
        match self {
            Kind::IstioNft => "istio",
            _ => "linkerd",
        }
    }
    fn expected(self) -> RedirectVerdict {
        match self {
            Kind::Bare => RedirectVerdict::Missing,
            _ => RedirectVerdict::Redirected,
        }
    }
}

struct Pod {
    ns: String,
    ips: Vec<IpAddr>,
    kind: Kind,
}

/// Everything created, removed on drop.
struct Node {
    prefix: String,
    node_ns: String,
    pods: Vec<Pod>,
    sleepers: Vec<Child>,
}

impl Drop for Node {
    fn drop(&mut self) {
        for c in &mut self.sleepers {
            let _ = c.kill();
        }
        for c in &mut self.sleepers {
            let _ = c.wait();
        }
        let mut batch = String::new();
        for p in &self.pods {
            batch.push_str(&format!("netns del {}\n", p.ns));
        }
        batch.push_str(&format!("netns del {}\n", self.node_ns));
        let _ = ip_batch(&batch, true);
        // Anything a failed batch left behind.
        if let Ok(list) = std::fs::read_dir(netns::DEFAULT_NETNS_DIR) {
            for e in list.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with(&self.prefix) {
                    let _ = Command::new("ip").args(["netns", "del", &name]).output();
                }
            }
        }
    }
}

fn ip_batch(batch: &str, force: bool) -> Result<(), String> {
    let mut args = vec!["-batch", "-"];
    if force {
        args.insert(0, "-force");
    }
    let mut child = Command::new("ip")
        .args(&args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("ip: {e}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(batch.as_bytes())
            .map_err(|e| e.to_string())?;
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn in_ns(ns: &str, cmd: &[&str], stdin: &str) {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns])
        .args(cmd)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?} in {ns}: {e}"));
    if let Some(mut s) = child.stdin.take() {
        s.write_all(stdin.as_bytes()).expect("write stdin");
    }
    let out = child.wait_with_output().expect("wait");
    assert!(
        out.status.success(),
        "{cmd:?} in {ns}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

const LINKERD_RESTORE: &str = "*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:PROXY_INIT_REDIRECT - [0:0]
:PROXY_INIT_OUTPUT - [0:0]
-A PREROUTING -m comment --comment proxy-init/install-proxy-init-prerouting -j PROXY_INIT_REDIRECT
-A OUTPUT -m comment --comment proxy-init/install-proxy-init-output -j PROXY_INIT_OUTPUT
-A PROXY_INIT_REDIRECT -p tcp -m multiport --dports 4190,4191,4567,4568 -j RETURN
-A PROXY_INIT_REDIRECT -p tcp -j REDIRECT --to-ports 4143
-A PROXY_INIT_OUTPUT -m owner --uid-owner 2102 -j RETURN
-A PROXY_INIT_OUTPUT -o lo -j RETURN
-A PROXY_INIT_OUTPUT -p tcp -m multiport --dports 443 -j RETURN
-A PROXY_INIT_OUTPUT -p tcp -j REDIRECT --to-ports 4140
COMMIT
";

const ISTIO_NFT: &str = "
table inet istio-proxy-nat {
    chain prerouting { type nat hook prerouting priority dstnat; policy accept; meta l4proto tcp jump istio-inbound; }
    chain output { type nat hook output priority -100; policy accept; meta l4proto tcp jump istio-output; }
    chain istio-inbound { tcp dport { 15008, 15090, 15021, 15020 } return; meta l4proto tcp jump istio-in-redirect; }
    chain istio-in-redirect { meta l4proto tcp redirect to :15006; }
    chain istio-output { meta skuid 1337 return; ip daddr 127.0.0.1 return; goto istio-redirect; }
    chain istio-redirect { meta l4proto tcp redirect to :15001; }
}
";

fn build(n: usize) -> Node {
    let prefix = format!("mgb-{}-", std::process::id());
    let node_ns = format!("{prefix}node");
    let mut node = Node {
        prefix: prefix.clone(),
        node_ns: node_ns.clone(),
        pods: Vec::new(),
        sleepers: Vec::new(),
    };
    let mut create = format!("netns add {node_ns}\n");
    for i in 0..n {
        let ns = format!("{prefix}{i}");
        create.push_str(&format!("netns add {ns}\n"));
        let (hi, lo) = (i / 250, i % 250 + 1);
        node.pods.push(Pod {
            ns,
            ips: vec![
                format!("10.200.{hi}.{lo}").parse().expect("ipv4"),
                format!("fd00:200::{hi}:{lo}").parse().expect("ipv6"),
            ],
            kind: Kind::of(i),
        });
    }
    ip_batch(&create, false).expect("create namespaces");
    // veth pairs: host ends stay in the node namespace, pod ends become eth0.
    let mut links = String::new();
    for (i, p) in node.pods.iter().enumerate() {
        links.push_str(&format!(
            "link add vb{i} type veth peer name eth0 netns {}\nlink set vb{i} up\n",
            p.ns
        ));
    }
    in_ns(&node_ns, &["ip", "-batch", "-"], &links);
    for p in &node.pods {
        let script = format!(
            "link set lo up\nlink set eth0 up\naddr add {}/16 dev eth0\naddr add {}/64 dev eth0 nodad\n",
            p.ips[0], p.ips[1]
        );
        in_ns(&p.ns, &["ip", "-batch", "-"], &script);
        match p.kind {
            Kind::LinkerdNft => {
                in_ns(&p.ns, &["iptables-nft-restore"], LINKERD_RESTORE);
                in_ns(&p.ns, &["ip6tables-nft-restore"], LINKERD_RESTORE);
            }
            Kind::LinkerdLegacy => {
                in_ns(&p.ns, &["iptables-legacy-restore", "-w"], LINKERD_RESTORE);
                in_ns(&p.ns, &["ip6tables-legacy-restore", "-w"], LINKERD_RESTORE);
            }
            Kind::IstioNft => in_ns(&p.ns, &["nft", "-f", "-"], ISTIO_NFT),
            Kind::Bare => {}
        }
        let child = Command::new("ip")
            .args(["netns", "exec", &p.ns, "sleep", "900"])
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn sleeper");
        node.sleepers.push(child);
    }
    node
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn rss_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

fn main() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("inspect_sweep: needs root (network namespaces, netfilter rules)");
        std::process::exit(1);
    }
    let n: usize = std::env::var("MESHGATE_BENCH_PODS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(250);
    let rounds: usize = 5;

    let t = Instant::now();
    let node = build(n);
    println!(
        "built {n} pod namespaces in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    // Let every sleeper finish entering its namespace.
    std::thread::sleep(Duration::from_millis(500));

    let figures = Figures::sweep(&node, rounds);
    figures.print(n, rounds);
    drop(node);
    if figures.wrong > 0 || figures.unknown > 0 {
        std::process::exit(1);
    }
}

/// What the rounds measured, each series sorted, and the verdicts that were not as built.
struct Figures {
    discovery: Vec<Duration>,
    per_pod: Vec<Duration>,
    sweeps: Vec<Duration>,
    wrong: usize,
    unknown: usize,
}

impl Figures {
    /// `rounds` full sweeps of `node`: discovery, then every pod located and inspected.
    fn sweep(node: &Node, rounds: usize) -> Self {
        let profiles = ProfileSet::all_builtin();
        let dirs = vec![PathBuf::from(netns::DEFAULT_NETNS_DIR)];
        let mut f = Figures {
            discovery: Vec::new(),
            per_pod: Vec::new(),
            sweeps: Vec::new(),
            wrong: 0,
            unknown: 0,
        };
        for round in 0..rounds {
            let sweep = Instant::now();
            let t = Instant::now();
            let (facts, errors) = netns::survey(&dirs).expect("survey");
            f.discovery.push(t.elapsed());
            if round == 0 {
                println!(
                    "discovery saw {} namespaces ({} unreadable)",
                    facts.len(),
                    errors.len()
                );
            }
            for pod in &node.pods {
                let profile = profiles.get(pod.kind.profile()).expect("profile");
                let t = Instant::now();
                let verdict = verdict_of(&facts, pod, profile);
                f.per_pod.push(t.elapsed());
                if verdict == RedirectVerdict::Unknown {
                    f.unknown += 1;
                } else if verdict != pod.kind.expected() {
                    f.wrong += 1;
                    eprintln!("{}: {:?} got {verdict:?}", pod.ns, pod.kind);
                }
            }
            f.sweeps.push(sweep.elapsed());
        }
        f.discovery.sort();
        f.per_pod.sort();
        f.sweeps.sort();
        f
    }

    fn print(&self, n: usize, rounds: usize) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let (discovery, per_pod, sweeps) = (&self.discovery, &self.per_pod, &self.sweeps);
        println!(
            "pods: {n}, rounds: {rounds}, mix: linkerd iptables-nft v4+v6 / linkerd legacy v4+v6 / istio nft inet / none"
        );
        println!(
            "discovery (scan + addresses of every netns): p50 {:.1} ms, max {:.1} ms",
            ms(pct(discovery, 0.5)),
            ms(pct(discovery, 1.0))
        );
        println!(
            "per-pod inspection (locate + enter + addresses + rules + match): p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs",
            us(pct(per_pod, 0.5)),
            us(pct(per_pod, 0.99)),
            us(pct(per_pod, 1.0))
        );
        println!(
            "full sweep of {n} pods (discovery + every pod): p50 {:.1} ms, max {:.1} ms",
            ms(pct(sweeps, 0.5)),
            ms(pct(sweeps, 1.0))
        );
        println!(
            "bench process RSS: {} KiB (peak {} KiB)",
            rss_kib("VmRSS:"),
            rss_kib("VmHWM:")
        );
        println!("wrong verdicts: {}, unknown: {}", self.wrong, self.unknown);
    }
}

/// `pod`'s verdict: located among `facts` by its IPs and inspected for `profile`; unknown
/// (said on stderr) when it cannot be.
fn verdict_of(
    facts: &[NetnsFacts<netns::NetnsRef>],
    pod: &Pod,
    profile: &MeshProfile,
) -> RedirectVerdict {
    match locate(facts, &pod.ips, None) {
        Located::Found(r) => match netns::check_pod(&r.path, profile, &BTreeMap::new()) {
            Ok(i) => i.verdict,
            Err(e) => {
                eprintln!("{}: {e}", pod.ns);
                RedirectVerdict::Unknown
            }
        },
        Located::Unknown(why) => {
            eprintln!("{}: {why}", pod.ns);
            RedirectVerdict::Unknown
        }
    }
}
