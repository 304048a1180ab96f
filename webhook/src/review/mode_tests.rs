//! What the reviewer answers in each mode: report admits what enforce refuses, with a
//! warning and an audit annotation; condition-only refuses as enforce does; only enforce
//! taints a Node at CREATE.

use meshgate_core::mode::Mode;
use serde_json::{Value, json};
use tokio::sync::watch;

use super::WOULD_REFUSE;
use super::tests::{
    binding_review, decoded_patch, fake_cluster, node_review, pod_review, reviewer, validate, wire,
};

fn metrics_text(registry: &prometheus_client::registry::Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    text
}

#[tokio::test]
async fn report_mode_admits_what_enforce_refuses_with_a_warning_and_an_audit_annotation() {
    let (tx, rx) = watch::channel(Mode::Report);
    let (r, registry) = reviewer(fake_cluster());
    let r = r.with_mode(rx);
    for review in [
        pod_review("web", Some("bad"), true),
        binding_review("meshed", "bad"),
    ] {
        let out = validate(&r, &review).await;
        let resp = &out["response"];
        assert_eq!(resp["allowed"], true, "{out}");
        assert!(
            resp["status"].get("code").is_none(),
            "no refusal status: {out}"
        );
        let warning = resp["warnings"][0].as_str().unwrap_or_default();
        assert!(
            warning.starts_with(
                "meshgate report mode: enforce would refuse this: meshgate: pod shop/"
            ),
            "{warning}"
        );
        assert!(warning.contains("ChainedPluginMissing"), "{warning}");
        let note = resp["auditAnnotations"][WOULD_REFUSE]
            .as_str()
            .unwrap_or_default();
        assert!(note.contains("node bad"), "{out}");
    }
    // A dry run is answered alike but places nothing: not counted.
    let mut dry = pod_review("web", Some("bad"), true);
    dry["request"]["dryRun"] = json!(true);
    let out = validate(&r, &dry).await;
    assert_eq!(out["response"]["allowed"], true, "{out}");
    assert!(out["response"]["warnings"][0].is_string(), "{out}");
    // What enforce would allow carries nothing.
    let ok = validate(&r, &pod_review("web", Some("good"), true)).await;
    assert_eq!(ok["response"]["allowed"], true);
    assert!(ok["response"].get("warnings").is_none(), "{ok}");
    let text = metrics_text(&registry);
    assert!(
        text.lines()
            .any(|l| l == "meshgate_report_only_actions_total{action=\"refuse\"} 2"),
        "{text}"
    );
    // Switched live to enforce, then condition-only: refused again, nothing more counted.
    for mode in [Mode::Enforce, Mode::ConditionOnly] {
        tx.send(mode).unwrap();
        let out = validate(&r, &pod_review("web", Some("bad"), true)).await;
        assert_eq!(out["response"]["allowed"], false, "{mode}: {out}");
        assert_eq!(out["response"]["status"]["code"], 403);
        assert!(out["response"].get("warnings").is_none());
    }
    assert!(
        metrics_text(&registry)
            .lines()
            .any(|l| l == "meshgate_report_only_actions_total{action=\"refuse\"} 2")
    );
}

#[test]
fn only_enforce_taints_a_node_at_create() {
    let node = json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "n1", "labels": {"kubernetes.io/hostname": "n1"}},
        "spec": {}
    });
    let label = json!({"op": "add", "path": "/metadata/labels/meshgate.io~1cni-verified", "value": "false"});
    let (tx, rx) = watch::channel(Mode::Enforce);
    let (r, _) = reviewer(fake_cluster());
    let r = r.with_mode(rx);
    let patch =
        |r: &super::Reviewer<_>| decoded_patch(&wire(r.mutate_node(&node_review(node.clone()))));
    let enforce = patch(&r);
    assert_eq!(enforce[0], label);
    assert_eq!(enforce[1]["path"], "/spec/taints", "{enforce}");
    for mode in [Mode::Report, Mode::ConditionOnly] {
        tx.send(mode).unwrap();
        assert_eq!(patch(&r), Value::Array(vec![label.clone()]), "{mode}");
    }
}
