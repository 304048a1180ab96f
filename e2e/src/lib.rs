//! meshgate-e2e: a real local Kubernetes control plane for meshgate's end-to-end tests and demo.
//!
//! In: etcd (Debian's `etcd-server`) and kube-apiserver, kube-controller-manager,
//! kube-scheduler and kubectl built by `e2e/install-deps.sh` for the Kubernetes version pinned
//! in the workspace Cargo.toml. Out, by folder:
//!
//! - [`harness`]: the [`ControlPlane`] on loopback ports (RBAC, client-cert admin identity,
//!   service-account tokens, controllers and scheduler), its PKI, processes, paths, waits,
//!   errors, audit log and host checks;
//! - [`sim`]: the stand-ins most tests run on: a kubelet that registers Nodes and runs their
//!   pods, a node's CNI dirs and agent, pods, pod network namespaces and the webhook's wiring;
//! - [`real`]: real nodes (a kubelet, containerd with Istio's real CNI plugin, and kube-proxy,
//!   each node in its own network and mount namespaces), a cluster of them with meshgate
//!   installed from its own Helm chart, and the story of meshgate's main job that the e2e suite
//!   and the demo ([`demo`]) tell;
//! - [`load`]: an AdmissionReview load generator, abusive HTTP clients with peak-memory
//!   readings, and the quantiles the benchmarks report.
//!
//! Tests share one control plane per test binary through [`ControlPlane::shared`] and isolate
//! themselves with their own namespace ([`ControlPlane::create_namespace`]) and node names
//! ([`unique_name`]).

pub mod demo;
pub mod harness;
pub mod load;
pub mod real;
pub mod sim;

pub use harness::control_plane::{ControlPlane, Options, Ports, unique_name};
pub use harness::error::Error;
pub use harness::identity::{TokenOptions, service_account_token};
pub use harness::paths::{Binaries, kubernetes_version};
pub use sim::kubelet::{NodeSpec, PodRunner, mark_pod_running, sequential_ips};
