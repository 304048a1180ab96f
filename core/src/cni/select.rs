//! Which config file the container runtime really loads: the *effective* config.
//!
//! In: a [`ConfSource`] over the config directory, the runtime's [`RuntimeRules`] and, for a
//! runtime that validates chains (CRI-O: ocicni runs libcni's `ValidateNetworkList` on every
//! list), a validation closure. Out: a [`EffectiveConfig`]: the effective file loaded into a
//! [`NetConfList`] (drop-in plugins appended), or why there is none ([`NotSelected`]). Messages name files and
//! positions, never content.
//!
//! Files are read lazily, in sorted order, and only as far as the runtime would get:
//! - Candidates (libcni `ConfFiles`): entries whose dirent is not a directory (a symlink to
//!   a directory *is* a candidate, and fails to load with `EISDIR`) and whose
//!   `filepath.Ext` is `.conf`, `.conflist` or `.json`, sorted bytewise (`sort.Strings`).
//! - A runtime whose rules say [`OnInvalid::Fatal`] (containerd) loads the first candidate
//!   and stops there, loaded or not; one that says [`OnInvalid::Skip`] (CRI-O) skips
//!   candidates that fail to load, have no plugins, or (when it validates chains) fail
//!   `ValidateNetworkList`; the first one left is the default network. Each runtime's
//!   record in [`super::runtime`] names the upstream code it follows.
//! - `.conflist` (libcni `NetworkConfFromFile`): unless `loadOnlyInlinedPlugins`, the
//!   `.conf` files of `filepath.Join(confDir, name)` are appended in name order
//!   (`NetworkPluginConfsFromFiles`): a missing directory adds nothing, an empty name makes
//!   it the config directory itself, and any other listing error (a regular file there:
//!   `ENOTDIR`) fails the whole list. No plugins at all fails it too.
//! - `.conf` / `.json`: `ConfFromFile` + `ConfListFromConf`; never extended by drop-ins.

use super::config::{NetConfList, PluginConf};
use super::listing::{ConfSource, Dirent, SourceError, display, ext, is_config_name, join_clean};
use super::reason::Reason;
use super::runtime::{OnInvalid, RuntimeRules};

/// What ocicni's `ValidateNetworkList` concluded about a loaded list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Validation {
    /// Every chain plugin's binary exists and supports the list's cniVersion.
    Valid,
    /// It fails: the reason the verdict would give, and a message without file content.
    Fails(Reason, String),
    /// meshgate cannot tell (a plugin ran out of time).
    Undecidable(Reason, String),
}

/// A candidate a skipping runtime (CRI-O) passed over, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    /// Its raw file name.
    pub file: Vec<u8>,
    /// `ConfigInvalid` for a load failure, or the binary reason for a validation failure.
    pub reason: Reason,
    /// Why, without file content.
    pub why: String,
}

/// The config the runtime loads, with how it was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EffectiveConfig {
    /// Raw file name of the effective config in the config directory.
    pub file: Vec<u8>,
    /// The file's bytes as read (a meta plugin's own fields, such as Multus's delegates,
    /// are read from them without reading the file twice).
    pub bytes: Vec<u8>,
    /// The loaded chain, drop-in plugins included.
    pub list: NetConfList,
    /// Drop-in plugin file names appended to the chain, in order.
    pub drop_ins: Vec<Vec<u8>>,
    /// Files sorting before the effective one that the runtime skipped (CRI-O).
    pub skipped: Vec<Skipped>,
}

/// Why effective-config selection found no config the runtime loads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotSelected {
    /// No candidate file at all (or no config directory).
    NoConfig,
    /// The config directory itself cannot be listed.
    Unlistable(String),
    /// A runtime whose first candidate decides (containerd): it does not load, so nothing
    /// loads.
    Invalid {
        /// The offending file name.
        file: Vec<u8>,
        /// `ConfigInvalid` for a load failure, or the binary reason for a validation failure.
        reason: Reason,
        /// Why it cannot be loaded.
        why: String,
    },
    /// A skipping runtime (CRI-O): every candidate was skipped.
    NoneValid {
        /// Each candidate and why it was skipped, in name order.
        skipped: Vec<Skipped>,
    },
    /// meshgate cannot tell what the runtime does with this file (byte budget, a FIFO, a
    /// plugin that ran out of time during CRI-O's validation).
    Undecidable {
        /// The file at which it stopped.
        file: Vec<u8>,
        /// The reason to report.
        reason: Reason,
        /// Why.
        why: String,
    },
}

/// Why a file does not load: an error, or meshgate cannot tell.
pub(super) enum LoadFail {
    /// It does not load, for this reason.
    Error(String),
    /// Past a read budget, or not a regular file: meshgate cannot tell.
    Undecidable(String),
}

fn from_source(e: SourceError) -> LoadFail {
    match e {
        SourceError::Undecidable(why) => LoadFail::Undecidable(why),
        other => LoadFail::Error(other.to_string()),
    }
}

/// Selects the effective config. `validate` is called only when the runtime's rules
/// validate chains, on lists that load.
pub fn select_effective(
    src: &mut dyn ConfSource,
    rules: &RuntimeRules,
    validate: &mut dyn FnMut(&NetConfList) -> Validation,
) -> Result<EffectiveConfig, NotSelected> {
    let entries = match src.list(b"") {
        Ok(e) => e,
        Err(SourceError::NotFound) => return Err(NotSelected::NoConfig),
        Err(e) => return Err(NotSelected::Unlistable(e.to_string())),
    };
    let mut candidates: Vec<Dirent> = entries
        .into_iter()
        .filter(|e| !e.is_dir && is_config_name(&e.name))
        .collect();
    // Go's sort.Strings compares bytes; so does Vec<u8>'s Ord.
    candidates.sort_by(|a, b| a.name.cmp(&b.name));
    if candidates.is_empty() {
        return Err(NotSelected::NoConfig);
    }

    let mut skipped = Vec::new();
    for c in candidates {
        let file = c.name;
        let (reason, why) = match load(src, &file) {
            Ok((bytes, list, drop_ins)) => match validated(rules, validate, &list) {
                Ok(()) => {
                    return Ok(EffectiveConfig {
                        file,
                        bytes,
                        list,
                        drop_ins,
                        skipped,
                    });
                }
                Err(Candidate::Fails(reason, why)) => (reason, why),
                Err(Candidate::Undecidable(reason, why)) => {
                    return Err(NotSelected::Undecidable { file, reason, why });
                }
            },
            Err(LoadFail::Undecidable(why)) => {
                return Err(NotSelected::Undecidable {
                    file,
                    reason: Reason::ConfigInvalid,
                    why,
                });
            }
            Err(LoadFail::Error(why)) => (Reason::ConfigInvalid, why),
        };
        match rules.on_invalid {
            OnInvalid::Fatal => return Err(NotSelected::Invalid { file, reason, why }),
            OnInvalid::Skip => skipped.push(Skipped { file, reason, why }),
        }
    }
    Err(NotSelected::NoneValid { skipped })
}

/// Why a loaded candidate is not chosen.
enum Candidate {
    Fails(Reason, String),
    Undecidable(Reason, String),
}

/// Runs the runtime's chain validation on a loaded list, when its rules have one.
fn validated(
    rules: &RuntimeRules,
    validate: &mut dyn FnMut(&NetConfList) -> Validation,
    list: &NetConfList,
) -> Result<(), Candidate> {
    if !rules.validates_chain {
        return Ok(());
    }
    match validate(list) {
        Validation::Valid => Ok(()),
        Validation::Fails(reason, why) => Err(Candidate::Fails(reason, why)),
        Validation::Undecidable(reason, why) => Err(Candidate::Undecidable(reason, why)),
    }
}

type Loaded = (Vec<u8>, NetConfList, Vec<Vec<u8>>);

/// Loads one candidate as go-cni / ocicni would, drop-ins included: its bytes, the chain, and
/// the drop-in file names.
fn load(src: &mut dyn ConfSource, file: &[u8]) -> Result<Loaded, LoadFail> {
    let bytes = src.read(file).map_err(from_source)?;
    if ext(file) != b".conflist" {
        let list =
            NetConfList::from_conf_bytes(&bytes).map_err(|e| LoadFail::Error(e.to_string()))?;
        return Ok((bytes, list, Vec::new()));
    }
    let mut list =
        NetConfList::from_conflist_bytes(&bytes).map_err(|e| LoadFail::Error(e.to_string()))?;
    let drop_ins = if list.load_only_inlined_plugins {
        Vec::new()
    } else {
        append_drop_ins(src, b"", &mut list)?
    };
    if list.plugins.is_empty() {
        return Err(LoadFail::Error(
            "has no plugins (none inline and none in its drop-in directory)".into(),
        ));
    }
    Ok((bytes, list, drop_ins))
}

/// libcni `NetworkPluginConfsFromFiles(filepath.Join(dir, list.name), ...)`: the `.conf` files
/// of the list's drop-in directory beside its file (`dir`, relative to the source), appended
/// to `list` in name order; their names are returned. A missing directory adds nothing; any
/// other listing error, or a drop-in that does not load, fails the whole list.
pub(super) fn append_drop_ins(
    src: &mut dyn ConfSource,
    dir: &[u8],
    list: &mut NetConfList,
) -> Result<Vec<Vec<u8>>, LoadFail> {
    let dir = join_clean(dir, list.name.as_bytes());
    let entries = match src.list(&dir) {
        Ok(e) => e,
        Err(SourceError::NotFound) => Vec::new(),
        Err(SourceError::Undecidable(why)) => return Err(LoadFail::Undecidable(why)),
        Err(SourceError::Io(why)) => {
            return Err(LoadFail::Error(format!(
                "names a network whose drop-in plugin directory cannot be listed ({why}), so the list fails to load"
            )));
        }
    };
    let mut drop_ins = Vec::new();
    for (k, f) in entries
        .into_iter()
        .filter(|f| !f.is_dir && ext(&f.name) == b".conf")
        .enumerate()
    {
        let path = join_clean(&dir, &f.name);
        let shown = display(&f.name);
        let plugin = src
            .read(&path)
            .map_err(|e| match e {
                SourceError::Undecidable(why) => LoadFail::Undecidable(why),
                other => {
                    LoadFail::Error(format!("drop-in plugin file #{} ({shown}) {other}", k + 1))
                }
            })
            .and_then(|b| {
                PluginConf::from_bytes(&b).map_err(|e| {
                    LoadFail::Error(format!("drop-in plugin file #{} ({shown}) {e}", k + 1))
                })
            })?;
        list.plugins.push(plugin);
        drop_ins.push(f.name);
    }
    Ok(drop_ins)
}
