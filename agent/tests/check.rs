//! Runs the built `meshgate-agent check` on temporary CNI directories with real executable
//! test plugins: scripts answering VERSION, one that hangs (and forks), one zero-byte, one
//! too old, one flooding stdout.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use meshgate_agent::cni::Prober;
use meshgate_core::cni::{Broken, ProbeOutcome};
use serde_json::Value;

const GOOD: &str = "#!/bin/sh\ncat >/dev/null\necho '{\"cniVersion\":\"1.0.0\",\"supportedVersions\":[\"0.3.0\",\"0.3.1\",\"0.4.0\",\"1.0.0\"]}'\n";

fn golden(name: &str) -> Vec<u8> {
    fs::read(format!(
        "{}/../core/testdata/{name}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

struct Node {
    _tmp: tempfile::TempDir,
    conf: PathBuf,
    bin: PathBuf,
}

impl Node {
    /// A node whose bin dir holds healthy calico, calico-ipam, portmap, bandwidth and linkerd-cni.
    fn new() -> Self {
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
        for p in [
            "calico",
            "calico-ipam",
            "portmap",
            "bandwidth",
            "linkerd-cni",
            "multus",
        ] {
            node.plugin(p, GOOD);
        }
        node
    }
    fn plugin(&self, name: &str, script: &str) {
        let path = self.bin.join(name);
        fs::write(&path, script).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
    }
    fn config(&self, name: &str, bytes: &[u8]) {
        fs::write(self.conf.join(name), bytes).unwrap();
    }
    fn check(&self, extra: &[&str]) -> (i32, Value, Duration) {
        let start = Instant::now();
        let out = Command::new(env!("CARGO_BIN_EXE_meshgate-agent"))
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

fn assert_reason(node: &Node, reason: &str, code: i32, extra: &[&str]) -> Value {
    let (got, json, _) = node.check(extra);
    assert_eq!(json["reason"], reason, "{json}");
    assert_eq!(got, code, "{json}");
    json
}

#[test]
fn s1_verified_exits_zero_with_contract_json() {
    let node = Node::new();
    node.config("10-calico.conflist", &golden("calico-linkerd.conflist"));
    let json = assert_reason(&node, "Verified", 0, &[]);
    assert_eq!(json["verified"], true);
    assert_eq!(json["runtime"], "containerd");
    assert_eq!(
        json["config_file"],
        node.conf.join("10-calico.conflist").display().to_string()
    );
    assert_eq!(
        json["plugins"],
        serde_json::json!(["calico", "portmap", "bandwidth", "linkerd-cni"])
    );
}

#[test]
fn s2_s3_s6_s8_structural_reasons() {
    let node = Node::new();
    assert_reason(&node, "NoConfig", 1, &[]);

    node.config("10-calico.conflist", &golden("calico.conflist"));
    let json = assert_reason(&node, "ChainedPluginMissing", 1, &[]); // S3
    assert!(
        json["message"]
            .as_str()
            .unwrap()
            .contains("10-calico.conflist")
    );

    node.config("01-linkerd-cni.conf", &golden("linkerd-only.conf"));
    assert_reason(&node, "PrimaryPluginMissing", 1, &[]); // S2
    fs::remove_file(node.conf.join("01-linkerd-cni.conf")).unwrap();

    node.config("10-calico.conflist", &golden("calico-linkerd.conflist"));
    node.config("00-multus.conf", &golden("multus.conf"));
    let json = assert_reason(&node, "ChainedPluginMissing", 1, &[]); // S6
    assert!(
        json["config_file"]
            .as_str()
            .unwrap()
            .ends_with("00-multus.conf")
    );
    fs::remove_file(node.conf.join("00-multus.conf")).unwrap();

    let full = golden("calico-linkerd.conflist");
    node.config("05-partial.conflist", &full[..full.len() / 3]); // S8
    assert_reason(&node, "ConfigInvalid", 1, &[]);
    let json = assert_reason(&node, "Verified", 0, &["--runtime", "crio"]);
    assert_eq!(json["runtime"], "crio");
}

#[test]
fn s7_broken_binaries() {
    let node = Node::new();
    node.config("10-calico.conflist", &golden("calico-linkerd.conflist"));

    fs::remove_file(node.bin.join("linkerd-cni")).unwrap();
    assert_reason(&node, "PluginBinaryMissing", 1, &[]);

    node.plugin("linkerd-cni", ""); // zero-byte partial copy
    let json = assert_reason(&node, "PluginBinaryBroken", 1, &[]);
    assert!(
        json["message"].as_str().unwrap().contains("is empty"),
        "{json}"
    );

    node.plugin("linkerd-cni", "#!/bin/sh\necho '{\"cniVersion\":\"0.2.0\",\"supportedVersions\":[\"0.1.0\",\"0.2.0\"]}'\n");
    let json = assert_reason(&node, "PluginBinaryBroken", 1, &[]);
    assert!(
        json["message"]
            .as_str()
            .unwrap()
            .contains("does not support cniVersion 0.3.1"),
        "{json}"
    );

    node.plugin(
        "linkerd-cni",
        "#!/bin/sh\necho '{\"code\":1,\"msg\":\"incompatible CNI versions\"}'\nexit 1\n",
    );
    let json = assert_reason(&node, "PluginBinaryBroken", 1, &[]);
    assert!(
        json["message"]
            .as_str()
            .unwrap()
            .contains("incompatible CNI versions"),
        "{json}"
    );

    node.plugin("linkerd-cni", GOOD);
    fs::set_permissions(
        node.bin.join("linkerd-cni"),
        fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let json = assert_reason(&node, "PluginBinaryBroken", 1, &[]);
    assert!(
        json["message"].as_str().unwrap().contains("not executable"),
        "{json}"
    );
}

#[test]
fn hanging_binary_is_reported_within_timeout_plus_one_second() {
    let node = Node::new();
    node.config("10-calico.conflist", &golden("calico-linkerd.conflist"));
    // It forks a child that would hold stdout open: the process-group kill must reap both.
    node.plugin("linkerd-cni", "#!/bin/sh\nsleep 60 &\nsleep 60\n");
    let (code, json, took) = node.check(&["--probe-timeout", "1s"]);
    assert_eq!(code, 1);
    assert_eq!(json["reason"], "PluginBinaryBroken", "{json}");
    assert!(
        json["message"].as_str().unwrap().contains("within 1000 ms"),
        "{json}"
    );
    assert!(
        took < Duration::from_secs(2),
        "took {took:?}, more than timeout + 1 s"
    );
}

#[test]
fn flooding_binary_costs_bounded_memory_and_is_broken() {
    let node = Node::new();
    node.config("10-calico.conflist", &golden("calico-linkerd.conflist"));
    node.plugin("linkerd-cni", "#!/bin/sh\nhead -c 50000000 /dev/zero\n");
    let json = assert_reason(&node, "PluginBinaryBroken", 1, &[]);
    assert!(
        json["message"]
            .as_str()
            .unwrap()
            .contains("invalid VERSION reply"),
        "{json}"
    );
}

#[test]
fn usage_and_io_errors_exit_two() {
    let node = Node::new();
    let out = Command::new(env!("CARGO_BIN_EXE_meshgate-agent"))
        .args(["check", "--cni-conf-dir"])
        .arg(&node.conf)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "missing --require-plugin is a usage error"
    );

    let not_a_dir = node.bin.join("calico");
    let out = Command::new(env!("CARGO_BIN_EXE_meshgate-agent"))
        .arg("check")
        .arg("--cni-conf-dir")
        .arg(&not_a_dir)
        .args(["--require-plugin", "linkerd-cni"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));
}

#[test]
fn text_output_names_file_reason_and_chain() {
    let node = Node::new();
    node.config("10-calico.conflist", &golden("calico.conflist"));
    let out = Command::new(env!("CARGO_BIN_EXE_meshgate-agent"))
        .arg("check")
        .arg("--cni-conf-dir")
        .arg(&node.conf)
        .arg("--cni-bin-dir")
        .arg(&node.bin)
        .args(["--require-plugin", "linkerd-cni"])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text.contains("NOT VERIFIED (ChainedPluginMissing)"),
        "{text}"
    );
    assert!(text.contains("calico → portmap → bandwidth"), "{text}");
}

fn counting_plugin(bin: &Path, counter: &Path, marker: &str) {
    let script = format!(
        "#!/bin/sh\n# {marker}\necho x >> {}\n{}",
        counter.display(),
        GOOD.trim_start_matches("#!/bin/sh\n")
    );
    fs::write(bin.join("linkerd-cni"), script).unwrap();
    fs::set_permissions(bin.join("linkerd-cni"), fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn unchanged_binary_is_not_run_twice() {
    let node = Node::new();
    let counter = node.bin.parent().unwrap().join("runs");
    counting_plugin(&node.bin, &counter, "v1");
    let prober = Prober::new(vec![node.bin.clone()], Duration::from_secs(2));
    let runs = || {
        fs::read_to_string(&counter)
            .unwrap_or_default()
            .lines()
            .count()
    };

    for _ in 0..3 {
        assert!(matches!(
            prober.probe("linkerd-cni", "0.3.1"),
            ProbeOutcome::Answered { .. }
        ));
    }
    assert_eq!(runs(), 1);
    // A rewrite (new size and mtime) is probed again.
    counting_plugin(&node.bin, &counter, "version two");
    assert!(matches!(
        prober.probe("linkerd-cni", "0.3.1"),
        ProbeOutcome::Answered { .. }
    ));
    assert_eq!(runs(), 2);
    // A chmod -x is noticed without running it.
    fs::set_permissions(
        node.bin.join("linkerd-cni"),
        fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    assert!(matches!(
        prober.probe("linkerd-cni", "0.3.1"),
        ProbeOutcome::Broken {
            why: Broken::NotExecutable,
            ..
        }
    ));
    assert_eq!(runs(), 2);
    assert_eq!(prober.cached(), 1);
}
