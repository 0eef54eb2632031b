//! No request waits behind another client's slow allocation: while one client's 1 GiB
//! region on a DAX device (a regular-file stand-in, which fabricd zeroes whole before
//! handing it out) is being made, other clients' Status, Regions and Alloc are answered.
//! The real daemon and real clients.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    AllocRequest, AllocTarget, Connection, DeviceName, FreeRequest, MemoryClass, RegionsRequest, Request, ResourceName,
    Response, StatusRequest,
};

use common::{on_set, two_way_set};

const GIB: u64 = 1 << 30;

fn call(c: &mut Connection, req: Request) -> Response {
    c.call(req, &[]).unwrap().0
}

#[test]
fn others_are_answered_while_an_allocation_zeroes_device_memory() {
    let (_, _, member) = two_way_set();
    let (setup, set) = common::dax_backed_set("[limits]\nallocated_bytes_per_uid = 1099511627776\n");
    let _d = common::start(&setup.config, setup.dir.path());
    let mut slow = common::client(&setup.socket);
    let mut other = common::client(&setup.socket);

    let done = Arc::new(AtomicBool::new(false));
    let flag = done.clone();
    let allocating = std::thread::spawn(move || {
        let t0 = Instant::now();
        let req = Request::Alloc(AllocRequest { target: on_set(&set), size: GIB, align: 0 });
        let (r, _fds) = slow.call(req, &[]).unwrap();
        flag.store(true, Ordering::SeqCst);
        assert!(matches!(r, Response::Alloc(_)), "{r:?}");
        t0.elapsed()
    });
    // Let the allocation reach its zeroing (it takes far longer than this).
    std::thread::sleep(Duration::from_millis(300));
    let (mut answered, mut slowest) = (0u32, Duration::ZERO);
    let mut other_alloc = false;
    while !done.load(Ordering::SeqCst) {
        let t = Instant::now();
        let r = match answered % 3 {
            0 => call(&mut other, Request::Status(StatusRequest {})),
            1 => call(&mut other, Request::Regions(RegionsRequest { all: false })),
            _ => {
                // A region on another resource: a member of the set, outside the set's range.
                let target = AllocTarget::Resource(ResourceName {
                    device: DeviceName::truncated(&member),
                    memory: MemoryClass::CxlVolatile,
                    ordinal: 0,
                });
                let req = Request::Alloc(AllocRequest { target, size: 2 << 20, align: 0 });
                let (r, _fds) = other.call(req, &[]).unwrap();
                if let Response::Alloc(a) = &r {
                    call(&mut other, Request::Free(FreeRequest { region: a.region, node: None }));
                    other_alloc = true;
                }
                r
            }
        };
        // An error answer is an `Err` of `call`, unwrapped above.
        drop(r);
        if done.load(Ordering::SeqCst) {
            // Answered only once the allocation was: it waited for it.
            break;
        }
        answered += 1;
        slowest = slowest.max(t.elapsed());
    }
    let took = allocating.join().unwrap();
    assert!(
        answered >= 6 && other_alloc,
        "{answered} requests answered during a {took:?} allocation (an allocation on another resource among them: {other_alloc})"
    );
    assert!(slowest * 4 < took, "the slowest answer took {slowest:?}, the allocation {took:?}");
}
