//! Reads the CNI config directory lazily for `meshgate_core::cni::verify`, the way Go's
//! `os.ReadDir` / `os.ReadFile` would, within a byte budget.
//!
//! In: the config directory, a per-file cap and a per-verification byte budget. Out: a
//! [`Reader`] implementing `ConfSource`: listings carry raw names and the dirent's own type
//! (a symlink is never followed to decide "directory", as libcni's `ConfFiles` does not),
//! and files are read only when the selection asks for them, in the runtime's order. So a
//! directory of symlinked directories or of hard links to a large file costs one file read,
//! not all of them.
//!
//! - Files are opened `O_NONBLOCK` and checked with `fstat`: a FIFO or device (which Go
//!   would block on or read forever) is never read and makes the verdict undecidable; a
//!   directory reached through a symlink fails like Go's `EISDIR`.
//! - Every byte of every name listed and file read is charged to the budget; past it, or
//!   past the per-file cap, verification stops as undecidable (never a skip: the runtime
//!   would load a large file, so skipping it could verify the wrong one).

use std::ffi::OsStr;
use std::fs::{self, OpenOptions};
use std::io::{self, Read};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

use meshgate_core::cni::{ConfSource, Dirent, SourceError};

/// Default cap on one config file: real conflists are a few KiB.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 1 << 20;

/// Default byte budget for one verification (names listed plus files read).
pub const DEFAULT_BUDGET_BYTES: u64 = 8 << 20;

/// What one name costs besides its bytes (the `Dirent` itself).
const NAME_OVERHEAD: u64 = 32;

/// A budgeted, lazy view of one config directory for one verification.
#[derive(Debug)]
pub struct Reader {
    conf_dir: PathBuf,
    max_file_bytes: u64,
    budget: u64,
    used: u64,
}

impl Reader {
    /// A reader of `conf_dir` with a per-file cap and a total budget.
    pub fn new(conf_dir: &Path, max_file_bytes: u64, budget: u64) -> Self {
        Self {
            conf_dir: conf_dir.to_path_buf(),
            max_file_bytes,
            budget,
            used: 0,
        }
    }

    /// Bytes charged so far (names and file contents).
    pub fn bytes_used(&self) -> u64 {
        self.used
    }

    /// Takes `n` bytes from the budget, or refuses (leaving it untouched) when they do not fit.
    fn charge(&mut self, n: u64) -> Result<(), SourceError> {
        let after = self.used.saturating_add(n);
        if after <= self.budget {
            self.used = after;
            return Ok(());
        }
        Err(SourceError::Undecidable(format!(
            "reading it would exceed the {}-byte budget for one verification",
            self.budget
        )))
    }

    /// Go's `filepath.Join(confDir, rel)`: joined and cleaned lexically, so `..` in a
    /// network name climbs the path as written, not through symlinks.
    fn resolve(&self, rel: &[u8]) -> PathBuf {
        let mut out: Vec<Component<'_>> = Vec::new();
        let rel = Path::new(OsStr::from_bytes(rel));
        for c in self.conf_dir.components().chain(rel.components()) {
            match c {
                Component::CurDir => {}
                Component::ParentDir => match out.last() {
                    Some(Component::Normal(_)) => {
                        out.pop();
                    }
                    Some(Component::RootDir) => {}
                    _ => out.push(c),
                },
                // A rooted name joins like any other (filepath.Join drops the separator).
                Component::RootDir if !out.is_empty() => {}
                other => out.push(other),
            }
        }
        if out.is_empty() {
            return PathBuf::from(".");
        }
        out.iter().collect()
    }
}

fn io_error(e: &io::Error) -> SourceError {
    if e.kind() == io::ErrorKind::NotFound {
        SourceError::NotFound
    } else {
        SourceError::Io(e.to_string())
    }
}

impl ConfSource for Reader {
    fn list(&mut self, dir: &[u8]) -> Result<Vec<Dirent>, SourceError> {
        let path = self.resolve(dir);
        let listing = fs::read_dir(&path).map_err(|e| io_error(&e))?;
        let mut out = Vec::new();
        for entry in listing {
            let entry = entry.map_err(|e| io_error(&e))?;
            let name = entry.file_name().into_vec();
            self.charge(name.len() as u64 + NAME_OVERHEAD)?;
            // The dirent type (lstat semantics when the filesystem does not report one),
            // exactly Go's DirEntry.IsDir: a symlink to a directory is not a directory.
            let is_dir = entry.file_type().map_err(|e| io_error(&e))?.is_dir();
            out.push(Dirent { name, is_dir });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    fn read(&mut self, rel: &[u8]) -> Result<Vec<u8>, SourceError> {
        let path = self.resolve(rel);
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| io_error(&e))?;
        let meta = file.metadata().map_err(|e| io_error(&e))?;
        let t = meta.file_type();
        if t.is_dir() {
            return Err(SourceError::Io("is a directory".into()));
        }
        if t.is_fifo() || t.is_char_device() || t.is_block_device() || t.is_socket() {
            return Err(SourceError::Undecidable(
                "it is a FIFO or device, which the runtime would block on or read forever".into(),
            ));
        }
        if meta.len() > self.max_file_bytes {
            return Err(SourceError::Undecidable(format!(
                "it is {} bytes, over the {}-byte limit for one CNI config file",
                meta.len(),
                self.max_file_bytes
            )));
        }
        self.charge(meta.len())?;
        let mut buf = Vec::with_capacity(meta.len() as usize);
        file.take(self.max_file_bytes + 1)
            .read_to_end(&mut buf)
            .map_err(|e| io_error(&e))?;
        if buf.len() as u64 > self.max_file_bytes {
            return Err(SourceError::Undecidable(format!(
                "it grew past the {}-byte limit for one CNI config file while being read",
                self.max_file_bytes
            )));
        }
        // Charge what really came in beyond the stat size (a file growing while read).
        self.charge((buf.len() as u64).saturating_sub(meta.len()))?;
        Ok(buf)
    }
}

/// Lists `dir` only to tell "cannot be listed" (an I/O error for the caller) from "missing"
/// (no config yet, as for the runtime).
pub fn check_listable(dir: &Path) -> io::Result<()> {
    match fs::read_dir(dir) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn lists_raw_names_and_dirent_types_without_following_links() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::write(d.join("10-a.conflist"), b"{}").unwrap();
        fs::create_dir(d.join("net")).unwrap();
        fs::write(d.join("net/50-x.conf"), b"{\"type\":\"x\"}").unwrap();
        symlink(d.join("net"), d.join("05-dir.conflist")).unwrap();
        let raw = OsStr::from_bytes(b"\xff-raw.conf");
        fs::write(d.join(raw), b"{}").unwrap();
        nix::unistd::mkfifo(&d.join("18-fifo.conf"), nix::sys::stat::Mode::S_IRWXU).unwrap();

        let mut r = Reader::new(d, 1024, 1 << 20);
        let names: Vec<(Vec<u8>, bool)> = r
            .list(b"")
            .unwrap()
            .into_iter()
            .map(|e| (e.name, e.is_dir))
            .collect();
        assert_eq!(
            names,
            vec![
                (b"05-dir.conflist".to_vec(), false),
                (b"10-a.conflist".to_vec(), false),
                (b"18-fifo.conf".to_vec(), false),
                (b"net".to_vec(), true),
                (b"\xff-raw.conf".to_vec(), false),
            ]
        );
        assert_eq!(r.read(b"10-a.conflist"), Ok(b"{}".to_vec()));
        assert_eq!(r.read(b"\xff-raw.conf"), Ok(b"{}".to_vec()));
        assert_eq!(
            r.read(b"05-dir.conflist"),
            Err(SourceError::Io("is a directory".into()))
        );
        assert!(matches!(
            r.read(b"18-fifo.conf"),
            Err(SourceError::Undecidable(_))
        ));
        assert_eq!(r.read(b"nowhere.conf"), Err(SourceError::NotFound));
        assert_eq!(r.list(b"nowhere"), Err(SourceError::NotFound));
        assert!(matches!(r.list(b"10-a.conflist"), Err(SourceError::Io(_))));
        assert_eq!(r.read(b"net/50-x.conf"), Ok(b"{\"type\":\"x\"}".to_vec()));
        // A network name with a NUL byte: Go's ReadDir fails (EINVAL), not "missing".
        assert!(matches!(r.list(b"a\0b"), Err(SourceError::Io(_))));
    }

    #[test]
    fn budget_and_cap_make_it_undecidable() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::write(d.join("a.conf"), vec![b' '; 600]).unwrap();
        fs::write(d.join("b.conf"), vec![b' '; 600]).unwrap();
        fs::write(d.join("big.conf"), vec![b' '; 2048]).unwrap();
        let mut r = Reader::new(d, 1024, 1000);
        assert!(r.read(b"a.conf").is_ok());
        assert!(matches!(
            r.read(b"b.conf"),
            Err(SourceError::Undecidable(_))
        ));
        let mut r = Reader::new(d, 1024, 1 << 20);
        assert!(matches!(
            r.read(b"big.conf"),
            Err(SourceError::Undecidable(_))
        ));
    }

    #[test]
    fn listed_names_are_charged_to_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..100 {
            fs::write(dir.path().join(format!("zz-{i:03}.bak")), b"").unwrap();
        }
        // 100 names of 10 bytes + overhead do not fit in 2000 bytes.
        let mut r = Reader::new(dir.path(), 1024, 2000);
        assert!(matches!(r.list(b""), Err(SourceError::Undecidable(_))));
        assert!(r.bytes_used() <= 2000);
        let mut r = Reader::new(dir.path(), 1024, 1 << 20);
        assert_eq!(r.list(b"").unwrap().len(), 100);
        assert_eq!(r.bytes_used(), 100 * (10 + NAME_OVERHEAD));
    }

    #[test]
    fn resolve_is_lexical_like_filepath_join() {
        let r = Reader::new(Path::new("/etc/cni/net.d"), 1, 1);
        assert_eq!(r.resolve(b""), PathBuf::from("/etc/cni/net.d"));
        assert_eq!(r.resolve(b"a/../../x"), PathBuf::from("/etc/cni/x"));
        assert_eq!(r.resolve(b"../../../../../x"), PathBuf::from("/x"));
        assert_eq!(r.resolve(b"/etc"), PathBuf::from("/etc/cni/net.d/etc"));
    }
}
