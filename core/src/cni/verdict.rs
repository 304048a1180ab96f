//! The chain verdict: one contract reason and a message an operator can act on.
//!
//! In: the config directory's entries, [`VerifyOptions`] (directory path for messages,
//! runtime semantics, required chained plugin types) and a probe closure answering what each
//! plugin binary said to `VERSION`. Out: a [`Verdict`], which is also the JSON object printed
//! by `meshgate-agent check --output json`.
//!
//! Checks run from the cheapest to the costliest, and binaries are probed only once the
//! structure is right: selection (`NoConfig`, `ConfigInvalid`), chain structure
//! (`ChainedPluginMissing`, `PrimaryPluginMissing`), then binaries (`PluginBinaryMissing`,
//! `PluginBinaryBroken`).

use serde::{Deserialize, Serialize};

use super::listing::{CONFIG_EXTENSIONS, DirEntry};
use super::probe::{Broken, ProbeOutcome};
use super::select::{EffectiveConfig, Runtime, Selection, select_effective};

/// The contract's verification reasons.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Reason {
    /// The effective config chains every required plugin after a primary plugin, and every
    /// plugin binary answers VERSION supporting the config's cniVersion.
    Verified,
    /// No `.conf`, `.conflist` or `.json` file in the config directory.
    NoConfig,
    /// The effective file cannot be parsed, or has no plugins.
    ConfigInvalid,
    /// The effective config lacks a required plugin type.
    ChainedPluginMissing,
    /// A required chained plugin is first in the chain: nothing before it creates the interface.
    PrimaryPluginMissing,
    /// A plugin type in the chain has no file of that name in any CNI bin dir.
    PluginBinaryMissing,
    /// A plugin file exists but is not a usable plugin.
    PluginBinaryBroken,
}

impl Reason {
    /// Every reason, for metrics pre-registration and docs.
    pub const ALL: [Reason; 7] = [
        Reason::Verified,
        Reason::NoConfig,
        Reason::ConfigInvalid,
        Reason::ChainedPluginMissing,
        Reason::PrimaryPluginMissing,
        Reason::PluginBinaryMissing,
        Reason::PluginBinaryBroken,
    ];

    /// The reason as written in conditions, JSON and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Verified => "Verified",
            Reason::NoConfig => "NoConfig",
            Reason::ConfigInvalid => "ConfigInvalid",
            Reason::ChainedPluginMissing => "ChainedPluginMissing",
            Reason::PrimaryPluginMissing => "PrimaryPluginMissing",
            Reason::PluginBinaryMissing => "PluginBinaryMissing",
            Reason::PluginBinaryBroken => "PluginBinaryBroken",
        }
    }

    /// Parses a reason as written by [`Reason::as_str`].
    pub fn parse(s: &str) -> Option<Reason> {
        Reason::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What to verify against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyOptions {
    /// The config directory, only used to name files in messages.
    pub conf_dir: String,
    /// Whose loading semantics apply.
    pub runtime: Runtime,
    /// Plugin types the effective chain must contain (e.g. `linkerd-cni`).
    pub required: Vec<String>,
}

/// The outcome of one verification.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    /// True exactly when `reason` is `Verified`.
    pub verified: bool,
    /// The contract reason.
    pub reason: Reason,
    /// What an operator reads: the effective file and the offending plugin.
    pub message: String,
    /// Path of the effective (or offending) config file, if there is one.
    pub config_file: Option<String>,
    /// The effective chain's plugin types, in order.
    pub plugins: Vec<String>,
    /// The runtime semantics applied.
    pub runtime: Runtime,
}

/// Plugin types that never create the pod's interface: a chain made only of these (and the
/// required mesh plugins) before a required plugin has no primary plugin.
const INTERFACE_LESS_PLUGINS: [&str; 7] = [
    "portmap",
    "bandwidth",
    "tuning",
    "firewall",
    "sbr",
    "linkerd-cni",
    "istio-cni",
];

/// Verifies a config directory. `probe(type, cni_version)` reports what the binary of that
/// plugin type answered to VERSION; it is called only once the chain's structure is right,
/// once per distinct type, chain plugins first and then IPAM plugins.
pub fn verify(
    entries: &[DirEntry],
    opts: &VerifyOptions,
    mut probe: impl FnMut(&str, &str) -> ProbeOutcome,
) -> Verdict {
    let path = |file: &str| {
        if opts.conf_dir.is_empty() {
            file.to_string()
        } else {
            format!("{}/{}", opts.conf_dir.trim_end_matches('/'), file)
        }
    };
    let verdict = |reason, message: String, file: Option<String>, plugins: Vec<String>| Verdict {
        verified: reason == Reason::Verified,
        reason,
        message,
        config_file: file,
        plugins,
        runtime: opts.runtime,
    };

    let eff = match select_effective(entries, opts.runtime) {
        Selection::Found(eff) => eff,
        Selection::NoConfig => {
            return verdict(
                Reason::NoConfig,
                format!(
                    "no {} file in {}",
                    CONFIG_EXTENSIONS.join(", "),
                    if opts.conf_dir.is_empty() {
                        "the CNI config directory"
                    } else {
                        &opts.conf_dir
                    }
                ),
                None,
                Vec::new(),
            );
        }
        Selection::Invalid { file, why } => {
            let semantics = match opts.runtime {
                Runtime::Containerd => {
                    " (containerd loads only the first config file and refuses every pod sandbox while it is invalid)"
                }
                Runtime::Crio => "",
            };
            return verdict(
                Reason::ConfigInvalid,
                format!("{} {why}{semantics}", path(&file)),
                Some(path(&file)),
                Vec::new(),
            );
        }
    };
    let file = path(&eff.file);
    let plugins = eff.list.plugin_types();
    let chain = plugins.join(" → ");

    if let Err((reason, message)) = check_structure(&eff, &opts.required, &file, &chain) {
        return verdict(reason, message, Some(file), plugins);
    }

    let version = eff.list.effective_version().to_string();
    let mut problems: Vec<(Reason, String)> = Vec::new();
    let mut probed = 0usize;
    for (plugin_type, role) in binaries(&eff) {
        probed += 1;
        let what = format!("{role} {plugin_type} of {file}");
        match probe(&plugin_type, &version) {
            ProbeOutcome::Answered { path, supported } => {
                if !supported.iter().any(|v| v == &version) {
                    problems.push((
                        Reason::PluginBinaryBroken,
                        format!(
                            "{what}: {path} does not support cniVersion {version} (supports {})",
                            supported.join(", ")
                        ),
                    ));
                }
            }
            ProbeOutcome::Missing { searched } => problems.push((
                Reason::PluginBinaryMissing,
                format!(
                    "{what}: no binary named {plugin_type} in {}",
                    searched.join(", ")
                ),
            )),
            ProbeOutcome::Broken { path, why } => {
                let why = match why {
                    // Name the version that was asked, so "not supported" is unambiguous.
                    Broken::Failed(m) => format!("failed on VERSION for cniVersion {version}: {m}"),
                    other => other.to_string(),
                };
                problems.push((Reason::PluginBinaryBroken, format!("{what}: {path} {why}")));
            }
        }
    }
    if let Some((reason, first)) = problems.first().cloned() {
        let more = match problems.len() {
            1 => String::new(),
            n => format!(
                " (and {} more plugin problem{})",
                n - 1,
                if n > 2 { "s" } else { "" }
            ),
        };
        return verdict(reason, format!("{first}{more}"), Some(file), plugins);
    }

    let required = opts.required.join(", ");
    let mut message = if required.is_empty() {
        format!("{file} loads chain {chain}")
    } else {
        format!("{file} chains {required} ({chain})")
    };
    message.push_str(&format!(
        "; {probed} plugin binar{} answer VERSION for cniVersion {version}",
        if probed == 1 { "y" } else { "ies" }
    ));
    if !eff.skipped.is_empty() {
        message.push_str(&format!(
            "; skipped invalid: {}",
            eff.skipped
                .iter()
                .map(|(f, _)| f.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    verdict(Reason::Verified, message, Some(file), plugins)
}

/// The chain-structure checks, which need no binary.
fn check_structure(
    eff: &EffectiveConfig,
    required: &[String],
    file: &str,
    chain: &str,
) -> Result<(), (Reason, String)> {
    let types: Vec<&str> = eff
        .list
        .plugins
        .iter()
        .map(|p| p.plugin_type.as_str())
        .collect();
    let missing: Vec<&str> = required
        .iter()
        .map(String::as_str)
        .filter(|r| !types.contains(r))
        .collect();
    if !missing.is_empty() {
        return Err((
            Reason::ChainedPluginMissing,
            format!(
                "{file} does not chain {} (chain: {chain})",
                missing.join(", ")
            ),
        ));
    }
    for r in required {
        // `missing` is empty, so every required type is present.
        let Some(at) = types.iter().position(|t| t == r) else {
            continue;
        };
        let has_primary = types[..at]
            .iter()
            .any(|t| !INTERFACE_LESS_PLUGINS.contains(t) && !required.iter().any(|q| q == t));
        if !has_primary {
            let before = if at == 0 {
                "it is first in the chain".to_string()
            } else {
                format!("only {} run before it", types[..at].join(", "))
            };
            return Err((
                Reason::PrimaryPluginMissing,
                format!(
                    "{r} in {file} has no primary plugin before it: {before}, so nothing creates the pod interface (chain: {chain})"
                ),
            ));
        }
    }
    Ok(())
}

/// Every distinct binary the chain needs, chain plugins first, then delegated IPAM plugins.
fn binaries(eff: &EffectiveConfig) -> Vec<(String, &'static str)> {
    let mut out: Vec<(String, &'static str)> = Vec::new();
    for p in &eff.list.plugins {
        if !out.iter().any(|(t, _)| t == &p.plugin_type) {
            out.push((p.plugin_type.clone(), "plugin"));
        }
    }
    for p in &eff.list.plugins {
        if let Some(ipam) = p.ipam_type().filter(|i| !out.iter().any(|(t, _)| t == i)) {
            out.push((ipam.to_string(), "IPAM plugin"));
        }
    }
    out
}
