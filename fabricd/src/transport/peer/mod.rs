//! Who is at the other end of a connection, fixed when the connection is accepted: the
//! credentials and supplementary groups the kernel recorded when the client connected
//! (`SO_PEERCRED`, `SO_PEERGROUPS`), and a pidfd for the process that connected
//! (`SO_PEERPIDFD`, or `pidfd_open` checked against those credentials on kernels before
//! 6.5).
//!
//! Nothing looks the client's pid up again later. A pid names a process only until that
//! process is reaped; then it may go to any process of any user. So every later use of
//! the client's process — reading its mappings, reaching its memory, asking whether it
//! is still there — goes through [`Process::with`], which checks through the pidfd that
//! the process has not exited before and after the pid is used: a process that has not
//! exited has not been reaped, so the pid named it all along. It also checks that the
//! process runs with the credentials it connected with (`SO_PEERCRED`'s) and is dumpable:
//! a client that `exec`s a set-user-ID or file-capability program keeps its pid and
//! pidfd, and the daemon (root, with `CAP_SYS_PTRACE`) would otherwise go on reading and
//! writing that program's memory for it.

pub(crate) mod sys;

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use fabric_proto::wire::PeerCred;

/// Why a connection's identity could not be read.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// `SO_PEERGROUPS` failed.
    #[error("reading the peer's supplementary groups")]
    Groups(#[source] io::Error),
}

/// The process that connected has exited (or was never known to the daemon), or no
/// longer runs with the credentials it connected with: its memory is out of reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the connecting process has exited or runs with other credentials than it connected with")]
pub struct ProcessGone;

/// Why the process found at the connecting pid is not the one that connected (the
/// `pidfd_open` fallback).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Mismatch {
    /// Its `/proc` files do not say what is needed.
    #[error("its uid or start time cannot be read")]
    Unreadable,
    /// It runs under another effective uid.
    #[error("it runs as uid {0}")]
    OtherUid(u32),
    /// It started after the connection was accepted.
    #[error("it started after the connection was accepted")]
    StartedLater,
}

/// The process that connected, followed by a pidfd taken at accept. Cheap to clone: the
/// registrations and copies that reach its memory share the one descriptor.
#[derive(Debug, Clone)]
pub struct Process {
    pid: i32,
    pidfd: Arc<OwnedFd>,
    /// Start time (clock ticks since boot), when it could be read.
    start: Option<u64>,
    /// The effective uid and gid it connected with (`SO_PEERCRED`): what the owner of its
    /// `/proc/<pid>` must be whenever its memory is reached ([`proc_owner`]).
    owner: (u32, u32),
}

impl Process {
    /// This process (for in-process callers and tests).
    pub fn this() -> io::Result<Self> {
        let pid = i32::try_from(std::process::id()).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
        let pidfd = sys::pidfd_open(pid)?;
        // SAFETY: geteuid/getegid have no preconditions.
        let owner = unsafe { (libc::geteuid(), libc::getegid()) };
        Ok(Self::found(pid, proc_start(pid), pidfd, owner))
    }

    /// The process at the other end of `sock` whose credentials are `cred`, accepted at
    /// `accepted` (clock ticks since boot); `None` when it has exited or cannot be shown
    /// to be the one that connected.
    fn of_socket(sock: BorrowedFd<'_>, cred: &PeerCred, accepted: Option<u64>) -> Option<Self> {
        let p = match sys::peer_pidfd(sock) {
            // The kernel's own record of who connected: no pid lookup at all.
            Ok(pidfd) => Self::found(cred.pid, proc_start(cred.pid), pidfd, (cred.uid, cred.gid)),
            Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => return Self::by_pid(cred, accepted),
            Err(e) => {
                tracing::debug!(pid = cred.pid, error = %e, "no pidfd for the peer (it has exited)");
                return None;
            }
        };
        // The start time read above is this process's only if it is still running.
        p.running().then_some(p)
    }

    /// Before Linux 6.5: a pidfd for the connecting pid, kept only when the process
    /// behind it runs as the connecting uid and started before the accept (a process
    /// that took the pid after the client exited fails one or the other), both read
    /// while the pidfd shows it running.
    fn by_pid(cred: &PeerCred, accepted: Option<u64>) -> Option<Self> {
        if cred.pid <= 0 {
            return None;
        }
        let pidfd = sys::pidfd_open(cred.pid).ok()?;
        let status = std::fs::read_to_string(format!("/proc/{}/status", cred.pid)).unwrap_or_default();
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", cred.pid)).unwrap_or_default();
        let p = Self::found(cred.pid, start_time_in(&stat), pidfd, (cred.uid, cred.gid));
        if !p.running() {
            return None;
        }
        match same_process(&status, &stat, cred.uid, accepted) {
            Ok(()) => Some(p),
            Err(why) => {
                tracing::warn!(uid = cred.uid, pid = cred.pid, "the process at the connecting pid is another: {why}");
                None
            }
        }
    }

    /// The process `pidfd` follows, at `pid`, with its start time and the effective uid
    /// and gid it connected with.
    fn found(pid: i32, start: Option<u64>, pidfd: OwnedFd, owner: (u32, u32)) -> Self {
        Self { pid, start, owner, pidfd: Arc::new(pidfd) }
    }

    /// The pid (for log lines; a pid alone names nothing, see [`Process::with`]).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Start time in clock ticks since boot, read at accept while the process ran.
    pub fn start_time(&self) -> Option<u64> {
        self.start
    }

    /// Whether the process has not exited.
    pub fn running(&self) -> bool {
        sys::pidfd_running(self.pidfd.as_fd())
    }

    /// Runs `f` with the process's pid, which names this process throughout: the process
    /// has not exited before the call nor after it (so it was not reaped in between, and
    /// its pid went to no one else), and runs with the credentials it connected with,
    /// before and after (its `/proc/<pid>` is owned by them: the kernel shows a process's
    /// effective uid and gid there, or root's once it is not dumpable, as after the `exec`
    /// of a set-user-ID, set-group-ID or file-capability program — and a client that made
    /// itself not dumpable is not reached). What `f` read is discarded when the second
    /// check fails; what it wrote in between, if the process ran such a program at that
    /// moment, is not undone (a window of one system call).
    pub fn with<T>(&self, f: impl FnOnce(i32) -> T) -> Result<T, ProcessGone> {
        if !self.unchanged() {
            return Err(ProcessGone);
        }
        let r = f(self.pid);
        if !self.unchanged() {
            return Err(ProcessGone);
        }
        Ok(r)
    }

    /// Running, with the credentials it connected with, dumpable.
    fn unchanged(&self) -> bool {
        // Read by pid, then the pidfd asked: the `/proc` entry read was this process's.
        proc_owner(self.pid) == Some(self.owner) && self.running()
    }
}

/// Checks a `/proc/<pid>/status` and `/proc/<pid>/stat` text of the process found at the
/// connecting pid against the connecting uid and the accept time (clock ticks since boot;
/// `None`: the clock could not be read, the uid alone decides).
pub fn same_process(status: &str, stat: &str, uid: u32, accepted: Option<u64>) -> Result<(), Mismatch> {
    let euid = effective_uid_in(status).ok_or(Mismatch::Unreadable)?;
    if euid != uid {
        return Err(Mismatch::OtherUid(euid));
    }
    let start = start_time_in(stat).ok_or(Mismatch::Unreadable)?;
    if accepted.is_some_and(|a| start > a) {
        return Err(Mismatch::StartedLater);
    }
    Ok(())
}

/// The effective uid in a `/proc/<pid>/status` text (`Uid:` real, effective, saved, fs):
/// what `SO_PEERCRED` records.
fn effective_uid_in(status: &str) -> Option<u32> {
    status.lines().find_map(|l| l.strip_prefix("Uid:"))?.split_whitespace().nth(1)?.parse().ok()
}

/// The start time in a `/proc/<pid>/stat` text (field 22, clock ticks since boot).
pub fn start_time_in(stat: &str) -> Option<u64> {
    // The command name (field 2) is in parentheses and may hold anything; fields after
    // the last ')' start at field 3.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(22 - 3)?.parse().ok()
}

/// The owner (uid, gid) of `/proc/<pid>`: the process's effective uid and gid while it is
/// dumpable, root's when it is not.
fn proc_owner(pid: i32) -> Option<(u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(format!("/proc/{pid}")).ok()?;
    Some((m.uid(), m.gid()))
}

fn proc_start(pid: i32) -> Option<u64> {
    start_time_in(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// A connection's identity: fixed when it is accepted, never looked up again.
#[derive(Debug, Clone)]
pub struct Peer {
    /// Uid, gid and pid at connect (`SO_PEERCRED`).
    pub cred: PeerCred,
    /// Supplementary groups at connect (`SO_PEERGROUPS`).
    groups: Arc<[u32]>,
    /// The process that connected, when it was still there at accept.
    process: Option<Process>,
}

impl Peer {
    /// The identity of the client at the other end of `sock`, whose `SO_PEERCRED`
    /// credentials are `cred`. A client whose process has already exited keeps its
    /// credentials and groups but reaches no process memory.
    pub fn accept(sock: BorrowedFd<'_>, cred: PeerCred) -> Result<Self, PeerError> {
        let groups = sys::peer_groups(sock).map_err(PeerError::Groups)?;
        let process = Process::of_socket(sock, &cred, sys::boot_ticks());
        Ok(Self::new(cred, groups, process))
    }

    /// An identity from parts (for in-process callers and tests, which vouch for them).
    pub fn new(cred: PeerCred, groups: Vec<u32>, process: Option<Process>) -> Self {
        Self { cred, groups: groups.into(), process }
    }

    /// Supplementary groups at connect.
    pub fn groups(&self) -> &[u32] {
        &self.groups
    }

    /// The process that connected, unless it had exited by the accept.
    pub fn process(&self) -> Result<&Process, ProcessGone> {
        self.process.as_ref().ok_or(ProcessGone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS: &str = "Name:\tbash\nUid:\t1000\t1001\t1000\t1001\nGid:\t100\t100\t100\t100\nGroups:\t4 27\n";
    // A command name with ") " in it, as a process may choose.
    const STAT: &str = "4242 (a) b (c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 5000 1000 10";

    #[test]
    fn start_time_is_field_22_after_any_command_name() {
        assert_eq!(start_time_in(STAT), Some(5000));
        assert_eq!(start_time_in("4242 (x) S 1"), None);
        assert_eq!(start_time_in("no parenthesis"), None);
    }

    #[test]
    fn the_fallback_keeps_only_a_process_of_the_connecting_uid_started_before_the_accept() {
        assert_eq!(same_process(STATUS, STAT, 1001, Some(5000)), Ok(()));
        assert_eq!(same_process(STATUS, STAT, 1001, None), Ok(()));
        // The real uid is not what SO_PEERCRED records.
        assert_eq!(same_process(STATUS, STAT, 1000, Some(6000)), Err(Mismatch::OtherUid(1001)));
        assert_eq!(same_process(STATUS, STAT, 1001, Some(4999)), Err(Mismatch::StartedLater));
        assert_eq!(same_process("", STAT, 1001, Some(6000)), Err(Mismatch::Unreadable));
        assert_eq!(same_process(STATUS, "", 1001, Some(6000)), Err(Mismatch::Unreadable));
    }

    #[test]
    fn this_process_is_running_started_before_now_and_found_by_the_fallback() {
        let me = Process::this().unwrap();
        assert!(me.running());
        assert!(me.start_time().is_some_and(|s| s <= sys::boot_ticks().unwrap()));
        assert_eq!(me.with(|pid| pid), Ok(me.pid()));
        // SAFETY: geteuid/getegid have no preconditions.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let cred = PeerCred { pid: me.pid(), uid, gid };
        assert!(Process::by_pid(&cred, sys::boot_ticks()).is_some());
        assert!(Process::by_pid(&PeerCred { uid: uid.wrapping_add(1), ..cred }, sys::boot_ticks()).is_none());
        assert!(Process::by_pid(&PeerCred { pid: 0, ..cred }, None).is_none());
    }

    #[test]
    fn a_socket_pair_gives_this_process_and_its_groups() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        // SAFETY: geteuid/getegid have no preconditions.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let pid = i32::try_from(std::process::id()).unwrap();
        let peer = Peer::accept(a.as_fd(), PeerCred { pid, uid, gid }).unwrap();
        let p = peer.process().unwrap();
        assert_eq!(p.pid(), pid);
        assert!(p.running());
        // SAFETY: getgroups(0, NULL) only counts.
        let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
        assert_eq!(peer.groups().len(), usize::try_from(n).unwrap());
    }

    #[test]
    fn an_exited_process_is_gone_through_its_pidfd() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let pidfd = sys::pidfd_open(pid).unwrap();
        let p = Process::found(pid, None, pidfd, (0, 0));
        child.wait().unwrap();
        assert!(!p.running());
        assert_eq!(p.with(|_| ()), Err(ProcessGone));
    }

    /// A process that takes other credentials after it was found (as the `exec` of a
    /// set-user-ID program does) is out of reach from then on, though it runs on.
    #[test]
    #[allow(clippy::print_stderr)]
    fn a_process_that_changes_its_credentials_is_out_of_reach() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root to start a process that changes its uid");
            return;
        }
        // Waits for a line on stdin, then runs as nobody.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "read _; exec setpriv --reuid=65534 --regid=65534 --clear-groups sleep 30"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let p = Process::found(pid, None, sys::pidfd_open(pid).unwrap(), (0, 0));
        assert_eq!(p.with(|pid| pid), Ok(pid), "as it connected: root");
        // One that connected as another uid than it runs as now is not reached.
        let other = Process::found(pid, None, sys::pidfd_open(pid).unwrap(), (65534, 65534));
        assert_eq!(other.with(|pid| pid), Err(ProcessGone));
        std::io::Write::write_all(child.stdin.as_mut().unwrap(), b"go\n").unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while proc_owner(pid) != Some((65534, 65534)) {
            assert!(std::time::Instant::now() < deadline, "the child never became nobody");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(p.running());
        assert_eq!(p.with(|pid| pid), Err(ProcessGone), "it runs, with other credentials");
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
