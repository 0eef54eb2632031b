//! Which fabric-level switches a node's topology record carries: the rings of hops around
//! the node's devices, nearest first, as many whole rings as the record's bounds hold.
//!
//! A node of a small fabric reaches every switch within a few rings, so its record
//! describes the whole fabric as before. A node of a large network (the 12,500 nodes of
//! the sim's `cluster-100k`, 3,160 leaf and spine switches) cannot: its record carries
//! its leaves and the spines above them, and the other nodes' records carry theirs. The
//! domain's merge is the union of the records, so every switch some live node reaches
//! within its rings is there, and every shortest path between two nodes' devices whose
//! length is at most twice the smaller of their radii is there whole (each switch on it
//! is within that radius of one end, each link on it within it of the same end).

use std::collections::HashSet;

use fabric_topology::{DeviceIdx, Fabric};

use crate::topology::is_shared_switch;

/// The devices a record may carry around `own`, in order, and where each ring ends.
#[derive(Debug)]
pub(crate) struct Rings {
    /// `own` first, then each ring of fabric-level switches, each ring in inventory order.
    pub devices: Vec<DeviceIdx>,
    /// `ends[k]`: how many of `devices` rings `0..=k` hold (ring 0 is `own`).
    pub ends: Vec<usize>,
}

impl Rings {
    /// The rings of fabric-level switches (devices of no node, of a switch kind) around
    /// `own`, walking only through such switches, until none is left or the devices
    /// would be more than `max_devices` (that ring and the ones past it are left out).
    pub fn around(fabric: &Fabric, own: Vec<DeviceIdx>, max_devices: usize) -> Self {
        let mut seen: HashSet<DeviceIdx> = own.iter().copied().collect();
        let mut ends = vec![own.len()];
        let mut devices = own;
        let mut ring_start = 0;
        loop {
            let room = max_devices.saturating_sub(devices.len());
            let mut ring: Vec<DeviceIdx> = Vec::new();
            // Stops as soon as the ring is past the room left: the first leaf of a large
            // network's spines would otherwise list every other leaf for nothing.
            'walk: for &d in &devices[ring_start..] {
                for (n, _) in fabric.neighbors(d) {
                    if is_shared_switch(fabric.device(n)) && seen.insert(n) {
                        ring.push(n);
                        if ring.len() > room {
                            break 'walk;
                        }
                    }
                }
            }
            if ring.is_empty() || ring.len() > room {
                return Self { devices, ends };
            }
            ring.sort_unstable();
            ring_start = devices.len();
            devices.extend(ring);
            ends.push(devices.len());
        }
    }

    /// The links among `devices` (`among(d)`: whether `d` is one of them), as indexes of the
    /// inventory's links, in its order.
    pub fn links_among(fabric: &Fabric, devices: &[DeviceIdx], among: impl Fn(DeviceIdx) -> bool) -> Vec<usize> {
        let mut links: Vec<usize> =
            devices.iter().flat_map(|&d| fabric.neighbors(d)).filter(|&(n, _)| among(n)).map(|(_, l)| l).collect();
        links.sort_unstable();
        links.dedup();
        links
    }
}

#[cfg(test)]
mod tests {
    use fabric_topology::{Bandwidth, Device, DeviceId, DeviceKind, Inventory, Link, LinkKind};

    use super::*;

    /// Two nodes on a leaf each, two spines above both leaves, a core above the spines.
    fn clos() -> Fabric {
        let mut inv = Inventory::new();
        let mut add = |id: DeviceId, kind, node: Option<&str>| inv.add_device(Device::new(id, kind, node)).unwrap();
        let nic0 = add(DeviceId::named("n0", "nic0"), DeviceKind::Nic, Some("n0"));
        let nic1 = add(DeviceId::named("n1", "nic0"), DeviceKind::Nic, Some("n1"));
        let leaf0 = add(DeviceId::named("fabric", "leaf0"), DeviceKind::NetworkSwitch, None);
        let leaf1 = add(DeviceId::named("fabric", "leaf1"), DeviceKind::NetworkSwitch, None);
        let spine0 = add(DeviceId::named("fabric", "spine0"), DeviceKind::NetworkSwitch, None);
        let spine1 = add(DeviceId::named("fabric", "spine1"), DeviceKind::NetworkSwitch, None);
        let core = add(DeviceId::named("fabric", "core"), DeviceKind::NetworkSwitch, None);
        let links = [(nic0, leaf0), (nic1, leaf1), (leaf0, spine0), (leaf0, spine1), (leaf1, spine0), (leaf1, spine1)];
        for (a, b) in links.into_iter().chain([(spine0, core), (spine1, core)]) {
            inv.add_link(Link::new(a, b, LinkKind::Network { gbps: 400 }, Bandwidth::full(400_000), None));
        }
        Fabric::build(inv).unwrap()
    }

    fn names(f: &Fabric, r: &Rings, upto: usize) -> Vec<String> {
        r.devices[..upto].iter().map(|&d| f.device(d).id.as_str().trim_start_matches("name:").to_owned()).collect()
    }

    #[test]
    fn rings_grow_outward_through_switches_only_and_stop_before_the_bound() {
        let f = clos();
        let nic0 = f.inventory().find(&DeviceId::named("n0", "nic0")).unwrap();
        let all = Rings::around(&f, vec![nic0], 100);
        assert_eq!(all.ends, [1, 2, 4, 6], "own, leaf0, both spines, then leaf1 and the core");
        assert_eq!(
            names(&f, &all, 6),
            ["n0/nic0", "fabric/leaf0", "fabric/spine0", "fabric/spine1", "fabric/leaf1", "fabric/core"]
        );
        assert!(!all.devices.iter().any(|&d| f.device(d).node.as_deref() == Some("n1")), "another node's NIC");
        let bounded = Rings::around(&f, vec![nic0], 5);
        assert_eq!(bounded.ends, [1, 2, 4], "the third ring would pass the bound: left out whole");
        let links = Rings::links_among(&f, &bounded.devices, |d| bounded.devices.contains(&d));
        assert_eq!(links, [0, 2, 3], "nic0-leaf0 and leaf0's two uplinks, not leaf1's");
        assert_eq!(Rings::around(&f, vec![], 100).ends, [0], "no devices of its own, no switches");
    }
}
