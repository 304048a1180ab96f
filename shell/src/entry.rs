//! The one way a meshgate daemon starts and ends: logging, the async runtime, and the exit
//! code.
//!
//! In: the `--log-format` flag, the runtime's size and the daemon's future (the allocator's
//! bounds, [`crate::alloc::bound`], are set first). Out: the process
//! exit code, from the one table in [`Exit`] (docs/operations.md, "Exit codes"), which the
//! one-shot `check` and `inspect` follow too.

use std::future::Future;
use std::process::ExitCode;

use crate::logging::{self, LogFormat};

/// meshgate's exit codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// 0: the daemon stopped cleanly; `check` verified, `inspect` found the redirects.
    Success = 0,
    /// 1: the daemon stopped on an error; `check` did not verify, `inspect` found the
    /// redirects missing.
    Failed = 1,
    /// 2: a usage error (clap exits with 2 itself), or the process could not do its I/O (the
    /// async runtime could not start; `check` or `inspect` could not read what it checks).
    UsageOrIo = 2,
}

impl From<Exit> for ExitCode {
    fn from(e: Exit) -> Self {
        ExitCode::from(e as u8)
    }
}

/// How a daemon's process is set up.
#[derive(Clone, Copy, Debug)]
pub struct Process {
    /// The binary's name, for the final error line.
    pub name: &'static str,
    /// `--log-format`.
    pub log_format: LogFormat,
    /// Worker threads of the runtime; `None`: one per CPU.
    pub worker_threads: Option<usize>,
}

/// Sets up logging, builds the runtime and runs `daemon` on it to the end: [`Exit::Success`]
/// when it returns `Ok`, [`Exit::Failed`] (with the error chain logged) when it returns an
/// error (a drain cut by a further stop signal among them: `shutdown::Aborted`),
/// [`Exit::UsageOrIo`] when the runtime cannot be built.
pub fn run(process: Process, daemon: impl Future<Output = anyhow::Result<()>>) -> ExitCode {
    // Before the runtime's threads: glibc reads the arena bound when a thread first allocates.
    crate::alloc::bound();
    logging::init(process.log_format);
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = process.worker_threads {
        builder.worker_threads(n);
    }
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the async runtime");
            return Exit::UsageOrIo.into();
        }
    };
    match rt.block_on(daemon) {
        Ok(()) => Exit::Success.into(),
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "{} stopped", process.name);
            // Ends now: blocking work still running (a DNS lookup, a plugin probe) is not
            // waited for, so a daemon whose drain was cut by a further signal exits at once.
            rt.shutdown_background();
            Exit::Failed.into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process() -> Process {
        Process {
            name: "test",
            log_format: LogFormat::Text,
            worker_threads: Some(1),
        }
    }

    #[test]
    fn a_daemon_result_maps_to_the_table() {
        assert_eq!(run(process(), async { Ok(()) }), ExitCode::SUCCESS);
        assert_eq!(
            run(process(), async { Err(anyhow::anyhow!("broken")) }),
            ExitCode::from(1)
        );
        // The runtime is a real one: the daemon can use timers and I/O.
        let timed = async {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            Ok(())
        };
        assert_eq!(run(process(), timed), ExitCode::SUCCESS);
    }
}
