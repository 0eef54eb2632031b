//! The CXL comparison on listings captured from a real guest run (6.12, QEMU 10.0; see
//! tests/fixtures/README.md): they agree as captured, and each kind of disagreement the
//! guest test guards against is caught.

use fabric_qemu_tests::cxl;
use serde_json::Value;

fn load(name: &str) -> Value {
    let p = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&p).expect("fixture")).expect("json")
}

fn fixtures() -> (cxl::KernelView, Value, Value) {
    (cxl::kernel_view(&load("guest-cxl-list.json")), load("guest-fabric-topology.json"), load("guest-fabric-map.json"))
}

fn decoder_mut<'a>(topo: &'a mut Value, name: &str) -> &'a mut Value {
    topo["cxl"]["decoders"]
        .as_array_mut()
        .expect("decoders")
        .iter_mut()
        .find(|d| d["kernel_name"] == name)
        .expect("decoder")
}

#[test]
fn captured_listings_agree() {
    let (k, topo, map) = fixtures();
    assert_eq!(k.memdevs.len(), 4);
    assert_eq!(k.regions.len(), 1);
    assert!(k.decoders.len() > 20, "{}", k.decoders.len());
    assert_eq!(cxl::compare(&k, &topo), Vec::<String>::new());
    assert_eq!(cxl::check_map(&k, "region0", &map), Vec::<String>::new());
}

#[test]
fn a_wrong_memdev_size_is_caught() {
    let (k, mut topo, _) = fixtures();
    let dev = topo["devices"]
        .as_array_mut()
        .expect("devices")
        .iter_mut()
        .find(|d| d["cxl"]["serial"] == 0x1002)
        .expect("memdev");
    dev["cxl"]["ram_size"] = Value::from(128u64 << 20);
    let diffs = cxl::compare(&k, &topo);
    assert!(diffs.iter().any(|d| d.contains("memdev 0x1002")), "{diffs:?}");
}

#[test]
fn wrong_decoder_ways_targets_and_dpa_are_caught() {
    let (k, mut topo, _) = fixtures();
    let switch = k
        .decoders
        .iter()
        .find(|(_, d)| d.ways == Some(2) && !d.targets.is_empty())
        .map(|(n, _)| n.clone())
        .expect("2-way switch decoder");
    let endpoint =
        k.decoders.iter().find(|(_, d)| d.dpa_size.is_some()).map(|(n, _)| n.clone()).expect("endpoint decoder");
    decoder_mut(&mut topo, &switch)["ways"] = Value::from(1);
    decoder_mut(&mut topo, &switch)["targets"].as_array_mut().expect("targets").reverse();
    decoder_mut(&mut topo, &endpoint)["dpa_start"] = Value::from(0x1000_0000u64);
    let diffs = cxl::compare(&k, &topo);
    assert!(diffs.iter().any(|d| d.starts_with(&format!("{switch} ways"))), "{diffs:?}");
    assert!(diffs.iter().any(|d| d.starts_with(&format!("{switch} targets"))), "{diffs:?}");
    assert!(diffs.iter().any(|d| d.starts_with(&format!("{endpoint} dpa_resource"))), "{diffs:?}");
}

#[test]
fn a_missing_decoder_or_region_is_caught() {
    let (k, mut topo, _) = fixtures();
    topo["cxl"]["decoders"].as_array_mut().expect("decoders").pop();
    topo["cxl"]["regions"] = Value::Array(Vec::new());
    let diffs = cxl::compare(&k, &topo);
    assert!(diffs.iter().any(|d| d.starts_with("decoders:")), "{diffs:?}");
    assert!(diffs.iter().any(|d| d.starts_with("regions:")), "{diffs:?}");
}

#[test]
fn region_target_order_and_granularity_are_checked() {
    let (k, mut topo, _) = fixtures();
    let r = &mut topo["cxl"]["regions"][0];
    r["targets"].as_array_mut().expect("targets").reverse();
    r["granularity"] = Value::from(512);
    let diffs = cxl::compare(&k, &topo);
    assert!(diffs.iter().any(|d| d.starts_with("region0 targets")), "{diffs:?}");
    assert!(diffs.iter().any(|d| d.starts_with("region0 granularity")), "{diffs:?}");
}

#[test]
fn the_map_must_place_the_region_as_its_interleave_set() {
    let (k, _, mut map) = fixtures();
    let set =
        map["ranges"].as_array_mut().expect("ranges").iter_mut().find(|r| r["kind"] == "interleave").expect("set");
    set["interleave"]["members"].as_array_mut().expect("members").reverse();
    let diffs = cxl::check_map(&k, "region0", &map);
    assert!(diffs.iter().any(|d| d.contains("members")), "{diffs:?}");
    map["ranges"] = Value::Array(Vec::new());
    assert!(!cxl::check_map(&k, "region0", &map).is_empty());
}
