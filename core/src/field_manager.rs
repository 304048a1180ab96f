//! The names meshgate's API clients go by, defined once for every binary and test.
//!
//! In: nothing. Out: the field manager each kind of write carries (the `fieldManager` query
//! parameter: what `kubectl get -o yaml --show-managed-fields` shows under `managedFields`,
//! and what an audit log's `requestURI` names), and the `User-Agent` each binary sends (an
//! audit log's `userAgent`). A write that names no field manager is recorded by the
//! apiserver under its User-Agent's product token (the text before the first `/`), so the
//! agent's User-Agent starts with [`AGENT`]: the kube `Recorder`, which sends its Events
//! without a field manager, then records them as `meshgate-agent` too.
//!
//! docs/operations.md, "Who wrote it: field managers", is the table of which writer uses
//! which name for which fields; operators filter audit logs and `managedFields` by these
//! names, so they are part of the contract and never change.

/// The agent DaemonSet: its Node's taint, label (`nodes`) and condition (`nodes/status`),
/// its Events (also their `reportingController`), the cluster-wide eviction ledger
/// (`core::cluster_budget::CONFIGMAP`) and its evictions (`pods/eviction`).
pub const AGENT: &str = "meshgate-agent";

/// `kubectl meshgate cleanup` and the chart's uninstall hook, which runs it: the removal of
/// meshgate's taint, label and condition from every Node.
pub const CLEANUP: &str = "meshgate-cleanup";

/// The webhook's User-Agent. It writes nothing through the API: a new Node's taint and label
/// travel in its admission response, and the apiserver records them under the creator of
/// the Node (the kubelet), not under the webhook.
pub const WEBHOOK: &str = "meshgate-webhook";

/// `kubectl meshgate`'s User-Agent; its only writes are [`CLEANUP`]'s (and the dry-run
/// probe pod of `status`, which is never stored).
pub const PLUGIN: &str = "kubectl-meshgate";

/// The `User-Agent` of the binary `name` ([`AGENT`], [`WEBHOOK`] or [`PLUGIN`]):
/// `name/version`, as kubectl sends `kubectl/v1.35.4 (...)`.
pub fn user_agent(name: &str) -> String {
    format!("{name}/{}", env!("CARGO_PKG_VERSION"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The apiserver takes a write's default field manager from the User-Agent's text before
    /// the first `/`: for the agent, that must be its own field manager.
    #[test]
    fn the_agents_user_agent_defaults_to_its_field_manager() {
        let ua = user_agent(AGENT);
        assert_eq!(ua.split('/').next(), Some(AGENT));
        assert_eq!(ua, format!("meshgate-agent/{}", env!("CARGO_PKG_VERSION")));
    }

    /// The apiserver refuses a field manager longer than 128 bytes; every name is a DNS label.
    #[test]
    fn every_name_is_a_short_dns_label() {
        for name in [AGENT, CLEANUP, WEBHOOK, PLUGIN] {
            assert!(name.len() <= 63, "{name}");
            assert!(
                name.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'),
                "{name}"
            );
        }
    }
}
