//! Reachability of the mesh's interception from a netfilter hook, through jump/goto edges and
//! across base chains, as the kernel evaluates a new TCP connection.
//!
//! In: a [`Ruleset`], the hook, the expected port and an IP family. Out: the first [`Path`]
//! from a base chain on that hook to a rule intercepting TCP packets to the port, or why none
//! is reached. [`check_expected`] runs that for both directions of an [`Expectation`] and
//! every family it requires, and turns it into an [`Inspection`]; [`check_pod`] and [`check`]
//! derive the expectation first.
//!
//! Semantics, kept to what the kernel does with the first packet of a TCP connection:
//! - **What intercepts.** Outbound: a redirect to the port in a chain reached from a base
//!   chain of type nat on OUTPUT (the kernel runs REDIRECT / `redirect` only there). Inbound:
//!   the same from nat PREROUTING, or a TPROXY to the port in a chain reached from any
//!   PREROUTING base chain (Istio's `TPROXY` mode: mangle PREROUTING → ISTIO_INBOUND →
//!   ISTIO_TPROXY). A redirect or TPROXY counts even when conditional: a mesh that skips some
//!   ports (Linkerd's ignored ports, Istio's 15008) is still intercepting.
//! - **Within a chain.** Rules are walked in order. A rule restricted to another protocol is
//!   skipped. A rule that applies to every TCP packet and ends evaluation (accept, drop,
//!   return, a NAT action, a redirect elsewhere, an xt TPROXY elsewhere, an unconditional
//!   goto) hides every rule after it; a conditional one does not. A jump explores the target
//!   and comes back; an unconditional jump into a chain that always ends evaluation ends the
//!   caller the same way. Jumps stay inside their table; every chain is explored at most once
//!   per search, which bounds the work and breaks cycles.
//! - **Across base chains.** Every base chain on the hook in a table of the packet's family
//!   runs, in priority order. An accept ends only its own base chain: the next one still
//!   runs. A drop ends everything. NAT chains are not hooked one by one: the kernel's nf_nat
//!   hook (`nf_nat_inet_fn`, priority -100 on PREROUTING/OUTPUT, 100 on INPUT/POSTROUTING)
//!   runs every nat chain of that hook and family in their own priority order, and stops at
//!   the first one that sets up a NAT binding for the connection. So an unconditional DNAT,
//!   masquerade or redirect elsewhere in an earlier nat chain (of any table, iptables' or
//!   native) means no later nat chain's redirect is ever reached.
//!
//! The search leans towards finding a path: a conditional drop or NAT never hides anything,
//! because a false `missing` evicts a healthy pod.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use serde::{Deserialize, Serialize};

use super::expect::expectation;
use super::expected::{Expectation, Expected};
use super::{
    Action, ChainType, DumpLimits, Family, Hook, IpFamily, Protocol, RedirectVerdict, Ruleset,
    Source, Table,
};
use crate::profile::MeshProfile;

/// Where an interception was found: the chain path from the hook's base chain to it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Path {
    /// Family of the table.
    pub family: Family,
    /// Table name.
    pub table: String,
    /// Chains from the base chain to the one holding the redirect / TPROXY.
    pub chains: Vec<String>,
    /// Which tool wrote the table.
    pub source: Source,
}

impl fmt::Display for Path {
    /// `ip nat PREROUTING -> PROXY_INIT_REDIRECT (iptables-nft)`: the contract's `via`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {} ({})",
            self.family,
            self.table,
            self.chains.join(" -> "),
            self.source
        )
    }
}

/// Why a search found nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NotFound {
    /// An earlier base chain that stops every TCP packet (drop) or every new connection's
    /// NAT (a binding set up first) before any interception could be reached.
    pub blocked_by: Option<String>,
}

/// The nf_nat hook's priority on `hook`: where every nat chain of that hook runs.
fn nat_hook_priority(hook: Hook) -> i32 {
    match hook {
        Hook::Prerouting | Hook::Output => -100,
        _ => 100,
    }
}

/// Finds a TCP interception to `port` on `hook` for packets of family `ip`: a redirect from a
/// nat chain, or (on PREROUTING) a TPROXY from any chain. See the module docs for the order.
pub fn find_interception(
    ruleset: &Ruleset,
    hook: Hook,
    port: u16,
    ip: IpFamily,
) -> Result<Path, NotFound> {
    struct Entry<'a> {
        key: (i32, u8, i32, usize),
        table: usize,
        name: &'a str,
        nat: bool,
    }
    let mut entries: Vec<Entry<'_>> = Vec::new();
    for (i, table) in ruleset.tables.iter().enumerate() {
        if !table.family.covers(ip) {
            continue;
        }
        for chain in &table.chains {
            let Some(base) = chain.base else { continue };
            if base.hook != hook {
                continue;
            }
            let nat = base.chain_type == ChainType::Nat;
            let key = if nat {
                (nat_hook_priority(hook), 1, base.priority, i)
            } else {
                (base.priority, 0, 0, i)
            };
            entries.push(Entry {
                key,
                table: i,
                name: chain.name.as_str(),
                nat,
            });
        }
    }
    entries.sort_by_key(|e| e.key);
    // One walker per table and chain kind: chains explored from one base chain need no
    // second visit from another base chain of the same kind in the same table.
    let mut walkers: HashMap<(usize, bool), Walker<'_>> = HashMap::new();
    let mut nat_bound: Option<String> = None;
    for e in entries {
        if e.nat && nat_bound.is_some() {
            continue;
        }
        let Some(table) = ruleset.tables.get(e.table) else {
            continue;
        };
        let walker = walkers.entry((e.table, e.nat)).or_insert_with(|| Walker {
            table,
            port,
            redirect_counts: e.nat,
            tproxy_counts: hook == Hook::Prerouting,
            ip,
            memo: HashMap::new(),
            stack: Vec::new(),
        });
        let here = || format!("{} {} {}", table.family, table.name, e.name);
        match walker.chain(e.name) {
            Outcome::Found(chains) => {
                return Ok(Path {
                    family: table.family,
                    table: table.name.clone(),
                    chains: chains.into_iter().map(str::to_owned).collect(),
                    source: table.source,
                });
            }
            Outcome::NotFound(Summary { end: End::Drop, .. }) => {
                return Err(NotFound {
                    blocked_by: Some(format!("every TCP packet is dropped in {}", here())),
                });
            }
            Outcome::NotFound(Summary { end: End::Nat, .. }) if e.nat => {
                nat_bound = Some(format!(
                    "every new TCP connection gets its NAT binding in {} first",
                    here()
                ));
            }
            Outcome::NotFound(_) => {}
        }
    }
    Err(NotFound {
        blocked_by: nat_bound,
    })
}

/// Finds a TCP interception to `port` reachable from `hook` for packets of family `ip`
/// ([`find_interception`] without the reason).
pub fn find_redirect(ruleset: &Ruleset, hook: Hook, port: u16, ip: IpFamily) -> Option<Path> {
    find_interception(ruleset, hook, port, ip).ok()
}

/// How evaluation of a chain ends for every TCP packet, when no interception was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// Some packets fall off the end (or return): the caller goes on.
    Falls,
    /// Every packet leaves the base chain's evaluation, and at least some are accepted
    /// without a NAT binding: the next base chain runs for them.
    Accept,
    /// Every packet is dropped: nothing after runs.
    Drop,
    /// Every packet that is not dropped gets a NAT binding: no later nat chain runs.
    Nat,
}

/// What a chain does with the TCP packets entering it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Summary {
    /// How evaluation ends for every packet.
    end: End,
    /// Some packets may leave the whole evaluation accepted, without a NAT binding, before
    /// the end (a conditional accept, a conditional return from a base chain...).
    leaks_accept: bool,
    /// Some packets may leave with a NAT binding before the end (a conditional DNAT).
    leaks_nat: bool,
}

impl Summary {
    const FALLS: Self = Self {
        end: End::Falls,
        leaks_accept: false,
        leaks_nat: false,
    };

    /// Folds in what some packets do (a conditional rule, or a callee's leaks).
    fn leak(&mut self, end: End) {
        match end {
            End::Accept => self.leaks_accept = true,
            End::Nat => self.leaks_nat = true,
            End::Drop | End::Falls => {}
        }
    }

    /// The chain ends here for every packet still in it with `end`. A drop that some packets
    /// escaped (accepted or NATed earlier) does not stop the next base chain for them, and
    /// a NAT that some escaped unbound does not stop the next nat chain: only an end that no
    /// packet escapes is reported as such, so nothing is hidden on a guess.
    fn finish(&mut self, end: End) {
        self.end = match end {
            End::Drop if self.leaks_accept || self.leaks_nat => End::Accept,
            End::Nat if self.leaks_accept => End::Accept,
            e => e,
        };
    }
}

enum Outcome<'a> {
    /// The chain path to the interception.
    Found(Vec<&'a str>),
    /// No interception; what the chain does with every TCP packet entering it.
    NotFound(Summary),
}

#[derive(Clone, Copy)]
enum Memo {
    InProgress,
    Done(Summary),
}

struct Walker<'a> {
    table: &'a Table,
    port: u16,
    /// Redirects count (the walk started from a nat base chain).
    redirect_counts: bool,
    /// TPROXY counts (the walk started from a PREROUTING base chain).
    tproxy_counts: bool,
    /// The packets' family.
    ip: IpFamily,
    memo: HashMap<&'a str, Memo>,
    stack: Vec<&'a str>,
}

impl<'a> Walker<'a> {
    fn chain(&mut self, name: &'a str) -> Outcome<'a> {
        match self.memo.get(name) {
            // A cycle: the kernel refuses loops, but a model built from odd data may have
            // one. Re-entering adds nothing that the first visit will not find.
            Some(Memo::InProgress) => return Outcome::NotFound(Summary::FALLS),
            Some(Memo::Done(summary)) => return Outcome::NotFound(*summary),
            None => {}
        }
        let table = self.table;
        let Some(chain) = table.chain(name) else {
            // A jump to a chain that does not exist: the kernel would not load it. Treat the
            // edge as leading nowhere.
            return Outcome::NotFound(Summary::FALLS);
        };
        // A return from a base chain ends its evaluation (the policy applies: accept, or a
        // drop the readers add as the chain's last rule).
        let is_base = chain.base.is_some();
        self.memo.insert(name, Memo::InProgress);
        self.stack.push(name);
        let mut summary = Summary::FALLS;
        for rule in &chain.rules {
            if rule.protocol == Protocol::Other {
                continue;
            }
            let always = rule.applies_to_all_tcp();
            let ends = match &rule.action {
                Action::Continue => None,
                Action::Redirect { port: Some(p) } if *p == self.port && self.redirect_counts => {
                    return Outcome::Found(self.stack.clone());
                }
                // nft's `tproxy ip` breaks off the rule for an IPv6 packet, and vice versa.
                Action::Tproxy { only: Some(f), .. } if *f != self.ip => None,
                Action::Tproxy { port: Some(p), .. } if *p == self.port && self.tproxy_counts => {
                    return Outcome::Found(self.stack.clone());
                }
                Action::Redirect { .. } | Action::Nat => Some(End::Nat),
                // xt TPROXY accepts the packet when a socket listens and drops it otherwise;
                // accept is the reading that hides less.
                Action::Tproxy { .. } | Action::Accept => Some(End::Accept),
                Action::Drop => Some(End::Drop),
                Action::Return if is_base => Some(End::Accept),
                Action::Return => Some(End::Falls),
                Action::Jump(target) => match self.chain(target) {
                    found @ Outcome::Found(_) => return found,
                    Outcome::NotFound(callee) => {
                        summary.leaks_accept |= callee.leaks_accept;
                        summary.leaks_nat |= callee.leaks_nat;
                        // A jump into a chain that lets packets fall back continues here.
                        (callee.end != End::Falls).then_some(callee.end)
                    }
                },
                Action::Goto(target) => match self.chain(target) {
                    found @ Outcome::Found(_) => return found,
                    Outcome::NotFound(callee) => {
                        summary.leaks_accept |= callee.leaks_accept;
                        summary.leaks_nat |= callee.leaks_nat;
                        // Control never comes back here: when the target returns, this
                        // chain has returned too.
                        match callee.end {
                            End::Falls if is_base => Some(End::Accept),
                            e => Some(e),
                        }
                    }
                },
            };
            let Some(end) = ends else { continue };
            if always {
                summary.finish(end);
                break;
            }
            summary.leak(end);
        }
        self.stack.pop();
        self.memo.insert(name, Memo::Done(summary));
        Outcome::NotFound(summary)
    }
}

/// The result for one direction, serialized as the contract's `{"port", "found", "via"}`,
/// plus `"expected": false` when the pod's mesh writes no interception for it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectionResult {
    /// Expected interception port.
    pub port: u16,
    /// Expected direction: true when the interception is reachable for every required
    /// family. Direction not expected: true when it is reachable for some family of the pod.
    pub found: bool,
    /// The paths found (one per distinct path, `; `-separated), `null` when none was found.
    pub via: Option<String>,
    /// False when the mesh writes no interception for this direction for this pod (its
    /// annotations opted out); such a direction never makes the verdict `missing`.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub expected: bool,
    /// Required families for which no path was found (empty when `found`).
    #[serde(skip)]
    pub missing_families: Vec<IpFamily>,
    /// Why a family or the direction is not required, and what blocked a search.
    #[serde(skip)]
    pub notes: Vec<String>,
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

impl DirectionResult {
    fn compute(ruleset: &Ruleset, hook: Hook, exp: &Expected, pod: &[IpFamily]) -> Self {
        let mut via: Vec<String> = Vec::new();
        let mut missing_families = Vec::new();
        let mut notes = exp.exempt.clone();
        let mut any = false;
        for &ip in pod {
            let required = exp.families.contains(&ip);
            match find_interception(ruleset, hook, exp.port, ip) {
                Ok(path) => {
                    any = true;
                    let text = path.to_string();
                    if !via.contains(&text) {
                        via.push(text);
                    }
                }
                Err(nf) => {
                    if required {
                        missing_families.push(ip);
                        if let Some(b) = nf.blocked_by
                            && !notes.contains(&b)
                        {
                            notes.push(b);
                        }
                    }
                }
            }
        }
        let expected = exp.is_expected();
        Self {
            port: exp.port,
            found: if expected {
                missing_families.is_empty()
            } else {
                any
            },
            via: (!via.is_empty()).then(|| via.join("; ")),
            expected,
            missing_families,
            notes,
        }
    }
}

/// One pod namespace checked against one profile.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inspection {
    /// Profile name.
    pub profile: String,
    /// `redirected` when every expected direction is found, else `missing` (or `unknown`,
    /// built by [`Inspection::unknown`] or for a ruleset beyond [`DumpLimits`]).
    pub verdict: RedirectVerdict,
    /// Inbound: redirect from nat PREROUTING or TPROXY from PREROUTING.
    pub inbound: DirectionResult,
    /// Outbound: redirect from nat OUTPUT.
    pub outbound: DirectionResult,
    /// One line for operators (Event notes, `inspect` output).
    pub message: String,
}

impl Inspection {
    /// The verdict for a pod whose namespace or rules could not be read: never evicted.
    pub fn unknown(profile: &MeshProfile, why: &str) -> Self {
        let dir = |port| DirectionResult {
            port,
            found: false,
            via: None,
            expected: true,
            missing_families: Vec::new(),
            notes: Vec::new(),
        };
        Self {
            profile: profile.name.clone(),
            verdict: RedirectVerdict::Unknown,
            inbound: dir(profile.inbound_port),
            outbound: dir(profile.outbound_port),
            message: why.to_owned(),
        }
    }
}

/// Checks one namespace's rules against a profile for a pod without annotations. `families`
/// are the IP families the pod has addresses in; an empty slice means IPv4 only. Kept for
/// callers that have no pod context; [`check_pod`] is the daemon's entry point.
pub fn check(ruleset: &Ruleset, profile: &MeshProfile, families: &[IpFamily]) -> Inspection {
    check_pod(ruleset, profile, families, &BTreeMap::new())
}

/// Checks one namespace's rules against what `profile`'s mesh writes for a pod with these IP
/// families (empty: IPv4 only) and annotations ([`expectation`]).
pub fn check_pod(
    ruleset: &Ruleset,
    profile: &MeshProfile,
    families: &[IpFamily],
    annotations: &BTreeMap<String, String>,
) -> Inspection {
    let exp = expectation(profile, families, annotations);
    check_expected(ruleset, profile, families, &exp)
}

/// Checks one namespace's rules against an [`Expectation`]. `families` are the pod's IP
/// families (paths are reported for all of them; only the expectation's are required). A
/// ruleset beyond [`DumpLimits::DEFAULT`] is `unknown`.
pub fn check_expected(
    ruleset: &Ruleset,
    profile: &MeshProfile,
    families: &[IpFamily],
    exp: &Expectation,
) -> Inspection {
    if let Some(why) = DumpLimits::DEFAULT.exceeded_by(ruleset) {
        return Inspection::unknown(
            profile,
            &format!(
                "{}: the namespace holds {why}: too many to judge",
                profile.name
            ),
        );
    }
    let mut pod: Vec<IpFamily> = families.to_vec();
    if pod.is_empty() {
        pod.push(IpFamily::V4);
    }
    pod.sort();
    pod.dedup();
    let inbound = DirectionResult::compute(ruleset, Hook::Prerouting, &exp.inbound, &pod);
    let outbound = DirectionResult::compute(ruleset, Hook::Output, &exp.outbound, &pod);
    let ok = |d: &DirectionResult| !d.expected || d.found;
    let verdict = if ok(&inbound) && ok(&outbound) {
        RedirectVerdict::Redirected
    } else {
        RedirectVerdict::Missing
    };
    let message = message(profile, &inbound, &outbound);
    Inspection {
        profile: profile.name.clone(),
        verdict,
        inbound,
        outbound,
        message,
    }
}

fn message(profile: &MeshProfile, inbound: &DirectionResult, outbound: &DirectionResult) -> String {
    if inbound.expected && outbound.expected && inbound.found && outbound.found {
        return format!(
            "{}: inbound ({}) and outbound ({}) TCP redirects are in place",
            profile.name, inbound.port, outbound.port
        );
    }
    let mut parts = Vec::new();
    for (dir, hook, res) in [
        ("inbound", "PREROUTING", inbound),
        ("outbound", "OUTPUT", outbound),
    ] {
        if !res.expected {
            parts.push(format!(
                "{dir} not expected ({})",
                res.notes.first().map_or("opted out", String::as_str)
            ));
        } else if res.found {
            parts.push(format!("{dir} ({}) in place", res.port));
        } else {
            let fam = res
                .missing_families
                .iter()
                .map(|f| f.as_str())
                .collect::<Vec<_>>()
                .join(" and ");
            let what = if hook == "PREROUTING" {
                "TCP redirect or TPROXY"
            } else {
                "TCP redirect"
            };
            let mut p = format!(
                "no {dir} {what} to port {} reachable from {hook} ({fam})",
                res.port
            );
            for n in &res.notes {
                if n.starts_with("every ") {
                    p.push_str(&format!(": {n}"));
                }
            }
            parts.push(p);
        }
    }
    format!("{}: {}", profile.name, parts.join("; "))
}

#[cfg(test)]
mod tests {
    use super::super::{Chain, Rule, Table};
    use super::*;
    use std::collections::BTreeMap;

    fn profile(name: &str) -> MeshProfile {
        crate::meshes::builtin_named(name).expect("built-in profile")
    }

    fn jump(c: &str) -> Action {
        Action::Jump(c.into())
    }
    fn goto(c: &str) -> Action {
        Action::Goto(c.into())
    }
    fn redirect(p: u16) -> Action {
        Action::Redirect { port: Some(p) }
    }

    fn table(family: Family, name: &str, source: Source, chains: Vec<Chain>) -> Table {
        Table {
            family,
            name: name.into(),
            source,
            chains,
        }
    }

    /// linkerd proxy-init's layout, as `iptables-save -t nat` shows it.
    fn linkerd_nat(family: Family, source: Source) -> Table {
        table(
            family,
            "nat",
            source,
            vec![
                Chain::nat_base(
                    "PREROUTING",
                    Hook::Prerouting,
                    -100,
                    // -j PROXY_INIT_REDIRECT -m comment: comments are not conditions.
                    vec![Rule::all(jump("PROXY_INIT_REDIRECT"))],
                ),
                Chain::nat_base("INPUT", Hook::Input, 100, vec![]),
                Chain::nat_base(
                    "OUTPUT",
                    Hook::Output,
                    -100,
                    vec![Rule::all(jump("PROXY_INIT_OUTPUT"))],
                ),
                Chain::nat_base("POSTROUTING", Hook::Postrouting, 100, vec![]),
                Chain::regular(
                    "PROXY_INIT_REDIRECT",
                    vec![
                        // -p tcp -m multiport --dports 4190,4191,4567,4568 -j RETURN
                        Rule::tcp(Action::Return).when(),
                        // -p tcp -j REDIRECT --to-ports 4143
                        Rule::tcp(redirect(4143)),
                    ],
                ),
                Chain::regular(
                    "PROXY_INIT_OUTPUT",
                    vec![
                        // -m owner --uid-owner 2102 -j RETURN
                        Rule::all(Action::Return).when(),
                        // -o lo -j RETURN
                        Rule::all(Action::Return).when(),
                        // -p tcp -m multiport --dports 443 -j RETURN
                        Rule::tcp(Action::Return).when(),
                        // -p tcp -j REDIRECT --to-ports 4140
                        Rule::tcp(redirect(4140)),
                    ],
                ),
            ],
        )
    }

    /// Istio's sidecar layout (istio-iptables / istio-cni).
    fn istio_nat(family: Family, source: Source) -> Table {
        table(
            family,
            "nat",
            source,
            vec![
                Chain::nat_base(
                    "PREROUTING",
                    Hook::Prerouting,
                    -100,
                    vec![Rule::tcp(jump("ISTIO_INBOUND"))],
                ),
                Chain::nat_base(
                    "OUTPUT",
                    Hook::Output,
                    -100,
                    vec![Rule::all(jump("ISTIO_OUTPUT"))],
                ),
                Chain::regular(
                    "ISTIO_INBOUND",
                    vec![
                        Rule::tcp(Action::Return).when(), // --dport 15008
                        Rule::tcp(Action::Return).when(), // --dport 15090
                        Rule::tcp(Action::Return).when(), // --dport 15021
                        Rule::tcp(Action::Return).when(), // --dport 15020
                        Rule::tcp(jump("ISTIO_IN_REDIRECT")),
                    ],
                ),
                Chain::regular("ISTIO_IN_REDIRECT", vec![Rule::tcp(redirect(15006))]),
                Chain::regular(
                    "ISTIO_OUTPUT",
                    vec![
                        Rule::all(Action::Return).when(),            // -s 127.0.0.6/32 -o lo
                        Rule::all(jump("ISTIO_IN_REDIRECT")).when(), // ! -d 127.0.0.1/32 -o lo -m owner --uid-owner 1337
                        Rule::all(Action::Return).when(), // -o lo -m owner ! --uid-owner 1337
                        Rule::all(Action::Return).when(), // -m owner --uid-owner 1337
                        Rule::all(Action::Return).when(), // -d 127.0.0.1/32
                        Rule::all(jump("ISTIO_REDIRECT")),
                    ],
                ),
                Chain::regular("ISTIO_REDIRECT", vec![Rule::tcp(redirect(15001))]),
            ],
        )
    }

    /// Istio's native nftables backend: `table inet istio-proxy-nat`.
    fn istio_nft() -> Table {
        table(
            Family::Inet,
            "istio-proxy-nat",
            Source::Nftables,
            vec![
                Chain::nat_base(
                    "prerouting",
                    Hook::Prerouting,
                    -100,
                    vec![Rule::tcp(jump("istio-inbound"))],
                ),
                Chain::nat_base(
                    "output",
                    Hook::Output,
                    -100,
                    vec![Rule::all(jump("istio-output"))],
                ),
                Chain::regular(
                    "istio-inbound",
                    vec![
                        Rule::tcp(Action::Return).when(), // tcp dport { 15008, 15090, ... }
                        Rule::tcp(jump("istio-in-redirect")),
                    ],
                ),
                Chain::regular("istio-in-redirect", vec![Rule::tcp(redirect(15006))]),
                Chain::regular(
                    "istio-output",
                    vec![
                        Rule::all(Action::Return).when(), // meta skuid 1337
                        Rule::all(goto("istio-redirect")),
                    ],
                ),
                Chain::regular("istio-redirect", vec![Rule::tcp(redirect(15001))]),
            ],
        )
    }

    fn set(tables: Vec<Table>) -> Ruleset {
        Ruleset { tables }
    }

    const V4: &[IpFamily] = &[IpFamily::V4];
    const DUAL: &[IpFamily] = &[IpFamily::V4, IpFamily::V6];

    #[test]
    fn linkerd_layout_is_redirected_with_via() {
        let rs = set(vec![linkerd_nat(Family::Ip, Source::IptablesNft)]);
        let got = check(&rs, &profile("linkerd"), V4);
        assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
        assert_eq!(
            got.inbound.via.as_deref(),
            Some("ip nat PREROUTING -> PROXY_INIT_REDIRECT (iptables-nft)")
        );
        assert_eq!(
            got.outbound.via.as_deref(),
            Some("ip nat OUTPUT -> PROXY_INIT_OUTPUT (iptables-nft)")
        );
        assert_eq!((got.inbound.port, got.outbound.port), (4143, 4140));
    }

    #[test]
    fn istio_layout_is_redirected_and_linkerd_is_not() {
        let rs = set(vec![istio_nat(Family::Ip, Source::IptablesLegacy)]);
        let got = check(&rs, &profile("istio"), V4);
        assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
        assert_eq!(
            got.inbound.via.as_deref(),
            Some("ip nat PREROUTING -> ISTIO_INBOUND -> ISTIO_IN_REDIRECT (iptables-legacy)")
        );
        assert_eq!(
            got.outbound.via.as_deref(),
            Some("ip nat OUTPUT -> ISTIO_OUTPUT -> ISTIO_REDIRECT (iptables-legacy)")
        );
        // Istio's ports are not Linkerd's: wrong ports never count.
        let other = check(&rs, &profile("linkerd"), V4);
        assert_eq!(other.verdict, RedirectVerdict::Missing);
        assert!(!other.inbound.found && !other.outbound.found);
        assert_eq!(other.inbound.via, None);
        assert!(
            other.message.contains("port 4143") && other.message.contains("port 4140"),
            "{}",
            other.message
        );
    }

    #[test]
    fn native_nft_inet_table_serves_both_families() {
        let rs = set(vec![istio_nft()]);
        let got = check(&rs, &profile("istio"), DUAL);
        assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
        // One inet path covers IPv4 and IPv6: reported once.
        assert_eq!(
            got.inbound.via.as_deref(),
            Some(
                "inet istio-proxy-nat prerouting -> istio-inbound -> istio-in-redirect (nftables)"
            )
        );
        assert_eq!(
            got.outbound.via.as_deref(),
            Some("inet istio-proxy-nat output -> istio-output -> istio-redirect (nftables)")
        );
    }

    #[test]
    fn empty_ruleset_is_missing_both() {
        let got = check(&Ruleset::default(), &profile("istio"), V4);
        assert_eq!(got.verdict, RedirectVerdict::Missing);
        assert!(!got.inbound.found && !got.outbound.found);
        assert!(got.message.contains("IPv4"), "{}", got.message);
    }

    #[test]
    fn unreachable_chain_does_not_count() {
        // The redirect chains exist but nothing jumps to them (a half-applied proxy-init).
        let mut t = linkerd_nat(Family::Ip, Source::IptablesNft);
        for c in &mut t.chains {
            if c.base.is_some() {
                c.rules.clear();
            }
        }
        let got = check(&set(vec![t]), &profile("linkerd"), V4);
        assert_eq!(got.verdict, RedirectVerdict::Missing);
        assert!(!got.inbound.found && !got.outbound.found);
    }

    #[test]
    fn redirect_in_wrong_hook_or_non_nat_chain_does_not_count() {
        // Inbound redirect only reachable from OUTPUT, outbound from PREROUTING: swapped.
        let t = table(
            Family::Ip,
            "nat",
            Source::IptablesNft,
            vec![
                Chain::nat_base(
                    "PREROUTING",
                    Hook::Prerouting,
                    -100,
                    vec![Rule::tcp(redirect(4140))],
                ),
                Chain::nat_base(
                    "OUTPUT",
                    Hook::Output,
                    -100,
                    vec![Rule::tcp(redirect(4143))],
                ),
            ],
        );
        assert_eq!(
            check(&set(vec![t]), &profile("linkerd"), V4).verdict,
            RedirectVerdict::Missing
        );
        // A filter-type base chain on the right hooks is no entry point.
        let mut f = istio_nft();
        for c in &mut f.chains {
            if let Some(b) = &mut c.base {
                b.chain_type = ChainType::Filter;
            }
        }
        assert_eq!(
            check(&set(vec![f]), &profile("istio"), V4).verdict,
            RedirectVerdict::Missing
        );
    }

    #[test]
    fn wrong_port_and_portless_redirect_do_not_count() {
        let t = table(
            Family::Ip,
            "nat",
            Source::IptablesLegacy,
            vec![
                Chain::nat_base(
                    "PREROUTING",
                    Hook::Prerouting,
                    -100,
                    vec![Rule::tcp(redirect(4144))],
                ),
                Chain::nat_base(
                    "OUTPUT",
                    Hook::Output,
                    -100,
                    vec![Rule::tcp(Action::Redirect { port: None })],
                ),
            ],
        );
        let got = check(&set(vec![t]), &profile("linkerd"), V4);
        assert!(!got.inbound.found && !got.outbound.found);
    }

    #[test]
    fn udp_redirect_does_not_count_but_conditional_tcp_redirect_does() {
        let udp = Rule {
            protocol: Protocol::Other,
            conditional: false,
            action: redirect(4143),
        };
        let t = table(
            Family::Ip,
            "nat",
            Source::IptablesNft,
            vec![
                Chain::nat_base("PREROUTING", Hook::Prerouting, -100, vec![udp]),
                // -p tcp --dport 8080 -j REDIRECT --to-ports 4140: partial coverage counts.
                Chain::nat_base(
                    "OUTPUT",
                    Hook::Output,
                    -100,
                    vec![Rule::tcp(redirect(4140)).when()],
                ),
            ],
        );
        let got = check(&set(vec![t]), &profile("linkerd"), V4);
        assert!(!got.inbound.found);
        assert!(got.outbound.found);
    }

    #[test]
    fn unconditional_terminal_rule_hides_later_rules() {
        for blocker in [
            Action::Accept,
            Action::Return,
            Action::Drop,
            Action::Nat,
            redirect(9999),
        ] {
            let t = table(
                Family::Ip,
                "nat",
                Source::IptablesNft,
                vec![Chain::nat_base(
                    "PREROUTING",
                    Hook::Prerouting,
                    -100,
                    vec![Rule::all(blocker.clone()), Rule::tcp(redirect(15006))],
                )],
            );
            let rs = set(vec![t]);
            assert_eq!(
                find_redirect(&rs, Hook::Prerouting, 15006, IpFamily::V4),
                None,
                "{blocker:?}"
            );
            // The same blocker limited to UDP or to some addresses hides nothing.
            let mut loose = rs.clone();
            loose.tables[0].chains[0].rules[0].conditional = true;
            assert!(find_redirect(&loose, Hook::Prerouting, 15006, IpFamily::V4).is_some());
            let mut udp = rs;
            udp.tables[0].chains[0].rules[0].protocol = Protocol::Other;
            assert!(find_redirect(&udp, Hook::Prerouting, 15006, IpFamily::V4).is_some());
        }
    }

    #[test]
    fn goto_does_not_come_back_but_jump_does() {
        // PREROUTING: jump A (A returns), then redirect: found through the base chain.
        let mk = |first: Action| {
            set(vec![table(
                Family::Ip,
                "nat",
                Source::Nftables,
                vec![
                    Chain::nat_base(
                        "pre",
                        Hook::Prerouting,
                        0,
                        vec![Rule::all(first), Rule::tcp(redirect(15006))],
                    ),
                    Chain::regular("A", vec![Rule::all(Action::Continue)]),
                ],
            )])
        };
        let via_jump = find_redirect(&mk(jump("A")), Hook::Prerouting, 15006, IpFamily::V4);
        assert_eq!(via_jump.map(|p| p.chains), Some(vec!["pre".to_owned()]));
        // An unconditional goto to A: when A returns, so does `pre`; the redirect after the
        // goto is never evaluated.
        assert_eq!(
            find_redirect(&mk(goto("A")), Hook::Prerouting, 15006, IpFamily::V4),
            None
        );
        // A goto to a chain holding the redirect is found, with the goto in the path.
        let rs = set(vec![table(
            Family::Ip,
            "nat",
            Source::Nftables,
            vec![
                Chain::nat_base("pre", Hook::Prerouting, 0, vec![Rule::all(goto("B"))]),
                Chain::regular("B", vec![Rule::tcp(redirect(15006))]),
            ],
        )]);
        assert_eq!(
            find_redirect(&rs, Hook::Prerouting, 15006, IpFamily::V4)
                .map(|p| p.to_string())
                .as_deref(),
            Some("ip nat pre -> B (nftables)")
        );
    }

    #[test]
    fn unconditional_jump_into_terminating_chain_hides_the_rest() {
        let rs = set(vec![table(
            Family::Ip,
            "nat",
            Source::IptablesNft,
            vec![
                Chain::nat_base(
                    "PREROUTING",
                    Hook::Prerouting,
                    -100,
                    vec![Rule::all(jump("ACCEPTALL")), Rule::tcp(redirect(15006))],
                ),
                Chain::regular("ACCEPTALL", vec![Rule::all(Action::Accept)]),
            ],
        )]);
        assert_eq!(
            find_redirect(&rs, Hook::Prerouting, 15006, IpFamily::V4),
            None
        );
    }

    #[test]
    fn cycles_terminate_and_still_find_redirects_behind_them() {
        let rs = set(vec![table(
            Family::Ip,
            "nat",
            Source::IptablesNft,
            vec![
                Chain::nat_base(
                    "PREROUTING",
                    Hook::Prerouting,
                    -100,
                    vec![Rule::all(jump("A"))],
                ),
                Chain::regular("A", vec![Rule::all(jump("B")).when(), Rule::all(jump("C"))]),
                Chain::regular("B", vec![Rule::all(jump("A")), Rule::all(goto("B"))]),
                Chain::regular("C", vec![Rule::all(jump("C")), Rule::tcp(redirect(15006))]),
            ],
        )]);
        let p = find_redirect(&rs, Hook::Prerouting, 15006, IpFamily::V4).expect("found");
        assert_eq!(p.chains, ["PREROUTING", "A", "C"]);
        // A pure cycle with no redirect ends with "not found".
        let rs = set(vec![table(
            Family::Ip,
            "nat",
            Source::IptablesNft,
            vec![
                Chain::nat_base(
                    "PREROUTING",
                    Hook::Prerouting,
                    0,
                    vec![Rule::all(jump("X"))],
                ),
                Chain::regular("X", vec![Rule::all(goto("Y"))]),
                Chain::regular("Y", vec![Rule::all(jump("X"))]),
            ],
        )]);
        assert_eq!(find_redirect(&rs, Hook::Prerouting, 1, IpFamily::V4), None);
    }

    #[test]
    fn jumps_to_missing_chains_and_other_tables_lead_nowhere() {
        // The redirect chain lives in another table: jumps never cross tables.
        let rs = set(vec![
            table(
                Family::Ip,
                "nat",
                Source::IptablesNft,
                vec![Chain::nat_base(
                    "PREROUTING",
                    Hook::Prerouting,
                    -100,
                    vec![Rule::all(jump("REDIR")), Rule::all(jump("GONE"))],
                )],
            ),
            table(
                Family::Ip,
                "other",
                Source::Nftables,
                vec![Chain::regular("REDIR", vec![Rule::tcp(redirect(15006))])],
            ),
        ]);
        assert_eq!(
            find_redirect(&rs, Hook::Prerouting, 15006, IpFamily::V4),
            None
        );
    }

    #[test]
    fn ipv6_is_required_only_when_asked() {
        // Linkerd legacy mode writes iptables and ip6tables; here ip6tables was forgotten.
        let rs = set(vec![linkerd_nat(Family::Ip, Source::IptablesLegacy)]);
        assert_eq!(
            check(&rs, &profile("linkerd"), V4).verdict,
            RedirectVerdict::Redirected
        );
        // On the mesh's default (disableIPv6) a dual-stack pod gets IPv4 rules only, and that
        // is what Linkerd writes: redirected. (This used to be `missing`, which evicted every
        // meshed pod of a dual-stack cluster in a loop.)
        let default = check(&rs, &profile("linkerd"), DUAL);
        assert_eq!(
            default.verdict,
            RedirectVerdict::Redirected,
            "{}",
            default.message
        );
        assert!(default.inbound.missing_families.is_empty());
        // With a profile configured dual-stack, the forgotten ip6tables rules are missing.
        let mut dual_profile = profile("linkerd");
        dual_profile.dual_stack = true;
        let dual = check(&rs, &dual_profile, DUAL);
        assert_eq!(dual.verdict, RedirectVerdict::Missing);
        assert_eq!(dual.inbound.missing_families, [IpFamily::V6]);
        assert!(dual.message.contains("IPv6"), "{}", dual.message);
        // A found IPv4 path is still reported for operators.
        assert!(dual.inbound.via.is_some());

        let both = set(vec![
            linkerd_nat(Family::Ip, Source::IptablesLegacy),
            linkerd_nat(Family::Ip6, Source::IptablesLegacy),
        ]);
        let got = check(&both, &dual_profile, DUAL);
        assert_eq!(got.verdict, RedirectVerdict::Redirected);
        assert_eq!(
            got.inbound.via.as_deref(),
            Some(
                "ip nat PREROUTING -> PROXY_INIT_REDIRECT (iptables-legacy); \
                 ip6 nat PREROUTING -> PROXY_INIT_REDIRECT (iptables-legacy)"
            )
        );
        // IPv6-only pod: the ip table is irrelevant.
        let v6 = set(vec![linkerd_nat(Family::Ip6, Source::IptablesNft)]);
        assert_eq!(
            check(&v6, &profile("linkerd"), &[IpFamily::V6]).verdict,
            RedirectVerdict::Redirected
        );
        assert_eq!(
            check(&v6, &profile("linkerd"), V4).verdict,
            RedirectVerdict::Missing
        );
    }

    #[test]
    fn any_table_of_any_source_may_provide_the_path() {
        // An empty iptables-nft nat table next to Istio's native table: the native one counts.
        let mut empty = linkerd_nat(Family::Ip, Source::IptablesNft);
        empty.chains.retain(|c| c.base.is_some());
        for c in &mut empty.chains {
            c.rules.clear();
        }
        let got = check(&set(vec![empty, istio_nft()]), &profile("istio"), V4);
        assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
        assert!(
            got.inbound
                .via
                .as_deref()
                .unwrap_or("")
                .contains("istio-proxy-nat")
        );
    }

    #[test]
    fn base_chains_are_tried_in_priority_order() {
        let rs = set(vec![
            table(
                Family::Ip,
                "late",
                Source::Nftables,
                vec![Chain::nat_base(
                    "pre",
                    Hook::Prerouting,
                    100,
                    vec![Rule::tcp(redirect(1))],
                )],
            ),
            table(
                Family::Ip,
                "early",
                Source::Nftables,
                vec![Chain::nat_base(
                    "pre",
                    Hook::Prerouting,
                    -100,
                    vec![Rule::tcp(redirect(1))],
                )],
            ),
        ]);
        let p = find_redirect(&rs, Hook::Prerouting, 1, IpFamily::V4).expect("found");
        assert_eq!(p.table, "early");
    }

    #[test]
    fn json_shape_follows_the_contract() {
        let rs = set(vec![istio_nft()]);
        let got = check(&rs, &profile("istio"), V4);
        let v = serde_json::to_value(&got).expect("serializes");
        assert_eq!(v["verdict"], "redirected");
        assert_eq!(v["inbound"]["port"], 15006);
        assert_eq!(v["inbound"]["found"], true);
        assert!(v["inbound"]["via"].is_string());
        assert!(v["inbound"].get("missing_families").is_none());
        let unknown = Inspection::unknown(&profile("istio"), "no netns");
        assert_eq!(
            serde_json::to_value(&unknown).expect("ser")["verdict"],
            "unknown"
        );
    }

    fn base(
        name: &str,
        hook: Hook,
        chain_type: ChainType,
        priority: i32,
        rules: Vec<Rule>,
    ) -> Chain {
        Chain {
            name: name.into(),
            base: Some(super::super::BaseChain {
                hook,
                chain_type,
                priority,
            }),
            rules,
        }
    }

    fn tproxy(p: u16) -> Action {
        Action::Tproxy {
            port: Some(p),
            only: None,
        }
    }

    /// istio-iptables' TPROXY mode (golden `tproxy.golden`), reduced: mangle PREROUTING ->
    /// ISTIO_INBOUND -> ISTIO_TPROXY, plus nat OUTPUT -> ISTIO_OUTPUT -> ISTIO_REDIRECT, and
    /// no nat PREROUTING rule at all.
    fn istio_tproxy(family: Family) -> Vec<Table> {
        let mangle = table(
            family,
            "mangle",
            Source::IptablesLegacy,
            vec![
                base(
                    "PREROUTING",
                    Hook::Prerouting,
                    ChainType::Filter,
                    -150,
                    vec![
                        Rule::tcp(jump("ISTIO_INBOUND")),
                        // -p tcp -m mark --mark 1337 -j CONNMARK --save-mark
                        Rule::tcp(Action::Continue).when(),
                    ],
                ),
                Chain::regular(
                    "ISTIO_INBOUND",
                    vec![
                        Rule::tcp(Action::Return).when(),       // -m mark --mark 1337
                        Rule::tcp(Action::Return).when(),       // -s 127.0.0.6/32 -i lo
                        Rule::tcp(Action::Return).when(),       // -i lo -m mark ! --mark 1338
                        Rule::tcp(Action::Return).when(),       // --dport 15008
                        Rule::tcp(jump("ISTIO_DIVERT")).when(), // --ctstate RELATED,ESTABLISHED
                        Rule::tcp(jump("ISTIO_TPROXY")),
                    ],
                ),
                Chain::regular(
                    "ISTIO_DIVERT",
                    vec![
                        Rule::all(Action::Continue), // MARK --set-mark 1337
                        Rule::all(Action::Accept),
                    ],
                ),
                // ! -d 127.0.0.1/32 -p tcp -j TPROXY --on-port 15006
                Chain::regular("ISTIO_TPROXY", vec![Rule::tcp(tproxy(15006)).when()]),
            ],
        );
        let mut nat = istio_nat(family, Source::IptablesLegacy);
        for c in &mut nat.chains {
            if c.name == "PREROUTING" {
                c.rules.clear();
            }
        }
        vec![mangle, nat]
    }

    #[test]
    fn istio_tproxy_mode_is_redirected() {
        let rs = set(istio_tproxy(Family::Ip));
        let got = check(&rs, &profile("istio"), V4);
        assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
        assert_eq!(
            got.inbound.via.as_deref(),
            Some("ip mangle PREROUTING -> ISTIO_INBOUND -> ISTIO_TPROXY (iptables-legacy)")
        );
        // A TPROXY to another port, or reached only from OUTPUT, does not count.
        let mut wrong = rs.clone();
        wrong.tables[0].chains[3].rules[0].action = tproxy(15007);
        assert!(!check(&wrong, &profile("istio"), V4).inbound.found);
        let mut out = rs.clone();
        if let Some(b) = &mut out.tables[0].chains[0].base {
            b.hook = Hook::Output;
        }
        assert!(!check(&out, &profile("istio"), V4).inbound.found);
        // A TPROXY never stands in for the outbound redirect.
        let t = table(
            Family::Ip,
            "mangle",
            Source::Nftables,
            vec![base(
                "pre",
                Hook::Prerouting,
                ChainType::Filter,
                -150,
                vec![Rule::tcp(tproxy(15001))],
            )],
        );
        assert_eq!(
            find_redirect(&set(vec![t]), Hook::Output, 15001, IpFamily::V4),
            None
        );
    }

    #[test]
    fn an_inet_tproxy_for_one_family_does_not_intercept_the_other() {
        let only = |f| Action::Tproxy {
            port: Some(15006),
            only: Some(f),
        };
        let t = |rules| {
            set(vec![table(
                Family::Inet,
                "m",
                Source::Nftables,
                vec![base(
                    "pre",
                    Hook::Prerouting,
                    ChainType::Filter,
                    -150,
                    rules,
                )],
            )])
        };
        let v4_only = t(vec![Rule::tcp(only(IpFamily::V4)).when()]);
        assert!(find_redirect(&v4_only, Hook::Prerouting, 15006, IpFamily::V4).is_some());
        assert_eq!(
            find_redirect(&v4_only, Hook::Prerouting, 15006, IpFamily::V6),
            None
        );
        let both = t(vec![
            Rule::tcp(only(IpFamily::V4)).when(),
            Rule::tcp(only(IpFamily::V6)).when(),
        ]);
        assert!(find_redirect(&both, Hook::Prerouting, 15006, IpFamily::V6).is_some());
    }

    #[test]
    fn accept_in_an_earlier_base_chain_does_not_hide_a_later_one() {
        let mut tables = vec![table(
            Family::Inet,
            "fw",
            Source::Nftables,
            vec![base(
                "pre",
                Hook::Prerouting,
                ChainType::Filter,
                -200,
                vec![Rule::tcp(Action::Accept)],
            )],
        )];
        tables.push(linkerd_nat(Family::Ip, Source::IptablesNft));
        let got = check(&set(tables), &profile("linkerd"), V4);
        assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
    }

    #[test]
    fn drop_in_an_earlier_base_chain_hides_everything_after_it() {
        let fw = |priority, rule: Rule| {
            table(
                Family::Inet,
                "fw",
                Source::Nftables,
                vec![base(
                    "pre",
                    Hook::Prerouting,
                    ChainType::Filter,
                    priority,
                    vec![rule],
                )],
            )
        };
        let rs = set(vec![
            fw(-200, Rule::tcp(Action::Drop)),
            linkerd_nat(Family::Ip, Source::IptablesNft),
        ]);
        let got = check(&rs, &profile("linkerd"), V4);
        assert_eq!(got.verdict, RedirectVerdict::Missing);
        assert!(!got.inbound.found && got.outbound.found);
        assert!(
            got.message
                .contains("every TCP packet is dropped in inet fw pre"),
            "{}",
            got.message
        );
        // A conditional drop, a UDP drop, or a drop after the nat hook hides nothing. A nat
        // chain declared at priority 0 still runs inside the nf_nat hook at -100, before a
        // filter chain at -50.
        for blocker in [
            fw(-200, Rule::tcp(Action::Drop).when()),
            fw(
                -200,
                Rule {
                    protocol: Protocol::Other,
                    conditional: false,
                    action: Action::Drop,
                },
            ),
            fw(-50, Rule::tcp(Action::Drop)),
        ] {
            let mut nat = linkerd_nat(Family::Ip, Source::IptablesNft);
            for c in &mut nat.chains {
                if let Some(b) = &mut c.base {
                    b.priority = 0;
                }
            }
            let got = check(&set(vec![blocker, nat]), &profile("linkerd"), V4);
            assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
        }
    }

    #[test]
    fn an_end_some_packets_escape_hides_nothing() {
        let early = |chain_type, rules: Vec<Rule>| {
            table(
                Family::Ip,
                "early",
                Source::Nftables,
                vec![base("pre", Hook::Prerouting, chain_type, -150, rules)],
            )
        };
        let verdict = |t: Table| {
            check(
                &set(vec![t, linkerd_nat(Family::Ip, Source::IptablesNft)]),
                &profile("linkerd"),
                V4,
            )
            .verdict
        };
        // `tcp dport 8080 accept; drop` (a firewall with a policy drop): port 8080 passes.
        assert_eq!(
            verdict(early(
                ChainType::Filter,
                vec![Rule::tcp(Action::Accept).when(), Rule::all(Action::Drop)]
            )),
            RedirectVerdict::Redirected
        );
        // The same escape through a conditional return from the base chain, or through a
        // jumped-to chain that accepts some packets.
        assert_eq!(
            verdict(early(
                ChainType::Filter,
                vec![Rule::all(Action::Return).when(), Rule::all(Action::Drop)]
            )),
            RedirectVerdict::Redirected
        );
        let mut t = early(
            ChainType::Filter,
            vec![Rule::all(jump("SOME")), Rule::all(Action::Drop)],
        );
        t.chains.push(Chain::regular(
            "SOME",
            vec![Rule::tcp(Action::Accept).when()],
        ));
        assert_eq!(verdict(t), RedirectVerdict::Redirected);
        // Without an escape the drop hides the redirect.
        let mut t = early(
            ChainType::Filter,
            vec![Rule::all(jump("NONE")), Rule::all(Action::Drop)],
        );
        t.chains
            .push(Chain::regular("NONE", vec![Rule::tcp(Action::Drop).when()]));
        assert_eq!(verdict(t), RedirectVerdict::Missing);
        // NAT: connections accepted unbound go on to the next nat chain; dropped ones do not
        // matter.
        assert_eq!(
            verdict(early(
                ChainType::Nat,
                vec![Rule::tcp(Action::Accept).when(), Rule::tcp(Action::Nat)]
            )),
            RedirectVerdict::Redirected
        );
        assert_eq!(
            verdict(early(
                ChainType::Nat,
                vec![Rule::tcp(Action::Drop).when(), Rule::tcp(Action::Nat)]
            )),
            RedirectVerdict::Missing
        );
    }

    #[test]
    fn the_first_nat_binding_wins_across_nat_chains() {
        // A native nat chain at -150 DNATs every TCP connection: iptables' nat PREROUTING
        // (-100) never runs for it, so Linkerd's inbound redirect is not reached.
        let dnat = |rule: Rule, priority| {
            table(
                Family::Ip,
                "kube",
                Source::Nftables,
                vec![Chain::nat_base(
                    "pre",
                    Hook::Prerouting,
                    priority,
                    vec![rule],
                )],
            )
        };
        let got = check(
            &set(vec![
                linkerd_nat(Family::Ip, Source::IptablesNft),
                dnat(Rule::tcp(Action::Nat), -150),
            ]),
            &profile("linkerd"),
            V4,
        );
        assert_eq!(got.verdict, RedirectVerdict::Missing);
        assert!(!got.inbound.found && got.outbound.found);
        assert!(
            got.message.contains("NAT binding in ip kube pre first"),
            "{}",
            got.message
        );
        // A redirect to another port binds too.
        let got = check(
            &set(vec![
                linkerd_nat(Family::Ip, Source::IptablesNft),
                dnat(Rule::tcp(redirect(9999)), -150),
            ]),
            &profile("linkerd"),
            V4,
        );
        assert!(!got.inbound.found);
        // Conditional NAT, an accept (no binding), or NAT after the redirect hide nothing.
        for other in [
            dnat(Rule::tcp(Action::Nat).when(), -150),
            dnat(Rule::tcp(Action::Accept), -150),
            dnat(Rule::tcp(Action::Nat), -50),
        ] {
            let got = check(
                &set(vec![linkerd_nat(Family::Ip, Source::IptablesNft), other]),
                &profile("linkerd"),
                V4,
            );
            assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
        }
        // Another family's NAT is irrelevant.
        let mut v6 = dnat(Rule::tcp(Action::Nat), -150);
        v6.family = Family::Ip6;
        let got = check(
            &set(vec![linkerd_nat(Family::Ip, Source::IptablesNft), v6]),
            &profile("linkerd"),
            V4,
        );
        assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
    }

    #[test]
    fn opted_out_directions_are_not_required() {
        // istio-iptables with includeInboundPorts "" writes no PREROUTING jump (golden
        // `ipv6-empty-inbound-ports`): missing without the annotation, redirected with it.
        let mut t = istio_nat(Family::Ip, Source::IptablesNft);
        for c in &mut t.chains {
            if c.name == "PREROUTING" {
                c.rules.clear();
            }
        }
        let rs = set(vec![t]);
        assert_eq!(
            check(&rs, &profile("istio"), V4).verdict,
            RedirectVerdict::Missing
        );
        let ann: BTreeMap<String, String> = [(
            "traffic.sidecar.istio.io/includeInboundPorts".to_string(),
            String::new(),
        )]
        .into();
        let got = check_pod(&rs, &profile("istio"), V4, &ann);
        assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
        assert!(!got.inbound.expected && !got.inbound.found);
        assert!(got.outbound.expected && got.outbound.found);
        assert!(
            got.message.contains("inbound not expected"),
            "{}",
            got.message
        );
        let v = serde_json::to_value(&got).expect("json");
        assert_eq!(v["inbound"]["expected"], false);
        assert!(v["outbound"].get("expected").is_none());
        // The direction it kept is still checked.
        let got = check_pod(&Ruleset::default(), &profile("istio"), V4, &ann);
        assert_eq!(got.verdict, RedirectVerdict::Missing);
    }

    #[test]
    fn rulesets_beyond_the_limits_are_unknown() {
        let mut t = linkerd_nat(Family::Ip, Source::IptablesNft);
        let filler = Chain::regular(
            "FILLER",
            vec![Rule::all(Action::Continue); DumpLimits::DEFAULT.max_rules],
        );
        t.chains.push(filler);
        let got = check(&set(vec![t]), &profile("linkerd"), V4);
        assert_eq!(got.verdict, RedirectVerdict::Unknown);
        assert!(got.message.contains("rules (limit"), "{}", got.message);
        let many = Ruleset {
            tables: vec![table(Family::Ip, "t", Source::Nftables, vec![]); 300],
        };
        assert_eq!(
            check(&many, &profile("linkerd"), V4).verdict,
            RedirectVerdict::Unknown
        );
    }

    mod arbitrary {
        use super::*;
        use proptest::prelude::*;

        fn action() -> impl Strategy<Value = Action> {
            prop_oneof![
                Just(Action::Continue),
                Just(Action::Accept),
                Just(Action::Drop),
                Just(Action::Return),
                Just(Action::Nat),
                (0u8..6).prop_map(|c| Action::Jump(format!("c{c}"))),
                (0u8..6).prop_map(|c| Action::Goto(format!("c{c}"))),
                prop::option::of(0u16..4).prop_map(|port| Action::Redirect { port }),
            ]
        }

        fn rule() -> impl Strategy<Value = Rule> {
            (
                prop_oneof![
                    Just(Protocol::Any),
                    Just(Protocol::Tcp),
                    Just(Protocol::Other)
                ],
                any::<bool>(),
                action(),
            )
                .prop_map(|(protocol, conditional, action)| Rule {
                    protocol,
                    conditional,
                    action,
                })
        }

        proptest! {
            /// Arbitrary graphs (cycles, dangling jumps) always terminate, and a found path
            /// always starts at a nat base chain and follows existing chains.
            #[test]
            fn arbitrary_graphs_terminate(chains in prop::collection::vec(prop::collection::vec(rule(), 0..6), 1..6)) {
                let chains: Vec<Chain> = chains.into_iter().enumerate().map(|(i, rules)| {
                    if i == 0 {
                        Chain::nat_base("c0", Hook::Prerouting, 0, rules)
                    } else {
                        Chain::regular(&format!("c{i}"), rules)
                    }
                }).collect();
                let rs = set(vec![table(Family::Inet, "t", Source::Nftables, chains)]);
                if let Some(p) = find_redirect(&rs, Hook::Prerouting, 1, IpFamily::V6) {
                    prop_assert_eq!(p.chains.first().map(String::as_str), Some("c0"));
                    for c in &p.chains {
                        prop_assert!(rs.tables[0].chain(c).is_some());
                    }
                }
            }
        }
    }
}
