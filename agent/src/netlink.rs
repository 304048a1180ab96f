//! The agent's netlink sockets (rtnetlink for addresses, nfnetlink for nf_tables dumps),
//! always opened close-on-exec.
//!
//! In: a [`Bus`] and request bytes. Out: the kernel's answer bytes, or an `io::Error`
//! (a reply larger than the buffer is `ENOSPC`, never silently cut).
//!
//! Why not libmnl (`mnl::Socket`): it opens its socket without `SOCK_CLOEXEC` and offers
//! no way to ask for it, and the agent runs CNI plugin binaries (VERSION probes) on other
//! threads while pods are inspected: every socket open at the moment of a fork would be
//! inherited by the plugin. Here the flag is part of the `socket(2)` call itself, so there
//! is no window between opening and marking.

use std::io::{self, IoSliceMut};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, getsockname,
    recvmsg, sendto, socket,
};

/// Which netlink family to talk to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bus {
    /// `NETLINK_ROUTE`: links, addresses.
    Route,
    /// `NETLINK_NETFILTER`: nf_tables.
    Netfilter,
}

/// A bound netlink socket talking to the kernel.
#[derive(Debug)]
pub struct Socket {
    fd: OwnedFd,
    portid: u32,
}

impl Socket {
    /// Opens a close-on-exec socket on `bus` in the calling thread's network namespace and
    /// binds it to a port id the kernel picks.
    pub fn open(bus: Bus) -> io::Result<Self> {
        let protocol = match bus {
            Bus::Route => SockProtocol::NetlinkRoute,
            Bus::Netfilter => SockProtocol::NetlinkNetFilter,
        };
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            protocol,
        )?;
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0))?;
        let portid = getsockname::<NetlinkAddr>(fd.as_raw_fd())?.pid();
        Ok(Self { fd, portid })
    }

    /// Sends one datagram to the kernel. Returns the bytes sent.
    pub fn send(&self, data: &[u8]) -> io::Result<usize> {
        let kernel = NetlinkAddr::new(0, 0);
        Ok(sendto(
            self.fd.as_raw_fd(),
            data,
            &kernel,
            MsgFlags::empty(),
        )?)
    }

    /// Receives one datagram (possibly several netlink messages) into `buf`. Returns the
    /// bytes received; a datagram that did not fit is `ENOSPC`.
    pub fn recv_raw(&self, buf: &mut [u8]) -> io::Result<usize> {
        let mut iov = [IoSliceMut::new(buf)];
        let msg = recvmsg::<NetlinkAddr>(self.fd.as_raw_fd(), &mut iov, None, MsgFlags::empty())?;
        if msg.flags.contains(MsgFlags::MSG_TRUNC) {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        Ok(msg.bytes)
    }

    /// The port id the kernel gave the socket.
    pub fn portid(&self) -> u32 {
        self.portid
    }
}

impl AsRawFd for Socket {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The close-on-exec flag is set by `socket(2)` itself; the kernel gave a port id.
    #[test]
    fn sockets_are_close_on_exec_from_the_start() {
        for bus in [Bus::Route, Bus::Netfilter] {
            let s = Socket::open(bus).unwrap();
            let flags = nix::fcntl::fcntl(&s.fd, nix::fcntl::FcntlArg::F_GETFD).unwrap();
            assert_ne!(flags & libc::FD_CLOEXEC, 0, "{bus:?}");
            assert_ne!(s.portid(), 0);
        }
    }
}
