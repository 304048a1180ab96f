//! Test-side helpers shared by the e2e modules; the simulated node itself lives in the
//! library (`meshgate_e2e::node_sim`) so the demo and benchmarks use the same code.

use anyhow::Context;
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::Api;
use meshgate_e2e::wait::poll_until;

pub use meshgate_e2e::node_sim::{Agent, CniDirs, GOOD_PLUGIN, golden};

/// Waits until the Node satisfies `pred`; the error says what the Node looked like last.
pub async fn wait_node(
    client: &Client,
    name: &str,
    what: &str,
    pred: impl Fn(&Node) -> bool,
) -> anyhow::Result<Node> {
    let nodes: Api<Node> = Api::all(client.clone());
    poll_until(what, crate::WAIT, || {
        let nodes = nodes.clone();
        let pred = &pred;
        async move {
            let n = nodes.get(name).await?;
            anyhow::Ok(pred(&n).then_some(n))
        }
    })
    .await
    .with_context(|| format!("waiting for node {name}: {what}"))
}
