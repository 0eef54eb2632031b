//! Resume by token after a dropped connection (not a dead process), against a real fabricd:
//! with `memory.detach_grace_s` set, the regions and exports of a session whose connection
//! closed survive for a new session that presents the token, which then owns them; without
//! a resume they are reclaimed after the grace period; with the default (0) at once.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use fabric_mm::{Error, MemoryClass, Policy, Session, SessionConfig, Target, WindowConfig};

fn open(socket: &std::path::Path, resume: Option<fabric_mm::Token>) -> fabric_mm::Result<Session> {
    Session::open_with(SessionConfig {
        socket: Some(socket.to_owned()),
        window: Some(WindowConfig::default()),
        client_name: Some("resume-test".into()),
        resume,
        ..SessionConfig::default()
    })
}

/// Waits until `f` holds (the daemon notices a closed connection asynchronously).
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_dropped_connection_resumes_by_token_with_its_regions_and_exports() {
    let d = common::daemon_with_config("[memory]\ndetach_grace_s = 60\n");
    let owner = common::session(&d.socket);
    let importer = common::session(&d.socket);
    let gpu = common::gpu(&owner);
    let region = owner.alloc(&Target::Device { device: gpu, memory: MemoryClass::Hbm }, 1 << 20).unwrap();
    let m = owner.map(&region).unwrap();
    // SAFETY: the mapping is this process's own and nothing else writes it.
    unsafe { std::ptr::write_volatile(m.as_ptr().add(4096), 0x5A) };
    let handle = owner.export(&region, &Policy::default()).unwrap();
    let token = owner.token().expect("fabricd speaks 1.1");
    assert_eq!(token.to_string().parse::<fabric_mm::Token>().unwrap(), token);

    owner.disconnect();
    assert!(matches!(owner.ping(), Err(Error::Disconnected)));
    // The daemon kept the region and its export: it still imports, with the contents.
    std::thread::sleep(Duration::from_millis(200));
    let imp = importer.import(&handle, false).unwrap();
    let seen = importer.map(&imp).unwrap();
    // SAFETY: read-only look at shared memory no one writes now.
    assert_eq!(unsafe { std::ptr::read_volatile(seen.as_ptr().add(4096)) }, 0x5A);
    drop(seen);
    drop(imp);

    // A new connection takes the session back, keeps its token, and owns the export.
    let back = open(&d.socket, Some(token)).unwrap();
    assert_eq!(back.token(), Some(token));
    assert_ne!(back.id(), owner.id());
    back.revoke(&handle).unwrap();
    assert!(importer.import(&handle, false).is_err(), "revoked by the resumed owner");
    // A token resumes once.
    assert!(matches!(open(&d.socket, Some(token)), Err(Error::Refused { .. })));
    // The old objects belong to the closed connection: dropping them is harmless, and
    // the mapping this process held stayed valid throughout.
    // SAFETY: as above.
    assert_eq!(unsafe { std::ptr::read_volatile(m.as_ptr().add(4096)) }, 0x5A);
    drop(m);
    drop(region);
    back.ping().unwrap();
}

#[test]
fn without_a_resume_the_session_is_reclaimed_after_the_grace_period_or_at_once_by_default() {
    for (extra, grace) in [("[memory]\ndetach_grace_s = 1\n", Some(Duration::from_secs(1))), ("", None)] {
        let d = common::daemon_with_config(extra);
        let owner = common::session(&d.socket);
        let importer = common::session(&d.socket);
        let gpu = common::gpu(&owner);
        let region = owner.alloc(&Target::Device { device: gpu, memory: MemoryClass::Hbm }, 1 << 20).unwrap();
        let handle = owner.export(&region, &Policy::default()).unwrap();
        let token = owner.token().unwrap();
        let closed = Instant::now();
        owner.disconnect();
        if let Some(grace) = grace {
            // Still importable within the grace period…
            drop(importer.import(&handle, false).unwrap());
            // …and gone after it, the token with it.
            eventually("the detached session reclaimed", || importer.import(&handle, false).is_err());
            assert!(closed.elapsed() >= grace, "reclaimed before the grace period was over");
        } else {
            eventually("the closed session reclaimed", || importer.import(&handle, false).is_err());
        }
        assert!(matches!(open(&d.socket, Some(token)), Err(Error::Refused { .. })), "{extra:?}");
        drop(region);
    }
}
