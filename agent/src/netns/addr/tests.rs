//! The address dump decoder on hand-built kernel messages and on arbitrary bytes.

use std::net::Ipv6Addr;

use proptest::prelude::*;

use super::*;

/// `IFA_LABEL`.
const IFA_LABEL: u16 = 3;

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

/// The interface name (the label) is the pod's choice and need not be UTF-8: the address
/// is still read. A whole-message `AddressMessage` parse refuses it.
#[test]
fn a_label_that_is_not_utf8_does_not_hide_the_address() {
    let mut buf = newaddr(
        1,
        libc::AF_INET as u8,
        24,
        0,
        &[
            attr(IFA_LABEL, &[0xff, 0xfe, b'x', 0]),
            attr(IFA_LOCAL, &[10, 0, 0, 7]),
        ],
    );
    buf.extend(done(1));
    let b = decode_buffer(&buf, 1).expect("decodes");
    let ips: Vec<String> = b.addresses.iter().map(|a| a.ip.to_string()).collect();
    assert_eq!(ips, ["10.0.0.7"]);
    assert!(b.done);
}

/// The request is an `RTM_GETADDR` dump of every family under the given sequence number.
#[test]
fn request_header_layout() {
    let r = request(7);
    assert_eq!(r.len(), NLMSG_HDR + IFADDRMSG);
    assert_eq!(
        u32::from_ne_bytes(r[0..4].try_into().unwrap()),
        r.len() as u32
    );
    assert_eq!(
        u16::from_ne_bytes(r[4..6].try_into().unwrap()),
        libc::RTM_GETADDR
    );
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    assert_eq!(u16::from_ne_bytes(r[6..8].try_into().unwrap()), flags);
    assert_eq!(u32::from_ne_bytes(r[8..12].try_into().unwrap()), 7);
    assert_eq!(r[16], libc::AF_UNSPEC as u8);
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
