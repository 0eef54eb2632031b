//! The system calls that tell what a received descriptor is. None of them reaches a
//! filesystem's server: `statx` with `AT_STATX_DONT_SYNC` answers from the inode the
//! kernel has (a FUSE file's attributes are not fetched again) and `F_GET_SEALS` is
//! answered by shmem and hugetlbfs alone, so a descriptor on a stuck FUSE mount cannot
//! block the caller here.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;

/// What `statx` says of a file, the fields the classifier uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// `st_mode` (type and permission bits).
    pub mode: u32,
    /// The device the inode lies on, `(major, minor)`.
    pub dev: (u32, u32),
    /// The device a character or block special file is, `(major, minor)`.
    pub rdev: (u32, u32),
    /// The inode number.
    pub ino: u64,
    /// The owner.
    pub uid: u32,
    /// Hard links to the inode.
    pub nlink: u32,
}

const MASK: u32 = libc::STATX_TYPE | libc::STATX_MODE | libc::STATX_INO | libc::STATX_UID | libc::STATX_NLINK;

fn statx_at(dirfd: i32, path: &std::ffi::CStr, flags: i32) -> io::Result<Stat> {
    // SAFETY: an all-zero statx is a valid value of the plain C struct.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and `st` is written by the call; both outlive it.
    if unsafe { libc::statx(dirfd, path.as_ptr(), flags | libc::AT_STATX_DONT_SYNC, MASK, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Stat {
        mode: u32::from(st.stx_mode),
        dev: (st.stx_dev_major, st.stx_dev_minor),
        rdev: (st.stx_rdev_major, st.stx_rdev_minor),
        ino: st.stx_ino,
        uid: st.stx_uid,
        nlink: st.stx_nlink,
    })
}

/// `statx` of the open file `fd`, from what the kernel holds.
pub fn stat_fd(fd: BorrowedFd<'_>) -> io::Result<Stat> {
    statx_at(fd.as_raw_fd(), c"", libc::AT_EMPTY_PATH)
}

/// `statx` of `path` itself (a symbolic link is not followed).
pub fn stat_path(path: &Path) -> io::Result<Stat> {
    use std::os::unix::ffi::OsStrExt;
    let c =
        std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    statx_at(libc::AT_FDCWD, &c, libc::AT_SYMLINK_NOFOLLOW)
}

/// The seals of `fd`, which only shmem (tmpfs, memfd) and hugetlbfs files have; `None`
/// for every other file.
pub fn seals(fd: BorrowedFd<'_>) -> Option<i32> {
    // SAFETY: F_GET_SEALS takes no argument and touches no memory of ours.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    (seals >= 0).then_some(seals)
}
