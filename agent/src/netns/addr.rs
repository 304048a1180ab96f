//! Interface addresses of one network namespace over rtnetlink (`RTM_GETADDR` dump).
//!
//! In: a `NETLINK_ROUTE` socket created inside the namespace (it stays bound to it after
//! the thread switches back). Out: every address with its prefix length, scope and interface.
//! [`decode_buffer`] is bounds-checked and never panics on arbitrary bytes.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// `RT_SCOPE_UNIVERSE`: a global address (pod IPs are).
pub const SCOPE_UNIVERSE: u8 = 0;
const RTM_NEWADDR: u16 = libc::RTM_NEWADDR;
const RTM_GETADDR: u16 = libc::RTM_GETADDR;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const NLMSG_HDR: usize = 16;
const IFADDRMSG: usize = 8;
const BUF_LEN: usize = 32 * 1024;
const MAX_ATTEMPTS: u32 = 5;

/// One interface address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Address {
    /// The address.
    pub ip: IpAddr,
    /// Prefix length.
    pub prefix_len: u8,
    /// RT_SCOPE_* (0 = global, 253 = link, 254 = host).
    pub scope: u8,
    /// Interface index.
    pub ifindex: u32,
}

impl Address {
    /// True for global-scope addresses: the kind a pod IP is.
    pub fn is_global(&self) -> bool {
        self.scope == SCOPE_UNIVERSE
    }
}

/// Failures dumping addresses.
#[derive(Debug, thiserror::Error)]
pub enum AddrError {
    /// Sending or receiving failed.
    #[error("rtnetlink {what} failed: {source}")]
    Io {
        /// `send` / `recv`.
        what: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// The kernel answered with an error.
    #[error("RTM_GETADDR refused: {0}")]
    Kernel(io::Error),
    /// The answer could not be decoded.
    #[error("cannot decode an RTM_GETADDR answer: {0}")]
    Decode(String),
    /// The address list kept changing during the dump.
    #[error("the address list changed during {0} consecutive dumps")]
    Interrupted(u32),
}

/// What one receive buffer carried.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// Addresses decoded from `RTM_NEWADDR` messages of the request's sequence.
    pub addresses: Vec<Address>,
    /// `NLMSG_DONE` seen.
    pub done: bool,
    /// Some message carried `NLM_F_DUMP_INTR`.
    pub interrupted: bool,
    /// `NLMSG_ERROR` with a non-zero errno (negative).
    pub error: Option<i32>,
}

#[repr(C, align(8))]
struct AlignedBuf([u8; BUF_LEN]);

/// Dumps every address of the socket's namespace, retrying an interrupted dump.
pub fn dump(sock: &crate::netlink::Socket) -> Result<Vec<Address>, AddrError> {
    let mut buf = Box::new(AlignedBuf([0; BUF_LEN]));
    for attempt in 1..=MAX_ATTEMPTS {
        let seq = attempt;
        sock.send(&request(seq)).map_err(|source| AddrError::Io {
            what: "send",
            source,
        })?;
        let mut all = Vec::new();
        let mut interrupted = false;
        loop {
            let n = sock.recv_raw(&mut buf.0).map_err(|source| AddrError::Io {
                what: "recv",
                source,
            })?;
            let batch = decode_buffer(&buf.0[..n.min(BUF_LEN)], seq)?;
            if let Some(errno) = batch.error {
                return Err(AddrError::Kernel(io::Error::from_raw_os_error(
                    errno.saturating_neg(),
                )));
            }
            all.extend(batch.addresses);
            interrupted |= batch.interrupted;
            if batch.done {
                break;
            }
        }
        if !interrupted {
            return Ok(all);
        }
    }
    Err(AddrError::Interrupted(MAX_ATTEMPTS))
}

/// nlmsghdr + ifaddrmsg (family AF_UNSPEC: both families).
fn request(seq: u32) -> [u8; NLMSG_HDR + IFADDRMSG] {
    let mut b = [0u8; NLMSG_HDR + IFADDRMSG];
    b[0..4].copy_from_slice(&((NLMSG_HDR + IFADDRMSG) as u32).to_ne_bytes());
    b[4..6].copy_from_slice(&RTM_GETADDR.to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    b[6..8].copy_from_slice(&flags.to_ne_bytes());
    b[8..12].copy_from_slice(&seq.to_ne_bytes());
    b
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Decodes one receive buffer of an `RTM_GETADDR` dump; messages of other sequence numbers
/// are ignored. Never panics.
pub fn decode_buffer(buf: &[u8], seq: u32) -> Result<Batch, AddrError> {
    let mut batch = Batch::default();
    for msg in crate::netfilter::split_messages(buf) {
        let msg = msg.map_err(AddrError::Decode)?;
        let kind = u16_at(msg, 4).unwrap_or(0);
        let flags = u16_at(msg, 6).unwrap_or(0);
        if u32_at(msg, 8) != Some(seq) {
            continue;
        }
        if flags & libc::NLM_F_DUMP_INTR as u16 != 0 {
            batch.interrupted = true;
        }
        match kind {
            k if k == libc::NLMSG_DONE as u16 => batch.done = true,
            k if k == libc::NLMSG_ERROR as u16 => {
                let errno = msg
                    .get(16..20)
                    .and_then(|b| b.try_into().ok())
                    .map(i32::from_ne_bytes)
                    .ok_or_else(|| AddrError::Decode("short NLMSG_ERROR".into()))?;
                if errno != 0 {
                    batch.error = Some(errno);
                }
                batch.done = true;
            }
            RTM_NEWADDR => {
                if let Some(a) = decode_addr(msg)? {
                    batch.addresses.push(a);
                }
            }
            _ => {}
        }
    }
    Ok(batch)
}

fn decode_addr(msg: &[u8]) -> Result<Option<Address>, AddrError> {
    let hdr = msg
        .get(NLMSG_HDR..NLMSG_HDR + IFADDRMSG)
        .ok_or_else(|| AddrError::Decode("RTM_NEWADDR shorter than ifaddrmsg".into()))?;
    let family = i32::from(hdr[0]);
    let prefix_len = hdr[1];
    let scope = hdr[3];
    let ifindex = u32_at(hdr, 4).unwrap_or(0);
    let mut local = None;
    let mut address = None;
    let mut at = NLMSG_HDR + IFADDRMSG;
    while at + 4 <= msg.len() {
        let alen = u16_at(msg, at).unwrap_or(0) as usize;
        let atype = u16_at(msg, at + 2).unwrap_or(0) & 0x3fff;
        if alen < 4 || at + alen > msg.len() {
            return Err(AddrError::Decode(format!(
                "attribute at {at} claims {alen} bytes"
            )));
        }
        let payload = &msg[at + 4..at + alen];
        let ip = match (family, payload.len()) {
            (libc::AF_INET, 4) => <[u8; 4]>::try_from(payload)
                .ok()
                .map(|b| IpAddr::V4(Ipv4Addr::from(b))),
            (libc::AF_INET6, 16) => <[u8; 16]>::try_from(payload)
                .ok()
                .map(|b| IpAddr::V6(Ipv6Addr::from(b))),
            _ => None,
        };
        match atype {
            IFA_LOCAL => local = ip.or(local),
            IFA_ADDRESS => address = ip.or(address),
            _ => {}
        }
        at += alen.next_multiple_of(4);
    }
    // IFA_LOCAL is the interface's own address; IFA_ADDRESS is the peer on point-to-point
    // links, so the local one wins when both are present.
    Ok(local.or(address).map(|ip| Address {
        ip,
        prefix_len,
        scope,
        ifindex,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn attr(ty: u16, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
        v.extend_from_slice(&ty.to_ne_bytes());
        v.extend_from_slice(payload);
        while v.len() % 4 != 0 {
            v.push(0);
        }
        v
    }

    fn newaddr(seq: u32, family: u8, prefix: u8, scope: u8, attrs: &[Vec<u8>]) -> Vec<u8> {
        let mut body = vec![family, prefix, 0, scope];
        body.extend_from_slice(&3u32.to_ne_bytes());
        for a in attrs {
            body.extend_from_slice(a);
        }
        let mut m = Vec::new();
        m.extend_from_slice(&((NLMSG_HDR + body.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&RTM_NEWADDR.to_ne_bytes());
        m.extend_from_slice(&(libc::NLM_F_MULTI as u16).to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&body);
        m
    }

    fn done(seq: u32) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&20u32.to_ne_bytes());
        m.extend_from_slice(&(libc::NLMSG_DONE as u16).to_ne_bytes());
        m.extend_from_slice(&0u16.to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&[0; 8]);
        m
    }

    #[test]
    fn decodes_v4_local_and_v6_address() {
        let mut buf = newaddr(
            1,
            libc::AF_INET as u8,
            24,
            0,
            &[
                attr(IFA_ADDRESS, &[10, 0, 0, 9]),
                attr(IFA_LOCAL, &[10, 0, 0, 1]),
            ],
        );
        let v6: [u8; 16] = "fd00::1".parse::<Ipv6Addr>().expect("ip").octets();
        buf.extend(newaddr(
            1,
            libc::AF_INET6 as u8,
            64,
            0,
            &[attr(IFA_ADDRESS, &v6)],
        ));
        buf.extend(newaddr(
            2,
            libc::AF_INET as u8,
            8,
            254,
            &[attr(IFA_LOCAL, &[127, 0, 0, 1])],
        ));
        buf.extend(done(1));
        let b = decode_buffer(&buf, 1).expect("decodes");
        assert!(b.done && !b.interrupted);
        let ips: Vec<String> = b.addresses.iter().map(|a| a.ip.to_string()).collect();
        assert_eq!(ips, ["10.0.0.1", "fd00::1"]);
        assert!(b.addresses.iter().all(Address::is_global));
        assert_eq!(b.addresses[0].prefix_len, 24);
    }

    #[test]
    fn interrupted_and_errors_are_reported() {
        let mut m = newaddr(
            4,
            libc::AF_INET as u8,
            24,
            0,
            &[attr(IFA_LOCAL, &[1, 2, 3, 4])],
        );
        let f = (libc::NLM_F_MULTI | libc::NLM_F_DUMP_INTR) as u16;
        m[6..8].copy_from_slice(&f.to_ne_bytes());
        assert!(decode_buffer(&m, 4).expect("ok").interrupted);
        let mut e = done(4);
        e[4..6].copy_from_slice(&(libc::NLMSG_ERROR as u16).to_ne_bytes());
        e[16..20].copy_from_slice(&(-libc::EPERM).to_ne_bytes());
        assert_eq!(decode_buffer(&e, 4).expect("ok").error, Some(-libc::EPERM));
        // Length beyond the buffer.
        let mut bad = done(4);
        bad[0..4].copy_from_slice(&999u32.to_ne_bytes());
        assert!(decode_buffer(&bad, 4).is_err());
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..600), seq in 0u32..3) {
            let _ = decode_buffer(&bytes, seq);
        }

        #[test]
        fn decode_framed_random_attrs_never_panics(
            attrs in prop::collection::vec(any::<u8>(), 0..200),
            fam in prop_oneof![Just(libc::AF_INET as u8), Just(libc::AF_INET6 as u8), any::<u8>()],
        ) {
            let mut m = newaddr(1, fam, 24, 0, &[]);
            m.extend_from_slice(&attrs);
            let len = m.len() as u32;
            m[0..4].copy_from_slice(&len.to_ne_bytes());
            let _ = decode_buffer(&m, 1);
        }
    }
}
