//! The normalized netfilter rule model, and the reachability matcher that decides whether a
//! pod's network namespace sends its traffic to the mesh proxy.
//!
//! In: a [`Ruleset`] built by the agent's netfilter readers from whatever the kernel holds in
//! the pod's namespace (nf_tables rules written by `iptables-nft` or by native `nft`, and the
//! legacy `ip_tables`/`ip6_tables` blobs written by `iptables-legacy`), a
//! [`MeshProfile`](crate::profile::MeshProfile), and what the mesh is expected to have written
//! for this pod ([`expected::Expectation`], derived from the profile, the pod's IP families and
//! its annotations). Out: an [`Inspection`] with one [`DirectionResult`] per direction and a
//! [`RedirectVerdict`] (`redirected` / `missing`; `unknown` when the rules could not be read or were
//! too large to judge, see [`DumpLimits`]).
//!
//! The model keeps only what the decision needs: per rule, whether it applies to every TCP
//! packet ([`Rule::protocol`], [`Rule::conditional`]) and what it does ([`Action`]). Readers
//! map every kernel construct they do not understand to a *conditional*, non-terminal rule,
//! which can only make the matcher find more paths, never hide one: a false `missing` evicts a
//! healthy pod, so uncertainty leans towards `redirected`.
//!
//! [`locate`] holds the other pure half of inspection: which of a node's network namespaces
//! belongs to a pod.

pub mod expect;
pub mod expected;
pub mod locate;
mod matcher;

use std::fmt;

use serde::{Deserialize, Serialize};

pub use expect::expectation;
pub use expected::{AnnotationDialect, Dialect, Expectation, Expected, IpFamily};
pub use matcher::{
    DirectionResult, Inspection, Path, check_expected, check_pod, find_interception, find_redirect,
};

/// The netfilter family a table lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// `ip`: IPv4 only (iptables, and nft `table ip`).
    Ip,
    /// `ip6`: IPv6 only (ip6tables, and nft `table ip6`).
    Ip6,
    /// `inet`: both (native nft only, e.g. Istio's `inet istio-proxy-nat`).
    Inet,
}

impl Family {
    /// The nft spelling: `ip`, `ip6`, `inet`.
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Ip => "ip",
            Family::Ip6 => "ip6",
            Family::Inet => "inet",
        }
    }

    /// True when packets of `ip` traverse tables of this family.
    pub fn covers(self, ip: IpFamily) -> bool {
        matches!(
            (self, ip),
            (Family::Inet, _) | (Family::Ip, IpFamily::V4) | (Family::Ip6, IpFamily::V6)
        )
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which tool wrote a table, for the `via` text. The matcher treats all three alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Source {
    /// nf_tables table written by `iptables-nft` (xt expressions, iptables table names).
    IptablesNft,
    /// `ip_tables` / `ip6_tables` table written by `iptables-legacy`.
    IptablesLegacy,
    /// nf_tables table written natively (`nft -f`, Istio's nftables backend).
    Nftables,
}

impl Source {
    /// `iptables-nft` / `iptables-legacy` / `nftables`.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::IptablesNft => "iptables-nft",
            Source::IptablesLegacy => "iptables-legacy",
            Source::Nftables => "nftables",
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Netfilter hook a base chain is attached to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Hook {
    /// Before routing, for packets arriving on an interface: inbound redirects live here.
    Prerouting,
    /// Packets for a local socket.
    Input,
    /// Routed packets.
    Forward,
    /// Locally generated packets: outbound redirects live here.
    Output,
    /// After routing, leaving an interface.
    Postrouting,
    /// Any other hook (netdev ingress/egress); never an entry point for the matcher.
    Other,
}

/// nf_tables chain type; legacy built-in chains get the type their table implies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChainType {
    /// `type nat`: the only chain type where the kernel runs REDIRECT / `redirect`.
    Nat,
    /// `type filter` (and legacy filter/mangle/raw/security built-ins).
    Filter,
    /// `type route`.
    Route,
}

/// Hook attachment of a base chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseChain {
    /// Where packets enter the chain.
    pub hook: Hook,
    /// What the chain may do with them.
    pub chain_type: ChainType,
    /// Order among base chains on the same hook (lower runs first).
    pub priority: i32,
}

/// Which packets a rule's match applies to, as far as the TCP redirect question goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// No layer-4 protocol constraint.
    Any,
    /// Only TCP.
    Tcp,
    /// Only some protocol other than TCP: the rule never sees the packets we care about.
    Other,
}

/// What a rule does when it matches.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Nothing that ends evaluation (counter, log, mark, comment, an unknown statement).
    Continue,
    /// Accept: ends evaluation of this hook's chain stack.
    Accept,
    /// Drop or reject.
    Drop,
    /// Return to the calling chain.
    Return,
    /// Jump to a chain of the same table; evaluation resumes here after it returns.
    Jump(String),
    /// Go to a chain of the same table; evaluation does not come back here.
    Goto(String),
    /// Redirect to a local port (`REDIRECT --to-ports N`, nft `redirect to :N`). `None` when
    /// the port is not given (or could not be decoded): the packet keeps its original port.
    Redirect {
        /// Target port.
        port: Option<u16>,
    },
    /// Another terminal NAT action (DNAT, SNAT, MASQUERADE, an nft `dnat`).
    Nat,
    /// Transparent proxying to a local port (`TPROXY --on-port N` in mangle PREROUTING, nft
    /// `tproxy to :N`): the inbound interception Istio's `TPROXY` mode uses. The kernel only
    /// accepts it in a prerouting chain. The xt target ends evaluation (accept when a socket
    /// was found, else drop); the nft statement lets the rule go on, and breaks off the rule
    /// when no socket listens, so readers mark an nft `tproxy` rule conditional.
    Tproxy {
        /// Target port; `None` when not given or not decodable.
        port: Option<u16>,
        /// The one IP family it acts on, for nft's `tproxy ip` / `tproxy ip6` in an `inet`
        /// table (for the other family the rule breaks off and does nothing); `None`: every
        /// family of its table.
        only: Option<IpFamily>,
    },
}

/// One rule, reduced to its effect on a TCP packet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rule {
    /// Layer-4 protocol constraint of the match.
    pub protocol: Protocol,
    /// True when the match has any other condition (ports, addresses, interfaces, owner,
    /// marks, sets, negations...): the rule may not apply to every TCP packet, so it neither
    /// hides the rules after it nor guarantees its action.
    pub conditional: bool,
    /// What the rule does.
    pub action: Action,
}

impl Rule {
    /// A rule matching every packet.
    pub fn all(action: Action) -> Self {
        Self {
            protocol: Protocol::Any,
            conditional: false,
            action,
        }
    }

    /// A rule matching every TCP packet (`-p tcp`).
    pub fn tcp(action: Action) -> Self {
        Self {
            protocol: Protocol::Tcp,
            conditional: false,
            action,
        }
    }

    /// The same rule with extra conditions.
    pub fn when(mut self) -> Self {
        self.conditional = true;
        self
    }

    /// True when this rule applies to every TCP packet that reaches it.
    pub fn applies_to_all_tcp(&self) -> bool {
        !self.conditional && self.protocol != Protocol::Other
    }
}

/// A chain: a base chain when `base` is set, else a regular chain reached only by jump/goto.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chain {
    /// Chain name (`PREROUTING`, `PROXY_INIT_REDIRECT`, `prerouting`, ...).
    pub name: String,
    /// Hook attachment, for base chains.
    pub base: Option<BaseChain>,
    /// Rules in evaluation order.
    pub rules: Vec<Rule>,
}

impl Chain {
    /// A regular chain.
    pub fn regular(name: &str, rules: Vec<Rule>) -> Self {
        Self {
            name: name.to_owned(),
            base: None,
            rules,
        }
    }

    /// A base chain of type nat on `hook`.
    pub fn nat_base(name: &str, hook: Hook, priority: i32, rules: Vec<Rule>) -> Self {
        Self {
            name: name.to_owned(),
            base: Some(BaseChain {
                hook,
                chain_type: ChainType::Nat,
                priority,
            }),
            rules,
        }
    }
}

/// A table: chains that may jump to each other.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Table {
    /// Netfilter family.
    pub family: Family,
    /// Table name (`nat`, `istio-proxy-nat`, ...).
    pub name: String,
    /// Which tool wrote it.
    pub source: Source,
    /// Its chains.
    pub chains: Vec<Chain>,
}

impl Table {
    /// Looks a chain up by name.
    pub fn chain(&self, name: &str) -> Option<&Chain> {
        self.chains.iter().find(|c| c.name == name)
    }
}

/// Everything read from one network namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ruleset {
    /// Tables from every reader, in reading order.
    pub tables: Vec<Table>,
}

impl Ruleset {
    /// Total number of chains in every table.
    pub fn chain_count(&self) -> usize {
        self.tables.iter().map(|t| t.chains.len()).sum()
    }

    /// Total number of rules in every chain.
    pub fn rule_count(&self) -> usize {
        self.tables
            .iter()
            .flat_map(|t| &t.chains)
            .map(|c| c.rules.len())
            .sum()
    }
}

/// How much of a namespace's rules meshgate is willing to read and judge.
///
/// A pod's own rules are a few dozen; a namespace holding more than these caps is either
/// hostile (a pod with `NET_ADMIN` filling its namespace to make the agent allocate) or not a
/// pod the mesh set up. Past a cap the readers stop reading and the verdict is `unknown`:
/// never `missing`, because a partial read could miss the redirect and evict a healthy pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DumpLimits {
    /// Bytes of netlink messages (nf_tables) plus legacy entry blobs read for one namespace.
    pub max_bytes: usize,
    /// Tables, across every reader.
    pub max_tables: usize,
    /// Chains, across every table.
    pub max_chains: usize,
    /// Rules, across every chain.
    pub max_rules: usize,
}

impl DumpLimits {
    /// The defaults: about 100 times what istio-iptables writes in its largest configuration
    /// (TPROXY + DNS capture + dual stack: under 150 rules in 30 chains).
    pub const DEFAULT: Self = Self {
        max_bytes: 4 << 20,
        max_tables: 256,
        max_chains: 4096,
        max_rules: 16_384,
    };

    /// Why `ruleset` is beyond these limits, or `None` when it is within them.
    pub fn exceeded_by(&self, ruleset: &Ruleset) -> Option<String> {
        let (t, c, r) = (
            ruleset.tables.len(),
            ruleset.chain_count(),
            ruleset.rule_count(),
        );
        if t > self.max_tables {
            Some(format!("{t} tables (limit {})", self.max_tables))
        } else if c > self.max_chains {
            Some(format!("{c} chains (limit {})", self.max_chains))
        } else if r > self.max_rules {
            Some(format!("{r} rules (limit {})", self.max_rules))
        } else {
            None
        }
    }
}

impl Default for DumpLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// The outcome of inspecting one pod for one profile (metric label `verdict`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RedirectVerdict {
    /// Every expected interception (redirect, or TPROXY inbound) is reachable, for every
    /// family the [`Expectation`] requires. A direction the pod opted out of is not expected.
    Redirected,
    /// At least one expected interception is not reachable.
    Missing,
    /// The pod's namespace or rules could not be read (or were beyond [`DumpLimits`]): never
    /// a reason to evict.
    Unknown,
}

impl RedirectVerdict {
    /// `redirected` / `missing` / `unknown`, as in metrics and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            RedirectVerdict::Redirected => "redirected",
            RedirectVerdict::Missing => "missing",
            RedirectVerdict::Unknown => "unknown",
        }
    }
}

impl fmt::Display for RedirectVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
