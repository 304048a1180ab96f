//! Which way the agent watches the CNI directories: inotify, or polling them.
//!
//! In: the operator's choice (`--fs-watch`: [`Mode`]) and, when inotify was tried, why it
//! failed ([`Failure`]). Out: the [`Backend`] to use, or `None` when the caller must give
//! up inotify without a replacement (fail at start, or warn and keep the watches it has).
//!
//! - inotify's resources are per user and shared by every process of that user on the host
//!   (`fs.inotify.max_user_instances`, 128 by default; `max_user_watches`): a busy node
//!   (many containers, editors, other agents) can exhaust them, and an agent that then
//!   failed to start, or started blind, would leave the node gated or unwatched for good.
//!   `auto` falls back to polling the same directories for exactly those failures.
//! - A failure about one path (permission denied, not found) is not one polling cures: the
//!   poller could not read the path either, so it is not a reason to switch.
//! - `inotify` keeps today's strict behaviour for operators who would rather the agent fail
//!   than poll; `poll` never touches inotify.

use std::fmt;
use std::str::FromStr;

/// `--fs-watch`: how the agent watches the CNI directories.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// inotify, falling back to polling when the host's inotify limits are reached.
    #[default]
    Auto,
    /// inotify only: the agent fails to start without it.
    Inotify,
    /// Poll the directories every `--fs-poll-interval`, without inotify.
    Poll,
}

/// Why inotify could not be had.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// No inotify instance: `inotify_init1` failed with EMFILE or ENFILE (the user's
    /// `fs.inotify.max_user_instances`, or the process's or the system's file limit).
    Instances,
    /// No watch: `inotify_add_watch` failed with ENOSPC (`fs.inotify.max_user_watches`).
    Watches,
    /// Anything else, such as a path that cannot be read.
    Other,
}

/// What watches the directories.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// inotify: an event per change, with close-after-write semantics.
    Inotify,
    /// A scan of the directories every poll interval, comparing what it sees.
    Poll,
}

/// The backend to use under `mode`, given inotify's `failure` (`None`: inotify works, or was
/// not tried). `None` when there is none: `inotify` mode without inotify, or a failure that
/// polling does not cure.
pub fn choose(mode: Mode, failure: Option<Failure>) -> Option<Backend> {
    match (mode, failure) {
        (Mode::Poll, _) => Some(Backend::Poll),
        (Mode::Auto | Mode::Inotify, None) => Some(Backend::Inotify),
        (Mode::Auto, Some(Failure::Instances | Failure::Watches)) => Some(Backend::Poll),
        (Mode::Auto, Some(Failure::Other)) | (Mode::Inotify, Some(_)) => None,
    }
}

/// `--fs-watch` was none of `auto`, `inotify`, `poll`.
#[derive(Debug, thiserror::Error)]
#[error("unknown watch mode {0:?}: expected auto, inotify or poll")]
pub struct UnknownMode(String);

impl FromStr for Mode {
    type Err = UnknownMode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "inotify" => Ok(Self::Inotify),
            "poll" => Ok(Self::Poll),
            other => Err(UnknownMode(other.to_owned())),
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Inotify => "inotify",
            Self::Poll => "poll",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_falls_back_to_polling_only_when_the_hosts_inotify_limits_are_reached() {
        assert_eq!(choose(Mode::Auto, None), Some(Backend::Inotify));
        assert_eq!(
            choose(Mode::Auto, Some(Failure::Instances)),
            Some(Backend::Poll)
        );
        assert_eq!(
            choose(Mode::Auto, Some(Failure::Watches)),
            Some(Backend::Poll)
        );
        assert_eq!(choose(Mode::Auto, Some(Failure::Other)), None);
    }

    #[test]
    fn inotify_mode_never_polls_and_poll_mode_never_uses_inotify() {
        assert_eq!(choose(Mode::Inotify, None), Some(Backend::Inotify));
        for f in [Failure::Instances, Failure::Watches, Failure::Other] {
            assert_eq!(choose(Mode::Inotify, Some(f)), None);
            assert_eq!(choose(Mode::Poll, Some(f)), Some(Backend::Poll));
        }
        assert_eq!(choose(Mode::Poll, None), Some(Backend::Poll));
    }

    #[test]
    fn modes_parse_and_print_as_the_flag_spells_them() {
        for m in [Mode::Auto, Mode::Inotify, Mode::Poll] {
            assert_eq!(m.to_string().parse::<Mode>().unwrap(), m);
        }
        assert!("inotify,poll".parse::<Mode>().is_err());
        assert_eq!(Mode::default(), Mode::Auto);
    }
}
