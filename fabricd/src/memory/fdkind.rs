//! What a descriptor a client sends is, checked rather than assumed, and whether `Adopt` or
//! `Register` can use it. Only memory objects pass: a memfd or a tmpfs or hugetlbfs file
//! (shmem), a region file fabricd handed out, and for `Adopt` a vendor driver's device
//! (an open `/dev/nvidiactl` is what NVIDIA's driver exports). Everything else — an
//! eventfd, `/dev/zero`, `/proc/self/mem`, a file on ext4 or a FUSE mount, a socket — is
//! refused before the daemon maps, pins or keeps it.
//!
//! The checks never reach a filesystem's server (see `sys`): a file on a FUSE mount is
//! refused without the daemon waiting on it.

mod sys;

use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;

/// `tmpfs`' `f_type`: memfds live there unless made with `MFD_HUGETLB`.
const TMPFS_MAGIC: i64 = 0x0102_1994;
/// `hugetlbfs`' `f_type`.
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// What a descriptor is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FdKind {
    /// A memfd or a file on tmpfs.
    Shmem,
    /// A hugetlbfs file or a memfd made with `MFD_HUGETLB`.
    Hugetlb,
    /// A region file under fabricd's memory directory.
    RegionFile,
    /// A character device, with the driver that registered its major (`/proc/devices`).
    CharDevice {
        /// The driver's name (`?` when unknown).
        driver: String,
    },
    /// Anything else, described for a refusal.
    Other(String),
}

/// Why a descriptor was refused.
#[derive(Debug, thiserror::Error)]
pub enum FdKindError {
    /// `statx` failed on it.
    #[error("the descriptor cannot be inspected")]
    Inspect(#[source] std::io::Error),
    /// It is not a kind the operation can use.
    #[error("the descriptor is {what}, not {wanted}")]
    Refused {
        /// What it is.
        what: String,
        /// What the operation takes.
        wanted: &'static str,
    },
}

/// What `Register { Fd }` takes.
const REGISTER_TAKES: &str = "a memory object the daemon can pin (a memfd, a tmpfs or hugetlbfs file, a region file \
                              fabricd handed out)";
/// What `Adopt` of a CUDA POSIX export takes.
const ADOPT_TAKES: &str = "a CUDA export (an open NVIDIA device) or a memfd";

/// Checks that `fd` is a memory object `Register` can map and lock; `regions` is fabricd's
/// memory directory (region files lie one level below it).
pub fn check_register(fd: BorrowedFd<'_>, regions: &Path) -> Result<FdKind, FdKindError> {
    match classify(fd, regions)? {
        k @ (FdKind::Shmem | FdKind::Hugetlb | FdKind::RegionFile) => Ok(k),
        FdKind::CharDevice { driver } if driver == "dax" => Err(FdKindError::Refused {
            what: "a DAX device; register the region it backs (source Region or Import) instead".into(),
            wanted: REGISTER_TAKES,
        }),
        other => Err(FdKindError::Refused { what: describe(&other), wanted: REGISTER_TAKES }),
    }
}

/// Checks that `fd` can be a CUDA POSIX export: an NVIDIA driver's device, or a memfd (the
/// test driver's export, and memory an importer can map like any).
pub fn check_cuda_export(fd: BorrowedFd<'_>, regions: &Path) -> Result<FdKind, FdKindError> {
    match classify(fd, regions)? {
        k @ (FdKind::Shmem | FdKind::Hugetlb) => Ok(k),
        FdKind::CharDevice { driver } if driver.starts_with("nvidia") => Ok(FdKind::CharDevice { driver }),
        other => Err(FdKindError::Refused { what: describe(&other), wanted: ADOPT_TAKES }),
    }
}

fn describe(kind: &FdKind) -> String {
    match kind {
        FdKind::Shmem => "a memfd or tmpfs file".into(),
        FdKind::Hugetlb => "a hugetlbfs file".into(),
        FdKind::RegionFile => "a fabricd region file".into(),
        FdKind::CharDevice { driver } => format!("a character device of driver {driver:?}"),
        FdKind::Other(what) => what.clone(),
    }
}

/// Tells what `fd` is.
pub fn classify(fd: BorrowedFd<'_>, regions: &Path) -> Result<FdKind, FdKindError> {
    let st = sys::stat_fd(fd).map_err(FdKindError::Inspect)?;
    match st.mode & libc::S_IFMT {
        libc::S_IFREG => {}
        libc::S_IFCHR => {
            let driver = std::fs::read_to_string("/proc/devices")
                .ok()
                .and_then(|t| char_driver(&t, st.rdev.0).map(str::to_owned))
                .unwrap_or_else(|| "?".into());
            return Ok(FdKind::CharDevice { driver });
        }
        libc::S_IFDIR => return Ok(FdKind::Other("a directory".into())),
        libc::S_IFSOCK => return Ok(FdKind::Other("a socket".into())),
        libc::S_IFIFO => return Ok(FdKind::Other("a pipe".into())),
        libc::S_IFBLK => return Ok(FdKind::Other("a block device".into())),
        // An anonymous inode (eventfd, timerfd, signalfd, epoll, pidfd…) has no file type.
        _ => return Ok(FdKind::Other(format!("an anonymous inode ({})", link(fd)))),
    }
    // Only shmem and hugetlbfs files have seals; their filesystems then answer fstatfs
    // without delay (asked of any other file first, a FUSE server could hold it).
    if sys::seals(fd).is_some() {
        return Ok(match crate::dma::sys::fs_magic(fd) {
            Some(HUGETLBFS_MAGIC) => FdKind::Hugetlb,
            Some(TMPFS_MAGIC) | None | Some(_) => FdKind::Shmem,
        });
    }
    if is_region_file(fd, &st, regions) {
        return Ok(FdKind::RegionFile);
    }
    Ok(FdKind::Other(format!("a regular file outside tmpfs and hugetlbfs ({})", link(fd))))
}

/// Which file a descriptor is: `(st_dev, st_ino)`, as `stat` gives them.
pub type FileId = (u64, u64);

/// The region whose file `fd` says it is, by the name it was opened at (`r<id>`, still
/// linked there), with the file's identity. A claim only: the registry then compares that
/// identity with the region's own file's before it believes it.
pub fn named_region(fd: BorrowedFd<'_>) -> Option<(u64, FileId)> {
    let id = region_id(&opened_at(fd)?)?;
    let st = sys::stat_fd(fd).ok()?;
    (st.mode & libc::S_IFMT == libc::S_IFREG).then_some((id, file_id(&st)))
}

/// Whether `fd` may be a region file under another name: a regular file of the daemon's
/// uid with more than one hard link, on the filesystem of one of `dirs` (the resource
/// directories). Such a link (made where the same uid, or `protected_hardlinks=0`, lets a
/// client link the daemon's file) is not known by its name for the region it is.
pub fn may_be_linked_region_file(fd: BorrowedFd<'_>, dirs: &[BorrowedFd<'_>]) -> bool {
    let Ok(st) = sys::stat_fd(fd) else { return false };
    st.mode & libc::S_IFMT == libc::S_IFREG
        && st.nlink > 1
        && st.uid == crate::sys::effective_uid()
        && dirs.iter().any(|d| sys::stat_fd(*d).is_ok_and(|dir| dir.dev == st.dev))
}

/// The region id a path's name gives, when it has a region file's name: `r<digits>`.
fn region_id(path: &Path) -> Option<u64> {
    let id = path.file_name()?.to_str()?.strip_prefix('r')?;
    if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    id.parse().ok()
}

/// `(st_dev, st_ino)` of a `statx` result.
fn file_id(st: &sys::Stat) -> FileId {
    (libc::makedev(st.dev.0, st.dev.1), st.ino)
}

/// Whether `fd` was opened at a path under `dir` (both as the kernel resolves them).
pub fn opened_under(fd: BorrowedFd<'_>, dir: &Path) -> bool {
    opened_at(fd).is_some_and(|path| std::fs::canonicalize(dir).is_ok_and(|dir| path.starts_with(dir)))
}

/// The path `fd` was opened at, as the kernel resolves it (`/proc/self/fd`).
pub fn opened_at(fd: BorrowedFd<'_>) -> Option<std::path::PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()
}

/// The path `/proc/self/fd` gives for `fd` (what the caller opened), for messages.
pub fn link(fd: BorrowedFd<'_>) -> String {
    opened_at(fd).map(|p| p.display().to_string()).unwrap_or_else(|| "?".into())
}

/// Whether the regular file `fd` (statted as `st`) is a region file fabricd made: named
/// `r<id>` in a resource directory right under `regions`, the very inode at that path, and
/// owned by the daemon's uid. A client cannot put a file there (the directory is the
/// daemon's), so holding one means fabricd handed it out.
fn is_region_file(fd: BorrowedFd<'_>, st: &sys::Stat, regions: &Path) -> bool {
    let Some(path) = opened_at(fd) else { return false };
    let Ok(root) = std::fs::canonicalize(regions) else { return false };
    region_path_shape(&path, &root)
        && sys::stat_path(&path).is_ok_and(|p| {
            p.dev == st.dev
                && p.ino == st.ino
                && p.mode & libc::S_IFMT == libc::S_IFREG
                && p.uid == crate::sys::effective_uid()
        })
}

/// Whether `path` has the shape `<root>/<resource dir>/r<digits>`.
fn region_path_shape(path: &Path, root: &Path) -> bool {
    region_id(path).is_some() && path.parent().and_then(Path::parent) == Some(root)
}

/// The driver `/proc/devices` (its text `devices`) names for character major `major`.
fn char_driver(devices: &str, major: u32) -> Option<&str> {
    let chars = devices.split("Block devices:").next()?;
    chars.lines().find_map(|l| {
        let (num, name) = l.trim().split_once(' ')?;
        (num.parse::<u32>().ok()? == major).then(|| name.trim())
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::os::fd::{AsFd, FromRawFd, OwnedFd};

    use super::*;

    const DEVICES: &str = "Character devices:\n  1 mem\n  4 /dev/vc/0\n195 nvidia-frontend\n252 dax\n\
                           508 nvidia-uvm\n\nBlock devices:\n  7 loop\n252 device-mapper\n";

    #[test]
    fn char_drivers_come_from_the_character_section_only() {
        assert_eq!(char_driver(DEVICES, 1), Some("mem"));
        assert_eq!(char_driver(DEVICES, 195), Some("nvidia-frontend"));
        assert_eq!(char_driver(DEVICES, 252), Some("dax"), "not the block device of that major");
        assert_eq!(char_driver(DEVICES, 7), None);
        assert_eq!(char_driver("", 1), None);
    }

    #[test]
    fn region_paths_have_one_shape() {
        let root = Path::new("/var/lib/fabricd/memory");
        assert!(region_path_shape(&root.join("gpu0.hbm0/r17"), root));
        for (dir, name) in [("gpu0.hbm0", "r"), ("gpu0.hbm0", "r1x"), ("gpu0.hbm0", "x17"), ("a/b", "r1")] {
            assert!(!region_path_shape(&root.join(dir).join(name), root), "{dir}/{name}");
        }
        assert!(!region_path_shape(Path::new("/var/lib/fabricd/r1"), root));
    }

    fn memfd(flags: libc::c_uint) -> Option<OwnedFd> {
        // SAFETY: a NUL-terminated name and flags; the result is checked.
        let fd = unsafe { libc::memfd_create(c"kind".as_ptr(), libc::MFD_CLOEXEC | flags) };
        // SAFETY: the descriptor was just created and is owned by nothing else.
        (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
    }

    #[test]
    fn memory_objects_pass_and_everything_else_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let m = memfd(0).unwrap();
        assert_eq!(check_register(m.as_fd(), root).unwrap(), FdKind::Shmem);
        assert_eq!(check_cuda_export(m.as_fd(), root).unwrap(), FdKind::Shmem);
        if let Some(h) = memfd(libc::MFD_HUGETLB) {
            assert_eq!(check_register(h.as_fd(), root).unwrap(), FdKind::Hugetlb);
        }
        // A region file fabricd made passes Register (not Adopt); the same bytes at another
        // place do not.
        std::fs::create_dir(root.join("gpu0.hbm0")).unwrap();
        let region = std::fs::File::create(root.join("gpu0.hbm0/r3")).unwrap();
        assert_eq!(check_register(region.as_fd(), root).unwrap(), FdKind::RegionFile);
        assert!(check_cuda_export(region.as_fd(), root).is_err());
        let elsewhere = std::fs::File::create(root.join("r4")).unwrap();
        // SAFETY: eventfd takes a count and flags; the result is checked.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        assert!(efd >= 0);
        // SAFETY: just created, owned by nothing else.
        let efd = unsafe { OwnedFd::from_raw_fd(efd) };
        let zero = std::fs::File::open("/dev/zero").unwrap();
        let mem = std::fs::File::open("/proc/self/mem").unwrap();
        let (sock, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let (pipe, _w) = std::io::pipe().unwrap();
        let refused: [(BorrowedFd<'_>, &str); 6] = [
            (elsewhere.as_fd(), "regular file"),
            (efd.as_fd(), "anonymous inode"),
            (zero.as_fd(), "\"mem\""),
            (mem.as_fd(), "/proc/"),
            (sock.as_fd(), "socket"),
            (pipe.as_fd(), "pipe"),
        ];
        for (fd, says) in refused {
            for e in [check_register(fd, root).unwrap_err(), check_cuda_export(fd, root).unwrap_err()] {
                assert!(e.to_string().contains(says), "{e}");
            }
        }
    }
}
