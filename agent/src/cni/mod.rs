//! The agent's CNI edge: reads the config directory and probes plugin binaries, then hands
//! the plain data to `meshgate_core::cni::verify`.
//!
//! In: [`CniArgs`] (shared by `check` and `run`). Out: a `ChainVerdict`, or an I/O error when the
//! directory itself cannot be listed (a missing directory is not an error: it is `NoConfig`,
//! as for the runtime). Each verification reads lazily within `--max-verify-bytes` and runs
//! plugins within one overall `--verify-timeout`.

pub mod answers;
pub mod preprobe;
pub mod prober;
pub mod reader;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use meshgate_core::cni::multus::{self, MultusOptions, MultusVersion};
use meshgate_core::cni::{ChainVerdict, Runtime, VerifyOptions, plan, verify};

pub use prober::Prober;

/// Flags shared by `check` and `run` that say what to verify.
#[derive(Clone, Debug, clap::Args)]
pub struct CniArgs {
    /// The CNI config directory the container runtime loads.
    #[arg(long, env = "MESHGATE_CNI_CONF_DIR", default_value = "/etc/cni/net.d")]
    pub cni_conf_dir: PathBuf,
    /// A CNI plugin binary directory; repeat for several, searched in order.
    #[arg(
        long = "cni-bin-dir",
        env = "MESHGATE_CNI_BIN_DIRS",
        value_delimiter = ',',
        default_value = "/opt/cni/bin"
    )]
    pub cni_bin_dirs: Vec<PathBuf>,
    /// A plugin type the effective chain must contain (e.g. linkerd-cni); repeat for several.
    #[arg(
        long = "require-plugin",
        env = "MESHGATE_REQUIRE_PLUGINS",
        value_delimiter = ',',
        required = true
    )]
    pub require_plugins: Vec<String>,
    /// Whose config-loading semantics to apply.
    #[arg(
        long,
        env = "MESHGATE_RUNTIME",
        default_value = "containerd",
        value_parser = runtime_parser()
    )]
    pub runtime: Runtime,
    /// How long a plugin binary may take to answer VERSION before it is killed.
    #[arg(long, env = "MESHGATE_PROBE_TIMEOUT", default_value = "2s", value_parser = meshgate_shell::cli::duration)]
    pub probe_timeout: Duration,
    /// Config files larger than this are reported as ConfigInvalid without being read.
    #[arg(long, env = "MESHGATE_MAX_CONFIG_BYTES", default_value_t = reader::DEFAULT_MAX_FILE_BYTES)]
    pub max_config_bytes: u64,
    /// Bytes one verification may list and read in total; past it the verdict is
    /// ConfigInvalid ("cannot be verified").
    #[arg(long, env = "MESHGATE_MAX_VERIFY_BYTES", default_value_t = reader::DEFAULT_BUDGET_BYTES)]
    pub max_verify_bytes: u64,
    /// Overall time one verification may spend running plugin binaries.
    #[arg(long, env = "MESHGATE_VERIFY_TIMEOUT", default_value = "10s", value_parser = meshgate_shell::cli::duration)]
    pub verify_timeout: Duration,
    /// Multus thick's view of this node's CNI config directory (its daemon config's
    /// `multusAutoconfigDir`): a `clusterNetwork` under it is read under --cni-conf-dir.
    #[arg(long, env = "MESHGATE_MULTUS_DAEMON_CONF_DIR", default_value = multus::DEFAULT_DAEMON_CONF_DIR)]
    pub multus_daemon_conf_dir: String,
    /// The Multus release the node runs (`latest`, or e.g. `v4.1.4`): from v4.2.1 on, a
    /// `.conflist` `clusterNetwork` file gets its subdirectory drop-in plugins.
    #[arg(long, env = "MESHGATE_MULTUS_VERSION", default_value = "latest")]
    pub multus_version: MultusVersion,
}

/// `--runtime` values: the names of the runtimes core has rules for, each with its summary
/// in `--help`.
fn runtime_parser() -> impl TypedValueParser<Value = Runtime> {
    let names = Runtime::ALL.into_iter().map(|r| {
        PossibleValue::new(r.as_str()).help(format!("{}: {}", r.rules().display, r.rules().summary))
    });
    PossibleValuesParser::new(names).try_map(|name| Runtime::named(&name).ok_or("unknown runtime"))
}

impl CniArgs {
    /// The prober these flags describe; pre-probes may run the required plugins.
    pub fn prober(&self) -> Prober {
        let prober = Prober::new(self.cni_bin_dirs.clone(), self.probe_timeout);
        prober.allow(&self.require_plugins);
        prober
    }

    /// Reads the config directory and verifies it, probing binaries through `prober`
    /// (which caches answers, so the daemon passes the same one every time).
    ///
    /// The types the verification will ask about ([`plan::plugin_types`], from a first read
    /// of the directory) are probed first, in parallel; the verdict then comes from a second
    /// read with those answers, and any type the plan missed is probed then.
    ///
    /// Blocking: it reads files and runs plugin binaries. Call it from a blocking thread.
    pub fn verify(&self, prober: &Prober) -> std::io::Result<ChainVerdict> {
        self.verify_timed(prober).map(|(v, _)| v)
    }

    /// [`CniArgs::verify`], and how long of it ran plugin binaries (answers from the cache
    /// included): the daemon's `probe` stage.
    pub fn verify_timed(&self, prober: &Prober) -> std::io::Result<(ChainVerdict, Duration)> {
        reader::check_listable(&self.cni_conf_dir)?;
        // One deadline for every plugin this verification runs, set before any of them.
        let deadline = Instant::now() + self.verify_timeout;
        let opts = VerifyOptions {
            conf_dir: self.cni_conf_dir.display().to_string(),
            runtime: self.runtime,
            required: self.require_plugins.clone(),
            multus: MultusOptions {
                daemon_conf_dir: self.multus_daemon_conf_dir.clone(),
                version: self.multus_version,
            },
        };
        let planned = plan::plugin_types(&mut self.reader(), &opts);
        prober.allow(&planned);
        let began = Instant::now();
        let answers = prober.probe_many(&planned, deadline);
        let mut probing = began.elapsed();
        let verdict = verify(&mut self.reader(), &opts, |t| match answers.get(t) {
            Some(outcome) => outcome.clone(),
            None => {
                let began = Instant::now();
                let outcome = prober.probe(t, deadline);
                probing += began.elapsed();
                outcome
            }
        });
        Ok((verdict, probing))
    }

    /// A fresh reader of the config directory, with the whole byte budget.
    fn reader(&self) -> reader::Reader {
        reader::Reader::new(
            &self.cni_conf_dir,
            self.max_config_bytes,
            self.max_verify_bytes,
        )
    }
}
