//! `kubectl-meshgate`: the kubectl plugin (`kubectl meshgate status|cleanup` once it is on
//! PATH). Parses the command line and hands off to `meshgate_agent::plugin`. Exit codes follow
//! the one table (docs/operations.md, "Exit codes"): 0 all well / all clean, 1 something needs
//! attention / something was not cleaned, 2 usage error or the API could not be read.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use meshgate_agent::plugin::{self, cleanup, status};

#[derive(Parser)]
#[command(
    name = "kubectl-meshgate",
    bin_name = "kubectl meshgate",
    version,
    about = "meshgate's kubectl plugin: status and cleanup, from the API alone"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Which nodes are gated and why, the last untaint latencies, pods without redirects,
    /// evictions, whether the webhook answers, the mode.
    Status(status::Args),
    /// Remove meshgate's taint, label and condition from every Node (after uninstall).
    Cleanup(cleanup::Args),
}

fn main() -> ExitCode {
    // clap exits with 2 on usage errors, matching the table.
    match Cli::parse().command {
        Command::Status(args) => plugin::run_command("status", status::run(args)),
        Command::Cleanup(args) => plugin::run_command("cleanup", cleanup::run(args)),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }
}
