//! One namespace by path, read in one visit and checked against one profile: the one-shot
//! `inspect` subcommand's library half, also used by the privileged tests and the bench.
//!
//! In: a namespace path, a [`MeshProfile`] and the pod's annotations. Out: the namespace's
//! addresses and rules ([`NetnsContents`]), or the [`Inspection`] of them ([`check_pod`]:
//! the rules alone; [`inspect_pod`]: with a node proxy's listeners too). The daemon does
//! not come through here: it pins each surveyed namespace and reads it through the pinned
//! descriptor (`daemon::pods::inspect`), so a path that now leads elsewhere is caught.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use meshgate_core::profile::MeshProfile;
use meshgate_core::rules::{self, Inspection, IpFamily, RedirectVerdict};

use super::addr::AddrError;
use super::{Address, NetnsError, open};
use crate::netfilter::ReadError;

/// What one visit to a namespace reads: its addresses and its rules.
#[derive(Debug)]
pub struct NetnsContents {
    /// Interface addresses.
    pub addresses: Vec<Address>,
    /// NAT-relevant rules of every backend.
    pub ruleset: rules::Ruleset,
}

impl NetnsContents {
    /// The IP families of the namespace's global addresses; IPv4 alone when it has none.
    /// (The daemon uses the pod's `status.podIPs` instead:
    /// [`meshgate_core::rules::locate::required_families`].)
    pub fn families(&self) -> Vec<IpFamily> {
        let has = |v4: bool| {
            self.addresses
                .iter()
                .any(|a| a.is_global() && a.ip.is_ipv4() == v4)
        };
        let mut families = Vec::new();
        if has(true) {
            families.push(IpFamily::V4);
        }
        if has(false) {
            families.push(IpFamily::V6);
        }
        if families.is_empty() {
            families.push(IpFamily::V4);
        }
        families
    }
}

/// Enters `path` once to open the sockets, then reads its addresses and rules. Blocking.
pub fn read_netns(path: &Path) -> Result<NetnsContents, NetnsError> {
    let opened = open(path, true)?;
    Ok(NetnsContents {
        addresses: opened.addresses()?,
        ruleset: opened.ruleset()?,
    })
}

/// Reads the namespace at `path` and checks its rules against what `profile`'s mesh writes
/// for a pod with these annotations ([`meshgate_core::rules::check_pod`]); the pod's
/// families are the namespace's global addresses'. Rules or addresses past the dump caps
/// give an `unknown` inspection, never `missing`. Blocking.
pub fn check_pod(
    path: &Path,
    profile: &MeshProfile,
    annotations: &BTreeMap<String, String>,
) -> Result<Inspection, NetnsError> {
    let too_large = |e: &dyn std::fmt::Display| {
        Ok(Inspection::unknown(
            profile,
            &format!("{}: {e}", profile.name),
        ))
    };
    let contents = match read_netns(path) {
        Ok(c) => c,
        Err(NetnsError::Rules {
            source: e @ ReadError::TooLarge { .. },
            ..
        }) => return too_large(&e),
        Err(NetnsError::Addresses {
            source: e @ AddrError::TooMany(_),
            ..
        }) => return too_large(&e),
        Err(e) => return Err(e),
    };
    Ok(rules::check_pod(
        &contents.ruleset,
        profile,
        &contents.families(),
        annotations,
    ))
}

/// How long reading a namespace's listening sockets may take.
pub const LISTEN_TIMEOUT: Duration = Duration::from_secs(2);

/// [`check_pod`], then, when the rules are in place and `profile`'s node proxy listens in
/// every pod (ztunnel), its listeners in the namespace judged over them as the daemon judges
/// them ([`meshgate_core::node_proxy::pod::judge`]), with the proxy taken as ready: whether
/// it is, is the node's verdict, which needs the API and the proxy's socket. Blocking.
pub fn inspect_pod(
    path: &Path,
    profile: &MeshProfile,
    annotations: &BTreeMap<String, String>,
) -> Result<Inspection, NetnsError> {
    let rules = check_pod(path, profile, annotations)?;
    let Some(proxy) = profile
        .node_proxy
        .as_ref()
        .filter(|np| !np.listen_ports.is_empty())
    else {
        return Ok(rules);
    };
    if rules.verdict != RedirectVerdict::Redirected {
        return Ok(rules);
    }
    let listening = open(path, true)
        .and_then(|o| o.tcp_listening(Instant::now() + LISTEN_TIMEOUT))
        .map_err(|e| e.to_string());
    let listening = listening.as_ref().map_err(String::as_str);
    Ok(meshgate_core::node_proxy::pod::judge(rules, proxy, listening, true).0)
}
