//! containerd, through go-cni.

use super::{OnInvalid, RuntimeRules};

/// go-cni `loadFromConfDir` with containerd's default `max_conf_num = 1`: the first
/// candidate is loaded; if it fails, loading fails; if it loads, the loop stops there.
/// Binaries are not looked at until a pod's ADD runs them.
pub(super) const RULES: RuntimeRules = RuntimeRules {
    name: "containerd",
    display: "containerd",
    summary: "the first file wins, an invalid first file is fatal",
    on_invalid: OnInvalid::Fatal,
    validates_chain: false,
};
