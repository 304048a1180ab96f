//! Whether something is connected to a unix socket's listener, read from the kernel's unix
//! socket table (`SOCK_DIAG_BY_FAMILY`, `AF_UNIX`) of the calling namespace, never by
//! connecting: istio-cni's node agent takes every connection to its socket for a new ztunnel.
//!
//! In: the listener's path and the inode of the socket file there (`lstat`), a sock_diag
//! socket, a deadline. Out: how many ESTABLISHED unix sockets carry that address. The
//! accepted end of a connection inherits its listener's address and bound path, so each one
//! reports the listener's name (`UNIX_DIAG_NAME`) and the socket file's inode
//! (`UNIX_DIAG_VFS`). Both must match: a listener that was replaced leaves its old
//! connections carrying the same path text but the old file's inode, and they do not count.
//! The device is not compared: on an overlay (a node whose `/run` is one) `lstat` reports the
//! upper layer's device while the socket table reports the overlay's, for the same file.

use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Instant;

use netlink_packet_core::Emitable;
use netlink_packet_sock_diag::SockDiagMessage;
use netlink_packet_sock_diag::unix::nlas::{Nla, UnixDiagName};
use netlink_packet_sock_diag::unix::{ShowFlags, StateFlags, UnixRequest};

use super::{DiagError, dump};
use crate::netlink::Socket;

/// The socket file a listener is bound to: its path and inode as `lstat` gives them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bound<'a> {
    /// The path it is bound to.
    pub path: &'a Path,
    /// `st_ino`.
    pub ino: u64,
}

/// How many established unix sockets carry `bound`'s address and file. Blocking.
pub fn connections(
    sock: &Socket,
    bound: &Bound<'_>,
    deadline: Instant,
) -> Result<usize, DiagError> {
    let request = SockDiagMessage::UnixRequest(UnixRequest {
        state_flags: StateFlags::ESTABLISHED,
        inode: 0,
        show_flags: ShowFlags::NAME | ShowFlags::VFS,
        cookie: [0; 8],
    });
    // The kernel reports the low 32 bits of the inode.
    let want = bound.ino as u32;
    let mut count = 0;
    dump(sock, request, deadline, |m| {
        let SockDiagMessage::UnixResponse(r) = m else {
            return;
        };
        let named = matches!(r.name(), Some(UnixDiagName::Pathname(p)) if p.as_bytes() == bound.path.as_os_str().as_bytes());
        let file = r.nlas.iter().find_map(|n| match n {
            Nla::Vfs(v) => Some(vfs_ino(v)),
            _ => None,
        });
        if named && file == Some(want) {
            count += 1;
        }
    })?;
    Ok(count)
}

/// The inode of a `UNIX_DIAG_VFS` attribute. The crate keeps the fields private; its
/// `Emitable` writes the kernel's `struct unix_diag_vfs` back (`udiag_vfs_ino`, then
/// `udiag_vfs_dev`, native endian).
fn vfs_ino(v: &impl Emitable) -> u32 {
    let mut raw = [0u8; 8];
    if v.buffer_len() == raw.len() {
        v.emit(&mut raw);
    }
    let [i0, i1, i2, i3, ..] = raw;
    u32::from_ne_bytes([i0, i1, i2, i3])
}

#[cfg(test)]
mod tests;
