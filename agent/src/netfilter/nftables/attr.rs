//! Netlink attribute TLVs (`struct nlattr`) and the nf_tables attribute numbers.
//!
//! In: attribute bytes of one nesting level. Out: `(type, payload)` pairs and the scalar
//! readers over them; every length is checked against the buffer, so a lying attribute is an
//! error, never a read past the end.

use crate::netfilter::{ReadError, u16_at};

/// Netlink attributes (`struct nlattr` TLVs, 4-byte aligned) of one level.
pub(super) struct Attrs<'a> {
    buf: &'a [u8],
}

/// `NLA_TYPE_MASK`: strips NLA_F_NESTED and NLA_F_NET_BYTEORDER.
const NLA_TYPE_MASK: u16 = 0x3fff;

impl<'a> Attrs<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
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

pub(super) fn be32(b: &[u8], what: &'static str) -> Result<u32, ReadError> {
    b.get(0..4)
        .and_then(|s| s.try_into().ok())
        .map(u32::from_be_bytes)
        .ok_or_else(|| ReadError::Decode {
            what,
            why: format!("{} bytes where a 32-bit value was expected", b.len()),
        })
}

pub(super) fn missing(what: &'static str) -> ReadError {
    ReadError::Decode {
        what,
        why: "a required attribute is missing".into(),
    }
}

// nf_tables attribute numbers (include/uapi/linux/netfilter/nf_tables.h).
pub(super) const NFTA_TABLE_NAME: u16 = 1;
pub(super) const NFTA_TABLE_FLAGS: u16 = 2;
pub(super) const NFTA_CHAIN_TABLE: u16 = 1;
pub(super) const NFTA_CHAIN_NAME: u16 = 3;
pub(super) const NFTA_CHAIN_HOOK: u16 = 4;
pub(super) const NFTA_CHAIN_POLICY: u16 = 5;
pub(super) const NFTA_CHAIN_TYPE: u16 = 7;
pub(super) const NFTA_HOOK_HOOKNUM: u16 = 1;
pub(super) const NFTA_HOOK_PRIORITY: u16 = 2;
pub(super) const NFTA_RULE_TABLE: u16 = 1;
pub(super) const NFTA_RULE_CHAIN: u16 = 2;
pub(super) const NFTA_RULE_EXPRESSIONS: u16 = 4;
pub(super) const NFTA_LIST_ELEM: u16 = 1;
pub(super) const NFTA_EXPR_NAME: u16 = 1;
pub(super) const NFTA_EXPR_DATA: u16 = 2;
pub(super) const NFTA_GEN_ID: u16 = 1;
pub(super) const NFTA_DATA_VALUE: u16 = 1;
pub(super) const NFTA_DATA_VERDICT: u16 = 2;
pub(super) const NFTA_VERDICT_CODE: u16 = 1;
pub(super) const NFTA_VERDICT_CHAIN: u16 = 2;

/// `NFTA_DATA_VALUE` bytes inside an `nft_data` nest.
pub(super) fn data_value(nest: &[u8]) -> Result<Vec<u8>, ReadError> {
    for a in Attrs::new(nest) {
        if let (NFTA_DATA_VALUE, v) = a? {
            return Ok(v.to_vec());
        }
    }
    Ok(Vec::new())
}
