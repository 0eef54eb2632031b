//! systemd readiness notification (`sd_notify`), by hand: one datagram to the socket named
//! by `$NOTIFY_SOCKET` (a path, or an abstract name starting with `@`).

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Sends `state` (e.g. `READY=1\nSTATUS=...`) to the service manager. Returns `false`
/// when not run under one (`NOTIFY_SOCKET` unset).
pub fn notify(state: &str) -> io::Result<bool> {
    let Some(target) = std::env::var_os("NOTIFY_SOCKET").filter(|v| !v.is_empty()) else {
        return Ok(false);
    };
    let bytes = target.as_encoded_bytes();
    let addr = match bytes.strip_prefix(b"@") {
        Some(name) => SocketAddr::from_abstract_name(name)?,
        None => SocketAddr::from_pathname(std::path::Path::new(&target))?,
    };
    let sock = UnixDatagram::unbound()?;
    sock.send_to_addr(state.as_bytes(), &addr)?;
    Ok(true)
}

/// [`notify`], logging instead of failing: readiness is best effort.
pub fn notify_logged(state: &str) {
    match notify(state) {
        Ok(true) => tracing::debug!(state, "service manager notified"),
        Ok(false) => {}
        Err(e) => tracing::warn!(error = %e, state, "cannot notify the service manager"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abstract_and_path_addresses_receive_the_datagram() {
        // One test changes the environment variable, so the cases run in sequence.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let rx = UnixDatagram::bind(&path).unwrap();
        let name = format!("fabricd-test-{}", std::process::id());
        let abs = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
        with_env(&path.display().to_string(), || assert!(notify("READY=1").unwrap()));
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
        with_env(&format!("@{name}"), || assert!(notify("STOPPING=1").unwrap()));
        let n = abs.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }

    fn with_env(v: &str, f: impl FnOnce()) {
        // SAFETY: no other thread of this test binary reads or writes NOTIFY_SOCKET.
        unsafe { std::env::set_var("NOTIFY_SOCKET", v) };
        f();
        // SAFETY: as above.
        unsafe { std::env::remove_var("NOTIFY_SOCKET") };
    }
}
