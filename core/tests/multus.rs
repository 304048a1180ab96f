//! Multus as the primary CNI: the chain verdict judges the cluster-default network Multus
//! runs, not the `[multus]` chain the runtime loads. The configs are Multus's own shapes
//! (core/testdata/README.md names the upstream file each comes from): the thin entrypoint's
//! generated `00-multus.conf(list)` with inline delegates, the thick daemon's generated
//! `00-multus.conf` with a `clusterNetwork` path under `/host`, and a `clusterNetwork` name.

mod common;
use common::{Bins, golden, golden_with, missing, opts, run_src};
use meshgate_core::cni::listing::SourceError;
use meshgate_core::cni::multus::Layout;
use meshgate_core::cni::{ChainVerdict, MemSource, ProbeOutcome, Reason};

fn run(src: &mut MemSource, required: &[&str], bins: &mut Bins) -> ChainVerdict {
    run_src(src, &opts(required), bins)
}

/// The thick daemon's `00-multus.conf` beside the primary config it names.
fn thick_node(primary: &str) -> MemSource {
    MemSource::new()
        .file("00-multus.conf", golden("multus-thick.conf"))
        .file("10-calico.conflist", golden(primary))
}

#[test]
fn thin_inline_delegate_chaining_the_mesh_plugin_is_verified() {
    for file in ["multus-thin-istio.conf", "multus-thin-istio.conflist"] {
        let name = format!("00-{}", file.replace("-thin-istio", ""));
        let mut src = MemSource::new()
            .file(&name, golden(file))
            .file("10-calico.conflist", golden("calico.conflist"));
        let mut bins = Bins::healthy();
        let v = run(&mut src, &["istio-cni"], &mut bins);
        assert_eq!(v.reason, Reason::Verified, "{file}: {}", v.message);
        assert_eq!(
            v.config_file.as_deref(),
            Some(format!("/etc/cni/net.d/{name}").as_str())
        );
        assert_eq!(v.plugins, ["multus"]);
        let d = v.delegate.as_ref().expect("a delegate");
        assert_eq!(d.layout, Layout::MultusThin);
        assert_eq!(d.source, "inline delegate #1");
        assert_eq!(d.plugins, ["calico", "portmap", "istio-cni"]);
        assert!(
            v.message.contains(&format!(
                "/etc/cni/net.d/{name} via multus (thin) inline delegate #1 chains istio-cni after a primary plugin (3 plugins)"
            )),
            "{}",
            v.message
        );
        // Multus's own binary and every delegate binary (IPAM included) answered VERSION.
        assert_eq!(
            bins.calls,
            ["multus", "calico", "portmap", "istio-cni", "calico-ipam"]
        );
        // The master conflist beside it is not what runs, and is not read.
        assert_eq!(src.reads, vec![name.into_bytes()]);
    }
}

#[test]
fn mesh_plugin_missing_from_the_delegate_is_chained_plugin_missing() {
    let mut src = MemSource::new().file("00-multus.conf", golden("multus.conf"));
    let mut bins = Bins::healthy();
    let v = run(&mut src, &["istio-cni"], &mut bins);
    assert_eq!(v.reason, Reason::ChainedPluginMissing, "{}", v.message);
    assert_eq!(
        v.message,
        "/etc/cni/net.d/00-multus.conf via multus (thin) inline delegate #1 does not chain istio-cni (its chain has 2 plugins)"
    );
    assert_eq!(v.delegate.unwrap().plugins, ["calico", "portmap"]);
    assert!(
        bins.calls.is_empty(),
        "no binary before the structure is right"
    );
}

#[test]
fn thick_cluster_network_path_under_host_is_the_hosts_conf_dir() {
    let mut src = thick_node("istio-cni.conflist");
    let v = run(&mut src, &["istio-cni"], &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert_eq!(v.plugins, ["multus-shim"]);
    let d = v.delegate.as_ref().unwrap();
    assert_eq!(d.layout, Layout::MultusThick);
    assert_eq!(d.file.as_deref(), Some("/etc/cni/net.d/10-calico.conflist"));
    assert!(
        v.message.contains(
            "via multus (thick) clusterNetwork /etc/cni/net.d/10-calico.conflist chains istio-cni"
        ),
        "{}",
        v.message
    );
    assert_eq!(
        src.reads,
        vec![b"00-multus.conf".to_vec(), b"10-calico.conflist".to_vec()]
    );

    let mut src = thick_node("calico.conflist");
    let v = run(&mut src, &["istio-cni"], &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ChainedPluginMissing, "{}", v.message);
    assert!(v.message.contains("via multus (thick)"), "{}", v.message);
}

#[test]
fn cluster_network_path_outside_the_conf_dir_is_read_and_not_named() {
    let conf = golden_with(
        "multus-thick.conf",
        "/host/etc/cni/net.d/10-calico.conflist",
        "/etc/cni/multus/net.d/default.conflist",
    );
    let conf = String::from_utf8(conf)
        .unwrap()
        .replace("multus-shim", "multus");
    let mut src = MemSource::new()
        .file("00-multus.conf", conf.into_bytes())
        .file(
            "../multus/net.d/default.conflist",
            golden("istio-cni.conflist"),
        );
    let v = run(&mut src, &["istio-cni"], &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    let d = v.delegate.unwrap();
    assert_eq!(
        d.file.as_deref(),
        Some("/etc/cni/multus/net.d/default.conflist")
    );
    assert_eq!(d.source, "clusterNetwork file outside /etc/cni/net.d");
    assert!(!v.message.contains("default.conflist"), "{}", v.message);
}

#[test]
fn cluster_network_name_fails_closed_without_reading_further() {
    let mut src = MemSource::new()
        .file("00-multus.conf", golden("multus-thick-by-name.conf"))
        .file("10-calico.conflist", golden("istio-cni.conflist"));
    let mut bins = Bins::healthy();
    let v = run(&mut src, &["istio-cni"], &mut bins);
    assert_eq!(v.reason, Reason::ConfigInvalid, "{}", v.message);
    assert!(
        v.message.contains(
            "runs multus (thick) (plugin #1), whose cluster-default network cannot be verified"
        ) && v.message.contains("NetworkAttachmentDefinition"),
        "{}",
        v.message
    );
    assert!(!v.message.contains("k8s-pod-network"), "{}", v.message);
    assert_eq!(src.reads, vec![b"00-multus.conf".to_vec()]);
    assert!(bins.calls.is_empty());
}

#[test]
fn delegate_file_missing_invalid_or_oversized_is_config_invalid() {
    let cases: Vec<(MemSource, &str)> = vec![
        (
            MemSource::new().file("00-multus.conf", golden("multus-thick.conf")),
            "clusterNetwork /etc/cni/net.d/10-calico.conflist does not exist",
        ),
        (
            thick_node("istio-cni.conflist").file("10-calico.conflist", b"{\"name\":".to_vec()),
            "is not valid JSON",
        ),
        (
            thick_node("istio-cni.conflist").file(
                "10-calico.conflist",
                br#"{"name":"k8s-pod-network","plugins":[{"type":"calico","ipam":"calico-ipam"}]}"#
                    .to_vec(),
            ),
            "does not load with libcni",
        ),
        (
            thick_node("istio-cni.conflist").failing(
                "10-calico.conflist",
                SourceError::Undecidable("it is 2097152 bytes, over the 1048576-byte limit".into()),
            ),
            "cannot be verified: it is 2097152 bytes",
        ),
        (
            MemSource::new()
                .file("00-multus.conf", golden("multus-thick.conf"))
                .dir("10-calico.conflist"),
            "is a directory",
        ),
    ];
    for (mut src, text) in cases {
        let v = run(&mut src, &["istio-cni"], &mut Bins::healthy());
        assert_eq!(v.reason, Reason::ConfigInvalid, "{text}: {}", v.message);
        assert!(v.message.contains(text), "{:?} lacks {text:?}", v.message);
    }
}

#[test]
fn delegate_binaries_are_probed_with_the_delegates_version() {
    let mut src = MemSource::new().file("00-multus.conf", golden("multus-thin-istio.conf"));
    let mut bins = Bins::healthy().with("istio-cni", missing());
    let v = run(&mut src, &["istio-cni"], &mut bins);
    assert_eq!(v.reason, Reason::PluginBinaryMissing, "{}", v.message);
    assert!(
        v.message.starts_with(
            "/etc/cni/net.d/00-multus.conf via multus (thin) inline delegate #1: plugin #3 (the required istio-cni): no regular file"
        ),
        "{}",
        v.message
    );
    // Multus's own binary first.
    let mut src = MemSource::new().file("00-multus.conf", golden("multus-thin-istio.conf"));
    let mut bins = Bins::healthy().with("multus", missing());
    let v = run(&mut src, &["istio-cni"], &mut bins);
    assert_eq!(v.reason, Reason::PluginBinaryMissing, "{}", v.message);
    assert!(
        v.message
            .starts_with("/etc/cni/net.d/00-multus.conf: plugin #1: no regular file"),
        "{}",
        v.message
    );
    // The delegate (0.3.1) and Multus (1.0.0 in the thin file) are checked each with its
    // own list's version: a calico that supports only 1.0.0 fails in a 0.3.1 delegate.
    let old = golden_with(
        "multus-thin-istio.conf",
        "{\"cniVersion\":\"1.0.0\",\"name\":\"k8s-pod-network\"",
        "{\"cniVersion\":\"0.3.1\",\"name\":\"k8s-pod-network\"",
    );
    let only_1 = ProbeOutcome::Answered {
        path: "/opt/cni/bin/calico".into(),
        supported: vec!["1.0.0".into()],
    };
    let mut src = MemSource::new().file("00-multus.conf", old);
    let v = run(
        &mut src,
        &["istio-cni"],
        &mut Bins::healthy().with("calico", only_1),
    );
    assert_eq!(v.reason, Reason::PluginBinaryBroken, "{}", v.message);
    assert!(
        v.message.contains("inline delegate #1: plugin #1"),
        "{}",
        v.message
    );
}

#[test]
fn multus_chained_with_other_plugins_runs_them_after_the_delegate() {
    // Istio's installer appends istio-cni to the file the runtime loads, 00-multus.conflist:
    // multus runs the delegate (calico, portmap), then libcni runs istio-cni.
    let appended = golden_with(
        "multus-thin-istio.conflist",
        "    }]\n}",
        "    }, {\"type\": \"istio-cni\"}]\n}",
    );
    let appended = String::from_utf8(appended)
        .unwrap()
        .replace("\"type\":\"istio-cni\"}]}", "\"type\":\"bandwidth\"}]}");
    let mut src = MemSource::new().file("00-multus.conflist", appended.into_bytes());
    let v = run(&mut src, &["istio-cni"], &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert_eq!(v.plugins, ["multus", "istio-cni"]);
    assert_eq!(
        v.delegate.unwrap().plugins,
        ["calico", "portmap", "bandwidth"]
    );
    assert!(v.message.contains("(4 plugins)"), "{}", v.message);

    // A mesh plugin before multus has no primary plugin before it.
    let first = golden_with(
        "multus-thin-istio.conflist",
        "\"plugins\": [ {",
        "\"plugins\": [ {\"type\": \"istio-cni\"}, {",
    );
    let mut src = MemSource::new().file("00-multus.conflist", first);
    let v = run(&mut src, &["istio-cni"], &mut Bins::healthy());
    assert_eq!(v.reason, Reason::PrimaryPluginMissing, "{}", v.message);
}

/// A thick node whose mesh plugin is a CNI 1.1 drop-in of the cluster network, as Multus's
/// own e2e `test-subdirectory-chaining.sh` lays one down (`<conf dir>/<network name>/`).
fn thick_node_with_drop_in() -> MemSource {
    thick_node("calico.conflist").file(
        "k8s-pod-network/50-istio-cni.conf",
        br#"{"type":"istio-cni"}"#.to_vec(),
    )
}

fn with_multus(version: &str) -> meshgate_core::cni::VerifyOptions {
    let mut o = opts(&["istio-cni"]);
    o.multus.version = version.parse().unwrap();
    o
}

#[test]
fn a_cluster_network_files_drop_ins_run_from_multus_v4_2_1() {
    // Multus v4.2.1+ loads a .conflist clusterNetwork with LoadChainedPluginsFromFile, which
    // appends the network's subdirectory drop-ins (loadSubdirectoryChain).
    for version in ["latest", "v4.2.1", "4.3"] {
        let mut src = thick_node_with_drop_in();
        let v = run_src(&mut src, &with_multus(version), &mut Bins::healthy());
        assert_eq!(v.reason, Reason::Verified, "{version}: {}", v.message);
        let d = v.delegate.unwrap();
        assert_eq!(
            d.plugins,
            ["calico", "portmap", "bandwidth", "istio-cni"],
            "{version}"
        );
        assert_eq!(
            d.source,
            "clusterNetwork /etc/cni/net.d/10-calico.conflist + drop-in plugin file 50-istio-cni.conf"
        );
    }
    // Before v4.2.1 Multus loaded the file's inline plugins only.
    for version in ["v4.2.0", "4.1.4", "v3.9"] {
        let mut src = thick_node_with_drop_in();
        let v = run_src(&mut src, &with_multus(version), &mut Bins::healthy());
        assert_eq!(
            v.reason,
            Reason::ChainedPluginMissing,
            "{version}: {}",
            v.message
        );
        assert_eq!(
            v.delegate.unwrap().plugins,
            ["calico", "portmap", "bandwidth"]
        );
    }
}

#[test]
fn load_only_inlined_plugins_and_inline_delegates_get_no_drop_ins() {
    // The list's own loadOnlyInlinedPlugins turns them off.
    let inlined = golden_with(
        "calico.conflist",
        "\"name\": \"k8s-pod-network\",",
        "\"name\": \"k8s-pod-network\", \"loadOnlyInlinedPlugins\": true,",
    );
    let mut src = MemSource::new()
        .file("00-multus.conf", golden("multus-thick.conf"))
        .file("10-calico.conflist", inlined)
        .file(
            "k8s-pod-network/50-istio-cni.conf",
            br#"{"type":"istio-cni"}"#.to_vec(),
        );
    let v = run(&mut src, &["istio-cni"], &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ChainedPluginMissing, "{}", v.message);
    // An inline delegate is run from its bytes (LoadDelegateNetConf): never drop-ins.
    let mut src = MemSource::new()
        .file("00-multus.conf", golden("multus-thin-istio.conf"))
        .file(
            "k8s-pod-network/50-bandwidth.conf",
            br#"{"type":"bandwidth"}"#.to_vec(),
        );
    let v = run(&mut src, &["istio-cni"], &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert_eq!(
        v.delegate.unwrap().plugins,
        ["calico", "portmap", "istio-cni"]
    );
}

#[test]
fn a_drop_in_that_does_not_load_or_a_bad_network_name_fails_closed() {
    let mut src = thick_node("calico.conflist")
        .file("k8s-pod-network/50-istio-cni.conf", b"{not json".to_vec());
    let v = run(&mut src, &["istio-cni"], &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ConfigInvalid, "{}", v.message);
    assert!(
        v.message
            .contains("drop-in plugin file #1 (50-istio-cni.conf)"),
        "{}",
        v.message
    );
    // Multus validates the network name before it reads the subdirectory.
    let bad = golden_with("calico.conflist", "k8s-pod-network", "-pod network");
    let mut src = MemSource::new()
        .file("00-multus.conf", golden("multus-thick.conf"))
        .file("10-calico.conflist", bad);
    let v = run(&mut src, &["istio-cni"], &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ConfigInvalid, "{}", v.message);
    assert!(
        v.message.contains("not a valid CNI network name"),
        "{}",
        v.message
    );
    assert!(
        !v.message.contains("-pod network"),
        "no file content: {}",
        v.message
    );
}

#[test]
fn a_thick_path_under_the_daemon_conf_dir_is_read_in_the_dir_being_checked() {
    // `check --cni-conf-dir /srv/node-a/net.d` on a copy of a node's directory: the daemon's
    // /host/etc/cni/net.d/10-calico.conflist is the copy's 10-calico.conflist.
    let mut o = opts(&["istio-cni"]);
    o.conf_dir = "/srv/node-a/net.d".into();
    let mut src = thick_node("istio-cni.conflist");
    let v = run_src(&mut src, &o, &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    let d = v.delegate.unwrap();
    assert_eq!(
        d.source,
        "clusterNetwork /srv/node-a/net.d/10-calico.conflist"
    );
    assert_eq!(
        d.file.as_deref(),
        Some("/srv/node-a/net.d/10-calico.conflist")
    );
    assert!(src.reads.contains(&b"10-calico.conflist".to_vec()));

    // A daemon configured with another conf dir: its paths map, /host ones outside it do not.
    let mut o = opts(&["istio-cni"]);
    o.multus.daemon_conf_dir = "/var/multus/net.d".into();
    let moved = golden_with(
        "multus-thick.conf",
        "/host/etc/cni/net.d/10-calico.conflist",
        "/var/multus/net.d/10-calico.conflist",
    );
    let mut src = MemSource::new()
        .file("00-multus.conf", moved)
        .file("10-calico.conflist", golden("istio-cni.conflist"));
    let v = run_src(&mut src, &o, &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert_eq!(
        v.delegate.unwrap().file.as_deref(),
        Some("/etc/cni/net.d/10-calico.conflist")
    );
}

#[test]
fn inline_delegates_load_as_multus_loads_them() {
    let single = br#"{"cniVersion":"0.3.1","name":"multus-cni-network","type":"multus","delegates":[{"cniVersion":"0.3.1","name":"cbr0","type":"flannel","delegate":{"isDefaultGateway":true}}]}"#;
    let mut src = MemSource::new().file("00-multus.conf", single.to_vec());
    let v = run(&mut src, &[], &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert_eq!(v.delegate.unwrap().plugins, ["flannel"]);

    for (conf, text) in [
        (
            r#"{"name":"m","type":"multus","delegates":[{"name":"d","type":"bridge"},{"name":"e"}]}"#,
            "inline delegate #2 that has neither a type nor plugins",
        ),
        (
            r#"{"name":"m","type":"multus","delegates":[{"name":"d","plugins":[]}]}"#,
            "inline delegate #1 that does not load",
        ),
        (
            r#"{"name":"m","type":"multus"}"#,
            "neither delegates nor a clusterNetwork",
        ),
        (
            r#"{"name":"m","type":"multus","delegates":"x"}"#,
            "not a list of JSON objects",
        ),
        (
            r#"{"name":"m","type":"multus","clusterNetwork":7}"#,
            "clusterNetwork that is not a string",
        ),
    ] {
        let mut src = MemSource::new().file("00-multus.conf", conf.as_bytes().to_vec());
        let v = run(&mut src, &[], &mut Bins::healthy());
        assert_eq!(v.reason, Reason::ConfigInvalid, "{conf}: {}", v.message);
        assert!(v.message.contains(text), "{:?} lacks {text:?}", v.message);
    }

    // Go's field matching: "ClusterNetwork" is Multus's clusterNetwork, which wins over
    // the inline delegates.
    let folded = br#"{"name":"m","type":"multus","ClusterNetwork":"default","delegates":[{"name":"d","type":"bridge"}]}"#;
    let mut src = MemSource::new().file("00-multus.conf", folded.to_vec());
    let v = run(&mut src, &[], &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ConfigInvalid, "{}", v.message);
    assert!(v.message.contains("network name"), "{}", v.message);
}

#[test]
fn multus_messages_never_quote_the_delegate() {
    const S: &str = "SECRETzz";
    let confs = [
        format!(r#"{{"name":"{S}","type":"multus","clusterNetwork":"{S}"}}"#),
        format!(r#"{{"name":"{S}","type":"multus","clusterNetwork":"/{S}/{S}.conflist"}}"#),
        format!(r#"{{"name":"{S}","type":"multus","delegates":[{{"name":"{S}","type":"{S}"}}]}}"#),
        format!(
            r#"{{"name":"{S}","type":"multus","delegates":[{{"name":"{S}","plugins":[{{"type":"{S}","ipam":{{"type":"{S}"}}}}]}}]}}"#
        ),
    ];
    for conf in confs {
        let mut src = MemSource::new().file("00-multus.conf", conf.clone().into_bytes());
        let v = run(
            &mut src,
            &["istio-cni"],
            &mut Bins::healthy().with("SECRETzz", missing()),
        );
        assert_ne!(v.reason, Reason::Verified);
        assert!(!v.message.contains(S), "{conf}: {}", v.message);
    }
}

#[test]
fn cluster_network_directory_runs_its_first_config() {
    let shim = |dir: &str| {
        format!(r#"{{"cniVersion":"0.3.1","name":"multus-cni-network","type":"multus-shim","clusterNetwork":"{dir}"}}"#)
            .into_bytes()
    };
    // GetCNIConfigFromFile("", dir): the first .conf/.json/.conflist by name.
    let mut src = MemSource::new()
        .file("00-multus.conf", shim("/host/etc/cni/multus/net.d"))
        .file(
            "../multus/net.d/10-default.conflist",
            golden("istio-cni.conflist"),
        )
        .file(
            "../multus/net.d/20-other.conflist",
            golden("calico.conflist"),
        )
        .file("../multus/net.d/README", b"not a config".to_vec());
    let v = run(&mut src, &["istio-cni"], &mut Bins::healthy());
    assert_eq!(v.reason, Reason::Verified, "{}", v.message);
    assert_eq!(
        v.delegate.unwrap().file.as_deref(),
        Some("/etc/cni/multus/net.d/10-default.conflist")
    );
    // A .json sorting first is the first config, but only .conf/.conflist make the
    // directory count (libcni ConfFiles is called twice, with different extensions).
    let mut src = MemSource::new()
        .file("00-multus.conf", shim("/etc/cni/multus/net.d"))
        .file("../multus/net.d/05-first.json", golden("linkerd-only.conf"))
        .file(
            "../multus/net.d/10-default.conflist",
            golden("istio-cni.conflist"),
        );
    let v = run(&mut src, &["istio-cni"], &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ChainedPluginMissing, "{}", v.message);
    let mut src = MemSource::new()
        .file("00-multus.conf", shim("/etc/cni/multus/net.d"))
        .file("../multus/net.d/05-only.json", golden("istio-cni.conflist"));
    let v = run(&mut src, &["istio-cni"], &mut Bins::healthy());
    assert_eq!(v.reason, Reason::ConfigInvalid, "{}", v.message);
    assert!(
        v.message.contains("without a .conf or .conflist"),
        "{}",
        v.message
    );
}
