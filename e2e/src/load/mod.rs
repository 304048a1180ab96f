//! Load and abuse for the benchmarks and the fault suite.
//!
//! In: a webhook's or agent's address. Out: AdmissionReview load over real TLS with its
//! latencies ([`review`]), abusive HTTP clients and peak-memory readings ([`http_abuse`]), and
//! the quantiles the benchmarks report ([`stats`]).

pub mod http_abuse;
pub mod review;
pub mod stats;
