//! The CNI network configuration model (`.conflist`, `.conf`, `.json`), parsed with libcni's
//! rules so that what meshgate calls valid is what the runtime would load.
//!
//! In: a file's bytes. Out: a [`NetConfList`] (a `.conf` becomes a one-plugin list, as
//! libcni's `ConfListFromConf` does) or a [`ConfigError`]. Unknown fields are kept in
//! `extra` maps, so a parsed config serializes back with everything it had.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

/// The newest CNI spec version libcni implements; `cniVersions` entries above it are ignored
/// when the effective version is resolved, as libcni does.
pub const CURRENT_SPEC_VERSION: &str = "1.1.0";

/// Why a config file is not a loadable network configuration.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// Not JSON, or JSON of the wrong shape (missing `name`, `plugins` not a list, a
    /// boolean field that is neither a bool nor "true"/"false", ...).
    #[error("cannot be parsed: {0}")]
    Syntax(String),
    /// A plugin object has no `type` or an empty one. `None` for a single-plugin `.conf`.
    #[error("{} has no plugin type", match .0 { Some(i) => format!("plugin #{}", i + 1), None => "the config".to_string() })]
    MissingType(Option<usize>),
    /// A plugin `type` contains a path separator, which the CNI spec forbids.
    #[error("plugin type {0:?} contains a path separator")]
    TypeWithPath(String),
    /// `cniVersions` holds an entry that is not a semantic version.
    #[error("invalid cniVersions entry {0:?}")]
    InvalidVersion(String),
    /// `loadOnlyInlinedPlugins` is true but the list has no `plugins` key.
    #[error("loadOnlyInlinedPlugins is true and there is no \"plugins\" list")]
    InlinedWithoutPlugins,
    /// `plugins` is present but empty.
    #[error("the \"plugins\" list is empty")]
    EmptyPluginList,
}

/// One plugin configuration object in a chain.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PluginConf {
    /// The plugin binary's name in the CNI bin dirs.
    #[serde(rename = "type", default)]
    pub plugin_type: String,
    /// Every other field, preserved as written.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl PluginConf {
    /// The delegated IPAM plugin's type (`ipam.type`), whose binary must exist too.
    pub fn ipam_type(&self) -> Option<&str> {
        self.extra
            .get("ipam")?
            .get("type")?
            .as_str()
            .filter(|t| !t.is_empty())
    }

    /// Parses one plugin object from a drop-in `<network>/*.conf` file.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ConfigError> {
        let p: PluginConf =
            serde_json::from_slice(bytes).map_err(|e| ConfigError::Syntax(e.to_string()))?;
        p.validate(None)?;
        Ok(p)
    }

    fn validate(&self, index: Option<usize>) -> Result<(), ConfigError> {
        if self.plugin_type.is_empty() {
            return Err(ConfigError::MissingType(index));
        }
        if self.plugin_type.contains(['/', '\\']) {
            return Err(ConfigError::TypeWithPath(self.plugin_type.clone()));
        }
        Ok(())
    }
}

/// A network configuration list: what the runtime runs, in order, for every pod sandbox.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetConfList {
    /// `cniVersion` as written.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cni_version: String,
    /// `cniVersions` as written (CNI 1.1).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cni_versions: Vec<String>,
    /// Network name; also names the drop-in plugin directory.
    pub name: String,
    /// If true, runtimes must not call CHECK.
    #[serde(default, deserialize_with = "bool_or_string")]
    pub disable_check: bool,
    /// If true, runtimes must not call GC.
    #[serde(default, rename = "disableGC", deserialize_with = "bool_or_string")]
    pub disable_gc: bool,
    /// If false (the default), plugins from `<conf dir>/<name>/*.conf` are appended.
    #[serde(default, deserialize_with = "bool_or_string")]
    pub load_only_inlined_plugins: bool,
    /// The inline chain, in order. Drop-in plugins are appended here by the loader.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub plugins: Vec<PluginConf>,
    /// Every other field, preserved as written.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// libcni accepts a JSON bool or the strings "true"/"false" in any case.
fn bool_or_string<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    match Value::deserialize(d)? {
        Value::Bool(b) => Ok(b),
        Value::String(s) if s.eq_ignore_ascii_case("true") => Ok(true),
        Value::String(s) if s.eq_ignore_ascii_case("false") => Ok(false),
        other => Err(serde::de::Error::custom(format!(
            "invalid boolean value {other}"
        ))),
    }
}

impl NetConfList {
    /// Parses a `.conflist`. Drop-in plugins are not loaded here (they live in other files).
    pub fn from_conflist_bytes(bytes: &[u8]) -> Result<Self, ConfigError> {
        let raw: Map<String, Value> =
            serde_json::from_slice(bytes).map_err(|e| ConfigError::Syntax(e.to_string()))?;
        let has_plugins_key = raw.contains_key("plugins");
        let list: NetConfList = serde_json::from_value(Value::Object(raw))
            .map_err(|e| ConfigError::Syntax(e.to_string()))?;
        if !has_plugins_key && list.load_only_inlined_plugins {
            return Err(ConfigError::InlinedWithoutPlugins);
        }
        if has_plugins_key && list.plugins.is_empty() {
            return Err(ConfigError::EmptyPluginList);
        }
        for (i, p) in list.plugins.iter().enumerate() {
            p.validate(Some(i))?;
        }
        for v in &list.cni_versions {
            parse_version(v).ok_or_else(|| ConfigError::InvalidVersion(v.clone()))?;
        }
        Ok(list)
    }

    /// Parses a single-plugin `.conf` / `.json` and turns it into a one-plugin list, the way
    /// libcni's `ConfListFromConf` does: the list takes the plugin's `name` and `cniVersion`.
    pub fn from_conf_bytes(bytes: &[u8]) -> Result<Self, ConfigError> {
        let plugin: PluginConf =
            serde_json::from_slice(bytes).map_err(|e| ConfigError::Syntax(e.to_string()))?;
        plugin.validate(None)?;
        let text = |k: &str| {
            plugin
                .extra
                .get(k)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        Ok(NetConfList {
            cni_version: text("cniVersion"),
            cni_versions: Vec::new(),
            name: text("name"),
            disable_check: false,
            disable_gc: false,
            // A .conf is never extended from a drop-in directory by libcni.
            load_only_inlined_plugins: true,
            plugins: vec![plugin],
            extra: Map::new(),
        })
    }

    /// The cniVersion the runtime runs the chain with: the highest of `cniVersions` and
    /// `cniVersion` that libcni implements (libcni `NetworkConfFromBytes`).
    pub fn effective_version(&self) -> &str {
        let current = parse_version(CURRENT_SPEC_VERSION);
        self.cni_versions
            .iter()
            .chain(std::iter::once(&self.cni_version))
            .filter_map(|v| parse_version(v).map(|p| (p, v)))
            .filter(|(p, _)| Some(*p) <= current)
            .max_by_key(|(p, _)| *p)
            .map(|(_, v)| v.as_str())
            .unwrap_or(self.cni_version.as_str())
    }

    /// The chain's plugin types, in order.
    pub fn plugin_types(&self) -> Vec<String> {
        self.plugins.iter().map(|p| p.plugin_type.clone()).collect()
    }
}

/// Parses `MAJOR.MINOR.PATCH` (also `MAJOR.MINOR`), as CNI versions are written.
pub fn parse_version(v: &str) -> Option<(u64, u64, u64)> {
    let mut it = v.trim().split('.');
    let major = it.next()?.parse().ok()?;
    let minor = it.next()?.parse().ok()?;
    let patch = match it.next() {
        Some(p) => p.parse().ok()?,
        None => 0,
    };
    if it.next().is_some() {
        return None;
    }
    Some((major, minor, patch))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflist_keeps_unknown_fields() {
        let text = br#"{"cniVersion":"0.3.1","name":"k8s-pod-network","plugins":[
            {"type":"calico","log_level":"info","ipam":{"type":"calico-ipam"},"mtu":0},
            {"type":"portmap","snat":true,"capabilities":{"portMappings":true}}],
            "x-vendor":{"a":1}}"#;
        let list = NetConfList::from_conflist_bytes(text).unwrap();
        assert_eq!(list.plugin_types(), ["calico", "portmap"]);
        assert_eq!(list.plugins[0].ipam_type(), Some("calico-ipam"));
        let back = serde_json::to_value(&list).unwrap();
        assert_eq!(back["x-vendor"]["a"], 1);
        assert_eq!(back["plugins"][0]["log_level"], "info");
        assert_eq!(back["plugins"][1]["capabilities"]["portMappings"], true);
    }

    #[test]
    fn conf_becomes_one_plugin_list() {
        let list = NetConfList::from_conf_bytes(
            br#"{"cniVersion":"0.3.1","name":"cbr0","type":"flannel","delegate":{"isDefaultGateway":true}}"#,
        )
        .unwrap();
        assert_eq!(list.name, "cbr0");
        assert_eq!(list.cni_version, "0.3.1");
        assert_eq!(list.plugin_types(), ["flannel"]);
        assert!(list.plugins[0].extra.contains_key("delegate"));
    }

    #[test]
    fn libcni_rejections() {
        use ConfigError::*;
        let e = |b: &[u8]| NetConfList::from_conflist_bytes(b).unwrap_err();
        assert!(matches!(
            e(b"{\"name\":\"x\",\"plugins\":[{\"type\":\"a\""),
            Syntax(_)
        ));
        assert!(matches!(e(br#"{"plugins":[{"type":"a"}]}"#), Syntax(_)));
        assert!(matches!(
            e(br#"{"name":"x","plugins":[]}"#),
            EmptyPluginList
        ));
        assert!(matches!(
            e(br#"{"name":"x","plugins":[{"a":1}]}"#),
            MissingType(Some(0))
        ));
        assert!(matches!(
            e(br#"{"name":"x","plugins":[{"type":"../bin/sh"}]}"#),
            TypeWithPath(_)
        ));
        assert!(matches!(
            e(br#"{"name":"x","loadOnlyInlinedPlugins":true}"#),
            InlinedWithoutPlugins
        ));
        assert!(matches!(
            e(br#"{"name":"x","disableCheck":"maybe","plugins":[{"type":"a"}]}"#),
            Syntax(_)
        ));
        assert!(matches!(
            e(br#"{"name":"x","cniVersions":["one"],"plugins":[{"type":"a"}]}"#),
            InvalidVersion(_)
        ));
        assert!(matches!(
            NetConfList::from_conf_bytes(br#"{"name":"x"}"#),
            Err(MissingType(None))
        ));
        // "TRUE" is a valid boolean for libcni.
        let ok = NetConfList::from_conflist_bytes(
            br#"{"name":"x","disableCheck":"TRUE","plugins":[{"type":"a"}]}"#,
        )
        .unwrap();
        assert!(ok.disable_check);
        // No plugins key and drop-ins allowed: valid here, the loader decides later.
        assert!(NetConfList::from_conflist_bytes(br#"{"name":"x"}"#).is_ok());
    }

    #[test]
    fn effective_version_picks_highest_supported() {
        let list = NetConfList::from_conflist_bytes(
            br#"{"cniVersion":"0.4.0","cniVersions":["1.0.0","9.9.9","1.1.0"],"name":"x","plugins":[{"type":"a"}]}"#,
        )
        .unwrap();
        assert_eq!(list.effective_version(), "1.1.0");
        let plain = NetConfList::from_conflist_bytes(
            br#"{"cniVersion":"0.3.1","name":"x","plugins":[{"type":"a"}]}"#,
        )
        .unwrap();
        assert_eq!(plain.effective_version(), "0.3.1");
    }
}
