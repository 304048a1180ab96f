//! The node proxy's edge (Istio ambient's ztunnel): a thin watch of its pods on this node,
//! and a bounded look at its socket on the host and at the connection on it.
//!
//! In: the [`NodeProxy`] record (the named profile's, with the `--node-proxy-*` flags over
//! it), this node's name and the pod client. Out: the proxy's pods bound to this node, on a
//! `watch` channel whose changes wake the verdict loop; what is at the socket path and
//! whether an established connection is on it ([`look`]: one `lstat`, then unix sock_diag
//! dumps in the Ready proxy pods' network namespaces, where the kernel puts both ends of the
//! proxy's connection, and in the agent's own; never a connection of our own), polled
//! every [`CONNECTION_POLL`] on a
//! second `watch` channel that changes only when the outcome does (a connection coming or
//! going is no file event). `meshgate_core::node_proxy::judge` decides from all three.

use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};
use meshgate_core::node_proxy::{ConnectionSeen, NodeProxy, ProxyPod, SocketSeen};

use crate::sock_diag::unix::Bound;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::Instrument;

/// Pods of the proxy kept at most (a DaemonSet has one per node; a rollout two).
const MAX_PODS: usize = 64;

/// How long one look at the socket and its connection may take (a hung host filesystem or
/// a socket table that does not answer is unreadable, never waited on).
const SOCKET_TIMEOUT: Duration = Duration::from_secs(2);

/// How often the connection on the socket is looked at between file events: the bound on
/// how long a node stays verified after the proxy disconnected (and untainted late after
/// it connected). One dump of the host's established unix sockets per poll.
pub const CONNECTION_POLL: Duration = Duration::from_secs(3);

/// What [`look`] saw: the socket file and the connection on it.
pub type Seen = (SocketSeen, ConnectionSeen);

/// The running watch.
pub struct NodeProxyWatch {
    /// The record the verdict is judged against.
    pub proxy: NodeProxy,
    /// The proxy's pods on this node; `None` until first listed.
    pub pods: watch::Receiver<Option<Vec<ProxyPod>>>,
    /// The socket and its connection as last polled; changes only when they do.
    pub socket: watch::Receiver<Option<Seen>>,
    task: JoinHandle<()>,
    poll: JoinHandle<()>,
}

impl NodeProxyWatch {
    /// Starts watching `proxy`'s pods on `node` (fieldSelector `spec.nodeName`, its labels,
    /// its namespace).
    pub fn start(client: kube::Client, node: &str, proxy: NodeProxy) -> Self {
        let api: Api<Pod> = Api::namespaced(client, &proxy.namespace);
        let config = watcher::Config::default()
            .fields(&format!("spec.nodeName={node}"))
            .labels(&proxy.label_selector());
        let (tx, pods) = watch::channel(None);
        let task = tokio::spawn(run(api, config, tx).in_current_span());
        let (socket_tx, socket) = watch::channel(None);
        let poll =
            tokio::spawn(poll(proxy.socket.clone(), pods.clone(), socket_tx).in_current_span());
        Self {
            proxy,
            pods,
            socket,
            task,
            poll,
        }
    }

    /// Waits up to `timeout` for the first list, so an agent restarted on a node whose
    /// ztunnel is ready does not gate it for the moment its watch takes to list.
    pub async fn wait_listed(&mut self, timeout: Duration) {
        let listed = self.pods.wait_for(Option::is_some);
        if tokio::time::timeout(timeout, listed).await.is_err() {
            tracing::warn!(namespace = %self.proxy.namespace, "node proxy pods not listed in time; the first verdict says so");
        }
    }

    /// Stops the watch.
    pub fn stop(&self) {
        self.task.abort();
        self.poll.abort();
    }

    /// Where the socket's directory is, for the inotify watch.
    pub fn socket_dir(&self) -> Option<PathBuf> {
        PathBuf::from(&self.proxy.socket)
            .parent()
            .map(PathBuf::from)
    }
}

/// Feeds `tx` with the pods as listed and watched, reconnecting with backoff.
async fn run(api: Api<Pod>, config: watcher::Config, tx: watch::Sender<Option<Vec<ProxyPod>>>) {
    let mut stream = std::pin::pin!(watcher(api, config).default_backoff());
    let mut pods: BTreeMap<String, ProxyPod> = BTreeMap::new();
    let mut listing: Option<BTreeMap<String, ProxyPod>> = None;
    while let Some(event) = stream.next().await {
        match event {
            Ok(watcher::Event::Init) => listing = Some(BTreeMap::new()),
            Ok(watcher::Event::InitApply(p)) => {
                if let Some(l) = listing.as_mut() {
                    keep(l, proxy_pod(&p));
                }
            }
            Ok(watcher::Event::InitDone) => {
                pods = listing.take().unwrap_or_default();
                publish(&tx, &pods);
            }
            Ok(watcher::Event::Apply(p)) => {
                keep(&mut pods, proxy_pod(&p));
                publish(&tx, &pods);
            }
            Ok(watcher::Event::Delete(p)) => {
                pods.remove(&p.metadata.name.unwrap_or_default());
                publish(&tx, &pods);
            }
            Err(e) => {
                tracing::debug!(error = %e, "node proxy pod watch error; retrying")
            }
        }
    }
}

/// Keeps `p`, within [`MAX_PODS`].
fn keep(pods: &mut BTreeMap<String, ProxyPod>, p: ProxyPod) {
    if pods.len() < MAX_PODS || pods.contains_key(&p.name) {
        pods.insert(p.name.clone(), p);
    }
}

/// Sends the pods when they differ from what was sent.
fn publish(tx: &watch::Sender<Option<Vec<ProxyPod>>>, pods: &BTreeMap<String, ProxyPod>) {
    let now: Vec<ProxyPod> = pods.values().cloned().collect();
    tx.send_if_modified(|cur| {
        let changed = cur.as_ref() != Some(&now);
        if changed {
            *cur = Some(now);
        }
        changed
    });
}

/// What the verdict reads of a pod: its name, its `Ready` condition, its deletion.
fn proxy_pod(p: &Pod) -> ProxyPod {
    let ready = p
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    ProxyPod {
        name: p.metadata.name.clone().unwrap_or_default(),
        uid: p.metadata.uid.clone().unwrap_or_default(),
        ready,
        deleting: p.metadata.deletion_timestamp.is_some(),
    }
}

/// The UIDs of the proxy's pods that are Ready and not being deleted: the pods whose
/// network namespace holds the proxy's end of its connection.
pub fn ready_uids(pods: Option<&[ProxyPod]>) -> Vec<String> {
    pods.unwrap_or_default()
        .iter()
        .filter(|p| p.ready && !p.deleting && !p.uid.is_empty())
        .map(|p| p.uid.clone())
        .collect()
}

/// Looks every [`CONNECTION_POLL`] and publishes what it saw when it differs.
async fn poll(
    path: String,
    pods: watch::Receiver<Option<Vec<ProxyPod>>>,
    tx: watch::Sender<Option<Seen>>,
) {
    let mut tick = tokio::time::interval(CONNECTION_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let uids = ready_uids(pods.borrow().as_deref());
        let now = look(&path, uids).await;
        tx.send_if_modified(|cur| {
            let changed = cur.as_ref() != Some(&now);
            if changed {
                *cur = Some(now);
            }
            changed
        });
    }
}

/// What is at `path` (not following a symlink: ztunnel connects to the path itself, and a
/// socket is never reached through one there) and, when it is a socket, whether a
/// connection is established on it (in the agent's own network namespace or in that of one
/// of the pods `uids`), within `SOCKET_TIMEOUT` for both.
pub async fn look(path: &str, uids: Vec<String>) -> Seen {
    let path = PathBuf::from(path);
    let deadline = Instant::now() + SOCKET_TIMEOUT;
    let look = tokio::task::spawn_blocking(move || look_blocking(&path, &uids, deadline));
    match tokio::time::timeout(SOCKET_TIMEOUT, look).await {
        Ok(Ok(seen)) => seen,
        Err(_) => {
            let why = format!("no answer within {SOCKET_TIMEOUT:?}");
            (
                SocketSeen::Unreadable(why.clone()),
                ConnectionSeen::Unreadable(why),
            )
        }
        Ok(Err(e)) => (
            SocketSeen::Unreadable(e.to_string()),
            ConnectionSeen::Unreadable(e.to_string()),
        ),
    }
}

/// [`look`]'s blocking half: one `lstat`, then, for a socket, the sock_diag dumps.
pub(crate) fn look_blocking(path: &Path, uids: &[String], deadline: Instant) -> Seen {
    let m = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) => {
            let seen = if e.kind() == std::io::ErrorKind::NotFound {
                SocketSeen::Missing
            } else {
                SocketSeen::Unreadable(e.to_string())
            };
            return (seen, ConnectionSeen::NotConnected);
        }
    };
    let seen = kind(m.file_type());
    if seen != SocketSeen::Socket {
        return (seen, ConnectionSeen::NotConnected);
    }
    let bound = Bound { path, ino: m.ino() };
    (seen, connection(&bound, uids, deadline))
}

/// Whether an established connection carries `bound`'s address: the kernel creates the
/// listener's accepted end in the network namespace of the socket that connected, so it is
/// looked for in each Ready proxy pod's namespace (ztunnel runs in a pod network of its own;
/// found by the pod UID in its processes' cgroups, or among the namespaces whose cgroups
/// name no pod) and in the agent's own (a proxy on the host network). One dump per namespace.
fn connection(bound: &Bound<'_>, uids: &[String], deadline: Instant) -> ConnectionSeen {
    let here = crate::sock_diag::open()
        .and_then(|s| crate::sock_diag::unix::connections(&s, bound, deadline));
    match here {
        Ok(n) if n > 0 => return ConnectionSeen::Connected,
        Ok(_) => {}
        Err(e) => return ConnectionSeen::Unreadable(e.to_string()),
    }
    if uids.is_empty() {
        return ConnectionSeen::NotConnected;
    }
    let mut failed = None;
    let namespaces = match crate::netns::discover(&[]) {
        Ok(n) => n,
        Err(e) => return ConnectionSeen::Unreadable(e.to_string()),
    };
    for r in namespaces {
        // As the pod inspector locates pods: a namespace whose processes' cgroups name
        // another pod is not the proxy's; one whose cgroups name none (a runtime that does
        // not put pod UIDs in cgroup paths) may be. Either way the match below is by the
        // listener's own socket file, so only a connection to it counts.
        let owners = crate::netns::pod_uids(&r.pids);
        if !owners.is_empty() && !uids.iter().any(|u| owners.contains(u)) {
            continue;
        }
        match in_namespace(&r, bound, deadline) {
            Ok(n) if n > 0 => return ConnectionSeen::Connected,
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(netns = %r.path.display(), error = %e, "node proxy pod's namespace not readable");
                failed = Some(format!("{}: {e:#}", r.path.display()));
            }
        }
    }
    // Not found, but a namespace could not be read (a deadline, a permission): say so
    // rather than "not connected".
    failed.map_or(ConnectionSeen::NotConnected, ConnectionSeen::Unreadable)
}

/// Connections carrying `bound`'s address in the namespace `r`, through a pinned descriptor.
fn in_namespace(
    r: &crate::netns::NetnsRef,
    bound: &Bound<'_>,
    deadline: Instant,
) -> anyhow::Result<usize> {
    let pinned = r.pin()?;
    let sock = pinned.sock_diag()??;
    Ok(crate::sock_diag::unix::connections(&sock, bound, deadline)?)
}

fn kind(t: std::fs::FileType) -> SocketSeen {
    if t.is_socket() {
        SocketSeen::Socket
    } else if t.is_file() {
        SocketSeen::NotASocket("a regular file")
    } else if t.is_dir() {
        SocketSeen::NotASocket("a directory")
    } else if t.is_symlink() {
        SocketSeen::NotASocket("a symbolic link")
    } else {
        SocketSeen::NotASocket("a special file")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};

    #[tokio::test]
    async fn the_socket_is_told_from_what_else_may_be_there() {
        let tmp = tempfile::tempdir().unwrap();
        let sock = tmp.path().join("ztunnel.sock");
        let at = sock.to_str().unwrap().to_string();
        assert_eq!(look(&at, Vec::new()).await.0, SocketSeen::Missing);
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        assert_eq!(
            look(&at, Vec::new()).await,
            (SocketSeen::Socket, ConnectionSeen::NotConnected)
        );
        let client = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        let accepted = listener.accept().unwrap();
        assert_eq!(
            look(&at, Vec::new()).await,
            (SocketSeen::Socket, ConnectionSeen::Connected)
        );
        drop((client, accepted, listener));
        std::fs::remove_file(&sock).unwrap();
        std::fs::write(&sock, b"").unwrap();
        assert_eq!(
            look(&at, Vec::new()).await.0,
            SocketSeen::NotASocket("a regular file")
        );
        std::fs::remove_file(&sock).unwrap();
        std::fs::create_dir(&sock).unwrap();
        assert_eq!(
            look(&at, Vec::new()).await.0,
            SocketSeen::NotASocket("a directory")
        );
    }

    #[test]
    fn a_pod_is_ready_only_with_ready_true() {
        let pod = |conds: Vec<(&str, &str)>| Pod {
            metadata: kube::api::ObjectMeta {
                name: Some("ztunnel-x".into()),
                ..Default::default()
            },
            status: Some(PodStatus {
                conditions: Some(
                    conds
                        .into_iter()
                        .map(|(t, s)| PodCondition {
                            type_: t.into(),
                            status: s.into(),
                            ..Default::default()
                        })
                        .collect(),
                ),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(proxy_pod(&pod(vec![("PodScheduled", "True"), ("Ready", "True")])).ready);
        assert!(!proxy_pod(&pod(vec![("Ready", "False")])).ready);
        assert!(!proxy_pod(&pod(vec![("ContainersReady", "True")])).ready);
        assert!(!proxy_pod(&Pod::default()).ready);
    }

    #[test]
    fn the_pods_kept_are_bounded() {
        let mut pods = BTreeMap::new();
        for i in 0..(MAX_PODS + 10) {
            keep(
                &mut pods,
                ProxyPod {
                    name: format!("p{i}"),
                    uid: format!("u{i}"),
                    ready: false,
                    deleting: false,
                },
            );
        }
        assert_eq!(pods.len(), MAX_PODS);
    }
}
