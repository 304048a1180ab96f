//! A mesh's node proxy: the per-node process a mesh's CNI plugin hands pods to (Istio
//! ambient's ztunnel). With such a mesh, a chain that is verified is not enough: istio-cni
//! writes the in-pod redirection, but a pod is only in the mesh once ztunnel on its node has
//! taken the pod: istio-cni's node agent listens on a unix socket, ztunnel connects to it and
//! receives each pod's netns over that connection, then opens its listeners inside the pod.
//!
//! In: the profile's [`NodeProxy`] record (part of [`crate::profile::MeshProfile`], so a mesh
//! declares it as data in its own file, as `istio-ambient` does with
//! [`crate::meshes::istio_ambient::ztunnel`]; the record is [`crate::profile::node_proxy`]'s,
//! re-exported here), the `--profile` names given (only a profile named there makes its node
//! proxy a requirement: [`required`]), and what the agent observed on its node
//! ([`Observed`]: the proxy's pods bound to the node with their Ready condition, what is at
//! the socket path, and whether an established connection is on that socket). Out: the
//! node's verdict ([`judge`]): the chain's own when it is not verified; otherwise `Verified`
//! only when a proxy pod is Ready, the socket is a socket and the proxy is connected to it,
//! else [`Reason::NodeProxyNotReady`] with a message naming what is missing. The pod-level
//! half (the proxy's listeners in each pod's netns) is [`pod`].

use crate::cni::{ChainVerdict, Reason};
use crate::profile::{MeshProfile, ProfileSet};

pub use crate::profile::node_proxy::{MAX_LISTEN_PORTS, NodeProxy, parse_labels};

/// Errors from choosing the node proxy requirement.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NodeProxyError {
    /// Two named profiles each need a node proxy; the agent watches one.
    #[error("profiles {0:?} and {1:?} both need a node proxy; name at most one of them")]
    TwoProxies(String, String),
}

/// The node proxy this node must run: the one of the profile named in `named` (the
/// `--profile` flag) that carries one. Only a profile named there counts: the default, every
/// built-in profile, gates every mesh's pods and does not mean "this cluster runs ambient",
/// so a Linkerd or sidecar-Istio cluster is never gated on a ztunnel it does not have.
pub fn required<'a>(
    set: &'a ProfileSet,
    named: &[String],
) -> Result<Option<&'a MeshProfile>, NodeProxyError> {
    let mut found: Option<&MeshProfile> = None;
    for p in set.iter().filter(|p| p.node_proxy.is_some()) {
        if !named.contains(&p.name) {
            continue;
        }
        if let Some(first) = found {
            return Err(NodeProxyError::TwoProxies(
                first.name.clone(),
                p.name.clone(),
            ));
        }
        found = Some(p);
    }
    Ok(found)
}

/// One of the proxy's pods bound to this node, as the API reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyPod {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.uid`: the agent finds the pod's network namespace by it, where the
    /// proxy's end of its connection lives.
    pub uid: String,
    /// Its `Ready` condition is `True`.
    pub ready: bool,
    /// It has a `deletionTimestamp`: it is going away.
    pub deleting: bool,
}

/// What is at the socket path on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SocketSeen {
    /// A unix socket.
    Socket,
    /// Nothing.
    Missing,
    /// Something else (`a regular file`, `a directory`).
    NotASocket(&'static str),
    /// It could not be examined (the error, as the OS said it).
    Unreadable(String),
}

/// Whether the proxy is connected to the socket: an established unix socket whose address
/// is the socket's (the listener's accepted end of the proxy's connection, which the kernel
/// creates in the *connecting* socket's network namespace: the proxy pod's), matched by the
/// socket file's device and inode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConnectionSeen {
    /// At least one such connection.
    Connected,
    /// None: nothing is connected to the listener.
    NotConnected,
    /// The socket table could not be read (the error, as the agent saw it).
    Unreadable(String),
}

/// What the agent observed of the node proxy on its node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    /// The proxy's pods on this node; `None` until the pod watch has listed them.
    pub pods: Option<Vec<ProxyPod>>,
    /// The socket.
    pub socket: SocketSeen,
    /// The connection on it (only read when the socket is a socket).
    pub connection: ConnectionSeen,
}

/// Pod names a message lists at most.
const MAX_NAMED_PODS: usize = 3;

/// The node's verdict: `chain` when it is not verified, else `Verified` only when `proxy`
/// is ready on this node: (a) a pod Ready and not being deleted, (b) its socket a socket
/// (the CNI node agent listens), (c) a connection established on it (the proxy connected).
pub fn judge(chain: ChainVerdict, proxy: &NodeProxy, seen: &Observed) -> ChainVerdict {
    if !chain.verified {
        return chain;
    }
    let mut missing = Vec::new();
    let mut ready_pod = None;
    match &seen.pods {
        None => missing.push(format!(
            "its pods ({} in {}) are not listed yet",
            proxy.label_selector(),
            proxy.namespace
        )),
        Some(pods) if pods.is_empty() => missing.push(format!(
            "no pod {} in {} on this node",
            proxy.label_selector(),
            proxy.namespace
        )),
        Some(pods) => match pods.iter().find(|p| p.ready && !p.deleting) {
            Some(p) => ready_pod = Some(p),
            None => missing.push(not_ready(proxy, pods)),
        },
    }
    match &seen.socket {
        SocketSeen::Socket => missing.extend(connection(proxy, &seen.connection)),
        SocketSeen::Missing => missing.push(format!(
            "its socket {} is missing: the CNI node agent {} connects to does not listen \
             there (istio-cni's node agent does so only in ambient mode)",
            proxy.socket, proxy.name
        )),
        SocketSeen::NotASocket(kind) => {
            missing.push(format!("{} is {kind}, not a socket", proxy.socket))
        }
        SocketSeen::Unreadable(e) => missing.push(format!(
            "its socket {} cannot be examined: {e}",
            proxy.socket
        )),
    }
    let mut v = chain;
    match (ready_pod, missing.is_empty()) {
        (Some(p), true) => {
            v.message = format!(
                "{}; {} ready: pod {}/{}, connected to {}",
                v.message, proxy.name, proxy.namespace, p.name, proxy.socket
            );
        }
        _ => {
            v.verified = false;
            v.reason = Reason::NodeProxyNotReady;
            v.message = format!(
                "the CNI chain is verified, but {} is not ready on this node: {}",
                proxy.name,
                missing.join("; ")
            );
        }
    }
    v
}

/// What (c) found wrong, if anything.
fn connection(proxy: &NodeProxy, seen: &ConnectionSeen) -> Option<String> {
    match seen {
        ConnectionSeen::Connected => None,
        ConnectionSeen::NotConnected => Some(format!(
            "{} is not connected to {}: no established connection on that socket",
            proxy.name, proxy.socket
        )),
        ConnectionSeen::Unreadable(e) => Some(format!(
            "whether {} is connected to {} cannot be read: {e}",
            proxy.name, proxy.socket
        )),
    }
}

/// "pod istio-system/ztunnel-x is not Ready", for every pod up to [`MAX_NAMED_PODS`].
fn not_ready(proxy: &NodeProxy, pods: &[ProxyPod]) -> String {
    let named = pods
        .iter()
        .take(MAX_NAMED_PODS)
        .map(|p| {
            let state = if p.deleting {
                "being deleted"
            } else {
                "not Ready"
            };
            format!("pod {}/{} is {state}", proxy.namespace, p.name)
        })
        .collect::<Vec<_>>();
    let more = pods.len().saturating_sub(MAX_NAMED_PODS);
    if more > 0 {
        format!("{} (and {more} more)", named.join(", "))
    } else {
        named.join(", ")
    }
}

pub mod pod;

#[cfg(test)]
mod tests;
