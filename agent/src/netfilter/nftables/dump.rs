//! The nf_tables dump over netlink: requests, the receive loop, the generation check around
//! the three dumps, and the caps on what one namespace can make the agent read.
//!
//! In: a netfilter netlink socket bound to the pod's namespace and [`DumpLimits`]. Out: a
//! [`Ruleset`] (through [`super::assemble`]), or a [`ReadError`].

use std::io;

use meshgate_core::rules::{DumpLimits, Ruleset};

use super::{Body, NFNL_SUBSYS_NFTABLES, NFT_HDR_LEN, assemble, decode_buffer};
use crate::netfilter::ReadError;

/// Dumps retried before giving up on a ruleset that keeps changing.
const MAX_ATTEMPTS: u32 = 5;
/// Receive buffer: large enough for the biggest dump skb the kernel sends (32 KiB).
const BUF_LEN: usize = 64 * 1024;

pub(super) const MSG_GETTABLE: u16 = libc::NFT_MSG_GETTABLE as u16;
pub(super) const MSG_GETCHAIN: u16 = libc::NFT_MSG_GETCHAIN as u16;
pub(super) const MSG_GETRULE: u16 = libc::NFT_MSG_GETRULE as u16;
pub(super) const MSG_GETGEN: u16 = libc::NFT_MSG_GETGEN as u16;
pub(super) const NLM_F_REQUEST: u16 = libc::NLM_F_REQUEST as u16;
pub(super) const NLM_F_DUMP: u16 = libc::NLM_F_DUMP as u16;
const NLM_F_ACK: u16 = libc::NLM_F_ACK as u16;

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
pub(super) fn request(msg: u16, flags: u16, seq: u32) -> [u8; NFT_HDR_LEN] {
    let mut b = [0u8; NFT_HDR_LEN];
    b[0..4].copy_from_slice(&(NFT_HDR_LEN as u32).to_ne_bytes());
    b[4..6].copy_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | msg).to_ne_bytes());
    b[6..8].copy_from_slice(&flags.to_ne_bytes());
    b[8..12].copy_from_slice(&seq.to_ne_bytes());
    // pid 0 (the kernel), nfgen_family 0, version NFNETLINK_V0, res_id 0.
    b
}
