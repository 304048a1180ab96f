//! meshgate-shell: the process glue the agent and the webhook share.
//!
//! - [`runtime`]: the one start-up both daemons go through ([`runtime::Runtime::builder`]):
//!   stop requests, the client, the admin server and the live mode, in that order.
//! - [`admin`]: the `/live`, `/ready`, `/metrics` server.
//! - [`server`]: the bounded HTTP/1 server behind every port (connection cap, handshake and
//!   header timeouts, buffer cap, delay and drain), for the admin ports and the webhook.
//! - [`cli`]: the flags both daemons share ([`cli::Common`]) and the duration grammar.
//! - [`entry`]: logging, the allocator's bounds ([`alloc`]), the async runtime and the
//!   exit-code table ([`entry::Exit`]).
//! - [`alloc`]: glibc's arena count and mmap threshold, and a trim after large work.
//! - [`client`]: a `kube::Client` from `--kubeconfig` / `KUBECONFIG` / in-cluster config, with
//!   a connect timeout, and its variants (without kube's retry, impersonating).
//! - [`logging`]: tracing subscriber setup (`--log-format text|json`, `RUST_LOG`).
//! - [`profiles`]: the mesh profiles from `--profile` and `--profile-file`.
//! - [`shutdown`]: stop requests (SIGTERM, SIGINT or an embedder's future) in order, and
//!   [`shutdown::Aborted`] for one that cuts a drain.
//! - [`mode`]: the live mode (ConfigMap `meshgate-mode`) as a `watch` value, its flags and
//!   metrics.
//! - [`meta`]: object metadata with the labels and annotations left as JSON text, for caches
//!   that keep only the keys they read.

pub mod admin;
pub mod alloc;
pub mod cli;
pub mod client;
pub mod entry;
pub mod logging;
pub mod meta;
pub mod mode;
pub mod profiles;
pub mod runtime;
pub mod server;
pub mod shutdown;
