//! What each agent costs the apiserver, small and fast: ten real agent processes, one per
//! stand-in Node, all under one audited ServiceAccount, counted in the apiserver's audit log.
//!
//! `idle_agents_only_watch_and_a_transition_costs_a_bounded_handful`: once every Node is
//! verified, a steady window holds no LIST from any agent, and each agent has exactly its
//! four watches open (its Node, the pods bound to it, the mode ConfigMap, the Namespaces);
//! one node's round trip (the mesh plugin leaves its chain, then comes back) costs at most
//! [`PER_TRANSITION`] requests each way, none of them a LIST and none from the other nine.
//! It fails if an agent re-lists or polls within the window, opens a watch more or fewer, or
//! a transition grows extra calls. `make bench`'s `agents` section measures the same at 10,
//! 100 and 1,000 Nodes, and the reconnect after an apiserver restart.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::ensure;
use meshgate_e2e::harness::audit::AuditedIdentity;
use meshgate_e2e::load::agent_cost::{Fleet, Room, Steady, Transition, tally};
use meshgate_e2e::unique_name;

use crate::cp;
use crate::support::golden;

const AGENTS: usize = 10;

/// Requests an agent may make for one half of a round trip: the three writes it makes (the
/// Node's taint and label, `patch nodes`; its condition, `patch nodes/status`; the Event,
/// `create` or `patch events`), plus one conflict's re-read and re-write.
const PER_TRANSITION: usize = 5;

/// The watches each agent holds, by resource.
const WATCHES: [&str; 4] = ["configmaps", "namespaces", "nodes", "pods"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_agents_only_watch_and_a_transition_costs_a_bounded_handful() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let ns = cp.create_namespace(&client, "agents-cost").await?;
    let id = AuditedIdentity::new(cp, &client, &ns, "meshgate-agent").await?;
    let room = Room {
        reserve_kib: 512 * 1024,
        batch: AGENTS,
        inotify: true,
    };
    let prefix = unique_name("ac");
    let fleet = Fleet::start(cp, &client, &id.kubeconfig, &prefix, AGENTS, room, &[]).await?;
    ensure!(
        fleet.short.is_none(),
        "fleet stopped short: {:?}",
        fleet.short
    );
    // The initial lists and the first writes are done once every Node is verified; a
    // moment more lets the Events of the first verdicts land.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let steady = Steady::measure(cp, &id, &fleet, Duration::from_secs(5)).await?;
    let kinds = tally::by_kind(&steady.requests);
    println!(
        "{AGENTS} idle agents over {:?}: {kinds:?}, {} bytes received; open watches {:?}",
        steady.span, steady.bytes, steady.open
    );
    ensure!(
        tally::lists(&steady.requests) == 0,
        "agents listed in a steady window: {kinds:?}"
    );
    let want: BTreeMap<String, usize> = WATCHES
        .iter()
        .map(|r| (format!("watch {r}"), AGENTS))
        .collect();
    ensure!(
        steady.open == want,
        "open watches {:?}, want {want:?}",
        steady.open
    );
    for (node, watches) in &steady.open_by_node {
        ensure!(
            watches == &["nodes", "pods"],
            "{node}: its own open watches are {watches:?}, want [nodes, pods]"
        );
    }

    let (invalid, valid) = (
        golden("calico.conflist")?,
        golden("calico-linkerd.conflist")?,
    );
    let member = &fleet.members[0];
    let tail = Duration::from_secs(1);
    let t = Transition::run(cp, &client, &id, member, (&invalid, &valid), tail).await?;
    let names = fleet.names();
    for (half, requests) in [("re-taint", &t.retaint), ("untaint", &t.untaint)] {
        let kinds = tally::by_kind(requests.iter());
        println!("{half} of {}: {kinds:?}", member.name);
        ensure!(tally::lists(requests) == 0, "{half}: a LIST: {kinds:?}");
        ensure!(
            requests.len() <= PER_TRANSITION,
            "{half}: {} requests over the bound {PER_TRANSITION}: {kinds:?}",
            requests.len()
        );
        ensure!(
            requests.iter().any(|r| r.kind() == "patch nodes"),
            "{half}: no Node patch counted: {kinds:?}"
        );
        let others: Vec<_> = requests
            .iter()
            .filter_map(|r| tally::node_of(r, &names))
            .filter(|n| *n != member.name)
            .collect();
        ensure!(
            others.is_empty(),
            "{half}: other agents' requests: {others:?}"
        );
    }
    drop(fleet);
    id.remove(&client).await;
    Ok(())
}
