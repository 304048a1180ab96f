//! The review memory budget: what the request bodies being read, and the reviews being
//! decoded and answered, may hold in memory at once.
//!
//! In: a request (its `Content-Length`, if any, and its body). Out: the body's bytes plus a
//! [`Held`] share of the budget, released when the handler has answered; or a [`Refusal`]:
//! 413 for a body over `--max-body-bytes`, 400 for a body that cannot be read.
//!
//! A review is charged as it goes: each chunk of its body as it arrives (so a slow sender
//! holds only what it has sent), then, once the body is complete, [`WORST_CASE_EXPANSION`]
//! bytes per body byte for its decoding, held until the answer is built. When the budget is
//! spent the next charge waits (the per-request timeout bounds the wait: 503), so many large
//! reviews at once queue instead of taking the pod past its memory limit. The apiserver's
//! reviews (a few KiB each) cost little: hundreds fit at once. A review costing more than the
//! whole budget is charged the whole budget, so it still runs, alone.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
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
pub struct Held {
    permit: Option<OwnedSemaphorePermit>,
    /// Bytes charged so far (the permit holds them rounded up to whole units).
    bytes: usize,
}

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

    /// Adds `bytes` to what `held` is charged, waiting for room in the budget if needed.
    /// Past the whole budget nothing more is charged.
    async fn charge(&self, held: &mut Held, bytes: usize) -> Result<(), Refusal> {
        held.bytes = held.bytes.saturating_add(bytes);
        let units = u32::try_from(held.bytes.div_ceil(UNIT))
            .unwrap_or(u32::MAX)
            .min(self.total_units);
        let have = held.permit.as_ref().map_or(0, |p| p.num_permits());
        let more = units.saturating_sub(u32::try_from(have).unwrap_or(u32::MAX));
        if more == 0 {
            return Ok(());
        }
        let permit = match self.shares.clone().try_acquire_many_owned(more) {
            Ok(p) => p,
            Err(_) => {
                tracing::debug!(kib = more, "review memory budget spent; waiting");
                self.shares
                    .clone()
                    .acquire_many_owned(more)
                    .await
                    .map_err(|_| Refusal::Unreadable("the server is stopping".into()))?
            }
        };
        match &mut held.permit {
            Some(p) => p.merge(permit),
            None => held.permit = Some(permit),
        }
        Ok(())
    }

    /// Reads the body within the budget, then charges its decoding: the bytes, and the share
    /// to hold until the review is answered.
    pub async fn read(&self, headers: &HeaderMap, body: Body) -> Result<(Bytes, Held), Refusal> {
        let declared = content_length(headers);
        if declared.is_some_and(|n| n > self.max_body_bytes) {
            return Err(Refusal::TooLarge(self.max_body_bytes));
        }
        let mut held = Held {
            permit: None,
            bytes: 0,
        };
        let bytes = self.read_limited(body, declared, &mut held).await?;
        self.charge(&mut held, bytes.len().saturating_mul(WORST_CASE_EXPANSION))
            .await?;
        Ok((bytes, held))
    }

    /// Reads `body` into one buffer of at most `--max-body-bytes`, each chunk charged before
    /// it is kept. Sized from `declared` (hyper holds the body to it) as the bytes arrive, and
    /// grown by doubling, never past the limit, when there is none.
    async fn read_limited(
        &self,
        mut body: Body,
        declared: Option<usize>,
        held: &mut Held,
    ) -> Result<Bytes, Refusal> {
        let max = self.max_body_bytes;
        let mut buf: Vec<u8> = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| Refusal::Unreadable(e.to_string()))?;
            let Ok(chunk) = frame.into_data() else {
                continue; // trailers
            };
            let len = buf.len() + chunk.len();
            if len > max {
                return Err(Refusal::TooLarge(max));
            }
            self.charge(held, chunk.len()).await?;
            if len > buf.capacity() {
                let want = match declared {
                    Some(d) => d.max(len),
                    None => len.max(buf.capacity().saturating_mul(2)),
                }
                .min(max);
                buf.reserve_exact(want - buf.len());
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(buf))
    }
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
        let (bytes, _second) = tokio::time::timeout(Duration::from_secs(1), second)
            .await
            .expect("released with the first")
            .unwrap()
            .unwrap();
        assert_eq!(bytes.len(), max);

        let over = budget.read(&headers(Some(max + 1)), Body::empty()).await;
        assert!(matches!(over, Err(Refusal::TooLarge(_))));
        let undeclared = budget
            .read(&headers(None), Body::from(vec![0u8; max + 1]))
            .await;
        assert!(matches!(undeclared, Err(Refusal::TooLarge(_))));
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
