//! The system calls behind a region on a NUMA node: a tmpfs file (`numadir`) whose pages
//! are bound to the node and faulted in by the daemon, then checked page by page — when
//! made, and again when a restarted daemon finds it.
//!
//! Why `mbind` on a mapping and not `set_mempolicy`: a tmpfs file is shmem, and `mbind` on
//! a shared shmem mapping sets the *file's* shared policy for that range (`shmem_set_policy`),
//! so every later fault through any process's mapping follows it too, while a thread's
//! `set_mempolicy` governs only that thread's faults. The daemon faults every page in
//! (`MADV_POPULATE_WRITE`, or a store per page on kernels before 5.14) so the memory is
//! committed on the node before the client gets the descriptor, and reads each page's node
//! back with `move_pages(2)` (a null `nodes` array: query only).

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Why a node-bound region file could not be made or checked.
#[derive(Debug, thiserror::Error)]
pub enum NodeFdError {
    /// Creating or opening the file.
    #[error("opening the region file")]
    Create(#[source] std::io::Error),
    /// `ftruncate` to the region's length.
    #[error("sizing the region file to {len} bytes")]
    Size {
        /// Bytes.
        len: u64,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `mmap` of the file.
    #[error("mapping the region file")]
    Map(#[source] std::io::Error),
    /// `mbind(MPOL_BIND)`.
    #[error("binding the memfd's pages to node {node}")]
    Bind {
        /// The node.
        node: u32,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Faulting the pages in failed (the node ran out of memory).
    #[error("allocating the pages on node {node}")]
    Populate {
        /// The node.
        node: u32,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The pages could not be read in to be checked (a page past the file's end, a poisoned
    /// page).
    #[error("reading the region file's pages in")]
    Read(#[source] std::io::Error),
    /// `move_pages` could not report placement.
    #[error("reading the pages' nodes (move_pages)")]
    Query(#[source] std::io::Error),
    /// A page is not on the node (or not present: a negative errno).
    #[error("page {page} is on node {found}, not {node}")]
    Misplaced {
        /// The node asked for.
        node: u32,
        /// Page index in the region.
        page: u64,
        /// What `move_pages` reported for it.
        found: i32,
    },
}

/// A shared mapping of a region file, unmapped on drop.
struct Mapping {
    addr: *mut libc::c_void,
    len: usize,
}

impl Mapping {
    fn new(fd: &OwnedFd, len: usize) -> Result<Self, NodeFdError> {
        // SAFETY: a fresh shared mapping chosen by the kernel (no MAP_FIXED) touches no
        // existing memory; `fd` is a live file of at least `len` bytes.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(NodeFdError::Map(std::io::Error::last_os_error()));
        }
        Ok(Self { addr, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `addr`/`len` are exactly the mapping `new` made, and no reference into it
        // outlives `self` (only raw pointers were used).
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// A new file `path` (mode 0600; it must not exist) of `len` bytes (a multiple of the page
/// size), on tmpfs, every page allocated on NUMA node `node` through the file's shared policy
/// and checked to be there. On failure the file is removed.
pub fn node_file(path: &Path, len: u64, node: u32) -> Result<OwnedFd, NodeFdError> {
    let made = (|| {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(NodeFdError::Create)?;
        f.set_len(len).map_err(|source| NodeFdError::Size { len, source })?;
        let fd = OwnedFd::from(f);
        let ulen = usize::try_from(len)
            .map_err(|_| NodeFdError::Size { len, source: std::io::ErrorKind::InvalidInput.into() })?;
        let map = Mapping::new(&fd, ulen)?;
        bind(&map, node)?;
        populate(&map, node)?;
        check_placement(&map, node)?;
        Ok(fd)
    })();
    if made.is_err() {
        let _ = std::fs::remove_file(path);
    }
    made
}

/// Checks that every page of `fd`'s first `len` bytes is on `node` (a restarted daemon's
/// check of a region file it finds).
pub fn check_file(fd: &OwnedFd, len: u64, node: u32) -> Result<(), NodeFdError> {
    for (page, found) in page_nodes(fd, len)?.into_iter().enumerate() {
        if found != node as libc::c_int {
            return Err(NodeFdError::Misplaced { node, page: page as u64, found });
        }
    }
    Ok(())
}

fn bind(map: &Mapping, node: u32) -> Result<(), NodeFdError> {
    let bits = libc::c_ulong::BITS as usize;
    let idx = node as usize;
    let mut mask = vec![0 as libc::c_ulong; idx / bits + 1];
    mask[idx / bits] |= 1 << (idx % bits);
    // The kernel reads `maxnode - 1` bits (a historical off-by-one libnuma also allows for).
    let maxnode = (mask.len() * bits + 1) as libc::c_ulong;
    // SAFETY: the range is the mapping `map` owns; `mask` holds `maxnode - 1` bits and lives
    // across the call; mbind does not touch the mapping's contents.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            map.addr,
            map.len as libc::c_ulong,
            libc::MPOL_BIND as libc::c_ulong,
            mask.as_ptr(),
            maxnode,
            0 as libc::c_ulong,
        )
    };
    if r != 0 {
        return Err(NodeFdError::Bind { node, source: std::io::Error::last_os_error() });
    }
    Ok(())
}

fn populate(map: &Mapping, node: u32) -> Result<(), NodeFdError> {
    // SAFETY: advice on the mapping `map` owns; POPULATE_WRITE only faults its pages in.
    if unsafe { libc::madvise(map.addr, map.len, libc::MADV_POPULATE_WRITE) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EINVAL) {
        return Err(NodeFdError::Populate { node, source: e });
    }
    // Before 5.14: a store of zero to the first byte of each page (the page is new and
    // zero-filled, so its contents do not change).
    let step = page_size();
    let base = map.addr.cast::<u8>();
    for off in (0..map.len).step_by(step) {
        // SAFETY: `off < len`, inside the mapping `map` owns, which is writable; volatile
        // because the store is made for its fault, not its value.
        unsafe { base.add(off).write_volatile(0) };
    }
    Ok(())
}

/// Chunk of pages asked about per `move_pages` call.
const QUERY_PAGES: usize = 4096;

fn check_placement(map: &Mapping, node: u32) -> Result<(), NodeFdError> {
    let step = page_size();
    let pages = map.len / step;
    let base = map.addr.cast::<u8>();
    let mut ptrs: Vec<*mut libc::c_void> = Vec::with_capacity(QUERY_PAGES.min(pages));
    let mut status: Vec<libc::c_int> = vec![0; QUERY_PAGES.min(pages)];
    for first in (0..pages).step_by(QUERY_PAGES) {
        let n = QUERY_PAGES.min(pages - first);
        ptrs.clear();
        // `wrapping_add` only computes addresses inside the mapping; nothing is dereferenced.
        ptrs.extend((first..first + n).map(|p| base.wrapping_add(p * step).cast::<libc::c_void>()));
        // SAFETY: `ptrs` and `status` hold `n` entries and live across the call; a null
        // `nodes` array makes move_pages report each page's node and move nothing; pid 0 is
        // this process.
        let r = unsafe {
            libc::syscall(
                libc::SYS_move_pages,
                0 as libc::c_long,
                n as libc::c_ulong,
                ptrs.as_ptr(),
                std::ptr::null::<libc::c_int>(),
                status.as_mut_ptr(),
                0 as libc::c_int,
            )
        };
        if r != 0 {
            return Err(NodeFdError::Query(std::io::Error::last_os_error()));
        }
        if let Some(i) = status[..n].iter().position(|&s| s != node as libc::c_int) {
            return Err(NodeFdError::Misplaced { node, page: (first + i) as u64, found: status[i] });
        }
    }
    Ok(())
}

/// The NUMA node of each page of `fd`'s first `len` bytes, read through a fresh shared
/// mapping with `move_pages` (a hole of the file reads as `-ENOENT`, or, on kernels before
/// 5.14, is filled by the read fault).
pub fn page_nodes(fd: &OwnedFd, len: u64) -> Result<Vec<i32>, NodeFdError> {
    let ulen =
        usize::try_from(len).map_err(|_| NodeFdError::Map(std::io::Error::from(std::io::ErrorKind::InvalidInput)))?;
    let map = Mapping::new(fd, ulen)?;
    let step = page_size();
    let base = map.addr.cast::<u8>();
    // The fresh mapping has no page table entries yet (move_pages would say ENOENT): map
    // the file's pages in without allocating any.
    // SAFETY: advice on the mapping `map` owns; POPULATE_READ only maps pages in.
    if unsafe { libc::madvise(map.addr, map.len, libc::MADV_POPULATE_READ) } != 0 {
        let e = std::io::Error::last_os_error();
        // Only a kernel without POPULATE_READ (before 5.14: EINVAL) gets the loads below.
        // Any other error — EFAULT for a page past a file someone shrank, EHWPOISON for a
        // poisoned page — is where a load would raise SIGBUS in the daemon: an error here.
        if e.raw_os_error() != Some(libc::EINVAL) {
            return Err(NodeFdError::Read(e));
        }
        let size = std::fs::File::from(fd.try_clone().map_err(NodeFdError::Read)?)
            .metadata()
            .map_err(NodeFdError::Read)?
            .len();
        if size < len {
            return Err(NodeFdError::Read(std::io::Error::other(format!("the file has {size} bytes, not {len}"))));
        }
        for off in (0..map.len).step_by(step) {
            // SAFETY: `off < len`, inside the readable mapping `map` owns; read for its fault.
            unsafe { base.add(off).read_volatile() };
        }
    }
    let ptrs: Vec<*mut libc::c_void> =
        (0..ulen / step).map(|p| base.wrapping_add(p * step).cast::<libc::c_void>()).collect();
    let mut status: Vec<libc::c_int> = vec![0; ptrs.len()];
    for (p, s) in ptrs.chunks(QUERY_PAGES).zip(status.chunks_mut(QUERY_PAGES)) {
        // SAFETY: as in `check_placement`: `p` and `s` have the same length and live across
        // the call; query only.
        let r = unsafe {
            libc::syscall(
                libc::SYS_move_pages,
                0 as libc::c_long,
                p.len() as libc::c_ulong,
                p.as_ptr(),
                std::ptr::null::<libc::c_int>(),
                s.as_mut_ptr(),
                0 as libc::c_int,
            )
        };
        if r != 0 {
            return Err(NodeFdError::Query(std::io::Error::last_os_error()));
        }
    }
    Ok(status)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A tmpfs directory for the test's files (`None`: /dev/shm is not tmpfs here).
    fn shm_dir() -> Option<tempfile::TempDir> {
        tempfile::tempdir_in("/dev/shm").ok()
    }

    #[test]
    fn a_node_file_is_on_its_node_and_stays_there_without_its_maker() {
        let Some(dir) = shm_dir() else { return };
        let len = 4u64 << 20;
        let path = dir.path().join("r1");
        let fd = match node_file(&path, len, 0) {
            Ok(fd) => fd,
            // A kernel without NUMA support refuses mbind: nothing to check here.
            Err(NodeFdError::Bind { source, .. }) if source.raw_os_error() == Some(libc::ENOSYS) => return,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(std::fs::metadata(&path).unwrap().len(), len);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let nodes = page_nodes(&fd, len).unwrap();
        assert_eq!(nodes.len() as u64, len / page_size() as u64);
        assert!(nodes.iter().all(|&n| n == 0), "{:?}", &nodes[..8]);
        // Closed and opened again (as a restarted daemon does): still there, still checked.
        drop(fd);
        let again = OwnedFd::from(std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap());
        check_file(&again, len, 0).unwrap();
        // Asked about another node, the same pages are misplaced.
        assert!(matches!(check_file(&again, len, 1), Err(NodeFdError::Misplaced { node: 1, page: 0, found: 0 })));
        // An existing file is never overwritten.
        assert!(matches!(node_file(&path, len, 0), Err(NodeFdError::Create(_))));
    }

    #[test]
    fn a_node_that_does_not_exist_is_refused_and_leaves_no_file() {
        let Some(dir) = shm_dir() else { return };
        let path = dir.path().join("r2");
        // Node 1000 exists on no test machine (MAX_NUMNODES allows it on some kernels).
        let e = node_file(&path, 2 << 20, 1000).unwrap_err();
        assert!(matches!(e, NodeFdError::Bind { node: 1000, .. }), "{e}");
        assert!(!path.exists());
    }
}
