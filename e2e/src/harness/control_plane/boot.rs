//! A control plane's boot: the background thread its processes are children of, then etcd,
//! kube-apiserver, the controller manager and the scheduler, each waited on until healthy, and
//! the routable address's link for real nodes.
//!
//! In: a run dir, the binaries, an address. Out: [`Booted`] (processes, ports, PKI, admin
//! kubeconfig), or the first component that did not answer, with the end of its log.

use super::*;

/// A thread running a current-thread tokio runtime: the parent of the control-plane processes
/// and the home of long-lived kubelet stand-in tasks.
pub(super) struct Background {
    pub(super) handle: tokio::runtime::Handle,
    pub(super) stop: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    pub(super) thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Background {
    pub(super) fn start() -> Result<Self, Error> {
        let (handle_tx, handle_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("meshgate-e2e-bg".into())
            .spawn(move || {
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => {
                        let _ = handle_tx.send(Ok(rt.handle().clone()));
                        // Drives every spawned task on this very thread until told to stop.
                        rt.block_on(async {
                            let _ = stop_rx.await;
                        });
                    }
                    Err(e) => {
                        let _ = handle_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| Error::io("spawning the control plane's background thread", e))?;
        let handle = handle_rx
            .recv()
            .map_err(|_| Error::StartPanicked)?
            .map_err(|e| Error::io("building the background tokio runtime", e))?;
        Ok(Self {
            handle,
            stop: Mutex::new(Some(stop_tx)),
            thread: Mutex::new(Some(thread)),
        })
    }

    pub(super) fn shutdown(&self) {
        if let Some(stop) = self.stop.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = stop.send(());
        }
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
    }
}

/// What the boot sequence produced.
pub(super) struct Booted {
    pub(super) procs: Vec<Proc>,
    /// kube-apiserver's command line, to start it again after [`ControlPlane::stop_apiserver`].
    pub(super) apiserver_args: Vec<String>,
    pub(super) ports: Ports,
    pub(super) pki: Pki,
    pub(super) admin_kubeconfig_path: PathBuf,
    pub(super) admin_kubeconfig: Kubeconfig,
}

/// The boot sequence; runs on the background thread.
pub(super) struct Boot {
    pub(super) dir: PathBuf,
    pub(super) binaries: Binaries,
    pub(super) mode: Mode,
    pub(super) timeout: Duration,
    pub(super) address: Ipv4Addr,
    /// [`Options::apiserver_flags`].
    pub(super) apiserver_flags: Vec<String>,
}

/// Processes started so far; stopped on drop unless the boot succeeded.
pub(super) struct Started(pub(super) Vec<Proc>);

impl Drop for Started {
    fn drop(&mut self) {
        process::stop_all(&self.0, STOP_GRACE);
    }
}

/// The controller manager's and the scheduler's kubeconfigs, in the run dir.
const KCM_KUBECONFIG: &str = "controller-manager.kubeconfig";
const SCHED_KUBECONFIG: &str = "scheduler.kubeconfig";

impl Boot {
    /// Certificates and kubeconfigs, then etcd, kube-apiserver, the controller manager and the
    /// scheduler, each healthy before the next; the whole within `timeout`.
    pub(super) async fn run(self) -> Result<Booted, Error> {
        let deadline = Instant::now() + self.timeout;
        let logs = self.dir.join("logs");
        std::fs::create_dir_all(&logs)
            .map_err(|e| Error::io(format!("creating {}", logs.display()), e))?;
        let extra_ips: Vec<IpAddr> = if self.address.is_loopback() {
            Vec::new()
        } else {
            vec![IpAddr::V4(self.address)]
        };
        let pki = Pki::generate(&self.dir.join("pki"), &extra_ips)?;
        let ports = free_ports()?;
        let server = format!("https://{}:{}", self.address, ports.apiserver);
        let (admin_kubeconfig_path, admin_kubeconfig) = self.write_kubeconfigs(&server, &pki)?;

        let mut started = Started(Vec::new());
        let etcd_url = self.start_etcd(&ports, &mut started, deadline).await?;
        let apiserver_args = self.apiserver_args(&etcd_url, &ports, &pki)?;
        let apiserver = self.spawn(
            "kube-apiserver",
            &self.binaries.kube_apiserver,
            apiserver_args.clone(),
        )?;
        started.0.push(apiserver.clone());
        let admin = client_from(admin_kubeconfig.clone(), "admin")?;
        wait_healthy(&apiserver, deadline, || get_text(&admin, "/readyz")).await?;
        self.start_controllers(&ports, &pki, &mut started, deadline)
            .await?;

        // The controllers are healthy only in a shallow sense until they act: wait for the
        // serviceaccount controller to create `default/default`.
        let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), "default");
        let remaining = deadline.saturating_duration_since(Instant::now());
        wait::poll_until(
            "the controller manager to create ServiceAccount default/default",
            remaining,
            || async { sas.get_opt("default").await.map(|sa| sa.map(|_| ())) },
        )
        .await?;

        let procs = std::mem::take(&mut started.0);
        Ok(Booted {
            procs,
            apiserver_args,
            ports,
            pki,
            admin_kubeconfig_path,
            admin_kubeconfig,
        })
    }

    /// The admin's, the controller manager's and the scheduler's kubeconfigs; returns the
    /// admin's path and contents.
    fn write_kubeconfigs(&self, server: &str, pki: &Pki) -> Result<(PathBuf, Kubeconfig), Error> {
        let admin_kubeconfig_path = self.dir.join("admin.kubeconfig");
        for (path, cert) in [
            (&admin_kubeconfig_path, &pki.admin),
            (&self.dir.join(KCM_KUBECONFIG), &pki.controller_manager),
            (&self.dir.join(SCHED_KUBECONFIG), &pki.scheduler),
        ] {
            write_private(path, &cert_kubeconfig_yaml(server, &pki.ca_cert, cert))?;
        }
        let admin_kubeconfig =
            Kubeconfig::read_from(&admin_kubeconfig_path).map_err(|source| Error::Kubeconfig {
                what: admin_kubeconfig_path.display().to_string(),
                source,
            })?;
        Ok((admin_kubeconfig_path, admin_kubeconfig))
    }

    /// etcd, loopback only, its data in the control plane's directory; returns its URL once
    /// it is healthy.
    async fn start_etcd(
        &self,
        ports: &Ports,
        started: &mut Started,
        deadline: Instant,
    ) -> Result<String, Error> {
        let s = |p: &Path| p.display().to_string();
        let etcd_url = format!("http://127.0.0.1:{}", ports.etcd_client);
        let peer_url = format!("http://127.0.0.1:{}", ports.etcd_peer);
        let etcd = self.spawn(
            "etcd",
            &self.binaries.etcd,
            vec![
                "--name=meshgate-e2e".into(),
                format!("--data-dir={}", s(&self.dir.join("etcd"))),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=meshgate-e2e={peer_url}"),
                "--initial-cluster-state=new".into(),
                "--logger=zap".into(),
                "--log-outputs=stderr".into(),
            ],
        )?;
        started.0.push(etcd.clone());
        wait_healthy(&etcd, deadline, || etcd_health(ports.etcd_client)).await?;
        Ok(etcd_url)
    }

    /// kube-apiserver's command line (kept for a restart); writes its audit policy.
    fn apiserver_args(
        &self,
        etcd_url: &str,
        ports: &Ports,
        pki: &Pki,
    ) -> Result<Vec<String>, Error> {
        let s = |p: &Path| p.display().to_string();
        let logs = self.dir.join("logs");
        let routable = !self.address.is_loopback();
        let audit_policy = logs.join("audit-policy.yaml");
        write_private(&audit_policy, AUDIT_POLICY)?;
        let mut apiserver_args: Vec<String> = vec![
            format!("--etcd-servers={etcd_url}"),
            format!("--bind-address={}", self.address),
            format!("--advertise-address={}", self.address),
            format!("--secure-port={}", ports.apiserver),
            format!("--tls-cert-file={}", s(&pki.apiserver.cert)),
            format!("--tls-private-key-file={}", s(&pki.apiserver.key)),
            format!("--client-ca-file={}", s(&pki.ca_cert)),
            format!("--requestheader-client-ca-file={}", s(&pki.front_proxy_ca)),
            format!("--requestheader-allowed-names={}", pki::FRONT_PROXY_CLIENT),
            "--requestheader-username-headers=X-Remote-User".into(),
            "--requestheader-group-headers=X-Remote-Group".into(),
            "--requestheader-extra-headers-prefix=X-Remote-Extra-".into(),
            format!(
                "--proxy-client-cert-file={}",
                s(&pki.front_proxy_client.cert)
            ),
            format!("--proxy-client-key-file={}", s(&pki.front_proxy_client.key)),
            "--authorization-mode=Node,RBAC".into(),
            "--enable-admission-plugins=NodeRestriction".into(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", s(&pki.service_account_pub)),
            format!(
                "--service-account-signing-key-file={}",
                s(&pki.service_account_key)
            ),
            format!("--service-cluster-ip-range={}", pki::SERVICE_CIDR),
            "--allow-privileged=true".into(),
            format!("--cert-dir={}", s(&self.dir.join("pki"))),
            "--profiling=false".into(),
            // Requests by identities under test (ServiceAccounts outside kube-system),
            // for the fault suite and the benchmarks: see [`ControlPlane::audit_log`].
            format!("--audit-policy-file={}", s(&audit_policy)),
            format!("--audit-log-path={}", s(&logs.join(AUDIT_LOG))),
            "--audit-log-format=json".into(),
        ];
        if routable {
            apiserver_args.extend([
                // kube-proxy on the real nodes sends the `kubernetes` Service to the
                // endpoints the apiserver reconciles: its own routable address.
                "--endpoint-reconciler-type=lease".into(),
                // No kube-proxy in the apiserver's namespace: dial a webhook Service's
                // endpoints (the webhook pods' IPs, routed to their node), not its ClusterIP.
                "--enable-aggregator-routing=true".into(),
            ]);
        } else {
            // No kube-proxy and a loopback advertise address: the `kubernetes` Service's
            // endpoints would be invalid (loopback), so do not reconcile them.
            apiserver_args.push("--endpoint-reconciler-type=none".into());
        }
        apiserver_args.extend(self.apiserver_flags.iter().cloned());
        Ok(apiserver_args)
    }

    /// The controller manager and the scheduler, both healthy.
    async fn start_controllers(
        &self,
        ports: &Ports,
        pki: &Pki,
        started: &mut Started,
        deadline: Instant,
    ) -> Result<(), Error> {
        let s = |p: &Path| p.display().to_string();
        let common = |port: u16, kubeconfig: &Path, serving: &pki::CertFiles| {
            vec![
                format!("--kubeconfig={}", s(kubeconfig)),
                format!("--authentication-kubeconfig={}", s(kubeconfig)),
                format!("--authorization-kubeconfig={}", s(kubeconfig)),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={port}"),
                format!("--tls-cert-file={}", s(&serving.cert)),
                format!("--tls-private-key-file={}", s(&serving.key)),
                "--leader-elect=false".into(),
                "--profiling=false".into(),
            ]
        };
        let mut kcm_args = common(
            ports.controller_manager,
            &self.dir.join(KCM_KUBECONFIG),
            &pki.controller_manager_serving,
        );
        kcm_args.extend([
            format!(
                "--service-account-private-key-file={}",
                s(&pki.service_account_key)
            ),
            format!("--root-ca-file={}", s(&pki.ca_cert)),
            "--use-service-account-credentials=true".into(),
            // Client-side rate limits sized for one busy test binary rather than a shared
            // production apiserver: controllers start (and react) without queueing behind the
            // default 20 QPS.
            "--kube-api-qps=200".into(),
            "--kube-api-burst=400".into(),
            // Every default controller: deployment, replicaset, disruption, garbage collector,
            // serviceaccount(-token), namespace, nodelifecycle (kept on: the kubelet stand-in
            // renews Leases, and the controller lifts the not-ready taint admission adds to new
            // Nodes, as in a real cluster), taint-eviction, podgc, root-ca-cert-publisher, ...
            "--controllers=*".into(),
        ]);
        let kcm = self.spawn(
            "kube-controller-manager",
            &self.binaries.kube_controller_manager,
            kcm_args,
        )?;
        started.0.push(kcm.clone());
        let scheduler = self.spawn(
            "kube-scheduler",
            &self.binaries.kube_scheduler,
            common(
                ports.scheduler,
                &self.dir.join(SCHED_KUBECONFIG),
                &pki.scheduler_serving,
            ),
        )?;
        started.0.push(scheduler.clone());

        let kcm_health = health_client(ports.controller_manager, pki)?;
        let sched_health = health_client(ports.scheduler, pki)?;
        wait_healthy(&kcm, deadline, || get_text(&kcm_health, "/healthz")).await?;
        wait_healthy(&scheduler, deadline, || get_text(&sched_health, "/healthz")).await
    }

    pub(super) fn spawn(&self, name: &str, bin: &Path, args: Vec<String>) -> Result<Proc, Error> {
        let log = self.dir.join("logs").join(format!("{name}.log"));
        process::spawn(name, bin, &args, &log, self.mode)
    }
}

/// Polls `check` until it answers `ok`, failing fast if the process exits.
pub(super) async fn wait_healthy<F, Fut>(
    proc_: &Proc,
    deadline: Instant,
    check: F,
) -> Result<(), Error>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<String, String>>,
{
    let begun = Instant::now();
    let mut last: String;
    loop {
        if let Some(status) = proc_.exit_status() {
            return Err(Error::Exited {
                component: proc_.name.clone(),
                status,
                log: proc_.log.clone(),
                tail: proc_.log_tail(30),
            });
        }
        match tokio::time::timeout(Duration::from_secs(5), check()).await {
            Ok(Ok(body)) if body.trim() == "ok" || body.contains("\"health\":\"true\"") => {
                tracing::debug!(component = %proc_.name, elapsed_ms = begun.elapsed().as_millis() as u64, "healthy");
                return Ok(());
            }
            Ok(Ok(body)) => last = body.chars().take(400).collect(),
            Ok(Err(e)) => last = e,
            Err(_) => last = "health check timed out".into(),
        }
        if Instant::now() >= deadline {
            return Err(Error::Unhealthy {
                component: proc_.name.clone(),
                timeout: begun.elapsed(),
                last,
                log: proc_.log.clone(),
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub(super) async fn get_text(client: &Client, path: &str) -> Result<String, String> {
    let req = http::Request::get(path)
        .body(Vec::new())
        .map_err(|e| e.to_string())?;
    client.request_text(req).await.map_err(|e| e.to_string())
}

/// etcd's `/health` over plain HTTP/1.0; a hand-written request keeps an HTTP client crate out.
pub(super) async fn etcd_health(port: u16) -> Result<String, String> {
    let mut stream = tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port))
        .await
        .map_err(|e| e.to_string())?;
    stream
        .write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .map_err(|e| e.to_string())?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .await
        .map_err(|e| e.to_string())?;
    Ok(response
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_owned())
}

/// An anonymous client for a component's secure port, trusting the harness CA (the component
/// serves a certificate it signed); `/healthz` is in every component's always-allowed paths.
pub(super) fn health_client(port: u16, pki: &Pki) -> Result<Client, Error> {
    let url = format!("https://127.0.0.1:{port}")
        .parse()
        .map_err(|e: http::uri::InvalidUri| {
            Error::io(
                format!("health URL for port {port}"),
                std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
            )
        })?;
    let mut config = Config::new(url);
    config.root_cert = Some(vec![pki.ca_der.clone()]);
    config.default_retry = false;
    Client::try_from(config).map_err(|e| Error::kube("building a health-check client", e))
}

pub(crate) fn client_from(kubeconfig: Kubeconfig, what: &str) -> Result<Client, Error> {
    let mut config = Config::try_from(kubeconfig).map_err(|source| Error::Kubeconfig {
        what: what.to_owned(),
        source,
    })?;
    config.default_retry = false;
    Client::try_from(config).map_err(|e| Error::kube(format!("building the {what} client"), e))
}

/// Picks five distinct free loopback ports, below the ephemeral range so a component
/// restarted on its port (`start_apiserver`) finds it free (see `sim::node::free_port`).
pub(super) fn free_ports() -> Result<Ports, Error> {
    let ports = (0..5)
        .map(|_| crate::sim::node::free_port())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::io("reserving loopback ports", e))?;
    Ok(Ports {
        etcd_client: ports[0],
        etcd_peer: ports[1],
        apiserver: ports[2],
        controller_manager: ports[3],
        scheduler: ports[4],
    })
}

/// The dummy link of a routable control plane in `dir` (IFNAMSIZ leaves 15 characters).
pub(super) fn link_name(dir: &Path) -> String {
    format!("mgcp{:08x}", hostnet::seed(dir))
}

/// A routable control plane's link while it starts: deleted on drop unless handed over to
/// the [`ControlPlane`], which deletes it on stop.
pub(super) struct LinkGuard(pub(super) Option<String>);

impl LinkGuard {
    pub(super) fn hand_over(mut self) -> Option<String> {
        self.0.take()
    }
}

impl Drop for LinkGuard {
    fn drop(&mut self) {
        if let Some(link) = self.0.take() {
            hostnet::delete_link(&link);
        }
    }
}

/// The apiserver's address: loopback, or with `routable` a dummy link's named after `dir`.
/// Until the ControlPlane owns it, the link is deleted by the returned guard on any early return
/// or panic: a temporary dir goes with it, and with the dir the owner file the next run's sweep
/// would have found the link by.
pub(super) fn apiserver_address(
    routable: bool,
    dir: &Path,
) -> Result<(Ipv4Addr, LinkGuard), Error> {
    if !routable {
        return Ok((Ipv4Addr::LOCALHOST, LinkGuard(None)));
    }
    let name = link_name(dir);
    let link = LinkGuard(Some(name.clone()));
    Ok((add_dummy(dir, &name)?, link))
}

/// Creates the link `link` (a port-less bridge) with an unused /32 in 10.203.0.0/16 (no other
/// fixture uses that range: pods get 10.200.x, the netns fixtures 10.100-199.x, real nodes'
/// links 10.202.x).
pub(super) fn add_dummy(dir: &Path, link: &str) -> Result<Ipv4Addr, Error> {
    const PART: &str = "the control plane's address";
    let address = hostnet::unused_net(hostnet::seed(dir), 32, |n| {
        Ipv4Addr::new(10, 203, (n >> 8) as u8, (n as u8).clamp(1, 254))
    })?;
    // A bridge without ports serves as the dummy: this machine kind's kernel has no `dummy`
    // link type ("Unknown device type"), and an address on an up bridge is local all the same.
    hostnet::ip(PART, &["link", "add", link, "type", "bridge"])?;
    hostnet::ip(
        PART,
        &["addr", "add", &format!("{address}/32"), "dev", link],
    )?;
    hostnet::ip(PART, &["link", "set", link, "up"])?;
    Ok(address)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A start that fails after the link was added deletes it (the guard), and a started
    /// control plane keeps it (handed over).
    #[test]
    fn a_failed_starts_link_is_deleted_and_a_handed_over_one_kept() {
        crate::harness::paths::require_root().expect("the link guard test needs root");
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let name = link_name(dir.path());
        let failed = || -> Result<(), Error> {
            let _link = LinkGuard(Some(name.clone()));
            add_dummy(dir.path(), &name)?;
            assert!(hostnet::link_exists(&name));
            Err(Error::StartPanicked)
        };
        assert!(failed().is_err());
        assert!(
            !hostnet::link_exists(&name),
            "{name} outlived a failed start"
        );

        let link = LinkGuard(Some(name.clone()));
        add_dummy(dir.path(), &name).unwrap();
        let kept = link.hand_over();
        assert!(
            hostnet::link_exists(&name),
            "{name} deleted though handed over"
        );
        hostnet::delete_link(kept.as_deref().unwrap());
        assert!(!hostnet::link_exists(&name));
    }

    #[test]
    fn free_ports_are_distinct() {
        let p = free_ports().unwrap();
        let all = BTreeSet::from([
            p.etcd_client,
            p.etcd_peer,
            p.apiserver,
            p.controller_manager,
            p.scheduler,
        ]);
        assert_eq!(all.len(), 5);
    }

    /// A routable control plane killed outright leaves its link on the host: the next run's
    /// sweep removes it with the directory. Needs root, like the real-node sweep test.
    #[test]
    fn a_dead_routable_runs_link_is_swept() {
        crate::harness::paths::require_root().expect("the link sweep test needs root");
        let base = tempfile::tempdir_in("/dev/shm").unwrap();
        let dead = base.path().join("meshgate-e2e-deadlink");
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(dead.join(OWNER_FILE), "1 18446744073709551615\n").unwrap();
        let link = link_name(&dead);
        let address = add_dummy(&dead, &link).unwrap();
        assert!(address.octets()[..2] == [10, 203], "{address}");
        assert!(hostnet::link_exists(&link));
        sweep_stale(base.path());
        assert!(!dead.exists());
        assert!(!hostnet::link_exists(&link), "{link} left behind");
    }
}
