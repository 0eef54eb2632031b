//! The diff of two inventories as device and link events: devices by
//! [`fabric_topology::DeviceId`] (added, removed, failed, recovered), links by their end
//! points and kind.

use std::collections::{BTreeMap, BTreeSet};

use fabric_proto::wire::{DeviceChange, DeviceName, Event, LinkChange, Name};
use fabric_topology::{Inventory, LinkState};

use super::failure;

/// A link bundle's summary: its worst state and its summed bandwidths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LinkSum {
    down: bool,
    degraded: bool,
    current: Option<u64>,
    max: Option<u64>,
}

impl LinkSum {
    fn change(&self) -> LinkChange {
        if self.down {
            return LinkChange::Down;
        }
        let permille = match (self.current, self.max) {
            (Some(c), Some(m)) if m > 0 => u16::try_from(c.min(m) * 1000 / m).unwrap_or(1000),
            _ if self.degraded => 0,
            _ => 1000,
        };
        if self.degraded || permille < 1000 {
            LinkChange::Degraded { bandwidth_permille: permille }
        } else {
            LinkChange::Up
        }
    }
}

fn links(inv: &Inventory) -> BTreeMap<(String, String, &'static str), LinkSum> {
    let mut out: BTreeMap<_, LinkSum> = BTreeMap::new();
    for l in &inv.links {
        let key = (inv.device(l.a).id.to_string(), inv.device(l.b).id.to_string(), l.kind.name());
        let e = out.entry(key).or_insert(LinkSum { down: false, degraded: false, current: Some(0), max: Some(0) });
        e.down |= l.state == LinkState::Down;
        e.degraded |= l.state == LinkState::Degraded;
        e.current = e.current.zip(l.bandwidth.current_mbps).map(|(a, b)| a + b);
        e.max = e.max.zip(l.bandwidth.max_mbps).map(|(a, b)| a + b);
    }
    out
}

/// The events that take `old` to `new`: devices added (`Recovered` instead for one in
/// `vanished`, seen before and gone since, unless it comes back failed), removed, failed
/// (its backend reports a failure: [`failure`]) and recovered (no longer failed); then links
/// whose state or bandwidth changed (a link that vanished while both ends stay is `Down`).
pub fn diff(old: &Inventory, new: &Inventory, vanished: &BTreeSet<String>) -> Vec<Event> {
    let ids = |inv: &Inventory| {
        inv.devices.iter().map(|d| (d.id.to_string(), failure(d).is_some())).collect::<BTreeMap<_, _>>()
    };
    let (before, after) = (ids(old), ids(new));
    let mut events = Vec::new();
    let dev = |id: &str, change| Event::Device { device: DeviceName::truncated(id), change };
    for (id, &failed) in &after {
        let change = match (before.get(id), failed) {
            (None, false) if vanished.contains(id) => DeviceChange::Recovered,
            (None, true) if vanished.contains(id) => DeviceChange::Failed,
            (None, false) => DeviceChange::Added,
            (None, true) => {
                events.push(dev(id, DeviceChange::Added));
                DeviceChange::Failed
            }
            (Some(false), true) => DeviceChange::Failed,
            (Some(true), false) => DeviceChange::Recovered,
            (Some(_), _) => continue,
        };
        events.push(dev(id, change));
    }
    for id in before.keys().filter(|id| !after.contains_key(*id)) {
        events.push(dev(id, DeviceChange::Removed));
    }
    let after: BTreeSet<String> = after.into_keys().collect();
    let (lb, la) = (links(old), links(new));
    let link_ev = |(a, b, kind): &(String, String, &str), change| Event::Link {
        a: DeviceName::truncated(a),
        b: DeviceName::truncated(b),
        kind: Name::truncated(kind),
        change,
    };
    for (key, now) in &la {
        match lb.get(key) {
            Some(was) if was == now => {}
            _ => events.push(link_ev(key, now.change())),
        }
    }
    for key in lb.keys() {
        if !la.contains_key(key) && after.contains(&key.0) && after.contains(&key.1) {
            events.push(link_ev(key, LinkChange::Down));
        }
    }
    events
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn sim(text: &str) -> Inventory {
        fabric_drivers::sim::parse(text, "test").unwrap()
    }

    fn hgx() -> String {
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/sim/hgx-h100-8gpu.toml")).unwrap()
    }

    fn diff(old: &Inventory, new: &Inventory) -> Vec<Event> {
        super::diff(old, new, &BTreeSet::new())
    }

    #[test]
    fn same_inventory_no_events() {
        assert!(diff(&sim(&hgx()), &sim(&hgx())).is_empty());
    }

    #[test]
    fn failed_recovered_and_returning_devices() {
        let base = sim(&hgx());
        let gpu = base.devices.iter().find(|d| d.kind == fabric_topology::DeviceKind::Gpu).unwrap().id.to_string();
        let mut failed = base.clone();
        let i = failed.devices.iter().position(|d| d.id.to_string() == gpu).unwrap();
        failed.devices[i].attrs.insert(super::super::FAILED_ATTR.into(), "fell off the bus".into());
        let dev = |change| Event::Device { device: DeviceName::truncated(&gpu), change };
        assert_eq!(diff(&base, &failed), vec![dev(DeviceChange::Failed)]);
        assert_eq!(diff(&failed, &base), vec![dev(DeviceChange::Recovered)]);
        assert!(diff(&failed, &failed).is_empty());
        // Gone, then back: Recovered when it was seen before, Added when it is new.
        let mut gone = base.clone();
        gone.devices.remove(i);
        let iu = u32::try_from(i).unwrap();
        gone.links.retain(|l| l.a.0 != iu && l.b.0 != iu);
        for l in &mut gone.links {
            l.a.0 -= u32::from(l.a.0 > iu);
            l.b.0 -= u32::from(l.b.0 > iu);
        }
        gone.reindex();
        let ev = diff(&base, &gone);
        assert_eq!(ev[0], dev(DeviceChange::Removed), "{ev:?}");
        let seen: BTreeSet<String> = [gpu.clone()].into();
        let back = super::diff(&gone, &base, &seen);
        assert_eq!(back[0], dev(DeviceChange::Recovered), "{back:?}");
        assert_eq!(diff(&gone, &base)[0], dev(DeviceChange::Added));
        let back_failed = super::diff(&gone, &failed, &seen);
        assert_eq!(back_failed[0], dev(DeviceChange::Failed), "{back_failed:?}");
        assert_eq!(diff(&gone, &failed)[..2], [dev(DeviceChange::Added), dev(DeviceChange::Failed)]);
    }

    #[test]
    fn degraded_pcie_link_and_vanished_gpu() {
        let base = hgx();
        let degraded = format!("{base}\n[[degraded]]\ndevice = \"node0/gpu0\"\nlink = \"pcie\"\nwidth = 4\n");
        let ev = diff(&sim(&base), &sim(&degraded));
        assert_eq!(ev.len(), 1, "{ev:?}");
        assert!(
            matches!(&ev[0], Event::Link { kind, change: LinkChange::Degraded { bandwidth_permille: 249 }, .. } if kind.as_str() == "pcie"),
            "{ev:?}"
        );
        let back = diff(&sim(&degraded), &sim(&base));
        assert!(matches!(&back[0], Event::Link { change: LinkChange::Up, .. }), "{back:?}");
        let seven = base
            .replacen(
                "count = 8\nparent = \"plx{i/2}\"\nmodel = \"NVIDIA H100",
                "count = 7\nparent = \"plx{i/2}\"\nmodel = \"NVIDIA H100",
                1,
            )
            .replacen("i = 8\n", "i = 7\n", 1);
        let ev = diff(&sim(&base), &sim(&seven));
        let removed: Vec<_> = ev
            .iter()
            .filter_map(|e| match e {
                Event::Device { device, change: DeviceChange::Removed } => Some(device.as_str().to_owned()),
                _ => None,
            })
            .collect();
        let gpus = |inv: &Inventory| -> BTreeSet<String> {
            inv.devices
                .iter()
                .filter(|d| d.kind == fabric_topology::DeviceKind::Gpu)
                .map(|d| d.id.to_string())
                .collect()
        };
        let gone: Vec<String> = gpus(&sim(&base)).difference(&gpus(&sim(&seven))).cloned().collect();
        assert_eq!(gone.len(), 1);
        let gpu7 = gone[0].clone();
        assert!(removed.contains(&gpu7), "{ev:?}");
    }
}
