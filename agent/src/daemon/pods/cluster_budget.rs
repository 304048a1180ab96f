//! The cluster-wide eviction budget, taken before each eviction (`core::cluster_budget`).
//!
//! In: the [`Budget`] (`--cluster-eviction-budget`, `--cluster-eviction-budget-window`), the
//! ledger ConfigMap in meshgate's namespace (`--namespace`), a client as the ServiceAccount
//! (nodes may not write ConfigMaps), a deadline per call. Out: `Ok` once one eviction is
//! taken (the ledger written back with it, conditional on the version read), or why not.
//! Another agent writing first (409) makes it read again after a jittered, doubling backoff,
//! at most [`ATTEMPTS`] times, then defers as if spent; the ConfigMap missing, unreadable or
//! any failed call refuses: no eviction without the budget.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use meshgate_core::cluster_budget::{self, Budget, CONFIGMAP, KEY};
use meshgate_core::field_manager;

/// Reads of the ledger per eviction when other agents keep writing first.
const ATTEMPTS: u32 = 10;
/// The first retry's backoff ceiling; it doubles each attempt up to [`MAX_BACKOFF`], and each
/// wait is drawn at random below its ceiling (full jitter), so a fleet of agents racing for
/// the last evictions spreads out instead of colliding again in step.
const FIRST_BACKOFF: Duration = Duration::from_millis(20);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// Why no eviction was taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deferral {
    /// True when the budget is spent, or other agents kept taking from it first; false when
    /// the ledger could not be used (missing, unreadable, the API failing): the two are told
    /// apart in the pod's Event.
    pub spent: bool,
    /// In words, for the Event and the log.
    pub why: String,
}

impl Deferral {
    fn unusable(why: String) -> Self {
        Self { spent: false, why }
    }
}

/// A wait below `ceiling`, drawn from the clock's nanoseconds (no RNG needed for jitter).
fn jitter(ceiling: Duration) -> Duration {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::from(d.subsec_nanos()));
    let ceiling_us = (ceiling.as_micros() as u64).max(1);
    Duration::from_micros(nanos.wrapping_mul(0x9E37_79B9_7F4A_7C15) % ceiling_us)
}

/// Why a write of the ledger did not land.
enum WriteError {
    /// Another agent wrote it since it was read.
    Conflict,
    /// Anything else, in words.
    Failed(String),
}

/// The budget and where its ledger is.
#[derive(Clone)]
pub struct ClusterBudget {
    api: Api<ConfigMap>,
    namespace: String,
    budget: Budget,
    timeout: Duration,
}

impl ClusterBudget {
    /// The budget whose ledger is `CONFIGMAP` in `namespace`, written by `client`.
    pub fn new(client: kube::Client, namespace: &str, budget: Budget, timeout: Duration) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_owned(),
            budget,
            timeout,
        }
    }

    /// Takes one eviction, or says why not.
    pub async fn take(&self) -> Result<(), Deferral> {
        let mut ceiling = FIRST_BACKOFF;
        for attempt in 1..=ATTEMPTS {
            let mut ledger = self.read().await?;
            let data = ledger.data.get_or_insert_with(Default::default);
            let now_ms = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            let next = cluster_budget::take(data.get(KEY).map(String::as_str), self.budget, now_ms)
                .map_err(|e| Deferral {
                    spent: matches!(e, cluster_budget::Refused::Exhausted { .. }),
                    why: e.to_string(),
                })?;
            data.insert(KEY.to_owned(), next);
            match self.write(&ledger).await {
                Ok(()) => return Ok(()),
                Err(WriteError::Failed(e)) => return Err(Deferral::unusable(e)),
                Err(WriteError::Conflict) if attempt < ATTEMPTS => {
                    // Another agent took one first: read its ledger again, later.
                    tokio::time::sleep(jitter(ceiling)).await;
                    ceiling = (ceiling * 2).min(MAX_BACKOFF);
                }
                Err(WriteError::Conflict) => break,
            }
        }
        Err(Deferral {
            spent: true,
            why: format!(
                "the cluster-wide eviction budget is contended: other agents took from it first {ATTEMPTS} times in a row (ConfigMap {}/{CONFIGMAP})",
                self.namespace
            ),
        })
    }

    async fn read(&self) -> Result<ConfigMap, Deferral> {
        let what = || {
            format!(
                "cannot read the cluster-wide eviction ledger (ConfigMap {}/{CONFIGMAP})",
                self.namespace
            )
        };
        match tokio::time::timeout(self.timeout, self.api.get(CONFIGMAP)).await {
            Ok(Ok(cm)) => Ok(cm),
            Ok(Err(e)) => Err(Deferral::unusable(format!("{}: {e}", what()))),
            Err(_) => Err(Deferral::unusable(format!(
                "{}: no answer within {:?}",
                what(),
                self.timeout
            ))),
        }
    }

    /// Writes the ledger back, if nobody wrote it since it was read (its resourceVersion).
    async fn write(&self, ledger: &ConfigMap) -> Result<(), WriteError> {
        let pp = PostParams {
            field_manager: Some(field_manager::AGENT.into()),
            ..PostParams::default()
        };
        match tokio::time::timeout(self.timeout, self.api.replace(CONFIGMAP, &pp, ledger)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(kube::Error::Api(s))) if s.code == 409 => Err(WriteError::Conflict),
            Ok(Err(e)) => Err(WriteError::Failed(format!(
                "cannot write the cluster-wide eviction ledger: {e}"
            ))),
            Err(_) => Err(WriteError::Failed(format!(
                "cannot write the cluster-wide eviction ledger: no answer within {:?}",
                self.timeout
            ))),
        }
    }
}
