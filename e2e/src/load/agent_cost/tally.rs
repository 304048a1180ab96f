//! Counting a fleet's audited requests: by kind, by node, per second, and the watches still
//! open. Pure: the audit reader ([`crate::harness::audit`]) supplies the requests.
//!
//! In: [`Request`]s and the fleet's node names. Out: counts for the tables and the goals.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use crate::harness::audit::Request;

/// Requests by `verb resource[/subresource]`.
pub fn by_kind<'a>(requests: impl IntoIterator<Item = &'a Request>) -> BTreeMap<String, usize> {
    let mut kinds = BTreeMap::new();
    for r in requests {
        *kinds.entry(r.kind()).or_default() += 1;
    }
    kinds
}

/// The LIST requests among `requests` (a watcher's initial or repeated list).
pub fn lists(requests: &[Request]) -> usize {
    requests.iter().filter(|r| r.verb == "list").count()
}

/// The node of `nodes` a request is about: the object it names (its Node), or the field
/// selector of its URI (`metadata.name=<node>`, `spec.nodeName=<node>`). `None` for what no
/// node's name appears in (the mode ConfigMap's and the Namespaces' watches, Events). Node
/// names must not be prefixes of each other (the fleet pads its indices).
pub fn node_of<'a>(r: &Request, nodes: &'a [String]) -> Option<&'a str> {
    nodes
        .iter()
        .find(|n| r.name == **n || selects(&r.uri, n))
        .map(String::as_str)
}

/// Whether a URI's query selects `name` (`%3D<name>` or `=<name>`, followed by the end of
/// the value).
fn selects(uri: &str, name: &str) -> bool {
    ["%3D", "="].iter().any(|eq| {
        let needle = format!("{eq}{name}");
        uri.match_indices(&needle).any(|(at, _)| {
            let rest = &uri[at + needle.len()..];
            rest.is_empty() || rest.starts_with('&') || rest.starts_with("%2C")
        })
    })
}

/// The watches among `requests` that have not completed (still streaming), by kind
/// (`watch nodes`, `watch pods`, ...).
pub fn open_watches(requests: &[Request]) -> BTreeMap<String, usize> {
    by_kind(requests.iter().filter(|r| r.verb == "watch" && !r.complete))
}

/// For each node, its open watches by resource (only the ones naming the node).
pub fn open_watches_by_node(
    requests: &[Request],
    nodes: &[String],
) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> =
        nodes.iter().map(|n| (n.clone(), Vec::new())).collect();
    for r in requests.iter().filter(|r| r.verb == "watch" && !r.complete) {
        if let Some(n) = node_of(r, nodes) {
            out.entry(n.to_owned())
                .or_default()
                .push(r.resource.clone());
        }
    }
    for v in out.values_mut() {
        v.sort();
    }
    out
}

/// The largest count of one second.
pub fn peak(per_second: &[usize]) -> usize {
    per_second.iter().copied().max().unwrap_or(0)
}

/// Requests received in each second from `from` on, for `seconds` seconds.
pub fn per_second(requests: &[Request], from: SystemTime, seconds: usize) -> Vec<usize> {
    let mut buckets = vec![0; seconds];
    for r in requests {
        let Ok(after) = r.received.duration_since(from) else {
            continue;
        };
        if let Some(b) = buckets.get_mut(after.as_secs() as usize) {
            *b += 1;
        }
    }
    buckets
}

/// When the burst in `buckets` is over: the end of the last second above `steady` requests
/// (`Duration::ZERO` when none is).
pub fn settled(buckets: &[usize], steady: usize) -> Duration {
    let last = buckets.iter().rposition(|&b| b > steady);
    Duration::from_secs(last.map_or(0, |i| i as u64 + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(verb: &str, resource: &str, name: &str, uri: &str, complete: bool, s: u64) -> Request {
        Request {
            audit_id: format!("{verb}{resource}{name}{s}"),
            user: "u".into(),
            impersonated_user: None,
            verb: verb.into(),
            resource: resource.into(),
            subresource: String::new(),
            namespace: String::new(),
            name: name.into(),
            uri: uri.into(),
            code: Some(200),
            complete,
            received: SystemTime::UNIX_EPOCH + Duration::from_millis(s),
            annotations: BTreeMap::new(),
        }
    }

    #[test]
    fn requests_are_told_apart_by_the_node_they_name() {
        let nodes = vec!["n-001".to_string(), "n-0011".to_string()];
        let pods = req(
            "watch",
            "pods",
            "",
            "/api/v1/pods?fieldSelector=spec.nodeName%3Dn-001&watch=true",
            false,
            0,
        );
        let node = req(
            "watch",
            "nodes",
            "",
            "/api/v1/nodes?fieldSelector=metadata.name%3Dn-0011&watch=true",
            false,
            0,
        );
        let patch = req("patch", "nodes", "n-0011", "/api/v1/nodes/n-0011", true, 0);
        let ns = req(
            "watch",
            "namespaces",
            "",
            "/api/v1/namespaces?watch=true",
            false,
            0,
        );
        assert_eq!(node_of(&pods, &nodes), Some("n-001"));
        assert_eq!(node_of(&node, &nodes), Some("n-0011"));
        assert_eq!(node_of(&patch, &nodes), Some("n-0011"));
        assert_eq!(node_of(&ns, &nodes), None);
        let all = [pods, node, patch, ns];
        let open = open_watches(&all);
        assert_eq!(open.get("watch pods"), Some(&1));
        assert_eq!(open.get("watch namespaces"), Some(&1));
        assert_eq!(open.values().sum::<usize>(), 3);
        let per_node = open_watches_by_node(&all, &nodes);
        assert_eq!(per_node["n-001"], vec!["pods"]);
        assert_eq!(per_node["n-0011"], vec!["nodes"]);
        assert_eq!(lists(&all), 0);
    }

    #[test]
    fn the_burst_ends_after_the_last_second_above_steady() {
        let at = |ms| req("get", "nodes", "x", "/", true, ms);
        let all = [at(100), at(200), at(1_500), at(4_100), at(9_000)];
        let b = per_second(&all, SystemTime::UNIX_EPOCH, 6);
        assert_eq!(b, vec![2, 1, 0, 0, 1, 0]);
        assert_eq!(settled(&b, 1), Duration::from_secs(1));
        assert_eq!(settled(&b, 0), Duration::from_secs(5));
        assert_eq!(settled(&b, 2), Duration::ZERO);
    }
}
