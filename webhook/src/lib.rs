//! meshgate-webhook: refuses mesh pods on nodes whose CNI chain is not verified, and gates
//! new Nodes from their first instant.
//!
//! In: AdmissionReviews over HTTPS from the apiserver; Node and unscheduled-Pod metadata from
//! watches. Out: allow / refuse answers (the decision is `meshgate_core::admission`), JSON
//! Patches for new Nodes, and `/live` `/ready` `/metrics` on the admin port.
//!
//! - [`review`]: AdmissionReview ⇄ `core::admission`, over a [`review::Cluster`] view;
//!   [`decode`]: the request body → only the parts of the review admission reads.
//! - [`cache`]: the real cluster view (metadata watches, bounded API fallbacks); [`nodes`]:
//!   its Nodes, each kept as its name and verified label; [`pods`]: its unscheduled pods,
//!   projected and capped, and the limits on looking one up.
//! - [`server`]: routes, limits and TLS, on the bounded server shared with the admin ports
//!   (`meshgate_shell::server`); [`budget`]: the memory the reviews in flight may hold;
//!   [`tls`]: certificates re-read on change.
//! - [`shutdown`]: the stop sequence (signal → not ready but serving for `--shutdown-delay`
//!   → drain within `--shutdown-timeout` → admin server stops; a signal while draining cuts
//!   the drain, and the process exits 1 through `meshgate_shell::entry`).
//! - [`placement`]: which new Nodes `/mutate-node` gates (those the agent DaemonSet will run
//!   on, `meshgate_core::placement`).
//! - [`metrics`]: the metrics of docs/operations.md, served by `meshgate_shell::admin` with the
//!   agent's admin server.
//!
//! The start-up (signal handlers, client, admin server, mode watch) is the agent's too:
//! `meshgate_shell::runtime`. Logging, profiles and the exit code come from `meshgate_shell`.

pub mod budget;
pub mod cache;
pub mod decode;
pub mod metrics;
pub mod nodes;
pub mod placement;
pub mod pods;
pub mod review;
pub mod server;
pub mod shutdown;
pub mod tls;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use meshgate_shell::admin::{AdminServer, AlwaysLive};
use meshgate_shell::cli::{Common, duration};
use meshgate_shell::runtime::Runtime;
use meshgate_shell::shutdown::Shutdown;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// `meshgate-webhook` command line (docs/operations.md, "`meshgate-webhook`"): its own flags
/// plus the ones it shares with the agent ([`Common`]).
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "meshgate-webhook",
    version,
    about = "meshgate admission webhook: refuses mesh pods on unverified nodes"
)]
pub struct Args {
    /// Address of the HTTPS listener (`POST /validate`, `POST /mutate-node`).
    #[arg(long, env = "MESHGATE_LISTEN")]
    pub listen: SocketAddr,
    /// PEM certificate chain; re-read when it changes on disk.
    #[arg(long, env = "MESHGATE_TLS_CERT")]
    pub tls_cert: PathBuf,
    /// PEM private key; re-read when it changes on disk.
    #[arg(long, env = "MESHGATE_TLS_KEY")]
    pub tls_key: PathBuf,
    /// Kubeconfig, admin address, profiles, log format.
    #[command(flatten)]
    pub common: Common,
    /// Deadline for answering one review (e.g. `3s`, `500ms`); keep it well below the
    /// webhook configuration's `timeoutSeconds`.
    #[arg(long, env = "MESHGATE_REQUEST_TIMEOUT", default_value = "3s", value_parser = duration)]
    pub request_timeout: Duration,
    /// Deadline for one API lookup (pod for a binding, node condition for a refusal).
    #[arg(long, env = "MESHGATE_LOOKUP_TIMEOUT", default_value = "1s", value_parser = duration)]
    pub lookup_timeout: Duration,
    /// Largest accepted request body in bytes.
    #[arg(long, env = "MESHGATE_MAX_BODY_BYTES", default_value_t = 3 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Memory, in bytes, that the reviews being read and decoded may hold at once: each is
    /// charged its body plus its decoding at worst (16 bytes per body byte); past it the next
    /// review waits within `--request-timeout`.
    #[arg(long, env = "MESHGATE_REVIEW_MEMORY_BYTES",
          default_value_t = budget::DEFAULT_REVIEW_MEMORY_BYTES)]
    pub review_memory_bytes: usize,
    /// Most connections served at once on the HTTPS listener; past it a new connection waits
    /// (unaccepted, in the kernel's backlog) until one ends.
    #[arg(long, env = "MESHGATE_MAX_CONNECTIONS", default_value_t = server::DEFAULT_MAX_CONNECTIONS,
          value_parser = parse_max_connections)]
    pub max_connections: usize,
    /// How long to keep accepting and answering after SIGTERM, with `/ready` answering 503,
    /// before the listener closes. The default, 5 s, covers the endpoint removal reaching the
    /// apiserver: a readiness probe failing twice 1 s apart (or the pod's deletion), then the
    /// EndpointSlice update and kube-proxy's sync (1 s minimum period), with room to spare;
    /// it adds only 5 s to a rollout. A second SIGTERM/SIGINT ends the delay early.
    #[arg(long, env = "MESHGATE_SHUTDOWN_DELAY", default_value = "5s", value_parser = duration)]
    pub shutdown_delay: Duration,
    /// How long in-flight requests may take to finish once the shutdown delay is over.
    #[arg(long, env = "MESHGATE_SHUTDOWN_TIMEOUT", default_value = "20s", value_parser = duration)]
    pub shutdown_timeout: Duration,
    /// What is kept and looked up about unscheduled pods.
    #[command(flatten)]
    pub pods: pods::PodLimits,
    /// The agent DaemonSet, `NAMESPACE/NAME`: `/mutate-node` taints a new Node only when this
    /// DaemonSet will run a pod on it (and not while it is unknown).
    #[arg(long, env = "MESHGATE_AGENT_DAEMONSET", default_value = placement::DEFAULT_AGENT_DAEMONSET)]
    pub agent_daemonset: placement::DaemonSetRef,
}

/// How long the start waits for the mode ConfigMap's first list; past it the webhook enforces
/// until the list comes (`meshgate_shell::mode`).
const MODE_FIRST_LIST: Duration = meshgate_shell::runtime::DEFAULT_MODE_FIRST_LIST;

/// Parses `--max-connections`: a positive count.
pub fn parse_max_connections(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!(
            "invalid connection count {s:?}: use a positive number"
        )),
    }
}

impl Args {
    /// The review server's limits, as given on the command line.
    fn limits(&self) -> server::Limits {
        server::Limits {
            max_body_bytes: self.max_body_bytes,
            request_timeout: self.request_timeout,
            max_connections: self.max_connections,
            max_connections_per_client: server::max_connections_per_client(self.max_connections),
            review_memory_bytes: self.review_memory_bytes,
        }
    }
}

/// Runs the webhook until SIGTERM/SIGINT (and the shutdown delay and drain after it). A
/// further signal once the drain has begun cuts it: the error is [`shutdown::Aborted`].
pub async fn run(args: Args) -> anyhow::Result<()> {
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    run_with(args, listener, None).await
}

/// Runs the webhook on an already-bound listener until `shutdown` resolves, then keeps
/// serving for `--shutdown-delay` and drains (tests and embedders pick their own port and
/// stop condition; the process's signal handlers are left alone).
pub async fn run_on(
    args: Args,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    run_with(args, listener, Some(Box::pin(shutdown))).await
}

/// An embedder's stop condition, instead of the signals.
type StopOn = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// Reads the profiles and certificates, starts the runtime (signals, client, admin server,
/// mode), the caches and the TLS server, and serves until the stop sequence has run.
async fn run_with(
    args: Args,
    listener: TcpListener,
    stop_on: Option<StopOn>,
) -> anyhow::Result<()> {
    // The flags' files first: a typo stops the webhook before it touches the API.
    let profiles = args.common.load_profiles()?;
    let tls = tls::server_config(&args.tls_cert, &args.tls_key)?;
    let (phase_tx, phase) = shutdown::phase_channel();
    let (synced_tx, synced) = watch::channel(false);
    let ready = shutdown::Readiness::new(synced.clone(), phase.clone());
    let (rt, metrics) = start_runtime(&args.common, stop_on, ready).await?;
    let setup = cache::Setup::new(
        &profiles,
        args.lookup_timeout,
        args.pods,
        args.agent_daemonset.clone(),
    );
    let (caches, watches) =
        cache::Caches::new(rt.client.clone(), setup, metrics.clone(), synced_tx);
    let watch_tasks = watches.spawn();

    let profile_names: Vec<&str> = profiles.iter().map(|p| p.name.as_str()).collect();
    tracing::info!(
        addr = %listener.local_addr()?,
        profiles = ?profile_names,
        request_timeout = ?args.request_timeout,
        shutdown_delay = ?args.shutdown_delay,
        "webhook listening"
    );
    let limits = args.limits();
    let reviewer = review::Reviewer::new(caches, profiles, metrics)
        .with_taint_key(args.common.taint_key.clone())
        .with_taint_effect(args.common.taint_effect)
        .with_agent_daemonset(args.agent_daemonset)
        .with_mode(rt.mode.subscribe());
    let servers = Servers {
        listener,
        tls,
        max_connections: (limits.max_connections, limits.max_connections_per_client),
        app: server::router(Arc::new(reviewer), synced, limits),
    };
    let stop = Stop {
        shutdown: rt.shutdown,
        admin: rt.admin,
        phase: (phase_tx, phase),
        delay: args.shutdown_delay,
        drain: args.shutdown_timeout,
    };
    let stopped = serve_until_stopped(servers, stop).await;
    for t in watch_tasks {
        t.abort();
    }
    stopped?;
    tracing::info!("webhook stopped");
    Ok(())
}

/// The shared runtime (`meshgate_shell::runtime`) with the webhook's metrics, `/ready`
/// following `ready` and `/live` always 200 (serving is its work); stopping on `stop_on`
/// instead of the signals when given.
async fn start_runtime(
    common: &Common,
    stop_on: Option<StopOn>,
    ready: shutdown::Readiness,
) -> anyhow::Result<(Runtime, metrics::Metrics)> {
    let mut registry = Registry::default();
    let metrics = metrics::Metrics::register(&mut registry);
    let builder = Runtime::builder(common, meshgate_core::field_manager::WEBHOOK)
        .metrics(registry, metrics.mode.clone())
        .probes(ready, AlwaysLive)
        .mode_first_list(MODE_FIRST_LIST);
    let builder = match stop_on {
        Some(stop) => builder.stop_on(stop),
        None => builder,
    };
    Ok((builder.build().await?, metrics))
}

/// The bound TLS socket and what it serves.
struct Servers {
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    /// `--max-connections`, and what one client may hold of it.
    max_connections: (usize, usize),
    app: axum::Router,
}

/// When and how to stop.
struct Stop {
    /// The stop requests ([`shutdown::sequence`]).
    shutdown: Shutdown,
    /// Serving since the start; stopped last.
    admin: AdminServer,
    /// What the sequence drives, and what the TLS server and `/ready` follow.
    phase: (
        watch::Sender<shutdown::Phase>,
        watch::Receiver<shutdown::Phase>,
    ),
    delay: Duration,
    drain: Duration,
}

/// Serves until the stop sequence has run: a stop request turns `/ready` to 503 while the
/// TLS server keeps serving for `delay`; then the TLS server drains (at most `drain`); the
/// admin server stops last, so `/live` stays 200 (the kubelet must not restart a draining
/// pod) and `/metrics` can be scraped to the end. A stop request during the drain cuts it:
/// the connections left and the admin server end at once, and it returns [`shutdown::Aborted`].
async fn serve_until_stopped(servers: Servers, stop: Stop) -> Result<(), shutdown::Aborted> {
    let Stop {
        shutdown,
        admin,
        phase: (phase_tx, phase),
        delay,
        drain,
    } = stop;
    let stopping = async move {
        let shutdown = shutdown::sequence(shutdown, delay, phase_tx).await;
        shutdown::while_draining(shutdown).await
    };
    let serving = server::serve_tls(
        servers.listener,
        servers.tls,
        servers.app,
        phase,
        drain,
        servers.max_connections,
    );
    // Dropping the server's future ends its connections (their tasks are aborted with it).
    let served = tokio::select! {
        () = serving => Ok(()),
        aborted = stopping => Err(aborted),
    };
    match served {
        Ok(()) => admin.stop().await,
        // Dropped: ends at once, without its drain.
        Err(_) => drop(admin),
    }
    served
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// Parses the required flags plus `extra`.
    fn parse(extra: &[&str]) -> Result<Args, clap::Error> {
        let required = [
            "meshgate-webhook",
            "--listen",
            "127.0.0.1:8443",
            "--tls-cert",
            "/c",
            "--tls-key",
            "/k",
        ];
        Args::try_parse_from(required.iter().chain(extra))
    }

    #[test]
    fn contract_flags_parse() {
        let a = parse(&[
            "--kubeconfig",
            "/kc",
            "--admin-addr",
            "127.0.0.1:9090",
            "--profile",
            "linkerd",
            "--profile",
            "istio",
        ])
        .unwrap();
        assert_eq!(a.common.profiles, ["linkerd", "istio"]);
        assert_eq!(a.request_timeout, Duration::from_secs(3));
        assert_eq!(a.max_connections, server::DEFAULT_MAX_CONNECTIONS);
        assert_eq!(
            parse(&["--max-connections", "64"]).unwrap().max_connections,
            64
        );
        assert!(parse(&["--max-connections", "0"]).is_err());
        assert_eq!(a.pods, pods::PodLimits::default());
        assert_eq!(
            a.agent_daemonset.to_string(),
            "meshgate-system/meshgate-agent"
        );
        let other = parse(&["--agent-daemonset", "mesh/agent"]).unwrap();
        assert_eq!(other.agent_daemonset.namespace, "mesh");
        assert!(parse(&["--agent-daemonset", "agent"]).is_err());
        let p = parse(&[
            "--max-pending-pods",
            "10",
            "--pod-lookups-per-second",
            "0",
            "--max-pod-lookups-in-flight",
            "2",
        ])
        .unwrap()
        .pods;
        assert_eq!(
            (
                p.max_pending_pods,
                p.pod_lookups_per_second,
                p.max_pod_lookups_in_flight
            ),
            (10, 0, 2)
        );
        assert!(parse(&["--max-connections", "many"]).is_err());
        let set = a.common.load_profiles().unwrap();
        assert_eq!(set.iter().count(), 2);

        let bad = parse(&["--profile", "consul"]).unwrap();
        assert!(bad.common.load_profiles().is_err());
        assert!(Args::try_parse_from(["meshgate-webhook", "--listen", "x"]).is_err());
    }

    #[test]
    fn the_taint_effect_flag_is_the_agents() {
        use meshgate_core::gate::TaintEffect;
        assert_eq!(
            parse(&[]).unwrap().common.taint_effect,
            TaintEffect::NoSchedule
        );
        let a = parse(&["--taint-effect", "NoExecute"]).unwrap();
        assert_eq!(a.common.taint_effect, TaintEffect::NoExecute);
        assert!(parse(&["--taint-effect", "PreferNoSchedule"]).is_err());
    }

    /// A plain HTTP/1.0 GET on the admin port: the status, or `None` when nothing answers.
    async fn admin_status(addr: SocketAddr, path: &str) -> Option<u16> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
            .await
            .ok()?;
        let mut out = String::new();
        tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut out))
            .await
            .ok()?
            .ok()?;
        out.split_whitespace().nth(1)?.parse().ok()
    }

    struct Running {
        pki: server::tests::Pki,
        addr: SocketAddr,
        admin: SocketAddr,
        requests: tokio::sync::mpsc::Sender<&'static str>,
        /// Ends when serving has.
        task: tokio::task::JoinHandle<()>,
        /// How serving ended.
        outcome: tokio::sync::oneshot::Receiver<Result<(), shutdown::Aborted>>,
        _synced: watch::Sender<bool>,
        _dir: tempfile::TempDir,
    }

    /// The TLS and admin servers over a fake cluster whose pod lookups take `lookup`, with
    /// synced caches, as `run_with` assembles them.
    async fn running(lookup: Duration, delay: Duration) -> Running {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let pki = server::tests::Pki::new();
        pki.issue(&cert, &key);
        let mut cluster = review::tests::fake_cluster();
        cluster.delay = Some(lookup);
        let (app, synced_tx) = server::tests::app(cluster, true, server::Limits::default());
        let synced = synced_tx.subscribe();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let admin_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = admin_listener.local_addr().unwrap();
        let (phase_tx, phase) = shutdown::phase_channel();
        let admin_server = AdminServer::start(
            Some(admin_listener),
            Arc::new(Registry::default()),
            shutdown::Readiness::new(synced, phase.clone()),
            AlwaysLive,
        );
        let (requests, stop_requests) = Shutdown::channel(4);
        let servers = Servers {
            listener,
            tls: tls::server_config(&cert, &key).unwrap(),
            max_connections: (
                server::DEFAULT_MAX_CONNECTIONS,
                server::DEFAULT_MAX_CONNECTIONS,
            ),
            app,
        };
        let stop = Stop {
            shutdown: stop_requests,
            admin: admin_server,
            phase: (phase_tx, phase),
            delay,
            drain: Duration::from_secs(5),
        };
        let (outcome_tx, outcome) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let served = serve_until_stopped(servers, stop).await;
            let _ = outcome_tx.send(served);
        });
        assert_eq!(admin_status(admin, "/ready").await, Some(200));
        Running {
            pki,
            addr,
            admin,
            requests,
            task,
            outcome,
            _synced: synced_tx,
            _dir: dir,
        }
    }

    /// SIGTERM as the kubelet sends it: `/ready` turns 503 at once while `/live` stays 200 and
    /// new connections are still accepted and answered for the delay; then the listener
    /// closes, a review in flight finishes, and the admin server outlives the TLS server.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn after_a_stop_request_it_serves_unready_for_the_delay_then_drains() {
        let delay = Duration::from_millis(1000);
        let r = running(Duration::from_millis(1500), delay).await;
        let review = review::tests::pod_review("web", Some("bad"), true);

        r.requests.send("SIGTERM").await.unwrap();
        let stop_requested = std::time::Instant::now();
        // A binding whose 1.5 s pod lookup outlasts the 1 s delay.
        let (mut c, _) = server::tests::connect(&r.pki, r.addr).await.unwrap();
        let binding = review::tests::binding_review("meshed", "bad");
        let in_flight =
            tokio::spawn(async move { server::tests::try_send(&mut c, &binding).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(admin_status(r.admin, "/ready").await, Some(503));
        assert_eq!(admin_status(r.admin, "/live").await, Some(200));
        // Still serving: new connections, every one answered right.
        for _ in 0..3 {
            let (mut c, _) = server::tests::connect(&r.pki, r.addr)
                .await
                .expect("accepting during the delay");
            let a = server::tests::try_send(&mut c, &review).await.unwrap();
            assert_eq!(a.status, http::StatusCode::OK);
            assert_eq!(a.body["response"]["allowed"], false);
            assert!(a.close);
            assert_eq!(admin_status(r.admin, "/ready").await, Some(503));
        }
        assert!(
            stop_requested.elapsed() < delay,
            "the checks above took longer than the delay; the test proves nothing"
        );

        tokio::time::sleep(
            (delay + Duration::from_millis(150)).saturating_sub(stop_requested.elapsed()),
        )
        .await;
        assert!(
            server::tests::connect(&r.pki, r.addr).await.is_err(),
            "the listener is closed after the delay"
        );
        assert_eq!(
            admin_status(r.admin, "/live").await,
            Some(200),
            "the admin server serves while the TLS server drains"
        );
        assert!(!in_flight.is_finished(), "the lookup outlasts the delay");
        let a = in_flight
            .await
            .unwrap()
            .expect("the in-flight review drained");
        assert_eq!(a.status, http::StatusCode::OK);
        assert_eq!(a.body["response"]["allowed"], false);
        tokio::time::timeout(Duration::from_secs(5), r.task)
            .await
            .expect("stopped after the drain")
            .unwrap();
        assert_eq!(
            admin_status(r.admin, "/live").await,
            None,
            "admin stopped last"
        );
    }

    /// A second SIGTERM/SIGINT during the delay ends it: the listener closes at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_second_stop_request_skips_the_rest_of_the_delay() {
        let r = running(Duration::from_millis(10), Duration::from_secs(60)).await;
        r.requests.send("SIGTERM").await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (mut c, _) = server::tests::connect(&r.pki, r.addr)
            .await
            .expect("serving during the delay");
        let review = review::tests::pod_review("web", Some("bad"), true);
        assert_eq!(
            server::tests::try_send(&mut c, &review)
                .await
                .unwrap()
                .status,
            http::StatusCode::OK
        );
        assert!(!r.task.is_finished());
        r.requests.send("SIGTERM").await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), r.task)
            .await
            .expect("the second request ended the 60 s delay")
            .unwrap();
        assert!(server::tests::connect(&r.pki, r.addr).await.is_err());
    }

    /// A stop request once the drain has begun cuts it: serving ends at once with `Aborted`
    /// (which `run` returns, so the process exits 1), the review still in flight is cut
    /// unanswered, and the admin server is gone with it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stop_request_while_draining_cuts_the_drain() {
        let r = running(Duration::from_secs(10), Duration::from_millis(500)).await;
        r.requests.send("SIGTERM").await.unwrap();
        // A binding whose 10 s pod lookup would hold the drain for as long.
        let (mut c, _) = server::tests::connect(&r.pki, r.addr).await.unwrap();
        let binding = review::tests::binding_review("meshed", "bad");
        let in_flight =
            tokio::spawn(async move { server::tests::try_send(&mut c, &binding).await });
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert!(
            server::tests::connect(&r.pki, r.addr).await.is_err(),
            "draining: the listener is closed"
        );
        assert!(!r.task.is_finished(), "the drain waits for the review");
        r.requests.send("SIGTERM").await.unwrap();
        tokio::time::timeout(Duration::from_secs(1), r.task)
            .await
            .expect("the request ended the drain at once")
            .unwrap();
        assert_eq!(
            r.outcome.await.unwrap(),
            Err(shutdown::Aborted { signal: "SIGTERM" })
        );
        let cut = tokio::time::timeout(Duration::from_secs(1), in_flight)
            .await
            .expect("the review's connection was closed")
            .unwrap();
        assert!(cut.is_err(), "the review in flight was cut");
        assert_eq!(admin_status(r.admin, "/live").await, None);
    }

    #[test]
    fn shutdown_flags_parse() {
        let a = parse(&[]).unwrap();
        assert_eq!(a.shutdown_delay, Duration::from_secs(5));
        assert_eq!(a.shutdown_timeout, Duration::from_secs(20));
        let a = parse(&["--shutdown-delay", "500ms"]).unwrap();
        assert_eq!(a.shutdown_delay, Duration::from_millis(500));
        // With `=`, so clap hands "-1s" to the parser instead of taking it for a flag.
        let err = parse(&["--shutdown-delay=-1s"]).expect_err("a negative delay is refused");
        assert!(
            err.to_string().contains("must be a positive number"),
            "refused by the duration parser: {err}"
        );
        let err = parse(&["--shutdown-timeout=soon"]).expect_err("a malformed timeout is refused");
        assert!(err.to_string().contains("use e.g. 3s"), "{err}");
    }
}
