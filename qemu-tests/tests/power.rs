//! Tier 3: power loss of fabricd's memory registry. The guest keeps fabricd's state on an
//! ext4 virtio disk (the region files on a second one), a workload changes the registry
//! and prints every acknowledged change, and the host cuts the power (SIGKILL of QEMU) at a
//! random moment; the next boot replays the journal and reports what is there, which must
//! be everything acknowledged (`fabric_qemu_tests::power` has the rules). Several kill
//! points, one disk; then a clean shutdown and `e2fsck` of both images.
//!
//! Disk cache mode `writeback`: the guest sees a volatile write cache and flushes it
//! (`fsync` → virtio flush), and QEMU turns each flush into an `fdatasync` of the image.
//! `unsafe` would ignore the flushes, which a host crash would expose; the SIGKILL here
//! loses what the guest had not yet written to its disk (page cache, the ext4 journal's
//! running transaction, requests QEMU had not completed), not what QEMU wrote to the image
//! (the host's page cache keeps it: the host stays up).
#![allow(clippy::print_stdout, reason = "the test's report: seed and kill points")]

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fabric_qemu_tests::power::{Model, Observed};
use fabric_qemu_tests::{disk, env, scripts, vm};

/// Power cuts per run.
const CUTS: usize = 4;
/// Every boot (boot, replay, check, workload up to the cut) must fit in this.
const BOOT_TIMEOUT: Duration = Duration::from_secs(90);

/// xorshift64*: the kill points, reproducible from the reported seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

/// Acknowledged changes in the workload's lines so far (only whole lines).
fn acks(data: &str) -> usize {
    let whole = data.rfind('\n').map_or("", |i| &data[..i]);
    whole
        .lines()
        .map(|l| l.trim_end_matches('\r'))
        .filter(|l| l.len() > 2 && matches!(&l[..2], "A " | "E " | "V " | "F "))
        .count()
}

fn spec(
    boot: usize,
    phase: &str,
    seed: u64,
    model: &Model,
    state: &std::path::Path,
    memory: &std::path::Path,
) -> vm::VmSpec {
    let mut spec = vm::VmSpec::new(&format!("power-{boot}"), scripts::POWER);
    spec.timeout = BOOT_TIMEOUT;
    spec.mem_mib = 512;
    for img in [state, memory] {
        spec.arg("-drive").arg(format!("file={},format=raw,if=virtio,cache=writeback", img.display()));
    }
    let token = model.token.clone().unwrap_or_else(|| "-".into());
    spec.files.push(("fabric/power.env".into(), format!("PHASE={phase}\nSEED={seed}\nTOKEN={token}\n").into_bytes()));
    spec.files.push(("fabric/power-handles".into(), model.handles().into_bytes()));
    spec.files.push(("fabric/cxl-pool.toml".into(), include_bytes!("../../configs/sim/cxl-pool.toml").to_vec()));
    spec
}

#[test]
fn acknowledged_registry_changes_survive_power_loss() {
    let Some(pre) = env::prereqs_or_skip("acknowledged_registry_changes_survive_power_loss") else { return };
    let seed = std::env::var("FABRIC_POWER_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1) % 1_000_000
    });
    let started = Instant::now();
    let disks = pre.logs.join("power-disks");
    std::fs::create_dir_all(&disks).expect("disk dir");
    let (state, memory) = (disks.join("state.img"), disks.join("memory.img"));
    disk::make_ext4(&state, 64).expect("state image");
    disk::make_ext4(&memory, 64).expect("memory image");
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut model = Model::default();
    let mut report = Vec::new();
    let ctx = |boot: usize| format!("seed {seed} (FABRIC_POWER_SEED={seed} reruns it), boot {boot}");
    for boot in 1..=CUTS + 1 {
        let phase = match boot {
            1 => "first",
            b if b == CUTS + 1 => "last",
            _ => "again",
        };
        let spec = spec(boot, phase, seed.wrapping_add(boot as u64), &model, &state, &memory);
        let mut guest = vm::Guest::start(&pre, &spec).unwrap_or_else(|e| panic!("{}: boot: {e}", ctx(boot)));
        let t0 = Instant::now();
        let mut cut = None;
        let out = if phase == "last" {
            guest.finish().unwrap_or_else(|e| panic!("{}: guest run: {e}", ctx(boot)))
        } else {
            // The cut: after a random number of acknowledged changes of this boot's
            // workload, plus a random delay, so that it falls anywhere in a change.
            let after = 1 + rng.below(8) as usize;
            let delay = Duration::from_micros(rng.below(300_000));
            let base = acks(&guest.data());
            guest
                .wait_data(|d| acks(d) >= base + after)
                .unwrap_or_else(|e| panic!("{}: waiting for {after} acknowledged changes: {e}", ctx(boot)));
            std::thread::sleep(delay);
            let out = guest.cut_power().unwrap_or_else(|e| panic!("{}: power cut: {e}", ctx(boot)));
            cut = Some(format!(
                "boot {boot}: power cut after {after} acknowledged changes + {} ms ({:.1} s after boot)",
                delay.as_millis(),
                t0.elapsed().as_secs_f64()
            ));
            out
        };
        out.expect_check("disks");
        out.expect_check("fabricd-start");
        if phase != "first" {
            out.expect_check("power-observe");
            let obs: Observed = serde_json::from_str(out.blob("observed"))
                .unwrap_or_else(|e| out.fail(&format!("{}: observed JSON: {e}", ctx(boot))));
            let diffs = model.check(&obs);
            if !diffs.is_empty() {
                out.fail(&format!(
                    "{}: after the power cut the registry disagrees with what was acknowledged (in flight: {:?}):\n  {}",
                    ctx(boot),
                    model.pending(),
                    diffs.join("\n  ")
                ));
            }
            model.settle(&obs);
            // fabricd's log lines about a torn tail cut off or leftover files removed.
            let replay = out.blob("journal-replay").lines().filter(|l| !l.trim().is_empty()).count();
            report.push(format!(
                "boot {boot}: replayed, checked {} regions and {} exports; {replay} journal clean-ups",
                obs.regions.len(),
                obs.exports.len(),
            ));
        }
        report.extend(cut);
        if phase == "last" {
            out.expect_check("clean-unmount");
        } else {
            let data = std::fs::read_to_string(out.dir.join("data.log")).unwrap_or_default();
            model.apply_log(&data).unwrap_or_else(|e| out.fail(&format!("{}: {e}", ctx(boot))));
        }
    }
    for img in [&state, &memory] {
        if let Err(e) = disk::fsck(img) {
            panic!("seed {seed}: {} is not clean after the last boot's unmount: {e}", img.display());
        }
    }
    let s = model.stats;
    let summary = format!(
        "survived {CUTS} power cuts in {:.1} s (seed {seed}): {} acknowledged changes, {} region checks ({} with msynced contents), \
         {} freed-region checks, {} handle imports checked; {} cuts with a change in flight ({} of them done); {} regions live at the end\n  {}",
        started.elapsed().as_secs_f64(),
        s.acknowledged,
        s.regions_checked,
        s.contents_checked,
        s.frees_checked,
        s.imports_checked,
        s.in_flight,
        s.in_flight_done,
        model.live(),
        report.join("\n  ")
    );
    let _ = std::fs::write(pre.logs.join("power-summary.txt"), &summary);
    println!("{summary}");
}
