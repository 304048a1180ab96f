//! Load and abuse for the benchmarks and the fault suite.
//!
//! In: a webhook's, agent's or apiserver's address. Out: AdmissionReview load over real TLS
//! with its latencies ([`review`]), open-loop API writes through the apiserver ([`api`]),
//! abusive HTTP clients and peak-memory readings ([`http_abuse`]), the quantiles the
//! benchmarks report ([`stats`]), the server-side histograms they scrape ([`histogram`]), and
//! what a fleet of real agents costs the apiserver ([`agent_cost`]).

pub mod agent_cost;
pub mod api;
pub mod histogram;
pub mod http_abuse;
pub mod review;
pub mod stats;
