//! Which config file the container runtime really loads: the *effective* config.
//!
//! In: the config directory's entries and the runtime's semantics. Out: a [`Selection`]:
//! the effective file parsed into a [`NetConfList`] (with CNI 1.1 drop-in plugins appended),
//! or why there is none.
//!
//! - Candidates are the non-directory entries ending in `.conf`, `.conflist` or `.json`,
//!   sorted by file name (libcni `ConfFiles` + `sort.Strings`).
//! - containerd (go-cni) loads only the first candidate and fails outright when it does not
//!   parse or has no plugins, so a broken first file blocks every pod sandbox.
//! - CRI-O (ocicni) skips candidates that do not load and takes the first that does.
//! - Unless the list sets `loadOnlyInlinedPlugins`, libcni appends every `.conf` plugin
//!   object from `<conf dir>/<network name>/`, in file-name order.

use serde::{Deserialize, Serialize};

use super::config::{NetConfList, PluginConf};
use super::listing::{DirEntry, EntryKind, is_config_name};

/// The container runtime whose loading semantics are applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Runtime {
    /// containerd (go-cni): the first file wins; an invalid first file is fatal.
    #[default]
    Containerd,
    /// CRI-O (ocicni): invalid files are skipped.
    Crio,
}

impl Runtime {
    /// The name used in flags and JSON output.
    pub fn as_str(self) -> &'static str {
        match self {
            Runtime::Containerd => "containerd",
            Runtime::Crio => "crio",
        }
    }
}

/// The config the runtime loads, with how it was found.
#[derive(Clone, Debug, PartialEq)]
pub struct EffectiveConfig {
    /// File name of the effective config in the config directory.
    pub file: String,
    /// The loaded chain, drop-in plugins included.
    pub list: NetConfList,
    /// Drop-in plugin files appended to the chain, as `<network>/<file>`.
    pub drop_ins: Vec<String>,
    /// Files sorting before the effective one that CRI-O skipped, with why.
    pub skipped: Vec<(String, String)>,
}

/// The outcome of effective-config selection.
#[derive(Clone, Debug, PartialEq)]
pub enum Selection {
    /// The runtime loads this config.
    Found(EffectiveConfig),
    /// No candidate file at all.
    NoConfig,
    /// The runtime cannot load a config: `file` is the offending one (the first file for
    /// containerd; for CRI-O the first of the files it skipped).
    Invalid {
        /// The offending file name.
        file: String,
        /// Why it cannot be loaded.
        why: String,
    },
}

/// Selects the effective config from a directory listing.
pub fn select_effective(entries: &[DirEntry], runtime: Runtime) -> Selection {
    let mut candidates: Vec<&DirEntry> = entries
        .iter()
        .filter(|e| !matches!(e.kind, EntryKind::Directory(_)) && is_config_name(&e.name))
        .collect();
    // Go's sort.Strings compares bytes, and so does str's Ord.
    candidates.sort_by(|a, b| a.name.cmp(&b.name));

    let mut skipped = Vec::new();
    for candidate in candidates {
        match load(candidate, entries) {
            Ok((list, drop_ins)) => {
                return Selection::Found(EffectiveConfig {
                    file: candidate.name.clone(),
                    list,
                    drop_ins,
                    skipped,
                });
            }
            Err(why) => match runtime {
                Runtime::Containerd => {
                    return Selection::Invalid {
                        file: candidate.name.clone(),
                        why,
                    };
                }
                Runtime::Crio => skipped.push((candidate.name.clone(), why)),
            },
        }
    }
    match skipped.into_iter().next() {
        None => Selection::NoConfig,
        Some((file, why)) => Selection::Invalid {
            file,
            why: format!("{why}; no other config file loads either"),
        },
    }
}

/// Loads one candidate file as the runtime would, drop-ins included.
fn load(entry: &DirEntry, siblings: &[DirEntry]) -> Result<(NetConfList, Vec<String>), String> {
    let bytes = readable(&entry.kind)?;
    let is_list = entry.name.ends_with(".conflist");
    let mut list = if is_list {
        NetConfList::from_conflist_bytes(bytes)
    } else {
        NetConfList::from_conf_bytes(bytes)
    }
    .map_err(|e| e.to_string())?;

    let mut drop_ins = Vec::new();
    let drop_in_dir = match is_list && !list.load_only_inlined_plugins {
        true => siblings.iter().find(|e| e.name == list.name),
        false => None,
    };
    if let Some(dir) = drop_in_dir {
        let EntryKind::Directory(files) = &dir.kind else {
            return Err(format!(
                "names network {:?}, but {:?} beside it is not a drop-in plugin directory",
                list.name, dir.name
            ));
        };
        let mut confs: Vec<&DirEntry> = files
            .iter()
            .filter(|f| f.name.ends_with(".conf") && !matches!(f.kind, EntryKind::Directory(_)))
            .collect();
        confs.sort_by(|a, b| a.name.cmp(&b.name));
        for f in confs {
            let shown = format!("{}/{}", dir.name, f.name);
            let plugin = readable(&f.kind)
                .and_then(|b| PluginConf::from_bytes(b).map_err(|e| e.to_string()))
                .map_err(|why| format!("drop-in plugin file {shown} {why}"))?;
            list.plugins.push(plugin);
            drop_ins.push(shown);
        }
    }
    if list.plugins.is_empty() {
        return Err("has no plugins".into());
    }
    Ok((list, drop_ins))
}

fn readable(kind: &EntryKind) -> Result<&[u8], String> {
    match kind {
        EntryKind::File(bytes) => Ok(bytes),
        EntryKind::TooLarge { size, limit } => Err(format!(
            "is {size} bytes, over the {limit}-byte limit for a CNI config"
        )),
        EntryKind::NotRegular(what) => Err(format!("is a {what}, not a regular file")),
        EntryKind::Unreadable(why) => Err(format!("cannot be read: {why}")),
        EntryKind::Directory(_) => Err("is a directory".into()),
    }
}
