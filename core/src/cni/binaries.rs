//! The plugin binaries' part of a verification: probes each plugin type at most once and
//! judges its answer against the list's cniVersion (libcni `ValidateNetworkList`).
//!
//! In: a probe closure answering what a plugin binary said to `VERSION`, and plugin types
//! with the version to check. Out: a [`Problem`] per plugin that fails, with its contract
//! reason and a message that names positions, never file content or plugin output.

use std::collections::HashMap;

use super::config::NetConfList;
use super::probe::{ProbeOutcome, is_plain_name};
use super::reason::Reason;

/// A binary problem: the reason, what is wrong, and whether it may be transient.
pub(super) struct Problem {
    pub(super) reason: Reason,
    pub(super) why: String,
    /// The failure says nothing lasting about the binary
    /// ([`super::probe::Broken::is_transient`]). CRI-O would skip its list only if the same
    /// happened to CRI-O, which cannot be predicted: selection stops on it instead of skipping.
    pub(super) undecidable: bool,
}

/// Probes each plugin type at most once per verification and judges its answer.
pub(super) struct Binaries<P: FnMut(&str) -> ProbeOutcome> {
    probe: P,
    seen: HashMap<String, ProbeOutcome>,
}

impl<P: FnMut(&str) -> ProbeOutcome> Binaries<P> {
    pub(super) fn new(probe: P) -> Self {
        Self {
            probe,
            seen: HashMap::new(),
        }
    }

    /// Whether a probe of this verification failed in a way that may pass by itself
    /// ([`super::probe::Broken::is_transient`]).
    pub(super) fn saw_transient(&self) -> bool {
        self.seen
            .values()
            .any(|o| matches!(o, ProbeOutcome::Broken { why, .. } if why.is_transient()))
    }

    /// How many distinct plugin types were probed.
    pub(super) fn distinct(&self) -> usize {
        self.seen.len()
    }

    pub(super) fn check(&mut self, plugin_type: &str, version: &str) -> Result<(), Problem> {
        if !is_plain_name(plugin_type) {
            return Err(Problem {
                reason: Reason::PluginBinaryMissing,
                why: "its type is not a plain file name, which libcni's FindInPath refuses (CVE-2021-20206); it was not looked up or run".into(),
                undecidable: false,
            });
        }
        let outcome = match self.seen.get(plugin_type) {
            Some(o) => o.clone(),
            None => {
                let o = (self.probe)(plugin_type);
                self.seen.insert(plugin_type.to_string(), o.clone());
                o
            }
        };
        match outcome {
            ProbeOutcome::Answered { supported, .. } => {
                if supported.iter().any(|v| v == version) {
                    Ok(())
                } else {
                    Err(Problem {
                        reason: Reason::PluginBinaryBroken,
                        why: format!(
                            "its binary's VERSION reply does not list the list's cniVersion ({} version{} listed)",
                            supported.len(),
                            if supported.len() == 1 { "" } else { "s" }
                        ),
                        undecidable: false,
                    })
                }
            }
            ProbeOutcome::Missing { searched } => Err(Problem {
                reason: Reason::PluginBinaryMissing,
                why: format!(
                    "no regular file of that name in the CNI bin dirs ({})",
                    searched.join(", ")
                ),
                undecidable: false,
            }),
            ProbeOutcome::Broken { why, .. } => Err(Problem {
                reason: Reason::PluginBinaryBroken,
                undecidable: why.is_transient(),
                why: format!("its binary {why}"),
            }),
        }
    }

    /// libcni `ValidateNetworkList`: every chain plugin (not IPAM) against the list version.
    pub(super) fn validate_chain(&mut self, list: &NetConfList) -> Vec<(usize, Problem)> {
        let version = list.version_to_check().to_string();
        let mut out = Vec::new();
        for (i, p) in list.plugins.iter().enumerate() {
            if let Err(problem) = self.check(&p.plugin_type, &version) {
                out.push((i, problem));
            }
        }
        out
    }
}

/// "plugin #2", naming the type only when it is one of the operator's `--require-plugin`
/// names (which come from the flags, not from the file).
pub(super) fn label(required: &[String], index: usize, plugin_type: &str) -> String {
    if required.iter().any(|r| r == plugin_type) {
        format!("plugin #{} (the required {plugin_type})", index + 1)
    } else {
        format!("plugin #{}", index + 1)
    }
}
