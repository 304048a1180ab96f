//! A simulated node's side of meshgate: its CNI directories with real executable test
//! plugins, and `meshgate-agent run` as a real process against a control plane.
//!
//! In: a [`ControlPlane`], a node name, flags. Out: handles to rewrite configs and plugins
//! atomically (as installers do), kill and restart the agent, and read its admin endpoints
//! and its log; the Node's gate as the agent writes it (taint, condition, label).
//! Shared by the e2e tests and the benchmarks.

use std::fs;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::ControlPlane;

/// A plugin that answers VERSION like a healthy CNI plugin.
pub const GOOD_PLUGIN: &str = "#!/bin/sh\ncat >/dev/null\necho '{\"cniVersion\":\"1.0.0\",\"supportedVersions\":[\"0.3.0\",\"0.3.1\",\"0.4.0\",\"1.0.0\"]}'\n";

/// [`GOOD_PLUGIN`] running the shell line `first` before it answers (a delay, a condition).
pub fn good_plugin_after(first: &str) -> String {
    let answer = GOOD_PLUGIN.trim_start_matches("#!/bin/sh\n");
    format!("#!/bin/sh\n{first}\n{answer}")
}

/// A workspace binary (`meshgate-agent`, `meshgate-webhook`) from the same target dir as the
/// running executable, or from `MESHGATE_BIN_DIR`. `make test` builds them first.
pub fn workspace_bin(name: &str) -> io::Result<PathBuf> {
    let dir = workspace_bin_dir()?;
    let path = dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "{} is not built: run `cargo build --bins` (make test does) or set MESHGATE_BIN_DIR",
                path.display()
            ),
        ))
    }
}

/// The directory of the workspace's binaries: `$MESHGATE_BIN_DIR`, else the cargo profile dir
/// this test or binary runs from (`target/<profile>`).
pub fn workspace_bin_dir() -> io::Result<PathBuf> {
    Ok(match std::env::var_os("MESHGATE_BIN_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            // target/<profile>/deps/<test>-<hash> or target/<profile>/<bin>
            let exe = std::env::current_exe()?;
            let dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
            if dir.ends_with("deps") {
                dir.parent().map(Path::to_path_buf).unwrap_or(dir)
            } else {
                dir
            }
        }
    })
}

/// A free loopback port for a listener that may be re-bound later (an agent restarted with
/// the same `--admin-addr`).
///
/// It is taken below the kernel's ephemeral range (32768-60999 by default): a port handed out
/// by binding port 0 lies inside that range, where any outgoing connection's local end can
/// occupy it between two runs of the same listener and make the restart fail with
/// "address already in use". Below it, only explicit binds compete, and this picks each
/// candidate once per process, starting from a pid-dependent offset.
pub fn free_port() -> io::Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let offset = std::process::id().wrapping_mul(7_919) % SPAN;
    for _ in 0..SPAN {
        let port = FIRST + (offset + NEXT.fetch_add(1, Ordering::Relaxed)) % SPAN;
        if TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
            return Ok(port as u16);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AddrInUse,
        "no free loopback port below the ephemeral range",
    ))
}

/// A golden config from `core/testdata`, read from the source tree so the tests and the
/// benchmarks use the same files.
pub fn golden(name: &str) -> io::Result<Vec<u8>> {
    fs::read(format!(
        "{}/../core/testdata/{name}",
        env!("CARGO_MANIFEST_DIR")
    ))
}

/// One simulated node's `/etc/cni/net.d` and `/opt/cni/bin`, removed on drop.
pub struct CniDirs {
    tmp: tempfile::TempDir,
    /// The config dir.
    pub conf: PathBuf,
    /// The plugin bin dir.
    pub bin: PathBuf,
}

impl CniDirs {
    /// An empty config dir, and a bin dir with healthy calico, calico-ipam, portmap, bandwidth,
    /// multus and linkerd-cni plugins.
    pub fn new() -> io::Result<Self> {
        let tmp = tempfile::tempdir()?;
        let conf = tmp.path().join("net.d");
        let bin = tmp.path().join("bin");
        fs::create_dir_all(&conf)?;
        fs::create_dir_all(&bin)?;
        let dirs = Self { tmp, conf, bin };
        for p in [
            "calico",
            "calico-ipam",
            "portmap",
            "bandwidth",
            "multus",
            "linkerd-cni",
        ] {
            dirs.plugin(p, GOOD_PLUGIN)?;
        }
        Ok(dirs)
    }

    /// Scratch space beside the CNI dirs (state files, logs).
    pub fn scratch(&self) -> &Path {
        self.tmp.path()
    }

    /// Installs a plugin binary atomically (write a temp file, then rename), as installers do.
    pub fn plugin(&self, name: &str, script: &str) -> io::Result<()> {
        let tmp = self.tmp.path().join(format!(".{name}.tmp"));
        fs::write(&tmp, script)?;
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755))?;
        fs::rename(&tmp, self.bin.join(name))
    }

    /// Writes a config file atomically (write then rename), as installers do.
    pub fn config(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        let tmp = self.tmp.path().join(format!(".{name}.tmp"));
        fs::write(&tmp, bytes)?;
        fs::rename(&tmp, self.conf.join(name))
    }

    /// Removes a config file.
    pub fn remove_config(&self, name: &str) -> io::Result<()> {
        fs::remove_file(self.conf.join(name))
    }
}

/// `meshgate-agent run` as a real process; killed on drop.
pub struct Agent {
    child: Option<Child>,
    args: Vec<String>,
    /// The agent's admin address (/live, /ready, /metrics).
    pub admin: SocketAddr,
    log: PathBuf,
}

impl Agent {
    /// Starts the agent for `node` with the admin kubeconfig, plus `extra` flags.
    pub fn start(
        cp: &ControlPlane,
        node: &str,
        dirs: &CniDirs,
        extra: &[&str],
    ) -> io::Result<Self> {
        Self::start_with_kubeconfig(cp.admin_kubeconfig_path(), node, dirs, extra)
    }

    /// Starts the agent for `node` with the given kubeconfig (e.g. its ServiceAccount's).
    pub fn start_with_kubeconfig(
        kubeconfig: &Path,
        node: &str,
        dirs: &CniDirs,
        extra: &[&str],
    ) -> io::Result<Self> {
        let admin: SocketAddr = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let mut args: Vec<String> = [
            "run",
            "--node-name",
            node,
            "--require-plugin",
            "linkerd-cni",
            "--api-timeout",
            "2s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for (flag, value) in [
            ("--kubeconfig", kubeconfig.display().to_string()),
            ("--cni-conf-dir", dirs.conf.display().to_string()),
            ("--cni-bin-dir", dirs.bin.display().to_string()),
            ("--admin-addr", admin.to_string()),
            (
                "--state-file",
                dirs.scratch()
                    .join("state/state.json")
                    .display()
                    .to_string(),
            ),
        ] {
            args.push(flag.into());
            args.push(value);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let log = dirs.scratch().join(format!("agent-{node}.log"));
        let mut agent = Self {
            child: None,
            args,
            admin,
            log,
        };
        agent.spawn()?;
        Ok(agent)
    }

    fn spawn(&mut self) -> io::Result<()> {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(workspace_bin("meshgate-agent")?)
            .args(&self.args)
            .env(
                "RUST_LOG",
                std::env::var("MESHGATE_AGENT_LOG")
                    .unwrap_or_else(|_| "meshgate_agent=debug,info".into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    /// The agent's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILLs the agent (no chance to clean up) and reaps it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends SIGTERM and waits up to `grace` for a clean exit; returns its exit code.
    pub fn terminate(&mut self, grace: Duration) -> Option<i32> {
        let mut c = self.child.take()?;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = std::time::Instant::now() + grace;
        loop {
            if let Ok(Some(status)) = c.try_wait() {
                return status.code();
            }
            if std::time::Instant::now() >= deadline {
                let _ = c.kill();
                let _ = c.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts the agent again with the same flags (and so the same state file).
    pub fn restart(&mut self) -> io::Result<()> {
        self.kill9();
        self.spawn()
    }

    /// The agent's log so far (for assertion messages).
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The agent's resident set size in KiB, from /proc.
    pub fn rss_kib(&self) -> Option<u64> {
        Some(crate::load::http_abuse::memory_kib(self.pid()?)?.0)
    }

    /// The agent's peak resident set size in KiB (`VmHWM`), from /proc.
    pub fn peak_rss_kib(&self) -> Option<u64> {
        Some(crate::load::http_abuse::memory_kib(self.pid()?)?.1)
    }

    /// GETs an admin path; `None` while the server is not up.
    pub async fn admin_get(&self, path: &str) -> Option<(u16, String)> {
        http_get(self.admin, path).await
    }

    /// Waits until `/ready` answers 200, up to `timeout`; the error carries the agent's log.
    pub async fn wait_ready(&self, timeout: Duration) -> anyhow::Result<()> {
        let end = std::time::Instant::now() + timeout;
        while self.admin_get("/ready").await.is_none_or(|r| r.0 != 200) {
            if std::time::Instant::now() > end {
                anyhow::bail!("agent not ready within {timeout:?}:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// The value of one sample line of /metrics (`name{labels}` exactly as printed).
    pub async fn metric(&self, sample: &str) -> Option<f64> {
        let (_, body) = self.admin_get("/metrics").await?;
        metric_sample(&body, sample)
    }
}

/// The value of the sample `name{labels}` (exactly as printed) in a Prometheus text body.
pub fn metric_sample(body: &str, name: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// `text` without terminal colour codes (`ESC [ ... m`): the agent's log as its fields read,
/// for matching `key=value`.
pub fn plain(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The last `lines` lines of `text` (a log, for assertion messages).
pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Whether the Node carries meshgate's taint.
pub fn tainted(n: &k8s_openapi::api::core::v1::Node) -> bool {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| {
            t.iter()
                .any(|t| t.key == meshgate_core::gate::DEFAULT_TAINT_KEY)
        })
}

/// The Node's `MeshCNIVerified` condition as (status, reason, message).
pub fn gate_condition(n: &k8s_openapi::api::core::v1::Node) -> Option<(String, String, String)> {
    let c = n
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == meshgate_core::gate::CONDITION_TYPE)?;
    Some((
        c.status.clone(),
        c.reason.clone().unwrap_or_default(),
        c.message.clone().unwrap_or_default(),
    ))
}

/// The Node's `meshgate.io/cni-verified` label.
pub fn verified_label(n: &k8s_openapi::api::core::v1::Node) -> Option<&str> {
    n.metadata
        .labels
        .as_ref()?
        .get(meshgate_core::gate::VERIFIED_LABEL)
        .map(String::as_str)
}

/// A plain HTTP/1.0 GET on an admin port, each step bounded by 2 s: (status, body), or
/// `None` while nothing answers.
pub async fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let connect = tokio::net::TcpStream::connect(addr);
    let mut s = tokio::time::timeout(Duration::from_secs(2), connect)
        .await
        .ok()?
        .ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut buf))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Some((code, body))
}

/// One `managedFields` entry, as `kubectl get -o yaml --show-managed-fields` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Managed {
    /// The field manager.
    pub manager: String,
    /// `Apply` (server-side apply) or `Update` (every other write).
    pub operation: String,
    /// `status` for a write to `nodes/status`, empty for the object itself.
    pub subresource: String,
}

impl Managed {
    /// The entry of `manager`'s `operation` on `subresource` (empty: the object itself).
    pub fn new(manager: &str, operation: &str, subresource: &str) -> Self {
        Self {
            manager: manager.into(),
            operation: operation.into(),
            subresource: subresource.into(),
        }
    }
}

/// The entries of `meta`'s `managedFields` that own the field at `path` (the `fieldsV1` keys
/// leading to it: `["f:spec", "f:taints"]`, `["f:status", "f:conditions",
/// "k:{\"type\":\"MeshCNIVerified\"}"]`).
pub fn owners(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    path: &[&str],
) -> Vec<Managed> {
    let entries = meta.managed_fields.iter().flatten();
    entries
        .filter(|e| {
            let fields = e.fields_v1.as_ref().map(|f| &f.0);
            path.iter()
                .try_fold(fields, |at, key| Some(at?.get(*key)))
                .flatten()
                .is_some()
        })
        .map(|e| Managed {
            manager: e.manager.clone().unwrap_or_default(),
            operation: e.operation.clone().unwrap_or_default(),
            subresource: e.subresource.clone().unwrap_or_default(),
        })
        .collect()
}

/// `meta`'s `managedFields` in one line per entry (manager, operation, subresource, the
/// top fields it owns), for a test's failure message.
pub fn managed_fields(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    let entries = meta.managed_fields.iter().flatten();
    entries
        .map(|e| {
            format!(
                "{} {} [{}] {}",
                e.manager.as_deref().unwrap_or("<none>"),
                e.operation.as_deref().unwrap_or_default(),
                e.subresource.as_deref().unwrap_or_default(),
                e.fields_v1
                    .as_ref()
                    .map(|f| f.0.to_string())
                    .unwrap_or_default()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}
