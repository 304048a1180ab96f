//! The key of meshgate's taint (`--taint-key`): one validated setting the agent, the webhook,
//! the ValidatingAdmissionPolicy and the alerts share.
//!
//! In: the flag's text. Out: a [`TaintKey`] (a Kubernetes qualified name, as the apiserver
//! validates a taint key), or an [`InvalidTaintKey`] naming what is wrong; and the keys an
//! earlier release or configuration may have left on a Node ([`TaintKey::superseded`]), which
//! the agent removes from its own Node.
//!
//! Why the default is under `readiness.k8s.io/` (docs/operations.md, "Autoscalers"):
//! Karpenter treats every taint with that prefix as ephemeral without configuration, the
//! node-readiness-controller accepts only that prefix for its rules' taints, and
//! cluster-autoscaler needs one flag whatever the key.

use std::fmt;
use std::str::FromStr;

/// The default taint key: ephemeral to Karpenter and a valid NodeReadinessRule taint.
pub const DEFAULT_TAINT_KEY: &str = "readiness.k8s.io/meshgate-cni-unverified";
/// The key releases before `--taint-key` used; the agent removes it from its own Node.
pub const LEGACY_TAINT_KEY: &str = "meshgate.io/cni-unverified";

/// Most bytes of a qualified name's prefix (a DNS subdomain).
const MAX_PREFIX: usize = 253;
/// Most bytes of a qualified name's name part.
const MAX_NAME: usize = 63;

/// A taint key the apiserver accepts: `[prefix/]name`, the prefix a DNS subdomain of at most
/// 253 bytes, the name at most 63 alphanumerics, `-`, `_` or `.`, starting and ending with an
/// alphanumeric.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TaintKey(String);

/// Why a `--taint-key` value is not a Kubernetes qualified name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidTaintKey {
    /// More than one `/`.
    #[error("taint key {0:?} has more than one '/': use [prefix/]name")]
    TooManySlashes(String),
    /// The part before `/` is empty.
    #[error("taint key {0:?} has an empty prefix before '/'")]
    EmptyPrefix(String),
    /// The prefix is longer than 253 bytes.
    #[error("taint key {0:?}: the prefix is longer than {MAX_PREFIX} bytes")]
    PrefixTooLong(String),
    /// The prefix is not a lowercase DNS subdomain.
    #[error(
        "taint key {0:?}: the prefix must be a DNS subdomain (lowercase letters, digits, '-' \
         and '.', each dot-separated part starting and ending with a letter or digit)"
    )]
    BadPrefix(String),
    /// The name part is empty.
    #[error("taint key {0:?} has an empty name")]
    EmptyName(String),
    /// The name part is longer than 63 bytes.
    #[error("taint key {0:?}: the name is longer than {MAX_NAME} bytes")]
    NameTooLong(String),
    /// The name part has a character other than alphanumerics, `-`, `_`, `.`, or does not
    /// start and end with an alphanumeric.
    #[error(
        "taint key {0:?}: the name must consist of letters, digits, '-', '_' or '.', and \
         start and end with a letter or digit"
    )]
    BadName(String),
}

impl TaintKey {
    /// The key as the API spells it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Keys meshgate may have put on Nodes under another configuration: the legacy key and
    /// the default, less this key. The agent removes them from its own Node, so a node gated
    /// before an upgrade or a change of `--taint-key` does not stay gated for ever.
    pub fn superseded(&self) -> impl Iterator<Item = &'static str> + '_ {
        [LEGACY_TAINT_KEY, DEFAULT_TAINT_KEY]
            .into_iter()
            .filter(move |k| *k != self.0)
    }
}

impl Default for TaintKey {
    fn default() -> Self {
        TaintKey(DEFAULT_TAINT_KEY.to_owned())
    }
}

impl fmt::Display for TaintKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for TaintKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl FromStr for TaintKey {
    type Err = InvalidTaintKey;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |f: fn(String) -> InvalidTaintKey| Err(f(s.to_owned()));
        let (prefix, name) = match s.split_once('/') {
            Some((_, rest)) if rest.contains('/') => return bad(InvalidTaintKey::TooManySlashes),
            Some((prefix, name)) => (Some(prefix), name),
            None => (None, s),
        };
        if let Some(prefix) = prefix {
            if prefix.is_empty() {
                return bad(InvalidTaintKey::EmptyPrefix);
            }
            if prefix.len() > MAX_PREFIX {
                return bad(InvalidTaintKey::PrefixTooLong);
            }
            if !prefix.split('.').all(is_dns_label) {
                return bad(InvalidTaintKey::BadPrefix);
            }
        }
        if name.is_empty() {
            return bad(InvalidTaintKey::EmptyName);
        }
        if name.len() > MAX_NAME {
            return bad(InvalidTaintKey::NameTooLong);
        }
        if !is_name(name) {
            return bad(InvalidTaintKey::BadName);
        }
        Ok(TaintKey(s.to_owned()))
    }
}

/// One part of a DNS subdomain (RFC 1123, lowercase): `[a-z0-9]([-a-z0-9]*[a-z0-9])?`.
fn is_dns_label(label: &str) -> bool {
    let b = label.as_bytes();
    let inner = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-';
    let edge = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    b.first().is_some_and(edge) && b.last().is_some_and(edge) && b.iter().all(inner)
}

/// A qualified name's name part: `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`.
fn is_name(name: &str) -> bool {
    let b = name.as_bytes();
    let inner = |c: &u8| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.');
    b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
        && b.iter().all(inner)
}
