//! Whether a burst of file events in the CNI directories can be verified at once, or must be
//! waited out.
//!
//! In: each event of the burst as a [`Change`] on a path (the agent maps inotify's kinds, as
//! the `notify` crate reports them, onto it). Out: [`Burst::settled`]: true when every file the
//! burst touched is complete on disk, so a verification now reads what the writer meant.
//!
//! - A rename into place (`Modify(Name(To))`), a removal, a chmod, a new directory or a new
//!   non-regular entry (a socket, a symlink) is atomic: a reader sees the old state or the new
//!   one, never half of it.
//! - A file created or written (`Create(File)`, `Modify(Data)`: the truncate and each write
//!   of an in-place rewrite) is incomplete until its `Access(Close(Write))`.
//! - An event that says nothing about a path (a queue overflow, a rescan, an unknown kind)
//!   means the burst can only end by going quiet.
//!
//! The caller still bounds the burst (the agent's `COALESCE_LIMIT`), so a writer that keeps a
//! file open for ever cannot hold the node: this only decides when waiting is pointless.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Files open for writing tracked per burst; past this the burst waits to go quiet.
pub const MAX_OPEN_TRACKED: usize = 256;

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

/// The files of one burst that are still being written.
#[derive(Debug, Default)]
pub struct Burst {
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
                if self.open.len() >= MAX_OPEN_TRACKED {
                    self.unknown = true;
                } else {
                    self.open.insert(path.to_path_buf());
                }
            }
            // The writer is done with it, or it is gone from this name: whatever happens to
            // it next comes with an event of its own.
            Change::ClosedWrite | Change::MovedOut | Change::Removed => {
                self.open.remove(path);
            }
            // A file renamed into place carries the data it was written with; a writer that
            // still holds it open writes to the new name, which the close will report.
            Change::MovedIn | Change::CreatedComplete | Change::Attrib => {}
            Change::Unknown => self.unknown = true,
        }
    }

    /// True when nothing in the burst is still being written: verify now.
    pub fn settled(&self) -> bool {
        !self.unknown && self.open.is_empty()
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
