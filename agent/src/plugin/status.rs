//! `kubectl meshgate status`: reads the Nodes, the agents' Events, the mode ConfigMap, the
//! webhook's answer to a probe, the agent's ClusterRole and the apiserver's feature gauge
//! (`/metrics`), and prints `core::status`'s report.
//!
//! In: [`Args`]. Out: the table (default) or the report as one JSON object (`-o json`,
//! schema `meshgate.io/status/v1`), and the exit code: 0 nothing gated and the webhook not
//! known to be unreachable, 1 a node is gated, the webhook is unreachable or the agent acts as
//! its node without the apiserver's gate, 2 usage error or the Nodes or Events could not be
//! read.

use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Node};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::ClusterRole;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams};
use meshgate_core::event_reason;
use meshgate_core::status::access::{self, AgentAccess, Gate};
use meshgate_core::status::{self, Inputs, Mode, Report};
use meshgate_shell::cli::duration;
use meshgate_shell::entry::Exit;

use super::{Conn, is_not_found, probe};

/// The ConfigMap that holds the mode, in meshgate's namespace, and its key.
pub const MODE_CONFIGMAP: &str = "meshgate-mode";
const MODE_KEY: &str = "mode";
/// The mode when the ConfigMap or its key is absent.
const DEFAULT_MODE: &str = "enforce";

/// Output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Columns for people.
    Table,
    /// One JSON object (schema `meshgate.io/status/v1`).
    Json,
}

/// `kubectl meshgate status [-o table|json]`
#[derive(Clone, Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub conn: Conn,
    /// Output format.
    #[arg(
        short = 'o',
        long,
        env = "MESHGATE_OUTPUT",
        value_enum,
        default_value = "table"
    )]
    pub output: Output,
    /// Evictions are counted over this window before now.
    #[arg(long, env = "MESHGATE_EVICTION_WINDOW", default_value = "1h", value_parser = duration)]
    pub eviction_window: Duration,
    #[command(flatten)]
    pub probe: probe::ProbeArgs,
    /// Judge the webhook alone: exit 1 unless the probe found it `reachable`, whatever the
    /// nodes say (the chart's `helm test`, where a gated node is no failure of the install).
    #[arg(long, env = "MESHGATE_WEBHOOK_ONLY")]
    pub webhook_only: bool,
}

/// Builds the report and prints it; the exit code says whether it needs attention.
pub async fn run(args: Args) -> anyhow::Result<Exit> {
    let report = report(&args).await?;
    match args.output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        Output::Table => print!("{}", status::table::render(&report, Timestamp::now())),
    }
    let failed = if args.webhook_only {
        report
            .webhook
            .as_ref()
            .is_none_or(|w| w.state != "reachable")
    } else {
        report.needs_attention()
    };
    Ok(if failed { Exit::Failed } else { Exit::Success })
}

/// The report, from the API alone.
pub async fn report(args: &Args) -> anyhow::Result<Report> {
    let conn = &args.conn;
    let client = conn.client().await?;
    let nodes = conn
        .list_all(
            &Api::<Node>::all(client.clone()),
            ListParams::default(),
            "nodes",
        )
        .await?;
    let mut events = Vec::new();
    let mut truncated = Vec::new();
    if nodes.truncated {
        truncated.push("nodes".to_string());
    }
    let api = Api::<Event>::all(client.clone());
    for reason in [event_reason::CHAIN_VERIFIED, event_reason::REDIRECT_MISSING] {
        let params = ListParams::default().fields(&format!("reason={reason}"));
        let listed = conn
            .list_all(&api, params, &format!("{reason} Events"))
            .await?;
        if listed.truncated {
            truncated.push(format!("{reason} Events"));
        }
        events.extend(listed.items);
    }
    let mut report = status::build(&Inputs {
        nodes: &nodes.items,
        events: &events,
        taint_key: &conn.taint_key,
        eviction_window: args.eviction_window,
        now: Timestamp::now(),
    });
    report.truncated = truncated;
    report.mode = mode(conn, &client).await;
    report.agent_access = agent_access(conn, &client).await;
    report.webhook = probe::run(&args.probe, conn, &client).await;
    Ok(report)
}

/// The mode ConfigMap's setting; `None` (with a warning on stderr) when it cannot be read.
async fn mode(conn: &Conn, client: &kube::Client) -> Option<Mode> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &conn.namespace);
    let read = conn
        .call("reading the mode ConfigMap", api.get(MODE_CONFIGMAP))
        .await;
    let configured = match read {
        Ok(cm) => cm.data.and_then(|mut d| d.remove(MODE_KEY)),
        Err(e) if is_not_found(&e) => None,
        Err(e) => {
            tracing::warn!(namespace = %conn.namespace, error = format!("{e:#}"), "the mode is not in the report");
            return None;
        }
    };
    Some(match configured {
        Some(mode) => Mode {
            mode: mode.trim().to_string(),
            source: "configmap",
        },
        None => Mode {
            mode: DEFAULT_MODE.into(),
            source: "default",
        },
    })
}

/// The agent's grants (its ClusterRole) and the apiserver's gate; `None` (with a warning on
/// stderr) when the ClusterRole cannot be read.
async fn agent_access(conn: &Conn, client: &kube::Client) -> Option<AgentAccess> {
    let api: Api<ClusterRole> = Api::all(client.clone());
    let role = conn
        .call(
            "reading the ClusterRole meshgate-agent",
            api.get_opt(access::CLUSTER_ROLE),
        )
        .await;
    let role = match role {
        Ok(role) => role,
        Err(e) => {
            tracing::warn!(
                cluster_role = access::CLUSTER_ROLE,
                error = format!("{e:#}"),
                "the agent's grants are not in the report"
            );
            return None;
        }
    };
    let gate = gate(conn, client).await;
    Some(access::assess(access::grants_of(role.as_ref()), gate))
}

/// The apiserver's ConstrainedImpersonation gate, from its `/metrics` (a non-resource URL
/// many read-only roles lack: then `unknown`, noted at debug level only). In an HA control
/// plane this is the answer of the one apiserver the request reached.
async fn gate(conn: &Conn, client: &kube::Client) -> Gate {
    let request = match http::Request::get("/metrics").body(Vec::new()) {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(error = %e, "cannot build the /metrics request");
            return Gate::Unknown;
        }
    };
    match conn
        .call(
            "reading the apiserver's /metrics",
            client.request_text(request),
        )
        .await
    {
        Ok(text) => access::gate_from_metrics(&text),
        Err(e) => {
            tracing::debug!(
                error = format!("{e:#}"),
                "the apiserver's feature gates are unknown"
            );
            Gate::Unknown
        }
    }
}
