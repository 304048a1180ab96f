//! `meshgate-e2e demo`: meshgate's main job end to end on real nodes, told as a timeline a
//! newcomer can follow without reading code.
//!
//! In: root, the Kubernetes and node binaries `e2e/install-deps.sh` caches (kubelet,
//! containerd, runc, istio-cni, images), meshgate's image (`make demo` builds it) and the
//! built `meshgate-agent` (the demo runs `meshgate-agent inspect` on pods as an operator
//! would). Out: a timeline on stdout, `kubectl describe node` excerpts, the agent's metric
//! lines, a one-line summary, and an exit code (0 when every step behaved as meshgate
//! promises). If a part of a real node cannot start, the demo fails with a message naming that
//! part; it never falls back to a stand-in. Everything it starts is torn down at the end, on an
//! error, and on Ctrl-C.
//!
//! The story itself is [`crate::real::story`], which the e2e suite runs too.

use std::time::Instant;

use crate::real::story::{self, Narrator};

/// Prints timeline lines with the time since the demo started.
struct Timeline(Instant);

impl Narrator for Timeline {
    fn say(&self, line: &str) {
        println!("[{:>7.3}s] {line}", self.0.elapsed().as_secs_f64());
    }
    fn detail(&self, text: &str) {
        for line in text.lines() {
            println!("            {line}");
        }
    }
}

/// Runs the demo; returns the summary line on success.
pub async fn run() -> anyhow::Result<String> {
    println!(
        "meshgate demo: real nodes (kubelet, containerd, runc), Istio's real CNI plugin, and meshgate installed from its Helm chart on a local kube-apiserver\n"
    );
    let started = Instant::now();
    let outcome = story::run(&Timeline(started)).await?;
    Ok(format!(
        "demo OK in {:.0}s: node gated until verified, untainted in {} ms, re-tainted on drift in {} ms, {} un-redirected pod evicted, 1 meshed pod refused",
        started.elapsed().as_secs_f64(),
        outcome.untaint_after_write.as_millis(),
        outcome.retaint_after_drift.as_millis(),
        outcome.evicted
    ))
}
