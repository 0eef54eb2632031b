//! The copy path a copy engine will use: `(device, iova, len)` resolved back to the
//! registered memory and read or written — a memory object the daemon pinned, a region,
//! and this process's own locked memory (reached with `process_vm_readv`/`writev`) —
//! with read-only registrations, unregistered ranges and undone registrations refused.
#![allow(clippy::unwrap_used)]

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;

use fabric_proto::wire::AccessMode;
use fabric_topology::{DeviceKind, MemoryKind};
use fabricd::config::LimitsConfig;
use fabricd::dma::{DmaError, target_of};
use fabricd::memory::{Identity, Memory, Place, Source};
use fabricd::transport::peer::Process;

fn memfd(len: u64) -> File {
    let name = CString::new("dma-copy").unwrap();
    // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: the descriptor was just created and is owned by nothing else.
    let f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    f.set_len(len).unwrap();
    f
}

fn me() -> Identity {
    // SAFETY: getuid/getgid have no preconditions.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    Identity { pid: std::process::id() as i32, uid, gid }
}

#[test]
fn registered_memory_is_reached_by_device_and_iova() {
    let sim = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml");
    let inv = fabric_drivers::sim::load(&sim).unwrap();
    let gpu = inv.devices.iter().find(|d| d.kind == DeviceKind::Gpu).unwrap();
    let t = target_of(gpu);
    let dir = tempfile::tempdir().unwrap();
    let mem = Memory::open(dir.path(), &inv, LimitsConfig::default()).unwrap();
    let peer = me();

    // A memory object: bytes 100.. of a memfd.
    let f = memfd(64 << 10);
    let pattern: Vec<u8> = (0..64u32 << 10).map(|i| (i * 7 % 251) as u8).collect();
    f.write_all_at(&pattern, 0).unwrap();
    let fd = OwnedFd::from(f.try_clone().unwrap());
    let r = mem.register(&peer, 1, &t, Source::Fd(fd), 100, 10_000, AccessMode::ReadWrite, &|| None).unwrap();
    let mut got = vec![0u8; 10_000];
    mem.dma_read(&t, r.iova, &mut got).unwrap();
    assert_eq!(got, pattern[100..10_100]);
    mem.dma_write(&t, r.iova + 5, b"hello").unwrap();
    let mut back = [0u8; 5];
    f.read_exact_at(&mut back, 105).unwrap();
    assert_eq!(&back, b"hello");

    // A region of the device, read-only for the device.
    let place = Place { device: gpu.id.clone(), kind: MemoryKind::Hbm, ordinal: None };
    let g = mem.alloc(&peer, 1, &place, 1 << 20, 0).unwrap();
    File::from(g.fd).write_all_at(b"region bytes", 4096).unwrap();
    let ro = mem.register(&peer, 1, &t, Source::Region(g.region), 4096, 12, AccessMode::ReadOnly, &|| None).unwrap();
    let mut got = [0u8; 12];
    mem.dma_read(&t, ro.iova, &mut got).unwrap();
    assert_eq!(&got, b"region bytes");
    assert!(matches!(mem.dma_write(&t, ro.iova, b"x"), Err(DmaError::ReadOnly(id)) if id == ro.registration));

    // This process's own locked memory.
    let mut own = memmap2::MmapMut::map_anon(8192).unwrap();
    own[..4].copy_from_slice(b"mine");
    // SAFETY: locks the mapping just made, 8192 bytes; it stays mapped until the end.
    assert_eq!(unsafe { libc::mlock(own.as_ptr().cast(), 8192) }, 0);
    let addr = own.as_ptr() as u64;
    let p = mem
        .register(
            &peer,
            1,
            &t,
            Source::Process { addr, process: Process::this().unwrap() },
            0,
            8192,
            AccessMode::ReadWrite,
            &|| None,
        )
        .unwrap();
    let mut got = [0u8; 4];
    mem.dma_read(&t, p.iova, &mut got).unwrap();
    assert_eq!(&got, b"mine");
    mem.dma_write(&t, p.iova + 4, b"!!").unwrap();
    // The write went through the kernel while no reference to the bytes was held.
    assert_eq!(&own[..6], b"mine!!");

    // Ranges no registration covers whole, in this domain or another.
    let end = r.iova - 100 + 12_288;
    assert!(matches!(mem.dma_read(&t, end - 2, &mut [0u8; 4]), Err(DmaError::NotRegistered { .. })));
    let other = inv.devices.iter().filter(|d| d.kind == DeviceKind::Gpu).nth(1).unwrap();
    assert!(matches!(mem.dma_read(&target_of(other), p.iova, &mut [0u8; 1]), Err(DmaError::NotRegistered { .. })));
    assert_eq!(mem.counts().registrations, 3);

    // Undone: unregister, and freeing the region.
    mem.unregister(1, p.registration).unwrap();
    assert!(matches!(mem.dma_read(&t, p.iova, &mut [0u8; 1]), Err(DmaError::NotRegistered { .. })));
    mem.free(1, g.region).unwrap();
    assert!(matches!(mem.dma_read(&t, ro.iova, &mut [0u8; 1]), Err(DmaError::NotRegistered { .. })));
    let left = mem.close_session(1);
    assert_eq!(left.registrations, 1);
    assert_eq!((mem.counts().registrations, mem.counts().pinned_bytes), (0, 0));
}
