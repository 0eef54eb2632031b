//! The x86_64 Linux recovering copy: the `rep movsb` routine, its labels, and the
//! `SIGBUS`/`SIGSEGV` handler that sends a fault of that one instruction to the fixup.
//!
//! # Why this is sound
//! - The routine's only instruction that touches memory is the `rep movsb` at
//!   `fabricd_copy_recovering_start`; the handler redirects only a fault whose
//!   instruction pointer is in `[start, end)` — that instruction — and that the kernel
//!   raised for a fault (`si_code > 0`, not a `kill`/`tgkill`/`sigqueue`, nor an
//!   asynchronous machine-check report, `BUS_MCEERR_AO`). `rep movsb` is
//!   restartable: at a fault `rcx`, `rsi` and `rdi` say how far it got, so the fixup
//!   returns the bytes left. The routine keeps nothing on the stack and calls nothing,
//!   so leaving it at the fixup abandons no state.
//! - Every other fault is handed on: to the handler that was there before (Rust's own,
//!   which reports a stack overflow and otherwise restores the default), or, if there was
//!   none, the previous action is put back and the handler returns — the instruction
//!   faults again under it and the process dies as it would have (a signal sent by a
//!   process is raised again instead, as it would not recur by itself).
//! - The handler calls only `sigaction`, `signal` and `raise` (async-signal-safe) and the
//!   previous handler, and reads atomics and memory written before it was installed.

use std::cell::UnsafeCell;
use std::io;
use std::mem::MaybeUninit;
use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, Ordering};

use super::FaultError;

// The copy routine, System V ABI:
//   usize fabricd_copy_recovering(u8 *dst /* rdi */, const u8 *src /* rsi */,
//                                 usize len /* rdx */, usize out[2] /* rcx */)
// returns 0 when all `len` bytes moved; else the bytes left (at least 1), with out[0] the
// faulting address and out[1] the signal, which the handler put in r9 and r10 before
// resuming at the fixup. The direction flag is clear on entry (the ABI says so).
std::arch::global_asm!(
    ".pushsection .text.fabricd_copy_recovering,\"ax\",@progbits",
    ".p2align 4",
    ".globl fabricd_copy_recovering",
    ".hidden fabricd_copy_recovering",
    ".type fabricd_copy_recovering,@function",
    "fabricd_copy_recovering:",
    "    mov r8, rcx",
    "    mov rcx, rdx",
    "    xor eax, eax",
    ".globl fabricd_copy_recovering_start",
    ".hidden fabricd_copy_recovering_start",
    "fabricd_copy_recovering_start:",
    "    rep movsb",
    ".globl fabricd_copy_recovering_end",
    ".hidden fabricd_copy_recovering_end",
    "fabricd_copy_recovering_end:",
    "    ret",
    ".globl fabricd_copy_recovering_fixup",
    ".hidden fabricd_copy_recovering_fixup",
    "fabricd_copy_recovering_fixup:",
    "    mov qword ptr [r8], r9",
    "    mov qword ptr [r8 + 8], r10",
    "    mov rax, rcx",
    "    ret",
    ".size fabricd_copy_recovering, . - fabricd_copy_recovering",
    ".popsection",
);

unsafe extern "sysv64" {
    fn fabricd_copy_recovering(dst: *mut u8, src: *const u8, len: usize, out: *mut [usize; 2]) -> usize;
    // Labels, not data: only their addresses are taken.
    static fabricd_copy_recovering_start: u8;
    static fabricd_copy_recovering_end: u8;
    static fabricd_copy_recovering_fixup: u8;
}

/// The signals handled, and the slot of each one's previous action.
const SIGNALS: [libc::c_int; 2] = [libc::SIGBUS, libc::SIGSEGV];

/// The actions in place before [`install`], one per [`SIGNALS`] entry; written once,
/// before the handler is installed, and only read after (by the handler).
struct Previous(UnsafeCell<[MaybeUninit<libc::sigaction>; 2]>);

// SAFETY: written only inside `INSTALL.call_once` before `SAVED` is set (Release) and
// the handler installed, read only after `SAVED` was seen set (Acquire): no write races a
// read.
unsafe impl Sync for Previous {}

static PREVIOUS: Previous = Previous(UnsafeCell::new([MaybeUninit::uninit(), MaybeUninit::uninit()]));
static INSTALL: Once = Once::new();
/// Whether `PREVIOUS` is written.
static SAVED: AtomicBool = AtomicBool::new(false);
/// `UNSET`, `READY` (the handler is installed) or `FAILED`.
static STATE: AtomicU8 = AtomicU8::new(UNSET);
const UNSET: u8 = 0;
const READY: u8 = 1;
const FAILED: u8 = 2;
/// The errno of a failed install, for the error.
static INSTALL_ERRNO: AtomicI32 = AtomicI32::new(0);

fn addresses() -> (usize, usize, usize) {
    (
        (&raw const fabricd_copy_recovering_start) as usize,
        (&raw const fabricd_copy_recovering_end) as usize,
        (&raw const fabricd_copy_recovering_fixup) as usize,
    )
}

/// Installs the `SIGBUS`/`SIGSEGV` handler for the whole process, once (later calls only
/// say how the first went). The actions in place are kept and faults outside the copy
/// routine go to them.
pub fn install() -> Result<(), FaultError> {
    if STATE.load(Ordering::Acquire) == READY {
        return Ok(());
    }
    INSTALL.call_once(|| {
        let r = install_now();
        if let Err(e) = &r {
            INSTALL_ERRNO.store(e.raw_os_error().unwrap_or(libc::EINVAL), Ordering::Relaxed);
        }
        STATE.store(if r.is_ok() { READY } else { FAILED }, Ordering::Release);
    });
    match STATE.load(Ordering::Acquire) {
        READY => Ok(()),
        _ => Err(FaultError::Install(io::Error::from_raw_os_error(INSTALL_ERRNO.load(Ordering::Relaxed)))),
    }
}

fn install_now() -> io::Result<()> {
    let slots = PREVIOUS.0.get();
    // First record what is there, then install: the handler may run (on any thread) as
    // soon as it is installed, and then needs the previous action. (Another thread
    // changing the action between the two calls would be lost; the daemon installs
    // signal actions only at start.)
    for (i, &sig) in SIGNALS.iter().enumerate() {
        let mut old = MaybeUninit::<libc::sigaction>::zeroed();
        // SAFETY: queries the action of `sig` into `old`; no action is changed.
        if unsafe { libc::sigaction(sig, std::ptr::null(), old.as_mut_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: runs once (`INSTALL`), before the handler that reads `PREVIOUS` exists.
        unsafe { (*slots)[i] = old };
    }
    // `PREVIOUS` is readable before the first handler can run.
    SAVED.store(true, Ordering::Release);
    for (i, &sig) in SIGNALS.iter().enumerate() {
        let act = our_action();
        // SAFETY: installs `on_fault`, an `extern "C"` SA_SIGINFO handler, for `sig`.
        if unsafe { libc::sigaction(sig, &act, std::ptr::null_mut()) } != 0 {
            let e = io::Error::last_os_error();
            // Undo the ones installed: no handler without a working install.
            for (j, &done) in SIGNALS.iter().enumerate().take(i) {
                // SAFETY: restores the action saved above for `done`.
                unsafe { libc::sigaction(done, (*slots)[j].as_ptr(), std::ptr::null_mut()) };
            }
            return Err(e);
        }
    }
    tracing::debug!("recovering copy: SIGBUS/SIGSEGV handler installed");
    Ok(())
}

/// The action that runs [`on_fault`]. Async-signal-safe (no allocation, no locks).
fn our_action() -> libc::sigaction {
    // SAFETY: an all-zero sigaction is a valid value (no flags, empty mask) that is filled
    // in below.
    let mut act: libc::sigaction = unsafe { MaybeUninit::zeroed().assume_init() };
    act.sa_sigaction = on_fault as *const () as usize;
    // SA_ONSTACK: a thread with an alternate stack (every Rust thread has one) runs it
    // there, so a stack overflow still reaches Rust's handler through ours. No SA_NODEFER:
    // a fault inside the handler itself is then fatal, never a loop.
    act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
    // SAFETY: `act.sa_mask` is a sigset owned here; sigemptyset is async-signal-safe.
    unsafe { libc::sigemptyset(&mut act.sa_mask) };
    act
}

/// The handler. Async-signal-safe: atomics, reads of `PREVIOUS`, `sigaction`, `raise`,
/// and the previous handler (which was already there for these signals).
extern "C" fn on_fault(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let (start, end, fixup) = addresses();
    // SAFETY: the kernel passes a valid siginfo and ucontext to an SA_SIGINFO handler, for
    // the duration of the call; nothing else refers to them meanwhile.
    let (info_ref, uc) = unsafe { (&*info, &mut *ctx.cast::<libc::ucontext_t>()) };
    let gregs = &mut uc.uc_mcontext.gregs;
    let rip = gregs[libc::REG_RIP as usize] as usize;
    // A fault of the routine's own access: raised by the kernel (si_code > 0, not sent by
    // a process), and not a machine-check report about some other page (action optional).
    let fault = info_ref.si_code > 0 && !(sig == libc::SIGBUS && info_ref.si_code == libc::BUS_MCEERR_AO);
    if fault && (start..end).contains(&rip) {
        // SAFETY: si_addr is the field of a SIGBUS/SIGSEGV raised by a fault.
        let addr = unsafe { info_ref.si_addr() } as usize;
        gregs[libc::REG_R9 as usize] = addr as i64;
        gregs[libc::REG_R10 as usize] = i64::from(sig);
        gregs[libc::REG_RIP as usize] = fixup as i64;
        return;
    }
    // SAFETY: the handler's own arguments, passed on unchanged.
    unsafe { pass_on(sig, info, ctx) };
}

/// Does for a fault not ours what would have happened without the handler.
///
/// # Safety
/// Called from the handler only, with its arguments.
unsafe fn pass_on(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let Some(i) = SIGNALS.iter().position(|&s| s == sig) else { return };
    if !SAVED.load(Ordering::Acquire) {
        // Cannot happen (saved before installed); the default is the safe guess.
        // SAFETY: sets the default action for `sig`, which the fault then meets.
        unsafe { libc::signal(sig, libc::SIG_DFL) };
        return;
    }
    // SAFETY: `SAVED` was seen set, so `PREVIOUS` was written (and is never written again).
    let prev: &libc::sigaction = unsafe { (*PREVIOUS.0.get())[i].assume_init_ref() };
    let h = prev.sa_sigaction;
    if h == libc::SIG_DFL || h == libc::SIG_IGN {
        // Put the old action back; a fault recurs when the instruction runs again (and
        // an ignored synchronous fault is fatal all the same); a sent signal is raised
        // again, to be delivered under the old action once this handler returns.
        // SAFETY: restores the action saved at install.
        unsafe { libc::sigaction(sig, prev, std::ptr::null_mut()) };
        // SAFETY: `info` is the kernel's siginfo for this call.
        if unsafe { (*info).si_code } <= 0 {
            // SAFETY: raise is async-signal-safe; `sig` is blocked until we return.
            unsafe { libc::raise(sig) };
        }
        return;
    }
    if prev.sa_flags & libc::SA_SIGINFO != 0 {
        // SAFETY: an SA_SIGINFO action's handler has this signature; it was installed
        // for this signal and is called as the kernel would have called it.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = unsafe { std::mem::transmute(h) };
        f(sig, info, ctx);
    } else {
        // SAFETY: a plain action's handler takes the signal number.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(h) };
        f(sig);
    }
    // A signal that does not recur by itself (sent by a process, or an asynchronous
    // machine-check report): the process lives on, so the copy must keep its recovery even
    // if the previous handler (Rust's resets to the default) replaced ours. A real fault
    // recurs when the instruction runs again and must meet what that handler left.
    // SAFETY: `info` is the kernel's siginfo for this call.
    let code = unsafe { (*info).si_code };
    if code <= 0 || (sig == libc::SIGBUS && code == libc::BUS_MCEERR_AO) {
        let act = our_action();
        // SAFETY: reinstalls `on_fault` for `sig` (sigaction is async-signal-safe).
        unsafe { libc::sigaction(sig, &act, std::ptr::null_mut()) };
    }
}

/// Copies `len` bytes from `src` to `dst` with the CPU (`rep movsb`), turning a fault
/// (`SIGBUS`, `SIGSEGV`) on either side into [`FaultError::Access`] with the faulting
/// address and the bytes done, the process unharmed. Installs the handler on first use.
///
/// # Safety
/// A fault is recovered, a wrong write is not. The caller ensures that:
/// - `dst..dst + len` is memory the copy may overwrite: no Rust reference covers it and
///   nothing the daemon relies on lies there (in the engine: a shared mapping of a
///   client's memory, which clients change at will anyway);
/// - `src..src + len` is memory no Rust `&mut` covers;
/// - the two ranges do not overlap (the copy runs forward only);
/// - both are, or were, mapped for the copy's purpose: an address range that is not
///   mapped, or not mapped for the access, or whose file shrank, faults, and that is what
///   is recovered from. Bytes up to the fault may have been written.
///
/// Bytes another thread or process changes meanwhile are copied torn, as a device's DMA
/// would copy them; that is no unsafety (the memory is not Rust's).
pub unsafe fn copy_recovering(dst: *mut u8, src: *const u8, len: usize) -> Result<(), FaultError> {
    install()?;
    if len == 0 {
        return Ok(());
    }
    let mut out = [0usize; 2];
    // SAFETY: the caller's contract for the ranges; the routine writes `out` only at
    // its fixup, and faults inside it are recovered by the installed handler.
    let left = unsafe { fabricd_copy_recovering(dst, src, len, &mut out) };
    if left == 0 {
        return Ok(());
    }
    Err(FaultError::Access { addr: out[0], done: len - left.min(len), len, signal: out[1] as i32 })
}
