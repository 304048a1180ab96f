//! meshgate's end-to-end tests: ONE test binary against ONE real control plane per run.
//!
//! In: the binaries `e2e/install-deps.sh` built (found through `MESHGATE_K8S_BIN_DIR` or the
//! cache), root. Out: pass/fail. Every test takes the shared control plane from
//! [`cp`], creates its own namespace and nodes with unique names, and selects only its own
//! nodes, so tests run in parallel without seeing each other. One module per area.

mod abuse;
mod abuse_flood;
mod abuse_pods;
mod affinity;
mod agent;
mod agents_cost;
mod ambient;
mod ambient_real;
mod apf;
mod authz;
mod control_plane;
mod dashboard;
mod faults;
mod field_managers;
mod fleet;
mod modes;
mod nrc;
mod outage;
mod placement;
mod plugin;
mod pods;
mod policy;
mod rbac;
mod reach;
mod real_node;
mod storm;
mod support;
mod taint_key;
mod uninstall;
mod webhook;

use std::time::Duration;

use meshgate_e2e::ControlPlane;

/// Upper bound for anything a test waits on (scheduling, controllers, status updates).
pub const WAIT: Duration = Duration::from_secs(60);

/// The shared control plane, started on first use and stopped when the binary exits.
/// A missing binary or a non-root user fails the test with the harness's explanation.
pub async fn cp() -> &'static ControlPlane {
    init_logging();
    match ControlPlane::shared().await {
        Ok(cp) => cp,
        Err(e) => panic!("cannot start the e2e control plane: {e}"),
    }
}

/// Test logging (`RUST_LOG`, default `meshgate_e2e=info`), for tests that start a control
/// plane of their own.
pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "meshgate_e2e=info".into()),
        )
        .with_test_writer()
        .try_init();
}
