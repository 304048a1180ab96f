//! The command-line block both daemons flatten into their own flags, and the one duration
//! grammar every meshgate flag uses.
//!
//! In: the command line and its environment twins (docs/operations.md, "Configuration
//! reference"). Out: [`Common`] (kubeconfig, admin address, profiles, log format, taint key
//! and effect) and
//! [`duration`] values; each binary adds only the flags that are its own.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::builder::{PossibleValuesParser, TypedValueParser};
use meshgate_core::gate::{TaintEffect, TaintKey};
use meshgate_core::profile::ProfileSet;
use tokio::net::TcpListener;

use crate::logging::LogFormat;

/// The flags `meshgate-agent run` and `meshgate-webhook` share, with the same names,
/// environment twins and defaults.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct Common {
    /// Kubeconfig file; else `KUBECONFIG`, else the in-cluster service account.
    #[arg(long, env = "MESHGATE_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Plain-HTTP address for `/live`, `/ready` and `/metrics`. No default: where it may
    /// listen (the node's interfaces or a pod's) is the deployment's choice, and the
    /// manifests always set it; unset, no admin server runs.
    #[arg(long, env = "MESHGATE_ADMIN_ADDR")]
    pub admin_addr: Option<SocketAddr>,
    /// Mesh profiles whose pods are gated (repeatable or comma-separated); default: every
    /// built-in and file-defined profile.
    #[arg(long = "profile", env = "MESHGATE_PROFILES", value_delimiter = ',')]
    pub profiles: Vec<String>,
    /// JSON file of custom mesh profiles, added to the built-in ones.
    #[arg(long, env = "MESHGATE_PROFILE_FILE")]
    pub profile_file: Option<PathBuf>,
    /// Log format on stderr (`RUST_LOG` filters, default `info`).
    #[arg(long, env = "MESHGATE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Key of meshgate's taint (the agent's on its Node, the webhook's on new Nodes), a
    /// Kubernetes qualified name. The default is ephemeral to Karpenter and valid for a
    /// NodeReadinessRule; see docs/operations.md, "Autoscalers", for cluster-autoscaler.
    /// Must match the admission policy, the alerts and the webhook's toleration.
    #[arg(
        long,
        env = "MESHGATE_TAINT_KEY",
        default_value = meshgate_core::gate::DEFAULT_TAINT_KEY,
        value_parser = |s: &str| s.parse::<TaintKey>()
    )]
    pub taint_key: TaintKey,
    /// Effect of meshgate's taint (the agent's on its Node, the webhook's on new Nodes):
    /// NoSchedule keeps new pods off the node; NoExecute also evicts running pods that do
    /// not tolerate it (use with care).
    #[arg(
        long,
        env = "MESHGATE_TAINT_EFFECT",
        default_value = "NoSchedule",
        value_parser = taint_effect_parser()
    )]
    pub taint_effect: TaintEffect,
}

/// Accepts exactly the effects core knows (`TaintEffect::ALL`), as the API spells them, and
/// lists them in `--help`.
fn taint_effect_parser() -> impl TypedValueParser<Value = TaintEffect> {
    PossibleValuesParser::new(TaintEffect::ALL.map(TaintEffect::as_str))
        .try_map(|s| s.parse::<TaintEffect>())
}

impl Common {
    /// The profile set from `--profile-file` and `--profile`.
    pub fn load_profiles(&self) -> anyhow::Result<ProfileSet> {
        crate::profiles::load(&self.profiles, self.profile_file.as_deref())
    }

    /// Binds `--admin-addr`, if set.
    pub async fn bind_admin(&self) -> anyhow::Result<Option<TcpListener>> {
        let Some(addr) = self.admin_addr else {
            tracing::info!("no --admin-addr: no admin server");
            return Ok(None);
        };
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the admin server to {addr}"))?;
        tracing::info!(addr = %listener.local_addr()?, "admin server listening");
        Ok(Some(listener))
    }
}

/// Parses a duration flag: humantime's grammar (`500ms`, `3s`, `1.5s`, `1m 30s`), or a bare
/// number of seconds (`1.5`). Negative, NaN and unknown units are refused, naming the value.
pub fn duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!("invalid duration {s:?}: must be a positive number"));
    }
    if let Ok(secs) = t.parse::<f64>() {
        if !secs.is_finite() {
            return Err(format!("invalid duration {s:?}: must be a positive number"));
        }
        return Duration::try_from_secs_f64(secs)
            .map_err(|e| format!("invalid duration {s:?}: {e}"));
    }
    humantime::parse_duration(t)
        .map_err(|e| format!("invalid duration {s:?} ({e}): use e.g. 3s or 500ms"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn durations_parse() {
        assert_eq!(duration("3s"), Ok(Duration::from_secs(3)));
        assert_eq!(duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(duration("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(duration("1m 30s"), Ok(Duration::from_secs(90)));
        assert_eq!(duration(" 20ms "), Ok(Duration::from_millis(20)));
        assert!(
            duration("-1s")
                .unwrap_err()
                .contains("must be a positive number")
        );
        assert!(duration("-1").is_err());
        assert!(duration("NaN").is_err());
        assert!(duration("inf").is_err());
        assert!(duration("soon").unwrap_err().contains("use e.g. 3s"));
        assert!(duration("NaNs").is_err());
        assert!(duration("3 parsecs").is_err());
        assert!(duration("").is_err());
    }

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        common: Common,
    }

    #[test]
    fn the_shared_flags_parse_with_their_defaults() {
        let c = Cli::try_parse_from(["x"]).unwrap().common;
        assert_eq!(c, Common::default());
        assert_eq!(c.admin_addr, None, "no admin server unless asked for");
        let c = Cli::try_parse_from([
            "x",
            "--kubeconfig",
            "/kc",
            "--admin-addr",
            "127.0.0.1:9990",
            "--profile",
            "linkerd,istio",
            "--profile",
            "istio-ambient",
            "--profile-file",
            "/p.json",
            "--log-format",
            "json",
        ])
        .unwrap()
        .common;
        assert_eq!(c.kubeconfig, Some(PathBuf::from("/kc")));
        assert_eq!(c.admin_addr, Some("127.0.0.1:9990".parse().unwrap()));
        assert_eq!(c.profiles, ["linkerd", "istio", "istio-ambient"]);
        assert_eq!(c.profile_file, Some(PathBuf::from("/p.json")));
        assert_eq!(c.log_format, LogFormat::Json);
        assert!(Cli::try_parse_from(["x", "--admin-addr", "localhost"]).is_err());
        assert!(Cli::try_parse_from(["x", "--log-format", "xml"]).is_err());
    }

    #[test]
    fn the_taint_effect_takes_the_api_names_and_defaults_to_no_schedule() {
        let effect = |args: &[&str]| {
            let argv = std::iter::once("x").chain(args.iter().copied());
            Cli::try_parse_from(argv).map(|c| c.common.taint_effect)
        };
        assert_eq!(effect(&[]).ok(), Some(TaintEffect::NoSchedule));
        assert_eq!(
            effect(&["--taint-effect", "NoExecute"]).ok(),
            Some(TaintEffect::NoExecute)
        );
        assert_eq!(
            effect(&["--taint-effect=NoSchedule"]).ok(),
            Some(TaintEffect::NoSchedule)
        );
        for bad in ["PreferNoSchedule", "noexecute", ""] {
            assert!(effect(&["--taint-effect", bad]).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_taint_key_is_validated_and_defaults_to_the_readiness_prefix() {
        let key = |args: &[&str]| {
            let argv = std::iter::once("x").chain(args.iter().copied());
            Cli::try_parse_from(argv).map(|c| c.common.taint_key)
        };
        assert_eq!(
            key(&[]).unwrap().as_str(),
            "readiness.k8s.io/meshgate-cni-unverified"
        );
        let custom = "startup-taint.cluster-autoscaler.kubernetes.io/meshgate-cni-unverified";
        assert_eq!(key(&["--taint-key", custom]).unwrap().as_str(), custom);
        for bad in ["", "a/b/c", "Example.com/x", "example.com/-x"] {
            let err = key(&["--taint-key", bad]).unwrap_err().to_string();
            assert!(err.contains("--taint-key"), "{bad:?}: {err}");
            assert!(
                err.contains("taint key"),
                "{bad:?}: the reason is shown: {err}"
            );
        }
    }

    #[tokio::test]
    async fn the_admin_listener_is_bound_only_when_asked_for() {
        assert!(Common::default().bind_admin().await.unwrap().is_none());
        let asked = Common {
            admin_addr: Some("127.0.0.1:0".parse().unwrap()),
            ..Common::default()
        };
        let l = asked.bind_admin().await.unwrap().expect("bound");
        assert!(l.local_addr().unwrap().ip().is_loopback());
        let taken = Common {
            admin_addr: Some(l.local_addr().unwrap()),
            ..Common::default()
        };
        let err = taken.bind_admin().await.unwrap_err();
        assert!(
            format!("{err:#}").contains("binding the admin server to"),
            "{err:#}"
        );
    }
}
