//! The daemon's files and directories against other local users (issue 16, items 4 and 8):
//! started under umask 022 its state dir is 0700 and its files 0600, unreadable by another
//! uid; a state dir or socket dir someone else could write, owns, or a symlink refuses the
//! start, naming path, owner and mode; a symlink planted where a region file or a state
//! file's temporary goes is not followed.
//!
//! The parts that need another uid (reading as it, a directory it owns) or admin rights run
//! as root only and print why they skipped otherwise; CI runs them as root.
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::print_stderr, reason = "a test and its child process")]

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use fabric_proto::wire::{
    AccessMode, BoundedVec, DeviceName, ExportPolicy, ExportRequest, ImportRequest, Name, PartitionSpec,
    PartitionsRequest, Request, Response,
};
use fabric_topology::Fabric;

/// Another uid, with no access to anything of the daemon's.
const OTHER_UID: u32 = 61011;
const ENV_READ: &str = "FABRICD_FILES_READ";

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn gpu() -> String {
    let f = Fabric::build(fabric_drivers::sim::load(&common::sim_file()).unwrap()).unwrap();
    f.inventory().devices.iter().find(|d| d.gpu.is_some()).unwrap().id.to_string()
}

/// The owner's uid only (empty uids and gids).
fn owner_only() -> ExportPolicy {
    ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: None,
        access: AccessMode::ReadWrite,
    }
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

/// Starts fabricd under umask 022, as a shell started by hand would.
fn start_umask_022(s: &common::Setup) -> common::Daemon {
    common::start_with(&s.config, s.dir.path(), |cmd| {
        // SAFETY: umask is async-signal-safe and touches no memory.
        unsafe {
            cmd.pre_exec(|| {
                libc::umask(0o022);
                Ok(())
            });
        }
    })
}

/// Runs fabricd on `config` expecting it to refuse to start: its exit status and log.
fn refused(config: &Path, dir: &Path) -> String {
    let log = dir.join("refused.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_fabricd"))
        .arg("--config")
        .arg(config)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let st = common::wait_exit(&mut child, 30);
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(st.code(), Some(4), "fabricd must refuse to start; log:\n{text}");
    text
}

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if e.file_type().unwrap().is_dir() {
            out.push(p.clone());
            files_under(&p, out);
        } else {
            out.push(p);
        }
    }
}

#[test]
fn under_umask_022_the_state_is_private_and_another_uid_reads_nothing() {
    let s = common::Setup::new(if is_root() { "group = \"61100\"" } else { "" });
    let d = start_umask_022(&s);
    let mut c = common::client(&s.socket);
    let (a, _file) = common::alloc_hbm(&mut c, &gpu(), 1 << 20);
    let policy = owner_only();
    let (r, _) = c.call(Request::Export(ExportRequest { region: a.region, policy, node: None }), &[]).unwrap();
    assert!(matches!(r, Response::Export(_)), "{r:?}");
    if is_root() {
        let spec = PartitionSpec {
            name: Name::truncated("p"),
            devices: vec![DeviceName::truncated(&gpu())].try_into().unwrap(),
            uids: BoundedVec::default(),
            gids: BoundedVec::default(),
        };
        let (r, _) = c.call(Request::Partitions(PartitionsRequest::Set(spec)), &[]).unwrap();
        assert!(matches!(r, Response::Partitions(_)), "{r:?}");
    }
    let mut all = Vec::new();
    files_under(&s.state, &mut all);
    assert_eq!(mode(&s.state), 0o700, "state dir");
    let mut regions = 0;
    for p in &all {
        let m = mode(p);
        if p.is_dir() {
            assert_eq!(m, 0o700, "{}", p.display());
        } else {
            assert_eq!(m, 0o600, "{}", p.display());
        }
        regions += usize::from(p.file_name().unwrap().to_str().unwrap() == format!("r{}", a.region));
    }
    assert_eq!(regions, 1, "the region's file is among {all:?}");
    for name in [fabricd::store::RECORD_FILE, "journal/journal.lock"] {
        assert!(all.contains(&s.state.join(name)), "{name} in {all:?}");
    }
    assert!(all.iter().any(|p| p.extension().is_some_and(|e| e == "seg")), "a journal segment in {all:?}");
    if is_root() {
        // The socket: its configured mode and group, and nothing left of its private
        // staging directory.
        let m = std::fs::metadata(&s.socket).unwrap();
        assert_eq!((m.mode() & 0o777, m.gid()), (0o660, 61100));
        let left: Vec<_> =
            std::fs::read_dir(s.socket.parent().unwrap()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left, vec![std::ffi::OsString::from("fabricd.sock")]);
        // Another uid reads nothing: not the directories, not the files.
        let list = all.iter().chain([&s.state]).map(|p| p.display().to_string()).collect::<Vec<_>>().join("\n");
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--ignored", "--exact", "read_child", "--nocapture", "--test-threads", "1"]).env(ENV_READ, list);
        // SAFETY: setgroups, setgid and setuid are async-signal-safe; no allocation.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setgid(OTHER_UID) != 0
                    || libc::setuid(OTHER_UID) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("read nothing"),
            "{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    } else {
        eprintln!("skipped the other-uid part: needs root to run a reader under uid {OTHER_UID}");
    }
    drop(d);
}

/// Run by the test above under another uid: tries to open each path listed.
#[test]
#[ignore = "run as a child process by the test above"]
fn read_child() {
    let list = std::env::var(ENV_READ).unwrap();
    for p in list.lines() {
        let r = if Path::new(p).is_dir() { std::fs::read_dir(p).map(|_| ()) } else { std::fs::read(p).map(|_| ()) };
        assert!(r.is_err(), "uid {} could read {p}", nix::unistd::getuid());
    }
    println!("read nothing");
}

#[test]
fn a_state_dir_others_can_write_another_owns_or_a_symlink_refuses_the_start() {
    let s = common::Setup::new("");
    std::fs::create_dir(&s.state).unwrap();
    for m in [0o777, 0o770, 0o1777] {
        std::fs::set_permissions(&s.state, std::fs::Permissions::from_mode(m)).unwrap();
        let log = refused(&s.config, s.dir.path());
        let want = format!("{} (owner uid {}, mode {m:04o}) is unsafe", s.state.display(), nix::unistd::geteuid());
        assert!(log.contains(&want) && log.contains("may write"), "{want}\n{log}");
    }
    std::fs::set_permissions(&s.state, std::fs::Permissions::from_mode(0o700)).unwrap();
    let real = s.dir.path().join("real");
    std::fs::rename(&s.state, &real).unwrap();
    std::os::unix::fs::symlink(&real, &s.state).unwrap();
    let log = refused(&s.config, s.dir.path());
    assert!(log.contains(&s.state.display().to_string()) && log.contains("symlink"), "{log}");
    std::fs::remove_file(&s.state).unwrap();
    std::fs::rename(&real, &s.state).unwrap();
    if is_root() {
        std::os::unix::fs::chown(&s.state, Some(OTHER_UID), None).unwrap();
        let log = refused(&s.config, s.dir.path());
        assert!(log.contains(&format!("owner uid {OTHER_UID}")) && log.contains("another uid owns it"), "{log}");
    } else {
        eprintln!("skipped the other-owner part: needs root to give the directory to uid {OTHER_UID}");
    }
}

#[test]
fn a_socket_dir_another_uid_can_write_or_owns_refuses_the_start() {
    let s = common::Setup::new("");
    let dir = s.socket.parent().unwrap();
    std::fs::create_dir(dir).unwrap();
    for m in [0o777, 0o1777, 0o775] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(m)).unwrap();
        let log = refused(&s.config, s.dir.path());
        let want = format!(
            "socket directory {} (owner uid {}, mode {m:04o}) is unsafe",
            dir.display(),
            nix::unistd::geteuid()
        );
        assert!(log.contains(&want), "{want}\n{log}");
    }
    if is_root() {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::chown(dir, Some(OTHER_UID), None).unwrap();
        let log = refused(&s.config, s.dir.path());
        assert!(log.contains(&format!("owner uid {OTHER_UID}, mode 0755")), "{log}");
    } else {
        eprintln!("skipped the other-owner part: needs root to give the directory to uid {OTHER_UID}");
    }
}

#[test]
fn symlinks_planted_at_a_region_file_or_a_state_files_temporary_are_not_followed() {
    let s = common::Setup::new("");
    let d = common::start(&s.config, s.dir.path());
    let mut c = common::client(&s.socket);
    let (a, _file) = common::alloc_hbm(&mut c, &gpu(), 1 << 20);
    let (r, _) =
        c.call(Request::Export(ExportRequest { region: a.region, policy: owner_only(), node: None }), &[]).unwrap();
    let Response::Export(e) = r else { panic!("{r:?}") };
    // A file only the daemon's uid may read, and a link to it where the region file was
    // (as whoever could write a misconfigured state dir could plant).
    let secret = s.dir.path().join("secret");
    std::fs::write(&secret, b"a secret of the daemon's uid").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut all = Vec::new();
    files_under(&s.state, &mut all);
    let region = all.iter().find(|p| p.file_name().unwrap().to_str() == Some(&format!("r{}", a.region))).unwrap();
    std::fs::remove_file(region).unwrap();
    std::os::unix::fs::symlink(&secret, region).unwrap();
    let got = c.call(Request::Import(ImportRequest { handle: e.handle, access: AccessMode::ReadWrite }), &[]);
    if let Ok((r, fds)) = &got {
        let leaked =
            fds.first().map(|fd| std::fs::read(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(fd))));
        panic!("Import followed the planted symlink: {r:?}, descriptor reads {leaked:?}");
    }
    if is_root() {
        // A link where the map record's temporary goes: the next change must not write
        // through it.
        let record = s.state.join(fabricd::store::RECORD_FILE);
        std::os::unix::fs::symlink(&secret, fabric_addrmap::durable::suffixed(&record, ".tmp")).unwrap();
        let spec = PartitionSpec {
            name: Name::truncated("p"),
            devices: vec![DeviceName::truncated(&gpu())].try_into().unwrap(),
            uids: BoundedVec::default(),
            gids: BoundedVec::default(),
        };
        let _ = c.call(Request::Partitions(PartitionsRequest::Set(spec)), &[]);
    }
    assert_eq!(std::fs::read(&secret).unwrap(), b"a secret of the daemon's uid", "written through a link");
    drop(d);
}

/// Region files are opened by name in their resource's directory as the daemon opened it
/// at start (a descriptor held since it was checked), not by path: a directory moved away
/// and another put in its place — what whoever could write a misconfigured parent could
/// do — does not change which file an Import hands out.
#[test]
fn region_files_are_opened_in_the_directory_held_since_start_not_by_path() {
    use std::io::{Read, Seek, Write};
    let s = common::Setup::new("");
    let d = common::start(&s.config, s.dir.path());
    let mut c = common::client(&s.socket);
    let (a, file) = common::alloc_hbm(&mut c, &gpu(), 1 << 20);
    let mut file = file;
    file.write_all(b"the region's own bytes").unwrap();
    let (r, _) =
        c.call(Request::Export(ExportRequest { region: a.region, policy: owner_only(), node: None }), &[]).unwrap();
    let Response::Export(e) = r else { panic!("{r:?}") };
    let mut all = Vec::new();
    files_under(&s.state, &mut all);
    let region = all.iter().find(|p| p.file_name().unwrap().to_str() == Some(&format!("r{}", a.region))).unwrap();
    let dir = region.parent().unwrap().to_owned();
    // The resource directory moved aside; a new one with a decoy of the same name in its place.
    std::fs::rename(&dir, dir.with_extension("moved")).unwrap();
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(region, vec![b'x'; 1 << 20]).unwrap();
    let (r, fds) =
        c.call(Request::Import(ImportRequest { handle: e.handle, access: AccessMode::ReadWrite }), &[]).unwrap();
    assert!(matches!(r, Response::Import(_)), "{r:?}");
    let mut got = std::fs::File::from(fds.into_iter().next().unwrap());
    got.rewind().unwrap();
    let mut head = [0u8; 22];
    got.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"the region's own bytes", "Import handed out the file now at the region's path");
    drop(d);
}
