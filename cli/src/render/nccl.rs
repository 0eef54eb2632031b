//! NCCL topology XML for `NCCL_TOPO_FILE`, for one node.
//!
//! The structure follows what NCCL's loader (`src/graph/xml.cc`, `topo.cc`) accepts:
//! `system > cpu > pci* > (pci | gpu | nic)`, `gpu > nvlink`, `nic > net`; AMD GPUs carry
//! `gpu > xgmi` and `gcn` (the GFX target) as RCCL's topology files do. As in NCCL's own
//! dumps, only switch upstream ports appear as `pci` elements (root ports and switch
//! downstream ports are folded away), bus ids are lower case, `link_speed`/`link_width` are
//! the link's maximum (NCCL reads `max_link_speed`, since idle GPUs train down), and CPU
//! affinity is the kernel's `cpumap` hex mask. A NIC with RDMA devices has one `<net>` per
//! active port, as NCCL's IB transport writes them. NCCL's hand-written parser has no XML
//! declaration support and does not decode entities, so none are written and attribute
//! values are restricted to plain characters. Attributes the inventory does not know
//! (`sm`, `gdr`, CPU `arch`/`vendor`/`familyid`/`modelid`) are omitted, never guessed: NCCL
//! fills them from the running host for local devices.

use std::collections::HashMap;
use std::io::{self, Write};

use fabric_topology::{CpuSet, DeviceIdx, DeviceKind, LinkKind, LinkState};

use fabric_drivers::rdma::attrs as rdma_attrs;

use crate::render::matrix::nic_port_name;
use crate::view::View;

/// PCI class NCCL uses for NVSwitch targets.
pub const NVSWITCH_CLASS: &str = "0x068000";
/// PCI class of a 3D controller (data-centre GPUs), used when a peer GPU's class is unknown.
pub const GPU_CLASS: &str = "0x030200";
/// The bus id NCCL uses for an NVLink peer that is not a PCI function (an NVSwitch).
pub const NO_BUS_ID: &str = "fffffff:ffff:ff";
/// NCCL's `MAX_STR_LEN`: longer values are rejected by its parser.
const MAX_VALUE: usize = 255;

/// A CPU set as the kernel's `cpumap`: 32-bit hex words, most significant first.
pub fn cpu_mask(set: &CpuSet) -> String {
    let max = set.ranges().last().map_or(0, |&(_, b)| b);
    let words = (max / 32 + 1) as usize;
    let mut w = vec![0u32; words];
    for &(a, b) in set.ranges() {
        for cpu in a..=b {
            w[(cpu / 32) as usize] |= 1 << (cpu % 32);
        }
    }
    w.iter().rev().map(|x| format!("{x:08x}")).collect::<Vec<_>>().join(",")
}

fn clean(v: &str) -> String {
    let s: String = v
        .chars()
        .filter_map(|c| match c {
            '"' => Some('\''),
            '<' | '>' | '&' => None,
            c if c.is_control() => None,
            c => Some(c),
        })
        .collect();
    s.chars().take(MAX_VALUE).collect()
}

struct Xml<'w> {
    w: &'w mut dyn Write,
    depth: usize,
}

impl Xml<'_> {
    fn tag(&mut self, name: &str, attrs: &[(&str, String)], close: bool) -> io::Result<()> {
        write!(self.w, "{:indent$}<{name}", "", indent = self.depth * 2)?;
        for (k, v) in attrs {
            write!(self.w, " {k}=\"{}\"", clean(v))?;
        }
        if close {
            writeln!(self.w, "/>")
        } else {
            self.depth += 1;
            writeln!(self.w, ">")
        }
    }

    fn open(&mut self, name: &str, attrs: &[(&str, String)]) -> io::Result<()> {
        self.tag(name, attrs, false)
    }

    fn leaf(&mut self, name: &str, attrs: &[(&str, String)]) -> io::Result<()> {
        self.tag(name, attrs, true)
    }

    fn close(&mut self, name: &str) -> io::Result<()> {
        self.depth = self.depth.saturating_sub(1);
        writeln!(self.w, "{:indent$}</{name}>", "", indent = self.depth * 2)
    }

    fn comment(&mut self, text: &str) -> io::Result<()> {
        let t = clean(text).replace("--", "-");
        writeln!(self.w, "{:indent$}<!-- {t} -->", "", indent = self.depth * 2)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Host,
    RootPort,
    Upstream,
    Downstream,
}

fn next_role(parent: Role) -> Role {
    match parent {
        Role::Host => Role::RootPort,
        Role::RootPort | Role::Downstream => Role::Upstream,
        Role::Upstream => Role::Downstream,
    }
}

struct Export<'a> {
    view: &'a View,
    pos: HashMap<DeviceIdx, usize>,
    relevant: Vec<bool>,
    gpu_dev: HashMap<DeviceIdx, usize>,
    nic_dev: HashMap<DeviceIdx, usize>,
}

fn speed_str(gen_: Option<u8>) -> String {
    match gen_ {
        Some(1) => "2.5 GT/s PCIe",
        Some(2) => "5.0 GT/s PCIe",
        Some(3) => "8.0 GT/s PCIe",
        Some(4) => "16.0 GT/s PCIe",
        Some(5) => "32.0 GT/s PCIe",
        Some(6) => "64.0 GT/s PCIe",
        _ => "",
    }
    .to_owned()
}

impl Export<'_> {
    fn pci_attrs(&self, idx: DeviceIdx) -> Vec<(&'static str, String)> {
        let f = &self.view.fabric;
        let d = f.device(idx);
        let p = d.pci.as_ref();
        let mut a = vec![("busid", d.pci_address().map(|x| x.bus_id()).unwrap_or_default())];
        let class = p.and_then(|p| p.class).map(|c| format!("0x{c:06x}")).unwrap_or_else(|| match d.kind {
            DeviceKind::PciBridge => "0x060400".to_owned(),
            DeviceKind::Gpu => GPU_CLASS.to_owned(),
            _ => "0x020000".to_owned(),
        });
        a.push(("class", class));
        let hex = |v: Option<u16>| v.map(|v| format!("0x{v:04x}"));
        for (k, v) in [
            ("vendor", hex(p.and_then(|p| p.vendor_id))),
            ("device", hex(p.and_then(|p| p.device_id))),
            ("subsystem_vendor", hex(p.and_then(|p| p.subsystem_vendor_id))),
            ("subsystem_device", hex(p.and_then(|p| p.subsystem_device_id))),
        ] {
            if let Some(v) = v {
                a.push((k, v));
            }
        }
        // The maximum of the link to the parent port (NCCL: min of device and port maximum).
        let (gen_, width) = match f.parent_link(idx).map(|li| f.link(li).kind) {
            Some(LinkKind::Pcie { gen_max, width_max, gen_current, width_current }) => {
                (gen_max.or(gen_current), width_max.or(width_current))
            }
            _ => (None, None),
        };
        a.push(("link_speed", speed_str(gen_)));
        a.push(("link_width", width.map(|w| w.to_string()).unwrap_or_default()));
        a
    }

    fn gpu(&self, x: &mut Xml<'_>, idx: DeviceIdx) -> io::Result<()> {
        let f = &self.view.fabric;
        let d = f.device(idx);
        let dev = self.gpu_dev[&idx].to_string();
        let mut attrs = vec![("dev", dev.clone())];
        let sm = d.gpu.as_ref().and_then(|g| g.compute_capability.as_deref()).and_then(|cc| {
            let (maj, min) = cc.split_once('.')?;
            Some(maj.trim().parse::<u32>().ok()? * 10 + min.trim().parse::<u32>().ok()?)
        });
        if let Some(sm) = sm {
            attrs.push(("sm", sm.to_string()));
        }
        // RCCL names an AMD GPU's architecture by its GFX target (`gcn="gfx942"`).
        if let Some(gfx) = d.gpu.as_ref().and_then(|g| g.gfx_target.as_deref()) {
            attrs.push(("gcn", gfx.to_owned()));
        }
        attrs.push(("rank", dev));
        if let Some(g) = d.attrs.get("gdr").filter(|g| matches!(g.as_str(), "0" | "1")) {
            attrs.push(("gdr", g.clone()));
        }
        let mut links: Vec<(&str, String, String, u32)> = Vec::new();
        let mut sorted: Vec<(DeviceIdx, usize)> = f.neighbors(idx).collect();
        sorted.sort_by_key(|&(n, li)| (self.pos.get(&n).copied().unwrap_or(usize::MAX), li));
        for (peer, li) in sorted {
            let l = f.link(li);
            // An xGMI bundle whose count the kernel did not give (partitioned modes) is
            // left out: RCCL would read a count as bandwidth.
            let (element, count) = match l.kind {
                LinkKind::NvLink { count, .. } => ("nvlink", count),
                LinkKind::Xgmi { count } => ("xgmi", count),
                _ => continue,
            };
            if l.state == LinkState::Down || count == 0 {
                continue;
            }
            let pd = f.device(peer);
            let target = pd.pci_address().map_or_else(|| NO_BUS_ID.to_owned(), |a| a.bus_id());
            let tclass = match pd.kind {
                DeviceKind::NvSwitch => NVSWITCH_CLASS.to_owned(),
                DeviceKind::Cpu => "0x068001".to_owned(),
                _ => {
                    pd.pci.as_ref().and_then(|p| p.class).map_or_else(|| GPU_CLASS.to_owned(), |c| format!("0x{c:06x}"))
                }
            };
            match links
                .iter_mut()
                .find(|(e, t, c, _)| *e == element && *t == target && *c == tclass && target != NO_BUS_ID)
            {
                Some(e) => e.3 += u32::from(count),
                None => links.push((element, target, tclass, u32::from(count))),
            }
        }
        if links.is_empty() {
            return x.leaf("gpu", &attrs);
        }
        x.open("gpu", &attrs)?;
        for (element, target, tclass, count) in links {
            x.leaf(element, &[("target", target), ("count", count.to_string()), ("tclass", tclass)])?;
        }
        x.close("gpu")
    }

    fn nic(&self, x: &mut Xml<'_>, idx: DeviceIdx) -> io::Result<()> {
        let f = &self.view.fabric;
        let d = f.device(idx);
        let dev = self.nic_dev[&idx];
        if !d.rdma.is_empty() {
            return self.rdma_nets(x, idx, dev);
        }
        let name = nic_port_name(d).map_or_else(|| self.view.short_name(idx), str::to_owned);
        let mut attrs = vec![("name", name), ("dev", dev.to_string())];
        let gbps = f
            .neighbors(idx)
            .filter_map(|(_, li)| match f.link(li).kind {
                LinkKind::Network { gbps } if f.link(li).state != LinkState::Down => Some(gbps),
                _ => None,
            })
            .max();
        if let Some(g) = gbps {
            attrs.push(("speed", (u64::from(g) * 1000).to_string()));
        }
        for key in ["port", "guid", "latency", "maxconn", "gdr", "coll"] {
            if let Some(v) = d.attrs.get(key) {
                attrs.push((key, v.clone()));
            }
        }
        x.open("nic", &[])?;
        x.leaf("net", &attrs)?;
        x.close("nic")
    }

    /// One `<net>` per active port of the NIC's RDMA devices, as NCCL's IB transport lists
    /// them (`ncclIbInit` skips ports that are not `ACTIVE`): `name` the RDMA device,
    /// `speed` the port rate in Mb/s, `port` its number, `guid` the `sys_image_guid` in
    /// NCCL's byte order, `gdr` 1 when a peer-memory client is loaded. `latency` and
    /// `maxconn` (the device's `max_qp`) are not in sysfs and are left to NCCL.
    fn rdma_nets(&self, x: &mut Xml<'_>, idx: DeviceIdx, first: usize) -> io::Result<()> {
        let d = self.view.fabric.device(idx);
        let mut dev = first;
        let mut nets = Vec::new();
        let mut left_out = Vec::new();
        for r in &d.rdma {
            let guid = r.sys_image_guid.as_deref().and_then(rdma_attrs::guid).map(|(g, _)| rdma_attrs::nccl_guid(g));
            for p in &r.ports {
                if p.link_state() != LinkState::Up {
                    left_out.push(format!("{} port {}", r.name, p.number));
                    continue;
                }
                let mut a = vec![("name", r.name.clone()), ("dev", dev.to_string())];
                dev += 1;
                if let Some(m) = p.rate_mbps {
                    a.push(("speed", m.to_string()));
                }
                a.push(("port", p.number.to_string()));
                if let Some(g) = &guid {
                    a.push(("guid", g.clone()));
                }
                if r.peer_memory.is_some() {
                    a.push(("gdr", "1".to_owned()));
                }
                nets.push(a);
            }
        }
        if !left_out.is_empty() {
            x.comment(&format!("not active, left out: {}", left_out.join(", ")))?;
        }
        if nets.is_empty() {
            return Ok(());
        }
        x.open("nic", &[])?;
        for a in &nets {
            x.leaf("net", a)?;
        }
        x.close("nic")
    }

    fn endpoint(&self, x: &mut Xml<'_>, idx: DeviceIdx) -> io::Result<()> {
        x.open("pci", &self.pci_attrs(idx))?;
        match self.view.fabric.device(idx).kind {
            DeviceKind::Gpu => self.gpu(x, idx)?,
            _ => self.nic(x, idx)?,
        }
        x.close("pci")
    }

    fn children(&self, idx: DeviceIdx) -> Vec<DeviceIdx> {
        let mut kids: Vec<DeviceIdx> = self.view.fabric.children(idx).filter(|k| self.relevant[k.get()]).collect();
        kids.sort_by_key(|k| self.pos.get(k).copied().unwrap_or(usize::MAX));
        kids.dedup();
        kids
    }

    fn walk(&self, x: &mut Xml<'_>, idx: DeviceIdx, role: Role, depth: usize) -> io::Result<()> {
        if depth > 64 {
            return Ok(());
        }
        for k in self.children(idx) {
            let kind = self.view.fabric.device(k).kind;
            match kind {
                DeviceKind::Gpu | DeviceKind::Nic if self.view.fabric.device(k).pci_address().is_some() => {
                    self.endpoint(x, k)?;
                }
                DeviceKind::PciBridge => {
                    let r = next_role(role);
                    if r == Role::Upstream && self.view.fabric.device(k).pci_address().is_some() {
                        x.open("pci", &self.pci_attrs(k))?;
                        self.walk(x, k, r, depth + 1)?;
                        x.close("pci")?;
                    } else {
                        self.walk(x, k, r, depth + 1)?;
                    }
                }
                DeviceKind::HostBridge => self.walk(x, k, Role::Host, depth + 1)?,
                _ => self.walk(x, k, role, depth + 1)?,
            }
        }
        Ok(())
    }
}

fn cpu_attrs(view: &View, idx: DeviceIdx) -> Vec<(&'static str, String)> {
    let d = view.fabric.device(idx);
    let mut a = vec![("numaid", d.numa_node.map_or_else(|| "-1".to_owned(), |n| n.to_string()))];
    if let Some(c) = d.local_cpus.as_ref().filter(|c| !c.is_empty()) {
        a.push(("affinity", cpu_mask(c)));
    }
    let get = |keys: &[&str]| keys.iter().find_map(|k| d.attrs.get(*k)).cloned();
    for (name, keys) in [
        ("arch", &["arch"][..]),
        ("vendor", &["vendor", "vendor_id"][..]),
        ("familyid", &["familyid", "family", "cpu_family"][..]),
        ("modelid", &["modelid", "model"][..]),
    ] {
        if let Some(v) = get(keys) {
            a.push((name, v));
        }
    }
    a
}

/// Renders the XML for `node`.
pub fn render(view: &View, node: &str, w: &mut dyn Write) -> io::Result<()> {
    let f = &view.fabric;
    let devs: Vec<DeviceIdx> =
        view.order.iter().copied().filter(|&i| f.device(i).node.as_deref() == Some(node)).collect();
    let pos: HashMap<DeviceIdx, usize> = devs.iter().enumerate().map(|(p, &i)| (i, p)).collect();
    let mut relevant = vec![false; f.len()];
    let (mut gpu_dev, mut nic_dev) = (HashMap::new(), HashMap::new());
    let mut next_net = 0;
    let mut skipped = Vec::new();
    for &i in &devs {
        let kind = f.device(i).kind;
        if !matches!(kind, DeviceKind::Gpu | DeviceKind::Nic) {
            continue;
        }
        if f.device(i).pci_address().is_none() {
            skipped.push(i);
            continue;
        }
        if kind == DeviceKind::Gpu {
            gpu_dev.insert(i, gpu_dev.len());
        } else {
            // NCCL numbers its nets, not NICs: an RDMA NIC has one per active port.
            nic_dev.insert(i, next_net);
            let d = f.device(i);
            next_net += if d.rdma.is_empty() {
                1
            } else {
                d.rdma.iter().flat_map(|r| &r.ports).filter(|p| p.link_state() == LinkState::Up).count()
            };
        }
        for a in f.ancestors(i) {
            relevant[a.get()] = true;
        }
    }
    let ex = Export { view, pos, relevant, gpu_dev, nic_dev };
    let mut x = Xml { w, depth: 0 };
    x.open("system", &[("version", "1".to_owned())])?;
    x.comment(&format!("fabricctl topology -o nccl-xml: node {node}"))?;
    let cpus: Vec<DeviceIdx> = devs.iter().copied().filter(|&i| f.device(i).kind == DeviceKind::Cpu).collect();
    for &c in &cpus {
        let attrs = cpu_attrs(view, c);
        if ex.children(c).is_empty() {
            x.leaf("cpu", &attrs)?;
        } else {
            x.open("cpu", &attrs)?;
            ex.walk(&mut x, c, Role::Host, 0)?;
            x.close("cpu")?;
        }
    }
    // GPUs and NICs that hang off no CPU: NCCL's "unknown CPU".
    let orphans: Vec<DeviceIdx> = devs
        .iter()
        .copied()
        .filter(|&i| (ex.gpu_dev.contains_key(&i) || ex.nic_dev.contains_key(&i)) && f.cpu_of(i).is_none())
        .collect();
    if !orphans.is_empty() {
        x.open("cpu", &[("numaid", "-1".to_owned())])?;
        for i in orphans {
            ex.endpoint(&mut x, i)?;
        }
        x.close("cpu")?;
    }
    for i in skipped {
        x.comment(&format!("skipped {} (no PCI address)", f.device(i).id))?;
    }
    x.close("system")
}
