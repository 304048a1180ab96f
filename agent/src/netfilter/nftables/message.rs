//! nf_tables messages: one receive buffer → [`Message`]s (tables, chains, rules, the
//! generation id, the end of a dump, errors).
//!
//! In: the bytes of one datagram. Out: the decoded messages, or [`ReadError::Decode`] for the
//! first message that is malformed. A rule's expressions are decoded ([`super::expr`]) and
//! summarized ([`super::summarize`]) here, so a rule is held as a [`Rule`] only.
//!
//! [`Rule`]: meshgate_core::rules::Rule

use meshgate_core::rules::Family;

use super::attr::{
    Attrs, NFTA_CHAIN_HOOK, NFTA_CHAIN_NAME, NFTA_CHAIN_POLICY, NFTA_CHAIN_TABLE, NFTA_CHAIN_TYPE,
    NFTA_GEN_ID, NFTA_HOOK_HOOKNUM, NFTA_HOOK_PRIORITY, NFTA_LIST_ELEM, NFTA_RULE_CHAIN,
    NFTA_RULE_EXPRESSIONS, NFTA_RULE_TABLE, NFTA_TABLE_FLAGS, NFTA_TABLE_NAME, be32, missing,
};
use super::expr::parse_expr;
use super::summarize::summarize;
use super::{
    Body, Message, NFNL_SUBSYS_NFTABLES, NFT_HDR_LEN, RawChain, RawRule, RawTable, nf_family,
};
use crate::netfilter::{ReadError, c_name, split_messages, u16_at, u32_at};

const NLMSG_ERROR: u16 = libc::NLMSG_ERROR as u16;
const NLMSG_DONE: u16 = libc::NLMSG_DONE as u16;
const NLM_F_DUMP_INTR: u16 = libc::NLM_F_DUMP_INTR as u16;

/// Splits a received buffer into messages and decodes each.
pub fn decode_buffer(buf: &[u8]) -> Result<Vec<Message>, ReadError> {
    let mut out = Vec::new();
    for msg in split_messages(buf) {
        let msg = msg.map_err(|why| ReadError::Decode {
            what: "netlink message",
            why,
        })?;
        out.push(decode_message(msg)?);
    }
    Ok(out)
}

/// Decodes one message, which [`split_messages`] has checked: `msg.len()` equals its
/// `nlmsg_len` and it is at least a header long.
fn decode_message(msg: &[u8]) -> Result<Message, ReadError> {
    let bad = |why: &str| ReadError::Decode {
        what: "netlink message",
        why: why.into(),
    };
    let kind = u16_at(msg, 4).ok_or_else(|| bad("short header"))?;
    let flags = u16_at(msg, 6).ok_or_else(|| bad("short header"))?;
    let seq = u32_at(msg, 8).ok_or_else(|| bad("short header"))?;
    let dump_intr = flags & NLM_F_DUMP_INTR != 0;
    let body = match kind {
        NLMSG_DONE => Body::Done,
        NLMSG_ERROR => {
            let errno = msg
                .get(16..20)
                .and_then(|b| b.try_into().ok())
                .map(i32::from_ne_bytes)
                .ok_or_else(|| bad("short NLMSG_ERROR"))?;
            Body::Error(errno)
        }
        k if k >> 8 == NFNL_SUBSYS_NFTABLES => {
            if msg.len() < NFT_HDR_LEN {
                return Err(bad("nf_tables message shorter than its headers"));
            }
            match k & 0xff {
                m if m == libc::NFT_MSG_NEWTABLE as u16 => Body::Table(parse_table(msg)?),
                m if m == libc::NFT_MSG_NEWCHAIN as u16 => Body::Chain(parse_chain(msg)?),
                m if m == libc::NFT_MSG_NEWRULE as u16 => Body::Rule(parse_rule(msg)?),
                m if m == libc::NFT_MSG_NEWGEN as u16 => Body::Gen(parse_gen(msg)?),
                _ => Body::Other,
            }
        }
        _ => Body::Other,
    };
    Ok(Message {
        seq,
        dump_intr,
        body,
    })
}

/// The nfgenmsg family and the attribute bytes of an nf_tables message.
fn nft_payload(msg: &[u8]) -> Result<(u32, &[u8]), ReadError> {
    let family = msg.get(16).copied().ok_or_else(|| missing("nfgenmsg"))?;
    Ok((
        u32::from(family),
        msg.get(NFT_HDR_LEN..).unwrap_or_default(),
    ))
}

fn parse_table(msg: &[u8]) -> Result<RawTable, ReadError> {
    let (family, attrs) = nft_payload(msg)?;
    let mut name = None;
    let mut flags = 0;
    for a in Attrs::new(attrs) {
        match a? {
            (NFTA_TABLE_NAME, v) => name = Some(c_name(v)),
            (NFTA_TABLE_FLAGS, v) => flags = be32(v, "table flags")?,
            _ => {}
        }
    }
    Ok(RawTable {
        family,
        name: name.ok_or_else(|| missing("table name"))?,
        flags,
    })
}

fn parse_chain(msg: &[u8]) -> Result<RawChain, ReadError> {
    let (family, attrs) = nft_payload(msg)?;
    let (mut table, mut name, mut hook, mut priority, mut chain_type) = (None, None, None, 0, None);
    let mut policy = None;
    for a in Attrs::new(attrs) {
        match a? {
            (NFTA_CHAIN_TABLE, v) => table = Some(c_name(v)),
            (NFTA_CHAIN_NAME, v) => name = Some(c_name(v)),
            (NFTA_CHAIN_TYPE, v) => chain_type = Some(c_name(v)),
            (NFTA_CHAIN_POLICY, v) => policy = Some(be32(v, "chain policy")?),
            (NFTA_CHAIN_HOOK, v) => {
                for h in Attrs::new(v) {
                    match h? {
                        (NFTA_HOOK_HOOKNUM, n) => hook = Some(be32(n, "chain hook")?),
                        (NFTA_HOOK_PRIORITY, p) => priority = be32(p, "chain priority")? as i32,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Ok(RawChain {
        family,
        table: table.ok_or_else(|| missing("chain table"))?,
        name: name.ok_or_else(|| missing("chain name"))?,
        hook,
        priority,
        chain_type,
        policy,
    })
}

fn parse_gen(msg: &[u8]) -> Result<u32, ReadError> {
    let (_, attrs) = nft_payload(msg)?;
    for a in Attrs::new(attrs) {
        if let (NFTA_GEN_ID, v) = a? {
            return be32(v, "generation id");
        }
    }
    Err(missing("generation id"))
}

fn parse_rule(msg: &[u8]) -> Result<RawRule, ReadError> {
    let (family, attrs) = nft_payload(msg)?;
    let (mut table, mut chain) = (None, None);
    let mut exprs = Vec::new();
    for a in Attrs::new(attrs) {
        match a? {
            (NFTA_RULE_TABLE, v) => table = Some(c_name(v)),
            (NFTA_RULE_CHAIN, v) => chain = Some(c_name(v)),
            (NFTA_RULE_EXPRESSIONS, v) => {
                for e in Attrs::new(v) {
                    if let (NFTA_LIST_ELEM, elem) = e? {
                        exprs.push(parse_expr(elem)?);
                    }
                }
            }
            _ => {}
        }
    }
    let (rule, uses_xt) = summarize(nf_family(family).unwrap_or(Family::Ip), &exprs);
    Ok(RawRule {
        family,
        table: table.ok_or_else(|| missing("rule table"))?,
        chain: chain.ok_or_else(|| missing("rule chain"))?,
        rule,
        uses_xt,
    })
}
