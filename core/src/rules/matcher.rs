//! Reachability of a TCP redirect from a nat hook, through jump/goto edges.
//!
//! In: a [`Ruleset`], the hook, the expected port and an IP family. Out: the first [`Path`]
//! from a nat base chain on that hook to a rule redirecting every TCP packet it sees to the
//! port, or `None`. [`check`] runs that for both directions of a [`MeshProfile`] and every
//! family the pod uses, and turns it into an [`Inspection`].
//!
//! Semantics, kept to what the kernel does with a TCP packet:
//! - Entry points are base chains of type nat on the hook, in every table whose family the
//!   packet traverses (iptables' `nat` PREROUTING/OUTPUT is such a chain, and so is any native
//!   `type nat hook prerouting` chain, whatever the table's name).
//! - Rules are walked in order. A rule restricted to another protocol is skipped. A rule that
//!   applies to every TCP packet and ends evaluation (accept, drop, return, another NAT
//!   action, a redirect elsewhere, or an unconditional goto) hides every rule after it; a
//!   conditional one does not.
//! - A redirect counts when it targets the expected port, even if conditional: a mesh that
//!   skips some ports (Linkerd's ignored ports, Istio's 15008) is still redirecting.
//! - A jump explores the target chain and comes back; an unconditional jump into a chain that
//!   always terminates also hides the rest of the caller. A goto does not come back.
//! - Jumps stay inside their table. Every chain is explored at most once per search, which
//!   both bounds the work and breaks cycles.

use std::collections::HashMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::{Action, ChainType, Family, Hook, IpFamily, Protocol, Ruleset, Source, Table, Verdict};
use crate::profile::MeshProfile;

/// Where a redirect was found: the chain path from the hook's base chain to the redirect.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Path {
    /// Family of the table.
    pub family: Family,
    /// Table name.
    pub table: String,
    /// Chains from the base chain to the one holding the redirect.
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

/// Finds a TCP redirect to `port` reachable from the nat base chains on `hook` for packets of
/// family `ip`. Base chains are tried in priority order, then in reading order.
pub fn find_redirect(ruleset: &Ruleset, hook: Hook, port: u16, ip: IpFamily) -> Option<Path> {
    let mut entries: Vec<(i32, usize, &Table, &str)> = Vec::new();
    for (i, table) in ruleset.tables.iter().enumerate() {
        if !table.family.covers(ip) {
            continue;
        }
        for chain in &table.chains {
            if let Some(base) = chain.base
                && base.hook == hook
                && base.chain_type == ChainType::Nat
            {
                entries.push((base.priority, i, table, chain.name.as_str()));
            }
        }
    }
    entries.sort_by_key(|(prio, i, _, _)| (*prio, *i));
    // One walker per table: chains explored from one base chain need no second visit from
    // another base chain of the same table.
    let mut walkers: HashMap<usize, Walker<'_>> = HashMap::new();
    for (_, i, table, name) in entries {
        let walker = walkers.entry(i).or_insert_with(|| Walker::new(table, port));
        if let Outcome::Found(chains) = walker.chain(name) {
            return Some(Path {
                family: table.family,
                table: table.name.clone(),
                chains: chains.into_iter().map(str::to_owned).collect(),
                source: table.source,
            });
        }
    }
    None
}

enum Outcome<'a> {
    /// The chain path to the redirect.
    Found(Vec<&'a str>),
    /// No redirect; `terminates` is true when every TCP packet entering the chain is
    /// accepted, dropped or NATed there (so an unconditional jump to it never comes back).
    NotFound { terminates: bool },
}

#[derive(Clone, Copy)]
enum Memo {
    InProgress,
    Done { terminates: bool },
}

struct Walker<'a> {
    table: &'a Table,
    port: u16,
    memo: HashMap<&'a str, Memo>,
    stack: Vec<&'a str>,
}

impl<'a> Walker<'a> {
    fn new(table: &'a Table, port: u16) -> Self {
        Self {
            table,
            port,
            memo: HashMap::new(),
            stack: Vec::new(),
        }
    }

    fn chain(&mut self, name: &'a str) -> Outcome<'a> {
        match self.memo.get(name) {
            // A cycle: the kernel refuses loops, but a model built from odd data may have
            // one. Re-entering adds nothing that the first visit will not find.
            Some(Memo::InProgress) => return Outcome::NotFound { terminates: false },
            Some(Memo::Done { terminates }) => {
                return Outcome::NotFound {
                    terminates: *terminates,
                };
            }
            None => {}
        }
        let table = self.table;
        let Some(chain) = table.chain(name) else {
            // A jump to a chain that does not exist: the kernel would not load it. Treat the
            // edge as leading nowhere.
            return Outcome::NotFound { terminates: false };
        };
        self.memo.insert(name, Memo::InProgress);
        self.stack.push(name);
        let mut terminates = false;
        for rule in &chain.rules {
            if rule.protocol == Protocol::Other {
                continue;
            }
            let always = rule.applies_to_all_tcp();
            match &rule.action {
                Action::Continue => {}
                Action::Redirect { port: Some(p) } if *p == self.port => {
                    return Outcome::Found(self.stack.clone());
                }
                Action::Redirect { .. } | Action::Accept | Action::Drop | Action::Nat => {
                    if always {
                        terminates = true;
                        break;
                    }
                }
                Action::Return => {
                    if always {
                        break;
                    }
                }
                Action::Jump(target) => match self.chain(target) {
                    found @ Outcome::Found(_) => return found,
                    Outcome::NotFound { terminates: t } => {
                        if always && t {
                            terminates = true;
                            break;
                        }
                    }
                },
                Action::Goto(target) => match self.chain(target) {
                    found @ Outcome::Found(_) => return found,
                    Outcome::NotFound { terminates: t } => {
                        if always {
                            // Control never comes back here: when the target returns, this
                            // chain has returned too.
                            terminates = t;
                            break;
                        }
                    }
                },
            }
        }
        self.stack.pop();
        self.memo.insert(name, Memo::Done { terminates });
        Outcome::NotFound { terminates }
    }
}

/// The result for one direction, serialized as the contract's `{"port", "found", "via"}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectionResult {
    /// Expected redirect port.
    pub port: u16,
    /// True when the redirect is reachable for every required family.
    pub found: bool,
    /// The paths found (one per distinct path, `; `-separated), `null` when none was found.
    pub via: Option<String>,
    /// Families for which no path was found (empty when `found`).
    #[serde(skip)]
    pub missing_families: Vec<IpFamily>,
}

impl DirectionResult {
    fn compute(ruleset: &Ruleset, hook: Hook, port: u16, families: &[IpFamily]) -> Self {
        let mut via: Vec<String> = Vec::new();
        let mut missing_families = Vec::new();
        for &ip in families {
            match find_redirect(ruleset, hook, port, ip) {
                Some(path) => {
                    let text = path.to_string();
                    if !via.contains(&text) {
                        via.push(text);
                    }
                }
                None => missing_families.push(ip),
            }
        }
        Self {
            port,
            found: missing_families.is_empty(),
            via: (!via.is_empty()).then(|| via.join("; ")),
            missing_families,
        }
    }
}

/// One pod namespace checked against one profile.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inspection {
    /// Profile name.
    pub profile: String,
    /// `redirected` when both directions are found, else `missing` (or `unknown`, built by
    /// [`Inspection::unknown`]).
    pub verdict: Verdict,
    /// Inbound: redirect reachable from nat PREROUTING.
    pub inbound: DirectionResult,
    /// Outbound: redirect reachable from nat OUTPUT.
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
            missing_families: Vec::new(),
        };
        Self {
            profile: profile.name.clone(),
            verdict: Verdict::Unknown,
            inbound: dir(profile.inbound_port),
            outbound: dir(profile.outbound_port),
            message: why.to_owned(),
        }
    }
}

/// Checks one namespace's rules against a profile. `families` are the IP families the pod
/// has addresses in; an empty slice means IPv4 only.
pub fn check(ruleset: &Ruleset, profile: &MeshProfile, families: &[IpFamily]) -> Inspection {
    let mut fams: Vec<IpFamily> = families.to_vec();
    if fams.is_empty() {
        fams.push(IpFamily::V4);
    }
    fams.sort();
    fams.dedup();
    let inbound = DirectionResult::compute(ruleset, Hook::Prerouting, profile.inbound_port, &fams);
    let outbound = DirectionResult::compute(ruleset, Hook::Output, profile.outbound_port, &fams);
    let verdict = if inbound.found && outbound.found {
        Verdict::Redirected
    } else {
        Verdict::Missing
    };
    let mut problems = Vec::new();
    for (dir, hook, res) in [
        ("inbound", "PREROUTING", &inbound),
        ("outbound", "OUTPUT", &outbound),
    ] {
        if !res.found {
            let fam = res
                .missing_families
                .iter()
                .map(|f| f.as_str())
                .collect::<Vec<_>>()
                .join(" and ");
            problems.push(format!(
                "no {dir} TCP redirect to port {} reachable from nat {hook} ({fam})",
                res.port
            ));
        }
    }
    let message = if problems.is_empty() {
        format!(
            "{}: inbound ({}) and outbound ({}) TCP redirects are in place",
            profile.name, profile.inbound_port, profile.outbound_port
        )
    } else {
        format!("{}: {}", profile.name, problems.join("; "))
    };
    Inspection {
        profile: profile.name.clone(),
        verdict,
        inbound,
        outbound,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Chain, Rule, Table};
    use super::*;
    use crate::profile::ProfileSet;

    fn profile(name: &str) -> MeshProfile {
        ProfileSet::all_builtin()
            .get(name)
            .cloned()
            .expect("built-in profile")
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
        assert_eq!(got.verdict, Verdict::Redirected, "{}", got.message);
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
        assert_eq!(got.verdict, Verdict::Redirected, "{}", got.message);
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
        assert_eq!(other.verdict, Verdict::Missing);
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
        assert_eq!(got.verdict, Verdict::Redirected, "{}", got.message);
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
        assert_eq!(got.verdict, Verdict::Missing);
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
        assert_eq!(got.verdict, Verdict::Missing);
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
            Verdict::Missing
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
            Verdict::Missing
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
            Verdict::Redirected
        );
        let dual = check(&rs, &profile("linkerd"), DUAL);
        assert_eq!(dual.verdict, Verdict::Missing);
        assert_eq!(dual.inbound.missing_families, [IpFamily::V6]);
        assert!(dual.message.contains("IPv6"), "{}", dual.message);
        // A found IPv4 path is still reported for operators.
        assert!(dual.inbound.via.is_some());

        let both = set(vec![
            linkerd_nat(Family::Ip, Source::IptablesLegacy),
            linkerd_nat(Family::Ip6, Source::IptablesLegacy),
        ]);
        let got = check(&both, &profile("linkerd"), DUAL);
        assert_eq!(got.verdict, Verdict::Redirected);
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
            Verdict::Redirected
        );
        assert_eq!(
            check(&v6, &profile("linkerd"), V4).verdict,
            Verdict::Missing
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
        assert_eq!(got.verdict, Verdict::Redirected, "{}", got.message);
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
