//! Reads a CNI config directory into `meshgate_core::cni::DirEntry` values.
//!
//! In: a directory path and a per-file size cap. Out: the config-named entries with their
//! bytes, and the subdirectories with their `.conf` files (the CNI 1.1 drop-in plugin
//! directories). Symlinks are followed. Only regular files are ever opened, and they are
//! opened non-blocking, so a FIFO swapped in at the last moment cannot hang the agent; files
//! over the cap are not read at all.

use std::fs::{self, File, Metadata, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use meshgate_core::cni::listing::is_config_name;
use meshgate_core::cni::{DirEntry, EntryKind};

/// Default cap on one config file: real conflists are a few KiB.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 1 << 20;

/// At most this many candidates (config-named entries and possible drop-in directories, in
/// name order) are opened per directory, so a directory flooded with configs costs bounded
/// time and memory. The runtime loads the first file by name anyway.
pub const MAX_ENTRIES: usize = 4096;

/// Lists `dir`. A missing directory yields no entries (the runtime treats it the same way:
/// no config yet); any other listing error is returned.
pub fn read_conf_dir(dir: &Path, max_file_bytes: u64) -> io::Result<Vec<DirEntry>> {
    read_dir(dir, max_file_bytes, true, is_config_name)
}

fn read_dir(
    dir: &Path,
    max_file_bytes: u64,
    descend: bool,
    wanted: fn(&str) -> bool,
) -> io::Result<Vec<DirEntry>> {
    let listing = match fs::read_dir(dir) {
        Ok(l) => l,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    // Names first, without a stat: only entries the runtime could load (or that may be a
    // drop-in directory) are candidates, and the cap applies to them in name order. Capping
    // the raw listing instead would let a directory flooded with other files hide the file
    // the runtime really loads: readdir order is arbitrary.
    let mut candidates: Vec<(String, std::path::PathBuf)> = Vec::new();
    for entry in listing {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let maybe_dir = descend
            && entry
                .file_type()
                .is_ok_and(|t| t.is_dir() || t.is_symlink());
        if wanted(&name) || maybe_dir {
            candidates.push((name, entry.path()));
        }
    }
    candidates.sort();
    let mut out = Vec::new();
    for (name, path) in candidates.into_iter().take(MAX_ENTRIES) {
        // fs::metadata follows symlinks: a symlinked config counts as its target.
        let kind = match fs::metadata(&path) {
            Err(e) => {
                if !wanted(&name) {
                    continue;
                }
                EntryKind::Unreadable(e.to_string())
            }
            Ok(meta) if meta.is_dir() => {
                if !descend {
                    continue;
                }
                let files = read_dir(&path, max_file_bytes, false, |n| n.ends_with(".conf"))
                    .unwrap_or_default();
                EntryKind::Directory(files)
            }
            Ok(meta) => {
                if !wanted(&name) {
                    continue;
                }
                read_file(&path, &meta, max_file_bytes)
            }
        };
        out.push(DirEntry { name, kind });
    }
    Ok(out)
}

fn read_file(path: &Path, meta: &Metadata, limit: u64) -> EntryKind {
    if !meta.is_file() {
        return EntryKind::NotRegular(kind_name(meta).into());
    }
    if meta.len() > limit {
        return EntryKind::TooLarge {
            size: meta.len(),
            limit,
        };
    }
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) => return EntryKind::Unreadable(e.to_string()),
    };
    match read_capped(file, limit) {
        Ok(Some(bytes)) => EntryKind::File(bytes),
        Ok(None) => EntryKind::TooLarge {
            size: limit + 1,
            limit,
        },
        Err(e) => EntryKind::Unreadable(e.to_string()),
    }
}

/// Reads at most `limit` bytes; `None` when the file holds more (it grew after the stat).
fn read_capped(file: File, limit: u64) -> io::Result<Option<Vec<u8>>> {
    // The path may have been swapped for a FIFO or device between stat and open.
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::other(format!(
            "became a {} while being read",
            kind_name(&meta)
        )));
    }
    let mut buf = Vec::with_capacity(meta.len().min(limit) as usize);
    file.take(limit + 1).read_to_end(&mut buf)?;
    Ok((buf.len() as u64 <= limit).then_some(buf))
}

fn kind_name(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_fifo() {
        "fifo"
    } else if t.is_socket() {
        "socket"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_dir() {
        "directory"
    } else {
        "special file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn reads_configs_follows_symlinks_and_reports_hostile_entries() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::write(d.join("10-a.conflist"), b"{}").unwrap();
        fs::write(d.join("notes.txt"), b"ignored").unwrap();
        fs::write(d.join("20-big.conf"), vec![b' '; 2048]).unwrap();
        symlink(d.join("10-a.conflist"), d.join("15-link.conflist")).unwrap();
        symlink(d.join("nowhere"), d.join("16-dangling.conf")).unwrap();
        symlink(d.join("17-loop.conf"), d.join("17-loop.conf")).unwrap();
        nix::unistd::mkfifo(&d.join("18-fifo.conf"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        fs::create_dir(d.join("net")).unwrap();
        fs::write(d.join("net/50-x.conf"), b"{\"type\":\"x\"}").unwrap();
        fs::write(d.join("net/readme"), b"ignored").unwrap();

        let mut entries = read_conf_dir(d, 1024).unwrap();
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        let by = |n: &str| entries.iter().find(|e| e.name == n).map(|e| e.kind.clone());
        assert_eq!(by("10-a.conflist"), Some(EntryKind::File(b"{}".to_vec())));
        assert_eq!(
            by("15-link.conflist"),
            Some(EntryKind::File(b"{}".to_vec()))
        );
        assert_eq!(
            by("20-big.conf"),
            Some(EntryKind::TooLarge {
                size: 2048,
                limit: 1024
            })
        );
        assert!(matches!(
            by("16-dangling.conf"),
            Some(EntryKind::Unreadable(_))
        ));
        assert!(
            matches!(by("17-loop.conf"), Some(EntryKind::Unreadable(e)) if e.contains("symbolic links"))
        );
        assert_eq!(
            by("18-fifo.conf"),
            Some(EntryKind::NotRegular("fifo".into()))
        );
        assert_eq!(
            by("net"),
            Some(EntryKind::Directory(vec![DirEntry::file(
                "50-x.conf",
                b"{\"type\":\"x\"}".to_vec()
            )]))
        );
        assert_eq!(by("notes.txt"), None);
    }

    #[test]
    fn missing_directory_is_empty_not_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(
            read_conf_dir(&dir.path().join("absent"), 1024)
                .unwrap()
                .is_empty()
        );
    }
}
