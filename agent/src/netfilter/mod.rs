//! Netfilter rule readers: the NAT rules a network namespace really holds → a
//! [`meshgate_core::rules::Ruleset`].
//!
//! In: [`Sockets`], opened while the calling thread is inside the target namespace (see
//! [`crate::netns::open`]): a netlink socket for nf_tables, and for each legacy family whose
//! `ip_tables_names` / `ip6_tables_names` list is non-empty, a datagram socket plus that list.
//! Out: one [`Ruleset`] covering nf_tables tables (written by `iptables-nft` or native `nft`)
//! and legacy `ip_tables` / `ip6_tables` tables (written by `iptables-legacy`).
//!
//! Everything here is blocking and synchronous; the daemon calls it from a blocking pool.
//! The byte decoders ([`nftables`] message decoding, [`legacy`] entry blobs, [`redirect_port`])
//! take arbitrary bytes and return errors instead of panicking.

pub mod legacy;
pub mod nftables;

use std::io;

use meshgate_core::rules::{DumpLimits, Family, Ruleset};

/// Failures reading one namespace's rules.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// A socket could not be created inside the namespace.
    #[error("cannot open a {what} socket: {source}")]
    Socket {
        /// Which socket.
        what: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// `/proc/thread-self/net/ip_tables_names` (or the ip6 one) exists but cannot be read.
    #[error("cannot read {path}: {source}")]
    TableNames {
        /// The file.
        path: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// Sending or receiving on the netlink socket failed.
    #[error("nf_tables netlink {what} failed: {source}")]
    Netlink {
        /// `send` / `recv`.
        what: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// The kernel answered a request with an error.
    #[error("nf_tables {request} request refused: {source}")]
    Kernel {
        /// Which request.
        request: &'static str,
        /// The errno carried by NLMSG_ERROR.
        source: io::Error,
    },
    /// The ruleset kept changing while it was being dumped.
    #[error("the nf_tables ruleset changed during {attempts} consecutive dumps")]
    DumpInterrupted {
        /// How many dumps were tried.
        attempts: u32,
    },
    /// A message or blob could not be decoded.
    #[error("cannot decode {what}: {why}")]
    Decode {
        /// What was being decoded.
        what: &'static str,
        /// Why it failed.
        why: String,
    },
    /// A legacy table could not be read with getsockopt.
    #[error("cannot read legacy table {family} {table}: {source}")]
    Legacy {
        /// `ip` or `ip6`.
        family: Family,
        /// Table name.
        table: String,
        /// The OS error.
        source: io::Error,
    },
    /// A legacy table kept changing between its info and entries reads.
    #[error("legacy table {family} {table} kept changing while being read")]
    LegacyChanging {
        /// `ip` or `ip6`.
        family: Family,
        /// Table name.
        table: String,
    },
    /// The namespace holds more than [`DumpLimits`] allow: reading stopped there, and the
    /// verdict is `unknown` (a partial read could miss the redirect).
    #[error("the netfilter rules are too large to judge: {what}")]
    TooLarge {
        /// Which limit, and how far it was passed.
        what: String,
    },
}

/// Handles bound to one namespace; create them with [`Sockets::open_here`] from inside it.
#[derive(Debug)]
pub struct Sockets {
    nft: crate::netlink::Socket,
    legacy: Vec<legacy::LegacyTables>,
}

impl Sockets {
    /// Opens every handle the readers need, in the calling thread's *current* namespace.
    ///
    /// Reads `/proc/thread-self/net/ip_tables_names` and `ip6_tables_names` first: a legacy
    /// query for a table that does not exist would make the kernel create it in the pod's
    /// namespace, so only the listed tables are ever queried.
    pub fn open_here() -> Result<Self, ReadError> {
        let nft =
            crate::netlink::Socket::open(crate::netlink::Bus::Netfilter).map_err(|source| {
                ReadError::Socket {
                    what: "nf_tables netlink",
                    source,
                }
            })?;
        let mut legacy = Vec::new();
        for fam in [Family::Ip, Family::Ip6] {
            if let Some(t) = legacy::LegacyTables::open_here(fam)? {
                legacy.push(t);
            }
        }
        Ok(Self { nft, legacy })
    }

    /// Reads every table (nf_tables first, then legacy) within [`DumpLimits::DEFAULT`].
    pub fn read(&self) -> Result<Ruleset, ReadError> {
        self.read_within(DumpLimits::DEFAULT)
    }

    /// Reads every table, stopping with [`ReadError::TooLarge`] as soon as the bytes read or
    /// the tables, chains or rules decoded pass `limits`: memory stays bounded whatever a
    /// pod with `NET_ADMIN` loads into its namespace.
    pub fn read_within(&self, limits: DumpLimits) -> Result<Ruleset, ReadError> {
        let mut dumper = nftables::Dumper::new(&self.nft).with_limits(limits);
        let mut ruleset = dumper.dump()?;
        let mut budget = limits.max_bytes.saturating_sub(dumper.bytes_read());
        for t in &self.legacy {
            ruleset.tables.extend(t.read(&mut budget)?);
        }
        if let Some(what) = limits.exceeded_by(&ruleset) {
            return Err(ReadError::TooLarge { what });
        }
        Ok(ruleset)
    }

    /// Names of the legacy tables found, per family (for diagnostics and tests).
    pub fn legacy_tables(&self) -> Vec<(Family, Vec<String>)> {
        self.legacy
            .iter()
            .map(|t| (t.family(), t.names().to_vec()))
            .collect()
    }
}

/// The native-endian u16 at `at`, if the buffer holds it.
pub(crate) fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

/// The native-endian u32 at `at`, if the buffer holds it.
pub(crate) fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// A name up to its first NUL (a fixed-size field or a netlink string), lossily as UTF-8:
/// names are whatever a pod with `NET_ADMIN` wrote, and never make a read fail.
pub(crate) fn c_name(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// Splits a buffer of netlink messages into messages, checking every length against the
/// buffer, the last message's padding included, so a short or lying header never reads past
/// the end. Iteration stops at the first malformed header.
pub(crate) fn split_messages(buf: &[u8]) -> impl Iterator<Item = Result<&[u8], String>> {
    const NLMSG_HDR: usize = 16;
    let mut rest = buf;
    std::iter::from_fn(move || {
        if rest.len() < NLMSG_HDR {
            return None;
        }
        let len = u32_at(rest, 0).unwrap_or(0) as usize;
        if len < NLMSG_HDR || len > rest.len() {
            rest = &[];
            return Some(Err(format!("netlink message claims {len} bytes")));
        }
        let (msg, tail) = rest.split_at(len);
        let pad = len.next_multiple_of(4) - len;
        rest = tail.get(pad..).unwrap_or_default();
        Some(Ok(msg))
    })
}

/// `NF_NAT_RANGE_PROTO_SPECIFIED`: the range carries ports.
const NAT_RANGE_PROTO_SPECIFIED: u32 = 1 << 1;

/// The port of an xt `REDIRECT` target's info, for the family it was written for.
///
/// IPv4 (`nf_nat_ipv4_multi_range_compat`): `rangesize` u32, then the first range's `flags`
/// at byte 4 and its minimum port, big-endian, at byte 16. IPv6 (`nf_nat_range`, and the
/// longer `nf_nat_range2`): `flags` at byte 0, minimum port at byte 36. `None` when the info
/// is too short or no port was given (`-j REDIRECT` without `--to-ports`).
pub fn redirect_port(family: Family, info: &[u8]) -> Option<u16> {
    let (flags_at, port_at) = match family {
        Family::Ip => (4, 16),
        Family::Ip6 => (0, 36),
        // iptables-nft never writes xt targets into inet tables; guess by the info's size.
        Family::Inet => {
            if info.len() < 40 {
                (4, 16)
            } else {
                (0, 36)
            }
        }
    };
    let flags = u32::from_ne_bytes(info.get(flags_at..flags_at + 4)?.try_into().ok()?);
    if flags & NAT_RANGE_PROTO_SPECIFIED == 0 {
        return None;
    }
    let port = u16::from_be_bytes(info.get(port_at..port_at + 2)?.try_into().ok()?);
    (port != 0).then_some(port)
}

/// The port of an xt `TPROXY` target's info. Revision 1 (`xt_tproxy_target_info_v1`, what
/// iptables writes for both families): `mark_mask`, `mark_value`, a 16-byte `laddr`, then
/// `lport` (big-endian) at byte 24; 32 bytes once aligned. Revision 0 (IPv4 only, 16 bytes):
/// `lport` at byte 12. `None` for port 0 (`--on-port 0` keeps the packet's own port) or short
/// info.
pub fn tproxy_port(info: &[u8]) -> Option<u16> {
    let at = if info.len() >= 26 { 24 } else { 12 };
    let port = u16::from_be_bytes(info.get(at..at + 2)?.try_into().ok()?);
    (port != 0).then_some(port)
}

/// The [`Action`](meshgate_core::rules::Action) of an xt target other than REDIRECT and the
/// standard verdicts: other NAT targets terminate, REJECT drops, the rest (LOG, MARK, ...)
/// let evaluation continue.
pub(crate) fn xt_target_action(name: &str) -> meshgate_core::rules::Action {
    use meshgate_core::rules::Action;
    match name {
        "DNAT" | "SNAT" | "MASQUERADE" | "NETMAP" => Action::Nat,
        // The xt target ends evaluation: accept when a socket was found, else drop.
        "TPROXY" => Action::Tproxy {
            port: None,
            only: None,
        },
        "REJECT" | "DROP" => Action::Drop,
        "ACCEPT" => Action::Accept,
        "RETURN" => Action::Return,
        _ => Action::Continue,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn v4_info(flags: u32, port: u16) -> Vec<u8> {
        let mut b = vec![0u8; 20];
        b[0..4].copy_from_slice(&1u32.to_ne_bytes());
        b[4..8].copy_from_slice(&flags.to_ne_bytes());
        b[16..18].copy_from_slice(&port.to_be_bytes());
        b[18..20].copy_from_slice(&port.to_be_bytes());
        b
    }

    fn v6_info(flags: u32, port: u16) -> Vec<u8> {
        let mut b = vec![0u8; 40];
        b[0..4].copy_from_slice(&flags.to_ne_bytes());
        b[36..38].copy_from_slice(&port.to_be_bytes());
        b[38..40].copy_from_slice(&port.to_be_bytes());
        b
    }

    #[test]
    fn redirect_port_reads_both_layouts() {
        assert_eq!(redirect_port(Family::Ip, &v4_info(2, 4143)), Some(4143));
        assert_eq!(redirect_port(Family::Ip6, &v6_info(2, 15006)), Some(15006));
        assert_eq!(redirect_port(Family::Inet, &v4_info(2, 4140)), Some(4140));
        assert_eq!(redirect_port(Family::Inet, &v6_info(2, 4140)), Some(4140));
        // No --to-ports: the flag is clear.
        assert_eq!(redirect_port(Family::Ip, &v4_info(0, 0)), None);
        // Truncated info.
        assert_eq!(redirect_port(Family::Ip, &v4_info(2, 4143)[..17]), None);
        assert_eq!(redirect_port(Family::Ip6, &[]), None);
    }

    /// `-j TPROXY --tproxy-mark 1337/0xffffffff --on-port 15006`, revision 1 and 0.
    #[test]
    fn tproxy_port_reads_both_revisions() {
        let mut v1 = vec![0u8; 32];
        v1[0..4].copy_from_slice(&u32::MAX.to_ne_bytes());
        v1[4..8].copy_from_slice(&1337u32.to_ne_bytes());
        v1[24..26].copy_from_slice(&15006u16.to_be_bytes());
        assert_eq!(tproxy_port(&v1), Some(15006));
        let mut v0 = vec![0u8; 16];
        v0[12..14].copy_from_slice(&15006u16.to_be_bytes());
        assert_eq!(tproxy_port(&v0), Some(15006));
        assert_eq!(tproxy_port(&[0u8; 32]), None);
        assert_eq!(tproxy_port(&[0u8; 5]), None);
    }

    #[test]
    fn split_messages_handles_padding_and_bad_lengths() {
        let mut b = vec![0u8; 17 + 3 + 16];
        b[0..4].copy_from_slice(&17u32.to_ne_bytes());
        b[20..24].copy_from_slice(&16u32.to_ne_bytes());
        let lens: Vec<_> = split_messages(&b).map(|m| m.map(<[u8]>::len)).collect();
        assert_eq!(lens, [Ok(17), Ok(16)]);
        // The last message ends unpadded at the end of the buffer.
        let lens: Vec<_> = split_messages(&b[..17])
            .map(|m| m.map(<[u8]>::len))
            .collect();
        assert_eq!(lens, [Ok(17)]);
        let mut bad = vec![0u8; 16];
        bad[0..4].copy_from_slice(&99u32.to_ne_bytes());
        assert!(split_messages(&bad).any(|m| m.is_err()));
    }

    proptest! {
        #[test]
        fn split_messages_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let total: usize = split_messages(&bytes).filter_map(Result::ok).map(<[u8]>::len).sum();
            prop_assert!(total <= bytes.len());
        }

        #[test]
        fn tproxy_port_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = tproxy_port(&bytes);
        }

        #[test]
        fn redirect_port_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            for fam in [Family::Ip, Family::Ip6, Family::Inet] {
                let _ = redirect_port(fam, &bytes);
            }
        }
    }
}
