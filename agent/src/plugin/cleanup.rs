//! `kubectl meshgate cleanup`: takes meshgate's taint, label and condition off every Node and
//! leaves everything else as it is.
//!
//! In: [`Args`]. Out: one line per Node changed (`node/NAME: removed taint, label,
//! condition`), a summary line, and the exit code: 0 every Node is clean, 1 a Node could not
//! be cleaned or agents were still running at `--timeout`, 2 usage error or the Nodes could
//! not be listed. Idempotent: a clean Node costs no write. Nodes are read and cleaned one
//! list page at a time.
//!
//! With `--wait-for-agents` it first waits, within `--timeout`, until no meshgate agent pod is
//! left in meshgate's namespace (a running agent would put its marks back). The writes are
//! `core::cleanup`'s guarded JSON Patches (`nodes` for the taint and label, `nodes/status`
//! for the condition), under the field manager `meshgate-cleanup`; a Node that changed
//! meanwhile is re-read and re-planned, at most [`MAX_ATTEMPTS`] times.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams};
use meshgate_core::cleanup::{self, Marks};
use meshgate_core::field_manager;
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
    let tally = clean_all(&args, &api).await?;
    println!(
        "cleanup: {} changed, {} failed, of {} nodes (taint {})",
        tally.changed, tally.failed, tally.nodes, conn.taint_key
    );
    Ok(if tally.failed > 0 {
        Exit::Failed
    } else {
        Exit::Success
    })
}

/// How many Nodes were read, changed, and could not be cleaned.
#[derive(Debug, Default)]
struct Tally {
    nodes: usize,
    changed: usize,
    failed: usize,
}

/// Cleans every Node, one list page (`--page-size`) at a time, so memory holds one page
/// however many Nodes there are; a line per Node changed or failed.
async fn clean_all(args: &Args, api: &Api<Node>) -> anyhow::Result<Tally> {
    let conn = &args.conn;
    let verb = if args.dry_run {
        "would remove"
    } else {
        "removed"
    };
    let mut params = ListParams::default().limit(conn.page_size);
    let mut tally = Tally::default();
    loop {
        let page = conn.call("listing nodes", api.list(&params)).await?;
        for node in page.items {
            tally.nodes += 1;
            let name = node.metadata.name.clone().unwrap_or_default();
            match clean(args, api, node).await {
                Ok(m) if m.is_empty() => {}
                Ok(m) => {
                    tally.changed += 1;
                    println!("node/{name}: {verb} {}", m.describe());
                }
                Err(e) => {
                    tally.failed += 1;
                    println!("node/{name}: FAILED: {e:#}");
                }
            }
        }
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(tally),
        }
    }
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
    // JSON Patches, not server-side apply: an apply can only drop what its own field manager
    // owns, and these marks are owned by the agent (or by whoever else wrote them).
    let params = PatchParams {
        field_manager: Some(field_manager::CLEANUP.into()),
        dry_run: args.dry_run,
        ..PatchParams::default()
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

#[cfg(test)]
mod tests {
    //! The exact requests `clean` sends, against a tower-test mock.
    use super::*;
    use http::{Request, Response};
    use http_body_util::BodyExt;
    use kube::client::Body;
    use meshgate_core::gate::{CONDITION_TYPE, DEFAULT_TAINT_KEY as TAINT_KEY, VERIFIED_LABEL};
    use serde_json::json;
    use std::pin::pin;
    use tower_test::mock;

    fn args() -> Args {
        Args {
            conn: Conn {
                kubeconfig: None,
                context: None,
                namespace: "meshgate-system".into(),
                taint_key: TAINT_KEY.parse().unwrap(),
                api_timeout: Duration::from_secs(5),
                page_size: 500,
                max_items: 100,
            },
            wait_for_agents: false,
            timeout: Duration::from_secs(5),
            agent_selector: "app.kubernetes.io/name=meshgate-agent".into(),
            dry_run: false,
        }
    }

    fn node(rv: &str, taints: Value, condition: bool) -> Value {
        let mut conditions = vec![json!({"type": "Ready", "status": "True"})];
        if condition {
            conditions.push(json!({"type": CONDITION_TYPE, "status": "False"}));
        }
        json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "n1", "resourceVersion": rv, "labels": {VERIFIED_LABEL: "false"}},
            "spec": {"taints": taints},
            "status": {"conditions": conditions},
        })
    }

    fn respond(status: u16, body: &Value) -> Response<Body> {
        let bytes = serde_json::to_vec(body).unwrap();
        Response::builder()
            .status(status)
            .body(Body::from(bytes))
            .unwrap()
    }

    async fn body_json(req: Request<Body>) -> Value {
        serde_json::from_slice(&req.into_body().collect().await.unwrap().to_bytes()).unwrap()
    }

    /// A conflict re-reads the Node and re-plans from it, keeping the taint another writer
    /// added meanwhile; the condition goes through nodes/status, guarded by the new version.
    #[tokio::test]
    async fn a_conflict_is_re_planned_from_a_fresh_read() {
        let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let ours = json!({"key": TAINT_KEY, "effect": "NoSchedule"});
        let foreign = json!({"key": "example.com/new", "effect": "NoSchedule"});
        let server = tokio::spawn({
            let (ours, foreign) = (ours.clone(), foreign.clone());
            async move {
                let mut handle = pin!(handle);
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(req.uri().path(), "/api/v1/nodes/n1");
                assert_eq!(req.uri().query(), Some("&fieldManager=meshgate-cleanup"));
                assert_eq!(body_json(req).await[0]["value"], "1");
                let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Invalid", "code": 422, "message": "test failed"});
                send.send_response(respond(422, &status));
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(
                    (req.method(), req.uri().path()),
                    (&http::Method::GET, "/api/v1/nodes/n1")
                );
                send.send_response(respond(200, &node("2", json!([ours, foreign]), true)));
                let (req, send) = handle.next_request().await.unwrap();
                let patch = body_json(req).await;
                assert_eq!(patch[0]["value"], "2");
                assert_eq!(
                    patch[1],
                    json!({"op": "replace", "path": "/spec/taints", "value": [foreign]})
                );
                assert_eq!(
                    patch[2],
                    json!({"op": "remove", "path": "/metadata/labels/meshgate.io~1cni-verified"})
                );
                let mut cleaned = node("3", json!([foreign]), true);
                cleaned["metadata"]["labels"] = json!({});
                send.send_response(respond(200, &cleaned));
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(req.uri().path(), "/api/v1/nodes/n1/status");
                assert_eq!(req.uri().query(), Some("&fieldManager=meshgate-cleanup"));
                let patch = body_json(req).await;
                assert_eq!(patch[0]["value"], "3");
                assert_eq!(
                    patch[1],
                    json!({"op": "remove", "path": "/status/conditions/1"})
                );
                let mut done = cleaned.clone();
                done["status"]["conditions"] = json!([{"type": "Ready", "status": "True"}]);
                send.send_response(respond(200, &done));
                assert!(
                    tokio::time::timeout(Duration::from_millis(100), handle.next_request())
                        .await
                        .is_err(),
                    "nothing after the node is clean"
                );
            }
        });
        let api: Api<Node> = Api::all(kube::Client::new(svc, "default"));
        let seen: Node = serde_json::from_value(node("1", json!([ours]), true)).unwrap();
        let removed = clean(&args(), &api, seen).await.unwrap();
        assert_eq!(removed.describe(), "taint, label, condition");
        server.await.unwrap();
    }

    /// A Node that keeps changing is given up after MAX_ATTEMPTS rounds, not retried forever.
    #[tokio::test]
    async fn endless_conflicts_are_bounded() {
        let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let ours = json!({"key": TAINT_KEY, "effect": "NoSchedule"});
        let server = tokio::spawn({
            let ours = ours.clone();
            async move {
                let mut handle = pin!(handle);
                let mut patches = 0;
                while let Ok(Some((req, send))) =
                    tokio::time::timeout(Duration::from_millis(200), handle.next_request()).await
                {
                    if req.method() == http::Method::GET {
                        send.send_response(respond(200, &node("9", json!([ours]), false)));
                    } else {
                        patches += 1;
                        let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict", "code": 409, "message": "changed"});
                        send.send_response(respond(409, &status));
                    }
                }
                patches
            }
        });
        let api: Api<Node> = Api::all(kube::Client::new(svc, "default"));
        let seen: Node = serde_json::from_value(node("1", json!([ours]), false)).unwrap();
        let err = clean(&args(), &api, seen).await.unwrap_err();
        assert!(err.to_string().contains("kept changing"), "{err:#}");
        assert_eq!(server.await.unwrap(), MAX_ATTEMPTS);
    }
}
