use super::*;
use crate::gate::{DEFAULT_TAINT_KEY, LEGACY_TAINT_KEY};

const TAINT_KEY: &str = DEFAULT_TAINT_KEY;

fn key(k: &str) -> TaintKey {
    k.parse().unwrap()
}

fn node(taints: Value, labels: Value, conditions: Value) -> Node {
    serde_json::from_value(json!({
        "metadata": {"name": "n1", "resourceVersion": "41", "labels": labels},
        "spec": {"taints": taints},
        "status": {"conditions": conditions},
    }))
    .unwrap()
}

/// Applies a JSON Patch as the apiserver would (the `test` included).
fn apply(node: &Node, patch: &Value) -> Value {
    let mut doc = serde_json::to_value(node).unwrap();
    let ops = patch.as_array().unwrap();
    for op in ops {
        let path = op["path"].as_str().unwrap();
        let (parent, last) = path.rsplit_once('/').unwrap();
        let last = last.replace("~1", "/").replace("~0", "~");
        match op["op"].as_str().unwrap() {
            "test" => assert_eq!(doc.pointer(path), Some(&op["value"]), "{path}"),
            "remove" => match doc.pointer_mut(parent).unwrap() {
                Value::Object(m) => assert!(m.remove(&last).is_some(), "{path}"),
                Value::Array(a) => {
                    a.remove(last.parse().unwrap());
                }
                other => panic!("{path} in {other}"),
            },
            "replace" => *doc.pointer_mut(path).unwrap() = op["value"].clone(),
            other => panic!("op {other}"),
        }
    }
    doc
}

#[test]
fn only_meshgates_marks_are_removed() {
    let n = node(
        json!([
            {"key": "example.com/maintenance", "effect": "NoSchedule"},
            {"key": TAINT_KEY, "effect": "NoExecute", "timeAdded": "2026-11-26T10:00:00Z"},
            {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"},
            // Left by a release before --taint-key: meshgate's too.
            {"key": LEGACY_TAINT_KEY, "effect": "NoSchedule"},
        ]),
        json!({"kubernetes.io/hostname": "n1", VERIFIED_LABEL: "false", "team": "a"}),
        json!([
            {"type": "Ready", "status": "True"},
            {"type": CONDITION_TYPE, "status": "False", "reason": "NoConfig"},
            {"type": "DiskPressure", "status": "False"},
        ]),
    );
    assert_eq!(
        marks(&n, &key(TAINT_KEY)),
        Marks {
            taint: true,
            label: true,
            condition: true
        }
    );
    let meta = metadata_patch(&n, &key(TAINT_KEY)).unwrap();
    assert_eq!(
        meta[0],
        json!({"op": "test", "path": "/metadata/resourceVersion", "value": "41"})
    );
    let after = apply(&n, &meta);
    assert_eq!(
        after["spec"]["taints"],
        json!([
            {"key": "example.com/maintenance", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"},
        ])
    );
    assert_eq!(
        after["metadata"]["labels"],
        json!({"kubernetes.io/hostname": "n1", "team": "a"})
    );
    let after = apply(&n, &status_patch(&n).unwrap());
    assert_eq!(
        after["status"]["conditions"],
        json!([{"type": "Ready", "status": "True"}, {"type": "DiskPressure", "status": "False"}])
    );
}

#[test]
fn a_clean_node_needs_no_write() {
    let n = node(
        json!([{"key": "example.com/maintenance", "effect": "NoSchedule"}]),
        json!({"kubernetes.io/hostname": "n1"}),
        json!([{"type": "Ready", "status": "True"}]),
    );
    assert!(marks(&n, &key(TAINT_KEY)).is_empty());
    assert_eq!(metadata_patch(&n, &key(TAINT_KEY)), None);
    assert_eq!(status_patch(&n), None);
    let bare: Node = serde_json::from_value(json!({"metadata": {"name": "n2"}})).unwrap();
    assert!(marks(&bare, &key(TAINT_KEY)).is_empty());
    assert_eq!(metadata_patch(&bare, &key(TAINT_KEY)), None);
    assert_eq!(status_patch(&bare), None);
}

#[test]
fn the_last_taint_removes_the_list_and_the_key_is_a_parameter() {
    let n = node(
        json!([{"key": "readiness.k8s.io/mesh-cni", "effect": "NoSchedule"}]),
        json!({}),
        json!([]),
    );
    // Another key: nothing of meshgate's under today's default.
    assert_eq!(metadata_patch(&n, &key(TAINT_KEY)), None);
    let patch = metadata_patch(&n, &key("readiness.k8s.io/mesh-cni")).unwrap();
    assert_eq!(patch[1], json!({"op": "remove", "path": "/spec/taints"}));
    assert_eq!(
        marks(&n, &key("readiness.k8s.io/mesh-cni")).describe(),
        "taint"
    );
}

#[test]
fn repeated_conditions_are_removed_highest_index_first() {
    let n = node(
        json!([]),
        json!({}),
        json!([
            {"type": CONDITION_TYPE, "status": "True"},
            {"type": "Ready", "status": "True"},
            {"type": CONDITION_TYPE, "status": "False"},
        ]),
    );
    let patch = status_patch(&n).unwrap();
    assert_eq!(patch[1]["path"], "/status/conditions/2");
    assert_eq!(patch[2]["path"], "/status/conditions/0");
    let after = apply(&n, &patch);
    assert_eq!(
        after["status"]["conditions"],
        json!([{"type": "Ready", "status": "True"}])
    );
}
