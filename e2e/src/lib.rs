//! meshgate-e2e: a real local Kubernetes control plane for meshgate's end-to-end tests and demo.
//!
//! In: etcd (Debian's `etcd-server`) and kube-apiserver, kube-controller-manager,
//! kube-scheduler and kubectl built by `e2e/install-deps.sh` for the Kubernetes version pinned
//! in the workspace Cargo.toml. Out: a [`ControlPlane`] on loopback ports with RBAC, client-cert
//! admin identity, service-account tokens, working controllers and scheduler; fresh
//! `kube::Client`s; a kubelet stand-in ([`kubelet`]) that registers Nodes and runs their pods;
//! and ServiceAccount tokens ([`identity`]) so components run under their real identities.
//!
//! The real-node tier ([`real_node`]) adds real nodes, each in its own network and mount
//! namespaces: a kubelet, containerd (runc, the reference CNI plugins, local images, Istio's
//! real CNI plugin) and kube-proxy, registered against a routable control plane.
//! [`real_cluster`] installs meshgate on them from its own manifests, and [`real_story`] tells
//! meshgate's main job there, for the e2e suite and for the demo ([`demo`]).
//!
//! Beside it, the simulated pieces the tests and the benchmarks share: a node's CNI
//! dirs and agent ([`node_sim`]), pods ([`pod_sim`]), pod network namespaces ([`netns_sim`]),
//! the webhook's wiring ([`webhook_sim`]), a load generator for it ([`review_load`]), abusive
//! HTTP clients and peak-memory readings for the fault suite ([`http_abuse`]) and the
//! quantiles the benchmarks report ([`stats`]).
//!
//! Tests share one control plane per test binary through [`ControlPlane::shared`] and isolate
//! themselves with their own namespace ([`ControlPlane::create_namespace`]) and node names
//! ([`unique_name`]).

pub mod audit;
pub mod control_plane;
pub mod demo;
mod error;
pub mod host_check;
mod hostnet;
pub mod http_abuse;
pub mod identity;
pub mod kubelet;
pub mod netns_sim;
mod node_mounts;
pub mod node_sim;
pub mod paths;
pub mod pki;
pub mod pod_sim;
mod process;
pub mod real_cluster;
pub mod real_node;
pub mod real_story;
pub mod review_load;
pub mod stats;
pub mod wait;
pub mod webhook_sim;

pub use control_plane::{ControlPlane, Options, Ports, unique_name};
pub use error::Error;
pub use identity::{TokenOptions, service_account_token};
pub use kubelet::{NodeSpec, PodRunner, mark_pod_running, sequential_ips};
pub use paths::{Binaries, kubernetes_version};
