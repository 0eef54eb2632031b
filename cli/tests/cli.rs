//! The built `fabricctl` binary: help, usage errors (exit 2) and runtime errors (exit 1 with
//! the error chain and a hint).

use std::process::{Command, Output};

fn fabricctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fabricctl")).args(args).env_remove("RUST_LOG").output().expect("runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn help_lists_the_commands() {
    let o = fabricctl(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    let t = text(&o.stdout);
    for c in ["topology", "devices", "path"] {
        assert!(t.contains(c), "{c} in {t}");
    }
    let o = fabricctl(&["topology", "--help"]);
    assert_eq!(o.status.code(), Some(0));
    let t = text(&o.stdout);
    for f in ["nccl-xml", "--sysfs-root", "--sim", "--node"] {
        assert!(t.contains(f), "{f} in {t}");
    }
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        &["topology", "--bogus"][..],
        &["topology", "-o", "yaml"],
        &["frobnicate"],
        &["path", "GPU0"],
        &["topology", "--sim", "a.toml", "--sysfs-root", "/"],
    ] {
        let o = fabricctl(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o.stderr));
        assert!(text(&o.stderr).starts_with("error:"), "{args:?}");
    }
}

#[test]
fn a_missing_sim_file_exits_1_naming_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let f = dir.path().join("no-such-fabric.toml");
    let o = fabricctl(&["topology", "--sim", f.to_str().expect("utf-8")]);
    assert_eq!(o.status.code(), Some(1));
    let e = text(&o.stderr);
    assert!(e.contains("error:") && e.contains(&f.display().to_string()), "{e}");
    assert!(e.contains("hint:"), "{e}");
    assert!(o.stdout.is_empty());
}

#[test]
fn a_sysfs_root_without_sys_exits_1_with_a_hint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let o = fabricctl(&["devices", "--sysfs-root", dir.path().to_str().expect("utf-8")]);
    assert_eq!(o.status.code(), Some(1));
    let e = text(&o.stderr);
    assert!(e.contains("has no sys/ directory") && e.contains("hint: pass --sysfs-root"), "{e}");
}

/// JSON far larger than a pipe holds, whose reader leaves after the first byte
/// (`| head -c 1`): the write that fails is inside the JSON writer, and that is the reader
/// leaving, not an error: exit 0, nothing on stderr. The review of the change that made
/// only a broken pipe count as the reader leaving found these exiting 1: the broken pipe
/// was hidden inside serde's error (or an `io::Error::other` around it).
#[test]
fn large_json_whose_reader_leaves_early_exits_0() {
    use std::io::Read;
    use std::process::Stdio;
    let sim = |name: &str| format!("{}/../configs/sim/{name}", env!("CARGO_MANIFEST_DIR"));
    let state = tempfile::tempdir().unwrap();
    let map_state = state.path().join("map.state");
    let (pod, supernode) = (sim("ualink-pod-1024.toml"), sim("supernode-64.toml"));
    for args in [
        vec!["map", "-o", "json", "--sim", &pod, "--state", map_state.to_str().unwrap()],
        vec!["devices", "-o", "json", "--sim", &supernode],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_fabricctl"))
            .args(&args)
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut first = [0u8; 1];
        child.stdout.as_mut().unwrap().read_exact(&mut first).unwrap();
        drop(child.stdout.take());
        let o = child.wait_with_output().unwrap();
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", text(&o.stderr));
    }
}
