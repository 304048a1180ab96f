//! The node proxy record a profile may carry: which pods are the mesh's per-node proxy, the
//! host socket its CNI plugin's node agent listens on, and the ports it opens in each pod.
//!
//! In: the record as a mesh file builds it, as a profile file writes it (`nodeProxy`), or
//! the `--node-proxy-labels` text. Out: the record, whether it is usable
//! ([`NodeProxy::problem`]) and the label selector its pods are listed with. What "ready"
//! means is judged in [`crate::node_proxy`], which reads this record; the record reads
//! nothing of that module, so profiles depend on it one way.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::is_dns_label;

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
