//! Live RDMA discovery on Soft-RoCE: creates an `rxe` device on a veth inside a network
//! namespace this test creates, discovers the live `/sys` and checks the device and its
//! port are read. Skips, saying why, when it cannot run (not root, no `ip`/`rdma` tools, no
//! `rdma_rxe` module). Touches only the namespace and devices it made, and removes them.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::process::Command;

use fabric_drivers::rdma::RdmaBackend;
use fabric_drivers::{Backend, SysfsRoot};
use fabric_topology::{DeviceId, Inventory, LinkLayer};

fn run(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0]).args(&args[1..]).output().map_err(|e| format!("{}: {e}", args[0]))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Removes what the test made, whatever happened.
struct Cleanup {
    ns: String,
    dev: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = run(&["rdma", "link", "delete", &self.dev]);
        let _ = run(&["ip", "netns", "delete", &self.ns]);
    }
}

fn setup(ns: &str, dev: &str) -> Result<Cleanup, String> {
    // The effective uid from /proc: creating namespaces and RDMA links needs root.
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| format!("/proc/self/status: {e}"))?;
    let euid = status.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|l| l.split_whitespace().nth(1));
    if euid != Some("0") {
        return Err("not root".into());
    }
    if !std::path::Path::new("/sys/module/rdma_rxe").exists() {
        run(&["modprobe", "rdma_rxe"]).map_err(|e| format!("rdma_rxe module not loadable ({e})"))?;
    }
    run(&["ip", "netns", "add", ns])?;
    let c = Cleanup { ns: ns.to_owned(), dev: dev.to_owned() };
    run(&["ip", "-n", ns, "link", "add", "fxa", "type", "veth", "peer", "name", "fxb"])?;
    run(&["ip", "-n", ns, "link", "set", "fxa", "up"])?;
    run(&["ip", "-n", ns, "link", "set", "fxb", "up"])?;
    run(&["ip", "netns", "exec", ns, "rdma", "link", "add", dev, "type", "rxe", "netdev", "fxa"])?;
    Ok(c)
}

#[test]
fn soft_roce_device_is_discovered_live() {
    let ns = format!("fabric-rxe-{}", std::process::id());
    let dev = format!("fxrxe{}", std::process::id() % 10_000);
    let _cleanup = match setup(&ns, &dev) {
        Ok(c) => c,
        Err(why) => {
            eprintln!("skipped: Soft-RoCE live test not possible here: {why}");
            let _ = run(&["ip", "netns", "delete", &ns]);
            return;
        }
    };
    let root = SysfsRoot::new("/", "live");
    let mut inv = Inventory::new();
    let report = RdmaBackend::new(root).discover(&mut inv);
    let i = inv.find(&DeviceId::named("live", &dev)).unwrap_or_else(|| panic!("{dev} not found: {report:?}"));
    let d = &inv.device(i).rdma[0];
    assert_eq!(d.ports.len(), 1);
    let p = &d.ports[0];
    assert_eq!(p.link_layer, Some(LinkLayer::Ethernet), "rxe is RoCE");
    assert_eq!(p.netdev.as_deref(), Some("fxa"), "{p:?}");
    assert!(p.rate_mbps.is_some(), "{p:?}");
}
