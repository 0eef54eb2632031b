//! The client socket: its directory, stale-socket handling, mode and group.

use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// Why the socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// Another daemon answers on the socket.
    #[error("another fabricd is already serving {0} (it accepted a connection); stop it first")]
    InUse(PathBuf),
    /// Something that is not a socket is in the way.
    #[error("{0} exists and is not a socket; refusing to remove it")]
    NotASocket(PathBuf),
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
/// here), removes a stale socket that nobody answers on, binds, sets mode 0660 and, when
/// `group` is set, gives the socket to that group.
pub fn bind(path: &Path, group: Option<&str>, root: bool) -> Result<UnixListener, SocketError> {
    let gid = group.map(group_gid).transpose()?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(if root { 0o755 } else { 0o700 })
            .create(dir)
            .map_err(io_err("creating socket directory", dir))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => match UnixStream::connect(path) {
            Ok(_) => return Err(SocketError::InUse(path.to_owned())),
            Err(e) => {
                tracing::info!(path = %path.display(), error = %e, "removing stale socket (nothing answers on it)");
                std::fs::remove_file(path).map_err(io_err("removing stale socket", path))?;
            }
        },
        Ok(_) => return Err(SocketError::NotASocket(path.to_owned())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("inspecting", path)(e)),
    }
    let listener = UnixListener::bind(path).map_err(io_err("binding", path))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(io_err("chmod 0660", path))?;
    if let Some(gid) = gid {
        nix::unistd::chown(path, None, Some(nix::unistd::Gid::from_raw(gid)))
            .map_err(|e| io_err("chown to socket.group", path)(e.into()))?;
    }
    Ok(listener)
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
}
