//! Where the control-plane binaries live, and which Kubernetes version they must be.
//!
//! In: the workspace Cargo.toml (compiled in, so the pinned version has one home), the
//! environment (`MESHGATE_K8S_BIN_DIR`, `MESHGATE_CACHE_DIR`, `XDG_CACHE_HOME`, `HOME`,
//! `MESHGATE_ETCD`, `PATH`) and the filesystem. Out: the paths of etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler and kubectl, or an error that says how to get them,
//! and the other versions pinned beside Kubernetes' ([`pinned_version`]: the real node's
//! containerd and istio-cni, located by [`crate::real::node::NodeBinaries`]). The lookup rules
//! mirror `e2e/install-deps.sh`, which builds into the same cache.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::Error;

/// The workspace manifest, holding `[workspace.metadata.meshgate] kubernetes-version`.
const WORKSPACE_TOML: &str = include_str!("../../../Cargo.toml");

/// Env var naming the directory of the built Kubernetes binaries (set by `make test`).
pub const BIN_DIR_ENV: &str = "MESHGATE_K8S_BIN_DIR";
/// Env var naming meshgate's cache root (default `$XDG_CACHE_HOME/meshgate`, `~/.cache/meshgate`).
pub const CACHE_DIR_ENV: &str = "MESHGATE_CACHE_DIR";
/// Env var naming the etcd binary (default: `etcd` on `PATH`, i.e. Debian's `/usr/bin/etcd`).
pub const ETCD_ENV: &str = "MESHGATE_ETCD";

/// The Kubernetes release the workspace pins, e.g. `v1.35.4`.
pub fn kubernetes_version() -> Result<&'static str, Error> {
    parse_kubernetes_version(WORKSPACE_TOML).ok_or(Error::NoPinnedVersion)
}

/// A version pinned under `[workspace.metadata.meshgate]`, e.g. `containerd-version`.
pub fn pinned_version(key: &'static str) -> Result<&'static str, Error> {
    parse_pin(WORKSPACE_TOML, key).ok_or_else(|| Error::RealNode {
        part: "the pinned versions",
        detail: format!(
            "no `{key} = \"v...\"` under [workspace.metadata.meshgate] in the workspace Cargo.toml"
        ),
    })
}

/// Finds `kubernetes-version = "..."` in the `[workspace.metadata.meshgate]` table.
fn parse_kubernetes_version(toml: &str) -> Option<&str> {
    parse_pin(toml, "kubernetes-version")
}

/// Finds `<key> = "v..."` in the `[workspace.metadata.meshgate]` table. A line scan is enough
/// for the few keys this reads, and keeps a TOML parser out of the crate.
fn parse_pin<'a>(toml: &'a str, wanted: &str) -> Option<&'a str> {
    let mut in_table = false;
    for line in toml.lines().map(str::trim) {
        if line.starts_with('[') {
            in_table = line == "[workspace.metadata.meshgate]";
            continue;
        }
        if !in_table {
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        if key.trim() != wanted {
            continue;
        }
        let value = value.split('#').next()?.trim();
        let value = value.strip_prefix('"')?.strip_suffix('"')?;
        return value.starts_with('v').then_some(value);
    }
    None
}

/// This repository's root (the e2e crate's parent): its manifests, overlays and scripts.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Copies the tree `from` to `to`, leaving out TLS material (`*.crt`, `*.key`) a developer
/// generated in the working tree: an install copies the manifests and generates its own.
pub fn copy_tree(from: &Path, to: &Path) -> Result<(), Error> {
    std::fs::create_dir_all(to).map_err(|e| Error::io(format!("creating {}", to.display()), e))?;
    let entries =
        std::fs::read_dir(from).map_err(|e| Error::io(format!("reading {}", from.display()), e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(format!("reading {}", from.display()), e))?;
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        let is_dir = entry
            .file_type()
            .map_err(|e| Error::io(format!("reading {}", src.display()), e))?
            .is_dir();
        if is_dir {
            copy_tree(&src, &dst)?;
        } else if !matches!(
            src.extension().and_then(|e| e.to_str()),
            Some("crt" | "key")
        ) {
            std::fs::copy(&src, &dst)
                .map_err(|e| Error::io(format!("copying {}", src.display()), e))?;
        }
    }
    Ok(())
}

/// meshgate's cache root: `$MESHGATE_CACHE_DIR`, else `$XDG_CACHE_HOME/meshgate`, else
/// `$HOME/.cache/meshgate`. Empty variables count as unset, as in the shell script.
pub fn cache_dir() -> Result<PathBuf, Error> {
    cache_dir_from(&env_var)
}

fn cache_dir_from(env: &dyn Fn(&str) -> Option<String>) -> Result<PathBuf, Error> {
    if let Some(dir) = env(CACHE_DIR_ENV) {
        return Ok(PathBuf::from(dir));
    }
    if let Some(xdg) = env("XDG_CACHE_HOME") {
        return Ok(Path::new(&xdg).join("meshgate"));
    }
    env("HOME")
        .map(|home| Path::new(&home).join(".cache/meshgate"))
        .ok_or(Error::NoCacheDir)
}

/// Directory of the Kubernetes binaries: `$MESHGATE_K8S_BIN_DIR`, else
/// `<cache>/kubernetes/<version>/bin`.
pub fn k8s_bin_dir() -> Result<PathBuf, Error> {
    k8s_bin_dir_from(&env_var)
}

fn k8s_bin_dir_from(env: &dyn Fn(&str) -> Option<String>) -> Result<PathBuf, Error> {
    if let Some(dir) = env(BIN_DIR_ENV) {
        return Ok(PathBuf::from(dir));
    }
    Ok(cache_dir_from(env)?
        .join("kubernetes")
        .join(kubernetes_version()?)
        .join("bin"))
}

pub(crate) fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The five binaries a control plane needs, all checked to be executable files.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// etcd (Debian's `etcd-server` package by default).
    pub etcd: PathBuf,
    /// kube-apiserver.
    pub kube_apiserver: PathBuf,
    /// kube-controller-manager.
    pub kube_controller_manager: PathBuf,
    /// kube-scheduler.
    pub kube_scheduler: PathBuf,
    /// kubectl, built from the same release (not whatever `kubectl` is on PATH).
    pub kubectl: PathBuf,
}

impl Binaries {
    /// Locates the binaries from the environment (see the module docs).
    pub fn locate() -> Result<Self, Error> {
        Self::locate_in(&k8s_bin_dir()?, env_var(ETCD_ENV).map(PathBuf::from))
    }

    /// Locates the Kubernetes binaries in `bin_dir`, and etcd at `etcd` or on `PATH`.
    pub fn locate_in(bin_dir: &Path, etcd: Option<PathBuf>) -> Result<Self, Error> {
        let version = kubernetes_version()?;
        let k8s = |name: &str| {
            let path = bin_dir.join(name);
            if is_executable(&path) {
                Ok(path)
            } else {
                Err(Error::MissingBinary {
                    binary: name.to_owned(),
                    path,
                    version: version.to_owned(),
                    hint: "MESHGATE_K8S_BIN_DIR",
                })
            }
        };
        let etcd = match etcd {
            Some(path) if is_executable(&path) => path,
            Some(path) => return Err(missing_etcd(path, version)),
            None => find_on_path("etcd")
                .ok_or_else(|| missing_etcd(PathBuf::from("$PATH/etcd"), version))?,
        };
        Ok(Self {
            etcd,
            kube_apiserver: k8s("kube-apiserver")?,
            kube_controller_manager: k8s("kube-controller-manager")?,
            kube_scheduler: k8s("kube-scheduler")?,
            kubectl: k8s("kubectl")?,
        })
    }
}

fn missing_etcd(path: PathBuf, version: &str) -> Error {
    Error::MissingBinary {
        binary: "etcd".into(),
        path,
        version: version.to_owned(),
        hint: "MESHGATE_ETCD",
    }
}

pub(crate) fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

pub(crate) fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

/// Fails with [`Error::NotRoot`] unless the effective user is root.
pub fn require_root() -> Result<(), Error> {
    if nix::unistd::geteuid().is_root() {
        Ok(())
    } else {
        Err(Error::NotRoot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn reads_the_pinned_version_from_the_workspace_manifest() {
        let v = kubernetes_version().unwrap();
        assert!(v.starts_with("v1."), "{v}");
        assert_eq!(v.split('.').count(), 3, "{v}");
    }

    #[test]
    fn the_node_binaries_are_pinned_beside_kubernetes() {
        for key in ["containerd-version", "istio-cni-version", "helm-version"] {
            let v = pinned_version(key).unwrap();
            assert!(v.starts_with('v'), "{key} = {v}");
        }
    }

    #[test]
    fn version_is_taken_only_from_the_meshgate_table() {
        let toml = r#"
[package]
kubernetes-version = "v0.0.1"
[workspace.metadata.meshgate]
# comment
kubernetes-version = "v1.35.4"   # the pin
[other]
kubernetes-version = "v9.9.9"
"#;
        assert_eq!(parse_kubernetes_version(toml), Some("v1.35.4"));
        assert_eq!(parse_pin(toml, "containerd-version"), None);
        assert_eq!(
            parse_kubernetes_version("[workspace.metadata.meshgate]\n"),
            None
        );
        assert_eq!(
            parse_kubernetes_version("[workspace.metadata.meshgate]\nkubernetes-version = 1\n"),
            None
        );
    }

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).filter(|v| !v.is_empty()).cloned()
    }

    #[test]
    fn cache_dir_precedence_matches_install_deps() {
        let all = env(&[
            ("MESHGATE_CACHE_DIR", "/c"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
        ]);
        assert_eq!(cache_dir_from(&all).unwrap(), PathBuf::from("/c"));
        let xdg = env(&[
            ("MESHGATE_CACHE_DIR", ""),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
        ]);
        assert_eq!(cache_dir_from(&xdg).unwrap(), PathBuf::from("/x/meshgate"));
        let home = env(&[("HOME", "/h")]);
        assert_eq!(
            cache_dir_from(&home).unwrap(),
            PathBuf::from("/h/.cache/meshgate")
        );
        assert!(matches!(cache_dir_from(&env(&[])), Err(Error::NoCacheDir)));
    }

    #[test]
    fn bin_dir_env_wins_else_cache_keyed_by_version() {
        let explicit = env(&[("MESHGATE_K8S_BIN_DIR", "/bin/k8s"), ("HOME", "/h")]);
        assert_eq!(
            k8s_bin_dir_from(&explicit).unwrap(),
            PathBuf::from("/bin/k8s")
        );
        let v = kubernetes_version().unwrap();
        let cached = env(&[("HOME", "/h")]);
        assert_eq!(
            k8s_bin_dir_from(&cached).unwrap(),
            PathBuf::from(format!("/h/.cache/meshgate/kubernetes/{v}/bin"))
        );
    }

    #[test]
    fn missing_binaries_name_the_installer() {
        let dir = tempfile::tempdir().unwrap();
        let err = Binaries::locate_in(dir.path(), Some(PathBuf::from("/bin/sh"))).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("kube-apiserver") && msg.contains("install-deps.sh"),
            "{msg}"
        );
    }
}
