//! Watches the CNI config and bin directories (and the node proxy's socket directory) with
//! inotify, or by polling them, and reports "something changed".
//!
//! In: the directories to watch and the [`Options`] (`--fs-watch`, `--fs-poll-interval`, the
//! `meshgate_fs_watch_polling` gauge). Out: an [`FsEvent`] on a channel for every relevant change
//! (when, which path, what it says: `meshgate_core::cni::burst::Change`), which the verifier
//! coalesces into one re-verification; and, on the inotify thread, each path created, closed
//! after writing, renamed into place or chmod'ed, to a [`Notice`] hook (the pre-prober, which
//! keeps only binaries directly in a bin dir).
//!
//! - The config dir is watched recursively, so CNI 1.1 drop-in plugin directories count.
//! - A directory that does not exist yet (a primary CNI not installed) is waited for by
//!   watching its nearest existing ancestor; [`FsWatch::ensure`] moves the watch onto the
//!   directory once it appears, and back to an ancestor if it is removed.
//! - A Multus `clusterNetwork` file outside the config dir (the verdict names it) is
//!   followed too: its directory is watched, so editing the delegate re-verifies at once.
//! - Open events are dropped: the verifier opens configs and runs plugin binaries itself, and
//!   must not wake itself up.
//! - Without inotify (the host's `fs.inotify.max_user_instances` or `max_user_watches`
//!   reached, at start or at any later watch) `--fs-watch=auto` polls the same directories
//!   instead (`meshgate_core::cni::watch_backend` decides; [`backend`] maps what a poll
//!   sees), warns once and sets the gauge to 1: a node must not go unwatched because other
//!   processes on it hold the user's inotify instances. It does not go back to inotify.

mod backend;

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use meshgate_core::cni::burst::Change;
use meshgate_core::cni::watch_backend::{self, Backend, Mode};
use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind, RenameMode};
use notify::{Event, EventKind, RecursiveMode};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::mpsc;

use backend::{Sink, Watchers, failure_of};

/// One relevant change in the watched directories.
#[derive(Clone, Debug)]
pub struct FsEvent {
    /// When it was seen.
    pub at: Instant,
    /// The path it is about; `None` for an inotify error or an overflow.
    pub path: Option<PathBuf>,
    /// What it says about the path.
    pub change: Change,
}

/// Called on the inotify thread with each path that may be a new or changed binary; must
/// not block.
pub type Notice = Arc<dyn Fn(&Path) + Send + Sync>;

struct Target {
    dir: PathBuf,
    mode: RecursiveMode,
    /// What is actually watched now: the dir itself, an ancestor, or nothing.
    watching: Option<PathBuf>,
}

/// How the directories are watched.
#[derive(Clone, Debug)]
pub struct Options {
    /// `--fs-watch`.
    pub mode: Mode,
    /// `--fs-poll-interval`: how often a poller scans.
    pub poll_interval: Duration,
    /// `meshgate_fs_watch_polling`: 1 while the directories are polled.
    pub polling: Gauge,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            mode: Mode::Auto,
            poll_interval: Duration::from_secs(1),
            polling: Gauge::default(),
        }
    }
}

/// The live watches.
pub struct FsWatch {
    watchers: Watchers,
    /// Where the watchers' events go; a poller opened later sends there too.
    sink: Sink,
    options: Options,
    targets: Vec<Target>,
    /// How many of `targets` are the fixed ones (config dir, bin dirs); a followed delegate
    /// directory comes after them.
    fixed: usize,
}

/// True for events that can change the verdict.
fn relevant(event: &Event, dirs: &[PathBuf]) -> bool {
    match event.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => {}
        EventKind::Access(_) => return false,
        _ => {}
    }
    // Events from an ancestor watch matter only on the way to a watched dir; events without
    // paths (queue overflow, rescan) always matter.
    event.paths.is_empty()
        || event
            .paths
            .iter()
            .any(|p| dirs.iter().any(|d| p.starts_with(d) || d.starts_with(p)))
}

/// What an inotify event (as `notify` reports it) says, and about which path: for a rename
/// with both ends known (`Name(Both)`), the destination.
fn change_of(event: &Event) -> (Option<PathBuf>, Change) {
    let path = event.paths.last().cloned();
    let change = match event.kind {
        EventKind::Create(CreateKind::Folder) => Change::CreatedComplete,
        // A socket or a symlink is whole when it appears; a regular file may be written next.
        EventKind::Create(_) => match path.as_deref().map(std::fs::symlink_metadata) {
            Some(Ok(m)) if !m.file_type().is_file() => Change::CreatedComplete,
            _ => Change::Created,
        },
        EventKind::Modify(ModifyKind::Data(_)) => Change::Written,
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => Change::ClosedWrite,
        EventKind::Modify(ModifyKind::Name(RenameMode::To | RenameMode::Both)) => Change::MovedIn,
        EventKind::Modify(ModifyKind::Name(RenameMode::From)) => Change::MovedOut,
        EventKind::Modify(ModifyKind::Metadata(_)) => Change::Attrib,
        EventKind::Remove(_) => Change::Removed,
        _ => Change::Unknown,
    };
    (path, change)
}

/// Hands `path` to the pre-prober when the change may have left a new or changed binary.
fn notice_binary(notice: &Notice, path: Option<&Path>, change: Change) {
    if let Some(p) = path
        && matches!(
            change,
            Change::Created | Change::ClosedWrite | Change::MovedIn | Change::Attrib
        )
    {
        notice(p);
    }
}

/// inotify, or pollers when `--fs-watch` says so or, under `auto`, when the host's inotify
/// instances are spent.
fn open(sink: &Sink, options: &Options) -> notify::Result<Watchers> {
    if watch_backend::choose(options.mode, None) == Some(Backend::Poll) {
        tracing::info!(interval = ?options.poll_interval, "polling the CNI directories (--fs-watch=poll)");
        return Watchers::poll(sink, options.poll_interval);
    }
    match Watchers::inotify(sink) {
        Ok(w) => Ok(w),
        Err(e)
            if watch_backend::choose(options.mode, Some(failure_of(&e))) == Some(Backend::Poll) =>
        {
            warn_polling(&e, options.poll_interval);
            Watchers::poll(sink, options.poll_interval)
        }
        Err(e) => Err(e),
    }
}

/// The one warning of a fall-back to polling (it happens at most once per agent).
fn warn_polling(e: &notify::Error, interval: Duration) {
    tracing::warn!(
        error = %e,
        interval = ?interval,
        "inotify unavailable (the host's fs.inotify limits reached?); polling the CNI directories instead"
    );
}

impl FsWatch {
    /// Starts watching `conf_dir` (recursively) and `bin_dirs` (flat: the plugin dirs, and any
    /// other directory the verdict reads, such as the node proxy's socket directory); changes
    /// are sent on `tx`.
    pub fn start(
        conf_dir: &Path,
        bin_dirs: &[PathBuf],
        tx: mpsc::UnboundedSender<FsEvent>,
        notice: Notice,
        options: Options,
    ) -> notify::Result<Self> {
        let dirs: Arc<RwLock<Vec<PathBuf>>> = Arc::new(RwLock::new(
            std::iter::once(conf_dir.to_path_buf())
                .chain(bin_dirs.iter().cloned())
                .collect(),
        ));
        let sink = Sink { dirs, tx, notice };
        let watchers = open(&sink, &options)?;
        options
            .polling
            .set(i64::from(watchers.backend() == Backend::Poll));
        let mut targets = vec![Target {
            dir: conf_dir.to_path_buf(),
            mode: RecursiveMode::Recursive,
            watching: None,
        }];
        targets.extend(bin_dirs.iter().map(|d| Target {
            dir: d.clone(),
            mode: RecursiveMode::NonRecursive,
            watching: None,
        }));
        let fixed = targets.len();
        let mut w = Self {
            watchers,
            sink,
            options,
            targets,
            fixed,
        };
        w.ensure();
        Ok(w)
    }

    /// Follows the directory of the delegate file the last verdict read (a Multus
    /// `clusterNetwork` path), unless the recursive config-dir watch already covers it;
    /// `None` stops following. Cheap when it did not change.
    pub fn follow_delegate(&mut self, file: Option<&Path>) {
        let conf_dir = self.targets[0].dir.clone();
        let want = file
            .and_then(Path::parent)
            .filter(|d| !d.starts_with(&conf_dir))
            .map(Path::to_path_buf);
        let have = self.targets.get(self.fixed).map(|t| t.dir.clone());
        if want == have {
            return;
        }
        if have.is_some()
            && let Some(w) = self.targets.pop().and_then(|old| old.watching)
        {
            self.watchers.unwatch(&w);
        }
        if let Ok(mut dirs) = self.sink.dirs.write() {
            dirs.truncate(self.fixed);
            dirs.extend(want.iter().cloned());
        }
        if let Some(dir) = want {
            // Recursive: Multus loads the file's drop-in plugins from a subdirectory.
            self.targets.push(Target {
                dir,
                mode: RecursiveMode::Recursive,
                watching: None,
            });
        }
        self.ensure();
    }

    /// Puts each watch on its directory if it exists now, else on its nearest existing
    /// ancestor. Cheap when nothing changed; called after every batch of events. A watch that
    /// inotify refuses for want of the host's watches moves every watch to polling (under
    /// `--fs-watch=auto`).
    pub fn ensure(&mut self) {
        if let Some(e) = self.ensure_once() {
            self.fall_back(&e);
            if let Some(e) = self.ensure_once() {
                tracing::warn!(error = %e, "cannot watch");
            }
        }
    }

    /// One round of [`FsWatch::ensure`]; the error of a watch that polling would have
    /// placed, if inotify refused one.
    fn ensure_once(&mut self) -> Option<notify::Error> {
        let backend = self.watchers.backend();
        for t in &mut self.targets {
            let want = if t.dir.is_dir() {
                Some((t.dir.clone(), t.mode))
            } else {
                t.dir
                    .ancestors()
                    .skip(1)
                    .find(|a| a.is_dir())
                    .map(|a| (a.to_path_buf(), RecursiveMode::NonRecursive))
            };
            let want_path = want.as_ref().map(|(p, _)| p.clone());
            // The inotify watch of a dir that was deleted and re-created is gone, so re-add
            // the watch whenever the dir is (again) the target, not only when it changed. A
            // poller keeps scanning the path through that; adding it again would take its
            // state as the new baseline, unreported.
            let again = backend == Backend::Inotify && want_path.as_deref() == Some(&t.dir);
            if want_path == t.watching && !again {
                continue;
            }
            if let Some(old) = t.watching.take() {
                self.watchers.unwatch(&old);
            }
            if let Some((path, mode)) = want {
                match self.watchers.watch(&path, mode) {
                    Ok(()) => t.watching = Some(path),
                    Err(e)
                        if backend == Backend::Inotify
                            && watch_backend::choose(self.options.mode, Some(failure_of(&e)))
                                == Some(Backend::Poll) =>
                    {
                        return Some(e);
                    }
                    Err(e) => {
                        tracing::warn!(dir = %t.dir.display(), watch = %path.display(), error = %e, "cannot watch")
                    }
                }
            }
        }
        None
    }

    /// Replaces inotify with pollers over the same targets after `e`, and re-verifies: what
    /// changed while a directory was unwatched is not known.
    fn fall_back(&mut self, e: &notify::Error) {
        match Watchers::poll(&self.sink, self.options.poll_interval) {
            Ok(poll) => {
                warn_polling(e, self.options.poll_interval);
                self.watchers = poll;
                self.options.polling.set(1);
                for t in &mut self.targets {
                    t.watching = None;
                }
                self.sink.unknown();
            }
            Err(pe) => tracing::warn!(error = %e, poll_error = %pe, "cannot watch, nor poll"),
        }
    }

    /// Whether the directories are polled rather than watched with inotify.
    pub fn polling(&self) -> bool {
        self.watchers.backend() == Backend::Poll
    }

    /// Whether every directory is watched directly (not through an ancestor).
    pub fn all_direct(&self) -> bool {
        self.targets
            .iter()
            .all(|t| t.watching.as_deref() == Some(t.dir.as_path()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Whether an event arrives within a second.
    fn woke(rx: &mut mpsc::UnboundedReceiver<FsEvent>) -> bool {
        for _ in 0..100 {
            if rx.try_recv().is_ok() {
                // The rest of the burst (modify, close-write) is not a second wake.
                std::thread::sleep(Duration::from_millis(200));
                while rx.try_recv().is_ok() {}
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    #[test]
    fn a_delegate_file_outside_the_conf_dir_is_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let conf = tmp.path().join("net.d");
        let other = tmp.path().join("multus/net.d");
        std::fs::create_dir_all(&conf).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        let delegate = other.join("default.conflist");
        std::fs::write(&delegate, b"{}").unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut w =
            FsWatch::start(&conf, &[], tx, Arc::new(|_: &Path| {}), Options::default()).unwrap();
        std::fs::write(&delegate, b"{ }").unwrap();
        assert!(!woke(&mut rx), "not followed yet");
        w.follow_delegate(Some(&delegate));
        std::fs::write(&delegate, b"{  }").unwrap();
        assert!(
            woke(&mut rx),
            "an edit of the followed delegate wakes the verifier"
        );
        // Still watching the config dir; a delegate inside it needs no extra watch.
        w.follow_delegate(Some(&conf.join("10-calico.conflist")));
        assert_eq!(w.targets.len(), 1);
        woke(&mut rx); // what removing the watch itself reports

        std::fs::write(&delegate, b"{}").unwrap();
        assert!(!woke(&mut rx), "no longer followed");
        std::fs::write(conf.join("10-calico.conflist"), b"{}").unwrap();
        assert!(woke(&mut rx));
    }

    #[test]
    fn polling_sees_a_rewrite_that_keeps_the_time_and_a_new_binary() {
        let tmp = tempfile::tempdir().unwrap();
        let (conf, bin) = (tmp.path().join("net.d"), tmp.path().join("bin"));
        std::fs::create_dir_all(&conf).unwrap();
        std::fs::create_dir_all(&bin).unwrap();
        let file = conf.join("10-calico.conflist");
        std::fs::write(&file, b"{}").unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let seen = Arc::new(std::sync::Mutex::new(Vec::<PathBuf>::new()));
        let noticed = seen.clone();
        let notice: Notice = Arc::new(move |p: &Path| noticed.lock().unwrap().push(p.into()));
        let options = Options {
            mode: Mode::Poll,
            poll_interval: Duration::from_millis(100),
            polling: Gauge::default(),
        };
        let w = FsWatch::start(
            &conf,
            std::slice::from_ref(&bin),
            tx,
            notice,
            options.clone(),
        )
        .unwrap();
        assert!(w.polling());
        assert_eq!(options.polling.get(), 1, "the gauge says so");
        assert!(
            !woke(&mut rx),
            "nothing changed: the first scan reports nothing"
        );
        // Same length, same modification time: only the content tells the two apart.
        let mtime = std::fs::metadata(&file).unwrap().modified().unwrap();
        std::fs::write(&file, b"[]").unwrap();
        let f = std::fs::File::options().write(true).open(&file).unwrap();
        f.set_modified(mtime).unwrap();
        let e = first(&mut rx).expect("a rewrite of the config wakes the verifier");
        assert_eq!(
            e.change,
            Change::Unknown,
            "a poll cannot tell a write is complete"
        );
        assert_eq!(e.path.as_deref(), Some(file.as_path()));
        woke(&mut rx);
        std::fs::write(bin.join("linkerd-cni"), b"#!/bin/sh\n").unwrap();
        assert!(woke(&mut rx), "a new binary wakes the verifier");
        assert!(
            seen.lock().unwrap().contains(&bin.join("linkerd-cni")),
            "and is pre-probed"
        );
    }

    /// The first event within a second.
    fn first(rx: &mut mpsc::UnboundedReceiver<FsEvent>) -> Option<FsEvent> {
        for _ in 0..100 {
            if let Ok(e) = rx.try_recv() {
                return Some(e);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    #[test]
    fn inotify_mode_does_not_poll() {
        let tmp = tempfile::tempdir().unwrap();
        let (tx, _rx) = mpsc::unbounded_channel();
        let options = Options {
            mode: Mode::Inotify,
            ..Options::default()
        };
        let w = FsWatch::start(
            tmp.path(),
            &[],
            tx,
            Arc::new(|_: &Path| {}),
            options.clone(),
        )
        .unwrap();
        assert!(!w.polling());
        assert_eq!(options.polling.get(), 0);
    }
}
