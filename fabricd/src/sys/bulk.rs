//! Bulk work at a lower CPU priority. Zeroing a 1 GiB region of device memory keeps a core
//! busy for a tenth of a second or more; run at the priority of every other request, a few
//! of them fill both cores of a small host and another client's no-op waits a whole
//! scheduler slice for a core (milliseconds, docs/BENCHMARKS.md, "Quiet rerun"). [`run`]
//! does such work on a thread of its own whose nice value is [`NICE`] higher: it still gets
//! the idle cores, but a request thread that wakes up takes the core from it at once.
//!
//! Why a thread and not the caller's: raising a thread's nice value is always allowed,
//! lowering it back needs `CAP_SYS_NICE`, which an unprivileged fabricd lacks, and the
//! caller is a connection's thread that goes on answering that client.

/// How much nicer than the daemon bulk work runs (weight 110 against 1,024 for nice 0:
/// about a tenth of a core where a request wants it).
pub const NICE: i32 = 10;

/// Runs `work` on a thread of its own at [`NICE`] and returns what it returned; the
/// caller waits. If no thread can be started (the process is out of threads), `work` runs
/// here, at the caller's priority, and a warning says so; if the priority cannot be
/// lowered, it runs on the new thread at the daemon's.
pub fn run<T: Send>(what: &str, work: impl FnOnce() -> T + Send) -> T {
    let mut slot = Some(work);
    let outcome = std::thread::scope(|s| {
        let slot = &mut slot;
        let spawned = std::thread::Builder::new().name("fabricd-bulk".into()).spawn_scoped(s, move || {
            lower_priority(what);
            slot.take().map(|w| w())
        });
        match spawned {
            Ok(h) => Some(h.join()),
            Err(e) => {
                tracing::warn!(error = %e, what, "cannot start a bulk-work thread; doing the work at full priority");
                None
            }
        }
    });
    match outcome {
        Some(Ok(Some(v))) => v,
        Some(Err(panic)) => std::panic::resume_unwind(panic),
        // The thread did not start (its closure, and the borrow of `slot`, are gone).
        Some(Ok(None)) | None => match slot.take() {
            Some(w) => w(),
            None => unreachable!("the bulk work ran neither on its thread nor here"),
        },
    }
}

/// Raises the calling thread's nice value by [`NICE`] (Linux's nice is per thread).
fn lower_priority(what: &str) {
    // SAFETY: gettid has no preconditions and cannot fail.
    let tid = unsafe { libc::gettid() };
    // SAFETY: plain system calls on this thread's id; they touch no memory of ours.
    // getpriority may return -1 as a value; errno is cleared first to tell.
    let now = unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t)
    };
    let err = std::io::Error::last_os_error();
    if now == -1 && err.raw_os_error().unwrap_or(0) != 0 {
        tracing::debug!(error = %err, what, "cannot read a bulk-work thread's priority; leaving it");
        return;
    }
    let want = (now + NICE).min(19);
    // SAFETY: as above.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, want) } != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), what, "cannot lower a bulk-work thread's priority");
    }
}

/// The nice value of the calling thread (tests).
#[cfg(test)]
fn nice_of_this_thread() -> i32 {
    // SAFETY: as in `lower_priority`.
    unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn work_runs_on_a_nicer_thread_and_the_caller_keeps_its_priority() {
        let before = nice_of_this_thread();
        let (there, name) = run("test", || (nice_of_this_thread(), std::thread::current().name().map(str::to_owned)));
        assert_eq!(there, (before + NICE).min(19));
        assert_eq!(name.as_deref(), Some("fabricd-bulk"));
        assert_eq!(nice_of_this_thread(), before);
    }

    #[test]
    fn work_may_borrow_and_a_panic_reaches_the_caller() {
        let bytes = [7u8; 16];
        assert_eq!(run("test", || bytes.iter().map(|&b| u32::from(b)).sum::<u32>()), 112);
        let r = std::panic::catch_unwind(|| run("test", || panic!("bulk work failed")));
        assert!(r.is_err());
    }
}
