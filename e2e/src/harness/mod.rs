//! The harness itself: what every test, the demo and the benchmarks stand on.
//!
//! In: the binaries `e2e/install-deps.sh` built, root. Out: a running control plane
//! ([`control_plane`]) with its certificates ([`pki`]) and tokens ([`identity`]), tracked
//! processes (`process`), where things are ([`paths`]), bounded waits ([`wait`]), the
//! harness's errors ([`error`]), meshgate's chart rendered and installed with helm ([`helm`]),
//! the apiserver's audit log ([`audit`]), a real Prometheus ([`prometheus`]), the host's links and
//! routes for routable control planes and real nodes (`hostnet`), and what a real node needs
//! of the host ([`host_check`]).

pub mod audit;
pub mod control_plane;
pub mod error;
pub mod helm;
pub mod host_check;
pub(crate) mod hostnet;
pub mod identity;
pub mod paths;
pub mod pki;
pub(crate) mod process;
pub mod prometheus;
pub mod wait;
