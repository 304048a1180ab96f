//! What a real node needs of the host, checked before the first node starts.
//!
//! In: the host as it is: its tools, the kernel features a node uses (probed in throwaway
//! mount and network namespaces, so nothing of the host's own changes), its cgroup mounts, its
//! inotify limit, the free space of the run dirs' filesystem, and its routes. Out: `Ok`, or
//! [`Error::HostNotReady`] naming every unmet need with how to meet it, so a fresh machine
//! fails in one message instead of a daemon's log two minutes later. What a node needs and
//! lays out inside its own namespaces instead (mount propagation, `/run/netns`,
//! `/etc/resolv.conf`, forwarding, the kubelet's sysctls) is not checked here; the list of both
//! is in docs/testing.md, "What the real nodes assume of the host".

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use crate::Error;

/// One need of the host: a probe, and what to do when it fails.
struct Need {
    /// What is needed, as the error names it.
    what: &'static str,
    /// Looks; `Err` says what it found.
    probe: fn() -> Result<(), String>,
    /// How to meet the need.
    fix: &'static str,
}

const NEEDS: &[Need] = &[
    Need {
        what: "tools",
        probe: tools,
        fix: "install Debian's util-linux, mount, iproute2, nftables, iptables and procps \
              (e2e/install-deps.sh does)",
    },
    Need {
        what: "the overlay filesystem (containerd's snapshotter and the node's /etc, /opt, /var, /run)",
        probe: overlay,
        fix: "`modprobe overlay`, or a kernel with CONFIG_OVERLAY_FS",
    },
    Need {
        what: "nf_tables with NAT chains (kube-proxy's nftables mode, Istio's native_nftables)",
        probe: nf_tables,
        fix: "`modprobe nf_tables nft_chain_nat`, or a kernel with CONFIG_NF_TABLES and \
              CONFIG_NFT_NAT",
    },
    Need {
        what: "iptables nat and mangle tables with the owner and mark matches and REDIRECT, \
               legacy and nft, IPv4 and IPv6 (istio-cni's rules)",
        probe: iptables,
        fix: "`modprobe iptable_nat iptable_mangle ip6table_nat ip6table_mangle xt_owner xt_mark \
              xt_REDIRECT nft_compat`, or a kernel with those options",
    },
    Need {
        what: "cgroup controllers cpu, cpuset, memory and pids (the kubelet's cgroupfs driver)",
        probe: cgroups,
        fix: "mount the cgroup v2 hierarchy at /sys/fs/cgroup (or the v1 controllers under it) \
              with those controllers enabled",
    },
    Need {
        what: "inotify instances (containerd, the kubelet and the agent of each node watch files)",
        probe: inotify,
        fix: "`sysctl -w fs.inotify.max_user_instances=512`",
    },
    Need {
        what: "1 GiB free where the runs keep their files (the control plane's etcd, each node's \
               containerd root and images)",
        probe: free_space,
        fix: "free space there, or point MESHGATE_E2E_TMPDIR at a directory with room",
    },
    Need {
        what: "the address ranges the harness routes (10.200.0.0/16 pod networks, \
               10.202.0.0/16 node links, 10.203.0.0/16 apiservers) free of host routes that \
               cover them whole",
        probe: ranges,
        fix: "remove or narrow that route on this machine, or run the tests on one without it",
    },
];

/// Checks every need once per process; later calls return the first answer.
pub fn check() -> Result<(), Error> {
    static ANSWER: OnceLock<Result<(), String>> = OnceLock::new();
    ANSWER
        .get_or_init(|| report(NEEDS.iter().map(|n| (n.what, (n.probe)(), n.fix))))
        .clone()
        .map_err(|unmet| Error::HostNotReady { unmet })
}

/// One line per unmet need: what, what was found, the fix. `Ok` when all are met.
fn report<'a>(
    answers: impl Iterator<Item = (&'a str, Result<(), String>, &'a str)>,
) -> Result<(), String> {
    let unmet: Vec<String> = answers
        .filter_map(|(what, answer, fix)| answer.err().map(|found| (what, found, fix)))
        .map(|(what, found, fix)| format!("- {what}: {found}; fix: {fix}"))
        .collect();
    if unmet.is_empty() {
        Ok(())
    } else {
        Err(unmet.join("\n"))
    }
}

/// Runs a shell script (bounded: the probes finish in milliseconds, 20 s is for a stalled
/// machine), `Err` with its exit status and stderr.
fn sh(wrapper: &[&str], script: &str, arg: &Path) -> Result<(), String> {
    let mut cmd = Command::new(wrapper[0]);
    cmd.args(&wrapper[1..])
        .args(["--", "timeout", "20", "sh", "-ec", script, "probe"])
        .arg(arg);
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {}: {e}", wrapper[0]))?;
    if out.status.success() {
        Ok(())
    } else {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr.lines().last().unwrap_or("").trim();
        Err(format!("{} ({last})", out.status))
    }
}

fn tools() -> Result<(), String> {
    let missing: Vec<&str> = [
        "sh",
        "unshare",
        "nsenter",
        "mount",
        "umount",
        "findmnt",
        "ip",
        "nft",
        "iptables-legacy",
        "ip6tables-legacy",
        "iptables-nft",
        "ip6tables-nft",
        "sysctl",
        "timeout",
    ]
    .into_iter()
    .filter(|t| crate::harness::paths::find_on_path(t).is_none())
    .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!("not on PATH: {}", missing.join(", ")))
    }
}

/// A scratch dir on the run dirs' filesystem (overlay's upper layer must support it).
fn scratch() -> Result<tempfile::TempDir, String> {
    let base = crate::harness::control_plane::tmp_base();
    tempfile::Builder::new()
        .prefix("meshgate-host-check-")
        .tempdir_in(&base)
        .map_err(|e| format!("cannot create a directory in {}: {e}", base.display()))
}

fn overlay() -> Result<(), String> {
    let dir = scratch()?;
    sh(
        &["unshare", "--mount", "--propagation=private"],
        r#"cd "$1"; mkdir l u w m
mount -t overlay overlay -o lowerdir=l,upperdir=u,workdir=w m"#,
        dir.path(),
    )
}

fn nf_tables() -> Result<(), String> {
    sh(
        &["unshare", "--net"],
        r#"nft add table inet meshgate_probe
nft add chain inet meshgate_probe out '{ type nat hook output priority -100; }'
nft add rule inet meshgate_probe out meta skuid 1337 tcp dport 80 redirect to :15001"#,
        Path::new("/"),
    )
}

fn iptables() -> Result<(), String> {
    sh(
        &["unshare", "--net"],
        r#"for t in iptables-legacy ip6tables-legacy iptables-nft ip6tables-nft; do
  $t -w -t nat -A OUTPUT -p tcp -m owner --uid-owner 1337 -j REDIRECT --to-ports 15001
  $t -w -t mangle -A PREROUTING -m mark --mark 0x539/0xfff -j RETURN
done"#,
        Path::new("/"),
    )
}

fn cgroups() -> Result<(), String> {
    let root = Path::new("/sys/fs/cgroup");
    let v2 = std::fs::read_to_string(root.join("cgroup.controllers")).ok();
    let missing = missing_controllers(v2.as_deref(), |c| {
        root.join(c).join("cgroup.procs").exists()
    });
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!("not available: {}", missing.join(", ")))
    }
}

/// The controllers the kubelet needs that neither the v2 root (`cgroup.controllers`, when the
/// host is on v2) nor a v1 hierarchy of that name (`v1_mounted`) provides.
fn missing_controllers(v2: Option<&str>, v1_mounted: impl Fn(&str) -> bool) -> Vec<&'static str> {
    ["cpu", "cpuset", "memory", "pids"]
        .into_iter()
        .filter(|c| match v2 {
            Some(list) => !list.split_whitespace().any(|x| x == *c),
            None => !v1_mounted(c),
        })
        .collect()
}

fn inotify() -> Result<(), String> {
    const NEEDED: u64 = 128;
    let path = "/proc/sys/fs/inotify/max_user_instances";
    let have: u64 = std::fs::read_to_string(path)
        .map_err(|e| format!("{path}: {e}"))?
        .trim()
        .parse()
        .map_err(|e| format!("{path}: {e}"))?;
    if have >= NEEDED {
        Ok(())
    } else {
        Err(format!(
            "fs.inotify.max_user_instances is {have}, below {NEEDED}"
        ))
    }
}

fn free_space() -> Result<(), String> {
    const NEEDED: u64 = 1 << 30;
    let base = crate::harness::control_plane::tmp_base();
    let st = nix::sys::statvfs::statvfs(&base).map_err(|e| format!("{}: {e}", base.display()))?;
    let free = st.blocks_available() as u64 * st.fragment_size() as u64;
    if free >= NEEDED {
        Ok(())
    } else {
        Err(format!("{} has {} MiB free", base.display(), free >> 20))
    }
}

fn ranges() -> Result<(), String> {
    let out = Command::new("ip")
        .args(["-4", "-o", "route", "show", "table", "all"])
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    let routes = String::from_utf8_lossy(&out.stdout);
    let covering = covering_routes(&routes);
    if covering.is_empty() {
        Ok(())
    } else {
        Err(format!("covered by {}", covering.join("; ")))
    }
}

/// The ranges the harness picks its networks from, each a /16.
const RANGES: [Ipv4Addr; 3] = [
    Ipv4Addr::new(10, 200, 0, 0),
    Ipv4Addr::new(10, 202, 0, 0),
    Ipv4Addr::new(10, 203, 0, 0),
];

/// The routes (lines of `ip -o route show table all`) that cover one of [`RANGES`] whole, so
/// no network of it is free: a destination of /16 or shorter containing it. The default route
/// does not count: it is where everything else goes, not a claim on the range.
fn covering_routes(routes: &str) -> Vec<String> {
    routes
        .lines()
        .filter_map(|line| {
            let dst = line
                .split_whitespace()
                .find(|w| *w != "local" && *w != "broadcast")?;
            let (addr, len) = dst.split_once('/')?;
            let addr: Ipv4Addr = addr.parse().ok()?;
            let len: u32 = len.parse().ok()?;
            let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
            let covers = (1..=16).contains(&len)
                && RANGES
                    .iter()
                    .any(|r| u32::from(*r) & mask == u32::from(addr) & mask);
            covers.then(|| line.trim().to_owned())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_covering_route_is_named_and_others_are_not() {
        let routes = "default via 192.0.2.1 dev eth0 \n\
                      10.0.0.0/8 via 192.0.2.9 dev eth0 \n\
                      10.200.7.0/24 via 10.202.0.2 dev mgv1 \n\
                      10.203.0.0/16 dev vpn0 scope link \n\
                      10.204.0.0/16 dev other scope link \n\
                      192.0.2.0/24 dev eth0 proto kernel scope link src 192.0.2.2 \n\
                      local 10.202.0.1 dev mgv1 table local proto kernel scope host src 10.202.0.1 \n";
        assert_eq!(
            covering_routes(routes),
            vec![
                "10.0.0.0/8 via 192.0.2.9 dev eth0".to_owned(),
                "10.203.0.0/16 dev vpn0 scope link".to_owned(),
            ]
        );
    }

    #[test]
    fn controllers_come_from_v2_or_from_v1_hierarchies() {
        assert!(
            missing_controllers(Some("cpuset cpu io memory hugetlb pids"), |_| false).is_empty()
        );
        assert_eq!(
            missing_controllers(Some("cpu io pids"), |_| true),
            vec!["cpuset", "memory"]
        );
        assert_eq!(missing_controllers(None, |c| c != "pids"), vec!["pids"]);
    }

    #[test]
    fn the_report_names_each_unmet_need_with_its_fix() {
        let answers = [
            ("tools", Ok(()), "install"),
            (
                "overlay",
                Err("exit status: 32 (unknown filesystem type)".into()),
                "`modprobe overlay`",
            ),
            ("inotify", Err("is 64, below 128".into()), "sysctl"),
        ];
        assert_eq!(
            report(answers.into_iter()),
            Err(
                "- overlay: exit status: 32 (unknown filesystem type); fix: `modprobe overlay`\n\
                 - inotify: is 64, below 128; fix: sysctl"
                    .into()
            )
        );
        assert_eq!(report([("tools", Ok(()), "x")].into_iter()), Ok(()));
    }

    /// The probes pass on the machines that run the tests (root, like every real-node test):
    /// a probe that refused a good host would block every real node.
    #[test]
    fn this_host_meets_every_need() {
        crate::harness::paths::require_root().expect("the host check needs root");
        if let Err(e) = check() {
            panic!("{e}");
        }
    }
}
