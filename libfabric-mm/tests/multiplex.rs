//! The connection's multiplexing (src/client.rs): many threads calling on one session each
//! get their own answers while whichever waits reads for the others, and events reach the
//! session both while callers read and while it is idle.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use fabric_mm::{Memory, MemoryClass, Policy, Target};

#[test]
fn many_threads_on_one_session_get_their_own_answers_and_events_still_arrive() {
    let d = common::daemon();
    let owner = common::session(&d.socket);
    let s = common::session(&d.socket);
    let gpu = common::gpu(&owner);
    let revoked = Arc::new(AtomicU64::new(0));
    let (tx, rx) = mpsc::channel();
    let seen = revoked.clone();
    s.on_revocation(move |r| {
        seen.fetch_add(1, Ordering::SeqCst);
        let _ = tx.send(r.region);
    });

    // Each thread imports its own region and checks it got that one, among pings.
    let regions: Vec<_> = (0..8)
        .map(|_| owner.alloc(&Target::Device { device: gpu.clone(), memory: MemoryClass::Hbm }, 2 << 20).unwrap())
        .collect();
    let handles: Vec<_> = regions.iter().map(|r| owner.export(r, &Policy::default()).unwrap()).collect();
    let threads: Vec<_> = handles
        .iter()
        .map(|h| {
            let (s, h) = (s.clone(), *h);
            std::thread::spawn(move || {
                for _ in 0..50 {
                    s.ping().unwrap();
                    let i = s.import(&h, false).unwrap();
                    assert_eq!(i.id(), h.region());
                }
                s.import(&h, false).unwrap()
            })
        })
        .collect();
    let imports: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();

    // A revocation while other threads keep calling (a caller reads the event)...
    let pinger = {
        let s = s.clone();
        std::thread::spawn(move || {
            for _ in 0..300 {
                s.ping().unwrap();
            }
        })
    };
    owner.revoke(&handles[0]).unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), regions[0].id());
    pinger.join().unwrap();
    // ...and one while the session is idle (the background reader reads it).
    std::thread::sleep(Duration::from_millis(100));
    owner.revoke(&handles[1]).unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), regions[1].id());
    assert!(imports[1].check().is_err(), "marked revoked");
    assert_eq!(revoked.load(Ordering::SeqCst), 2);
}
