//! The kubectl plugin `kubectl-meshgate`: `status` (what meshgate says about the cluster,
//! from the API alone) and `cleanup` (meshgate's marks off every Node).
//!
//! In: the flags both subcommands share ([`Conn`]), and each one's own. Out: the report or
//! the summary on stdout, and the exit code from `shell::entry::Exit`. Every API call is
//! bounded by `--api-timeout`, every list is read in pages of `--page-size` and cut at
//! `--max-items`. The decisions are `meshgate_core::status` and `meshgate_core::cleanup`;
//! this module only reads and writes.

pub mod cleanup;
pub mod probe;
pub mod status;

use std::fmt::Debug;
use std::future::Future;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use kube::api::{Api, ListParams};
use meshgate_core::gate::TaintKey;
use meshgate_shell::cli::duration;
use meshgate_shell::entry::Exit;
use meshgate_shell::logging::{self, LogFormat};
use serde::de::DeserializeOwned;

/// meshgate's namespace, as the manifests install it.
pub const DEFAULT_NAMESPACE: &str = "meshgate-system";

/// The flags both subcommands take.
#[derive(Clone, Debug, clap::Args)]
pub struct Conn {
    /// Kubeconfig file; else `KUBECONFIG`, else `~/.kube/config`, else the in-cluster
    /// service account (as kubectl).
    #[arg(long, env = "MESHGATE_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use instead of its current one.
    #[arg(long, env = "MESHGATE_CONTEXT")]
    pub context: Option<String>,
    /// meshgate's namespace (its agents, the mode ConfigMap).
    #[arg(short = 'n', long, env = "MESHGATE_NAMESPACE", default_value = DEFAULT_NAMESPACE)]
    pub namespace: String,
    /// meshgate's taint key, as the agents and the webhook are configured (the keys it
    /// supersedes count as meshgate's too, as the agent removes them).
    #[arg(
        long,
        env = "MESHGATE_TAINT_KEY",
        default_value = meshgate_core::gate::DEFAULT_TAINT_KEY,
        value_parser = |s: &str| s.parse::<TaintKey>()
    )]
    pub taint_key: TaintKey,
    /// Deadline of each API call.
    #[arg(long, env = "MESHGATE_API_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub api_timeout: Duration,
    /// Objects asked for per list page.
    #[arg(long, env = "MESHGATE_PAGE_SIZE", default_value_t = 500,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub page_size: u32,
    /// Most objects read from one list (Nodes, Events, Pods); past it the list is cut and
    /// the output says so.
    #[arg(long, env = "MESHGATE_MAX_ITEMS", default_value_t = 20_000)]
    pub max_items: usize,
}

impl Conn {
    /// The API client, as kubectl would find its credentials.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        meshgate_shell::client::build_in_context(
            self.kubeconfig.as_deref(),
            self.context.as_deref(),
            meshgate_core::field_manager::PLUGIN,
        )
        .await
    }

    /// `f`, bounded by `--api-timeout`; `what` names the call in the error.
    pub async fn call<T>(
        &self,
        what: &str,
        f: impl Future<Output = kube::Result<T>>,
    ) -> anyhow::Result<T> {
        match tokio::time::timeout(self.api_timeout, f).await {
            Ok(r) => r.with_context(|| format!("{what} failed")),
            Err(_) => anyhow::bail!("{what} timed out after {:?}", self.api_timeout),
        }
    }

    /// Every object `params` selects, in pages, cut at `--max-items`.
    pub async fn list_all<K>(
        &self,
        api: &Api<K>,
        params: ListParams,
        what: &str,
    ) -> anyhow::Result<Listed<K>>
    where
        K: Clone + DeserializeOwned + Debug,
    {
        let mut params = params.limit(self.page_size);
        let mut items = Vec::new();
        loop {
            let page = self
                .call(&format!("listing {what}"), api.list(&params))
                .await?;
            items.extend(page.items);
            if items.len() >= self.max_items {
                let truncated = items.len() > self.max_items
                    || page
                        .metadata
                        .continue_
                        .as_deref()
                        .is_some_and(|c| !c.is_empty());
                items.truncate(self.max_items);
                return Ok(Listed { items, truncated });
            }
            match page.metadata.continue_ {
                Some(token) if !token.is_empty() => params = params.continue_token(&token),
                _ => {
                    return Ok(Listed {
                        items,
                        truncated: false,
                    });
                }
            }
        }
    }
}

/// A list, and whether it was cut at `--max-items`.
#[derive(Debug)]
pub struct Listed<K> {
    /// The objects read.
    pub items: Vec<K>,
    /// More were there.
    pub truncated: bool,
}

/// True for the answers of a guarded write whose guard failed: a stale resourceVersion
/// (409), or a JSON-patch `test` that did not hold (422).
pub fn is_conflict(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(c.downcast_ref::<kube::Error>(), Some(kube::Error::Api(s)) if s.code == 409 || s.code == 422)
    })
}

/// True when the API answered 404.
pub fn is_not_found(e: &anyhow::Error) -> bool {
    e.chain().any(
        |c| matches!(c.downcast_ref::<kube::Error>(), Some(kube::Error::Api(s)) if s.code == 404),
    )
}

/// Runs a subcommand on a small runtime: its exit code, or [`Exit::UsageOrIo`] (with the
/// error on stderr) when it could not do its work.
pub fn run_command(name: &str, command: impl Future<Output = anyhow::Result<Exit>>) -> ExitCode {
    logging::init(LogFormat::Text);
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kubectl-meshgate {name}: cannot start the async runtime: {e}");
            return Exit::UsageOrIo.into();
        }
    };
    match rt.block_on(command) {
        Ok(exit) => exit.into(),
        Err(e) => {
            eprintln!("kubectl-meshgate {name}: {e:#}");
            Exit::UsageOrIo.into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Request, Response};
    use k8s_openapi::api::core::v1::Node;
    use kube::client::Body;
    use serde_json::json;
    use std::pin::pin;
    use tower_test::mock;

    fn conn(page_size: u32, max_items: usize) -> Conn {
        Conn {
            kubeconfig: None,
            context: None,
            namespace: DEFAULT_NAMESPACE.into(),
            taint_key: TaintKey::default(),
            api_timeout: Duration::from_secs(5),
            page_size,
            max_items,
        }
    }

    fn page(names: &[&str], next: &str) -> Response<Body> {
        let items: Vec<_> = names
            .iter()
            .map(|n| json!({"metadata": {"name": n}}))
            .collect();
        let list = json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {"continue": next}, "items": items});
        Response::new(Body::from(serde_json::to_vec(&list).unwrap()))
    }

    /// Serves `pages` in order and returns the query strings it was asked with.
    fn serve(pages: Vec<Response<Body>>) -> (Api<Node>, tokio::task::JoinHandle<Vec<String>>) {
        let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let server = tokio::spawn(async move {
            let mut handle = pin!(handle);
            let mut queries = Vec::new();
            for p in pages {
                let (req, send) = handle.next_request().await.unwrap();
                let query = req.uri().query().unwrap_or_default();
                let parts: Vec<&str> = query.split('&').filter(|p| !p.is_empty()).collect();
                queries.push(parts.join("&"));
                send.send_response(p);
            }
            queries
        });
        (Api::all(kube::Client::new(svc, "default")), server)
    }

    #[tokio::test]
    async fn lists_follow_continue_tokens_in_pages() {
        let (api, server) = serve(vec![page(&["a", "b"], "t1"), page(&["c"], "")]);
        let listed = conn(2, 10)
            .list_all(&api, ListParams::default(), "nodes")
            .await
            .unwrap();
        assert_eq!(listed.items.len(), 3);
        assert!(!listed.truncated);
        let queries = server.await.unwrap();
        assert_eq!(queries[0], "limit=2");
        assert_eq!(queries[1], "limit=2&continue=t1");
    }

    #[tokio::test]
    async fn lists_are_cut_at_max_items_and_say_so() {
        let (api, server) = serve(vec![page(&["a", "b"], "t1"), page(&["c", "d"], "t2")]);
        let listed = conn(2, 3)
            .list_all(&api, ListParams::default(), "nodes")
            .await
            .unwrap();
        let names: Vec<_> = listed
            .items
            .iter()
            .filter_map(|n| n.metadata.name.as_deref())
            .collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert!(listed.truncated);
        assert_eq!(server.await.unwrap().len(), 2, "no page past the bound");
    }
}
