//! A connection's head timer: one deadline for the first request head, another for the wait
//! between requests.
//!
//! In: the accepted TCP stream, wrapped in a [`Socket`] that counts the bytes read from it,
//! and the two timeouts. Out: the [`hyper::rt::Timer`] given to that connection's HTTP/1
//! builder.
//!
//! hyper's HTTP/1 server uses its timer for one thing only: it arms the header-read timer,
//! `sleep_until(now + header_read_timeout)`, each time it starts waiting for a request head,
//! and polls that sleep after every read that leaves the head incomplete (hyper 1.x,
//! `proto/h1/conn.rs`, `Conn::poll_read_head`). So a timer of its own per connection tells
//! the waits apart:
//! - the first arming (the first request of the connection, armed when serving begins, right
//!   after the handshake) keeps hyper's deadline: a connection that never sends a head is
//!   closed after `header_read_timeout`;
//! - a later arming (an idle keep-alive connection) ends `keep_alive_timeout` after it,
//!   unless bytes arrive on the socket after it: then it ends `header_read_timeout` after the
//!   poll that first sees them, so a head begun slowly is held to the slow-client limit.
//!
//! Bytes count as read from the TCP socket, under TLS: a partial TLS record starts the head's
//! deadline too. Known gap: bytes of the next request that were read before the arming (sent
//! ahead while the previous request was served, and taken into hyper's or TLS's buffer) are
//! not seen as new, so such a head is held only to the idle bound.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// What a connection's socket and its timer share.
#[derive(Debug, Default)]
struct Shared {
    /// Bytes read from the socket so far.
    read: AtomicU64,
    /// Whether hyper armed the head timer once already.
    armed: AtomicBool,
}

/// An accepted TCP connection, counting the bytes read from it for its connection's head
/// timer (see [`super::Limits::keep_alive_timeout`]). The stream a [`super::Handshake`]
/// starts from.
#[derive(Debug)]
pub struct Socket {
    tcp: TcpStream,
    shared: Arc<Shared>,
}

impl Socket {
    /// `tcp` and the timer of its connection.
    pub(super) fn new(
        tcp: TcpStream,
        header_read: Duration,
        keep_alive: Duration,
    ) -> (Self, HeadTimer) {
        let shared = Arc::new(Shared::default());
        let timer = HeadTimer {
            shared: shared.clone(),
            header_read,
            keep_alive,
        };
        (Self { tcp, shared }, timer)
    }
}

impl AsyncRead for Socket {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.tcp).poll_read(cx, buf);
        let n = buf.filled().len().saturating_sub(before);
        if n > 0 {
            self.shared.read.fetch_add(n as u64, Ordering::Relaxed);
        }
        polled
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// The head timer of one connection (see the module's documentation).
#[derive(Debug)]
pub(super) struct HeadTimer {
    shared: Arc<Shared>,
    header_read: Duration,
    keep_alive: Duration,
}

impl hyper::rt::Timer for HeadTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        // Not called by the HTTP/1 server; a plain sleep if it ever is.
        Box::pin(HeadSleep {
            sleep: Box::pin(tokio::time::sleep(duration)),
            idle: None,
        })
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        if !self.shared.armed.swap(true, Ordering::Relaxed) {
            return Box::pin(HeadSleep {
                sleep: Box::pin(tokio::time::sleep_until(deadline.into())),
                idle: None,
            });
        }
        let idle = Idle {
            shared: self.shared.clone(),
            at_arming: self.shared.read.load(Ordering::Relaxed),
            header_read: self.header_read,
        };
        Box::pin(HeadSleep {
            sleep: Box::pin(tokio::time::sleep(self.keep_alive)),
            idle: Some(idle),
        })
    }
}

/// A wait for a head; `idle` while it is a keep-alive wait no byte has ended yet.
struct HeadSleep {
    sleep: Pin<Box<tokio::time::Sleep>>,
    idle: Option<Idle>,
}

/// A keep-alive wait: the socket's count when it began.
struct Idle {
    shared: Arc<Shared>,
    at_arming: u64,
    header_read: Duration,
}

impl Future for HeadSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        if let Some(idle) = this
            .idle
            .take_if(|i| i.shared.read.load(Ordering::Relaxed) != i.at_arming)
        {
            // A head has begun: from now on it is held to the slow-client limit.
            this.sleep
                .as_mut()
                .reset(tokio::time::Instant::now() + idle.header_read);
        }
        this.sleep.as_mut().poll(cx)
    }
}

impl hyper::rt::Sleep for HeadSleep {}
