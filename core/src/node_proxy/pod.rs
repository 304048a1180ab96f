//! The pod-level half of a node proxy: is the pod taken by it? ztunnel, once istio-cni's
//! node agent hands it a pod's netns, opens its listeners inside that netns (15008, 15006,
//! 15001); the in-pod redirect rules istio-cni writes send traffic to them. Rules without
//! listeners send the pod's traffic nowhere.
//!
//! In: the pod's [`Inspection`] of its rules ([`crate::rules::check_pod`]), the profile's
//! [`NodeProxy`] record, the TCP ports in LISTEN state in the pod's netns (or why they could
//! not be read), and whether the node proxy is ready on this node (the node's verdict,
//! [`super::judge`]). Out: the pod's inspection: `redirected` only when the rules are and
//! every one of the record's `listen_ports` listens; listeners missing make it `missing`,
//! evicted by the usual policy while the proxy is ready and held (reported, never evicted)
//! while it is not, so a proxy restart does not evict every pod of the mesh on the node.

use std::collections::BTreeSet;

use super::NodeProxy;
use crate::rules::{Inspection, RedirectVerdict};

/// The pod's inspection with the proxy's listeners over its rules' (see the module doc),
/// and whether it must not evict: `true` when the listeners are missing while the proxy is
/// not ready (the pod is `missing`, reported, never evicted:
/// [`crate::evict::SkipWhy::NodeProxyNotReady`]).
pub fn judge(
    rules: Inspection,
    proxy: &NodeProxy,
    listening: Result<&BTreeSet<u16>, &str>,
    proxy_ready: bool,
) -> (Inspection, bool) {
    if proxy.listen_ports.is_empty() || rules.verdict != RedirectVerdict::Redirected {
        return (rules, false);
    }
    let mut out = rules;
    let listening = match listening {
        Ok(l) => l,
        Err(why) => {
            out.verdict = RedirectVerdict::Unknown;
            out.message = format!(
                "{}; {}'s listeners in the pod's netns cannot be read: {why}",
                out.message, proxy.name
            );
            return (out, false);
        }
    };
    let absent: Vec<String> = proxy
        .listen_ports
        .iter()
        .filter(|p| !listening.contains(p))
        .map(u16::to_string)
        .collect();
    if absent.is_empty() {
        out.message = format!("{}; {} listens in the pod's netns", out.message, proxy.name);
        return (out, false);
    }
    let taken = format!(
        "{} has not taken this pod: no listener on {} in its netns",
        proxy.name,
        absent.join(", ")
    );
    out.verdict = RedirectVerdict::Missing;
    if proxy_ready {
        out.message = taken;
    } else {
        out.message = format!(
            "{taken}; not evicted while {} is not ready on this node",
            proxy.name
        );
    }
    (out, !proxy_ready)
}

#[cfg(test)]
mod tests;
