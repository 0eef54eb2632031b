//! The shipped systemd unit passes `systemd-analyze verify` (when the tool exists) and
//! keeps the properties the daemon relies on.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::path::Path;
use std::process::Command;

fn unit_text() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/systemd/fabricd.service")).unwrap()
}

#[test]
fn the_unit_is_type_notify_hardened_and_keeps_sys_and_dev_readable() {
    let text = unit_text();
    for want in [
        "Type=notify",
        "ExecStart=/usr/local/bin/fabricd --config /etc/fabric/fabricd.toml",
        "RuntimeDirectory=fabric",
        "StateDirectory=fabric",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ReadWritePaths=/var/lib/fabric /run/fabric",
        "ProtectHome=yes",
        "PrivateTmp=yes",
    ] {
        assert!(text.lines().any(|l| l == want), "missing {want:?}");
    }
    // /sys and /dev must stay readable for discovery.
    for forbidden in
        ["ProtectKernelTunables=yes", "PrivateDevices=yes", "InaccessiblePaths=/sys", "InaccessiblePaths=/dev"]
    {
        assert!(!text.contains(forbidden), "{forbidden} would hide /sys or /dev from discovery");
    }
}

#[test]
fn systemd_analyze_verify_accepts_the_unit() {
    if Command::new("systemd-analyze").arg("--version").output().is_err() {
        eprintln!("skipped: systemd-analyze is not installed");
        return;
    }
    // verify also checks that ExecStart exists; point it at the binary just built (the
    // only change), under the unit's own name.
    let dir = tempfile::tempdir().unwrap();
    let text = unit_text().replace("/usr/local/bin/fabricd", env!("CARGO_BIN_EXE_fabricd"));
    let unit = dir.path().join("fabricd.service");
    std::fs::write(&unit, text).unwrap();
    let out = Command::new("systemd-analyze").arg("verify").arg(&unit).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let relevant: Vec<&str> = err
        .lines()
        // Lines about other units on this machine (or no running systemd) are not ours.
        .filter(|l| l.contains("fabricd.service"))
        .collect();
    assert!(out.status.success() && relevant.is_empty(), "systemd-analyze verify:\n{err}");
}
