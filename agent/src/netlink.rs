//! The agent's netlink sockets (rtnetlink for addresses, nfnetlink for nf_tables dumps,
//! sock_diag for sockets: [`crate::sock_diag`]), on
//! `netlink-sys`, always close-on-exec.
//!
//! In: a [`Bus`] and request bytes. Out: the kernel's answer bytes, or an `io::Error`
//! (a reply larger than the buffer is `ENOSPC`, never silently cut).
//!
//! Close-on-exec matters because the agent runs CNI plugin binaries (VERSION probes) on
//! other threads while pods are inspected: every socket open at the moment of a fork would
//! be inherited by the plugin. `netlink_sys::Socket::new` passes `SOCK_CLOEXEC` to
//! `socket(2)` itself (0.9), so there is no window between opening and marking; the test
//! below fails if a later version stops doing so.
//!
//! Each socket is also connected to the kernel (port id 0): the kernel then refuses
//! (`ECONNREFUSED`) any datagram another socket addresses to it. The socket lives in the pod's
//! namespace, where a process with `CAP_NET_ADMIN` could otherwise send it forged answers (a
//! made-up redirect rule, an early end of dump).

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use netlink_sys::{Socket as NlSocket, SocketAddr, protocols};

/// Which netlink family to talk to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bus {
    /// `NETLINK_ROUTE`: links, addresses.
    Route,
    /// `NETLINK_NETFILTER`: nf_tables.
    Netfilter,
    /// `NETLINK_SOCK_DIAG`: the namespace's sockets.
    SockDiag,
}

/// A bound netlink socket talking to the kernel.
#[derive(Debug)]
pub struct Socket {
    inner: NlSocket,
    portid: u32,
}

impl Socket {
    /// Opens a close-on-exec socket on `bus` in the calling thread's network namespace and
    /// binds it to a port id the kernel picks.
    pub fn open(bus: Bus) -> io::Result<Self> {
        let protocol = match bus {
            Bus::Route => protocols::NETLINK_ROUTE,
            Bus::Netfilter => protocols::NETLINK_NETFILTER,
            Bus::SockDiag => protocols::NETLINK_SOCK_DIAG,
        };
        let mut inner = NlSocket::new(protocol)?;
        let portid = inner.bind_auto()?.port_number();
        inner.connect(&SocketAddr::new(0, 0))?;
        Ok(Self { inner, portid })
    }

    /// Sends one datagram to the kernel. Returns the bytes sent.
    pub fn send(&self, data: &[u8]) -> io::Result<usize> {
        self.inner.send(data, 0)
    }

    /// Receives one datagram (possibly several netlink messages) into `buf`. Returns the
    /// bytes received; a datagram that did not fit is `ENOSPC`.
    pub fn recv_raw(&self, buf: &mut [u8]) -> io::Result<usize> {
        let cap = buf.len();
        // MSG_TRUNC: the kernel returns the datagram's real length even when it was cut.
        let n = self.inner.recv(&mut &mut buf[..], libc::MSG_TRUNC)?;
        if n > cap {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        Ok(n)
    }

    /// Bounds each later receive to `timeout` (`SO_RCVTIMEO`): a receive that waits longer
    /// fails with `EAGAIN`, so a dump has a deadline.
    pub fn set_recv_timeout(&self, timeout: std::time::Duration) -> io::Result<()> {
        // SO_RCVTIMEO of zero means "no timeout": at least one microsecond.
        let micros = timeout.as_micros().clamp(1, i64::MAX as u128) as i64;
        let tv = nix::sys::time::TimeVal::new(micros / 1_000_000, (micros % 1_000_000) as _);
        nix::sys::socket::setsockopt(&self.inner, nix::sys::socket::sockopt::ReceiveTimeout, &tv)
            .map_err(io::Error::from)
    }

    /// The port id the kernel gave the socket.
    pub fn portid(&self) -> u32 {
        self.portid
    }
}

impl AsRawFd for Socket {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The close-on-exec flag is set by `socket(2)` itself; the kernel gave a port id.
    #[test]
    fn sockets_are_close_on_exec_from_the_start() {
        for bus in [Bus::Route, Bus::Netfilter, Bus::SockDiag] {
            let s = Socket::open(bus).unwrap();
            let flags = nix::fcntl::fcntl(&s.inner, nix::fcntl::FcntlArg::F_GETFD).unwrap();
            assert_ne!(flags & libc::FD_CLOEXEC, 0, "{bus:?}");
            assert_ne!(s.portid(), 0);
        }
    }

    /// A datagram larger than the buffer is `ENOSPC`, not a silently cut answer.
    #[test]
    fn a_reply_larger_than_the_buffer_is_refused() {
        let s = Socket::open(Bus::Route).unwrap();
        // RTM_GETLINK dump: the loopback link alone is far more than 32 bytes.
        let mut req = [0u8; 32];
        req[0..4].copy_from_slice(&32u32.to_ne_bytes());
        req[4..6].copy_from_slice(&libc::RTM_GETLINK.to_ne_bytes());
        let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
        req[6..8].copy_from_slice(&flags.to_ne_bytes());
        s.send(&req).unwrap();
        let mut small = [0u8; 32];
        let e = s.recv_raw(&mut small).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
    }
}
