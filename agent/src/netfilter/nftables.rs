//! nf_tables reader: dumps tables, chains and rules over netlink (a [`crate::netlink::Socket`]) and
//! decodes them into [`meshgate_core::rules`] tables.
//!
//! In: a netfilter netlink socket bound to the pod's namespace. Out: every `ip`, `ip6` and
//! `inet` table that is not dormant, whether `iptables-nft` or native `nft` wrote it.
//!
//! Consistency: the ruleset generation id is read before and after the three dumps, and any
//! message flagged `NLM_F_DUMP_INTR` marks the dump as interrupted; either way the whole read
//! is retried (a few times), so chains and rules always come from one generation.
//!
//! Decoding is plain Rust over the netlink attribute TLVs, in two steps so the semantics are
//! testable without the kernel: [`decode_buffer`] turns netlink bytes into [`Message`]s, and
//! [`summarize`] turns one rule's [`Expr`] list into a [`Rule`]. Neither panics on arbitrary
//! input. libnftnl's parsers (reachable through `nftnl::nftnl_sys`) are deliberately not
//! used: on an attribute of an unexpected type they print "nf_tables kernel ABI is broken"
//! and call `exit()`, which would take the whole agent down on one odd message (the
//! random-input tests below found exactly that).

use std::collections::HashMap;
use std::io;

use meshgate_core::rules::{
    Action, BaseChain, Chain, ChainType, DumpLimits, Family, Hook, IpFamily, Protocol, Rule,
    Ruleset, Source, Table,
};

use super::{ReadError, redirect_port, split_messages, tproxy_port, xt_target_action};

/// Dumps retried before giving up on a ruleset that keeps changing.
const MAX_ATTEMPTS: u32 = 5;
/// Receive buffer: large enough for the biggest dump skb the kernel sends (32 KiB).
const BUF_LEN: usize = 64 * 1024;

const NFNL_SUBSYS_NFTABLES: u16 = libc::NFNL_SUBSYS_NFTABLES as u16;
const MSG_GETTABLE: u16 = libc::NFT_MSG_GETTABLE as u16;
const MSG_GETCHAIN: u16 = libc::NFT_MSG_GETCHAIN as u16;
const MSG_GETRULE: u16 = libc::NFT_MSG_GETRULE as u16;
const MSG_GETGEN: u16 = libc::NFT_MSG_GETGEN as u16;
const NLMSG_ERROR: u16 = libc::NLMSG_ERROR as u16;
const NLMSG_DONE: u16 = libc::NLMSG_DONE as u16;
const NLM_F_DUMP_INTR: u16 = libc::NLM_F_DUMP_INTR as u16;
const NLM_F_REQUEST: u16 = libc::NLM_F_REQUEST as u16;
const NLM_F_DUMP: u16 = libc::NLM_F_DUMP as u16;
const NLM_F_ACK: u16 = libc::NLM_F_ACK as u16;
/// `NFT_TABLE_F_DORMANT`: the table's base chains are not attached to their hooks.
const TABLE_F_DORMANT: u32 = 1;
/// Size of `struct nlmsghdr` + `struct nfgenmsg`: the smallest nf_tables message.
const NFT_HDR_LEN: usize = 20;

/// Network-header offset of the IPv4 `protocol` and IPv6 `nexthdr` bytes.
const IPV4_PROTOCOL_OFFSET: u32 = 9;
const IPV6_NEXTHDR_OFFSET: u32 = 6;

#[repr(C, align(8))]
struct AlignedBuf([u8; BUF_LEN]);

/// Runs dumps on one socket.
pub struct Dumper<'a> {
    sock: &'a crate::netlink::Socket,
    seq: u32,
    buf: Box<AlignedBuf>,
    limits: DumpLimits,
    /// Bytes received in the current dump attempt.
    bytes: usize,
}

/// A table header from `NFT_MSG_NEWTABLE`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawTable {
    /// NFPROTO_* family.
    pub family: u32,
    /// Table name.
    pub name: String,
    /// NFT_TABLE_F_* flags.
    pub flags: u32,
}

/// A chain from `NFT_MSG_NEWCHAIN`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawChain {
    /// NFPROTO_* family.
    pub family: u32,
    /// Table name.
    pub table: String,
    /// Chain name.
    pub name: String,
    /// Hook number, for base chains.
    pub hook: Option<u32>,
    /// Base chain priority.
    pub priority: i32,
    /// Base chain type (`nat`, `filter`, `route`).
    pub chain_type: Option<String>,
    /// Base chain policy verdict (`NF_ACCEPT` / `NF_DROP`), when given.
    pub policy: Option<u32>,
}

/// A rule from `NFT_MSG_NEWRULE`, already summarized.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawRule {
    /// NFPROTO_* family.
    pub family: u32,
    /// Table name.
    pub table: String,
    /// Chain name.
    pub chain: String,
    /// The rule's effect.
    pub rule: Rule,
    /// True when the rule uses xt `match`/`target` expressions (iptables-nft's mark).
    pub uses_xt: bool,
}

/// What one netlink message carried.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Body {
    /// A table.
    Table(RawTable),
    /// A chain.
    Chain(RawChain),
    /// A rule.
    Rule(RawRule),
    /// The ruleset generation id.
    Gen(u32),
    /// End of a dump.
    Done,
    /// NLMSG_ERROR: 0 is an acknowledgement, else a negative errno.
    Error(i32),
    /// Anything else (ignored).
    Other,
}

/// One decoded netlink message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// Sequence number, to match the request.
    pub seq: u32,
    /// The kernel flagged the dump as interrupted by a concurrent change.
    pub dump_intr: bool,
    /// Payload.
    pub body: Body,
}

impl<'a> Dumper<'a> {
    /// A dumper on a socket opened inside the target namespace.
    pub fn new(sock: &'a crate::netlink::Socket) -> Self {
        Self {
            sock,
            seq: 0,
            buf: Box::new(AlignedBuf([0; BUF_LEN])),
            limits: DumpLimits::DEFAULT,
            bytes: 0,
        }
    }

    /// The same dumper, stopping at `limits` instead of [`DumpLimits::DEFAULT`].
    pub fn with_limits(mut self, limits: DumpLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Bytes received by the last dump attempt.
    pub fn bytes_read(&self) -> usize {
        self.bytes
    }

    /// Reads every nf_tables table of the socket's namespace, retrying interrupted dumps.
    pub fn dump(&mut self) -> Result<Ruleset, ReadError> {
        for _ in 0..MAX_ATTEMPTS {
            self.bytes = 0;
            let before = match self.generation() {
                Ok(g) => g,
                Err(ReadError::Kernel { source, .. }) if unsupported(&source) => {
                    // nf_tables is not available in this kernel: no nf_tables rules.
                    return Ok(Ruleset::default());
                }
                Err(e) => return Err(e),
            };
            let (tables, i1) = self.collect(MSG_GETTABLE, "table dump", self.limits.max_tables)?;
            let (chains, i2) = self.collect(MSG_GETCHAIN, "chain dump", self.limits.max_chains)?;
            let (rules, i3) = self.collect(MSG_GETRULE, "rule dump", self.limits.max_rules)?;
            let after = self.generation()?;
            if i1 || i2 || i3 || before != after {
                continue;
            }
            return Ok(assemble(tables, chains, rules));
        }
        Err(ReadError::DumpInterrupted {
            attempts: MAX_ATTEMPTS,
        })
    }

    fn generation(&mut self) -> Result<u32, ReadError> {
        let (bodies, _) = self.exchange(MSG_GETGEN, NLM_F_REQUEST | NLM_F_ACK, "generation")?;
        bodies
            .into_iter()
            .find_map(|b| match b {
                Body::Gen(g) => Some(g),
                _ => None,
            })
            .ok_or_else(|| ReadError::Decode {
                what: "generation",
                why: "the kernel sent no generation id".into(),
            })
    }

    /// One dump, stopping once it carried more than `max` objects or the attempt's bytes
    /// passed the byte limit.
    fn collect(
        &mut self,
        msg: u16,
        what: &'static str,
        max: usize,
    ) -> Result<(Vec<Body>, bool), ReadError> {
        let (bodies, intr) = self.exchange_capped(msg, NLM_F_REQUEST | NLM_F_DUMP, what, max)?;
        Ok((bodies, intr))
    }

    fn exchange(
        &mut self,
        msg: u16,
        flags: u16,
        what: &'static str,
    ) -> Result<(Vec<Body>, bool), ReadError> {
        self.exchange_capped(msg, flags, what, usize::MAX)
    }

    /// Sends one request and reads messages until the dump ends (or the ack arrives).
    fn exchange_capped(
        &mut self,
        msg: u16,
        flags: u16,
        what: &'static str,
        max: usize,
    ) -> Result<(Vec<Body>, bool), ReadError> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let req = request(msg, flags, seq);
        self.sock.send(&req).map_err(|source| ReadError::Netlink {
            what: "send",
            source,
        })?;
        let dump = flags & NLM_F_DUMP != 0;
        let mut out = Vec::new();
        let mut interrupted = false;
        loop {
            let n = self
                .sock
                .recv_raw(&mut self.buf.0)
                .map_err(|source| ReadError::Netlink {
                    what: "recv",
                    source,
                })?;
            self.bytes = self.bytes.saturating_add(n);
            if self.bytes > self.limits.max_bytes {
                return Err(ReadError::TooLarge {
                    what: format!(
                        "more than {} bytes of nf_tables messages (during the {what})",
                        self.limits.max_bytes
                    ),
                });
            }
            let messages = decode_buffer(&self.buf.0[..n.min(BUF_LEN)])?;
            let mut finished = false;
            for m in messages {
                if m.seq != seq {
                    // A late answer to an earlier request: not ours.
                    continue;
                }
                interrupted |= m.dump_intr;
                match m.body {
                    Body::Done => finished = true,
                    Body::Error(0) => {
                        if !dump {
                            finished = true;
                        }
                    }
                    Body::Error(errno) => {
                        return Err(ReadError::Kernel {
                            request: what,
                            source: io::Error::from_raw_os_error(errno.saturating_neg()),
                        });
                    }
                    body => {
                        if out.len() >= max {
                            return Err(ReadError::TooLarge {
                                what: format!("more than {max} objects in the {what}"),
                            });
                        }
                        out.push(body);
                    }
                }
            }
            if finished {
                return Ok((out, interrupted));
            }
        }
    }
}

fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP | libc::EPROTONOSUPPORT | libc::ENOENT | libc::EAFNOSUPPORT)
    )
}

/// A 20-byte nf_tables request: nlmsghdr + nfgenmsg (family AF_UNSPEC: every family).
fn request(msg: u16, flags: u16, seq: u32) -> [u8; NFT_HDR_LEN] {
    let mut b = [0u8; NFT_HDR_LEN];
    b[0..4].copy_from_slice(&(NFT_HDR_LEN as u32).to_ne_bytes());
    b[4..6].copy_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | msg).to_ne_bytes());
    b[6..8].copy_from_slice(&flags.to_ne_bytes());
    b[8..12].copy_from_slice(&seq.to_ne_bytes());
    // pid 0 (the kernel), nfgen_family 0, version NFNETLINK_V0, res_id 0.
    b
}

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

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
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

/// Netlink attributes (`struct nlattr` TLVs, 4-byte aligned) of one level.
struct Attrs<'a> {
    buf: &'a [u8],
}

/// `NLA_TYPE_MASK`: strips NLA_F_NESTED and NLA_F_NET_BYTEORDER.
const NLA_TYPE_MASK: u16 = 0x3fff;

impl<'a> Attrs<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }
}

impl<'a> Iterator for Attrs<'a> {
    type Item = Result<(u16, &'a [u8]), ReadError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.buf.len() < 4 {
            // Trailing bytes shorter than an attribute header are padding.
            return None;
        }
        let len = u16_at(self.buf, 0).unwrap_or(0) as usize;
        let ty = u16_at(self.buf, 2).unwrap_or(0) & NLA_TYPE_MASK;
        if len < 4 || len > self.buf.len() {
            self.buf = &[];
            return Some(Err(ReadError::Decode {
                what: "netlink attribute",
                why: format!("length {len} out of bounds"),
            }));
        }
        let payload = &self.buf[4..len];
        let next = len.next_multiple_of(4).min(self.buf.len());
        self.buf = &self.buf[next..];
        Some(Ok((ty, payload)))
    }
}

fn be32(b: &[u8], what: &'static str) -> Result<u32, ReadError> {
    b.get(0..4)
        .and_then(|s| s.try_into().ok())
        .map(u32::from_be_bytes)
        .ok_or_else(|| ReadError::Decode {
            what,
            why: format!("{} bytes where a 32-bit value was expected", b.len()),
        })
}

fn text(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

fn missing(what: &'static str) -> ReadError {
    ReadError::Decode {
        what,
        why: "a required attribute is missing".into(),
    }
}

/// The nfgenmsg family and the attribute bytes of an nf_tables message.
fn nft_payload(msg: &[u8]) -> Result<(u32, &[u8]), ReadError> {
    let family = msg.get(16).copied().ok_or_else(|| missing("nfgenmsg"))?;
    Ok((
        u32::from(family),
        msg.get(NFT_HDR_LEN..).unwrap_or_default(),
    ))
}

// nf_tables attribute numbers (include/uapi/linux/netfilter/nf_tables.h).
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_FLAGS: u16 = 2;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_GEN_ID: u16 = 1;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;

fn parse_table(msg: &[u8]) -> Result<RawTable, ReadError> {
    let (family, attrs) = nft_payload(msg)?;
    let mut name = None;
    let mut flags = 0;
    for a in Attrs::new(attrs) {
        match a? {
            (NFTA_TABLE_NAME, v) => name = Some(text(v)),
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
            (NFTA_CHAIN_TABLE, v) => table = Some(text(v)),
            (NFTA_CHAIN_NAME, v) => name = Some(text(v)),
            (NFTA_CHAIN_TYPE, v) => chain_type = Some(text(v)),
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

/// One rule expression, reduced to what [`summarize`] needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expr {
    /// `immediate` with a verdict (`reg 0`): NF_ACCEPT, NF_DROP, NFT_JUMP, ... plus chain.
    Verdict {
        /// The verdict code.
        code: i32,
        /// Jump/goto target.
        chain: Option<String>,
    },
    /// `immediate` loading data into a register.
    Load {
        /// Destination register.
        dreg: u32,
        /// The data.
        data: Vec<u8>,
    },
    /// `meta load KEY => reg`.
    Meta {
        /// NFT_META_* key.
        key: u32,
        /// Destination register.
        dreg: u32,
    },
    /// `payload load LEN @ BASE + OFFSET => reg`.
    Payload {
        /// NFT_PAYLOAD_* base.
        base: u32,
        /// Offset.
        offset: u32,
        /// Length.
        len: u32,
        /// Destination register.
        dreg: u32,
    },
    /// `cmp OP reg DATA`.
    Cmp {
        /// Source register.
        sreg: u32,
        /// NFT_CMP_* operator.
        op: u32,
        /// Compared data.
        data: Vec<u8>,
    },
    /// xt `match NAME`.
    XtMatch {
        /// Match name.
        name: String,
    },
    /// xt `target NAME` with its info bytes.
    XtTarget {
        /// Target name.
        name: String,
        /// Target info.
        info: Vec<u8>,
    },
    /// `redir` with the register holding the minimum port, if any.
    Redir {
        /// Register of proto_min.
        proto_min_reg: Option<u32>,
    },
    /// `tproxy` with the register holding the port, if any.
    Tproxy {
        /// NFPROTO_* family it acts on (`tproxy ip` / `tproxy ip6`); unspecified in ip/ip6
        /// tables.
        family: Option<u32>,
        /// Register of the port.
        port_reg: Option<u32>,
    },
    /// Another expression, by name.
    Named(String),
}

/// Expressions that never make a rule skip a packet and never end evaluation: loads into
/// registers other than those tracked, and side-effect statements.
fn passive(name: &str) -> bool {
    matches!(
        name,
        "counter"
            | "log"
            | "bitwise"
            | "byteorder"
            | "ct"
            | "notrack"
            | "numgen"
            | "hash"
            | "objref"
            | "last"
            | "exthdr"
            | "meta"
            | "payload"
    )
}

/// What a register holds, as far as protocol matching goes.
#[derive(Clone, Debug)]
enum Reg {
    L4Proto,
    Const(Vec<u8>),
    Other,
}

/// Reduces one rule's expressions to a [`Rule`]. `family` picks the REDIRECT info layout and
/// the meaning of network-header offsets. Returns the rule and whether xt was used.
pub fn summarize(family: Family, exprs: &[Expr]) -> (Rule, bool) {
    let mut regs: HashMap<u32, Reg> = HashMap::new();
    let mut protocol = Protocol::Any;
    let mut conditional = false;
    let mut uses_xt = false;
    let mut action = Action::Continue;
    for e in exprs {
        match e {
            Expr::Verdict { code, chain } => {
                let verdict = match *code {
                    libc::NF_ACCEPT => Some(Action::Accept),
                    libc::NF_DROP => Some(Action::Drop),
                    libc::NFT_RETURN => Some(Action::Return),
                    libc::NFT_JUMP => chain.clone().map(Action::Jump),
                    libc::NFT_GOTO => chain.clone().map(Action::Goto),
                    // NFT_CONTINUE, NFT_BREAK, NF_QUEUE, ...: nothing that ends evaluation
                    // here in a way the matcher models.
                    _ => None,
                };
                if let Some(a) = verdict {
                    action = a;
                    break;
                }
            }
            Expr::Load { dreg, data } => {
                regs.insert(*dreg, Reg::Const(data.clone()));
            }
            Expr::Meta { key, dreg } => {
                let r = if *key == libc::NFT_META_L4PROTO as u32 {
                    Reg::L4Proto
                } else {
                    Reg::Other
                };
                regs.insert(*dreg, r);
            }
            Expr::Payload {
                base,
                offset,
                len,
                dreg,
            } => {
                let proto_byte = *base == libc::NFT_PAYLOAD_NETWORK_HEADER as u32
                    && *len == 1
                    && match family {
                        Family::Ip => *offset == IPV4_PROTOCOL_OFFSET,
                        Family::Ip6 => *offset == IPV6_NEXTHDR_OFFSET,
                        // In inet tables nft guards `ip protocol` with an nfproto check,
                        // which already made the rule conditional; be conservative.
                        Family::Inet => false,
                    };
                regs.insert(*dreg, if proto_byte { Reg::L4Proto } else { Reg::Other });
            }
            Expr::Cmp { sreg, op, data } => {
                let is_proto = matches!(regs.get(sreg), Some(Reg::L4Proto));
                if is_proto && *op == libc::NFT_CMP_EQ as u32 && !data.is_empty() {
                    protocol = match (protocol, data[0]) {
                        (Protocol::Other, _) => Protocol::Other,
                        (_, 6) => Protocol::Tcp,
                        _ => Protocol::Other,
                    };
                } else {
                    conditional = true;
                }
            }
            Expr::XtMatch { name } => {
                uses_xt = true;
                if name != "comment" {
                    conditional = true;
                }
            }
            Expr::XtTarget { name, info } => {
                uses_xt = true;
                let a = match name.as_str() {
                    "REDIRECT" => Action::Redirect {
                        port: redirect_port(family, info),
                    },
                    "TPROXY" => Action::Tproxy {
                        port: tproxy_port(info),
                        only: None,
                    },
                    _ => xt_target_action(name),
                };
                if a != Action::Continue {
                    action = a;
                    break;
                }
            }
            Expr::Redir { proto_min_reg } => {
                let port = proto_min_reg.and_then(|r| match regs.get(&r) {
                    Some(Reg::Const(d)) if d.len() >= 2 => {
                        let p = u16::from_be_bytes([d[0], d[1]]);
                        (p != 0).then_some(p)
                    }
                    _ => None,
                });
                action = Action::Redirect { port };
                break;
            }
            Expr::Tproxy { family, port_reg } => {
                let port = port_reg.and_then(|r| match regs.get(&r) {
                    Some(Reg::Const(d)) if d.len() >= 2 => {
                        let p = u16::from_be_bytes([d[0], d[1]]);
                        (p != 0).then_some(p)
                    }
                    _ => None,
                });
                // nft's tproxy breaks off the rule when no socket listens, and lets it go on
                // (to `accept`, `meta mark set`) when one does: it never ends evaluation by
                // itself, so the rule hides nothing after it.
                conditional = true;
                let only = match family.map(|f| f as i32) {
                    Some(libc::NFPROTO_IPV4) => Some(IpFamily::V4),
                    Some(libc::NFPROTO_IPV6) => Some(IpFamily::V6),
                    _ => None,
                };
                action = Action::Tproxy { port, only };
                break;
            }
            Expr::Named(name) => match name.as_str() {
                "nat" | "masq" => {
                    action = Action::Nat;
                    break;
                }
                "reject" => {
                    action = Action::Drop;
                    break;
                }
                n if passive(n) => {}
                // lookup, range, limit, quota, fib, rt, socket, connlimit, dynset, and
                // anything newer: may not match every packet.
                _ => conditional = true,
            },
        }
    }
    (
        Rule {
            protocol,
            conditional,
            action,
        },
        uses_xt,
    )
}

/// Maps a register number onto 32-bit slots, so that the 128-bit names (`NFT_REG_1..4`) and
/// the 32-bit ones (`NFT_REG32_00..15`) that nft and iptables-nft use refer to the same slot.
fn reg_slot(r: u32) -> u32 {
    match r {
        1..=4 => (r - 1) * 4,
        8..=23 => r - 8,
        // Verdict register and out-of-range numbers: keep them apart from real slots.
        other => 0x1000 | other,
    }
}

/// `NFTA_DATA_VALUE` bytes inside an `nft_data` nest.
fn data_value(nest: &[u8]) -> Result<Vec<u8>, ReadError> {
    for a in Attrs::new(nest) {
        if let (NFTA_DATA_VALUE, v) = a? {
            return Ok(v.to_vec());
        }
    }
    Ok(Vec::new())
}

/// Decodes one `NFTA_LIST_ELEM` expression nest.
fn parse_expr(elem: &[u8]) -> Result<Expr, ReadError> {
    let mut name = String::new();
    let mut data: &[u8] = &[];
    for a in Attrs::new(elem) {
        match a? {
            (NFTA_EXPR_NAME, v) => name = text(v),
            (NFTA_EXPR_DATA, v) => data = v,
            _ => {}
        }
    }
    // Attribute numbers of each expression's NFTA_<EXPR>_* enum.
    let mut u32s: HashMap<u16, u32> = HashMap::new();
    let mut raw: HashMap<u16, &[u8]> = HashMap::new();
    for a in Attrs::new(data) {
        let (ty, v) = a?;
        if let Some(b) = v.get(0..4).and_then(|s| <[u8; 4]>::try_from(s).ok()) {
            u32s.insert(ty, u32::from_be_bytes(b));
        }
        raw.insert(ty, v);
    }
    let get = |ty: u16| u32s.get(&ty).copied();
    Ok(match name.as_str() {
        "immediate" => {
            // NFTA_IMMEDIATE_DREG = 1, NFTA_IMMEDIATE_DATA = 2.
            let dreg = get(1).unwrap_or(0);
            let nest = raw.get(&2).copied().unwrap_or_default();
            let mut verdict = None;
            for a in Attrs::new(nest) {
                if let (NFTA_DATA_VERDICT, v) = a? {
                    let (mut code, mut chain) = (None, None);
                    for va in Attrs::new(v) {
                        match va? {
                            (NFTA_VERDICT_CODE, c) => code = Some(be32(c, "verdict code")? as i32),
                            (NFTA_VERDICT_CHAIN, c) => chain = Some(text(c)),
                            _ => {}
                        }
                    }
                    verdict = code.map(|code| Expr::Verdict { code, chain });
                }
            }
            match verdict {
                Some(v) if dreg == libc::NFT_REG_VERDICT as u32 => v,
                _ => Expr::Load {
                    dreg: reg_slot(dreg),
                    data: data_value(nest)?,
                },
            }
        }
        // NFTA_META_DREG = 1, NFTA_META_KEY = 2 (SREG = 3 is a `meta set` statement).
        "meta" => match get(1) {
            Some(dreg) => Expr::Meta {
                key: get(2).unwrap_or(u32::MAX),
                dreg: reg_slot(dreg),
            },
            None => Expr::Named(name),
        },
        // NFTA_PAYLOAD_DREG = 1, BASE = 2, OFFSET = 3, LEN = 4 (SREG = 5 is a set statement).
        "payload" => match get(1) {
            Some(dreg) => Expr::Payload {
                base: get(2).unwrap_or(u32::MAX),
                offset: get(3).unwrap_or(u32::MAX),
                len: get(4).unwrap_or(0),
                dreg: reg_slot(dreg),
            },
            None => Expr::Named(name),
        },
        // NFTA_CMP_SREG = 1, OP = 2, DATA = 3.
        "cmp" => Expr::Cmp {
            sreg: reg_slot(get(1).unwrap_or(u32::MAX)),
            op: get(2).unwrap_or(u32::MAX),
            data: data_value(raw.get(&3).copied().unwrap_or_default())?,
        },
        // NFTA_MATCH_NAME / NFTA_TARGET_NAME = 1, INFO = 3.
        "match" => Expr::XtMatch {
            name: text(raw.get(&1).copied().unwrap_or_default()),
        },
        "target" => Expr::XtTarget {
            name: text(raw.get(&1).copied().unwrap_or_default()),
            info: raw.get(&3).copied().unwrap_or_default().to_vec(),
        },
        // NFTA_REDIR_REG_PROTO_MIN = 1.
        "redir" => Expr::Redir {
            proto_min_reg: get(1).map(reg_slot),
        },
        // NFTA_TPROXY_FAMILY = 1, REG_ADDR = 2, REG_PORT = 3.
        "tproxy" => Expr::Tproxy {
            family: get(1),
            port_reg: get(3).map(reg_slot),
        },
        _ => Expr::Named(name),
    })
}

fn parse_rule(msg: &[u8]) -> Result<RawRule, ReadError> {
    let (family, attrs) = nft_payload(msg)?;
    let (mut table, mut chain) = (None, None);
    let mut exprs = Vec::new();
    for a in Attrs::new(attrs) {
        match a? {
            (NFTA_RULE_TABLE, v) => table = Some(text(v)),
            (NFTA_RULE_CHAIN, v) => chain = Some(text(v)),
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

/// NFPROTO_* → family; `None` for families whose packets are not IP (arp, bridge, netdev).
fn nf_family(f: u32) -> Option<Family> {
    match f as i32 {
        libc::NFPROTO_IPV4 => Some(Family::Ip),
        libc::NFPROTO_IPV6 => Some(Family::Ip6),
        libc::NFPROTO_INET => Some(Family::Inet),
        _ => None,
    }
}

fn hook(n: u32) -> Hook {
    match n {
        0 => Hook::Prerouting,
        1 => Hook::Input,
        2 => Hook::Forward,
        3 => Hook::Output,
        4 => Hook::Postrouting,
        _ => Hook::Other,
    }
}

fn chain_type(t: Option<&str>) -> ChainType {
    match t {
        Some("nat") => ChainType::Nat,
        Some("route") => ChainType::Route,
        _ => ChainType::Filter,
    }
}

/// Table names and base chain names iptables-nft uses: with xt expressions, how a table
/// is recognised as written by iptables-nft rather than by hand.
const IPTABLES_TABLES: &[&str] = &["nat", "filter", "mangle", "raw", "security"];
const IPTABLES_CHAINS: &[&str] = &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// Builds tables from the three dumps. Rules arrive in chain order.
pub fn assemble(tables: Vec<Body>, chains: Vec<Body>, rules: Vec<Body>) -> Ruleset {
    struct Building {
        table: Table,
        uses_xt: bool,
        index: HashMap<String, usize>,
        /// Base chains with `policy drop`.
        drops: Vec<usize>,
    }
    let mut order: Vec<(u32, String)> = Vec::new();
    let mut building: HashMap<(u32, String), Building> = HashMap::new();
    for b in tables {
        let Body::Table(t) = b else { continue };
        let Some(family) = nf_family(t.family) else {
            continue;
        };
        if t.flags & TABLE_F_DORMANT != 0 {
            continue;
        }
        let key = (t.family, t.name.clone());
        if building.contains_key(&key) {
            continue;
        }
        order.push(key.clone());
        building.insert(
            key,
            Building {
                table: Table {
                    family,
                    name: t.name,
                    source: Source::Nftables,
                    chains: Vec::new(),
                },
                uses_xt: false,
                index: HashMap::new(),
                drops: Vec::new(),
            },
        );
    }
    for b in chains {
        let Body::Chain(c) = b else { continue };
        let Some(t) = building.get_mut(&(c.family, c.table.clone())) else {
            continue;
        };
        if t.index.contains_key(&c.name) {
            continue;
        }
        let base = c.hook.map(|h| BaseChain {
            hook: hook(h),
            chain_type: chain_type(c.chain_type.as_deref()),
            priority: c.priority,
        });
        if base.is_some() && c.policy == Some(libc::NF_DROP as u32) {
            t.drops.push(t.table.chains.len());
        }
        t.index.insert(c.name.clone(), t.table.chains.len());
        t.table.chains.push(Chain {
            name: c.name,
            base,
            rules: Vec::new(),
        });
    }
    for b in rules {
        let Body::Rule(r) = b else { continue };
        let Some(t) = building.get_mut(&(r.family, r.table.clone())) else {
            continue;
        };
        let Some(&i) = t.index.get(&r.chain) else {
            continue;
        };
        t.uses_xt |= r.uses_xt;
        if let Some(chain) = t.table.chains.get_mut(i) {
            chain.rules.push(r.rule);
        }
    }
    let mut out = Ruleset::default();
    for key in order {
        let Some(mut b) = building.remove(&key) else {
            continue;
        };
        // A base chain's policy is the verdict of every packet that reaches its end: the
        // same as a last rule, which is how legacy tables hold it (the underflow entry).
        for &i in &b.drops {
            if let Some(c) = b.table.chains.get_mut(i) {
                c.rules.push(Rule::all(Action::Drop));
            }
        }
        let iptables_shape = matches!(b.table.family, Family::Ip | Family::Ip6)
            && IPTABLES_TABLES.contains(&b.table.name.as_str())
            && b.table
                .chains
                .iter()
                .filter(|c| c.base.is_some())
                .all(|c| IPTABLES_CHAINS.contains(&c.name.as_str()));
        if b.uses_xt || iptables_shape {
            b.table.source = Source::IptablesNft;
        }
        out.tables.push(b.table);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
        // Other NAT and reject.
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
        let tables = vec![
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
        ];
        let chains = vec![
            raw_chain(2, "nat", "PREROUTING", Some(0)),
            raw_chain(2, "nat", "PROXY_INIT_REDIRECT", None),
            raw_chain(1, "istio-proxy-nat", "prerouting", Some(0)),
            raw_chain(1, "sleeping", "prerouting", Some(0)),
        ];
        let rule = |family, table: &str, chain: &str, action| {
            Body::Rule(RawRule {
                family,
                table: table.into(),
                chain: chain.into(),
                rule: Rule::all(action),
                uses_xt: false,
            })
        };
        let rules = vec![
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
        ];
        let rs = assemble(tables, chains, rules);
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
}
