//! Oversized input is refused before it is allocated: a counting allocator records the
//! largest single allocation while a frame announcing 4 GiB, and bodies announcing huge
//! lists and strings, are read.

#![allow(clippy::unwrap_used)] // Helpers outside #[test] fns: a panic there is a failed test.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use fabric_proto::wire::*;

struct Counting;

thread_local! {
    /// Whether this thread's allocations are being counted: only the measured closure's
    /// thread, so that the test harness's own threads (busy on a loaded machine) never
    /// count. A `const` cell without a destructor: reading it never allocates.
    static TRACKING: Cell<bool> = const { Cell::new(false) };
}

/// Whether the current thread's allocations count now.
fn tracking() -> bool {
    TRACKING.try_with(Cell::get).unwrap_or(false)
}

static LARGEST: AtomicUsize = AtomicUsize::new(0);
/// Allocations (and reallocations) while tracking.
static COUNT: AtomicUsize = AtomicUsize::new(0);
/// Tests in this file run one at a time so that the measurements do not mix.
static SERIAL: Mutex<()> = Mutex::new(());

// SAFETY: defers every call to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if tracking() {
            LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
            COUNT.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours, passed through.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from System.alloc with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if tracking() {
            LARGEST.fetch_max(new_size, Ordering::Relaxed);
            COUNT.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as ours, passed through.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The largest allocation `f` makes.
fn largest_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.store(0, Ordering::Relaxed);
    COUNT.store(0, Ordering::Relaxed);
    TRACKING.with(|t| t.set(true));
    let r = f();
    TRACKING.with(|t| t.set(false));
    (r, LARGEST.load(Ordering::Relaxed))
}

fn header_announcing(opcode: Opcode, kind: FrameKind, body_len: u32) -> [u8; HEADER_LEN] {
    let mut raw = Header::new(opcode, kind, 1).to_raw();
    raw.body_len = body_len.into();
    let mut out = [0u8; HEADER_LEN];
    out.copy_from_slice(zerocopy::IntoBytes::as_bytes(&raw));
    out
}

#[test]
fn a_frame_announcing_4_gib_is_refused_without_allocating() {
    let _g = SERIAL.lock().unwrap();
    for (opcode, kind) in [(Opcode::Topology, FrameKind::Response), (Opcode::Alloc, FrameKind::Request)] {
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(&header_announcing(opcode, kind, u32::MAX)).unwrap();
        (&a).write_all(&[0u8; 64]).unwrap();
        let (r, largest) = largest_allocation(|| recv_frame(&b));
        match r {
            Err(CodecError::Frame(FrameError::BodyTooLarge { len, max, .. })) => {
                assert_eq!(len, u64::from(u32::MAX));
                assert!(max <= MAX_BODY);
            }
            other => panic!("{other:?}"),
        }
        assert!(largest < 16 << 10, "largest allocation {largest} bytes");
    }
}

#[test]
fn a_body_announcing_a_huge_list_allocates_little() {
    let _g = SERIAL.lock().unwrap();
    // Translate: a varint count of 2^32 - 1 queries followed by nothing.
    let body = [0xff, 0xff, 0xff, 0xff, 0x0f];
    let (r, largest) = largest_allocation(|| decode_request(Opcode::Translate, &body));
    assert!(r.is_err());
    assert!(largest < 4 << 10, "largest allocation {largest} bytes");
    // Partitions response: 1,000 partitions announced, each claims 2^32 devices.
    let mut body = vec![0xe8, 0x07];
    for _ in 0..1000 {
        body.extend_from_slice(&[0, 0xff, 0xff, 0xff, 0xff, 0x0f]);
    }
    let (r, largest) = largest_allocation(|| decode_response(Opcode::Partitions, &body));
    assert!(r.is_err());
    assert!(largest < 16 << 10, "largest allocation {largest} bytes");
}

#[test]
fn a_body_announcing_a_huge_string_allocates_little() {
    let _g = SERIAL.lock().unwrap();
    // Error body: code 0, then a message announced as 2^32 - 1 bytes.
    let body = [0, 0xff, 0xff, 0xff, 0xff, 0x0f, b'a', b'b'];
    let (r, largest) = largest_allocation(|| decode_error(Opcode::Hello, &body));
    assert!(r.is_err());
    assert!(largest < 1 << 10, "largest allocation {largest} bytes");
    // A document's JSON (an unbounded String, bounded by the frame) announced past the end.
    let body = [3, b'a', b'b', b'c', 0xff, 0xff, 0xff, 0xff, 0x0f, b'{'];
    let (r, largest) = largest_allocation(|| decode_response(Opcode::Topology, &body));
    assert!(r.is_err());
    assert!(largest < 1 << 10, "largest allocation {largest} bytes");
}

#[test]
fn the_counter_sees_large_allocations() {
    let _g = SERIAL.lock().unwrap();
    // Another thread allocating all the while (as the harness's may on a loaded machine)
    // is not counted.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (busy, started) = (stop.clone(), std::sync::Arc::new(std::sync::Barrier::new(2)));
    let go = started.clone();
    let other = std::thread::spawn(move || {
        go.wait();
        while !busy.load(Ordering::Relaxed) {
            std::hint::black_box(vec![0u8; 4 << 20]);
        }
    });
    started.wait();
    let (v, largest) = largest_allocation(|| {
        std::thread::sleep(std::time::Duration::from_millis(20));
        vec![1u8; 1 << 20]
    });
    stop.store(true, Ordering::Relaxed);
    other.join().unwrap();
    assert_eq!(v.len(), 1 << 20);
    assert!((1 << 20..4 << 20).contains(&largest), "largest allocation {largest} bytes");
    assert_eq!(COUNT.load(Ordering::Relaxed), 1);
}

#[test]
fn a_warm_decoder_allocates_nothing_per_frame() {
    let _g = SERIAL.lock().unwrap();
    let mut stream = Vec::new();
    for id in 1..=200 {
        let h = Header::new(Opcode::Free, FrameKind::Request, id);
        encode_frame(&h, &[7; 9], &mut stream).unwrap();
    }
    let mut d = FrameDecoder::<std::os::fd::OwnedFd>::new(DecoderConfig::SERVER);
    // Warm: the buffer reaches its working size on the first read.
    let n = d.push(&stream[..100], Vec::new(), false);
    let mut at = n;
    let (frames, _) = largest_allocation(|| {
        let mut frames = 0;
        loop {
            while let Some(r) = d.next_frame() {
                assert!(r.is_ok_and(|f| f.body == [7; 9]));
                frames += 1;
            }
            if at == stream.len() {
                return frames;
            }
            at += d.push(&stream[at..(at + 333).min(stream.len())], Vec::new(), false);
        }
    });
    assert_eq!(frames, 200);
    assert_eq!(COUNT.load(Ordering::Relaxed), 0, "the decoder allocated while framing");
}
