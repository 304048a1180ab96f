//! Network namespace discovery and entry.
//!
//! In: `/proc` (every process's `ns/net`, and its `cgroup` for the pod UID) and the netns
//! directories (default [`DEFAULT_NETNS_DIR`]). Out: [`NetnsRef`]s deduplicated by inode with
//! the host's namespace left out, their addresses, and [`Opened`] handles from which the
//! netfilter readers get the namespace's rules and sock_diag its listening TCP ports.
//!
//! Identity: a path names a namespace only for as long as what backs it lives. A
//! `/proc/<pid>/ns/net` path follows the pid, and a pid can be reused by a process in
//! another pod's namespace; a netns dir entry can be deleted and re-created for a new
//! sandbox. So every visit after the survey goes through [`NetnsRef::pin`], which opens the
//! path once and checks that the descriptor is the surveyed namespace (nsfs device and
//! inode); the descriptor is then used to enter, never the path again. While a [`Pinned`]
//! descriptor is open the kernel keeps that namespace, so its inode number cannot be handed
//! to a new one, and [`Pinned::confirm`] can tell, right before an eviction, whether the
//! path still leads to it and it still holds the pod's IPs.
//!
//! Entering a namespace is per thread (`setns`), so [`with_netns`] enters, runs a short
//! synchronous closure that only creates sockets and reads `/proc/thread-self/net/*`, and
//! switches back through a saved descriptor of `/proc/thread-self/ns/net` before returning,
//! even if the closure panics. The sockets stay bound to the pod's namespace afterwards, so
//! every query runs from the agent's own namespace. Never call this across an `.await`: the
//! daemon runs it on a blocking thread.
//!
//! [`read_netns`] and [`check_pod`] read one namespace by path in one visit (the one-shot
//! `inspect` subcommand, the privileged tests and the bench).

pub mod addr;
mod read;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io;
use std::net::IpAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use meshgate_core::rules::Ruleset;
use meshgate_core::rules::locate::{NetnsFacts, pod_uid_from_cgroup};
use nix::sched::{CloneFlags, setns};

use crate::netfilter::{self, ReadError};
pub use addr::Address;
pub use read::{LISTEN_TIMEOUT, NetnsContents, check_pod, inspect_pod, read_netns};

/// Where `ip netns` and the container runtimes bind-mount named namespaces.
pub const DEFAULT_NETNS_DIR: &str = "/var/run/netns";

/// How many processes per namespace are remembered (for the pod UID cross-check): a pod's
/// pause and app containers are a handful; a bound keeps memory flat on busy nodes.
const MAX_PIDS_PER_NETNS: usize = 16;

/// Failures around one namespace.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// The namespace file could not be opened (gone, or no permission: CAP_SYS_PTRACE).
    #[error("cannot open network namespace {path}: {source}")]
    Open {
        /// The namespace path.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// `/proc/thread-self/ns/net` could not be opened, so entering would be a one-way trip.
    #[error("cannot save the current network namespace: {0}")]
    SaveHome(io::Error),
    /// `setns` into the namespace failed (CAP_SYS_ADMIN, or not a network namespace).
    #[error("cannot enter network namespace {path}: {source}")]
    Enter {
        /// The namespace path.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The rtnetlink socket could not be created inside the namespace.
    #[error("cannot open an rtnetlink socket in {path}: {source}")]
    RouteSocket {
        /// The namespace path.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// Listing addresses failed.
    #[error("cannot list addresses in {path}: {source}")]
    Addresses {
        /// The namespace path.
        path: PathBuf,
        /// What failed.
        source: addr::AddrError,
    },
    /// Opening the sock_diag socket or reading the namespace's sockets failed.
    #[error("cannot read the sockets of {path}: {source}")]
    SockDiag {
        /// The namespace path.
        path: PathBuf,
        /// What failed.
        source: crate::sock_diag::DiagError,
    },
    /// Reading rules failed.
    #[error("cannot read netfilter rules in {path}: {source}")]
    Rules {
        /// The namespace path.
        path: PathBuf,
        /// What failed.
        source: ReadError,
    },
    /// The path now leads to another namespace than the one surveyed (a recycled pid, a
    /// netns entry re-created for a new sandbox).
    #[error(
        "network namespace {path} is no longer the one surveyed (device {dev} inode {inode}, now device {now_dev} inode {now_inode})"
    )]
    Replaced {
        /// The namespace path.
        path: PathBuf,
        /// nsfs device seen by the survey.
        dev: u64,
        /// nsfs inode seen by the survey.
        inode: u64,
        /// Device the path leads to now.
        now_dev: u64,
        /// Inode the path leads to now.
        now_inode: u64,
    },
    /// The namespace no longer holds one of the pod's IPs.
    #[error("network namespace {path} no longer holds pod IP {ip}")]
    PodIpGone {
        /// The namespace path.
        path: PathBuf,
        /// The pod IP not found among its addresses.
        ip: IpAddr,
    },
    /// A netns directory or `/proc` could not be listed.
    #[error("cannot list {path}: {source}")]
    Scan {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
}

/// Switches the thread back to its saved namespace when dropped, also during a panic.
struct Return {
    home: File,
}

impl Drop for Return {
    fn drop(&mut self) {
        if let Err(e) = setns(&self.home, CloneFlags::CLONE_NEWNET) {
            // A thread stuck in a pod's namespace would carry every later task of the
            // pool into it (and the agent's own sockets with it). There is no safe way
            // to continue.
            tracing::error!(error = %e, "cannot return to the agent's network namespace; aborting");
            std::process::abort();
        }
    }
}

/// Runs `f` with the calling thread inside the namespace `target`, and returns to the
/// original namespace before returning. `f` must be short and synchronous.
pub fn with_netns<T>(target: &Path, f: impl FnOnce() -> T) -> Result<T, NetnsError> {
    with_netns_file(&open_ns(target)?, target, f)
}

/// Opens a namespace path (a netns dir entry or `/proc/<pid>/ns/net`).
fn open_ns(path: &Path) -> Result<File, NetnsError> {
    File::open(path).map_err(|source| NetnsError::Open {
        path: path.to_owned(),
        source,
    })
}

/// [`with_netns`] through an already open namespace descriptor (`path` only for errors).
fn with_netns_file<T>(ns: &File, path: &Path, f: impl FnOnce() -> T) -> Result<T, NetnsError> {
    let home = File::open("/proc/thread-self/ns/net").map_err(NetnsError::SaveHome)?;
    setns(ns, CloneFlags::CLONE_NEWNET).map_err(|e| NetnsError::Enter {
        path: path.to_owned(),
        source: io::Error::from(e),
    })?;
    let _back = Return { home };
    Ok(f())
}

/// Sockets bound to one namespace, opened in a single visit.
#[derive(Debug)]
pub struct Opened {
    path: PathBuf,
    route: crate::netlink::Socket,
    rules: Option<netfilter::Sockets>,
    /// sock_diag, opened with the rules: a node proxy's listeners in the pod.
    diag: Option<crate::netlink::Socket>,
}

/// Enters `path` once and opens the rtnetlink socket, plus the netfilter handles and a
/// sock_diag socket when `with_rules` (which also reads the legacy table name lists inside
/// the namespace).
pub fn open(path: &Path, with_rules: bool) -> Result<Opened, NetnsError> {
    open_file(&open_ns(path)?, path, with_rules)
}

/// [`open`] through an already open namespace descriptor.
fn open_file(ns: &File, path: &Path, with_rules: bool) -> Result<Opened, NetnsError> {
    open_sockets(ns, path, with_rules, with_rules)
}

/// Opens the rtnetlink socket, the netfilter handles with `with_rules` and the sock_diag
/// socket with `with_diag`, in one visit through `ns`.
fn open_sockets(
    ns: &File,
    path: &Path,
    with_rules: bool,
    with_diag: bool,
) -> Result<Opened, NetnsError> {
    let (route, rules, diag) = with_netns_file(ns, path, || {
        let route = crate::netlink::Socket::open(crate::netlink::Bus::Route);
        let rules = with_rules.then(netfilter::Sockets::open_here);
        let diag = with_diag.then(crate::sock_diag::open);
        (route, rules, diag)
    })?;
    let route = route.map_err(|source| NetnsError::RouteSocket {
        path: path.to_owned(),
        source,
    })?;
    let rules = rules.transpose().map_err(|source| NetnsError::Rules {
        path: path.to_owned(),
        source,
    })?;
    let diag = diag.transpose().map_err(|source| NetnsError::SockDiag {
        path: path.to_owned(),
        source,
    })?;
    Ok(Opened {
        path: path.to_owned(),
        route,
        rules,
        diag,
    })
}

impl Opened {
    /// The namespace's addresses.
    pub fn addresses(&self) -> Result<Vec<Address>, NetnsError> {
        addr::dump(&self.route).map_err(|source| NetnsError::Addresses {
            path: self.path.clone(),
            source,
        })
    }

    /// The namespace's NAT-relevant rules (empty when opened without rules).
    pub fn ruleset(&self) -> Result<Ruleset, NetnsError> {
        match &self.rules {
            Some(s) => s.read().map_err(|source| NetnsError::Rules {
                path: self.path.clone(),
                source,
            }),
            None => Ok(Ruleset::default()),
        }
    }

    /// The namespace's listening TCP ports, IPv4 and IPv6 (none when opened without the
    /// sock_diag socket: without rules, or by [`Pinned::open_rules`] without listeners).
    pub fn tcp_listening(&self, deadline: std::time::Instant) -> Result<BTreeSet<u16>, NetnsError> {
        let Some(diag) = &self.diag else {
            return Ok(BTreeSet::new());
        };
        crate::sock_diag::inet::tcp_listening(diag, deadline).map_err(|source| {
            NetnsError::SockDiag {
                path: self.path.clone(),
                source,
            }
        })
    }

    /// The netfilter handles, when opened with rules.
    pub fn rule_sockets(&self) -> Option<&netfilter::Sockets> {
        self.rules.as_ref()
    }
}

/// One distinct network namespace on the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetnsRef {
    /// nsfs device: with the inode, the namespace's identity.
    pub dev: u64,
    /// nsfs inode: the namespace's identity.
    pub inode: u64,
    /// A path that opens it (a netns dir entry when there is one, else `/proc/<pid>/ns/net`).
    pub path: PathBuf,
    /// Some processes inside it (at most a handful).
    pub pids: Vec<u32>,
}

fn stat_ns(path: &Path) -> io::Result<(u64, u64)> {
    let m = std::fs::metadata(path)?;
    Ok((m.dev(), m.ino()))
}

/// The first of `ips` that is not among `addresses`, if any. A pod's namespace holds every
/// one of its IPs; one missing means the sandbox is not (or no longer) the pod's.
pub fn missing_ip(addresses: &[Address], ips: &[IpAddr]) -> Option<IpAddr> {
    ips.iter()
        .copied()
        .find(|ip| !addresses.iter().any(|a| a.ip == *ip))
}

/// `Ok` when `path` still leads to the surveyed namespace: nsfs (device, inode) `now` equal
/// to `surveyed`; else [`NetnsError::Replaced`].
fn same_namespace(path: &Path, surveyed: (u64, u64), now: (u64, u64)) -> Result<(), NetnsError> {
    if now == surveyed {
        return Ok(());
    }
    Err(NetnsError::Replaced {
        path: path.to_owned(),
        dev: surveyed.0,
        inode: surveyed.1,
        now_dev: now.0,
        now_inode: now.1,
    })
}

impl NetnsRef {
    /// Opens the namespace and checks that the descriptor is the one surveyed (device and
    /// inode): a path that now leads elsewhere is [`NetnsError::Replaced`].
    pub fn pin(&self) -> Result<Pinned, NetnsError> {
        let file = open_ns(&self.path)?;
        let m = file.metadata().map_err(|source| NetnsError::Open {
            path: self.path.clone(),
            source,
        })?;
        same_namespace(&self.path, (self.dev, self.inode), (m.dev(), m.ino()))?;
        Ok(Pinned {
            path: self.path.clone(),
            dev: self.dev,
            inode: self.inode,
            file,
        })
    }
}

/// A surveyed namespace held open: entered through its descriptor only, and kept alive (so
/// its inode number is not reused) for as long as this lives.
#[derive(Debug)]
pub struct Pinned {
    path: PathBuf,
    dev: u64,
    inode: u64,
    file: File,
}

impl Pinned {
    /// The path it was surveyed under.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// nsfs (device, inode).
    pub fn id(&self) -> (u64, u64) {
        (self.dev, self.inode)
    }

    /// Enters it through the held descriptor and opens a sock_diag socket there.
    pub fn sock_diag(
        &self,
    ) -> Result<Result<crate::netlink::Socket, crate::sock_diag::DiagError>, NetnsError> {
        with_netns_file(&self.file, &self.path, crate::sock_diag::open)
    }

    /// Enters it through the held descriptor and opens its sockets: see [`open`].
    pub fn open(&self, with_rules: bool) -> Result<Opened, NetnsError> {
        open_file(&self.file, &self.path, with_rules)
    }

    /// Enters it through the held descriptor and opens the rtnetlink socket and the
    /// netfilter handles, and the sock_diag socket only with `listeners`: a pod whose
    /// listening ports nobody judges costs no socket more than its rules need.
    pub fn open_rules(&self, listeners: bool) -> Result<Opened, NetnsError> {
        open_sockets(&self.file, &self.path, true, listeners)
    }

    /// Checks, right before acting on the pod, that the path still leads to this namespace
    /// (the sandbox that was inspected is still the one there) and that it still holds
    /// every one of `ips`. Blocking.
    pub fn confirm(&self, ips: &[IpAddr]) -> Result<(), NetnsError> {
        let (dev, ino) = stat_ns(&self.path).map_err(|source| NetnsError::Open {
            path: self.path.clone(),
            source,
        })?;
        same_namespace(&self.path, (self.dev, self.inode), (dev, ino))?;
        let addresses = self.open(false)?.addresses()?;
        match missing_ip(&addresses, ips) {
            Some(ip) => Err(NetnsError::PodIpGone {
                path: self.path.clone(),
                ip,
            }),
            None => Ok(()),
        }
    }
}

/// Finds every network namespace on the node except the host's (the agent's own and pid
/// 1's): one per inode, from `/proc/*/ns/net` and from the entries of `netns_dirs` that are
/// namespace bind mounts. Processes that exit during the scan are skipped.
pub fn discover(netns_dirs: &[PathBuf]) -> Result<Vec<NetnsRef>, NetnsError> {
    let scan_err = |path: &str| {
        let path = PathBuf::from(path);
        move |source| NetnsError::Scan { path, source }
    };
    let (nsfs_dev, own) =
        stat_ns(Path::new("/proc/self/ns/net")).map_err(scan_err("/proc/self/ns/net"))?;
    let mut host = BTreeSet::from([own]);
    if let Ok((_, init)) = stat_ns(Path::new("/proc/1/ns/net")) {
        host.insert(init);
    }
    let mut found: BTreeMap<u64, NetnsRef> = BTreeMap::new();

    for dir in netns_dirs {
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            // No named namespaces on this node (or no such runtime): nothing to add.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => {
                return Err(NetnsError::Scan {
                    path: dir.clone(),
                    source,
                });
            }
        };
        for entry in entries.flatten() {
            let path = entry.path();
            // An entry that is not a live bind mount is a plain file on the dir's own
            // filesystem: its device is not nsfs.
            let Ok((dev, ino)) = stat_ns(&path) else {
                continue;
            };
            if dev != nsfs_dev || host.contains(&ino) {
                continue;
            }
            found.entry(ino).or_insert_with(|| NetnsRef {
                dev,
                inode: ino,
                path,
                pids: Vec::new(),
            });
        }
    }

    let procs = std::fs::read_dir("/proc").map_err(scan_err("/proc"))?;
    for entry in procs.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let path = PathBuf::from(format!("/proc/{pid}/ns/net"));
        let Ok((dev, ino)) = stat_ns(&path) else {
            continue;
        };
        if dev != nsfs_dev || host.contains(&ino) {
            continue;
        }
        let r = found.entry(ino).or_insert_with(|| NetnsRef {
            dev,
            inode: ino,
            path,
            pids: Vec::new(),
        });
        if r.pids.len() < MAX_PIDS_PER_NETNS {
            r.pids.push(pid);
        }
    }
    Ok(found.into_values().collect())
}

/// Pod UIDs of the given processes, from their cgroup paths.
pub fn pod_uids(pids: &[u32]) -> BTreeSet<String> {
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok())
        .filter_map(|text| pod_uid_from_cgroup(&text))
        .collect()
}

/// Every non-host namespace with its addresses and pod UIDs: the input of
/// [`meshgate_core::rules::locate::locate`]. Namespaces that vanish while being read are
/// skipped (their pods are gone); other failures are returned in the second list so the
/// caller can log them.
pub fn survey(
    netns_dirs: &[PathBuf],
) -> Result<(Vec<NetnsFacts<NetnsRef>>, Vec<NetnsError>), NetnsError> {
    let mut facts = Vec::new();
    let mut errors = Vec::new();
    for r in discover(netns_dirs)? {
        // Pinned: the addresses are those of the namespace discovered, even if the pid
        // behind its path was reused meanwhile (that is a `Replaced`, skipped below).
        let addresses = match r.pin().and_then(|p| p.open(false)?.addresses()) {
            Ok(a) => a,
            Err(NetnsError::Open { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                continue;
            }
            // The process behind the path exited and its pid went to another namespace:
            // that one is (or will be) found under its own pid or entry.
            Err(NetnsError::Replaced { .. }) => continue,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        facts.push(NetnsFacts {
            addresses: addresses
                .iter()
                .filter(|a| a.is_global())
                .map(|a| a.ip)
                .collect(),
            pod_uids: pod_uids(&r.pids),
            key: r,
        });
    }
    Ok((facts, errors))
}
