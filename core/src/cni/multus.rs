//! Multus as the primary CNI: the chain the runtime loads is `[multus]` (thin plugin) or
//! `[multus-shim]` (thick plugin), and the pod's interface and the mesh plugin come from the
//! *cluster-default network* Multus runs as its first delegate. This module finds that
//! delegate the way Multus v4 does and loads it with libcni's rules.
//!
//! In: the effective config (its bytes and loaded chain), the position and [`Layout`] of the
//! Multus plugin in it, the config directory (to read a `clusterNetwork` file through the
//! same budgeted [`ConfSource`]). Out: a [`Delegate`] (the loaded delegate chain and where
//! it came from), or an [`Unresolved`] that says why it cannot be verified, never quoting
//! file content.
//!
//! Upstream (k8snetworkplumbingwg/multus-cni):
//! - `pkg/types/conf.go` `LoadNetConf`: the plugin object is decoded into Multus's `NetConf`
//!   (Go field matching; `delegates` a `[]map[string]interface{}`, `clusterNetwork` a
//!   string); no delegates and no `clusterNetwork` is an error. Without `clusterNetwork`,
//!   every delegate is loaded (`LoadDelegateNetConf`) and the first is the master plugin.
//! - `LoadDelegateNetConf`: the delegate, re-marshalled, is decoded as `types.NetConf`; a
//!   non-empty `type` makes it a single plugin (`ConfFromBytes`, run by `AddNetwork`),
//!   otherwise it must have `plugins` whose first `type` is non-empty (`ConfListFromBytes`,
//!   run by `AddNetworkList`: inline plugins only, never CNI 1.1 drop-ins).
//! - `pkg/k8sclient/k8sclient.go` `getNetDelegate`: a `clusterNetwork` without `/` is a
//!   NetworkAttachmentDefinition name looked up through the API first, then a network name
//!   in Multus's own conf dir; with `/` it is a directory (its first config, as
//!   `GetCNIConfigFromFile("", dir)` picks it) or a file, loaded with libcni
//!   `ConfListFromFile` (`.conflist`) or `ConfFromFile` (other names).
//!   Since v4.2.1 a `.conflist` file is loaded by `LoadChainedPluginsFromFile`
//!   (`loadSubdirectoryChain`): unless the list sets `loadOnlyInlinedPlugins`, the `.conf`
//!   files of `<the file's directory>/<its network name>/` are appended, as libcni's
//!   `NetworkPluginConfsFromFiles` lists them; the name must be a valid CNI network name.
//!   Older releases load the file's inline plugins only ([`MultusVersion`]).
//! - `pkg/server/config/manager.go`: the thick daemon's generated `00-multus.conf` names the
//!   primary config as `clusterNetwork` = `multusAutoconfigDir` + file; the shipped thick
//!   DaemonSet (`deployments/multus-daemonset-thick.yml`) sets `cniConfigDir` and
//!   `multusAutoconfigDir` to `/host/etc/cni/net.d`, where it mounts the node's
//!   `/etc/cni/net.d`. So a thick path under the daemon's conf dir
//!   ([`MultusOptions::daemon_conf_dir`]) is the same file under the directory being checked;
//!   any other thick path under [`THICK_HOST_ROOT`] is that host path.

use serde::{Deserialize, Serialize};

use super::config::{NetConfList, PluginConf};
use super::gojson::{self, GoValue};
use super::listing::{ConfSource, Dirent, SourceError, display, ext, is_config_name, join_clean};
use super::reason::Reason;
use super::select::{EffectiveConfig, LoadFail, append_drop_ins};

/// Where the thick daemon of Multus's shipped DaemonSet sees the host's root for the config
/// directory (`hostPath: /etc/cni/net.d` mounted at `/host/etc/cni/net.d`).
pub const THICK_HOST_ROOT: &str = "/host";

/// The daemon conf dir of Multus's shipped thick DaemonSet (`cniConfigDir` and
/// `multusAutoconfigDir` in its `daemon-config.json`).
pub const DEFAULT_DAEMON_CONF_DIR: &str = "/host/etc/cni/net.d";

/// What meshgate must be told of the Multus on the node: nothing on the node's disk says it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MultusOptions {
    /// The thick daemon's view of the node's CNI config directory (its daemon config's
    /// `multusAutoconfigDir`, which prefixes the `clusterNetwork` it generates). A thick
    /// `clusterNetwork` under it is read under the directory being checked.
    pub daemon_conf_dir: String,
    /// The Multus release, for how it loads a `clusterNetwork` file.
    pub version: MultusVersion,
}

impl Default for MultusOptions {
    fn default() -> Self {
        Self {
            daemon_conf_dir: DEFAULT_DAEMON_CONF_DIR.into(),
            version: MultusVersion::Latest,
        }
    }
}

/// A Multus release, as the operator names it (`latest`, `v4.2.1`, `4.1`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MultusVersion {
    /// The current release's behaviour.
    #[default]
    Latest,
    /// `major.minor.patch`.
    Release(u32, u32, u32),
}

impl MultusVersion {
    /// True when a `.conflist` `clusterNetwork` file gets its subdirectory drop-ins (v4.2.1
    /// and later).
    pub fn loads_drop_ins(self) -> bool {
        match self {
            MultusVersion::Latest => true,
            MultusVersion::Release(a, b, c) => (a, b, c) >= (4, 2, 1),
        }
    }
}

impl std::str::FromStr for MultusVersion {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "latest" {
            return Ok(MultusVersion::Latest);
        }
        let bad = || format!("{s:?} is not `latest` or a release such as v4.2.1");
        let digits = s.strip_prefix('v').unwrap_or(s);
        let parts: Vec<u32> = digits
            .split('.')
            .map(|p| p.parse::<u32>().map_err(|_| bad()))
            .collect::<Result<_, _>>()?;
        match parts[..] {
            [a, b] => Ok(MultusVersion::Release(a, b, 0)),
            [a, b, c] => Ok(MultusVersion::Release(a, b, c)),
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for MultusVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MultusVersion::Latest => f.write_str("latest"),
            MultusVersion::Release(a, b, c) => write!(f, "v{a}.{b}.{c}"),
        }
    }
}

/// Which Multus runs the cluster-default network.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Layout {
    /// The thin plugin (`type: multus`), run by the runtime on the host.
    MultusThin,
    /// The thick plugin (`type: multus-shim`), which hands the request to the Multus daemon.
    MultusThick,
}

impl Layout {
    /// The layout of a plugin type, if it is Multus.
    pub fn of(plugin_type: &str) -> Option<Layout> {
        match plugin_type {
            "multus" => Some(Layout::MultusThin),
            "multus-shim" => Some(Layout::MultusThick),
            _ => None,
        }
    }

    /// How messages name it.
    pub fn display(self) -> &'static str {
        match self {
            Layout::MultusThin => "multus (thin)",
            Layout::MultusThick => "multus (thick)",
        }
    }
}

/// The cluster-default network Multus runs, loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delegate {
    /// Which Multus.
    pub layout: Layout,
    /// How messages name the delegate: `inline delegate #1`, or `clusterNetwork <path>` for
    /// a file inside the config directory (a config-dir entry), or `clusterNetwork file
    /// outside <dir>`.
    pub source: String,
    /// The path of a `clusterNetwork` file as the agent reads it (`check` output and the
    /// agent's file watch only; never in messages).
    pub file: Option<String>,
    /// The delegate chain as libcni loads it for Multus.
    pub list: NetConfList,
}

/// Why the cluster-default network cannot be verified.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unresolved {
    /// The reason to report.
    pub reason: Reason,
    /// Why, without file content.
    pub why: String,
}

fn invalid(why: impl Into<String>) -> Unresolved {
    Unresolved {
        reason: Reason::ConfigInvalid,
        why: why.into(),
    }
}

/// The first Multus plugin of the chain, with its position.
pub fn find(list: &NetConfList) -> Option<(usize, Layout)> {
    list.plugins
        .iter()
        .enumerate()
        .find_map(|(i, p)| Layout::of(&p.plugin_type).map(|l| (i, l)))
}

/// Multus's own fields of its plugin object (`NetConf` in `pkg/types/types.go`).
struct MultusConf {
    delegates: Vec<GoValue>,
    cluster_network: String,
}

/// Resolves and loads the cluster-default delegate of the Multus plugin at `at`.
pub fn resolve(
    src: &mut dyn ConfSource,
    conf_dir: &str,
    opts: &MultusOptions,
    eff: &EffectiveConfig,
    at: usize,
    layout: Layout,
) -> Result<Delegate, Unresolved> {
    let conf = multus_conf(eff, at)?;
    if conf.cluster_network.is_empty() {
        return inline(conf.delegates, layout);
    }
    if !conf.cluster_network.contains('/') {
        return Err(invalid(
            "its clusterNetwork is a network name, which Multus resolves through the API first (a NetworkAttachmentDefinition in its namespace) and only then in its own conf dir, so the cluster-default network cannot be verified from the node's files; name the file by its path in clusterNetwork, or let Multus copy the primary config into its delegates",
        ));
    }
    from_file(src, conf_dir, opts, &conf.cluster_network, layout)
}

/// The Multus plugin's object as Multus decodes it: the Go map of the plugin (libcni's
/// `buildOneConfig` re-marshals it), then `delegates` and `clusterNetwork` by Go's field
/// matching (exact, then case-folded; the last matching key wins).
fn multus_conf(eff: &EffectiveConfig, at: usize) -> Result<MultusConf, Unresolved> {
    if at >= eff.list.plugins.len() - eff.drop_ins.len() {
        return Err(invalid(
            "it comes from a drop-in plugin file, which meshgate does not read as Multus's configuration",
        ));
    }
    let doc = gojson::parse(&eff.bytes).map_err(|e| invalid(format!("is not valid JSON: {e}")))?;
    let object = if ext(&eff.file) == b".conflist" {
        match doc.get_exact("plugins") {
            Some(GoValue::Array(items)) if at < items.len() => items[at].as_go_map(),
            _ => return Err(invalid("has no Multus plugin object where it was loaded")),
        }
    } else {
        doc.as_go_map()
    };
    let GoValue::Object(members) = &object else {
        return Err(invalid("has a Multus plugin that is not a JSON object"));
    };
    let mut conf = MultusConf {
        delegates: Vec::new(),
        cluster_network: String::new(),
    };
    for (key, value) in members {
        if gojson::field_matches(key, "delegates") {
            conf.delegates = delegates(value)?;
        } else if gojson::field_matches(key, "clusterNetwork") {
            match value {
                GoValue::String(s) => conf.cluster_network = s.clone(),
                GoValue::Null => {}
                _ => {
                    return Err(invalid(
                        "has a clusterNetwork that is not a string, so Multus refuses every pod (LoadNetConf)",
                    ));
                }
            }
        }
    }
    Ok(conf)
}

/// `[]map[string]interface{}`: null, or a list of objects (a null item decodes to a nil map).
fn delegates(value: &GoValue) -> Result<Vec<GoValue>, Unresolved> {
    let bad = || {
        invalid(
            "has delegates that are not a list of JSON objects, so Multus refuses every pod (LoadNetConf)",
        )
    };
    match value {
        GoValue::Null => Ok(Vec::new()),
        GoValue::Array(items) => {
            if items
                .iter()
                .all(|i| matches!(i, GoValue::Object(_) | GoValue::Null))
            {
                Ok(items.iter().map(GoValue::as_go_map).collect())
            } else {
                Err(bad())
            }
        }
        _ => Err(bad()),
    }
}

/// Inline delegates (no `clusterNetwork`): every one must load, the first is the master.
fn inline(delegates: Vec<GoValue>, layout: Layout) -> Result<Delegate, Unresolved> {
    if delegates.is_empty() {
        return Err(invalid(
            "has neither delegates nor a clusterNetwork, so Multus refuses every pod (LoadNetConf)",
        ));
    }
    let mut master = None;
    for (i, d) in delegates.iter().enumerate() {
        let list = load_delegate(d)
            .map_err(|why| invalid(format!("has inline delegate #{} that {why}", i + 1)))?;
        master.get_or_insert(list);
    }
    let list = master.ok_or_else(|| invalid("has no delegate"))?;
    Ok(Delegate {
        layout,
        source: "inline delegate #1".into(),
        file: None,
        list,
    })
}

/// Multus `LoadDelegateNetConf` on the delegate's Go map, then what libcni loads from those
/// bytes when Multus runs it (`ConfFromBytes` or `ConfListFromBytes`: no drop-ins).
fn load_delegate(map: &GoValue) -> Result<NetConfList, String> {
    if !map.numbers_fit_f64() {
        return Err("holds a number out of float64 range".into());
    }
    let typed = PluginConf::decode_typed(map, None).map_err(|e| format!("does not load: {e}"))?;
    if !typed.plugin_type.is_empty() {
        return NetConfList::from_conf_value(map.as_go_map())
            .map_err(|e| format!("does not load: {e}"));
    }
    match map.get_exact("plugins") {
        None | Some(GoValue::Null) => {
            return Err("has neither a type nor plugins, which Multus refuses".into());
        }
        _ => {}
    }
    NetConfList::from_go_map(map).map_err(|e| format!("does not load: {e}"))
}

/// A `clusterNetwork` path: read through the budgeted source, loaded as libcni's
/// `ConfListFromFile` / `ConfFromFile` and then as Multus's delegate, with the subdirectory
/// drop-ins of a `.conflist` file when the release loads them.
fn from_file(
    src: &mut dyn ConfSource,
    conf_dir: &str,
    opts: &MultusOptions,
    path: &str,
    layout: Layout,
) -> Result<Delegate, Unresolved> {
    let Some((rel, on_node)) = locate(conf_dir, opts, path, layout) else {
        return Err(invalid(
            "its clusterNetwork path is not an absolute path without `..` that meshgate can map onto the node, so the cluster-default network cannot be verified",
        ));
    };
    let inside = !rel.starts_with(b"../") && rel != b"..";
    let mut source = if inside {
        format!(
            "clusterNetwork {}/{}",
            conf_dir.trim_end_matches('/'),
            display(&rel)
        )
    } else {
        format!("clusterNetwork file outside {conf_dir}")
    };
    let fail = |source: &str, why: String| invalid(format!("its {source} {why}"));
    let (bytes, read) = read_path(src, &rel).map_err(|why| fail(&source, why))?;
    let file = if read == rel {
        on_node
    } else {
        format!(
            "{}/{}",
            on_node.trim_end_matches('/'),
            display(&read[rel.len()..]).trim_start_matches('/')
        )
    };
    let doc =
        gojson::parse(&bytes).map_err(|e| fail(&source, format!("is not valid JSON: {e}")))?;
    let conflist = ext(&read) == b".conflist";
    let loaded = if conflist {
        NetConfList::from_go_map(&doc).map(drop)
    } else {
        PluginConf::decode_typed(&doc, None).and_then(|p| {
            if p.plugin_type.is_empty() {
                Err(super::config::ConfigError::MissingType(None))
            } else {
                Ok(())
            }
        })
    };
    loaded.map_err(|e| fail(&source, format!("does not load with libcni: {e}")))?;
    let mut list = load_delegate(&doc.as_go_map()).map_err(|why| fail(&source, why))?;
    // A named file only: a directory's first config is read as Multus reads bytes.
    if conflist && read == rel && opts.version.loads_drop_ins() && !list.load_only_inlined_plugins {
        let drop_ins =
            subdirectory_drop_ins(src, &read, &mut list).map_err(|why| fail(&source, why))?;
        if !drop_ins.is_empty() {
            source = format!("{source} + {}", drop_in_names(&drop_ins));
        }
    }
    Ok(Delegate {
        layout,
        source,
        file: Some(file),
        list,
    })
}

/// Where a `clusterNetwork` path is read: relative to the config directory (with `..` to
/// climb out of it), and the absolute path the agent reads and watches. A thick path under
/// the daemon's conf dir is the same file under `conf_dir`; any other thick path loses its
/// [`THICK_HOST_ROOT`]; a thin path is the host's.
fn locate(
    conf_dir: &str,
    opts: &MultusOptions,
    path: &str,
    layout: Layout,
) -> Option<(Vec<u8>, String)> {
    if layout == Layout::MultusThick
        && let Some(rel) = relative_to(&opts.daemon_conf_dir, path)
            .filter(|r| !r.starts_with(b"..") && conf_dir.starts_with('/'))
    {
        let on_node = if rel.is_empty() {
            conf_dir.to_string()
        } else {
            format!("{}/{}", conf_dir.trim_end_matches('/'), display(&rel))
        };
        return Some((rel, on_node));
    }
    let host_path = match layout {
        Layout::MultusThick => path
            .strip_prefix(THICK_HOST_ROOT)
            .filter(|rest| rest.starts_with('/'))
            .unwrap_or(path),
        Layout::MultusThin => path,
    };
    relative_to(conf_dir, host_path).map(|rel| (rel, host_path.to_string()))
}

/// Multus's `loadSubdirectoryChain` for the `.conflist` at `file`: its network name must be a
/// valid CNI name, then libcni's drop-ins beside the file are appended.
fn subdirectory_drop_ins(
    src: &mut dyn ConfSource,
    file: &[u8],
    list: &mut NetConfList,
) -> Result<Vec<Vec<u8>>, String> {
    if !is_cni_network_name(&list.name) {
        return Err(
            "has a network name that is not a valid CNI network name, which Multus refuses when it loads the network's drop-in plugins".into(),
        );
    }
    let dir = match file.iter().rposition(|&b| b == b'/') {
        Some(i) => &file[..i],
        None => &b""[..],
    };
    append_drop_ins(src, dir, list).map_err(|e| match e {
        LoadFail::Error(why) | LoadFail::Undecidable(why) => why,
    })
}

/// The CNI spec's network name: an alphanumeric, then alphanumerics, `_`, `.` or `-`.
fn is_cni_network_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// `drop-in plugin files a.conf, b.conf`, for the delegate's source (file names only: the
/// directory is the network's name, which is file content).
fn drop_in_names(files: &[Vec<u8>]) -> String {
    let names: Vec<String> = files.iter().map(|f| display(f)).collect();
    let s = if names.len() == 1 { "" } else { "s" };
    format!("drop-in plugin file{s} {}", names.join(", "))
}

/// Reads a `clusterNetwork` path as Multus does (`os.Stat`, then a file, or a directory's
/// first config: libcni `ConfFiles` with `.conf`/`.conflist` must find one, then
/// `GetCNIConfigFromFile("", dir)` takes the first `.conf`/`.json`/`.conflist`): the bytes
/// and the relative path of the file read.
fn read_path(src: &mut dyn ConfSource, rel: &[u8]) -> Result<(Vec<u8>, Vec<u8>), String> {
    match src.read(rel) {
        Ok(b) => Ok((b, rel.to_vec())),
        Err(SourceError::Io(why)) if why == "is a directory" => first_in_dir(src, rel),
        Err(SourceError::NotFound) => Err("does not exist, so Multus fails every pod's ADD".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// A `clusterNetwork` directory: its first config file, read.
fn first_in_dir(src: &mut dyn ConfSource, dir: &[u8]) -> Result<(Vec<u8>, Vec<u8>), String> {
    let entries = src
        .list(dir)
        .map_err(|e| format!("is a directory that {e}"))?;
    let files: Vec<&Dirent> = entries.iter().filter(|e| !e.is_dir).collect();
    if !files
        .iter()
        .any(|f| matches!(ext(&f.name), b".conf" | b".conflist"))
    {
        return Err(
            "is a directory without a .conf or .conflist file, so Multus finds no network in it"
                .into(),
        );
    }
    let Some(first) = files.iter().find(|f| is_config_name(&f.name)) else {
        return Err("is a directory without a config file".into());
    };
    let path = join_clean(dir, &first.name);
    let bytes = src
        .read(&path)
        .map_err(|e| format!("is a directory whose first config file {e}"))?;
    Ok((bytes, path))
}

/// `abs` relative to `dir` (both absolute, lexically), with `..` to climb out of `dir`;
/// `None` when either is not absolute or `abs` has `.` or `..` parts (the runtime would
/// resolve those through symlinks, which a lexical path cannot follow).
pub fn relative_to(dir: &str, abs: &str) -> Option<Vec<u8>> {
    if !dir.starts_with('/') || !abs.starts_with('/') {
        return None;
    }
    let parts = |p: &str| -> Vec<String> {
        p.split('/')
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()
    };
    let (d, a) = (parts(dir), parts(abs));
    if a.iter().any(|s| s == "." || s == "..") || d.iter().any(|s| s == "..") {
        return None;
    }
    let common = d.iter().zip(&a).take_while(|(x, y)| x == y).count();
    let mut out: Vec<String> = vec!["..".to_string(); d.len() - common];
    out.extend(a[common..].iter().cloned());
    Some(out.join("/").into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_are_lexical() {
        let r = |d, a| relative_to(d, a).map(|v| String::from_utf8(v).unwrap());
        assert_eq!(
            r("/etc/cni/net.d", "/etc/cni/net.d/10-calico.conflist").as_deref(),
            Some("10-calico.conflist")
        );
        assert_eq!(
            r("/etc/cni/net.d/", "/etc/cni/multus/net.d/a.conf").as_deref(),
            Some("../multus/net.d/a.conf")
        );
        assert_eq!(r("/etc/cni/net.d", "/etc/cni/net.d/../x"), None);
        assert_eq!(r("net.d", "/etc/x"), None);
        assert_eq!(r("/etc/cni/net.d", "x.conf"), None);
    }

    #[test]
    fn releases_parse_and_drop_ins_start_at_v4_2_1() {
        let v = |s: &str| s.parse::<MultusVersion>();
        assert_eq!(v("latest"), Ok(MultusVersion::Latest));
        assert_eq!(v("v4.2.1"), Ok(MultusVersion::Release(4, 2, 1)));
        assert_eq!(v("4.1"), Ok(MultusVersion::Release(4, 1, 0)));
        for bad in ["", "v", "4", "4.x", "v4.2.1.1", "-1.2", "4.2.1-rc1"] {
            assert!(v(bad).is_err(), "{bad:?}");
        }
        let drops = |s: &str| v(s).unwrap().loads_drop_ins();
        assert!(drops("latest") && drops("v4.2.1") && drops("4.3.0") && drops("v5.0"));
        assert!(!drops("v4.2.0") && !drops("4.1.4") && !drops("3.9.3"));
        assert_eq!(MultusVersion::Release(4, 2, 1).to_string(), "v4.2.1");
    }

    #[test]
    fn layouts_are_the_two_multus_plugin_types() {
        assert_eq!(Layout::of("multus"), Some(Layout::MultusThin));
        assert_eq!(Layout::of("multus-shim"), Some(Layout::MultusThick));
        assert_eq!(Layout::of("multus-cni"), None);
        assert_eq!(
            serde_json::to_string(&Layout::MultusThick).unwrap(),
            "\"multus-thick\""
        );
    }
}
