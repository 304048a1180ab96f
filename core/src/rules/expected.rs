//! What a mesh writes into one pod's network namespace, as values, and the annotation
//! dialects that narrow it.
//!
//! In: nothing but plain data. Out: [`IpFamily`], the [`Expectation`] the matcher checks (per
//! direction, the proxy port and the IP families whose rules must intercept it), and
//! [`AnnotationDialect`], a profile's handle on a [`Dialect`] record: which pod annotations
//! the mesh reads and how they remove requirements. The meshes' own records (and the lookup
//! of a dialect by name, for profile files) are in [`crate::meshes`]; this module imports
//! nothing of the crate, so profiles and meshes can both build on it.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// The IP family a pod uses. IPv6 rules are required only when the pod has an IPv6 address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IpFamily {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl IpFamily {
    /// `IPv4` / `IPv6`, for messages.
    pub fn as_str(self) -> &'static str {
        match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    }
}

/// What one direction must look like.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Expected {
    /// Proxy port the direction must be intercepted to.
    pub port: u16,
    /// Families whose rules must intercept this direction, sorted; empty when the mesh
    /// writes no interception for this direction.
    pub families: Vec<IpFamily>,
    /// Why a family the pod has is not required, one line each (for messages).
    pub exempt: Vec<String>,
}

impl Expected {
    /// True when at least one family must be intercepted.
    pub fn is_expected(&self) -> bool {
        !self.families.is_empty()
    }

    /// Removes family `ip`, saying why, when it was required.
    pub fn drop_family(&mut self, ip: IpFamily, why: String) {
        if self.families.contains(&ip) {
            self.families.retain(|f| *f != ip);
            self.exempt.push(why);
        }
    }

    /// Removes every family, saying why, when any was required.
    pub fn drop_all(&mut self, why: String) {
        if !self.families.is_empty() {
            self.families.clear();
            self.exempt.push(why);
        }
    }
}

/// What the mesh writes for one pod, per direction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Expectation {
    /// Inbound: redirect (nat PREROUTING) or TPROXY (prerouting) to the inbound port.
    pub inbound: Expected,
    /// Outbound: redirect from nat OUTPUT to the outbound port.
    pub outbound: Expected,
}

/// One mesh's pod annotations: which keys it reads and how they narrow an expectation. An
/// opt-out only ever removes a requirement, so a pod that opts out is never `missing` for
/// the part it opted out of; unknown or malformed values never add one.
pub struct Dialect {
    /// The name profile files use (`"annotationDialect": "istio"`).
    pub name: &'static str,
    /// The pod annotations [`Dialect::narrow`] reads: what a cache of pods must keep, as they
    /// are, for the rules check.
    pub annotation_keys: &'static [&'static str],
    /// Removes what the pod's annotations opt out of.
    pub narrow: fn(&BTreeMap<String, String>, &mut Expectation),
}

/// No annotation is read: both directions are expected (custom profiles' default).
pub const NO_DIALECT: Dialect = Dialect {
    name: "none",
    annotation_keys: &[],
    narrow: |_, _| {},
};

/// Whose pod annotations narrow a profile's expectation: a handle on a [`Dialect`] record,
/// written in profile files as the dialect's name. It is read back by name from the mesh
/// records (the `Deserialize` impl is in [`crate::meshes`], which knows them all).
#[derive(Clone, Copy)]
pub struct AnnotationDialect(&'static Dialect);

impl AnnotationDialect {
    /// No annotation is read.
    pub const NONE: AnnotationDialect = AnnotationDialect(&NO_DIALECT);

    /// The handle on `dialect`.
    pub const fn of(dialect: &'static Dialect) -> Self {
        Self(dialect)
    }

    /// The dialect's name.
    pub fn name(self) -> &'static str {
        self.0.name
    }

    /// The pod annotations the dialect reads.
    pub fn annotation_keys(self) -> &'static [&'static str] {
        self.0.annotation_keys
    }

    /// Narrows `out` by the pod's annotations.
    pub fn narrow(self, annotations: &BTreeMap<String, String>, out: &mut Expectation) {
        (self.0.narrow)(annotations, out)
    }
}

impl Default for AnnotationDialect {
    fn default() -> Self {
        Self::NONE
    }
}

impl PartialEq for AnnotationDialect {
    fn eq(&self, other: &Self) -> bool {
        self.0.name == other.0.name
    }
}

impl Eq for AnnotationDialect {}

impl std::hash::Hash for AnnotationDialect {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.name.hash(state)
    }
}

impl std::fmt::Debug for AnnotationDialect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("AnnotationDialect")
            .field(&self.0.name)
            .finish()
    }
}

impl Serialize for AnnotationDialect {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.name)
    }
}

/// An annotation's value, trimmed.
pub fn get<'a>(annotations: &'a BTreeMap<String, String>, key: &str) -> Option<&'a str> {
    annotations.get(key).map(|v| v.trim())
}

/// The non-empty, trimmed items of a comma-separated annotation value.
pub fn list(v: &str) -> impl Iterator<Item = &str> {
    v.split(',').map(str::trim).filter(|s| !s.is_empty())
}

/// The family of a CIDR or address (`10.0.0.0/8`, `2001:db8::/32`), if it parses.
pub fn cidr_family(cidr: &str) -> Option<IpFamily> {
    let addr = cidr.split_once('/').map_or(cidr, |(a, _)| a);
    match addr.trim().parse::<IpAddr>().ok()? {
        IpAddr::V4(_) => Some(IpFamily::V4),
        IpAddr::V6(_) => Some(IpFamily::V6),
    }
}

/// True when `cidr` is a `/0` of family `ip` (`0.0.0.0/0`, `::/0`): it matches every address.
pub fn covers_family(cidr: &str, ip: IpFamily) -> bool {
    match cidr.split_once('/') {
        Some((_, len)) => len.trim() == "0" && cidr_family(cidr) == Some(ip),
        None => false,
    }
}
