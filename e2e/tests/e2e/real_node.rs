//! The real-node tier: a kubelet built from the pinned module and containerd with runc and the
//! reference CNI plugins, registered against the shared control plane; real pods from local
//! images; Istio's real CNI plugin writing the rules; `meshgate-agent inspect --pid` judging
//! the pods' real network namespaces; `meshgate-agent check`'s effective file against what
//! containerd reports loaded (CRI `Status`) and what a pod's sandbox ran (libcni's cache).
//!
//! In: the node binaries and images `e2e/install-deps.sh` caches, root. Out: pass/fail. A part
//! of the node that cannot start fails the test with [`meshgate_e2e::Error::RealNode`] naming
//! it; nothing here skips. The node is torn down at the end, and on a failure by its drop.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use meshgate_e2e::harness::wait::poll_until;
use meshgate_e2e::real::node::{CachedAttachment, RealNode, host_residue, start_control_plane};
use meshgate_e2e::real::story::{
    self, Transcript, all_running, app_pid, in_netns, inspect_pid, istio_cni_kubeconfig,
    istio_cni_log,
};

/// A pod's containers start within this on the real node (images are local).
const POD_START: Duration = Duration::from_secs(90);

/// One real node at a time in this process: two kubelets and containerds at once would only
/// compete for the 2 CPUs, and after each test nothing may be left on the host, which can
/// only be checked once no other real node runs.
pub(crate) static ONE_NODE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A test that fails with pods running still tears its node down: the node is dropped while
/// the panic unwinds, and its drop runs the same teardown as `stop`.
#[tokio::test]
async fn a_failing_real_node_test_leaves_nothing_behind() -> anyhow::Result<()> {
    let _one = ONE_NODE.lock().await;
    let cp = std::sync::Arc::new(start_control_plane().await?);
    let client = cp.client()?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let task_client = client.clone();
    let task_cp = cp.clone();
    let failed = tokio::spawn(async move {
        let cp = &*task_cp;
        let node = RealNode::start(cp)
            .await
            .expect("the real node did not come up");
        let ns = cp
            .create_namespace(&task_client, "real-node-fail")
            .await
            .expect("namespace");
        run_pod(&task_client, &node, &ns, pod(&node, "doomed", false))
            .await
            .expect("pod");
        let _ = tx.send((node.name().to_owned(), node.footprint().clone()));
        panic!("a real-node test failing with a pod running");
    })
    .await;
    ensure!(
        failed.as_ref().is_err_and(|e| e.is_panic()),
        "the failing test did not panic: {failed:?}"
    );
    let (name, footprint) = rx
        .await
        .context("the node did not start, so the teardown was not exercised")?;
    let mut left = footprint.residue();
    left.extend(host_residue());
    ensure!(left.is_empty(), "left behind after a failed test: {left:?}");
    let nodes: Api<Node> = Api::all(client);
    ensure!(
        nodes.get_opt(&name).await?.is_none(),
        "Node {name} still exists"
    );
    Ok(())
}

/// For conf-dir layouts where runtimes and readers have disagreed (a lone `.conf` sorting
/// first, an invalid first file, a `.conf` beside a `.conflist` of the same stem, a leftover
/// `.bak`), `meshgate-agent check --runtime containerd` names the config containerd really
/// loaded, as containerd reports it in its verbose CRI status.
#[tokio::test]
async fn check_names_the_config_containerd_really_loaded() -> anyhow::Result<()> {
    let _one = ONE_NODE.lock().await;
    let cp = &start_control_plane().await?;
    let node = RealNode::start(cp)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))
        .context("the real node did not come up")?;
    print_times(&node);
    let dir = node.cni_conf_dir();
    // The drop-in directory of the primary network, and where it is prepared.
    let drop_in = dir.join("meshgate-e2e");
    let staged = dir.with_file_name("drop-in.staged");
    let mut steps = plain_layouts(&dir);
    steps.extend(drop_in_layouts(&dir, &drop_in, &staged));
    for (what, change, want) in steps {
        change().with_context(|| format!("writing the layout: {what}"))?;
        let (_, files) = agree_on(&node, what, want).await?;
        eprintln!(
            "layout \"{what}\" {files:?}: containerd and meshgate both load {}",
            describe(want)
        );
    }
    node.stop();
    assert_clean(&cp.client()?, &node).await
}

/// What a layout should load: Some((network name, plugin types)), or None when the first file
/// is invalid and nothing is loaded.
type Want = Option<(&'static str, &'static [&'static str])>;
/// Writes one layout over the previous one.
type Layout<'a> = Box<dyn Fn() -> std::io::Result<()> + 'a>;

/// A single-plugin `.conf` of network `name`.
fn single_conf(name: &str) -> String {
    serde_json::json!({
        "cniVersion": "0.4.0", "name": name, "type": "bridge", "bridge": "unused0",
        "ipam": {"type": "host-local", "subnet": "10.201.0.0/24"}
    })
    .to_string()
}

/// A two-plugin `.conflist` of network `name`.
fn list_conf(name: &str) -> String {
    serde_json::json!({
        "cniVersion": "1.0.0", "name": name,
        "plugins": [{"type": "bridge", "bridge": "unused1"}, {"type": "portmap", "capabilities": {"portMappings": true}}]
    })
    .to_string()
}

/// containerd 2.4.2 reloads its CNI config on Write, Remove and Rename events in the conf dir,
/// never on Create or Chmod (`internal/cri/server/cni_conf_syncer.go`): an entry that only
/// appears (a symlink, a directory or file renamed in) is loaded at the next other event. The
/// layouts that only create end with this rewrite of the ignored `.bak`, the event a later
/// config write would bring. (meshgate re-verifies on every event.)
fn reload(dir: &Path) -> std::io::Result<()> {
    std::fs::write(dir.join("00-old.conflist.bak"), list_conf("old"))
}

/// Layouts of plain files in `dir`: (what is on disk, how it is written, what both must name).
fn plain_layouts(dir: &Path) -> Vec<(&'static str, Layout<'_>, Want)> {
    let write = move |name: &str, text: &str| std::fs::write(dir.join(name), text);
    vec![
        (
            "the primary conflist alone",
            Box::new(|| Ok(())),
            Some(("meshgate-e2e", &["bridge", "portmap"])),
        ),
        (
            "a lone .conf sorting first",
            Box::new(move || write("05-lone.conf", &single_conf("lone"))),
            Some(("lone", &["bridge"])),
        ),
        (
            "an invalid first file",
            Box::new(move || {
                write(
                    "01-broken.conflist",
                    "{\"cniVersion\": \"1.0.0\", \"name\": ",
                )
            }),
            None,
        ),
        (
            "a leftover .bak sorting first, the .conf moved after the conflist",
            Box::new(move || {
                std::fs::remove_file(dir.join("01-broken.conflist"))?;
                std::fs::rename(dir.join("05-lone.conf"), dir.join("20-lone.conf"))?;
                write("00-old.conflist.bak", &list_conf("old"))
            }),
            Some(("meshgate-e2e", &["bridge", "portmap"])),
        ),
        (
            "a .conf beside a .conflist of the same stem",
            Box::new(move || write("10-meshgate-e2e-bridge.conf", &single_conf("beside"))),
            Some(("beside", &["bridge"])),
        ),
    ]
}

/// CNI 1.1 drop-ins (libcni v1.3.1 `NetworkConfFromFile`, which containerd 2.4.2 vendors):
/// `<conf dir>/<network name>/*.conf` is appended to the list. The directory `drop_in` is made
/// at `staged`, beside the conf dir, and renamed in whole.
fn drop_in_layouts<'a>(
    dir: &'a Path,
    drop_in: &'a Path,
    staged: &'a Path,
) -> Vec<(&'static str, Layout<'a>, Want)> {
    vec![
        (
            "a drop-in plugin directory for the primary network",
            Box::new(move || {
                std::fs::remove_file(dir.join("10-meshgate-e2e-bridge.conf"))?;
                std::fs::create_dir(staged)?;
                std::fs::write(
                    staged.join("50-portmap.conf"),
                    r#"{"type": "portmap", "capabilities": {"portMappings": true}}"#,
                )?;
                std::fs::rename(staged, drop_in)?;
                reload(dir)
            }),
            Some(("meshgate-e2e", &["bridge", "portmap", "portmap"])),
        ),
        (
            "a symlink to a directory sorting first (a candidate that cannot be read)",
            Box::new(move || {
                std::os::unix::fs::symlink(drop_in, dir.join("00-linked.conflist"))?;
                reload(dir)
            }),
            None,
        ),
        (
            "a regular file where the drop-in directory would be",
            Box::new(move || {
                std::fs::remove_file(dir.join("00-linked.conflist"))?;
                std::fs::remove_dir_all(drop_in)?;
                std::fs::write(dir.join("meshgate-e2e"), "not a directory")
            }),
            None,
        ),
    ]
}

/// The second witness of what containerd loaded: for a pod sandbox containerd really created,
/// the config list libcni really executed, from libcni's result cache (written once every
/// plugin of the list returned from ADD). For each layout, once CRI `Status` shows it loaded,
/// a pod runs, and the chain that ran for its `eth0` must be the file `meshgate-agent check`
/// names as effective: the same network, plugins and content. libcni caches the list's file
/// bytes, never its CNI 1.1 drop-ins, so for the drop-in layout the drop-in (istio-cni) must
/// show it ran by what it did: its log names the pod, and the pod is redirected. Where
/// nothing is loaded (`check`: `ConfigInvalid`), a pod is refused and no chain runs.
#[tokio::test]
async fn a_pod_sandboxs_real_chain_is_the_file_check_names() -> anyhow::Result<()> {
    let _one = ONE_NODE.lock().await;
    let cp = &start_control_plane().await?;
    let client = cp.client()?;
    let node = RealNode::start(cp)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))
        .context("the real node did not come up")?;
    let ns = cp.create_namespace(&client, "real-chain").await?;
    let kubeconfig = istio_cni_kubeconfig(cp, &client, &ns).await?;
    let dir = node.cni_conf_dir();
    let drop_in = dir.join("meshgate-e2e");
    let staged = dir.with_file_name("drop-in.staged");
    let steps = loaded_layouts(&node, &kubeconfig, &dir, &drop_in, &staged)?;
    for (i, (what, change, want, meshed)) in steps.into_iter().enumerate() {
        change().with_context(|| format!("writing the layout: {what}"))?;
        let name = format!("chain-{i}");
        the_chain_that_ran(&node, &client, &ns, &name, what, want, meshed).await?;
    }
    // Layouts where nothing is loaded: check says ConfigInvalid, containerd loads nothing, and
    // no chain runs. A pod created meanwhile is refused by the kubelet (`NetworkNotReady`) or
    // by containerd (`FailedCreatePodSandBox`), and libcni caches nothing for it. Each is
    // undone before anything can fail: the teardown's CNI DELs need a valid config (with
    // none, the kubelet retries them until the drain gives up, about a minute).
    let linked = dir.join("00-linked.conflist");
    let broken = dir.join("01-broken.conflist");
    let invalid = invalid_layouts(&dir, &drop_in, &linked, &broken);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    for (j, (what, spoil, restore, after)) in invalid.into_iter().enumerate() {
        spoil().with_context(|| format!("writing the layout: {what}"))?;
        let name = format!("chain-invalid-{j}");
        nothing_loaded_refuses_the_pod(&node, &pods, &events, what, &name, restore).await?;
        agree_on(&node, &format!("{what}, undone"), Some(after)).await?;
    }
    node.stop();
    assert_clean(&client, &node).await
}

/// Writes one layout over the previous one, or undoes one.
type Change<'a> = Box<dyn Fn() -> anyhow::Result<()> + 'a>;

/// Layouts containerd loads: (layout, how it is written, the network both views must name,
/// whether the pod is meshed). The drop-in is prepared at `staged` and renamed to `drop_in`.
fn loaded_layouts<'a>(
    node: &'a RealNode,
    kubeconfig: &'a str,
    dir: &'a Path,
    drop_in: &'a Path,
    staged: &'a Path,
) -> anyhow::Result<Vec<(&'static str, Change<'a>, Network, bool)>> {
    // A lone network on the node's own bridge and IPAM (the primary list's first plugin), so
    // a pod can run through it and the teardown removes what it creates.
    let primary: serde_json::Value = serde_json::from_slice(&std::fs::read(node.conflist_path())?)?;
    let single = |name: &str| {
        let mut conf = primary["plugins"][0].clone();
        conf["cniVersion"] = "1.0.0".into();
        conf["name"] = name.into();
        conf.to_string()
    };
    let (old, beside, lone) = (single("old"), single("beside"), single("lone"));
    Ok(vec![
        (
            "the primary conflist alone",
            Box::new(|| Ok(())),
            ("meshgate-e2e", &["bridge", "portmap"]),
            false,
        ),
        (
            "istio-cni chained by its installer",
            Box::new(move || Ok(node.install_istio_cni(kubeconfig, false)?)),
            ("meshgate-e2e", &["bridge", "portmap", "istio-cni"]),
            false,
        ),
        (
            "a leftover .bak of another network sorting first",
            Box::new(move || Ok(std::fs::write(dir.join("00-old.conflist.bak"), &old)?)),
            ("meshgate-e2e", &["bridge", "portmap", "istio-cni"]),
            false,
        ),
        (
            "a .conf beside the .conflist of the same stem",
            Box::new(move || {
                Ok(std::fs::write(
                    dir.join("10-meshgate-e2e-bridge.conf"),
                    &beside,
                )?)
            }),
            ("beside", &["bridge"]),
            false,
        ),
        (
            "a lone .conf sorting first",
            Box::new(move || Ok(std::fs::write(dir.join("05-lone.conf"), &lone)?)),
            ("lone", &["bridge"]),
            false,
        ),
        (
            "istio-cni as a CNI 1.1 drop-in of the primary network",
            Box::new(move || istio_cni_as_drop_in(node, dir, drop_in, staged)),
            ("meshgate-e2e", &["bridge", "portmap", "istio-cni"]),
            true,
        ),
    ])
}

/// Moves the entry istio-cni's installer appended out of the list into a drop-in of the
/// primary network, prepared at `staged` and renamed to `drop_in`.
fn istio_cni_as_drop_in(
    node: &RealNode,
    dir: &Path,
    drop_in: &Path,
    staged: &Path,
) -> anyhow::Result<()> {
    std::fs::remove_file(dir.join("05-lone.conf"))?;
    std::fs::remove_file(dir.join("10-meshgate-e2e-bridge.conf"))?;
    // The entry the installer appended, moved out of the list into the drop-in.
    let list: serde_json::Value = serde_json::from_slice(&std::fs::read(node.conflist_path())?)?;
    let entry = list["plugins"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["type"] == "istio-cni"))
        .context("the conflist has no istio-cni entry to move")?
        .to_string();
    node.remove_istio_cni()?;
    std::fs::create_dir(staged)?;
    std::fs::write(staged.join("50-istio-cni.conf"), entry)?;
    std::fs::rename(staged, drop_in)?;
    // Renamed in whole, which containerd does not reload on: nudge it with a write
    // (see check_names_the_config_containerd_really_loaded).
    Ok(std::fs::write(dir.join("00-old.conflist.bak"), "{}")?)
}

/// Layouts where nothing is loaded: (layout, how it is written, how it is undone, the network
/// both views name once it is undone).
fn invalid_layouts<'a>(
    dir: &'a Path,
    drop_in: &'a Path,
    linked: &'a Path,
    broken: &'a Path,
) -> Vec<(&'static str, Change<'a>, Change<'a>, Network)> {
    let nudge = move || std::fs::write(dir.join("00-old.conflist.bak"), "{}");
    vec![
        (
            "an invalid first file",
            Box::new(move || {
                Ok(std::fs::write(
                    broken,
                    "{\"cniVersion\": \"1.0.0\", \"name\": ",
                )?)
            }),
            Box::new(move || Ok(std::fs::remove_file(broken)?)),
            ("meshgate-e2e", &["bridge", "portmap", "istio-cni"]),
        ),
        (
            "a symlink to a directory sorting first",
            Box::new(move || {
                std::os::unix::fs::symlink(drop_in, linked)?;
                Ok(nudge()?)
            }),
            Box::new(move || Ok(std::fs::remove_file(linked)?)),
            ("meshgate-e2e", &["bridge", "portmap", "istio-cni"]),
        ),
        (
            "a regular file where the drop-in directory would be",
            Box::new(move || {
                std::fs::remove_dir_all(drop_in)?;
                Ok(std::fs::write(drop_in, "not a directory")?)
            }),
            Box::new(move || Ok(std::fs::remove_file(drop_in)?)),
            ("meshgate-e2e", &["bridge", "portmap"]),
        ),
    ]
}

/// With nothing loaded, pod `name` is refused and no chain runs for it; the pod is deleted and
/// the layout undone with `restore` before anything can fail.
async fn nothing_loaded_refuses_the_pod(
    node: &RealNode,
    pods: &Api<Pod>,
    events: &Api<Event>,
    what: &str,
    name: &str,
    restore: Change<'_>,
) -> anyhow::Result<()> {
    let refused = refusal(node, pods, events, what, name).await;
    let _ = pods
        .delete(name, &DeleteParams::default().grace_period(0))
        .await;
    restore().with_context(|| format!("undoing the layout: {what}"))?;
    let (event, ran) = refused.with_context(|| format!("layout \"{what}\""))?;
    ensure!(
        ran.is_empty(),
        "layout \"{what}\": a chain ran for {name} although nothing is loaded: {ran:?}"
    );
    eprintln!(
        "layout \"{what}\": {name} refused ({}: {}); no chain ran",
        event.reason.unwrap_or_default(),
        event.message.unwrap_or_default()
    );
    Ok(())
}

/// A pod network both views must name: its name and plugin types.
type Network = (&'static str, &'static [&'static str]);
/// Once both views name `want` for layout `what`, a pod runs (a sidecar pod when `meshed`), and
/// the chain libcni cached for its `eth0` is the file `check` calls effective: one entry, made
/// for its sandbox, with the address its namespace holds; a drop-in (istio-cni) shows it ran
/// by programming the pod.
async fn the_chain_that_ran(
    node: &RealNode,
    client: &Client,
    ns: &str,
    name: &str,
    what: &str,
    want: Network,
    meshed: bool,
) -> anyhow::Result<()> {
    let (verdict, files) = agree_on(node, what, Some(want)).await?;
    let (pod, started) = run_pod(client, node, ns, pod(node, name, meshed)).await?;
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let ran = node.pod_attachments(&uid)?;
    // One sandbox, one pod network: exactly one eth0 entry, made for that sandbox.
    let eth0s: Vec<&CachedAttachment> = ran.iter().filter(|a| a.if_name == "eth0").collect();
    let [eth0] = eth0s[..] else {
        bail!(
            "layout \"{what}\": not one eth0 attachment of pod {ns}/{name} (uid {uid}) in {}: {ran:?}",
            node.cni_cache_dir().display()
        );
    };
    ensure!(
        eth0.cni_arg("K8S_POD_INFRA_CONTAINER_ID") == Some(eth0.container_id.as_str())
            && eth0.cni_arg("K8S_POD_NAME") == Some(name),
        "layout \"{what}\": the eth0 entry of {name} names another sandbox or pod: {eth0:?}"
    );
    let effective = effective_file(node, &verdict)?;
    let matched = compare_chain(eth0, &verdict, &effective)
        .with_context(|| format!("layout \"{what}\" {files:?}: pod {ns}/{name}"))?;
    // The entry is this pod's sandbox: the address its chain returned is the one on the
    // eth0 of the pod's network namespace.
    let pid = app_pid(node, &pod).await?;
    ensure_address(pid, eth0)
        .await
        .with_context(|| format!("layout \"{what}\": pod {name}"))?;
    if !effective.drop_ins.is_empty() {
        // The drop-in is istio-cni: it ran if it programmed this pod.
        let (code, judged) = inspect_pid(pid).await?;
        ensure!(
            istio_cni_log(node).contains(name) && code == Some(0) && judged == "redirected",
            "layout \"{what}\": the drop-in istio-cni did not run for {name} (inspect: exit \
             {code:?}, {judged}); its log:\n{}",
            istio_cni_log(node)
        );
    }
    eprintln!(
        "layout \"{what}\": pod {name} running after {started:?}; sandbox {} ran {} {:?} on \
         eth0 ({matched}); its attachments: {:?}",
        eth0.container_id,
        eth0.network_name,
        eth0.plugins,
        ran.iter().map(|a| a.file_name()).collect::<Vec<_>>()
    );
    Ok(())
}

/// Once both views say nothing is loaded for layout `what`, a pod created is refused by the
/// kubelet or containerd: the Event that says so, and what libcni cached for the pod.
async fn refusal(
    node: &RealNode,
    pods: &Api<Pod>,
    events: &Api<Event>,
    what: &str,
    name: &str,
) -> anyhow::Result<(Event, Vec<CachedAttachment>)> {
    agree_on(node, what, None).await?;
    let created = pods
        .create(&PostParams::default(), &pod(node, name, false))
        .await?;
    let lp = ListParams::default().fields(&format!("involvedObject.name={name}"));
    let event = poll_until(&format!("the refusal of {name}"), POD_START, || async {
        let list = events.list(&lp).await?;
        anyhow::Ok(list.items.into_iter().find(|e| {
            matches!(
                e.reason.as_deref(),
                Some("NetworkNotReady" | "FailedCreatePodSandBox")
            )
        }))
    })
    .await?;
    let uid = created.metadata.uid.unwrap_or_default();
    Ok((event, node.pod_attachments(&uid)?))
}

/// The addresses `ran` cached for its interface are on that interface in `pid`'s namespace.
async fn ensure_address(pid: i32, ran: &CachedAttachment) -> anyhow::Result<()> {
    let shown = in_netns(pid, &["ip", "-o", "addr", "show", "dev", &ran.if_name]).await?;
    ensure!(
        !ran.ips.is_empty()
            && ran
                .ips
                .iter()
                .all(|ip| shown.split_whitespace().any(|w| w == ip)),
        "the cached result of {} gave {:?}; {} in the pod's namespace has:\n{shown}",
        ran.file_name(),
        ran.ips,
        ran.if_name
    );
    Ok(())
}

/// The file `check` calls effective, read back: its path and bytes, and, when it is a list,
/// its CNI 1.1 drop-ins (`<conf dir>/<network name>/*.conf`, in name order).
struct Effective {
    path: std::path::PathBuf,
    bytes: Vec<u8>,
    drop_ins: Vec<serde_json::Value>,
}

fn effective_file(node: &RealNode, verdict: &serde_json::Value) -> anyhow::Result<Effective> {
    let file = verdict["config_file"]
        .as_str()
        .with_context(|| format!("check named no effective file: {verdict}"))?;
    let path = node
        .cni_conf_dir()
        .join(Path::new(file).file_name().unwrap_or_default());
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let conf: serde_json::Value = serde_json::from_slice(&bytes)?;
    let mut drop_ins = Vec::new();
    if let (Some(name), Some(_)) = (conf["name"].as_str(), conf.get("plugins")) {
        let dir = node.cni_conf_dir().join(name);
        if dir.is_dir() {
            let mut confs: Vec<_> = std::fs::read_dir(&dir)?
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "conf"))
                .collect();
            confs.sort();
            for c in confs {
                drop_ins.push(serde_json::from_slice(&std::fs::read(&c)?)?);
            }
        }
    }
    Ok(Effective {
        path,
        bytes,
        drop_ins,
    })
}

/// The chain that ran (`eth0`'s cache entry) against `check`'s verdict and its effective file:
/// `check` reports the file's plugins (then its drop-ins'), and what ran is that file: the
/// same network, the same plugins in order, the same content. A `.conflist`'s bytes are cached
/// unchanged; a `.conf` is cached as libcni's `ConfListFromConf` wraps it (`{"cniVersion",
/// "name", "plugins": [the .conf]}`, re-marshalled), so it is compared as JSON. Returns how
/// the content matched.
fn compare_chain(
    ran: &CachedAttachment,
    verdict: &serde_json::Value,
    effective: &Effective,
) -> anyhow::Result<&'static str> {
    let file: serde_json::Value = serde_json::from_slice(&effective.bytes)?;
    let path = effective.path.display();
    let is_list = file.get("plugins").is_some();
    let inline: Vec<serde_json::Value> = if is_list {
        file["plugins"].as_array().cloned().unwrap_or_default()
    } else {
        vec![file.clone()]
    };
    let types = |ps: &[serde_json::Value]| -> Vec<String> {
        ps.iter()
            .map(|p| p["type"].as_str().unwrap_or("<no type>").to_owned())
            .collect()
    };
    let reported: Vec<String> = verdict["plugins"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .filter_map(|p| p.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let on_disk = [types(&inline), types(&effective.drop_ins)].concat();
    ensure!(
        reported == on_disk,
        "check reports {reported:?} for {path}, which holds {on_disk:?} (with its drop-ins)"
    );
    ensure!(
        file["name"] == ran.network_name.as_str(),
        "the network that ran is {:?}; check's effective file {path} is {}",
        ran.network_name,
        file["name"]
    );
    ensure!(
        ran.plugins == types(&inline),
        "the chain that ran is {:?}; check's effective file {path} holds {:?}",
        ran.plugins,
        types(&inline)
    );
    if is_list {
        ensure!(
            ran.config == effective.bytes,
            "the config list that ran is not {path}:\nran:  {}\nfile: {}",
            String::from_utf8_lossy(&ran.config),
            String::from_utf8_lossy(&effective.bytes)
        );
        return Ok(if effective.drop_ins.is_empty() {
            "the config that ran is the file, byte for byte"
        } else {
            "the config that ran is the file, byte for byte; libcni caches no drop-in"
        });
    }
    let wrapped = serde_json::json!({
        "cniVersion": file["cniVersion"], "name": file["name"], "plugins": [file]
    });
    let config: serde_json::Value = serde_json::from_slice(&ran.config)?;
    ensure!(
        config == wrapped,
        "the config that ran is not {path} as a list:\nran:  {config}\nfile: {wrapped}"
    );
    Ok("the config that ran is the .conf wrapped in a list, equal as JSON")
}

/// Waits (up to 10 s) until containerd's CRI status and `meshgate-agent check` both name
/// `want`, and returns `check`'s verdict and the conf dir's entries. containerd reloads on file
/// events, so a reload may still be in flight; it fails with both views if they never settle.
async fn agree_on(
    node: &RealNode,
    what: &str,
    want: Option<(&str, &[&str])>,
) -> anyhow::Result<(serde_json::Value, Vec<String>)> {
    let mut files: Vec<String> = std::fs::read_dir(node.cni_conf_dir())?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    let deadline = Instant::now() + Duration::from_secs(10);
    let expected = describe(want);
    let last = loop {
        let status = node.cri_cni_status().await?;
        let (_, verdict) = check_plugins(node, "bridge")?;
        if containerd_network(&status) == expected && meshgate_network(node, &verdict) == expected {
            return Ok((verdict, files));
        }
        if Instant::now() >= deadline {
            break (status, verdict);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    bail!(
        "layout \"{what}\" ({files:?}): expected {expected};\ncontainerd: {} ({})\nmeshgate: {} ({})",
        containerd_network(&last.0),
        last.0,
        meshgate_network(node, &last.1),
        last.1
    )
}

/// What a view says was loaded: `"<network name> [<plugin types>]"`, or `"invalid"` when the
/// first file is invalid and no pod network is loaded.
fn describe(want: Option<(&str, &[&str])>) -> String {
    match want {
        Some((name, plugins)) => format!("{name} [{}]", plugins.join(",")),
        None => "invalid".into(),
    }
}

/// containerd's view: the pod network (`eth0`) of its verbose CRI status, or `invalid` when
/// there is none because the last load failed (`lastCNILoadStatus` is not `OK`).
fn containerd_network(status: &serde_json::Value) -> String {
    let net = status["cniconfig"]["Networks"]
        .as_array()
        .and_then(|ns| ns.iter().find(|n| n["IFName"] == "eth0"));
    let Some(net) = net else {
        return match status["lastCNILoadStatus"].as_str() {
            Some("OK") | None => format!("no pod network although the load succeeded: {status}"),
            Some(_) => "invalid".into(),
        };
    };
    let plugins: Vec<&str> = net["Config"]["Plugins"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .filter_map(|p| p["Network"]["type"].as_str())
                .collect()
        })
        .unwrap_or_default();
    let name = net["Config"]["Name"].as_str().unwrap_or("<no name>");
    describe(Some((name, &plugins)))
}

/// meshgate's view: the network of the file `check` calls effective (its name read from the
/// file, the plugin types `check` reports), or `invalid` when `check` found it invalid.
fn meshgate_network(node: &RealNode, verdict: &serde_json::Value) -> String {
    if verdict["reason"] == "ConfigInvalid" {
        return "invalid".into();
    }
    let Some(file) = verdict["config_file"].as_str() else {
        return format!("no effective file: {verdict}");
    };
    let path = node
        .cni_conf_dir()
        .join(Path::new(file).file_name().unwrap_or_default());
    let conf: Option<serde_json::Value> = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    let Some(name) = conf.as_ref().and_then(|c| c["name"].as_str()) else {
        return format!("unreadable effective file {}", path.display());
    };
    let plugins: Vec<&str> = verdict["plugins"]
        .as_array()
        .map(|ps| ps.iter().filter_map(|p| p.as_str()).collect())
        .unwrap_or_default();
    describe(Some((name, &plugins)))
}

/// How long the node took to come up, for docs/testing.md's figures.
fn print_times(node: &RealNode) {
    let times = node.times();
    eprintln!(
        "real node {}: containerd {:?}, images {:?}, kubelet→registered {:?}, registered→Ready {:?}, Ready→kube-proxy's rules {:?}",
        node.name(),
        times.containerd,
        times.images,
        times.registered,
        times.ready_after_registration,
        times.kube_proxy_after_ready
    );
}

/// Nothing of `node` is left on the host or in the API.
async fn assert_clean(client: &Client, node: &RealNode) -> anyhow::Result<()> {
    let mut left = node.footprint().residue();
    left.extend(host_residue());
    ensure!(left.is_empty(), "left behind after teardown: {left:?}");
    let nodes: Api<Node> = Api::all(client.clone());
    ensure!(
        nodes.get_opt(node.name()).await?.is_none(),
        "Node {} still exists",
        node.name()
    );
    Ok(())
}

/// A busybox pod for the real node: tolerates its taint and is bound to it directly. With
/// `meshed`, it looks as Istio's sidecar injector leaves a pod in CNI mode
/// ([`story::sidecar_pod_template`]: an `istio-proxy` container running as 1337 and the
/// `sidecar.istio.io/status` annotation istio-cni's plugin checks before it programs the
/// redirect); without, the same pod with its `app` container alone.
fn pod(node: &RealNode, name: &str, meshed: bool) -> Pod {
    let mut pod = story::sidecar_pod_template(name);
    pod["metadata"]["name"] = serde_json::json!(name);
    if !meshed {
        pod["metadata"]["labels"] = serde_json::json!({"app": name});
        pod["metadata"]["annotations"] = serde_json::json!({});
        let spec = &mut pod["spec"]["containers"];
        let app: Vec<_> = spec
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| c["name"] == "app")
            .cloned()
            .collect();
        *spec = serde_json::json!(app);
    }
    pod["spec"]["nodeName"] = serde_json::json!(node.name());
    serde_json::from_value(pod).expect("the pod above is a valid Pod")
}

/// Creates the pod and waits until every container runs; returns it and the time it took.
async fn run_pod(
    client: &Client,
    node: &RealNode,
    ns: &str,
    pod: Pod,
) -> anyhow::Result<(Pod, Duration)> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let name = pod.metadata.name.clone().unwrap_or_default();
    let begun = Instant::now();
    pods.create(&PostParams::default(), &pod).await?;
    let got = poll_until(&format!("pod {ns}/{name} running"), POD_START, || async {
        let p = pods.get(&name).await?;
        anyhow::Ok(all_running(&p).then_some(p))
    })
    .await;
    match got {
        Ok(p) => Ok((p, begun.elapsed())),
        Err(e) => {
            let last = pods.get(&name).await.ok().and_then(|p| p.status);
            bail!(
                "{e}\nlast status: {last:?}\nkubelet:\n{}\ncontainerd:\n{}",
                node.log_tail("kubelet", 30),
                node.log_tail("containerd", 30)
            )
        }
    }
}

/// `meshgate-agent check --runtime containerd --require-plugin <plugin>` on the real node's
/// CNI dirs: exit code and the JSON verdict.
fn check_plugins(
    node: &RealNode,
    plugin: &str,
) -> anyhow::Result<(Option<i32>, serde_json::Value)> {
    let bin = meshgate_e2e::sim::node::workspace_bin("meshgate-agent")?;
    let out = std::process::Command::new(bin)
        .arg("check")
        .arg("--cni-conf-dir")
        .arg(node.cni_conf_dir())
        .arg("--cni-bin-dir")
        .arg(node.cni_bin_dir())
        .args(["--runtime", "containerd", "--require-plugin", plugin])
        .args(["--output", "json"])
        .output()?;
    let verdict = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "check printed no JSON verdict: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    Ok((out.status.code(), verdict))
}

/// Issue 12's story on real nodes, with meshgate installed from its chart: S3 → S1 → S4
/// and an agent restart (`meshgate_e2e::real::story`, which `make demo` tells too). Each step
/// asserts inside the story; the figures are checked here.
#[tokio::test]
async fn meshgate_from_its_chart_gates_real_nodes_through_the_whole_story() -> anyhow::Result<()> {
    let _one = ONE_NODE.lock().await;
    let transcript = Transcript::default();
    let outcome = story::run(&transcript)
        .await
        .with_context(|| format!("the story so far:\n{}", transcript.text()))?;
    eprintln!("{}", transcript.text());
    ensure!(
        outcome.evicted == 1,
        "exactly the pod started without rules is evicted: {outcome:?}"
    );
    ensure!(
        outcome.refused.contains(&format!(
            "node {} is not verified for the mesh CNI chain",
            outcome.node
        )),
        "the refusal names the node and what it lacks: {}",
        outcome.refused
    );
    let left = host_residue();
    ensure!(left.is_empty(), "left behind after the story: {left:?}");
    Ok(())
}
