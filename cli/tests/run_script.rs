//! README command 1, `scripts/run.sh`, as a user runs it and stops it: started in its own
//! process group with a private `XDG_RUNTIME_DIR` and `XDG_STATE_HOME` (and no terminal),
//! with the test build's fabricd and fabricctl (`FABRIC_BIN`); once it has shown the
//! topology, the address map and the status, the whole group gets SIGINT, as Ctrl-C sends
//! it. The script must exit 0 having stopped fabricd cleanly, and leave no daemon and no
//! socket behind.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Kills the script's whole group if the test fails half-way.
struct Group(Child);

impl Drop for Group {
    fn drop(&mut self) {
        let pgid = self.0.id() as libc::pid_t;
        // SAFETY: signals the process group this test created (its leader is our child).
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| !s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
            .unwrap_or(false)
}

#[test]
fn run_script_serves_the_sim_and_stops_cleanly_on_ctrl_c() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_owned();
    let bin = Path::new(env!("CARGO_BIN_EXE_fabricctl")).parent().unwrap().to_owned();
    assert!(bin.join("fabricd").exists(), "{} has no fabricd: run `cargo build -p fabricd`", bin.display());
    let tmp = tempfile::tempdir().unwrap();
    let (runtime, state) = (tmp.path().join("run"), tmp.path().join("state"));
    std::fs::create_dir(&runtime).unwrap();
    std::fs::create_dir(&state).unwrap();

    let started = Instant::now();
    let mut child = Command::new("bash")
        .arg(root.join("scripts/run.sh"))
        .current_dir(tmp.path())
        .env("FABRIC_BIN", &bin)
        .env("XDG_RUNTIME_DIR", &runtime)
        .env("XDG_STATE_HOME", &state)
        .env_remove("FABRIC_SOCKET")
        .env_remove("SIM")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let (stdout, mut stderr) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let mut group = Group(child);

    // Lines as they come, so that the signal goes only once the script is waiting.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line.unwrap_or_default()).is_err() {
                break;
            }
        }
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let mut out = String::new();
    let deadline = started + Duration::from_secs(20);
    while !out.contains("Ctrl-C stops it.") {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                out.push_str(&line);
                out.push('\n');
            }
            Err(_) => panic!("run.sh did not show the daemon serving within 20 s:\n{out}"),
        }
    }
    let serving = out.lines().find(|l| l.contains("fabricd is serving on")).unwrap();
    let socket = PathBuf::from(serving.split("serving on ").nth(1).unwrap().split(" (pid").next().unwrap());
    let pid: u32 = serving
        .rsplit("(pid ")
        .next()
        .unwrap()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap();
    assert!(socket.starts_with(&runtime), "the socket {} is not under XDG_RUNTIME_DIR", socket.display());
    assert!(alive(pid), "fabricd (pid {pid}) is not running while the script says it serves");
    for section in ["fabricctl topology --daemon", "fabricctl map --daemon", "fabricctl status --daemon"] {
        assert!(out.contains(section), "no {section:?} section:\n{out}");
    }
    // What each section shows: the sim's GPUs and links, the HBM in the map, a status.
    assert!(out.contains("GPU0  X     NV18"), "topology:\n{out}");
    assert!(out.contains("Address map generation") && out.contains(" hbm "), "map:\n{out}");
    assert!(out.contains(": serving (up") && out.contains("\ndevices "), "status:\n{out}");

    // Ctrl-C: SIGINT to the foreground group (script, fabricd, whatever runs).
    let pgid = group.0.id() as libc::pid_t;
    // SAFETY: signals the process group this test created.
    assert_eq!(unsafe { libc::kill(-pgid, libc::SIGINT) }, 0);
    let status = loop {
        if let Some(s) = group.0.try_wait().unwrap() {
            break s;
        }
        assert!(started.elapsed() < Duration::from_secs(28), "run.sh did not stop within 8 s of SIGINT:\n{out}");
        std::thread::sleep(Duration::from_millis(20));
    };
    for line in rx.try_iter() {
        out.push_str(&line);
        out.push('\n');
    }
    let err = err.join().unwrap();
    assert!(status.success(), "run.sh exited with {status}\nstdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("fabricd stopped cleanly"), "stdout:\n{out}\nstderr:\n{err}");
    let deadline = Instant::now() + Duration::from_secs(2);
    while alive(pid) {
        assert!(Instant::now() < deadline, "fabricd (pid {pid}) outlived run.sh");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!socket.exists(), "the socket {} is left behind", socket.display());
    assert_eq!(std::fs::read_dir(&runtime).unwrap().count(), 0, "run.sh left files in XDG_RUNTIME_DIR");
    assert!(started.elapsed() < Duration::from_secs(30));
}
