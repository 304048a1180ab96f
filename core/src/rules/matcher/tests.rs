//! Tests of the reachability matcher: rule graphs as the readers build them, and the
//! verdicts and paths the matcher finds in them.

use super::super::{Chain, Rule, Table};
use super::*;
use std::collections::BTreeMap;

/// [`check_pod`] for a pod without annotations.
fn check(ruleset: &Ruleset, profile: &MeshProfile, families: &[IpFamily]) -> Inspection {
    check_pod(ruleset, profile, families, &BTreeMap::new())
}

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
        Some("inet istio-proxy-nat prerouting -> istio-inbound -> istio-in-redirect (nftables)")
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

fn base(name: &str, hook: Hook, chain_type: ChainType, priority: i32, rules: Vec<Rule>) -> Chain {
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
