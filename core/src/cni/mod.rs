//! CNI chain verification, decided exactly as a container runtime would load the config.
//!
//! In: a listing of the CNI config directory with each file's bytes ([`listing`]), the
//! runtime's loading semantics, the required chained plugin types, and a closure that
//! reports what each plugin binary answered to `CNI_COMMAND=VERSION` ([`probe`]).
//! Out: a [`Verdict`]: one contract reason, a human message naming the effective file and
//! the offending plugin, and the chain's plugin types.
//!
//! The closure is the only way binaries are looked at, so this module stays free of I/O: the
//! agent passes a prober that executes binaries, the tests pass plain data.

pub mod config;
pub mod listing;
pub mod probe;
pub mod select;
pub mod verdict;

pub use config::{ConfigError, NetConfList, PluginConf};
pub use listing::{DirEntry, EntryKind};
pub use probe::{Broken, ProbeOutcome};
pub use select::{EffectiveConfig, Runtime};
pub use verdict::{Reason, Verdict, VerifyOptions, verify};
