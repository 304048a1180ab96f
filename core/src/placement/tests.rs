use super::*;
use serde_json::{Value, json};

fn spec(v: Value) -> PodSpec {
    let mut v = v;
    v["containers"] = json!([{"name": "agent"}]);
    serde_json::from_value(v).expect("a PodSpec")
}

fn taint(key: &str, value: Option<&str>, effect: &str) -> Taint {
    Taint {
        key: key.into(),
        value: value.map(Into::into),
        effect: effect.into(),
        time_added: None,
    }
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A template whose only constraint is `required`, a node selector term list.
fn affinity(terms: Value) -> PodSpec {
    spec(json!({"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}}))
}

fn runs(spec: &PodSpec, name: &str, l: &[(&str, &str)], taints: &[Taint]) -> Placement {
    let l = labels(l);
    daemon_pod_placement(
        spec,
        &NodeView {
            name,
            labels: &l,
            taints,
        },
    )
}

fn excluded_by_taint(key: &str, effect: &str) -> Placement {
    Placement::Excluded(Exclusion::Taint {
        key: key.into(),
        effect: effect.into(),
    })
}

const LINUX: (&str, &str) = ("kubernetes.io/os", "linux");
const WINDOWS: (&str, &str) = ("kubernetes.io/os", "windows");
const VK_TAINT: &str = "virtual-kubelet.io/provider";

/// One case: what it shows, the template, the node's name, labels and taints, the placement.
type Row<'a> = (
    &'a str,
    &'a PodSpec,
    &'a str,
    Vec<(&'a str, &'a str)>,
    Vec<Taint>,
    Placement,
);

/// The cases the issue names, one row each.
#[test]
fn placement_follows_the_daemonset_controller() {
    let linux_only = spec(json!({"nodeSelector": {"kubernetes.io/os": "linux"}}));
    let plain = spec(json!({}));
    let tolerate_all = spec(json!({"tolerations": [{"operator": "Exists"}]}));
    let tolerate_dedicated = spec(json!({"tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "mesh", "effect": "NoExecute"}]}));
    let zone_in = affinity(json!([{"matchExpressions": [
        {"key": "zone", "operator": "In", "values": ["a", "b"]}]}]));
    let not_virtual = affinity(json!([{"matchExpressions": [
        {"key": "type", "operator": "NotIn", "values": ["virtual-kubelet"]}]}]));
    let big = affinity(json!([{"matchExpressions": [
        {"key": "cores", "operator": "Gt", "values": ["8"]}]}]));
    let small = affinity(json!([{"matchExpressions": [
        {"key": "cores", "operator": "Lt", "values": ["8"]}]}]));
    let named = affinity(json!([{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]));
    let not_named = affinity(json!([{"matchFields": [
        {"key": "metadata.name", "operator": "NotIn", "values": ["n1"]}]}]));
    let pinned = spec(json!({"nodeName": "n1"}));
    let host_net = spec(json!({"hostNetwork": true}));

    let vk = taint(VK_TAINT, Some("azure"), "NoSchedule");
    let not_ready_exec = taint("node.kubernetes.io/not-ready", None, "NoExecute");
    let not_ready_sched = taint("node.kubernetes.io/not-ready", None, "NoSchedule");
    let dedicated = taint("dedicated", Some("mesh"), "NoExecute");
    let other_dedicated = taint("dedicated", Some("gpu"), "NoExecute");
    let prefer = taint("x", None, "PreferNoSchedule");
    let net = taint("node.kubernetes.io/network-unavailable", None, "NoSchedule");
    let cordoned = taint("node.kubernetes.io/unschedulable", None, "NoSchedule");
    let selector_miss = Placement::Excluded(Exclusion::NodeSelector {
        key: "kubernetes.io/os".into(),
    });
    let affinity_miss = Placement::Excluded(Exclusion::NodeAffinity);

    #[rustfmt::skip]
    let rows: Vec<Row<'_>> = vec![
        ("linux node, linux selector", &linux_only, "n1", vec![LINUX], vec![], Placement::Runs),
        ("windows node", &linux_only, "n1", vec![WINDOWS], vec![], selector_miss.clone()),
        ("nodeSelector label missing", &linux_only, "n1", vec![], vec![], selector_miss),
        ("virtual-kubelet taint, no toleration", &plain, "vk", vec![LINUX], vec![vk.clone()], excluded_by_taint(VK_TAINT, "NoSchedule")),
        ("virtual-kubelet taint, other toleration", &tolerate_dedicated, "vk", vec![], vec![vk.clone()], excluded_by_taint(VK_TAINT, "NoSchedule")),
        ("virtual-kubelet taint, Exists with empty key", &tolerate_all, "vk", vec![], vec![vk.clone()], Placement::Runs),
        ("virtual-kubelet label, NotIn affinity", &not_virtual, "vk", vec![("type", "virtual-kubelet")], vec![], affinity_miss.clone()),
        ("no type label, NotIn affinity", &not_virtual, "n1", vec![], vec![], Placement::Runs),
        ("other type, NotIn affinity", &not_virtual, "n1", vec![("type", "vm")], vec![], Placement::Runs),
        ("affinity In, value listed", &zone_in, "n1", vec![("zone", "b")], vec![], Placement::Runs),
        ("affinity In, value not listed", &zone_in, "n1", vec![("zone", "c")], vec![], affinity_miss.clone()),
        ("affinity In, label missing", &zone_in, "n1", vec![], vec![], affinity_miss.clone()),
        ("affinity Gt, above", &big, "n1", vec![("cores", "16")], vec![], Placement::Runs),
        ("affinity Gt, equal", &big, "n1", vec![("cores", "8")], vec![], affinity_miss.clone()),
        ("affinity Gt, not a number", &big, "n1", vec![("cores", "many")], vec![], affinity_miss.clone()),
        ("affinity Gt, label missing", &big, "n1", vec![], vec![], affinity_miss.clone()),
        ("affinity Lt, below", &small, "n1", vec![("cores", "-2")], vec![], Placement::Runs),
        ("matchFields In, this node", &named, "n1", vec![], vec![], Placement::Runs),
        ("matchFields In, another node", &named, "n2", vec![], vec![], affinity_miss.clone()),
        ("matchFields NotIn, this node", &not_named, "n1", vec![], vec![], affinity_miss.clone()),
        ("matchFields NotIn, another node", &not_named, "n2", vec![], vec![], Placement::Runs),
        ("matchFields, nameless node: skipped", &named, "", vec![], vec![], Placement::Runs),
        ("template nodeName, this node", &pinned, "n1", vec![], vec![], Placement::Runs),
        ("template nodeName, another node", &pinned, "n2", vec![], vec![], Placement::Excluded(Exclusion::NodeName)),
        ("untolerated NoExecute", &plain, "n1", vec![], vec![other_dedicated.clone()], excluded_by_taint("dedicated", "NoExecute")),
        ("tolerated NoExecute (Equal, value and effect)", &tolerate_dedicated, "n1", vec![], vec![dedicated.clone()], Placement::Runs),
        ("Equal toleration, other value", &tolerate_dedicated, "n1", vec![], vec![other_dedicated], excluded_by_taint("dedicated", "NoExecute")),
        ("not-ready NoExecute: the controller tolerates it", &plain, "n1", vec![], vec![not_ready_exec], Placement::Runs),
        ("not-ready NoSchedule: the controller does not", &plain, "n1", vec![], vec![not_ready_sched.clone()], excluded_by_taint("node.kubernetes.io/not-ready", "NoSchedule")),
        ("cordoned: the controller tolerates it", &plain, "n1", vec![], vec![cordoned], Placement::Runs),
        ("network-unavailable, pod network", &plain, "n1", vec![], vec![net.clone()], excluded_by_taint("node.kubernetes.io/network-unavailable", "NoSchedule")),
        ("network-unavailable, hostNetwork", &host_net, "n1", vec![], vec![net], Placement::Runs),
        ("PreferNoSchedule never excludes", &plain, "n1", vec![], vec![prefer], Placement::Runs),
        ("tolerate everything, every taint", &tolerate_all, "n1", vec![], vec![dedicated, not_ready_sched, vk], Placement::Runs),
    ];
    for (what, spec, name, l, taints, want) in rows {
        assert_eq!(runs(spec, name, &l, &taints), want, "{what}");
    }
}

/// Terms are ORed, requirements ANDed; an empty term, or one that does not parse, matches
/// nothing, and the other terms still decide.
#[test]
fn terms_are_ored_and_bad_terms_match_nothing() {
    let two_terms = affinity(json!([
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [
            {"key": "pool", "operator": "Exists"},
            {"key": "spot", "operator": "DoesNotExist"}]}
    ]));
    assert_eq!(
        runs(&two_terms, "n", &[("zone", "a")], &[]),
        Placement::Runs
    );
    assert_eq!(
        runs(&two_terms, "n", &[("pool", "x")], &[]),
        Placement::Runs
    );
    assert_eq!(
        runs(&two_terms, "n", &[("pool", "x"), ("spot", "")], &[]),
        Placement::Excluded(Exclusion::NodeAffinity),
        "ANDed within the term"
    );
    let everything = [("zone", "a"), ("cores", "9")];
    for bad in [
        json!([{}]),
        json!([]),
        json!([{"matchExpressions": [{"key": "zone", "operator": "In", "values": []}]}]),
        json!([{"matchExpressions": [{"key": "zone", "operator": "Exists", "values": ["a"]}]}]),
        json!([{"matchExpressions": [{"key": "cores", "operator": "Gt", "values": ["1", "2"]}]}]),
        json!([{"matchExpressions": [{"key": "cores", "operator": "Gt", "values": ["1.5"]}]}]),
        json!([{"matchExpressions": [{"key": "zone", "operator": "Equals", "values": ["a"]}]}]),
        json!([{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n", "m"]}]}]),
        json!([{"matchFields": [{"key": "metadata.name", "operator": "Exists"}]}]),
        // A good label requirement does not rescue a bad field requirement in its term.
        json!([{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}],
                "matchFields": [{"key": "metadata.name", "operator": "Gt", "values": ["1"]}]}]),
    ] {
        assert_eq!(
            runs(&affinity(bad.clone()), "n", &everything, &[]),
            Placement::Excluded(Exclusion::NodeAffinity),
            "{bad}"
        );
        let mut rescued = bad.as_array().cloned().unwrap_or_default();
        rescued.push(json!({"matchExpressions": [{"key": "zone", "operator": "Exists"}]}));
        assert_eq!(
            runs(&affinity(Value::Array(rescued)), "n", &everything, &[]),
            Placement::Runs,
            "another term still matches after {bad}"
        );
    }
    // An unknown field reads as empty: NotIn holds, In does not.
    let unknown_field = |op: &str| {
        affinity(
            json!([{"matchFields": [{"key": "spec.unschedulable", "operator": op, "values": ["x"]}]}]),
        )
    };
    assert_eq!(
        runs(&unknown_field("NotIn"), "n", &[], &[]),
        Placement::Runs
    );
    assert_eq!(
        runs(&unknown_field("In"), "n", &[], &[]),
        Placement::Excluded(Exclusion::NodeAffinity)
    );
    // nodeSelector and affinity must both hold.
    let mut both = affinity(json!([{"matchExpressions": [{"key": "zone", "operator": "Exists"}]}]));
    both.node_selector = Some(labels(&[LINUX]));
    assert_eq!(
        runs(&both, "n", &[LINUX, ("zone", "a")], &[]),
        Placement::Runs
    );
    assert!(matches!(
        runs(&both, "n", &[("zone", "a")], &[]),
        Placement::Excluded(Exclusion::NodeSelector { .. })
    ));
}

/// `ToleratesTaint`, operator by operator.
#[test]
fn tolerations_match_as_upstream() {
    let t = |v: Value| -> Toleration { serde_json::from_value(v).unwrap() };
    let vk = taint(VK_TAINT, Some("azure"), "NoSchedule");
    let cases = [
        (json!({"operator": "Exists"}), true),
        (json!({"operator": "Exists", "effect": "NoExecute"}), false),
        (json!({"key": VK_TAINT, "operator": "Exists"}), true),
        (json!({"key": VK_TAINT, "value": "azure"}), true),
        (
            json!({"key": VK_TAINT, "operator": "Equal", "value": "aws"}),
            false,
        ),
        (json!({"key": "other", "operator": "Exists"}), false),
        (
            json!({"key": VK_TAINT, "operator": "Bogus", "value": "azure"}),
            false,
        ),
    ];
    for (toleration, want) in cases {
        assert_eq!(tolerates(&t(toleration.clone()), &vk), want, "{toleration}");
    }
    // Lt and Gt compare the taint's value with the toleration's, as integers.
    let level = taint("level", Some("5"), "NoSchedule");
    for (op, value, want) in [
        ("Lt", "6", true),
        ("Lt", "5", false),
        ("Gt", "4", true),
        ("Gt", "x", false),
    ] {
        let toleration = t(json!({"key": "level", "operator": op, "value": value}));
        assert_eq!(tolerates(&toleration, &level), want, "{op} {value}");
    }
}

/// At registration the lifecycle taints admission and the node lifecycle controller manage
/// are left out, every other taint still counts.
#[test]
fn at_registration_the_not_ready_taint_does_not_count() {
    let plain = spec(json!({}));
    let l = labels(&[LINUX]);
    let registering = [
        taint("node.kubernetes.io/not-ready", None, "NoSchedule"),
        taint("node.kubernetes.io/unreachable", None, "NoSchedule"),
    ];
    let node = NodeView {
        name: "n1",
        labels: &l,
        taints: &registering,
    };
    assert_eq!(placement_at_registration(&plain, &node), Placement::Runs);
    assert!(matches!(
        daemon_pod_placement(&plain, &node),
        Placement::Excluded(Exclusion::Taint { .. })
    ));
    let with_vk = [registering[0].clone(), taint(VK_TAINT, None, "NoSchedule")];
    let node = NodeView {
        taints: &with_vk,
        ..node
    };
    assert_eq!(
        placement_at_registration(&plain, &node),
        excluded_by_taint(VK_TAINT, "NoSchedule")
    );
}

#[test]
fn exclusions_read_well_in_a_log() {
    let taint = Exclusion::Taint {
        key: VK_TAINT.into(),
        effect: "NoSchedule".into(),
    };
    assert_eq!(
        taint.to_string(),
        "taint virtual-kubelet.io/provider:NoSchedule not tolerated"
    );
    let key = "kubernetes.io/os".to_string();
    assert_eq!(
        Exclusion::NodeSelector { key }.to_string(),
        "nodeSelector kubernetes.io/os does not match"
    );
}
