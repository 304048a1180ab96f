//! What watches the directories for [`super::FsWatch`]: inotify, or two `notify`
//! `PollWatcher`s; and how each one's reports become [`FsEvent`]s.
//!
//! In: the directories whose events count and where events go ([`Sink`]), the poll
//! interval. Out: [`Watchers`], which add and remove watches, and [`failure_of`], what an
//! inotify error says about the host's limits (decided by
//! `meshgate_core::cni::watch_backend`).
//!
//! Polling compares two scans, so it reports a state, not an operation: no close after
//! writing, no rename. Every change it sees is `Change::Unknown`, which a burst only ends
//! by going quiet; a file caught half-written by one scan is seen changed again by the next
//! and verified again. The scan compares modification times, which the `notify` poller
//! keeps in whole seconds, so the config dirs (recursive, a few small files) are also
//! compared by content: a rewrite within the same second still shows. The plugin dirs are
//! compared by time only: hashing tens of MiB of binaries every interval would cost more
//! than it saves; a binary replaced within the second of its previous change, or only
//! chmod'ed, is seen at the next resync.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use meshgate_core::cni::burst::Change;
use meshgate_core::cni::watch_backend::{Backend, Failure};
use notify::event::{EventKind, ModifyKind, RenameMode};
use notify::{Event, PollWatcher, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;

use super::{FsEvent, Notice, change_of, notice_binary, relevant};

/// Where a watcher's events go, shared by every watcher the [`super::FsWatch`] opens.
#[derive(Clone)]
pub(super) struct Sink {
    /// The directories whose events count.
    pub dirs: Arc<RwLock<Vec<PathBuf>>>,
    pub tx: mpsc::UnboundedSender<FsEvent>,
    pub notice: Notice,
}

impl Sink {
    /// Sends a change that says nothing about a path: re-verify once quiet.
    pub fn unknown(&self) {
        let _ = self.tx.send(FsEvent {
            at: Instant::now(),
            path: None,
            change: Change::Unknown,
        });
    }

    fn counts(&self, event: &Event) -> bool {
        // A poisoned lock (a panic elsewhere) counts every event: re-verifying is safe.
        self.dirs.read().map_or(true, |d| relevant(event, &d))
    }

    /// inotify's events, with their close-after-write and rename semantics.
    fn inotify_event(&self, event: &Event) {
        let at = Instant::now();
        // A rename reported with both ends also takes the file away from its old name
        // (a temporary file of an atomic write), whether or not `From` came alone.
        if let (EventKind::Modify(ModifyKind::Name(RenameMode::Both)), [from, _]) =
            (event.kind, event.paths.as_slice())
        {
            let path = Some(from.clone());
            let _ = self.tx.send(FsEvent {
                at,
                path,
                change: Change::MovedOut,
            });
        }
        let (path, change) = change_of(event);
        notice_binary(&self.notice, path.as_deref(), change);
        let _ = self.tx.send(FsEvent { at, path, change });
    }

    /// A poll's events: a path that appeared or changed may be a new binary for the
    /// pre-prober; every one is a change of unknown kind.
    fn poll_event(&self, event: &Event) {
        let path = event.paths.last().cloned();
        if let Some(p) = path.as_deref()
            && matches!(event.kind, EventKind::Create(_) | EventKind::Modify(_))
        {
            (self.notice)(p);
        }
        let _ = self.tx.send(FsEvent {
            at: Instant::now(),
            path,
            change: Change::Unknown,
        });
    }

    /// The callback a watcher of `backend` calls with each report.
    fn handler(&self, backend: Backend) -> impl FnMut(notify::Result<Event>) + Send + 'static {
        let sink = self.clone();
        move |res| match res {
            Ok(event) if sink.counts(&event) => match backend {
                Backend::Inotify => sink.inotify_event(&event),
                Backend::Poll => sink.poll_event(&event),
            },
            Ok(_) => {}
            Err(e) => {
                // An error may hide a change (an inotify queue overflow; a scan that could
                // not read a path): re-verify, once the directories have gone quiet. A
                // poller repeats its error every scan, hence only a debug line for it.
                match backend {
                    Backend::Inotify => tracing::warn!(error = %e, "inotify error; re-verifying"),
                    Backend::Poll => tracing::debug!(error = %e, "poll error; re-verifying"),
                }
                sink.unknown();
            }
        }
    }
}

/// The watcher(s) in use.
pub(super) enum Watchers {
    Inotify(RecommendedWatcher),
    /// `contents` watches the recursive targets (config dirs: small files, compared by
    /// content too), `times` the flat ones (plugin and socket dirs, and ancestors).
    Poll {
        contents: PollWatcher,
        times: PollWatcher,
    },
}

impl Watchers {
    /// One inotify instance.
    pub fn inotify(sink: &Sink) -> notify::Result<Self> {
        notify::recommended_watcher(sink.handler(Backend::Inotify)).map(Self::Inotify)
    }

    /// Two pollers scanning every `interval`.
    pub fn poll(sink: &Sink, interval: Duration) -> notify::Result<Self> {
        let config = notify::Config::default().with_poll_interval(interval);
        Ok(Self::Poll {
            contents: PollWatcher::new(
                sink.handler(Backend::Poll),
                config.with_compare_contents(true),
            )?,
            times: PollWatcher::new(sink.handler(Backend::Poll), config)?,
        })
    }

    pub fn backend(&self) -> Backend {
        match self {
            Self::Inotify(_) => Backend::Inotify,
            Self::Poll { .. } => Backend::Poll,
        }
    }

    pub fn watch(&mut self, path: &Path, mode: RecursiveMode) -> notify::Result<()> {
        match self {
            Self::Inotify(w) => w.watch(path, mode),
            Self::Poll { contents, .. } if mode == RecursiveMode::Recursive => {
                contents.watch(path, mode)
            }
            Self::Poll { times, .. } => times.watch(path, mode),
        }
    }

    pub fn unwatch(&mut self, path: &Path) {
        match self {
            Self::Inotify(w) => {
                let _ = w.unwatch(path);
            }
            // Not told which one holds it: a path is in at most one.
            Self::Poll { contents, times } => {
                let _ = contents.unwatch(path);
                let _ = times.unwatch(path);
            }
        }
    }
}

/// What an inotify error says about the host: out of instances (EMFILE, ENFILE), out of
/// watches (ENOSPC, which `notify` reports as `MaxFilesWatch`), or something else.
pub(super) fn failure_of(e: &notify::Error) -> Failure {
    match &e.kind {
        notify::ErrorKind::MaxFilesWatch => Failure::Watches,
        notify::ErrorKind::Io(io) => match io.raw_os_error() {
            Some(libc::EMFILE | libc::ENFILE) => Failure::Instances,
            Some(libc::ENOSPC) => Failure::Watches,
            _ => Failure::Other,
        },
        _ => Failure::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hosts_inotify_limits_are_told_from_other_errors() {
        let io = |errno| notify::Error::io(std::io::Error::from_raw_os_error(errno));
        assert_eq!(failure_of(&io(libc::EMFILE)), Failure::Instances);
        assert_eq!(failure_of(&io(libc::ENFILE)), Failure::Instances);
        assert_eq!(failure_of(&io(libc::ENOSPC)), Failure::Watches);
        assert_eq!(
            failure_of(&notify::Error::new(notify::ErrorKind::MaxFilesWatch)),
            Failure::Watches
        );
        assert_eq!(failure_of(&io(libc::EACCES)), Failure::Other);
        assert_eq!(failure_of(&notify::Error::path_not_found()), Failure::Other);
    }
}
