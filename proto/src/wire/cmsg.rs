//! The control data of a received message, read without trusting it: the `SCM_RIGHTS`
//! descriptors in it, found by walking the headers the way the kernel lays them out
//! (`struct cmsghdr`: a `size_t` length, then level and type as `int`s, each message
//! aligned to `size_t`), with every length checked against the buffer.
//!
//! Walking the buffer here, rather than through an iterator that refuses truncated control
//! data, is what lets a receiver own every descriptor the kernel installed: on `MSG_CTRUNC`
//! the kernel still installs the descriptors that fit and records them in a well-formed
//! header, and each of them must be closed.

use std::os::fd::RawFd;

/// Bytes of the kernel's `cmsg_len` field, and the alignment of every control message.
const WORD: usize = std::mem::size_of::<usize>();
/// Bytes of a control message's header, aligned (`CMSG_LEN(0)`).
const HEADER: usize = align(WORD + 2 * std::mem::size_of::<i32>());
/// Bytes of one descriptor in an `SCM_RIGHTS` message.
const FD: usize = std::mem::size_of::<RawFd>();

/// `CMSG_ALIGN`: `n` rounded up to the control-message alignment.
const fn align(n: usize) -> usize {
    (n + WORD - 1) & !(WORD - 1)
}

/// `CMSG_LEN` of an `SCM_RIGHTS` message with `fds` descriptors: the control length that
/// holds exactly that many. The kernel installs as many as fit in the length it is given
/// (not rounded up: `CMSG_SPACE` would hold one more when `fds` is odd) and sets
/// `MSG_CTRUNC` for the rest, which it never installs.
pub const fn rights_len(fds: usize) -> usize {
    HEADER + fds * FD
}

/// The descriptors a control buffer names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rights {
    /// Each descriptor of every `SCM_RIGHTS` message, in order, each once; none negative.
    pub fds: Vec<RawFd>,
    /// The buffer was not as the kernel writes one: a length past its end or shorter than
    /// a header, a partial descriptor, a negative or repeated descriptor. What could be
    /// read is in `fds`; the rest was skipped.
    pub malformed: bool,
}

/// Reads the `SCM_RIGHTS` descriptors out of `control`, the bytes of the control buffer
/// the kernel filled (`msg_controllen` of them). Never panics, whatever the bytes; every
/// descriptor in a well-formed message is returned exactly once, so that the caller can
/// own (and close) each once.
pub fn parse_rights(control: &[u8]) -> Rights {
    let mut out = Rights::default();
    let mut at = 0usize;
    // A header must fit whole (`CMSG_FIRSTHDR`, `CMSG_NXTHDR`).
    while let Some(head) = control.get(at..).filter(|rest| rest.len() >= HEADER) {
        let word = |i: usize, n: usize| &head[i..i + n];
        let len = usize::from_ne_bytes(word(0, WORD).try_into().unwrap_or([0; WORD]));
        let level = i32::from_ne_bytes(word(WORD, 4).try_into().unwrap_or([0; 4]));
        let kind = i32::from_ne_bytes(word(WORD + 4, 4).try_into().unwrap_or([0; 4]));
        if len < HEADER || len > head.len() {
            out.malformed = true;
            break;
        }
        if level == libc::SOL_SOCKET && kind == libc::SCM_RIGHTS {
            let data = &head[HEADER..len];
            if !data.len().is_multiple_of(FD) {
                out.malformed = true;
            }
            for raw in data.chunks_exact(FD) {
                let fd = RawFd::from_ne_bytes(raw.try_into().unwrap_or([0xff; FD]));
                if fd < 0 || out.fds.contains(&fd) {
                    out.malformed = true;
                } else {
                    out.fds.push(fd);
                }
            }
        }
        at += align(len);
    }
    out
}

/// Lays out control messages as the kernel does: `(level, type, data)` each. For tests of
/// the parser and of receivers (a buffer the kernel would write).
pub fn build_control(messages: &[(i32, i32, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (level, kind, data) in messages {
        let len = HEADER + data.len();
        out.extend_from_slice(&len.to_ne_bytes());
        out.extend_from_slice(&level.to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.resize(out.len() + (HEADER - WORD - 8), 0);
        out.extend_from_slice(data);
        out.resize(out.len() + (align(len) - len), 0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rights(fds: &[RawFd]) -> Vec<u8> {
        fds.iter().flat_map(|f| f.to_ne_bytes()).collect()
    }

    #[test]
    fn the_layout_is_the_kernels() {
        // SAFETY: CMSG_LEN computes sizes and touch no memory.
        let (len3, len0) = unsafe { (libc::CMSG_LEN(3 * 4) as usize, libc::CMSG_LEN(0) as usize) };
        assert_eq!((rights_len(3), HEADER), (len3, len0));
        assert_eq!(std::mem::size_of::<libc::cmsghdr>(), HEADER);
    }

    #[test]
    fn rights_are_found_among_other_messages_and_odd_ones_are_flagged() {
        let creds = [0u8; 12];
        let buf = build_control(&[
            (libc::SOL_SOCKET, libc::SCM_CREDENTIALS, &creds),
            (libc::SOL_SOCKET, libc::SCM_RIGHTS, &rights(&[5, 9])),
            (libc::SOL_SOCKET, libc::SCM_RIGHTS, &rights(&[7])),
        ]);
        assert_eq!(parse_rights(&buf), Rights { fds: vec![5, 9, 7], malformed: false });
        // Truncated mid-message: what precedes it is kept, the rest flagged.
        // (The last 4 bytes are padding: cut into the descriptor.)
        let cut = parse_rights(&buf[..buf.len() - 5]);
        assert_eq!(cut, Rights { fds: vec![5, 9], malformed: true });
        // Repeated and negative descriptors are never handed out twice or at all.
        let buf = build_control(&[(libc::SOL_SOCKET, libc::SCM_RIGHTS, &rights(&[3, -1, 3, 4]))]);
        assert_eq!(parse_rights(&buf), Rights { fds: vec![3, 4], malformed: true });
        // A length shorter than a header, or past the end.
        let mut buf = build_control(&[(libc::SOL_SOCKET, libc::SCM_RIGHTS, &rights(&[3]))]);
        buf[..WORD].copy_from_slice(&1usize.to_ne_bytes());
        assert_eq!(parse_rights(&buf), Rights { fds: vec![], malformed: true });
        buf[..WORD].copy_from_slice(&usize::MAX.to_ne_bytes());
        assert_eq!(parse_rights(&buf), Rights { fds: vec![], malformed: true });
        assert_eq!(parse_rights(&[]), Rights::default());
    }
}
