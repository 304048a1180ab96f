//! meshgate's chart (`manifests/charts/meshgate`), rendered and installed with helm as an
//! operator does.
//!
//! In: the helm binary `e2e/install-deps.sh` builds (`MESHGATE_HELM`, else
//! `<cache>/helm/<helm-version>/bin/helm`), the chart in this repository, values files and
//! `--set` pairs, and a control plane's admin kubeconfig. Out: the rendered YAML
//! ([`template`]), or helm's stdout after `install`/`uninstall` ([`run`]); every call bounded
//! in time, and a failure carries helm's stderr.

use std::path::PathBuf;
use std::time::Duration;

use crate::harness::paths::{self, env_var, is_executable};
use crate::harness::wait;
use crate::{ControlPlane, Error};

/// Env var naming the helm binary.
pub const HELM_ENV: &str = "MESHGATE_HELM";
/// The release name every test installs.
pub const RELEASE: &str = "meshgate";
/// The namespace the release is stored in. meshgate's own namespace is a chart object, which
/// `helm uninstall` deletes, so the release lives elsewhere (the chart refuses the same one).
pub const RELEASE_NAMESPACE: &str = "kube-system";
/// `helm template` renders in well under a second; bounded all the same.
const TEMPLATE_TIMEOUT: Duration = Duration::from_secs(60);

/// The helm binary: `MESHGATE_HELM`, else the one install-deps.sh built for the pinned version.
pub fn binary() -> Result<PathBuf, Error> {
    let version = paths::pinned_version("helm-version")?;
    let path = match env_var(HELM_ENV) {
        Some(p) => PathBuf::from(p),
        None => paths::cache_dir()?
            .join("helm")
            .join(version)
            .join("bin/helm"),
    };
    if is_executable(&path) {
        Ok(path)
    } else {
        Err(Error::MissingHelm {
            path,
            version: version.to_owned(),
        })
    }
}

/// The chart's directory in this repository.
pub fn chart() -> PathBuf {
    paths::repo_root().join("manifests/charts/meshgate")
}

/// `helm template meshgate manifests/charts/meshgate -n kube-system --kube-version V ARGS...`:
/// the rendered objects. V is the pinned Kubernetes version, the test apiserver's, as `helm
/// install` would see it: without it Helm renders for its own client version, and
/// `agent.impersonateNode=auto` would then pick the grants of a newer cluster. A
/// `--kube-version` in ARGS wins (the last one does).
pub async fn template(args: &[&str]) -> Result<String, Error> {
    let chart = chart();
    let chart = chart.to_string_lossy();
    let mut all = vec![
        "template",
        RELEASE,
        &chart,
        "--namespace",
        RELEASE_NAMESPACE,
        "--kube-version",
        paths::kubernetes_version()?,
    ];
    all.extend_from_slice(args);
    exec(None, &all, TEMPLATE_TIMEOUT).await
}

/// The kinds the chart renders only where the apiserver serves them (`.Capabilities
/// .APIVersions.Has`): group/version and resource.
const OPTIONAL_KINDS: [(&str, &str, &str); 2] = [
    (
        "admissionregistration.k8s.io/v1",
        "mutatingadmissionpolicies",
        "MutatingAdmissionPolicy",
    ),
    (
        "admissionregistration.k8s.io/v1beta1",
        "mutatingadmissionpolicies",
        "MutatingAdmissionPolicy",
    ),
];

/// `--api-versions` arguments for each of [`OPTIONAL_KINDS`] `cp` serves, so that `helm
/// template` renders what `helm install` would render against it (install reads discovery;
/// template sees only what it is told).
pub async fn api_versions(cp: &ControlPlane) -> Result<Vec<String>, Error> {
    let client = cp.client()?;
    let mut args = Vec::new();
    for (group_version, resource, kind) in OPTIONAL_KINDS {
        let served = wait::api(
            &format!("discovery of {group_version}"),
            client.list_api_group_resources(group_version),
        )
        .await;
        // Not served at all is a 404; anything else is an error of the cluster.
        let served = match served {
            Ok(list) => list.resources.iter().any(|r| r.name == resource),
            Err(e) if e.api_code() == Some(404) => false,
            Err(e) => return Err(e),
        };
        if served {
            args.push("--api-versions".to_owned());
            args.push(format!("{group_version}/{kind}"));
        }
    }
    Ok(args)
}

/// `helm VERB meshgate manifests/charts/meshgate -n kube-system EXTRA...` against `cp` (`install`,
/// `upgrade`), bounded by `timeout`; helm's stdout.
pub async fn release(
    cp: &ControlPlane,
    verb: &str,
    extra: &[&str],
    timeout: Duration,
) -> Result<String, Error> {
    let chart = chart();
    let chart = chart.to_string_lossy();
    let mut all = vec![verb, RELEASE, &chart, "--namespace", RELEASE_NAMESPACE];
    all.extend_from_slice(extra);
    run(cp, &all, timeout).await
}

/// `helm ARGS...` against `cp` (its admin kubeconfig), bounded by `timeout`; helm's stdout.
pub async fn run(cp: &ControlPlane, args: &[&str], timeout: Duration) -> Result<String, Error> {
    exec(Some(cp), args, timeout).await
}

/// `helm ARGS...` with no cluster (`template`, `lint`), bounded; helm's stdout.
pub async fn run_offline(args: &[&str]) -> Result<String, Error> {
    exec(None, args, TEMPLATE_TIMEOUT).await
}

async fn exec(
    cp: Option<&ControlPlane>,
    args: &[&str],
    timeout: Duration,
) -> Result<String, Error> {
    let mut cmd = tokio::process::Command::new(binary()?);
    if let Some(cp) = cp {
        cmd.arg("--kubeconfig").arg(cp.admin_kubeconfig_path());
    }
    // helm's caches and config stay out of the invoking user's home.
    let home = std::env::temp_dir().join("meshgate-e2e-helm");
    cmd.env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"))
        .args(args);
    let what = format!("helm {}", args.join(" "));
    let out = wait::command_output(&what, timeout, &mut cmd).await?;
    if !out.status.success() {
        return Err(Error::Helm {
            args: args.join(" "),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
