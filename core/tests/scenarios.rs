//! Golden-config tests of the chain verdict: every scenario S1–S8 of the problem statement,
//! and the realistic configs of the primary CNIs meshgate runs beside.

use std::collections::BTreeMap;

use meshgate_core::cni::{
    Broken, DirEntry, EntryKind, ProbeOutcome, Reason, Runtime, Verdict, VerifyOptions, verify,
};

fn golden(name: &str) -> Vec<u8> {
    let path = format!("{}/testdata/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn opts(required: &[&str]) -> VerifyOptions {
    VerifyOptions {
        conf_dir: "/etc/cni/net.d".into(),
        runtime: Runtime::Containerd,
        required: required.iter().map(|s| s.to_string()).collect(),
    }
}

/// A probe that answers like a healthy binary supporting the usual versions, except for the
/// types given special outcomes.
struct Bins {
    special: BTreeMap<&'static str, ProbeOutcome>,
    calls: Vec<(String, String)>,
}

impl Bins {
    fn healthy() -> Self {
        Self {
            special: BTreeMap::new(),
            calls: Vec::new(),
        }
    }
    fn with(mut self, t: &'static str, o: ProbeOutcome) -> Self {
        self.special.insert(t, o);
        self
    }
    fn probe(&mut self, t: &str, version: &str) -> ProbeOutcome {
        self.calls.push((t.to_string(), version.to_string()));
        self.special
            .get(t)
            .cloned()
            .unwrap_or_else(|| ProbeOutcome::Answered {
                path: format!("/opt/cni/bin/{t}"),
                supported: ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
                    .map(String::from)
                    .to_vec(),
            })
    }
}

fn run(entries: &[DirEntry], o: &VerifyOptions, bins: &mut Bins) -> Verdict {
    verify(entries, o, |t, v| bins.probe(t, v))
}

#[test]
fn s1_primary_then_mesh_plugin_appended_is_verified() {
    let entries = [DirEntry::file(
        "10-calico.conflist",
        golden("calico-linkerd.conflist"),
    )];
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
    let probed: Vec<&str> = bins.calls.iter().map(|(t, _)| t.as_str()).collect();
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
    assert!(bins.calls.iter().all(|(_, v)| v == "0.3.1"));
}

#[test]
fn s2_lone_mesh_conf_sorting_first_has_no_primary() {
    let entries = [
        DirEntry::file("01-linkerd-cni.conf", golden("linkerd-only.conf")),
        DirEntry::file("10-calico.conflist", golden("calico.conflist")),
    ];
    let mut bins = Bins::healthy();
    let v = run(&entries, &opts(&["linkerd-cni"]), &mut bins);
    assert_eq!(v.reason, Reason::PrimaryPluginMissing, "{}", v.message);
    assert_eq!(
        v.config_file.as_deref(),
        Some("/etc/cni/net.d/01-linkerd-cni.conf")
    );
    assert!(
        v.message.contains("linkerd-cni") && v.message.contains("first in the chain"),
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
        &[DirEntry::file("10.conflist", conf.to_vec())],
        &opts(&["linkerd-cni"]),
        &mut Bins::healthy(),
    );
    assert_eq!(v.reason, Reason::PrimaryPluginMissing);
    assert!(
        v.message.contains("only portmap run before it"),
        "{}",
        v.message
    );
}

#[test]
fn s3_s4_primary_without_mesh_plugin_is_chained_plugin_missing() {
    let entries = [DirEntry::file(
        "10-calico.conflist",
        golden("calico.conflist"),
    )];
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
        DirEntry::file("00-multus.conf", golden("multus.conf")),
        DirEntry::file("02-istio-cni.conflist", golden("istio-cni.conflist")),
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
    let entries = [DirEntry::file(
        "10-calico.conflist",
        golden("calico-linkerd.conflist"),
    )];
    let o = opts(&["linkerd-cni"]);
    let cases = [
        (
            ProbeOutcome::Missing {
                searched: vec!["/opt/cni/bin".into()],
            },
            Reason::PluginBinaryMissing,
            "no binary named linkerd-cni in /opt/cni/bin",
        ),
        (
            ProbeOutcome::Broken {
                path: "/opt/cni/bin/linkerd-cni".into(),
                why: Broken::Empty,
            },
            Reason::PluginBinaryBroken,
            "/opt/cni/bin/linkerd-cni is empty",
        ),
        (
            ProbeOutcome::Broken {
                path: "/opt/cni/bin/linkerd-cni".into(),
                why: Broken::TimedOut { after_ms: 2000 },
            },
            Reason::PluginBinaryBroken,
            "within 2000 ms",
        ),
        (
            ProbeOutcome::Answered {
                path: "/opt/cni/bin/linkerd-cni".into(),
                supported: vec!["0.1.0".into(), "0.2.0".into()],
            },
            Reason::PluginBinaryBroken,
            "does not support cniVersion 0.3.1",
        ),
    ];
    for (outcome, reason, text) in cases {
        let mut bins = Bins::healthy().with("linkerd-cni", outcome);
        let v = run(&entries, &o, &mut bins);
        assert_eq!(v.reason, reason, "{}", v.message);
        assert!(v.message.contains(text), "{:?} lacks {text:?}", v.message);
        assert!(
            v.message
                .contains("plugin linkerd-cni of /etc/cni/net.d/10-calico.conflist"),
            "{}",
            v.message
        );
    }
}

#[test]
fn ipam_binary_is_required_too() {
    let entries = [DirEntry::file(
        "10-calico.conflist",
        golden("calico-linkerd.conflist"),
    )];
    let mut bins = Bins::healthy().with(
        "calico-ipam",
        ProbeOutcome::Missing {
            searched: vec!["/opt/cni/bin".into()],
        },
    );
    let v = run(&entries, &opts(&["linkerd-cni"]), &mut bins);
    assert_eq!(v.reason, Reason::PluginBinaryMissing);
    assert!(
        v.message.contains("IPAM plugin calico-ipam"),
        "{}",
        v.message
    );
}

#[test]
fn several_binary_problems_report_the_first_in_chain_order() {
    let entries = [DirEntry::file(
        "10-calico.conflist",
        golden("calico-linkerd.conflist"),
    )];
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
        v.message.contains("portmap is not executable") && v.message.contains("and 1 more"),
        "{}",
        v.message
    );
}

#[test]
fn s8_truncated_first_file_containerd_vs_crio() {
    let full = golden("calico-linkerd.conflist");
    let entries = [
        DirEntry::file("05-partial.conflist", full[..full.len() / 2].to_vec()),
        DirEntry::file("10-calico.conflist", full.clone()),
    ];
    let v = run(&entries, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ConfigInvalid);
    assert_eq!(
        v.config_file.as_deref(),
        Some("/etc/cni/net.d/05-partial.conflist")
    );
    assert!(v.message.contains("cannot be parsed"), "{}", v.message);

    let crio = VerifyOptions {
        runtime: Runtime::Crio,
        ..opts(&["linkerd-cni"])
    };
    let v = run(&entries, &crio, &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert_eq!(
        v.config_file.as_deref(),
        Some("/etc/cni/net.d/10-calico.conflist")
    );
    assert!(
        v.message.contains("skipped invalid: 05-partial.conflist"),
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
        DirEntry::file("10-calico.conflist.bak", golden("calico.conflist")),
        DirEntry::file("calico-kubeconfig", b"apiVersion: v1".to_vec()),
        DirEntry::dir("multus.d", vec![]),
        DirEntry::dir("20-dir.conflist", vec![]),
    ];
    let v = run(&entries, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::NoConfig);
    assert_eq!(v.config_file, None);
    assert!(v.message.contains("/etc/cni/net.d"), "{}", v.message);
}

#[test]
fn sort_is_bytewise_and_json_counts() {
    // "0" (0x30) sorts before "1", and uppercase before lowercase, as Go's sort.Strings.
    let entries = [
        DirEntry::file("a.json", golden("cilium.conflist")),
        DirEntry::file("Z.conflist", golden("calico-linkerd.conflist")),
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
            EntryKind::TooLarge {
                size: 1 << 30,
                limit: 1 << 20,
            },
            "over the 1048576-byte limit",
        ),
        (
            EntryKind::NotRegular("fifo".into()),
            "is a fifo, not a regular file",
        ),
        (
            EntryKind::Unreadable("too many levels of symbolic links".into()),
            "symbolic links",
        ),
        (EntryKind::File(vec![0xff, 0xfe, 0x00]), "cannot be parsed"),
        (
            EntryKind::File(br#"{"name":"x","plugins":[]}"#.to_vec()),
            "empty",
        ),
    ];
    for (kind, text) in cases {
        let entries = [DirEntry {
            name: "00-bad.conflist".into(),
            kind,
        }];
        let v = run(&entries, &o, &mut Bins::healthy());
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
        let entries = [DirEntry::file(&format!("10-{file}"), golden(file))];
        let v = run(&entries, &opts(&[]), &mut Bins::healthy());
        assert_eq!(v.reason, Reason::Verified, "{file}: {}", v.message);
        assert_eq!(v.plugins, chain, "{file}");
        let v = run(&entries, &opts(&["linkerd-cni"]), &mut Bins::healthy());
        assert_eq!(v.reason, Reason::ChainedPluginMissing, "{file}");
    }
}

#[test]
fn istio_owned_config_verifies_with_cni_1_0() {
    let entries = [DirEntry::file(
        "02-istio-cni.conflist",
        golden("istio-cni.conflist"),
    )];
    let mut bins = Bins::healthy();
    let v = run(&entries, &opts(&["istio-cni"]), &mut bins);
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert!(bins.calls.iter().all(|(_, v)| v == "1.0.0"));
    assert!(v.message.contains("cniVersion 1.0.0"), "{}", v.message);
}

#[test]
fn cni_1_1_drop_in_plugins_are_appended() {
    let dropin = br#"{"type":"linkerd-cni","linkerd":{"incoming-proxy-port":4143}}"#;
    let entries = [
        DirEntry::file("10-calico.conflist", golden("calico.conflist")),
        DirEntry::dir(
            "k8s-pod-network",
            vec![
                DirEntry::file("50-linkerd.conf", dropin.to_vec()),
                DirEntry::file("README", b"not a plugin".to_vec()),
            ],
        ),
    ];
    let v = run(&entries, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert_eq!(v.plugins.last().map(String::as_str), Some("linkerd-cni"));

    // loadOnlyInlinedPlugins turns the drop-in directory off.
    let mut inlined: serde_json::Value =
        serde_json::from_slice(&golden("calico.conflist")).unwrap();
    inlined["loadOnlyInlinedPlugins"] = true.into();
    let mut only = entries.clone();
    only[0] = DirEntry::file("10-calico.conflist", serde_json::to_vec(&inlined).unwrap());
    let v = run(&only, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ChainedPluginMissing);

    // A broken drop-in file breaks the whole network, as in libcni.
    let mut bad = entries.clone();
    bad[1] = DirEntry::dir(
        "k8s-pod-network",
        vec![DirEntry::file("50-linkerd.conf", b"{".to_vec())],
    );
    let v = run(&bad, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ConfigInvalid);
    assert!(
        v.message
            .contains("drop-in plugin file k8s-pod-network/50-linkerd.conf"),
        "{}",
        v.message
    );

    // A conflist without inline plugins, made only of drop-ins.
    let bare = br#"{"cniVersion":"1.1.0","name":"net"}"#;
    let entries = [
        DirEntry::file("10-net.conflist", bare.to_vec()),
        DirEntry::dir(
            "net",
            vec![
                DirEntry::file("10-calico.conf", br#"{"type":"calico"}"#.to_vec()),
                DirEntry::file("20-linkerd.conf", dropin.to_vec()),
            ],
        ),
    ];
    let v = run(&entries, &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    let v = run(&entries[..1], &opts(&["linkerd-cni"]), &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ConfigInvalid);
    assert!(v.message.contains("has no plugins"), "{}", v.message);
}

#[test]
fn verdict_json_matches_the_contract_shape() {
    let entries = [DirEntry::file(
        "10-calico.conflist",
        golden("calico.conflist"),
    )];
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
