//! The endpoints `bench copy` copies between — two regions (by registration and by GFA),
//! two sealed memfds of fabricctl's registered, and fabricctl's own locked memory
//! registered as process memory — and the two ways a copy is timed:
//! one at a time (request to `CopyDone`) and pipelined (`depth` copies in flight).

use std::collections::HashSet;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocTarget, BoundedVec, Connection, CopyBatchRequest, CopyEndpoint, CopyRequest,
    CopyResult, DeviceName, Event, FrameKind, Header, MAX_BATCH, MemoryClass, Message, Opcode, RegisterRequest,
    RegisterSource, Request, Response, recv_message, send_message,
};

use super::{CopyBenchError, call_err, io_err};

/// A region's GFA and, when the daemon could pin it, its registration.
pub(super) struct Region {
    pub gfa: u64,
    pub registration: Option<u64>,
}

fn register(c: &mut Connection, device: &str, source: RegisterSource, len: u64, fd: Option<&OwnedFd>) -> Option<u64> {
    let req = Request::Register(RegisterRequest {
        device: DeviceName::truncated(device),
        source,
        offset: 0,
        len,
        access: AccessMode::ReadWrite,
        node: None,
    });
    let fds: Vec<_> = fd.iter().map(|f| f.as_fd()).collect();
    match c.call(req, &fds) {
        Ok((Response::Register(r), _)) => Some(r.registration),
        // Pinning refused (RLIMIT_MEMLOCK without CAP_IPC_LOCK).
        _ => None,
    }
}

/// Allocates an HBM region of `size` bytes on `device` and registers it.
pub(super) fn region(c: &mut Connection, device: &str, size: u64) -> Result<Region, CopyBenchError> {
    let req = Request::Alloc(AllocRequest {
        target: AllocTarget::Device { device: DeviceName::truncated(device), memory: MemoryClass::Hbm },
        size,
        align: 0,
    });
    let (resp, _fds) = c.call(req, &[]).map_err(call_err("alloc"))?;
    let Response::Alloc(a) = resp else { return Err(CopyBenchError::Unexpected("alloc answer")) };
    let gfa = a.gfa.ok_or(CopyBenchError::Unexpected("a region without a GFA"))?;
    let registration = register(c, device, RegisterSource::Region(a.region), size, None);
    Ok(Region { gfa, registration })
}

/// A memfd of `size` bytes sealed against shrinking and growing (and further sealing),
/// registered on `device`: memory the daemon may copy with the CPU. The descriptor is
/// kept open for the registration's life. `None` when the daemon could not pin it.
pub(super) fn sealed_memfd(
    c: &mut Connection,
    device: &str,
    size: u64,
) -> Result<Option<(OwnedFd, u64)>, CopyBenchError> {
    // SAFETY: a NUL-terminated name and flags; returns a new descriptor or -1.
    let fd =
        unsafe { libc::memfd_create(c"fabricctl-bench-copy".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io_err("memfd_create")(std::io::Error::last_os_error()));
    }
    // SAFETY: the descriptor was just made and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    File::from(fd.try_clone().map_err(io_err("dup of the memfd"))?)
        .set_len(size)
        .map_err(io_err("sizing the memfd"))?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS takes an int and touches no memory of ours.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io_err("sealing the memfd")(std::io::Error::last_os_error()));
    }
    Ok(register(c, device, RegisterSource::Fd, size, Some(&fd)).map(|id| (fd, id)))
}

/// `len` bytes of fabricctl's own anonymous memory, locked (`mlock`), unmapped on drop:
/// what a client registers as process memory (`RegisterSource::Process`), which the
/// daemon reaches with `process_vm_readv`/`writev`.
pub(super) struct Locked {
    addr: *mut libc::c_void,
    len: usize,
}

impl Drop for Locked {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `locked` with this length and nothing else
        // unmaps it; no reference into it outlives `self`.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

/// `size` bytes of fabricctl's memory, locked and registered as process memory on
/// `device`. `None` when they could not be locked (RLIMIT_MEMLOCK) or registered.
pub(super) fn process_memory(
    c: &mut Connection,
    device: &str,
    size: u64,
) -> Result<Option<(Locked, u64)>, CopyBenchError> {
    let len = usize::try_from(size).map_err(|_| CopyBenchError::Options(format!("{size} bytes do not fit")))?;
    // SAFETY: a new private anonymous mapping; no address of ours is passed.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(io_err("mapping process memory")(std::io::Error::last_os_error()));
    }
    let mem = Locked { addr, len };
    // SAFETY: the range is the mapping just made, whole; locking faults it in.
    if unsafe { libc::mlock(mem.addr, mem.len) } != 0 {
        return Ok(None);
    }
    Ok(register(c, device, RegisterSource::Process { addr: addr as u64 }, size, None).map(|id| (mem, id)))
}

/// Issues one copy; returns its id.
fn issue(c: &mut Connection, dst: CopyEndpoint, src: CopyEndpoint, len: u64) -> Result<u64, CopyBenchError> {
    let (resp, _) = c.call(Request::Copy(CopyRequest { dst, src, len }), &[]).map_err(call_err("copy"))?;
    let Response::Copy(r) = resp else { return Err(CopyBenchError::Unexpected("copy answer")) };
    Ok(r.copy)
}

/// Waits for the completion of one of `ids` and takes it out; an incomplete copy is an error.
fn complete(c: &mut Connection, ids: &mut HashSet<u64>, len: u64) -> Result<(), CopyBenchError> {
    loop {
        if let Event::CopyDone(d) = c.next_event().map_err(call_err("copy completion"))?
            && ids.remove(&d.copy)
        {
            return match d.result {
                CopyResult::Ok if d.bytes == len => Ok(()),
                result => Err(CopyBenchError::CopyFailed { len, result }),
            };
        }
    }
}

/// One copy at a time: request to completion.
pub(super) fn one_copy(
    c: &mut Connection,
    dst: CopyEndpoint,
    src: CopyEndpoint,
    len: u64,
) -> Result<Duration, CopyBenchError> {
    let t = Instant::now();
    let id = issue(c, dst, src, len)?;
    complete(c, &mut HashSet::from([id]), len)?;
    Ok(t.elapsed())
}

/// Request ids of pipelined copies: far above those the connection numbers its calls with.
const PIPE_IDS: u64 = 1 << 48;

/// `requests` requests with `depth` in flight, each one copy of `len` bytes (`batch` 1:
/// `Copy`) or `batch` of them (`CopyBatch`), all of the same ranges (the working set of
/// the memcpy baseline): the wall time of them all. Requests are written without waiting
/// for their answers — a queue the client keeps full, as a DMA engine's ring is — and a
/// new one goes as each completes. Every answer and completion is read before returning,
/// so that `c` is left with nothing pending; no other copy may be in flight on `c`.
pub(super) fn pipelined(
    c: &mut Connection,
    (dst, src): (CopyEndpoint, CopyEndpoint),
    len: u64,
    depth: usize,
    requests: usize,
    batch: usize,
) -> Result<Duration, CopyBenchError> {
    let one = CopyRequest { dst, src, len };
    let (op, req) = if batch <= 1 {
        (Opcode::Copy, Request::Copy(one))
    } else {
        let copies = BoundedVec::new(vec![one; batch])
            .map_err(|_| CopyBenchError::Options(format!("a batch holds at most {MAX_BATCH} copies")))?;
        (Opcode::CopyBatch, Request::CopyBatch(CopyBatchRequest { copies }))
    };
    let bytes = len * batch.max(1) as u64;
    let req = Message::Request(req);
    let t = Instant::now();
    let (mut issued, mut answered, mut done) = (0, 0, 0);
    while done < requests || answered < requests {
        while issued < requests && issued - done < depth {
            let id = PIPE_IDS + issued as u64;
            let header = Header { version: c.version(), ..Header::new(op, FrameKind::Request, id) };
            send_message(c.stream(), &header, &req, &[]).map_err(call_err("copy"))?;
            issued += 1;
        }
        match recv_message(c.stream()).map_err(call_err("copy answer"))? {
            (h, Message::Response(Response::Copy(_) | Response::CopyBatch(_)), _) if h.request_id >= PIPE_IDS => {
                answered += 1
            }
            (_, Message::Event(Event::CopyDone(d)), _) => match d.result {
                CopyResult::Ok if d.bytes == bytes => done += 1,
                result => return Err(CopyBenchError::CopyFailed { len: bytes, result }),
            },
            (_, Message::Error(_), _) => return Err(CopyBenchError::Unexpected("a pipelined copy was refused")),
            _ => {}
        }
    }
    Ok(t.elapsed())
}
