//! `fabric-guest-probe`: runs inside the QEMU guests. `fill PATH LEN SEED` maps PATH (a DAX
//! device or a PCI BAR's sysfs `resourceN`) with libfabric-mm's `DeviceMapping` and stores
//! the test pattern through the mapping; `check PATH LEN SEED` loads through the mapping and compares. Exit 0 on
//! success, 1 on a mismatch (the first one is printed), 2 on a usage or mapping error.
//! `edu-dma BDF GROUP` drives QEMU's edu device through VFIO (see `vfio.rs`).
//! `mm-edu BDF` does the same through libfabric-mm and fabricd's VFIO backend (`mmvfio.rs`).
//! `owner TARGET LEN SEED OUT` and `importer OUT LEN SEED [STORE]` share device memory through fabricd
//! and libfabric-mm's Session API (see `session.rs`); `hold OUT LEN SEED READY [SECONDS]`
//! maps an import and loads it until a fault ends it (the revocation of a per-region DAX
//! import across hosts).
//! `power-workload OUT TOKEN|- SEED` and `power-observe MEMORY_DIR HANDLES OUT` are the
//! guest's half of the power-loss test (see `power.rs`).
//! `split SET DIR` is the client of the per-region DAX test (see `split.rs`).
//! `watch SOCKET` subscribes to every fabricd event topic and prints each event as one
//! `FABRIC-EVENT {json}` line until the daemon closes the connection or the probe is killed.

use std::process::ExitCode;

use fabric_qemu_tests::pattern;

mod mmvfio;
mod power;
mod session;
mod split;
mod vfio;

fn parse(s: &str) -> Option<u64> {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

#[allow(clippy::print_stderr, clippy::print_stdout)] // A command-line tool run by guest scripts.
fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if let (Some("edu-dma"), Some(bdf), Some(group)) = (args.get(1).map(String::as_str), args.get(2), args.get(3)) {
        return match vfio::edu_dma(bdf, group) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("edu-dma: {e}");
                ExitCode::from(1)
            }
        };
    }
    if let (Some("mm-edu"), Some(bdf)) = (args.get(1).map(String::as_str), args.get(2)) {
        return match mmvfio::mm_edu(bdf) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("mm-edu: {e}");
                ExitCode::from(1)
            }
        };
    }
    let arg = |i: usize| args.get(i).map(String::as_str);
    let num = |i: usize| args.get(i).and_then(|s| parse(s));
    let done = |r: Result<String, String>| match r {
        Ok(m) => {
            println!("{m}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(1)
        }
    };
    if let (Some("owner"), Some(target), Some(len), Some(seed), Some(out)) = (arg(1), arg(2), num(3), num(4), arg(5)) {
        return done(session::owner(target, len, seed, std::path::Path::new(out)));
    }
    if let (Some("split"), Some(set), Some(dir)) = (arg(1), arg(2), arg(3)) {
        return done(split::split(set, std::path::Path::new(dir)));
    }
    if let (Some("importer"), Some(file), Some(len), Some(seed)) = (arg(1), arg(2), num(3), num(4)) {
        return done(session::importer(std::path::Path::new(file), len, seed, num(5)));
    }
    if let (Some("hold"), Some(file), Some(len), Some(seed), Some(ready)) = (arg(1), arg(2), num(3), num(4), arg(5)) {
        use std::path::Path;
        return done(session::hold(Path::new(file), len, seed, Path::new(ready), num(6).unwrap_or(60)));
    }
    if let (Some("power-workload"), Some(out), Some(token), Some(seed)) = (arg(1), arg(2), arg(3), num(4)) {
        let resume = if token == "-" { None } else { power::parse_token(token) };
        return done(power::workload(std::path::Path::new(out), resume, seed));
    }
    if let (Some("power-observe"), Some(memory), Some(handles), Some(out)) = (arg(1), arg(2), arg(3), arg(4)) {
        use std::path::Path;
        return done(power::observe(Path::new(memory), Path::new(handles), Path::new(out)));
    }
    if args.get(1).map(String::as_str) == Some("watch") {
        return watch(args.get(2).map(String::as_str).unwrap_or("/run/fabric/fabricd.sock"));
    }
    let (Some(op), Some(path), Some(len), Some(seed)) =
        (args.get(1), args.get(2), args.get(3).and_then(|s| parse(s)), args.get(4).and_then(|s| parse(s)))
    else {
        eprintln!("usage: fabric-guest-probe fill|check PATH LEN SEED [ORIGIN]");
        return ExitCode::from(2);
    };
    // ORIGIN: where in the file the patterned bytes start (a region's offset in a DAX
    // device); the pattern's offsets count from there. 0 when absent.
    let origin = match args.get(5).map(|s| parse(s)) {
        None => 0,
        Some(Some(o)) => o,
        Some(None) => {
            eprintln!("ORIGIN {:?} is not a number", args[5]);
            return ExitCode::from(2);
        }
    };
    let Some(end) = origin.checked_add(len) else {
        eprintln!("ORIGIN + LEN overflows");
        return ExitCode::from(2);
    };
    // The mapping is libfabric-mm's: the library's device-memory path under test.
    let map = match fabric_mm::device::DeviceMapping::open(std::path::Path::new(path), end as usize) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("{e}: {}", std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default());
            return ExitCode::from(2);
        }
    };
    const CHUNK: u64 = 0x1_0000;
    let mut buf = vec![0u8; CHUNK as usize];
    match op.as_str() {
        "fill" => {
            for at in (0..len).step_by(CHUNK as usize) {
                let n = CHUNK.min(len - at) as usize;
                for (i, w) in buf[..n].chunks_exact_mut(8).enumerate() {
                    w.copy_from_slice(&pattern::word(seed, at + i as u64 * 8).to_le_bytes());
                }
                if let Err(e) = map.write((origin + at) as usize, &buf[..n]) {
                    eprintln!("{e}");
                    return ExitCode::from(2);
                }
            }
            println!("filled {len:#x} bytes of {path} at {origin:#x} with seed {seed:#x}");
            ExitCode::SUCCESS
        }
        "check" => {
            for at in (0..len).step_by(CHUNK as usize) {
                let n = CHUNK.min(len - at) as usize;
                if let Err(e) = map.read((origin + at) as usize, &mut buf[..n]) {
                    eprintln!("{e}");
                    return ExitCode::from(2);
                }
                for (i, w) in buf[..n].chunks_exact(8).enumerate() {
                    let off = at + i as u64 * 8;
                    let got = u64::from_le_bytes(w.try_into().unwrap_or_default());
                    let want = pattern::word(seed, off);
                    if got != want {
                        eprintln!("{path}: offset {:#x}: {got:#018x}, expected {want:#018x}", origin + off);
                        return ExitCode::from(1);
                    }
                }
            }
            println!("checked {len:#x} bytes of {path} at {origin:#x} with seed {seed:#x}");
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("unknown operation {op}");
            ExitCode::from(2)
        }
    }
}

#[allow(clippy::print_stderr, clippy::print_stdout)] // As above.
fn watch(socket: &str) -> ExitCode {
    use fabric_proto::wire::{Connection, Request, Response, SUPPORTED_VERSIONS, SubscribeRequest, Topics};
    use std::io::Write;
    let stream = match std::os::unix::net::UnixStream::connect(socket) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("connect {socket}: {e}");
            return ExitCode::from(2);
        }
    };
    let mut c = Connection::new(stream);
    if let Err(e) = c.hello("fabric-guest-probe", SUPPORTED_VERSIONS) {
        eprintln!("hello: {e}");
        return ExitCode::from(2);
    }
    match c.call(Request::Subscribe(SubscribeRequest { topics: Topics::ALL }), &[]) {
        Ok((Response::Subscribe(_), _)) => println!("FABRIC-WATCH subscribed"),
        other => {
            eprintln!("subscribe: {other:?}");
            return ExitCode::from(2);
        }
    }
    let _ = std::io::stdout().flush();
    loop {
        match c.next_event() {
            Ok(ev) => {
                println!(
                    "FABRIC-EVENT {}",
                    serde_json::to_string(&ev).unwrap_or_else(|e| format!("{{\"unprintable\":\"{e}\"}}"))
                );
                let _ = std::io::stdout().flush();
            }
            Err(e) => {
                println!("FABRIC-WATCH ended: {e}");
                return ExitCode::SUCCESS;
            }
        }
    }
}
