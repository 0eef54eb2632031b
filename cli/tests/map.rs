//! `fabricctl map` end to end through the built binary: stable placement across runs, holes
//! for vanished devices and their return, gc, translation both ways, partitions, CXL
//! interleave sets, and a corrupt state file that is reported, left alone and rebuilt.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

struct Env {
    dir: tempfile::TempDir,
    sim: PathBuf,
}

impl Env {
    /// A copy of the HGX sim fabric with `gpus` GPUs, and a private state directory.
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let sim = dir.path().join("board.toml");
        let e = Env { dir, sim };
        e.set_gpus(8);
        e
    }

    fn set_gpus(&self, n: u32) {
        let text = std::fs::read_to_string(repo().join("configs/sim/hgx-h100-8gpu.toml")).unwrap();
        let gpus = "name = \"gpu{i}\"\ncount = 8";
        let links = "to = \"nvswitch{j}\"\ni = 8";
        assert!(text.contains(gpus) && text.contains(links), "the HGX config declares its GPUs as this test expects");
        let text = text
            .replace(gpus, &format!("name = \"gpu{{i}}\"\ncount = {n}"))
            .replace(links, &format!("to = \"nvswitch{{j}}\"\ni = {n}"));
        std::fs::write(&self.sim, text).unwrap();
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state/map.state")
    }

    fn run(&self, args: &[&str]) -> Output {
        let state = self.state();
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["--sim", self.sim.to_str().unwrap(), "--state", state.to_str().unwrap()]);
        Command::new(env!("CARGO_BIN_EXE_fabricctl")).args(&all).env_remove("RUST_LOG").output().unwrap()
    }

    fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        serde_json::from_str(&self.ok(&a)).unwrap()
    }

    fn listing(&self) -> Value {
        self.json(&["map"])
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// (start, owner, vanished?) of every range.
fn ranges(listing: &Value) -> Vec<(u64, String, bool)> {
    listing["ranges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (r["start"].as_u64().unwrap(), r["owner"].as_str().unwrap().to_owned(), !r["vanished_since"].is_null())
        })
        .collect()
}

#[test]
fn placement_is_stable_vanished_devices_leave_holes_and_come_back() {
    let env = Env::new();
    let first = env.listing();
    let r1 = ranges(&first);
    assert_eq!(r1.len(), 8, "one HBM range per GPU");
    assert!(r1.iter().all(|(_, _, v)| !v));
    assert_eq!(ranges(&env.listing()), r1, "a second run changes nothing");

    env.set_gpus(6);
    let two_gone = ranges(&env.listing());
    assert_eq!(two_gone.len(), 8, "vanished GPUs keep their ranges as holes");
    assert_eq!(two_gone.iter().filter(|(_, _, v)| *v).count(), 2);
    let (hole, _, _) = two_gone.iter().find(|(_, _, v)| *v).unwrap();
    let o = env.run(&["map", "translate", &format!("{:#x}", hole + 4096)]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("hole") && err.contains("map gc"), "{err}");

    env.set_gpus(8);
    assert_eq!(ranges(&env.listing()), r1, "returning GPUs get their old ranges back");

    env.set_gpus(6);
    // One node's holes, for a node this fabric no longer has: nothing to collect, and no
    // refusal (the gc's --node is not the global one that narrows the fabric read).
    let gc = env.json(&["map", "gc", "--node", "node-gone"]);
    assert!(gc["collected"].as_array().is_none_or(Vec::is_empty), "{gc}");
    let gc = env.json(&["map", "gc"]);
    assert_eq!(gc["collected"].as_array().unwrap().len(), 2);
    let after = ranges(&env.listing());
    assert_eq!(after.len(), 6);
    assert!(after.iter().all(|(_, _, v)| !v));
    for r in &after {
        assert!(r1.contains(r), "surviving GPUs did not move: {r:?}");
    }
}

#[test]
fn translate_and_reverse_agree_on_every_range_edge() {
    let env = Env::new();
    let listing = env.listing();
    for r in listing["ranges"].as_array().unwrap() {
        let start = r["start"].as_u64().unwrap();
        let size = r["size"].as_u64().unwrap();
        for gfa in [start, start + size / 2, start + size - 1] {
            let t = env.json(&["map", "translate", &format!("{gfa:#x}")]);
            let device = t["device"].as_str().unwrap().to_owned();
            let offset = t["offset"].as_str().unwrap().to_owned();
            assert_eq!(u64::from_str_radix(offset.trim_start_matches("0x"), 16).unwrap(), gfa - start);
            let back = env.json(&["map", "reverse", &device, &offset, "--kind", "hbm"]);
            assert_eq!(back["gfa"].as_str().unwrap(), format!("{gfa:#x}"));
        }
    }
    let o = env.run(&["map", "reverse", "GPU0", "0x1400000000"]);
    assert_eq!(o.status.code(), Some(1), "an offset past 80 GiB is refused");
}

#[test]
fn partitions_resolve_only_their_own_ranges() {
    let env = Env::new();
    env.ok(&["map", "partition", "set", "tenant-a", "GPU0", "GPU1"]);
    let gpu0 = env.json(&["map", "reverse", "GPU0", "0"])["gfa"].as_str().unwrap().to_owned();
    let gpu5 = env.json(&["map", "reverse", "GPU5", "0"])["gfa"].as_str().unwrap().to_owned();
    env.ok(&["map", "translate", &gpu0, "--partition", "tenant-a"]);
    let o = env.run(&["map", "translate", &gpu5, "--partition", "tenant-a"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not in this partition"));
    let o = env.run(&["map", "translate", &gpu0, "--partition", "nope"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("no partition named"));
}

#[test]
fn a_corrupt_state_file_is_reported_left_alone_and_rebuilt() {
    let env = Env::new();
    let before = ranges(&env.listing());
    env.ok(&["map", "partition", "set", "p", "GPU0"]); // a second save: `.prev` now exists
    let state = env.state();
    let mut bytes = std::fs::read(&state).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&state, &bytes).unwrap();

    let o = env.run(&["map"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("corrupt") && err.contains("map rebuild"), "{err}");
    assert_eq!(std::fs::read(&state).unwrap(), bytes, "the damaged file is left untouched");

    let out = env.ok(&["map", "rebuild", "--from", "previous"]);
    assert!(out.contains("moved the damaged state aside"), "{out}");
    let aside = std::fs::read_dir(state.parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok())
        .any(|e| e.file_name().to_string_lossy().contains(".corrupt-"));
    assert!(aside, "the bad file is kept for inspection");
    assert_eq!(ranges(&env.listing()), before, "rebuilt from the previous copy: same placement");
}

#[test]
fn cxl_regions_become_interleave_sets_with_exact_striping() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("m.state");
    let sim = repo().join("configs/sim/cxl-pool.toml");
    let run = |args: &[&str]| -> Value {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["--sim", sim.to_str().unwrap(), "--state", state.to_str().unwrap(), "-o", "json"]);
        let o = Command::new(env!("CARGO_BIN_EXE_fabricctl")).args(&all).output().unwrap();
        assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let listing = run(&["map"]);
    let set = listing["ranges"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["interleave"]["ways"].as_u64() == Some(2))
        .expect("the 2-way region is an interleave set")
        .clone();
    let start = set["start"].as_u64().unwrap();
    let g = set["interleave"]["granularity"].as_u64().unwrap();
    let members: Vec<String> =
        set["interleave"]["members"].as_array().unwrap().iter().map(|m| m.as_str().unwrap().to_owned()).collect();
    // Chunk k of the set lives on member k % 2 at device offset (k / 2) * g.
    for k in [0u64, 1, 2, 3, 7, 1000] {
        let t = run(&["map", "translate", &format!("{:#x}", start + k * g + 5)]);
        let member = &members[(k % 2) as usize];
        assert!(member.starts_with(t["device"].as_str().unwrap()), "{member} vs {t}");
        assert_eq!(t["offset"].as_str().unwrap(), format!("{:#x}", (k / 2) * g + 5));
    }
}

#[test]
fn the_shipped_map_configuration_states_the_defaults() {
    let path = repo().join("configs/addrmap.toml");
    let config = fabric_cli::map::load_config(&path).expect("configs/addrmap.toml parses");
    assert_eq!(config, fabric_addrmap::MapConfig::default(), "the file documents the real defaults");
}

#[test]
fn a_map_configuration_steers_new_placements_and_bad_keys_are_named() {
    let env = Env::new();
    let cfg = env.dir.path().join("map.toml");
    std::fs::write(&cfg, "base = 0x100_0000_0000\n").unwrap();
    let listing = env.json(&["map", "--config", cfg.to_str().unwrap()]);
    let first = ranges(&listing)[0].0;
    assert!(first >= 0x100_0000_0000, "new placements start at the configured base: {first:#x}");

    std::fs::write(&cfg, "address_bits = 57\ndevice_allign = 4096\n").unwrap();
    let o = env.run(&["map", "--config", cfg.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("map.toml") && err.contains("line 2") && err.contains("device_allign"), "{err}");
}

/// A malformed address or kind is a usage error (exit 2) found before discovery: no state
/// file is written for it. Before, the fabric was discovered and its state saved first,
/// and the refusal exited 1 (a bad `--kind` was even called "not an address").
#[test]
fn malformed_addresses_and_kinds_are_usage_errors_that_save_nothing() {
    let env = Env::new();
    for args in [
        &["map", "translate", "zzz"][..],
        &["map", "translate", "+5"],
        &["map", "translate", "0x-1"],
        &["map", "reverse", "GPU0", "0xg"],
        &["map", "reverse", "GPU0", "0", "--kind", "bogus"],
    ] {
        let o = env.run(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        assert!(!env.state().exists(), "{args:?} saved the state");
    }
    let o = env.run(&["map", "reverse", "GPU0", "0", "--kind", "bogus"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("\"bogus\" is no memory kind"));
    env.ok(&["map", "translate", "1_000"]);
}
