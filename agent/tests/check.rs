//! Runs the built `meshgate-agent check` on temporary CNI directories with real executable
//! test plugins: scripts answering VERSION, one that hangs (and forks), one zero-byte, one
//! too old, one flooding stdout, ones that `setsid` and double-fork holding the pipes, one
//! that never reads stdin, one that records what libcni would send it; plus the reader's
//! memory on symlinked directories and hard links.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use meshgate_agent::cni::Prober;
use meshgate_agent::cni::reader::{DEFAULT_BUDGET_BYTES, DEFAULT_MAX_FILE_BYTES, Reader};
use meshgate_core::cni::{Broken, ProbeOutcome, Reason, Runtime, VerifyOptions, verify};
use serde_json::Value;

mod common;
use common::{CHAIN, GOOD, Node, alive, golden, read_pid};

fn assert_reason(node: &Node, reason: &str, code: i32, extra: &[&str]) -> Value {
    let (got, json, _) = node.check(extra);
    assert_eq!(json["reason"], reason, "{json}");
    assert_eq!(got, code, "{json}");
    json
}

/// Not verified for `reason`, and the message says `needle`.
fn assert_names(node: &Node, reason: &str, extra: &[&str], needle: &str) {
    let json = assert_reason(node, reason, 1, extra);
    let message = json["message"].as_str().unwrap_or_default();
    assert!(message.contains(needle), "{json}");
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
            .contains("does not list the list's cniVersion (2 versions listed)"),
        "{json}"
    );

    node.plugin(
        "linkerd-cni",
        "#!/bin/sh\necho '{\"code\":1,\"msg\":\"incompatible CNI versions\"}'\nexit 1\n",
    );
    let json = assert_reason(&node, "PluginBinaryBroken", 1, &[]);
    // The CNI error code is reported; the plugin's own text never is (issue 13 item 6).
    let message = json["message"].as_str().unwrap();
    assert!(message.contains("CNI error code 1"), "{json}");
    assert!(!message.contains("incompatible"), "{json}");

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

/// `meshgate-agent check` on `node`'s directories with `extra` flags, text output.
fn run_check(node: &Node, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_meshgate-agent"))
        .arg("check")
        .arg("--cni-conf-dir")
        .arg(&node.conf)
        .arg("--cni-bin-dir")
        .arg(&node.bin)
        .args(["--require-plugin", "linkerd-cni"])
        .args(extra)
        .output()
        .unwrap()
}

/// [`run_check`]'s exit code and stderr.
fn check_fails(node: &Node, extra: &[&str]) -> (Option<i32>, String) {
    let out = run_check(node, extra);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `meshgate-agent check` with text output on `node`: exit code and stdout.
fn check_text(node: &Node) -> (Option<i32>, String) {
    let out = run_check(node, &[]);
    (out.status.code(), String::from_utf8(out.stdout).unwrap())
}

#[test]
fn text_output_names_file_reason_and_chain() {
    let node = Node::new();
    node.config("10-calico.conflist", &golden("calico.conflist"));
    let (code, text) = check_text(&node);
    assert_eq!(code, Some(1));
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

    let deadline = || Instant::now() + Duration::from_secs(10);
    for _ in 0..3 {
        assert!(matches!(
            prober.probe("linkerd-cni", deadline()),
            ProbeOutcome::Answered { .. }
        ));
    }
    assert_eq!(runs(), 1);
    // A rewrite (new size and mtime) is probed again.
    counting_plugin(&node.bin, &counter, "version two");
    assert!(matches!(
        prober.probe("linkerd-cni", deadline()),
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
        prober.probe("linkerd-cni", deadline()),
        ProbeOutcome::Broken {
            why: Broken::NotExecutable,
            ..
        }
    ));
    assert_eq!(runs(), 2);
    assert_eq!(prober.cached(), 1);
}

#[test]
fn setsid_grandchildren_are_killed_always() {
    let node = Node::new();
    node.config("10-calico.conflist", &golden("calico-linkerd.conflist"));
    let pidfile = node.bin.parent().unwrap().join("escaped.pid");
    // Double fork + setsid: the grandchild is in its own session and process group and
    // outlives its parent. It records its host PID (/proc/self is the host's procfs even
    // inside a PID namespace); the plugin answers only once it has.
    let escape = |redirect: &str| {
        format!(
            "( setsid sh -c 'read pid rest < /proc/self/stat; echo $pid > {p}.tmp; mv {p}.tmp {p}; exec sleep 300' {redirect} & )\nwhile [ ! -s {p} ]; do sleep 0.01; done\n",
            p = pidfile.display()
        )
    };
    let answer = GOOD.trim_start_matches("#!/bin/sh\ncat >/dev/null\n");

    // 1. The escapee closed its stdio (a proper daemon): Go's cmd.Run returns as soon as
    //    the plugin exits, so the answer counts, and the escapee is killed anyway.
    let daemon = format!(
        "#!/bin/sh\ncat >/dev/null\n{}{answer}",
        escape("</dev/null >/dev/null 2>&1")
    );
    node.plugin("linkerd-cni", &daemon);
    let (code, json, took) = node.check(&["--probe-timeout", "2s"]);
    assert_eq!(json["reason"], "Verified", "{json}");
    assert_eq!(code, 0);
    let pid = read_pid(&pidfile);
    assert!(
        !alive(pid),
        "the setsid grandchild {pid} survived the probe"
    );
    assert!(took < Duration::from_secs(2), "took {took:?}");

    // 2. The escapee holds the plugin's stdout/stderr: libcni would wait for it, so the
    //    plugin is broken; it and the escapee are killed at the deadline.
    fs::remove_file(&pidfile).unwrap();
    node.plugin(
        "linkerd-cni",
        &format!("#!/bin/sh\ncat >/dev/null\n{}{answer}", escape("")),
    );
    let (code, json, took) = node.check(&["--probe-timeout", "1s"]);
    assert_eq!(code, 1);
    assert_eq!(json["reason"], "PluginBinaryBroken", "{json}");
    assert!(
        json["message"]
            .as_str()
            .unwrap()
            .contains("kept its output open past 1000 ms"),
        "{json}"
    );
    assert!(took < Duration::from_secs(2), "took {took:?}");
    let pid = read_pid(&pidfile);
    assert!(!alive(pid), "the setsid grandchild {pid} survived");

    // 3. The same escapee from a plugin that hangs: killed at the deadline, not after 300 s.
    fs::remove_file(&pidfile).unwrap();
    node.plugin(
        "linkerd-cni",
        &format!("#!/bin/sh\n{}exec sleep 300\n", escape("")),
    );
    let (code, json, took) = node.check(&["--probe-timeout", "1s"]);
    assert_eq!(code, 1);
    assert_eq!(json["reason"], "PluginBinaryBroken", "{json}");
    assert!(took < Duration::from_secs(2), "took {took:?}");
    let pid = read_pid(&pidfile);
    assert!(
        !alive(pid),
        "the setsid grandchild {pid} survived the timeout"
    );
}

#[test]
fn one_deadline_for_the_whole_verification() {
    let node = Node::new();
    node.config("10-calico.conflist", &golden("calico-linkerd.conflist"));
    // Every binary hangs; each alone would get 5 s, the verification as a whole gets 1 s.
    for p in CHAIN {
        node.plugin(p, "#!/bin/sh\nexec sleep 60\n");
    }
    let (code, json, took) = node.check(&["--probe-timeout", "5s", "--verify-timeout", "1s"]);
    assert_eq!(code, 1);
    assert_eq!(json["reason"], "PluginBinaryBroken", "{json}");
    assert!(
        took < Duration::from_secs(2),
        "took {took:?} for 5 hanging plugins"
    );
    // The first plugin used the whole deadline; the other four were never started.
    let message = json["message"].as_str().unwrap();
    assert!(
        message.contains("did not answer VERSION within") && message.contains("and 4 more"),
        "{json}"
    );
}

#[test]
fn a_plugin_that_never_reads_stdin_and_a_huge_cni_version_cannot_hang_the_check() {
    let node = Node::new();
    let huge = "9".repeat(900_000);
    let conf = String::from_utf8(golden("calico-linkerd.conflist"))
        .unwrap()
        .replace("\"0.3.1\"", &format!("\"{huge}\""));
    node.config("10-calico.conflist", conf.as_bytes());
    // Never reads stdin, answers at once.
    for p in CHAIN {
        node.plugin(
            p,
            "#!/bin/sh\necho '{\"cniVersion\":\"1.0.0\",\"supportedVersions\":[\"0.3.1\",\"1.0.0\"]}'\nexec sleep 60\n",
        );
    }
    // Stdin is never read and the plugins never exit: only the deadlines end this.
    let (code, json, took) = node.check(&["--probe-timeout", "1s", "--verify-timeout", "2s"]);
    assert_eq!(code, 1);
    assert!(took < Duration::from_secs(3), "took {took:?}");
    // The version is not quoted back either.
    assert!(
        !json["message"].as_str().unwrap().contains("999999"),
        "{json}"
    );
}

#[test]
fn plugins_get_exactly_libcnis_version_call() {
    let node = Node::new();
    node.config("10-calico.conflist", &golden("calico-linkerd.conflist"));
    let seen = node.bin.parent().unwrap().join("seen");
    node.plugin(
        "linkerd-cni",
        &format!(
            "#!/bin/sh\ncat > {s}.stdin\nenv | grep -E '^(CNI_|GO)' | sort > {s}.env\necho $$ > {s}.pid\n{}",
            GOOD.trim_start_matches("#!/bin/sh\ncat >/dev/null\n"),
            s = seen.display()
        ),
    );
    assert_reason(&node, "Verified", 0, &[]);
    // libcni GetVersionInfo sends version.Current(), not the config's 0.3.1.
    assert_eq!(
        fs::read_to_string(seen.with_extension("stdin")).unwrap(),
        r#"{"cniVersion":"1.1.0"}"#
    );
    assert_eq!(
        fs::read_to_string(seen.with_extension("env")).unwrap(),
        concat!(
            "CNI_ARGS=\nCNI_COMMAND=VERSION\nCNI_CONTAINERID=\nCNI_IFNAME=dummy\nCNI_NETNS=dummy\nCNI_PATH=dummy\n",
            // Not libcni's: a Go plugin's start-up without collections (see the prober).
            "GOGC=off\nGOMEMLIMIT=32MiB\n"
        )
    );
    // As root the plugin runs in its own PID namespace, as PID 2 under meshgate's minimal
    // init (PID 1): what makes "kill everything it started" hold for setsid'd grandchildren.
    if nix::unistd::geteuid().is_root() {
        assert_eq!(
            fs::read_to_string(seen.with_extension("pid"))
                .unwrap()
                .trim(),
            "2"
        );
    }
}

#[test]
fn old_plugins_without_version_support_count_as_0_1_0() {
    let node = Node::new();
    // A real pre-0.2 config: no cniVersion, so libcni checks "0.1.0".
    let conf = String::from_utf8(golden("calico-linkerd.conflist"))
        .unwrap()
        .replace("\"cniVersion\": \"0.3.1\",", "");
    node.config("10-calico.conflist", conf.as_bytes());
    let old = "#!/bin/sh\necho '{\"code\":4,\"msg\":\"unknown CNI_COMMAND: VERSION\"}'\nexit 1\n";
    for p in CHAIN {
        node.plugin(p, old);
    }
    assert_reason(&node, "Verified", 0, &[]);
    // A bare {"cniVersion":"0.2.0"} reply supports 0.1.0 too.
    node.plugin(
        "linkerd-cni",
        "#!/bin/sh\necho '{\"cniVersion\":\"0.2.0\"}'\n",
    );
    assert_reason(&node, "Verified", 0, &[]);
    // A reply without cniVersion is rejected.
    node.plugin(
        "linkerd-cni",
        "#!/bin/sh\necho '{\"supportedVersions\":[\"0.1.0\"]}'\n",
    );
    let json = assert_reason(&node, "PluginBinaryBroken", 1, &[]);
    assert!(
        json["message"].as_str().unwrap().contains("no cniVersion"),
        "{json}"
    );
}

#[test]
fn ipam_type_path_traversal_never_runs_anything() {
    let node = Node::new();
    let marker = node.bin.parent().unwrap().join("pwned");
    let evil = node.bin.parent().unwrap().join("evil");
    fs::write(
        &evil,
        format!("#!/bin/sh\ntouch {}\n{}", marker.display(), GOOD),
    )
    .unwrap();
    fs::set_permissions(&evil, fs::Permissions::from_mode(0o755)).unwrap();
    for ipam in ["../evil".to_string(), evil.display().to_string()] {
        let conf = String::from_utf8(golden("calico-linkerd.conflist"))
            .unwrap()
            .replace("\"calico-ipam\"", &format!("\"{ipam}\""));
        node.config("10-calico.conflist", conf.as_bytes());
        let json = assert_reason(&node, "PluginBinaryMissing", 1, &[]);
        assert!(!marker.exists(), "{ipam} was executed");
        assert!(
            !json["message"].as_str().unwrap().contains("evil"),
            "{json}"
        );
    }
    // The prober refuses a path on its own too (defence in depth).
    let prober = Prober::new(vec![node.bin.clone()], Duration::from_secs(2));
    let out = prober.probe("../evil", Instant::now() + Duration::from_secs(2));
    assert!(matches!(out, ProbeOutcome::Broken { .. }), "{out:?}");
    assert!(!marker.exists());
}

#[test]
fn plugin_output_is_never_quoted() {
    let node = Node::new();
    node.config("10-calico.conflist", &golden("calico-linkerd.conflist"));
    for script in [
        "#!/bin/sh\necho 'SECRET on stderr' >&2\nexit 3\n",
        "#!/bin/sh\necho '{\"code\":9,\"msg\":\"SECRET msg\",\"details\":\"SECRET\"}'\nexit 1\n",
        "#!/bin/sh\necho 'SECRET not json'\n",
        "#!/bin/sh\necho '{\"cniVersion\":\"SECRET\",\"supportedVersions\":[\"SECRET\"]}'\n",
    ] {
        node.plugin("linkerd-cni", script);
        let (_, json, _) = node.check(&[]);
        assert_eq!(json["reason"], "PluginBinaryBroken", "{json}");
        assert!(
            !json["message"].as_str().unwrap().contains("SECRET"),
            "{json}"
        );
    }
}

/// Runs `check` under GNU time and returns its peak RSS in KiB and its JSON. (wait4's
/// rusage would count the test process itself: Rust spawns with a shared-memory vfork.)
fn check_rss(conf: &Path, bin: &Path, runtime: &str) -> Option<(u64, Value)> {
    if !Path::new("/usr/bin/time").exists() {
        return None;
    }
    let out = Command::new("/usr/bin/time")
        .args(["-f", "maxrss_kb=%M"])
        .arg(env!("CARGO_BIN_EXE_meshgate-agent"))
        .arg("check")
        .arg("--cni-conf-dir")
        .arg(conf)
        .arg("--cni-bin-dir")
        .arg(bin)
        .args([
            "--require-plugin",
            "linkerd-cni",
            "--output",
            "json",
            "--runtime",
            runtime,
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let rss = err
        .lines()
        .find_map(|l| l.strip_prefix("maxrss_kb="))
        .and_then(|v| v.trim().parse().ok())?;
    Some((rss, serde_json::from_slice(&out.stdout).unwrap()))
}

#[test]
fn symlinked_directories_and_hard_links_cost_one_read_not_hundreds_of_mb() {
    let node = Node::new();
    let root = node.bin.parent().unwrap().to_path_buf();
    // 30 x 1 MB .conf files behind 10 symlinks named like configs (before: each was
    // followed and read: 313 MB peak RSS), and 200 hard links of a 1 MB file (215 MB).
    let big = root.join("big");
    fs::create_dir(&big).unwrap();
    let blob = vec![b' '; 1_000_000];
    for i in 0..30 {
        fs::write(big.join(format!("{i}.conf")), &blob).unwrap();
    }
    for i in 0..10 {
        std::os::unix::fs::symlink(&big, node.conf.join(format!("0{i}-dir.conflist"))).unwrap();
    }
    node.config("50-calico.conflist", &golden("calico-linkerd.conflist"));
    let hard = root.join("hard");
    fs::create_dir(&hard).unwrap();
    fs::write(root.join("blob"), &blob).unwrap();
    for i in 100..300 {
        fs::hard_link(root.join("blob"), hard.join(format!("{i}-x.conflist"))).unwrap();
    }
    fs::copy(
        node.conf.join("50-calico.conflist"),
        hard.join("999-calico.conflist"),
    )
    .unwrap();
    for (dir, runtime) in [
        (&node.conf, Runtime::Containerd),
        (&node.conf, Runtime::Crio),
        (&hard, Runtime::Containerd),
        (&hard, Runtime::Crio),
    ] {
        // What one verification reads, from the reader's own accounting.
        let mut reader = Reader::new(dir, DEFAULT_MAX_FILE_BYTES, DEFAULT_BUDGET_BYTES);
        let opts = VerifyOptions {
            conf_dir: dir.display().to_string(),
            runtime,
            required: vec!["linkerd-cni".into()],
            multus: Default::default(),
        };
        let prober = Prober::new(vec![node.bin.clone()], Duration::from_secs(2));
        let deadline = Instant::now() + Duration::from_secs(10);
        let v = verify(&mut reader, &opts, |t| prober.probe(t, deadline));
        eprintln!(
            "{} {}: {} bytes read, {:?}",
            dir.display(),
            runtime.as_str(),
            reader.bytes_used(),
            v.reason
        );
        assert!(reader.bytes_used() <= DEFAULT_BUDGET_BYTES);
        // The symlinked directory sorts first and fails to load: containerd is stuck on it,
        // CRI-O skips it (exactly like ocicni). The 200 junk hard links fail for containerd
        // and exhaust CRI-O's read budget: not verified, never a guess.
        let expected = match (dir == &node.conf, runtime) {
            (true, Runtime::Crio) => Reason::Verified,
            _ => Reason::ConfigInvalid,
        };
        assert_eq!(v.reason, expected, "{}", v.message);
        if let Some((rss_kb, json)) = check_rss(dir, &node.bin, runtime.as_str()) {
            eprintln!(
                "{} {}: peak RSS {rss_kb} KiB",
                dir.display(),
                runtime.as_str()
            );
            assert!(rss_kb < 48 * 1024, "{}: {rss_kb} KiB", runtime.as_str());
            assert_eq!(json["reason"], v.reason.as_str(), "{json}");
        }
    }
}

/// A plugin entry nesting as deep as Go's decoder allows (10,000 levels, 9,997 of them in a
/// field of calico's entry) is judged as libcni judges it, even on a 512 KiB main-thread
/// stack; one level more is ConfigInvalid, as Go refuses it. This file used to abort `check`.
#[test]
fn a_conflist_as_deep_as_go_allows_is_judged_on_a_small_stack() {
    let node = Node::new();
    let small_stack = ["sh", "-c", "ulimit -s 512 && exec \"$0\" \"$@\""];
    for (levels, reason, code) in [(10_000, "Verified", 0), (10_001, "ConfigInvalid", 1)] {
        let k = levels - 3;
        let conf = format!(
            r#"{{"cniVersion":"0.3.1","name":"k8s-pod-network","plugins":[{{"type":"calico","deep":{}{}}},{{"type":"linkerd-cni"}}]}}"#,
            "[".repeat(k),
            "]".repeat(k)
        );
        node.config("10-calico.conflist", conf.as_bytes());
        let (got, json, _) = node.check_via(&small_stack, &[]);
        assert_eq!(json["reason"], reason, "{levels}: {json}");
        assert_eq!(got, code, "{levels}: {json}");
    }
}

/// A thin `00-multus.conf` as Multus's entrypoint writes it: the primary config copied into
/// `delegates` (core/testdata/README.md).
fn thin_multus(primary: &[u8]) -> Vec<u8> {
    let master: Value = serde_json::from_slice(primary).unwrap();
    serde_json::to_vec(&serde_json::json!({
        "cniVersion": "0.3.1", "name": "multus-cni-network", "type": "multus",
        "kubeconfig": "/etc/cni/net.d/multus.d/multus.kubeconfig", "delegates": [master],
    }))
    .unwrap()
}

#[test]
fn multus_thin_node_is_verified_through_its_inline_delegate() {
    let node = Node::new();
    node.config("10-calico.conflist", &golden("calico.conflist"));
    node.config(
        "00-multus.conf",
        &thin_multus(&golden("calico-linkerd.conflist")),
    );
    let json = assert_reason(&node, "Verified", 0, &[]);
    assert_eq!(json["plugins"], serde_json::json!(["multus"]));
    assert_eq!(json["delegate"]["layout"], "multus-thin");
    assert_eq!(json["delegate"]["source"], "inline delegate #1");
    assert_eq!(
        json["delegate"]["plugins"],
        serde_json::json!(["calico", "portmap", "bandwidth", "linkerd-cni"])
    );
    // Multus's own binary answers VERSION too.
    fs::remove_file(node.bin.join("multus")).unwrap();
    assert_names(
        &node,
        "PluginBinaryMissing",
        &[],
        "00-multus.conf: plugin #1",
    );
    // The primary file beside it does not matter; the copy in delegates does.
    node.plugin("multus", GOOD);
    node.config("00-multus.conf", &thin_multus(&golden("calico.conflist")));
    node.config("10-calico.conflist", &golden("calico-linkerd.conflist"));
    assert_names(
        &node,
        "ChainedPluginMissing",
        &[],
        "via multus (thin) inline delegate #1 does not chain linkerd-cni",
    );
}

#[test]
fn multus_thick_delegate_file_verifies_and_its_drift_re_gates() {
    let node = Node::new();
    node.plugin("multus-shim", GOOD);
    let primary = node.conf.join("10-calico.conflist");
    // The thick daemon names the primary under /host, where its DaemonSet mounts the node's
    // config directory.
    let shim = serde_json::json!({
        "cniVersion": "0.3.1", "name": "multus-cni-network", "type": "multus-shim",
        "clusterNetwork": format!("/host{}", primary.display()),
    });
    node.config("00-multus.conf", &serde_json::to_vec(&shim).unwrap());
    node.config("10-calico.conflist", &golden("calico-linkerd.conflist"));
    let json = assert_reason(&node, "Verified", 0, &[]);
    assert_eq!(json["delegate"]["layout"], "multus-thick");
    assert_eq!(json["delegate"]["file"], primary.display().to_string());

    let (code, shown) = check_text(&node);
    assert_eq!(code, Some(0));
    assert!(
        shown.contains(&format!(
            "delegate: multus (thick) clusterNetwork {}: {}: calico → portmap → bandwidth → linkerd-cni",
            primary.display(),
            primary.display()
        )),
        "{shown}"
    );

    // Drift of the delegate file: the mesh plugin is gone, the file is broken, too large,
    // deleted; each time the node is gated again, and restored it verifies.
    node.config("10-calico.conflist", &golden("calico.conflist"));
    assert_reason(&node, "ChainedPluginMissing", 1, &[]);
    node.config("10-calico.conflist", b"{\"name\":");
    assert_reason(&node, "ConfigInvalid", 1, &[]);
    node.config("10-calico.conflist", &golden("calico-linkerd.conflist"));
    assert_names(
        &node,
        "ConfigInvalid",
        &["--max-config-bytes", "700"],
        "cannot be verified",
    );
    fs::remove_file(&primary).unwrap();
    assert_names(&node, "ConfigInvalid", &[], "does not exist");
    node.config("10-calico.conflist", &golden("calico-linkerd.conflist"));
    assert_reason(&node, "Verified", 0, &[]);
    // A delegate binary going missing gates the node as well.
    fs::remove_file(node.bin.join("linkerd-cni")).unwrap();
    assert_names(&node, "PluginBinaryMissing", &[], "via multus (thick)");
}

/// `check --cni-conf-dir <copy>` on a copy of a thick Multus node's directory: the daemon's
/// `/host/etc/cni/net.d/...` clusterNetwork is the copy's file, and the mesh plugin dropped in
/// under the network's name (Multus v4.2.1+ runs it) is part of the chain.
#[test]
fn multus_thick_on_a_copy_reads_the_copy_and_its_drop_ins() {
    let node = Node::new();
    node.plugin("multus-shim", GOOD);
    let shim = serde_json::json!({
        "cniVersion": "0.3.1", "name": "multus-cni-network", "type": "multus-shim",
        "clusterNetwork": "/host/etc/cni/net.d/10-calico.conflist",
    });
    node.config("00-multus.conf", &serde_json::to_vec(&shim).unwrap());
    node.config("10-calico.conflist", &golden("calico.conflist"));
    fs::create_dir_all(node.conf.join("k8s-pod-network")).unwrap();
    node.config(
        "k8s-pod-network/50-linkerd-cni.conf",
        br#"{"type":"linkerd-cni"}"#,
    );
    let json = assert_reason(&node, "Verified", 0, &[]);
    let copy = node.conf.join("10-calico.conflist").display().to_string();
    assert_eq!(json["delegate"]["file"], copy);
    assert_eq!(
        json["delegate"]["plugins"],
        serde_json::json!(["calico", "portmap", "bandwidth", "linkerd-cni"])
    );
    // An older Multus runs the inline plugins only.
    assert_names(
        &node,
        "ChainedPluginMissing",
        &["--multus-version", "v4.1.4"],
        "does not chain linkerd-cni",
    );
    let (code, err) = check_fails(&node, &["--multus-version", "four"]);
    assert_eq!(
        code,
        Some(2),
        "a release that does not parse is a usage error"
    );
    assert!(
        err.contains("is not `latest` or a release such as v4.2.1"),
        "{err}"
    );
}

/// `check` reads the chain only: what the agent's node verdict also needs for the profiles
/// its `--profile` names (ztunnel for istio-ambient) is listed in `not_judged`, never assumed;
/// with none named the agent requires no node proxy, and nothing is left out.
#[test]
fn check_names_what_it_does_not_judge() {
    let node = Node::new();
    node.config("10-calico.conflist", &golden("calico-linkerd.conflist"));
    let json = assert_reason(&node, "Verified", 0, &["--profile", "istio-ambient"]);
    let listed = json["not_judged"].as_array().expect("not_judged").clone();
    assert_eq!(listed.len(), 1, "{json}");
    let line = listed[0].as_str().unwrap();
    assert!(
        line.starts_with("istio-ambient: whether ztunnel is ready on this node")
            && line.contains("/var/run/ztunnel/ztunnel.sock")
            && line.contains("NodeProxyNotReady"),
        "{line}"
    );
    for none in [&[][..], &["--profile", "linkerd,istio"][..]] {
        let json = assert_reason(&node, "Verified", 0, none);
        assert_eq!(json["not_judged"], serde_json::json!([]), "{none:?}");
    }
    let (code, err) = check_fails(&node, &["--profile", "kuma"]);
    assert_eq!(code, Some(2), "an unknown profile is a usage error");
    assert!(err.contains("kuma"), "{err}");
    let (_, shown) = check_text(&node);
    assert!(!shown.contains("not judged"), "{shown}");
    let out = run_check(&node, &["--profile", "istio-ambient"]);
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains("not judged: istio-ambient: whether ztunnel"),
        "{shown}"
    );
}
