//! What a probed plugin gets from the agent and what it leaves behind: no socket of the
//! agent's is inherited, and without `CAP_SYS_ADMIN` (a non-root `check`, so no PID
//! namespace) nothing the plugin started survives the probe, whether it answered, hung, or
//! left a `setsid`'d daemon with or without the plugin's pipes.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use meshgate_agent::cni::Prober;
use meshgate_agent::netlink::{Bus, Socket};
use meshgate_agent::netns;
use meshgate_core::cni::ProbeOutcome;

mod common;
use common::{GOOD, NOBODY, Node, agent_via, alive, read_pid};
use std::process::Stdio;

/// The reply part of [`GOOD`].
fn answer() -> &'static str {
    GOOD.trim_start_matches("#!/bin/sh\ncat >/dev/null\n")
}

/// The sockets the daemon holds while it inspects pods (rtnetlink, nfnetlink and, as root,
/// a namespace opened with its rules) stay out of the plugins it probes meanwhile.
#[test]
fn a_probed_plugin_inherits_no_socket() {
    let node = Node::new();
    let listing = node.bin.parent().unwrap().join("fds");
    // `ls` lists its own descriptors: what the plugin's shell could pass on.
    node.plugin(
        "lister",
        &format!(
            "#!/bin/sh\ncat >/dev/null\nls -l /proc/self/fd/ > {}\n{}",
            listing.display(),
            answer()
        ),
    );
    let _route = Socket::open(Bus::Route).unwrap();
    let _nft = Socket::open(Bus::Netfilter).unwrap();
    let _opened = nix::unistd::geteuid()
        .is_root()
        .then(|| netns::open(Path::new("/proc/self/ns/net"), true).unwrap());
    let here = fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter(|e| {
            fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
        })
        .count();
    assert!(here >= 2, "the test holds {here} sockets");
    let prober = Prober::new(vec![node.bin.clone()], Duration::from_secs(5));
    let outcome = prober.probe("lister", Instant::now() + Duration::from_secs(10));
    assert!(
        matches!(outcome, ProbeOutcome::Answered { .. }),
        "{outcome:?}"
    );
    let fds = fs::read_to_string(&listing).unwrap();
    assert!(
        !fds.contains("socket:"),
        "the plugin inherited sockets:\n{fds}"
    );
}

/// Runs `check` as nobody (no PID namespace possible) with `script` as linkerd-cni.
fn check_as_nobody(node: &Node, script: &str, timeout: &str) -> (i32, serde_json::Value, Duration) {
    node.plugin("linkerd-cni", script);
    let root = node.bin.parent().unwrap();
    for d in [root, &node.conf, &node.bin] {
        fs::set_permissions(d, fs::Permissions::from_mode(0o777)).unwrap();
    }
    node.check_via(NOBODY, &["--probe-timeout", timeout])
}

#[test]
fn without_cap_sys_admin_nothing_a_plugin_started_survives() {
    if !nix::unistd::geteuid().is_root() || !Path::new("/usr/bin/setpriv").exists() {
        eprintln!("skipped: needs root and setpriv");
        return;
    }
    let node = Node::new();
    node.config(
        "10-calico.conflist",
        &common::golden("calico-linkerd.conflist"),
    );
    let pidfile = node.bin.parent().unwrap().join("escaped.pid");
    // Double fork + setsid: the grandchild is in its own session and process group, and
    // outlives its parent; the plugin goes on once it has recorded its pid.
    let escape = |redirect: &str| {
        format!(
            "( setsid sh -c 'echo $$ > {p}.tmp; mv {p}.tmp {p}; exec sleep 300' {redirect} & )\nwhile [ ! -s {p} ]; do sleep 0.01; done\n",
            p = pidfile.display()
        )
    };
    let daemon = escape("</dev/null >/dev/null 2>&1");
    for (what, script, reason) in [
        // A proper daemon (stdio closed): the plugin's answer counts, and the daemon dies.
        (
            "daemon, answered",
            format!("#!/bin/sh\n{daemon}{}", answer()),
            "Verified",
        ),
        // The same daemon from a plugin that then hangs until the timeout.
        (
            "daemon, hung",
            format!("#!/bin/sh\n{daemon}exec sleep 300\n"),
            "PluginBinaryBroken",
        ),
        // An escapee holding the plugin's stdout/stderr: libcni would wait for it.
        (
            "pipe holder",
            format!("#!/bin/sh\n{}{}", escape(""), answer()),
            "PluginBinaryBroken",
        ),
    ] {
        let _ = fs::remove_file(&pidfile);
        let (_, json, took) = check_as_nobody(&node, &script, "1s");
        assert_eq!(json["reason"], reason, "{what}: {json}");
        assert!(took < Duration::from_secs(3), "{what}: took {took:?}");
        let pid = read_pid(&pidfile);
        assert!(
            !alive(pid),
            "{what}: the setsid grandchild {pid} survived the probe"
        );
    }
}

/// `check` SIGKILLed while its plugin hangs: the plugin dies with it, with a PID namespace
/// (root) and without (nobody).
#[test]
fn a_plugin_dies_with_the_agent_that_probes_it() {
    let node = Node::new();
    node.config(
        "10-calico.conflist",
        &common::golden("calico-linkerd.conflist"),
    );
    let root = node.bin.parent().unwrap().to_path_buf();
    for d in [&root, &node.conf, &node.bin] {
        fs::set_permissions(d, fs::Permissions::from_mode(0o777)).unwrap();
    }
    let pidfile = root.join("plugin.pid");
    // The plugin's host pid (its child reads its own stat from the host's procfs, even in a
    // PID namespace); `exec` keeps it for the sleep.
    node.plugin(
        "calico",
        &format!(
            "#!/bin/sh\nsh -c 'read pid comm state ppid rest < /proc/self/stat; echo $ppid > {p}.tmp; mv {p}.tmp {p}'\nexec sleep 300\n",
            p = pidfile.display()
        ),
    );
    let setpriv = Path::new("/usr/bin/setpriv").exists() && nix::unistd::geteuid().is_root();
    for wrapper in [&[][..], if setpriv { NOBODY } else { &[] }] {
        let _ = fs::remove_file(&pidfile);
        let mut check = agent_via(wrapper)
            .arg("check")
            .arg("--cni-conf-dir")
            .arg(&node.conf)
            .arg("--cni-bin-dir")
            .arg(&node.bin)
            .args(["--require-plugin", "linkerd-cni", "--probe-timeout", "60s"])
            .args(["--verify-timeout", "60s"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let pid = read_pid(&pidfile);
        assert!(alive(pid), "{wrapper:?}: the plugin runs");
        check.kill().unwrap();
        check.wait().unwrap();
        let deadline = Instant::now() + Duration::from_secs(2);
        while alive(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            !alive(pid),
            "{wrapper:?}: the plugin {pid} outlived the agent"
        );
    }
}
