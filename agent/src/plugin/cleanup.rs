//! `kubectl meshgate cleanup`: takes meshgate's taint, label and condition off every Node and
//! leaves everything else as it is.
//!
//! In: [`Args`]. Out: one line per Node changed (`node/NAME: removed taint, label,
//! condition`), a summary line, and the exit code: 0 every Node is clean, 1 a Node could not
//! be cleaned or agents were still running at `--timeout`, 2 usage error or the Nodes could
//! not be listed. Idempotent: a clean Node costs no write.
//!
//! With `--wait-for-agents` it first waits, within `--timeout`, until no meshgate agent pod is
//! left in meshgate's namespace (a running agent would put its marks back). The writes are
//! `core::cleanup`'s guarded JSON Patches (`nodes` for the taint and label, `nodes/status`
//! for the condition); a Node that changed meanwhile is re-read and re-planned, at most
//! [`MAX_ATTEMPTS`] times.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams};
use meshgate_core::cleanup::{self, Marks};
use meshgate_shell::cli::duration;
use meshgate_shell::entry::Exit;
use serde_json::Value;

use super::{Conn, is_conflict, is_not_found};

/// Read-plan-write rounds per Node before it is reported failed.
pub const MAX_ATTEMPTS: usize = 8;
/// How often the agent pods are listed while waiting for them to go.
const POLL: Duration = Duration::from_secs(1);

/// `kubectl meshgate cleanup [--wait-for-agents] [--timeout D]`
#[derive(Clone, Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub conn: Conn,
    /// First wait until no meshgate agent pod is left in meshgate's namespace.
    #[arg(long, env = "MESHGATE_WAIT_FOR_AGENTS")]
    pub wait_for_agents: bool,
    /// Longest wait for the agents to go.
    #[arg(long, env = "MESHGATE_TIMEOUT", default_value = "5m", value_parser = duration)]
    pub timeout: Duration,
    /// The agent pods' label selector (the DaemonSet's).
    #[arg(
        long,
        env = "MESHGATE_AGENT_SELECTOR",
        default_value = "app.kubernetes.io/name=meshgate-agent"
    )]
    pub agent_selector: String,
    /// Server-side dry run: print what would be removed, change nothing.
    #[arg(long, env = "MESHGATE_DRY_RUN")]
    pub dry_run: bool,
}

/// Waits for the agents if asked, then cleans every Node.
pub async fn run(args: Args) -> anyhow::Result<Exit> {
    let conn = &args.conn;
    let client = conn.client().await?;
    if args.wait_for_agents && !wait_for_agents(&args, &client).await? {
        return Ok(Exit::Failed);
    }
    let api: Api<Node> = Api::all(client);
    let nodes = conn.list_all(&api, ListParams::default(), "nodes").await?;
    let (mut changed, mut failed) = (0, 0);
    let verb = if args.dry_run {
        "would remove"
    } else {
        "removed"
    };
    for node in nodes.items {
        let name = node.metadata.name.clone().unwrap_or_default();
        match clean(&args, &api, node).await {
            Ok(m) if m.is_empty() => {}
            Ok(m) => {
                changed += 1;
                println!("node/{name}: {verb} {}", m.describe());
            }
            Err(e) => {
                failed += 1;
                println!("node/{name}: FAILED: {e:#}");
            }
        }
    }
    let total = changed + failed;
    let clean = if nodes.truncated {
        "nodes read (the list was cut at --max-items; run again)"
    } else {
        "nodes"
    };
    println!(
        "cleanup: {changed} changed, {failed} failed, of {total} with meshgate's marks; taint {}; {clean}",
        conn.taint_key
    );
    Ok(if failed > 0 || nodes.truncated {
        Exit::Failed
    } else {
        Exit::Success
    })
}

/// Waits until no agent pod is listed; false (and the pods named) when `--timeout` passes.
async fn wait_for_agents(args: &Args, client: &kube::Client) -> anyhow::Result<bool> {
    let conn = &args.conn;
    let api: Api<Pod> = Api::namespaced(client.clone(), &conn.namespace);
    let deadline = tokio::time::Instant::now() + args.timeout;
    let params = ListParams::default().labels(&args.agent_selector);
    loop {
        let left = conn.list_all(&api, params.clone(), "agent pods").await?;
        if left.items.is_empty() {
            return Ok(true);
        }
        if tokio::time::Instant::now() + POLL > deadline {
            let names: Vec<String> = left
                .items
                .iter()
                .filter_map(|p| p.metadata.name.clone())
                .collect();
            println!(
                "cleanup: {} agent pod(s) still in {} after {:?} ({}); nothing cleaned: a running agent would put its marks back",
                names.len(),
                conn.namespace,
                args.timeout,
                names.join(", ")
            );
            return Ok(false);
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Cleans one Node: what it removed (empty when the Node was clean or is gone).
async fn clean(args: &Args, api: &Api<Node>, mut node: Node) -> anyhow::Result<Marks> {
    let conn = &args.conn;
    let name = node.metadata.name.clone().unwrap_or_default();
    let found = cleanup::marks(&node, &conn.taint_key);
    let params = if args.dry_run {
        PatchParams::default().dry_run()
    } else {
        PatchParams::default()
    };
    for _ in 0..MAX_ATTEMPTS {
        let write = if let Some(p) = cleanup::metadata_patch(&node, &conn.taint_key) {
            patch(conn, api, &name, &params, p, false).await
        } else if let Some(p) = cleanup::status_patch(&node) {
            patch(conn, api, &name, &params, p, true).await
        } else {
            return Ok(found);
        };
        node = match write {
            // A dry run changes nothing: what it would do next is planned from the answer.
            Ok(updated) if !args.dry_run => updated,
            Ok(_) => return Ok(found),
            Err(e) if is_not_found(&e) => return Ok(Marks::default()),
            Err(e) if is_conflict(&e) => {
                tracing::debug!(node = %name, "the node changed under us; re-reading");
                match conn.call("reading the node", api.get(&name)).await {
                    Ok(n) => n,
                    Err(e) if is_not_found(&e) => return Ok(Marks::default()),
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        };
    }
    anyhow::bail!("the node kept changing under {MAX_ATTEMPTS} read-modify-write attempts")
}

async fn patch(
    conn: &Conn,
    api: &Api<Node>,
    name: &str,
    params: &PatchParams,
    ops: Value,
    status: bool,
) -> anyhow::Result<Node> {
    let ops: json_patch::Patch = serde_json::from_value(ops)?;
    let patch = Patch::<()>::Json(ops);
    if status {
        conn.call(
            "removing the condition",
            api.patch_status(name, params, &patch),
        )
        .await
    } else {
        conn.call(
            "removing the taint and label",
            api.patch(name, params, &patch),
        )
        .await
    }
}
