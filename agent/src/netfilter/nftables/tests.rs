//! The nf_tables decoder, summarizer and assembler on hand-built expressions and kernel
//! messages, and on arbitrary bytes.

use meshgate_core::rules::{Action, Family, Hook, IpFamily, Protocol, Rule, Source};
use proptest::prelude::*;

use super::assemble::TABLE_F_DORMANT;
use super::dump::{MSG_GETRULE, NLM_F_DUMP, NLM_F_REQUEST, request};
use super::*;
use crate::netfilter::{u16_at, u32_at};

fn meta_l4(dreg: u32) -> Expr {
    Expr::Meta {
        key: libc::NFT_META_L4PROTO as u32,
        dreg,
    }
}
fn cmp_eq(sreg: u32, data: &[u8]) -> Expr {
    Expr::Cmp {
        sreg,
        op: libc::NFT_CMP_EQ as u32,
        data: data.to_vec(),
    }
}

/// `iptables-nft -t nat -A X -p tcp -j REDIRECT --to-ports 4143` as the kernel holds it.
#[test]
fn iptables_nft_redirect() {
    let mut info = vec![0u8; 20];
    info[0..4].copy_from_slice(&1u32.to_ne_bytes());
    info[4..8].copy_from_slice(&2u32.to_ne_bytes());
    info[16..18].copy_from_slice(&4143u16.to_be_bytes());
    let exprs = [
        meta_l4(1),
        cmp_eq(1, &[6, 0, 0, 0]),
        Expr::Named("counter".into()),
        Expr::XtTarget {
            name: "REDIRECT".into(),
            info,
        },
    ];
    let (rule, xt) = summarize(Family::Ip, &exprs);
    assert!(xt);
    assert_eq!(rule, Rule::tcp(Action::Redirect { port: Some(4143) }));
}

/// `tcp dport != 15008 redirect to :15006` (native nft).
#[test]
fn native_redirect_through_register() {
    let exprs = [
        meta_l4(1),
        cmp_eq(1, &[6]),
        Expr::Payload {
            base: 2,
            offset: 2,
            len: 2,
            dreg: 1,
        },
        Expr::Cmp {
            sreg: 1,
            op: 1, // NFT_CMP_NEQ
            data: vec![0x3a, 0xa0],
        },
        Expr::Load {
            dreg: 1,
            data: vec![0x3a, 0x9e, 0, 0],
        },
        Expr::Redir {
            proto_min_reg: Some(1),
        },
    ];
    let (rule, xt) = summarize(Family::Inet, &exprs);
    assert!(!xt);
    assert_eq!(
        rule,
        Rule::tcp(Action::Redirect { port: Some(15006) }).when()
    );
}

/// `iptables-nft -t mangle -A ISTIO_TPROXY ! -d 127.0.0.1/32 -p tcp -j TPROXY
/// --tproxy-mark 1337/0xffffffff --on-port 15006` (xt TPROXY revision 1).
#[test]
fn iptables_nft_tproxy() {
    let mut info = vec![0u8; 32];
    info[0..4].copy_from_slice(&u32::MAX.to_ne_bytes());
    info[4..8].copy_from_slice(&1337u32.to_ne_bytes());
    info[24..26].copy_from_slice(&15006u16.to_be_bytes());
    let exprs = [
        Expr::Payload {
            base: 1,
            offset: 16,
            len: 4,
            dreg: 1,
        },
        Expr::Cmp {
            sreg: 1,
            op: 1, // NFT_CMP_NEQ
            data: vec![127, 0, 0, 1],
        },
        meta_l4(1),
        cmp_eq(1, &[6]),
        Expr::XtTarget {
            name: "TPROXY".into(),
            info,
        },
    ];
    let (rule, xt) = summarize(Family::Ip, &exprs);
    assert!(xt);
    assert_eq!(
        rule,
        Rule::tcp(Action::Tproxy {
            port: Some(15006),
            only: None
        })
        .when()
    );
}

/// `meta l4proto tcp tproxy ip to :15006 meta mark set 0x539 accept` (native nft).
#[test]
fn native_tproxy_is_conditional() {
    let exprs = [
        meta_l4(1),
        cmp_eq(1, &[6]),
        Expr::Load {
            dreg: 1,
            data: vec![0x3a, 0x9e, 0, 0],
        },
        Expr::Tproxy {
            family: Some(libc::NFPROTO_IPV6 as u32),
            port_reg: Some(1),
        },
        Expr::Named("meta".into()),
        Expr::Verdict {
            code: libc::NF_ACCEPT,
            chain: None,
        },
    ];
    let (rule, xt) = summarize(Family::Inet, &exprs);
    assert!(!xt);
    assert_eq!(
        rule,
        Rule::tcp(Action::Tproxy {
            port: Some(15006),
            only: Some(IpFamily::V6)
        })
        .when()
    );
    let (rule, _) = summarize(
        Family::Ip,
        &[Expr::Tproxy {
            family: None,
            port_reg: None,
        }],
    );
    assert_eq!(
        rule.action,
        Action::Tproxy {
            port: None,
            only: None
        }
    );
}

#[test]
fn verdicts_comments_and_conditions() {
    jumps_returns_and_gotos();
    sets_and_redirects();
    nat_and_reject();
}

/// Jumps, returns and gotos, with and without conditions.
fn jumps_returns_and_gotos() {
    // `-m comment --comment x -j PROXY_INIT_REDIRECT`: unconditional jump.
    let (r, xt) = summarize(
        Family::Ip,
        &[
            Expr::XtMatch {
                name: "comment".into(),
            },
            Expr::Named("counter".into()),
            Expr::Verdict {
                code: libc::NFT_JUMP,
                chain: Some("PROXY_INIT_REDIRECT".into()),
            },
        ],
    );
    assert!(xt);
    assert_eq!(r, Rule::all(Action::Jump("PROXY_INIT_REDIRECT".into())));
    // `-m owner --uid-owner 2102 -j RETURN`: conditional return.
    let (r, _) = summarize(
        Family::Ip,
        &[
            Expr::XtMatch {
                name: "owner".into(),
            },
            Expr::Verdict {
                code: libc::NFT_RETURN,
                chain: None,
            },
        ],
    );
    assert_eq!(r, Rule::all(Action::Return).when());
    // goto, and the IPv4 header protocol byte (older iptables-nft) for UDP.
    let (r, _) = summarize(
        Family::Ip,
        &[
            Expr::Payload {
                base: 1,
                offset: 9,
                len: 1,
                dreg: 1,
            },
            cmp_eq(1, &[17]),
            Expr::Verdict {
                code: libc::NFT_GOTO,
                chain: Some("X".into()),
            },
        ],
    );
    assert_eq!(r.protocol, Protocol::Other);
    assert_eq!(r.action, Action::Goto("X".into()));
}

/// Redirects, with and without conditions.
fn sets_and_redirects() {
    // Sets and unknown expressions are conditions; redirect without port has none.
    let (r, _) = summarize(
        Family::Ip6,
        &[
            Expr::Named("lookup".into()),
            Expr::Redir {
                proto_min_reg: None,
            },
        ],
    );
    assert_eq!(r, Rule::all(Action::Redirect { port: None }).when());
    // A redirect ends the rule: later expressions do not change it.
    let (r, _) = summarize(
        Family::Ip,
        &[
            Expr::Redir {
                proto_min_reg: Some(9),
            },
            Expr::Named("lookup".into()),
        ],
    );
    assert_eq!(r, Rule::all(Action::Redirect { port: None }));
}

/// Other NAT and reject.
fn nat_and_reject() {
    assert_eq!(
        summarize(Family::Ip, &[Expr::Named("masq".into())])
            .0
            .action,
        Action::Nat
    );
    assert_eq!(
        summarize(
            Family::Ip,
            &[Expr::XtTarget {
                name: "DNAT".into(),
                info: vec![]
            }]
        )
        .0
        .action,
        Action::Nat
    );
    assert_eq!(
        summarize(Family::Ip, &[Expr::Named("reject".into())])
            .0
            .action,
        Action::Drop
    );
}

fn raw_chain(family: u32, table: &str, name: &str, hook: Option<u32>) -> Body {
    Body::Chain(RawChain {
        family,
        table: table.into(),
        name: name.into(),
        hook,
        priority: -100,
        chain_type: hook.map(|_| "nat".into()),
        policy: None,
    })
}

#[test]
fn assemble_groups_and_labels_tables() {
    let chains = vec![
        raw_chain(2, "nat", "PREROUTING", Some(0)),
        raw_chain(2, "nat", "PROXY_INIT_REDIRECT", None),
        raw_chain(1, "istio-proxy-nat", "prerouting", Some(0)),
        raw_chain(1, "sleeping", "prerouting", Some(0)),
    ];
    let rs = assemble(raw_tables(), chains, raw_rules());
    let names: Vec<_> = rs
        .tables
        .iter()
        .map(|t| (t.family, t.name.as_str(), t.source))
        .collect();
    assert_eq!(
        names,
        [
            (Family::Ip, "nat", Source::IptablesNft),
            (Family::Inet, "istio-proxy-nat", Source::Nftables),
        ]
    );
    let nat = &rs.tables[0];
    assert_eq!(nat.chains.len(), 2);
    assert_eq!(
        nat.chain("PREROUTING").map(|c| c.base.map(|b| b.hook)),
        Some(Some(Hook::Prerouting))
    );
    assert_eq!(
        nat.chain("PROXY_INIT_REDIRECT").map(|c| c.rules.len()),
        Some(1)
    );
}

/// An iptables-nft table, an nftables one, a dormant one and a bridge table.
fn raw_tables() -> Vec<Body> {
    vec![
        Body::Table(RawTable {
            family: 2,
            name: "nat".into(),
            flags: 0,
        }),
        Body::Table(RawTable {
            family: 1,
            name: "istio-proxy-nat".into(),
            flags: 0,
        }),
        Body::Table(RawTable {
            family: 1,
            name: "sleeping".into(),
            flags: TABLE_F_DORMANT,
        }),
        Body::Table(RawTable {
            family: 7, // bridge
            name: "br".into(),
            flags: 0,
        }),
    ]
}

/// A rule in each table's chains, and one in a chain that does not exist.
fn raw_rules() -> Vec<Body> {
    let rule = |family, table: &str, chain: &str, action| {
        Body::Rule(RawRule {
            family,
            table: table.into(),
            chain: chain.into(),
            rule: Rule::all(action),
            uses_xt: false,
        })
    };
    vec![
        rule(
            2,
            "nat",
            "PREROUTING",
            Action::Jump("PROXY_INIT_REDIRECT".into()),
        ),
        rule(
            2,
            "nat",
            "PROXY_INIT_REDIRECT",
            Action::Redirect { port: Some(4143) },
        ),
        rule(
            1,
            "istio-proxy-nat",
            "prerouting",
            Action::Redirect { port: Some(15006) },
        ),
        rule(
            1,
            "sleeping",
            "prerouting",
            Action::Redirect { port: Some(1) },
        ),
        rule(2, "nat", "VANISHED", Action::Accept),
    ]
}

#[test]
fn request_header_layout() {
    let r = request(MSG_GETRULE, NLM_F_REQUEST | NLM_F_DUMP, 7);
    assert_eq!(u32_at(&r, 0), Some(20));
    assert_eq!(u16_at(&r, 4), Some((10 << 8) | 7));
    assert_eq!(u32_at(&r, 8), Some(7));
}

#[repr(C, align(8))]
struct Aligned([u8; 4096]);

fn aligned(bytes: &[u8]) -> Box<Aligned> {
    let mut b = Box::new(Aligned([0; 4096]));
    let n = bytes.len().min(4096);
    b.0[..n].copy_from_slice(&bytes[..n]);
    b
}

/// A well-formed nf_tables message header with arbitrary attribute bytes after it.
fn nft_message(msg: u16, attrs: &[u8]) -> Vec<u8> {
    let len = NFT_HDR_LEN + attrs.len();
    let mut b = vec![0u8; len];
    b[0..4].copy_from_slice(&(len as u32).to_ne_bytes());
    b[4..6].copy_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | msg).to_ne_bytes());
    b[16] = 2;
    b[20..].copy_from_slice(attrs);
    b
}

#[test]
fn decode_rejects_garbage_without_panicking() {
    // A length field larger than the buffer.
    let mut b = vec![0u8; 32];
    b[0..4].copy_from_slice(&1000u32.to_ne_bytes());
    assert!(decode_buffer(&aligned(&b).0[..32]).is_err());
    // An nf_tables message too short for nfgenmsg.
    let mut short = vec![0u8; 16];
    short[0..4].copy_from_slice(&16u32.to_ne_bytes());
    short[4..6].copy_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | 6).to_ne_bytes());
    assert!(decode_buffer(&aligned(&short).0[..16]).is_err());
    // A rule message without table/chain attributes.
    let m = nft_message(libc::NFT_MSG_NEWRULE as u16, &[]);
    assert!(decode_buffer(&aligned(&m).0[..m.len()]).is_err());
}

proptest! {
    /// Arbitrary bytes as a receive buffer.
    #[test]
    fn decode_buffer_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let b = aligned(&bytes);
        let _ = decode_buffer(&b.0[..bytes.len()]);
    }

    /// Well-framed nf_tables messages with arbitrary attribute bytes.
    #[test]
    fn parsers_never_panic_on_random_attributes(
        kind in prop_oneof![Just(0u16), Just(3), Just(6), Just(15)],
        attrs in prop::collection::vec(any::<u8>(), 0..400),
    ) {
        let m = nft_message(kind, &attrs);
        let b = aligned(&m);
        let _ = decode_buffer(&b.0[..m.len()]);
    }

    /// Arbitrary, but well-formed, attribute trees: nested TLVs of random types.
    #[test]
    fn parsers_survive_wellformed_random_tlvs(
        kind in prop_oneof![Just(0u16), Just(3), Just(6), Just(15)],
        tlvs in prop::collection::vec((1u16..12, any::<bool>(), prop::collection::vec(any::<u8>(), 0..24)), 0..8),
    ) {
        let mut attrs = Vec::new();
        for (ty, nested, payload) in tlvs {
            let inner: Vec<u8> = if nested {
                // One nested attribute wrapping the payload.
                let mut v = Vec::new();
                let l = (4 + payload.len()) as u16;
                v.extend_from_slice(&l.to_ne_bytes());
                v.extend_from_slice(&1u16.to_ne_bytes());
                v.extend_from_slice(&payload);
                while v.len() % 4 != 0 { v.push(0); }
                v
            } else {
                payload
            };
            let l = (4 + inner.len()) as u16;
            let ty = if nested { ty | 0x8000 } else { ty };
            attrs.extend_from_slice(&l.to_ne_bytes());
            attrs.extend_from_slice(&ty.to_ne_bytes());
            attrs.extend_from_slice(&inner);
            while attrs.len() % 4 != 0 { attrs.push(0); }
        }
        let m = nft_message(kind, &attrs);
        let b = aligned(&m);
        let _ = decode_buffer(&b.0[..m.len()]);
    }

    #[test]
    fn summarize_never_panics(
        exprs in prop::collection::vec(
            prop_oneof![
                (any::<i32>(), prop::option::of("[A-Z]{1,5}")).prop_map(|(code, chain)| Expr::Verdict { code, chain }),
                (0u32..4, prop::collection::vec(any::<u8>(), 0..6)).prop_map(|(dreg, data)| Expr::Load { dreg, data }),
                (any::<u32>(), 0u32..4).prop_map(|(key, dreg)| Expr::Meta { key, dreg }),
                (0u32..4, prop::collection::vec(any::<u8>(), 0..6)).prop_map(|(sreg, data)| Expr::Cmp { sreg, op: 0, data }),
                ("[a-zA-Z]{0,10}", prop::collection::vec(any::<u8>(), 0..48)).prop_map(|(name, info)| Expr::XtTarget { name, info }),
                prop::option::of(0u32..4).prop_map(|proto_min_reg| Expr::Redir { proto_min_reg }),
                (prop::option::of(0u32..12), prop::option::of(0u32..4)).prop_map(|(family, port_reg)| Expr::Tproxy { family, port_reg }),
                "[a-z]{0,8}".prop_map(Expr::Named),
            ],
            0..10,
        )
    ) {
        for fam in [Family::Ip, Family::Ip6, Family::Inet] {
            let _ = summarize(fam, &exprs);
        }
    }
}
