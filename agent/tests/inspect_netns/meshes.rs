//! Each mesh's rules as its own tools write them (linkerd proxy-init, istio-iptables in
//! REDIRECT and TPROXY modes, Istio's native nftables), through each backend (`iptables-nft`,
//! `iptables-legacy`, `nft`), read back from a real namespace and judged per pod: dual-stack
//! pods, opt-out annotations, wrong ports and unreachable chains.

use super::*;

#[test]
fn linkerd_iptables_nft_dual_stack() {
    let ns = Netns::new("lnft");
    ns.addr("10.244.1.5/24");
    ns.addr("fd00:10:244:1::5/64");
    ns.sh(&linkerd_rules("iptables-nft", 4143));
    // IPv4 rules only, on a dual-stack pod: what Linkerd writes on its default
    // (`disableIPv6`), so redirected. Missing for IPv6 only when the mesh is dual-stack.
    let default = inspect(&ns, "linkerd");
    assert_eq!(
        default.verdict,
        RedirectVerdict::Redirected,
        "{}",
        default.message
    );
    let half =
        netns::check_pod(&ns.path(), &dual_stack("linkerd"), &BTreeMap::new()).expect("inspect");
    assert_eq!(half.verdict, RedirectVerdict::Missing, "{}", half.message);
    assert!(half.message.contains("IPv6"), "{}", half.message);
    ns.sh(&linkerd_rules("ip6tables-nft", 4143));
    assert_linkerd_redirected_in_both_families(&ns, "iptables-nft");
    let both =
        netns::check_pod(&ns.path(), &dual_stack("linkerd"), &BTreeMap::new()).expect("inspect");
    assert_eq!(
        both.verdict,
        RedirectVerdict::Redirected,
        "{}",
        both.message
    );
    // Istio's ports are elsewhere.
    assert_eq!(inspect(&ns, "istio").verdict, RedirectVerdict::Missing);
}

#[test]
fn linkerd_iptables_legacy_dual_stack() {
    let ns = Netns::new("lleg");
    ns.addr("10.244.1.6/24");
    ns.addr("fd00:10:244:1::6/64");
    ns.sh(&linkerd_rules("iptables-legacy", 4143));
    ns.sh(&linkerd_rules("ip6tables-legacy", 4143));
    assert_linkerd_redirected_in_both_families(&ns, "iptables-legacy");
}

#[test]
fn istio_iptables_layout_both_backends() {
    for ipt in ["iptables-nft", "iptables-legacy"] {
        let ns = Netns::new("istio");
        ns.addr("10.244.2.7/24");
        ns.sh(&istio_rules(ipt));
        let got = inspect(&ns, "istio");
        assert_eq!(
            got.verdict,
            RedirectVerdict::Redirected,
            "{ipt}: {}",
            got.message
        );
        assert_eq!(
            got.inbound.via,
            Some(format!(
                "ip nat PREROUTING -> ISTIO_INBOUND -> ISTIO_IN_REDIRECT ({ipt})"
            ))
        );
        assert_eq!(
            got.outbound.via,
            Some(format!(
                "ip nat OUTPUT -> ISTIO_OUTPUT -> ISTIO_REDIRECT ({ipt})"
            ))
        );
        let linkerd = inspect(&ns, "linkerd");
        assert_eq!(linkerd.verdict, RedirectVerdict::Missing);
        assert!(!linkerd.inbound.found && !linkerd.outbound.found);
    }
}

#[test]
fn istio_native_nftables_inet_table() {
    let ns = Netns::new("nft");
    ns.addr("10.244.3.8/24");
    ns.addr("fd00:10:244:3::8/64");
    ns.nft(ISTIO_NFT);
    for p in ["istio", "istio-ambient"] {
        let got = inspect(&ns, p);
        assert_eq!(
            got.verdict,
            RedirectVerdict::Redirected,
            "{p}: {}",
            got.message
        );
        assert_eq!(
            got.inbound.via.as_deref(),
            Some(
                "inet istio-proxy-nat prerouting -> istio-inbound -> istio-in-redirect (nftables)"
            )
        );
        assert_eq!(
            got.outbound.via.as_deref(),
            Some("inet istio-proxy-nat output -> istio-output -> istio-redirect (nftables)")
        );
    }
}

#[test]
fn wrong_port_and_unreachable_chain_are_missing() {
    let ns = Netns::new("wrong");
    ns.addr("10.244.4.9/24");
    ns.sh(&linkerd_rules("iptables-nft", 4144));
    let got = inspect(&ns, "linkerd");
    assert_eq!(got.verdict, RedirectVerdict::Missing);
    assert!(!got.inbound.found, "redirect to 4144 must not count");
    assert!(got.outbound.found);

    let ns = Netns::new("unreach");
    ns.addr("10.244.4.10/24");
    ns.nft(
        "table inet istio-proxy-nat {
            chain istio-in-redirect { meta l4proto tcp redirect to :15006; }
            chain istio-output { meta l4proto tcp redirect to :15001; }
            chain prerouting { type nat hook prerouting priority dstnat; policy accept; }
            chain output { type nat hook output priority -100; policy accept; jump istio-output; }
        }",
    );
    let got = inspect(&ns, "istio");
    assert_eq!(got.verdict, RedirectVerdict::Missing);
    assert!(
        !got.inbound.found,
        "a chain nothing jumps to must not count"
    );
    assert!(got.outbound.found);
    assert!(got.message.contains("15006"), "{}", got.message);
}

#[test]
fn empty_namespace_is_missing_and_a_redirect_in_a_dormant_table_does_not_count() {
    let ns = Netns::new("empty");
    ns.addr("10.244.5.11/24");
    let got = inspect(&ns, "istio");
    assert_eq!(got.verdict, RedirectVerdict::Missing);
    ns.nft(ISTIO_NFT);
    ns.sh("nft add table inet istio-proxy-nat '{ flags dormant; }'");
    assert_eq!(inspect(&ns, "istio").verdict, RedirectVerdict::Missing);
}

/// istio-iptables in `TPROXY` mode, IPv4: its golden `tproxy.golden` (tools/istio-iptables/
/// pkg/capture/testdata; config: interceptionMode TPROXY, includeInboundPorts "*",
/// outbound include 9.9.0.0/16 exclude 1.1.0.0/16, DNS capture, exclude nic), in
/// `iptables-save` form. Inbound is intercepted in mangle only: nat PREROUTING has no jump.
pub(crate) const ISTIO_TPROXY_V4: &str = "*mangle
-N ISTIO_DIVERT
-N ISTIO_TPROXY
-N ISTIO_INBOUND
-A PREROUTING -i not-istio-nic -j RETURN
-A OUTPUT -o not-istio-nic -j RETURN
-A ISTIO_DIVERT -j MARK --set-mark 1337
-A ISTIO_DIVERT -j ACCEPT
-A ISTIO_TPROXY ! -d 127.0.0.1/32 -p tcp -j TPROXY --tproxy-mark 1337/0xffffffff --on-port 15006
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT
-A ISTIO_INBOUND -p tcp -j ISTIO_TPROXY
-A PREROUTING -p tcp -m mark --mark 1337 -j CONNMARK --save-mark
-A OUTPUT -p tcp -o lo -m mark --mark 1337 -j RETURN
-A OUTPUT ! -d 127.0.0.1/32 -p tcp -o lo -m owner --uid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT ! -d 127.0.0.1/32 -p tcp -o lo -m owner --gid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT -p tcp -m connmark --mark 1337 -j CONNMARK --restore-mark
-I ISTIO_INBOUND 1 -p tcp -m mark --mark 1337 -j RETURN
-I ISTIO_INBOUND 2 -p tcp -s 127.0.0.6/32 -i lo -j RETURN
-I ISTIO_INBOUND 3 -p tcp -i lo -m mark ! --mark 1338 -j RETURN
COMMIT
*nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
-N ISTIO_OUTPUT_DNS
-A PREROUTING -i not-istio-nic -j RETURN
-A OUTPUT -o not-istio-nic -j RETURN
-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp -m multiport ! --dports 53,15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -p tcp ! --dport 53 -m owner ! --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_OUTPUT_DNS
-A ISTIO_OUTPUT_DNS -p tcp --dport 53 -d 127.0.0.53/32 -j REDIRECT --to-ports 15053
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d 127.0.0.53/32 -j REDIRECT --to-port 15053
-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN
-A ISTIO_OUTPUT -d 1.1.0.0/16 -j RETURN
-A ISTIO_OUTPUT -d 9.9.0.0/16 -j ISTIO_REDIRECT
COMMIT
*raw
-N ISTIO_OUTPUT_DNS
-N ISTIO_INBOUND
-A OUTPUT -j ISTIO_OUTPUT_DNS
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --uid-owner 1337 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp --sport 15053 -m owner --uid-owner 1337 -j CT --zone 2
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -m owner --gid-owner 1337 -j CT --zone 1
-A ISTIO_OUTPUT_DNS -p udp --sport 15053 -m owner --gid-owner 1337 -j CT --zone 2
-A PREROUTING -j ISTIO_INBOUND
-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d 127.0.0.53/32 -j CT --zone 2
-A ISTIO_INBOUND -p udp --sport 53 -s 127.0.0.53/32 -j CT --zone 1
COMMIT";

/// The same golden's IPv6 half (written because that golden sets `EnableIPv6`).
const ISTIO_TPROXY_V6: &str = "*mangle
-N ISTIO_DIVERT
-N ISTIO_TPROXY
-N ISTIO_INBOUND
-A PREROUTING -i not-istio-nic -j RETURN
-A OUTPUT -o not-istio-nic -j RETURN
-A ISTIO_DIVERT -j MARK --set-mark 1337
-A ISTIO_DIVERT -j ACCEPT
-A ISTIO_TPROXY ! -d ::1/128 -p tcp -j TPROXY --tproxy-mark 1337/0xffffffff --on-port 15006
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT
-A ISTIO_INBOUND -p tcp -j ISTIO_TPROXY
-A PREROUTING -p tcp -m mark --mark 1337 -j CONNMARK --save-mark
-A OUTPUT -p tcp -o lo -m mark --mark 1337 -j RETURN
-A OUTPUT ! -d ::1/128 -p tcp -o lo -m owner --uid-owner 1337 -j MARK --set-mark 1338
-A OUTPUT -p tcp -m connmark --mark 1337 -j CONNMARK --restore-mark
-I ISTIO_INBOUND 1 -p tcp -m mark --mark 1337 -j RETURN
-I ISTIO_INBOUND 2 -p tcp -s ::6/128 -i lo -j RETURN
-I ISTIO_INBOUND 3 -p tcp -i lo -m mark ! --mark 1338 -j RETURN
COMMIT
*nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
-A PREROUTING -i not-istio-nic -j RETURN
-A OUTPUT -o not-istio-nic -j RETURN
-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -o lo -s ::6/128 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -d ::1/128 -j RETURN
-A ISTIO_OUTPUT -j ISTIO_REDIRECT
COMMIT";

#[test]
fn istio_tproxy_mode_is_redirected_with_both_backends() {
    for (backend, v4, v6) in [
        (
            "iptables-nft",
            "iptables-nft-restore",
            "ip6tables-nft-restore",
        ),
        (
            "iptables-legacy",
            "iptables-legacy-restore",
            "ip6tables-legacy-restore",
        ),
    ] {
        let ns = Netns::new("tproxy");
        ns.addr("10.244.10.17/24");
        ns.addr("fd00:10:244:10::17/64");
        ns.restore(v4, ISTIO_TPROXY_V4);
        ns.restore(v6, ISTIO_TPROXY_V6);
        // The policy routing istio-iptables adds in TPROXY mode (not required by meshgate:
        // inbound traffic is for the pod's own, local address).
        ns.sh("ip -4 rule add fwmark 1337 lookup 133
               ip -4 route add local default dev lo table 133
               ip -6 rule add fwmark 1337 lookup 133
               ip -6 route add local default dev lo table 133");
        let got =
            netns::check_pod(&ns.path(), &dual_stack("istio"), &BTreeMap::new()).expect("inspect");
        assert_eq!(
            got.verdict,
            RedirectVerdict::Redirected,
            "{backend}: {}",
            got.message
        );
        assert_eq!(
            got.inbound.via,
            Some(format!(
                "ip mangle PREROUTING -> ISTIO_INBOUND -> ISTIO_TPROXY ({backend}); \
                 ip6 mangle PREROUTING -> ISTIO_INBOUND -> ISTIO_TPROXY ({backend})"
            ))
        );
        assert_eq!(
            got.outbound.via,
            Some(format!(
                "ip nat OUTPUT -> ISTIO_OUTPUT -> ISTIO_REDIRECT ({backend}); \
                 ip6 nat OUTPUT -> ISTIO_OUTPUT -> ISTIO_REDIRECT ({backend})"
            ))
        );
        // Control: without the TPROXY rule nothing intercepts inbound traffic.
        let ipt = if backend == "iptables-nft" {
            "iptables-nft"
        } else {
            "iptables-legacy"
        };
        ns.sh(&format!("{ipt} -w -t mangle -F ISTIO_TPROXY"));
        let got = inspect(&ns, "istio");
        assert_eq!(
            got.verdict,
            RedirectVerdict::Missing,
            "{backend}: {}",
            got.message
        );
        assert!(!got.inbound.found && got.outbound.found);
    }
}

#[test]
fn native_nft_tproxy_is_redirected() {
    let ns = Netns::new("nfttp");
    ns.addr("10.244.11.18/24");
    ns.nft(
        "table inet istio-proxy-mangle {
            chain prerouting {
                type filter hook prerouting priority mangle; policy accept;
                meta l4proto tcp jump istio-inbound
            }
            chain istio-inbound {
                tcp dport 15008 return
                meta l4proto tcp jump istio-tproxy
            }
            chain istio-tproxy {
                meta l4proto tcp tproxy ip to :15006 meta mark set 0x539 accept
                meta l4proto tcp tproxy ip6 to :15006 meta mark set 0x539 accept
            }
        }
        table inet istio-proxy-nat {
            chain output {
                type nat hook output priority -100; policy accept;
                meta skuid 1337 return
                meta l4proto tcp redirect to :15001
            }
        }",
    );
    let got = inspect(&ns, "istio");
    assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
    assert_eq!(
        got.inbound.via.as_deref(),
        Some("inet istio-proxy-mangle prerouting -> istio-inbound -> istio-tproxy (nftables)")
    );
    // `tproxy ip` and `tproxy ip6` each intercept their own family only.
    ns.addr("fd00:10:244:11::18/64");
    let dual =
        netns::check_pod(&ns.path(), &dual_stack("istio"), &BTreeMap::new()).expect("inspect");
    assert_eq!(
        dual.verdict,
        RedirectVerdict::Redirected,
        "{}",
        dual.message
    );
    ns.sh("nft flush chain inet istio-proxy-mangle istio-tproxy
           nft add rule inet istio-proxy-mangle istio-tproxy meta l4proto tcp tproxy ip to :15006 meta mark set 0x539 accept");
    let dual =
        netns::check_pod(&ns.path(), &dual_stack("istio"), &BTreeMap::new()).expect("inspect");
    assert_eq!(dual.verdict, RedirectVerdict::Missing, "{}", dual.message);
    assert_eq!(dual.inbound.missing_families, [IpFamily::V6]);
}

#[test]
fn dual_stack_pods_on_the_meshes_defaults_need_ipv4_rules_only() {
    // Istio without ISTIO_DUAL_STACK writes iptables only (golden `inbound-ports-wildcard`
    // has no ip6tables half); Linkerd with disableIPv6 likewise.
    let ns = Netns::new("dsist");
    ns.addr("10.244.12.19/24");
    ns.addr("fd00:10:244:12::19/64");
    ns.sh(&istio_rules("iptables-nft"));
    let got = inspect(&ns, "istio");
    assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
    // Configured dual-stack, the absent ip6tables rules are missing.
    let dual =
        netns::check_pod(&ns.path(), &dual_stack("istio"), &BTreeMap::new()).expect("inspect");
    assert_eq!(dual.verdict, RedirectVerdict::Missing, "{}", dual.message);
    assert!(dual.message.contains("IPv6"), "{}", dual.message);

    let ns = Netns::new("dslnk");
    ns.addr("10.244.12.20/24");
    ns.addr("fd00:10:244:12::20/64");
    ns.sh(&linkerd_rules("iptables-legacy", 4143));
    assert_eq!(inspect(&ns, "linkerd").verdict, RedirectVerdict::Redirected);
    // An IPv6-only pod still needs IPv6 rules.
    let v6 = Netns::new("v6only");
    v6.addr("fd00:10:244:12::21/64");
    v6.sh(&linkerd_rules("iptables-nft", 4143));
    assert_eq!(inspect(&v6, "linkerd").verdict, RedirectVerdict::Missing);
}

/// istio-iptables with an empty config (golden `empty.golden`: includeInboundPorts "" and
/// includeOutboundIPRanges ""), IPv4, as its dry-run prints it.
const ISTIO_EMPTY: &str = "
iptables -t nat -N ISTIO_INBOUND
iptables -t nat -N ISTIO_REDIRECT
iptables -t nat -N ISTIO_IN_REDIRECT
iptables -t nat -N ISTIO_OUTPUT
iptables -t nat -A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN
iptables -t nat -A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
iptables -t nat -A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
iptables -t nat -A OUTPUT -p tcp -j ISTIO_OUTPUT
iptables -t nat -A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN
iptables -t nat -A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
iptables -t nat -A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 1337 -j RETURN
iptables -t nat -A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
iptables -t nat -A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
iptables -t nat -A ISTIO_OUTPUT -o lo -m owner ! --gid-owner 1337 -j RETURN
iptables -t nat -A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
iptables -t nat -A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN";

/// Golden `ipv6-outbound-ports` (includeInboundPorts "", includeOutboundPorts
/// "32000,31000"), IPv4 half: the empty layout plus two per-port outbound redirects.
const ISTIO_OUTBOUND_PORTS_EXTRA: &str = "
iptables -t nat -A ISTIO_OUTPUT -p tcp --dport 32000 -j ISTIO_REDIRECT
iptables -t nat -A ISTIO_OUTPUT -p tcp --dport 31000 -j ISTIO_REDIRECT";

/// Golden `inbound-ports-wildcard` (includeInboundPorts "*", includeOutboundIPRanges "").
pub(crate) const ISTIO_INBOUND_WILDCARD: &str = "*nat
-N ISTIO_INBOUND
-N ISTIO_REDIRECT
-N ISTIO_IN_REDIRECT
-N ISTIO_OUTPUT
-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN
-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001
-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006
-A PREROUTING -p tcp -j ISTIO_INBOUND
-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
-A ISTIO_OUTPUT -o lo -m owner ! --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN
-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN
COMMIT";

const IN_PORTS: &str = "traffic.sidecar.istio.io/includeInboundPorts";
pub(crate) const OUT_RANGES: &str = "traffic.sidecar.istio.io/includeOutboundIPRanges";
const OUT_PORTS: &str = "traffic.sidecar.istio.io/includeOutboundPorts";

#[test]
fn istio_opt_out_pods_match_what_istio_writes_for_their_annotations() {
    let istio = profile("istio");
    for ipt in ["iptables-nft", "iptables-legacy"] {
        // Both directions opted out.
        let ns = Netns::new("optall");
        ns.addr("10.244.13.22/24");
        ns.sh(&ISTIO_EMPTY.replace("iptables ", &format!("{ipt} -w ")));
        assert_eq!(inspect(&ns, "istio").verdict, RedirectVerdict::Missing);
        let got = inspect_pod(&ns, &istio, &[(IN_PORTS, ""), (OUT_RANGES, "")]);
        assert_eq!(
            got.verdict,
            RedirectVerdict::Redirected,
            "{ipt}: {}",
            got.message
        );
        assert!(!got.inbound.expected && !got.outbound.expected);
        // Only inbound opted out: outbound must still be there, and is not.
        let got = inspect_pod(&ns, &istio, &[(IN_PORTS, "")]);
        assert_eq!(
            got.verdict,
            RedirectVerdict::Missing,
            "{ipt}: {}",
            got.message
        );
        assert!(!got.outbound.found);

        // Inbound opted out, outbound limited to two ports.
        ns.sh(&ISTIO_OUTBOUND_PORTS_EXTRA.replace("iptables ", &format!("{ipt} -w ")));
        let got = inspect_pod(
            &ns,
            &istio,
            &[(IN_PORTS, ""), (OUT_RANGES, ""), (OUT_PORTS, "32000,31000")],
        );
        assert_eq!(
            got.verdict,
            RedirectVerdict::Redirected,
            "{ipt}: {}",
            got.message
        );
        assert_eq!(
            got.outbound.via,
            Some(format!(
                "ip nat OUTPUT -> ISTIO_OUTPUT -> ISTIO_REDIRECT ({ipt})"
            ))
        );
    }

    // Outbound opted out (includeOutboundIPRanges ""), inbound for every port.
    let ns = Netns::new("optout");
    ns.addr("10.244.13.23/24");
    ns.restore("iptables-nft-restore", ISTIO_INBOUND_WILDCARD);
    assert_eq!(inspect(&ns, "istio").verdict, RedirectVerdict::Missing);
    let got = inspect_pod(&ns, &istio, &[(OUT_RANGES, "")]);
    assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
    assert!(got.inbound.found && !got.outbound.expected);
}

#[test]
fn linkerd_opt_out_pods_match_what_proxy_init_writes() {
    // proxy-init with --subnets-to-ignore 0.0.0.0/0 (config.linkerd.io/skip-subnets): an
    // unconditional RETURN ahead of the inbound redirect.
    let ns = Netns::new("lskip");
    ns.addr("10.244.14.24/24");
    ns.sh(&linkerd_rules("iptables-nft", 4143).replace(
        "-A PROXY_INIT_REDIRECT -p tcp -j REDIRECT",
        "-A PROXY_INIT_REDIRECT -p all -j RETURN -s 0.0.0.0/0 -m comment --comment proxy-init/ignore-subnet-0.0.0.0/0\n\
         iptables-nft -w -t nat -A PROXY_INIT_REDIRECT -p tcp -j REDIRECT",
    ));
    let linkerd = profile("linkerd");
    let bare = inspect(&ns, "linkerd");
    assert_eq!(bare.verdict, RedirectVerdict::Missing, "{}", bare.message);
    assert!(!bare.inbound.found && bare.outbound.found);
    let got = inspect_pod(
        &ns,
        &linkerd,
        &[("config.linkerd.io/skip-subnets", "0.0.0.0/0")],
    );
    assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);

    // skip-inbound-ports covering every port: proxy-init still writes the redirect behind a
    // multiport RETURN, which the matcher reads as conditional.
    let ns = Netns::new("lports");
    ns.addr("10.244.14.25/24");
    ns.sh(&linkerd_rules("iptables-legacy", 4143).replace("4190,4191,4567,4568", "1:65535"));
    assert_eq!(inspect(&ns, "linkerd").verdict, RedirectVerdict::Redirected);
    let got = inspect_pod(
        &ns,
        &linkerd,
        &[("config.linkerd.io/skip-inbound-ports", "1-65535")],
    );
    assert_eq!(got.verdict, RedirectVerdict::Redirected, "{}", got.message);
    assert!(!got.inbound.expected);
}
