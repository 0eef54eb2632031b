//! Host discovery names the devices' node: a lone daemon after the host, a domain node
//! after the name it joins with — the map places, and the domain publishes, only memory of
//! the node's own name, so a real host's devices under its hostname would be no one's (the
//! two-host QEMU test found this: an empty placements record). Runs on the CXL sysfs
//! fixture of the drivers' tests (the kernel tree QEMU's CXL topology makes).
#![allow(clippy::unwrap_used)]

#[path = "../../drivers/tests/cxl_fixture/mod.rs"]
mod cxl_fixture;

use std::path::Path;

use fabricd::config::Config;

fn config(root: &Path, domain: &str) -> Config {
    let text = format!(
        "[socket]\npath = \"/nonexistent/fabricd.sock\"\n[state]\ndir = \"/nonexistent\"\n[discovery]\nsysfs_root = {:?}\nbackends = [\"cxl\"]\n{domain}",
        root.display().to_string()
    );
    Config::parse(&text, Path::new("test.toml"), Path::new("/")).unwrap()
}

fn nodes(config: &Config) -> Vec<Option<String>> {
    let inv = fabricd::daemon::discover(config).unwrap();
    assert!(!inv.devices.is_empty(), "the fixture has CXL devices");
    inv.devices.iter().map(|d| d.node.clone()).collect()
}

#[test]
fn a_domain_nodes_devices_carry_its_domain_name() {
    let tree = cxl_fixture::qemu_cxl(&cxl_fixture::Names::default());
    std::fs::create_dir_all(tree.p("proc/sys/kernel")).unwrap();
    std::fs::write(tree.p("proc/sys/kernel/hostname"), "rack4-host7\n").unwrap();

    let alone = nodes(&config(tree.root(), ""));
    assert!(alone.iter().all(|n| n.as_deref() == Some("rack4-host7")), "{alone:?}");

    let domain = "[map]\nnode_span = { fixed = 1099511627776 }\n[domain]\nname = \"d\"\nendpoints = [\"http://127.0.0.1:1\"]\nnode = \"tray7\"\n";
    let member = nodes(&config(tree.root(), domain));
    assert!(member.iter().all(|n| n.as_deref() == Some("tray7")), "{member:?}");
}
