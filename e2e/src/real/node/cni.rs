//! A real node's CNI: the primary bridge conflist, istio-cni chained and removed the way its
//! installer does it, the config containerd reports loaded (CRI `Status`), and the config list
//! a pod sandbox really ran (libcni's result cache).
//!
//! In: the node's CNI conf dir, containerd's socket, libcni's cache dir. Out: files written,
//! containerd's verbose status, [`CachedAttachment`]s.

use super::*;

impl RealNode {
    /// The attachments libcni cached for the pod with `pod_uid` (`metadata.uid`): one per
    /// network the pod sandbox joined (containerd's `cni-loopback` on `lo`, the pod network on
    /// `eth0`), each with the config list that really ran. Found by the `K8S_POD_UID` CNI arg
    /// containerd passes; the sandbox id is their `container_id`. Sorted by file name, as
    /// libcni's `GetCachedAttachments` lists them. Like it, a file that is not a `cniCacheV1`
    /// entry is skipped (another runtime's, or one being written); none at all is an empty list.
    pub fn pod_attachments(&self, pod_uid: &str) -> Result<Vec<CachedAttachment>, Error> {
        attachments_of(&self.cni_cache_dir(), pod_uid)
    }

    /// Installs istio-cni the way Istio's installer (`cni/pkg/install`) does: the plugin binary
    /// into the CNI bin dir, its kubeconfig (`kubeconfig_yaml`, normally the istio-cni
    /// ServiceAccount's token) into its run dir as `istio-cni-kubeconfig`, and its entry
    /// appended to the primary conflist's plugins, with the fields its `plugin.Config` writes.
    pub fn install_istio_cni(
        &self,
        kubeconfig_yaml: &str,
        native_nftables: bool,
    ) -> Result<(), Error> {
        let bin = self.cni_bin_dir().join("istio-cni");
        if !bin.exists() {
            // Copied, as Istio's installer does (see the reference plugins in boot).
            std::fs::copy(&self.bins.istio_cni, &bin)
                .map_err(|e| Error::io(format!("copying {}", bin.display()), e))?;
        }
        write_private(
            &self.istio_cni_run_dir().join("istio-cni-kubeconfig"),
            kubeconfig_yaml,
        )?;
        let entry = istio_cni_entry(&self.istio_cni_run_dir(), native_nftables);
        // Like insertCNIConfig: an existing istio-cni entry is replaced, not duplicated.
        self.edit_plugins(|plugins| {
            plugins.retain(|p| p.get("type").and_then(|t| t.as_str()) != Some("istio-cni"));
            plugins.push(entry);
        })
    }

    /// Copies istio-cni's binary into the CNI bin dir as Istio's installer does on every
    /// (re)install (`copyBinaries`, which always copies, through `file.AtomicCopy`): into a
    /// temporary file beside it, then renamed over it, so each copy is a new file.
    pub fn copy_istio_cni_binary(&self) -> Result<(), Error> {
        let bin = self.cni_bin_dir().join("istio-cni");
        let tmp = self
            .cni_bin_dir()
            .join(format!("istio-cni.tmp.{}", std::process::id()));
        std::fs::copy(&self.bins.istio_cni, &tmp)
            .and_then(|_| std::fs::rename(&tmp, &bin))
            .map_err(|e| Error::io(format!("copying istio-cni to {}", bin.display()), e))
    }

    /// Removes istio-cni's entry from the primary conflist, as Istio's uninstall does (the
    /// binary and kubeconfig stay, which only matters to a later install).
    pub fn remove_istio_cni(&self) -> Result<(), Error> {
        self.edit_plugins(|plugins| {
            plugins.retain(|p| p.get("type").and_then(|t| t.as_str()) != Some("istio-cni"));
        })
    }

    pub(super) fn edit_plugins(
        &self,
        edit: impl FnOnce(&mut Vec<serde_json::Value>),
    ) -> Result<(), Error> {
        let path = self.conflist_path();
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        let mut conf: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::RealNode {
                part: "the CNI config",
                detail: format!("{} is not JSON: {e}", path.display()),
            })?;
        let Some(plugins) = conf
            .get_mut("plugins")
            .and_then(serde_json::Value::as_array_mut)
        else {
            return Err(Error::RealNode {
                part: "the CNI config",
                detail: format!("{} has no plugins array", path.display()),
            });
        };
        edit(plugins);
        let text = serde_json::to_string_pretty(&conf).map_err(|e| Error::RealNode {
            part: "the CNI config",
            detail: e.to_string(),
        })?;
        // Written as Istio's installer writes it (`file.AtomicWrite`, on install and on
        // uninstall alike): into a temporary file beside it, then renamed over it.
        let tmp = path.with_extension(format!("conflist.tmp.{}", std::process::id()));
        write_file(&tmp, &text)?;
        std::fs::rename(&tmp, &path)
            .map_err(|e| Error::io(format!("renaming {} into place", tmp.display()), e))
    }

    /// The CNI part of containerd's verbose CRI status (`Status` with `verbose`):
    /// `{"cniconfig": {...the loaded networks...}, "lastCNILoadStatus": "OK" | error}`.
    pub async fn cri_cni_status(&self) -> Result<serde_json::Value, Error> {
        let mut cmd = tokio::process::Command::new(&self.bins.cri_status);
        cmd.arg(self.containerd_socket());
        let out = wait::command_output("cri-status", Duration::from_secs(15), &mut cmd).await?;
        if !out.status.success() {
            return Err(Error::RealNode {
                part: "containerd",
                detail: format!(
                    "its CRI Status failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            });
        }
        serde_json::from_slice(&out.stdout).map_err(|e| Error::RealNode {
            part: "containerd",
            detail: format!("cri-status printed no JSON: {e}"),
        })
    }

    pub(super) fn bridge_conflist(&self) -> String {
        // A bridge network as a simple CNI provider writes it. ipMasq is off so the host's
        // nat table is never touched; host-local keeps its leases in the run dir.
        serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "meshgate-e2e",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.fp.bridge,
                    "isGateway": true,
                    "ipMasq": false,
                    "hairpinMode": true,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": self.dir.join("cni/ipam"),
                        "ranges": [[{ "subnet": self.pod_subnet() }]],
                        "routes": [{ "dst": "0.0.0.0/0" }]
                    }
                },
                { "type": "portmap", "capabilities": { "portMappings": true } }
            ]
        })
        .to_string()
    }
}

/// istio-cni's entry as Istio's installer writes it: `plugin.Config` marshalled, with
/// `cniVersion` dropped (the conflist's applies). Sidecar mode, so ambient is off.
pub fn istio_cni_entry(run_dir: &Path, native_nftables: bool) -> serde_json::Value {
    serde_json::json!({
        "name": "istio-cni",
        "type": "istio-cni",
        "ipam": {},
        "dns": {},
        "plugin_log_level": "debug",
        "cni_agent_run_dir": run_dir,
        "ambient_enabled": false,
        "enablement_selectors": [],
        "exclude_namespaces": ["istio-system", "kube-system"],
        "pod_namespace": "istio-system",
        "native_nftables": native_nftables,
        "enable_ambient_detection_retry": false
    })
}

/// One attachment from libcni's result cache: what libcni's `cacheAdd` writes after every
/// plugin of a config list returned from ADD (`{"kind": "cniCacheV1", "containerId",
/// "config", "ifName", "networkName", "netns", "cniArgs", "capabilityArgs", "result"}`). The
/// `config` is the bytes of the config list that ran (`NetworkConfigList.Bytes`), so its
/// plugins are the chain the runtime executed, independent of what the runtime reports, with
/// one gap: libcni keeps `Bytes` as the file it read, so CNI 1.1 drop-ins
/// (`<conf dir>/<network>/*.conf`), which it appends to the list's plugins, ran after them
/// but are not in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedAttachment {
    /// The network (the config list's `name`).
    pub network_name: String,
    /// The container the runtime attached: for CRI, the pod sandbox id.
    pub container_id: String,
    /// The interface inside the pod (`eth0` for the pod network, `lo` for loopback).
    pub if_name: String,
    /// The CNI args the runtime passed (`K8S_POD_NAMESPACE`, `K8S_POD_NAME`, `K8S_POD_UID`, ...).
    pub cni_args: Vec<(String, String)>,
    /// The plugin `type`s of `config`, in the order they ran (drop-ins not included).
    pub plugins: Vec<String>,
    /// The config list that ran, as libcni held it.
    pub config: Vec<u8>,
    /// The addresses (`10.200.3.2/24`) of the chain's final result, which the last plugin
    /// returned: what the sandbox's interface was given.
    pub ips: Vec<String>,
}

impl CachedAttachment {
    /// Parses one cache file; any field libcni always writes that is missing or of the wrong
    /// shape is an error naming it.
    pub fn parse(bytes: &[u8]) -> Result<Self, Error> {
        Self::parse_inner(bytes).map_err(|detail| Error::CniCache {
            what: "an entry".into(),
            detail,
        })
    }

    pub(super) fn parse_inner(bytes: &[u8]) -> Result<Self, String> {
        use base64::Engine as _;
        let v: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
        if v["kind"] != "cniCacheV1" {
            return Err(format!("kind is {}, not \"cniCacheV1\"", v["kind"]));
        }
        let text = |field: &str| {
            v[field]
                .as_str()
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .ok_or_else(|| format!("no {field}"))
        };
        // Go marshals a []byte as standard, padded base64.
        let config = base64::engine::general_purpose::STANDARD
            .decode(text("config")?)
            .map_err(|e| format!("config is not base64: {e}"))?;
        let list: serde_json::Value = serde_json::from_slice(&config)
            .map_err(|e| format!("config is not a JSON config: {e}"))?;
        // A list (`AddNetworkList`, all containerd does) or a single network (`AddNetwork`).
        let plugins = match list.get("plugins") {
            Some(ps) => ps
                .as_array()
                .ok_or("config's plugins is not a list")?
                .iter()
                .map(|p| p["type"].as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .ok_or("a plugin of config has no type")?,
            None => vec![
                list["type"]
                    .as_str()
                    .ok_or("config has neither plugins nor a type")?
                    .to_owned(),
            ],
        };
        let cni_args = match &v["cniArgs"] {
            serde_json::Value::Null => Vec::new(),
            args => args
                .as_array()
                .ok_or("cniArgs is not a list")?
                .iter()
                .map(|kv| match kv.as_array().map(Vec::as_slice) {
                    Some([k, v]) => Some((k.as_str()?.to_owned(), v.as_str()?.to_owned())),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()
                .ok_or("a cniArgs entry is not a [key, value] pair")?,
        };
        // The result is a CNI result of the list's version (0.3.0 and later: `ips[].address`).
        let ips = v["result"]["ips"]
            .as_array()
            .map(|ips| {
                ips.iter()
                    .filter_map(|ip| ip["address"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        Ok(Self {
            network_name: text("networkName")?,
            container_id: text("containerId")?,
            if_name: text("ifName")?,
            cni_args,
            plugins,
            config,
            ips,
        })
    }

    /// The value of one CNI arg, if the runtime passed it.
    pub fn cni_arg(&self, key: &str) -> Option<&str> {
        self.cni_args
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The name libcni gives this attachment's file under `<cache dir>/results`.
    pub fn file_name(&self) -> String {
        format!(
            "{}-{}-{}",
            self.network_name, self.container_id, self.if_name
        )
    }
}

/// The `cniCacheV1` entries under `<cache_dir>/results` whose `K8S_POD_UID` is `pod_uid`, in
/// file-name order (see [`RealNode::pod_attachments`]).
pub(super) fn attachments_of(
    cache_dir: &Path,
    pod_uid: &str,
) -> Result<Vec<CachedAttachment>, Error> {
    let dir = cache_dir.join("results");
    let mut paths: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(entries) => entries.flatten().map(|e| e.path()).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(format!("listing {}", dir.display()), e)),
    };
    paths.sort();
    Ok(paths
        .iter()
        .filter_map(|path| {
            let att = CachedAttachment::parse(&std::fs::read(path).ok()?).ok()?;
            // libcni names the file `<network>-<container id>-<ifname>`; a file whose name
            // and content disagree is not the entry libcni wrote for this attachment.
            let name = path.file_name()?.to_str()?;
            (name == att.file_name() && att.cni_arg("K8S_POD_UID") == Some(pod_uid)).then_some(att)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Real entries, captured from `/var/lib/cni/results` while the real-node test ran pods
    /// through containerd 2.4.2: the primary conflist with istio-cni chained, a lone `.conf`
    /// (libcni wraps it in a list), and containerd's loopback network.
    const CACHED_CHAIN: &str =
        "meshgate-e2e-0322db0f69645918e80030007968ab5cb4f3cfd60def221d91622f6e47b38f60-eth0";
    const CACHED_LONE: &str =
        "lone-41dd11e953eae272521ffcb4835d2fec046790da37dc1dd9aead70f07eddad77-eth0";
    const CACHED_LO: &str =
        "cni-loopback-41dd11e953eae272521ffcb4835d2fec046790da37dc1dd9aead70f07eddad77-lo";

    fn testdata(name: &str) -> Vec<u8> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("testdata/cni-cache")
            .join(name);
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    #[test]
    fn a_cached_attachment_names_the_chain_that_ran() {
        let a = CachedAttachment::parse(&testdata(CACHED_CHAIN)).unwrap();
        assert_eq!(a.network_name, "meshgate-e2e");
        assert_eq!(
            a.container_id,
            "0322db0f69645918e80030007968ab5cb4f3cfd60def221d91622f6e47b38f60"
        );
        assert_eq!(a.if_name, "eth0");
        assert_eq!(a.plugins, ["bridge", "portmap", "istio-cni"]);
        assert_eq!(a.file_name(), CACHED_CHAIN);
        assert_eq!(a.cni_arg("K8S_POD_NAME"), Some("chain-1"));
        assert_eq!(
            a.cni_arg("K8S_POD_UID"),
            Some("488be5de-7edb-4e9e-b522-6b99564a4eb9")
        );
        assert_eq!(
            a.cni_arg("K8S_POD_INFRA_CONTAINER_ID"),
            Some(a.container_id.as_str())
        );
        assert_eq!(a.cni_arg("K8S_POD_IP"), None);
        assert_eq!(a.ips, ["10.200.82.3/24"]);
        // The config is the conflist's bytes as written (pretty-printed by edit_plugins).
        assert!(a.config.starts_with(b"{\n  \"cniVersion\": \"1.0.0\""));
        let conf: serde_json::Value = serde_json::from_slice(&a.config).unwrap();
        assert_eq!(conf["plugins"][2]["native_nftables"], false);

        let lone = CachedAttachment::parse(&testdata(CACHED_LONE)).unwrap();
        assert_eq!(
            (lone.network_name.as_str(), lone.plugins.as_slice()),
            ("lone", &["bridge".to_owned()][..])
        );
        let conf: serde_json::Value = serde_json::from_slice(&lone.config).unwrap();
        assert_eq!(
            conf["plugins"][0]["name"], "lone",
            "the .conf itself, wrapped"
        );

        let lo = CachedAttachment::parse(&testdata(CACHED_LO)).unwrap();
        assert_eq!(
            (lo.network_name.as_str(), lo.if_name.as_str()),
            ("cni-loopback", "lo")
        );
        assert_eq!(lo.plugins, ["loopback"]);
        assert_eq!(lo.ips, ["127.0.0.1/8", "::1/128"]);
    }

    #[test]
    fn what_libcni_does_not_write_is_refused() {
        let good: serde_json::Value = serde_json::from_slice(&testdata(CACHED_CHAIN)).unwrap();
        let with = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut v = good.clone();
            edit(&mut v);
            CachedAttachment::parse(v.to_string().as_bytes())
                .map(|a| a.plugins)
                .map_err(|e| e.to_string())
        };
        assert!(with(&|_| ()).is_ok());
        let b64 = |s: &str| {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD.encode(s)
        };
        // A single network (`AddNetwork`) is its own one-plugin chain.
        assert_eq!(
            with(&|v| v["config"] = b64(r#"{"name":"n","type":"ptp"}"#).into()),
            Ok(vec!["ptp".to_owned()])
        );
        for (what, edit, err) in [
            (
                "legacy kind",
                Box::new(|v: &mut serde_json::Value| v["kind"] = "".into())
                    as Box<dyn Fn(&mut serde_json::Value)>,
                "kind",
            ),
            (
                "no network",
                Box::new(|v| v["networkName"] = serde_json::Value::Null),
                "networkName",
            ),
            (
                "no container",
                Box::new(|v| v["containerId"] = "".into()),
                "containerId",
            ),
            (
                "no ifname",
                Box::new(|v| v["ifName"] = serde_json::Value::Null),
                "ifName",
            ),
            (
                "not base64",
                Box::new(|v| v["config"] = "not base64!".into()),
                "base64",
            ),
            (
                "not JSON config",
                Box::new(|v| v["config"] = b64("{").into()),
                "not a JSON config",
            ),
            (
                "a plugin without type",
                Box::new(|v| v["config"] = b64(r#"{"plugins":[{"type":"bridge"},{}]}"#).into()),
                "no type",
            ),
            (
                "neither",
                Box::new(|v| v["config"] = b64(r#"{"name":"n"}"#).into()),
                "neither",
            ),
            (
                "bad args",
                Box::new(|v| v["cniArgs"] = serde_json::json!([["K8S_POD_UID"]])),
                "cniArgs",
            ),
        ] {
            let got = with(&*edit);
            assert!(
                got.as_ref().is_err_and(|e| e.contains(err)),
                "{what}: {got:?}"
            );
        }
        assert!(CachedAttachment::parse(b"not json").is_err());
    }

    #[test]
    fn a_pods_attachments_are_found_by_its_uid() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            attachments_of(dir.path(), "x").unwrap(),
            vec![],
            "no results dir yet"
        );
        let results = dir.path().join("results");
        std::fs::create_dir(&results).unwrap();
        for name in [CACHED_CHAIN, CACHED_LONE, CACHED_LO] {
            std::fs::write(results.join(name), testdata(name)).unwrap();
        }
        // Entries libcni would not have written for an attachment are skipped: garbage, and
        // an entry under another attachment's name.
        std::fs::write(results.join("junk-1-eth0"), "{").unwrap();
        std::fs::write(results.join("other-1-eth0"), testdata(CACHED_CHAIN)).unwrap();
        let chain1 = attachments_of(dir.path(), "488be5de-7edb-4e9e-b522-6b99564a4eb9").unwrap();
        assert_eq!(
            chain1.iter().map(|a| a.file_name()).collect::<Vec<_>>(),
            [CACHED_CHAIN]
        );
        let lone = CachedAttachment::parse(&testdata(CACHED_LONE)).unwrap();
        let uid = lone.cni_arg("K8S_POD_UID").unwrap();
        let both = attachments_of(dir.path(), uid).unwrap();
        assert_eq!(
            both.iter().map(|a| a.file_name()).collect::<Vec<_>>(),
            [CACHED_LO, CACHED_LONE],
            "loopback and eth0 of one sandbox, in file-name order"
        );
        assert_eq!(attachments_of(dir.path(), "no-such-pod").unwrap(), vec![]);
    }

    #[test]
    fn istio_cni_entry_has_the_installer_fields() {
        let e = istio_cni_entry(Path::new("/run/istio-cni"), true);
        assert_eq!(e["type"], "istio-cni");
        assert_eq!(e["cni_agent_run_dir"], "/run/istio-cni");
        assert_eq!(e["native_nftables"], true);
        assert_eq!(e["ambient_enabled"], false);
        assert!(e.get("cniVersion").is_none());
    }
}
