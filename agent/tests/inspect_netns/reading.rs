//! How a namespace is read: reading creates nothing (no legacy tables), discovery finds each
//! namespace once, the reading thread returns to its own namespace, forged netlink answers
//! from the pod are refused, concurrent rule changes never give a torn read, and an oversized
//! dump (rules or addresses) is `unknown`, never `missing`.

use super::*;

fn legacy_names(pid: u32) -> (String, String) {
    let read =
        |f: &str| std::fs::read_to_string(format!("/proc/{pid}/net/{f}")).unwrap_or_default();
    (read("ip_tables_names"), read("ip6_tables_names"))
}

#[test]
fn reading_never_creates_legacy_tables() {
    let mut ns = Netns::new("pitfall");
    ns.addr("10.244.7.13/24");
    ns.addr("fd00:10:244:7::13/64");
    ns.nft(ISTIO_NFT);
    let pid = ns.spawn_sleeper();
    assert_eq!(legacy_names(pid), (String::new(), String::new()));

    // Library reader, then the binary, by path and by pid.
    assert_eq!(inspect(&ns, "istio").verdict, RedirectVerdict::Redirected);
    let path = ns.path();
    let (code, _, err) = binary(&[
        "inspect",
        "--netns",
        path.to_str().expect("utf-8"),
        "--profile",
        "istio",
    ]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = binary(&["inspect", "--pid", &pid.to_string(), "--profile", "linkerd"]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(
        legacy_names(pid),
        (String::new(), String::new()),
        "inspection created legacy tables in the pod's namespace"
    );

    // Control: the names files do show tables once something queries them, so the check
    // above can fail.
    ns.sh("iptables-legacy -w -t nat -S >/dev/null; ip6tables-legacy -w -t mangle -S >/dev/null");
    let (v4, v6) = legacy_names(pid);
    assert!(v4.lines().any(|l| l == "nat"), "{v4:?}");
    assert!(v6.lines().any(|l| l == "mangle"), "{v6:?}");
    // And now that they exist, the reader reads exactly those (empty) tables.
    let opened = netns::open(&ns.path(), true).expect("open");
    let sockets = opened.rule_sockets().expect("rules requested");
    let names = sockets.legacy_tables();
    assert!(
        names.iter().any(|(_, t)| t.iter().any(|n| n == "nat")),
        "{names:?}"
    );
    assert!(
        names.iter().any(|(_, t)| t.iter().any(|n| n == "mangle")),
        "{names:?}"
    );
    let rs = opened.ruleset().expect("ruleset");
    assert!(rs.tables.iter().any(|t| t.name == "mangle"));
    assert_eq!(legacy_names(pid).0.lines().count(), 1, "still only nat");
}

#[test]
fn discovery_finds_named_and_process_namespaces_once() {
    let mut ns = Netns::new("disc");
    ns.addr("10.244.8.14/24");
    ns.addr("fd00:10:244:8::14/64");
    let pid = ns.spawn_sleeper();
    let other = Netns::new("disc2");
    other.addr("10.244.8.15/24");

    let dirs = vec![PathBuf::from(netns::DEFAULT_NETNS_DIR)];
    let found = netns::discover(&dirs).expect("discover");
    let inode =
        |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).expect("stat"));
    let me = found
        .iter()
        .filter(|r| r.inode == inode(&ns.path()))
        .collect::<Vec<_>>();
    assert_eq!(me.len(), 1, "deduplicated by inode: {found:?}");
    assert_eq!(me[0].path, ns.path(), "the named path is preferred");
    assert!(me[0].pids.contains(&pid), "{:?}", me[0]);
    let host = inode(Path::new("/proc/self/ns/net"));
    assert!(
        found.iter().all(|r| r.inode != host),
        "the host namespace is excluded"
    );

    let (facts, _errors) = netns::survey(&dirs).expect("survey");
    let ip: IpAddr = "fd00:10:244:8::14".parse().expect("ip");
    match locate(&facts, &[ip], Some("00000000-0000-0000-0000-000000000000")) {
        Located::Found(r) => assert_eq!(r.inode, inode(&ns.path())),
        Located::Unknown(why) => panic!("not located: {why}"),
    }
    let other_ip: IpAddr = "10.244.8.15".parse().expect("ip");
    match locate(&facts, &[other_ip], None) {
        Located::Found(r) => assert_eq!(r.path, other.path()),
        Located::Unknown(why) => panic!("not located: {why}"),
    }
    let nowhere: IpAddr = "10.255.255.1".parse().expect("ip");
    assert!(matches!(
        locate(&facts, &[nowhere], None),
        Located::Unknown(_)
    ));
}

#[test]
fn the_thread_returns_to_its_own_namespace() {
    let ns = Netns::new("ret");
    let here = || {
        std::fs::metadata("/proc/thread-self/ns/net")
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
            .expect("stat own netns")
    };
    let before = here();
    let inside = netns::with_netns(&ns.path(), here).expect("enter");
    let target = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(ns.path()).expect("stat"));
    assert_eq!(inside, target);
    assert_eq!(here(), before);
    // Also when the closure panics.
    let path = ns.path();
    let caught = std::panic::catch_unwind(move || {
        let _ = netns::with_netns(&path, || panic!("boom"));
    });
    assert!(caught.is_err());
    assert_eq!(here(), before);
}

/// A process of the pod's namespace (root, so `CAP_NET_ADMIN` there) cannot slip a forged
/// answer (here an early end of dump) into the agent's netlink sockets: they are connected to
/// the kernel, which refuses datagrams from any other socket.
#[test]
fn forged_netlink_answers_from_the_pod_are_refused() {
    use meshgate_agent::netlink::{Bus, Socket};
    use netlink_sys::{Socket as RawSocket, SocketAddr, protocols};
    let ns = Netns::new("forge");
    let (victims, forgers) = netns::with_netns(&ns.path(), || {
        let victims = [Bus::Route, Bus::Netfilter].map(|b| Socket::open(b).expect("open"));
        let forgers = [protocols::NETLINK_ROUTE, protocols::NETLINK_NETFILTER].map(|p| {
            let mut s = RawSocket::new(p).expect("forger socket");
            s.bind_auto().expect("bind");
            s
        });
        (victims, forgers)
    })
    .expect("enter");
    let mut done = [0u8; 20];
    done[0..4].copy_from_slice(&20u32.to_ne_bytes());
    done[4..6].copy_from_slice(&(libc::NLMSG_DONE as u16).to_ne_bytes());
    for (victim, forger) in victims.iter().zip(&forgers) {
        let to = SocketAddr::new(victim.portid(), 0);
        let e = forger
            .send_to(&done, &to, 0)
            .expect_err("a forged datagram was accepted");
        assert_eq!(e.raw_os_error(), Some(libc::ECONNREFUSED), "{e}");
    }
}

#[test]
fn concurrent_rule_changes_never_yield_a_torn_read() {
    let ns = Netns::new("churn");
    ns.addr("10.244.9.16/24");
    ns.nft(ISTIO_NFT);
    let name = ns.name().to_owned();
    // A writer adds and flushes a table in a loop while the reader reads.
    let writer = std::thread::spawn(move || {
        for i in 0..40 {
            let script = format!(
                "nft add table ip churn{i}; nft add chain ip churn{i} c; \
                 nft add rule ip churn{i} c counter; nft delete table ip churn{i}"
            );
            let _ = Command::new("ip")
                .args(["netns", "exec", &name, "sh", "-c", &script])
                .output();
        }
    });
    let opened = netns::open(&ns.path(), true).expect("open");
    let mut reads = 0;
    while !writer.is_finished() {
        let rs = opened
            .ruleset()
            .expect("a consistent read (interrupted dumps are retried)");
        let got = meshgate_core::rules::check_pod(&rs, &profile("istio"), &[], &BTreeMap::new());
        assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
        reads += 1;
    }
    writer.join().expect("writer");
    assert!(reads > 0);
}

#[test]
fn oversized_rule_dumps_are_unknown_never_missing() {
    // 5000 empty chains: past the chain cap (4096).
    let ns = Netns::new("bigchains");
    ns.addr("10.244.17.28/24");
    let mut script = String::from("table ip big {\n");
    for i in 0..5000 {
        script.push_str(&format!("chain c{i} {{ }}\n"));
    }
    script.push('}');
    ns.run_file("nft -f", "nft", &script);
    let got = inspect(&ns, "linkerd");
    assert_eq!(got.verdict, RedirectVerdict::Unknown, "{}", got.message);
    let path = ns.path();
    let (code, out, err) = binary(&[
        "inspect",
        "--netns",
        path.to_str().expect("utf-8"),
        "--profile",
        "linkerd",
        "--output",
        "json",
    ]);
    assert_eq!(code, 2, "stdout: {out}\nstderr: {err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
    assert_eq!(v["verdict"], "unknown");
    assert!(
        v["message"]
            .as_str()
            .is_some_and(|m| m.contains("too large")),
        "{v}"
    );

    // 17000 legacy rules: past the rule cap (16384), also through the legacy reader.
    let ns = Netns::new("bigrules");
    ns.addr("10.244.17.29/24");
    let mut script = String::from("*filter\n-N FILL\n");
    for i in 0..17_000u32 {
        script.push_str(&format!(
            "-A FILL -s 10.{}.{}.0/24 -j RETURN\n",
            i / 256,
            i % 256
        ));
    }
    script.push_str("COMMIT");
    ns.restore("iptables-legacy-restore", &script);
    ns.sh(&linkerd_rules("iptables-legacy", 4143));
    let got = inspect(&ns, "linkerd");
    assert_eq!(got.verdict, RedirectVerdict::Unknown, "{}", got.message);
}

#[test]
fn a_namespace_with_too_many_addresses_is_unknown_never_missing() {
    // One more than the agent reads: the dump stops there, at bounded memory.
    let ns = Netns::new("bigaddrs");
    ns.addr("10.244.17.30/24");
    let extra = netns::addr::MAX_ADDRESSES;
    let mut batch = String::new();
    for i in 0..extra {
        batch.push_str(&format!(
            "addr add 10.99.{}.{}/32 dev eth0\n",
            i / 250,
            i % 250 + 1
        ));
    }
    ns.run_file("ip -batch", "ip", &batch);
    let got = inspect(&ns, "linkerd");
    assert_eq!(got.verdict, RedirectVerdict::Unknown, "{}", got.message);
    assert!(
        got.message
            .contains(&format!("more than {extra} addresses, too many to judge")),
        "{}",
        got.message
    );
    // The daemon's survey cannot read it either: the namespace is an error, its pods are
    // located nowhere (unknown), never judged on a partial address list.
    let dirs = vec![PathBuf::from(netns::DEFAULT_NETNS_DIR)];
    let (facts, errors) = netns::survey(&dirs).expect("survey");
    assert!(
        errors
            .iter()
            .any(|e| e.to_string().contains("too many to judge")),
        "{errors:?}"
    );
    let pod_ip: IpAddr = "10.244.17.30".parse().expect("ip");
    assert!(!facts.iter().any(|f| f.addresses.contains(&pod_ip)));
}
