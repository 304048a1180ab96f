//! Loads the mesh profiles a component acts on from its flags.
//!
//! In: `--profile` names and an optional `--profile-file` path. Out: a `ProfileSet`, or an
//! error that names the file or the unknown profile, so a typo stops the process at start
//! instead of silently gating or inspecting nothing.

use std::path::Path;

use anyhow::Context;
use meshgate_core::profile::ProfileSet;

/// The built-in profiles, plus the file's custom ones, narrowed to `names` (all when empty).
pub fn load(names: &[String], file: Option<&Path>) -> anyhow::Result<ProfileSet> {
    let mut set = ProfileSet::all_builtin();
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading profile file {}", path.display()))?;
        set = set
            .with_custom_json(&text)
            .with_context(|| format!("in profile file {}", path.display()))?;
    }
    set.select(names).context("--profile")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_profiles_join_the_builtins_and_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("profiles.json");
        std::fs::write(
            &path,
            r#"[{"name":"kuma","selector":{"annotations":{"kuma.io/sidecar-injected":"true"}},"pluginType":"kuma-cni","inboundPort":15006,"outboundPort":15001}]"#,
        )
        .unwrap();
        let set = load(&["kuma".into(), "linkerd".into()], Some(&path)).unwrap();
        assert_eq!(
            set.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
            ["kuma", "linkerd"]
        );
        assert_eq!(load(&[], None).unwrap().iter().count(), 3);
        let err = format!(
            "{:#}",
            load(&[], Some(&dir.path().join("missing.json"))).unwrap_err()
        );
        assert!(err.contains("missing.json"), "{err}");
        let err = format!("{:#}", load(&["consul".into()], None).unwrap_err());
        assert!(err.contains("consul"), "{err}");
    }
}
