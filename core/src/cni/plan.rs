//! Which plugin binaries a verification will ask about, before it asks, so the agent can
//! probe them in parallel.
//!
//! In: the same config view and options as [`verify`]. Out: the plugin types a verification
//! probes when every binary answers with every CNI spec version: the chain (and, for a Multus
//! entry, its delegate's) of the file the runtime would load, in the order the verification
//! asks. When a binary does fail, selection may go on to another file (CRI-O) and ask about
//! more types; those are probed as today, one by one, so the plan only has to be right for
//! the common case. It never decides anything: the verdict is [`verify`]'s, with real answers.

use super::listing::ConfSource;
use super::probe::ProbeOutcome;
use super::verdict::{VerifyOptions, verify};

/// Every CNI spec version libcni knows, so a planned binary never fails its version check.
const SPEC_VERSIONS: [&str; 7] = [
    "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0",
];

/// The plugin types a verification of `src` asks about when every binary answers, in order,
/// each once.
pub fn plugin_types(src: &mut dyn ConfSource, opts: &VerifyOptions) -> Vec<String> {
    let mut asked = Vec::new();
    let _ = verify(src, opts, |t| {
        asked.push(t.to_string());
        ProbeOutcome::Answered {
            path: String::new(),
            supported: SPEC_VERSIONS.iter().map(ToString::to_string).collect(),
        }
    });
    asked
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cni::{MemSource, Runtime};

    fn opts(runtime: Runtime) -> VerifyOptions {
        VerifyOptions {
            conf_dir: "/etc/cni/net.d".into(),
            runtime,
            required: vec!["istio-cni".into()],
            multus: Default::default(),
        }
    }

    #[test]
    fn the_effective_chain_is_planned_in_order() {
        let mut src = MemSource::new().file(
            "10-calico.conflist",
            br#"{"cniVersion":"0.3.1","name":"k8s-pod-network","plugins":[{"type":"calico","ipam":{"type":"calico-ipam"}},{"type":"portmap"},{"type":"istio-cni"}]}"#,
        );
        let types = plugin_types(&mut src, &opts(Runtime::Containerd));
        assert_eq!(types, ["calico", "portmap", "istio-cni", "calico-ipam"]);
    }

    #[test]
    fn nothing_is_planned_without_a_config() {
        let mut src = MemSource::new();
        assert!(plugin_types(&mut src, &opts(Runtime::Containerd)).is_empty());
    }
}
