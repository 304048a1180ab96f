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

/// A base chain on the hook, in the order the kernel runs it.
struct Entry<'a> {
    key: (i32, u8, i32, usize),
    table: usize,
    name: &'a str,
    nat: bool,
}

/// The base chains on `hook` of the tables packets of family `ip` traverse, sorted as the
/// kernel runs them (nat chains at their hook's NAT priority, see the module docs).
fn entries(ruleset: &Ruleset, hook: Hook, ip: IpFamily) -> Vec<Entry<'_>> {
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
    entries
}

/// Finds a TCP interception to `port` on `hook` for packets of family `ip`: a redirect from a
/// nat chain, or (on PREROUTING) a TPROXY from any chain. See the module docs for the order.
pub fn find_interception(
    ruleset: &Ruleset,
    hook: Hook,
    port: u16,
    ip: IpFamily,
) -> Result<Path, NotFound> {
    // One walker per table and chain kind: chains explored from one base chain need no
    // second visit from another base chain of the same kind in the same table.
    let mut walkers: HashMap<(usize, bool), Walker<'_>> = HashMap::new();
    let mut nat_bound: Option<String> = None;
    for e in entries(ruleset, hook, ip) {
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
mod tests;
