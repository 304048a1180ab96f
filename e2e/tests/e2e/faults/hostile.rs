//! Hostile entries in the CNI conf and bin dirs never hang or bloat the daemon.

use super::*;

/// One hostile input the agent has answered: what it was, the verdict it showed, and how long
/// that took to show on the Node.
struct Hostile<'a> {
    what: &'a str,
    want: &'a str,
    took: Duration,
}

impl Hostile<'_> {
    /// Undoes the input with `repair`, waits for the Node to say Verified again, records both
    /// times in `report` and the agent's RSS in `rss_max`, and requires the agent's process
    /// `pid` (the one started before the first input) alive.
    async fn repair(
        &self,
        log: &NodeLog,
        agent: &Agent,
        pid: u32,
        repair: impl FnOnce() -> std::io::Result<()>,
        rss_max: &mut u64,
        report: &mut Vec<String>,
    ) -> anyhow::Result<()> {
        let what = self.what;
        *rss_max = (*rss_max).max(agent.rss_kib().unwrap_or(0));
        repair()?;
        let t1 = Instant::now();
        log.wait(
            &format!("verified after removing {what}"),
            Duration::from_secs(10),
            verified,
        )
        .await
        .with_context(|| tail(&agent.log(), 40))?;
        report.push(format!(
            "{what}: {} in {:.0} ms, repaired in {:.0} ms",
            self.want,
            ms(self.took),
            ms(t1.elapsed())
        ));
        ensure!(
            alive(pid),
            "the agent died on {what}:\n{}",
            tail(&agent.log(), 60)
        );
        Ok(())
    }
}

/// Hostile entries against the running daemon, one after the other, each followed by the
/// repair: the node must show the expected reason quickly, return to Verified once the entry
/// is gone, and the agent must stay up with bounded memory.
#[tokio::test]
async fn hostile_entries_in_the_cni_dirs_never_hang_or_bloat_the_daemon() -> anyhow::Result<()> {
    let cp = cp().await;
    let client = cp.client()?;
    let rig = Rig::start(&client, "faults-hostile", |node, dirs| {
        Agent::start(cp, node, dirs, &["--probe-timeout", "500ms"])
    })
    .await?;
    let log = rig.watch_verified(&client).await?;
    let Rig { dirs, agent, .. } = rig;
    let pid = agent.pid().context("pid")?;
    let rss0 = agent.rss_kib().unwrap_or(0);
    let conf = dirs.conf.clone();
    let mut report = Vec::new();
    let mut rss_max = rss0;

    config_entries_are_judged(&conf, &log, &agent, pid, &mut rss_max, &mut report).await?;
    broken_plugins_are_judged(&dirs, &log, &agent, pid, &mut rss_max, &mut report).await?;
    eprintln!(
        "[faults] hostile entries (agent RSS {rss0} KiB at start, max {rss_max} KiB):\n  {}",
        report.join("\n  ")
    );
    ensure!(
        rss_max < rss0 + 32 * 1024,
        "the agent's RSS grew from {rss0} KiB to {rss_max} KiB"
    );
    ensure!(!agent.log().contains("panicked"), "{}", agent.log());
    Ok(())
}

/// Sets up and removes one hostile entry in the conf dir.
type Action = Box<dyn Fn(&Path) -> std::io::Result<()>>;
/// (name, set up, expected reason while present, remove)
type Step = (&'static str, Action, &'static str, Action);

/// The hostile entries in the conf dir, each with the reason the node shows while it is there.
fn config_entries() -> Vec<Step> {
    let rm = |name: &'static str| -> Action {
        Box::new(move |d: &Path| std::fs::remove_file(d.join(name)))
    };
    vec![
        (
            "a sparse 8 GiB file sorting first",
            Box::new(|d: &Path| {
                std::fs::File::create(d.join("00-huge.conflist"))?.set_len(8 << 30)
            }),
            "ConfigInvalid",
            rm("00-huge.conflist"),
        ),
        (
            "a sparse 8 GiB file sorting last",
            Box::new(|d: &Path| {
                std::fs::File::create(d.join("99-huge.conflist"))?.set_len(8 << 30)
            }),
            "Verified",
            rm("99-huge.conflist"),
        ),
        (
            "a symlink loop sorting first",
            Box::new(|d: &Path| {
                std::os::unix::fs::symlink("00-loop.conflist", d.join("00-loop.conflist"))
            }),
            "ConfigInvalid",
            rm("00-loop.conflist"),
        ),
        (
            "a symlink to /dev/zero sorting first",
            Box::new(|d: &Path| {
                std::os::unix::fs::symlink("/dev/zero", d.join("00-zero.conflist"))
            }),
            "ConfigInvalid",
            rm("00-zero.conflist"),
        ),
        (
            "a FIFO sorting first",
            Box::new(|d: &Path| {
                nix::unistd::mkfifo(
                    &d.join("00-fifo.conflist"),
                    nix::sys::stat::Mode::from_bits_truncate(0o644),
                )
                .map_err(std::io::Error::from)
            }),
            "ConfigInvalid",
            rm("00-fifo.conflist"),
        ),
        (
            "a directory named like a config, sorting first",
            Box::new(|d: &Path| std::fs::create_dir(d.join("00-dir.conflist"))),
            "Verified",
            Box::new(|d: &Path| std::fs::remove_dir(d.join("00-dir.conflist"))),
        ),
        (
            // readdir order is arbitrary: among 20,000 entries, a reader that caps the raw
            // listing would miss the lone mesh-only file the runtime loads first.
            "20,000 other files plus a mesh-only config sorting first",
            Box::new(|d: &Path| {
                for i in 0..20_000 {
                    std::fs::write(d.join(format!("zz-{i:05}.bak")), b"{}")?;
                }
                std::fs::write(d.join("00-linkerd-cni.conf"), golden("linkerd-only.conf")?)
            }),
            "PrimaryPluginMissing",
            Box::new(|d: &Path| {
                std::fs::remove_file(d.join("00-linkerd-cni.conf"))?;
                for i in 0..20_000 {
                    std::fs::remove_file(d.join(format!("zz-{i:05}.bak")))?;
                }
                Ok(())
            }),
        ),
    ]
}

/// Each hostile conf dir entry in turn: the node shows the expected reason quickly (or stays
/// Verified), and returns to Verified once the entry is removed.
async fn config_entries_are_judged(
    conf: &Path,
    log: &NodeLog,
    agent: &Agent,
    pid: u32,
    rss_max: &mut u64,
    report: &mut Vec<String>,
) -> anyhow::Result<()> {
    let steps = config_entries();
    for (what, setup, reason, remove) in &steps {
        setup(conf)?;
        let t0 = Instant::now();
        let want = *reason;
        let took = if want == "Verified" {
            // Nothing changes: give the agent time to look, then check it still says so.
            tokio::time::sleep(Duration::from_secs(1)).await;
            log.wait(what, Duration::from_secs(5), verified)
                .await
                .with_context(|| tail(&agent.log(), 40))?;
            Duration::ZERO
        } else {
            log.wait(what, Duration::from_secs(10), move |s: &Seen| {
                s.tainted && s.reason.as_deref() == Some(want)
            })
            .await
            .with_context(|| tail(&agent.log(), 40))?;
            t0.elapsed()
        };
        let hostile = Hostile { what, want, took };
        hostile
            .repair(log, agent, pid, || remove(conf), rss_max, report)
            .await?;
    }
    Ok(())
}

/// Plugins: one floods stdout forever, one floods stderr and exits 1, one exits at once but
/// leaves a child holding its stdout open. Each is judged broken, and the node returns to
/// Verified once the good plugin is back.
async fn broken_plugins_are_judged(
    dirs: &CniDirs,
    log: &NodeLog,
    agent: &Agent,
    pid: u32,
    rss_max: &mut u64,
    report: &mut Vec<String>,
) -> anyhow::Result<()> {
    let plugins = [
        (
            "floods stdout forever",
            "#!/bin/sh\nexec yes 0123456789abcdef0123456789abcdef\n",
        ),
        (
            "floods stderr, then fails",
            "#!/bin/sh\nhead -c 50000000 /dev/zero | tr '\\0' x >&2\nexit 1\n",
        ),
        (
            "leaves a child holding stdout",
            "#!/bin/sh\nsleep 60 &\necho '{\"cniVersion\":\"1.0.0\",\"supportedVersions\":[\"0.3.1\"]}'\nexit 0\n",
        ),
    ];
    for (what, script) in plugins {
        let t0 = Instant::now();
        dirs.plugin("linkerd-cni", script)?;
        log.wait(what, Duration::from_secs(10), gated("PluginBinaryBroken"))
            .await
            .with_context(|| format!("plugin that {what}\n{}", tail(&agent.log(), 40)))?;
        let what = format!("a plugin that {what}");
        let hostile = Hostile {
            what: &what,
            want: "PluginBinaryBroken",
            took: t0.elapsed(),
        };
        let fix = || dirs.plugin("linkerd-cni", GOOD_PLUGIN).map(drop);
        hostile
            .repair(log, agent, pid, fix, rss_max, report)
            .await?;
    }
    Ok(())
}
