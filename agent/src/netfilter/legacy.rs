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

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use meshgate_core::rules::{
    Action, BaseChain, Chain, ChainType, Family, Hook, Protocol, Rule, Source, Table,
};

use super::{ReadError, c_name, redirect_port, tproxy_port, u16_at, u32_at, xt_target_action};

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

/// Splits an entries blob into its entries, checking every offset against the blob.
fn decode_entries<'a>(l: &Layout, blob: &'a [u8]) -> Result<Vec<Entry<'a>>, ReadError> {
    let mut out = Vec::new();
    let mut off = 0usize;
    while off < blob.len() {
        let e = blob
            .get(off..off + l.entry_len)
            .ok_or_else(|| bad_entries(format!("entry at {off} is truncated")))?;
        let target_offset = u16_at(e, l.target_offset).unwrap_or(0) as usize;
        let next_offset = u16_at(e, l.next_offset).unwrap_or(0) as usize;
        if target_offset < l.entry_len
            || target_offset + XT_HDR > next_offset
            || off + next_offset > blob.len()
        {
            return Err(bad_entries(format!(
                "entry at {off}: target_offset {target_offset}, next_offset {next_offset}"
            )));
        }
        let mut rule = header_facts(l, e);
        let t = off + target_offset;
        // Matches between the entry header and the target.
        rule.conditional |= matches_condition(blob, off + l.entry_len, t)?;
        let tsize = u16_at(blob, t).unwrap_or(0) as usize;
        if tsize < XT_HDR || t + tsize > off + next_offset {
            return Err(bad_entries(format!("target at {t} has size {tsize}")));
        }
        out.push(Entry {
            offset: off,
            next: off + next_offset,
            rule,
            target: c_name(blob.get(t + 2..t + 31).unwrap_or_default()),
            data: blob.get(t + XT_HDR..t + tsize).unwrap_or_default(),
            goto: e.get(l.flags).copied().unwrap_or(0) & l.goto_flag != 0,
        });
        off += next_offset;
    }
    Ok(out)
}

fn bad_entries(why: String) -> ReadError {
    ReadError::Decode {
        what: "iptables entries",
        why,
    }
}

/// What an entry's fixed header says: its protocol, and whether addresses, interfaces or
/// flags make it conditional.
fn header_facts(l: &Layout, e: &[u8]) -> RuleFacts {
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
    RuleFacts {
        protocol,
        conditional,
    }
}

/// Whether any match in `blob[from..to]` (an entry's matches) restricts its packets.
fn matches_condition(blob: &[u8], from: usize, to: usize) -> Result<bool, ReadError> {
    let mut conditional = false;
    let mut m = from;
    while m < to {
        let size = u16_at(blob, m).unwrap_or(0) as usize;
        if size < XT_HDR || m + size > to {
            return Err(bad_entries(format!("match at {m} has size {size}")));
        }
        let name = c_name(blob.get(m + 2..m + 31).unwrap_or_default());
        let data = blob.get(m + XT_HDR..m + size).unwrap_or_default();
        conditional |= match_is_condition(&name, data);
        m += size;
    }
    Ok(conditional)
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
    let mut chains = Chains::built_in(name, info);
    let heads = chains.add_user_chains(&entries);
    let names_at: BTreeMap<usize, String> = chains
        .starts
        .iter()
        .filter_map(|(&at, &i)| chains.list.get(i).map(|c| (at, c.name.clone())))
        .collect();
    for e in entries.iter().filter(|e| !heads.contains(&e.offset)) {
        let Some((_, &ci)) = chains.starts.range(..=e.offset).next_back() else {
            continue;
        };
        let action = entry_action(family, e, &names_at);
        if let Some(chain) = chains.list.get_mut(ci) {
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
        chains: chains.list,
    })
}

/// A table's chains, and the blob offset each one starts at.
struct Chains {
    /// Offset → index into `list`.
    starts: BTreeMap<usize, usize>,
    list: Vec<Chain>,
}

impl Chains {
    /// The built-in chains, at their hook entries.
    fn built_in(table: &str, info: &TableInfo) -> Self {
        let mut c = Chains {
            starts: BTreeMap::new(),
            list: Vec::new(),
        };
        let chain_type = if table == "nat" {
            ChainType::Nat
        } else {
            ChainType::Filter
        };
        for h in 0..5 {
            if info.valid_hooks & (1 << h) == 0 {
                continue;
            }
            let at = info.hook_entry[h] as usize;
            if c.starts.contains_key(&at) {
                continue;
            }
            c.starts.insert(at, c.list.len());
            c.list.push(Chain {
                name: HOOK_NAMES[h].to_owned(),
                base: Some(BaseChain {
                    hook: HOOKS[h],
                    chain_type,
                    priority: table_priority(table, HOOKS[h]),
                }),
                rules: Vec::new(),
            });
        }
        c
    }

    /// User chains start right after their ERROR head entry (whose data is the chain name).
    /// Returns the offsets of the head entries, which are not rules.
    fn add_user_chains(&mut self, entries: &[Entry]) -> BTreeSet<usize> {
        let mut heads = BTreeSet::new();
        for e in entries.iter().filter(|e| e.target == "ERROR") {
            heads.insert(e.offset);
            let chain = c_name(e.data);
            if chain != "ERROR" && !chain.is_empty() && !self.starts.contains_key(&e.next) {
                self.starts.insert(e.next, self.list.len());
                self.list.push(Chain::regular(&chain, Vec::new()));
            }
        }
        heads
    }
}

/// What an entry's target does.
fn entry_action(family: Family, e: &Entry, names_at: &BTreeMap<usize, String>) -> Action {
    match e.target.as_str() {
        "" => standard_action(e, names_at),
        "REDIRECT" => Action::Redirect {
            port: redirect_port(family, e.data),
        },
        "TPROXY" => Action::Tproxy {
            port: tproxy_port(e.data),
            only: None,
        },
        other => xt_target_action(other),
    }
}

/// The standard target: a verdict, or an offset to jump (or go) to.
fn standard_action(e: &Entry, names_at: &BTreeMap<usize, String>) -> Action {
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

#[cfg(test)]
mod tests;
