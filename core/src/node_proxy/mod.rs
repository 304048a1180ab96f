//! A mesh's node proxy: the per-node process a mesh's CNI plugin hands pods to (Istio
//! ambient's ztunnel). With such a mesh, a chain that is verified is not enough: istio-cni
//! writes the in-pod redirection, but a pod is only in the mesh once ztunnel on its node has
//! taken the pod: istio-cni's node agent listens on a unix socket, ztunnel connects to it and
//! receives each pod's netns over that connection, then opens its listeners inside the pod.
//!
//! In: the profile's [`NodeProxy`] record (part of [`crate::profile::MeshProfile`], so a mesh
//! declares it as data), the `--profile` names given (only a profile named there makes its
//! node proxy a requirement: [`required`]), and what the agent observed on its node
//! ([`Observed`]: the proxy's pods bound to the node with their Ready condition, what is at
//! the socket path, and whether an established connection is on that socket). Out: the
//! node's verdict ([`judge`]): the chain's own when it is not verified; otherwise `Verified`
//! only when a proxy pod is Ready, the socket is a socket and the proxy is connected to it,
//! else [`Reason::NodeProxyNotReady`] with a message naming what is missing. The pod-level
//! half (the proxy's listeners in each pod's netns) is [`pod`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::cni::{ChainVerdict, Reason};
use crate::profile::{MeshProfile, ProfileSet, is_dns_label};

/// Istio ambient's ztunnel, as istio/istio ships it: the DaemonSet's pods are labelled
/// `app: ztunnel` (`manifests/charts/ztunnel/templates/daemonset.yaml`) in `istio-system`.
/// `/var/run/ztunnel/ztunnel.sock` is LISTENED on by istio-cni's node agent
/// (`cni/pkg/nodeagent/ztunnelserver_linux.go`, `net.ListenUnix("unixpacket", ...)`; the
/// flag's default in `cni/cmd/root.go`) and ztunnel connects to it (its `INPOD_UDS`); both
/// charts mount that directory from the host (`hostPath` `/var/run/ztunnel`). Over that
/// connection ztunnel receives each ambient pod's netns and opens, inside it, inbound HBONE
/// 15008, plaintext inbound 15006 and outbound 15001.
pub fn ztunnel() -> NodeProxy {
    NodeProxy {
        name: "ztunnel".into(),
        namespace: "istio-system".into(),
        labels: BTreeMap::from([("app".to_string(), "ztunnel".to_string())]),
        socket: "/var/run/ztunnel/ztunnel.sock".into(),
        listen_ports: vec![15008, 15006, 15001],
    }
}

/// Ports a record may list in `listenPorts` at most.
pub const MAX_LISTEN_PORTS: usize = 16;

/// The node proxy a mesh needs on every node: its pods, the unix socket its CNI plugin's
/// node agent listens on and the proxy connects to (a path on the host), and the ports the
/// proxy listens on inside each of the mesh's pods.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeProxy {
    /// What messages call it (`ztunnel`).
    pub name: String,
    /// The namespace its pods run in.
    pub namespace: String,
    /// Labels every one of its pods carries (all must match).
    pub labels: BTreeMap<String, String>,
    /// The socket's absolute path on the host.
    pub socket: String,
    /// TCP ports the proxy listens on inside every pod of the mesh once it has taken the
    /// pod (ztunnel: 15008, 15006, 15001). Empty: pods are judged on their rules alone.
    #[serde(default)]
    pub listen_ports: Vec<u16>,
}

impl NodeProxy {
    /// Why the record is unusable, if it is: an empty name or label set, a namespace that
    /// is no DNS label, a relative socket path.
    pub fn problem(&self) -> Option<&'static str> {
        if self.name.is_empty() {
            return Some("nodeProxy.name is empty");
        }
        if !is_dns_label(&self.namespace) {
            return Some("nodeProxy.namespace must be a namespace name");
        }
        if self.labels.is_empty() || self.labels.keys().any(String::is_empty) {
            return Some("nodeProxy.labels must name at least one label");
        }
        if !self.socket.starts_with('/') || self.socket.contains('\0') {
            return Some("nodeProxy.socket must be an absolute path");
        }
        if self.listen_ports.len() > MAX_LISTEN_PORTS {
            return Some("nodeProxy.listenPorts lists more than 16 ports");
        }
        if self.listen_ports.contains(&0) {
            return Some("nodeProxy.listenPorts holds port 0");
        }
        let distinct: std::collections::BTreeSet<_> = self.listen_ports.iter().collect();
        if distinct.len() != self.listen_ports.len() {
            return Some("nodeProxy.listenPorts lists a port twice");
        }
        None
    }

    /// The label selector the agent lists its pods with (`app=ztunnel`).
    pub fn label_selector(&self) -> String {
        self.labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// `key=value[,key=value]` as `--node-proxy-labels` takes it.
pub fn parse_labels(s: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| format!("{pair:?} is not key=value"))?;
        if k.is_empty() {
            return Err(format!("{pair:?} has no key"));
        }
        out.insert(k.to_string(), v.to_string());
    }
    if out.is_empty() {
        return Err("no label given".into());
    }
    Ok(out)
}

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
