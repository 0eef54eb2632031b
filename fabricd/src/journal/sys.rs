//! File-system steps the journal's durability rests on: whole-file creation by rename,
//! directory fsync, the lock file. Files are made 0600 and opened without following a
//! symlink (`crate::sys::privdir`). Only `std::fs`; no raw syscalls are needed.

use std::fs::{self, File, TryLockError};
use std::path::{Path, PathBuf};

use super::JournalError;

/// Suffix of a file being created; such files are garbage after a crash.
pub const TEMP_SUFFIX: &str = fabric_addrmap::durable::TEMP_SUFFIX;
/// Suffix of a segment file.
pub const SEGMENT_SUFFIX: &str = ".seg";
/// Name of the lock file that keeps a second writer out.
pub const LOCK_FILE: &str = "journal.lock";

/// File name of segment `n`: 16 lower-case hex digits, so names sort by number.
pub fn segment_name(n: u64) -> String {
    format!("{n:016x}{SEGMENT_SUFFIX}")
}

/// Path of segment `n` in `dir`.
pub fn segment_path(dir: &Path, n: u64) -> PathBuf {
    dir.join(segment_name(n))
}

/// What a directory entry is to the journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// A segment, by number.
    Segment(u64),
    /// A segment left half-created by a crash.
    Temp,
    /// Something else (ignored).
    Other,
}

/// Classifies a file name.
pub fn classify(name: &str) -> Entry {
    let (stem, temp) = match name.strip_suffix(TEMP_SUFFIX) {
        Some(stem) => (stem, true),
        None => (name, false),
    };
    let Some(hex) = stem.strip_suffix(SEGMENT_SUFFIX) else {
        return Entry::Other;
    };
    if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return Entry::Other;
    }
    match (temp, u64::from_str_radix(hex, 16)) {
        (true, _) => Entry::Temp,
        (false, Ok(n)) => Entry::Segment(n),
        (false, Err(_)) => Entry::Other,
    }
}

/// Makes a directory's entries (creations, renames, removals) durable.
pub fn sync_dir(dir: &Path) -> Result<(), JournalError> {
    fsync_dir(dir).map_err(|source| JournalError::Sync { path: dir.to_owned(), source })
}

/// `fsync` of a directory: its entries (creations, renames, removals) become durable.
pub fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir).and_then(|d| d.sync_all())
}

/// Creates `dir` and every missing ancestor, each made durable: after each `mkdir` the
/// directory that holds the new entry is fsynced (a power loss would otherwise forget a new
/// directory, and every file in it, even after those files were fsynced). Existing
/// directories are left alone; returns how many were created.
pub fn create_dir_durable(dir: &Path) -> std::io::Result<usize> {
    let mut missing = Vec::new();
    let mut at = dir;
    while !at.is_dir() {
        missing.push(at);
        match at.parent() {
            Some(p) if !p.as_os_str().is_empty() => at = p,
            _ => break,
        }
    }
    for d in missing.iter().rev() {
        match fs::create_dir(d) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && d.is_dir() => continue,
            Err(e) => return Err(e),
        }
        match d.parent() {
            Some(p) if !p.as_os_str().is_empty() => fsync_dir(p)?,
            _ => fsync_dir(Path::new("."))?,
        }
    }
    Ok(missing.len())
}

/// Creates `path` with exactly `bytes`, all or nothing ([`fabric_addrmap::durable::write_whole`]:
/// `path.tmp`, fsync, rename, fsync of `dir`). Returns the file, open for writing.
pub fn create_whole(dir: &Path, path: &Path, bytes: &[u8]) -> Result<File, JournalError> {
    use fabric_addrmap::durable::{WriteStep, write_whole};
    debug_assert_eq!(path.parent(), Some(dir));
    write_whole(path, bytes).map_err(|e| match e.step {
        WriteStep::Sync | WriteStep::SyncDir => JournalError::Sync { path: e.path, source: e.source },
        WriteStep::Create | WriteStep::Write | WriteStep::Rename => {
            JournalError::Write { path: e.path, source: e.source }
        }
    })
}

/// Removes a file; a file already gone is fine.
pub fn remove(path: &Path) -> Result<(), JournalError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(JournalError::Remove { path: path.to_owned(), source }),
    }
}

/// Takes the journal's exclusive lock (`flock`), released when the file closes, so also
/// when the process dies.
pub fn lock(dir: &Path) -> Result<File, JournalError> {
    let path = dir.join(LOCK_FILE);
    let file = crate::sys::privdir::file_options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .and_then(|f| crate::sys::privdir::check_file(&f, &path).map(|()| f))
        .map_err(|source| JournalError::Write { path: path.clone(), source })?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(TryLockError::WouldBlock) => Err(JournalError::Locked { path }),
        Err(TryLockError::Error(source)) => Err(JournalError::Write { path, source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_others_are_ignored() {
        assert_eq!(segment_name(0x2a), "000000000000002a.seg");
        assert_eq!(classify(&segment_name(0x2a)), Entry::Segment(0x2a));
        assert_eq!(classify(&segment_name(u64::MAX)), Entry::Segment(u64::MAX));
        assert_eq!(classify("000000000000002a.seg.tmp"), Entry::Temp);
        for other in ["journal.lock", "2a.seg", "000000000000002A.seg", "000000000000002a.segx", "x.tmp", ""] {
            assert_eq!(classify(other), Entry::Other, "{other}");
        }
    }

    #[test]
    fn durable_mkdir_creates_every_missing_level_once() {
        let t = tempfile::tempdir().unwrap();
        let deep = t.path().join("a/b/c");
        assert_eq!(create_dir_durable(&deep).unwrap(), 3);
        assert!(deep.is_dir());
        assert_eq!(create_dir_durable(&deep).unwrap(), 0);
        assert_eq!(create_dir_durable(&t.path().join("a/b/d")).unwrap(), 1);
        std::fs::write(t.path().join("file"), b"x").unwrap();
        assert!(create_dir_durable(&t.path().join("file/x")).is_err());
    }
}
