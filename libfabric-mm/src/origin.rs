//! Which process made an object. A forked child has copies of the parent's library objects
//! but neither its session (the connection is the parent's; the reader thread was not
//! copied) nor the memory kept out of children (`MADV_DONTFORK`: holes in the child, where
//! the child's own mappings may land): a copy used or dropped in the child acts on neither.

use std::sync::atomic::{AtomicU32, Ordering};

/// Children made by `fork(3)` on the way to this process, counted by a fork handler: a
/// check of it costs no system call, where `getpid` costs one (150–190 ns on the VMs the
/// benchmarks ran on), so hot paths (a registration cache hit) look at this alone.
static FORKS: AtomicU32 = AtomicU32::new(0);

/// The process an object was made in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Origin {
    pid: u32,
    forks: u32,
}

impl Origin {
    /// This process.
    pub(crate) fn here() -> Self {
        count_forks();
        Self { pid: std::process::id(), forks: FORKS.load(Ordering::Relaxed) }
    }

    /// Whether this process is another than the one the object was made in (a forked
    /// child of it, whichever way it was made).
    pub(crate) fn forked(self) -> bool {
        self.forked_cheaply() || std::process::id() != self.pid
    }

    /// [`Self::forked`] for a child made by `fork(3)` (whose fork handlers ran), without
    /// a system call; a child made by a raw `clone`/`fork` system call is not seen.
    pub(crate) fn forked_cheaply(self) -> bool {
        FORKS.load(Ordering::Relaxed) != self.forks
    }
}

/// Installs, once per process, the fork handler that counts children.
fn count_forks() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a handler that runs in the child and only adds to an atomic.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(counted)) };
        if rc != 0 {
            tracing::warn!(rc, "cannot install the fork counter: forked children are found by getpid alone");
        }
    });
}

/// The fork handler of [`count_forks`], in the child.
extern "C" fn counted() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}
