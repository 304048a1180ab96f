use super::*;
use std::os::unix::fs::PermissionsExt;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::cni::answers::ResultLabel;

const REPLY: &str = r#"{"cniVersion":"1.1.0","supportedVersions":["1.0.0","1.1.0"]}"#;

/// A plugin whose first run fails the way `fail` says and whose later runs answer.
fn flaky(dir: &Path, fail: &str) -> Prober {
    let script = format!(
        "#!/bin/sh\nif [ ! -e {marker} ]; then : > {marker}; {fail}; fi\necho '{REPLY}'\n",
        marker = dir.join("ran-once").display(),
    );
    let bin = dir.join("flaky");
    std::fs::write(&bin, script).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    Prober::new(vec![dir.to_path_buf()], Duration::from_secs(5))
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// Killed by a signal (as by the OOM killer) or "not found" (127): asked again next time,
/// and the binary's answer then counts.
#[test]
fn transient_failures_are_not_cached() {
    for fail in ["kill -9 $$", "exit 127", "exit 126"] {
        let dir = tempfile::tempdir().unwrap();
        let prober = flaky(dir.path(), fail);
        let first = prober.probe("flaky", deadline());
        assert!(
            matches!(
                first,
                ProbeOutcome::Broken {
                    why: Broken::Failed { .. },
                    ..
                }
            ),
            "{fail}: {first:?}"
        );
        let second = prober.probe("flaky", deadline());
        assert!(
            matches!(second, ProbeOutcome::Answered { .. }),
            "{fail}: the failure was cached: {second:?}"
        );
    }
}

/// A plugin that fails with its own exit code keeps failing the same way until the binary
/// changes: that answer is cached.
#[test]
fn a_plain_failure_is_cached_until_the_binary_changes() {
    let dir = tempfile::tempdir().unwrap();
    let prober = flaky(dir.path(), "exit 3");
    assert!(matches!(
        prober.probe("flaky", deadline()),
        ProbeOutcome::Broken {
            why: Broken::Failed { .. },
            ..
        }
    ));
    assert!(matches!(
        prober.probe("flaky", deadline()),
        ProbeOutcome::Broken {
            why: Broken::Failed { .. },
            ..
        }
    ));
    assert_eq!(prober.cached(), 1);
}

/// A plugin `name` in `dir` that logs "start"/"end" lines to `<dir>/<name>.log` around a
/// `pause` and answers `versions`; installed by a rename, as installers do.
fn plugin(dir: &Path, name: &str, pause: &str, versions: &str) -> PathBuf {
    let log = dir.join(format!("{name}.log"));
    let script = format!(
        "#!/bin/sh\necho start >> {log}\nsleep {pause}\necho end >> {log}\necho '{{\"cniVersion\":\"1.1.0\",\"supportedVersions\":[{versions}]}}'\n",
        log = log.display(),
    );
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, script).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = dir.join(name);
    std::fs::rename(&tmp, &bin).unwrap();
    bin
}

/// How many times `name` was run (its "start" lines).
fn runs(dir: &Path, name: &str) -> usize {
    std::fs::read_to_string(dir.join(format!("{name}.log")))
        .map(|l| l.lines().filter(|l| *l == "start").count())
        .unwrap_or(0)
}

fn count(family: &Family<ResultLabel, Counter>, result: &'static str) -> u64 {
    ProbeCounters::count(family, result)
}

fn supported(o: &ProbeOutcome) -> Vec<String> {
    match o {
        ProbeOutcome::Answered { supported, .. } => supported.clone(),
        other => panic!("not answered: {other:?}"),
    }
}

/// A bin dir with an `istio-cni` answering 1.0.0, and a prober that probed it ahead.
fn preprobed_istio_cni() -> (tempfile::TempDir, Prober) {
    let dir = tempfile::tempdir().unwrap();
    plugin(dir.path(), "istio-cni", "0", r#""1.0.0""#);
    let prober = Prober::new(vec![dir.path().to_path_buf()], Duration::from_secs(5));
    prober.allow(["istio-cni"]);
    prober.preprobe("istio-cni");
    (dir, prober)
}

/// A pre-probed binary is not run again by the verification: its answer is a cache hit.
#[test]
fn a_preprobed_binary_is_a_cache_hit_at_verification() {
    let (dir, prober) = preprobed_istio_cni();
    assert_eq!(runs(dir.path(), "istio-cni"), 1);
    assert_eq!(supported(&prober.probe("istio-cni", deadline())), ["1.0.0"]);
    assert_eq!(runs(dir.path(), "istio-cni"), 1, "run once, ahead");
    let c = prober.counters();
    assert_eq!(count(&c.preprobes, "ran"), 1);
    assert_eq!(count(&c.lookups, "hit"), 1);
    assert_eq!(count(&c.lookups, "miss"), 0);
}

/// Replaced (renamed over) between its pre-probe and the verification: the new binary is
/// run and its answer counts, not the pre-probe's.
#[test]
fn a_binary_replaced_after_its_preprobe_is_not_trusted() {
    let (dir, prober) = preprobed_istio_cni();
    plugin(dir.path(), "istio-cni", "0", r#""0.4.0""#);
    assert_eq!(supported(&prober.probe("istio-cni", deadline())), ["0.4.0"]);
    assert_eq!(runs(dir.path(), "istio-cni"), 2);
    assert_eq!(count(&prober.counters().lookups, "miss"), 1);
    assert_eq!(count(&prober.counters().lookups, "hit"), 0);
}

/// A binary that changes while it runs (here: it touches itself) is answered, but the
/// answer is not cached under either version of it.
#[test]
fn a_binary_changed_during_its_run_is_not_cached() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("self-touching");
    std::fs::write(
        &bin,
        format!(
            "#!/bin/sh\nsleep 0.01\ntouch {}\necho '{REPLY}'\n",
            bin.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let prober = Prober::new(vec![dir.path().to_path_buf()], Duration::from_secs(5));
    assert!(matches!(
        prober.probe("self-touching", deadline()),
        ProbeOutcome::Answered { .. }
    ));
    assert_eq!(prober.cached(), 0);
}

/// A verification asking for a binary whose pre-probe is running waits for it: one run.
#[test]
fn a_verification_waits_for_the_preprobe_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    plugin(dir.path(), "slow", "0.3", r#""1.0.0""#);
    let prober = std::sync::Arc::new(Prober::new(
        vec![dir.path().to_path_buf()],
        Duration::from_secs(5),
    ));
    prober.allow(["slow"]);
    let ahead = {
        let prober = prober.clone();
        std::thread::spawn(move || prober.preprobe("slow"))
    };
    // Until the pre-probe's run has begun.
    while runs(dir.path(), "slow") == 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(supported(&prober.probe("slow", deadline())), ["1.0.0"]);
    ahead.join().unwrap();
    assert_eq!(runs(dir.path(), "slow"), 1, "not run a second time");
    assert_eq!(count(&prober.counters().lookups, "inflight"), 1);
}

/// Pre-probes run only names a verification could ask about, and never through a symlink.
#[test]
fn preprobes_run_only_allowed_plain_files() {
    let dir = tempfile::tempdir().unwrap();
    plugin(dir.path(), "unnamed", "0", r#""1.0.0""#);
    let elsewhere = tempfile::tempdir().unwrap();
    plugin(elsewhere.path(), "target", "0", r#""1.0.0""#);
    std::os::unix::fs::symlink(elsewhere.path().join("target"), dir.path().join("linked")).unwrap();
    let prober = Prober::new(vec![dir.path().to_path_buf()], Duration::from_secs(5));
    prober.allow(["linked", "../x"]);
    prober.preprobe("unnamed");
    prober.preprobe("linked");
    prober.preprobe("../x");
    assert_eq!(runs(dir.path(), "unnamed"), 0, "no config or flag names it");
    assert_eq!(
        runs(elsewhere.path(), "target"),
        0,
        "a symlink is not followed ahead"
    );
    assert_eq!(count(&prober.counters().preprobes, "ran"), 0);
    // The verification still follows the symlink, as libcni does.
    assert!(matches!(
        prober.probe("linked", deadline()),
        ProbeOutcome::Answered { .. }
    ));
}

/// A chain's uncached plugins run side by side: each starts before the others end.
#[test]
fn a_chains_plugins_are_probed_in_parallel() {
    let dir = tempfile::tempdir().unwrap();
    let names = ["a", "b", "c"];
    for n in names {
        plugin(dir.path(), n, "0.3", r#""1.0.0""#);
    }
    let shared = dir.path().join("all.log");
    for n in names {
        // Every plugin also logs into one shared file, in the order things happen.
        let bin = dir.path().join(n);
        let text = std::fs::read_to_string(&bin).unwrap().replace(
            &format!("{}", dir.path().join(format!("{n}.log")).display()),
            &shared.display().to_string(),
        );
        std::fs::write(&bin, text).unwrap();
    }
    let prober = Prober::new(vec![dir.path().to_path_buf()], Duration::from_secs(5));
    let types: Vec<String> = ["a", "b", "a", "c"].iter().map(|s| s.to_string()).collect();
    let started = Instant::now();
    let answers = prober.probe_many(&types, deadline());
    println!(
        "3 plugins sleeping 300 ms each, probed in parallel: {} ms",
        started.elapsed().as_millis()
    );
    assert_eq!(answers.len(), 3);
    assert!(
        answers
            .values()
            .all(|o| matches!(o, ProbeOutcome::Answered { .. })),
        "{answers:?}"
    );
    let log = std::fs::read_to_string(&shared).unwrap();
    let order: Vec<&str> = log.lines().collect();
    assert_eq!(
        order,
        ["start", "start", "start", "end", "end", "end"],
        "all three ran at once"
    );
    assert_eq!(count(&prober.counters().lookups, "miss"), 3);
}
