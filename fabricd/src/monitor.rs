//! Monitoring: a rescan every `discovery.rescan_interval_s` seconds, and the diff of two
//! inventories as device and link events (devices by [`fabric_topology::DeviceId`], links by their end
//! points and kind).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use fabric_proto::wire::{DeviceChange, DeviceName, Event, LinkChange, Name};
use fabric_topology::{Inventory, LinkState};
use tokio_util::sync::CancellationToken;

use crate::daemon::Daemon;

/// Rescans every `discovery.rescan_interval_s` seconds (0: never) until `shutdown`.
pub async fn run(daemon: Arc<Daemon>, shutdown: CancellationToken) {
    let secs = daemon.config.discovery.rescan_interval_s;
    if secs == 0 {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_secs(secs));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let d = daemon.clone();
        match tokio::task::spawn_blocking(move || d.rescan()).await {
            Ok(Ok(events)) if !events.is_empty() => tracing::info!(events = events.len(), "rescan found changes"),
            Ok(Ok(_)) => tracing::debug!("rescan: no change"),
            Ok(Err(e)) => tracing::warn!(error = %crate::error_chain(&e), "rescan failed; keeping the fabric"),
            Err(e) => tracing::warn!(error = %e, "rescan panicked; keeping the fabric"),
        }
    }
}

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

/// The events that take `old` to `new`: devices added and removed, then links whose
/// state or bandwidth changed (a link that vanished while both ends stay is `Down`).
pub fn diff(old: &Inventory, new: &Inventory) -> Vec<Event> {
    let ids = |inv: &Inventory| inv.devices.iter().map(|d| d.id.to_string()).collect::<BTreeSet<_>>();
    let (before, after) = (ids(old), ids(new));
    let mut events = Vec::new();
    for id in after.difference(&before) {
        events.push(Event::Device { device: DeviceName::truncated(id), change: DeviceChange::Added });
    }
    for id in before.difference(&after) {
        events.push(Event::Device { device: DeviceName::truncated(id), change: DeviceChange::Removed });
    }
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
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.toml");
        std::fs::write(&p, text).unwrap();
        fabric_drivers::sim::load(&p).unwrap()
    }

    fn hgx() -> String {
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/sim/hgx-h100-8gpu.toml")).unwrap()
    }

    #[test]
    fn same_inventory_no_events() {
        assert!(diff(&sim(&hgx()), &sim(&hgx())).is_empty());
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
