use super::*;
use crate::daemon::pods::slim::SlimPod;
use k8s_openapi::api::core::v1::Pod;
use meshgate_core::projection::PodKeys;
use std::net::IpAddr;

fn pod(json: serde_json::Value) -> Pod {
    serde_json::from_value(json).expect("pod json")
}

fn meshed(name: &str, ip: &str) -> Pod {
    pod(serde_json::json!({
        "metadata": {
            "namespace": "ns", "name": name, "uid": format!("uid-{name}"),
            "labels": { "linkerd.io/control-plane-ns": "linkerd" },
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs",
                "uid": "rs-uid", "controller": true
            }]
        },
        "spec": { "containers": [{ "name": "app" }] },
        "status": {
            "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }],
            "containerStatuses": [{
                "name": "app", "image": "x", "imageID": "", "ready": true,
                "restartCount": 0
            }]
        }
    }))
}

fn info(p: &Pod) -> PodInfo {
    // The namespace is known and carries no mesh label.
    info_in(p, &ProfileSet::all_builtin(), Some(&BTreeMap::new())).expect("identity")
}

/// [`PodInfo::from_pod`] with the keys `profiles` read, of `p` as the watch decodes it.
fn info_in(
    p: &Pod,
    profiles: &ProfileSet,
    namespace_labels: Option<&BTreeMap<String, String>>,
) -> Option<PodInfo> {
    let slim: SlimPod = serde_json::from_str(&serde_json::to_string(p).unwrap()).unwrap();
    PodInfo::from_pod(
        &slim,
        profiles,
        &PodKeys::inspection(profiles),
        namespace_labels,
    )
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn listed(pods: &[&Pod]) -> Tracker {
    let mut t = Tracker::new();
    t.start_list();
    for p in pods {
        t.apply(info(p), secs(0));
    }
    t.finish_list();
    t
}

fn due_names(t: &Tracker, now: Duration) -> Vec<String> {
    t.due(now).into_iter().map(|d| d.info.name).collect()
}

fn inspect_all(t: &mut Tracker, now: Duration) {
    for d in t.due(now) {
        t.inspected(&d);
    }
}

#[test]
fn pod_is_read_into_the_inspector_inputs() {
    let mut p = meshed("a", "10.1.0.5");
    let status = p.status.as_mut().unwrap();
    status.pod_ips = Some(vec![
        serde_json::from_value(serde_json::json!({"ip": "fd00::5"})).unwrap(),
        serde_json::from_value(serde_json::json!({"ip": "10.1.0.5"})).unwrap(),
        serde_json::from_value(serde_json::json!({"ip": "not-an-ip"})).unwrap(),
    ]);
    status.container_statuses.as_mut().unwrap()[0].restart_count = 2;
    let i = info(&p);
    assert_eq!(i.key(), "ns/a");
    assert_eq!(i.uid, "uid-a");
    assert_eq!(i.profiles, ["linkerd"]);
    assert!(i.owned && i.running && !i.terminating && !i.host_network);
    assert_eq!(
        i.ips,
        [
            "10.1.0.5".parse::<IpAddr>().unwrap(),
            "fd00::5".parse().unwrap()
        ]
    );
    assert_eq!(i.sandbox(), "10.1.0.5,fd00::5#2");
    assert!(i.inspectable());

    // Only the singular podIP: still read.
    let mut p = meshed("b", "10.1.0.6");
    p.status.as_mut().unwrap().pod_ips = None;
    assert_eq!(info(&p).ips, ["10.1.0.6".parse::<IpAddr>().unwrap()]);

    // An owner that is not the controller does not count.
    let mut p = meshed("c", "10.1.0.7");
    p.metadata.owner_references.as_mut().unwrap()[0].controller = Some(false);
    assert!(!info(&p).owned);

    // No identity, no info.
    let mut p = meshed("d", "10.1.0.8");
    p.metadata.uid = None;
    assert_eq!(info_in(&p, &ProfileSet::all_builtin(), None), None);
}

#[test]
fn only_running_selected_pods_with_their_own_netns_are_inspected() {
    let ok = meshed("ok", "10.1.0.1");
    let mut plain = meshed("plain", "10.1.0.2");
    plain.metadata.labels = None;
    let mut host = meshed("host", "10.1.0.3");
    host.spec.as_mut().unwrap().host_network = Some(true);
    let mut pending = meshed("pending", "10.1.0.4");
    pending.status.as_mut().unwrap().phase = Some("Pending".into());
    let mut no_ip = meshed("noip", "10.1.0.5");
    no_ip.status.as_mut().unwrap().pod_ip = None;
    no_ip.status.as_mut().unwrap().pod_ips = None;
    let mut deleting = meshed("deleting", "10.1.0.6");
    deleting.metadata.deletion_timestamp =
        Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
        ));
    let t = listed(&[&ok, &plain, &host, &pending, &no_ip, &deleting]);
    // Unselected and hostNetwork pods are not even kept.
    assert_eq!(t.len(), 4);
    assert_eq!(due_names(&t, secs(1)), ["ok"]);
}

#[test]
fn nothing_is_due_before_the_first_full_list() {
    let mut t = Tracker::new();
    t.start_list();
    t.apply(info(&meshed("a", "10.1.0.1")), secs(0));
    assert!(t.due(secs(0)).is_empty());
    t.finish_list();
    assert_eq!(due_names(&t, secs(0)), ["a"]);
}

#[test]
fn inspected_once_then_again_on_sandbox_or_verdict_change() {
    let a = meshed("a", "10.1.0.1");
    let mut t = listed(&[&a]);
    inspect_all(&mut t, secs(1));
    assert!(t.due(secs(2)).is_empty(), "inspected once");

    // A status update that changes nothing about the sandbox: not due.
    let mut same = a.clone();
    same.status.as_mut().unwrap().conditions = Some(vec![]);
    t.apply(info(&same), secs(3));
    assert!(t.due(secs(3)).is_empty());

    // Restart count moves: the sandbox may have been recreated.
    let mut restarted = a.clone();
    restarted
        .status
        .as_mut()
        .unwrap()
        .container_statuses
        .as_mut()
        .unwrap()[0]
        .restart_count = 1;
    t.apply(info(&restarted), secs(4));
    assert_eq!(due_names(&t, secs(4)), ["a"]);
    inspect_all(&mut t, secs(4));

    // New IP: new sandbox.
    t.apply(info(&meshed("a", "10.1.0.9")), secs(5));
    assert_eq!(due_names(&t, secs(5)), ["a"]);
    inspect_all(&mut t, secs(5));
    assert!(t.due(secs(6)).is_empty());

    // The node's verdict changes: everything again, once.
    t.verdict_changed();
    assert_eq!(due_names(&t, secs(7)), ["a"]);
    inspect_all(&mut t, secs(7));
    assert!(t.due(secs(8)).is_empty());
}

#[test]
fn a_verdict_change_during_an_inspection_is_not_lost() {
    let mut t = listed(&[&meshed("a", "10.1.0.1")]);
    let batch = t.due(secs(1));
    t.verdict_changed();
    for d in batch {
        t.inspected(&d);
    }
    assert_eq!(due_names(&t, secs(2)), ["a"]);
}

#[test]
fn refusals_back_off_and_a_new_sandbox_resets() {
    let mut t = listed(&[&meshed("a", "10.1.0.1")]);
    inspect_all(&mut t, secs(0));
    assert_eq!(t.back_off("uid-a", secs(10)), Some(secs(2)));
    assert_eq!(t.next_retry(secs(10)), Some(secs(12)));
    assert!(t.due(secs(11)).is_empty());
    assert_eq!(due_names(&t, secs(12)), ["a"]);
    inspect_all(&mut t, secs(12));
    assert_eq!(t.next_retry(secs(12)), None, "inspection clears the retry");
    assert_eq!(t.back_off("uid-a", secs(12)), Some(secs(4)));
    assert_eq!(t.back_off("uid-a", secs(12)), Some(secs(8)));
    for _ in 0..10 {
        t.back_off("uid-a", secs(12));
    }
    assert_eq!(t.back_off("uid-a", secs(12)), Some(RETRY_MAX));

    // A new sandbox starts over.
    t.apply(info(&meshed("a", "10.1.0.2")), secs(13));
    inspect_all(&mut t, secs(13));
    assert_eq!(t.back_off("uid-a", secs(13)), Some(secs(2)));

    // Redirects found: the slate is clean.
    t.settled("uid-a");
    assert_eq!(t.next_retry(secs(14)), None);
    assert_eq!(t.back_off("uid-a", secs(14)), Some(secs(2)));
}

#[test]
fn unknown_is_retried_a_few_times_only() {
    let mut t = listed(&[&meshed("a", "10.1.0.1")]);
    let mut now = secs(0);
    let mut retries = 0;
    loop {
        inspect_all(&mut t, now);
        match t.unknown("uid-a", now) {
            Some(d) => {
                retries += 1;
                now += d;
                assert_eq!(due_names(&t, now), ["a"]);
            }
            None => break,
        }
    }
    assert_eq!(retries, MAX_UNKNOWN_RETRIES);
    assert!(t.due(now + RETRY_MAX).is_empty());
}

#[test]
fn rate_limited_pods_retry_when_the_token_frees_up_oldest_first() {
    let mut t = Tracker::new();
    t.start_list();
    t.apply(info(&meshed("late", "10.1.0.2")), secs(5));
    t.apply(info(&meshed("early", "10.1.0.1")), secs(1));
    t.finish_list();
    assert_eq!(due_names(&t, secs(6)), ["early", "late"]);
    inspect_all(&mut t, secs(6));
    t.retry_at("uid-late", secs(60));
    assert_eq!(t.next_retry(secs(6)), Some(secs(60)));
    assert_eq!(due_names(&t, secs(60)), ["late"]);
}

#[test]
fn a_relist_forgets_pods_that_are_gone_and_keeps_the_rest() {
    let mut t = listed(&[&meshed("a", "10.1.0.1"), &meshed("b", "10.1.0.2")]);
    inspect_all(&mut t, secs(0));
    t.start_list();
    t.apply(info(&meshed("a", "10.1.0.1")), secs(5));
    t.finish_list();
    assert_eq!(t.uids(), BTreeSet::from(["uid-a".to_string()]));
    assert!(
        t.due(secs(5)).is_empty(),
        "a was inspected before the relist"
    );
    t.delete("uid-a");
    assert!(t.is_empty());
}

#[test]
fn a_pod_that_loses_its_mesh_label_is_dropped() {
    let mut t = listed(&[&meshed("a", "10.1.0.1")]);
    let mut p = meshed("a", "10.1.0.1");
    p.metadata.labels = None;
    t.apply(info(&p), secs(1));
    assert!(t.is_empty());
}

#[test]
fn each_outcome_is_published_once_per_sandbox() {
    let mut t = listed(&[&meshed("a", "10.1.0.1")]);
    assert!(t.should_publish("uid-a", "s1", "DryRun"));
    assert!(!t.should_publish("uid-a", "s1", "DryRun"));
    assert!(t.should_publish("uid-a", "s1", "Evict"));
    assert!(t.should_publish("uid-a", "s2", "Evict"));
    assert!(!t.should_publish("uid-gone", "s1", "Evict"));
}

/// A pod as Istio's ambient mode meets it: no mesh label of its own, enrolled by its
/// namespace's `istio.io/dataplane-mode=ambient`.
fn ambient_candidate(name: &str, ip: &str) -> Pod {
    let mut p = meshed(name, ip);
    p.metadata.labels = Some(BTreeMap::from([("app".to_string(), "web".to_string())]));
    p
}

/// An operator labels a namespace `istio.io/dataplane-mode=ambient` (or a running pod):
/// Istio enrolls its running pods asynchronously, so they are left alone for
/// ENROLL_GRACE instead of being inspected (and evicted as `missing`) at once.
#[test]
fn running_pods_enrolled_by_a_label_change_get_time_to_be_enrolled() {
    let set = ProfileSet::all_builtin();
    let ambient = BTreeMap::from([("istio.io/dataplane-mode".to_string(), "ambient".to_string())]);
    let plain = BTreeMap::new();
    let p = ambient_candidate("a", "10.1.0.1");
    let mut t = Tracker::new();
    t.start_list();
    t.apply(info_in(&p, &set, Some(&plain)).unwrap(), secs(0));
    t.finish_list();
    assert!(t.due(secs(1)).is_empty(), "not meshed yet");

    // The known namespace is labelled at 10 s.
    assert_eq!(
        t.reselect_namespace("ns", &set, Some(&ambient), true, secs(10)),
        1
    );
    assert!(t.due(secs(10)).is_empty());
    assert!(t.due(secs(10) + ENROLL_GRACE - secs(1)).is_empty());
    assert_eq!(
        t.next_retry(secs(10)),
        Some(secs(10) + ENROLL_GRACE),
        "the loop wakes for it"
    );
    let due = t.due(secs(10) + ENROLL_GRACE);
    assert_eq!(due.len(), 1);
    assert_eq!(due[0].info.profiles, ["istio-ambient"]);
    t.inspected(&due[0]);
    assert_eq!(
        t.next_retry(secs(10) + ENROLL_GRACE),
        None,
        "an ended grace does not keep the loop awake"
    );

    // The same through the pod's own label, on a pod of a plain namespace.
    let q = ambient_candidate("b", "10.1.0.2");
    let mut t = Tracker::new();
    t.start_list();
    t.apply(info_in(&q, &set, Some(&plain)).unwrap(), secs(0));
    t.finish_list();
    let mut labelled = q.clone();
    labelled
        .metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert("istio.io/dataplane-mode".into(), "ambient".into());
    t.apply(info_in(&labelled, &set, Some(&plain)).unwrap(), secs(5));
    assert!(t.due(secs(5)).is_empty());
    assert_eq!(t.due(secs(5) + ENROLL_GRACE).len(), 1);
}

/// A linkerd pod whose ambient label is toggled: only istio-ambient waits for its grace;
/// linkerd, which selected the pod all along, is judged at once every time.
#[test]
fn a_label_toggle_postpones_only_the_profile_it_gains() {
    let set = ProfileSet::all_builtin();
    let plain = BTreeMap::new();
    let p = meshed("a", "10.1.0.1");
    let mut ambient = p.clone();
    ambient
        .metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert("istio.io/dataplane-mode".into(), "ambient".into());
    let mut t = listed(&[&p]);
    inspect_all(&mut t, secs(0));
    let mut now = secs(0);
    for _ in 0..10 {
        now += secs(10);
        t.apply(info_in(&ambient, &set, Some(&plain)).unwrap(), now);
        now += secs(10);
        t.verdict_changed();
        let due = t.due(now);
        assert_eq!(due.len(), 1, "at {now:?}");
        assert_eq!(due[0].info.profiles, ["linkerd"], "at {now:?}");
        t.inspected(&due[0]);
        now += secs(5);
        t.apply(info_in(&p, &set, Some(&plain)).unwrap(), now);
    }
    // Left labelled, istio-ambient is judged too once its own grace ends.
    t.apply(info_in(&ambient, &set, Some(&plain)).unwrap(), now);
    assert_eq!(t.next_retry(now), Some(now + ENROLL_GRACE));
    assert!(
        t.due(now + ENROLL_GRACE - secs(1)).is_empty(),
        "linkerd was judged"
    );
    let due = t.due(now + ENROLL_GRACE);
    assert_eq!(due[0].info.profiles, ["linkerd", "istio-ambient"]);
}

#[test]
fn a_namespace_label_selects_its_pods_once_known_and_only_then() {
    let set = ProfileSet::all_builtin();
    let p = ambient_candidate("a", "10.1.0.1");
    let mut t = Tracker::new();
    t.start_list();
    // The namespace's labels are not known yet: kept, not selected, not due.
    let unknown = info_in(&p, &set, None).unwrap();
    assert!(unknown.profiles.is_empty() && unknown.namespace_dependent);
    t.apply(unknown, secs(0));
    t.finish_list();
    assert!(t.is_empty());
    assert!(t.due(secs(1)).is_empty());

    // They arrive: ambient. Selected and due at once.
    let ambient = BTreeMap::from([("istio.io/dataplane-mode".to_string(), "ambient".to_string())]);
    assert_eq!(
        t.reselect_namespace("ns", &set, Some(&ambient), false, secs(2)),
        1
    );
    let due = t.due(secs(2));
    assert_eq!(due.len(), 1);
    assert_eq!(due[0].info.profiles, ["istio-ambient"]);
    assert_eq!(due[0].ready_since, secs(2));
    inspect_all(&mut t, secs(2));
    // Same labels again: nothing changes, nothing due.
    assert_eq!(
        t.reselect_namespace("ns", &set, Some(&ambient), true, secs(3)),
        0
    );
    assert!(t.due(secs(3)).is_empty());
    // Another namespace's change does not touch it.
    assert_eq!(t.reselect_namespace("other", &set, None, false, secs(3)), 0);

    // The namespace drops the label: no longer selected, never inspected again.
    assert_eq!(
        t.reselect_namespace("ns", &set, Some(&BTreeMap::new()), true, secs(4)),
        1
    );
    assert!(t.is_empty() && t.due(secs(5)).is_empty());

    // A pod that opted out (dataplane-mode=none) is not selected by its ambient
    // namespace, and no namespace can change that: it is not even kept.
    let mut out = ambient_candidate("b", "10.1.0.2");
    out.metadata
        .labels
        .as_mut()
        .unwrap()
        .insert("istio.io/dataplane-mode".into(), "none".into());
    let i = info_in(&out, &set, Some(&ambient)).unwrap();
    assert!(i.profiles.is_empty() && !i.namespace_dependent && !i.tracked());

    // With only sidecar profiles, an unlabelled pod is not kept at all.
    let sidecars = set.clone().select(&["linkerd".into()]).unwrap();
    let i = info_in(&p, &sidecars, None).unwrap();
    assert!(!i.tracked());
}

#[test]
fn containers_and_native_sidecars_tell_whether_the_proxy_runs() {
    let set = ProfileSet::all_builtin();
    // Labelled by hand (or injection skipped): no linkerd-proxy.
    let bare = info(&meshed("a", "10.1.0.1"));
    assert_eq!(bare.containers, ["app"]);
    assert!(!bare.has_proxy(&set, "linkerd"));

    // As linkerd's injector writes it: the proxy is a container.
    let mut p = meshed("b", "10.1.0.2");
    p.spec
        .as_mut()
        .unwrap()
        .containers
        .push(serde_json::from_value(serde_json::json!({"name": "linkerd-proxy"})).unwrap());
    assert!(info(&p).has_proxy(&set, "linkerd"));

    // Native sidecar (Kubernetes ≥ 1.29; linkerd's proxy-enable-native-sidecar, Istio's
    // ENABLE_NATIVE_SIDECARS): an init container with restartPolicy Always counts, a
    // plain init container of that name does not (it ran to completion before the pod
    // started).
    let mut p = meshed("c", "10.1.0.3");
    p.spec.as_mut().unwrap().init_containers = Some(vec![
        serde_json::from_value(serde_json::json!({"name": "linkerd-init"})).unwrap(),
        serde_json::from_value(
            serde_json::json!({"name": "linkerd-proxy", "restartPolicy": "Always"}),
        )
        .unwrap(),
    ]);
    assert!(info(&p).has_proxy(&set, "linkerd"));
    p.spec.as_mut().unwrap().init_containers = Some(vec![
        serde_json::from_value(serde_json::json!({"name": "linkerd-proxy"})).unwrap(),
    ]);
    assert!(!info(&p).has_proxy(&set, "linkerd"));

    // Ambient has no proxy container to look for.
    assert!(bare.has_proxy(&set, "istio-ambient"));
}

#[test]
fn annotations_are_kept_for_the_rules_but_not_kubectls_copy() {
    let mut p = meshed("a", "10.1.0.1");
    let fat = "x".repeat(256 * 1024);
    p.metadata.annotations = Some(BTreeMap::from([
        (
            "traffic.sidecar.istio.io/includeInboundPorts".to_string(),
            String::new(),
        ),
        (
            "config.linkerd.io/skip-subnets".to_string(),
            "10.0.0.0/8,0.0.0.0/0".to_string(),
        ),
        (
            "kubectl.kubernetes.io/last-applied-configuration".to_string(),
            fat.clone(),
        ),
        ("example.com/notes".to_string(), fat),
    ]));
    p.metadata
        .labels
        .as_mut()
        .unwrap()
        .insert("team".into(), "payments".into());
    let i = info(&p);
    assert_eq!(
        i.annotations,
        BTreeMap::from([
            (
                "config.linkerd.io/skip-subnets".to_string(),
                "10.0.0.0/8,0.0.0.0/0".to_string()
            ),
            (
                "traffic.sidecar.istio.io/includeInboundPorts".to_string(),
                String::new()
            ),
        ])
    );
    assert_eq!(
        i.labels.keys().collect::<Vec<_>>(),
        ["linkerd.io/control-plane-ns"]
    );
    assert_eq!(i.profiles, ["linkerd"]);
}

#[test]
fn ready_since_marks_the_first_inspectable_sighting() {
    let mut pending = meshed("a", "10.1.0.1");
    pending.status.as_mut().unwrap().phase = Some("Pending".into());
    let mut t = Tracker::new();
    t.start_list();
    t.apply(info(&pending), secs(1));
    t.finish_list();
    t.apply(info(&meshed("a", "10.1.0.1")), secs(7));
    t.apply(info(&meshed("a", "10.1.0.1")), secs(9));
    assert_eq!(t.due(secs(10))[0].ready_since, secs(7));
}
