//! The deepest CNI configs Go accepts get libcni's verdict, and one level more is
//! ConfigInvalid, on a thread whose stack is far too small for one frame per level.
//!
//! Go's `encoding/json` scanner allows 10,000 nested arrays/objects (`maxNestingDepth` in
//! `scanner.go`) and refuses the next with "exceeded max depth". libcni v1.3.0, run on the
//! same documents these tests build, loads a `.conflist` nested 10,000 levels and refuses
//! 10,001; loads a `.conf` nested 9,998 levels and refuses 9,999 (`ConfListFromConf` wraps it
//! in a list two levels deeper); loads a drop-in plugin file nested 10,000 levels.

use meshgate_core::cni::gojson::{self, GoValue, JsonError, MAX_DEPTH};
use meshgate_core::cni::{
    ChainVerdict, MemSource, ProbeOutcome, Reason, Runtime, VerifyOptions, verify,
};

/// `levels` nested arrays or objects, as one JSON value.
fn nested(levels: usize, objects: bool) -> String {
    if objects {
        format!(
            "{}{{}}{}",
            r#"{"a":"#.repeat(levels - 1),
            "}".repeat(levels - 1)
        )
    } else {
        format!("{}{}", "[".repeat(levels), "]".repeat(levels))
    }
}

/// A calico + linkerd-cni list whose whole document nests `total` levels: the list object,
/// `plugins` and the plugin object are three, the rest sit in calico's `deep` field.
fn deep_conflist(total: usize, objects: bool) -> Vec<u8> {
    format!(
        r#"{{"cniVersion":"0.3.1","name":"k8s-pod-network","plugins":[{{"type":"calico","deep":{}}},{{"type":"linkerd-cni"}}]}}"#,
        nested(total - 3, objects)
    )
    .into_bytes()
}

/// A single plugin object nesting `total` levels (itself plus `total - 1` in `deep`).
fn deep_plugin(plugin_type: &str, total: usize) -> Vec<u8> {
    format!(
        r#"{{"cniVersion":"0.3.1","name":"k8s-pod-network","type":"{plugin_type}","deep":{}}}"#,
        nested(total - 1, false)
    )
    .into_bytes()
}

fn check(src: MemSource, runtime: Runtime) -> ChainVerdict {
    let opts = VerifyOptions {
        conf_dir: "/etc/cni/net.d".into(),
        runtime,
        required: vec!["linkerd-cni".into()],
        multus: Default::default(),
    };
    let mut src = src;
    verify(&mut src, &opts, |t| ProbeOutcome::Answered {
        path: format!("/opt/cni/bin/{t}"),
        supported: vec!["0.3.1".into(), "1.0.0".into()],
    })
}

/// Runs `f` on a 256 KiB stack: recursing once per level over 10,000 levels needs several MiB.
fn on_small_stack(f: impl FnOnce() + Send + 'static) {
    std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(f)
        .unwrap()
        .join()
        .unwrap();
}

/// The decoded tree itself: mapped, compared, shown and dropped without one frame per level.
#[test]
fn the_deepest_tree_go_accepts_is_walked_dropped_and_compared_without_recursion() {
    on_small_stack(|| {
        for objects in [false, true] {
            let v = gojson::parse(nested(MAX_DEPTH, objects).as_bytes()).unwrap();
            assert_eq!(v.depth(), MAX_DEPTH);
            let m = v.as_go_map();
            assert!(m == v);
            assert!(v.numbers_fit_f64());
            let shown = format!("{v:?}");
            assert!(shown.len() < 400 && shown.contains('…'), "{shown}");
            drop(m);
            drop(v);
            let over = nested(MAX_DEPTH + 1, objects);
            assert_eq!(gojson::parse(over.as_bytes()), Err(JsonError::TooDeep));
        }
        // Wide and deep at once: every level also holds leaves and an object to sort.
        let wide = format!(
            "{}[]{}",
            r#"[1,{"b":2,"a":3},"#.repeat(MAX_DEPTH - 1),
            "]".repeat(MAX_DEPTH - 1)
        );
        let m = gojson::parse(wide.as_bytes()).unwrap().as_go_map();
        let GoValue::Array(top) = &m else {
            panic!("not an array")
        };
        assert_eq!(top.len(), 3);
        let sorted = gojson::parse(br#"{"a":3,"b":2}"#).unwrap();
        assert!(top[1] == sorted, "keys sorted at every level");
    });
}

#[test]
fn a_conflist_nested_as_deep_as_go_allows_gets_libcnis_verdict() {
    on_small_stack(|| {
        for objects in [false, true] {
            for runtime in [Runtime::Containerd, Runtime::Crio] {
                let at_max =
                    MemSource::new().file("10-calico.conflist", deep_conflist(MAX_DEPTH, objects));
                let v = check(at_max, runtime);
                assert_eq!(v.reason, Reason::Verified, "{objects} {}", v.message);
                assert_eq!(v.plugins, ["calico", "linkerd-cni"]);

                let over = MemSource::new()
                    .file("10-calico.conflist", deep_conflist(MAX_DEPTH + 1, objects));
                let v = check(over, runtime);
                // CRI-O skips the list, and then has nothing it loads: ConfigInvalid too.
                assert_eq!(v.reason, Reason::ConfigInvalid, "{objects} {}", v.message);
                assert!(
                    v.message.contains("nested more than 10000 levels"),
                    "{}",
                    v.message
                );
            }
        }
    });
}

#[test]
fn a_conf_loses_two_levels_to_the_list_libcni_wraps_it_in() {
    on_small_stack(|| {
        let conf = |total| MemSource::new().file("10-calico.conf", deep_plugin("calico", total));
        // Loaded: the chain is judged (the mesh plugin is not in it).
        let v = check(conf(MAX_DEPTH - 2), Runtime::Containerd);
        assert_eq!(v.reason, Reason::ChainedPluginMissing, "{}", v.message);
        for total in [MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1] {
            let v = check(conf(total), Runtime::Containerd);
            assert_eq!(v.reason, Reason::ConfigInvalid, "{total}: {}", v.message);
        }
    });
}

#[test]
fn a_drop_in_plugin_nested_as_deep_as_go_allows_is_appended() {
    on_small_stack(|| {
        let base =
            br#"{"cniVersion":"0.3.1","name":"k8s-pod-network","plugins":[{"type":"calico"}]}"#;
        let with = |total| {
            MemSource::new()
                .file("10-calico.conflist", base.to_vec())
                .file(
                    "k8s-pod-network/50-linkerd.conf",
                    deep_plugin("linkerd-cni", total),
                )
        };
        let v = check(with(MAX_DEPTH), Runtime::Containerd);
        assert_eq!(v.reason, Reason::Verified, "{}", v.message);
        assert_eq!(v.plugins, ["calico", "linkerd-cni"]);
        let v = check(with(MAX_DEPTH + 1), Runtime::Containerd);
        assert_eq!(v.reason, Reason::ConfigInvalid, "{}", v.message);
    });
}
