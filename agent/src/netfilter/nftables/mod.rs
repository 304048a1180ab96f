//! nf_tables reader: dumps tables, chains and rules over netlink (a [`crate::netlink::Socket`])
//! and decodes them into [`meshgate_core::rules`] tables.
//!
//! In: a netfilter netlink socket bound to the pod's namespace. Out: every `ip`, `ip6` and
//! `inet` table that is not dormant, whether `iptables-nft` or native `nft` wrote it.
//!
//! One module per step: [`dump`] is the transport (requests, the receive loop, the
//! generation check and the dump caps); `attr` reads netlink attribute TLVs; `message`
//! decodes tables, chains and rules ([`decode_buffer`]); `expr` decodes one rule expression
//! into an [`Expr`]; [`summarize`] turns one rule's expressions into a [`Rule`]; [`assemble`]
//! builds the tables from the three dumps.
//!
//! Consistency: the ruleset generation id is read before and after the three dumps, and any
//! message flagged `NLM_F_DUMP_INTR` marks the dump as interrupted; either way the whole read
//! is retried (a few times), so chains and rules always come from one generation.
//!
//! Decoding is plain Rust over the netlink attribute TLVs, testable without the kernel, and
//! never panics on arbitrary input. libnftnl's parsers are deliberately not used: on an
//! attribute of an unexpected type they print "nf_tables kernel ABI is broken" and call
//! `exit()`, which would take the whole agent down on one odd message (the random-input tests
//! found exactly that). netlink-packet-netfilter cannot decode the expressions a mesh's
//! redirect is made of either (see docs/architecture.md).

mod assemble;
mod attr;
pub mod dump;
mod expr;
mod message;
mod summarize;
#[cfg(test)]
mod tests;

use meshgate_core::rules::{Family, Rule};

pub use assemble::assemble;
pub use dump::Dumper;
pub use expr::Expr;
pub use message::decode_buffer;
pub use summarize::summarize;

/// `NFNL_SUBSYS_NFTABLES`: the high byte of every nf_tables message type.
const NFNL_SUBSYS_NFTABLES: u16 = libc::NFNL_SUBSYS_NFTABLES as u16;
/// Size of `struct nlmsghdr` + `struct nfgenmsg`: the smallest nf_tables message.
const NFT_HDR_LEN: usize = 20;

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

/// NFPROTO_* → family; `None` for families whose packets are not IP (arp, bridge, netdev).
fn nf_family(f: u32) -> Option<Family> {
    match f as i32 {
        libc::NFPROTO_IPV4 => Some(Family::Ip),
        libc::NFPROTO_IPV6 => Some(Family::Ip6),
        libc::NFPROTO_INET => Some(Family::Inet),
        _ => None,
    }
}
