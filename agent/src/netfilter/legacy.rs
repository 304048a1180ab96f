//! iptables-legacy reader: `ip_tables` / `ip6_tables` tables through
//! `getsockopt(IPT_SO_GET_INFO / IPT_SO_GET_ENTRIES)` (and the `IP6T_SO_*` twins).
//!
//! In: a datagram socket opened inside the pod's namespace, and the table names listed in that
//! namespace's `/proc/thread-self/net/ip_tables_names` (`ip6_tables_names`). Out: one
//! [`Table`] per listed table, with its built-in chains as base chains and its user chains.
//!
//! The pitfall this module is shaped around: `IPT_SO_GET_INFO` for a table that does not
//! exist yet makes the kernel *instantiate* it in that namespace. So the names file is read
//! first, inside the namespace, and only the tables it lists are ever queried.
//!
//! [`decode_table`] is pure and bounds-checked: arbitrary bytes give an error, never a panic.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use meshgate_core::rules::{
    Action, BaseChain, Chain, ChainType, Family, Hook, Protocol, Rule, Source, Table,
};

use super::{ReadError, redirect_port, tproxy_port, xt_target_action};

/// `IPT_SO_GET_INFO` / `IP6T_SO_GET_INFO`.
const SO_GET_INFO: libc::c_int = 64;
/// `IPT_SO_GET_ENTRIES` / `IP6T_SO_GET_ENTRIES`.
const SO_GET_ENTRIES: libc::c_int = 65;
/// `XT_TABLE_MAXNAMELEN`.
const TABLE_MAXNAMELEN: usize = 32;
/// `sizeof(struct ipt_getinfo)` (same for ip6t).
const GETINFO_LEN: usize = 84;
/// `offsetof(struct ipt_get_entries, entrytable)` (same for ip6t).
const GET_ENTRIES_HDR: usize = 40;
/// `sizeof(struct xt_entry_match)` / `xt_entry_target` header.
const XT_HDR: usize = 32;
/// `XT_RETURN` as a standard verdict.
const XT_RETURN: i32 = -5;
/// Attempts when the table changes between the info and entries reads (EAGAIN).
const MAX_ATTEMPTS: u32 = 5;

const HOOK_NAMES: [&str; 5] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];
const HOOKS: [Hook; 5] = [
    Hook::Prerouting,
    Hook::Input,
    Hook::Forward,
    Hook::Output,
    Hook::Postrouting,
];

/// The fixed layout of `struct ipt_entry` / `struct ip6t_entry`.
struct Layout {
    entry_len: usize,
    target_offset: usize,
    next_offset: usize,
    proto: usize,
    flags: usize,
    invflags: usize,
    /// Source and destination masks.
    masks: std::ops::Range<usize>,
    iniface: usize,
    outiface: usize,
    goto_flag: u8,
    /// Flags that restrict the match (IPv4 fragments, IPv6 TOS).
    cond_flags: u8,
    /// IPv6 only: the protocol field is meaningful only with IP6T_F_PROTO.
    proto_flag: Option<u8>,
}

const IPV4: Layout = Layout {
    entry_len: 112,
    target_offset: 88,
    next_offset: 90,
    proto: 80,
    flags: 82,
    invflags: 83,
    masks: 8..16,
    iniface: 16,
    outiface: 32,
    goto_flag: 0x02,
    cond_flags: 0x01,
    proto_flag: None,
};

const IPV6: Layout = Layout {
    entry_len: 168,
    target_offset: 140,
    next_offset: 142,
    proto: 128,
    flags: 131,
    invflags: 132,
    masks: 32..64,
    iniface: 64,
    outiface: 80,
    goto_flag: 0x04,
    cond_flags: 0x02,
    proto_flag: Some(0x01),
};

/// `XT_INV_PROTO`.
const INV_PROTO: u8 = 0x40;

/// Table geometry from `IPT_SO_GET_INFO`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableInfo {
    /// Bit per hook with a built-in chain.
    pub valid_hooks: u32,
    /// Offset of each built-in chain's first entry.
    pub hook_entry: [u32; 5],
    /// Offset of each built-in chain's policy entry.
    pub underflow: [u32; 5],
    /// Size of the entries blob.
    pub size: u32,
}

/// One family's legacy tables in one namespace.
#[derive(Debug)]
pub struct LegacyTables {
    family: Family,
    sock: OwnedFd,
    names: Vec<String>,
}

fn names_path(family: Family) -> &'static str {
    match family {
        Family::Ip6 => "/proc/thread-self/net/ip6_tables_names",
        _ => "/proc/thread-self/net/ip_tables_names",
    }
}

impl LegacyTables {
    /// Reads the family's table names in the calling thread's *current* namespace and, if
    /// there are any, opens the socket the queries go through. `None` when the family has
    /// no legacy table (or the kernel has no `ip_tables` support at all).
    pub fn open_here(family: Family) -> Result<Option<Self>, ReadError> {
        let path = names_path(family);
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(ReadError::TableNames { path, source }),
        };
        let names: Vec<String> = text
            .lines()
            .map(str::trim)
            .filter(|n| !n.is_empty() && n.len() < TABLE_MAXNAMELEN)
            .map(str::to_owned)
            .collect();
        if names.is_empty() {
            return Ok(None);
        }
        let domain = match family {
            Family::Ip6 => libc::AF_INET6,
            _ => libc::AF_INET,
        };
        // A UDP socket, not the raw one iptables itself opens: the kernel hands IPT_SO_GET_*
        // to netfilter for any inet socket (ip_getsockopt / ipv6_getsockopt → nf_getsockopt),
        // and those check CAP_NET_ADMIN only, while a raw socket also needs CAP_NET_RAW, which
        // would let a host-network agent forge and sniff the node's packets.
        // SAFETY: plain socket(2); the fd is owned right away.
        let fd = unsafe {
            libc::socket(
                domain,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                libc::IPPROTO_UDP,
            )
        };
        if fd < 0 {
            return Err(ReadError::Socket {
                what: "datagram (iptables-legacy)",
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: fd is a fresh, valid descriptor nobody else owns.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Some(Self {
            family,
            sock,
            names,
        }))
    }

    /// The family.
    pub fn family(&self) -> Family {
        self.family
    }

    /// The listed tables.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Reads and decodes every listed table. `budget` is how many bytes of entry blobs may
    /// still be read for this namespace; a table that would pass it is not read at all
    /// ([`ReadError::TooLarge`]), so the allocation stays bounded.
    pub fn read(&self, budget: &mut usize) -> Result<Vec<Table>, ReadError> {
        self.names
            .iter()
            .map(|n| self.read_table(n, budget))
            .collect()
    }

    fn level(&self) -> libc::c_int {
        match self.family {
            Family::Ip6 => libc::IPPROTO_IPV6,
            _ => libc::IPPROTO_IP,
        }
    }

    fn getsockopt(&self, opt: libc::c_int, buf: &mut [u8]) -> io::Result<usize> {
        let mut len = buf.len() as libc::socklen_t;
        // SAFETY: buf is valid for len bytes; the kernel writes at most len bytes.
        let rc = unsafe {
            libc::getsockopt(
                self.sock.as_raw_fd(),
                self.level(),
                opt,
                buf.as_mut_ptr().cast(),
                &mut len,
            )
        };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(len as usize)
        }
    }

    fn read_table(&self, name: &str, budget: &mut usize) -> Result<Table, ReadError> {
        let err = |source| ReadError::Legacy {
            family: self.family,
            table: name.to_owned(),
            source,
        };
        for _ in 0..MAX_ATTEMPTS {
            let mut info_buf = [0u8; GETINFO_LEN];
            info_buf[..name.len()].copy_from_slice(name.as_bytes());
            self.getsockopt(SO_GET_INFO, &mut info_buf).map_err(err)?;
            let info = decode_info(&info_buf).ok_or_else(|| ReadError::Decode {
                what: "ipt_getinfo",
                why: "short answer".into(),
            })?;
            let size = info.size as usize;
            if size > *budget {
                return Err(ReadError::TooLarge {
                    what: format!(
                        "legacy table {} {name} holds {size} bytes of entries, past the budget",
                        self.family
                    ),
                });
            }
            let mut buf = vec![0u8; GET_ENTRIES_HDR + size];
            buf[..name.len()].copy_from_slice(name.as_bytes());
            buf[TABLE_MAXNAMELEN..TABLE_MAXNAMELEN + 4].copy_from_slice(&info.size.to_ne_bytes());
            match self.getsockopt(SO_GET_ENTRIES, &mut buf) {
                Ok(_) => {}
                // The table changed size between the two calls: read it again.
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => continue,
                Err(e) => return Err(err(e)),
            }
            *budget -= size;
            let blob = buf.get(GET_ENTRIES_HDR..).unwrap_or_default();
            return decode_table(self.family, name, &info, blob);
        }
        Err(ReadError::LegacyChanging {
            family: self.family,
            table: name.to_owned(),
        })
    }
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Decodes `struct ipt_getinfo` (after the kernel filled it).
pub fn decode_info(b: &[u8]) -> Option<TableInfo> {
    let mut info = TableInfo {
        valid_hooks: u32_at(b, 32)?,
        size: u32_at(b, 80)?,
        ..TableInfo::default()
    };
    for h in 0..5 {
        info.hook_entry[h] = u32_at(b, 36 + 4 * h)?;
        info.underflow[h] = u32_at(b, 56 + 4 * h)?;
    }
    Some(info)
}

/// A NUL-terminated name inside a fixed-size field.
fn c_name(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// One entry of the blob, decoded.
struct Entry<'a> {
    offset: usize,
    next: usize,
    rule: RuleFacts,
    target: String,
    data: &'a [u8],
    goto: bool,
}

struct RuleFacts {
    protocol: Protocol,
    conditional: bool,
}

/// True when a match restricts the packets a rule applies to. Comments never do, and
/// neither does a `tcp`/`udp` match without ports, flags or options.
fn match_is_condition(name: &str, data: &[u8]) -> bool {
    match name {
        "comment" => false,
        "tcp" | "udp" => {
            // struct xt_tcp: spts[2], dpts[2] (u16), option, flg_mask, flg_cmp, invflags.
            // struct xt_udp: spts[2], dpts[2], invflags.
            let full = |at| u16_at(data, at) == Some(0) && u16_at(data, at + 2) == Some(0xffff);
            let rest = if name == "tcp" { 8..12 } else { 8..9 };
            !(full(0) && full(4) && data.get(rest).is_some_and(|r| r.iter().all(|&b| b == 0)))
        }
        _ => true,
    }
}

fn decode_entries<'a>(l: &Layout, blob: &'a [u8]) -> Result<Vec<Entry<'a>>, ReadError> {
    let bad = |why: String| ReadError::Decode {
        what: "iptables entries",
        why,
    };
    let mut out = Vec::new();
    let mut off = 0usize;
    while off < blob.len() {
        let e = blob
            .get(off..off + l.entry_len)
            .ok_or_else(|| bad(format!("entry at {off} is truncated")))?;
        let target_offset = u16_at(e, l.target_offset).unwrap_or(0) as usize;
        let next_offset = u16_at(e, l.next_offset).unwrap_or(0) as usize;
        if target_offset < l.entry_len
            || target_offset + XT_HDR > next_offset
            || off + next_offset > blob.len()
        {
            return Err(bad(format!(
                "entry at {off}: target_offset {target_offset}, next_offset {next_offset}"
            )));
        }
        let mut conditional = e
            .get(l.masks.clone())
            .is_some_and(|m| m.iter().any(|&b| b != 0))
            || e.get(l.iniface).is_some_and(|&b| b != 0)
            || e.get(l.outiface).is_some_and(|&b| b != 0);
        let flags = e.get(l.flags).copied().unwrap_or(0);
        let invflags = e.get(l.invflags).copied().unwrap_or(0);
        if flags & l.cond_flags != 0 {
            conditional = true;
        }
        let proto = u16_at(e, l.proto).unwrap_or(0);
        let proto_given = proto != 0 && l.proto_flag.is_none_or(|f| flags & f != 0);
        let protocol = if !proto_given {
            Protocol::Any
        } else if invflags & INV_PROTO != 0 {
            // `! -p X`: excludes TCP when X is TCP, else a condition that TCP passes.
            if proto == 6 {
                Protocol::Other
            } else {
                conditional = true;
                Protocol::Any
            }
        } else if proto == 6 {
            Protocol::Tcp
        } else {
            Protocol::Other
        };
        // Matches between the entry header and the target.
        let mut m = off + l.entry_len;
        let t = off + target_offset;
        while m < t {
            let size = u16_at(blob, m).unwrap_or(0) as usize;
            if size < XT_HDR || m + size > t {
                return Err(bad(format!("match at {m} has size {size}")));
            }
            let name = c_name(blob.get(m + 2..m + 31).unwrap_or_default());
            let data = blob.get(m + XT_HDR..m + size).unwrap_or_default();
            if match_is_condition(&name, data) {
                conditional = true;
            }
            m += size;
        }
        let tsize = u16_at(blob, t).unwrap_or(0) as usize;
        if tsize < XT_HDR || t + tsize > off + next_offset {
            return Err(bad(format!("target at {t} has size {tsize}")));
        }
        out.push(Entry {
            offset: off,
            next: off + next_offset,
            rule: RuleFacts {
                protocol,
                conditional,
            },
            target: c_name(blob.get(t + 2..t + 31).unwrap_or_default()),
            data: blob.get(t + XT_HDR..t + tsize).unwrap_or_default(),
            goto: flags & l.goto_flag != 0,
        });
        off += next_offset;
    }
    Ok(out)
}

/// The hook priority the kernel registers a legacy table's built-in chains at
/// (`NF_IP_PRI_*`, the same for IPv6): raw -300, mangle -150, nat -100 on PREROUTING and
/// OUTPUT (destination NAT) and 100 on INPUT and POSTROUTING (source NAT), filter 0,
/// security 50. The matcher orders base chains of every table and backend by it.
fn table_priority(table: &str, hook: Hook) -> i32 {
    match table {
        "raw" => -300,
        "mangle" => -150,
        "nat" => match hook {
            Hook::Prerouting | Hook::Output => -100,
            _ => 100,
        },
        "security" => 50,
        _ => 0,
    }
}

/// Decodes a table's entries blob (`ipt_get_entries.entrytable`) into a [`Table`].
pub fn decode_table(
    family: Family,
    name: &str,
    info: &TableInfo,
    blob: &[u8],
) -> Result<Table, ReadError> {
    let layout = match family {
        Family::Ip6 => &IPV6,
        _ => &IPV4,
    };
    let entries = decode_entries(layout, blob)?;
    let is_nat = name == "nat";

    // Chain starts: built-in chains at their hook entries, user chains right after their
    // ERROR head entry (whose data is the chain name).
    let mut starts: BTreeMap<usize, usize> = BTreeMap::new();
    let mut chains: Vec<Chain> = Vec::new();
    for h in 0..5 {
        if info.valid_hooks & (1 << h) == 0 {
            continue;
        }
        let at = info.hook_entry[h] as usize;
        if starts.contains_key(&at) {
            continue;
        }
        starts.insert(at, chains.len());
        chains.push(Chain {
            name: HOOK_NAMES[h].to_owned(),
            base: Some(BaseChain {
                hook: HOOKS[h],
                chain_type: if is_nat {
                    ChainType::Nat
                } else {
                    ChainType::Filter
                },
                priority: table_priority(name, HOOKS[h]),
            }),
            rules: Vec::new(),
        });
    }
    let mut heads = std::collections::BTreeSet::new();
    for e in &entries {
        if e.target == "ERROR" {
            heads.insert(e.offset);
            let chain = c_name(e.data);
            if chain != "ERROR" && !chain.is_empty() && !starts.contains_key(&e.next) {
                starts.insert(e.next, chains.len());
                chains.push(Chain::regular(&chain, Vec::new()));
            }
        }
    }
    let names_at: BTreeMap<usize, String> = starts
        .iter()
        .filter_map(|(&at, &i)| chains.get(i).map(|c| (at, c.name.clone())))
        .collect();

    for e in &entries {
        if heads.contains(&e.offset) {
            continue;
        }
        let Some((_, &ci)) = starts.range(..=e.offset).next_back() else {
            continue;
        };
        let action = match e.target.as_str() {
            // The standard target: a verdict or an offset to jump to.
            "" => {
                let v = e
                    .data
                    .get(0..4)
                    .and_then(|b| b.try_into().ok())
                    .map(i32::from_ne_bytes)
                    .unwrap_or(0);
                if v == XT_RETURN {
                    Action::Return
                } else if v < 0 {
                    match v.wrapping_neg().wrapping_sub(1) {
                        libc::NF_DROP => Action::Drop,
                        // NF_ACCEPT, NF_QUEUE, ...: evaluation of the hook ends.
                        _ => Action::Accept,
                    }
                } else if v as usize == e.next {
                    Action::Continue
                } else {
                    match names_at.get(&(v as usize)) {
                        Some(target) if e.goto => Action::Goto(target.clone()),
                        Some(target) => Action::Jump(target.clone()),
                        None => Action::Continue,
                    }
                }
            }
            "REDIRECT" => Action::Redirect {
                port: redirect_port(family, e.data),
            },
            "TPROXY" => Action::Tproxy {
                port: tproxy_port(e.data),
                only: None,
            },
            other => xt_target_action(other),
        };
        if let Some(chain) = chains.get_mut(ci) {
            chain.rules.push(Rule {
                protocol: e.rule.protocol,
                conditional: e.rule.conditional,
                action,
            });
        }
    }
    Ok(Table {
        family: if family == Family::Ip6 {
            Family::Ip6
        } else {
            Family::Ip
        },
        name: name.to_owned(),
        source: Source::IptablesLegacy,
        chains,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Builds entries blobs the way the kernel lays them out.
    struct Blob {
        l: &'static Layout,
        bytes: Vec<u8>,
    }

    enum Target<'a> {
        Standard(i32),
        Error(&'a str),
        Redirect(u16),
    }

    impl Blob {
        fn new(l: &'static Layout) -> Self {
            Self {
                l,
                bytes: Vec::new(),
            }
        }

        fn offset(&self) -> usize {
            self.bytes.len()
        }

        fn push(&mut self, proto: u16, flags: u8, matches: &[&str], target: Target<'_>) -> usize {
            let at = self.bytes.len();
            let mut e = vec![0u8; self.l.entry_len];
            e[self.l.proto..self.l.proto + 2].copy_from_slice(&proto.to_ne_bytes());
            e[self.l.flags] = flags;
            for m in matches {
                let mut mb = vec![0u8; XT_HDR + 8];
                mb[0..2].copy_from_slice(&((XT_HDR + 8) as u16).to_ne_bytes());
                mb[2..2 + m.len()].copy_from_slice(m.as_bytes());
                e.extend_from_slice(&mb);
            }
            let target_offset = e.len();
            let (name, data): (&str, Vec<u8>) = match target {
                Target::Standard(v) => ("", {
                    let mut d = v.to_ne_bytes().to_vec();
                    d.extend_from_slice(&[0; 4]);
                    d
                }),
                Target::Error(n) => ("ERROR", {
                    let mut d = vec![0u8; 32];
                    d[..n.len()].copy_from_slice(n.as_bytes());
                    d
                }),
                Target::Redirect(p) => ("REDIRECT", {
                    if self.l.entry_len == 112 {
                        let mut d = vec![0u8; 24];
                        d[0..4].copy_from_slice(&1u32.to_ne_bytes());
                        d[4..8].copy_from_slice(&2u32.to_ne_bytes());
                        d[16..18].copy_from_slice(&p.to_be_bytes());
                        d
                    } else {
                        let mut d = vec![0u8; 40];
                        d[0..4].copy_from_slice(&2u32.to_ne_bytes());
                        d[36..38].copy_from_slice(&p.to_be_bytes());
                        d
                    }
                }),
            };
            let mut t = vec![0u8; XT_HDR];
            t[0..2].copy_from_slice(&((XT_HDR + data.len()) as u16).to_ne_bytes());
            t[2..2 + name.len()].copy_from_slice(name.as_bytes());
            e.extend_from_slice(&t);
            e.extend_from_slice(&data);
            let next = e.len();
            e[self.l.target_offset..self.l.target_offset + 2]
                .copy_from_slice(&(target_offset as u16).to_ne_bytes());
            e[self.l.next_offset..self.l.next_offset + 2]
                .copy_from_slice(&(next as u16).to_ne_bytes());
            self.bytes.extend_from_slice(&e);
            at
        }

        /// Patches the standard verdict of the entry at `at` (for forward jumps).
        fn set_verdict(&mut self, at: usize, v: i32) {
            let t = at + u16_at(&self.bytes, at + self.l.target_offset).unwrap_or(0) as usize;
            self.bytes[t + XT_HDR..t + XT_HDR + 4].copy_from_slice(&v.to_ne_bytes());
        }
    }

    const ACCEPT: i32 = -libc::NF_ACCEPT - 1;

    /// linkerd's legacy nat table: PREROUTING -j PROXY_INIT_REDIRECT, OUTPUT -g
    /// PROXY_INIT_OUTPUT, user chains with conditional returns and REDIRECTs.
    fn linkerd(l: &'static Layout) -> (TableInfo, Vec<u8>) {
        let mut b = Blob::new(l);
        let mut info = TableInfo {
            valid_hooks: 0b11011,
            ..TableInfo::default()
        };
        info.hook_entry[0] = b.offset() as u32;
        let jump_in = b.push(0, 0, &["comment"], Target::Standard(0));
        info.underflow[0] = b.push(0, 0, &[], Target::Standard(ACCEPT)) as u32;
        info.hook_entry[1] = b.offset() as u32;
        info.underflow[1] = b.push(0, 0, &[], Target::Standard(ACCEPT)) as u32;
        info.hook_entry[3] = b.offset() as u32;
        let goto_out = b.push(0, l.goto_flag, &[], Target::Standard(0));
        info.underflow[3] = b.push(0, 0, &[], Target::Standard(ACCEPT)) as u32;
        info.hook_entry[4] = b.offset() as u32;
        info.underflow[4] = b.push(0, 0, &[], Target::Standard(ACCEPT)) as u32;
        b.push(0, 0, &[], Target::Error("PROXY_INIT_OUTPUT"));
        let out_start = b.offset();
        b.push(0, 0, &["owner"], Target::Standard(XT_RETURN));
        b.push(6, proto_flag(l), &[], Target::Redirect(4140));
        b.push(0, 0, &[], Target::Standard(XT_RETURN));
        b.push(0, 0, &[], Target::Error("PROXY_INIT_REDIRECT"));
        let in_start = b.offset();
        b.push(
            6,
            proto_flag(l),
            &["multiport"],
            Target::Standard(XT_RETURN),
        );
        b.push(6, proto_flag(l), &[], Target::Redirect(4143));
        b.push(0, 0, &[], Target::Standard(XT_RETURN));
        b.push(0, 0, &[], Target::Error("ERROR"));
        b.set_verdict(jump_in, in_start as i32);
        b.set_verdict(goto_out, out_start as i32);
        info.size = b.bytes.len() as u32;
        (info, b.bytes)
    }

    fn proto_flag(l: &Layout) -> u8 {
        l.proto_flag.unwrap_or(0)
    }

    #[test]
    fn decodes_linkerd_layout_for_both_families() {
        for (fam, l) in [(Family::Ip, &IPV4), (Family::Ip6, &IPV6)] {
            let (info, blob) = linkerd(l);
            let t = decode_table(fam, "nat", &info, &blob).expect("decodes");
            assert_eq!(t.family, fam);
            assert_eq!(t.source, Source::IptablesLegacy);
            let names: Vec<_> = t.chains.iter().map(|c| c.name.as_str()).collect();
            assert_eq!(
                names,
                [
                    "PREROUTING",
                    "INPUT",
                    "OUTPUT",
                    "POSTROUTING",
                    "PROXY_INIT_OUTPUT",
                    "PROXY_INIT_REDIRECT"
                ]
            );
            let pre = t.chain("PREROUTING").expect("chain");
            assert_eq!(
                pre.base.map(|b| (b.hook, b.chain_type)),
                Some((Hook::Prerouting, ChainType::Nat))
            );
            assert_eq!(
                pre.rules[0],
                Rule::all(Action::Jump("PROXY_INIT_REDIRECT".into()))
            );
            assert_eq!(pre.rules[1], Rule::all(Action::Accept));
            let out = t.chain("OUTPUT").expect("chain");
            assert_eq!(
                out.rules[0].action,
                Action::Goto("PROXY_INIT_OUTPUT".into())
            );
            let redir = t.chain("PROXY_INIT_REDIRECT").expect("chain");
            assert_eq!(redir.rules[0], Rule::tcp(Action::Return).when());
            assert_eq!(
                redir.rules[1],
                Rule::tcp(Action::Redirect { port: Some(4143) })
            );
            let outc = t.chain("PROXY_INIT_OUTPUT").expect("chain");
            assert_eq!(
                outc.rules[1],
                Rule::tcp(Action::Redirect { port: Some(4140) })
            );

            let profile = meshgate_core::profile::ProfileSet::all_builtin();
            let linkerd = profile.get("linkerd").expect("profile");
            let ip = if fam == Family::Ip {
                meshgate_core::rules::IpFamily::V4
            } else {
                meshgate_core::rules::IpFamily::V6
            };
            let rs = meshgate_core::rules::Ruleset { tables: vec![t] };
            let got = meshgate_core::rules::check(&rs, linkerd, &[ip]);
            assert_eq!(
                got.verdict,
                meshgate_core::rules::RedirectVerdict::Redirected,
                "{}",
                got.message
            );
            assert_eq!(
                got.outbound.via.as_deref(),
                Some(format!("{fam} nat OUTPUT -> PROXY_INIT_OUTPUT (iptables-legacy)").as_str())
            );
        }
    }

    #[test]
    fn built_in_chains_get_their_tables_hook_priority() {
        assert_eq!(table_priority("mangle", Hook::Prerouting), -150);
        assert_eq!(table_priority("raw", Hook::Prerouting), -300);
        assert_eq!(table_priority("nat", Hook::Output), -100);
        assert_eq!(table_priority("nat", Hook::Postrouting), 100);
        assert_eq!(table_priority("filter", Hook::Input), 0);
        assert_eq!(table_priority("security", Hook::Output), 50);
    }

    /// A mangle table whose PREROUTING TPROXYs every TCP packet to 15006 (rev 1 info).
    #[test]
    fn decodes_tproxy_in_mangle() {
        let mut b = Blob::new(&IPV4);
        let mut info = TableInfo {
            valid_hooks: 0b00001,
            ..TableInfo::default()
        };
        info.hook_entry[0] = 0;
        let at = b.push(6, 0, &[], Target::Standard(0));
        info.underflow[0] = b.push(0, 0, &[], Target::Standard(ACCEPT)) as u32;
        b.push(0, 0, &[], Target::Error("ERROR"));
        // Turn the first entry's standard target into `-j TPROXY --on-port 15006`.
        let t = at + u16_at(&b.bytes, at + IPV4.target_offset).unwrap_or(0) as usize;
        b.bytes[t + 2..t + 8].copy_from_slice(b"TPROXY");
        let data = t + XT_HDR;
        b.bytes[data..data + 8].fill(0);
        let mut tproxy = vec![0u8; 32];
        tproxy[24..26].copy_from_slice(&15006u16.to_be_bytes());
        // Rebuild the entry with a 32-byte target payload.
        let mut blob = b.bytes[..t + XT_HDR].to_vec();
        blob[t..t + 2].copy_from_slice(&((XT_HDR + 32) as u16).to_ne_bytes());
        blob.extend_from_slice(&tproxy);
        let next = blob.len() - at;
        blob[at + IPV4.next_offset..at + IPV4.next_offset + 2]
            .copy_from_slice(&(next as u16).to_ne_bytes());
        let rest_from = at + u16_at(&b.bytes, at + IPV4.next_offset).unwrap_or(0) as usize;
        let shift = blob.len() - rest_from;
        blob.extend_from_slice(&b.bytes[rest_from..]);
        info.underflow[0] += shift as u32;
        info.size = blob.len() as u32;
        let table = decode_table(Family::Ip, "mangle", &info, &blob).expect("decodes");
        let pre = table.chain("PREROUTING").expect("chain");
        assert_eq!(
            pre.base.map(|b| (b.chain_type, b.priority)),
            Some((ChainType::Filter, -150))
        );
        assert_eq!(
            pre.rules[0],
            Rule::tcp(Action::Tproxy {
                port: Some(15006),
                only: None
            })
        );
    }

    #[test]
    fn plain_tcp_match_is_not_a_condition() {
        let mut d = vec![0u8; 12];
        d[2..4].copy_from_slice(&0xffffu16.to_ne_bytes());
        d[6..8].copy_from_slice(&0xffffu16.to_ne_bytes());
        assert!(!match_is_condition("tcp", &d));
        d[4..6].copy_from_slice(&80u16.to_ne_bytes());
        assert!(match_is_condition("tcp", &d));
        assert!(match_is_condition("owner", &[]));
        assert!(!match_is_condition("comment", &[]));
        assert!(match_is_condition("tcp", &[]));
    }

    #[test]
    fn truncated_and_inconsistent_blobs_are_errors() {
        let (info, blob) = linkerd(&IPV4);
        for cut in [1, 50, 111, 113, blob.len() - 1] {
            assert!(
                decode_table(Family::Ip, "nat", &info, &blob[..cut]).is_err(),
                "cut {cut}"
            );
        }
        let mut bad = blob.clone();
        bad[IPV4.next_offset..IPV4.next_offset + 2].copy_from_slice(&0u16.to_ne_bytes());
        assert!(decode_table(Family::Ip, "nat", &info, &bad).is_err());
        assert!(decode_info(&[0u8; 10]).is_none());
    }

    proptest! {
        #[test]
        fn decode_table_never_panics(
            bytes in prop::collection::vec(any::<u8>(), 0..2048),
            hooks in any::<u32>(),
            entry in prop::array::uniform5(0u32..2048),
            v6 in any::<bool>(),
        ) {
            let info = TableInfo { valid_hooks: hooks, hook_entry: entry, underflow: entry, size: bytes.len() as u32 };
            let fam = if v6 { Family::Ip6 } else { Family::Ip };
            let _ = decode_table(fam, "nat", &info, &bytes);
        }

        /// Valid blobs with single bytes flipped: still no panic.
        #[test]
        fn mutated_blobs_never_panic(at in any::<prop::sample::Index>(), byte in any::<u8>(), v6 in any::<bool>()) {
            let (fam, l) = if v6 { (Family::Ip6, &IPV6) } else { (Family::Ip, &IPV4) };
            let (info, mut blob) = linkerd(l);
            let i = at.index(blob.len());
            blob[i] = byte;
            let _ = decode_table(fam, "nat", &info, &blob);
        }

        #[test]
        fn decode_info_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..100)) {
            let _ = decode_info(&bytes);
        }
    }
}
