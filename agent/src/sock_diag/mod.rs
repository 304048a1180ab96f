//! Socket tables over `NETLINK_SOCK_DIAG`, framed and decoded with `netlink-packet-sock-diag`:
//! whether a process is connected to a unix socket's listener ([`unix`]), and which TCP
//! ports listen in a network namespace ([`inet`]).
//!
//! In: a sock_diag socket ([`crate::netlink::Bus::SockDiag`]) opened in the namespace to
//! read (the kernel answers about the namespace the socket was created in), a deadline.
//! Out: the decoded answer, or a [`DiagError`]. Every dump is bounded: one request, a
//! receive timeout down to the deadline, at most [`MAX_ENTRIES`] sockets and
//! [`MAX_DATAGRAMS`] datagrams, each at most [`BUF_LEN`] bytes (a larger one is an error,
//! never cut). Nothing here connects to any socket: sock_diag only reads the kernel's tables.

pub mod inet;
pub mod unix;

use std::io;
use std::time::Instant;

use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_sock_diag::SockDiagMessage;

use crate::netlink::Socket;

/// Sockets one dump may report at most (a busy node has a few thousand unix sockets).
pub const MAX_ENTRIES: usize = 65_536;
/// Datagrams one dump may take at most.
pub const MAX_DATAGRAMS: usize = 16_384;
/// The receive buffer: the kernel fills sock_diag dump datagrams up to 32 KiB.
pub const BUF_LEN: usize = 32 * 1024;
/// Netlink message header length.
const NLMSG_HDR: usize = 16;

/// Failures of one dump.
#[derive(Debug, thiserror::Error)]
pub enum DiagError {
    /// Opening, sending or receiving on the socket failed (`EAGAIN`: no answer in time).
    #[error("sock_diag {what} failed: {source}")]
    Io {
        /// `open`, `send`, `recv`.
        what: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// The deadline passed before the dump ended.
    #[error("the sock_diag dump did not end in time")]
    Deadline,
    /// The kernel refused the request.
    #[error("sock_diag request refused: {0}")]
    Kernel(io::Error),
    /// An answer could not be decoded.
    #[error("cannot decode a sock_diag answer: {0}")]
    Decode(String),
    /// More sockets or datagrams than the caps.
    #[error("the sock_diag dump is larger than {0} sockets or {MAX_DATAGRAMS} datagrams")]
    TooLarge(usize),
}

/// Sends `request` as a dump on `sock` and hands every answer to `each`, until the kernel's
/// end of dump, within `deadline` and the caps. Blocking.
pub fn dump(
    sock: &Socket,
    request: SockDiagMessage,
    deadline: Instant,
    mut each: impl FnMut(SockDiagMessage),
) -> Result<(), DiagError> {
    let seq = 1;
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    header.sequence_number = seq;
    let mut msg = NetlinkMessage::new(header, request.into());
    msg.finalize();
    let mut out = vec![0u8; msg.buffer_len()];
    msg.serialize(&mut out);
    sock.send(&out).map_err(|source| DiagError::Io {
        what: "send",
        source,
    })?;
    let mut buf = vec![0u8; BUF_LEN];
    let mut entries = 0usize;
    for _ in 0..MAX_DATAGRAMS {
        let left = deadline
            .checked_duration_since(Instant::now())
            .ok_or(DiagError::Deadline)?;
        sock.set_recv_timeout(left)
            .map_err(|source| DiagError::Io {
                what: "setsockopt",
                source,
            })?;
        let n = match sock.recv_raw(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Err(DiagError::Deadline),
            Err(source) => {
                return Err(DiagError::Io {
                    what: "recv",
                    source,
                });
            }
        };
        if decode(
            buf.get(..n).unwrap_or_default(),
            seq,
            &mut entries,
            &mut each,
        )? {
            return Ok(());
        }
    }
    Err(DiagError::TooLarge(MAX_ENTRIES))
}

/// Decodes one datagram; `true` at the end of the dump.
fn decode(
    mut rest: &[u8],
    seq: u32,
    entries: &mut usize,
    each: &mut impl FnMut(SockDiagMessage),
) -> Result<bool, DiagError> {
    while rest.len() >= NLMSG_HDR {
        let msg = NetlinkMessage::<SockDiagMessage>::deserialize(rest)
            .map_err(|e| DiagError::Decode(e.to_string()))?;
        let len = msg.header.length as usize;
        if len < NLMSG_HDR {
            return Err(DiagError::Decode(format!("message of {len} bytes")));
        }
        rest = rest.get(len.next_multiple_of(4)..).unwrap_or_default();
        if msg.header.sequence_number != seq {
            continue;
        }
        match msg.payload {
            NetlinkPayload::Done(_) => return Ok(true),
            NetlinkPayload::Error(e) if e.code.is_some() => {
                return Err(DiagError::Kernel(e.to_io()));
            }
            NetlinkPayload::Error(_) => return Ok(true),
            NetlinkPayload::InnerMessage(m) => {
                *entries += 1;
                if *entries > MAX_ENTRIES {
                    return Err(DiagError::TooLarge(MAX_ENTRIES));
                }
                each(m);
            }
            _ => {}
        }
    }
    Ok(false)
}

/// Opens a sock_diag socket in the calling thread's network namespace.
pub fn open() -> Result<Socket, DiagError> {
    Socket::open(crate::netlink::Bus::SockDiag).map_err(|source| DiagError::Io {
        what: "open",
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
    use netlink_packet_sock_diag::{AF_INET, IPPROTO_TCP};
    use proptest::prelude::*;

    fn listen_v4() -> SockDiagMessage {
        SockDiagMessage::InetRequest(InetRequest {
            family: AF_INET,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::LISTEN,
            socket_id: SocketId::new_v4(),
        })
    }

    /// A deadline already past ends the dump before any wait.
    #[test]
    fn a_past_deadline_is_an_error_not_a_wait() {
        let sock = open().unwrap();
        let past = Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(1));
        let got = dump(&sock, listen_v4(), past, |_| {});
        assert!(matches!(got, Err(DiagError::Deadline)), "{got:?}");
    }

    proptest! {
        /// Whatever bytes come back, decoding returns (an answer or an error), never panics.
        #[test]
        fn decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut entries = 0;
            let _ = decode(&bytes, 1, &mut entries, &mut |_| {});
        }
    }
}
