//! meshgate-agent: the thin I/O edges around `meshgate-core` on one node.
//!
//! - [`cni`]: reads the CNI config dir and probes plugin binaries → `core::cni` verdicts.
//! - [`netns`], [`netfilter`]: find pod network namespaces and read their NAT rules →
//!   `core::rules` graphs, over [`netlink`] sockets (close-on-exec).
//! - [`daemon`]: the `run` subcommand that keeps the Node in step with the verdict.
//! - [`cli`]: the one-shot `check` and `inspect` subcommands (no library module imports
//!   from it).
//! - [`plugin`]: the kubectl plugin `kubectl-meshgate` (`status`, `cleanup`), a second
//!   binary; it talks to the API only.

pub mod cli;
pub mod cni;
pub mod daemon;
pub mod netfilter;
pub mod netlink;
pub mod netns;
pub mod plugin;
pub mod sock_diag;
