//! How the verifier looks at the CNI config directory: lazily, through a [`ConfSource`], so
//! it reads only what the runtime would read, in the order the runtime reads it.
//!
//! In: nothing (types and a trait). Out: what [`super::select`] consumes. The agent's
//! reader implements [`ConfSource`] over the real directory with a byte budget; tests use
//! [`MemSource`].
//!
//! Names are raw bytes everywhere (a Linux file name need not be UTF-8, and a non-UTF-8
//! name can sort first), and are only made printable, lossily, in messages ([`display`]).

use std::collections::BTreeMap;

/// One directory entry, as Go's `os.ReadDir` reports it: the name and whether the entry
/// itself (not what a symlink points at) is a directory (`DirEntry.IsDir`, from the dirent
/// type, `lstat` semantics).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dirent {
    /// The raw file name.
    pub name: Vec<u8>,
    /// True only for a real directory; a symlink to a directory is `false`.
    pub is_dir: bool,
}

/// Why the source could not list or read a path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceError {
    /// `ENOENT` (Go's `os.IsNotExist`).
    NotFound,
    /// Any other error the runtime would see too (`EISDIR` for a symlink to a directory,
    /// `ENOTDIR`, `ELOOP`, `EACCES`, ...), described without file content.
    Io(String),
    /// meshgate cannot tell what the runtime would do: the byte budget ran out, or the
    /// path is a FIFO or device the runtime would block on. Verification stops here.
    Undecidable(String),
}

impl std::fmt::Display for SourceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SourceError::NotFound => f.write_str("does not exist"),
            SourceError::Io(why) => write!(f, "cannot be read: {why}"),
            SourceError::Undecidable(why) => write!(f, "cannot be verified: {why}"),
        }
    }
}

/// Lazy access to the config directory. Paths are relative to the config directory, as raw
/// bytes joined with `/`, lexically cleaned like Go's `filepath.Join`; the empty path is the
/// config directory itself. A path may start with `../` when a network name climbs out.
pub trait ConfSource {
    /// Go's `os.ReadDir(dir)`, sorted by name. `Err(NotFound)` when it does not exist.
    fn list(&mut self, dir: &[u8]) -> Result<Vec<Dirent>, SourceError>;
    /// Go's `os.ReadFile(path)` (symlinks followed).
    fn read(&mut self, path: &[u8]) -> Result<Vec<u8>, SourceError>;
}

/// The extensions a runtime loads from the config directory (go-cni `loadFromConfDir` and
/// ocicni `loadNetworks` call libcni `ConfFiles` with these).
pub const CONFIG_EXTENSIONS: [&str; 3] = [".conf", ".conflist", ".json"];

/// Go's `filepath.Ext`: from the last `.` of the name (which never holds `/`).
pub fn ext(name: &[u8]) -> &[u8] {
    match name.iter().rposition(|&b| b == b'.') {
        Some(i) => &name[i..],
        None => &[],
    }
}

/// True when `name` has one of [`CONFIG_EXTENSIONS`]. Only the last extension counts, so
/// `a.conf.bak` and `a.conflist~` are ignored.
pub fn is_config_name(name: &[u8]) -> bool {
    CONFIG_EXTENSIONS.iter().any(|e| ext(name) == e.as_bytes())
}

/// A raw name made printable for a message: lossy UTF-8, control characters escaped.
pub fn display(name: &[u8]) -> String {
    String::from_utf8_lossy(name)
        .chars()
        .flat_map(|c| {
            if c.is_control() {
                c.escape_default().collect::<Vec<_>>()
            } else {
                vec![c]
            }
        })
        .collect()
}

/// Go's `filepath.Join(dir, name)` relative to the config directory, cleaned lexically
/// (`filepath.Clean`): `""` for the directory itself, and `..` kept at the front when the
/// name climbs out of it.
pub fn join_clean(dir: &[u8], name: &[u8]) -> Vec<u8> {
    let mut parts: Vec<&[u8]> = Vec::new();
    for part in dir.split(|&b| b == b'/').chain(name.split(|&b| b == b'/')) {
        match part {
            b"" | b"." => {}
            b".." => {
                if matches!(parts.last(), Some(p) if *p != b"..") {
                    parts.pop();
                } else {
                    parts.push(b"..");
                }
            }
            p => parts.push(p),
        }
    }
    parts.join(&b'/')
}

/// An in-memory [`ConfSource`] for tests and fuzzing: files by relative path; directories
/// are implied by the paths (plus any listed in `dirs`); `symlinked_dirs` are entries that
/// list as non-directories and fail to read with `EISDIR`, as a symlink to a directory does.
#[derive(Clone, Debug, Default)]
pub struct MemSource {
    /// Relative path → content.
    pub files: BTreeMap<Vec<u8>, Vec<u8>>,
    /// Extra (possibly empty) directories, relative.
    pub dirs: Vec<Vec<u8>>,
    /// Symlinks to directories, relative, and the directory they point at.
    pub symlinked_dirs: BTreeMap<Vec<u8>, Vec<u8>>,
    /// Paths whose read fails with this error.
    pub failing: BTreeMap<Vec<u8>, SourceError>,
    /// Every path read, in order (what the runtime would have read).
    pub reads: Vec<Vec<u8>>,
}

impl MemSource {
    /// An empty directory.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a file at a relative path.
    pub fn file(mut self, path: impl AsRef<[u8]>, content: impl Into<Vec<u8>>) -> Self {
        self.files.insert(path.as_ref().to_vec(), content.into());
        self
    }

    /// Adds an (empty) directory.
    pub fn dir(mut self, path: impl AsRef<[u8]>) -> Self {
        self.dirs.push(path.as_ref().to_vec());
        self
    }

    /// Adds a symlink to a directory.
    pub fn symlink_dir(mut self, path: impl AsRef<[u8]>, target: impl AsRef<[u8]>) -> Self {
        self.symlinked_dirs
            .insert(path.as_ref().to_vec(), target.as_ref().to_vec());
        self
    }

    /// Makes reading `path` fail.
    pub fn failing(mut self, path: impl AsRef<[u8]>, e: SourceError) -> Self {
        self.failing.insert(path.as_ref().to_vec(), e);
        self
    }

    fn resolve(&self, dir: &[u8]) -> Vec<u8> {
        match self.symlinked_dirs.get(dir) {
            Some(t) => t.clone(),
            None => dir.to_vec(),
        }
    }

    fn is_dir(&self, dir: &[u8]) -> bool {
        dir.is_empty()
            || self.dirs.iter().any(|d| d == dir)
            || self
                .files
                .keys()
                .chain(self.dirs.iter())
                .chain(self.symlinked_dirs.keys())
                .any(|p| p.len() > dir.len() && p.starts_with(dir) && p[dir.len()] == b'/')
    }
}

impl ConfSource for MemSource {
    fn list(&mut self, dir: &[u8]) -> Result<Vec<Dirent>, SourceError> {
        let dir = self.resolve(dir);
        if self.files.contains_key(&dir) {
            return Err(SourceError::Io("not a directory".into()));
        }
        if !self.is_dir(&dir) {
            return Err(SourceError::NotFound);
        }
        let prefix: Vec<u8> = if dir.is_empty() {
            Vec::new()
        } else {
            [dir.as_slice(), b"/"].concat()
        };
        let mut out: BTreeMap<Vec<u8>, bool> = BTreeMap::new();
        for p in self
            .files
            .keys()
            .chain(self.dirs.iter())
            .chain(self.symlinked_dirs.keys())
        {
            if let Some(rest) = p.strip_prefix(prefix.as_slice()) {
                if rest.is_empty() {
                    continue;
                }
                let (name, deeper) = match rest.iter().position(|&b| b == b'/') {
                    Some(i) => (&rest[..i], true),
                    None => (rest, false),
                };
                let full = [prefix.as_slice(), name].concat();
                let is_dir = deeper || self.dirs.contains(&full);
                let is_dir = is_dir && !self.symlinked_dirs.contains_key(&full);
                out.insert(name.to_vec(), is_dir);
            }
        }
        Ok(out
            .into_iter()
            .map(|(name, is_dir)| Dirent { name, is_dir })
            .collect())
    }

    fn read(&mut self, path: &[u8]) -> Result<Vec<u8>, SourceError> {
        self.reads.push(path.to_vec());
        if let Some(e) = self.failing.get(path) {
            return Err(e.clone());
        }
        if self.symlinked_dirs.contains_key(path) || self.is_dir(path) {
            return Err(SourceError::Io("is a directory".into()));
        }
        self.files.get(path).cloned().ok_or(SourceError::NotFound)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_clean_is_go_filepath_join() {
        assert_eq!(join_clean(b"", b""), b"");
        assert_eq!(join_clean(b"", b"net"), b"net");
        assert_eq!(join_clean(b"", b"/etc"), b"etc");
        assert_eq!(join_clean(b"", b"a/../../x"), b"../x");
        assert_eq!(join_clean(b"net", b"50.conf"), b"net/50.conf");
        assert_eq!(join_clean(b"", b"."), b"");
    }

    #[test]
    fn extensions_are_go_filepath_ext() {
        assert!(is_config_name(b".conf"));
        assert!(is_config_name(b"\xff.conflist"));
        assert!(!is_config_name(b"a.conf.bak"));
        assert!(!is_config_name(b"conf"));
    }
}
