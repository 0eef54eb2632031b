//! The configuration files shipped in `configs/` parse, and state the real defaults.

use std::path::Path;

use fabricd::config::Config;

#[test]
fn the_shipped_configuration_states_the_defaults() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/fabricd.toml");
    let c = Config::load(&path).expect("configs/fabricd.toml parses");
    assert_eq!(c, Config::default(), "every key in configs/fabricd.toml is at its default");
}

#[test]
fn the_sim_configuration_points_at_a_bundled_fabric() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/fabricd-sim.toml");
    let c = Config::load(&path).expect("configs/fabricd-sim.toml parses");
    assert_eq!(c.discovery.sim.len(), 1);
    assert!(c.discovery.sim[0].is_file(), "{} exists", c.discovery.sim[0].display());
}

#[test]
fn sim_node_serves_one_node_of_the_sim_fabric() {
    let sim = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/supernode-64.toml");
    let mut c = Config::default();
    c.discovery.sim = vec![sim];
    let whole = fabricd::daemon::discover(&c).unwrap();
    c.discovery.sim_node = Some("tray3".into());
    let one = fabricd::daemon::discover(&c).unwrap();
    let of = |n: &str| whole.devices.iter().filter(|d| d.node.as_deref() == Some(n)).count();
    let fabric_level = whole.devices.iter().filter(|d| d.node.is_none()).count();
    assert!(of("tray3") > 0 && fabric_level > 0);
    assert_eq!(one.devices.len(), of("tray3") + fabric_level, "tray3's devices and the fabric-level ones");
    assert!(one.devices.iter().all(|d| d.node.as_deref().is_none_or(|n| n == "tray3")));
    // Every link kept joins two kept devices, and the NVLinks to the fabric switches stay.
    let fabric = fabric_topology::Fabric::build(one).expect("the node's part indexes");
    assert!(fabric.inventory().links.iter().any(|l| l.kind.name() == "nvlink"));
    c.discovery.sim_node = Some("tray99".into());
    let e = fabricd::daemon::discover(&c).unwrap_err().to_string();
    assert!(e.contains("tray99") && e.contains("not a node"), "{e}");
}
