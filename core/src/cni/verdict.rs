//! The chain verdict: one contract reason and a message an operator can act on.
//!
//! In: a [`ConfSource`] over the config directory, [`VerifyOptions`] (directory path for
//! messages, runtime semantics, required chained plugin types) and a probe closure answering
//! what each plugin binary said to `VERSION`. Out: a [`ChainVerdict`], which is also the JSON
//! object printed by `meshgate-agent check --output json`.
//!
//! Checks run from the cheapest to the costliest: selection (`NoConfig`, `ConfigInvalid`;
//! for CRI-O the chain binaries already take part here, as ocicni validates every list),
//! chain structure (`ChainedPluginMissing`, `PrimaryPluginMissing`), then binaries
//! (`PluginBinaryMissing`, `PluginBinaryBroken`): each chain plugin with the list's
//! cniVersion (libcni `ValidateNetworkList`, an empty version checked as 0.1.0), then each
//! delegated IPAM plugin (meshgate's own addition: ADD would fail without it).
//!
//! Messages never quote file content or plugin output: they name files (config dir entry
//! names), positions ("plugin #2"), the operator's own `--require-plugin` names, counts and
//! lengths. The chain's types are in [`ChainVerdict::plugins`] for the `check` command only.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::config::NetConfList;
use super::listing::{CONFIG_EXTENSIONS, ConfSource, display};
use super::probe::{Broken, ProbeOutcome, is_plain_name};
use super::select::{EffectiveConfig, Runtime, Selection, Validation, select_effective};

/// The contract's verification reasons.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Reason {
    /// The effective config chains every required plugin after a primary plugin, and every
    /// plugin binary answers VERSION supporting the config's cniVersion.
    Verified,
    /// No `.conf`, `.conflist` or `.json` file in the config directory.
    NoConfig,
    /// The effective file does not load as the runtime loads it (not JSON for Go, a wrong
    /// value type, no plugins, a bad drop-in, ...), CRI-O skips every file, or the file
    /// cannot be verified (over the read budget, a FIFO or device).
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
pub struct ChainVerdict {
    /// True exactly when `reason` is `Verified`.
    pub verified: bool,
    /// The contract reason.
    pub reason: Reason,
    /// What an operator reads: the effective file and the offending position. Never quotes
    /// file content or plugin output.
    pub message: String,
    /// Path of the effective (or offending) config file, if there is one.
    pub config_file: Option<String>,
    /// The effective chain's plugin types, in order (for `check` output only).
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

/// A binary problem: the reason, what is wrong, and whether it may be transient.
struct Problem {
    reason: Reason,
    why: String,
    /// The failure says nothing lasting about the binary: it ran out of time, kept its output
    /// open, or could not be started at all (`ETXTBSY` while an installer rewrites it in place,
    /// a failed fork, thread or pipe). CRI-O would skip its list only if the same happened to
    /// CRI-O, which cannot be predicted: selection stops on it instead of skipping.
    undecidable: bool,
}

/// Probes each plugin type at most once per verification and judges its answer.
struct Binaries<P: FnMut(&str) -> ProbeOutcome> {
    probe: P,
    seen: HashMap<String, ProbeOutcome>,
}

impl<P: FnMut(&str) -> ProbeOutcome> Binaries<P> {
    fn check(&mut self, plugin_type: &str, version: &str) -> Result<(), Problem> {
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
                undecidable: matches!(
                    why,
                    Broken::TimedOut { .. } | Broken::HeldOutput { .. } | Broken::CannotStart(_)
                ),
                why: format!("its binary {why}"),
            }),
        }
    }

    /// libcni `ValidateNetworkList`: every chain plugin (not IPAM) against the list version.
    fn validate_chain(&mut self, list: &NetConfList) -> Vec<(usize, Problem)> {
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

/// Verifies a config directory. `probe(type)` reports what the binary of that plugin type
/// answered to VERSION; it is called at most once per type, only for plain file names.
pub fn verify(
    src: &mut dyn ConfSource,
    opts: &VerifyOptions,
    probe: impl FnMut(&str) -> ProbeOutcome,
) -> ChainVerdict {
    let path = |file: &[u8]| {
        let name = display(file);
        if opts.conf_dir.is_empty() {
            name
        } else {
            format!("{}/{}", opts.conf_dir.trim_end_matches('/'), name)
        }
    };
    let verdict =
        |reason, message: String, file: Option<String>, plugins: Vec<String>| ChainVerdict {
            verified: reason == Reason::Verified,
            reason,
            message,
            config_file: file,
            plugins,
            runtime: opts.runtime,
        };
    let dir = if opts.conf_dir.is_empty() {
        "the CNI config directory"
    } else {
        &opts.conf_dir
    };
    let mut bins = Binaries {
        probe,
        seen: HashMap::new(),
    };

    let mut validate = |list: &NetConfList| {
        let problems = bins.validate_chain(list);
        match problems.into_iter().next() {
            None => Validation::Valid,
            Some((i, p)) => {
                let msg = format!(
                    "fails CRI-O's ValidateNetworkList: {}: {}",
                    bins_label(&opts.required, i, &list.plugins[i].plugin_type),
                    p.why
                );
                if p.undecidable {
                    Validation::Undecidable(p.reason, msg)
                } else {
                    Validation::Fails(p.reason, msg)
                }
            }
        }
    };
    let selection = select_effective(src, opts.runtime, &mut validate);
    let eff = match selection {
        Selection::Found(eff) => eff,
        Selection::NoConfig => {
            return verdict(
                Reason::NoConfig,
                format!("no {} file in {dir}", CONFIG_EXTENSIONS.join(", ")),
                None,
                Vec::new(),
            );
        }
        Selection::Unlistable(why) => {
            return verdict(
                Reason::ConfigInvalid,
                format!("{dir} cannot be listed: {why}"),
                None,
                Vec::new(),
            );
        }
        Selection::Invalid { file, why } => {
            return verdict(
                Reason::ConfigInvalid,
                format!(
                    "{} {why} (containerd loads only the first config file and refuses every pod sandbox while it is invalid)",
                    path(&file)
                ),
                Some(path(&file)),
                Vec::new(),
            );
        }
        Selection::NoneValid { skipped } => {
            let n = skipped.len();
            let Some(first) = skipped.into_iter().next() else {
                return verdict(
                    Reason::NoConfig,
                    format!("no loadable config in {dir}"),
                    None,
                    Vec::new(),
                );
            };
            return verdict(
                first.reason,
                format!(
                    "CRI-O skips every config file in {dir} ({n} skipped); the first, {}, {}",
                    path(&first.file),
                    first.why
                ),
                Some(path(&first.file)),
                Vec::new(),
            );
        }
        Selection::Undecidable { file, reason, why } => {
            return verdict(
                reason,
                format!("{} cannot be verified: {why}", path(&file)),
                Some(path(&file)),
                Vec::new(),
            );
        }
    };
    let file = path(&eff.file);
    let plugins = eff.list.plugin_types();

    if let Err((reason, message)) = check_structure(&eff, &opts.required, &file) {
        return verdict(reason, message, Some(file), plugins);
    }

    // Chain plugins (libcni ValidateNetworkList), then delegated IPAM plugins.
    let version = eff.list.version_to_check().to_string();
    let mut problems: Vec<(Reason, String)> = bins
        .validate_chain(&eff.list)
        .into_iter()
        .map(|(i, p)| {
            (
                p.reason,
                format!(
                    "{}: {}",
                    bins_label(&opts.required, i, &eff.list.plugins[i].plugin_type),
                    p.why
                ),
            )
        })
        .collect();
    for (i, p) in eff.list.plugins.iter().enumerate() {
        let Some(ipam) = p.ipam_type() else { continue };
        if let Err(problem) = bins.check(ipam, &version) {
            problems.push((
                problem.reason,
                format!("the IPAM plugin of plugin #{}: {}", i + 1, problem.why),
            ));
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
        return verdict(
            reason,
            format!("{file}: {first}{more}"),
            Some(file),
            plugins,
        );
    }

    let required = opts.required.join(", ");
    let n = eff.list.plugins.len();
    let mut message = if required.is_empty() {
        format!(
            "{file} loads a chain of {n} plugin{}",
            if n == 1 { "" } else { "s" }
        )
    } else {
        format!("{file} chains {required} after a primary plugin ({n} plugins)")
    };
    if !eff.drop_ins.is_empty() {
        message.push_str(&format!(
            ", {} from drop-in file{} {}",
            eff.drop_ins.len(),
            if eff.drop_ins.len() == 1 { "" } else { "s" },
            name_list(eff.drop_ins.iter())
        ));
    }
    let distinct = bins.seen.len();
    message.push_str(&format!(
        "; {distinct} plugin binar{} answer VERSION supporting the list's cniVersion",
        if distinct == 1 { "y" } else { "ies" }
    ));
    if !eff.skipped.is_empty() {
        message.push_str(&format!(
            "; CRI-O skips the earlier {}",
            name_list(eff.skipped.iter().map(|s| &s.file))
        ));
    }
    verdict(Reason::Verified, message, Some(file), plugins)
}

/// At most five names, then a count: a directory of thousands of files must not make a
/// message of thousands of names.
fn name_list<'a>(names: impl ExactSizeIterator<Item = &'a Vec<u8>>) -> String {
    const SHOWN: usize = 5;
    let total = names.len();
    let mut out: Vec<String> = names.take(SHOWN).map(|n| display(n)).collect();
    if total > SHOWN {
        out.push(format!("and {} more", total - SHOWN));
    }
    out.join(", ")
}

/// "plugin #2", naming the type only when it is one of the operator's `--require-plugin`
/// names (which come from the flags, not from the file).
fn bins_label(required: &[String], index: usize, plugin_type: &str) -> String {
    if required.iter().any(|r| r == plugin_type) {
        format!("plugin #{} (the required {plugin_type})", index + 1)
    } else {
        format!("plugin #{}", index + 1)
    }
}

/// The chain-structure checks, which need no binary.
fn check_structure(
    eff: &EffectiveConfig,
    required: &[String],
    file: &str,
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
                "{file} does not chain {} (its chain has {} plugin{})",
                missing.join(", "),
                types.len(),
                if types.len() == 1 { "" } else { "s" }
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
                format!("only interface-less plugins (#1 to #{at}) run before it")
            };
            return Err((
                Reason::PrimaryPluginMissing,
                format!(
                    "{r} is plugin #{} of {file} and has no primary plugin before it: {before}, so nothing creates the pod interface",
                    at + 1
                ),
            ));
        }
    }
    Ok(())
}
