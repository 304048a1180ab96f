//! The built `meshgate-agent inspect` binary on real namespaces: text and JSON output, exit
//! codes, and the pod's annotations taken from the command line.

use super::*;
use crate::meshes::{ISTIO_INBOUND_WILDCARD, OUT_RANGES};

#[test]
fn inspect_binary_text_json_and_exit_codes() {
    let mut ns = Netns::new("bin");
    ns.addr("10.244.6.12/24");
    ns.sh(&linkerd_rules("iptables-nft", 4143));
    let path = ns.path();
    let path = path.to_str().expect("utf-8 path");
    text_redirected_and_json_missing(path);
    pid_reads_the_same_namespace(&mut ns);
    usage_and_io_errors_exit_two(path);
    a_file_defined_profile_is_inspected(&ns, path);
}

/// Text output of a redirected pod (exit 0), JSON of a missing one (exit 1).
fn text_redirected_and_json_missing(path: &str) {
    let (code, out, err) = binary(&["inspect", "--netns", path, "--profile", "linkerd"]);
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    assert!(out.contains("REDIRECTED"), "{out}");
    assert!(
        out.contains("via ip nat PREROUTING -> PROXY_INIT_REDIRECT (iptables-nft)"),
        "{out}"
    );

    let (code, out, err) = binary(&[
        "inspect",
        "--netns",
        path,
        "--profile",
        "istio",
        "--output",
        "json",
    ]);
    assert_eq!(code, 1, "stdout: {out}\nstderr: {err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    assert_eq!(v["verdict"], "missing");
    assert_eq!(v["profile"], "istio");
    assert_eq!(v["netns"], path);
    assert_eq!(v["inbound"]["port"], 15006);
    assert_eq!(v["inbound"]["found"], false);
    assert_eq!(v["outbound"]["port"], 15001);
    assert!(v["message"].as_str().is_some_and(|m| m.contains("15006")));
}

/// --pid reads the same namespace through a process inside it.
fn pid_reads_the_same_namespace(ns: &mut Netns) {
    let pid = ns.spawn_sleeper().to_string();
    let (code, out, err) = binary(&[
        "inspect",
        "--pid",
        &pid,
        "--profile",
        "linkerd",
        "--output",
        "json",
    ]);
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
    assert_eq!(v["verdict"], "redirected");
    assert_eq!(
        v["outbound"]["via"],
        "ip nat OUTPUT -> PROXY_INIT_OUTPUT (iptables-nft)"
    );
    assert_eq!(v["netns"], format!("/proc/{pid}/ns/net"));
}

/// Usage and I/O errors exit 2.
fn usage_and_io_errors_exit_two(path: &str) {
    let (code, _, err) = binary(&["inspect", "--netns", path, "--profile", "consul"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("consul"), "{err}");
    let (code, _, err) = binary(&[
        "inspect",
        "--netns",
        "/nonexistent/netns",
        "--profile",
        "istio",
    ]);
    assert_eq!(code, 2, "{err}");
    let (code, _, _) = binary(&["inspect", "--profile", "istio"]);
    assert_eq!(code, 2);
}

/// A custom profile from --profile-file.
fn a_file_defined_profile_is_inspected(ns: &Netns, path: &str) {
    let file = std::env::temp_dir().join(format!("{}-profiles.json", ns.name()));
    std::fs::write(
        &file,
        r#"[{"name":"custom","selector":{"labels":{"mesh":"custom"}},"pluginType":"custom-cni","inboundPort":4143,"outboundPort":4140}]"#,
    )
    .expect("write profile file");
    let (code, out, err) = binary(&[
        "inspect",
        "--netns",
        path,
        "--profile",
        "custom",
        "--profile-file",
        file.to_str().expect("utf-8"),
    ]);
    let _ = std::fs::remove_file(&file);
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
}

#[test]
fn inspect_binary_takes_the_pods_annotations() {
    let ns = Netns::new("binann");
    ns.addr("10.244.15.26/24");
    ns.restore("iptables-nft-restore", ISTIO_INBOUND_WILDCARD);
    let path = ns.path();
    let path = path.to_str().expect("utf-8 path");
    let (code, out, err) = binary(&["inspect", "--netns", path, "--profile", "istio"]);
    assert_eq!(code, 1, "stdout: {out}\nstderr: {err}");
    let (code, out, err) = binary(&[
        "inspect",
        "--netns",
        path,
        "--profile",
        "istio",
        "--annotation",
        &format!("{OUT_RANGES}="),
        "--output",
        "json",
    ]);
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("JSON");
    assert_eq!(v["verdict"], "redirected");
    assert_eq!(v["outbound"]["expected"], false);
    assert!(v["inbound"].get("expected").is_none());
    let (code, out, err) = binary(&[
        "inspect",
        "--netns",
        path,
        "--profile",
        "istio",
        "--pod-annotations-json",
        &format!("{{\"{OUT_RANGES}\":\"\",\"app\":\"web\"}}"),
    ]);
    assert_eq!(code, 0, "stdout: {out}\nstderr: {err}");
    assert!(out.contains("not expected"), "{out}");
    let (code, _, err) = binary(&[
        "inspect",
        "--netns",
        path,
        "--profile",
        "istio",
        "--annotation",
        "no-equals-sign",
    ]);
    assert_eq!(code, 2, "{err}");
}
