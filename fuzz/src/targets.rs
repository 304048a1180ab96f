//! The decoders under test, each wrapped as a `fn(&[u8]) -> u64` for the runner.
//!
//! In: one input's bytes. Out: a signature of what the decoder concluded (error kind,
//! verdict, counts), used only to tell new outcomes from known ones. Every target drives
//! the *whole* pure path behind the decoder, not just the first parse, because a panic in
//! selection, assembly or matching on strange-but-decodable input is as fatal to the agent:
//!
//! - [`conflist`]: the Go-compatible JSON parser, `NetConfList`/`PluginConf` parsing,
//!   `select_effective` for containerd and CRI-O over a lazy in-memory directory (with the
//!   input as the first file, as a `.conf`, as a CNI 1.1 drop-in plugin, behind an invalid
//!   file, beside a symlinked directory, and as a Multus `clusterNetwork` file), then `verify` with a deterministic fake prober,
//!   checking that no message quotes the input; plus the VERSION reply decoders on the same
//!   bytes.
//! - [`netlink`]: `nftables::decode_buffer` on arbitrary nf_tables dump bytes, then
//!   `assemble` of every table, chain and rule it decoded, then the reachability matcher for
//!   every built-in profile and IP family; plus `redirect_port` on the raw bytes.
//! - [`getsockopt`]: `legacy::decode_info` and `legacy::decode_table` on arbitrary
//!   `IPT_SO_GET_INFO` / `IPT_SO_GET_ENTRIES` answers (both families, several table names),
//!   then the matcher.
//! - [`admission`]: the webhook's `Reviewer::validate` and `mutate_node` on arbitrary request
//!   bodies, over a fake cluster view with a verified and an unverified node.
//! - [`profiles`]: the custom mesh-profile file (`--profile-file`), then pod selection.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use meshgate_agent::netfilter::{legacy, nftables, redirect_port};
use meshgate_core::cni::probe::{decode_error_reply, decode_version_reply};
use meshgate_core::cni::select::{NotSelected, Validation, select_effective};
use meshgate_core::cni::{
    Broken, MemSource, NetConfList, PluginConf, ProbeOutcome, Runtime, VerifyOptions, gojson,
    verify,
};
use meshgate_core::profile::ProfileSet;
use meshgate_core::rules::{self, Family, IpFamily, RedirectVerdict, Ruleset};
use meshgate_webhook::placement::AgentDaemonSet;
use meshgate_webhook::review::{Cluster, Outcome, PodMeta, Reviewer};

use crate::mutate::Mutator;
use crate::runner::Target;

/// Every target, in the order the test runs them.
pub fn all() -> Vec<Target> {
    vec![conflist(), netlink(), getsockopt(), admission(), profiles()]
}

fn tokens(list: &[&[u8]]) -> Vec<Vec<u8>> {
    list.iter().map(|t| t.to_vec()).collect()
}

/// Order-sensitive mixing of small facts into a signature.
#[derive(Default)]
struct Sig(u64);

impl Sig {
    fn add(&mut self, v: u64) -> &mut Self {
        self.0 = (self.0 ^ v).wrapping_mul(0x100_0000_01b3).rotate_left(7);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        for b in s.bytes() {
            self.add(u64::from(b));
        }
        self.add(0xff)
    }
}

// ---------------------------------------------------------------------------------------
// CNI configuration
// ---------------------------------------------------------------------------------------

/// The conflist target.
pub fn conflist() -> Target {
    Target {
        name: "conflist",
        mutator: Mutator {
            dictionary: tokens(&[
                b"\"cniVersion\"",
                b"\"cniVersions\"",
                b"\"plugins\"",
                b"\"type\"",
                b"\"name\"",
                b"\"ipam\"",
                b"\"linkerd-cni\"",
                b"\"istio-cni\"",
                b"\"calico\"",
                b"\"portmap\"",
                b"\"1.0.0\"",
                b"\"0.3.1\"",
                b"\"0.4.0\"",
                b"\"1.1.0\"",
                b"\"99.0.0\"",
                b"\"loadOnlyInlinedPlugins\"",
                b"\"disableCheck\"",
                b"\"disableGC\"",
                b"\"true\"",
                b"true",
                b"null",
                b"[]",
                b"{}",
                b"\"supportedVersions\"",
                b"\"Type\"",
                "\"\u{212A}\"".as_bytes(),
                "\"capabilitie\u{17F}\"".as_bytes(),
                b"\"capabilities\"",
                b"\"dns\"",
                b"\"prevResult\"",
                b"\"QQMARKQQ\"",
                b"\"\\ud800\"",
                b"\"\xff\"",
                b"\"v1.0.0\"",
                b"\"1\"",
                b"\"\"",
                b"1e999",
                b"-0",
                b"\"a/b\"",
                b"\"\\u0000\"",
                "\u{feff}".as_bytes(),
            ]),
            json: true,
            max_len: 64 * 1024,
        },
        exec: conflist_exec,
    }
}

/// What the fake prober answers for a plugin type: decided by the type's bytes, so the same
/// input always meets the same binaries.
fn fake_probe(plugin: &str) -> ProbeOutcome {
    let h = plugin
        .bytes()
        .fold(7u32, |h, b| h.wrapping_mul(31) ^ u32::from(b));
    let path = format!("/opt/cni/bin/{plugin}");
    match h % 8 {
        0 => ProbeOutcome::Missing {
            searched: vec!["/opt/cni/bin".into()],
        },
        1 => ProbeOutcome::Broken {
            path,
            why: Broken::TimedOut { after_ms: 2000 },
        },
        2 => ProbeOutcome::Answered {
            path,
            supported: vec!["0.3.1".into()],
        },
        _ => ProbeOutcome::Answered {
            path,
            supported: vec![
                "0.1.0".into(),
                "0.3.0".into(),
                "0.3.1".into(),
                "0.4.0".into(),
                "1.0.0".into(),
                "1.1.0".into(),
            ],
        },
    }
}

const DROP_IN_BASE: &str = r#"{"cniVersion":"1.1.0","name":"mg","plugins":[{"type":"calico","ipam":{"type":"calico-ipam"}}]}"#;
const GOOD: &str =
    r#"{"cniVersion":"0.3.1","name":"k8s","plugins":[{"type":"calico"},{"type":"linkerd-cni"}]}"#;

/// A thick Multus `00-multus.conf` (core/testdata/multus-thick.conf's shape) whose
/// `clusterNetwork` is the input, so the delegate loader runs on it.
const MULTUS_BY_PATH: &str = r#"{"cniVersion":"0.3.1","name":"multus-cni-network","type":"multus-shim","clusterNetwork":"/host/etc/cni/net.d/10-delegate.conflist"}"#;

/// A marker that must never appear in a verdict message when the input holds it.
const MARK: &str = "QQMARKQQ";

fn conflist_exec(input: &[u8]) -> u64 {
    let mut sig = Sig::default();
    sig.add(u64::from(gojson::parse(input).is_ok()));
    sig.add(u64::from(NetConfList::from_conflist_bytes(input).is_ok()));
    if let Ok(list) = NetConfList::from_conf_bytes(input) {
        sig.add(list.plugin_types().len() as u64);
        sig.add(u64::from(
            meshgate_core::cni::config::parse_version(list.effective_version()).is_some(),
        ));
    }
    sig.add(u64::from(PluginConf::from_bytes(input).is_ok()));
    sig.add(u64::from(decode_version_reply(input).is_ok()));
    sig.add(u64::from(decode_error_reply(input).is_some()));

    let sources: [MemSource; 6] = [
        MemSource::new().file("10-net.conflist", input),
        MemSource::new()
            .file("10-net.conf", input)
            .file("20-good.conflist", GOOD),
        MemSource::new()
            .file("10-mg.conflist", DROP_IN_BASE)
            .file("mg/50-plugin.conf", input),
        MemSource::new()
            .file("00-broken.json", &input[..input.len() / 2])
            .file("05-net.json", input)
            .file("10-good.conflist", GOOD),
        MemSource::new()
            .symlink_dir("00-dir.conflist", "d")
            .dir("d")
            .file(b"\xff.conflist", input)
            .file("10-good.conflist", GOOD),
        MemSource::new()
            .file("00-multus.conf", MULTUS_BY_PATH)
            .file("10-delegate.conflist", input),
    ];
    let quotes_input = std::str::from_utf8(input).is_ok_and(|s| s.contains(MARK));
    for src in &sources {
        for runtime in [Runtime::Containerd, Runtime::Crio] {
            let mut s = src.clone();
            let mut valid = |_: &NetConfList| Validation::Valid;
            match select_effective(&mut s, runtime.rules(), &mut valid) {
                Ok(eff) => {
                    sig.add(1).add(eff.list.plugins.len().min(8) as u64);
                }
                Err(NotSelected::NoConfig) => {
                    sig.add(2);
                }
                Err(_) => {
                    sig.add(3);
                }
            }
            let opts = VerifyOptions {
                conf_dir: "/etc/cni/net.d".into(),
                runtime,
                required: vec!["linkerd-cni".into()],
                multus: Default::default(),
            };
            let mut s = src.clone();
            let v = verify(&mut s, &opts, fake_probe);
            // The verdict's own invariant: `verified` exactly when the reason is Verified.
            assert_eq!(
                v.verified,
                v.reason == meshgate_core::cni::Reason::Verified,
                "{v:?}"
            );
            // Issue 13 item 6: messages never quote file content.
            if quotes_input {
                assert!(!v.message.contains(MARK), "{v:?}");
            }
            sig.str(v.reason.as_str());
        }
    }
    sig.0
}

// ---------------------------------------------------------------------------------------
// Netfilter
// ---------------------------------------------------------------------------------------

fn check_all(ruleset: &Ruleset, sig: &mut Sig) {
    static PROFILES: OnceLock<ProfileSet> = OnceLock::new();
    let profiles = PROFILES.get_or_init(ProfileSet::all_builtin);
    for p in profiles.iter() {
        for fams in [
            &[IpFamily::V4][..],
            &[IpFamily::V6],
            &[IpFamily::V4, IpFamily::V6],
        ] {
            let i = rules::check_pod(ruleset, p, fams, &BTreeMap::new());
            sig.add(match i.verdict {
                RedirectVerdict::Redirected => 1,
                RedirectVerdict::Missing => 2,
                RedirectVerdict::Unknown => 3,
            });
        }
    }
}

/// The nf_tables netlink target.
pub fn netlink() -> Target {
    Target {
        name: "netlink",
        mutator: Mutator {
            dictionary: tokens(&[
                b"nat\0",
                b"filter\0",
                b"PREROUTING\0",
                b"OUTPUT\0",
                b"INPUT\0",
                b"POSTROUTING\0",
                b"PROXY_INIT_REDIRECT\0",
                b"istio-proxy-nat\0",
                b"immediate\0",
                b"redir\0",
                b"target\0",
                b"match\0",
                b"REDIRECT\0",
                b"payload\0",
                b"cmp\0",
                b"meta\0",
                b"lookup\0",
                b"counter\0",
                b"bitwise\0",
                b"multiport\0",
                b"owner\0",
                b"\x03\x00\x00\x00",
                b"\xff\xff\xff\xff",
            ]),
            json: false,
            max_len: 64 * 1024,
        },
        exec: netlink_exec,
    }
}

fn netlink_exec(input: &[u8]) -> u64 {
    use nftables::Body;
    let mut sig = Sig::default();
    for fam in [Family::Ip, Family::Ip6, Family::Inet] {
        sig.add(u64::from(redirect_port(fam, input).is_some()));
    }
    match nftables::decode_buffer(input) {
        Err(_) => {
            sig.add(0xdead);
        }
        Ok(messages) => {
            let (mut tables, mut chains, mut rules) = (Vec::new(), Vec::new(), Vec::new());
            // Which other kinds of message were seen (a set, not a count, so the signature
            // stays coarse enough for the corpus to mean something).
            let mut kinds = 0u64;
            for m in messages {
                kinds |= u64::from(m.dump_intr);
                match m.body {
                    b @ Body::Table(_) => tables.push(b),
                    b @ Body::Chain(_) => chains.push(b),
                    b @ Body::Rule(_) => rules.push(b),
                    Body::Gen(_) => kinds |= 2,
                    Body::Done => kinds |= 4,
                    Body::Error(0) => kinds |= 8,
                    Body::Error(_) => kinds |= 16,
                    Body::Other => kinds |= 32,
                }
            }
            sig.add(kinds);
            sig.add(tables.len().min(4) as u64)
                .add(chains.len().min(8) as u64)
                .add(rules.len().min(16) as u64);
            let ruleset = nftables::assemble(tables, chains, rules);
            sig.add(ruleset.tables.len() as u64);
            check_all(&ruleset, &mut sig);
        }
    }
    sig.0
}

/// The legacy `getsockopt` target. Input layout: byte 0 picks the family (even: IPv4, odd:
/// IPv6), byte 1 the table name, the next 84 bytes are the `ipt_getinfo` answer, and the
/// rest is the entries blob.
pub fn getsockopt() -> Target {
    Target {
        name: "getsockopt",
        mutator: Mutator {
            dictionary: tokens(&[
                b"REDIRECT\0",
                b"ERROR\0",
                b"PREROUTING\0",
                b"OUTPUT\0",
                b"PROXY_INIT_REDIRECT\0",
                b"tcp\0",
                b"udp\0",
                b"multiport\0",
                b"owner\0",
                b"comment\0",
                b"DNAT\0",
                b"RETURN\0",
                b"\xfb\xff\xff\xff",
                b"\xfe\xff\xff\xff",
                b"\x98\x00",
                b"\xb0\x00",
            ]),
            json: false,
            max_len: 64 * 1024,
        },
        exec: getsockopt_exec,
    }
}

/// Length of `struct ipt_getinfo`.
pub const GETINFO_LEN: usize = 84;

fn getsockopt_exec(input: &[u8]) -> u64 {
    let mut sig = Sig::default();
    let (Some(&fam), Some(&table)) = (input.first(), input.get(1)) else {
        return sig.add(1).0;
    };
    let family = if fam % 2 == 0 {
        Family::Ip
    } else {
        Family::Ip6
    };
    let name = ["nat", "filter", "mangle", "raw"][usize::from(table % 4)];
    let rest = &input[2..];
    // Short answers are decoded too: the kernel's answer length is not trusted.
    let info = legacy::decode_info(rest);
    sig.add(u64::from(info.is_some()));
    let Some(info) = info else { return sig.0 };
    let blob = rest.get(GETINFO_LEN..).unwrap_or_default();
    match legacy::decode_table(family, name, &info, blob) {
        Err(_) => {
            sig.add(2);
        }
        Ok(t) => {
            sig.add(3).add(t.chains.len().min(8) as u64);
            let rules: usize = t.chains.iter().map(|c| c.rules.len()).sum();
            sig.add(rules.min(16) as u64);
            check_all(&Ruleset { tables: vec![t] }, &mut sig);
        }
    }
    sig.0
}

// ---------------------------------------------------------------------------------------
// Webhook
// ---------------------------------------------------------------------------------------

/// The shipped agent DaemonSet's placement: every node, every taint tolerated, so every
/// Node CREATE input reaches the registration patch.
fn agent_tolerating_all() -> AgentDaemonSet {
    static AGENT: OnceLock<std::sync::Arc<k8s_openapi::api::apps::v1::DaemonSet>> = OnceLock::new();
    let ds = AGENT.get_or_init(|| {
        let spec = serde_json::json!({"spec": {"selector": {}, "template": {"spec": {
            "containers": [], "tolerations": [{"operator": "Exists"}]}}}});
        std::sync::Arc::new(serde_json::from_value(spec).unwrap_or_default())
    });
    AgentDaemonSet::Known(ds.clone())
}

/// A fixed cluster view: node `good` verified, `bad` not, a few pods for bindings.
struct FakeCluster {
    nodes: BTreeMap<String, BTreeMap<String, String>>,
    pods: BTreeMap<(String, String), PodMeta>,
}

impl Cluster for FakeCluster {
    fn node_labels(&self, name: &str) -> Option<BTreeMap<String, String>> {
        self.nodes.get(name).cloned()
    }
    async fn pod_meta(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<PodMeta, meshgate_core::admission::LookupFailure> {
        self.pods
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
            .ok_or(meshgate_core::admission::LookupFailure::NotFound)
    }
    async fn node_reason(&self, name: &str) -> Option<String> {
        (name == "bad").then(|| "ChainedPluginMissing".to_string())
    }
    fn namespace_labels(&self, name: &str) -> Option<BTreeMap<String, String>> {
        // `default` is cached, `ambient` enrolled in Istio ambient, any other unknown.
        match name {
            "default" => Some(BTreeMap::new()),
            "ambient" => Some(BTreeMap::from([(
                "istio.io/dataplane-mode".to_string(),
                "ambient".to_string(),
            )])),
            _ => None,
        }
    }
    fn agent_daemonset(&self) -> AgentDaemonSet {
        agent_tolerating_all()
    }
}

fn reviewer() -> &'static Reviewer<FakeCluster> {
    static R: OnceLock<Reviewer<FakeCluster>> = OnceLock::new();
    R.get_or_init(|| {
        let label = |v: &str| {
            BTreeMap::from([(
                meshgate_core::gate::VERIFIED_LABEL.to_string(),
                v.to_string(),
            )])
        };
        let mut pods = BTreeMap::new();
        pods.insert(
            ("default".to_string(), "meshed".to_string()),
            PodMeta {
                labels: BTreeMap::from([(
                    "linkerd.io/control-plane-ns".to_string(),
                    "linkerd".to_string(),
                )]),
                annotations: BTreeMap::new(),
            },
        );
        pods.insert(
            ("default".to_string(), "plain".to_string()),
            PodMeta::default(),
        );
        let cluster = FakeCluster {
            nodes: BTreeMap::from([
                ("good".to_string(), label("true")),
                ("bad".to_string(), label("false")),
            ]),
            pods,
        };
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = meshgate_webhook::metrics::Metrics::register(&mut registry);
        Reviewer::new(cluster, ProfileSet::all_builtin(), metrics)
    })
}

/// The AdmissionReview target.
pub fn admission() -> Target {
    Target {
        name: "admission",
        mutator: Mutator {
            dictionary: tokens(&[
                b"\"request\"",
                b"\"uid\"",
                b"\"object\"",
                b"\"oldObject\"",
                b"\"spec\"",
                b"\"nodeName\"",
                b"\"metadata\"",
                b"\"labels\"",
                b"\"annotations\"",
                b"\"linkerd.io/control-plane-ns\"",
                b"\"security.istio.io/tlsMode\"",
                b"\"istio\"",
                b"\"ambient.istio.io/redirection\"",
                b"\"enabled\"",
                b"\"istio.io/dataplane-mode\"",
                b"\"ambient\"",
                b"\"none\"",
                b"\"sidecar.istio.io/status\"",
                b"\"namespace\"",
                b"\"binding\"",
                b"\"subResource\"",
                b"\"target\"",
                b"\"pods\"",
                b"\"nodes\"",
                b"\"CREATE\"",
                b"\"UPDATE\"",
                b"\"AdmissionReview\"",
                b"\"admission.k8s.io/v1\"",
                b"\"good\"",
                b"\"bad\"",
                b"\"meshed\"",
                b"\"meshgate.io/cni-verified\"",
                b"\"taints\"",
                b"\"dryRun\"",
            ]),
            json: true,
            max_len: 256 * 1024,
        },
        exec: admission_exec,
    }
}

fn admission_exec(input: &[u8]) -> u64 {
    let mut sig = Sig::default();
    let r = reviewer();
    let outcome = |o: &Outcome| -> u64 {
        match o {
            Outcome::Malformed(_) => 1,
            Outcome::Answer(review) => match review.response.as_ref() {
                None => 2,
                Some(resp) => 3 + u64::from(resp.allowed) * 2 + u64::from(resp.patch.is_some()) * 4,
            },
        }
    };
    match meshgate_webhook::review::decode(input) {
        Ok(req) => {
            sig.add(1).str(req.resource.resource.as_str());
            sig.add(u64::from(req.sub_resource.is_some()));
        }
        Err(e) => {
            // The kind of refusal, without the details that vary with every input.
            let kinds = [
                "missing field",
                "invalid type",
                "unknown variant",
                "EOF",
                "recursion limit",
                "expected",
                "kind is",
                "no request",
                "uid is empty",
                "trailing",
                "invalid",
            ];
            let k = kinds
                .iter()
                .position(|k| e.contains(k))
                .unwrap_or(kinds.len());
            sig.add(100 + k as u64);
        }
    }
    let v = futures::executor::block_on(r.validate(input));
    sig.add(outcome(&v));
    let m = r.mutate_node(input);
    sig.add(outcome(&m));
    // The review must echo the request's uid whenever it answers one.
    if let (Ok(req), Outcome::Answer(review)) = (meshgate_webhook::review::decode(input), &v)
        && let Some(resp) = review.response.as_ref()
    {
        assert_eq!(resp.uid, req.uid, "the answer's uid is the request's");
    }
    sig.0
}

// ---------------------------------------------------------------------------------------
// Mesh profile files
// ---------------------------------------------------------------------------------------

/// The `--profile-file` target.
pub fn profiles() -> Target {
    Target {
        name: "profiles",
        mutator: Mutator {
            dictionary: tokens(&[
                b"\"name\"",
                b"\"selector\"",
                b"\"labels\"",
                b"\"annotations\"",
                b"\"pluginType\"",
                b"\"inboundPort\"",
                b"\"outboundPort\"",
                b"65535",
                b"65536",
                b"0",
                b"\"linkerd\"",
                b"\"\"",
            ]),
            json: true,
            max_len: 64 * 1024,
        },
        exec: profiles_exec,
    }
}

fn profiles_exec(input: &[u8]) -> u64 {
    let mut sig = Sig::default();
    let text = String::from_utf8_lossy(input);
    match ProfileSet::all_builtin().with_custom_json(&text) {
        Err(_) => {
            sig.add(1);
        }
        Ok(set) => {
            let labels =
                BTreeMap::from([("linkerd.io/control-plane-ns".to_string(), "x".to_string())]);
            let annotations = BTreeMap::new();
            let n = set.selecting(&labels, &annotations).count();
            sig.add(2).add(n as u64);
            for p in set.iter() {
                let i = rules::check_pod(&Ruleset::default(), p, &[IpFamily::V4], &annotations);
                assert_eq!(
                    i.verdict,
                    RedirectVerdict::Missing,
                    "no rules can redirect: {i:?}"
                );
            }
        }
    }
    sig.0
}
