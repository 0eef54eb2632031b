//! Scraping a test daemon's metrics page: a free port, a raw HTTP request, the value of
//! one series, and `promtool check metrics` when promtool is installed.
#![allow(clippy::print_stderr)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

/// A port free right now on 127.0.0.1 (bound, read, released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Sends `request` raw and returns (status line, headers, body).
pub fn http(port: u16, request: &[u8]) -> (String, String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(request).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8(raw).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    (status.to_owned(), headers.to_owned(), body.to_owned())
}

pub fn scrape(port: u16) -> String {
    let (status, headers, body) = http(port, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert!(headers.contains("Content-Type: text/plain; version=0.0.4"), "{headers}");
    assert!(headers.contains(&format!("Content-Length: {}", body.len())), "{headers}");
    body
}

/// The value of the sample `series` (name and labels exactly as rendered), if present.
pub fn value(page: &str, series: &str) -> Option<f64> {
    page.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// `promtool check metrics` on the page, when promtool is installed (Debian `prometheus`;
/// `scripts/deps.sh` installs it as root).
pub fn promtool_check(page: &str) {
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("skipped promtool check: promtool not installed (Debian package prometheus; scripts/deps.sh)");
            return;
        }
        Err(e) => panic!("running promtool: {e}"),
    };
    child.stdin.take().unwrap().write_all(page.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && said.trim().is_empty(), "promtool check metrics: {said}\npage:\n{page}");
    eprintln!("promtool check metrics: ok");
}
