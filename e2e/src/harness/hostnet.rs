//! The few links and routes the real-node tier adds to the host's network namespace, through
//! `ip` (iproute2): a routable control plane's dummy link and each real node's veth pair.
//!
//! In: names and addresses derived from a run directory. Out: links created or deleted, an
//! unused address picked, whether a link still exists (for the residue checks), and whether a
//! node's namespace reaches the apiserver through them. Every
//! name is derived from the run directory alone, so a later run can remove what a killed
//! run left (deleting a link removes its addresses and the routes through it).

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::Error;

/// Runs `ip args...`; the error names `part` and carries ip's stderr.
pub(crate) fn ip(part: &'static str, args: &[&str]) -> Result<String, Error> {
    run(part, "ip", args)
}

/// Runs `ip args...` inside the network namespace pinned at `pin` (through `nsenter`).
pub(crate) fn ip_in(part: &'static str, pin: &Path, args: &[&str]) -> Result<String, Error> {
    let net = format!("--net={}", pin.display());
    let mut all = vec![net.as_str(), "--", "ip"];
    all.extend_from_slice(args);
    run(part, "nsenter", &all)
}

/// Runs `program args...` (bounded by the commands themselves: ip and sysctl do not block).
pub(crate) fn run(part: &'static str, program: &str, args: &[&str]) -> Result<String, Error> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| Error::io(format!("running {program}"), e))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(Error::RealNode {
            part,
            detail: format!(
                "`{program} {}` failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        })
    }
}

/// Whether a link of that name exists in this process's network namespace.
pub fn link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// Deletes a link if it exists (a veth's peer goes with it); logs a failure.
pub(crate) fn delete_link(name: &str) {
    // A veth also goes when its peer's namespace is destroyed, which may happen between the
    // check and the delete: only a link that is still there after a failed delete is a leak.
    if link_exists(name)
        && let Err(e) = ip("the host's links", &["link", "del", name])
        && link_exists(name)
    {
        tracing::warn!(link = name, error = %e, "cannot delete a link");
    }
}

/// A stable 32-bit hash (FNV-1a) of a run directory's path: the seed of its link names and
/// addresses, so they can be derived again from the directory alone.
pub(crate) fn seed(dir: &Path) -> u32 {
    dir.as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0x811c_9dc5u32, |h, b| {
            (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
        })
}

/// The first address, starting at `candidate(seed)` and trying the following seeds, whose
/// network (`prefix` bits) no address or route of the host's namespace overlaps: concurrent
/// runs (other test binaries) pick distinct ones.
pub(crate) fn unused_net(
    seed: u32,
    prefix: u8,
    candidate: impl Fn(u32) -> Ipv4Addr,
) -> Result<Ipv4Addr, Error> {
    let taken = ip("the host's addresses", &["-4", "-o", "addr", "show"])?
        + &ip(
            "the host's routes",
            &["-4", "route", "show", "table", "all"],
        )?;
    let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
    let used: Vec<(u32, u32)> = taken
        .split_whitespace()
        .filter_map(|w| {
            let (a, len) = w.split_once('/').unwrap_or((w, "32"));
            let a: Ipv4Addr = a.parse().ok()?;
            let len: u32 = len.parse().ok()?;
            Some((u32::from(a), u32::MAX.checked_shl(32 - len).unwrap_or(0)))
        })
        .collect();
    for i in 0..4096 {
        let net = u32::from(candidate(seed.wrapping_add(i))) & mask;
        // Overlap: either network contains the other's base address.
        let clash = used
            .iter()
            .any(|(a, m)| (a & m) == (net & m) || (a & mask) == net);
        if !clash {
            return Ok(Ipv4Addr::from(net));
        }
    }
    Err(Error::RealNode {
        part: "the host's addresses",
        detail: format!("no unused /{prefix} left in the range"),
    })
}

/// A TCP connection from the network namespace pinned at `pin` to `to`, within 2 s. A host
/// firewall that drops the node's traffic would otherwise show only as a kubelet that never
/// registers, two minutes later.
pub(crate) fn reaches_from(part: &'static str, pin: &Path, to: SocketAddr) -> Result<(), Error> {
    let ns =
        std::fs::File::open(pin).map_err(|e| Error::io(format!("opening {}", pin.display()), e))?;
    // A thread of its own enters the namespace and ends with it: the caller's stays put.
    let probe = std::thread::spawn(move || {
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| format!("entering the namespace: {e}"))?;
        TcpStream::connect_timeout(&to, Duration::from_secs(2))
            .map(drop)
            .map_err(|e| e.to_string())
    });
    let answer = probe
        .join()
        .unwrap_or_else(|_| Err("the probe thread panicked".into()));
    answer.map_err(|e| Error::RealNode {
        part,
        detail: format!(
            "it cannot reach the apiserver at {to}: {e}. A host firewall (an INPUT policy or an \
             nftables input hook) or strict reverse-path filtering may drop the node's traffic: \
             allow 10.200.0.0/16 and 10.202.0.0/16 to reach 10.203.0.0/16"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_are_stable_and_spread() {
        assert_eq!(seed(Path::new("/a")), seed(Path::new("/a")));
        assert_ne!(
            seed(Path::new("/dev/shm/x1")),
            seed(Path::new("/dev/shm/x2"))
        );
    }
}
