//! Fuzzes the control-data parser of the descriptor-receiving path: any bytes, read as the
//! control buffer a `recvmsg` filled, yield each descriptor at most once and none negative,
//! never a panic; and the same descriptors laid out as the kernel writes them come back
//! exactly, whole or cut short.
#![no_main]

use fabric_proto::wire::{build_control, parse_rights, rights_len};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let got = parse_rights(data);
    assert!(got.fds.iter().all(|fd| *fd >= 0));
    let mut seen = got.fds.clone();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), got.fds.len(), "a descriptor named twice would be closed twice");
    // The input as distinct descriptors in one SCM_RIGHTS message: all of them come back,
    // and a buffer cut inside the message gives none and says so.
    let mut fds: Vec<i32> = data.chunks_exact(4).map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]]) & i32::MAX).collect();
    fds.sort_unstable();
    fds.dedup();
    let bytes: Vec<u8> = fds.iter().flat_map(|f| f.to_ne_bytes()).collect();
    let buf = build_control(&[(libc::SOL_SOCKET, libc::SCM_RIGHTS, &bytes)]);
    let whole = parse_rights(&buf);
    assert_eq!(whole.fds.len(), fds.len());
    assert!(!whole.malformed);
    if !bytes.is_empty() {
        let cut = parse_rights(&buf[..rights_len(fds.len()) - 1]);
        assert!(cut.fds.is_empty() && cut.malformed);
    }
});
