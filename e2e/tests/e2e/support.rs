//! Test-side helpers shared by the e2e modules: locating the workspace's built binaries, a
//! node's CNI directories with real executable test plugins, and the agent as a real process.

use std::fs;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::Api;
use meshgate_e2e::ControlPlane;
use meshgate_e2e::wait::poll_until;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A plugin that answers VERSION like a healthy CNI plugin.
pub const GOOD_PLUGIN: &str = "#!/bin/sh\ncat >/dev/null\necho '{\"cniVersion\":\"1.0.0\",\"supportedVersions\":[\"0.3.0\",\"0.3.1\",\"0.4.0\",\"1.0.0\"]}'\n";

/// A workspace binary (`meshgate-agent`, `meshgate-webhook`) from the same target dir as this
/// test binary, or from `MESHGATE_BIN_DIR`. `make test` builds them first.
pub fn workspace_bin(name: &str) -> PathBuf {
    let dir = match std::env::var_os("MESHGATE_BIN_DIR") {
        Some(d) => PathBuf::from(d),
        // target/debug/deps/e2e-<hash> → target/debug
        None => std::env::current_exe()
            .ok()
            .and_then(|p| p.parent()?.parent().map(Path::to_path_buf))
            .unwrap_or_default(),
    };
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is not built: run `cargo build --bins` (make test does) or set MESHGATE_BIN_DIR",
        path.display()
    );
    path
}

/// A free loopback port (bound then released; good enough for a test's own listeners).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// The golden configs of `core/testdata`.
pub fn golden(name: &str) -> Vec<u8> {
    let path = format!("{}/../core/testdata/{name}", env!("CARGO_MANIFEST_DIR"));
    fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// One simulated node's `/etc/cni/net.d` and `/opt/cni/bin`.
pub struct CniDirs {
    tmp: tempfile::TempDir,
    pub conf: PathBuf,
    pub bin: PathBuf,
}

impl CniDirs {
    /// Empty config dir, and a bin dir with healthy calico, calico-ipam, portmap, bandwidth,
    /// multus and linkerd-cni plugins.
    pub fn new() -> Self {
        let tmp = tempfile::tempdir().expect("tempdir");
        let conf = tmp.path().join("net.d");
        let bin = tmp.path().join("bin");
        fs::create_dir_all(&conf).unwrap();
        fs::create_dir_all(&bin).unwrap();
        let dirs = Self { tmp, conf, bin };
        for p in [
            "calico",
            "calico-ipam",
            "portmap",
            "bandwidth",
            "multus",
            "linkerd-cni",
        ] {
            dirs.plugin(p, GOOD_PLUGIN);
        }
        dirs
    }

    /// Scratch space beside the CNI dirs (state files, kubeconfigs).
    pub fn scratch(&self) -> &Path {
        self.tmp.path()
    }

    /// Installs a plugin binary atomically (write a temp file, then rename), as installers do.
    pub fn plugin(&self, name: &str, script: &str) {
        let tmp = self.tmp.path().join(format!(".{name}.tmp"));
        fs::write(&tmp, script).unwrap();
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755)).unwrap();
        fs::rename(&tmp, self.bin.join(name)).unwrap();
    }

    /// Writes a config file atomically (write then rename), as installers do.
    pub fn config(&self, name: &str, bytes: &[u8]) {
        let tmp = self.tmp.path().join(format!(".{name}.tmp"));
        fs::write(&tmp, bytes).unwrap();
        fs::rename(&tmp, self.conf.join(name)).unwrap();
    }

    /// Removes a config file.
    pub fn remove_config(&self, name: &str) {
        fs::remove_file(self.conf.join(name)).unwrap();
    }
}

/// `meshgate-agent run` as a real process against the control plane.
pub struct Agent {
    child: Option<Child>,
    args: Vec<String>,
    pub admin: SocketAddr,
    log: PathBuf,
}

impl Agent {
    /// Starts the agent for `node` with the admin kubeconfig, plus `extra` flags.
    pub fn start(cp: &ControlPlane, node: &str, dirs: &CniDirs, extra: &[&str]) -> Self {
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let mut args: Vec<String> = vec![
            "run".into(),
            "--node-name".into(),
            node.into(),
            "--kubeconfig".into(),
            cp.admin_kubeconfig_path().display().to_string(),
            "--cni-conf-dir".into(),
            dirs.conf.display().to_string(),
            "--cni-bin-dir".into(),
            dirs.bin.display().to_string(),
            "--require-plugin".into(),
            "linkerd-cni".into(),
            "--admin-addr".into(),
            admin.to_string(),
            "--state-file".into(),
            dirs.scratch()
                .join("state/state.json")
                .display()
                .to_string(),
            "--api-timeout".into(),
            "2s".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let log = dirs.scratch().join(format!("agent-{node}.log"));
        let mut agent = Self {
            child: None,
            args,
            admin,
            log,
        };
        agent.spawn();
        agent
    }

    fn spawn(&mut self) {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("agent log");
        let child = Command::new(workspace_bin("meshgate-agent"))
            .args(&self.args)
            .env("RUST_LOG", "meshgate_agent=debug,info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            .spawn()
            .expect("starting meshgate-agent");
        self.child = Some(child);
    }

    /// SIGKILLs the agent (no chance to clean up) and reaps it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the agent again with the same flags (same state file).
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// The agent's log so far (for assertion messages).
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// GETs an admin path; `None` while the server is not up.
    pub async fn admin_get(&self, path: &str) -> Option<(u16, String)> {
        let mut s = tokio::time::timeout(
            Duration::from_secs(2),
            tokio::net::TcpStream::connect(self.admin),
        )
        .await
        .ok()?
        .ok()?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
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

    /// The value of one sample line of /metrics (`name{labels}` exactly as printed).
    pub async fn metric(&self, sample: &str) -> Option<f64> {
        let (_, body) = self.admin_get("/metrics").await?;
        body.lines()
            .find_map(|l| l.strip_prefix(sample)?.trim().parse().ok())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Waits until the Node satisfies `pred`; the error says what the Node looked like last.
pub async fn wait_node(
    client: &Client,
    name: &str,
    what: &str,
    pred: impl Fn(&Node) -> bool,
) -> anyhow::Result<Node> {
    let nodes: Api<Node> = Api::all(client.clone());
    poll_until(what, crate::WAIT, || {
        let nodes = nodes.clone();
        let pred = &pred;
        async move {
            let n = nodes.get(name).await?;
            anyhow::Ok(pred(&n).then_some(n))
        }
    })
    .await
    .with_context(|| format!("waiting for node {name}: {what}"))
}
