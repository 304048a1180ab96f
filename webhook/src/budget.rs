//! The review memory budget: what the request bodies being read, and the reviews being
//! decoded and answered, may hold in memory at once.
//!
//! In: a request (its client's address, its `Content-Length`, if any, and its body). Out: the
//! body's bytes plus a [`Held`] share of the budget, released when the handler has answered;
//! or a [`Refusal`]: 413 for a body over `--max-body-bytes`, 408 for a body that does not
//! arrive within [`BODY_READ_TIMEOUT`], 503 for a body sent in chunks that finds the budget
//! spent, 400 for a body that cannot be read.
//!
//! The budget is two pools, and a review takes from them in one order:
//! - **bodies** (`4 × --max-body-bytes`, at most half the budget): a body's bytes, held from
//!   its reading until the answer. A declared body (`Content-Length`) is charged before a byte
//!   of it is read, waiting in arrival order while it holds nothing; a body sent in chunks is
//!   charged chunk by chunk as they arrive, never waiting once it holds some (no room for the
//!   next chunk: 503), so a body that trickles costs what has come, not the largest size. One
//!   client (peer address) holds at most half of this pool, waiting among its own reviews for
//!   it, so a client that trickles bodies leaves the other half to the others;
//! - **decoding** (the rest): [`WORST_CASE_EXPANSION`] bytes per body byte, taken once the
//!   whole body is in, waiting in arrival order. A review whose decoding costs more than the
//!   whole pool is charged all of it, so it still runs, alone.
//!
//! No cycle of waits: a review waits for bodies only while it holds nothing, and for decoding
//! while it holds only its body; what holds decoding waits for nothing more. (Reviews charged
//! their whole worst case chunk by chunk from one pool each held a body while waiting for the
//! room to decode it, and four large ones at once waited on each other until their timeout.)
//! A body is read within [`BODY_READ_TIMEOUT`] of its charge, well inside the request timeout
//! and the apiserver's, so a slow body's share is back in a second. The apiserver's reviews
//! (a few KiB each) cost little: hundreds fit at once.

mod pool;

use std::net::IpAddr;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt as _;
use tokio::time::Instant;

use crate::decode::WORST_CASE_EXPANSION;
use pool::{Claim, Pool};

/// Default of `--review-memory-bytes`.
pub const DEFAULT_REVIEW_MEMORY_BYTES: usize = 48 * 1024 * 1024;

/// How long a body may take to arrive once it is charged: a 3 MiB body takes milliseconds
/// from an apiserver; a body that trickles is cut (408) long before the request timeout.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(1);

/// The budget is counted in KiB: a semaphore's permits are at most `u32` per acquire.
const UNIT: usize = 1024;

/// Bodies the bodies pool holds at once, of the largest size (when half the budget allows).
const LARGEST_BODIES: usize = 4;

/// A review whose decoding was charged this much (4 MiB) or more hands the allocator's free
/// memory back to the kernel once answered ([`meshgate_shell::alloc::trim`]).
const TRIM_UNITS: u32 = 4 * 1024;

/// The shared budget and the body limits.
#[derive(Clone, Debug)]
pub struct Budget {
    bodies: Pool,
    decoding: Pool,
    max_body_bytes: usize,
    read_timeout: Duration,
}

/// A review's share of the budget, released when dropped.
#[derive(Debug)]
pub struct Held {
    decoding: Claim,
    body: Claim,
}

/// Why a body was not read.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// The body (declared or read) is over `--max-body-bytes`: 413.
    #[error("request body over {0} bytes")]
    TooLarge(usize),
    /// The body did not arrive within the body read timeout: 408, and the connection closed.
    #[error("request body not received within {0:?}")]
    TooSlow(Duration),
    /// A body sent in chunks found no room for its next chunk: 503.
    #[error("the review memory budget is spent")]
    Spent,
    /// The body could not be read (the connection broke, a bad chunk): 400.
    #[error("cannot read the request body: {0}")]
    Unreadable(String),
}

impl Refusal {
    /// The `reason` label of `meshgate_review_bodies_refused_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::TooLarge(_) => "too_large",
            Refusal::TooSlow(_) => "too_slow",
            Refusal::Spent => "budget_spent",
            Refusal::Unreadable(_) => "unreadable",
        }
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let status = match self {
            Refusal::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Refusal::TooSlow(_) => StatusCode::REQUEST_TIMEOUT,
            Refusal::Spent => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::Unreadable(_) => StatusCode::BAD_REQUEST,
        };
        let close = matches!(self, Refusal::TooSlow(_));
        let mut resp = (status, format!("{self}\n")).into_response();
        if close {
            // The rest of a slow body is not waited for.
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

fn units(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(UNIT)).unwrap_or(u32::MAX)
}

impl Budget {
    /// A budget of `total_bytes` (at least a KiB a pool) for bodies of at most
    /// `max_body_bytes`, each read within [`BODY_READ_TIMEOUT`].
    pub fn new(total_bytes: usize, max_body_bytes: usize) -> Self {
        let total = units(total_bytes).max(2);
        let bodies = units(max_body_bytes.saturating_mul(LARGEST_BODIES)).clamp(1, total / 2);
        Self {
            bodies: Pool::new(bodies, true),
            decoding: Pool::new(total - bodies, false),
            max_body_bytes,
            read_timeout: BODY_READ_TIMEOUT,
        }
    }

    /// The same budget with another body read timeout (tests).
    #[cfg(test)]
    fn read_within(self, read_timeout: Duration) -> Self {
        Self {
            read_timeout,
            ..self
        }
    }

    /// Reads the body of a review from `client` within its share of the budget (see the
    /// module's documentation): the bytes, and the share to hold until it is answered.
    pub async fn read(
        &self,
        client: IpAddr,
        headers: &HeaderMap,
        body: Body,
    ) -> Result<(Bytes, Held), Refusal> {
        let declared = content_length(headers);
        if declared.is_some_and(|n| n > self.max_body_bytes) {
            return Err(Refusal::TooLarge(self.max_body_bytes));
        }
        let mut held = Held {
            decoding: self.decoding.claim(client),
            body: self.bodies.claim(client),
        };
        let bytes = match declared {
            Some(len) => {
                self.wait(&self.bodies, &mut held.body, units(len)).await?;
                let deadline = Instant::now() + self.read_timeout;
                self.read_declared(body, len, deadline).await?
            }
            None => self.read_chunked(body, &mut held.body).await?,
        };
        let decoding = units(bytes.len().saturating_mul(WORST_CASE_EXPANSION));
        self.wait(&self.decoding, &mut held.decoding, decoding)
            .await?;
        Ok((bytes, held))
    }

    /// Waits in `pool` for `units`, logging a wait.
    async fn wait(&self, pool: &Pool, claim: &mut Claim, units: u32) -> Result<(), Refusal> {
        if pool.try_grow(claim, units) {
            return Ok(());
        }
        tracing::debug!(kib = units, "review memory budget spent; waiting");
        pool.wait(claim, units)
            .await
            .map_err(|_| Refusal::Unreadable("the server is stopping".into()))
    }

    /// Reads a declared body of `len` bytes (hyper holds it to that) into one buffer.
    async fn read_declared(
        &self,
        body: Body,
        len: usize,
        deadline: Instant,
    ) -> Result<Bytes, Refusal> {
        let mut buf: Vec<u8> = Vec::with_capacity(len);
        // Data frames only: trailers are skipped.
        let mut chunks = body.into_data_stream();
        while let Some(chunk) = self.next(&mut chunks, deadline).await? {
            if buf.len() + chunk.len() > self.max_body_bytes {
                return Err(Refusal::TooLarge(self.max_body_bytes));
            }
            buf.extend_from_slice(&chunk);
        }
        if buf.len() != len {
            // hyper ends such a body with an error; a stream that ends short is refused too.
            return Err(Refusal::Unreadable(format!(
                "{} bytes of a body of {len}",
                buf.len()
            )));
        }
        Ok(Bytes::from(buf))
    }

    /// Reads a body sent in chunks, charging `claim` for each as it arrives: waiting for the
    /// first one's room (the wait does not count against the read timeout), trying for the
    /// later ones'. The buffer grows by doubling, never past `--max-body-bytes`.
    async fn read_chunked(&self, body: Body, claim: &mut Claim) -> Result<Bytes, Refusal> {
        let max = self.max_body_bytes;
        let mut buf: Vec<u8> = Vec::new();
        let mut chunks = body.into_data_stream();
        let mut deadline = Instant::now() + self.read_timeout;
        while let Some(chunk) = self.next(&mut chunks, deadline).await? {
            let len = buf.len() + chunk.len();
            if len > max {
                return Err(Refusal::TooLarge(max));
            }
            if claim.units() == 0 {
                let begun = Instant::now();
                self.wait(&self.bodies, claim, units(len)).await?;
                deadline += begun.elapsed();
            } else if !self.bodies.try_grow(claim, units(len)) {
                tracing::debug!(bytes = len, "no room for a body's next chunk; refusing it");
                return Err(Refusal::Spent);
            }
            if len > buf.capacity() {
                let want = len.max(buf.capacity().saturating_mul(2)).min(max);
                buf.reserve_exact(want - buf.len());
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(buf))
    }

    /// The body's next data frame, by `deadline`.
    async fn next(
        &self,
        chunks: &mut axum::body::BodyDataStream,
        deadline: Instant,
    ) -> Result<Option<Bytes>, Refusal> {
        match tokio::time::timeout_at(deadline, chunks.next()).await {
            Err(_) => Err(Refusal::TooSlow(self.read_timeout)),
            Ok(None) => Ok(None),
            Ok(Some(chunk)) => chunk
                .map(Some)
                .map_err(|e| Refusal::Unreadable(e.to_string())),
        }
    }
}

impl Drop for Held {
    /// Dropped once the review is answered, after its body and decoding were freed.
    fn drop(&mut self) {
        if self.decoding.units() >= TRIM_UNITS {
            meshgate_shell::alloc::trim();
        }
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

    const CLIENT: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    type Feed = futures::channel::mpsc::UnboundedSender<Result<Bytes, std::io::Error>>;

    /// A body whose chunks the test sends, when it wants.
    fn fed() -> (Feed, Body) {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        (tx, Body::from_stream(rx))
    }

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
        let (bytes, first) = budget
            .read(CLIENT, &headers(Some(max)), body())
            .await
            .unwrap();
        assert_eq!(bytes.len(), max);
        // A small one fits in what is left.
        let small_len = headers(Some(100));
        let small = budget.read(CLIENT, &small_len, Body::from(vec![b'y'; 100]));
        let (bytes, small) = tokio::time::timeout(Duration::from_secs(1), small)
            .await
            .expect("a small review fits beside a large one")
            .unwrap();
        assert_eq!(&bytes[..], &[b'y'; 100][..]);
        drop(small);

        let b2 = budget.clone();
        let second =
            tokio::spawn(async move { b2.read(CLIENT, &headers(Some(max)), body()).await });
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

        let over = budget
            .read(CLIENT, &headers(Some(max + 1)), Body::empty())
            .await;
        assert!(matches!(over, Err(Refusal::TooLarge(_))));
        let undeclared = budget
            .read(CLIENT, &headers(None), Body::from(vec![0u8; max + 1]))
            .await;
        assert!(matches!(undeclared, Err(Refusal::TooLarge(_))));
    }

    /// Four large reviews whose bodies arrive at the same time, each in two chunks, whose
    /// decoding fills the budget: each holds only its body while it waits for the room to
    /// decode, and what decodes waits for nothing, so they run one after the other. Charged
    /// their whole worst case chunk by chunk from one pool, each held a first chunk while
    /// waiting for room, and none ever got it.
    #[tokio::test]
    async fn large_reviews_arriving_together_run_in_turn_and_never_wait_on_each_other() {
        let max = 64 * 1024;
        let budget = Budget::new(max * (1 + WORST_CASE_EXPANSION), max);
        let half = Bytes::from(vec![b'z'; max / 2]);
        let mut senders = Vec::new();
        let mut readers = Vec::new();
        for _ in 0..4 {
            let (tx, body) = fed();
            senders.push(tx);
            let budget = budget.clone();
            readers.push(tokio::spawn(async move {
                let (bytes, held) = budget.read(CLIENT, &headers(Some(max)), body).await?;
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
            .read(CLIENT, &headers(None), Body::from(vec![1u8; 300_000]))
            .await
            .unwrap();
        assert_eq!(bytes.len(), 300_000);
        let one = headers(Some(1));
        let next = budget.read(CLIENT, &one, Body::from(vec![2u8]));
        assert!(
            tokio::time::timeout(Duration::from_millis(100), next)
                .await
                .is_err(),
            "the whole budget is held"
        );
        drop(held);
        assert!(
            budget
                .read(CLIENT, &headers(Some(1)), Body::from(vec![2u8]))
                .await
                .is_ok()
        );
    }

    /// A body that trickles in chunks costs what has come: a large declared review of the same
    /// client runs beside it at once; the trickle is cut at the read timeout (408).
    #[tokio::test]
    async fn a_trickling_chunked_body_is_charged_what_came_and_cut_at_the_timeout() {
        let max = 64 * 1024;
        let budget = Budget::new(max * (1 + WORST_CASE_EXPANSION), max)
            .read_within(Duration::from_millis(300));
        let (tx, body) = fed();
        tx.unbounded_send(Ok(Bytes::from_static(b"x"))).unwrap();
        let b = budget.clone();
        let trickle = tokio::spawn(async move { b.read(CLIENT, &headers(None), body).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let declared = headers(Some(max));
        let large = budget.read(CLIENT, &declared, Body::from(vec![b'l'; max]));
        let (bytes, _held) = tokio::time::timeout(Duration::from_millis(200), large)
            .await
            .expect("the trickle holds what came, not the largest size")
            .unwrap();
        assert_eq!(bytes.len(), max);
        let cut = tokio::time::timeout(Duration::from_secs(1), trickle)
            .await
            .expect("cut at the read timeout")
            .unwrap();
        assert!(matches!(cut, Err(Refusal::TooSlow(_))), "{cut:?}");
        assert_eq!(
            Refusal::TooSlow(Duration::ZERO).into_response().status(),
            StatusCode::REQUEST_TIMEOUT
        );
        drop(tx);
    }

    /// One client whose declared bodies never arrive holds at most half the bodies' pool: its
    /// next review waits for its own share while another client's review is read at once.
    #[tokio::test]
    async fn a_client_holds_at_most_half_the_bodies_pool() {
        let max = 64 * 1024;
        // Bodies pool: 4 largest bodies; half of it: two.
        let budget = Budget::new(64 * max, max).read_within(Duration::from_millis(300));
        let attacker = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 9));
        let mut stalled = Vec::new();
        let mut senders = Vec::new();
        for _ in 0..3 {
            let (tx, body) = fed();
            senders.push(tx);
            let b = budget.clone();
            stalled.push(tokio::spawn(async move {
                b.read(attacker, &headers(Some(max)), body).await
            }));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let declared = headers(Some(max));
        let others: Vec<_> = (0..2)
            .map(|_| budget.read(CLIENT, &declared, Body::from(vec![b'o'; max])))
            .collect();
        let read = tokio::time::timeout(
            Duration::from_millis(500),
            futures::future::join_all(others),
        )
        .await
        .expect("the other client's bodies are read beside the stalled ones");
        assert!(read.iter().all(Result::is_ok));
        drop(read);
        for s in stalled {
            let got = tokio::time::timeout(Duration::from_secs(3), s)
                .await
                .unwrap()
                .unwrap();
            assert!(matches!(got, Err(Refusal::TooSlow(_))), "{got:?}");
        }
        drop(senders);
    }

    /// Chunked bodies that together need more than the bodies' pool: those that find no room
    /// for a next chunk are refused at once (503) instead of waiting while they hold some, and
    /// the others are read.
    #[tokio::test]
    async fn chunked_bodies_past_the_pool_are_refused_not_deadlocked() {
        let max = 64 * 1024;
        // Room to decode all six: only the bodies' pool (four largest bodies) is short.
        let budget = Budget::new(4 * max + 6 * max * WORST_CASE_EXPANSION, max);
        let half = Bytes::from(vec![b'c'; max / 2]);
        let mut senders = Vec::new();
        let mut readers = Vec::new();
        for i in 0..6u8 {
            let (tx, body) = fed();
            senders.push(tx);
            let b = budget.clone();
            let client = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 1, i));
            readers.push(tokio::spawn(async move {
                b.read(client, &headers(None), body)
                    .await
                    .map(|(bytes, held)| (bytes.len(), held))
            }));
        }
        for tx in &senders {
            tx.unbounded_send(Ok(half.clone())).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        for tx in senders {
            tx.unbounded_send(Ok(half.clone())).unwrap();
        }
        let (mut read, mut spent, mut kept) = (0, 0, Vec::new());
        for r in readers {
            match tokio::time::timeout(Duration::from_secs(2), r)
                .await
                .expect("no deadlock")
                .unwrap()
            {
                Ok((len, held)) => {
                    assert_eq!(len, max);
                    read += 1;
                    kept.push(held);
                }
                Err(Refusal::Spent) => spent += 1,
                Err(e) => panic!("{e}"),
            }
        }
        assert!(read >= 1 && spent >= 1, "read {read}, refused {spent}");
    }
}
