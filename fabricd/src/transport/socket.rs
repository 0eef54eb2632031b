//! The client socket: its directory (checked), stale-socket handling, mode and group (set
//! with no path another process could change).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat, renameat};
use nix::sys::stat::{FchmodatFlags, Mode, SFlag, fchmodat, fstat, fstatat, mkdirat};
use nix::unistd::{UnlinkatFlags, unlinkat};

/// Why the socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// Another daemon answers on the socket.
    #[error("another fabricd is already serving {0} (it accepted a connection); stop it first")]
    InUse(PathBuf),
    /// Something that is not a socket is in the way.
    #[error("{0} exists and is not a socket; refusing to remove it")]
    NotASocket(PathBuf),
    /// The socket's directory could let another user replace the socket.
    #[error(
        "socket directory {} (owner uid {owner}, mode {mode:04o}) is unsafe: it must be owned by root or uid {euid} and writable by no one else, or another user could put a socket of theirs in fabricd's place",
        path.display()
    )]
    UnsafeDir {
        /// The directory.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// Its mode bits (file type left out).
        mode: u32,
        /// The daemon's effective uid.
        euid: u32,
    },
    /// The configured group does not exist.
    #[error("socket.group {0:?} is not a group on this system")]
    UnknownGroup(String),
    /// A system call failed.
    #[error("{what} {path}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> SocketError + 'a {
    move |source| SocketError::Io { what, path: path.to_owned(), source }
}

/// Resolves a group to its gid: a numeric gid (all digits) is taken as it is, so that a
/// group need not exist in `/etc/group`; anything else is looked up by name.
pub fn group_gid(name: &str) -> Result<u32, SocketError> {
    if !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit()) {
        return name.parse().map_err(|_| SocketError::UnknownGroup(name.to_owned()));
    }
    match nix::unistd::Group::from_name(name) {
        Ok(Some(g)) => Ok(g.gid.as_raw()),
        Ok(None) => Err(SocketError::UnknownGroup(name.to_owned())),
        Err(e) => Err(SocketError::Io { what: "looking up group", path: PathBuf::from(name), source: e.into() }),
    }
}

/// Creates the socket's directory (mode 0755 as root, 0700 otherwise, when it is created
/// here), checks it ([`check_dir`]), refuses to replace a socket something answers on or
/// anything that is not a socket, and puts a new socket there with mode 0660 and, when
/// `group` is set, that group.
///
/// The socket is bound in a private directory made for it inside the socket's directory,
/// given its mode and group there, and renamed into place (replacing a stale socket in
/// one step). So no `chmod` or `chown` goes through a path another process could have
/// changed: nothing can be planted in the private directory, and Linux ignores `fchmod`
/// on a socket's descriptor for the inode the path names.
pub fn bind(path: &Path, group: Option<&str>, root: bool) -> Result<UnixListener, SocketError> {
    let gid = group.map(group_gid).transpose()?;
    let name = path.file_name().ok_or_else(|| {
        io_err("binding", path)(io::Error::new(io::ErrorKind::InvalidInput, "socket.path names no file"))
    })?;
    let dir_path = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !dir_path.exists() {
        let mode = if root { 0o755 } else { 0o700 };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(mode)
            .create(dir_path)
            .map_err(io_err("creating socket directory", dir_path))?;
        // The mode asked for, not what the umask left of it.
        std::fs::set_permissions(dir_path, std::fs::Permissions::from_mode(mode))
            .map_err(io_err("creating socket directory", dir_path))?;
    }
    let dir = nix::fcntl::open(dir_path, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
        .map_err(|e| io_err("opening socket directory", dir_path)(e.into()))?;
    check_dir(&dir, dir_path)?;
    match fstatat(&dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFSOCK => {
            match UnixStream::connect(path) {
                Ok(_) => return Err(SocketError::InUse(path.to_owned())),
                Err(e) => {
                    tracing::info!(path = %path.display(), error = %e, "replacing stale socket (nothing answers on it)");
                }
            }
        }
        Ok(_) => return Err(SocketError::NotASocket(path.to_owned())),
        Err(Errno::ENOENT) => {}
        Err(e) => return Err(io_err("inspecting", path)(e.into())),
    }
    let stage_name = format!(".{}.{}.new", name.to_string_lossy(), std::process::id());
    let stage_path = dir_path.join(&stage_name);
    // A directory of the same name is left by a crash of an earlier daemon with this pid.
    unstage(&dir, &stage_name);
    mkdirat(&dir, stage_name.as_str(), Mode::S_IRWXU)
        .map_err(|e| io_err("creating a private directory for the socket", &stage_path)(e.into()))?;
    let placed = (|| {
        let stage = openat(
            &dir,
            stage_name.as_str(),
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_err("opening", &stage_path)(e.into()))?;
        // Bound through the descriptor held, so that the path cannot be switched under it.
        let via = PathBuf::from(format!("/proc/self/fd/{}/{STAGED}", stage.as_raw_fd()));
        let listener = UnixListener::bind(&via).map_err(io_err("binding", path))?;
        fchmodat(&stage, STAGED, Mode::from_bits_truncate(0o660), FchmodatFlags::FollowSymlink)
            .map_err(|e| io_err("chmod 0660", path)(e.into()))?;
        if let Some(gid) = gid {
            nix::unistd::fchownat(
                &stage,
                STAGED,
                None,
                Some(nix::unistd::Gid::from_raw(gid)),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .map_err(|e| io_err("chown to socket.group", path)(e.into()))?;
        }
        renameat(&stage, STAGED, &dir, name).map_err(|e| io_err("renaming the socket into place", path)(e.into()))?;
        Ok(listener)
    })();
    unstage(&dir, &stage_name);
    placed
}

/// Name of the socket in its private directory before it is renamed into place.
const STAGED: &str = "s";

/// Removes the private directory a socket was bound in (and the socket, when it is still
/// there); errors are ignored: what is left is harmless and removed by the next start.
fn unstage(dir: &OwnedFd, stage_name: &str) {
    if let Ok(stage) = openat(
        dir,
        stage_name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) {
        let _ = unlinkat(&stage, STAGED, UnlinkatFlags::NoRemoveDir);
    }
    let _ = unlinkat(dir, stage_name, UnlinkatFlags::RemoveDir);
}

/// Checks the directory that holds the socket: owned by root or the daemon's euid, and
/// writable by no one else. Another user who could write it could rename a socket of
/// theirs over fabricd's and pose as fabricd to every client (collecting export secrets).
/// A sticky bit does not make a world-writable directory acceptable: anyone could take
/// the socket's name there while the daemon is stopped.
pub fn check_dir(dir: &OwnedFd, path: &Path) -> Result<(), SocketError> {
    let st = fstat(dir).map_err(|e| io_err("inspecting socket directory", path)(e.into()))?;
    let euid = crate::sys::privdir::euid();
    if (st.st_uid != euid && st.st_uid != 0) || st.st_mode & 0o022 != 0 {
        return Err(SocketError::UnsafeDir {
            path: path.to_owned(),
            owner: st.st_uid,
            mode: st.st_mode & 0o7777,
            euid,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_sockets_go_live_ones_and_files_stay() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/d.sock");
        let l = bind(&path, None, false).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o660);
        let dmode = std::fs::metadata(path.parent().unwrap()).unwrap().permissions().mode() & 0o777;
        assert_eq!(dmode, 0o700);
        assert!(matches!(bind(&path, None, false), Err(SocketError::InUse(_))));
        drop(l);
        // Nobody listens now: the stale socket is replaced.
        let _l = bind(&path, None, false).unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(bind(&file, None, false), Err(SocketError::NotASocket(_))));
        assert!(file.exists());
        assert_eq!(group_gid("61100").unwrap(), 61100);
        assert!(matches!(group_gid("99999999999"), Err(SocketError::UnknownGroup(_))));
        let e = bind(&dir.path().join("g.sock"), Some("no-such-group-fabric"), false).unwrap_err();
        assert!(e.to_string().contains("no-such-group-fabric"), "{e}");
    }

    #[test]
    fn a_directory_others_may_write_is_refused_and_nothing_is_left_behind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.sock");
        let _l = bind(&path, None, false).unwrap();
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("d.sock")], "no private directory left");
        for m in [0o777, 0o1777, 0o720] {
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(m)).unwrap();
            let e = bind(&dir.path().join("e.sock"), None, false).unwrap_err().to_string();
            assert!(e.contains(&format!("mode {m:04o}")) && e.contains("unsafe"), "{e}");
        }
    }
}
