//! Agents: what each agent costs the apiserver, at N = 10, 100 and 1,000 stand-in Nodes
//! (`MESHGATE_BENCH_AGENTS`), each with a real `meshgate-agent run` process, all under one
//! audited ServiceAccount per N. Per agent in a steady window (`..._WINDOW_SECS`, 60):
//! requests per minute by kind, LISTs (goal 0), open watches, bytes received, CPU; per
//! transition of one node (re-taint, untaint; `..._TRANSITIONS`, 3); a fleet-wide event (every
//! node's chain broken at once, then mended: when every Node was re-tainted, then re-verified,
//! the agents' peak requests per second, eviction requests, and the release webhook's review
//! p99 throughout it against just before: [`hook`]); the reconnect after the
//! apiserver is stopped for `..._DOWN_SECS` (10): peak requests per second, when every watch
//! was back, when the burst ended (observed for `..._OBSERVE_SECS`, 90). Figures at each N
//! are ratios to N = 10 of the same run: flat means linear total cost. The figures against N
//! are drawn into `MESHGATE_BENCH_AGENTS_SVG` (`target/bench/agents-cost.svg`).
//!
//! Every agent runs with `--fs-watch=poll` (`..._FS_WATCH`, `..._POLL`: 1s): one host holds
//! them all, and the host user's `fs.inotify.max_user_instances` (128) would let only the
//! first ~100 use inotify, mixing two ways of seeing the event at N = 1,000 and starving the
//! host's other inotify users (the e2e nodes' containerd and kubelets). Agents start in
//! batches while the host has room (memory beyond `..._RESERVE_MIB`, 4096; inotify instances
//! too when they use inotify); an N that does not fit runs as many as fit, and the table says
//! so.

mod hook;

use super::*;
use meshgate_e2e::load::agent_cost::event::FleetEvent;
use meshgate_e2e::load::agent_cost::{Fleet, Reconnect, Room, Steady, Transition, tally};
use meshgate_e2e::load::plot;

/// Reads one figure of an N.
type Of = fn(&Figures) -> f64;

fn ratio_of(v: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}×", v / b)
    } else {
        "—".into()
    }
}

/// One N's figures, per agent unless named otherwise.
struct Figures {
    asked: usize,
    ran: usize,
    short: Option<String>,
    started_in: Duration,
    per_min: f64,
    kinds_per_min: BTreeMap<String, f64>,
    lists: usize,
    watches: f64,
    open: BTreeMap<String, usize>,
    kib_per_min: f64,
    transition: BTreeMap<String, f64>,
    transition_total: f64,
    reconnect: Reconnect,
    busiest_steady: usize,
    rss_mib: f64,
    /// CPU milliseconds per agent per minute, steady.
    cpu_ms_per_min: f64,
    event: FleetEvent,
    /// The webhook's reviews before and during the event.
    hook: hook::Readings,
}

fn agent_counts() -> Vec<usize> {
    std::env::var("MESHGATE_BENCH_AGENTS")
        .unwrap_or_else(|_| "10,100,1000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .filter(|&n| n > 0)
        .collect()
}

pub(super) async fn run(
    cp: &ControlPlane,
    client: &Client,
    ns: &str,
    table: &mut Table,
) -> anyhow::Result<()> {
    let mut all = Vec::new();
    for n in agent_counts() {
        eprintln!("agents: {n} agent processes ...");
        let f = measure(cp, client, ns, n)
            .await
            .with_context(|| format!("{n} agents"))?;
        all.push(f);
    }
    print_curves(&all);
    print_events(&all);
    rows(table, &all);
    if all.len() > 1 {
        let path = draw(&all)?;
        println!("\nagents: cost against N drawn into {}", path.display());
    }
    Ok(())
}

/// `--fs-watch` and `--fs-poll-interval` of every agent, and whether they use inotify.
fn watch_flags() -> (Vec<String>, bool) {
    let mode = std::env::var("MESHGATE_BENCH_AGENTS_FS_WATCH").unwrap_or_else(|_| "poll".into());
    let every = std::env::var("MESHGATE_BENCH_AGENTS_POLL").unwrap_or_else(|_| "1s".into());
    let inotify = mode != "poll";
    let flags = vec![
        "--fs-watch".into(),
        mode,
        "--fs-poll-interval".into(),
        every,
    ];
    (flags, inotify)
}

async fn measure(
    cp: &ControlPlane,
    client: &Client,
    ns: &str,
    n: usize,
) -> anyhow::Result<Figures> {
    let id = AuditedIdentity::new(cp, client, ns, &format!("agents-{n}")).await?;
    let (flags, inotify) = watch_flags();
    let room = Room {
        reserve_kib: env_num("MESHGATE_BENCH_AGENTS_RESERVE_MIB", 4096) * 1024,
        batch: 25,
        inotify,
    };
    agent_log("warn");
    let prefix = meshgate_e2e::unique_name(&format!("ag{n}"));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let fleet = Fleet::start(cp, client, &id.kubeconfig, &prefix, n, room, &flags).await?;
    let ran = fleet.members.len();
    eprintln!(
        "agents: {ran} of {n} verified in {:.1} s{}",
        fleet.started_in.as_secs_f64(),
        fleet
            .short
            .as_deref()
            .map(|s| format!(" (stopped: {s})"))
            .unwrap_or_default()
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    let window = Duration::from_secs(env_num("MESHGATE_BENCH_AGENTS_WINDOW_SECS", 60));
    let cpu_before = fleet.cpu();
    let steady = Steady::measure(cp, &id, &fleet, window).await?;
    let cpu = fleet.cpu().saturating_sub(cpu_before);
    let kinds_per_min = tally::by_kind(&steady.requests)
        .into_iter()
        .map(|(k, c)| (k, steady.per_agent_per_min(ran, c as f64)))
        .collect();
    let transition = transitions(cp, client, &id, &fleet).await?;
    let transition_total = transition.values().sum();
    eprintln!("agents: fleet-wide event on {ran} nodes ...");
    let chains = (
        golden("calico.conflist")?,
        golden("calico-linkerd.conflist")?,
    );
    let names: Vec<String> = fleet.members.iter().map(|m| m.name.clone()).collect();
    let webhook = hook::Hook::start(cp, client, &prefix, &names).await?;
    let (event, hook) = webhook
        .around(FleetEvent::run(
            cp,
            client,
            &id,
            &fleet,
            (&chains.0, &chains.1),
            Duration::from_secs(2),
        ))
        .await?;
    drop(webhook);
    let rss: Vec<u64> = fleet.rss_kib();
    let rss_mib = rss.iter().sum::<u64>() as f64 / rss.len().max(1) as f64 / 1024.0;
    let watches: usize = steady.open.values().sum();
    let busiest_steady = steady.busiest_second();
    let phases = (
        Duration::from_secs(env_num("MESHGATE_BENCH_AGENTS_DOWN_SECS", 10)),
        Duration::from_secs(env_num("MESHGATE_BENCH_AGENTS_OBSERVE_SECS", 90)),
    );
    eprintln!("agents: apiserver restart with {ran} agents ...");
    let reconnect = Reconnect::run(cp, &id, watches, phases, busiest_steady).await?;
    let figures = Figures {
        asked: n,
        ran,
        short: fleet.short.clone(),
        started_in: fleet.started_in,
        per_min: steady.per_agent_per_min(ran, steady.requests.len() as f64),
        kinds_per_min,
        lists: tally::lists(&steady.requests),
        watches: watches as f64 / ran.max(1) as f64,
        open: steady.open.clone(),
        kib_per_min: steady.per_agent_per_min(ran, steady.bytes as f64 / 1024.0),
        transition,
        transition_total,
        reconnect,
        busiest_steady,
        rss_mib,
        cpu_ms_per_min: steady.per_agent_per_min(ran, cpu.as_secs_f64() * 1000.0),
        event,
        hook,
    };
    drop(fleet);
    id.remove(client).await;
    Ok(figures)
}

/// Mean requests by kind per transition (re-taint and untaint counted apart).
async fn transitions(
    cp: &ControlPlane,
    client: &Client,
    id: &AuditedIdentity,
    fleet: &Fleet,
) -> anyhow::Result<BTreeMap<String, f64>> {
    let count = env_num("MESHGATE_BENCH_AGENTS_TRANSITIONS", 3) as usize;
    let (invalid, valid) = (
        golden("calico.conflist")?,
        golden("calico-linkerd.conflist")?,
    );
    let mut sum: BTreeMap<String, f64> = BTreeMap::new();
    let mut halves = 0usize;
    for member in fleet.members.iter().take(count) {
        let t = Transition::run(
            cp,
            client,
            id,
            member,
            (&invalid, &valid),
            Duration::from_secs(1),
        )
        .await?;
        for (half, requests) in [("re-taint", &t.retaint), ("untaint", &t.untaint)] {
            for (kind, c) in tally::by_kind(requests.iter()) {
                *sum.entry(format!("{half}: {kind}")).or_default() += c as f64;
            }
        }
        halves += 1;
    }
    Ok(sum
        .into_iter()
        .map(|(k, v)| (k, v / halves.max(1) as f64))
        .collect())
}

fn ran_label(f: &Figures) -> String {
    if f.ran == f.asked {
        format!("N={}", f.ran)
    } else {
        format!("N={} (ran {})", f.asked, f.ran)
    }
}

/// The per-N tables, straight to stdout.
fn print_curves(all: &[Figures]) {
    println!(
        "\nWhat each agent costs the apiserver (per agent unless named; ratio: to the first N of this run):\n"
    );
    println!(
        "| N | agents run | start+verify | req/min | LIST (window) | open watches | KiB/min received | CPU ms/min | req per round trip | restart: peak req/s (fleet) | watches back | burst over | RSS MiB |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let base = all.first();
    for f in all {
        let r = |v: f64, b: fn(&Figures) -> f64| match base {
            Some(b0) if b(b0) > 0.0 => format!("{v:.2} ({:.2}×)", v / b(b0)),
            _ => format!("{v:.2}"),
        };
        println!(
            "| {} | {} | {:.0} s | {} | {} | {} | {} | {} | {} | {} | {} | {} s | {:.1} |",
            f.asked,
            f.ran,
            f.started_in.as_secs_f64(),
            r(f.per_min, |f| f.per_min),
            f.lists,
            r(f.watches, |f| f.watches),
            r(f.kib_per_min, |f| f.kib_per_min),
            r(f.cpu_ms_per_min, |f| f.cpu_ms_per_min),
            r(f.transition_total, |f| f.transition_total),
            f.reconnect.peak(),
            f.reconnect
                .rewatched
                .map_or("not within the window".into(), |d| format!(
                    "{:.1} s",
                    d.as_secs_f64()
                )),
            f.reconnect.settled.as_secs(),
            f.rss_mib,
        );
    }
    for f in all {
        println!(
            "\n{}: steady requests per minute per agent by kind {:?}; open watches {:?}; per round trip {:?}; restart: apiserver down {:?}, requests per second after it was back {:?} (a second counts as burst above {} requests, the busiest second of the steady window), requests after it by kind {:?}{}",
            ran_label(f),
            f.kinds_per_min,
            f.open,
            f.transition,
            f.reconnect.down,
            f.reconnect.per_second,
            f.busiest_steady,
            tally::by_kind(&f.reconnect.requests),
            f.short
                .as_deref()
                .map(|s| format!("; stopped short of {}: {s}", f.asked))
                .unwrap_or_default(),
        );
    }
}

/// The fleet-wide event at each N, against the first N of the run.
fn print_events(all: &[Figures]) {
    println!(
        "\nFleet-wide event: every node's conflist rewritten without linkerd-cni at once, then written back (ratio: to the first N of this run):\n"
    );
    println!(
        "| N | all re-tainted | all re-verified | agents' peak req/s (fleet) | agents' requests per node | eviction requests (no pods on these Nodes) | webhook p50 / p99 during the event (× just before) |"
    );
    println!("|---|---|---|---|---|---|---|");
    let Some(base) = all.first() else { return };
    for f in all {
        let e = &f.event;
        let secs = |d: Duration, b: Duration| {
            format!(
                "{:.2} s ({})",
                d.as_secs_f64(),
                ratio_of(d.as_secs_f64(), b.as_secs_f64())
            )
        };
        let (b, d) = (&f.hook.before, &f.hook.during);
        let q = |r: &meshgate_e2e::load::review::Report, p: f64| r.latency(p);
        println!(
            "| {} | {} | {} | {} ({}) | {:.2} | {} | {} / {} ({} / {}) |",
            ran_label(f),
            secs(e.gated_in, base.event.gated_in),
            secs(e.verified_in, base.event.verified_in),
            e.peak(),
            ratio_of(e.peak() as f64, base.event.peak() as f64),
            event_requests_per_node(f),
            e.evictions,
            human(q(d, 0.5)),
            human(q(d, 0.99)),
            ratio_of(q(d, 0.5).as_secs_f64(), q(b, 0.5).as_secs_f64()),
            ratio_of(q(d, 0.99).as_secs_f64(), q(b, 0.99).as_secs_f64()),
        );
    }
    for f in all {
        println!(
            "\n{}: the webhook's reviews before the event: {}; during it: {}",
            ran_label(f),
            f.hook.before.summary(),
            f.hook.during.summary(),
        );
        println!(
            "\n{}: the event's requests by kind {:?}, per second from the first rewrite {:?}",
            ran_label(f),
            tally::by_kind(&f.event.requests),
            f.event.per_second,
        );
    }
}

fn event_requests_per_node(f: &Figures) -> f64 {
    f.event.requests.len() as f64 / f.ran.max(1) as f64
}

/// Draws the figures against N; where the SVG went.
fn draw(all: &[Figures]) -> anyhow::Result<PathBuf> {
    let line = |name: &str, of: Of| plot::Series {
        name: name.into(),
        // Log axes: a figure that is 0 at some N (steady requests) has no point there.
        points: all
            .iter()
            .map(|f| (f.ran as f64, of(f)))
            .filter(|&(_, y)| y > 0.0)
            .collect(),
    };
    let series = vec![
        line("open watches per agent", |f| f.watches),
        line("KiB/min received per agent, steady", |f| f.kib_per_min),
        line("CPU ms/min per agent, steady", |f| f.cpu_ms_per_min),
        line("requests per agent, one round trip", |f| f.transition_total),
        line(
            "requests per agent, fleet-wide event",
            event_requests_per_node,
        ),
        line("fleet-wide event: all re-tainted, s", |f| {
            f.event.gated_in.as_secs_f64()
        }),
        line("fleet-wide event: peak req/s, all agents", |f| {
            f.event.peak() as f64
        }),
        line("apiserver restart: peak req/s, all agents", |f| {
            f.reconnect.peak() as f64
        }),
    ];
    let svg = plot::svg(&plot::Chart {
        title: "What the agents cost the apiserver against N (real agents, one host)".into(),
        x_label: "agents = stand-in Nodes (log scale)".into(),
        y_label: "per agent unless named (log scale)".into(),
        series: series
            .into_iter()
            .filter(|s| !s.points.is_empty())
            .collect(),
    })?;
    plot::save(
        "MESHGATE_BENCH_AGENTS_SVG",
        "target/bench/agents-cost.svg",
        &svg,
    )
}

/// The main table's rows: each N against the first N of the run.
fn rows(table: &mut Table, all: &[Figures]) {
    let Some(base) = all.first() else { return };
    // Each figure against the first N; `true`: its goal is to stay flat in N.
    let figures: [(&str, Of, bool); 5] = [
        ("Agent API requests/min, steady", |f| f.per_min, true),
        ("Agent KiB/min received, steady", |f| f.kib_per_min, true),
        (
            "Agent requests per round trip (re-taint + untaint)",
            |f| f.transition_total,
            true,
        ),
        (
            "Fleet-wide event: every Node re-tainted, s",
            |f| f.event.gated_in.as_secs_f64(),
            false,
        ),
        (
            "Fleet-wide event: every Node re-verified, s",
            |f| f.event.verified_in.as_secs_f64(),
            false,
        ),
    ];
    for f in all {
        let at = ran_label(f);
        let base_label = format!("same at {}", ran_label(base));
        for (figure, of, flat) in figures {
            let (v, b) = (of(f), of(base));
            table.row(
                &format!("{figure}, {at}"),
                format!("{v:.2}"),
                &base_label,
                format!("{b:.2}"),
                ratio_of(v, b),
                if flat { "flat in N (≤ 1.5×)" } else { "—" },
                flat.then_some(v <= b * 1.5 + 1e-9),
            );
        }
        table.row(
            &format!("Agent LISTs in the steady window, {at} (all agents)"),
            f.lists.to_string(),
            "—",
            "—".into(),
            "—".into(),
            "0",
            Some(f.lists == 0),
        );
        let peak = |f: &Figures| f.reconnect.peak() as f64 / f.ran.max(1) as f64;
        table.row(
            &format!("Apiserver restart: peak req/s per agent, {at}"),
            format!("{:.2} ({} fleet)", peak(f), f.reconnect.peak()),
            &base_label,
            format!("{:.2}", peak(base)),
            ratio_of(peak(f), peak(base)),
            "—",
            None,
        );
    }
    table.note(
        "Agents: real meshgate-agent processes on one host against one loopback apiserver: no network latency, one clock (agents started together stay in phase), the CPUs shared with the control plane; each stand-in Node's Lease is renewed by the harness as the admin (not counted). Requests are the apiserver's audit log (the agents' ServiceAccount), bytes are the kernel's TCP counters of the agents' connections (TLS included). The kubelet's own request rate was not measured here (the kubelet stand-in is not the kubelet).".into(),
    );
}
