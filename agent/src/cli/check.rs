//! The one-shot `check` subcommand: verify the node's effective CNI config once.
//!
//! In: [`Args`]. Out: the verdict on stdout (text or the contract's JSON object, with
//! `not_judged`: what the daemon's verdict also needs of the node and `check` does not read)
//! and the exit code: 0 verified, 1 not verified, 2 usage or I/O error.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use meshgate_core::cni::ChainVerdict;
use meshgate_shell::entry::Exit;

use super::{Output, node_proxy_not_judged};
use crate::cni::CniArgs;

/// `meshgate-agent check --cni-conf-dir DIR --cni-bin-dir DIR --require-plugin TYPE ...`
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub cni: CniArgs,
    /// The mesh profiles the node's agent is run with (its `--profile`, repeatable or
    /// comma-separated): a node proxy the agent requires of a profile named there is what
    /// `check` lists as not judged. None named: the agent requires none.
    #[arg(long = "profile", env = "MESHGATE_PROFILES", value_delimiter = ',')]
    pub profiles: Vec<String>,
    /// JSON file of custom mesh profiles, added to the built-in ones.
    #[arg(long, env = "MESHGATE_PROFILE_FILE")]
    pub profile_file: Option<PathBuf>,
    /// Output format.
    #[arg(long, env = "MESHGATE_OUTPUT", value_enum, default_value = "text")]
    pub output: Output,
}

/// Runs `check` and maps the verdict to the exit code.
pub fn main(args: Args) -> ExitCode {
    let not_judged = match not_judged(&args) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("meshgate-agent check: {e:#}");
            return Exit::UsageOrIo.into();
        }
    };
    let prober = args.cni.prober();
    let verdict = match args.cni.verify(&prober) {
        Ok(v) => v,
        Err(e) => {
            eprintln!(
                "meshgate-agent check: cannot read {}: {e}",
                args.cni.cni_conf_dir.display()
            );
            return Exit::UsageOrIo.into();
        }
    };
    match args.output {
        Output::Json => match render_json(&verdict, &not_judged) {
            Ok(json) => println!("{json}"),
            Err(e) => {
                eprintln!("meshgate-agent check: cannot encode the verdict: {e}");
                return Exit::UsageOrIo.into();
            }
        },
        Output::Text => print!("{}", render_text(&verdict, &not_judged)),
    }
    if verdict.verified {
        Exit::Success.into()
    } else {
        Exit::Failed.into()
    }
}

/// What the agent's node verdict also needs and `check` does not judge: the node proxy of
/// the profile `--profile` names, as the agent requires it
/// ([`meshgate_core::node_proxy::required`]).
fn not_judged(args: &Args) -> anyhow::Result<Vec<String>> {
    let profiles = meshgate_shell::profiles::load(&args.profiles, args.profile_file.as_deref())
        .context("the profiles")?;
    let required =
        meshgate_core::node_proxy::required(&profiles, &args.profiles).context("--profile")?;
    Ok(required
        .and_then(node_proxy_not_judged)
        .into_iter()
        .collect())
}

/// The contract's JSON object, with `not_judged`.
pub fn render_json(v: &ChainVerdict, not_judged: &[String]) -> serde_json::Result<String> {
    let mut value = serde_json::to_value(v)?;
    if let Some(o) = value.as_object_mut() {
        o.insert("not_judged".into(), serde_json::json!(not_judged));
    }
    serde_json::to_string(&value)
}

/// The human-readable verdict.
pub fn render_text(v: &ChainVerdict, not_judged: &[String]) -> String {
    let status = if v.verified {
        "VERIFIED"
    } else {
        "NOT VERIFIED"
    };
    let mut out = format!("verdict:  {status} ({})\n", v.reason);
    out.push_str(&format!(
        "config:   {} ({})\n",
        v.config_file.as_deref().unwrap_or("-"),
        v.runtime.as_str()
    ));
    if !v.plugins.is_empty() {
        out.push_str(&format!("chain:    {}\n", v.plugins.join(" → ")));
    }
    if let Some(d) = &v.delegate {
        let runs = match (&d.file, d.plugins.is_empty()) {
            (_, true) => "-".to_string(),
            (Some(f), false) => format!("{f}: {}", d.plugins.join(" → ")),
            (None, false) => d.plugins.join(" → "),
        };
        out.push_str(&format!(
            "delegate: {} {}: {runs}\n",
            d.layout.display(),
            d.source
        ));
    }
    out.push_str(&format!("message:  {}\n", v.message));
    for n in not_judged {
        out.push_str(&format!("not judged: {n}\n"));
    }
    out
}
