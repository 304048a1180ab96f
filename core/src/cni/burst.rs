//! Whether a burst of file events in the CNI directories can be verified at once, or must be
//! waited out.
//!
//! In: each event of the burst as a [`Change`] on a path (the agent maps inotify's kinds, as
//! the `notify` crate reports them, onto it). Out: [`Burst::settled`]: true when the burst
//! only made atomic changes, so a verification now reads what the writer meant; and
//! [`Burst::writing`]: true while a file is still open for writing, so going quiet is not the
//! end of it either.
//!
//! - A rename into place (`Modify(Name(To))`), a removal, a chmod, a new directory or a new
//!   non-regular entry (a socket, a symlink) is atomic: a reader sees the old state or the new
//!   one, never half of it. So is the whole of an atomic write: a temporary file written,
//!   closed and renamed over the config (how Istio's and Linkerd's installers write).
//! - A file created or written in place (`Create(File)`, `Modify(Data)`: the truncate and
//!   each write of an in-place rewrite) is not: a writer may close it and open it again
//!   (`echo a > f; echo b >> f`), so even after its `Access(Close(Write))` only quiet (the
//!   agent's `--coalesce`) ends the burst, unless the file was renamed away or removed.
//! - An event that says nothing about a path (a queue overflow, a rescan, an unknown kind)
//!   means the burst can only end by going quiet.
//!
//! The caller still bounds the burst (the agent's `COALESCE_LIMIT`), so a writer that keeps a
//! file open for ever cannot hold the node: this only decides when waiting is pointless.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Files written in place tracked per burst; past this the burst waits to go quiet.
pub const MAX_WRITTEN_TRACKED: usize = 256;

/// What one file event says about its path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// A regular file was created (`Create(File)`): writes may follow until its close.
    Created,
    /// Something complete appeared: a directory, a socket, a symlink.
    CreatedComplete,
    /// Data was written or truncated in place (`Modify(Data)`).
    Written,
    /// A writer closed the file (`Access(Close(Write))`): its writes are done.
    ClosedWrite,
    /// Renamed into this path (`Modify(Name(To))`, or the destination of `Name(Both)`).
    MovedIn,
    /// Renamed away from this path (`Modify(Name(From))`).
    MovedOut,
    /// Removed (`Remove`).
    Removed,
    /// Mode, owner or times changed (`Modify(Metadata)`, inotify's `IN_ATTRIB`).
    Attrib,
    /// Anything else, or an event without a path: only quiet ends the burst.
    Unknown,
}

/// The files of one burst written in place, and those still open for writing.
#[derive(Debug, Default)]
pub struct Burst {
    /// Written (or created) in place during the burst, and still at that name.
    written: HashSet<PathBuf>,
    /// Of those, the ones whose writer has not closed them yet.
    open: HashSet<PathBuf>,
    /// An event the burst can only outwait.
    unknown: bool,
}

impl Burst {
    /// An empty burst (settled).
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes one event; `path` is `None` for an event without one.
    pub fn note(&mut self, path: Option<&Path>, change: Change) {
        let Some(path) = path else {
            self.unknown = true;
            return;
        };
        match change {
            Change::Created | Change::Written => {
                if self.written.len() >= MAX_WRITTEN_TRACKED {
                    self.unknown = true;
                } else {
                    self.written.insert(path.to_path_buf());
                    self.open.insert(path.to_path_buf());
                }
            }
            // The writer is done with it for now; it may open it again.
            Change::ClosedWrite => {
                self.open.remove(path);
            }
            // Gone from this name (a temporary file renamed over the config, or removed):
            // what it held is judged at its new name, whose event is atomic.
            Change::MovedOut | Change::Removed => {
                self.open.remove(path);
                self.written.remove(path);
            }
            // A file renamed into place carries the data it was written with; a writer that
            // still holds it open writes to the new name, which its events will report.
            Change::MovedIn | Change::CreatedComplete | Change::Attrib => {}
            Change::Unknown => self.unknown = true,
        }
    }

    /// True when the burst made only atomic changes: verify now.
    pub fn settled(&self) -> bool {
        !self.unknown && self.written.is_empty()
    }

    /// True while a file written in the burst is still open for writing: going quiet does
    /// not end the burst yet (the caller's bound still does).
    pub fn writing(&self) -> bool {
        !self.open.is_empty()
    }
}

/// Whether a whole sequence of events leaves the directories complete (see [`Burst`]).
pub fn settles<'a>(events: impl IntoIterator<Item = (Option<&'a Path>, Change)>) -> bool {
    let mut b = Burst::new();
    for (path, change) in events {
        b.note(path, change);
    }
    b.settled()
}

#[cfg(test)]
mod tests;
