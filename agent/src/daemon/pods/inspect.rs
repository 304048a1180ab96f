//! One batch of pod inspections, on a blocking thread.
//!
//! In: the pods due ([`Job`]: UID, IPs, the profiles that select it) and the netns
//! directories. Out: per pod, one [`Inspection`] per profile, the namespace it was read from,
//! and the time it took ([`Inspected`]).
//!
//! The node's namespaces are surveyed once per batch (`/proc` scan plus their addresses),
//! each pod is attributed to one of them by IP and UID (`core::rules::locate`), and that
//! namespace's rules are read once and matched against every profile selecting the pod.
//! Anything that keeps a pod from being read makes it `unknown`, which never evicts.
//! Everything here blocks (setns, netlink): call it from `spawn_blocking`, never from an
//! async worker.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use meshgate_core::profile::MeshProfile;
use meshgate_core::rules::locate::{self, Located, NetnsFacts};
use meshgate_core::rules::{self, Inspection, Verdict};

use crate::inspect::read_netns;
use crate::netns::{self, NetnsRef};

/// One pod to inspect.
#[derive(Clone, Debug)]
pub struct Job {
    /// `metadata.uid`, for the UID cross-check against the namespaces' cgroups.
    pub uid: String,
    /// `status.podIPs`.
    pub ips: Vec<IpAddr>,
    /// The profiles that select it.
    pub profiles: Vec<MeshProfile>,
}

/// One pod's inspection.
#[derive(Clone, Debug)]
pub struct Inspected {
    /// One per profile of the job, in its order.
    pub inspections: Vec<Inspection>,
    /// The namespace that was read, when one was attributed to the pod.
    pub netns: Option<PathBuf>,
    /// Time spent on this pod: locating, reading and matching.
    pub elapsed: Duration,
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
/// told, else `redirected`. The inspection returned is the one that decided.
pub fn combine(inspections: &[Inspection]) -> Option<&Inspection> {
    inspections
        .iter()
        .find(|i| i.verdict == Verdict::Missing)
        .or_else(|| inspections.iter().find(|i| i.verdict == Verdict::Unknown))
        .or_else(|| inspections.first())
}

fn all_unknown(profiles: &[MeshProfile], why: &str) -> Vec<Inspection> {
    profiles
        .iter()
        .map(|p| Inspection::unknown(p, why))
        .collect()
}

/// Inspects one pod against the surveyed namespaces.
fn inspect_one(facts: &[NetnsFacts<NetnsRef>], job: &Job) -> Inspected {
    let start = Instant::now();
    let (inspections, netns) = match locate::locate(facts, &job.ips, Some(&job.uid)) {
        Located::Unknown(why) => (all_unknown(&job.profiles, &why), None),
        Located::Found(r) => match read_netns(&r.path) {
            Ok(contents) => {
                let families = locate::required_families(&job.ips);
                let inspections = job
                    .profiles
                    .iter()
                    .map(|p| rules::check(&contents.ruleset, p, &families))
                    .collect();
                (inspections, Some(r.path))
            }
            Err(e) => (all_unknown(&job.profiles, &e.to_string()), Some(r.path)),
        },
    };
    Inspected {
        inspections,
        netns,
        elapsed: start.elapsed(),
    }
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
                        elapsed: Duration::ZERO,
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
    use meshgate_core::profile::ProfileSet;
    use meshgate_core::rules::Ruleset;

    fn profile(name: &str) -> MeshProfile {
        ProfileSet::all_builtin()
            .get(name)
            .cloned()
            .expect("built-in")
    }

    fn missing(name: &str) -> Inspection {
        rules::check(&Ruleset::default(), &profile(name), &[])
    }

    #[test]
    fn missing_wins_over_unknown_and_redirected() {
        let unknown = Inspection::unknown(&profile("istio"), "no netns");
        let mut redirected = missing("istio-ambient");
        redirected.verdict = Verdict::Redirected;
        assert_eq!(missing("linkerd").verdict, Verdict::Missing);

        let all = [redirected.clone(), unknown.clone(), missing("linkerd")];
        assert_eq!(combine(&all).map(|i| i.profile.as_str()), Some("linkerd"));
        let no_missing = [redirected.clone(), unknown.clone()];
        assert_eq!(
            combine(&no_missing).map(|i| i.verdict),
            Some(Verdict::Unknown)
        );
        assert_eq!(
            combine(std::slice::from_ref(&redirected)).map(|i| i.verdict),
            Some(Verdict::Redirected)
        );
        assert!(combine(&[]).is_none());
    }

    #[test]
    fn a_pod_no_namespace_holds_is_unknown() {
        let job = Job {
            uid: "u1".into(),
            ips: vec!["10.99.0.1".parse().unwrap()],
            profiles: vec![profile("linkerd"), profile("istio")],
        };
        let facts: Vec<NetnsFacts<NetnsRef>> = Vec::new();
        let got = inspect_one(&facts, &job);
        assert_eq!(got.netns, None);
        assert_eq!(got.inspections.len(), 2);
        assert!(
            got.inspections
                .iter()
                .all(|i| i.verdict == Verdict::Unknown && i.message.contains("10.99.0.1")),
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
