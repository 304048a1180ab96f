//! The one-shot `check` subcommand: verify the node's effective CNI config once.
//!
//! In: [`Args`]. Out: the verdict on stdout (text or the contract's JSON object) and the
//! exit code: 0 verified, 1 not verified, 2 usage or I/O error.

use std::process::ExitCode;

use meshgate_core::cni::ChainVerdict;
use meshgate_shell::entry::Exit;

use super::Output;
use crate::cni::CniArgs;

/// `meshgate-agent check --cni-conf-dir DIR --cni-bin-dir DIR --require-plugin TYPE ...`
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub cni: CniArgs,
    /// Output format.
    #[arg(long, env = "MESHGATE_OUTPUT", value_enum, default_value = "text")]
    pub output: Output,
}

/// Runs `check` and maps the verdict to the exit code.
pub fn main(args: Args) -> ExitCode {
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
        Output::Json => match serde_json::to_string(&verdict) {
            Ok(json) => println!("{json}"),
            Err(e) => {
                eprintln!("meshgate-agent check: cannot encode the verdict: {e}");
                return Exit::UsageOrIo.into();
            }
        },
        Output::Text => print!("{}", render_text(&verdict)),
    }
    if verdict.verified {
        Exit::Success.into()
    } else {
        Exit::Failed.into()
    }
}

/// The human-readable verdict.
pub fn render_text(v: &ChainVerdict) -> String {
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
    out
}
