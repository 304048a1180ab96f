//! `meshgate-agent run`: the DaemonSet process that gates its own Node on the chain verdict.
//!
//! In: the flags ([`Args`], read once into a [`Config`] per part), inotify events from the
//! CNI dirs, a periodic resync tick, changes to the agent's own Node (watched by name), the
//! live mode (`meshgate_shell::mode`: what the agent may do to its taint and whether it
//! evicts), and SIGTERM. Out: the Node's taint, label, condition and Events (through
//! [`node::NodeGate`], which carries out `meshgate_core::gate`'s plans), the state file, the
//! pod inspector ([`pods`]), and metrics on the admin port, whose `/live` follows the loop's
//! progress: a pass (verify, then write the Node) running longer than `--stall-timeout`, or
//! no pass begun for `--resync-interval` plus that, fails it, so the kubelet restarts a
//! wedged agent instead of leaving its Node's state frozen.
//!
//! The daemon starts through the runtime both daemons share (`meshgate_shell::runtime`:
//! signal handlers, client, admin server, mode watch), then gives each task the context it
//! uses ([`start`]). The verdict loop ([`verdict_loop`]) is `pass` → `next_wake`, in order —
//! wait for a reason, coalesce a burst of file events, verify, reconcile — so there is never
//! more than one writer of meshgate's names on the Node and every write is based on a verdict
//! computed just before it. A failed reconcile is retried with capped exponential backoff, and each
//! retry verifies again, so a long API outage can never end in an untaint based on what the
//! disk said before it. A verdict that rests on a failure that may pass by itself (a plugin
//! that timed out) is verified again on a schedule of its own, 1–2 s doubling to 15–30 s.
//!
//! Logs: everything the daemon and its tasks log is inside an `agent` span naming the node;
//! a verdict pass's lines inside a `pass` span (why it woke), a pod's inside a `pod` span.

pub mod clients;
mod coalesce;
pub mod events;
pub mod fswatch;
pub mod metrics;
pub mod node;
pub mod node_proxy;
pub mod pods;
mod stages;
pub mod start;
pub mod state;
mod timer;
pub mod verdict_loop;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use tracing::Instrument;

use meshgate_core::cni::watch_backend::Mode as FsWatchMode;
use meshgate_core::gate::{TaintEffect, TaintKey};
use meshgate_core::node_proxy::NodeProxy;
use meshgate_core::profile::ProfileSet;
use meshgate_shell::cli::{Common, duration};

use crate::cni::CniArgs;
use start::Daemon;

/// `meshgate-agent run` flags (see docs/operations.md).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// This node's name (from the Downward API in the DaemonSet).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    #[command(flatten)]
    pub cni: CniArgs,
    /// Kubeconfig, admin address, profiles, log format, taint effect.
    #[command(flatten)]
    pub common: Common,
    /// Read the Node and the pods on it, and evict them, as the node itself (Constrained
    /// Impersonation: Kubernetes 1.35+ with the ConstrainedImpersonation feature gate, and
    /// the RBAC of the chart's agent.impersonateNode). Node writes and Events stay
    /// with the ServiceAccount.
    #[arg(long, env = "MESHGATE_IMPERSONATE_NODE")]
    pub impersonate_node: bool,
    /// Decide and report evictions, but evict nothing.
    #[arg(long, env = "MESHGATE_DRY_RUN")]
    pub dry_run: bool,
    /// Report pods without redirect rules, never evict them.
    #[arg(long, env = "MESHGATE_NO_EVICT")]
    pub no_evict: bool,
    /// Per-node eviction rate limit.
    #[arg(long, env = "MESHGATE_MAX_EVICTIONS_PER_MINUTE", default_value_t = 10)]
    pub max_evictions_per_minute: u32,
    /// Evictions all agents together may make per --cluster-eviction-budget-window, kept in
    /// the ConfigMap meshgate-eviction-budget in --namespace; 0 turns it off. Past it, or
    /// when the ConfigMap cannot be read or written, nothing is evicted.
    #[arg(long, env = "MESHGATE_CLUSTER_EVICTION_BUDGET", default_value_t = 0)]
    pub cluster_eviction_budget: u32,
    /// The sliding window of --cluster-eviction-budget.
    #[arg(long, env = "MESHGATE_CLUSTER_EVICTION_BUDGET_WINDOW", default_value = "10m", value_parser = duration)]
    pub cluster_eviction_budget_window: Duration,
    /// Also evict pods without a controlling owner (bare pods), which nothing recreates.
    #[arg(long, env = "MESHGATE_EVICT_UNOWNED")]
    pub evict_unowned: bool,
    /// Node-local state (boot id, last verdict, eviction history); keep it on tmpfs.
    #[arg(
        long,
        env = "MESHGATE_STATE_FILE",
        default_value = "/var/run/meshgate/state.json"
    )]
    pub state_file: PathBuf,
    /// Re-verify at least this often, as a safety net for missed inotify events.
    #[arg(long, env = "MESHGATE_RESYNC_INTERVAL", default_value = "60s", value_parser = duration)]
    pub resync_interval: Duration,
    /// Quiet time that ends a burst of file events that wrote a file in place (a burst of
    /// renames into place and removals is verified at once); a burst that never ends is cut
    /// after ten times this.
    #[arg(long, env = "MESHGATE_COALESCE", default_value = "20ms", value_parser = duration)]
    pub coalesce: Duration,
    /// How the CNI directories are watched: auto (inotify; polling when the host's
    /// fs.inotify.max_user_instances or max_user_watches is reached), inotify (fail to start
    /// without it) or poll (every --fs-poll-interval).
    #[arg(long, env = "MESHGATE_FS_WATCH", default_value = "auto", value_parser = fs_watch)]
    pub fs_watch: FsWatchMode,
    /// How often the CNI directories are scanned while polled (--fs-watch); a change is seen
    /// within this, plus --coalesce.
    #[arg(long, env = "MESHGATE_FS_POLL_INTERVAL", default_value = "1s", value_parser = poll_interval)]
    pub fs_poll_interval: Duration,
    /// Deadline for each Kubernetes API call.
    #[arg(long, env = "MESHGATE_API_TIMEOUT", default_value = "5s", value_parser = duration)]
    pub api_timeout: Duration,
    /// /live fails when one pass of the loop (verify, then write the Node) runs longer than
    /// this, or when no pass begins within --resync-interval plus this. A pass is a
    /// verification (each plugin probe bounded by --probe-timeout) and a few API calls (each
    /// bounded by --api-timeout): well under a second normally.
    #[arg(long, env = "MESHGATE_STALL_TIMEOUT", default_value = "60s", value_parser = duration)]
    pub stall_timeout: Duration,
    /// The namespace of the node proxy's pods (Istio ambient's ztunnel), when a profile named
    /// by --profile has one (istio-ambient); default: the profile's (istio-system).
    #[arg(long, env = "MESHGATE_NODE_PROXY_NAMESPACE")]
    pub node_proxy_namespace: Option<String>,
    /// The labels of the node proxy's pods, key=value[,key=value]; default: the profile's
    /// (app=ztunnel).
    #[arg(long, env = "MESHGATE_NODE_PROXY_LABELS", value_parser = node_proxy_labels)]
    pub node_proxy_labels: Option<BTreeMap<String, String>>,
    /// The node proxy's socket on the host, as the mesh's CNI plugin connects to it;
    /// default: the profile's (/var/run/ztunnel/ztunnel.sock). Its directory must be mounted
    /// at the same path in the agent's container.
    #[arg(long, env = "MESHGATE_NODE_PROXY_SOCKET")]
    pub node_proxy_socket: Option<String>,
}

fn fs_watch(s: &str) -> Result<FsWatchMode, String> {
    s.parse()
        .map_err(|e: meshgate_core::cni::watch_backend::UnknownMode| e.to_string())
}

/// A poll interval: at least 100 ms, so a poller cannot spin on the directories.
fn poll_interval(s: &str) -> Result<Duration, String> {
    let d = duration(s)?;
    if d < Duration::from_millis(100) {
        return Err(format!("{s} is below 100ms"));
    }
    Ok(d)
}

fn node_proxy_labels(s: &str) -> Result<BTreeMap<String, String>, String> {
    meshgate_core::node_proxy::parse_labels(s)
}

/// The node proxy this node must run, with the `--node-proxy-*` flags over the named
/// profile's record, and that profile's name; `None` when no profile named by `--profile`
/// has one.
fn node_proxy(args: &Args, profiles: &ProfileSet) -> anyhow::Result<Option<(String, NodeProxy)>> {
    let Some(profile) = meshgate_core::node_proxy::required(profiles, &args.common.profiles)?
    else {
        return Ok(None);
    };
    let Some(mut proxy) = profile.node_proxy.clone() else {
        return Ok(None);
    };
    if let Some(ns) = &args.node_proxy_namespace {
        proxy.namespace = ns.clone();
    }
    if let Some(labels) = &args.node_proxy_labels {
        proxy.labels = labels.clone();
    }
    if let Some(socket) = &args.node_proxy_socket {
        proxy.socket = socket.clone();
    }
    if let Some(why) = proxy.problem() {
        anyhow::bail!("--node-proxy-* for profile {:?}: {why}", profile.name);
    }
    Ok(Some((profile.name.clone(), proxy)))
}

/// What each part of the daemon takes from the flags: the one place that reads [`Args`].
#[derive(Clone, Debug)]
pub struct Config {
    /// This node's name.
    pub node: String,
    /// `--kubeconfig`, `--admin-addr` (the profiles are read into `pods`).
    pub common: Common,
    /// `--impersonate-node`.
    pub impersonate_node: bool,
    /// `--state-file`.
    pub state_file: PathBuf,
    /// The CNI dirs, runtime and probes to verify with.
    pub cni: CniArgs,
    /// `--taint-key`.
    pub taint_key: TaintKey,
    /// `--taint-effect`.
    pub taint_effect: TaintEffect,
    /// `--api-timeout`: each Node write and Event.
    pub api_timeout: Duration,
    /// `--resync-interval`.
    pub resync_interval: Duration,
    /// `--coalesce`.
    pub coalesce: Duration,
    /// `--fs-watch`.
    pub fs_watch: FsWatchMode,
    /// `--fs-poll-interval`.
    pub fs_poll_interval: Duration,
    /// `--stall-timeout`.
    pub stall_timeout: Duration,
    /// The pod inspector's.
    pub pods: pods::Config,
    /// The node proxy that must be ready for the node to be verified (ambient's ztunnel).
    pub node_proxy: Option<NodeProxy>,
}

impl Config {
    /// Reads the flags; fails on an unreadable profile file or an unknown `--profile`, so a
    /// typo stops the agent at start instead of silently inspecting nothing.
    pub fn from_args(args: &Args) -> anyhow::Result<Self> {
        let profiles = args.common.load_profiles()?;
        let node_proxy = node_proxy(args, &profiles).context("the node proxy")?;
        let pods = pods::Config {
            node: args.node_name.clone(),
            keys: meshgate_core::projection::PodKeys::inspection(&profiles),
            profiles,
            flags: meshgate_core::evict::Flags {
                dry_run: args.dry_run,
                no_evict: args.no_evict,
                evict_unowned: args.evict_unowned,
                // The live mode is read at each decision (`pods::Inputs::mode`).
                mode: meshgate_core::mode::Mode::default(),
            },
            per_minute: args.max_evictions_per_minute,
            cluster_budget: meshgate_core::cluster_budget::Budget::new(
                args.cluster_eviction_budget,
                args.cluster_eviction_budget_window,
            )
            .map_err(|e| anyhow::anyhow!("--cluster-eviction-budget: {e}"))?,
            namespace: args.common.mode.namespace.clone(),
            api_timeout: args.api_timeout,
            netns_dirs: vec![PathBuf::from(crate::netns::DEFAULT_NETNS_DIR)],
            node_proxy: node_proxy.clone(),
        };
        Ok(Self {
            node: args.node_name.clone(),
            common: args.common.clone(),
            impersonate_node: args.impersonate_node,
            state_file: args.state_file.clone(),
            cni: args.cni.clone(),
            taint_key: args.common.taint_key.clone(),
            taint_effect: args.common.taint_effect,
            api_timeout: args.api_timeout,
            resync_interval: args.resync_interval,
            coalesce: args.coalesce,
            fs_watch: args.fs_watch,
            fs_poll_interval: args.fs_poll_interval,
            stall_timeout: args.stall_timeout,
            pods,
            node_proxy: node_proxy.map(|(_, p)| p),
        })
    }
}

/// Runs the daemon until SIGTERM/SIGINT.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let config = Config::from_args(&args)?;
    // Every line the daemon logs is about this node: its span says so once, and the tasks the
    // daemon starts log inside it too.
    let span = tracing::info_span!("agent", node = %config.node);
    run_on_node(config).instrument(span).await
}

/// The daemon, from start to stop.
async fn run_on_node(config: Config) -> anyhow::Result<()> {
    Daemon::start(config).await?.run().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn proxy(flags: &[&str]) -> anyhow::Result<Option<NodeProxy>> {
        let base = [
            "agent",
            "--node-name",
            "n1",
            "--require-plugin",
            "istio-cni",
        ];
        let cli = Cli::try_parse_from(base.iter().chain(flags))?;
        let profiles = cli.args.common.load_profiles()?;
        Ok(node_proxy(&cli.args, &profiles)?.map(|(profile, p)| {
            assert_eq!(profile, "istio-ambient");
            p
        }))
    }

    #[test]
    fn ztunnel_is_required_only_when_ambient_is_named_and_the_flags_override_it() {
        assert_eq!(
            proxy(&[]).unwrap(),
            None,
            "the default profiles need no ztunnel"
        );
        assert_eq!(proxy(&["--profile", "istio"]).unwrap(), None);
        assert_eq!(
            proxy(&["--profile", "istio,istio-ambient"]).unwrap(),
            Some(meshgate_core::meshes::istio_ambient::ztunnel())
        );
        let p = proxy(&[
            "--profile",
            "istio-ambient",
            "--node-proxy-namespace",
            "ztunnel",
            "--node-proxy-labels",
            "app=zt,rev=a",
            "--node-proxy-socket",
            "/run/zt/zt.sock",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(p.namespace, "ztunnel");
        assert_eq!(p.label_selector(), "app=zt,rev=a");
        assert_eq!(p.socket, "/run/zt/zt.sock");
        let bad = proxy(&[
            "--profile",
            "istio-ambient",
            "--node-proxy-socket",
            "zt.sock",
        ]);
        assert!(format!("{:#}", bad.unwrap_err()).contains("absolute"));
        assert!(proxy(&["--node-proxy-labels", "app"]).is_err());
    }
}
