//! The daemon's private directories and files: created mode 0700 and 0600 whatever the
//! umask, checked before use, opened without following a symlink.
//!
//! Why: the state directory holds capabilities. A region file reaches its region's bytes,
//! and the journal names export secrets and resume tokens, so a uid that can read them
//! needs no socket access; a uid that can write the directory can plant a symlink that
//! the daemon (often root) would open for it. So every directory fabricd keeps state in
//! must be a real directory (not a symlink), owned by the daemon's effective uid, that no
//! one else may write. What cannot be trusted is refused, naming the path, owner and mode:
//! another owner, a symlink, write access for group or others (entries may already have
//! been planted). What can be fixed safely is fixed through the descriptor held, never by
//! path: read or search bits for group or others (an earlier fabricd started under umask
//! 022 left them) are cleared with `fchmod`, with a warning; the same for files, which end
//! 0600. The directory's ancestors are the operator's: they are not checked.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{FileStat, Mode, SFlag, fchmod, fstat, fstatat, mkdirat};

/// Why a directory cannot hold the daemon's state.
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    /// It could not be created, opened or changed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// It is not the daemon's own.
    #[error(
        "{} (owner uid {owner}, mode {mode:04o}) is unsafe: {why}; it must be a directory owned by uid {euid} that no one else may write (mode 0700)",
        path.display()
    )]
    Unsafe {
        /// The directory.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// Its mode bits (file type left out).
        mode: u32,
        /// The daemon's effective uid.
        euid: u32,
        /// What is wrong.
        why: &'static str,
    },
}

/// A checked private directory, held open: files in it are opened relative to it.
#[derive(Debug)]
pub struct PrivateDir {
    path: PathBuf,
    fd: OwnedFd,
}

/// The daemon's effective uid.
pub fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

impl PrivateDir {
    /// Creates `path` (mode 0700; missing ancestors as `mkdir -p` would, each made durable)
    /// when missing, then opens and checks it as [`PrivateDir::open`] does.
    pub fn create(path: &Path) -> Result<Self, DirError> {
        let io = |source| DirError::Io { path: path.to_owned(), source };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            crate::journal::sys::create_dir_durable(parent).map_err(io)?;
        }
        match nix::unistd::mkdir(path, Mode::S_IRWXU) {
            Ok(()) => {
                // Durably: a power loss must not forget the directory of fsynced files.
                let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
                crate::journal::sys::fsync_dir(parent).map_err(io)?;
            }
            Err(Errno::EEXIST) => {}
            Err(e) => return Err(io(e.into())),
        }
        Self::open(path)
    }

    /// Opens `path`, which must exist, without following a symlink and checks it: a
    /// directory owned by the daemon's euid that group and others cannot write. Any other
    /// bits for group or others are cleared (and a mode the umask narrowed is made 0700).
    pub fn open(path: &Path) -> Result<Self, DirError> {
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        match nix::fcntl::open(path, flags, Mode::empty()) {
            Ok(fd) => Self::checked(path.to_owned(), fd),
            Err(Errno::ELOOP | Errno::ENOTDIR) => {
                // Say what is there instead, with its owner and mode.
                let st = fstatat(nix::fcntl::AT_FDCWD, path, AtFlags::AT_SYMLINK_NOFOLLOW)
                    .map_err(|s| DirError::Io { path: path.to_owned(), source: s.into() })?;
                let link = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFLNK;
                let why = if link { "it is a symlink" } else { "it is not a directory" };
                Err(unsafe_dir(path, &st, why))
            }
            Err(e) => Err(DirError::Io { path: path.to_owned(), source: e.into() }),
        }
    }

    /// The directory `name` in this one, created (mode 0700) when missing and checked as
    /// [`PrivateDir::open`] does, opened relative to this one's descriptor.
    pub fn subdir(&self, name: &str) -> Result<Self, DirError> {
        let path = self.path.join(name);
        let io = |source: Errno| DirError::Io { path: path.clone(), source: source.into() };
        match mkdirat(self.fd.as_fd(), name, Mode::S_IRWXU) {
            // Durably, as in `create`.
            Ok(()) => {
                nix::unistd::fsync(&self.fd).map_err(|e| DirError::Io { path: self.path.clone(), source: e.into() })?
            }
            Err(Errno::EEXIST) => {}
            Err(e) => return Err(io(e)),
        }
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        match openat(self.fd.as_fd(), name, flags, Mode::empty()) {
            Ok(fd) => Self::checked(path, fd),
            Err(Errno::ELOOP | Errno::ENOTDIR) => {
                let st = fstatat(self.fd.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW).map_err(io)?;
                Err(unsafe_dir(&path, &st, "it is a symlink or not a directory"))
            }
            Err(e) => Err(io(e)),
        }
    }

    fn checked(path: PathBuf, fd: OwnedFd) -> Result<Self, DirError> {
        let io = |source: Errno| DirError::Io { path: path.clone(), source: source.into() };
        let st = fstat(&fd).map_err(io)?;
        if st.st_uid != euid() {
            return Err(unsafe_dir(&path, &st, "another uid owns it"));
        }
        let mode = st.st_mode & 0o7777;
        if mode & 0o022 != 0 {
            return Err(unsafe_dir(&path, &st, "group or others may write it"));
        }
        if mode != 0o700 {
            fchmod(&fd, Mode::S_IRWXU).map_err(io)?;
            if mode & 0o077 != 0 {
                tracing::warn!(path = %path.display(), mode = format!("{mode:04o}"), "group or others could read this directory; mode set to 0700");
            }
        }
        Ok(Self { path, fd })
    }

    /// Its path, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The directory as an open file (for `fstatfs`, `fsync`).
    pub fn into_file(self) -> File {
        File::from(self.fd)
    }

    /// The directory's descriptor, kept to open its files with [`open_in`].
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }
}

/// Opens the existing file `name` of the directory held open as `dir`, read-only or
/// read-write: relative to that descriptor (whatever has happened to the directory's path
/// since it was checked), one path component only, and a symlink there refused (`ELOOP`).
pub fn open_in(dir: BorrowedFd<'_>, name: &std::ffi::OsStr, write: bool) -> io::Result<File> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes == b"." || bytes == b".." || bytes.contains(&b'/') {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a file name in the directory"));
    }
    let access = if write { OFlag::O_RDWR } else { OFlag::O_RDONLY };
    let fd =
        openat(dir, name, access | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty()).map_err(io::Error::from)?;
    Ok(File::from(fd))
}

fn unsafe_dir(path: &Path, st: &FileStat, why: &'static str) -> DirError {
    DirError::Unsafe { path: path.to_owned(), owner: st.st_uid, mode: st.st_mode & 0o7777, euid: euid(), why }
}

/// Options for the daemon's files: created mode 0600, a symlink at the path refused
/// (`ELOOP`) rather than followed. Pass what is opened to [`check_file`].
pub fn file_options() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.mode(0o600).custom_flags(libc::O_NOFOLLOW);
    o
}

/// Checks a file opened with [`file_options`] through its descriptor: a regular file owned
/// by the daemon's euid (anything else is refused, `PermissionDenied`), mode 0600 (a wider
/// mode, or one the umask narrowed, is set so, with a warning when it was wider).
pub fn check_file(file: &File, path: &Path) -> io::Result<()> {
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, "not a regular file"));
    }
    if meta.uid() != euid() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("owned by uid {}, not the daemon's {}", meta.uid(), euid()),
        ));
    }
    let mode = meta.mode() & 0o7777;
    if mode != 0o600 {
        fchmod(file.as_fd(), Mode::S_IRUSR | Mode::S_IWUSR).map_err(io::Error::from)?;
        if mode & 0o077 != 0 {
            tracing::warn!(path = %path.display(), mode = format!("{mode:04o}"), "group or others could read this file; mode set to 0600");
        }
    }
    Ok(())
}

/// Opens an existing region or state file at `path` read-only or read-write, refusing a
/// symlink there (`ELOOP`): a link planted in a directory someone misconfigured must not
/// hand a client a descriptor to whatever it points at.
pub fn open_nofollow(path: &Path, write: bool) -> io::Result<File> {
    OpenOptions::new().read(true).write(write).custom_flags(libc::O_NOFOLLOW).open(path)
}

/// A whole state file of the daemon's (the map record, the quarantine record): not
/// through a symlink, and checked ([`check_file`]).
pub fn read_private(path: &Path) -> io::Result<Vec<u8>> {
    let mut f = open_nofollow(path, false)?;
    check_file(&f, path)?;
    let mut bytes = Vec::new();
    io::Read::read_to_end(&mut f, &mut bytes).map(|_| bytes)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
    }

    #[test]
    fn created_private_whatever_the_umask_and_checked_when_found() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("a/state");
        let dir = PrivateDir::create(&d).unwrap();
        assert_eq!(mode(&d), 0o700);
        let sub = dir.subdir("journal").unwrap();
        assert_eq!(mode(sub.path()), 0o700);
        // Readable by others (an earlier daemon under umask 022): tightened through the fd.
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        PrivateDir::create(&d).unwrap();
        assert_eq!(mode(&d), 0o700);
        // Narrowed by a umask: made usable again.
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o500)).unwrap();
        PrivateDir::open(&d).unwrap();
        assert_eq!(mode(&d), 0o700);
        // Writable by group or others: refused, naming path, owner and mode.
        for m in [0o770, 0o703, 0o1777] {
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(m)).unwrap();
            let e = PrivateDir::create(&d).unwrap_err().to_string();
            assert!(e.contains(&d.display().to_string()) && e.contains(&format!("mode {m:04o}")), "{e}");
            assert!(e.contains("may write"), "{e}");
            assert!(e.contains(&format!("owner uid {}", euid())), "{e}");
        }
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        // A symlink to it: refused, at the top and below.
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&d, &link).unwrap();
        let e = PrivateDir::create(&link).unwrap_err().to_string();
        assert!(e.contains("symlink"), "{e}");
        std::os::unix::fs::symlink(t.path(), d.join("memory")).unwrap();
        let e = dir.subdir("memory").unwrap_err().to_string();
        assert!(e.contains("symlink"), "{e}");
        std::fs::write(t.path().join("file"), b"").unwrap();
        let e = PrivateDir::open(&t.path().join("file")).unwrap_err().to_string();
        assert!(e.contains("not a directory"), "{e}");
    }

    #[test]
    fn files_end_0600_and_symlinks_are_not_followed() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("f");
        let f = file_options().write(true).create(true).truncate(false).open(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        check_file(&f, &p).unwrap();
        assert_eq!(mode(&p), 0o600);
        let link = t.path().join("l");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        let e = file_options().write(true).create(true).truncate(false).open(&link).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP));
        assert_eq!(open_nofollow(&link, false).unwrap_err().raw_os_error(), Some(libc::ELOOP));
        let d = File::open(t.path()).unwrap();
        assert!(check_file(&d, t.path()).is_err(), "a directory is not a state file");
    }
}
