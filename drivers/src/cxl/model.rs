//! Turns a [`Scan`] into inventory devices, links and CXL objects keyed by stable identity.
//!
//! Identities: a memdev is `serial:cxl/0x<serial>` (its PCIe DSN), or its PCI function
//! when the serial is missing, zero or shared by two memdevs; a host bridge is
//! `name:<node>/pciDDDD:BB` (the PCI backend's id); a switch is its upstream port's
//! `pci:<node>/<addr>`; a dport is its PCI function or host bridge; the root is
//! `name:<node>/ACPI0017:00`; a window (root decoder) or a RAM region is named by its host
//! physical start `hpa:0x…`, a PMEM region by its UUID. Kernel names (`portN`, `decoderX.Y`,
//! `regionN`) change between boots and appear only in display fields.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use fabric_topology::cxl::{CxlDax, CxlDecoder, CxlDecoderLevel, CxlMemdevInfo, CxlMode, CxlRegion};
use fabric_topology::{
    BackendReport, Bandwidth, Device, DeviceId, DeviceIdx, DeviceKind, Inventory, Link, LinkKind, MemoryKind,
    MemoryResource, PciAddress, PciInfo,
};

use super::scan::{DportRaw, MemdevRaw, PortKind, PortRaw, Scan};

/// The backend name, recorded in device `sources`.
const SOURCE: &str = "cxl";

/// A port's stable identity and, for host bridges and switches, its inventory device.
#[derive(Debug, Clone)]
struct PortIdent {
    id: DeviceId,
    idx: Option<DeviceIdx>,
}

/// What a device directory is, judged by its name.
enum DevName {
    HostBridge(String),
    Pci(PciAddress),
    Other(String),
}

fn dev_name(path: &Path) -> Option<DevName> {
    let name = path.file_name()?.to_str()?;
    if let Ok(addr) = name.parse::<PciAddress>() {
        return Some(DevName::Pci(addr));
    }
    let is_hb = name.strip_prefix("pci").and_then(|r| r.split_once(':')).is_some_and(|(d, b)| {
        !d.is_empty() && b.len() == 2 && d.len() <= 8 && (d.chars().chain(b.chars())).all(|c| c.is_ascii_hexdigit())
    });
    Some(if is_hb { DevName::HostBridge(name.to_owned()) } else { DevName::Other(name.to_owned()) })
}

fn printable_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_graphic() && b != b'/')
}

/// Builds the inventory contribution of a scan. Returns the number of devices added or
/// enriched.
pub fn build(scan: &Scan, node: &str, inv: &mut Inventory, report: &mut BackendReport) -> usize {
    let mut b =
        Builder { scan, node, inv, report, touched: Vec::new(), memdevs: HashMap::new(), ports: HashMap::new() };
    b.memdevs();
    b.ports();
    b.links();
    let decoders = b.decoders();
    b.regions(decoders);
    b.touched.sort();
    b.touched.dedup();
    b.touched.len()
}

struct Builder<'a> {
    scan: &'a Scan,
    node: &'a str,
    inv: &'a mut Inventory,
    report: &'a mut BackendReport,
    touched: Vec<DeviceIdx>,
    /// Memdev directory -> (id, device).
    memdevs: HashMap<PathBuf, (DeviceId, DeviceIdx)>,
    /// Port directory -> identity.
    ports: HashMap<PathBuf, PortIdent>,
}

impl Builder<'_> {
    fn memdev_pci(&self, m: &MemdevRaw) -> Option<PciAddress> {
        match m.host.as_deref().and_then(dev_name) {
            Some(DevName::Pci(a)) => Some(a),
            _ => None,
        }
    }

    fn memdevs(&mut self) {
        let mut serial_count: HashMap<u64, usize> = HashMap::new();
        for m in &self.scan.memdevs {
            if let Some(s) = m.serial.filter(|&s| s != 0) {
                *serial_count.entry(s).or_default() += 1;
            }
        }
        let mut keyed = Vec::new();
        for m in &self.scan.memdevs {
            let pci = self.memdev_pci(m);
            let id = match (m.serial.filter(|s| *s != 0 && serial_count[s] == 1), pci) {
                (Some(s), _) => DeviceId::cxl(s),
                (None, Some(a)) => {
                    let why = match m.serial {
                        Some(0) => "serial is 0",
                        Some(_) => "serial shared with another memdev",
                        None => "serial unknown",
                    };
                    self.report.note_unknown(format!("{}: {why}; keyed by PCI address {a}", m.path.display()));
                    DeviceId::pci(self.node, a)
                }
                (None, None) => {
                    self.report
                        .note_unknown(format!("{}: no usable serial and no PCI parent; skipped", m.path.display()));
                    continue;
                }
            };
            keyed.push((id, pci, m));
        }
        keyed.sort_by(|a, b| a.0.cmp(&b.0));
        for (id, pci, m) in keyed {
            let idx = match pci.and_then(|a| self.inv.find_pci(Some(self.node), a)).or_else(|| self.inv.find(&id)) {
                Some(idx) => {
                    if self.inv.device(idx).id != id && !self.inv.rename(idx, id.clone()) {
                        self.report
                            .note_unknown(format!("{}: identity {id} already taken; not merged", m.path.display()));
                        continue;
                    }
                    idx
                }
                None => {
                    let mut d = Device::new(id.clone(), DeviceKind::CxlMemdev, Some(self.node));
                    d.pci = pci.map(|a| PciInfo { address: Some(a), ..PciInfo::default() });
                    match self.inv.add_device(d) {
                        Ok(i) => i,
                        Err(e) => {
                            self.report.note_unknown(format!("{}: {e}", m.path.display()));
                            continue;
                        }
                    }
                }
            };
            let d = self.inv.device_mut(idx);
            d.kind = DeviceKind::CxlMemdev;
            if let Some(n) = m.numa_node {
                d.numa_node = n;
            }
            d.cxl = Some(CxlMemdevInfo {
                serial: m.serial,
                kernel_name: Some(m.name.clone()),
                pci_address: pci,
                ram_size: m.ram_size,
                pmem_size: m.pmem_size,
                firmware_version: m.firmware_version.clone(),
                dc_regions: (!m.dc.is_empty()).then_some(m.dc.len() as u32),
            });
            d.memory.retain(|r| {
                !matches!(r.kind, MemoryKind::CxlVolatile | MemoryKind::CxlPersistent | MemoryKind::CxlDynamic)
            });
            let res = |kind, size| MemoryResource { kind, size, hpa: None, numa_node: None };
            if let Some(s) = m.ram_size.filter(|&s| s > 0) {
                d.memory.push(res(MemoryKind::CxlVolatile, s));
            }
            if let Some(s) = m.pmem_size.filter(|&s| s > 0) {
                d.memory.push(res(MemoryKind::CxlPersistent, s));
            }
            for p in &m.dc {
                d.memory.push(res(MemoryKind::CxlDynamic, p.size));
            }
            if !d.sources.iter().any(|s| s == SOURCE) {
                d.sources.push(SOURCE.to_owned());
            }
            self.touched.push(idx);
            self.memdevs.insert(m.path.clone(), (id, idx));
        }
    }

    fn parent_port(&self, p: &PortRaw) -> Option<&'_ PortRaw> {
        let parent = p.path.parent()?;
        self.scan.ports.iter().find(|q| q.path == parent)
    }

    fn ports(&mut self) {
        let mut ports: Vec<&PortRaw> = self.scan.ports.iter().collect();
        // Roots first, then by depth, so that parents are known before children.
        // Ties broken by the upstream device path, which (unlike `portN`) is stable.
        ports.sort_by(|a, b| {
            let key = |p: &PortRaw| (p.kind != PortKind::Root, p.path.components().count());
            key(a).cmp(&key(b)).then_with(|| a.uport.cmp(&b.uport))
        });
        for p in ports {
            let ident = match p.kind {
                PortKind::Root => {
                    let name = p.uport.as_deref().and_then(|u| u.file_name()?.to_str()).filter(|n| printable_name(n));
                    Some(PortIdent { id: DeviceId::named(self.node, name.unwrap_or("cxl-root")), idx: None })
                }
                PortKind::Endpoint => {
                    let m = p.uport.as_ref().and_then(|u| self.memdevs.get(u));
                    if m.is_none() {
                        self.report.note_unknown(format!("{}: uport is not a known memdev", p.path.display()));
                    }
                    m.map(|(id, idx)| PortIdent { id: id.clone(), idx: Some(*idx) })
                }
                PortKind::Port => self.port_device(p),
            };
            if let Some(ident) = ident {
                if let (Some(idx), Some(n)) = (ident.idx, p.decoders_committed) {
                    self.inv.device_mut(idx).attrs.insert("cxl_decoders_committed".into(), n.to_string());
                }
                self.ports.insert(p.path.clone(), ident);
            }
        }
    }

    /// The host bridge or switch device a `portN` stands for, reusing the PCI backend's.
    fn port_device(&mut self, p: &PortRaw) -> Option<PortIdent> {
        let under_root = self.parent_port(p).is_some_and(|q| q.kind == PortKind::Root);
        let (id, kind, pci) = match p.uport.as_deref().and_then(dev_name) {
            Some(DevName::HostBridge(n)) => (DeviceId::named(self.node, &n), DeviceKind::HostBridge, None),
            Some(DevName::Pci(a)) => (DeviceId::pci(self.node, a), DeviceKind::CxlSwitch, Some(a)),
            Some(DevName::Other(n)) if printable_name(&n) => {
                let kind = if under_root { DeviceKind::HostBridge } else { DeviceKind::CxlSwitch };
                (DeviceId::named(self.node, &n), kind, None)
            }
            _ => {
                self.report.note_unknown(format!("{}: uport unknown; port skipped", p.path.display()));
                return None;
            }
        };
        let existing = pci.and_then(|a| self.inv.find_pci(Some(self.node), a)).or_else(|| self.inv.find(&id));
        let idx = match existing {
            Some(i) => i,
            None => {
                let mut d = Device::new(id.clone(), kind, Some(self.node));
                d.pci = pci.map(|a| PciInfo { address: Some(a), ..PciInfo::default() });
                self.inv
                    .add_device(d)
                    .map_err(|e| self.report.note_unknown(format!("{}: {e}", p.path.display())))
                    .ok()?
            }
        };
        let d = self.inv.device_mut(idx);
        if kind == DeviceKind::CxlSwitch {
            d.kind = DeviceKind::CxlSwitch;
        }
        if !d.sources.iter().any(|s| s == SOURCE) {
            d.sources.push(SOURCE.to_owned());
        }
        self.touched.push(idx);
        Some(PortIdent { id: d.id.clone(), idx: Some(idx) })
    }

    /// The stable identity of a dport's device.
    fn dport_id(&self, d: &DportRaw) -> Option<DeviceId> {
        let pick = |p: &Path| match dev_name(p)? {
            DevName::HostBridge(n) => Some(DeviceId::named(self.node, &n)),
            DevName::Pci(a) => Some(DeviceId::pci(self.node, a)),
            DevName::Other(_) => None,
        };
        pick(&d.path).or_else(|| d.physical.as_deref().and_then(pick))
    }

    fn find_id(&self, id: &DeviceId) -> Option<DeviceIdx> {
        if let Some(i) = self.inv.find(id) {
            return Some(i);
        }
        let addr = id.as_str().rsplit_once('/').and_then(|(_, a)| a.parse::<PciAddress>().ok())?;
        (id.scheme() == "pci").then(|| self.inv.find_pci(Some(self.node), addr)).flatten()
    }

    /// Links every port to its dports present in the inventory, and every child port to its
    /// parent dport (or, when the dport is not in the inventory, to its parent port).
    fn links(&mut self) {
        let mut pairs: Vec<(DeviceIdx, DeviceIdx)> = Vec::new();
        for p in &self.scan.ports {
            let Some(me) = self.ports.get(&p.path).and_then(|i| i.idx) else { continue };
            if p.kind != PortKind::Endpoint {
                for d in p.dports.values() {
                    if let Some(di) = self.dport_id(d).and_then(|id| self.find_id(&id)).filter(|&di| di != me) {
                        pairs.push((me, di));
                    }
                }
            }
            let Some(parent) = self.parent_port(p) else { continue };
            let Some(up) = self.ports.get(&parent.path).and_then(|i| i.idx) else { continue };
            let dport =
                p.parent_dport.as_deref().and_then(|pd| parent.dports.values().find(|d| d.path == pd)).or_else(|| {
                    let u = p.uport.as_deref()?;
                    parent.dports.values().find(|d| u.starts_with(&d.path))
                });
            match dport.and_then(|d| self.dport_id(d)).and_then(|id| self.find_id(&id)) {
                Some(di) if di != me => pairs.push((di, me)),
                _ => pairs.push((up, me)),
            }
        }
        pairs.sort_by(|x, y| {
            (&self.inv.device(x.0).id, &self.inv.device(x.1).id)
                .cmp(&(&self.inv.device(y.0).id, &self.inv.device(y.1).id))
        });
        pairs.dedup();
        for (a, b) in pairs {
            ensure_cxl_link(self.inv, a, b);
        }
    }

    fn decoders(&mut self) -> HashMap<String, (PathBuf, CxlDecoder)> {
        let mut out = HashMap::new();
        for d in &self.scan.decoders {
            let Some(port) = d.path.parent().and_then(|pp| self.scan.ports.iter().find(|p| p.path == pp)) else {
                self.report.note_unknown(format!("{}: not inside a known port", d.path.display()));
                continue;
            };
            let level = match port.kind {
                PortKind::Root => CxlDecoderLevel::Root,
                PortKind::Port => CxlDecoderLevel::Switch,
                PortKind::Endpoint => CxlDecoderLevel::Endpoint,
            };
            let a = &d.attrs;
            let mut targets = Vec::new();
            for t in a.targets.iter().flatten() {
                match port.dports.get(t).and_then(|dp| self.dport_id(dp)) {
                    Some(id) => targets.push(id.to_string()),
                    None => {
                        self.report.note_unknown(format!("{}: target dport {t} not resolvable", d.path.display()));
                        targets.push(format!("unresolved:dport{t}"));
                    }
                }
            }
            let capabilities: Vec<String> =
                [(a.cap_ram, "ram"), (a.cap_pmem, "pmem"), (a.cap_type2, "accelmem"), (a.cap_type3, "expander")]
                    .iter()
                    .filter(|(c, _)| *c == Some(true))
                    .map(|(_, n)| (*n).to_owned())
                    .collect();
            let dec = CxlDecoder {
                kernel_name: d.name.clone(),
                level,
                owner: self.ports.get(&port.path).map(|i| i.id.clone()),
                start: a.start,
                size: a.size,
                ways: a.ways,
                granularity: a.granularity,
                mode: a.mode,
                dpa_start: a.dpa_resource,
                dpa_size: a.dpa_size,
                targets,
                capabilities,
                qos_class: a.qos_class,
                region: None,
                locked: a.locked,
            };
            out.insert(d.name.clone(), (d.path.clone(), dec));
        }
        out
    }

    fn regions(&mut self, mut decoders: HashMap<String, (PathBuf, CxlDecoder)>) {
        let mut regions = Vec::new();
        for r in &self.scan.regions {
            let a = &r.attrs;
            let root =
                r.path.parent().and_then(|pp| decoders.values().find(|(p, _)| p == pp)).and_then(|(_, d)| d.start);
            let mut targets = Vec::new();
            let mut members = Vec::new();
            for (pos, name) in &a.targets {
                let owner = decoders
                    .get(name)
                    .filter(|(_, d)| d.level == CxlDecoderLevel::Endpoint)
                    .and_then(|(_, d)| d.owner.clone());
                match owner {
                    Some(id) => {
                        targets.push(id);
                        members.push(name.clone());
                    }
                    None => self
                        .report
                        .note_unknown(format!("{}/target{pos}: {name} is not a memdev's decoder", r.path.display())),
                }
            }
            let key = a.uuid.clone().or_else(|| a.resource.map(|s| format!("hpa:{s:#x}")));
            for m in &members {
                if let Some((_, d)) = decoders.get_mut(m) {
                    d.region = key.clone();
                }
            }
            let dax: Vec<CxlDax> = r
                .dax
                .iter()
                .map(|x| CxlDax { name: x.name.clone(), size: x.size, numa_node: x.target_node.or(x.numa_node) })
                .collect();
            // The node the region's memory is onlined to, when the DAX devices agree on one.
            let node = dax.first().and_then(|x| x.numa_node).filter(|n| dax.iter().all(|x| x.numa_node == Some(*n)));
            if let (Some(n), Some(kind)) = (node, a.mode.and_then(mode_memory)) {
                for t in &targets {
                    if let Some(i) = self.inv.find(t) {
                        for m in
                            self.inv.device_mut(i).memory.iter_mut().filter(|m| m.kind == kind && m.numa_node.is_none())
                        {
                            m.numa_node = Some(n);
                        }
                    }
                }
            }
            regions.push(CxlRegion {
                kernel_name: r.name.clone(),
                uuid: a.uuid.clone(),
                mode: a.mode,
                resource: a.resource,
                size: a.size,
                ways: a.ways,
                granularity: a.granularity,
                targets,
                committed: a.committed,
                dax,
                root_decoder: root.map(|s| format!("hpa:{s:#x}")),
            });
        }
        let mut decs: Vec<(u32, CxlDecoder)> = decoders.into_values().map(|(p, d)| (instance_of(&p), d)).collect();
        decs.sort_by(|(ia, a), (ib, b)| (level_rank(a.level), &a.owner, ia).cmp(&(level_rank(b.level), &b.owner, ib)));
        regions.sort_by(|a, b| (a.resource, &a.uuid, a.size).cmp(&(b.resource, &b.uuid, b.size)));
        self.inv.cxl.decoders.extend(decs.into_iter().map(|(_, d)| d));
        self.inv.cxl.regions.extend(regions);
    }
}

fn instance_of(p: &Path) -> u32 {
    p.file_name().and_then(|n| n.to_str()).and_then(super::parse::parse_decoder_name).map_or(u32::MAX, |(_, y)| y)
}

fn level_rank(l: CxlDecoderLevel) -> u8 {
    match l {
        CxlDecoderLevel::Root => 0,
        CxlDecoderLevel::Switch => 1,
        CxlDecoderLevel::Endpoint => 2,
    }
}

fn mode_memory(m: CxlMode) -> Option<MemoryKind> {
    match m {
        CxlMode::Ram => Some(MemoryKind::CxlVolatile),
        CxlMode::Pmem => Some(MemoryKind::CxlPersistent),
        CxlMode::DynamicRam => Some(MemoryKind::CxlDynamic),
        CxlMode::None | CxlMode::Unknown => None,
    }
}

/// Makes the edge `a` (upstream) -> `b` a CXL link: a PCIe link the PCI backend found between
/// them becomes CXL (CXL runs over the PCIe PHY, so its width and bandwidth stay); otherwise
/// a CXL link of unknown bandwidth is added.
pub fn ensure_cxl_link(inv: &mut Inventory, a: DeviceIdx, b: DeviceIdx) {
    let same = |l: &Link| (l.a == a && l.b == b) || (l.a == b && l.b == a);
    if let Some(l) =
        inv.links.iter_mut().find(|l| same(l) && matches!(l.kind, LinkKind::Pcie { .. } | LinkKind::Cxl { .. }))
    {
        if let LinkKind::Pcie { width_current, .. } = l.kind {
            l.kind = LinkKind::Cxl { width: width_current };
        }
        return;
    }
    inv.add_link(Link::new(a, b, LinkKind::Cxl { width: None }, Bandwidth::default(), None));
}
