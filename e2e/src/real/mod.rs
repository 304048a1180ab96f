//! The real-node tier: real kubelets, containerd and kube-proxy beside the control plane.
//!
//! In: the node binaries and images `e2e/install-deps.sh` caches, root. Out: real nodes, each
//! in its own network and mount namespaces ([`node`], laid out by `mounts`), a routable
//! control plane with nodes added one by one and meshgate installed from its own Helm chart
//! ([`cluster`]), meshgate's main job told on them ([`story`]), and Istio ambient's node
//! components deployed on them ([`ambient`]).

pub mod ambient;
pub mod cluster;
pub(crate) mod mounts;
pub mod node;
pub mod story;
