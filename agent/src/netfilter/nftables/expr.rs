//! One nf_tables rule expression (an `NFTA_LIST_ELEM` nest) → an [`Expr`]: only what
//! [`super::summarize`] needs of the expressions a mesh's rules are made of.
//!
//! In: the nest's bytes. Out: the [`Expr`], or [`ReadError::Decode`] for a malformed nest.
//! Expressions it does not know become [`Expr::Named`].

use std::collections::HashMap;

use super::attr::{
    Attrs, NFTA_DATA_VERDICT, NFTA_EXPR_DATA, NFTA_EXPR_NAME, NFTA_VERDICT_CHAIN,
    NFTA_VERDICT_CODE, be32, data_value,
};
use crate::netfilter::{ReadError, c_name};

/// One rule expression, reduced to what [`super::summarize`] needs.
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

/// The attributes of one expression's `NFTA_EXPR_DATA`, by their `NFTA_<EXPR>_*` number.
struct Fields<'a> {
    u32s: HashMap<u16, u32>,
    raw: HashMap<u16, &'a [u8]>,
}

impl<'a> Fields<'a> {
    fn parse(data: &'a [u8]) -> Result<Self, ReadError> {
        let mut u32s = HashMap::new();
        let mut raw = HashMap::new();
        for a in Attrs::new(data) {
            let (ty, v) = a?;
            if let Some(b) = v.get(0..4).and_then(|s| <[u8; 4]>::try_from(s).ok()) {
                u32s.insert(ty, u32::from_be_bytes(b));
            }
            raw.insert(ty, v);
        }
        Ok(Self { u32s, raw })
    }

    /// The attribute as a big-endian u32, when it is at least 4 bytes long.
    fn u32(&self, ty: u16) -> Option<u32> {
        self.u32s.get(&ty).copied()
    }

    /// The attribute's bytes; empty when absent.
    fn raw(&self, ty: u16) -> &'a [u8] {
        self.raw.get(&ty).copied().unwrap_or_default()
    }
}

/// Decodes one `NFTA_LIST_ELEM` expression nest.
pub(super) fn parse_expr(elem: &[u8]) -> Result<Expr, ReadError> {
    let mut name = String::new();
    let mut data: &[u8] = &[];
    for a in Attrs::new(elem) {
        match a? {
            (NFTA_EXPR_NAME, v) => name = c_name(v),
            (NFTA_EXPR_DATA, v) => data = v,
            _ => {}
        }
    }
    let f = Fields::parse(data)?;
    Ok(match name.as_str() {
        "immediate" => immediate(&f)?,
        // NFTA_META_DREG = 1, NFTA_META_KEY = 2 (SREG = 3 is a `meta set` statement).
        "meta" => match f.u32(1) {
            Some(dreg) => Expr::Meta {
                key: f.u32(2).unwrap_or(u32::MAX),
                dreg: reg_slot(dreg),
            },
            None => Expr::Named(name),
        },
        // NFTA_PAYLOAD_DREG = 1, BASE = 2, OFFSET = 3, LEN = 4 (SREG = 5 is a set statement).
        "payload" => match f.u32(1) {
            Some(dreg) => Expr::Payload {
                base: f.u32(2).unwrap_or(u32::MAX),
                offset: f.u32(3).unwrap_or(u32::MAX),
                len: f.u32(4).unwrap_or(0),
                dreg: reg_slot(dreg),
            },
            None => Expr::Named(name),
        },
        // NFTA_CMP_SREG = 1, OP = 2, DATA = 3.
        "cmp" => Expr::Cmp {
            sreg: reg_slot(f.u32(1).unwrap_or(u32::MAX)),
            op: f.u32(2).unwrap_or(u32::MAX),
            data: data_value(f.raw(3))?,
        },
        // NFTA_MATCH_NAME / NFTA_TARGET_NAME = 1, INFO = 3.
        "match" => Expr::XtMatch {
            name: c_name(f.raw(1)),
        },
        "target" => Expr::XtTarget {
            name: c_name(f.raw(1)),
            info: f.raw(3).to_vec(),
        },
        // NFTA_REDIR_REG_PROTO_MIN = 1.
        "redir" => Expr::Redir {
            proto_min_reg: f.u32(1).map(reg_slot),
        },
        // NFTA_TPROXY_FAMILY = 1, REG_ADDR = 2, REG_PORT = 3.
        "tproxy" => Expr::Tproxy {
            family: f.u32(1),
            port_reg: f.u32(3).map(reg_slot),
        },
        _ => Expr::Named(name),
    })
}

/// `immediate`: a verdict when it targets the verdict register, else data loaded into a
/// register. NFTA_IMMEDIATE_DREG = 1, NFTA_IMMEDIATE_DATA = 2.
fn immediate(f: &Fields) -> Result<Expr, ReadError> {
    let dreg = f.u32(1).unwrap_or(0);
    let nest = f.raw(2);
    match verdict(nest)? {
        Some(v) if dreg == libc::NFT_REG_VERDICT as u32 => Ok(v),
        _ => Ok(Expr::Load {
            dreg: reg_slot(dreg),
            data: data_value(nest)?,
        }),
    }
}

/// The verdict inside an `nft_data` nest (`NFTA_DATA_VERDICT`), if it holds one.
fn verdict(nest: &[u8]) -> Result<Option<Expr>, ReadError> {
    let mut verdict = None;
    for a in Attrs::new(nest) {
        if let (NFTA_DATA_VERDICT, v) = a? {
            let (mut code, mut chain) = (None, None);
            for va in Attrs::new(v) {
                match va? {
                    (NFTA_VERDICT_CODE, c) => code = Some(be32(c, "verdict code")? as i32),
                    (NFTA_VERDICT_CHAIN, c) => chain = Some(c_name(c)),
                    _ => {}
                }
            }
            verdict = code.map(|code| Expr::Verdict { code, chain });
        }
    }
    Ok(verdict)
}
