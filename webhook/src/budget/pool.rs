//! A pool of the review memory budget, with an optional share per client.
//!
//! In: a number of units (KiB), the share one client may hold (or none), and requests to hold
//! more: waiting (only by a holder of nothing in this pool) or trying. Out: a [`Claim`], the
//! units one review holds in the pool, released when dropped. A client is a peer IP address;
//! its share is a semaphore of its own, taken before the pool's, so one client's reviews wait
//! among themselves for its share while the others' reviews go on. A client's semaphore is
//! forgotten once nothing of it is held or awaited.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

type Lanes = Arc<Mutex<HashMap<IpAddr, Arc<Semaphore>>>>;

/// One pool of units.
#[derive(Clone, Debug)]
pub(super) struct Pool {
    units: Arc<Semaphore>,
    total: u32,
    /// What one client may hold, when clients have shares.
    share: Option<u32>,
    lanes: Lanes,
}

/// What one review holds in a [`Pool`].
#[derive(Debug)]
pub(super) struct Claim {
    held: Option<OwnedSemaphorePermit>,
    lane: Option<Lane>,
}

/// A client's share: its semaphore, and what this claim holds of it.
#[derive(Debug)]
struct Lane {
    ip: IpAddr,
    units: Arc<Semaphore>,
    held: Option<OwnedSemaphorePermit>,
    lanes: Lanes,
}

/// The pool's semaphore was closed: the server is stopping.
#[derive(Debug)]
pub(super) struct Closed;

impl Pool {
    /// `total` units (at least 1); when `shared`, a client may hold at most half of them.
    pub(super) fn new(total: u32, shared: bool) -> Self {
        let total = total.clamp(1, u32::try_from(Semaphore::MAX_PERMITS).unwrap_or(u32::MAX));
        Self {
            units: Arc::new(Semaphore::new(total as usize)),
            total,
            share: shared.then_some((total / 2).max(1)),
            lanes: Lanes::default(),
        }
    }

    /// The most one review can be charged here: the client's share, or the whole pool.
    pub(super) fn most(&self) -> u32 {
        self.share.unwrap_or(self.total)
    }

    /// A claim of `client`'s holding nothing yet.
    pub(super) fn claim(&self, client: IpAddr) -> Claim {
        let lane = self.share.map(|share| {
            let ip = client.to_canonical();
            let mut lanes = self.lanes.lock().unwrap_or_else(PoisonError::into_inner);
            let units = lanes
                .entry(ip)
                .or_insert_with(|| Arc::new(Semaphore::new(share as usize)))
                .clone();
            Lane {
                ip,
                units,
                held: None,
                lanes: self.lanes.clone(),
            }
        });
        Claim { held: None, lane }
    }

    /// Waits until `claim`, which holds nothing here, holds `units` (at most [`Self::most`]):
    /// the client's share first, then the pool's, each in arrival order.
    pub(super) async fn wait(&self, claim: &mut Claim, units: u32) -> Result<(), Closed> {
        debug_assert_eq!(claim.units(), 0, "waiting while holding");
        let units = units.clamp(1, self.most());
        if let Some(lane) = &mut claim.lane {
            let p = lane.units.clone().acquire_many_owned(units).await;
            lane.held = Some(p.map_err(|_| Closed)?);
        }
        let p = self.units.clone().acquire_many_owned(units).await;
        claim.held = Some(p.map_err(|_| Closed)?);
        Ok(())
    }

    /// Makes `claim` hold `units` (at most [`Self::most`]) without waiting: false, with the
    /// claim unchanged, when the pool or the client's share has no room for the rest.
    pub(super) fn try_grow(&self, claim: &mut Claim, units: u32) -> bool {
        let more = units.min(self.most()).saturating_sub(claim.units());
        if more == 0 {
            return true;
        }
        let lane_more = match &claim.lane {
            Some(lane) => match lane.units.clone().try_acquire_many_owned(more) {
                Ok(p) => Some(p),
                Err(_) => return false,
            },
            None => None,
        };
        let Ok(pool_more) = self.units.clone().try_acquire_many_owned(more) else {
            return false;
        };
        merge(&mut claim.held, pool_more);
        if let (Some(lane), Some(p)) = (&mut claim.lane, lane_more) {
            merge(&mut lane.held, p);
        }
        true
    }
}

fn merge(held: &mut Option<OwnedSemaphorePermit>, more: OwnedSemaphorePermit) {
    match held {
        Some(p) => p.merge(more),
        None => *held = Some(more),
    }
}

impl Claim {
    /// Units held in the pool.
    pub(super) fn units(&self) -> u32 {
        self.held
            .as_ref()
            .map_or(0, |p| u32::try_from(p.num_permits()).unwrap_or(u32::MAX))
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        drop(self.held.take());
        let mut lanes = self.lanes.lock().unwrap_or_else(PoisonError::into_inner);
        // The map's and this one's: no other claim holds or awaits this client's share.
        if Arc::strong_count(&self.units) == 2 {
            lanes.remove(&self.ip);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client holds at most half the pool, tries never wait, and a client's share is
    /// forgotten once released.
    #[tokio::test]
    async fn a_client_holds_at_most_its_share() {
        let pool = Pool::new(10, true);
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let mut first = pool.claim(a);
        pool.wait(&mut first, 100).await.unwrap();
        assert_eq!(first.units(), 5, "charged at most the share");
        let mut second = pool.claim(a);
        assert!(!pool.try_grow(&mut second, 1), "the client's share is held");
        assert_eq!(second.units(), 0);
        let mut other = pool.claim(b);
        assert!(pool.try_grow(&mut other, 3));
        assert!(pool.try_grow(&mut other, 5));
        assert!(!pool.try_grow(&mut second, 1), "and the pool is spent");
        drop((first, other));
        assert!(pool.try_grow(&mut second, 2));
        drop(second);
        assert!(
            pool.lanes.lock().unwrap().is_empty(),
            "a share kept after its use"
        );
    }
}
