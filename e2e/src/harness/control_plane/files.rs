//! A control plane's files: its directory (temporary or given), the kubeconfigs it writes,
//! the state file `up` leaves for `down`, and the sweep of directories whose owner died.
//!
//! In: paths, certificates, tokens. Out: files written with private modes, directories
//! prepared, swept or removed (only the entries a control plane creates).

use super::*;

/// Entries a control plane creates in its directory; `down` removes exactly these.
pub(super) const LAYOUT: &[&str] = &[
    "pki",
    "etcd",
    "logs",
    "admin.kubeconfig",
    "controller-manager.kubeconfig",
    "scheduler.kubeconfig",
    "tokens",
    STATE_FILE,
];

/// kube-apiserver's audit log, in the control plane's `logs/` directory.
pub const AUDIT_LOG: &str = "audit.log";

/// Audit policy: metadata of every request made by an identity under test, and by real
/// nodes' kubelets (`system:nodes`: the reference for what a node costs the apiserver). The
/// harness's admin (`system:masters`), the control-plane components, kube-system's
/// controllers and health probes are left out, so the log stays small and holds only what
/// tests count.
pub(super) const AUDIT_POLICY: &str = r#"apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: None
  userGroups: ["system:masters", "system:serviceaccounts:kube-system"]
- level: None
  users: ["system:kube-controller-manager", "system:kube-scheduler", "system:apiserver", "system:anonymous"]
- level: None
  nonResourceURLs: ["/healthz*", "/readyz*", "/livez*", "/version", "/openapi*", "/api", "/apis"]
- level: Metadata
"#;

/// JSON strings are valid YAML scalars, so paths and tokens are quoted with serde_json.
pub(super) fn quote(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

pub(super) fn kubeconfig_yaml(server: &str, ca: &Path, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: meshgate-e2e\n  cluster:\n    server: {}\n    certificate-authority: {}\n\
         users:\n- name: user\n  user:\n{user}contexts:\n- name: meshgate-e2e\n  context:\n    cluster: meshgate-e2e\n    user: user\n\
         current-context: meshgate-e2e\n",
        quote(server),
        quote(&ca.display().to_string()),
    )
}

pub(crate) fn cert_kubeconfig_yaml(server: &str, ca: &Path, cert: &pki::CertFiles) -> String {
    let user = format!(
        "    client-certificate: {}\n    client-key: {}\n",
        quote(&cert.cert.display().to_string()),
        quote(&cert.key.display().to_string())
    );
    kubeconfig_yaml(server, ca, &user)
}

pub(super) fn token_kubeconfig_yaml(server: &str, ca: &Path, token: &str) -> String {
    kubeconfig_yaml(server, ca, &format!("    token: {}\n", quote(token)))
}

pub(crate) fn write_private(path: &Path, text: &str) -> Result<(), Error> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
    f.write_all(text.as_bytes())
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

/// Base of temporary control-plane directories: `$MESHGATE_E2E_TMPDIR`, else `/dev/shm` (a
/// tmpfs: etcd's fsyncs cost nothing there, and Debian's etcd 3.4 has no `--unsafe-no-fsync`),
/// else the system temp dir.
pub(crate) fn tmp_base() -> PathBuf {
    if let Some(dir) = std::env::var_os(TMPDIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let shm = Path::new("/dev/shm");
    if shm.is_dir() && nix::unistd::access(shm, nix::unistd::AccessFlags::W_OK).is_ok() {
        return shm.to_owned();
    }
    std::env::temp_dir()
}

/// Records this process (pid and start time) as the owner of a temporary directory.
pub(crate) fn write_owner(dir: &Path) -> Result<(), Error> {
    let pid = std::process::id() as i32;
    let start = process::start_time(pid).unwrap_or(0);
    write_private(&dir.join(OWNER_FILE), &format!("{pid} {start}\n"))
}

/// Removes temporary control-plane directories whose owner process is gone. A test binary
/// killed outright (SIGKILL, or SIGINT, which skips atexit) loses its components to
/// PDEATHSIG but cannot remove its directory; the next run does. Directories of live owners,
/// and anything without an owner file, are left alone.
pub(super) fn sweep_stale(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let is_ours = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(TMP_PREFIX));
        let Ok(owner) = std::fs::read_to_string(path.join(OWNER_FILE)) else {
            continue;
        };
        let mut fields = owner.split_whitespace().map(str::parse::<u64>);
        let (Some(Ok(pid)), Some(Ok(start))) = (fields.next(), fields.next()) else {
            continue;
        };
        let Ok(pid) = i32::try_from(pid) else {
            continue;
        };
        let owner = Proc {
            name: "owner".into(),
            pid,
            start_time: start,
            log: PathBuf::new(),
        };
        if is_ours && !owner.alive() {
            tracing::info!(dir = %path.display(), "removing the directory of a dead test run");
            hostnet::delete_link(&link_name(&path));
            if let Err(e) = std::fs::remove_dir_all(&path) {
                tracing::warn!(dir = %path.display(), error = %e, "cannot remove a stale directory");
            }
        }
    }
}

/// For `up`: refuses a directory that already holds a control plane, and clears leftovers of
/// a crashed `up` (only the entries the harness itself creates).
pub(super) fn prepare_dir(dir: &Path) -> Result<(), Error> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    if dir.join(STATE_FILE).exists() {
        return Err(Error::AlreadyUp {
            dir: dir.to_owned(),
        });
    }
    remove_layout(dir);
    Ok(())
}

pub(super) fn remove_layout(dir: &Path) {
    for entry in LAYOUT {
        let path = dir.join(entry);
        let result = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        match result {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "cannot remove"),
        }
    }
}

pub(super) fn keep_logs(dir: &Path) {
    let Some(target) = std::env::var_os(KEEP_LOGS_ENV).filter(|d| !d.is_empty()) else {
        return;
    };
    let target = Path::new(&target).join(dir.file_name().unwrap_or_default());
    let Ok(entries) = std::fs::read_dir(dir.join("logs")) else {
        return;
    };
    if std::fs::create_dir_all(&target).is_err() {
        return;
    }
    for entry in entries.flatten() {
        let _ = std::fs::copy(entry.path(), target.join(entry.file_name()));
    }
}

/// The run dir `dir` names (prepared), or a fresh temporary one (kept as a `TempDir`, so
/// an early return removes it).
pub(super) fn run_dir(
    dir: Option<&PathBuf>,
) -> Result<(PathBuf, Option<tempfile::TempDir>), Error> {
    Ok(match dir {
        Some(dir) => {
            prepare_dir(dir)?;
            (dir.clone(), None)
        }
        None => {
            let base = tmp_base();
            sweep_stale(&base);
            let temp = tempfile::Builder::new()
                .prefix(TMP_PREFIX)
                .tempdir_in(&base)
                .map_err(|e| {
                    Error::io(
                        format!("creating a temporary directory in {}", base.display()),
                        e,
                    )
                })?;
            write_owner(temp.path())?;
            (temp.path().to_owned(), Some(temp))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubeconfigs_parse_and_carry_their_credentials() {
        let certs = pki::CertFiles {
            cert: PathBuf::from("/d/pki/admin.crt"),
            key: PathBuf::from("/d/pki/a \"b\".key"),
        };
        let kc = Kubeconfig::from_yaml(&cert_kubeconfig_yaml(
            "https://127.0.0.1:6443",
            Path::new("/d/ca.crt"),
            &certs,
        ))
        .unwrap();
        let user = kc.auth_infos[0].auth_info.as_ref().unwrap();
        assert_eq!(user.client_key.as_deref(), Some("/d/pki/a \"b\".key"));
        assert_eq!(
            kc.clusters[0].cluster.as_ref().unwrap().server.as_deref(),
            Some("https://127.0.0.1:6443")
        );
        assert_eq!(kc.current_context.as_deref(), Some("meshgate-e2e"));

        let kc = Kubeconfig::from_yaml(&token_kubeconfig_yaml(
            "https://x:1",
            Path::new("/ca"),
            "ey.J:x",
        ))
        .unwrap();
        let user = kc.auth_infos[0].auth_info.as_ref().unwrap();
        assert!(user.token.is_some());
    }

    #[test]
    fn down_refuses_a_directory_up_did_not_create() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("keep.txt"), "user data").unwrap();
        assert!(matches!(
            ControlPlane::down(dir.path()),
            Err(Error::NotStateDir { .. })
        ));
        assert!(dir.path().join("keep.txt").exists());
    }

    #[test]
    fn sweep_removes_only_directories_of_dead_owners() {
        let base = tempfile::tempdir().unwrap();
        let dead = base.path().join("meshgate-e2e-dead");
        let live = base.path().join("meshgate-e2e-live");
        let foreign = base.path().join("other-dead");
        let ownerless = base.path().join("meshgate-e2e-noowner");
        for d in [&dead, &live, &foreign, &ownerless] {
            std::fs::create_dir(d).unwrap();
        }
        // pid 1 with an impossible start time stands for a process that is gone.
        std::fs::write(dead.join(OWNER_FILE), "1 18446744073709551615\n").unwrap();
        std::fs::write(foreign.join(OWNER_FILE), "1 18446744073709551615\n").unwrap();
        write_owner(&live).unwrap();
        sweep_stale(base.path());
        assert!(!dead.exists());
        assert!(live.exists() && foreign.exists() && ownerless.exists());
    }

    #[test]
    fn remove_layout_leaves_foreign_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("etcd/member")).unwrap();
        std::fs::write(dir.path().join("admin.kubeconfig"), "x").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "mine").unwrap();
        remove_layout(dir.path());
        assert!(!dir.path().join("etcd").exists());
        assert!(!dir.path().join("admin.kubeconfig").exists());
        assert!(dir.path().join("notes.txt").exists());
    }
}
