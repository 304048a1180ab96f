//! Connections per client: how many connections each peer address holds, so that one client
//! cannot take more than its share of the connection cap.
//!
//! In: the peer address of an accepted connection. Out: a [`Slot`] counted against that
//! address until it is dropped, or `None` when the address already holds its share. A client
//! is a peer IP address (an IPv4-mapped IPv6 address counts as its IPv4 one): every
//! connection of an apiserver comes from its address, one from a pod from the pod's.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

type Counts = Arc<Mutex<HashMap<IpAddr, usize>>>;

/// The connections each client holds, against a share.
#[derive(Debug)]
pub(super) struct PerClient {
    share: usize,
    held: Counts,
}

/// One connection of a client, counted until dropped.
#[derive(Debug)]
pub(super) struct Slot {
    ip: IpAddr,
    held: Counts,
}

impl PerClient {
    /// At most `share` connections (at least one) per client.
    pub(super) fn new(share: usize) -> Self {
        Self {
            share: share.max(1),
            held: Arc::default(),
        }
    }

    /// A slot for a connection from `ip`, unless it holds its share already.
    pub(super) fn take(&self, ip: IpAddr) -> Option<Slot> {
        let ip = ip.to_canonical();
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let n = held.entry(ip).or_default();
        if *n >= self.share {
            return None;
        }
        *n += 1;
        Some(Slot {
            ip,
            held: self.held.clone(),
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = held.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_holds_at_most_its_share_and_gets_it_back() {
        let clients = PerClient::new(2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let first = clients.take(a).unwrap();
        let _second = clients.take(mapped).unwrap();
        assert!(
            clients.take(a).is_none(),
            "a third connection of one client"
        );
        assert!(
            clients.take(b).is_some(),
            "another client has its own share"
        );
        drop(first);
        assert!(
            clients.take(a).is_some(),
            "a place freed is the client's again"
        );
        drop(clients.take(b));
        assert_eq!(
            clients.held.lock().unwrap().get(&b),
            None,
            "no count kept at 0"
        );
    }
}
