//! The one-shot `inspect` subcommand: one pod network namespace → redirected / missing.
//!
//! In: [`Args`] (a namespace path or a pid, a profile name, optionally a profile file and the
//! pod's annotations). Out: the verdict on stdout, as text or the contract's JSON object, and
//! the exit code: 0 redirected, 1 missing, 2 unknown, usage or I/O error. The library half
//! is [`crate::netns::inspect_pod`]: enter, read addresses and rules, derive what the mesh
//! writes for this pod, match; then a node proxy's listeners in the namespace, as the daemon
//! judges them. Its readiness on the node is not judged: the verdict's `not_judged` says so.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use meshgate_core::rules::{self, Inspection, RedirectVerdict};
use meshgate_shell::entry::Exit;

use super::{Output, node_proxy_not_judged};
use crate::netns;

/// `meshgate-agent inspect (--netns PATH | --pid PID) --profile NAME [--output text|json]`
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["netns", "pid"])))]
pub struct Args {
    /// Path of the network namespace to inspect (e.g. /var/run/netns/NAME or /proc/PID/ns/net).
    #[arg(long, env = "MESHGATE_NETNS")]
    pub netns: Option<PathBuf>,
    /// Inspect the network namespace of this process.
    #[arg(long, env = "MESHGATE_PID")]
    pub pid: Option<u32>,
    /// Mesh profile whose redirect ports are expected.
    #[arg(long, env = "MESHGATE_PROFILE")]
    pub profile: String,
    /// Extra mesh profiles (JSON array), added to the built-in ones.
    #[arg(long, env = "MESHGATE_PROFILE_FILE")]
    pub profile_file: Option<PathBuf>,
    /// One of the pod's annotations, `KEY=VALUE` (repeatable; the environment variable takes
    /// one per line). Opt-outs such as `traffic.sidecar.istio.io/includeInboundPorts=` narrow
    /// what the mesh is expected to have written.
    #[arg(
        long = "annotation",
        env = "MESHGATE_POD_ANNOTATIONS",
        value_name = "KEY=VALUE",
        value_delimiter = '\n',
        value_parser = parse_annotation
    )]
    pub annotations: Vec<(String, String)>,
    /// The pod's annotations as one JSON object (`kubectl get pod -o
    /// jsonpath='{.metadata.annotations}'`); `--annotation` entries override its keys.
    #[arg(long, env = "MESHGATE_POD_ANNOTATIONS_JSON", value_name = "JSON")]
    pub pod_annotations_json: Option<String>,
    /// Output format.
    #[arg(long, env = "MESHGATE_OUTPUT", value_enum, default_value = "text")]
    pub output: Output,
}

/// Runs `inspect`. Exit 0 = redirected, 1 = missing, 2 = unknown (rules unreadable or past the dump caps), usage or I/O error.
pub fn main(args: Args) -> ExitCode {
    match run(&args) {
        Ok((path, inspection, not_judged)) => {
            match args.output {
                Output::Json => match render_json(&path, &inspection, &not_judged) {
                    Ok(json) => println!("{json}"),
                    Err(e) => {
                        eprintln!("meshgate-agent inspect: cannot encode the verdict: {e}");
                        return Exit::UsageOrIo.into();
                    }
                },
                Output::Text => print!("{}", render_text(&path, &inspection, &not_judged)),
            }
            match inspection.verdict {
                RedirectVerdict::Redirected => Exit::Success.into(),
                RedirectVerdict::Missing => Exit::Failed.into(),
                RedirectVerdict::Unknown => Exit::UsageOrIo.into(),
            }
        }
        Err(e) => {
            eprintln!("meshgate-agent inspect: {e:#}");
            Exit::UsageOrIo.into()
        }
    }
}

fn run(args: &Args) -> anyhow::Result<(PathBuf, Inspection, Vec<String>)> {
    let profiles = meshgate_shell::profiles::load(&[], args.profile_file.as_deref())?;
    let profile = profiles
        .select(std::slice::from_ref(&args.profile))
        .context("--profile")?
        .get(&args.profile)
        .cloned()
        .with_context(|| format!("unknown mesh profile {:?}", args.profile))?;
    let path = match (&args.netns, args.pid) {
        (Some(p), _) => p.clone(),
        (None, Some(pid)) => PathBuf::from(format!("/proc/{pid}/ns/net")),
        (None, None) => anyhow::bail!("give --netns PATH or --pid PID"),
    };
    let annotations = annotations(args)?;
    let inspection = netns::inspect_pod(&path, &profile, &annotations)?;
    let not_judged = node_proxy_not_judged(&profile).into_iter().collect();
    Ok((path, inspection, not_judged))
}

/// `KEY=VALUE` → `(KEY, VALUE)`; the value may be empty, the key may not.
fn parse_annotation(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.to_owned())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

/// The pod's annotations from `--pod-annotations-json` and `--annotation`.
fn annotations(args: &Args) -> anyhow::Result<BTreeMap<String, String>> {
    let mut out: BTreeMap<String, String> = match &args.pod_annotations_json {
        Some(text) if !text.trim().is_empty() => serde_json::from_str(text)
            .context("--pod-annotations-json: not a JSON object of strings")?,
        _ => BTreeMap::new(),
    };
    for (k, v) in &args.annotations {
        out.insert(k.clone(), v.clone());
    }
    Ok(out)
}

/// The contract's JSON object, with `not_judged`.
pub fn render_json(
    path: &Path,
    i: &Inspection,
    not_judged: &[String],
) -> serde_json::Result<String> {
    serde_json::to_string(&serde_json::json!({
        "verdict": i.verdict.as_str(),
        "profile": i.profile,
        "netns": path.display().to_string(),
        "inbound": i.inbound,
        "outbound": i.outbound,
        "message": i.message,
        "not_judged": not_judged,
    }))
}

/// Human-readable lines.
pub fn render_text(path: &Path, i: &Inspection, not_judged: &[String]) -> String {
    let dir = |d: &rules::DirectionResult| match (&d.via, d.found, d.expected) {
        (Some(via), _, false) => format!("{} not expected (found via {via})", d.port),
        (None, _, false) => format!("{} not expected", d.port),
        (Some(via), true, true) => format!("{} found via {via}", d.port),
        (Some(via), false, true) => format!("{} MISSING (only via {via})", d.port),
        (None, _, true) => format!("{} MISSING", d.port),
    };
    let mut out = format!(
        "verdict:  {}\nprofile:  {}\nnetns:    {}\ninbound:  {}\noutbound: {}\nmessage:  {}\n",
        i.verdict.as_str().to_uppercase(),
        i.profile,
        path.display(),
        dir(&i.inbound),
        dir(&i.outbound),
        i.message
    );
    for n in not_judged {
        out.push_str(&format!("not judged: {n}\n"));
    }
    out
}
