//! meshgate-core: the pure decisions behind meshgate, and the names every part shares.
//!
//! In: plain data (directory listings and file bytes, plugin probe outcomes, rule graphs, pod
//! and node metadata). Out: verdicts and decisions. Nothing here touches the filesystem, the
//! network, netlink or a Kubernetes client, so every decision is tested without a cluster.
//!
//! The string constants below are names operators write alerts and runbooks against, as
//! docs/operations.md states them ("Reading `kubectl describe node`" for the Events; "The
//! webhook's failure policy" for `meshgate.io/ignore`): they are defined once, here. The node
//! gate's names (taint key, label, condition) are `gate`'s; the field managers and User-Agents
//! meshgate's writes carry are `field_manager`'s.

pub mod admission;
pub mod cleanup;
pub mod cluster_budget;
pub mod cni;
pub mod enroll;
pub mod evict;
pub mod field_manager;
pub mod gate;
pub mod lookup;
pub mod meshes;
pub mod mode;
pub mod node_proxy;
pub mod placement;
pub mod profile;
pub mod projection;
pub mod rules;
pub mod status;

/// Namespace label that exempts a namespace from the pod admission webhook.
pub const IGNORE_NAMESPACE_LABEL: &str = "meshgate.io/ignore";

/// Event reasons (events.k8s.io/v1), from the contract's Events table.
pub mod event_reason {
    /// Node, Normal: the chain became verified.
    pub const CHAIN_VERIFIED: &str = "CNIChainVerified";
    /// Node, Warning: the chain became unverified; the note carries the verification reason.
    pub const CHAIN_UNVERIFIED: &str = "CNIChainUnverified";
    /// Pod, Warning: the pod's netns lacks the expected redirect rules.
    pub const REDIRECT_MISSING: &str = "MeshRedirectMissing";
}

/// Most bytes of an Event's note the API accepts (events.k8s.io/v1).
pub const EVENT_NOTE_MAX_BYTES: usize = 1024;

/// `text` cut to [`EVENT_NOTE_MAX_BYTES`] on a character boundary, ending in `…` when cut.
pub fn event_note(text: &str) -> String {
    if text.len() <= EVENT_NOTE_MAX_BYTES {
        return text.to_string();
    }
    let mut end = EVENT_NOTE_MAX_BYTES - '…'.len_utf8();
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}
