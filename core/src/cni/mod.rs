//! CNI chain verification, decided exactly as a container runtime would load the config.
//!
//! In: a lazy view of the CNI config directory ([`listing::ConfSource`]), the runtime's
//! loading semantics, the required chained plugin types, and a closure that reports what
//! each plugin binary answered to `CNI_COMMAND=VERSION` ([`probe`]).
//! Out: a [`ChainVerdict`]: one contract reason, a message naming the effective file and the
//! offending position (never file content), and the chain's plugin types.
//!
//! The source and the closure are the only ways files and binaries are looked at, so this
//! module stays free of I/O: the agent passes a budgeted reader and a prober that executes
//! binaries, the tests pass plain data. JSON is decoded with Go's rules ([`gojson`]),
//! because libcni's Go decoder is what decides what the runtime loads.

mod binaries;
pub mod burst;
pub mod config;
pub mod gojson;
pub mod listing;
pub mod multus;
pub mod plan;
pub mod probe;
pub mod reason;
pub mod runtime;
pub mod select;
pub mod verdict;
pub mod watch_backend;

pub use config::{ConfigError, NetConfList, PluginConf};
pub use listing::{ConfSource, Dirent, MemSource, SourceError};
pub use probe::{Broken, ProbeOutcome};
pub use reason::Reason;
pub use runtime::{Runtime, RuntimeRules};
pub use select::EffectiveConfig;
pub use verdict::{ChainVerdict, DelegateView, VerifyOptions, verify};
