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
