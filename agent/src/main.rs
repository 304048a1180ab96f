//! `meshgate-agent`: parses the command line and hands off to the library.
//!
//! `run` is the DaemonSet daemon, `check` a one-shot CNI chain verification, `inspect` a
//! one-shot check of one pod network namespace. Exit codes follow the contract: 0 verified /
//! redirected, 1 not, 2 usage or I/O error.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "meshgate-agent", version, about = "meshgate node agent")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node agent daemon (taint, condition, label, pod inspection, eviction).
    // Boxed: the daemon's flags dwarf the others, and the enum is built once.
    Run(Box<meshgate_agent::daemon::Args>),
    /// Verify the node's effective CNI config once and print the verdict.
    Check(meshgate_agent::check::Args),
    /// Inspect one pod network namespace for the mesh's redirect rules.
    Inspect(meshgate_agent::inspect::Args),
}

fn main() -> ExitCode {
    // clap exits with 2 on usage errors, matching the contract.
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => meshgate_agent::daemon::main(*args),
        Command::Check(args) => meshgate_agent::check::main(args),
        Command::Inspect(args) => meshgate_agent::inspect::main(args),
    }
}
