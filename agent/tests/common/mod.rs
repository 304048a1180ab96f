//! Helpers shared by the agent's integration tests: a temporary node (CNI config and bin
//! dirs with healthy test plugins) that runs the built `meshgate-agent check`, and process
//! liveness checks for what plugins leave behind.
#![allow(dead_code)] // each test binary uses a different part

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

/// A wrapper that runs the agent as nobody (uid and gid 65534, no groups, no capabilities).
pub const NOBODY: &[&str] = &[
    "/usr/bin/setpriv",
    "--reuid",
    "65534",
    "--regid",
    "65534",
    "--clear-groups",
];

/// The built `meshgate-agent`, started through `wrapper` (a command that execs its
/// arguments), or directly when it is empty.
pub fn agent_via(wrapper: &[&str]) -> Command {
    let agent = env!("CARGO_BIN_EXE_meshgate-agent");
    match wrapper.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(agent);
            c
        }
        None => Command::new(agent),
    }
}

/// The plugin types of `calico-linkerd.conflist`'s chain (IPAM included).
pub const CHAIN: [&str; 5] = [
    "calico",
    "calico-ipam",
    "portmap",
    "bandwidth",
    "linkerd-cni",
];

/// A plugin answering VERSION like a current plugin.
pub const GOOD: &str = "#!/bin/sh\ncat >/dev/null\necho '{\"cniVersion\":\"1.0.0\",\"supportedVersions\":[\"0.3.0\",\"0.3.1\",\"0.4.0\",\"1.0.0\"]}'\n";

pub fn golden(name: &str) -> Vec<u8> {
    fs::read(format!(
        "{}/../core/testdata/{name}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

pub struct Node {
    _tmp: tempfile::TempDir,
    pub conf: PathBuf,
    pub bin: PathBuf,
}

impl Node {
    /// A node whose bin dir holds healthy calico, calico-ipam, portmap, bandwidth and linkerd-cni.
    pub fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let conf = tmp.path().join("net.d");
        let bin = tmp.path().join("bin");
        fs::create_dir_all(&conf).unwrap();
        fs::create_dir_all(&bin).unwrap();
        let node = Node {
            _tmp: tmp,
            conf,
            bin,
        };
        for p in CHAIN.iter().chain(&["multus"]) {
            node.plugin(p, GOOD);
        }
        node
    }
    /// Writes an executable plugin script.
    pub fn plugin(&self, name: &str, script: &str) {
        let path = self.bin.join(name);
        fs::write(&path, script).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
    }
    /// Writes a config file.
    pub fn config(&self, name: &str, bytes: &[u8]) {
        fs::write(self.conf.join(name), bytes).unwrap();
    }
    /// Runs `meshgate-agent check --output json` on this node: exit code, verdict, time.
    pub fn check(&self, extra: &[&str]) -> (i32, Value, Duration) {
        self.check_via(&[], extra)
    }

    /// [`Node::check`] started through `wrapper` (a command that execs its arguments, such
    /// as [`NOBODY`]), or directly when it is empty.
    pub fn check_via(&self, wrapper: &[&str], extra: &[&str]) -> (i32, Value, Duration) {
        let mut cmd = agent_via(wrapper);
        let start = Instant::now();
        let out = cmd
            .arg("check")
            .arg("--cni-conf-dir")
            .arg(&self.conf)
            .arg("--cni-bin-dir")
            .arg(&self.bin)
            .args(["--require-plugin", "linkerd-cni", "--output", "json"])
            .args(extra)
            .output()
            .unwrap();
        let took = start.elapsed();
        let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout is not JSON ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        });
        (out.status.code().unwrap(), json, took)
    }
}

/// True while a process with this pid exists (and is not a zombie).
pub fn alive(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .is_some_and(|r| !r.trim_start().starts_with('Z'))
    })
}

/// Waits (at most 5 s) for a pid file and reads it.
pub fn read_pid(path: &Path) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Ok(s) = fs::read_to_string(path)
            && let Ok(pid) = s.trim().parse()
        {
            return pid;
        }
        assert!(
            Instant::now() < deadline,
            "{} never written",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
