//! One rule's expressions → its effect ([`Rule`]): which packets it may skip, what it does
//! to the rest, and whether it came from iptables-nft (xt expressions).
//!
//! In: the address family of the rule's table and its [`Expr`] list. Out: the [`Rule`] and
//! whether xt was used. Registers are tracked as far as protocol matching and redirect ports
//! go; anything not understood makes the rule conditional, never unconditional.

use std::collections::HashMap;

use meshgate_core::rules::{Action, Family, IpFamily, Protocol, Rule};

use super::expr::Expr;
use crate::netfilter::{redirect_port, tproxy_port, xt_target_action};

/// Network-header offset of the IPv4 `protocol` and IPv6 `nexthdr` bytes.
const IPV4_PROTOCOL_OFFSET: u32 = 9;
const IPV6_NEXTHDR_OFFSET: u32 = 6;

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

/// What the expressions seen so far established.
struct State {
    regs: HashMap<u32, Reg>,
    protocol: Protocol,
    conditional: bool,
    uses_xt: bool,
}

/// Reduces one rule's expressions to a [`Rule`]. `family` picks the REDIRECT info layout and
/// the meaning of network-header offsets. Returns the rule and whether xt was used.
pub fn summarize(family: Family, exprs: &[Expr]) -> (Rule, bool) {
    let mut st = State {
        regs: HashMap::new(),
        protocol: Protocol::Any,
        conditional: false,
        uses_xt: false,
    };
    let mut action = Action::Continue;
    for e in exprs {
        if let Some(end) = st.step(family, e) {
            action = end;
            break;
        }
    }
    (
        Rule {
            protocol: st.protocol,
            conditional: st.conditional,
            action,
        },
        st.uses_xt,
    )
}

impl State {
    /// Takes one expression in; `Some(action)` when it ends the rule's evaluation.
    fn step(&mut self, family: Family, e: &Expr) -> Option<Action> {
        match e {
            Expr::Verdict { code, chain } => verdict(*code, chain.as_deref()),
            Expr::Load { dreg, data } => {
                self.regs.insert(*dreg, Reg::Const(data.clone()));
                None
            }
            Expr::Meta { key, dreg } => {
                let r = if *key == libc::NFT_META_L4PROTO as u32 {
                    Reg::L4Proto
                } else {
                    Reg::Other
                };
                self.regs.insert(*dreg, r);
                None
            }
            Expr::Payload {
                base,
                offset,
                len,
                dreg,
            } => {
                let r = payload_reg(family, *base, *offset, *len);
                self.regs.insert(*dreg, r);
                None
            }
            Expr::Cmp { sreg, op, data } => {
                self.cmp(*sreg, *op, data);
                None
            }
            Expr::XtMatch { name } => {
                self.uses_xt = true;
                self.conditional |= name != "comment";
                None
            }
            Expr::XtTarget { name, info } => {
                self.uses_xt = true;
                xt_target(family, name, info)
            }
            Expr::Redir { proto_min_reg } => Some(Action::Redirect {
                port: self.port_in(*proto_min_reg),
            }),
            Expr::Tproxy {
                family: nfproto,
                port_reg,
            } => Some(self.tproxy(*nfproto, *port_reg)),
            Expr::Named(name) => self.named(name),
        }
    }

    /// `cmp`: an equality on the L4 protocol narrows [`Protocol`]; any other comparison
    /// makes the rule conditional.
    fn cmp(&mut self, sreg: u32, op: u32, data: &[u8]) {
        let is_proto = matches!(self.regs.get(&sreg), Some(Reg::L4Proto));
        match data.first() {
            Some(&first) if is_proto && op == libc::NFT_CMP_EQ as u32 => {
                self.protocol = match (self.protocol, first) {
                    (Protocol::Other, _) => Protocol::Other,
                    (_, 6) => Protocol::Tcp,
                    _ => Protocol::Other,
                };
            }
            _ => self.conditional = true,
        }
    }

    /// The non-zero port a register holds as a constant (big-endian, first two bytes).
    fn port_in(&self, reg: Option<u32>) -> Option<u16> {
        reg.and_then(|r| match self.regs.get(&r) {
            Some(Reg::Const(d)) if d.len() >= 2 => {
                let p = u16::from_be_bytes([d[0], d[1]]);
                (p != 0).then_some(p)
            }
            _ => None,
        })
    }

    /// nft's `tproxy` breaks off the rule when no socket listens, and lets it go on (to
    /// `accept`, `meta mark set`) when one does: it never ends evaluation by itself, so the
    /// rule is conditional and hides nothing after it.
    fn tproxy(&mut self, family: Option<u32>, port_reg: Option<u32>) -> Action {
        let port = self.port_in(port_reg);
        self.conditional = true;
        let only = match family.map(|f| f as i32) {
            Some(libc::NFPROTO_IPV4) => Some(IpFamily::V4),
            Some(libc::NFPROTO_IPV6) => Some(IpFamily::V6),
            _ => None,
        };
        Action::Tproxy { port, only }
    }

    /// Another expression, by name: NAT and reject end the rule, passive ones change
    /// nothing, anything else may not match every packet.
    fn named(&mut self, name: &str) -> Option<Action> {
        match name {
            "nat" | "masq" => Some(Action::Nat),
            "reject" => Some(Action::Drop),
            n if passive(n) => None,
            // lookup, range, limit, quota, fib, rt, socket, connlimit, dynset, and anything
            // newer.
            _ => {
                self.conditional = true;
                None
            }
        }
    }
}

/// An `immediate` verdict: the action when it ends evaluation in a way the matcher models.
fn verdict(code: i32, chain: Option<&str>) -> Option<Action> {
    match code {
        libc::NF_ACCEPT => Some(Action::Accept),
        libc::NF_DROP => Some(Action::Drop),
        libc::NFT_RETURN => Some(Action::Return),
        libc::NFT_JUMP => chain.map(|c| Action::Jump(c.to_owned())),
        libc::NFT_GOTO => chain.map(|c| Action::Goto(c.to_owned())),
        // NFT_CONTINUE, NFT_BREAK, NF_QUEUE, ...: nothing that ends evaluation here in a
        // way the matcher models.
        _ => None,
    }
}

/// What a `payload load` puts in its register: the L4 protocol byte of the network header,
/// or something else.
fn payload_reg(family: Family, base: u32, offset: u32, len: u32) -> Reg {
    let proto_byte = base == libc::NFT_PAYLOAD_NETWORK_HEADER as u32
        && len == 1
        && match family {
            Family::Ip => offset == IPV4_PROTOCOL_OFFSET,
            Family::Ip6 => offset == IPV6_NEXTHDR_OFFSET,
            // In inet tables nft guards `ip protocol` with an nfproto check, which already
            // made the rule conditional; be conservative.
            Family::Inet => false,
        };
    if proto_byte { Reg::L4Proto } else { Reg::Other }
}

/// An xt target: REDIRECT and TPROXY with their ports, the others by name; `None` for
/// targets that let evaluation continue.
fn xt_target(family: Family, name: &str, info: &[u8]) -> Option<Action> {
    let a = match name {
        "REDIRECT" => Action::Redirect {
            port: redirect_port(family, info),
        },
        "TPROXY" => Action::Tproxy {
            port: tproxy_port(info),
            only: None,
        },
        _ => xt_target_action(name),
    };
    (a != Action::Continue).then_some(a)
}
