//! The review memory budget: what the request bodies being read, and the reviews being
//! decoded and answered, may hold in memory at once.
//!
//! In: a request (its `Content-Length`, if any, and its body). Out: the body's bytes plus a
//! [`Held`] share of the budget, released when the handler has answered; or a [`Refusal`]:
//! 413 for a body over `--max-body-bytes`, 400 for a body that cannot be read.
//!
//! A review is charged, before a byte of its body is read, what it may cost at worst: its
//! declared body once plus [`WORST_CASE_EXPANSION`] bytes per body byte for its decoding (a
//! body without a `Content-Length`, chunked, is charged as one of the largest size), and holds
//! that share until it is answered. All at once, so no review ever holds a part of the budget
//! while it waits for more (reviews charged chunk by chunk each held a body while waiting for
//! the room to decode it, and four large ones at once waited on each other until their
//! timeout). When the budget is spent, the next review waits for its share, in arrival order,
//! within the per-request timeout (then 503), so many large reviews at once queue instead of
//! taking the pod past its memory limit. The apiserver's reviews (a few KiB each) cost little:
//! hundreds fit at once. A review costing more than the whole budget is charged the whole
//! budget, so it still runs, alone.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt as _;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::decode::WORST_CASE_EXPANSION;

/// Default of `--review-memory-bytes`.
pub const DEFAULT_REVIEW_MEMORY_BYTES: usize = 48 * 1024 * 1024;

/// The budget is counted in KiB: a semaphore's permits are at most `u32` per acquire.
const UNIT: usize = 1024;

/// The shared budget and the body limit.
#[derive(Clone, Debug)]
pub struct Budget {
    shares: Arc<Semaphore>,
    total_units: u32,
    max_body_bytes: usize,
}

/// A share of the budget, released when dropped.
#[derive(Debug)]
pub struct Held(#[allow(dead_code)] OwnedSemaphorePermit);

/// Why a body was not read.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// The body (declared or read) is over `--max-body-bytes`: 413.
    #[error("request body over {0} bytes")]
    TooLarge(usize),
    /// The body could not be read (the connection broke, a bad chunk): 400.
    #[error("cannot read the request body: {0}")]
    Unreadable(String),
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let status = match self {
            Refusal::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Refusal::Unreadable(_) => StatusCode::BAD_REQUEST,
        };
        (status, format!("{self}\n")).into_response()
    }
}

impl Budget {
    /// A budget of `total_bytes` (at least one KiB) for bodies of at most `max_body_bytes`.
    pub fn new(total_bytes: usize, max_body_bytes: usize) -> Self {
        let total_units = u32::try_from(total_bytes.div_ceil(UNIT).max(1)).unwrap_or(u32::MAX);
        let total_units =
            total_units.min(u32::try_from(Semaphore::MAX_PERMITS).unwrap_or(u32::MAX));
        Self {
            shares: Arc::new(Semaphore::new(total_units as usize)),
            total_units,
            max_body_bytes,
        }
    }

    /// What a review whose body has `len` bytes is charged, in units: never more than the
    /// whole budget.
    fn cost(&self, len: usize) -> u32 {
        let bytes = len.saturating_mul(1 + WORST_CASE_EXPANSION);
        u32::try_from(bytes.div_ceil(UNIT))
            .unwrap_or(u32::MAX)
            .clamp(1, self.total_units)
    }

    /// Waits for the review's share of the budget, then reads its body: the bytes, and the
    /// share to hold until the review is answered.
    pub async fn read(&self, headers: &HeaderMap, body: Body) -> Result<(Bytes, Held), Refusal> {
        let declared = content_length(headers);
        if declared.is_some_and(|n| n > self.max_body_bytes) {
            return Err(Refusal::TooLarge(self.max_body_bytes));
        }
        let cost = self.cost(declared.unwrap_or(self.max_body_bytes));
        let permit = match self.shares.clone().try_acquire_many_owned(cost) {
            Ok(p) => p,
            Err(_) => {
                tracing::debug!(kib = cost, "review memory budget spent; waiting");
                self.shares
                    .clone()
                    .acquire_many_owned(cost)
                    .await
                    .map_err(|_| Refusal::Unreadable("the server is stopping".into()))?
            }
        };
        let bytes = read_limited(body, declared, self.max_body_bytes).await?;
        Ok((bytes, Held(permit)))
    }
}

/// Reads `body` into one buffer of at most `max` bytes: sized from `declared` up front (hyper
/// holds the body to it), or grown by doubling, never past `max`, when there is none.
async fn read_limited(body: Body, declared: Option<usize>, max: usize) -> Result<Bytes, Refusal> {
    let mut buf: Vec<u8> = Vec::with_capacity(declared.unwrap_or(0).min(max));
    // Data frames only: trailers are skipped.
    let mut chunks = body.into_data_stream();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| Refusal::Unreadable(e.to_string()))?;
        let len = buf.len() + chunk.len();
        if len > max {
            return Err(Refusal::TooLarge(max));
        }
        if len > buf.capacity() {
            let want = len.max(buf.capacity().saturating_mul(2)).min(max);
            buf.reserve_exact(want - buf.len());
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(buf))
}

/// The `Content-Length` header, when there is exactly one valid one.
fn content_length(headers: &HeaderMap) -> Option<usize> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn headers(len: Option<usize>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(n) = len {
            h.insert(header::CONTENT_LENGTH, n.into());
        }
        h
    }

    /// A review whose worst case does not fit beside another's waits until that one's share
    /// is released; small ones fit beside a large one; a body over the limit is refused
    /// before it is read, whether declared or not.
    #[tokio::test]
    async fn reviews_wait_for_their_share_and_oversized_bodies_are_refused() {
        let max = 64 * 1024;
        let big = max * (1 + WORST_CASE_EXPANSION);
        let budget = Budget::new(big + big / 2, max);
        let body = move || Body::from(vec![b'x'; max]);
        let (bytes, first) = budget.read(&headers(Some(max)), body()).await.unwrap();
        assert_eq!(bytes.len(), max);
        // A small one fits in what is left.
        let small_len = headers(Some(100));
        let small = budget.read(&small_len, Body::from(vec![b'y'; 100]));
        let (bytes, small) = tokio::time::timeout(Duration::from_secs(1), small)
            .await
            .expect("a small review fits beside a large one")
            .unwrap();
        assert_eq!(&bytes[..], &[b'y'; 100][..]);
        drop(small);

        let b2 = budget.clone();
        let second = tokio::spawn(async move { b2.read(&headers(Some(max)), body()).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!second.is_finished(), "the budget had room for two at once");
        drop(first);
        let (bytes, second) = tokio::time::timeout(Duration::from_secs(1), second)
            .await
            .expect("released with the first")
            .unwrap()
            .unwrap();
        assert_eq!(bytes.len(), max);
        drop(second);

        let over = budget.read(&headers(Some(max + 1)), Body::empty()).await;
        assert!(matches!(over, Err(Refusal::TooLarge(_))));
        let undeclared = budget
            .read(&headers(None), Body::from(vec![0u8; max + 1]))
            .await;
        assert!(matches!(undeclared, Err(Refusal::TooLarge(_))));
    }

    /// Four large reviews whose bodies arrive at the same time, each in two chunks, whose
    /// shares fill the budget: each gets its whole share before its body is read, so they run
    /// one after the other. Charged chunk by chunk, each held a first chunk while waiting for
    /// room, and none ever got it.
    #[tokio::test]
    async fn large_reviews_arriving_together_run_in_turn_and_never_wait_on_each_other() {
        let max = 64 * 1024;
        let budget = Budget::new(max * (1 + WORST_CASE_EXPANSION), max);
        let half = Bytes::from(vec![b'z'; max / 2]);
        let mut senders = Vec::new();
        let mut readers = Vec::new();
        for _ in 0..4 {
            let (tx, rx) = futures::channel::mpsc::unbounded::<Result<Bytes, std::io::Error>>();
            senders.push(tx);
            let budget = budget.clone();
            readers.push(tokio::spawn(async move {
                let (bytes, held) = budget
                    .read(&headers(Some(max)), Body::from_stream(rx))
                    .await?;
                drop(held); // answered
                Ok::<usize, Refusal>(bytes.len())
            }));
        }
        for tx in &senders {
            tx.unbounded_send(Ok(half.clone())).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        for tx in senders {
            tx.unbounded_send(Ok(half.clone())).unwrap();
        }
        for r in readers {
            let len = tokio::time::timeout(Duration::from_secs(2), r)
                .await
                .expect("every review ran")
                .unwrap()
                .unwrap();
            assert_eq!(len, max);
        }
    }

    /// A review that alone costs more than the whole budget is charged the whole budget: it
    /// runs, alone, instead of waiting for ever.
    #[tokio::test]
    async fn a_review_larger_than_the_budget_runs_alone() {
        let budget = Budget::new(1024, 1 << 20);
        let (bytes, held) = budget
            .read(&headers(None), Body::from(vec![1u8; 300_000]))
            .await
            .unwrap();
        assert_eq!(bytes.len(), 300_000);
        let one = headers(Some(1));
        let next = budget.read(&one, Body::from(vec![2u8]));
        assert!(
            tokio::time::timeout(Duration::from_millis(100), next)
                .await
                .is_err(),
            "the whole budget is held"
        );
        drop(held);
        assert!(
            budget
                .read(&headers(Some(1)), Body::from(vec![2u8]))
                .await
                .is_ok()
        );
    }
}
