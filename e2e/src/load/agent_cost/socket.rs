//! Bytes the agents received from the apiserver, from the agents' side: the kernel's TCP
//! counters (`ss -tinp`, `bytes_received`) of their connections to its port, TLS and HTTP
//! framing included. The apiserver's own response-size histogram leaves watch events out
//! and does not tell clients apart, so the sockets are read instead.
//!
//! In: the apiserver's port and the agents' pids. Out: per connection, the bytes received so
//! far; the difference between two readings.

use std::collections::{BTreeMap, HashSet};

use anyhow::Context;

/// One established connection's counter: local address → (pid, bytes received).
pub type Counters = BTreeMap<String, (u32, u64)>;

/// Reads the counters of the established TCP connections to `port` owned by `pids`.
pub async fn read(port: u16, pids: &HashSet<u32>) -> anyhow::Result<Counters> {
    let filter = format!("( dport = :{port} )");
    let out = crate::harness::wait::command_output(
        "ss",
        std::time::Duration::from_secs(30),
        tokio::process::Command::new("ss").args(["-tinpH", "state", "established", &filter]),
    )
    .await
    .context("running ss")?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(parse(&text)
        .into_iter()
        .filter(|(_, (pid, _))| pids.contains(pid))
        .collect())
}

/// Bytes received between two readings: a connection opened in between counts in full.
pub fn received_between(before: &Counters, after: &Counters) -> u64 {
    after
        .iter()
        .map(|(local, (_, bytes))| {
            let was = before.get(local).map_or(0, |(_, b)| *b);
            bytes.saturating_sub(was)
        })
        .sum()
}

/// Parses `ss -tinpH` output: a socket line (`state` omitted when filtered by one: recv-q,
/// send-q, local, peer, `users:((...,pid=N,...))`), then an indented line of TCP info.
pub fn parse(text: &str) -> Counters {
    let mut out = Counters::new();
    let mut current: Option<(String, u32)> = None;
    for line in text.lines() {
        if line.starts_with(char::is_whitespace) {
            let Some((local, pid)) = current.take() else {
                continue;
            };
            let bytes = line
                .split_whitespace()
                .find_map(|f| f.strip_prefix("bytes_received:")?.parse().ok())
                .unwrap_or(0);
            out.insert(local, (pid, bytes));
        } else {
            current = socket_line(line);
        }
    }
    out
}

fn socket_line(line: &str) -> Option<(String, u32)> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let local = fields.get(2)?.to_string();
    let users = fields.iter().find(|f| f.starts_with("users:"))?;
    let pid = users.split("pid=").nth(1)?;
    let pid = pid
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    Some((local, pid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_per_connection_and_their_difference() {
        let before = "0      0      127.0.0.1:40001 127.0.0.1:6443 users:((\"meshgate-agent\",pid=11,fd=9))\n\t bbr wscale:10,10 bytes_sent:10 bytes_received:1000 segs_out:2\n";
        let after = "0      0      127.0.0.1:40001 127.0.0.1:6443 users:((\"meshgate-agent\",pid=11,fd=9))\n\t bbr bytes_received:1500 segs_out:3\n0 0 127.0.0.1:40002 127.0.0.1:6443 users:((\"meshgate-agent\",pid=12,fd=7),(\"x\",pid=12,fd=8))\n\t bbr bytes_acked:1 bytes_received:200\n";
        let (b, a) = (parse(before), parse(after));
        assert_eq!(b["127.0.0.1:40001"], (11, 1000));
        assert_eq!(a["127.0.0.1:40002"], (12, 200));
        assert_eq!(received_between(&b, &a), 700);
    }
}
