//! `meshgate-webhook`: parses the command line and hands [`meshgate_webhook::run`] to the
//! shared entry point, which sets up logging and maps the result to the exit-code table
//! (docs/operations.md, "Exit codes").

use std::process::ExitCode;

use clap::Parser;
use meshgate_shell::entry::{self, Process};

fn main() -> ExitCode {
    let args = meshgate_webhook::Args::parse();
    let process = Process {
        name: "meshgate-webhook",
        log_format: args.common.log_format,
        worker_threads: None,
    };
    entry::run(process, meshgate_webhook::run(args))
}
