//! The matcher against the kernel: termination across base chains, real connections under
//! Linkerd's rules reaching the proxy exactly when the matcher says so, and Istio's TPROXY
//! delivering to a transparent listener with or without its fwmark rule.

use super::*;
use crate::meshes::ISTIO_TPROXY_V4;

#[test]
fn termination_across_base_chains_follows_the_kernel() {
    let ns = Netns::new("order");
    ns.addr("10.244.16.27/24");
    ns.sh(&linkerd_rules("iptables-nft", 4143));
    assert_eq!(inspect(&ns, "linkerd").verdict, RedirectVerdict::Redirected);

    // A filter chain ahead of nat PREROUTING that accepts every TCP packet: the next base
    // chain still runs.
    ns.nft(
        "table inet fw {
            chain pre { type filter hook prerouting priority -200; policy accept; meta l4proto tcp accept; }
        }",
    );
    assert_eq!(inspect(&ns, "linkerd").verdict, RedirectVerdict::Redirected);
    // One that drops every TCP packet: nothing after it runs.
    ns.sh("nft flush chain inet fw pre; nft add rule inet fw pre meta l4proto tcp drop");
    let got = inspect(&ns, "linkerd");
    assert_eq!(got.verdict, RedirectVerdict::Missing, "{}", got.message);
    assert!(
        got.message.contains("dropped in inet fw pre"),
        "{}",
        got.message
    );
    // A base chain with `policy drop` and nothing else drops every packet too; one that
    // accepts a port first lets that port through, so it hides nothing.
    ns.sh("nft delete table inet fw");
    ns.nft(
        "table inet fw {
            chain pre { type filter hook prerouting priority -200; policy drop; }
        }",
    );
    assert_eq!(inspect(&ns, "linkerd").verdict, RedirectVerdict::Missing);
    ns.sh("nft add rule inet fw pre tcp dport 8080 accept");
    assert_eq!(inspect(&ns, "linkerd").verdict, RedirectVerdict::Redirected);
    ns.sh("nft delete table inet fw");

    // A native nat chain at -150 that DNATs every TCP connection binds it first: iptables'
    // nat PREROUTING redirect (-100) is never reached.
    ns.nft(
        "table ip kube {
            chain pre { type nat hook prerouting priority -150; policy accept; meta l4proto tcp dnat to 10.96.0.10; }
        }",
    );
    let got = inspect(&ns, "linkerd");
    assert_eq!(got.verdict, RedirectVerdict::Missing, "{}", got.message);
    assert!(
        got.message.contains("NAT binding in ip kube pre"),
        "{}",
        got.message
    );
    assert!(got.outbound.found);
    // Limited to one port, it binds only those connections.
    ns.sh("nft flush chain ip kube pre; nft add rule ip kube pre tcp dport 53 dnat to 10.96.0.10");
    assert_eq!(inspect(&ns, "linkerd").verdict, RedirectVerdict::Redirected);
}

/// Listeners inside a namespace that answer every connection with their name, until dropped.
struct Answerers {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Answerers {
    fn start(ns: &Netns, ports: &[(u16, &'static str)]) -> Self {
        use std::io::Write as _;
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut threads = Vec::new();
        for &(port, name) in ports {
            // A socket belongs to the namespace it was created in, whichever thread uses it.
            let listener = netns::with_netns(&ns.path(), || {
                std::net::TcpListener::bind(("0.0.0.0", port))
            })
            .expect("enter")
            .expect("bind");
            listener.set_nonblocking(true).expect("nonblocking");
            let stop = stop.clone();
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((mut c, _)) => {
                            let _ = c.write_all(name.as_bytes());
                        }
                        Err(_) => std::thread::sleep(std::time::Duration::from_millis(5)),
                    }
                }
            }));
        }
        Self { stop, threads }
    }
}

impl Drop for Answerers {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Connects from inside the namespace to a remote address and returns who answered, or
/// `None` when nobody did (dropped, or sent out unNATed to an address nobody holds).
fn who_answers(ns: &Netns, to: &str) -> Option<String> {
    use std::io::Read as _;
    let to: std::net::SocketAddr = to.parse().expect("address");
    netns::with_netns(&ns.path(), || {
        let mut c =
            std::net::TcpStream::connect_timeout(&to, std::time::Duration::from_millis(700))
                .ok()?;
        c.set_read_timeout(Some(std::time::Duration::from_millis(700)))
            .ok()?;
        let mut s = String::new();
        c.read_to_string(&mut s).ok()?;
        Some(s)
    })
    .expect("enter")
}

/// The kernel decides: a real outbound connection from inside the namespace, under Linkerd's
/// iptables-nft rules plus one competing chain, reaches the proxy port exactly when the
/// matcher says the outbound redirect is reachable. This pins the order semantics (the first
/// NAT binding wins, nat chains run at the nf_nat hook priority whatever their own, accept in
/// one base chain does not stop the next, drop does) to what the kernel does.
#[test]
fn the_matcher_agrees_with_the_kernel_on_real_connections() {
    let ns = Netns::new("kernel");
    ns.addr("10.244.18.30/24");
    ns.sh("ip addr add 10.250.0.1/32 dev lo");
    ns.sh(&linkerd_rules("iptables-nft", 4143));
    let _answer = Answerers::start(&ns, &[(4140, "proxy"), (9000, "other")]);
    let dest = "10.244.18.99:80";
    let cases: &[(&str, &str, bool)] = &[
        ("proxy-init alone", "", true),
        (
            "nat chain at -150 DNATs every TCP connection first",
            "table ip compete {
                chain c { type nat hook output priority -150; policy accept; meta l4proto tcp dnat to 10.250.0.1:9000; }
            }",
            false,
        ),
        (
            "the same DNAT at -50 comes after proxy-init's binding",
            "table ip compete {
                chain c { type nat hook output priority -50; policy accept; meta l4proto tcp dnat to 10.250.0.1:9000; }
            }",
            true,
        ),
        (
            "a redirect elsewhere at -150 binds first too",
            "table ip compete {
                chain c { type nat hook output priority -150; policy accept; meta l4proto tcp redirect to :9000; }
            }",
            false,
        ),
        (
            "accept in a nat chain sets no binding: the next nat chain runs",
            "table ip compete {
                chain c { type nat hook output priority -150; policy accept; meta l4proto tcp accept; }
            }",
            true,
        ),
        (
            "accept in a filter chain ahead: the next base chain runs",
            "table ip compete {
                chain c { type filter hook output priority -200; policy accept; meta l4proto tcp accept; }
            }",
            true,
        ),
        (
            "drop in a filter chain ahead: nothing after runs",
            "table ip compete {
                chain c { type filter hook output priority -150; policy accept; meta l4proto tcp drop; }
            }",
            false,
        ),
        (
            "a nat chain declared at priority 10 still runs inside the nat hook, after -100",
            "table ip compete {
                chain c { type nat hook output priority 10; policy accept; meta l4proto tcp redirect to :9000; }
            }",
            true,
        ),
    ];
    for (what, script, reaches_proxy) in cases {
        if !script.is_empty() {
            ns.nft(script);
        }
        let kernel = who_answers(&ns, dest);
        assert_eq!(
            kernel.as_deref() == Some("proxy"),
            *reaches_proxy,
            "{what}: the kernel sent the connection to {kernel:?}"
        );
        let got = inspect(&ns, "linkerd");
        assert_eq!(
            got.outbound.found, *reaches_proxy,
            "{what}: matcher disagrees with the kernel: {}",
            got.message
        );
        if !script.is_empty() {
            ns.sh("nft delete table ip compete");
        }
    }
}

/// A listener on `0.0.0.0:port` with `IP_TRANSPARENT`, as Envoy's 15006 listener in TPROXY
/// mode: TPROXY only hands connections to transparent sockets.
fn transparent_listener(ns: &Netns, port: u16) -> std::net::TcpListener {
    use std::os::fd::FromRawFd as _;
    netns::with_netns(&ns.path(), || {
        // SAFETY: plain socket(2)/setsockopt(2)/bind(2)/listen(2) on a fresh descriptor that
        // the TcpListener owns from here on; every pointer outlives its call.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0, "socket");
            let listener = std::net::TcpListener::from_raw_fd(fd);
            let one: libc::c_int = 1;
            for (level, opt) in [
                (libc::SOL_SOCKET, libc::SO_REUSEADDR),
                (libc::SOL_IP, libc::IP_TRANSPARENT),
            ] {
                let rc = libc::setsockopt(
                    fd,
                    level,
                    opt,
                    (&one as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
                assert_eq!(rc, 0, "setsockopt {opt}");
            }
            let addr = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: port.to_be(),
                sin_addr: libc::in_addr { s_addr: 0 },
                sin_zero: [0; 8],
            };
            let rc = libc::bind(
                fd,
                (&addr as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            );
            assert_eq!(rc, 0, "bind");
            assert_eq!(libc::listen(fd, 16), 0, "listen");
            listener
        }
    })
    .expect("enter")
}

/// Why meshgate does not require istio-iptables' fwmark `ip rule`: a client in another
/// namespace connects to the pod's own IP under Istio's TPROXY rules, and the kernel hands the
/// connection to the transparent 15006 listener with and without the policy routing (the
/// `local` table already delivers the pod's address locally). The verdict is `redirected` in
/// both cases, and `missing` once the TPROXY rule is gone (then nothing answers).
#[test]
fn tproxy_delivers_without_the_fwmark_rule_and_the_verdict_follows() {
    let pod = Netns::new("tppod");
    let client = Netns::new("tpcli");
    link_pod_and_client(&pod, &client);
    pod.restore("iptables-nft-restore", ISTIO_TPROXY_V4);
    let listener = transparent_listener(&pod, 15006);
    listener.set_nonblocking(true).expect("nonblocking");
    let connect = || connect_through(&client, &listener);

    assert_eq!(
        connect().as_deref(),
        Some("proxy at 10.252.0.2:8080"),
        "without the ip rule"
    );
    assert_eq!(inspect(&pod, "istio").verdict, RedirectVerdict::Redirected);
    pod.sh("ip rule add fwmark 1337 lookup 133; ip route add local default dev lo table 133");
    assert_eq!(
        connect().as_deref(),
        Some("proxy at 10.252.0.2:8080"),
        "with the ip rule"
    );
    assert_eq!(inspect(&pod, "istio").verdict, RedirectVerdict::Redirected);
    pod.sh("iptables-nft -w -t mangle -F ISTIO_TPROXY");
    assert_eq!(
        connect(),
        None,
        "nothing intercepts without the TPROXY rule"
    );
    assert_eq!(inspect(&pod, "istio").verdict, RedirectVerdict::Missing);
}

/// A veth pair between the pod (10.252.0.2) and the client (10.252.0.1).
fn link_pod_and_client(pod: &Netns, client: &Netns) {
    let (a, b) = (
        format!("tpa{}", std::process::id() % 100_000),
        format!("tpb{}", std::process::id() % 100_000),
    );
    let out = Command::new("ip")
        .args([
            "link",
            "add",
            &a,
            "netns",
            pod.name(),
            "type",
            "veth",
            "peer",
            "name",
            &b,
            "netns",
            client.name(),
        ])
        .output()
        .expect("ip link add");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    pod.sh(&format!(
        "ip link set {a} up; ip addr add 10.252.0.2/24 dev {a}"
    ));
    client.sh(&format!(
        "ip link set {b} up; ip addr add 10.252.0.1/24 dev {b}"
    ));
}

/// The client connects to the pod's 10.252.0.2:8080; what it reads back from whoever
/// accepted on the transparent `listener`, and the destination that one saw (`None`: no
/// connection, or nothing accepted it).
fn connect_through(client: &Netns, listener: &std::net::TcpListener) -> Option<String> {
    use std::io::Read as _;
    let connected = netns::with_netns(&client.path(), || {
        std::net::TcpStream::connect_timeout(
            &"10.252.0.2:8080".parse().expect("addr"),
            std::time::Duration::from_millis(700),
        )
    })
    .expect("enter");
    let mut c = connected.ok()?;
    // Accept on this thread: the connection is queued on the transparent listener.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let (mut s, _) = loop {
        match listener.accept() {
            Ok(x) => break x,
            Err(_) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(5))
            }
            Err(_) => return None,
        }
    };
    // The proxy sees the original destination, as Envoy's inbound listener does.
    let local = s.local_addr().ok()?;
    std::io::Write::write_all(&mut s, b"proxy").ok()?;
    drop(s);
    let mut got = String::new();
    c.set_read_timeout(Some(std::time::Duration::from_millis(700)))
        .ok()?;
    c.read_to_string(&mut got).ok()?;
    Some(format!("{got} at {local}"))
}
