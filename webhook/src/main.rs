//! `meshgate-webhook`: parses the command line, sets up logging and hands off to
//! [`meshgate_webhook::run`]. Exit code 0 after a clean shutdown, 1 on a startup or runtime
//! error, 2 on a usage error (clap).

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = meshgate_webhook::Args::parse();
    meshgate_shell::logging::init(args.log_format);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(meshgate_webhook::run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "meshgate-webhook failed");
            ExitCode::FAILURE
        }
    }
}
