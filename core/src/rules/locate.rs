//! Which of a node's network namespaces belongs to a pod.
//!
//! In: the namespaces the agent found (their addresses, and the pod UIDs read from the cgroup
//! paths of the processes inside them), and the pod's IPs (`status.podIPs`) and UID. Out:
//! [`Located::Found`] with the namespace's key, or [`Located::Unknown`] with the reason.
//! `Unknown` is never a reason to evict: a pod whose namespace cannot be told apart from
//! another's (or is invisible, as with VM-isolated runtimes) is left alone.
//!
//! Also [`pod_uid_from_cgroup`], which reads a pod UID out of a `/proc/<pid>/cgroup` text in
//! both the cgroupfs spelling (`/kubepods/burstable/pod<uid>/...`) and the systemd one
//! (`/kubepods.slice/.../kubepods-burstable-pod<uid_with_underscores>.slice/...`).

use std::collections::BTreeSet;
use std::net::IpAddr;

use super::IpFamily;

/// What the agent knows about one network namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetnsFacts<K> {
    /// Caller's handle for the namespace (an inode, a path).
    pub key: K,
    /// Addresses on its interfaces.
    pub addresses: Vec<IpAddr>,
    /// Pod UIDs (normalized, dashes) from the cgroups of processes inside it; empty when none
    /// is known (a namespace found only under a netns dir, or a non-Kubernetes cgroup).
    pub pod_uids: BTreeSet<String>,
}

/// Where a pod's network namespace is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Located<K> {
    /// This namespace holds the pod's IP (and, when known, its processes carry the pod UID).
    Found(K),
    /// No single namespace could be attributed to the pod.
    Unknown(String),
}

/// Attributes a pod to one namespace by IP, cross-checked by pod UID where the cgroups tell.
///
/// A namespace holding a pod IP is rejected when its processes belong to *other* pods only:
/// the IP was reused after the pod's sandbox died, or the pod status is stale. Among the rest,
/// a namespace confirmed by UID wins; otherwise exactly one candidate must remain.
pub fn locate<K: Clone>(
    candidates: &[NetnsFacts<K>],
    pod_ips: &[IpAddr],
    pod_uid: Option<&str>,
) -> Located<K> {
    if pod_ips.is_empty() {
        return Located::Unknown("the pod has no IP yet".into());
    }
    let uid = pod_uid.map(normalize_uid);
    let holding: Vec<&NetnsFacts<K>> = candidates
        .iter()
        .filter(|c| c.addresses.iter().any(|a| pod_ips.contains(a)))
        .collect();
    if holding.is_empty() {
        return Located::Unknown(format!(
            "no network namespace on this node holds {}",
            join_ips(pod_ips)
        ));
    }
    let plausible: Vec<&NetnsFacts<K>> = holding
        .iter()
        .copied()
        .filter(|c| match &uid {
            Some(u) => c.pod_uids.is_empty() || c.pod_uids.contains(u),
            None => true,
        })
        .collect();
    if plausible.is_empty() {
        return Located::Unknown(format!(
            "the network namespace holding {} belongs to another pod",
            join_ips(pod_ips)
        ));
    }
    if let Some(u) = &uid {
        let confirmed: Vec<&&NetnsFacts<K>> = plausible
            .iter()
            .filter(|c| c.pod_uids.contains(u))
            .collect();
        if let [one] = confirmed.as_slice() {
            return Located::Found(one.key.clone());
        }
        if confirmed.len() > 1 {
            return Located::Unknown(format!(
                "{} network namespaces carry pod UID {u}",
                confirmed.len()
            ));
        }
    }
    match plausible.as_slice() {
        [one] => Located::Found(one.key.clone()),
        many => Located::Unknown(format!(
            "{} network namespaces hold {}",
            many.len(),
            join_ips(pod_ips)
        )),
    }
}

/// The families whose rules a pod needs: IPv6 only when it has an IPv6 address. A pod with
/// no IP needs IPv4, the default the matcher also assumes.
pub fn required_families(pod_ips: &[IpAddr]) -> Vec<IpFamily> {
    let mut fams = Vec::new();
    if pod_ips.iter().any(IpAddr::is_ipv4) || pod_ips.is_empty() {
        fams.push(IpFamily::V4);
    }
    if pod_ips.iter().any(IpAddr::is_ipv6) {
        fams.push(IpFamily::V6);
    }
    fams
}

fn join_ips(ips: &[IpAddr]) -> String {
    ips.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Lowercases a UID and turns the systemd driver's `_` back into `-`.
pub fn normalize_uid(uid: &str) -> String {
    uid.trim().to_ascii_lowercase().replace('_', "-")
}

/// The pod UID in a `/proc/<pid>/cgroup` text, if its path is a kubelet pod cgroup.
///
/// Looks at every path segment for `pod` followed by a UUID (dashes, or the systemd driver's
/// underscores), optionally followed by `.slice`. The innermost match wins.
pub fn pod_uid_from_cgroup(text: &str) -> Option<String> {
    let mut found = None;
    for line in text.lines() {
        // v1: "N:controllers:/path", v2: "0::/path". The path may itself contain ':'.
        let Some(path) = line.splitn(3, ':').nth(2) else {
            continue;
        };
        for seg in path.split('/') {
            if let Some(uid) = uid_in_segment(seg) {
                found = Some(uid);
            }
        }
        if found.is_some() {
            break;
        }
    }
    found
}

fn uid_in_segment(seg: &str) -> Option<String> {
    let seg = seg.strip_suffix(".slice").unwrap_or(seg);
    let at = seg.rfind("pod")?;
    let cand = &seg[at + 3..];
    is_uuid(cand).then(|| normalize_uid(cand))
}

fn is_uuid(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-' || *c == b'_',
            _ => c.is_ascii_hexdigit(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f3c2a4e-1b2c-4d5e-8f90-123456789abc";
    const OTHER: &str = "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    fn ns(key: u64, addrs: &[&str], uids: &[&str]) -> NetnsFacts<u64> {
        NetnsFacts {
            key,
            addresses: addrs.iter().map(|a| ip(a)).collect(),
            pod_uids: uids.iter().map(|u| u.to_string()).collect(),
        }
    }

    #[test]
    fn cgroupfs_and_systemd_spellings() {
        let cgroupfs = format!("0::/kubepods/burstable/pod{UID}/3f1e2d\n");
        assert_eq!(pod_uid_from_cgroup(&cgroupfs).as_deref(), Some(UID));
        let systemd = format!(
            "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-abc.scope\n",
            UID.replace('-', "_")
        );
        assert_eq!(pod_uid_from_cgroup(&systemd).as_deref(), Some(UID));
        let guaranteed = format!(
            "0::/kubepods.slice/kubepods-pod{}.slice/x.scope",
            UID.replace('-', "_")
        );
        assert_eq!(pod_uid_from_cgroup(&guaranteed).as_deref(), Some(UID));
        // cgroup v1 with several hierarchies: the first pod path is taken.
        let v1 = format!(
            "12:pids:/kubepods/pod{UID}/c1\n11:memory:/kubepods/pod{UID}/c1\n1:name=systemd:/system.slice/containerd.service\n"
        );
        assert_eq!(pod_uid_from_cgroup(&v1).as_deref(), Some(UID));
        // Uppercase is normalized.
        let upper = format!("0::/kubepods/pod{}/c", UID.to_uppercase());
        assert_eq!(pod_uid_from_cgroup(&upper).as_deref(), Some(UID));
    }

    #[test]
    fn non_pod_cgroups_give_nothing() {
        for text in [
            "0::/system.slice/sshd.service\n",
            "0::/user.slice/user-0.slice/session-1.scope",
            "0::/kubepods/burstable/podnot-a-uid/c",
            "0::/kubepods.slice/kubepods-burstable.slice",
            "",
            "garbage without colons",
            "0::/kubepods/pod0f3c2a4e-1b2c-4d5e-8f90-123456789ab", // one short
        ] {
            assert_eq!(pod_uid_from_cgroup(text), None, "{text:?}");
        }
    }

    #[test]
    fn found_by_ip_alone_when_no_uids_are_known() {
        let c = [ns(1, &["10.0.0.1"], &[]), ns(2, &["10.0.0.2"], &[])];
        assert_eq!(locate(&c, &[ip("10.0.0.2")], Some(UID)), Located::Found(2));
        assert_eq!(locate(&c, &[ip("10.0.0.1")], None), Located::Found(1));
    }

    #[test]
    fn unknown_without_ip_or_match() {
        let c = [ns(1, &["10.0.0.1"], &[])];
        assert!(matches!(locate(&c, &[], Some(UID)), Located::Unknown(_)));
        match locate(&c, &[ip("10.0.0.9")], Some(UID)) {
            Located::Unknown(why) => assert!(why.contains("10.0.0.9"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn uid_rejects_a_reused_ip_and_breaks_ties() {
        // The IP now belongs to another pod's namespace: not ours.
        let c = [ns(1, &["10.0.0.1"], &[OTHER])];
        assert!(matches!(
            locate(&c, &[ip("10.0.0.1")], Some(UID)),
            Located::Unknown(_)
        ));
        // Two namespaces with the IP: the UID-confirmed one wins (systemd spelling too).
        let c = [ns(1, &["10.0.0.1"], &[]), ns(2, &["10.0.0.1"], &[UID])];
        let systemd_uid = UID.replace('-', "_");
        assert_eq!(
            locate(&c, &[ip("10.0.0.1")], Some(&systemd_uid)),
            Located::Found(2)
        );
        // Two unconfirmed namespaces: ambiguous, so unknown.
        let c = [ns(1, &["10.0.0.1"], &[]), ns(2, &["10.0.0.1"], &[])];
        assert!(matches!(
            locate(&c, &[ip("10.0.0.1")], Some(UID)),
            Located::Unknown(_)
        ));
    }

    #[test]
    fn dual_stack_pod_matches_either_address() {
        let c = [ns(7, &["fd00::7", "10.0.0.7"], &[UID])];
        assert_eq!(locate(&c, &[ip("fd00::7")], Some(UID)), Located::Found(7));
        assert_eq!(
            required_families(&[ip("10.0.0.7"), ip("fd00::7")]),
            [IpFamily::V4, IpFamily::V6]
        );
        assert_eq!(required_families(&[ip("fd00::7")]), [IpFamily::V6]);
        assert_eq!(required_families(&[]), [IpFamily::V4]);
    }

    proptest::proptest! {
        #[test]
        fn cgroup_parser_never_panics(text in ".{0,300}") {
            let _ = pod_uid_from_cgroup(&text);
        }
    }
}
