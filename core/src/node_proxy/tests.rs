use super::*;
use crate::cni::Runtime;

fn chain(reason: Reason) -> ChainVerdict {
    ChainVerdict {
        verified: reason == Reason::Verified,
        reason,
        message: "/etc/cni/net.d/10-calico.conflist: chain ok".into(),
        config_file: Some("/etc/cni/net.d/10-calico.conflist".into()),
        plugins: vec!["calico".into(), "istio-cni".into()],
        runtime: Runtime::Containerd,
        delegate: None,
    }
}

fn pod(name: &str, ready: bool, deleting: bool) -> ProxyPod {
    ProxyPod {
        name: name.into(),
        ready,
        deleting,
    }
}

fn seen(pods: Option<Vec<ProxyPod>>, socket: SocketSeen) -> Observed {
    Observed { pods, socket }
}

#[test]
fn a_ready_ztunnel_with_its_socket_keeps_the_chain_verified() {
    let v = judge(
        chain(Reason::Verified),
        &ztunnel(),
        &seen(
            Some(vec![pod("ztunnel-abc", true, false)]),
            SocketSeen::Socket,
        ),
    );
    assert!(v.verified);
    assert_eq!(v.reason, Reason::Verified);
    assert!(
        v.message.ends_with(
            "; ztunnel ready: pod istio-system/ztunnel-abc, socket /var/run/ztunnel/ztunnel.sock"
        ),
        "{}",
        v.message
    );
    assert_eq!(
        v.config_file.as_deref(),
        Some("/etc/cni/net.d/10-calico.conflist")
    );
}

#[test]
fn each_missing_piece_is_node_proxy_not_ready_and_named() {
    let ready = || Some(vec![pod("ztunnel-abc", true, false)]);
    let table: Vec<(Observed, &str)> = vec![
        (
            seen(None, SocketSeen::Socket),
            "its pods (app=ztunnel in istio-system) are not listed yet",
        ),
        (
            seen(Some(Vec::new()), SocketSeen::Socket),
            "no pod app=ztunnel in istio-system on this node",
        ),
        (
            seen(
                Some(vec![pod("ztunnel-abc", false, false)]),
                SocketSeen::Socket,
            ),
            "pod istio-system/ztunnel-abc is not Ready",
        ),
        (
            seen(
                Some(vec![pod("ztunnel-abc", true, true)]),
                SocketSeen::Socket,
            ),
            "pod istio-system/ztunnel-abc is being deleted",
        ),
        (
            seen(ready(), SocketSeen::Missing),
            "its socket /var/run/ztunnel/ztunnel.sock is missing",
        ),
        (
            seen(ready(), SocketSeen::NotASocket("a regular file")),
            "/var/run/ztunnel/ztunnel.sock is a regular file, not a socket",
        ),
        (
            seen(ready(), SocketSeen::Unreadable("permission denied".into())),
            "its socket /var/run/ztunnel/ztunnel.sock cannot be examined: permission denied",
        ),
    ];
    for (observed, want) in table {
        let v = judge(chain(Reason::Verified), &ztunnel(), &observed);
        assert!(!v.verified, "{observed:?}");
        assert_eq!(v.reason, Reason::NodeProxyNotReady, "{observed:?}");
        assert_eq!(
            v.message,
            format!("the CNI chain is verified, but ztunnel is not ready on this node: {want}"),
        );
    }
}

#[test]
fn both_missing_are_both_named_and_many_pods_are_bounded() {
    let pods = (0..5)
        .map(|i| pod(&format!("z{i}"), false, false))
        .collect();
    let v = judge(
        chain(Reason::Verified),
        &ztunnel(),
        &seen(Some(pods), SocketSeen::Missing),
    );
    assert_eq!(
        v.message,
        "the CNI chain is verified, but ztunnel is not ready on this node: pod istio-system/z0 is not Ready, pod istio-system/z1 is not Ready, pod istio-system/z2 is not Ready (and 2 more); its socket /var/run/ztunnel/ztunnel.sock is missing"
    );
}

#[test]
fn one_ready_pod_among_others_is_enough() {
    let pods = vec![pod("old", false, true), pod("new", true, false)];
    let v = judge(
        chain(Reason::Verified),
        &ztunnel(),
        &seen(Some(pods), SocketSeen::Socket),
    );
    assert!(v.verified, "{}", v.message);
}

#[test]
fn an_unverified_chain_keeps_its_own_reason() {
    let c = chain(Reason::ChainedPluginMissing);
    let v = judge(c.clone(), &ztunnel(), &seen(None, SocketSeen::Missing));
    assert_eq!(v, c);
}

#[test]
fn only_a_named_profile_with_a_node_proxy_is_a_requirement() {
    let all = ProfileSet::all_builtin();
    // The default (no --profile): every built-in, no node proxy required.
    assert_eq!(required(&all, &[]), Ok(None));
    // Profiles without a node proxy.
    assert_eq!(
        required(&all, &["linkerd".into(), "istio".into()]),
        Ok(None)
    );
    let got = required(&all, &["linkerd".into(), "istio-ambient".into()])
        .unwrap()
        .unwrap();
    assert_eq!(got.name, "istio-ambient");
    assert_eq!(got.node_proxy, Some(ztunnel()));

    let custom = r#"[{"name":"kuma","selector":{"labels":{"a":""}},"pluginType":"kuma-cni","inboundPort":1,"outboundPort":2,
        "nodeProxy":{"name":"kp","namespace":"kuma","labels":{"app":"kp"},"socket":"/run/kp.sock"}}]"#;
    let set = ProfileSet::all_builtin().with_custom_json(custom).unwrap();
    assert_eq!(
        required(&set, &["istio-ambient".into(), "kuma".into()]),
        Err(NodeProxyError::TwoProxies(
            "istio-ambient".into(),
            "kuma".into()
        ))
    );
    assert_eq!(
        required(&set, &["kuma".into()]).unwrap().unwrap().name,
        "kuma"
    );
}

#[test]
fn a_custom_node_proxy_record_is_checked() {
    for (bad, why) in [
        (
            r#""name":"","namespace":"k","labels":{"a":"b"},"socket":"/s""#,
            "name",
        ),
        (
            r#""name":"k","namespace":"K S","labels":{"a":"b"},"socket":"/s""#,
            "namespace",
        ),
        (
            r#""name":"k","namespace":"k","labels":{},"socket":"/s""#,
            "labels",
        ),
        (
            r#""name":"k","namespace":"k","labels":{"a":"b"},"socket":"s""#,
            "socket",
        ),
    ] {
        let text = format!(
            r#"[{{"name":"x","selector":{{"labels":{{"a":""}}}},"pluginType":"x","inboundPort":1,"outboundPort":2,"nodeProxy":{{{bad}}}}}]"#
        );
        let err = ProfileSet::all_builtin()
            .with_custom_json(&text)
            .unwrap_err();
        assert!(err.to_string().contains(why), "{err}");
    }
}

#[test]
fn labels_parse_as_the_flag_takes_them() {
    assert_eq!(
        parse_labels("app=ztunnel, tier=node"),
        Ok(BTreeMap::from([
            ("app".into(), "ztunnel".into()),
            ("tier".into(), "node".into())
        ]))
    );
    assert!(parse_labels("app").is_err());
    assert!(parse_labels("=x").is_err());
    assert!(parse_labels("").is_err());
    assert_eq!(ztunnel().label_selector(), "app=ztunnel");
}
