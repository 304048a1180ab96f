use super::*;
use crate::cni::Runtime;
use crate::meshes::istio_ambient::ztunnel;
use std::collections::BTreeMap;

fn chain(reason: Reason) -> ChainVerdict {
    ChainVerdict {
        verified: reason == Reason::Verified,
        reason,
        message: "/etc/cni/net.d/10-calico.conflist: chain ok".into(),
        config_file: Some("/etc/cni/net.d/10-calico.conflist".into()),
        plugins: vec!["calico".into(), "istio-cni".into()],
        runtime: Runtime::Containerd,
        delegate: None,
        transient: false,
    }
}

fn pod(name: &str, ready: bool, deleting: bool) -> ProxyPod {
    ProxyPod {
        name: name.into(),
        uid: format!("uid-{name}"),
        ready,
        deleting,
    }
}

/// Connected whenever the socket is there: the (a)/(b) cases; (c) has its own test.
fn seen(pods: Option<Vec<ProxyPod>>, socket: SocketSeen) -> Observed {
    Observed {
        pods,
        socket,
        connection: ConnectionSeen::Connected,
    }
}

const MISSING: &str = "its socket /var/run/ztunnel/ztunnel.sock is missing: the CNI node agent ztunnel connects to does not listen there (istio-cni's node agent does so only in ambient mode)";

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
            "; ztunnel ready: pod istio-system/ztunnel-abc, connected to /var/run/ztunnel/ztunnel.sock"
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
        (seen(ready(), SocketSeen::Missing), MISSING),
        (
            Observed {
                connection: ConnectionSeen::NotConnected,
                ..seen(ready(), SocketSeen::Socket)
            },
            "ztunnel is not connected to /var/run/ztunnel/ztunnel.sock: no established connection on that socket",
        ),
        (
            Observed {
                connection: ConnectionSeen::Unreadable("no answer".into()),
                ..seen(ready(), SocketSeen::Socket)
            },
            "whether ztunnel is connected to /var/run/ztunnel/ztunnel.sock cannot be read: no answer",
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
        format!(
            "the CNI chain is verified, but ztunnel is not ready on this node: pod istio-system/z0 is not Ready, pod istio-system/z1 is not Ready, pod istio-system/z2 is not Ready (and 2 more); {MISSING}"
        )
    );
}

/// (a) × (b) × (c): verified only when all three hold; otherwise every failing one named.
#[test]
fn verified_only_with_a_ready_pod_a_socket_and_a_connection() {
    let pods = [
        (Some(vec![pod("z", true, false)]), None),
        (
            Some(vec![pod("z", false, false)]),
            Some("pod istio-system/z is not Ready"),
        ),
    ];
    let sockets = [
        (SocketSeen::Socket, None),
        (SocketSeen::Missing, Some(MISSING)),
    ];
    let conns = [
        (ConnectionSeen::Connected, None),
        (
            ConnectionSeen::NotConnected,
            Some("ztunnel is not connected"),
        ),
    ];
    for (p, p_why) in &pods {
        for (s, s_why) in &sockets {
            for (c, c_why) in &conns {
                let observed = Observed {
                    pods: p.clone(),
                    socket: s.clone(),
                    connection: c.clone(),
                };
                let v = judge(chain(Reason::Verified), &ztunnel(), &observed);
                // The connection is only read, and so only named, where the socket is.
                let c_why = c_why.filter(|_| *s == SocketSeen::Socket);
                let whys: Vec<&str> = [*p_why, *s_why, c_why].into_iter().flatten().collect();
                assert_eq!(v.verified, whys.is_empty(), "{observed:?}: {}", v.message);
                for why in &whys {
                    assert!(v.message.contains(why), "{observed:?}: {}", v.message);
                }
                if !whys.is_empty() {
                    assert_eq!(v.reason, Reason::NodeProxyNotReady);
                }
            }
        }
    }
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
    let kuma = required(&set, &["kuma".into()]).unwrap().unwrap();
    assert_eq!(kuma.name, "kuma");
    // A custom record without listenPorts judges pods on their rules alone.
    assert!(kuma.node_proxy.as_ref().unwrap().listen_ports.is_empty());
    assert_eq!(ztunnel().listen_ports, vec![15008, 15006, 15001]);
}

#[test]
fn a_custom_node_proxy_record_is_checked() {
    for (bad, why) in [
        (
            r#""name":"","namespace":"k","labels":{"a":"b"},"socket":"/s""#,
            "name",
        ),
        (
            r#""name":"k","namespace":"k","labels":{"a":"b"},"socket":"/s","listenPorts":[0]"#,
            "listenPorts holds port 0",
        ),
        (
            r#""name":"k","namespace":"k","labels":{"a":"b"},"socket":"/s","listenPorts":[1,1]"#,
            "listenPorts lists a port twice",
        ),
        (
            r#""name":"k","namespace":"k","labels":{"a":"b"},"socket":"/s","listenPorts":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]"#,
            "more than 16",
        ),
        (
            r#""name":"k","namespace":"k","labels":{"a":"b"},"socket":"/s","listenPorts":[70000]"#,
            "expected u16",
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
