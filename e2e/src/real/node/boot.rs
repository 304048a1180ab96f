//! A real node's boot, step by step: its directories and CNI files, containerd, the images,
//! the kubelet, kube-proxy, and the wait for the Node to be `Ready`.
//!
//! In: a [`RealNode`] whose network is up, its [`ControlPlane`]. Out: [`NodeTimes`], or
//! [`Error::RealNode`] naming the part that did not start, with the end of its log.

use super::*;

impl RealNode {
    /// Boots the node in order; each step fails with the part that did not start.
    pub(super) async fn boot(&self, cp: &ControlPlane) -> Result<NodeTimes, Error> {
        self.lay_out()?;
        let (containerd, containerd_time) = self.start_containerd().await?;
        let images_time = self.import_images().await?;
        let joined = Ns::Join(containerd.pid);
        let (kubelet, begun) = self.start_kubelet(cp, joined)?;
        let kube_proxy = self.start_kube_proxy(cp, joined).await?;
        let daemons = [
            (&containerd, "containerd"),
            (&kubelet, "kubelet"),
            (&kube_proxy, "kube-proxy"),
        ];
        let (registered, ready) = self.wait_ready(cp, begun, daemons).await?;
        self.wait_kube_proxy(&kube_proxy).await?;
        Ok(NodeTimes {
            containerd: containerd_time,
            images: images_time,
            registered,
            ready_after_registration: ready.saturating_sub(registered),
            kube_proxy_after_ready: begun.elapsed().saturating_sub(ready),
        })
    }

    /// The run dir's layout: the daemons' directories, what the node's mount namespace binds
    /// from, the reference CNI plugins and the primary conflist.
    fn lay_out(&self) -> Result<(), Error> {
        for sub in [
            "containerd/root",
            "containerd/state",
            "cni/ipam",
            "istio-cni",
            "kubelet/pki",
            "logs",
            "kube-proxy",
        ] {
            let path = self.dir.join(sub);
            std::fs::create_dir_all(&path)
                .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
        }
        // What the node's mount namespace binds from (the CNI conf and bin dirs among them),
        // its copies of the host-wide sysctls the kubelet sets, and its resolver config.
        mounts::prepare(&self.dir)?;
        // The node's CNI bin dir: the reference plugins, copied in as a CNI provider's
        // installer does (not linked: the agent's container runs them for their VERSION
        // through its /opt/cni/bin mount, where a link to a host path would dangle). istio-cni
        // joins later, in install_istio_cni.
        for plugin in ["bridge", "host-local", "portmap", "loopback"] {
            let to = self.cni_bin_dir().join(plugin);
            std::fs::copy(self.bins.cni_plugins.join(plugin), &to)
                .map_err(|e| Error::io(format!("copying {}", to.display()), e))?;
        }
        write_file(&self.conflist_path(), &self.bridge_conflist())
    }

    /// containerd in the node's own mount namespace, once its socket answers (30 s bound).
    async fn start_containerd(&self) -> Result<(Proc, Duration), Error> {
        let config = self.dir.join("containerd/config.toml");
        write_file(&config, &self.containerd_config())?;
        let begun = Instant::now();
        let path_env = format!(
            "{}:{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            self.bins.shim_dir.display(),
            self.bins
                .runc
                .parent()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        );
        let containerd = self.spawn(
            "containerd",
            Ns::NewMount,
            &self.bins.containerd,
            vec!["--config".into(), config.display().to_string()],
            vec![("PATH".into(), path_env)],
        )?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.ctr(&["version"]).await.is_ok() {
                return Ok((containerd, begun.elapsed()));
            }
            fail_if_exited(&containerd, "containerd")?;
            if Instant::now() >= deadline {
                return Err(Error::RealNode {
                    part: "containerd",
                    detail: format!(
                        "its socket did not answer within 30 s; the end of {}:\n{}",
                        containerd.log.display(),
                        containerd.log_tail(20)
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Images: no registry, so the OCI layouts install-deps.sh built are imported.
    async fn import_images(&self) -> Result<Duration, Error> {
        let begun = Instant::now();
        let images = [
            self.bins.images.join("pause.tar"),
            self.bins.images.join("busybox.tar"),
            self.bins.meshgate_image.clone(),
        ];
        for image in images {
            self.import_image(&image, "the node images").await?;
        }
        Ok(begun.elapsed())
    }

    /// Imports one OCI image-layout tarball into containerd's `k8s.io` namespace.
    pub(super) async fn import_image(&self, tar: &Path, part: &'static str) -> Result<(), Error> {
        let path = tar.display().to_string();
        self.ctr(&["-n", K8S_NS, "images", "import", &path])
            .await
            .map(drop)
            .map_err(|detail| Error::RealNode { part, detail })
    }

    /// The kubelet, as system:node:<name> in system:nodes (Node authorizer, NodeRestriction),
    /// in containerd's mount namespace; returns it and when it was spawned.
    fn start_kubelet(&self, cp: &ControlPlane, joined: Ns) -> Result<(Proc, Instant), Error> {
        let pki_dir = self.dir.join("kubelet/pki");
        let cert = cp.pki().issue_client(
            &pki_dir,
            "kubelet-client",
            &format!("system:node:{}", self.name),
            Some("system:nodes"),
        )?;
        let kubeconfig = self.dir.join("kubelet/kubeconfig");
        write_private(
            &kubeconfig,
            &cert_kubeconfig_yaml(&cp.apiserver_url(), cp.ca_path(), &cert),
        )?;
        self.create_cgroup_root()?;
        let ports = (0..2)
            .map(|_| crate::sim::node::free_port())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Error::io("reserving the kubelet's ports", e))?;
        let kubelet_config = self.dir.join("kubelet/config.yaml");
        write_file(
            &kubelet_config,
            &self.kubelet_config(cp.ca_path(), ports[0], ports[1]),
        )?;
        let begun = Instant::now();
        let kubelet = self.spawn(
            "kubelet",
            joined,
            &self.bins.kubelet,
            vec![
                format!("--config={}", kubelet_config.display()),
                format!("--kubeconfig={}", kubeconfig.display()),
                format!("--hostname-override={}", self.name),
                format!("--root-dir={}", self.dir.join("kubelet/root").display()),
                format!("--cert-dir={}", pki_dir.display()),
                format!("--node-ip={}", self.net.node_ip),
                "--v=2".into(),
            ],
            Vec::new(),
        )?;
        Ok((kubelet, begun))
    }

    /// Waits until the Node registers and goes `Ready` (bounded by [`READY_TIMEOUT`]) while
    /// every daemon runs; returns both times since `begun`.
    async fn wait_ready(
        &self,
        cp: &ControlPlane,
        begun: Instant,
        daemons: [(&Proc, &'static str); 3],
    ) -> Result<(Duration, Duration), Error> {
        let nodes: Api<Node> = Api::all(cp.client()?);
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut registered: Option<Duration> = None;
        loop {
            for (daemon, part) in daemons {
                fail_if_exited(daemon, part)?;
            }
            if let Ok(Ok(Some(n))) =
                tokio::time::timeout(wait::API_TIMEOUT, nodes.get_opt(&self.name)).await
            {
                let at = *registered.get_or_insert_with(|| begun.elapsed());
                if is_ready(&n) {
                    return Ok((at, begun.elapsed()));
                }
            }
            if Instant::now() >= deadline {
                let what = if registered.is_some() {
                    "the Node registered but was not Ready"
                } else {
                    "the Node did not register"
                };
                let kubelet = daemons[1].0;
                return Err(Error::RealNode {
                    part: "kubelet",
                    detail: format!(
                        "{what} within {READY_TIMEOUT:?}; the end of {}:\n{}",
                        kubelet.log.display(),
                        kubelet.log_tail(30)
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// kube-proxy in the node's namespaces, nftables mode, as `system:kube-proxy` (bound to
    /// the `system:node-proxier` ClusterRole, as kubeadm does), so pods and hostNetwork pods
    /// reach the apiserver at `KUBERNETES_SERVICE_HOST` (10.0.0.1:443) as in a cluster. It
    /// writes its `kube-proxy` nftables tables into the node's namespace only; conntrack
    /// `maxPerCore: 0` keeps it from writing the host-wide conntrack sysctls.
    pub(super) async fn start_kube_proxy(&self, cp: &ControlPlane, ns: Ns) -> Result<Proc, Error> {
        let dir = self.dir.join("kube-proxy");
        let cert = cp
            .pki()
            .issue_client(&dir, "kube-proxy", "system:kube-proxy", None)?;
        let kubeconfig = dir.join("kubeconfig");
        write_private(
            &kubeconfig,
            &cert_kubeconfig_yaml(&cp.apiserver_url(), cp.ca_path(), &cert),
        )?;
        bind_node_proxier(cp).await?;
        let q = |s: &str| serde_json::Value::String(s.to_owned()).to_string();
        let config = dir.join("config.yaml");
        write_file(
            &config,
            &format!(
                r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: {kubeconfig}
hostnameOverride: {node}
mode: nftables
clusterCIDR: 10.200.0.0/16
# Both in the node's network namespace.
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
conntrack:
  # nf_conntrack_max is host-wide: never write it.
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"#,
                kubeconfig = q(&kubeconfig.display().to_string()),
                node = q(&self.name),
            ),
        )?;
        self.spawn(
            "kube-proxy",
            ns,
            &self.bins.kube_proxy,
            vec![format!("--config={}", config.display()), "--v=2".into()],
            Vec::new(),
        )
    }

    /// Waits until kube-proxy's rules in the node's namespace send the `kubernetes` Service
    /// (10.0.0.1) somewhere: its first full sync after the Node and the Service's endpoints.
    pub(super) async fn wait_kube_proxy(&self, kube_proxy: &Proc) -> Result<(), Error> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let pin = format!("--net={}", self.fp.netns_pin.display());
        loop {
            fail_if_exited(kube_proxy, "kube-proxy")?;
            let mut nft = tokio::process::Command::new(&self.bins.nsenter);
            nft.args([
                pin.as_str(),
                "--",
                "nft",
                "list",
                "table",
                "ip",
                "kube-proxy",
            ]);
            let listed =
                wait::command_output("kube-proxy's table", Duration::from_secs(10), &mut nft);
            if let Ok(out) = listed.await
                && String::from_utf8_lossy(&out.stdout).contains("10.0.0.1")
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::RealNode {
                    part: "kube-proxy",
                    detail: format!(
                        "no rule for the kubernetes Service (10.0.0.1) in the node's nftables within 60 s; the end of {}:\n{}",
                        kube_proxy.log.display(),
                        kube_proxy.log_tail(30)
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The kubelet requires its cgroup root to exist in every hierarchy it uses.
    pub(super) fn create_cgroup_root(&self) -> Result<(), Error> {
        for hierarchy in cgroup_hierarchies() {
            let path = hierarchy.join(self.fp.cgroup_root.trim_start_matches('/'));
            std::fs::create_dir_all(&path)
                .map_err(|e| Error::io(format!("creating cgroup {}", path.display()), e))?;
        }
        Ok(())
    }
}

/// The real node reaches the apiserver from its own network namespace: loopback will not do.
pub(super) fn cp_reachable(cp: &ControlPlane) -> Result<(), Error> {
    if cp.address().is_loopback() {
        return Err(Error::RealNode {
            part: "the control plane",
            detail: "its apiserver listens on loopback, which the node's network namespace cannot \
                     reach: start it with `Options { routable: true, .. }` (see start_control_plane)"
                .into(),
        });
    }
    Ok(())
}

/// Binds `system:kube-proxy` to the bootstrap `system:node-proxier` ClusterRole (once per
/// control plane; an existing binding is kept).
pub(super) async fn bind_node_proxier(cp: &ControlPlane) -> Result<(), Error> {
    use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleRef, Subject};
    let api: Api<ClusterRoleBinding> = Api::all(cp.client()?);
    let binding = ClusterRoleBinding {
        metadata: kube::api::ObjectMeta {
            name: Some("meshgate-e2e:kube-proxy".into()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "ClusterRole".into(),
            name: "system:node-proxier".into(),
        },
        subjects: Some(vec![Subject {
            kind: "User".into(),
            name: "system:kube-proxy".into(),
            api_group: Some("rbac.authorization.k8s.io".into()),
            ..Default::default()
        }]),
    };
    match wait::bounded(
        "creating kube-proxy's ClusterRoleBinding",
        wait::API_TIMEOUT,
        async {
            Ok::<_, Error>(
                api.create(&kube::api::PostParams::default(), &binding)
                    .await,
            )
        },
    )
    .await?
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(Error::kube("creating kube-proxy's ClusterRoleBinding", e)),
    }
}

pub(super) fn is_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

pub(super) fn fail_if_exited(p: &Proc, part: &'static str) -> Result<(), Error> {
    match p.exit_status() {
        None => Ok(()),
        Some(status) => Err(Error::RealNode {
            part,
            detail: format!(
                "it exited ({status}); the end of {}:\n{}",
                p.log.display(),
                p.log_tail(30)
            ),
        }),
    }
}
