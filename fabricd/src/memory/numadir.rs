//! Where regions on NUMA nodes live: one file per region on a tmpfs directory
//! (`[memory] numa_dir`), so that they outlive the daemon like sim region files do.
//!
//! Why tmpfs: a tmpfs file is shmem, and `mbind` on a shared mapping of it sets the *file's*
//! shared policy (`shmem_set_policy`), which stays with the inode after the daemon unmaps it
//! and exits; the pages stay where they were placed, and a restarted daemon finds the file,
//! checks its pages are on the node (`move_pages`) and serves the region again. A regular
//! file's pages follow whoever faults them instead, and a memfd ends with its last
//! descriptor. tmpfs is cleared at reboot, as the memory of a volatile CXL node is.
//!
//! The directory holds capabilities (any process that opens a region file reaches its
//! bytes), so it must be the daemon's own: a real directory (not a symlink), owned by the
//! daemon's uid, with no access for group or others, on tmpfs. It is created so when
//! missing and checked as every private directory is (`crate::sys::privdir`); not on tmpfs
//! refuses the start too.

use std::path::{Path, PathBuf};

use crate::dma::sys::{TMPFS_MAGIC, fs_magic};

/// Why the directory for NUMA regions cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum NumaDirError {
    /// It could not be created or inspected.
    #[error("{}: {source}", path.display())]
    Io {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// It is not the daemon's own private directory.
    #[error(transparent)]
    Private(#[from] crate::sys::privdir::DirError),
    /// It is not on tmpfs.
    #[error("{} cannot hold NUMA regions: {why}", path.display())]
    Unusable {
        /// The directory.
        path: PathBuf,
        /// Why.
        why: String,
    },
}

/// The directory for regions on NUMA nodes: `configured` when set, else `numa-HASH` under
/// `base` — the daemon's runtime directory, `/run/fabric` for root or
/// `$XDG_RUNTIME_DIR/fabric` — HASH naming the state directory (two daemons never share
/// one, and a restarted daemon finds its own). Not under `/dev/shm`: a predictable name in
/// a world-writable directory could be taken first by any user. `None`: no default here.
pub fn numa_root(configured: &str, base: Option<&Path>, state_dir: &Path) -> Option<PathBuf> {
    if !configured.is_empty() {
        return Some(PathBuf::from(configured));
    }
    // FNV-1a of the state directory's path: stable across runs and builds.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in state_dir.as_os_str().as_encoded_bytes() {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    base.map(|b| b.join(format!("numa-{:08x}", h as u32)))
}

/// Creates `dir` (mode 0700) when missing and checks it: a private directory
/// ([`crate::sys::privdir::PrivateDir`]: not a symlink, the daemon's uid's, no one else may
/// write it; read bits for others are cleared), on tmpfs.
pub fn prepare(dir: &Path) -> Result<(), NumaDirError> {
    let file = crate::sys::privdir::PrivateDir::create(dir)?.into_file();
    match fs_magic(&file) {
        Some(TMPFS_MAGIC) => Ok(()),
        Some(m) => Err(NumaDirError::Unusable {
            path: dir.to_owned(),
            why: format!(
                "not on tmpfs (filesystem type {m:#x}): only a tmpfs file keeps its NUMA policy without the daemon"
            ),
        }),
        None => Err(NumaDirError::Io { path: dir.to_owned(), source: std::io::Error::last_os_error() }),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use super::*;

    fn filesystem_magic(path: &Path) -> std::io::Result<i64> {
        let dir = std::fs::File::open(path)?;
        fs_magic(&dir).ok_or_else(std::io::Error::last_os_error)
    }
    #[test]
    fn the_default_is_per_state_dir_and_stable() {
        let base = Some(Path::new("/run/fabric"));
        let a = numa_root("", base, Path::new("/var/lib/fabric")).unwrap();
        assert_eq!(Some(&a), numa_root("", base, Path::new("/var/lib/fabric")).as_ref());
        assert_ne!(Some(&a), numa_root("", base, Path::new("/var/lib/fabric2")).as_ref());
        assert!(a.to_str().unwrap().starts_with("/run/fabric/numa-"), "{}", a.display());
        assert_eq!(numa_root("/run/x", None, Path::new("/y")), Some(PathBuf::from("/run/x")));
        assert_eq!(numa_root("", None, Path::new("/y")), None);
    }

    #[test]
    fn only_a_private_tmpfs_directory_is_accepted() {
        if filesystem_magic(Path::new("/dev/shm")).ok() != Some(TMPFS_MAGIC) {
            eprintln!("skipped: /dev/shm is not tmpfs here");
            return;
        }
        let base = tempfile::tempdir_in("/dev/shm").unwrap();
        let d = base.path().join("numa");
        prepare(&d).unwrap();
        assert_eq!(std::fs::metadata(&d).unwrap().mode() & 0o777, 0o700);
        prepare(&d).unwrap(); // again: already there, fine
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o775)).unwrap();
        let e = prepare(&d).unwrap_err().to_string();
        assert!(e.contains("mode 0775") && e.contains("may write"), "{e}");
        let link = base.path().join("link");
        std::os::unix::fs::symlink(&d, &link).unwrap();
        let e = prepare(&link).unwrap_err().to_string();
        assert!(e.contains("symlink"), "{e}");
        // A directory on a disk filesystem (the test binary's) is refused when that is not tmpfs.
        let exe_dir = std::env::current_exe().unwrap().parent().unwrap().to_owned();
        let disk = tempfile::tempdir_in(exe_dir).unwrap();
        if filesystem_magic(disk.path()).unwrap() != TMPFS_MAGIC {
            let e = prepare(&disk.path().join("numa")).unwrap_err();
            assert!(e.to_string().contains("not on tmpfs"), "{e}");
        }
    }
}
