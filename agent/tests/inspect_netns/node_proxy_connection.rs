//! Where a node proxy's connection shows: the kernel creates the listener's accepted end in
//! the network namespace of the socket that connected. A listener in the agent's namespace
//! (istio-cni's node agent, host network) and a client connecting from a pod's namespace
//! (ztunnel): the agent's own dump sees no connection, the pod namespace's dump does.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use meshgate_agent::netns;
use meshgate_agent::sock_diag::unix::{Bound, connections};
use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, UnixAddr, accept4, bind, connect, listen, socket,
};

use super::{Netns, eventually};

fn seqpacket() -> OwnedFd {
    socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .unwrap()
}

#[test]
fn a_proxy_in_its_own_pod_network_holds_both_ends_of_its_connection() {
    let ns = Netns::new("ztc");
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("ztunnel.sock");
    let listener = seqpacket();
    bind(listener.as_raw_fd(), &UnixAddr::new(&path).unwrap()).unwrap();
    listen(&listener, Backlog::new(8).unwrap()).unwrap();
    let m = std::fs::symlink_metadata(&path).unwrap();
    let bound = Bound {
        path: &path,
        ino: m.ino(),
    };
    let count = |sock: &meshgate_agent::netlink::Socket| {
        connections(sock, &bound, Instant::now() + Duration::from_secs(2)).unwrap()
    };
    let here = meshgate_agent::sock_diag::open().unwrap();
    let (dev, ino) = {
        let m = std::fs::metadata(ns.path()).unwrap();
        (m.dev(), m.ino())
    };
    let r = netns::discover(&[std::path::PathBuf::from(netns::DEFAULT_NETNS_DIR)])
        .unwrap()
        .into_iter()
        .find(|r| (r.dev, r.inode) == (dev, ino))
        .expect("the test's namespace is discovered");
    let pod = r.pin().unwrap().sock_diag().unwrap().unwrap();
    assert_eq!((count(&here), count(&pod)), (0, 0));

    // ztunnel connects from inside its pod's namespace; the node agent accepts.
    let client = netns::with_netns(&ns.path(), || {
        let c = seqpacket();
        connect(c.as_raw_fd(), &UnixAddr::new(&path).unwrap()).unwrap();
        c
    })
    .unwrap();
    let fd = accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC).unwrap();
    // SAFETY: accept4(2) just returned this descriptor; nothing else owns it.
    let accepted = unsafe { OwnedFd::from_raw_fd(fd) };
    assert_eq!(
        (count(&here), count(&pod)),
        (0, 1),
        "the accepted end lives in the connecting socket's namespace"
    );
    drop((client, accepted));
    assert!(
        eventually(|| count(&pod) == 0),
        "the connection outlived both its ends"
    );
}
