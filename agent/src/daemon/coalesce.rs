//! When a burst of file events in the watched directories is over, so one verification
//! covers it.
//!
//! In: the first [`FsEvent`] of a burst, the channel the rest arrive on, and `--coalesce`
//! (the quiet time). Out: when the burst's last event happened (the start of the untaint
//! latency); the decision whether the burst is complete is `meshgate_core::cni::burst`'s.

use std::time::{Duration, Instant};

use meshgate_core::cni::burst::Burst;
use tokio::sync::mpsc;

use super::fswatch::FsEvent;

/// A burst of file events that is not complete yet ends after `quiet` without one, and at
/// the latest `COALESCE_LIMIT` times `quiet` after it began.
const COALESCE_LIMIT: u32 = 10;

/// Waits until a burst of file events is over and returns when its last event happened. A
/// burst whose files are all complete (`meshgate_core::cni::burst`: renamed into place,
/// closed after writing, removed) is over at once; one with a file still being written (or
/// an event that says nothing) goes on until `quiet` passes without an event. The bound
/// matters: a writer touching the directories more often than `quiet`, forever (a flapping
/// installer, a log rotated into the conf dir), would otherwise keep the node from ever being
/// verified again. Events after the return wake the loop again.
pub(super) async fn coalesce(
    rx: &mut mpsc::UnboundedReceiver<FsEvent>,
    first: FsEvent,
    quiet: Duration,
) -> Instant {
    let end = tokio::time::Instant::now() + quiet * COALESCE_LIMIT;
    let mut burst = Burst::new();
    burst.note(first.path.as_deref(), first.change);
    let mut last = first.at;
    loop {
        // What has arrived already belongs to this burst.
        while tokio::time::Instant::now() < end
            && let Ok(e) = rx.try_recv()
        {
            burst.note(e.path.as_deref(), e.change);
            last = e.at;
        }
        if burst.settled() {
            return last;
        }
        let at = (tokio::time::Instant::now() + quiet).min(end);
        match tokio::time::timeout_at(at, rx.recv()).await {
            Ok(Some(e)) => {
                burst.note(e.path.as_deref(), e.change);
                last = e.at;
            }
            Ok(None) | Err(_) => return last,
        }
    }
}

#[cfg(test)]
mod tests;
