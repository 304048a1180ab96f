//! One sweep: a batch of pod inspections on a blocking thread (the node's namespaces surveyed
//! once, then each pod located, pinned and read).
//!
//! In: the pods due ([`Job`]: UID, IPs, annotations, the profiles that select it, and the
//! required node proxy's check: [`ProxyCheck`]) and the netns directories. Out: per pod,
//! one [`Inspection`] per profile, the namespace it was read from, the time it took, and,
//! when a redirect is missing, that namespace held open for the pre-eviction re-check
//! ([`Inspected`]).
//!
//! The node's namespaces are surveyed once per batch (`/proc` scan plus their addresses),
//! each pod is attributed to one of them by IP and UID (`core::rules::locate`), and that
//! namespace is pinned (opened once, checked to be the surveyed device and inode: a reused
//! pid or re-created netns entry is caught here) and entered through the pinned descriptor;
//! its addresses must still hold every pod IP, then its rules are read once and matched
//! against every profile selecting the pod. For the profile whose node proxy the node
//! requires (ambient's ztunnel), the namespace's listening TCP ports are read too (one
//! inet sock_diag dump) and `core::node_proxy::pod::judge` puts them over the rules' verdict.
//! Anything that keeps a pod from being read makes it `unknown`, which never evicts.
//! Everything here blocks (setns, netlink): call it from `spawn_blocking`, never from an
//! async worker.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use meshgate_core::node_proxy::NodeProxy;
use meshgate_core::profile::MeshProfile;
use meshgate_core::rules::locate::{self, Located, NetnsFacts};
use meshgate_core::rules::{self, Inspection, RedirectVerdict};

use crate::netns::LISTEN_TIMEOUT;
use crate::netns::{self, NetnsError, NetnsRef, Pinned};

/// One pod to inspect.
#[derive(Clone, Debug)]
pub struct Job {
    /// `metadata.uid`, for the UID cross-check against the namespaces' cgroups.
    pub uid: String,
    /// `status.podIPs`.
    pub ips: Vec<IpAddr>,
    /// `metadata.annotations`: the rules a mesh writes follow from them (Istio's
    /// `traffic.sidecar.istio.io/*` and `sidecar.istio.io/interceptionMode`, Linkerd's
    /// `config.linkerd.io/skip-*`), so the expected rules are derived from them at the
    /// `rules::check_pod` call in [`inspect_one`].
    pub annotations: BTreeMap<String, String>,
    /// The profiles that select it.
    pub profiles: Vec<MeshProfile>,
    /// The node proxy the node requires, when there is one.
    pub node_proxy: Option<ProxyCheck>,
}

/// The node proxy a profile's pods must be taken by, and whether it is ready on the node.
#[derive(Clone, Debug)]
pub struct ProxyCheck {
    /// The profile that requires it (`istio-ambient`).
    pub profile: String,
    /// Its record: the ports it listens on in each pod.
    pub proxy: NodeProxy,
    /// The node's verdict is verified (so the proxy is ready): missing listeners may evict.
    pub ready: bool,
    /// UIDs of its Ready pods on the node, where its connection is looked for again.
    pub pods: Vec<String>,
}

/// One pod's inspection.
#[derive(Debug)]
pub struct Inspected {
    /// One per profile of the job, in its order.
    pub inspections: Vec<Inspection>,
    /// The namespace that was read, when one was attributed to the pod.
    pub netns: Option<PathBuf>,
    /// That namespace, held open, when some profile's redirects are missing: the daemon
    /// re-checks it ([`Pinned::confirm`]) before evicting. `None` otherwise, so a batch holds
    /// descriptors only for the pods it may act on.
    pub pinned: Option<Pinned>,
    /// Time spent on this pod: locating, reading and matching.
    pub elapsed: Duration,
    /// The profile whose `missing` verdict must not evict: the node proxy's listeners are
    /// what is missing, and the proxy is not ready (`core::node_proxy::pod::judge`).
    pub held: Option<String>,
}

/// What one batch found.
#[derive(Debug)]
pub struct Batch {
    /// One per job, in job order.
    pub pods: Vec<Inspected>,
    /// Time of the node-wide namespace survey the batch started with.
    pub survey: Duration,
    /// Namespaces found.
    pub namespaces: usize,
    /// Namespaces that could not be read during the survey (logged by the caller).
    pub survey_errors: Vec<String>,
}

/// The pod's verdict over every profile that selects it: `missing` as soon as one profile's
/// redirects are missing (the pod is evicted for it), else `unknown` if one could not be
/// told, else `redirected`. Among missing ones, a profile whose proxy container the pod runs
/// (`has_proxy(profile name)`) goes first: a pod without one profile's proxy is still
/// evicted for another mesh it does belong to. The inspection returned is the one that
/// decided.
pub fn combine(
    inspections: &[Inspection],
    has_proxy: impl Fn(&str) -> bool,
) -> Option<&Inspection> {
    inspections
        .iter()
        .find(|i| i.verdict == RedirectVerdict::Missing && has_proxy(&i.profile))
        .or_else(|| {
            inspections
                .iter()
                .find(|i| i.verdict == RedirectVerdict::Missing)
        })
        .or_else(|| {
            inspections
                .iter()
                .find(|i| i.verdict == RedirectVerdict::Unknown)
        })
        .or_else(|| inspections.first())
}

fn all_unknown(profiles: &[MeshProfile], why: &str) -> Vec<Inspection> {
    profiles
        .iter()
        .map(|p| Inspection::unknown(p, why))
        .collect()
}

/// What one pinned visit read: the rules, and the listening ports when asked for (or why
/// they could not be read).
type Read = (
    Pinned,
    rules::Ruleset,
    Option<Result<BTreeSet<u16>, String>>,
);

/// Pins the namespace, checks it still holds every pod IP, and reads its rules (and, with
/// `listeners`, its listening TCP ports) through the pinned descriptor.
fn read_pinned(r: &NetnsRef, ips: &[IpAddr], listeners: bool) -> Result<Read, NetnsError> {
    let pinned = r.pin()?;
    let opened = pinned.open_rules(listeners)?;
    let addresses = opened.addresses()?;
    if let Some(ip) = netns::missing_ip(&addresses, ips) {
        return Err(NetnsError::PodIpGone {
            path: r.path.clone(),
            ip,
        });
    }
    let ruleset = opened.ruleset()?;
    let listening = listeners.then(|| {
        opened
            .tcp_listening(Instant::now() + LISTEN_TIMEOUT)
            .map_err(|e| e.to_string())
    });
    Ok((pinned, ruleset, listening))
}

/// `profile`'s inspection of the rules, with the node proxy's listeners over it when the
/// node requires that profile's proxy; and whether it must not evict.
fn judge(
    ruleset: &rules::Ruleset,
    p: &MeshProfile,
    job: &Job,
    listening: Option<&Result<BTreeSet<u16>, String>>,
) -> (Inspection, bool) {
    let families = locate::required_families(&job.ips);
    // What the mesh writes follows from the profile and the pod's annotations (opt-outs
    // of a direction or family), so a pod that opted out is not missing.
    let inspection = rules::check_pod(ruleset, p, &families, &job.annotations);
    match (&job.node_proxy, listening) {
        (Some(np), Some(l)) if np.profile == p.name => {
            let l = l.as_ref().map_err(String::as_str);
            meshgate_core::node_proxy::pod::judge(inspection, &np.proxy, l, np.ready)
        }
        _ => (inspection, false),
    }
}

/// Inspects one pod against the surveyed namespaces.
pub fn inspect_one(facts: &[NetnsFacts<NetnsRef>], job: &Job) -> Inspected {
    let start = Instant::now();
    let mut held = None;
    let (inspections, netns, pinned) = match locate::locate(facts, &job.ips, Some(&job.uid)) {
        Located::Unknown(why) => (all_unknown(&job.profiles, &why), None, None),
        Located::Found(r) => match read_pinned(&r, &job.ips, wants_listeners(job)) {
            Ok((pinned, ruleset, listening)) => {
                let mut inspections = Vec::with_capacity(job.profiles.len());
                for p in &job.profiles {
                    let (i, hold) = judge(&ruleset, p, job, listening.as_ref());
                    if hold {
                        held = Some(p.name.clone());
                    }
                    inspections.push(i);
                }
                let missing = inspections
                    .iter()
                    .any(|i| i.verdict == RedirectVerdict::Missing);
                (inspections, Some(r.path), missing.then_some(pinned))
            }
            Err(e) => (
                all_unknown(&job.profiles, &e.to_string()),
                Some(r.path),
                None,
            ),
        },
    };
    Inspected {
        inspections,
        netns,
        pinned,
        elapsed: start.elapsed(),
        held,
    }
}

/// True when one of the job's profiles is the one whose node proxy's listeners count.
fn wants_listeners(job: &Job) -> bool {
    job.node_proxy.as_ref().is_some_and(|np| {
        !np.proxy.listen_ports.is_empty() && job.profiles.iter().any(|p| p.name == np.profile)
    })
}

/// The jobs with the node proxy's readiness confirmed right now: the verdict the jobs were
/// built from may be up to one connection poll old, and a proxy that just went away has
/// also just closed its listeners in every pod. Without its connection on the socket, no
/// job's missing listeners may evict. Blocking.
pub fn confirm_ready(mut jobs: Vec<Job>) -> Vec<Job> {
    let Some(np) = jobs
        .iter()
        .find_map(|j| j.node_proxy.as_ref().filter(|n| n.ready))
    else {
        return jobs;
    };
    let deadline = Instant::now() + LISTEN_TIMEOUT;
    let (_, connection) =
        crate::daemon::node_proxy::look_blocking(Path::new(&np.proxy.socket), &np.pods, deadline);
    if connection != meshgate_core::node_proxy::ConnectionSeen::Connected {
        for np in jobs.iter_mut().filter_map(|j| j.node_proxy.as_mut()) {
            np.ready = false;
        }
    }
    jobs
}

/// Surveys the node's namespaces once and inspects every job. Blocking.
pub fn run(jobs: &[Job], netns_dirs: &[PathBuf]) -> Batch {
    let start = Instant::now();
    let (facts, survey_errors) = match netns::survey(netns_dirs) {
        Ok((facts, errors)) => (facts, errors.iter().map(ToString::to_string).collect()),
        Err(e) => {
            // Without a survey no pod can be located: all unknown, none evicted.
            let why = format!("cannot survey the node's network namespaces: {e}");
            return Batch {
                pods: jobs
                    .iter()
                    .map(|j| Inspected {
                        inspections: all_unknown(&j.profiles, &why),
                        netns: None,
                        pinned: None,
                        elapsed: Duration::ZERO,
                        held: None,
                    })
                    .collect(),
                survey: start.elapsed(),
                namespaces: 0,
                survey_errors: vec![why],
            };
        }
    };
    let survey = start.elapsed();
    Batch {
        pods: jobs.iter().map(|j| inspect_one(&facts, j)).collect(),
        survey,
        namespaces: facts.len(),
        survey_errors,
    }
}

/// `<profile> redirects <verdict> in <netns>: <what>` for the deciding inspection.
pub fn summary(decided: &Inspection, netns: Option<&Path>) -> String {
    // The matcher's message already starts with the profile name.
    let what = decided
        .message
        .strip_prefix(&format!("{}: ", decided.profile))
        .unwrap_or(&decided.message);
    match netns {
        Some(p) => format!(
            "{} redirects {} in {}: {what}",
            decided.profile,
            decided.verdict,
            p.display(),
        ),
        None => format!("{} redirects {}: {what}", decided.profile, decided.verdict),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgate_core::rules::Ruleset;

    fn profile(name: &str) -> MeshProfile {
        meshgate_core::meshes::builtin_named(name).expect("built-in")
    }

    fn missing(name: &str) -> Inspection {
        rules::check_pod(&Ruleset::default(), &profile(name), &[], &BTreeMap::new())
    }

    #[test]
    fn missing_wins_over_unknown_and_redirected() {
        let unknown = Inspection::unknown(&profile("istio"), "no netns");
        let mut redirected = missing("istio-ambient");
        redirected.verdict = RedirectVerdict::Redirected;
        assert_eq!(missing("linkerd").verdict, RedirectVerdict::Missing);

        let any = |_: &str| true;
        let all = [redirected.clone(), unknown.clone(), missing("linkerd")];
        assert_eq!(
            combine(&all, any).map(|i| i.profile.as_str()),
            Some("linkerd")
        );
        let no_missing = [redirected.clone(), unknown.clone()];
        assert_eq!(
            combine(&no_missing, any).map(|i| i.verdict),
            Some(RedirectVerdict::Unknown)
        );
        assert_eq!(
            combine(std::slice::from_ref(&redirected), any).map(|i| i.verdict),
            Some(RedirectVerdict::Redirected)
        );
        assert!(combine(&[], any).is_none());
    }

    #[test]
    fn a_missing_verdict_of_a_mesh_whose_proxy_runs_decides_first() {
        // Labelled for both meshes, running only linkerd's proxy: the linkerd verdict
        // decides (the pod is linkerd's to evict), not istio's.
        let both = [missing("istio"), missing("linkerd")];
        let only_linkerd = |p: &str| p == "linkerd";
        assert_eq!(
            combine(&both, only_linkerd).map(|i| i.profile.as_str()),
            Some("linkerd")
        );
        // No proxy for any: the first missing one is still the one reported.
        assert_eq!(
            combine(&both, |_| false).map(|i| i.profile.as_str()),
            Some("istio")
        );
    }

    #[test]
    fn a_pod_no_namespace_holds_is_unknown() {
        let job = Job {
            node_proxy: None,
            uid: "u1".into(),
            ips: vec!["10.99.0.1".parse().unwrap()],
            annotations: BTreeMap::new(),
            profiles: vec![profile("linkerd"), profile("istio")],
        };
        let facts: Vec<NetnsFacts<NetnsRef>> = Vec::new();
        let got = inspect_one(&facts, &job);
        assert_eq!(got.netns, None);
        assert!(got.pinned.is_none());
        assert_eq!(got.inspections.len(), 2);
        assert!(
            got.inspections
                .iter()
                .all(|i| i.verdict == RedirectVerdict::Unknown && i.message.contains("10.99.0.1")),
            "{:?}",
            got.inspections
        );
    }

    #[test]
    fn summary_names_profile_verdict_and_namespace() {
        let m = missing("linkerd");
        let s = summary(&m, Some(Path::new("/var/run/netns/x")));
        assert!(
            s.starts_with("linkerd redirects missing in /var/run/netns/x: no inbound"),
            "{s}"
        );
        assert!(summary(&m, None).starts_with("linkerd redirects missing: "));
    }
}
