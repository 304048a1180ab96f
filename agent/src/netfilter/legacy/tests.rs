//! The legacy entries decoder on blobs laid out the way the kernel does, and on arbitrary
//! bytes.

use super::*;
use proptest::prelude::*;

/// Builds entries blobs the way the kernel lays them out.
struct Blob {
    l: &'static Layout,
    bytes: Vec<u8>,
}

enum Target<'a> {
    Standard(i32),
    Error(&'a str),
    Redirect(u16),
}

impl Blob {
    fn new(l: &'static Layout) -> Self {
        Self {
            l,
            bytes: Vec::new(),
        }
    }

    fn offset(&self) -> usize {
        self.bytes.len()
    }

    fn push(&mut self, proto: u16, flags: u8, matches: &[&str], target: Target<'_>) -> usize {
        let at = self.bytes.len();
        let mut e = vec![0u8; self.l.entry_len];
        e[self.l.proto..self.l.proto + 2].copy_from_slice(&proto.to_ne_bytes());
        e[self.l.flags] = flags;
        for m in matches {
            let mut mb = vec![0u8; XT_HDR + 8];
            mb[0..2].copy_from_slice(&((XT_HDR + 8) as u16).to_ne_bytes());
            mb[2..2 + m.len()].copy_from_slice(m.as_bytes());
            e.extend_from_slice(&mb);
        }
        let target_offset = e.len();
        let (name, data): (&str, Vec<u8>) = match target {
            Target::Standard(v) => ("", {
                let mut d = v.to_ne_bytes().to_vec();
                d.extend_from_slice(&[0; 4]);
                d
            }),
            Target::Error(n) => ("ERROR", {
                let mut d = vec![0u8; 32];
                d[..n.len()].copy_from_slice(n.as_bytes());
                d
            }),
            Target::Redirect(p) => ("REDIRECT", {
                if self.l.entry_len == 112 {
                    let mut d = vec![0u8; 24];
                    d[0..4].copy_from_slice(&1u32.to_ne_bytes());
                    d[4..8].copy_from_slice(&2u32.to_ne_bytes());
                    d[16..18].copy_from_slice(&p.to_be_bytes());
                    d
                } else {
                    let mut d = vec![0u8; 40];
                    d[0..4].copy_from_slice(&2u32.to_ne_bytes());
                    d[36..38].copy_from_slice(&p.to_be_bytes());
                    d
                }
            }),
        };
        let mut t = vec![0u8; XT_HDR];
        t[0..2].copy_from_slice(&((XT_HDR + data.len()) as u16).to_ne_bytes());
        t[2..2 + name.len()].copy_from_slice(name.as_bytes());
        e.extend_from_slice(&t);
        e.extend_from_slice(&data);
        let next = e.len();
        e[self.l.target_offset..self.l.target_offset + 2]
            .copy_from_slice(&(target_offset as u16).to_ne_bytes());
        e[self.l.next_offset..self.l.next_offset + 2].copy_from_slice(&(next as u16).to_ne_bytes());
        self.bytes.extend_from_slice(&e);
        at
    }

    /// Patches the standard verdict of the entry at `at` (for forward jumps).
    fn set_verdict(&mut self, at: usize, v: i32) {
        let t = at + u16_at(&self.bytes, at + self.l.target_offset).unwrap_or(0) as usize;
        self.bytes[t + XT_HDR..t + XT_HDR + 4].copy_from_slice(&v.to_ne_bytes());
    }
}

const ACCEPT: i32 = -libc::NF_ACCEPT - 1;

/// linkerd's legacy nat table: PREROUTING -j PROXY_INIT_REDIRECT, OUTPUT -g
/// PROXY_INIT_OUTPUT, user chains with conditional returns and REDIRECTs.
fn linkerd(l: &'static Layout) -> (TableInfo, Vec<u8>) {
    let mut b = Blob::new(l);
    let mut info = TableInfo {
        valid_hooks: 0b11011,
        ..TableInfo::default()
    };
    info.hook_entry[0] = b.offset() as u32;
    let jump_in = b.push(0, 0, &["comment"], Target::Standard(0));
    info.underflow[0] = b.push(0, 0, &[], Target::Standard(ACCEPT)) as u32;
    info.hook_entry[1] = b.offset() as u32;
    info.underflow[1] = b.push(0, 0, &[], Target::Standard(ACCEPT)) as u32;
    info.hook_entry[3] = b.offset() as u32;
    let goto_out = b.push(0, l.goto_flag, &[], Target::Standard(0));
    info.underflow[3] = b.push(0, 0, &[], Target::Standard(ACCEPT)) as u32;
    info.hook_entry[4] = b.offset() as u32;
    info.underflow[4] = b.push(0, 0, &[], Target::Standard(ACCEPT)) as u32;
    b.push(0, 0, &[], Target::Error("PROXY_INIT_OUTPUT"));
    let out_start = b.offset();
    b.push(0, 0, &["owner"], Target::Standard(XT_RETURN));
    b.push(6, proto_flag(l), &[], Target::Redirect(4140));
    b.push(0, 0, &[], Target::Standard(XT_RETURN));
    b.push(0, 0, &[], Target::Error("PROXY_INIT_REDIRECT"));
    let in_start = b.offset();
    b.push(
        6,
        proto_flag(l),
        &["multiport"],
        Target::Standard(XT_RETURN),
    );
    b.push(6, proto_flag(l), &[], Target::Redirect(4143));
    b.push(0, 0, &[], Target::Standard(XT_RETURN));
    b.push(0, 0, &[], Target::Error("ERROR"));
    b.set_verdict(jump_in, in_start as i32);
    b.set_verdict(goto_out, out_start as i32);
    info.size = b.bytes.len() as u32;
    (info, b.bytes)
}

fn proto_flag(l: &Layout) -> u8 {
    l.proto_flag.unwrap_or(0)
}

#[test]
fn decodes_linkerd_layout_for_both_families() {
    for (fam, l) in [(Family::Ip, &IPV4), (Family::Ip6, &IPV6)] {
        let (info, blob) = linkerd(l);
        let t = decode_table(fam, "nat", &info, &blob).expect("decodes");
        assert_eq!(t.family, fam);
        assert_eq!(t.source, Source::IptablesLegacy);
        let names: Vec<_> = t.chains.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "PREROUTING",
                "INPUT",
                "OUTPUT",
                "POSTROUTING",
                "PROXY_INIT_OUTPUT",
                "PROXY_INIT_REDIRECT"
            ]
        );
        let pre = t.chain("PREROUTING").expect("chain");
        assert_eq!(
            pre.base.map(|b| (b.hook, b.chain_type)),
            Some((Hook::Prerouting, ChainType::Nat))
        );
        assert_eq!(
            pre.rules[0],
            Rule::all(Action::Jump("PROXY_INIT_REDIRECT".into()))
        );
        assert_eq!(pre.rules[1], Rule::all(Action::Accept));
        let out = t.chain("OUTPUT").expect("chain");
        assert_eq!(
            out.rules[0].action,
            Action::Goto("PROXY_INIT_OUTPUT".into())
        );
        let redir = t.chain("PROXY_INIT_REDIRECT").expect("chain");
        assert_eq!(redir.rules[0], Rule::tcp(Action::Return).when());
        assert_eq!(
            redir.rules[1],
            Rule::tcp(Action::Redirect { port: Some(4143) })
        );
        let outc = t.chain("PROXY_INIT_OUTPUT").expect("chain");
        assert_eq!(
            outc.rules[1],
            Rule::tcp(Action::Redirect { port: Some(4140) })
        );

        let profile = meshgate_core::profile::ProfileSet::all_builtin();
        let linkerd = profile.get("linkerd").expect("profile");
        let ip = if fam == Family::Ip {
            meshgate_core::rules::IpFamily::V4
        } else {
            meshgate_core::rules::IpFamily::V6
        };
        let rs = meshgate_core::rules::Ruleset { tables: vec![t] };
        let got = meshgate_core::rules::check_pod(
            &rs,
            linkerd,
            &[ip],
            &std::collections::BTreeMap::new(),
        );
        assert_eq!(
            got.verdict,
            meshgate_core::rules::RedirectVerdict::Redirected,
            "{}",
            got.message
        );
        assert_eq!(
            got.outbound.via.as_deref(),
            Some(format!("{fam} nat OUTPUT -> PROXY_INIT_OUTPUT (iptables-legacy)").as_str())
        );
    }
}

#[test]
fn built_in_chains_get_their_tables_hook_priority() {
    assert_eq!(table_priority("mangle", Hook::Prerouting), -150);
    assert_eq!(table_priority("raw", Hook::Prerouting), -300);
    assert_eq!(table_priority("nat", Hook::Output), -100);
    assert_eq!(table_priority("nat", Hook::Postrouting), 100);
    assert_eq!(table_priority("filter", Hook::Input), 0);
    assert_eq!(table_priority("security", Hook::Output), 50);
}

/// A mangle table whose PREROUTING TPROXYs every TCP packet to 15006 (rev 1 info).
#[test]
fn decodes_tproxy_in_mangle() {
    let mut b = Blob::new(&IPV4);
    let mut info = TableInfo {
        valid_hooks: 0b00001,
        ..TableInfo::default()
    };
    info.hook_entry[0] = 0;
    let at = b.push(6, 0, &[], Target::Standard(0));
    info.underflow[0] = b.push(0, 0, &[], Target::Standard(ACCEPT)) as u32;
    b.push(0, 0, &[], Target::Error("ERROR"));
    // Turn the first entry's standard target into `-j TPROXY --on-port 15006`.
    let t = at + u16_at(&b.bytes, at + IPV4.target_offset).unwrap_or(0) as usize;
    b.bytes[t + 2..t + 8].copy_from_slice(b"TPROXY");
    let data = t + XT_HDR;
    b.bytes[data..data + 8].fill(0);
    let mut tproxy = vec![0u8; 32];
    tproxy[24..26].copy_from_slice(&15006u16.to_be_bytes());
    // Rebuild the entry with a 32-byte target payload.
    let mut blob = b.bytes[..t + XT_HDR].to_vec();
    blob[t..t + 2].copy_from_slice(&((XT_HDR + 32) as u16).to_ne_bytes());
    blob.extend_from_slice(&tproxy);
    let next = blob.len() - at;
    blob[at + IPV4.next_offset..at + IPV4.next_offset + 2]
        .copy_from_slice(&(next as u16).to_ne_bytes());
    let rest_from = at + u16_at(&b.bytes, at + IPV4.next_offset).unwrap_or(0) as usize;
    let shift = blob.len() - rest_from;
    blob.extend_from_slice(&b.bytes[rest_from..]);
    info.underflow[0] += shift as u32;
    info.size = blob.len() as u32;
    let table = decode_table(Family::Ip, "mangle", &info, &blob).expect("decodes");
    let pre = table.chain("PREROUTING").expect("chain");
    assert_eq!(
        pre.base.map(|b| (b.chain_type, b.priority)),
        Some((ChainType::Filter, -150))
    );
    assert_eq!(
        pre.rules[0],
        Rule::tcp(Action::Tproxy {
            port: Some(15006),
            only: None
        })
    );
}

#[test]
fn plain_tcp_match_is_not_a_condition() {
    let mut d = vec![0u8; 12];
    d[2..4].copy_from_slice(&0xffffu16.to_ne_bytes());
    d[6..8].copy_from_slice(&0xffffu16.to_ne_bytes());
    assert!(!match_is_condition("tcp", &d));
    d[4..6].copy_from_slice(&80u16.to_ne_bytes());
    assert!(match_is_condition("tcp", &d));
    assert!(match_is_condition("owner", &[]));
    assert!(!match_is_condition("comment", &[]));
    assert!(match_is_condition("tcp", &[]));
}

#[test]
fn truncated_and_inconsistent_blobs_are_errors() {
    let (info, blob) = linkerd(&IPV4);
    for cut in [1, 50, 111, 113, blob.len() - 1] {
        assert!(
            decode_table(Family::Ip, "nat", &info, &blob[..cut]).is_err(),
            "cut {cut}"
        );
    }
    let mut bad = blob.clone();
    bad[IPV4.next_offset..IPV4.next_offset + 2].copy_from_slice(&0u16.to_ne_bytes());
    assert!(decode_table(Family::Ip, "nat", &info, &bad).is_err());
    assert!(decode_info(&[0u8; 10]).is_none());
}

proptest! {
    #[test]
    fn decode_table_never_panics(
        bytes in prop::collection::vec(any::<u8>(), 0..2048),
        hooks in any::<u32>(),
        entry in prop::array::uniform5(0u32..2048),
        v6 in any::<bool>(),
    ) {
        let info = TableInfo { valid_hooks: hooks, hook_entry: entry, underflow: entry, size: bytes.len() as u32 };
        let fam = if v6 { Family::Ip6 } else { Family::Ip };
        let _ = decode_table(fam, "nat", &info, &bytes);
    }

    /// Valid blobs with single bytes flipped: still no panic.
    #[test]
    fn mutated_blobs_never_panic(at in any::<prop::sample::Index>(), byte in any::<u8>(), v6 in any::<bool>()) {
        let (fam, l) = if v6 { (Family::Ip6, &IPV6) } else { (Family::Ip, &IPV4) };
        let (info, mut blob) = linkerd(l);
        let i = at.index(blob.len());
        blob[i] = byte;
        let _ = decode_table(fam, "nat", &info, &blob);
    }

    #[test]
    fn decode_info_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..100)) {
        let _ = decode_info(&bytes);
    }
}
