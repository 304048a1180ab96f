//! `meshgate-agent`: parses the command line and hands off to the library.
//!
//! `run` is the DaemonSet daemon, started through the shared entry point; `check` a one-shot
//! CNI chain verification, `inspect` a one-shot check of one pod network namespace. Exit
//! codes follow the one table (docs/operations.md, "Exit codes"): 0 verified / redirected /
//! clean stop, 1 not / stopped on an error, 2 usage or I/O error.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use meshgate_shell::entry::{self, Process};

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
    Check(meshgate_agent::cli::check::Args),
    /// Inspect one pod network namespace for the mesh's redirect rules.
    Inspect(meshgate_agent::cli::inspect::Args),
}

fn main() -> ExitCode {
    // clap exits with 2 on usage errors, matching the contract.
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => {
            let process = Process {
                name: "meshgate-agent",
                log_format: args.common.log_format,
                // A node daemon: two workers keep its CPU share small on every node.
                worker_threads: Some(2),
            };
            entry::run(process, meshgate_agent::daemon::run(*args))
        }
        Command::Check(args) => meshgate_agent::cli::check::main(args),
        Command::Inspect(args) => meshgate_agent::cli::inspect::main(args),
    }
}
