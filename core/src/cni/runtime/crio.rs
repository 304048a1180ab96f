//! CRI-O, through ocicni.

use super::{OnInvalid, RuntimeRules};

/// ocicni `loadNetworks`: candidates that fail to load, have no plugins, or fail libcni's
/// `ValidateNetworkList` (a chain plugin's binary missing, or not supporting the list's
/// cniVersion) are skipped; the first one left is the default network.
pub(super) const RULES: RuntimeRules = RuntimeRules {
    name: "crio",
    display: "CRI-O",
    summary: "files that fail to load or to validate (plugin binaries) are skipped",
    on_invalid: OnInvalid::Skip,
    validates_chain: true,
};
