//! Interface addresses of one network namespace over rtnetlink (`RTM_GETADDR` dump), framed
//! and decoded with `netlink-packet-core` and `netlink-packet-route`.
//!
//! In: a `NETLINK_ROUTE` socket created inside the namespace (it stays bound to it after
//! the thread switches back). Out: every address with its prefix length, scope and interface,
//! up to [`MAX_ADDRESSES`]: a pod that can make its own user namespace can fill its netns
//! with millions of addresses, and past the cap the namespace is unreadable (its pod
//! `unknown`, never evicted) rather than costing the agent memory without bound.
//! [`decode_buffer`] is bounds-checked and never panics on arbitrary bytes.
//!
//! Only the `ifaddrmsg` header and the two address attributes are parsed, not the whole
//! message: netlink-packet-route's `AddressMessage` parse fails on an `IFA_LABEL` that is
//! not UTF-8, and the label is the interface name, which a pod with `NET_ADMIN` chooses. One
//! such name would make its namespace unreadable (its pod `unknown`, never evicted).

use std::io;
use std::net::IpAddr;

use netlink_packet_core::{
    ErrorBuffer, NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR,
    NetlinkBuffer, NetlinkMessage, NlasIterator, Parseable,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_packet_route::address::{AddressAttribute, AddressHeader, AddressMessage};

/// `RT_SCOPE_UNIVERSE`: a global address (pod IPs are).
pub const SCOPE_UNIVERSE: u8 = 0;
const RTM_NEWADDR: u16 = libc::RTM_NEWADDR;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
/// `struct nlmsghdr`.
const NLMSG_HDR: usize = 16;
/// `struct ifaddrmsg`.
const IFADDRMSG: usize = 8;
/// Receive buffer: the largest dump datagram the kernel sends (32 KiB).
const BUF_LEN: usize = 32 * 1024;
/// Dumps retried before giving up on an address list that keeps changing.
const MAX_ATTEMPTS: u32 = 5;
/// Addresses one namespace may hold before it is too many to judge (a pod has a handful;
/// 4,096 cost the agent about 100 KiB).
pub const MAX_ADDRESSES: usize = 4096;

/// One interface address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Address {
    /// The address.
    pub ip: IpAddr,
    /// Prefix length.
    pub prefix_len: u8,
    /// RT_SCOPE_* (0 = global, 253 = link, 254 = host).
    pub scope: u8,
    /// Interface index.
    pub ifindex: u32,
}

impl Address {
    /// True for global-scope addresses: the kind a pod IP is.
    pub fn is_global(&self) -> bool {
        self.scope == SCOPE_UNIVERSE
    }
}

/// Failures dumping addresses.
#[derive(Debug, thiserror::Error)]
pub enum AddrError {
    /// Sending or receiving failed.
    #[error("rtnetlink {what} failed: {source}")]
    Io {
        /// `send` / `recv`.
        what: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// The kernel answered with an error.
    #[error("RTM_GETADDR refused: {0}")]
    Kernel(io::Error),
    /// The answer could not be decoded.
    #[error("cannot decode an RTM_GETADDR answer: {0}")]
    Decode(String),
    /// The address list kept changing during the dump.
    #[error("the address list changed during {0} consecutive dumps")]
    Interrupted(u32),
    /// More addresses than the cap: reading stopped there.
    #[error("more than {0} addresses, too many to judge")]
    TooMany(usize),
}

/// What one receive buffer carried.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// Addresses decoded from `RTM_NEWADDR` messages of the request's sequence.
    pub addresses: Vec<Address>,
    /// `NLMSG_DONE` seen.
    pub done: bool,
    /// Some message carried `NLM_F_DUMP_INTR`.
    pub interrupted: bool,
    /// `NLMSG_ERROR` with a non-zero errno (negative).
    pub error: Option<i32>,
}

/// Dumps every address of the socket's namespace, retrying an interrupted dump; more than
/// [`MAX_ADDRESSES`] is [`AddrError::TooMany`].
pub fn dump(sock: &crate::netlink::Socket) -> Result<Vec<Address>, AddrError> {
    dump_within(sock, MAX_ADDRESSES)
}

/// [`dump`] with a cap of `max` addresses.
pub fn dump_within(sock: &crate::netlink::Socket, max: usize) -> Result<Vec<Address>, AddrError> {
    let mut buf = vec![0u8; BUF_LEN];
    for seq in 1..=MAX_ATTEMPTS {
        sock.send(&request(seq)).map_err(|source| AddrError::Io {
            what: "send",
            source,
        })?;
        let (all, interrupted) = receive(sock, &mut buf, seq, max)?;
        if !interrupted {
            return Ok(all);
        }
    }
    Err(AddrError::Interrupted(MAX_ATTEMPTS))
}

/// Reads one dump's datagrams until `NLMSG_DONE`: the addresses, and whether any message
/// was flagged interrupted. Past `max` addresses it stops (one datagram over at most).
fn receive(
    sock: &crate::netlink::Socket,
    buf: &mut [u8],
    seq: u32,
    max: usize,
) -> Result<(Vec<Address>, bool), AddrError> {
    let mut all = Vec::new();
    let mut interrupted = false;
    loop {
        let n = sock.recv_raw(buf).map_err(|source| AddrError::Io {
            what: "recv",
            source,
        })?;
        let batch = decode_buffer(buf.get(..n).unwrap_or(buf), seq)?;
        if let Some(errno) = batch.error {
            return Err(AddrError::Kernel(io::Error::from_raw_os_error(
                errno.saturating_neg(),
            )));
        }
        all.extend(batch.addresses);
        if all.len() > max {
            return Err(AddrError::TooMany(max));
        }
        interrupted |= batch.interrupted;
        if batch.done {
            return Ok((all, interrupted));
        }
    }
}

/// `RTM_GETADDR` with `NLM_F_DUMP` for every family (an `AF_UNSPEC` ifaddrmsg).
fn request(seq: u32) -> Vec<u8> {
    let mut msg = NetlinkMessage::from(RouteNetlinkMessage::GetAddress(AddressMessage::default()));
    msg.header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    msg.header.sequence_number = seq;
    msg.finalize();
    let mut out = vec![0u8; msg.buffer_len()];
    msg.serialize(&mut out);
    out
}

/// The netlink messages of one datagram, each length checked against the buffer (the last
/// message's padding included) by `NetlinkBuffer::new_checked`. Trailing bytes shorter than
/// a header end the iteration; a header that lies about its length ends it with an error.
fn frames(buf: &[u8]) -> impl Iterator<Item = Result<NetlinkBuffer<&[u8]>, AddrError>> {
    let mut rest = buf;
    std::iter::from_fn(move || {
        if rest.len() < NLMSG_HDR {
            return None;
        }
        let checked = NetlinkBuffer::new_checked(rest).map(|b| b.length() as usize);
        let len = match checked {
            Ok(len) => len,
            Err(e) => {
                rest = &[];
                return Some(Err(AddrError::Decode(e.to_string())));
            }
        };
        let (msg, tail) = rest.split_at(len);
        rest = tail
            .get(len.next_multiple_of(4) - len..)
            .unwrap_or_default();
        Some(Ok(NetlinkBuffer::new(msg)))
    })
}

/// Decodes one receive buffer of an `RTM_GETADDR` dump; messages of other sequence numbers
/// are ignored. Never panics.
pub fn decode_buffer(buf: &[u8], seq: u32) -> Result<Batch, AddrError> {
    let mut batch = Batch::default();
    for msg in frames(buf) {
        let msg = msg?;
        if msg.sequence_number() != seq {
            continue;
        }
        batch.interrupted |= msg.flags() & NLM_F_DUMP_INTR != 0;
        match msg.message_type() {
            NLMSG_DONE => batch.done = true,
            NLMSG_ERROR => {
                let e = ErrorBuffer::new_checked(msg.payload())
                    .map_err(|_| AddrError::Decode("short NLMSG_ERROR".into()))?;
                batch.error = e.code().map(|c| c.get());
                batch.done = true;
            }
            RTM_NEWADDR => batch.addresses.extend(decode_addr(msg.payload())?),
            _ => {}
        }
    }
    Ok(batch)
}

/// One `RTM_NEWADDR` payload (ifaddrmsg + attributes) → its address, if it has one.
fn decode_addr(payload: &[u8]) -> Result<Option<Address>, AddrError> {
    let header = AddressHeader::parse(payload)
        .map_err(|_| AddrError::Decode("RTM_NEWADDR shorter than ifaddrmsg".into()))?;
    let mut local = None;
    let mut address = None;
    for nla in NlasIterator::new(payload.get(IFADDRMSG..).unwrap_or_default()) {
        let nla = nla.map_err(|e| AddrError::Decode(e.to_string()))?;
        if !matches!(nla.kind(), IFA_LOCAL | IFA_ADDRESS) {
            continue;
        }
        // An address of neither 4 nor 16 bytes is skipped, as the kernel never sends one.
        match AddressAttribute::parse(&nla) {
            Ok(AddressAttribute::Local(ip)) => local = Some(ip),
            Ok(AddressAttribute::Address(ip)) => address = Some(ip),
            _ => {}
        }
    }
    // IFA_LOCAL is the interface's own address; IFA_ADDRESS is the peer on point-to-point
    // links, so the local one wins when both are present.
    Ok(local.or(address).map(|ip| Address {
        ip,
        prefix_len: header.prefix_len,
        scope: header.scope.into(),
        ifindex: header.index,
    }))
}

#[cfg(test)]
mod tests;
