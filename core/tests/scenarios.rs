//! Golden-config tests of the chain verdict: every scenario S1–S8 of the problem statement,
//! the realistic configs of the primary CNIs meshgate runs beside, and the libcni / go-cni /
//! ocicni loading rules of issue 13, each on configs shaped as the peers' installers write
//! them (core/testdata).

mod common;
use common::{Bins, crio, dir, golden, golden_with, missing, opts, run, run_src};
use meshgate_core::cni::listing::SourceError;
use meshgate_core::cni::probe::ReplyError;
use meshgate_core::cni::{Broken, MemSource, ProbeOutcome, Reason, Runtime, VerifyOptions};

#[test]
fn s1_primary_then_mesh_plugin_appended_is_verified() {
    let entries = [("10-calico.conflist", golden("calico-linkerd.conflist"))];
    let mut bins = Bins::healthy();
    let v = run(&entries, &opts(&["linkerd-cni"]), &mut bins);
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert!(v.verified);
    assert_eq!(
        v.config_file.as_deref(),
        Some("/etc/cni/net.d/10-calico.conflist")
    );
    assert_eq!(v.plugins, ["calico", "portmap", "bandwidth", "linkerd-cni"]);
    assert!(
        v.message.contains("/etc/cni/net.d/10-calico.conflist"),
        "{}",
        v.message
    );
    // Every chain binary and the delegated IPAM binary were probed with the list's version.
    let probed: Vec<&str> = bins.calls.iter().map(String::as_str).collect();
    assert_eq!(
        probed,
        [
            "calico",
            "portmap",
            "bandwidth",
            "linkerd-cni",
            "calico-ipam"
        ]
    );
}

#[test]
fn s2_lone_mesh_conf_sorting_first_has_no_primary() {
    let entries = [
        ("01-linkerd-cni.conf", golden("linkerd-only.conf")),
        ("10-calico.conflist", golden("calico.conflist")),
    ];
    let mut bins = Bins::healthy();
    let v = run(&entries, &opts(&["linkerd-cni"]), &mut bins);
    assert_eq!(v.reason, Reason::PrimaryPluginMissing, "{}", v.message);
    assert_eq!(
        v.config_file.as_deref(),
        Some("/etc/cni/net.d/01-linkerd-cni.conf")
    );
    assert!(
        v.message.contains("linkerd-cni is plugin #1") && v.message.contains("first in the chain"),
        "{}",
        v.message
    );
    assert!(
        bins.calls.is_empty(),
        "no binary is run before the structure is right"
    );
}

#[test]
fn primary_missing_when_only_meta_plugins_precede() {
    let conf = br#"{"cniVersion":"0.3.1","name":"n","plugins":[{"type":"portmap"},{"type":"linkerd-cni"},{"type":"calico"}]}"#;
    let v = run(
        &[("10.conflist", conf.to_vec())],
        &opts(&["linkerd-cni"]),
        &mut Bins::healthy(),
    );
    assert_eq!(v.reason, Reason::PrimaryPluginMissing);
    assert!(
        v.message
            .contains("only interface-less plugins (#1 to #1) run before it"),
        "{}",
        v.message
    );
}

#[test]
fn s3_s4_primary_without_mesh_plugin_is_chained_plugin_missing() {
    let entries = [("10-calico.conflist", golden("calico.conflist"))];
    let mut bins = Bins::healthy();
    let v = run(&entries, &opts(&["linkerd-cni"]), &mut bins);
    assert_eq!(v.reason, Reason::ChainedPluginMissing);
    assert!(!v.verified);
    assert!(
        v.message.contains("10-calico.conflist")
            && v.message.contains("does not chain linkerd-cni"),
        "{}",
        v.message
    );
    assert!(bins.calls.is_empty());
}

#[test]
fn s6_multus_sorting_first_is_the_effective_file() {
    let entries = [
        ("00-multus.conf", golden("multus.conf")),
        ("02-istio-cni.conflist", golden("istio-cni.conflist")),
    ];
    let v = run(&entries, &opts(&["istio-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ChainedPluginMissing);
    assert_eq!(
        v.config_file.as_deref(),
        Some("/etc/cni/net.d/00-multus.conf")
    );
    assert_eq!(v.plugins, ["multus"]);
    // Without multus in front, the mesh-owned file verifies.
    let v = run(&entries[1..], &opts(&["istio-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
}

#[test]
fn s7_binary_missing_empty_hanging_or_too_old() {
    let entries = [("10-calico.conflist", golden("calico-linkerd.conflist"))];
    let o = opts(&["linkerd-cni"]);
    let cases = [
        (
            ProbeOutcome::Missing {
                searched: vec!["/opt/cni/bin".into()],
            },
            Reason::PluginBinaryMissing,
            "no regular file of that name in the CNI bin dirs (/opt/cni/bin)",
            false,
        ),
        (
            ProbeOutcome::Broken {
                path: "/opt/cni/bin/linkerd-cni".into(),
                why: Broken::Empty,
            },
            Reason::PluginBinaryBroken,
            "its binary is empty",
            false,
        ),
        (
            ProbeOutcome::Broken {
                path: "/opt/cni/bin/linkerd-cni".into(),
                why: Broken::TimedOut { after_ms: 2000 },
            },
            Reason::PluginBinaryBroken,
            "within 2000 ms",
            true,
        ),
        (
            ProbeOutcome::Broken {
                path: "/opt/cni/bin/linkerd-cni".into(),
                why: Broken::CannotStart("Text file busy (os error 26)".into()),
            },
            Reason::PluginBinaryBroken,
            "cannot be executed: Text file busy",
            true,
        ),
        (
            ProbeOutcome::Answered {
                path: "/opt/cni/bin/linkerd-cni".into(),
                supported: vec!["0.1.0".into(), "0.2.0".into()],
            },
            Reason::PluginBinaryBroken,
            "does not list the list's cniVersion (2 versions listed)",
            false,
        ),
    ];
    for (outcome, reason, text, transient) in cases {
        let mut bins = Bins::healthy().with("linkerd-cni", outcome);
        let v = run(&entries, &o, &mut bins);
        assert_eq!(v.reason, reason, "{}", v.message);
        // A timeout or a failed start may pass by itself: the agent verifies again soon.
        assert_eq!(v.transient, transient, "{}", v.message);
        assert!(v.message.contains(text), "{:?} lacks {text:?}", v.message);
        assert!(
            v.message.contains(
                "/etc/cni/net.d/10-calico.conflist: plugin #4 (the required linkerd-cni)"
            ),
            "{}",
            v.message
        );
    }
}

#[test]
fn ipam_binary_is_required_too() {
    let entries = [("10-calico.conflist", golden("calico-linkerd.conflist"))];
    let mut bins = Bins::healthy().with(
        "calico-ipam",
        ProbeOutcome::Missing {
            searched: vec!["/opt/cni/bin".into()],
        },
    );
    let v = run(&entries, &opts(&["linkerd-cni"]), &mut bins);
    assert_eq!(v.reason, Reason::PluginBinaryMissing);
    assert!(
        v.message
            .contains("the IPAM plugin of plugin #1: no regular file"),
        "{}",
        v.message
    );
}

#[test]
fn several_binary_problems_report_the_first_in_chain_order() {
    let entries = [("10-calico.conflist", golden("calico-linkerd.conflist"))];
    let mut bins = Bins::healthy()
        .with(
            "linkerd-cni",
            ProbeOutcome::Missing {
                searched: vec!["/opt/cni/bin".into()],
            },
        )
        .with(
            "portmap",
            ProbeOutcome::Broken {
                path: "/opt/cni/bin/portmap".into(),
                why: Broken::NotExecutable,
            },
        );
    let v = run(&entries, &opts(&["linkerd-cni"]), &mut bins);
    assert_eq!(v.reason, Reason::PluginBinaryBroken);
    assert!(
        v.message
            .contains("plugin #2: its binary is not executable")
            && v.message.contains("and 1 more"),
        "{}",
        v.message
    );
}

#[test]
fn s8_truncated_first_file_containerd_vs_crio() {
    let full = golden("calico-linkerd.conflist");
    let entries = [
        ("05-partial.conflist", full[..full.len() / 2].to_vec()),
        ("10-calico.conflist", full.clone()),
    ];
    let v = run(&entries, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ConfigInvalid);
    assert_eq!(
        v.config_file.as_deref(),
        Some("/etc/cni/net.d/05-partial.conflist")
    );
    assert!(v.message.contains("is not valid JSON"), "{}", v.message);

    let crio = crio(&["linkerd-cni"]);
    let v = run(&entries, &crio, &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert_eq!(
        v.config_file.as_deref(),
        Some("/etc/cni/net.d/10-calico.conflist")
    );
    assert!(
        v.message
            .contains("CRI-O skips the earlier 05-partial.conflist"),
        "{}",
        v.message
    );
    assert_eq!(v.runtime, Runtime::Crio);

    // CRI-O with nothing loadable at all is still ConfigInvalid, not NoConfig.
    let v = run(&entries[..1], &crio, &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ConfigInvalid);
}

#[test]
fn no_config_ignores_directories_and_other_extensions() {
    let entries = [
        ("10-calico.conflist.bak", golden("calico.conflist")),
        ("calico-kubeconfig", b"apiVersion: v1".to_vec()),
    ];
    let mut src = dir(&entries).dir("multus.d").dir("20-dir.conflist");
    let v = run_src(&mut src, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::NoConfig);
    assert_eq!(v.config_file, None);
    assert!(v.message.contains("/etc/cni/net.d"), "{}", v.message);
}

#[test]
fn sort_is_bytewise_and_json_counts() {
    // "0" (0x30) sorts before "1", and uppercase before lowercase, as Go's sort.Strings.
    let entries = [
        ("a.json", golden("cilium.conflist")),
        ("Z.conflist", golden("calico-linkerd.conflist")),
    ];
    let v = run(&entries, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.config_file.as_deref(), Some("/etc/cni/net.d/Z.conflist"));
    assert_eq!(v.reason, Reason::Verified);
}

#[test]
fn hostile_entries_are_config_invalid_not_crashes() {
    let o = opts(&["linkerd-cni"]);
    let cases = [
        (
            SourceError::Undecidable("it is 1073741824 bytes, over the 1048576-byte limit".into()),
            "cannot be verified: it is 1073741824 bytes",
        ),
        (
            SourceError::Undecidable("it is a FIFO or device".into()),
            "cannot be verified: it is a FIFO",
        ),
        (
            SourceError::Io("Too many levels of symbolic links (os error 40)".into()),
            "symbolic links",
        ),
    ];
    for (e, text) in cases {
        let mut src = MemSource::new()
            .file("00-bad.conflist", Vec::new())
            .failing("00-bad.conflist", e);
        let v = run_src(&mut src, &o, &mut Bins::healthy());
        assert_eq!(v.reason, Reason::ConfigInvalid);
        assert!(v.message.contains(text), "{:?} lacks {text:?}", v.message);
    }
    for (bytes, text) in [
        (vec![0xff, 0xfe, 0x00], "is not valid JSON"),
        (br#"{"name":"x","plugins":[]}"#.to_vec(), "empty"),
    ] {
        let v = run(&[("00-bad.conflist", bytes)], &o, &mut Bins::healthy());
        assert_eq!(v.reason, Reason::ConfigInvalid);
        assert!(v.message.contains(text), "{:?} lacks {text:?}", v.message);
    }
}

#[test]
fn realistic_primaries_verify_alone_and_lack_the_mesh_plugin() {
    for (file, chain) in [
        ("calico.conflist", vec!["calico", "portmap", "bandwidth"]),
        ("cilium.conflist", vec!["cilium-cni"]),
        ("flannel.conflist", vec!["flannel", "portmap"]),
        (
            "aws-vpc-cni.conflist",
            vec!["aws-cni", "egress-cni", "portmap"],
        ),
    ] {
        let name = format!("10-{file}");
        let entries = [(name.as_str(), golden(file))];
        let v = run(&entries, &opts(&[]), &mut Bins::healthy());
        assert_eq!(v.reason, Reason::Verified, "{file}: {}", v.message);
        assert_eq!(v.plugins, chain, "{file}");
        let v = run(&entries, &opts(&["linkerd-cni"]), &mut Bins::healthy());
        assert_eq!(v.reason, Reason::ChainedPluginMissing, "{file}");
    }
}

#[test]
fn istio_owned_config_verifies_with_cni_1_0() {
    let entries = [("02-istio-cni.conflist", golden("istio-cni.conflist"))];
    let mut bins = Bins::healthy();
    let v = run(&entries, &opts(&["istio-cni"]), &mut bins);
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert!(
        v.message.contains("supporting the list's cniVersion"),
        "{}",
        v.message
    );
}

#[test]
fn cni_1_1_drop_in_plugins_are_appended() {
    let dropin = br#"{"type":"linkerd-cni","linkerd":{"incoming-proxy-port":4143}}"#;
    let base = || {
        MemSource::new()
            .file("10-calico.conflist", golden("calico.conflist"))
            .file("k8s-pod-network/50-linkerd.conf", dropin.to_vec())
            .file("k8s-pod-network/README", b"not a plugin".to_vec())
    };
    let v = run_src(&mut base(), &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert_eq!(v.plugins.last().map(String::as_str), Some("linkerd-cni"));
    assert!(
        v.message.contains("1 from drop-in file 50-linkerd.conf"),
        "{}",
        v.message
    );

    // loadOnlyInlinedPlugins turns the drop-in directory off.
    let only = golden_with(
        "calico.conflist",
        "\"cniVersion\"",
        "\"loadOnlyInlinedPlugins\": true, \"cniVersion\"",
    );
    let mut src = base().file("10-calico.conflist", only);
    let v = run_src(&mut src, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ChainedPluginMissing);

    // A broken drop-in file breaks the whole network, as in libcni.
    let mut bad = base().file("k8s-pod-network/50-linkerd.conf", b"{".to_vec());
    let v = run_src(&mut bad, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ConfigInvalid);
    assert!(
        v.message
            .contains("drop-in plugin file #1 (50-linkerd.conf) is not valid JSON"),
        "{}",
        v.message
    );

    // A conflist without inline plugins, made only of drop-ins.
    let bare = br#"{"cniVersion":"1.1.0","name":"net"}"#;
    let mut src = MemSource::new()
        .file("10-net.conflist", bare.to_vec())
        .file("net/10-calico.conf", br#"{"type":"calico"}"#.to_vec())
        .file("net/20-linkerd.conf", dropin.to_vec());
    let v = run_src(&mut src, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    let v = run(
        &[("10-net.conflist", bare.to_vec())],
        &opts(&["linkerd-cni"]),
        &mut Bins::healthy(),
    );
    assert_eq!(v.reason, Reason::ConfigInvalid);
    assert!(v.message.contains("has no plugins"), "{}", v.message);
}

#[test]
fn verdict_json_matches_the_contract_shape() {
    let entries = [("10-calico.conflist", golden("calico.conflist"))];
    let v = run(&entries, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    let json = serde_json::to_value(&v).unwrap();
    let keys: Vec<&str> = json
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        [
            "verified",
            "reason",
            "message",
            "config_file",
            "plugins",
            "runtime"
        ]
    );
    assert_eq!(json["reason"], "ChainedPluginMissing");
    assert_eq!(json["runtime"], "containerd");
    assert_eq!(json["verified"], false);
}

// ---------------------------------------------------------------------------------------
// Issue 13: effective config must be runtime-exact.
// ---------------------------------------------------------------------------------------

#[test]
fn symlink_to_a_directory_is_a_candidate_that_fails_to_load() {
    // libcni's ConfFiles decides "directory" from the dirent, without following the link:
    // `00-backup.conflist -> /some/dir` is a candidate, and reading it fails with EISDIR.
    let mut src = MemSource::new()
        .symlink_dir("00-backup.conflist", "backup")
        .file("backup/old.conf", golden("linkerd-only.conf"))
        .file("10-calico.conflist", golden("calico-linkerd.conflist"));
    let v = run_src(&mut src, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ConfigInvalid, "{}", v.message);
    assert_eq!(
        v.config_file.as_deref(),
        Some("/etc/cni/net.d/00-backup.conflist")
    );
    assert!(v.message.contains("is a directory"), "{}", v.message);
    // containerd stops at the first file: the valid one behind it is never read.
    assert_eq!(src.reads, vec![b"00-backup.conflist".to_vec()]);
    // CRI-O skips it and loads the next.
    let v = run_src(&mut src, &crio(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert!(
        v.message
            .contains("CRI-O skips the earlier 00-backup.conflist"),
        "{}",
        v.message
    );
}

#[test]
fn crio_skips_lists_that_fail_validate_network_list() {
    let files = [
        ("10-calico.conflist", golden("calico-linkerd.conflist")),
        ("20-calico.conflist", golden("calico.conflist")),
    ];
    a_missing_mesh_binary_skips_the_list(&files);
    bad_replies_skip_the_list(&files);
    only_the_chain_is_validated(&files);
    a_timeout_never_skips(&files);
}

/// The mesh plugin's binary is missing: CRI-O skips the list, containerd does not.
fn a_missing_mesh_binary_skips_the_list(files: &[(&str, Vec<u8>)]) {
    // The mesh plugin's binary is missing: ocicni skips the first list, so the effective
    // one is the second, which does not chain the mesh plugin.
    let v = run(
        files,
        &crio(&["linkerd-cni"]),
        &mut Bins::healthy().with("linkerd-cni", missing()),
    );
    assert_eq!(v.reason, Reason::ChainedPluginMissing, "{}", v.message);
    assert_eq!(
        v.config_file.as_deref(),
        Some("/etc/cni/net.d/20-calico.conflist")
    );
    // containerd does not validate: the first list is effective and its binary is missing.
    let v = run(
        files,
        &opts(&["linkerd-cni"]),
        &mut Bins::healthy().with("linkerd-cni", missing()),
    );
    assert_eq!(v.reason, Reason::PluginBinaryMissing, "{}", v.message);
}

/// A bad VERSION reply and an unsupported cniVersion are skips too.
fn bad_replies_skip_the_list(files: &[(&str, Vec<u8>)]) {
    for outcome in [
        ProbeOutcome::Broken {
            path: "/opt/cni/bin/linkerd-cni".into(),
            why: Broken::BadReply {
                why: ReplyError::NoCniVersion,
                len: 30,
            },
        },
        ProbeOutcome::Answered {
            path: "/opt/cni/bin/linkerd-cni".into(),
            supported: vec!["1.0.0".into()],
        },
    ] {
        let v = run(
            files,
            &crio(&["linkerd-cni"]),
            &mut Bins::healthy().with("linkerd-cni", outcome),
        );
        assert_eq!(v.reason, Reason::ChainedPluginMissing, "{}", v.message);
    }
}

/// Only the chain is validated, not the IPAM plugin; when no list validates, the first
/// skip's reason is the verdict.
fn only_the_chain_is_validated(files: &[(&str, Vec<u8>)]) {
    // Only the chain is validated by ocicni, not the IPAM plugin: the list stays effective.
    let v = run(
        files,
        &crio(&["linkerd-cni"]),
        &mut Bins::healthy().with("calico-ipam", missing()),
    );
    assert_eq!(
        v.config_file.as_deref(),
        Some("/etc/cni/net.d/10-calico.conflist")
    );
    assert_eq!(v.reason, Reason::PluginBinaryMissing, "{}", v.message);
    // Nothing validates: the first skip's reason is the verdict.
    let v = run(
        &files[..1],
        &crio(&["linkerd-cni"]),
        &mut Bins::healthy().with("linkerd-cni", missing()),
    );
    assert_eq!(v.reason, Reason::PluginBinaryMissing, "{}", v.message);
    assert!(
        v.message.contains("fails CRI-O's ValidateNetworkList"),
        "{}",
        v.message
    );
}

/// A plugin that runs out of time cannot be judged: stop, never skip to a later file.
fn a_timeout_never_skips(files: &[(&str, Vec<u8>)]) {
    let slow = ProbeOutcome::Broken {
        path: "/opt/cni/bin/linkerd-cni".into(),
        why: Broken::TimedOut { after_ms: 2000 },
    };
    let v = run(
        files,
        &crio(&["linkerd-cni"]),
        &mut Bins::healthy().with("linkerd-cni", slow),
    );
    assert_eq!(v.reason, Reason::PluginBinaryBroken, "{}", v.message);
    assert!(v.transient, "{}", v.message);
    assert_eq!(
        v.config_file.as_deref(),
        Some("/etc/cni/net.d/10-calico.conflist")
    );
}

/// A primary plugin that cannot be started for a moment (`ETXTBSY` while its installer
/// rewrites it in place, a failed fork) says nothing about what CRI-O will do: the first list,
/// which lacks the mesh plugin, must not be skipped in favour of a later one that has it.
#[test]
fn crio_never_skips_a_list_on_a_plugin_that_could_not_be_started() {
    // The later list has another primary, so only the first depends on the busy binary.
    let flannel_linkerd = br#"{"cniVersion": "0.3.1", "name": "cbr0", "plugins": [
        {"type": "flannel", "delegate": {"isDefaultGateway": true}}, {"type": "linkerd-cni"}]}"#;
    let files = [
        ("10-calico.conflist", golden("calico.conflist")),
        ("20-flannel.conflist", flannel_linkerd.to_vec()),
    ];
    let busy = ProbeOutcome::Broken {
        path: "/opt/cni/bin/calico".into(),
        why: Broken::CannotStart("Text file busy (os error 26)".into()),
    };
    let v = run(
        &files,
        &crio(&["linkerd-cni"]),
        &mut Bins::healthy().with("calico", busy),
    );
    assert!(!v.verified, "{}", v.message);
    assert_eq!(v.reason, Reason::PluginBinaryBroken, "{}", v.message);
    assert_eq!(
        v.config_file.as_deref(),
        Some("/etc/cni/net.d/10-calico.conflist")
    );
}

#[test]
fn wrong_value_types_are_load_errors() {
    for (from, to) in [
        (
            "\"capabilities\": { \"portMappings\": true }",
            "\"capabilities\": { \"portMappings\": \"true\" }",
        ),
        (
            "\"ipam\": { \"type\": \"calico-ipam\" }",
            "\"ipam\": \"calico-ipam\"",
        ),
        ("\"name\": \"linkerd-cni\"", "\"name\": 7"),
    ] {
        let bad = golden_with("calico-linkerd.conflist", from, to);
        let files = [
            ("10-calico.conflist", bad),
            ("20-calico.conflist", golden("calico-linkerd.conflist")),
        ];
        let v = run(&files, &opts(&["linkerd-cni"]), &mut Bins::healthy());
        assert_eq!(v.reason, Reason::ConfigInvalid, "{to}: {}", v.message);
        assert!(v.message.contains("wrong JSON type"), "{}", v.message);
        let v = run(&files, &crio(&["linkerd-cni"]), &mut Bins::healthy());
        assert_eq!(
            v.config_file.as_deref(),
            Some("/etc/cni/net.d/20-calico.conflist"),
            "{to}"
        );
    }
    let dns = golden_with(
        "linkerd-only.conf",
        "\"log_level\"",
        "\"dns\": \"10.96.0.10\", \"log_level\"",
    );
    let v = run(
        &[("05-linkerd.conf", dns)],
        &opts(&["linkerd-cni"]),
        &mut Bins::healthy(),
    );
    assert_eq!(v.reason, Reason::ConfigInvalid, "{}", v.message);
}

#[test]
fn cni_versions_parse_or_fail_like_libcni() {
    let bad = golden_with(
        "istio-cni.conflist",
        "\"cniVersion\": \"1.0.0\"",
        "\"cniVersion\": \"1.0.0\", \"cniVersions\": [\"v1.0.0\"]",
    );
    let v = run(
        &[("02-istio.conflist", bad)],
        &opts(&["istio-cni"]),
        &mut Bins::healthy(),
    );
    assert_eq!(v.reason, Reason::ConfigInvalid, "{}", v.message);
    assert!(v.message.contains("cniVersions entry #1"), "{}", v.message);
    let major = golden_with(
        "istio-cni.conflist",
        "\"cniVersion\": \"1.0.0\"",
        "\"cniVersion\": \"1.0.0\", \"cniVersions\": [\"1\", \"1.1.0\"]",
    );
    let v = run(
        &[("02-istio.conflist", major)],
        &opts(&["istio-cni"]),
        &mut Bins::healthy(),
    );
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
}

#[test]
fn go_field_names_and_encoding() {
    // `"Type"` selects the type field (Go matches case-insensitively), invalid UTF-8 in a
    // string is accepted, U+212A KELVIN SIGN folds to k.
    let folded = golden_with(
        "istio-cni.conflist",
        "\"type\": \"istio-cni\"",
        "\"Type\": \"istio-cni\"",
    );
    let v = run(
        &[("02-istio.conflist", folded)],
        &opts(&["istio-cni"]),
        &mut Bins::healthy(),
    );
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    let mut bytes = golden_with(
        "istio-cni.conflist",
        "\"log_level\": \"info\"",
        "\"log_level\": \"in@fo\"",
    );
    let at = bytes.iter().position(|&b| b == b'@').unwrap();
    bytes[at] = 0xff;
    let v = run(
        &[("02-istio.conflist", bytes)],
        &opts(&["istio-cni"]),
        &mut Bins::healthy(),
    );
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    // U+017F LONG S folds to s: "capabilitieſ" is the typed capabilities field, so a
    // string value there is a load error; "capabilitieš" is no field at all.
    let long_s = golden_with(
        "calico-linkerd.conflist",
        "\"capabilities\": { \"portMappings\": true }",
        "\"capabilitie\u{017F}\": { \"portMappings\": \"yes\" }",
    );
    let v = run(
        &[("10-calico.conflist", long_s)],
        &opts(&["linkerd-cni"]),
        &mut Bins::healthy(),
    );
    assert_eq!(v.reason, Reason::ConfigInvalid, "{}", v.message);
    let other = golden_with(
        "calico-linkerd.conflist",
        "\"capabilities\": { \"portMappings\": true }",
        "\"capabilitie\u{0161}\": { \"portMappings\": \"yes\" }",
    );
    let v = run(
        &[("10-calico.conflist", other)],
        &opts(&["linkerd-cni"]),
        &mut Bins::healthy(),
    );
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    // Kelvin sign: "\u{212A}" is not in any field name here, but "nameſ" is not "name" either.
    assert!(meshgate_core::cni::gojson::field_matches("\u{212A}", "k"));
}

#[test]
fn drop_in_directory_rules() {
    // A regular file at <dir>/<network name> makes the whole list fail (ENOTDIR).
    let mut src = MemSource::new()
        .file("10-calico.conflist", golden("calico-linkerd.conflist"))
        .file("k8s-pod-network", b"left over".to_vec());
    let v = run_src(&mut src, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ConfigInvalid, "{}", v.message);
    assert!(
        v.message
            .contains("drop-in plugin directory cannot be listed"),
        "{}",
        v.message
    );
    // An empty network name makes the conf dir itself the drop-in dir: its .conf files are
    // appended as plugins (here the mesh plugin's own .conf).
    let unnamed = golden_with(
        "calico.conflist",
        "\"name\": \"k8s-pod-network\"",
        "\"name\": \"\"",
    );
    let mut src = MemSource::new()
        .file("10-calico.conflist", unnamed)
        .file("99-linkerd.conf", golden("linkerd-only.conf"));
    let v = run_src(&mut src, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert_eq!(v.plugins.last().map(String::as_str), Some("linkerd-cni"));
    // A symlink to a directory inside the drop-in dir is read, and fails (EISDIR).
    let mut src = MemSource::new()
        .file("10-calico.conflist", golden("calico.conflist"))
        .file(
            "k8s-pod-network/50-linkerd.conf",
            golden("linkerd-only.conf"),
        )
        .symlink_dir("k8s-pod-network/60-x.conf", "elsewhere")
        .dir("elsewhere");
    let v = run_src(&mut src, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ConfigInvalid, "{}", v.message);
}

#[test]
fn version_checks_follow_libcni() {
    // An empty cniVersion is checked as 0.1.0 (validatePlugin).
    let unversioned = golden_with("calico-linkerd.conflist", "\"cniVersion\": \"0.3.1\",", "");
    let files = [("10-calico.conflist", unversioned)];
    let old = |v: &[&str]| ProbeOutcome::Answered {
        path: "/opt/cni/bin/x".into(),
        supported: v.iter().map(|s| s.to_string()).collect(),
    };
    let mut bins = Bins::healthy();
    for t in [
        "calico",
        "portmap",
        "bandwidth",
        "linkerd-cni",
        "calico-ipam",
    ] {
        bins = bins.with(t, old(&["0.1.0", "0.2.0"]));
    }
    let v = run(&files, &opts(&["linkerd-cni"]), &mut bins);
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    let v = run(&files, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::PluginBinaryBroken, "{}", v.message);
}

#[test]
fn file_names_sort_as_raw_bytes() {
    // 0xE0 sorts before 0xEF: the non-UTF-8 name is first. Lossy conversion would turn it
    // into U+FFFD (EF BF BD) and sort it after the other one.
    let mut src = MemSource::new()
        .file(b"\xe0-b.conflist", golden("calico.conflist"))
        .file("\u{FFFD}-a.conflist", golden("calico-linkerd.conflist"));
    let v = run_src(&mut src, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ChainedPluginMissing, "{}", v.message);
    assert_eq!(src.reads, vec![b"\xe0-b.conflist".to_vec()]);
}

#[test]
fn ipam_type_path_traversal_is_never_probed() {
    for evil in ["../../usr/bin/python3", "/bin/sh", "..", "sub/dir"] {
        let bad = golden_with(
            "calico-linkerd.conflist",
            "\"type\": \"calico-ipam\"",
            &format!("\"type\": \"{evil}\""),
        );
        let mut bins = Bins::healthy();
        let v = run(
            &[("10-calico.conflist", bad)],
            &opts(&["linkerd-cni"]),
            &mut bins,
        );
        assert_eq!(
            v.reason,
            Reason::PluginBinaryMissing,
            "{evil}: {}",
            v.message
        );
        assert!(
            v.message.contains("the IPAM plugin of plugin #1"),
            "{}",
            v.message
        );
        assert!(v.message.contains("CVE-2021-20206"), "{}", v.message);
        assert!(!v.message.contains(evil), "{}", v.message);
        assert!(bins.calls.iter().all(|c| c != evil), "{:?}", bins.calls);
    }
    // The same for `type` itself.
    let bad = golden_with(
        "calico-linkerd.conflist",
        "\"type\": \"portmap\"",
        "\"type\": \"../portmap\"",
    );
    let mut bins = Bins::healthy();
    let v = run(
        &[("10-calico.conflist", bad)],
        &opts(&["linkerd-cni"]),
        &mut bins,
    );
    assert_eq!(v.reason, Reason::PluginBinaryMissing, "{}", v.message);
    assert!(bins.calls.iter().all(|c| !c.contains('/')));
}

/// A marker in file content and plugin output that no message may quote.
const S: &str = "SECRETzz";

#[test]
fn messages_never_quote_file_content_or_plugin_output() {
    for (files, o) in secret_cases() {
        let v = run(&files, &o, &mut secret_bins());
        assert!(!v.message.contains(S), "{:?}: {}", v.reason, v.message);
    }
    // A drop-in directory named by the network name: neither is quoted.
    let mut src = MemSource::new()
        .file("10.conflist", format!(r#"{{"name":"{S}"}}"#).into_bytes())
        .file(
            format!("{S}/50.conf"),
            format!(r#"{{"type":{{"{S}":1}}}}"#).into_bytes(),
        );
    let v = run_src(&mut src, &opts(&[]), &mut secret_bins());
    assert_eq!(v.reason, Reason::ConfigInvalid);
    assert!(!v.message.contains(S), "{}", v.message);
}

/// A plugin named by the marker that fails with a CNI error.
fn secret_bins() -> Bins {
    Bins::healthy().with(
        S,
        ProbeOutcome::Broken {
            path: format!("/opt/cni/bin/{S}"),
            why: Broken::Failed {
                status: "exit status: 1".into(),
                cni_code: Some(7),
                stdout_len: 40,
                stderr_len: 12,
            },
        },
    )
}

/// Files and options whose every field a message might quote holds the marker: (files,
/// options).
type Case = (Vec<(&'static str, Vec<u8>)>, VerifyOptions);

/// Configs whose names, versions, types, capabilities and plugin names are the marker, valid
/// and not.
fn secret_cases() -> Vec<Case> {
    let secret_list = format!(
        r#"{{"cniVersion":"{S}","name":"{S}","plugins":[{{"type":"{S}","ipam":{{"type":"{S}2"}}}},{{"type":"linkerd-cni","capabilities":{{"{S}":true}}}}]}}"#
    );
    vec![
        (
            vec![("10.conflist", secret_list.clone().into_bytes())],
            opts(&["linkerd-cni"]),
        ),
        (
            vec![("10.conflist", secret_list.clone().into_bytes())],
            crio(&["linkerd-cni"]),
        ),
        (
            vec![(
                "10.conflist",
                secret_list.replace("linkerd-cni", S).into_bytes(),
            )],
            opts(&["linkerd-cni"]),
        ),
        (
            vec![(
                "10.conflist",
                format!(r#"{{"name":"{S}","plugins":[{{"type":"{S}","capabilities":"{S}"}}]}}"#)
                    .into_bytes(),
            )],
            opts(&[]),
        ),
        (
            vec![(
                "10.conflist",
                format!(r#"{{"name":"{S}","cniVersions":["{S}"]}}"#).into_bytes(),
            )],
            opts(&[]),
        ),
        (
            vec![(
                "10.conflist",
                format!(r#"{{"name":"{S}","plugins":[{{"type":"{S}"}}]"#).into_bytes(),
            )],
            opts(&[]),
        ),
        (
            vec![(
                "10.conflist",
                format!(r#"{{"name":"{S}","plugins":[{{"type":"linkerd-cni"}}]}}"#).into_bytes(),
            )],
            opts(&["linkerd-cni"]),
        ),
        (
            vec![(
                "10.conf",
                format!(r#"{{"name":"{S}","type":"{S}","cniVersion":"{S}"}}"#).into_bytes(),
            )],
            opts(&[]),
        ),
    ]
}

#[test]
fn crio_reads_only_as_far_as_the_first_valid_file() {
    let mut src = MemSource::new()
        .file("05-partial.conflist", b"{\"name\":".to_vec())
        .file("10-calico.conflist", golden("calico-linkerd.conflist"))
        .file("20-never.conflist", golden("calico.conflist"))
        .file("30-never.conf", golden("linkerd-only.conf"));
    let v = run_src(&mut src, &crio(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    let reads: Vec<String> = src
        .reads
        .iter()
        .map(|r| String::from_utf8_lossy(r).into_owned())
        .collect();
    assert_eq!(reads, ["05-partial.conflist", "10-calico.conflist"]);
}

#[test]
fn long_name_lists_are_capped_in_messages() {
    let mut src = (0..8).fold(MemSource::new().dir("d"), |s, i| {
        s.symlink_dir(format!("0{i}-dir.conflist"), "d")
    });
    src = src.file("50-calico.conflist", golden("calico-linkerd.conflist"));
    let v = run_src(&mut src, &crio(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert!(
        v.message.contains("04-dir.conflist, and 3 more"),
        "{}",
        v.message
    );
    assert!(!v.message.contains("05-dir"), "{}", v.message);
}

#[test]
fn containerd_never_reads_a_second_file() {
    // go-cni loadFromConfDir with max_conf_num = 1 breaks out of the loop after the first
    // network loads: a broken file sorting second is never read, and does not matter.
    let mut src = MemSource::new()
        .file("10-calico.conflist", golden("calico-linkerd.conflist"))
        .file("20-broken.conflist", b"{".to_vec())
        .file("30-fifo.conf", Vec::new())
        .failing("30-fifo.conf", SourceError::Undecidable("a FIFO".into()));
    let v = run_src(&mut src, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert_eq!(src.reads, vec![b"10-calico.conflist".to_vec()]);
}
