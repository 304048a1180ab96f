use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, UnixAddr, accept4, bind, connect, listen, socket,
};

use super::*;

/// A `unixpacket` listener at `path`, as istio-cni's node agent binds its ztunnel socket.
fn listener(path: &Path) -> OwnedFd {
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    bind(fd.as_raw_fd(), &UnixAddr::new(path).unwrap()).unwrap();
    listen(&fd, Backlog::new(8).unwrap()).unwrap();
    fd
}

/// Connects to `path` as ztunnel does, and accepts on `l`: (client end, accepted end).
fn connection(l: &OwnedFd, path: &Path) -> (OwnedFd, OwnedFd) {
    let c = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap();
    connect(c.as_raw_fd(), &UnixAddr::new(path).unwrap()).unwrap();
    // Close-on-exec: a process another test forks meanwhile must not keep it open.
    (
        c,
        owned(accept4(l.as_raw_fd(), SockFlag::SOCK_CLOEXEC).unwrap()),
    )
}

fn owned(fd: std::os::fd::RawFd) -> OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: `fd` was just returned by accept(2) and is owned by nobody else.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn count(path: &Path) -> usize {
    let m = std::fs::symlink_metadata(path).unwrap();
    let bound = Bound { path, ino: m.ino() };
    let sock = super::super::open().unwrap();
    connections(&sock, &bound, Instant::now() + Duration::from_secs(2)).unwrap()
}

#[test]
fn a_connection_to_the_listener_is_seen_and_a_bare_listener_is_not() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("ztunnel.sock");
    let l = listener(&path);
    assert_eq!(count(&path), 0, "a listener alone is not a connection");
    let (client, accepted) = connection(&l, &path);
    assert_eq!(count(&path), 1);
    drop(client);
    drop(accepted);
    assert_eq!(count(&path), 0, "a closed connection is gone");
}

#[test]
fn a_connection_to_a_replaced_listener_does_not_count() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("ztunnel.sock");
    let old = listener(&path);
    let _conn = connection(&old, &path);
    assert_eq!(count(&path), 1);
    // The node agent restarts: a new socket file at the same path, another inode. The old
    // connection still carries the path's text, and must not count for the new listener.
    std::fs::remove_file(&path).unwrap();
    let new = listener(&path);
    assert_eq!(count(&path), 0);
    let _conn2 = connection(&new, &path);
    assert_eq!(count(&path), 1);
}
