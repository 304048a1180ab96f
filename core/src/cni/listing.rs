//! The plain-data picture of a CNI config directory that the agent's reader produces.
//!
//! In: nothing (a data type). Out: what [`super::select`] reads. The reader follows
//! symlinks, caps file sizes and never opens anything but regular files, so the kinds here
//! already say why a file could not be read.

/// One entry of the config directory (or of a network's drop-in plugin directory).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    /// File name, without the directory.
    pub name: String,
    /// What the entry is, after following symlinks.
    pub kind: EntryKind,
}

/// What a directory entry turned out to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EntryKind {
    /// A regular file and its whole content.
    File(Vec<u8>),
    /// A regular file larger than the reader's cap; its content was not read.
    TooLarge { size: u64, limit: u64 },
    /// A directory with its own entries (one level deep: the CNI 1.1 drop-in plugin
    /// directory `<conf dir>/<network name>/*.conf`). Directories are never configs.
    Directory(Vec<DirEntry>),
    /// A FIFO, socket or device: never opened, because reading a FIFO blocks forever.
    NotRegular(String),
    /// The entry could not be read: a dangling symlink, a symlink loop, a permission error.
    Unreadable(String),
}

impl DirEntry {
    /// A regular file entry, for tests and fixtures.
    pub fn file(name: &str, content: impl Into<Vec<u8>>) -> Self {
        Self {
            name: name.into(),
            kind: EntryKind::File(content.into()),
        }
    }

    /// A directory entry, for tests and fixtures.
    pub fn dir(name: &str, entries: Vec<DirEntry>) -> Self {
        Self {
            name: name.into(),
            kind: EntryKind::Directory(entries),
        }
    }
}

/// The extensions a runtime loads from the config directory (libcni `ConfFiles`, as
/// containerd's go-cni and CRI-O call it).
pub const CONFIG_EXTENSIONS: [&str; 3] = [".conf", ".conflist", ".json"];

/// True when `name` has one of [`CONFIG_EXTENSIONS`]. Like Go's `filepath.Ext`, only the
/// last extension counts, so `a.conf.bak` and `a.conflist~` are ignored.
pub fn is_config_name(name: &str) -> bool {
    match name.rfind('.') {
        Some(i) => CONFIG_EXTENSIONS.contains(&&name[i..]),
        None => false,
    }
}
