//! The pod-level half of a node proxy on real namespaces, through the daemon's path (survey
//! → `inspect_one`) and the `inspect` command: an ambient pod whose rules are in place is
//! `redirected` only once ztunnel's listeners (15008, 15006, 15001) are bound inside its
//! netns.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::path::PathBuf;

use meshgate_agent::daemon::pods::sweep::{Job, ProxyCheck, inspect_one};
use meshgate_agent::netns;
use meshgate_core::meshes::istio_ambient::ztunnel;
use meshgate_core::rules::RedirectVerdict;
use meshgate_e2e::sim::netns as netns_sim;

use super::{ISTIO_NFT, Netns, binary, eventually, profile};

fn job(ip: IpAddr, ready: bool) -> Job {
    Job {
        uid: "00000000-0000-0000-0000-000000000000".into(),
        ips: vec![ip],
        annotations: BTreeMap::new(),
        profiles: vec![profile("istio-ambient")],
        node_proxy: Some(ProxyCheck {
            profile: "istio-ambient".into(),
            proxy: ztunnel(),
            ready,
            pods: Vec::new(),
        }),
    }
}

fn inspect(ip: IpAddr, ready: bool) -> (RedirectVerdict, String) {
    let dirs = vec![PathBuf::from(netns::DEFAULT_NETNS_DIR)];
    let (facts, _) = netns::survey(&dirs).expect("survey");
    let got = inspect_one(&facts, &job(ip, ready));
    let i = &got.inspections[0];
    // Held from eviction exactly when listeners are missing while ztunnel is not ready.
    let held = i.verdict == RedirectVerdict::Missing && !ready;
    assert_eq!(got.held.is_some(), held, "{got:?}");
    (i.verdict, i.message.clone())
}

#[test]
fn ztunnels_listeners_in_the_pods_netns_make_an_ambient_pod_redirected() {
    let [a, b, c] = netns_sim::private_subnet();
    let ip = IpAddr::V4(Ipv4Addr::new(a, b, c, 9));
    let ns = Netns::new("ztl");
    ns.addr(&format!("{ip}/24"));
    ns.nft(ISTIO_NFT);

    // istio-cni's rules, but ztunnel has not taken the pod.
    let (v, why) = inspect(ip, true);
    assert_eq!(v, RedirectVerdict::Missing, "{why}");
    assert_eq!(
        why,
        "ztunnel has not taken this pod: no listener on 15008, 15006, 15001 in its netns"
    );
    // ...while ztunnel is not ready on the node: reported missing, held from eviction.
    let (v, why) = inspect(ip, false);
    assert_eq!(v, RedirectVerdict::Missing, "{why}");
    assert!(
        why.ends_with("not evicted while ztunnel is not ready on this node"),
        "{why}"
    );

    // ztunnel opens its listeners inside the pod's netns (one of them IPv6-only: both
    // families are read). The sockets stay in the namespace after the thread returns.
    let bind = |addr: &str| TcpListener::bind(addr).expect("bind in the pod's netns");
    let some = netns::with_netns(&ns.path(), || bind("0.0.0.0:15006")).expect("enter");
    let (v, why) = inspect(ip, true);
    assert_eq!(v, RedirectVerdict::Missing, "{why}");
    assert!(why.contains("no listener on 15008, 15001 in"), "{why}");

    let rest = netns::with_netns(&ns.path(), || (bind("0.0.0.0:15008"), bind("[::]:15001")))
        .expect("enter");
    let (v, why) = inspect(ip, true);
    assert_eq!(v, RedirectVerdict::Redirected, "{why}");
    drop((some, rest));
    let mut last = inspect(ip, true);
    eventually(|| {
        last = inspect(ip, true);
        last.0 == RedirectVerdict::Missing
    });
    assert_eq!(
        last.0,
        RedirectVerdict::Missing,
        "listeners closed: {}",
        last.1
    );
}

/// `meshgate-agent inspect --profile istio-ambient` judges ztunnel's listeners as the daemon
/// does, and says that ztunnel's readiness on the node is not judged.
#[test]
fn the_inspect_command_judges_ztunnels_listeners_and_names_what_it_cannot() {
    let ns = Netns::new("ztb");
    ns.addr("10.244.7.9/24");
    ns.nft(ISTIO_NFT);
    let path = ns.path();
    let path = path.to_str().expect("utf-8 path");
    let run = |p: &str| {
        let (code, out, err) = binary(&[
            "inspect",
            "--netns",
            path,
            "--profile",
            p,
            "--output",
            "json",
        ]);
        let v: serde_json::Value = serde_json::from_str(out.trim())
            .unwrap_or_else(|e| panic!("{e}: stdout {out}\nstderr {err}"));
        (code, v)
    };
    let (code, v) = run("istio-ambient");
    assert_eq!((code, v["verdict"].as_str()), (1, Some("missing")), "{v}");
    assert_eq!(
        v["message"],
        "ztunnel has not taken this pod: no listener on 15008, 15006, 15001 in its netns"
    );
    let not_judged = v["not_judged"].as_array().expect("not_judged");
    assert_eq!(not_judged.len(), 1, "{v}");
    assert!(
        not_judged[0]
            .as_str()
            .is_some_and(|n| n.starts_with("istio-ambient: whether ztunnel is ready on this node")),
        "{v}"
    );

    let bind = |addr: &str| TcpListener::bind(addr).expect("bind in the pod's netns");
    let held = netns::with_netns(&ns.path(), || {
        (
            bind("0.0.0.0:15008"),
            bind("0.0.0.0:15006"),
            bind("0.0.0.0:15001"),
        )
    })
    .expect("enter");
    let (code, v) = run("istio-ambient");
    assert_eq!(
        (code, v["verdict"].as_str()),
        (0, Some("redirected")),
        "{v}"
    );
    assert!(
        v["message"]
            .as_str()
            .is_some_and(|m| m.ends_with("ztunnel listens in the pod's netns")),
        "{v}"
    );
    // The sidecar profile has no node proxy: nothing is left unjudged.
    let (_, v) = run("istio");
    assert_eq!(v["not_judged"], serde_json::json!([]), "{v}");
    drop(held);
}
