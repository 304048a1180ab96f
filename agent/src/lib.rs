//! meshgate-agent: the thin I/O edges around `meshgate-core` on one node.
//!
//! - [`cni`]: reads the CNI config dir and probes plugin binaries → `core::cni` verdicts.
//! - [`check`]: the one-shot `check` subcommand.
//! - [`netns`], [`netfilter`]: find pod network namespaces and read their NAT rules →
//!   `core::rules` graphs, over [`netlink`] sockets (close-on-exec); [`inspect`] is the one-shot `inspect` subcommand.
//! - [`daemon`]: the `run` subcommand that keeps the Node in step with the verdict.

pub mod check;
pub mod cni;
pub mod daemon;
pub mod inspect;
pub mod netfilter;
pub mod netlink;
pub mod netns;

/// Output format of the one-shot subcommands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Human-readable lines.
    Text,
    /// One JSON object on stdout.
    Json,
}
