//! The one-shot subcommands: `check` (the node's CNI chain, once) and `inspect` (one pod
//! network namespace, once).
//!
//! In: their parsed arguments. Out: the verdict on stdout (text or one JSON object) and the
//! exit code. They sit on top of the library modules and nothing below imports from here.
//!
//! They read the node's files and one netns, never the API or a node proxy's socket, so
//! what the daemon also judges from those (a node proxy's readiness) is named in each
//! verdict's `not_judged` list rather than assumed.

pub mod check;
pub mod inspect;

use meshgate_core::profile::MeshProfile;

/// Output format of the one-shot subcommands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Human-readable lines.
    Text,
    /// One JSON object on stdout.
    Json,
}

/// What the daemon judges of `profile` and a one-shot command cannot: whether its node proxy
/// is ready on the node (a Ready pod of it, connected on its socket) needs the API and the
/// socket. `None` for a mesh without one.
pub fn node_proxy_not_judged(profile: &MeshProfile) -> Option<String> {
    profile.node_proxy.as_ref().map(|np| {
        format!(
            "{}: whether {} is ready on this node (a Ready {} pod in {}, connected on {}); until it is, the daemon's node verdict is NodeProxyNotReady and it evicts no pod for missing listeners",
            profile.name, np.name, np.name, np.namespace, np.socket
        )
    })
}
