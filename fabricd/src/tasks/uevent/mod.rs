//! Kernel uevents: a `NETLINK_KOBJECT_UEVENT` socket bound to the kernel's multicast group
//! (1), read by one task. Each message is parsed ([`parse`]); one from a subsystem the
//! fabric is made of ([`RELEVANT`]) asks the monitor for a rescan, which
//! [`monitor`](crate::tasks::monitor) debounces. Messages not sent by the kernel (sender port
//! not 0) are dropped. If the socket cannot be opened the daemon logs it once and keeps
//! its periodic rescans.

pub mod parse;

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use nix::sys::socket::{
    AddressFamily, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recvfrom, setsockopt, socket, sockopt,
};
use tokio::io::unix::AsyncFd;
use tokio_util::sync::CancellationToken;

pub use parse::{ParseError, Uevent};

use crate::daemon::Daemon;
use crate::metrics::UeventKind;

/// The kernel's uevent multicast group (udev re-broadcasts on group 2, which we ignore).
pub const KERNEL_GROUP: u32 = 1;
/// Receive buffer asked for, bytes: a hot-plug of a GPU tray sends hundreds of events.
const RCVBUF: usize = 4 << 20;

/// Subsystems whose uevents can change the fabric: PCI functions and buses, CXL and DAX
/// devices, memory blocks and NUMA nodes, UALink, NVIDIA and InfiniBand devices.
pub const RELEVANT: [&str; 10] =
    ["pci", "pci_bus", "cxl", "dax", "memory", "node", "ualink", "nvidia", "nvidia-caps", "infiniband"];

/// Why the uevent socket could not be opened or read.
#[derive(Debug, thiserror::Error)]
pub enum UeventError {
    /// `socket`, `bind` or registering with the runtime failed.
    #[error("{what} of the NETLINK_KOBJECT_UEVENT socket")]
    Socket {
        /// The step.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Whether a uevent can change the fabric.
pub fn relevant(ev: &Uevent) -> bool {
    ev.subsystem.as_deref().is_some_and(|s| RELEVANT.contains(&s))
}

/// The bound socket.
#[derive(Debug)]
pub struct Listener {
    fd: AsyncFd<OwnedFd>,
}

impl Listener {
    /// Opens a non-blocking uevent socket bound to the kernel group. Must run inside the
    /// tokio runtime.
    pub fn open() -> Result<Self, UeventError> {
        let sock_err = |what| move |e: nix::Error| UeventError::Socket { what, source: e.into() };
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Datagram,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkKObjectUEvent,
        )
        .map_err(sock_err("socket"))?;
        // A bigger buffer makes overruns rarer; RcvBufForce passes rmem_max as root.
        if setsockopt(&fd, sockopt::RcvBufForce, &RCVBUF).is_err() {
            let _ = setsockopt(&fd, sockopt::RcvBuf, &RCVBUF);
        }
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, KERNEL_GROUP)).map_err(sock_err("bind"))?;
        // SAFETY: an OwnedFd is a valid open descriptor, and its as_raw_fd returns that same
        // descriptor for as long as the AsyncFd owns it (it is closed only when dropped).
        let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
            .map_err(|e| UeventError::Socket { what: "registering", source: e.into() })?;
        Ok(Self { fd })
    }

    /// Reads until `shutdown`: counts every message, logs it at `debug`, and asks for a
    /// rescan when it is relevant (or when messages were lost to an overrun).
    pub async fn run(self, daemon: Arc<Daemon>, shutdown: CancellationToken) {
        let mut buf = vec![0u8; parse::MAX_MESSAGE + 1];
        loop {
            let guard = tokio::select! {
                () = shutdown.cancelled() => return,
                g = self.fd.readable() => g,
            };
            let mut guard = match guard {
                Ok(g) => g,
                Err(e) => {
                    tracing::warn!(error = %e, "uevent socket failed; relying on periodic rescans");
                    daemon.metrics.set_uevents_listening(false);
                    return;
                }
            };
            let got = guard.try_io(|fd| recvfrom::<NetlinkAddr>(fd.as_raw_fd(), &mut buf).map_err(Into::into));
            match got {
                Err(_would_block) => continue,
                Ok(Ok((n, from))) => {
                    let from_kernel = from.is_some_and(|a| a.pid() == 0);
                    if !from_kernel {
                        tracing::debug!(sender = ?from.map(|a| a.pid()), "dropped a uevent not sent by the kernel");
                        daemon.metrics.uevent(UeventKind::Malformed);
                        continue;
                    }
                    handle(&daemon, buf.get(..n).unwrap_or_default());
                }
                Ok(Err(e)) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    tracing::warn!("uevent socket overrun: events were lost; rescanning");
                    daemon.metrics.uevent_overrun();
                    daemon.monitor.want();
                }
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "reading the uevent socket failed; relying on periodic rescans");
                    daemon.metrics.set_uevents_listening(false);
                    return;
                }
            }
        }
    }
}

/// Counts, logs and acts on one message.
fn handle(daemon: &Daemon, msg: &[u8]) {
    match parse::parse(msg) {
        Ok(ev) => {
            let rel = relevant(&ev);
            tracing::debug!(
                action = %ev.action,
                devpath = %ev.devpath,
                subsystem = %ev.subsystem.as_deref().unwrap_or(""),
                seqnum = ev.seqnum,
                synth_uuid = %ev.get("SYNTH_UUID").unwrap_or(""),
                relevant = rel,
                "kernel uevent"
            );
            if rel {
                daemon.metrics.uevent(UeventKind::Relevant);
                daemon.monitor.want();
            } else {
                daemon.metrics.uevent(UeventKind::Ignored);
            }
        }
        Err(e) => {
            tracing::debug!(error = %e, len = msg.len(), "malformed uevent");
            daemon.metrics.uevent(UeventKind::Malformed);
        }
    }
}

/// Opens the listener when the configuration asks for it (`discovery.uevents`) and spawns
/// its task on `tasks`; a socket that cannot be opened is logged once (`warn`) and the
/// periodic rescans go on. Returns whether it listens.
pub fn start(daemon: &Arc<Daemon>, shutdown: &CancellationToken, tasks: &tokio_util::task::TaskTracker) -> bool {
    if !daemon.config.uevents_enabled() {
        tracing::info!("kernel uevents not listened to (discovery.uevents)");
        return false;
    }
    match Listener::open() {
        Ok(l) => {
            tracing::info!("listening for kernel uevents");
            daemon.metrics.set_uevents_listening(true);
            tasks.spawn(l.run(daemon.clone(), shutdown.clone()));
            true
        }
        Err(e) => {
            tracing::warn!(
                error = %crate::error_chain(&e),
                "cannot listen for kernel uevents; changes are seen at the periodic rescans only"
            );
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relevance_follows_the_subsystem() {
        let ev = |s: Option<&str>| Uevent {
            action: "add".into(),
            devpath: "/devices/x".into(),
            subsystem: s.map(str::to_owned),
            seqnum: None,
            fields: Vec::new(),
        };
        for s in ["pci", "cxl", "dax", "memory", "node", "ualink", "nvidia"] {
            assert!(relevant(&ev(Some(s))), "{s}");
        }
        for s in ["net", "block", "tty", "PCI"] {
            assert!(!relevant(&ev(Some(s))), "{s}");
        }
        assert!(!relevant(&ev(None)));
    }
}
