//! The one-shot subcommands: `check` (the node's CNI chain, once) and `inspect` (one pod
//! network namespace, once).
//!
//! In: their parsed arguments. Out: the verdict on stdout (text or one JSON object) and the
//! exit code. They sit on top of the library modules and nothing below imports from here.

pub mod check;
pub mod inspect;

/// Output format of the one-shot subcommands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Human-readable lines.
    Text,
    /// One JSON object on stdout.
    Json,
}
