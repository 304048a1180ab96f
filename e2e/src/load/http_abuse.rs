//! Abusive HTTP clients for the fault and abuse suite, and the peak memory of the process they
//! aim at.
//!
//! In: a server's address, its transport (plain, or TLS trusting a CA), and what to send.
//! Out: how the server treated each connection or request (status, close and when), and
//! [`PeakRss`]: the target's peak resident memory (`VmHWM`) while the attack ran. Every
//! connection and every wait is bounded in time; the attacks only ever address the loopback
//! servers the tests start.
//!
//! - [`slow_heads`]: connections that send a long request head and never finish it.
//! - [`post_all`]: request bodies posted all at once, each on its own connection.
//! - [`slow_chunked`]: requests at a steady rate, each a body sent in chunks that trickle,
//!   from a source address of their own (another client than the apiserver).
//! - [`tiny_objects_review`], [`label_flood_review`]: bodies just under a size, made of tiny
//!   JSON objects (which a tree-building decoder turns into about 75 times their size) or of
//!   the shortest distinct labels.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use hyper::body::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// How to reach the server.
#[derive(Clone)]
pub enum Transport {
    /// Plain HTTP (the admin ports).
    Plain,
    /// TLS trusting the given connector's roots, for the name 127.0.0.1 (the webhook).
    Tls(tokio_rustls::TlsConnector),
}

/// A connection's stream, whichever the transport.
trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// Bound on a TCP connect plus handshake.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

impl Transport {
    async fn connect(&self, addr: SocketAddr) -> std::io::Result<Box<dyn Stream>> {
        self.connect_from(addr, None).await
    }

    /// A connection to `addr`, from the loopback address `source` when given.
    async fn connect_from(
        &self,
        addr: SocketAddr,
        source: Option<IpAddr>,
    ) -> std::io::Result<Box<dyn Stream>> {
        let connect = async {
            let tcp = match source {
                None => TcpStream::connect(addr).await?,
                Some(ip) => {
                    let socket = tokio::net::TcpSocket::new_v4()?;
                    socket.bind(SocketAddr::new(ip, 0))?;
                    socket.connect(addr).await?
                }
            };
            let stream: Box<dyn Stream> = match self {
                Transport::Plain => Box::new(tcp),
                Transport::Tls(connector) => {
                    let name = rustls::pki_types::ServerName::try_from("127.0.0.1")
                        .map_err(std::io::Error::other)?;
                    Box::new(connector.connect(name, tcp).await?)
                }
            };
            Ok(stream)
        };
        tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| std::io::Error::other("connect timed out"))?
    }
}

/// A process's resident memory in KiB, now and at its peak (`VmRSS`, `VmHWM`).
pub fn memory_kib(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status.lines().find_map(|l| {
            l.strip_prefix(name)?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// Peak resident memory of a process, from its start (`VmHWM` is never reset).
#[derive(Clone, Copy, Debug)]
pub struct PeakRss {
    /// Resident memory before the attack, KiB.
    pub before_kib: u64,
    /// Peak resident memory at the end of the attack, KiB.
    pub peak_kib: u64,
}

impl PeakRss {
    /// Reads the process's memory before an attack.
    pub fn start(pid: u32) -> Option<Self> {
        let (rss, _) = memory_kib(pid)?;
        Some(Self {
            before_kib: rss,
            peak_kib: rss,
        })
    }

    /// Reads the peak after the attack.
    pub fn finish(mut self, pid: u32) -> Option<Self> {
        self.peak_kib = memory_kib(pid)?.1;
        Some(self)
    }

    /// Peak in MiB.
    pub fn peak_mib(&self) -> f64 {
        self.peak_kib as f64 / 1024.0
    }

    /// Before, in MiB.
    pub fn before_mib(&self) -> f64 {
        self.before_kib as f64 / 1024.0
    }
}

/// How the server treated the connections of [`slow_heads`].
#[derive(Debug, Default)]
pub struct SlowHeads {
    /// Connections made.
    pub connected: usize,
    /// Connections that could not be made (refused, or not accepted within the bound).
    pub not_connected: usize,
    /// For each connection the server closed within the hold: after how long (from the
    /// first byte sent), and what it answered (the status line, or "" for none).
    pub closed: Vec<(Duration, String)>,
    /// Connections still open at the end of the hold.
    pub still_open: usize,
}

impl SlowHeads {
    /// The slowest close, if any.
    pub fn slowest_close(&self) -> Option<Duration> {
        self.closed.iter().map(|c| c.0).max()
    }

    /// How many were answered with `status` before the close.
    pub fn answered(&self, status: &str) -> usize {
        self.closed
            .iter()
            .filter(|c| c.1.split_whitespace().nth(1) == Some(status))
            .count()
    }
}

/// Opens `n` connections at once; on each, sends a `POST path` request head of about
/// `head_bytes` bytes that never ends (no blank line), then waits, for at most `hold`, for
/// the server to close it. Writes that fail (the server closed) end the sending early.
/// The connections come from `sources` in turn (loopback addresses: clients apart, each
/// with its own share of the server's connection cap), or from the default address.
pub async fn slow_heads(
    addr: SocketAddr,
    transport: &Transport,
    (path, sources): (&str, &[IpAddr]),
    n: usize,
    head_bytes: usize,
    hold: Duration,
) -> SlowHeads {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let transport = transport.clone();
            let path = path.to_string();
            let source = (!sources.is_empty()).then(|| sources[i % sources.len()]);
            tokio::spawn(async move {
                let head = (i, head_bytes, hold);
                slow_head(addr, &transport, &path, source, head).await
            })
        })
        .collect();
    let (ended, not_connected, still_open) = tally(tasks).await;
    SlowHeads {
        connected: ended.len() + still_open,
        not_connected,
        closed: ended,
        still_open,
    }
}

/// What a connection of an attack came to: `None`, it could not connect; `Some(None)`, still
/// open at the end of its hold; `Some(Some((after, status)))`, answered or closed.
type Ended = Option<Option<(Duration, String)>>;

/// The attack's connections once all ended: those answered or closed, how many could not
/// connect and how many were still open.
async fn tally(
    tasks: Vec<tokio::task::JoinHandle<Ended>>,
) -> (Vec<(Duration, String)>, usize, usize) {
    let (mut ended, mut not_connected, mut still_open) = (Vec::new(), 0, 0);
    for t in tasks {
        match t.await {
            Ok(Some(Some(end))) => ended.push(end),
            Ok(Some(None)) => still_open += 1,
            Ok(None) | Err(_) => not_connected += 1,
        }
    }
    (ended, not_connected, still_open)
}

/// One connection of [`slow_heads`]: `None` if it could not connect, else `Some(close)`.
async fn slow_head(
    addr: SocketAddr,
    transport: &Transport,
    path: &str,
    source: Option<IpAddr>,
    (i, head_bytes, hold): (usize, usize, Duration),
) -> Ended {
    let mut s = transport.connect_from(addr, source).await.ok()?;
    let begun = Instant::now();
    let line = format!("X-Pad-{i}: {}\r\n", "p".repeat(1000));
    let mut head = format!("POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n");
    while head.len() + line.len() <= head_bytes {
        head.push_str(&line);
    }
    // Past the server's buffer the server closes: a failed write is expected then.
    let _ = tokio::time::timeout(hold, s.write_all(head.as_bytes())).await;
    let _ = s.flush().await;
    let mut answer = Vec::new();
    let left = hold.saturating_sub(begun.elapsed());
    let closed = tokio::time::timeout(left, async {
        let mut chunk = [0u8; 1024];
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) if answer.len() < 4096 => answer.extend_from_slice(&chunk[..n]),
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok();
    let status = String::from_utf8_lossy(&answer)
        .lines()
        .next()
        .unwrap_or_default()
        .to_string();
    Some(closed.then(|| (begun.elapsed(), status)))
}

/// Posts every body of `bodies` to `path` at once, each on its own connection: the status
/// of each answer (or why there was none), each bounded by `timeout`.
pub async fn post_all(
    addr: SocketAddr,
    transport: &Transport,
    path: &str,
    bodies: &[Bytes],
    timeout: Duration,
) -> Vec<Result<u16, String>> {
    let tasks: Vec<_> = bodies
        .iter()
        .map(|body| {
            let (transport, path, body) = (transport.clone(), path.to_string(), body.clone());
            tokio::spawn(async move {
                tokio::time::timeout(timeout, post(addr, &transport, &path, &body))
                    .await
                    .unwrap_or_else(|_| Err(format!("no answer within {timeout:?}")))
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap_or_else(|e| Err(e.to_string())));
    }
    out
}

/// One `POST` with `Connection: close`: the answer's status.
async fn post(
    addr: SocketAddr,
    transport: &Transport,
    path: &str,
    body: &[u8],
) -> Result<u16, String> {
    let mut s = transport.connect(addr).await.map_err(|e| e.to_string())?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    s.write_all(body).await.map_err(|e| e.to_string())?;
    s.flush().await.map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    // The status line is all that is needed; read until it is complete or the close.
    while !answer.windows(2).any(|w| w == b"\r\n") {
        match s.read(&mut chunk).await {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(e.to_string()),
        }
    }
    String::from_utf8_lossy(&answer)
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no status line: {:?}", String::from_utf8_lossy(&answer)))
}

/// The requests of [`slow_chunked`]: how many of each outcome, and how long the server let
/// the slowest one run.
#[derive(Debug, Default)]
pub struct SlowChunked {
    /// Requests begun (connected and head sent).
    pub sent: usize,
    /// Connections that could not be made (refused, closed at once, or not within the bound).
    pub not_connected: usize,
    /// Per answer status ("" for a close without an answer), how many.
    pub outcomes: std::collections::BTreeMap<String, usize>,
    /// From the head sent to the answer or close, each request's time.
    pub held: Vec<Duration>,
    /// Requests neither answered nor closed within their hold.
    pub still_open: usize,
}

/// What one slow chunked request trickles.
#[derive(Clone, Copy, Debug)]
pub struct Trickle {
    /// One-byte chunks sent, one every `gap`, then the last (empty) chunk.
    pub chunks: usize,
    pub gap: Duration,
    /// How long after its head a request waits for an answer at most.
    pub hold: Duration,
}

/// Sends `rate` requests a second for `duration`, from `source`, each a `POST path` whose
/// body is sent chunked (no `Content-Length`) as `trickle` says, on its own connection; how
/// the server treated them once every one ended (answered, closed, or past its hold).
pub async fn slow_chunked(
    addr: SocketAddr,
    transport: &Transport,
    source: IpAddr,
    path: &str,
    (rate, duration): (f64, Duration),
    trickle: Trickle,
) -> SlowChunked {
    let interval = Duration::from_secs_f64(1.0 / rate.max(0.001));
    let begun = Instant::now();
    let mut tasks = Vec::new();
    while begun.elapsed() < duration {
        let (transport, path) = (transport.clone(), path.to_string());
        tasks.push(tokio::spawn(async move {
            slow_chunked_one(addr, &transport, source, &path, trickle).await
        }));
        let due = begun + interval * u32::try_from(tasks.len()).unwrap_or(u32::MAX);
        tokio::time::sleep_until(due.into()).await;
    }
    let (ended, not_connected, still_open) = tally(tasks).await;
    let mut out = SlowChunked {
        sent: ended.len() + still_open,
        not_connected,
        still_open,
        ..SlowChunked::default()
    };
    for (held, status) in ended {
        out.held.push(held);
        *out.outcomes.entry(status).or_default() += 1;
    }
    out
}

/// One request of [`slow_chunked`]: `None` if it could not connect, else `Some(end)`: the time
/// to the answer or close and the answer's status code ("" for none), or `None` past the hold.
async fn slow_chunked_one(
    addr: SocketAddr,
    transport: &Transport,
    source: IpAddr,
    path: &str,
    trickle: Trickle,
) -> Ended {
    let s = transport.connect_from(addr, Some(source)).await.ok()?;
    let (mut rd, mut wr) = tokio::io::split(s);
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\n\r\n"
    );
    wr.write_all(head.as_bytes()).await.ok()?;
    wr.flush().await.ok()?;
    let begun = Instant::now();
    let send = async move {
        for _ in 0..trickle.chunks {
            tokio::time::sleep(trickle.gap).await;
            if wr.write_all(b"1\r\n{\r\n").await.is_err() || wr.flush().await.is_err() {
                break;
            }
        }
        let _ = wr.write_all(b"0\r\n\r\n").await;
        let _ = wr.flush().await;
        // Kept open until the answer: dropping a TLS write half sends no close.
        std::future::pending::<()>().await;
    };
    let answer = async {
        let mut answer = Vec::new();
        let mut chunk = [0u8; 1024];
        while !answer.windows(2).any(|w| w == b"\r\n") {
            match rd.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&chunk[..n]),
            }
        }
        String::from_utf8_lossy(&answer)
            .split_whitespace()
            .nth(1)
            .unwrap_or_default()
            .to_string()
    };
    let ended = tokio::time::timeout(trickle.hold, async {
        tokio::select! {
            status = answer => status,
            () = send => String::new(),
        }
    })
    .await;
    Some(ended.ok().map(|status| (begun.elapsed(), status)))
}

/// The opening of an AdmissionReview for a pod CREATE (`uid` empty when `uid` is `None`),
/// up to where its object's members go.
fn review_opening(uid: Option<&str>) -> String {
    let uid = uid.map(|u| format!(r#""uid":"{u}","#)).unwrap_or_default();
    format!(
        r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{{uid}"kind":{{"group":"","version":"v1","kind":"Pod"}},"resource":{{"group":"","version":"v1","resource":"pods"}},"name":"flood","namespace":"default","operation":"CREATE","userInfo":{{"username":"attacker"}},"object":{{"apiVersion":"v1","kind":"Pod","metadata":{{"name":"flood""#
    )
}

/// A review of `size` bytes (at most) whose object's `spec` holds an array of tiny JSON
/// objects (`{}`) and whose request has no `uid`: any decoder refuses it (400), a
/// tree-building one only after it built the whole object.
pub fn tiny_objects_review(size: usize) -> Bytes {
    let mut body = review_opening(None);
    body.push_str(r#"},"spec":{"x":["#);
    let close = "{}]}}}}";
    while body.len() + 3 + close.len() <= size {
        body.push_str("{},");
    }
    body.push_str(close);
    Bytes::from(body)
}

/// A valid review of `size` bytes (at most) of an unbound pod whose labels are the shortest
/// distinct entries (`"ab":"",`): it is allowed (unbound pods are decided at binding), after
/// its labels were decoded.
pub fn label_flood_review(uid: &str, size: usize) -> Bytes {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let mut body = review_opening(Some(uid));
    body.push_str(r#","labels":{"#);
    let close = r#""z":""}},"spec":{}},"dryRun":true}}"#;
    let mut i = 0usize;
    loop {
        let (mut key, mut k) = (String::new(), i);
        loop {
            key.push(DIGITS[k % DIGITS.len()] as char);
            k /= DIGITS.len();
            if k == 0 {
                break;
            }
        }
        let entry = format!(r#""{key}0":"","#);
        if body.len() + entry.len() + close.len() > size {
            break;
        }
        body.push_str(&entry);
        i += 1;
    }
    body.push_str(close);
    Bytes::from(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bodies_are_json_of_the_size_asked() {
        let size = 64 * 1024;
        let tiny = tiny_objects_review(size);
        assert!(tiny.len() <= size && tiny.len() > size - 8);
        let v: serde_json::Value = serde_json::from_slice(&tiny).unwrap();
        assert!(v["request"].get("uid").is_none());
        assert!(
            v["request"]["object"]["spec"]["x"]
                .as_array()
                .unwrap()
                .len()
                > 20_000
        );

        let labels = label_flood_review("u1", size);
        assert!(labels.len() <= size && labels.len() > size - 16);
        let v: serde_json::Value = serde_json::from_slice(&labels).unwrap();
        assert_eq!(v["request"]["uid"], "u1");
        let n = v["request"]["object"]["metadata"]["labels"]
            .as_object()
            .unwrap()
            .len();
        assert!(n > 6_000, "{n} labels");
    }
}
