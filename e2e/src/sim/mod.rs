//! The stand-ins: the parts of a node the fast tests, the fault suite and the benchmarks play
//! themselves instead of running a real kubelet and containerd.
//!
//! In: a [`crate::ControlPlane`]. Out: Nodes registered and their pods moved to Running
//! ([`kubelet`]), a node's CNI dirs and its agent process ([`node`]), pods ([`pod`]), pod
//! network namespaces with or without a mesh's rules ([`netns`]), and the shipped webhook
//! configurations pointed at a local webhook process ([`webhook`]).

pub mod kubelet;
pub mod netns;
pub mod node;
pub mod pod;
pub mod policy;
pub mod webhook;
