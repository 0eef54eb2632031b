//! UALink discovery from vendor sysfs attributes.
//!
//! No mainline kernel exposes UALink yet, so this module defines the layout it reads and a
//! vendor driver is expected to provide, per PCI function, in
//! `sys/bus/pci/devices/<BDF>/ualink/`:
//!
//! | file | meaning | format |
//! | --- | --- | --- |
//! | `pod_id` | the pod (one UALink scale-up domain) | decimal `u32` |
//! | `vpod_id` | the virtual pod (a partition of the pod) | decimal `u32` |
//! | `accelerator_id` | accelerator id within the pod (accelerators only) | decimal, 0..=1023 (10 bits) |
//! | `switch_id` | switch id within the pod (switches only) | decimal `u16` |
//! | `port_count` | UALink ports (stations) of the device | decimal, 1..=256 |
//! | `link_rate_gts` | per-lane signalling rate a port is built for, GT/s | decimal, may have a fraction (`212.5`) |
//! | `lanes` | lanes per port the device is built for | decimal, 1..=16 |
//! | `ports/portN/state` | `up`, `down` or `training` | word |
//! | `ports/portN/remote_accelerator_id` | accelerator at the far end | decimal, as `accelerator_id` |
//! | `ports/portN/remote_switch_id` | switch at the far end | decimal, as `switch_id` |
//! | `ports/portN/lanes` | lanes the port trained to | decimal |
//! | `ports/portN/rate_gts` | rate the port trained to | as `link_rate_gts` |
//!
//! A function with `accelerator_id` is an accelerator, one with `switch_id` a UALink switch.
//! Remote ids are resolved within the local device's pod.
//!
//! Links: the ports of one device that reach the same remote device are bundled into one
//! [`LinkKind::Ualink`] link (`ports` = ports up, `lanes` = lanes per port, `gts` = whole
//! GT/s rounded down). Links come from the accelerator's side for accelerator-switch pairs
//! and from the lower-indexed side for accelerator-accelerator and switch-switch pairs, so a
//! pair is never counted twice. Per-direction bandwidth in MB/s:
//!
//! ```text
//! lane_mbps(rate) = rate_GT/s * 200/212.5 * 1000/8      (UALink 1.0: 212.5 GT/s carries
//!                                                         200 Gb/s after 256b/257b and
//!                                                         RS(544,514) FEC: 25,000 MB/s)
//! current = sum over ports up of port_lanes * lane_mbps(port_rate)
//! max     = ports in bundle * device lanes * lane_mbps(device link_rate)
//! ```

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use fabric_topology::{
    BackendReport, Bandwidth, Device, DeviceId, DeviceIdx, DeviceKind, Inventory, Link, LinkKind, LinkState,
    PciAddress, PciInfo, UalinkInfo,
};

use crate::cxl::scan::Resolver;
use crate::sysfs::{list_dir, parse_dec_u64, read_attr};
use crate::{Backend, SysfsRoot};

/// Most ports read per device.
pub const MAX_PORTS: usize = 256;
/// Most PCI functions examined.
pub const MAX_FUNCTIONS: usize = 65_536;

/// Attribute values by relative name (`pod_id`, `state`, ...).
pub type RawAttrs = BTreeMap<String, String>;

/// State of one UALink port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortState {
    /// Carrying traffic.
    Up,
    /// Not carrying traffic.
    Down,
    /// Link training in progress (not carrying traffic).
    Training,
}

/// The far end of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Remote {
    /// An accelerator, by its id in the pod.
    Accelerator(u16),
    /// A switch, by its id in the pod.
    Switch(u16),
}

/// One parsed `ports/portN` directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UalinkPort {
    /// `N`.
    pub index: u32,
    /// `state`.
    pub state: Option<PortState>,
    /// `remote_accelerator_id` or `remote_switch_id` (`None` when absent, invalid, or both).
    pub remote: Option<Remote>,
    /// `lanes`.
    pub lanes: Option<u8>,
    /// `rate_gts` in MT/s (thousandths of GT/s).
    pub rate_mts: Option<u64>,
    /// Attribute names that were present but did not parse.
    pub invalid: Vec<String>,
}

/// Parsed device-level `ualink/` attributes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UalinkDeviceAttrs {
    /// `pod_id`.
    pub pod: Option<u32>,
    /// `vpod_id`.
    pub vpod: Option<u32>,
    /// `accelerator_id`.
    pub accelerator_id: Option<u16>,
    /// `switch_id`.
    pub switch_id: Option<u16>,
    /// `port_count`.
    pub port_count: Option<u16>,
    /// `link_rate_gts` in MT/s.
    pub rate_mts: Option<u64>,
    /// `lanes`.
    pub lanes: Option<u8>,
    /// Attribute names that were present but did not parse.
    pub invalid: Vec<String>,
}

/// Parses a rate in GT/s (`212.5`, `106.25`, `200`) into MT/s. At most three fractional
/// digits; 0 and rates above 1,000 GT/s are refused.
pub fn parse_rate_gts(s: &str) -> Option<u64> {
    let t = s.trim();
    let (int, frac) = t.split_once('.').unwrap_or((t, ""));
    if frac.len() > 3 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let whole = parse_dec_u64(int).filter(|&v| v <= 1000)?;
    let frac_mts = if frac.is_empty() { 0 } else { parse_dec_u64(frac)? * 10u64.pow(3 - frac.len() as u32) };
    Some(whole * 1000 + frac_mts).filter(|&v| v > 0 && v <= 1_000_000)
}

/// Parses a port `state`.
pub fn parse_port_state(s: &str) -> Option<PortState> {
    match s.trim() {
        "up" => Some(PortState::Up),
        "down" => Some(PortState::Down),
        "training" => Some(PortState::Training),
        _ => None,
    }
}

fn parse_u16(s: &str, max: u16) -> Option<u16> {
    parse_dec_u64(s).and_then(|v| u16::try_from(v).ok()).filter(|&v| v <= max)
}

fn parse_lanes(s: &str) -> Option<u8> {
    parse_dec_u64(s).and_then(|v| u8::try_from(v).ok()).filter(|v| (1..=16).contains(v))
}

/// Parses the files of one `ports/portN` directory.
pub fn parse_ualink_port(index: u32, attrs: &RawAttrs) -> UalinkPort {
    let get = |n: &str| attrs.get(n).map(String::as_str);
    let state = get("state").and_then(parse_port_state);
    let acc = get("remote_accelerator_id").and_then(|s| parse_u16(s, 1023));
    let sw = get("remote_switch_id").and_then(|s| parse_u16(s, u16::MAX));
    let lanes = get("lanes").and_then(parse_lanes);
    let rate_mts = get("rate_gts").and_then(parse_rate_gts);
    let checks = [
        ("state", state.is_some()),
        ("remote_accelerator_id", acc.is_some()),
        ("remote_switch_id", sw.is_some()),
        ("lanes", lanes.is_some()),
        ("rate_gts", rate_mts.is_some()),
    ];
    let mut invalid: Vec<String> =
        checks.iter().filter(|(n, ok)| attrs.contains_key(*n) && !ok).map(|(n, _)| (*n).to_owned()).collect();
    let remote = match (acc, sw) {
        (Some(a), None) => Some(Remote::Accelerator(a)),
        (None, Some(s)) => Some(Remote::Switch(s)),
        (Some(_), Some(_)) => {
            invalid.push("remote (both accelerator and switch)".to_owned());
            None
        }
        (None, None) => None,
    };
    UalinkPort { index, state, remote, lanes, rate_mts, invalid }
}

/// Parses the device-level files of a `ualink/` directory.
pub fn parse_ualink_device(attrs: &RawAttrs) -> UalinkDeviceAttrs {
    let mut d = UalinkDeviceAttrs::default();
    let mut check = |name: &str, ok: bool| {
        if attrs.contains_key(name) && !ok {
            d.invalid.push(name.to_owned());
        }
    };
    let get = |n: &str| attrs.get(n).map(String::as_str);
    let pod = get("pod_id").and_then(parse_dec_u64).and_then(|v| u32::try_from(v).ok());
    check("pod_id", pod.is_some());
    let vpod = get("vpod_id").and_then(parse_dec_u64).and_then(|v| u32::try_from(v).ok());
    check("vpod_id", vpod.is_some());
    let accelerator_id = get("accelerator_id").and_then(|s| parse_u16(s, 1023));
    check("accelerator_id", accelerator_id.is_some());
    let switch_id = get("switch_id").and_then(|s| parse_u16(s, u16::MAX));
    check("switch_id", switch_id.is_some());
    let port_count = get("port_count").and_then(|s| parse_u16(s, MAX_PORTS as u16)).filter(|&v| v > 0);
    check("port_count", port_count.is_some());
    let rate_mts = get("link_rate_gts").and_then(parse_rate_gts);
    check("link_rate_gts", rate_mts.is_some());
    let lanes = get("lanes").and_then(parse_lanes);
    check("lanes", lanes.is_some());
    UalinkDeviceAttrs { pod, vpod, accelerator_id, switch_id, port_count, rate_mts, lanes, invalid: d.invalid }
}

/// Per-direction data bandwidth of one lane in MB/s at a signalling rate in MT/s: UALink 1.0
/// carries 200 Gb/s of data on 212.5 GT/s of signalling.
pub fn lane_mbps(rate_mts: u64) -> u64 {
    rate_mts.saturating_mul(200_000) / 212_500 / 8
}

/// Discovers UALink attributes of accelerators and switches.
#[derive(Debug)]
pub struct UalinkBackend {
    root: SysfsRoot,
}

impl UalinkBackend {
    /// A backend reading under `root`.
    pub fn new(root: SysfsRoot) -> Self {
        Self { root }
    }
}

struct Found {
    addr: PciAddress,
    attrs: UalinkDeviceAttrs,
    ports: Vec<UalinkPort>,
}

fn read_dir_attrs(dir: &Path, names: &[&str], report: &mut BackendReport) -> RawAttrs {
    let mut out = RawAttrs::new();
    for n in names {
        match read_attr(&dir.join(n)) {
            Ok(v) => {
                out.insert((*n).to_owned(), v);
            }
            Err(e) if e.is_missing() => {}
            Err(e) => report.note_unknown(e.to_string()),
        }
    }
    out
}

fn note_invalid(dir: &Path, names: &[String], report: &mut BackendReport) {
    for n in names {
        report.note_unknown(format!("{}: invalid value", dir.join(n).display()));
    }
}

impl UalinkBackend {
    fn scan(&self, report: &mut BackendReport) -> Vec<Found> {
        let devices = self.root.path("sys/bus/pci/devices");
        let Some(res) = Resolver::new(self.root.root()) else { return Vec::new() };
        let mut found = Vec::new();
        for name in list_dir(&devices).unwrap_or_default().into_iter().take(MAX_FUNCTIONS) {
            let Ok(addr) = name.parse::<PciAddress>() else { continue };
            let link = devices.join(&name);
            if !link.join("ualink").is_dir() {
                continue;
            }
            let dir = match res.resolve(&link.join("ualink")) {
                Ok(d) => d,
                Err(e) => {
                    report.note_unknown(e.to_string());
                    continue;
                }
            };
            const DEVICE_FILES: [&str; 7] =
                ["pod_id", "vpod_id", "accelerator_id", "switch_id", "port_count", "link_rate_gts", "lanes"];
            let attrs = parse_ualink_device(&read_dir_attrs(&dir, &DEVICE_FILES, report));
            note_invalid(&dir, &attrs.invalid, report);
            let mut ports = Vec::new();
            for p in list_dir(&dir.join("ports")).unwrap_or_default().into_iter().take(MAX_PORTS) {
                let Some(index) = p.strip_prefix("port").and_then(parse_dec_u64).and_then(|v| u32::try_from(v).ok())
                else {
                    continue;
                };
                let pdir = dir.join("ports").join(&p);
                const PORT_FILES: [&str; 5] =
                    ["state", "remote_accelerator_id", "remote_switch_id", "lanes", "rate_gts"];
                let port = parse_ualink_port(index, &read_dir_attrs(&pdir, &PORT_FILES, report));
                note_invalid(&pdir, &port.invalid, report);
                ports.push(port);
            }
            ports.sort_by_key(|p| p.index);
            found.push(Found { addr, attrs, ports });
        }
        found
    }
}

impl Backend for UalinkBackend {
    fn name(&self) -> &'static str {
        "ualink"
    }

    fn discover(&self, inventory: &mut Inventory) -> BackendReport {
        let mut report = BackendReport::present("ualink");
        let found = self.scan(&mut report);
        if found.is_empty() {
            let mut r = BackendReport::not_present("ualink", "no device exposes ualink/ attributes");
            r.unknown = report.unknown;
            return r;
        }
        let node = self.root.node();
        // `None`: the id is claimed by more than one device, so no port naming it is linked.
        let mut accels: HashMap<(Option<u32>, u16), Option<DeviceIdx>> = HashMap::new();
        let mut switches: HashMap<(Option<u32>, u16), Option<DeviceIdx>> = HashMap::new();
        let mut placed = Vec::new();
        for f in &found {
            let Some(idx) = enrich(inventory, node, f, &mut report) else { continue };
            let a = &f.attrs;
            let table = match (a.accelerator_id, a.switch_id) {
                (Some(id), None) => Some((&mut accels, id)),
                (None, Some(id)) => Some((&mut switches, id)),
                _ => {
                    report.note_unknown(format!("{}: needs exactly one of accelerator_id, switch_id", f.addr));
                    None
                }
            };
            if let Some((t, id)) = table
                && t.insert((a.pod, id), Some(idx)).is_some()
            {
                t.insert((a.pod, id), None);
                report.note_unknown(format!(
                    "{}: id {id} used twice in pod {:?}; ports naming it are not linked",
                    f.addr, a.pod
                ));
            }
            placed.push((idx, f));
            report.devices += 1;
        }
        links(inventory, &placed, &accels, &switches, &mut report);
        report
    }
}

/// Finds (or, without a PCI backend, adds) the function and records its UALink identity.
fn enrich(inv: &mut Inventory, node: &str, f: &Found, report: &mut BackendReport) -> Option<DeviceIdx> {
    let idx = match inv.find_pci(Some(node), f.addr) {
        Some(i) => i,
        None => {
            report.note_unknown(format!("{}: not found by the PCI backend; added with UALink facts only", f.addr));
            let mut d = Device::new(DeviceId::pci(node, f.addr), DeviceKind::Other, Some(node));
            d.pci = Some(PciInfo { address: Some(f.addr), ..PciInfo::default() });
            inv.add_device(d).map_err(|e| report.note_unknown(format!("{}: {e}", f.addr))).ok()?
        }
    };
    let a = &f.attrs;
    let d = inv.device_mut(idx);
    d.ualink = Some(UalinkInfo {
        pod: a.pod,
        vpod: a.vpod,
        accelerator_id: a.accelerator_id,
        switch_id: a.switch_id,
        ports: a.port_count.or_else(|| u16::try_from(f.ports.len()).ok().filter(|&n| n > 0)),
    });
    match (a.accelerator_id, a.switch_id) {
        (Some(_), None) if d.kind != DeviceKind::Gpu => d.kind = DeviceKind::Accelerator,
        (None, Some(_)) => d.kind = DeviceKind::UalinkSwitch,
        _ => {}
    }
    if !d.sources.iter().any(|s| s == "ualink") {
        d.sources.push("ualink".to_owned());
    }
    Some(idx)
}

fn links(
    inv: &mut Inventory,
    placed: &[(DeviceIdx, &Found)],
    accels: &HashMap<(Option<u32>, u16), Option<DeviceIdx>>,
    switches: &HashMap<(Option<u32>, u16), Option<DeviceIdx>>,
    report: &mut BackendReport,
) {
    // (local, remote) -> the local device's ports that reach the remote.
    let mut bundles: BTreeMap<(DeviceIdx, DeviceIdx), (&Found, Vec<&UalinkPort>)> = BTreeMap::new();
    for &(me, f) in placed {
        // A device that is neither or both an accelerator and a switch has no place in the
        // pod's id space, so its own ports make no links either.
        if f.attrs.accelerator_id.is_some() == f.attrs.switch_id.is_some() {
            continue;
        }
        let local_is_switch = f.attrs.switch_id.is_some();
        for p in &f.ports {
            let Some(remote) = p.remote else { continue };
            let (table, remote_is_switch, id) = match remote {
                Remote::Accelerator(id) => (accels, false, id),
                Remote::Switch(id) => (switches, true, id),
            };
            let other = match table.get(&(f.attrs.pod, id)) {
                Some(Some(other)) => *other,
                Some(None) => {
                    report.note_unknown(format!(
                        "{} port{}: remote {remote:?} is claimed by several devices in pod {:?}; not linked",
                        f.addr, p.index, f.attrs.pod
                    ));
                    continue;
                }
                None => {
                    report.note_unknown(format!(
                        "{} port{}: remote {remote:?} not found in pod {:?}",
                        f.addr, p.index, f.attrs.pod
                    ));
                    continue;
                }
            };
            let owns = match (local_is_switch, remote_is_switch) {
                (false, true) => true,
                (true, false) => false,
                _ => me < other,
            };
            if owns {
                bundles.entry((me, other)).or_insert_with(|| (f, Vec::new())).1.push(p);
            }
        }
    }
    for ((a, b), (f, ports)) in bundles {
        let exists = inv
            .links
            .iter()
            .any(|l| matches!(l.kind, LinkKind::Ualink { .. }) && ((l.a == a && l.b == b) || (l.a == b && l.b == a)));
        if !exists {
            inv.add_link(bundle_link(a, b, f, &ports));
        }
    }
}

/// One link for the ports of `f` that reach the same remote device.
fn bundle_link(a: DeviceIdx, b: DeviceIdx, f: &Found, ports: &[&UalinkPort]) -> Link {
    let up: Vec<&&UalinkPort> = ports.iter().filter(|p| p.state == Some(PortState::Up)).collect();
    let current = up.iter().try_fold(0u64, |acc, p| {
        let (l, r) = (p.lanes?, p.rate_mts?);
        Some(acc + u64::from(l) * lane_mbps(r))
    });
    let max = f.attrs.lanes.zip(f.attrs.rate_mts).map(|(l, r)| ports.len() as u64 * u64::from(l) * lane_mbps(r));
    let lanes = f.attrs.lanes.or_else(|| up.iter().filter_map(|p| p.lanes).max()).unwrap_or(0);
    let rate = f.attrs.rate_mts.or_else(|| up.iter().filter_map(|p| p.rate_mts).max()).unwrap_or(0);
    let kind = LinkKind::Ualink {
        ports: u16::try_from(up.len()).unwrap_or(u16::MAX),
        lanes,
        gts: u16::try_from(rate / 1000).unwrap_or(u16::MAX),
    };
    let mut link = Link::new(a, b, kind, Bandwidth { current_mbps: current, max_mbps: max }, None);
    if up.is_empty() {
        link.state = LinkState::Down;
    }
    link
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(kv: &[(&str, &str)]) -> RawAttrs {
        kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn rates_parse_to_mts_and_lanes_to_bandwidth() {
        assert_eq!(parse_rate_gts("212.5"), Some(212_500));
        assert_eq!(parse_rate_gts("106.25\n"), Some(106_250));
        assert_eq!(parse_rate_gts("200"), Some(200_000));
        for bad in ["", "0", "1.2345", "-5", "1e3", "2000", ".5.", "x"] {
            assert_eq!(parse_rate_gts(bad), None, "{bad}");
        }
        assert_eq!(lane_mbps(212_500), 25_000);
        assert_eq!(lane_mbps(106_250), 12_500);
    }

    #[test]
    fn ports_need_exactly_one_remote() {
        let p = parse_ualink_port(3, &attrs(&[("state", "up"), ("remote_switch_id", "7"), ("lanes", "4")]));
        assert_eq!((p.index, p.state, p.remote, p.lanes), (3, Some(PortState::Up), Some(Remote::Switch(7)), Some(4)));
        let p = parse_ualink_port(0, &attrs(&[("remote_switch_id", "7"), ("remote_accelerator_id", "1")]));
        assert_eq!(p.remote, None);
        assert_eq!(p.invalid.len(), 1);
        let p = parse_ualink_port(0, &attrs(&[("remote_accelerator_id", "1024"), ("state", "sideways")]));
        assert_eq!((p.remote, p.state), (None, None));
        assert_eq!(p.invalid, vec!["state".to_owned(), "remote_accelerator_id".to_owned()]);
    }

    #[test]
    fn device_attributes_are_bounded() {
        let d = parse_ualink_device(&attrs(&[("pod_id", "3"), ("accelerator_id", "1023"), ("port_count", "0")]));
        assert_eq!((d.pod, d.accelerator_id, d.port_count), (Some(3), Some(1023), None));
        assert_eq!(d.invalid, vec!["port_count".to_owned()]);
    }

    proptest::proptest! {
        #[test]
        fn parsers_never_panic(s in ".{0,40}") {
            let _ = parse_rate_gts(&s);
            let a = attrs(&[("state", &s), ("rate_gts", &s), ("lanes", &s), ("remote_switch_id", &s), ("pod_id", &s)]);
            let _ = parse_ualink_port(0, &a);
            let _ = parse_ualink_device(&a);
        }
    }
}
