//! The chain verdict: one contract reason and a message an operator can act on.
//!
//! In: a [`ConfSource`] over the config directory, [`VerifyOptions`] (directory path for
//! messages, runtime semantics, required chained plugin types) and a probe closure answering
//! what each plugin binary said to `VERSION`; the meshes' CNI plugin types, which never
//! create a pod's interface, come from their records ([`meshes::ALL`]). Out: a
//! [`ChainVerdict`], which is also the JSON object printed by `meshgate-agent check --output
//! json`.
//!
//! Checks run from the cheapest to the costliest: selection (`NoConfig`, `ConfigInvalid`;
//! for a runtime whose rules validate chains, CRI-O, the chain binaries already take part
//! here, as ocicni validates every list),
//! chain structure (`ChainedPluginMissing`, `PrimaryPluginMissing`), then binaries
//! (`PluginBinaryMissing`, `PluginBinaryBroken`): each chain plugin with the list's
//! cniVersion (libcni `ValidateNetworkList`, an empty version checked as 0.1.0), then each
//! delegated IPAM plugin (meshgate's own addition: ADD would fail without it).
//!
//! Messages never quote file content or plugin output: they name files (config dir entry
//! names), positions ("plugin #2"), the operator's own `--require-plugin` names, counts and
//! lengths. The chain's types are in [`ChainVerdict::plugins`] for the `check` command only.
//! [`ChainVerdict::transient`] marks a verdict that a probe failure which may pass by itself
//! decided, so the agent verifies again soon.

use serde::{Deserialize, Serialize};

use super::binaries::{self, Binaries};
use super::config::NetConfList;
use super::listing::{CONFIG_EXTENSIONS, ConfSource, display};
use super::multus::{self, Delegate, Layout, MultusOptions};
use super::probe::ProbeOutcome;
use super::reason::Reason;
use super::runtime::Runtime;
use super::select::{EffectiveConfig, NotSelected, Validation, select_effective};
use crate::meshes::{self, Mesh};

/// What to verify against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyOptions {
    /// The config directory, only used to name files in messages.
    pub conf_dir: String,
    /// Whose loading semantics apply.
    pub runtime: Runtime,
    /// Plugin types the effective chain must contain (e.g. `linkerd-cni`).
    pub required: Vec<String>,
    /// What the node's Multus, if it runs, loads and from where.
    pub multus: MultusOptions,
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
    /// When the effective chain is Multus: the cluster-default network it runs (for `check`
    /// output; the message names the layout and the delegate without its content).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delegate: Option<Box<DelegateView>>,
    /// Not verified, and a plugin probe of this verification failed in a way that may pass
    /// by itself ([`super::probe::Broken::is_transient`]: timed out, kept its output open,
    /// could not be started), or (set by the agent) the config dir could not be read: the
    /// agent verifies again soon instead of at the next resync.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub transient: bool,
}

/// The cluster-default network a meta plugin (Multus) runs, as `check` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DelegateView {
    /// `multus-thin` or `multus-thick`.
    pub layout: Layout,
    /// Where the delegate came from, as the message names it (`inline delegate #1`,
    /// `clusterNetwork /etc/cni/net.d/10-calico.conflist`).
    pub source: String,
    /// A `clusterNetwork` file's path on the node, which the agent also watches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// The delegate chain's plugin types, in order (empty when it could not be loaded).
    pub plugins: Vec<String>,
}

/// Generic plugin types that never create the pod's interface. Neither does a mesh's plugin
/// ([`meshes::plugin_types`]): a chain made only of these, the meshes' plugins and the
/// required plugins before a required plugin has no primary plugin.
const INTERFACE_LESS_PLUGINS: [&str; 5] = ["portmap", "bandwidth", "tuning", "firewall", "sbr"];

/// Verifies a config directory. `probe(type)` reports what the binary of that plugin type
/// answered to VERSION; it is called at most once per type, only for plain file names.
pub fn verify(
    src: &mut dyn ConfSource,
    opts: &VerifyOptions,
    probe: impl FnMut(&str) -> ProbeOutcome,
) -> ChainVerdict {
    verify_knowing(src, opts, &meshes::ALL, probe)
}

/// [`verify`], knowing `meshes` (the built-in ones: [`meshes::ALL`]), whose plugins are
/// interface-less wherever they are in the chain.
pub(crate) fn verify_knowing(
    src: &mut dyn ConfSource,
    opts: &VerifyOptions,
    meshes: &[Mesh],
    probe: impl FnMut(&str) -> ProbeOutcome,
) -> ChainVerdict {
    let mut bins = Binaries::new(probe);
    let mesh_plugins = meshes::plugin_types(meshes);
    let mut v = judge(src, opts, &mesh_plugins, &mut bins);
    v.transient = !v.verified && bins.saw_transient();
    v
}

/// [`verify`]'s verdict, before it is marked transient.
fn judge<P: FnMut(&str) -> ProbeOutcome>(
    src: &mut dyn ConfSource,
    opts: &VerifyOptions,
    mesh_plugins: &[String],
    bins: &mut Binaries<P>,
) -> ChainVerdict {
    let out = Report { opts };
    let eff = match select(src, &out, bins) {
        Ok(eff) => eff,
        Err(verdict) => return verdict,
    };
    let file = out.path(&eff.file);
    let plugins = eff.list.plugin_types();
    let delegate = match multus::find(&eff.list) {
        None => None,
        Some((at, layout)) => {
            match multus::resolve(src, &opts.conf_dir, &opts.multus, &eff, at, layout) {
                Ok(d) => Some((at, d)),
                Err(u) => {
                    let message = format!(
                        "{file} runs {} (plugin #{}), whose cluster-default network cannot be verified: {}",
                        layout.display(),
                        at + 1,
                        u.why
                    );
                    let view = DelegateView {
                        layout,
                        source: "its cluster-default network (not resolved)".into(),
                        file: None,
                        plugins: Vec::new(),
                    };
                    let mut v = out.verdict(u.reason, message, Some(file), plugins);
                    v.delegate = Some(Box::new(view));
                    return v;
                }
            }
        }
    };
    let chain = Chain::new(&eff, delegate.as_ref(), &file);
    let problem = check_structure(&chain, &opts.required, mesh_plugins)
        .err()
        .or_else(|| binary_problem(bins, &chain, &opts.required));
    let view = delegate.as_ref().map(|(_, d)| {
        Box::new(DelegateView {
            layout: d.layout,
            source: d.source.clone(),
            file: d.file.clone(),
            plugins: d.list.plugin_types(),
        })
    });
    let mut v = match problem {
        Some((reason, message)) => out.verdict(reason, message, Some(file.clone()), plugins),
        None => {
            let message = verified_message(opts, &eff, &chain, bins.distinct());
            out.verdict(Reason::Verified, message, Some(file.clone()), plugins)
        }
    };
    v.delegate = view;
    v
}

/// The chain the runtime really runs for a pod: the effective list, or, when it runs Multus,
/// the list with the Multus plugin expanded into its cluster-default delegate chain.
struct Chain<'a> {
    /// How messages name it: the file, or `<file> via multus (thin) inline delegate #1`.
    name: String,
    /// The plugin types in the order they run.
    types: Vec<&'a str>,
    /// Each loaded list whose binaries must answer, with how messages prefix its positions.
    lists: Vec<(&'a NetConfList, String)>,
}

impl<'a> Chain<'a> {
    fn new(eff: &'a EffectiveConfig, delegate: Option<&'a (usize, Delegate)>, file: &str) -> Self {
        let top: Vec<&str> = eff
            .list
            .plugins
            .iter()
            .map(|p| p.plugin_type.as_str())
            .collect();
        let Some((at, d)) = delegate else {
            return Chain {
                name: file.to_string(),
                types: top,
                lists: vec![(&eff.list, file.to_string())],
            };
        };
        let name = format!("{file} via {} {}", d.layout.display(), d.source);
        let mut types: Vec<&str> = top[..*at].to_vec();
        types.extend(d.list.plugins.iter().map(|p| p.plugin_type.as_str()));
        types.extend(&top[at + 1..]);
        Chain {
            lists: vec![(&eff.list, file.to_string()), (&d.list, name.clone())],
            name,
            types,
        }
    }
}

/// Names files and builds verdicts for one verification.
struct Report<'a> {
    opts: &'a VerifyOptions,
}

impl Report<'_> {
    /// The config file's path as messages show it.
    fn path(&self, file: &[u8]) -> String {
        let name = display(file);
        if self.opts.conf_dir.is_empty() {
            name
        } else {
            format!("{}/{}", self.opts.conf_dir.trim_end_matches('/'), name)
        }
    }

    /// The config directory as messages show it.
    fn dir(&self) -> &str {
        if self.opts.conf_dir.is_empty() {
            "the CNI config directory"
        } else {
            &self.opts.conf_dir
        }
    }

    fn verdict(
        &self,
        reason: Reason,
        message: String,
        file: Option<String>,
        plugins: Vec<String>,
    ) -> ChainVerdict {
        ChainVerdict {
            verified: reason == Reason::Verified,
            reason,
            message,
            config_file: file,
            plugins,
            runtime: self.opts.runtime,
            delegate: None,
            transient: false,
        }
    }

    /// The verdict when the runtime loads no config.
    fn not_selected(&self, why: NotSelected) -> ChainVerdict {
        let rt = self.opts.runtime.rules().display;
        let dir = self.dir();
        let (reason, message, file) = match why {
            NotSelected::NoConfig => (
                Reason::NoConfig,
                format!("no {} file in {dir}", CONFIG_EXTENSIONS.join(", ")),
                None,
            ),
            NotSelected::Unlistable(why) => (
                Reason::ConfigInvalid,
                format!("{dir} cannot be listed: {why}"),
                None,
            ),
            NotSelected::Invalid { file, reason, why } => (
                reason,
                format!(
                    "{} {why} ({rt} loads only the first config file and refuses every pod sandbox while it is invalid)",
                    self.path(&file)
                ),
                Some(self.path(&file)),
            ),
            NotSelected::NoneValid { skipped } => {
                let n = skipped.len();
                match skipped.into_iter().next() {
                    None => (
                        Reason::NoConfig,
                        format!("no loadable config in {dir}"),
                        None,
                    ),
                    Some(first) => (
                        first.reason,
                        format!(
                            "{rt} skips every config file in {dir} ({n} skipped); the first, {}, {}",
                            self.path(&first.file),
                            first.why
                        ),
                        Some(self.path(&first.file)),
                    ),
                }
            }
            NotSelected::Undecidable { file, reason, why } => (
                reason,
                format!("{} cannot be verified: {why}", self.path(&file)),
                Some(self.path(&file)),
            ),
        };
        self.verdict(reason, message, file, Vec::new())
    }
}

/// Selection as the runtime's rules say, with chain validation (when the rules have it) done
/// by `bins`, so a binary probed then is not probed again.
fn select<P: FnMut(&str) -> ProbeOutcome>(
    src: &mut dyn ConfSource,
    out: &Report<'_>,
    bins: &mut Binaries<P>,
) -> Result<EffectiveConfig, ChainVerdict> {
    let rules = out.opts.runtime.rules();
    let required = &out.opts.required;
    let mut validate = |list: &NetConfList| {
        let Some((i, p)) = bins.validate_chain(list).into_iter().next() else {
            return Validation::Valid;
        };
        let msg = format!(
            "fails {}'s ValidateNetworkList: {}: {}",
            rules.display,
            binaries::label(required, i, &list.plugins[i].plugin_type),
            p.why
        );
        if p.undecidable {
            Validation::Undecidable(p.reason, msg)
        } else {
            Validation::Fails(p.reason, msg)
        }
    };
    select_effective(src, rules, &mut validate).map_err(|why| out.not_selected(why))
}

/// The first binary problem of the chain, with how many more there are: for each list (the
/// effective one, then a Multus delegate), its chain plugins (libcni `ValidateNetworkList`,
/// with that list's cniVersion), then its delegated IPAM plugins.
fn binary_problem<P: FnMut(&str) -> ProbeOutcome>(
    bins: &mut Binaries<P>,
    chain: &Chain<'_>,
    required: &[String],
) -> Option<(Reason, String)> {
    let mut problems: Vec<(Reason, String)> = Vec::new();
    for (list, prefix) in &chain.lists {
        list_binary_problems(bins, list, required, prefix, &mut problems);
    }
    let n = problems.len();
    let (reason, first) = problems.into_iter().next()?;
    let more = match n {
        1 => String::new(),
        n => format!(
            " (and {} more plugin problem{})",
            n - 1,
            if n > 2 { "s" } else { "" }
        ),
    };
    Some((reason, format!("{first}{more}")))
}

/// One list's binary problems, each message prefixed with how the list is named.
fn list_binary_problems<P: FnMut(&str) -> ProbeOutcome>(
    bins: &mut Binaries<P>,
    list: &NetConfList,
    required: &[String],
    prefix: &str,
    problems: &mut Vec<(Reason, String)>,
) {
    let version = list.version_to_check().to_string();
    for (i, p) in bins.validate_chain(list) {
        let label = binaries::label(required, i, &list.plugins[i].plugin_type);
        problems.push((p.reason, format!("{prefix}: {label}: {}", p.why)));
    }
    for (i, p) in list.plugins.iter().enumerate() {
        let Some(ipam) = p.ipam_type() else { continue };
        if let Err(problem) = bins.check(ipam, &version) {
            problems.push((
                problem.reason,
                format!(
                    "{prefix}: the IPAM plugin of plugin #{}: {}",
                    i + 1,
                    problem.why
                ),
            ));
        }
    }
}

/// What a verified chain's message says: the required plugins, the drop-ins, the binaries
/// that answered, and the files the runtime skipped.
fn verified_message(
    opts: &VerifyOptions,
    eff: &EffectiveConfig,
    chain: &Chain<'_>,
    distinct: usize,
) -> String {
    let required = opts.required.join(", ");
    let n = chain.types.len();
    let file = &chain.name;
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
    message.push_str(&format!(
        "; {distinct} plugin binar{} answer VERSION supporting {}",
        if distinct == 1 { "y" } else { "ies" },
        if chain.lists.len() == 1 {
            "the list's cniVersion"
        } else {
            "their list's cniVersion"
        }
    ));
    if !eff.skipped.is_empty() {
        message.push_str(&format!(
            "; {} skips the earlier {}",
            opts.runtime.rules().display,
            name_list(eff.skipped.iter().map(|s| &s.file))
        ));
    }
    message
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

/// The chain-structure checks, which need no binary.
fn check_structure(
    chain: &Chain<'_>,
    required: &[String],
    mesh_plugins: &[String],
) -> Result<(), (Reason, String)> {
    let types = &chain.types;
    let file = &chain.name;
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
        let has_primary = types[..at].iter().any(|t| {
            !INTERFACE_LESS_PLUGINS.contains(t)
                && !mesh_plugins.iter().any(|m| m == t)
                && !required.iter().any(|q| q == t)
        });
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
