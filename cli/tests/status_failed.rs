//! `fabricctl status` against a daemon on a host (the PCI backend over a fixture sysfs
//! tree) whose rescan finds a PCI function failed (its AER fatal counter went up): the
//! device is listed as failed with the reason, in JSON; the region on its exported BAR is
//! lost (its export revoked, the importer refused); the address map keeps its range.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::os::unix::fs::symlink;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::Path;
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocTarget, BoundedVec, CodecError, Connection, DeviceName, ErrorCode, ExportPolicy,
    ExportRequest, ImportRequest, MemoryClass, Request, Response, SUPPORTED_VERSIONS, TranslateQuery, TranslateRequest,
    Translation,
};

const BDF: &str = "0000:01:00.0";
const FUNCTION: &str = "sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0";
const BAR_BYTES: u64 = 4 << 20;
const AER_CLEAN: &str = "Undefined 0\nDLP 0\nSDES 0\nTLP 0\nFCP 0\nCmpltTO 0\nMalfTLP 0\nTOTAL_ERR_FATAL 0\n";

fn fabricctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fabricctl")).args(args).env_remove("RUST_LOG").output().unwrap()
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn write(root: &Path, rel: &str, contents: impl AsRef<[u8]>) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, contents).unwrap();
}

/// One NUMA node, a root port and below it an accelerator whose BAR 2 (4 MiB) the
/// daemon exports; host name `syn`.
fn host(root: &Path) {
    write(root, "proc/sys/kernel/hostname", "syn\n");
    write(root, "sys/devices/system/node/node0/cpulist", "0-3\n");
    write(root, "sys/devices/system/node/node0/meminfo", "Node 0 MemTotal: 1048576 kB\n");
    std::fs::create_dir_all(root.join("sys/bus/pci/devices")).unwrap();
    let function = |path: &str, ids: [&str; 3], resource: Option<&str>| {
        for (name, value) in [("vendor", ids[0]), ("device", ids[1]), ("class", ids[2]), ("numa_node", "0")] {
            write(root, &format!("{path}/{name}"), format!("{value}\n"));
        }
        write(root, &format!("{path}/aer_dev_fatal"), AER_CLEAN);
        if let Some(r) = resource {
            write(root, &format!("{path}/resource"), r);
        }
        let name = path.rsplit('/').next().unwrap();
        symlink(format!("../../../{}", path.trim_start_matches("sys/")), root.join("sys/bus/pci/devices").join(name))
            .unwrap();
    };
    function("sys/devices/pci0000:00/0000:00:01.0", ["0x8086", "0x347a", "0x060400"], None);
    let zero = "0x0000000000000000 0x0000000000000000 0x0000000000000000\n";
    let bar2 = format!("0x00000000fe000000 0x{:016x} 0x0000000000040200\n", 0xfe00_0000 + BAR_BYTES - 1);
    function(FUNCTION, ["0x1ded", "0x1234", "0x120000"], Some(&format!("{zero}{zero}{bar2}{zero}{zero}{zero}")));
    std::fs::File::create(root.join(FUNCTION).join("resource2")).unwrap().set_len(BAR_BYTES).unwrap();
}

fn client(socket: &Path) -> Connection {
    let s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut c = Connection::new(s);
    c.hello("status-failed-test", SUPPORTED_VERSIONS).unwrap();
    c
}

fn import(c: &mut Connection, handle: fabric_proto::wire::ExportHandle) -> Result<(), ErrorCode> {
    match c.call(Request::Import(ImportRequest { handle, access: AccessMode::ReadOnly }), &[]) {
        Ok((Response::Import(_), _)) => Ok(()),
        Err(CodecError::Refused { body, .. }) => Err(body.code),
        other => panic!("{other:?}"),
    }
}

fn translate(c: &mut Connection, gfa: u64) -> Translation {
    let queries = vec![TranslateQuery::Gfa(gfa)].try_into().unwrap();
    let Response::Translate(t) = c.call(Request::Translate(TranslateRequest { queries }), &[]).unwrap().0 else {
        panic!()
    };
    t.results[0].clone()
}

#[test]
fn a_rescan_that_finds_a_pci_function_failed_shows_it_with_why_and_loses_its_memory() {
    let bin = Path::new(env!("CARGO_BIN_EXE_fabricctl")).with_file_name("fabricd");
    if !bin.exists() {
        eprintln!("skipped: fabricd is not built next to fabricctl (run the workspace's tests)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    host(&root);
    let socket = dir.path().join("fabricd.sock");
    let config = dir.path().join("fabricd.toml");
    let body = format!(
        "[socket]\npath = {:?}\n[state]\ndir = {:?}\n[discovery]\nsysfs_root = {:?}\nbackends = [\"pci\"]\n\
         rescan_interval_s = 1\nuevents = \"off\"\n[metrics]\nlisten = \"\"\n[memory]\nbars = [\"{BDF}/2\"]\n",
        socket.display().to_string(),
        dir.path().join("state").display().to_string(),
        root.display().to_string(),
    );
    std::fs::write(&config, body).unwrap();
    let notify_path = dir.path().join("notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let log = dir.path().join("log");
    let _d = Daemon(
        Command::new(&bin)
            .arg("--config")
            .arg(&config)
            .env("NOTIFY_SOCKET", &notify_path)
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let mut buf = [0u8; 128];
    if notify.recv(&mut buf).is_err() {
        panic!("fabricd did not start:\n{}", std::fs::read_to_string(&log).unwrap_or_default());
    }
    let sock = socket.to_str().unwrap();
    let device = format!("pci:syn/{BDF}");

    let mut owner = client(&socket);
    let req = Request::Alloc(AllocRequest {
        target: AllocTarget::Device { device: DeviceName::truncated(&device), memory: MemoryClass::HostExported },
        size: 2 << 20,
        align: 0,
    });
    let Response::Alloc(a) = owner.call(req, &[]).unwrap().0 else { panic!() };
    let gfa = a.gfa.expect("the BAR is placed in the map");
    let policy = ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: None,
        access: AccessMode::ReadOnly,
    };
    let Response::Export(e) =
        owner.call(Request::Export(ExportRequest { region: a.region, policy, node: None }), &[]).unwrap().0
    else {
        panic!()
    };
    let mut importer = client(&socket);
    import(&mut importer, e.handle).unwrap();
    let o = fabricctl(&["status", "--daemon", sock, "-o", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(!v["problems"].as_array().unwrap().iter().any(|p| p["kind"] == "device_failed"), "{v}");

    // The function reports a fatal uncorrectable error; the next rescan sees it.
    write(
        &root,
        &format!("{FUNCTION}/aer_dev_fatal"),
        AER_CLEAN.replace("DLP 0", "DLP 1").replace("FATAL 0", "FATAL 1"),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let failed = loop {
        let o = fabricctl(&["status", "--daemon", sock, "-o", "json"]);
        assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let found = v["problems"].as_array().unwrap().iter().find(|p| p["kind"] == "device_failed").cloned();
        if let Some(p) = found {
            break p;
        }
        assert!(Instant::now() < deadline, "the failed function never showed: {v}");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(failed["subject"], device.as_str(), "{failed}");
    let detail = failed["detail"].as_str().unwrap();
    assert!(detail.contains("AER") && detail.contains("1 fatal") && detail.contains("DLP 1"), "{detail}");
    assert!(detail.contains("regions are lost"), "{detail}");
    let table = String::from_utf8_lossy(&fabricctl(&["status", "--daemon", sock]).stdout).into_owned();
    assert!(table.contains(&device) && table.contains("fatal uncorrectable"), "{table}");

    // Its memory is lost: the export is revoked, a new import refused; the map keeps the
    // range (a failed device is still there, unlike a vanished one).
    assert_eq!(import(&mut importer, e.handle), Err(ErrorCode::Revoked));
    assert!(
        matches!(translate(&mut importer, gfa), Translation::Resource { .. }),
        "{:?}",
        translate(&mut importer, gfa)
    );
    // A new export of the lost region is refused.
    let refused = owner.call(
        Request::Export(ExportRequest {
            region: a.region,
            policy: ExportPolicy {
                uids: BoundedVec::default(),
                gids: BoundedVec::default(),
                partition: None,
                access: AccessMode::ReadOnly,
            },
            node: None,
        }),
        &[],
    );
    assert!(
        matches!(refused, Err(CodecError::Refused { ref body, .. }) if body.code == ErrorCode::Unavailable),
        "{refused:?}"
    );
}
