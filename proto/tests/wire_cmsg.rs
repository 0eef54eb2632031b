//! The descriptor-receiving path, as properties: the control-data parser on random
//! buffers (well-formed, cut short anywhere, or arbitrary bytes) never panics and names each
//! descriptor of a complete `SCM_RIGHTS` message exactly once; and `recv_with_fds` on a
//! real socket pair, with any number of descriptors up to the kernel's maximum against any
//! room, owns every descriptor the kernel installed and closes each (the pipes they are
//! write ends of reach end of file), and reports truncation exactly when some were lost.

#![allow(clippy::unwrap_used)] // Helpers outside #[test] fns: a panic there is a failed test.

use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use fabric_proto::wire::{SCM_MAX_FD, build_control, parse_rights, recv_with_fds};
use proptest::prelude::*;

/// One control message: SCM_RIGHTS with descriptors, or another (level, type) with bytes.
#[derive(Debug, Clone)]
enum Msg {
    Rights(Vec<RawFd>),
    Other(i32, i32, Vec<u8>),
}

fn msg() -> impl Strategy<Value = Msg> {
    prop_oneof![
        prop::collection::vec(0..4096i32, 0..40).prop_map(Msg::Rights),
        (
            prop_oneof![Just(libc::SOL_SOCKET), any::<i32>()],
            prop_oneof![Just(libc::SCM_CREDENTIALS), Just(libc::SCM_RIGHTS + 100), any::<i32>()],
            prop::collection::vec(any::<u8>(), 0..40)
        )
            .prop_filter("not SCM_RIGHTS", |(l, t, _)| !(*l == libc::SOL_SOCKET && *t == libc::SCM_RIGHTS))
            .prop_map(|(l, t, d)| Msg::Other(l, t, d)),
    ]
}

/// The buffer the kernel would write for `msgs`, and where each message starts.
fn layout(msgs: &[Msg]) -> (Vec<u8>, Vec<usize>) {
    let data: Vec<(i32, i32, Vec<u8>)> = msgs
        .iter()
        .map(|m| match m {
            Msg::Rights(fds) => {
                (libc::SOL_SOCKET, libc::SCM_RIGHTS, fds.iter().flat_map(|f| f.to_ne_bytes()).collect())
            }
            Msg::Other(l, t, d) => (*l, *t, d.clone()),
        })
        .collect();
    let parts: Vec<(i32, i32, &[u8])> = data.iter().map(|(l, t, d)| (*l, *t, d.as_slice())).collect();
    let starts = (0..parts.len()).map(|n| build_control(&parts[..n]).len()).collect();
    (build_control(&parts), starts)
}

/// Bytes of a control message's header (`CMSG_LEN(0)`).
fn header() -> usize {
    build_control(&[(0, 0, &[])]).len()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn well_formed_buffers_cut_anywhere_give_each_whole_messages_descriptors_once(
        msgs in prop::collection::vec(msg(), 0..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let (buf, starts) = layout(&msgs);
        let at = cut.index(buf.len() + 1);
        let got = parse_rights(&buf[..at]);
        // The model: messages are read in order while their header fits; one whose length
        // runs past the cut ends the walk as malformed; repeated descriptors are skipped.
        let mut want = Vec::new();
        let mut malformed = false;
        for (m, &start) in msgs.iter().zip(&starts) {
            let len = match m {
                Msg::Rights(fds) => fds.len() * 4,
                Msg::Other(_, _, d) => d.len(),
            };
            if at < start + header() {
                break;
            }
            if at < start + header() + len {
                malformed = true;
                break;
            }
            let Msg::Rights(fds) = m else { continue };
            for fd in fds {
                if want.contains(fd) { malformed = true } else { want.push(*fd) }
            }
        }
        prop_assert_eq!(&got.fds, &want);
        prop_assert_eq!(got.malformed, malformed);
        let mut seen = got.fds.clone();
        seen.sort_unstable();
        seen.dedup();
        prop_assert_eq!(seen.len(), got.fds.len(), "a descriptor named twice would be closed twice");
    }

    #[test]
    fn arbitrary_bytes_never_panic_and_name_each_descriptor_once(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        let got = parse_rights(&bytes);
        prop_assert!(got.fds.iter().all(|fd| *fd >= 0));
        prop_assert!(got.fds.len() <= bytes.len() / 4);
        let mut seen = got.fds.clone();
        seen.sort_unstable();
        seen.dedup();
        prop_assert_eq!(seen.len(), got.fds.len());
    }
}

/// Raises the soft open-file limit to the hard one: a case holds up to 253 pipes.
fn raise_open_files() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `r`, which lives across the call.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0);
    r.rlim_cur = r.rlim_max;
    // SAFETY: setrlimit reads the rlimit `r` points to.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) }, 0);
}

fn send(sock: &UnixStream, bytes: &[u8], fds: &[RawFd]) {
    use nix::sys::socket::{ControlMessage, MsgFlags, UnixAddr, sendmsg};
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
    let iov = [std::io::IoSlice::new(bytes)];
    assert_eq!(sendmsg::<UnixAddr>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None).unwrap(), bytes.len());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn every_installed_descriptor_is_owned_and_closed_and_losses_are_reported(
        sent in 0..=SCM_MAX_FD,
        room in prop_oneof![0..=10usize, Just(SCM_MAX_FD), Just(SCM_MAX_FD + 5)],
        nonblocking in any::<bool>(),
    ) {
        raise_open_files();
        let (a, b) = UnixStream::pair().unwrap();
        let pipes: Vec<(std::fs::File, OwnedFd)> = (0..sent)
            .map(|_| {
                let (r, w) = std::io::pipe().unwrap();
                let r = std::fs::File::from(OwnedFd::from(r));
                nix::fcntl::fcntl(r.as_fd(), nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK)).unwrap();
                (r, OwnedFd::from(w))
            })
            .collect();
        let raw: Vec<RawFd> = pipes.iter().map(|(_, w)| w.as_raw_fd()).collect();
        send(&a, b"frame", &raw);
        // Then plain bytes: a read stops at the descriptors' message, so they stay apart
        // (without descriptors the two would be read as one).
        if sent > 0 {
            (&a).write_all(b"more").unwrap();
        }
        let mut buf = [0u8; 64];
        let got = recv_with_fds(b.as_fd(), &mut buf, room, nonblocking).unwrap();
        prop_assert_eq!(&buf[..got.bytes], b"frame");
        let fit = room.min(SCM_MAX_FD);
        prop_assert_eq!(got.fds.len(), sent.min(fit));
        prop_assert_eq!(got.truncated, sent > fit);
        // Each received descriptor is a distinct write end, not one of ours.
        for fd in &got.fds {
            prop_assert!(!raw.contains(&fd.as_raw_fd()));
        }
        drop(got);
        let mut pipes = pipes;
        for (r, w) in &mut pipes {
            drop(std::mem::replace(w, OwnedFd::from(std::fs::File::open("/dev/null").unwrap())));
            let mut one = [0u8; 1];
            match r.read(&mut one) {
                Ok(0) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => prop_assert!(false, "a received write end leaked"),
                other => prop_assert!(false, "unexpected pipe read {:?}", other),
            }
        }
        if sent > 0 {
            let again = recv_with_fds(b.as_fd(), &mut buf, room, nonblocking).unwrap();
            prop_assert_eq!((&buf[..again.bytes], again.fds.len(), again.truncated), (&b"more"[..], 0, false));
        }
    }
}
