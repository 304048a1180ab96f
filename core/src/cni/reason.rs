//! The contract's verification reasons: the one word a chain verdict carries, shared by
//! selection ([`super::select`]) and the verdict ([`super::verdict`]).
//!
//! In: nothing. Out: [`Reason`], its spelling in conditions, JSON and metric labels, and its
//! parser.

use serde::{Deserialize, Serialize};

/// The contract's verification reasons.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Reason {
    /// The effective config chains every required plugin after a primary plugin, and every
    /// plugin binary answers VERSION supporting the config's cniVersion.
    Verified,
    /// No `.conf`, `.conflist` or `.json` file in the config directory.
    NoConfig,
    /// The effective file does not load as the runtime loads it (not JSON for Go, a wrong
    /// value type, no plugins, a bad drop-in, ...), CRI-O skips every file, or the file
    /// cannot be verified (over the read budget, a FIFO or device).
    ConfigInvalid,
    /// The effective config lacks a required plugin type.
    ChainedPluginMissing,
    /// A required chained plugin is first in the chain: nothing before it creates the interface.
    PrimaryPluginMissing,
    /// A plugin type in the chain has no file of that name in any CNI bin dir.
    PluginBinaryMissing,
    /// A plugin file exists but is not a usable plugin.
    PluginBinaryBroken,
    /// The chain is verified, but the mesh's node proxy (Istio ambient's ztunnel) is not
    /// ready on the node: no Ready pod of it there, or its socket missing
    /// ([`crate::node_proxy`]).
    NodeProxyNotReady,
}

impl Reason {
    /// Every reason, for metrics pre-registration and docs.
    pub const ALL: [Reason; 8] = [
        Reason::Verified,
        Reason::NoConfig,
        Reason::ConfigInvalid,
        Reason::ChainedPluginMissing,
        Reason::PrimaryPluginMissing,
        Reason::PluginBinaryMissing,
        Reason::PluginBinaryBroken,
        Reason::NodeProxyNotReady,
    ];

    /// The reason as written in conditions, JSON and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Verified => "Verified",
            Reason::NoConfig => "NoConfig",
            Reason::ConfigInvalid => "ConfigInvalid",
            Reason::ChainedPluginMissing => "ChainedPluginMissing",
            Reason::PrimaryPluginMissing => "PrimaryPluginMissing",
            Reason::PluginBinaryMissing => "PluginBinaryMissing",
            Reason::PluginBinaryBroken => "PluginBinaryBroken",
            Reason::NodeProxyNotReady => "NodeProxyNotReady",
        }
    }

    /// Parses a reason as written by [`Reason::as_str`].
    pub fn parse(s: &str) -> Option<Reason> {
        Reason::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
