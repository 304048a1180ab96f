//! The CNI network configuration model (`.conflist`, `.conf`, `.json`), loaded with libcni
//! v1.3's rules (`libcni/conf.go`) so that what meshgate calls loadable is exactly what the
//! runtime loads.
//!
//! In: a file's bytes. Out: a [`NetConfList`] (a `.conf` becomes a one-plugin list, as
//! libcni's `ConfListFromConf` does) or a [`ConfigError`], whose message never quotes the
//! file (offsets, indexes and field names only).
//!
//! - `.conflist` (`NetworkConfFromBytes`): the document is decoded into a Go
//!   `map[string]interface{}` (exact keys, last duplicate wins, every number must fit a
//!   `float64`); `name` must be a string; `cniVersion`, if present, a string; `cniVersions`,
//!   if present, a list of strings that all parse as versions, and then the list's version
//!   is the highest of them and `cniVersion` not above [`CURRENT_SPEC_VERSION`];
//!   `disableCheck`, `disableGC` and `loadOnlyInlinedPlugins` are a bool or a string that
//!   lower-cases to "true"/"false"; `plugins` is a non-empty list. Each plugin object is
//!   re-marshalled from the map (sorted keys) and decoded into the typed
//!   `types.PluginConf`.
//! - Typed decoding (`types.PluginConf`): Go field matching (exact, then case-folded),
//!   typed fields (`cniVersion`, `name`, `type` strings; `capabilities` a
//!   `map[string]bool`; `ipam` an object with a string `type`; `dns` an object of string
//!   lists and a string `domain`; `prevResult` an object; `cni.dev/valid-attachments` a list
//!   of objects with string `containerID`/`ifname`); a JSON `null` leaves a field as it was;
//!   a wrong JSON type anywhere in these is a load error. `type` must end up non-empty.
//! - `.conf` (`ConfFromBytes` + `ConfListFromConf`): the typed decode on the document as
//!   written, then the list is rebuilt from the Go map (`name` and `cniVersion` from the
//!   typed decode) and loaded as a `.conflist` would be. That list is two levels deeper than
//!   the file, so a `.conf` may nest at most `MAX_DEPTH - 2` = 9,998 levels.
//!
//! Depth: Go's `encoding/json` scanner refuses more than 10,000 nested arrays/objects
//! ([`gojson::MAX_DEPTH`]); every walk here is iterative or shallow (typed fields are read
//! one or two levels down), so the deepest file Go accepts gets libcni's verdict on any stack.

use super::gojson::{self, GoValue, JsonError};

/// `version.Current()` of libcni v1.3: `cniVersions` entries above it are ignored.
pub const CURRENT_SPEC_VERSION: &str = "1.1.0";

/// Why a config file is not a loadable network configuration. Never quotes the file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// Not JSON for Go's decoder.
    #[error("is not valid JSON: {0}")]
    Json(#[from] JsonError),
    /// The document is not a JSON object.
    #[error("is not a JSON object")]
    NotAnObject,
    /// A number anywhere in the document does not fit a float64 (Go's map decoding fails).
    #[error("holds a number out of float64 range")]
    NumberOutOfRange,
    /// A `.conflist` without `name`.
    #[error("has no \"name\"")]
    NoName,
    /// A top-level field of the list has the wrong JSON type.
    #[error("has a {field:?} of the wrong JSON type ({got})")]
    ListFieldType {
        /// The field, as libcni names it.
        field: &'static str,
        /// The JSON type found.
        got: &'static str,
    },
    /// An entry of `cniVersions` is not a string.
    #[error("has cniVersions entry #{} that is not a string", .0 + 1)]
    CniVersionsEntryType(usize),
    /// An entry of `cniVersions` does not parse as a version.
    #[error("has cniVersions entry #{} that is not a version number", .0 + 1)]
    InvalidCniVersionsEntry(usize),
    /// `cniVersions` is present and `cniVersion` does not parse as a version.
    #[error(
        "has a cniVersion that is not a version number (checked because cniVersions is present)"
    )]
    InvalidCniVersion,
    /// A boolean field is neither a bool nor a "true"/"false" string.
    #[error("has a {0:?} that is not a boolean")]
    BadBool(&'static str),
    /// `loadOnlyInlinedPlugins` is true but the list has no `plugins` key.
    #[error("sets loadOnlyInlinedPlugins and has no \"plugins\" list")]
    InlinedWithoutPlugins,
    /// `plugins` is present but empty.
    #[error("has an empty \"plugins\" list")]
    EmptyPluginList,
    /// A typed plugin field has the wrong JSON type (libcni decodes into `types.PluginConf`).
    #[error("{}: field {field:?} has the wrong JSON type", plugin_label(*.plugin))]
    PluginFieldType {
        /// Index in `plugins`; `None` for a single-plugin file.
        plugin: Option<usize>,
        /// The field path, as libcni's struct tags name it.
        field: &'static str,
    },
    /// A plugin has no `type` or an empty one.
    #[error("{} has no plugin type", plugin_label(*.0))]
    MissingType(Option<usize>),
    /// A `.conf` nested deeper than `MAX_DEPTH - 2` levels: libcni's `ConfListFromConf`
    /// wraps it in a list object and a `plugins` array, and Go's decoder refuses the result.
    #[error(
        "is nested {0} levels deep; as a one-plugin list that is more than Go's limit of {max}",
        max = gojson::MAX_DEPTH
    )]
    ConfTooDeepForList(usize),
}

fn plugin_label(index: Option<usize>) -> String {
    match index {
        Some(i) => format!("plugin #{}", i + 1),
        None => "the plugin object".to_string(),
    }
}

/// One plugin configuration object in a chain: the fields libcni's `types.PluginConf`
/// gives meaning to. Everything else in the object is the plugin's own business.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PluginConf {
    /// `type`: the plugin binary's name in the CNI bin dirs.
    pub plugin_type: String,
    /// `ipam.type`: the delegated IPAM plugin's binary, empty when none.
    pub ipam: String,
    /// `name`, as the typed decode saw it.
    pub name: String,
    /// `cniVersion`, as the typed decode saw it.
    pub cni_version: String,
}

impl PluginConf {
    /// The delegated IPAM plugin's type (`ipam.type`), whose binary must exist too.
    pub fn ipam_type(&self) -> Option<&str> {
        Some(self.ipam.as_str()).filter(|t| !t.is_empty())
    }

    /// Parses one plugin object from a drop-in `<network>/*.conf` file (libcni
    /// `NetworkPluginConfFromBytes`): the typed decode on the document as written.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, ConfigError> {
        let v = gojson::parse(bytes)?;
        Self::decode(&v, None)
    }

    /// Go's `json.Unmarshal` into `types.PluginConf`, then libcni's non-empty `type` check.
    fn decode(v: &GoValue, index: Option<usize>) -> Result<Self, ConfigError> {
        let p = Self::decode_typed(v, index)?;
        if p.plugin_type.is_empty() {
            return Err(ConfigError::MissingType(index));
        }
        Ok(p)
    }

    /// Go's `json.Unmarshal` into `types.PluginConf` (or `types.NetConf`, the same fields)
    /// alone: an empty `type` is no error here (Multus then reads the object as a list).
    pub(super) fn decode_typed(v: &GoValue, index: Option<usize>) -> Result<Self, ConfigError> {
        let wrong = |field| ConfigError::PluginFieldType {
            plugin: index,
            field,
        };
        let mut p = PluginConf::default();
        let members = match v {
            GoValue::Null => &[][..],
            GoValue::Object(m) => m.as_slice(),
            _ => return Err(wrong("(the plugin object)")),
        };
        // Go reports the first type error but keeps decoding; the outcome is an error either way.
        let mut first_err = None;
        for (key, value) in members {
            let r = match match_field(key, &PLUGIN_FIELDS) {
                Some("cniVersion") => set_string(&mut p.cni_version, value),
                Some("name") => set_string(&mut p.name, value),
                Some("type") => set_string(&mut p.plugin_type, value),
                Some("capabilities") => {
                    check_map_of(value, |e| matches!(e, GoValue::Bool(_) | GoValue::Null))
                }
                Some("ipam") => decode_ipam(&mut p.ipam, value),
                Some("dns") => check_dns(value),
                Some("prevResult") => check_map_of(value, |_| true)
                    .and_then(|()| value.numbers_fit_f64().then_some(()).ok_or(())),
                Some("cni.dev/valid-attachments") => check_attachments(value),
                _ => Ok(()),
            };
            if r.is_err() && first_err.is_none() {
                let field = match_field(key, &PLUGIN_FIELDS).unwrap_or("(unknown)");
                first_err = Some(wrong(field));
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        Ok(p)
    }
}

/// The JSON names of `types.PluginConf`'s fields in libcni v1.3 (`pkg/types/types.go`).
const PLUGIN_FIELDS: [&str; 8] = [
    "cniVersion",
    "name",
    "type",
    "capabilities",
    "ipam",
    "dns",
    "prevResult",
    "cni.dev/valid-attachments",
];

/// Which field a key selects: an exact name first, then a case-folded one (Go).
fn match_field(key: &str, fields: &[&'static str]) -> Option<&'static str> {
    fields
        .iter()
        .find(|f| **f == key)
        .or_else(|| fields.iter().find(|f| gojson::field_matches(key, f)))
        .copied()
}

/// A Go `string` field: a string sets it, `null` leaves it, anything else is an error.
fn set_string(slot: &mut String, v: &GoValue) -> Result<(), ()> {
    match v {
        GoValue::String(s) => {
            *slot = s.clone();
            Ok(())
        }
        GoValue::Null => Ok(()),
        _ => Err(()),
    }
}

/// A Go map field: `null` or an object whose values pass `ok`.
fn check_map_of(v: &GoValue, ok: impl Fn(&GoValue) -> bool) -> Result<(), ()> {
    match v {
        GoValue::Null => Ok(()),
        GoValue::Object(m) if m.iter().all(|(_, e)| ok(e)) => Ok(()),
        _ => Err(()),
    }
}

/// `[]string`: `null`, or a list of strings and nulls.
fn check_string_list(v: &GoValue) -> Result<(), ()> {
    match v {
        GoValue::Null => Ok(()),
        GoValue::Array(items)
            if items
                .iter()
                .all(|e| matches!(e, GoValue::String(_) | GoValue::Null)) =>
        {
            Ok(())
        }
        _ => Err(()),
    }
}

/// `types.IPAM{Type string}`, decoded into the existing value (Go decodes a repeated
/// struct field into the same struct, so an earlier `type` survives a later `{}`).
fn decode_ipam(slot: &mut String, v: &GoValue) -> Result<(), ()> {
    match v {
        GoValue::Null => Ok(()),
        GoValue::Object(m) => {
            let mut r = Ok(());
            for (k, e) in m {
                if match_field(k, &["type"]).is_some() && set_string(slot, e).is_err() {
                    r = Err(());
                }
            }
            r
        }
        _ => Err(()),
    }
}

/// `types.DNS{Nameservers, Search, Options []string; Domain string}`.
fn check_dns(v: &GoValue) -> Result<(), ()> {
    const FIELDS: [&str; 4] = ["nameservers", "domain", "search", "options"];
    match v {
        GoValue::Null => Ok(()),
        GoValue::Object(m) => {
            let mut r = Ok(());
            for (k, e) in m {
                let ok = match match_field(k, &FIELDS) {
                    Some("domain") => set_string(&mut String::new(), e),
                    Some(_) => check_string_list(e),
                    None => Ok(()),
                };
                if ok.is_err() {
                    r = Err(());
                }
            }
            r
        }
        _ => Err(()),
    }
}

/// `[]types.GCAttachment{ContainerID string "containerID"; IfName string "ifname"}`.
fn check_attachments(v: &GoValue) -> Result<(), ()> {
    const FIELDS: [&str; 2] = ["containerID", "ifname"];
    let one = |e: &GoValue| match e {
        GoValue::Null => true,
        GoValue::Object(m) => m.iter().all(|(k, x)| {
            match_field(k, &FIELDS).is_none() || set_string(&mut String::new(), x).is_ok()
        }),
        _ => false,
    };
    match v {
        GoValue::Null => Ok(()),
        GoValue::Array(items) if items.iter().all(one) => Ok(()),
        _ => Err(()),
    }
}

/// A network configuration list: what the runtime runs, in order, for every pod sandbox.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NetConfList {
    /// libcni's `list.CNIVersion`: `cniVersion`, or the highest supported entry of
    /// `cniVersions` when that is present. Possibly empty (then plugins are asked for 0.1.0).
    pub cni_version: String,
    /// Network name; also names the drop-in plugin directory.
    pub name: String,
    /// If true, runtimes must not call CHECK.
    pub disable_check: bool,
    /// If true, runtimes must not call GC.
    pub disable_gc: bool,
    /// If false (the default), plugins from `<conf dir>/<name>/*.conf` are appended.
    pub load_only_inlined_plugins: bool,
    /// The chain, in order. Drop-in plugins are appended here by the loader.
    pub plugins: Vec<PluginConf>,
}

impl NetConfList {
    /// Parses a `.conflist` (libcni `NetworkConfFromBytes`). Drop-in plugins are not loaded
    /// here (they live in other files).
    pub fn from_conflist_bytes(bytes: &[u8]) -> Result<Self, ConfigError> {
        let doc = gojson::parse(bytes)?;
        Self::from_go_map(&doc)
    }

    /// libcni `NetworkConfFromBytes` on an already decoded document (a delegate that a meta
    /// plugin such as Multus re-marshals and hands to libcni's `ConfListFromBytes`).
    pub(super) fn from_go_map(doc: &GoValue) -> Result<Self, ConfigError> {
        if !matches!(doc, GoValue::Object(_) | GoValue::Null) {
            return Err(ConfigError::NotAnObject);
        }
        if !doc.numbers_fit_f64() {
            return Err(ConfigError::NumberOutOfRange);
        }
        let ty = |field, v: &GoValue| ConfigError::ListFieldType {
            field,
            got: v.kind(),
        };
        let name = match doc.get_exact("name") {
            None => return Err(ConfigError::NoName),
            Some(GoValue::String(s)) => s.clone(),
            Some(v) => return Err(ty("name", v)),
        };
        let mut cni_version = match doc.get_exact("cniVersion") {
            None => String::new(),
            Some(GoValue::String(s)) => s.clone(),
            Some(v) => return Err(ty("cniVersion", v)),
        };
        if let Some(raw) = doc.get_exact("cniVersions")
            && let Some(highest) = highest_supported(raw, &cni_version)?
        {
            cni_version = highest;
        }
        let read_bool = |key: &'static str| -> Result<bool, ConfigError> {
            match doc.get_exact(key) {
                None => Ok(false),
                Some(GoValue::Bool(b)) => Ok(*b),
                // Go's strings.ToLower; no non-ASCII rune lower-cases into "true"/"false".
                Some(GoValue::String(s)) if s.to_lowercase() == "true" => Ok(true),
                Some(GoValue::String(s)) if s.to_lowercase() == "false" => Ok(false),
                Some(_) => Err(ConfigError::BadBool(key)),
            }
        };
        let disable_check = read_bool("disableCheck")?;
        let disable_gc = read_bool("disableGC")?;
        let load_only_inlined_plugins = read_bool("loadOnlyInlinedPlugins")?;
        let mut list = NetConfList {
            cni_version,
            name,
            disable_check,
            disable_gc,
            load_only_inlined_plugins,
            plugins: Vec::new(),
        };
        let Some(raw) = doc.get_exact("plugins") else {
            if load_only_inlined_plugins {
                return Err(ConfigError::InlinedWithoutPlugins);
            }
            return Ok(list);
        };
        let GoValue::Array(items) = raw else {
            return Err(ty("plugins", raw));
        };
        if items.is_empty() {
            return Err(ConfigError::EmptyPluginList);
        }
        for (i, item) in items.iter().enumerate() {
            // json.Marshal of the map value, then the typed decode: sorted, de-duplicated keys.
            list.plugins
                .push(PluginConf::decode(&item.as_go_map(), Some(i))?);
        }
        Ok(list)
    }

    /// Parses a single-plugin `.conf` / `.json` and turns it into a one-plugin list, the way
    /// go-cni and ocicni do: `ConfFromBytes` (typed decode as written, non-empty `type`),
    /// then `ConfListFromConf` (the list takes the typed `name` and `cniVersion`, and the
    /// plugin object is the Go map of the file, loaded like a `.conflist`).
    pub fn from_conf_bytes(bytes: &[u8]) -> Result<Self, ConfigError> {
        Self::from_conf_value(gojson::parse(bytes)?)
    }

    /// libcni `ConfFromBytes` + `ConfListFromConf` on an already decoded document.
    pub(super) fn from_conf_value(doc: GoValue) -> Result<Self, ConfigError> {
        let typed = PluginConf::decode(&doc, None)?;
        // ConfListFromConf unmarshals the bytes into map[string]interface{} again.
        if !matches!(doc, GoValue::Object(_)) {
            return Err(ConfigError::NotAnObject);
        }
        // The list adds two levels (its object and `plugins`) before Go decodes it again.
        let depth = doc.depth();
        if depth + 2 > gojson::MAX_DEPTH {
            return Err(ConfigError::ConfTooDeepForList(depth));
        }
        let rebuilt = GoValue::Object(vec![
            ("name".into(), GoValue::String(typed.name)),
            ("cniVersion".into(), GoValue::String(typed.cni_version)),
            ("plugins".into(), GoValue::Array(vec![doc])),
        ]);
        Self::from_go_map(&rebuilt)
    }

    /// The cniVersion the runtime runs the chain with (libcni's `list.CNIVersion`).
    pub fn effective_version(&self) -> &str {
        &self.cni_version
    }

    /// The version plugins must support: libcni's `validatePlugin` checks an empty
    /// cniVersion as "0.1.0".
    pub fn version_to_check(&self) -> &str {
        if self.cni_version.is_empty() {
            "0.1.0"
        } else {
            &self.cni_version
        }
    }

    /// The chain's plugin types, in order.
    pub fn plugin_types(&self) -> Vec<String> {
        self.plugins.iter().map(|p| p.plugin_type.clone()).collect()
    }
}

/// libcni's `cniVersions` handling: the highest version, of the list and `cniVersion`, that
/// this spec supports (`None`: none of them). An entry that is no string or no version fails.
fn highest_supported(raw: &GoValue, cni_version: &str) -> Result<Option<String>, ConfigError> {
    let GoValue::Array(items) = raw else {
        return Err(ConfigError::ListFieldType {
            field: "cniVersions",
            got: raw.kind(),
        });
    };
    let current = parse_version(CURRENT_SPEC_VERSION);
    let mut vs: Vec<String> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let GoValue::String(v) = item else {
            return Err(ConfigError::CniVersionsEntryType(i));
        };
        let parsed = parse_version(v).ok_or(ConfigError::InvalidCniVersionsEntry(i))?;
        if Some(parsed) <= current {
            vs.push(v.clone());
        }
    }
    if !cni_version.is_empty() {
        let parsed = parse_version(cni_version).ok_or(ConfigError::InvalidCniVersion)?;
        if Some(parsed) <= current {
            vs.push(cni_version.to_string());
        }
    }
    go_sort_versions(&mut vs);
    Ok(vs.pop())
}

/// libcni's `version.ParseVersion`: one to three dot-separated parts, each a Go
/// `strconv.Atoi` integer (optional sign, decimal digits, within int64); the empty string
/// and four or more parts are errors; a missing minor or micro is 0.
pub fn parse_version(v: &str) -> Option<(i64, i64, i64)> {
    if v.is_empty() {
        return None;
    }
    let parts: Vec<&str> = v.split('.').collect();
    if parts.len() >= 4 {
        return None;
    }
    let atoi = |s: &str| -> Option<i64> {
        let digits = s.strip_prefix(['+', '-']).unwrap_or(s);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        s.parse::<i64>().ok()
    };
    let major = atoi(parts[0])?;
    let minor = match parts.get(1) {
        Some(p) => atoi(p)?,
        None => 0,
    };
    let micro = match parts.get(2) {
        Some(p) => atoi(p)?,
        None => 0,
    };
    Some((major, minor, micro))
}

/// libcni sorts the candidate versions with `slices.SortFunc` and a comparator that says
/// "less" for equal-but-differently-written versions; for the short lists configs carry Go
/// runs an insertion sort, reproduced here so the same spelling ends up last.
fn go_sort_versions(vs: &mut [String]) {
    let cmp_less = |a: &str, b: &str| -> bool {
        if a == b {
            return false;
        }
        // Both parsed already; an unparsable one compares as "less", as Go's ignored error.
        !matches!((parse_version(a), parse_version(b)), (Some(x), Some(y)) if x > y)
    };
    for i in 1..vs.len() {
        let mut j = i;
        while j > 0 && cmp_less(&vs[j], &vs[j - 1]) {
            vs.swap(j, j - 1);
            j -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflist_typed_fields() {
        let text = br#"{"cniVersion":"0.3.1","name":"k8s-pod-network","plugins":[
            {"type":"calico","log_level":"info","ipam":{"type":"calico-ipam"},"mtu":0},
            {"type":"portmap","snat":true,"capabilities":{"portMappings":true}}],
            "x-vendor":{"a":1}}"#;
        let list = NetConfList::from_conflist_bytes(text).unwrap();
        assert_eq!(list.plugin_types(), ["calico", "portmap"]);
        assert_eq!(list.plugins[0].ipam_type(), Some("calico-ipam"));
        assert_eq!(list.effective_version(), "0.3.1");
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
        // Go matches "Name" and "CNIVERSION" case-insensitively in the typed decode.
        let folded =
            NetConfList::from_conf_bytes(br#"{"CNIVERSION":"1.0.0","Name":"n","Type":"bridge"}"#)
                .unwrap();
        assert_eq!(
            (folded.name.as_str(), folded.cni_version.as_str()),
            ("n", "1.0.0")
        );
        assert_eq!(folded.plugin_types(), ["bridge"]);
    }

    #[test]
    fn libcni_rejections() {
        use ConfigError::*;
        let e = |b: &[u8]| NetConfList::from_conflist_bytes(b).unwrap_err();
        assert!(matches!(
            e(b"{\"name\":\"x\",\"plugins\":[{\"type\":\"a\""),
            Json(_)
        ));
        assert_eq!(e(br#"{"plugins":[{"type":"a"}]}"#), NoName);
        assert_eq!(e(br#"{"name":"x","plugins":[]}"#), EmptyPluginList);
        assert_eq!(
            e(br#"{"name":"x","plugins":[{"a":1}]}"#),
            MissingType(Some(0))
        );
        assert_eq!(
            e(br#"{"name":"x","loadOnlyInlinedPlugins":true}"#),
            InlinedWithoutPlugins
        );
        assert_eq!(
            e(br#"{"name":"x","disableCheck":"maybe","plugins":[{"type":"a"}]}"#),
            BadBool("disableCheck")
        );
        assert_eq!(
            e(br#"{"name":"x","cniVersions":["one"],"plugins":[{"type":"a"}]}"#),
            InvalidCniVersionsEntry(0)
        );
        assert!(matches!(
            NetConfList::from_conf_bytes(br#"{"name":"x"}"#),
            Err(MissingType(None))
        ));
        let ok = NetConfList::from_conflist_bytes(
            br#"{"name":"x","disableCheck":"TRUE","plugins":[{"type":"a"}]}"#,
        )
        .unwrap();
        assert!(ok.disable_check);
        // No plugins key and drop-ins allowed: valid here, the loader decides later.
        assert!(NetConfList::from_conflist_bytes(br#"{"name":"x"}"#).is_ok());
        // A path in `type` loads (libcni refuses it only in FindInPath).
        assert!(
            NetConfList::from_conflist_bytes(br#"{"name":"x","plugins":[{"type":"../sh"}]}"#)
                .is_ok()
        );
    }

    #[test]
    fn typed_decoding_rejects_wrong_value_types() {
        for (bad, field) in [
            (
                r#"{"type":"portmap","capabilities":{"portMappings":"true"}}"#,
                "capabilities",
            ),
            (r#"{"type":"calico","ipam":"calico-ipam"}"#, "ipam"),
            (r#"{"type":"calico","ipam":{"type":7}}"#, "ipam"),
            (r#"{"type":"calico","dns":"8.8.8.8"}"#, "dns"),
            (
                r#"{"type":"calico","dns":{"nameservers":"8.8.8.8"}}"#,
                "dns",
            ),
            (r#"{"type":"calico","name":5}"#, "name"),
            (r#"{"type":"calico","prevResult":[]}"#, "prevResult"),
            (
                r#"{"type":"calico","cni.dev/valid-attachments":[{"ifname":1}]}"#,
                "cni.dev/valid-attachments",
            ),
            (r#"{"TYPE":5}"#, "type"),
        ] {
            let list = format!(r#"{{"name":"n","cniVersion":"1.0.0","plugins":[{bad}]}}"#);
            assert_eq!(
                NetConfList::from_conflist_bytes(list.as_bytes()),
                Err(ConfigError::PluginFieldType {
                    plugin: Some(0),
                    field
                }),
                "{bad}"
            );
        }
        // nulls leave fields alone and are not errors.
        let ok = br#"{"name":"n","plugins":[{"type":"a","ipam":null,"dns":null,"capabilities":{"x":null}}]}"#;
        assert!(NetConfList::from_conflist_bytes(ok).is_ok());
        // A numeric list name is a load error.
        assert!(matches!(
            NetConfList::from_conflist_bytes(br#"{"name":5,"plugins":[{"type":"a"}]}"#),
            Err(ConfigError::ListFieldType { field: "name", .. })
        ));
    }

    #[test]
    fn field_folding_and_duplicates_follow_go() {
        // Map semantics first (last duplicate wins), then sorted keys into the struct:
        // "Type" sorts before "type", so "type" is decoded last and wins.
        let l = NetConfList::from_conflist_bytes(
            br#"{"name":"n","plugins":[{"type":"calico","Type":"../x"}]}"#,
        )
        .unwrap();
        assert_eq!(l.plugin_types(), ["calico"]);
        // Unicode simple folding: U+212A KELVIN SIGN and U+017F LONG S select ASCII fields.
        let l = NetConfList::from_conflist_bytes(
            "{\"name\":\"n\",\"plugins\":[{\"\u{017F}\u{212A}ip\":1,\"t\u{0079}pe\":\"a\",\"ipam\":{\"TYPE\":\"host-local\"}}]}"
                .as_bytes(),
        )
        .unwrap();
        assert_eq!(l.plugins[0].ipam_type(), Some("host-local"));
        let drop_in = PluginConf::from_bytes(
            "{\"\u{017F}ome\":1,\"type\":\"a\",\"ipam\":{\"\u{212A}\":1}}".as_bytes(),
        );
        assert!(drop_in.is_ok());
        // Invalid UTF-8 inside a string is accepted by Go (U+FFFD).
        let l = NetConfList::from_conflist_bytes(
            b"{\"name\":\"n\xff\",\"plugins\":[{\"type\":\"a\"}]}",
        )
        .unwrap();
        assert_eq!(l.name, "n\u{FFFD}");
        // A .conf is decoded twice, as go-cni and ocicni do: as written (ConfFromBytes, the
        // last "type" in document order wins) and from the sorted Go map (ConfListFromConf,
        // "type" after "Type"). Both must yield a type.
        let l = NetConfList::from_conf_bytes(br#"{"name":"n","Type":"","type":"bridge"}"#).unwrap();
        assert_eq!(l.plugin_types(), ["bridge"]);
        assert_eq!(
            NetConfList::from_conf_bytes(br#"{"name":"n","type":"","Type":"bridge"}"#),
            Err(ConfigError::MissingType(Some(0)))
        );
        assert_eq!(
            NetConfList::from_conf_bytes(br#"{"name":"n","type":"bridge","Type":""}"#),
            Err(ConfigError::MissingType(None))
        );
        // Out-of-range numbers fail Go's map decoding.
        assert_eq!(
            NetConfList::from_conflist_bytes(
                br#"{"name":"n","mtu":1e400,"plugins":[{"type":"a"}]}"#
            ),
            Err(ConfigError::NumberOutOfRange)
        );
    }

    #[test]
    fn cni_versions_follow_libcni() {
        let l = |b: &str| NetConfList::from_conflist_bytes(b.as_bytes());
        let list = l(r#"{"cniVersion":"0.4.0","cniVersions":["1.0.0","9.9.9","1.1.0"],"name":"x","plugins":[{"type":"a"}]}"#).unwrap();
        assert_eq!(list.effective_version(), "1.1.0");
        // Major-only entries parse.
        let list = l(r#"{"cniVersions":["1"],"name":"x","plugins":[{"type":"a"}]}"#).unwrap();
        assert_eq!(list.effective_version(), "1");
        // "v1.0.0" does not parse: a load error when cniVersions is present ...
        assert_eq!(
            l(r#"{"cniVersions":["v1.0.0"],"name":"x","plugins":[{"type":"a"}]}"#),
            Err(ConfigError::InvalidCniVersionsEntry(0))
        );
        assert_eq!(
            l(
                r#"{"cniVersion":"v1.0.0","cniVersions":["1.0.0"],"name":"x","plugins":[{"type":"a"}]}"#
            ),
            Err(ConfigError::InvalidCniVersion)
        );
        // ... and kept as written when it is not.
        let list = l(r#"{"cniVersion":"v1.0.0","name":"x","plugins":[{"type":"a"}]}"#).unwrap();
        assert_eq!(list.effective_version(), "v1.0.0");
        // Nothing at or below the current version: cniVersion stays as written.
        let list = l(
            r#"{"cniVersion":"2.0.0","cniVersions":["3.0.0"],"name":"x","plugins":[{"type":"a"}]}"#,
        )
        .unwrap();
        assert_eq!(list.effective_version(), "2.0.0");
        // Empty cniVersion is checked as 0.1.0.
        let list = l(r#"{"name":"x","plugins":[{"type":"a"}]}"#).unwrap();
        assert_eq!(list.version_to_check(), "0.1.0");
        assert_eq!(parse_version("+1.-0.007"), Some((1, 0, 7)));
        assert_eq!(parse_version("1.0.0.0"), None);
        assert_eq!(parse_version("1..0"), None);
        assert_eq!(parse_version("99999999999999999999"), None);
    }
}
