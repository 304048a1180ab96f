use super::*;
use crate::cni::{Reason, Runtime};
use crate::mode::{Mode, TaintPolicy};

/// A fixed clock.
const T: Timestamp = Timestamp::constant(1_700_000_000, 0);
/// The default key, which most tests gate with.
const TAINT_KEY: &str = DEFAULT_TAINT_KEY;

fn key() -> TaintKey {
    TaintKey::default()
}

fn taint(key: &str, effect: &str) -> Taint {
    Taint {
        key: key.into(),
        effect: effect.into(),
        value: None,
        time_added: None,
    }
}

fn verdict(reason: Reason, message: &str) -> ChainVerdict {
    ChainVerdict {
        verified: reason == Reason::Verified,
        reason,
        message: message.into(),
        config_file: None,
        plugins: vec![],
        runtime: Runtime::Containerd,
        delegate: None,
        transient: false,
    }
}

#[test]
fn taint_effects_parse_as_the_api_spells_them() {
    for e in TaintEffect::ALL {
        assert_eq!(e.as_str().parse::<TaintEffect>(), Ok(e));
    }
    assert_eq!(TaintEffect::default(), TaintEffect::NoSchedule);
    assert!("PreferNoSchedule".parse::<TaintEffect>().is_err());
    assert!("noschedule".parse::<TaintEffect>().is_err());
}

#[test]
fn taint_is_added_and_removed_keeping_other_taints() {
    let others = vec![
        taint("node.kubernetes.io/not-ready", "NoSchedule"),
        taint("dedicated", "NoExecute"),
    ];
    let added = plan_taints(&others, false, &key(), TaintEffect::NoSchedule, T).unwrap();
    assert_eq!(added.len(), 3);
    assert_eq!(&added[..2], &others[..]);
    assert_eq!(added[2].key, TAINT_KEY);
    assert_eq!(added[2].effect, "NoSchedule");
    assert!(added[2].time_added.is_none());

    assert_eq!(
        plan_taints(&added, false, &key(), TaintEffect::NoSchedule, T),
        None,
        "already tainted"
    );
    assert_eq!(
        plan_taints(&added, true, &key(), TaintEffect::NoSchedule, T).unwrap(),
        others
    );
    assert_eq!(
        plan_taints(&others, true, &key(), TaintEffect::NoSchedule, T),
        None,
        "already untainted"
    );

    // An effect change replaces our taint; duplicates of ours are collapsed to one.
    let ne = plan_taints(&added, false, &key(), TaintEffect::NoExecute, T).unwrap();
    assert_eq!(ne.iter().filter(|t| t.key == TAINT_KEY).count(), 1);
    assert!(ne[2].time_added.is_some());
    let dup = [added.clone(), vec![taint(TAINT_KEY, "NoSchedule")]].concat();
    assert_eq!(
        plan_taints(&dup, false, &key(), TaintEffect::NoSchedule, T)
            .unwrap()
            .len(),
        3
    );
}

#[test]
fn label_follows_the_verdict() {
    let mut labels = BTreeMap::new();
    assert_eq!(plan_label(&labels, false), Some("false"));
    labels.insert(VERIFIED_LABEL.into(), "false".into());
    assert_eq!(plan_label(&labels, false), None);
    assert_eq!(plan_label(&labels, true), Some("true"));
}

#[test]
fn metadata_plan_is_one_guarded_patch_or_nothing() {
    let node: Node = serde_json::from_value(json!({
        "metadata": {"name": "n1", "resourceVersion": "5"},
        "spec": {"taints": [{"key": "dedicated", "effect": "NoExecute"}]},
    }))
    .unwrap();
    let plan = plan_metadata(
        &node,
        false,
        &key(),
        TaintEffect::NoSchedule,
        TaintPolicy::Manage,
        T,
    )
    .unwrap();
    assert_eq!(plan.label, Some("false"));
    assert_eq!(plan.taints.as_ref().map(Vec::len), Some(2));
    assert!(!plan.has_labels);
    let patch = plan.patch();
    assert_eq!(patch[0]["value"], "5");
    assert_eq!(patch[2]["path"], "/metadata/labels");

    let mut gated = node.clone();
    gated.metadata.labels = Some(BTreeMap::from([(VERIFIED_LABEL.into(), "false".into())]));
    gated.spec.as_mut().unwrap().taints = plan.taints.clone();
    assert_eq!(
        plan_metadata(
            &gated,
            false,
            &key(),
            TaintEffect::NoSchedule,
            TaintPolicy::Manage,
            T
        ),
        None
    );
    let open = plan_metadata(
        &gated,
        true,
        &key(),
        TaintEffect::NoSchedule,
        TaintPolicy::Manage,
        T,
    )
    .unwrap();
    assert_eq!(open.label, Some("true"));
    assert!(open.has_labels);
    assert_eq!(open.taints.as_ref().map(Vec::len), Some(1));
}

#[test]
fn condition_transition_time_moves_only_on_status_change() {
    let t0 = Timestamp::from_second(1_000).unwrap();
    let t1 = Timestamp::from_second(2_000).unwrap();
    let missing = verdict(Reason::ChainedPluginMissing, "a");
    let first = plan_condition(None, &missing, t0).unwrap();
    assert_eq!(first.status, "False");
    assert_eq!(first.last_transition_time, Some(Time(t0)));
    assert_eq!(
        plan_condition(Some(&first), &missing, t1),
        None,
        "unchanged: no write"
    );

    // Same status, new reason: written, transition time kept.
    let invalid = verdict(Reason::ConfigInvalid, "b");
    let second = plan_condition(Some(&first), &invalid, t1).unwrap();
    assert_eq!(second.reason.as_deref(), Some("ConfigInvalid"));
    assert_eq!(second.last_transition_time, Some(Time(t0)));

    let ok = verdict(Reason::Verified, "c");
    let third = plan_condition(Some(&second), &ok, t1).unwrap();
    assert_eq!(third.status, "True");
    assert_eq!(third.last_transition_time, Some(Time(t1)));
}

#[test]
fn events_only_on_status_or_reason_change() {
    let missing = verdict(Reason::ChainedPluginMissing, "a");
    let ev = plan_event(None, &missing, Mode::Enforce).unwrap();
    assert_eq!(ev.reason, event_reason::CHAIN_UNVERIFIED);
    assert!(ev.warning);
    assert!(ev.note.starts_with("ChainedPluginMissing: "));
    let cond = plan_condition(None, &missing, T).unwrap();
    assert!(
        plan_event(
            Some(&cond),
            &verdict(Reason::ChainedPluginMissing, "other text"),
            Mode::Enforce
        )
        .is_none()
    );
    let ok = plan_event(Some(&cond), &verdict(Reason::Verified, "ok"), Mode::Enforce).unwrap();
    assert_eq!(ok.reason, event_reason::CHAIN_VERIFIED);
    assert!(!ok.warning);
}

#[test]
fn a_long_verdict_message_fits_the_event_note() {
    let long = verdict(Reason::ConfigInvalid, &"é".repeat(2000));
    let ev = plan_event(None, &long, Mode::Enforce).unwrap();
    assert!(
        ev.note.len() <= crate::EVENT_NOTE_MAX_BYTES,
        "{}",
        ev.note.len()
    );
    assert!(ev.note.ends_with('…'));
}

#[test]
fn patch_is_guarded_by_resource_version_and_escapes_the_label_key() {
    let p = metadata_patch(
        "42",
        true,
        Some(&[taint(TAINT_KEY, "NoSchedule")]),
        Some("false"),
    );
    assert_eq!(
        p[0],
        json!({"op": "test", "path": "/metadata/resourceVersion", "value": "42"})
    );
    assert_eq!(p[1]["path"], "/spec/taints");
    assert_eq!(p[2]["path"], "/metadata/labels/meshgate.io~1cni-verified");
    let p = metadata_patch("7", false, None, Some("true"));
    assert_eq!(
        p[1],
        json!({"op": "add", "path": "/metadata/labels", "value": {VERIFIED_LABEL: "true"}})
    );
}

#[test]
fn registration_patch_adds_taint_and_label() {
    let node = json!({
        "metadata": {"name": "n1", "labels": {"kubernetes.io/hostname": "n1"}},
        "spec": {}
    });
    let ops = node_registration_patch(&node, &key(), TaintEffect::NoSchedule, Mode::Enforce);
    assert_eq!(
        ops,
        vec![
            json!({"op":"add","path":"/metadata/labels/meshgate.io~1cni-verified","value":"false"}),
            json!({"op":"add","path":"/spec/taints","value":[{"key":TAINT_KEY,"effect":"NoSchedule"}]}),
        ]
    );
}

#[test]
fn registration_patch_appends_to_existing_taints_and_builds_missing_maps() {
    let node = json!({
        "metadata": {"name": "n1"},
        "spec": {"taints": [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]}
    });
    let ops = node_registration_patch(&node, &key(), TaintEffect::NoSchedule, Mode::Enforce);
    assert_eq!(
        ops,
        vec![
            json!({"op":"add","path":"/metadata/labels","value":{VERIFIED_LABEL:"false"}}),
            json!({"op":"add","path":"/spec/taints/-","value":{"key":TAINT_KEY,"effect":"NoSchedule"}}),
        ]
    );
    let bare = json!({});
    let ops = node_registration_patch(&bare, &key(), TaintEffect::NoExecute, Mode::Enforce);
    assert_eq!(
        ops,
        vec![
            json!({"op":"add","path":"/metadata","value":{"labels":{VERIFIED_LABEL:"false"}}}),
            json!({"op":"add","path":"/spec","value":{"taints":[{"key":TAINT_KEY,"effect":"NoExecute"}]}}),
        ]
    );
}

#[test]
fn registration_patch_never_duplicates_the_taint_and_overrides_a_claimed_label() {
    // kubelet --register-with-taints already set it (with another effect): keep theirs.
    let node = json!({
        "metadata": {"labels": {VERIFIED_LABEL: "true"}},
        "spec": {"taints": [{"key": TAINT_KEY, "effect": "NoExecute"}]}
    });
    let ops = node_registration_patch(&node, &key(), TaintEffect::NoSchedule, Mode::Enforce);
    assert_eq!(
        ops,
        vec![
            json!({"op":"add","path":"/metadata/labels/meshgate.io~1cni-verified","value":"false"})
        ]
    );
    let gated = json!({
        "metadata": {"labels": {VERIFIED_LABEL: "false"}},
        "spec": {"taints": [{"key": TAINT_KEY, "effect": "NoSchedule"}]}
    });
    assert!(
        node_registration_patch(&gated, &key(), TaintEffect::NoSchedule, Mode::Enforce).is_empty()
    );
}

#[test]
fn taint_keys_are_kubernetes_qualified_names() {
    assert_eq!(TaintKey::default().as_str(), DEFAULT_TAINT_KEY);
    for good in [
        DEFAULT_TAINT_KEY,
        LEGACY_TAINT_KEY,
        "startup-taint.cluster-autoscaler.kubernetes.io/meshgate-cni-unverified",
        "ignore-taint.cluster-autoscaler.kubernetes.io/mesh",
        "mesh-not-ready",
        "a/B.c_d-9",
        "x",
    ] {
        let k: TaintKey = good.parse().unwrap_or_else(|e| panic!("{good}: {e}"));
        assert_eq!(k.to_string(), good);
    }
    let long_prefix = format!("{}/n", vec!["a".repeat(63); 4].join("."));
    assert_eq!(long_prefix.len(), 257);
    let long_name = format!("p.io/{}", "n".repeat(64));
    type Variant = fn(String) -> InvalidTaintKey;
    let cases: [(&str, Variant); 11] = [
        ("", InvalidTaintKey::EmptyName),
        ("a/b/c", InvalidTaintKey::TooManySlashes),
        ("/name", InvalidTaintKey::EmptyPrefix),
        (&long_prefix, InvalidTaintKey::PrefixTooLong),
        ("Example.com/x", InvalidTaintKey::BadPrefix),
        ("example..com/x", InvalidTaintKey::BadPrefix),
        ("-example.com/x", InvalidTaintKey::BadPrefix),
        ("example.com/", InvalidTaintKey::EmptyName),
        (&long_name, InvalidTaintKey::NameTooLong),
        ("example.com/-x", InvalidTaintKey::BadName),
        ("example.com/x y", InvalidTaintKey::BadName),
    ];
    for (bad, want) in cases {
        assert_eq!(
            bad.parse::<TaintKey>(),
            Err(want(bad.to_owned())),
            "{bad:?}"
        );
    }
    let n63 = format!("p.io/{}", "n".repeat(63));
    assert!(n63.parse::<TaintKey>().is_ok());
    let p253 = format!(
        "{}/n",
        [
            "a".repeat(63),
            "a".repeat(63),
            "a".repeat(63),
            "a".repeat(61)
        ]
        .join(".")
    );
    assert!(
        p253.parse::<TaintKey>().is_ok(),
        "a 253-byte prefix is allowed"
    );
    let msg = "a/b/c".parse::<TaintKey>().unwrap_err().to_string();
    assert!(
        msg.contains("\"a/b/c\"") && msg.contains("[prefix/]name"),
        "{msg}"
    );
}

#[test]
fn a_custom_key_gates_and_the_keys_it_supersedes_are_removed() {
    let custom: TaintKey = "example.com/mesh-not-ready".parse().unwrap();
    assert_eq!(
        custom.superseded().collect::<Vec<_>>(),
        [LEGACY_TAINT_KEY, DEFAULT_TAINT_KEY]
    );
    assert_eq!(key().superseded().collect::<Vec<_>>(), [LEGACY_TAINT_KEY]);

    // A node gated by an older release (legacy key) and by the default key: the agent with
    // the custom key gates with its own key only, keeping every other taint.
    let other = taint("dedicated", "NoExecute");
    let before = vec![
        taint(LEGACY_TAINT_KEY, "NoSchedule"),
        other.clone(),
        taint(DEFAULT_TAINT_KEY, "NoSchedule"),
    ];
    let gated = plan_taints(&before, false, &custom, TaintEffect::NoSchedule, T).unwrap();
    assert_eq!(gated, [other.clone(), taint(custom.as_str(), "NoSchedule")]);
    assert_eq!(
        plan_taints(&gated, false, &custom, TaintEffect::NoSchedule, T),
        None
    );
    let open = plan_taints(&before, true, &custom, TaintEffect::NoSchedule, T).unwrap();
    assert_eq!(open, std::slice::from_ref(&other));

    // Upgrade: the default key's agent removes the legacy taint even when already verified.
    let upgraded = vec![taint(LEGACY_TAINT_KEY, "NoSchedule"), other.clone()];
    assert_eq!(
        plan_taints(&upgraded, true, &key(), TaintEffect::NoSchedule, T).unwrap(),
        std::slice::from_ref(&other)
    );
    let regated = plan_taints(&upgraded, false, &key(), TaintEffect::NoSchedule, T).unwrap();
    assert_eq!(regated, [other, taint(DEFAULT_TAINT_KEY, "NoSchedule")]);
}

#[test]
fn registration_uses_the_configured_key() {
    let custom: TaintKey = "example.com/mesh-not-ready".parse().unwrap();
    // kubelet registered with the legacy key: the new key is added beside it (the agent
    // removes the legacy one).
    let node = json!({
        "metadata": {"labels": {VERIFIED_LABEL: "false"}},
        "spec": {"taints": [{"key": LEGACY_TAINT_KEY, "effect": "NoSchedule"}]}
    });
    assert_eq!(
        node_registration_patch(&node, &custom, TaintEffect::NoSchedule, Mode::Enforce),
        vec![
            json!({"op":"add","path":"/spec/taints/-","value":{"key":"example.com/mesh-not-ready","effect":"NoSchedule"}})
        ]
    );
    let gated = json!({
        "metadata": {"labels": {VERIFIED_LABEL: "false"}},
        "spec": {"taints": [{"key": "example.com/mesh-not-ready", "effect": "NoSchedule"}]}
    });
    assert!(
        node_registration_patch(&gated, &custom, TaintEffect::NoSchedule, Mode::Enforce).is_empty()
    );
    assert_eq!(
        node_registration_patch(&gated, &key(), TaintEffect::NoSchedule, Mode::Enforce).len(),
        1,
        "the default key is not the custom one"
    );
}

#[test]
fn the_untaint_latency_is_appended_and_read_back() {
    let ok = plan_event(
        None,
        &verdict(Reason::Verified, "10-calico.conflist chains it"),
        Mode::Enforce,
    )
    .unwrap();
    let ev = ok.with_untaint_latency(Duration::from_micros(183_900));
    assert_eq!(
        ev.note,
        "Verified: 10-calico.conflist chains it [untaint latency: 183 ms]"
    );
    assert_eq!(untaint_latency(&ev.note), Some(Duration::from_millis(183)));
}

#[test]
fn a_long_note_is_cut_before_the_latency_so_the_latency_always_fits() {
    let long = verdict(Reason::Verified, &"é".repeat(2000));
    let ev = plan_event(None, &long, Mode::Enforce)
        .unwrap()
        .with_untaint_latency(Duration::from_secs(3600));
    assert!(
        ev.note.len() <= crate::EVENT_NOTE_MAX_BYTES,
        "{}",
        ev.note.len()
    );
    assert!(
        ev.note.ends_with("é… [untaint latency: 3600000 ms]"),
        "{}",
        ev.note
    );
    assert_eq!(untaint_latency(&ev.note), Some(Duration::from_secs(3600)));
}

#[test]
fn a_note_without_the_latency_form_has_none() {
    for note in [
        "Verified: ok",
        "Verified: ok [untaint latency:  ms]",
        "Verified: ok [untaint latency: -3 ms]",
        "Verified: ok [untaint latency: 12 ms] and more",
        "Verified: ok [untaint latency: 99999999999999999999999 ms]",
    ] {
        assert_eq!(untaint_latency(note), None, "{note}");
    }
}

/// A Node with `taints` and meshgate's label saying `label`.
fn node_with(taints: &[Taint], label: &str) -> Node {
    serde_json::from_value(json!({
        "metadata": {"name": "n1", "resourceVersion": "5", "labels": {VERIFIED_LABEL: label}},
        "spec": {"taints": taints},
    }))
    .unwrap()
}

#[test]
fn report_mode_removes_meshgates_taint_and_never_adds_it() {
    let ours = taint(TAINT_KEY, "NoSchedule");
    let other = taint("example.com/maintenance", "NoSchedule");
    let (e, p) = (TaintEffect::NoSchedule, TaintPolicy::RemoveOnly);
    // Unverified, untainted: the label says so, no taint is planned.
    let plan = plan_metadata(
        &node_with(std::slice::from_ref(&other), "true"),
        false,
        &key(),
        e,
        p,
        T,
    )
    .unwrap();
    assert_eq!((plan.taints, plan.label), (None, Some("false")));
    // Unverified, tainted from enforce: the taint goes, the other stays.
    let tainted = node_with(&[other.clone(), ours.clone()], "false");
    let plan = plan_metadata(&tainted, false, &key(), e, p, T).unwrap();
    assert_eq!(plan.taints, Some(vec![other.clone()]));
    assert_eq!(plan.label, None);
    // Nothing of ours, label right: nothing to write.
    assert_eq!(
        plan_metadata(&node_with(&[other], "false"), false, &key(), e, p, T),
        None
    );
}

#[test]
fn condition_only_mode_never_touches_a_taint_under_any_key() {
    let ours = taint(TAINT_KEY, "NoSchedule");
    let (e, p) = (TaintEffect::NoSchedule, TaintPolicy::Leave);
    for (taints, verified) in [
        (vec![], false),
        (vec![ours.clone()], true),
        (vec![ours.clone()], false),
        (vec![taint(TAINT_KEY, "NoExecute")], false),
    ] {
        let label = if verified { "false" } else { "true" };
        let plan = plan_metadata(&node_with(&taints, label), verified, &key(), e, p, T).unwrap();
        assert_eq!(plan.taints, None, "{taints:?} verified={verified}");
        assert!(plan.label.is_some(), "the label still follows the verdict");
    }
}

#[test]
fn the_events_say_what_the_mode_does() {
    let missing = verdict(Reason::ChainedPluginMissing, "a");
    let ok = verdict(Reason::Verified, "ok");
    let ev = plan_event(None, &missing, Mode::Report).unwrap();
    assert_eq!(
        (ev.reason, ev.action),
        (event_reason::CHAIN_UNVERIFIED, "WouldTaint")
    );
    assert!(
        ev.note
            .starts_with("report mode, would taint: ChainedPluginMissing: "),
        "{}",
        ev.note
    );
    let ev = plan_event(None, &ok, Mode::Report).unwrap();
    assert_eq!(ev.action, "Untaint");
    for v in [&missing, &ok] {
        let ev = plan_event(None, v, Mode::ConditionOnly).unwrap();
        assert_eq!(ev.action, "SetCondition");
        assert!(!ev.note.contains("taint"), "{}", ev.note);
    }
    assert_eq!(
        plan_event(None, &missing, Mode::Enforce).unwrap().action,
        "Taint"
    );
}

#[test]
fn registration_taints_only_in_enforce_and_labels_in_every_mode() {
    let node = json!({"metadata": {"name": "n1", "labels": {}}, "spec": {}});
    let label =
        json!({"op":"add","path":"/metadata/labels/meshgate.io~1cni-verified","value":"false"});
    for mode in [Mode::Report, Mode::ConditionOnly] {
        assert_eq!(
            node_registration_patch(&node, &key(), TaintEffect::NoSchedule, mode),
            vec![label.clone()],
            "{mode}"
        );
    }
    let enforce = node_registration_patch(&node, &key(), TaintEffect::NoSchedule, Mode::Enforce);
    assert_eq!(enforce.len(), 2);
    assert_eq!(enforce[0], label);
}
