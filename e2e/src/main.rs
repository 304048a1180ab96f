//! `meshgate-e2e up|down`: a local control plane for the demo and for manual poking.
//!
//! In: flags (each with an env twin). Out: `up` starts etcd, kube-apiserver,
//! kube-controller-manager and kube-scheduler detached, returns once all are healthy, and prints
//! the admin kubeconfig path as its last line; `down` stops the processes by the pids `up`
//! recorded in the directory and removes what `up` created there.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use meshgate_e2e::{Binaries, ControlPlane, Options};

#[derive(Parser)]
#[command(
    name = "meshgate-e2e",
    version,
    about = "meshgate's local Kubernetes control plane"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start etcd + kube-apiserver + controller manager + scheduler, detached; print the admin
    /// kubeconfig path last.
    Up(UpArgs),
    /// Stop the control plane `up` started in DIR and remove its files.
    Down(DownArgs),
    /// Play meshgate's main job end to end on a local control plane (what `make demo` runs).
    Demo,
}

#[derive(Args)]
struct UpArgs {
    /// Directory for data, certificates, kubeconfigs, logs and the pid state file.
    #[arg(long, env = "MESHGATE_E2E_DIR")]
    dir: PathBuf,
    /// Directory of kube-apiserver, kube-controller-manager, kube-scheduler and kubectl
    /// (default: the cache `e2e/install-deps.sh` builds into).
    #[arg(long, env = "MESHGATE_K8S_BIN_DIR")]
    k8s_bin_dir: Option<PathBuf>,
    /// The etcd binary (default: `etcd` on PATH).
    #[arg(long, env = "MESHGATE_ETCD")]
    etcd: Option<PathBuf>,
    /// Give up if the control plane is not healthy after this many seconds.
    #[arg(long, env = "MESHGATE_E2E_STARTUP_TIMEOUT", default_value_t = 180)]
    startup_timeout: u64,
    /// An extra kube-apiserver flag, after the harness's own (a later flag wins), e.g.
    /// `--feature-gates=MutatingAdmissionPolicy=true`; repeat for more.
    #[arg(
        long = "apiserver-flag",
        env = "MESHGATE_E2E_APISERVER_FLAGS",
        value_delimiter = ' ',
        allow_hyphen_values = true
    )]
    apiserver_flags: Vec<String>,
}

#[derive(Args)]
struct DownArgs {
    /// The directory given to `up`.
    #[arg(long, env = "MESHGATE_E2E_DIR")]
    dir: PathBuf,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The demo tells its own story on stdout; only warnings go to stderr meanwhile.
    let default_filter = if matches!(cli.command, Command::Demo) {
        "warn,kube_client=off"
    } else {
        "meshgate_e2e=info"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Demo => demo().await,
        Command::Up(args) => up(args).await,
        Command::Down(args) => ControlPlane::down(&args.dir)
            .with_context(|| format!("stopping the control plane in {}", args.dir.display())),
    }
}

/// Runs the demo; Ctrl-C (or SIGTERM) stops it, and everything it started is torn down as
/// the demo's future is dropped.
async fn demo() -> anyhow::Result<()> {
    let outcome = tokio::select! {
        r = meshgate_e2e::demo::run() => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    println!(
        "\ntorn down: meshgate, the real nodes (pods, kubelets, containerds, their namespaces), the control plane"
    );
    match outcome {
        Ok(summary) => {
            println!("{summary}");
            Ok(())
        }
        Err(e) => Err(e.context("demo failed")),
    }
}

async fn up(args: UpArgs) -> anyhow::Result<()> {
    let binaries = match args.k8s_bin_dir {
        Some(dir) => Some(Binaries::locate_in(&dir, args.etcd)?),
        None if args.etcd.is_some() => {
            let dir = meshgate_e2e::harness::paths::k8s_bin_dir()?;
            Some(Binaries::locate_in(&dir, args.etcd)?)
        }
        None => None,
    };
    let dir = std::path::absolute(&args.dir)
        .with_context(|| format!("resolving {}", args.dir.display()))?;
    let options = Options {
        dir: Some(dir.clone()),
        detached: true,
        binaries,
        startup_timeout: Duration::from_secs(args.startup_timeout),
        routable: false,
        apiserver_flags: args.apiserver_flags,
    };
    let cp = ControlPlane::start(options)
        .await
        .context("starting the control plane")?;
    println!(
        "Kubernetes {} control plane healthy in {:.1} s at {} (stop it with: meshgate-e2e down --dir {})",
        cp.version(),
        cp.started_in().as_secs_f64(),
        cp.apiserver_url(),
        dir.display()
    );
    let kubeconfig = cp.admin_kubeconfig_path().to_owned();
    cp.detach();
    println!("{}", kubeconfig.display());
    Ok(())
}
