//! meshgate-fuzz: fixed-budget, seeded mutation fuzzing of every decoder that reads bytes an
//! attacker or a broken installer controls, on stable Rust (no nightly, no sanitizer runtime).
//!
//! In: committed seed corpora (`fuzz/corpus/<target>/`), committed regression inputs
//! (`fuzz/regressions/<target>/`), a seed for the random generator and a budget per target.
//! Out: a [`runner::Report`] per target, or a failure naming the input that panicked or ran
//! too long; that input is also written to `fuzz/artifacts/<target>/` so it can be replayed
//! and, once fixed, committed as a regression.
//!
//! - [`mutate`]: a small deterministic generator and byte-level plus JSON-aware mutations.
//! - [`runner`]: the loop: replay seeds and regressions, then mutate for the budget; catch
//!   panics; flag slow inputs; keep inputs whose outcome is new (a cheap stand-in for coverage
//!   feedback, so the loop explores the decoders' error paths rather than re-running one).
//! - [`targets`]: the decoders under test: CNI conflists through effective-config selection
//!   and verification, nf_tables netlink dumps and legacy `getsockopt` blobs through rule
//!   assembly and matching, and AdmissionReviews through the webhook's reviewer.
//!
//! Without coverage instrumentation this finds less than libFuzzer would; it exists so every
//! `make test` spends a few seconds per decoder on inputs no unit test thought of, with
//! reproducible results (same seed, same inputs).

pub mod mutate;
pub mod runner;
pub mod targets;
