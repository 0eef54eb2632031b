//! Region files keep their size through the real daemon: a client that shrinks or grows its
//! region's file (it holds it read-write) finds the size put back within
//! `memory.size_check_s`, and the daemon says so in its log; with 0 nothing is checked.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use fabric_topology::DeviceKind;

const MIB: u64 = 1 << 20;

fn first_gpu() -> String {
    let inv = fabric_drivers::sim::load(&common::sim_file()).unwrap();
    inv.devices.iter().find(|d| d.kind == DeviceKind::Gpu).unwrap().id.to_string()
}

#[test]
fn a_resized_region_file_gets_its_size_back() {
    let setup = common::Setup::with_sim(&common::sim_file(), "[memory]\nsize_check_s = 1\n");
    let d = common::start(&setup.config, setup.dir.path());
    let mut c = common::client(&setup.socket);
    let gpu = first_gpu();
    let (_, small) = common::alloc_hbm(&mut c, &gpu, 4 * MIB);
    let (_, big) = common::alloc_hbm(&mut c, &gpu, 2 * MIB);
    small.set_len(MIB).unwrap();
    big.set_len(256 * MIB).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while small.metadata().unwrap().len() != 4 * MIB || big.metadata().unwrap().len() != 2 * MIB {
        assert!(
            Instant::now() < deadline,
            "sizes not restored: {} and {}",
            small.metadata().unwrap().len(),
            big.metadata().unwrap().len()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(d.log().contains("a client resized its region file; size restored"), "{}", d.log());
}

/// A sim interleave-set region's file (one file holds the whole region) is put back too:
/// before, set regions were skipped, so a client could grow one without bound or shrink it
/// under its importers.
#[test]
fn a_resized_set_region_file_gets_its_size_back() {
    use fabric_proto::wire::{AllocRequest, Request, Response};
    let (set, _, _) = common::two_way_set();
    let setup = common::Setup::with_sim(&common::cxl_pool(), "[memory]\nsize_check_s = 1\n");
    let d = common::start(&setup.config, setup.dir.path());
    let mut c = common::client(&setup.socket);
    let req = Request::Alloc(AllocRequest { target: common::on_set(&set), size: 8 * MIB, align: 0 });
    let (r, mut fds) = c.call(req, &[]).unwrap();
    let Response::Alloc(_) = r else { panic!("{r:?}") };
    let file = std::fs::File::from(fds.remove(0));
    assert_eq!(file.metadata().unwrap().len(), 8 * MIB);
    file.set_len(64 * MIB).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while file.metadata().unwrap().len() != 8 * MIB {
        assert!(Instant::now() < deadline, "size not restored: {}", file.metadata().unwrap().len());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(d.log().contains("a client resized its region file; size restored"), "{}", d.log());
}

#[test]
fn with_the_check_off_a_resized_file_stays_so() {
    let setup = common::Setup::with_sim(&common::sim_file(), "[memory]\nsize_check_s = 0\n");
    let _d = common::start(&setup.config, setup.dir.path());
    let mut c = common::client(&setup.socket);
    let (_, f) = common::alloc_hbm(&mut c, &first_gpu(), 4 * MIB);
    f.set_len(MIB).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(f.metadata().unwrap().len(), MIB);
}
