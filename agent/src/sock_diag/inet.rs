//! The TCP ports in LISTEN state in a network namespace (`SOCK_DIAG_BY_FAMILY`, `AF_INET`
//! and `AF_INET6`, `IPPROTO_TCP`), where a node proxy that took a pod opens its listeners
//! (ztunnel: 15008, 15006, 15001).
//!
//! In: a sock_diag socket opened inside the namespace, a deadline. Out: the set of local
//! ports with a listening socket, over both families. A kernel without IPv6 refuses the
//! `AF_INET6` dump: that family then simply holds no listener.

use std::collections::BTreeSet;
use std::time::Instant;

use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
use netlink_packet_sock_diag::{AF_INET, AF_INET6, IPPROTO_TCP, SockDiagMessage};

use super::{DiagError, dump};
use crate::netlink::Socket;

/// Local ports of the namespace's listening TCP sockets, IPv4 and IPv6. Blocking.
pub fn tcp_listening(sock: &Socket, deadline: Instant) -> Result<BTreeSet<u16>, DiagError> {
    let mut ports = BTreeSet::new();
    for (family, id) in [
        (AF_INET, SocketId::new_v4()),
        (AF_INET6, SocketId::new_v6()),
    ] {
        let request = SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::LISTEN,
            socket_id: id,
        });
        let got = dump(sock, request, deadline, |m| {
            if let SockDiagMessage::InetResponse(r) = m {
                ports.insert(r.header.socket_id.source_port);
            }
        });
        match got {
            Ok(()) => {}
            Err(DiagError::Kernel(_)) if family == AF_INET6 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(ports)
}
