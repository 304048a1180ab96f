//! Load and abuse for the benchmarks and the fault suite.
//!
//! In: a webhook's, agent's or apiserver's address. Out: AdmissionReview load over real TLS
//! with its latencies ([`review`]), Node objects at a cloud node's real size ([`cloud_node`]),
//! open-loop API writes through the apiserver ([`api`]), a closed-loop flood of API requests
//! from one identity and another client's probe beside it ([`flood`]), abusive HTTP clients
//! and peak-memory readings ([`http_abuse`]), a webhook that admits everything for baselines
//! ([`allow_all`]), the quantiles the benchmarks report ([`stats`]), line charts of their
//! figures as SVG ([`plot`]), the server-side histograms and counters they scrape
//! ([`histogram`]), and what a fleet of real agents costs the apiserver ([`agent_cost`]).

pub mod agent_cost;
pub mod allow_all;
pub mod api;
pub mod cloud_node;
pub mod flood;
pub mod histogram;
pub mod http_abuse;
pub mod plot;
pub mod review;
pub mod stats;
