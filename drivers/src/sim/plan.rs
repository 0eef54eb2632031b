//! Compiles a node template into a [`NodePlan`]: prototype devices with node-relative
//! identities, links between them by position, and the PCIe tree with allocated bus
//! numbers. A plan is compiled once and stamped out for every node built from the template,
//! which is what keeps a 12,500-node cluster cheap.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use fabric_topology::link::{nvlink_mbps_per_link, pcie_mbps};
use fabric_topology::{
    Bandwidth, CpuSet, Device, DeviceId, DeviceIdx, DeviceKind, Link, LinkKind, MemoryKind, MemoryResource, PciAddress,
    PciInfo,
};
use toml::Spanned;

use super::cxl::{self, DecoderOrRegion, WindowPlan};
use super::error::Located;
use super::r#gen::{MAX_COUNT, Pattern, check_name};
use super::schema::{EndpointBase, IntOrPattern, LinkKindSpec, LinkSpec, PerJ, SwitchSpec, Template};

/// How a prototype's identity is formed on a node.
#[derive(Debug, Clone)]
pub(crate) enum Ident {
    /// `name:NODE/NAME`.
    Named,
    /// `pci:NODE/ADDR`.
    Pci(PciAddress),
    /// `uuid:GPU-…` from fabric, node and name.
    GpuUuid,
    /// `serial:cxl/0x…`, explicit or from fabric, node and name.
    CxlSerial(Option<u64>),
}

/// A device of the template, before it is placed on a node.
#[derive(Debug, Clone)]
pub(crate) struct Proto {
    /// Name inside the node (`gpu3`), used for references and generated identities.
    pub local: String,
    pub ident: Ident,
    /// The device with a placeholder id and no node.
    pub device: Device,
}

/// One end of a planned link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// A device of this node, by position in the plan.
    Local(u32),
    /// A fabric-level device.
    Fabric(DeviceIdx),
}

/// A compiled template.
#[derive(Debug, Default)]
pub(crate) struct NodePlan {
    pub protos: Vec<Proto>,
    /// Links; the `a`/`b` of the [`Link`] are placeholders replaced by the ends.
    pub links: Vec<(End, End, Link)>,
    pub names: HashMap<String, u32>,
    /// NIC position for each rail that has one.
    pub rails: Vec<(u32, u32)>,
    /// CXL fixed memory windows of the template's CXL host bridges.
    pub windows: Vec<WindowPlan>,
    /// CXL root decoders and regions with their decoders.
    pub regions: Vec<DecoderOrRegion>,
}

/// Per host bridge: where the next root port and bus go.
#[derive(Debug, Clone, Copy)]
struct BridgeAlloc {
    domain: u32,
    next_bus: u16,
    next_slot: u8,
    cxl: bool,
}

/// Per switch: its downstream bus and next port.
#[derive(Debug, Clone, Copy)]
struct SwitchAlloc {
    host_bridge: u32,
    dsp_bus: u8,
    next_port: u8,
    r#gen: Option<u8>,
    width: Option<u8>,
    cxl: bool,
}

pub(crate) struct Compiler<'a> {
    template: &'a str,
    fabric: &'a HashMap<String, DeviceIdx>,
    plan: NodePlan,
    bridges: HashMap<u32, BridgeAlloc>,
    switches: HashMap<u32, SwitchAlloc>,
    addresses: HashSet<PciAddress>,
    buf: String,
}

/// Checks a `count`-like value and returns it.
pub(crate) fn count_of(count: Option<&Spanned<i64>>, what: &str) -> Result<u64, Located> {
    match count {
        None => Ok(1),
        Some(c) if (1..=MAX_COUNT).contains(c.get_ref()) => Ok(*c.get_ref() as u64),
        Some(c) => Err(Located::at(c, format!("{what} must be between 1 and {MAX_COUNT}, not {}", c.get_ref()))),
    }
}

pub(crate) fn pattern(s: &Spanned<String>) -> Result<Pattern, Located> {
    Pattern::parse(s.get_ref()).map_err(|e| Located::at(s, e))
}

/// Renders a pattern into a checked name.
pub(crate) fn render_name(p: &Pattern, s: &Spanned<String>, i: u64, j: u64, out: &mut String) -> Result<(), Located> {
    p.render_into(i, j, out).map_err(|e| Located::at(s, e))?;
    check_name(out).map_err(|e| Located::at(s, e))
}

fn gts(generation: u8) -> Option<f64> {
    [2.5, 5.0, 8.0, 16.0, 32.0, 64.0].get(usize::from(generation).checked_sub(1)?).copied()
}

fn check_pcie(r#gen: Option<u8>, width: Option<u8>, at: &Spanned<String>) -> Result<(), Located> {
    if let Some(g) = r#gen
        && !(1..=6).contains(&g)
    {
        return Err(Located::at(at, format!("gen {g} is not a PCIe generation (1..=6)")));
    }
    if let Some(w) = width
        && ![1, 2, 4, 8, 12, 16, 32].contains(&w)
    {
        return Err(Located::at(at, format!("width {w} is not a PCIe link width")));
    }
    Ok(())
}

fn parse_pci_id(s: Option<&Spanned<String>>) -> Result<(Option<u16>, Option<u16>), Located> {
    let Some(s) = s else { return Ok((None, None)) };
    let bad = || Located::at(s, format!("invalid pci_id {:?} (expected VVVV:DDDD in hex)", s.get_ref()));
    let (v, d) = s.get_ref().split_once(':').ok_or_else(bad)?;
    let v = u16::from_str_radix(v, 16).map_err(|_| bad())?;
    let d = u16::from_str_radix(d, 16).map_err(|_| bad())?;
    Ok((Some(v), Some(d)))
}

/// The link kind and bandwidth of a `[[link]]` entry for index `j`.
pub(crate) fn link_shape(spec: &LinkSpec, j: u64) -> Result<(LinkKind, Bandwidth), Located> {
    let count = |what: &str| -> Result<u16, Located> {
        let c = spec.count.as_ref().ok_or_else(|| Located::at(&spec.from, format!("a {what} link needs `count`")))?;
        let n = match c.get_ref() {
            PerJ::One(n) => *n,
            PerJ::Many(v) => *v
                .get(j as usize)
                .ok_or_else(|| Located::at(c, format!("count has {} entries but j runs to {}", v.len(), j + 1)))?,
        };
        if n == 0 {
            return Err(Located::at(c, "count must be at least 1"));
        }
        Ok(n)
    };
    let (kind, computed) = match spec.kind {
        LinkKindSpec::Nvlink => {
            let g = spec.generation.as_ref().ok_or_else(|| Located::at(&spec.from, "an nvlink needs `generation`"))?;
            let per = nvlink_mbps_per_link(*g.get_ref())
                .ok_or_else(|| Located::at(g, format!("NVLink generation {} is unknown (1..=5)", g.get_ref())))?;
            let n = count("nvlink")?;
            (LinkKind::NvLink { generation: *g.get_ref(), count: n }, Some(per * u64::from(n)))
        }
        LinkKindSpec::Xgmi => (LinkKind::Xgmi { count: count("xgmi")? }, None),
        LinkKindSpec::Ualink => {
            let (ports, lanes, gts) = (spec.ports.unwrap_or(1), spec.lanes.unwrap_or(4), spec.gts.unwrap_or(200));
            if ports == 0 || lanes == 0 || gts == 0 {
                return Err(Located::at(&spec.from, "ualink ports, lanes and gts must be at least 1"));
            }
            let mbps = u64::from(ports) * u64::from(lanes) * u64::from(gts) * 125;
            (LinkKind::Ualink { ports, lanes, gts }, Some(mbps))
        }
        LinkKindSpec::C2c => (LinkKind::C2c, None),
        LinkKindSpec::Network => {
            let g = spec.gbps.ok_or_else(|| Located::at(&spec.from, "a network link needs `gbps`"))?;
            (LinkKind::Network { gbps: g }, Some(u64::from(g) * 125))
        }
    };
    let bw = spec.mbps.or(computed).map_or_else(Bandwidth::default, Bandwidth::full);
    Ok((kind, bw))
}

/// A link value with placeholder ends.
pub(crate) fn placeholder_link(kind: LinkKind, bw: Bandwidth, latency_ns: Option<u32>) -> Link {
    Link::new(DeviceIdx(0), DeviceIdx(0), kind, bw, latency_ns)
}

impl<'a> Compiler<'a> {
    pub fn new(template: &'a str, fabric: &'a HashMap<String, DeviceIdx>) -> Self {
        Self {
            template,
            fabric,
            plan: NodePlan::default(),
            bridges: HashMap::new(),
            switches: HashMap::new(),
            addresses: HashSet::new(),
            buf: String::new(),
        }
    }

    pub(crate) fn plan(&self) -> &NodePlan {
        &self.plan
    }

    fn push(&mut self, local: String, ident: Ident, device: Device, at: Range<usize>) -> Result<u32, Located> {
        let idx = self.plan.protos.len() as u32;
        if self.plan.names.insert(local.clone(), idx).is_some() {
            return Err(Located::new(at, format!("duplicate device name `{local}` in template {}", self.template)));
        }
        if let Some(a) = device.pci_address()
            && !self.addresses.insert(a)
        {
            return Err(Located::new(at, format!("duplicate PCI address {a} in template {}", self.template)));
        }
        self.plan.protos.push(Proto { local, ident, device });
        Ok(idx)
    }

    fn link(&mut self, a: u32, b: u32, link: Link) {
        self.plan.links.push((End::Local(a), End::Local(b), link));
    }

    pub(crate) fn lookup(&self, name: &str) -> Option<u32> {
        self.plan.names.get(name).copied()
    }

    fn new_device(kind: DeviceKind, name: Option<&str>, parent: Option<&Device>) -> Device {
        let mut d = Device::new(DeviceId::named("-", "-"), kind, None);
        d.name = name.map(str::to_owned);
        d.sources = vec!["sim".to_owned()];
        if let Some(p) = parent {
            d.numa_node = p.numa_node;
            d.local_cpus.clone_from(&p.local_cpus);
        }
        d
    }

    fn pci_info(addr: PciAddress, class: u32, r#gen: Option<u8>, width: Option<u8>) -> PciInfo {
        let speed = r#gen.and_then(gts);
        PciInfo {
            address: Some(addr),
            class: Some(class),
            link_speed_gts: speed,
            link_width: width,
            max_link_speed_gts: speed,
            max_link_width: width,
            ..PciInfo::default()
        }
    }

    fn bus(&mut self, hb: u32, at: &Spanned<String>) -> Result<u8, Located> {
        let alloc = self.bridges.get_mut(&hb).ok_or_else(|| Located::at(at, "internal: unknown host bridge"))?;
        let bus = u8::try_from(alloc.next_bus)
            .map_err(|_| Located::at(at, "PCI bus numbers exhausted below this host bridge"))?;
        alloc.next_bus += 1;
        Ok(bus)
    }

    /// Creates the bridge that `child` hangs from below `parent` and returns it, the child's
    /// allocated address, its host bridge and whether the parent speaks CXL.
    fn attach(&mut self, parent: u32, at: &Spanned<String>) -> Result<(u32, PciAddress, u32, bool), Located> {
        let bad_addr = || Located::at(at, "PCI slots exhausted on this bus");
        if let Some(hb) = self.bridges.get(&parent).copied() {
            let slot = hb.next_slot;
            if slot >= 32 {
                return Err(bad_addr());
            }
            let root_bus = self.root_bus(parent);
            let rp_addr = PciAddress::new(hb.domain, root_bus, slot, 0).ok_or_else(bad_addr)?;
            if let Some(b) = self.bridges.get_mut(&parent) {
                b.next_slot += 1;
            }
            let secondary = self.bus(parent, at)?;
            let parent_dev = &self.plan.protos[parent as usize].device;
            // The root port's model is the CPU's, which the file does not give: unknown.
            let mut rp = Self::new_device(DeviceKind::PciBridge, None, Some(parent_dev));
            rp.pci = Some(Self::pci_info(rp_addr, 0x06_0400, None, None));
            let local = format!("rp-{rp_addr}");
            let rp_idx = self.push(local, Ident::Pci(rp_addr), rp, at.span())?;
            let kind = if hb.cxl { LinkKind::Cxl { width: None } } else { pcie_kind(None, None) };
            self.link(parent, rp_idx, placeholder_link(kind, Bandwidth::default(), None));
            let addr = PciAddress::new(hb.domain, secondary, 0, 0).ok_or_else(bad_addr)?;
            return Ok((rp_idx, addr, parent, hb.cxl));
        }
        if let Some(sw) = self.switches.get(&parent).copied() {
            if sw.next_port >= 32 {
                return Err(bad_addr());
            }
            let domain = self.bridges.get(&sw.host_bridge).map_or(0, |b| b.domain);
            let dsp_addr = PciAddress::new(domain, sw.dsp_bus, sw.next_port, 0).ok_or_else(bad_addr)?;
            if let Some(s) = self.switches.get_mut(&parent) {
                s.next_port += 1;
            }
            let child_bus = self.bus(sw.host_bridge, at)?;
            let parent_dev = &self.plan.protos[parent as usize].device;
            let mut dsp = Self::new_device(DeviceKind::PciBridge, parent_dev.name.as_deref(), Some(parent_dev));
            dsp.pci = Some(Self::pci_info(dsp_addr, 0x06_0400, sw.r#gen, sw.width));
            let dsp_idx = self.push(format!("dsp-{dsp_addr}"), Ident::Pci(dsp_addr), dsp, at.span())?;
            let link = if sw.cxl { cxl_link(sw.r#gen, sw.width) } else { pcie_link(sw.r#gen, sw.width) };
            self.link(parent, dsp_idx, link);
            let addr = PciAddress::new(domain, child_bus, 0, 0).ok_or_else(bad_addr)?;
            return Ok((dsp_idx, addr, sw.host_bridge, sw.cxl));
        }
        Err(Located::at(at, format!("`{}` is not a host bridge or switch of template {}", self.buf, self.template)))
    }

    fn root_bus(&self, hb: u32) -> u8 {
        // The root bus is in the host bridge's local name `pciDDDD:BB`.
        let local = &self.plan.protos[hb as usize].local;
        local.rsplit(':').next().and_then(|b| u8::from_str_radix(b, 16).ok()).unwrap_or(0)
    }

    fn resolve_parent(&mut self, p: &Pattern, s: &Spanned<String>, i: u64) -> Result<u32, Located> {
        let mut buf = std::mem::take(&mut self.buf);
        render_name(p, s, i, 0, &mut buf)?;
        self.buf = buf;
        self.lookup(&self.buf).ok_or_else(|| {
            Located::at(s, format!("parent `{}` is not declared (earlier) in template {}", self.buf, self.template))
        })
    }

    /// NUMA nodes, host bridges and the SMP links between sockets.
    pub fn numa_and_bridges(&mut self, t: &Template) -> Result<(), Located> {
        let mut numa_locals: Vec<u32> = Vec::with_capacity(t.numa.len());
        for (n, spec) in t.numa.iter().enumerate() {
            let id = spec.id.as_ref().map_or(n as u32, |s| *s.get_ref());
            let cpus: CpuSet = spec.cpus.get_ref().parse().map_err(|e| Located::at(&spec.cpus, format!("{e}")))?;
            let mut d = Self::new_device(DeviceKind::Cpu, spec.model.as_deref(), None);
            d.numa_node = Some(id);
            d.local_cpus = Some(cpus);
            if let Some(size) = spec.dram {
                d.memory.push(MemoryResource { kind: MemoryKind::Dram, size: size.0, hpa: None, numa_node: Some(id) });
            }
            let at = spec.id.as_ref().map_or_else(|| spec.cpus.span(), |s| s.span());
            numa_locals.push(self.push(format!("numa{id}"), Ident::Named, d, at)?);
        }
        for (x, &a) in numa_locals.iter().enumerate() {
            for &b in &numa_locals[x + 1..] {
                self.link(a, b, placeholder_link(LinkKind::Smp, Bandwidth::default(), None));
            }
        }
        for spec in &t.host_bridge {
            let bad = || {
                Located::at(&spec.bus, format!("invalid host bridge bus {:?} (expected DDDD:BB)", spec.bus.get_ref()))
            };
            let (dom, bus) = spec.bus.get_ref().split_once(':').ok_or_else(bad)?;
            let domain = u32::from_str_radix(dom, 16).map_err(|_| bad())?;
            let bus = u8::from_str_radix(bus, 16).map_err(|_| bad())?;
            let numa_name = format!("numa{}", spec.numa.get_ref());
            let cpu = self.lookup(&numa_name).ok_or_else(|| {
                Located::at(
                    &spec.numa,
                    format!("NUMA node {} is not declared in template {}", spec.numa.get_ref(), self.template),
                )
            })?;
            let parent = &self.plan.protos[cpu as usize].device;
            let label = if spec.cxl { "CXL host bridge" } else { "PCI host bridge" };
            let d = Self::new_device(DeviceKind::HostBridge, Some(label), Some(parent));
            let local = format!("pci{domain:04x}:{bus:02x}");
            let hb = self.push(local, Ident::Named, d, spec.bus.span())?;
            self.link(cpu, hb, placeholder_link(LinkKind::HostAttach, Bandwidth::default(), None));
            self.bridges.insert(hb, BridgeAlloc { domain, next_bus: u16::from(bus) + 1, next_slot: 1, cxl: spec.cxl });
            if let Some(w) = &spec.window {
                cxl::add_window(&mut self.plan, hb, w);
            }
        }
        Ok(())
    }

    /// PCIe or CXL switches: upstream port (named by the switch) below a root port or
    /// downstream port of its parent.
    pub fn switches(&mut self, specs: &[SwitchSpec], cxl_switch: bool) -> Result<(), Located> {
        for spec in specs {
            let n = count_of(spec.count.as_ref(), "count")?;
            let name_p = pattern(&spec.name)?;
            let parent_p = pattern(&spec.parent)?;
            check_pcie(spec.r#gen, spec.width, &spec.name)?;
            let (vendor, device) = parse_pci_id(spec.pci_id.as_ref())?;
            for i in 0..n {
                let parent = self.resolve_parent(&parent_p, &spec.parent, i)?;
                let (up, addr, hb, parent_cxl) = self.attach(parent, &spec.parent)?;
                if cxl_switch && !parent_cxl {
                    return Err(Located::at(&spec.parent, "a CXL switch must hang below a CXL host bridge or switch"));
                }
                let mut local = String::new();
                render_name(&name_p, &spec.name, i, 0, &mut local)?;
                let kind = if cxl_switch { DeviceKind::CxlSwitch } else { DeviceKind::PciBridge };
                let display = spec.model.as_deref().unwrap_or(&local);
                let parent_dev = &self.plan.protos[up as usize].device;
                let mut d = Self::new_device(kind, Some(display), Some(parent_dev));
                let mut pci = Self::pci_info(addr, 0x06_0400, spec.r#gen, spec.width);
                (pci.vendor_id, pci.device_id) = (vendor, device);
                d.pci = Some(pci);
                let dsp_bus = self.bus(hb, &spec.parent)?;
                let usp = self.push(local, Ident::Pci(addr), d, spec.name.span())?;
                let link =
                    if cxl_switch { cxl_link(spec.r#gen, spec.width) } else { pcie_link(spec.r#gen, spec.width) };
                self.link(up, usp, link);
                let alloc = SwitchAlloc {
                    host_bridge: hb,
                    dsp_bus,
                    next_port: 0,
                    r#gen: spec.r#gen,
                    width: spec.width,
                    cxl: cxl_switch,
                };
                self.switches.insert(usp, alloc);
            }
        }
        Ok(())
    }

    /// Endpoints of one kind. `fill` sets kind-specific details on instance `i`.
    pub fn endpoints(
        &mut self,
        base: EndpointBase<'_>,
        kind: DeviceKind,
        class: u32,
        mut fill: impl FnMut(&mut Device, u64) -> Result<(), Located>,
    ) -> Result<Vec<u32>, Located> {
        let n = count_of(base.count, "count")?;
        let name_p = pattern(base.name)?;
        let parent_p = base.parent.map(pattern).transpose()?;
        let bdf_p = base.bdf.map(pattern).transpose()?;
        check_pcie(base.r#gen, base.width, base.name)?;
        let (vendor, device_id) = parse_pci_id(base.pci_id)?;
        let is_cxl = kind == DeviceKind::CxlMemdev;
        let mut out = Vec::with_capacity(n as usize);
        for i in 0..n {
            let mut local = String::new();
            render_name(&name_p, base.name, i, 0, &mut local)?;
            let display = base.model.unwrap_or(&local);
            let attached = match (&parent_p, base.parent) {
                (Some(p), Some(s)) => {
                    let parent = self.resolve_parent(p, s, i)?;
                    let (up, mut addr, _, cxl_parent) = self.attach(parent, s)?;
                    if let (Some(bp), Some(bs)) = (&bdf_p, base.bdf) {
                        let text = bp.render(i, 0).map_err(|e| Located::at(bs, e))?;
                        addr = text.parse().map_err(|e| Located::at(bs, format!("{e}")))?;
                    }
                    if is_cxl && !cxl_parent {
                        return Err(Located::at(s, "a CXL memdev must hang below a CXL host bridge or switch"));
                    }
                    Some((up, addr, is_cxl && cxl_parent))
                }
                _ => None,
            };
            let parent_dev = attached.map(|(up, _, _)| &self.plan.protos[up as usize].device);
            let mut d = Self::new_device(kind, Some(display), parent_dev);
            if let Some((_, addr, _)) = attached {
                let mut pci = Self::pci_info(addr, class, base.r#gen, base.width);
                (pci.vendor_id, pci.device_id) = (vendor, device_id);
                d.pci = Some(pci);
            }
            fill(&mut d, i)?;
            let ident = match (kind, attached) {
                (DeviceKind::Gpu, _) => Ident::GpuUuid,
                (DeviceKind::CxlMemdev, _) => Ident::CxlSerial(d.cxl.as_ref().and_then(|c| c.serial)),
                (_, Some((_, addr, _))) => Ident::Pci(addr),
                (_, None) => Ident::Named,
            };
            let idx = self.push(local, ident, d, base.name.span())?;
            if let Some((up, _, cxl)) = attached {
                let link = if cxl { cxl_link(base.r#gen, base.width) } else { pcie_link(base.r#gen, base.width) };
                self.link(up, idx, link);
            }
            out.push(idx);
        }
        Ok(out)
    }

    /// Records the rail of NIC `idx` (instance `i`).
    pub fn rail(&mut self, idx: u32, rail: &Spanned<IntOrPattern>, i: u64) -> Result<(), Located> {
        let r = match rail.get_ref() {
            IntOrPattern::Int(r) => *r,
            IntOrPattern::Pattern(p) => {
                let text = Pattern::parse(p).and_then(|p| p.render(i, 0)).map_err(|e| Located::at(rail, e))?;
                text.parse().map_err(|_| Located::at(rail, format!("rail {text:?} is not a number")))?
            }
        };
        if self.plan.rails.iter().any(|&(x, _)| x == r) {
            return Err(Located::at(rail, format!("two NICs on rail {r} in template {}", self.template)));
        }
        self.plan.rails.push((r, idx));
        self.plan.protos[idx as usize].device.attrs.insert("rail".to_owned(), r.to_string());
        Ok(())
    }

    /// `[[templates.T.link]]` entries.
    pub fn links(&mut self, specs: &[LinkSpec]) -> Result<(), Located> {
        for spec in specs {
            let ni = count_of(spec.i.as_ref(), "i")?;
            let nj = count_of(spec.j.as_ref(), "j")?;
            if ni * nj > MAX_COUNT as u64 {
                return Err(Located::at(&spec.from, format!("i x j must be at most {MAX_COUNT}")));
            }
            let from_p = pattern(&spec.from)?;
            let to_p = pattern(&spec.to)?;
            for i in 0..ni {
                for j in 0..nj {
                    let a = self.end(&from_p, &spec.from, i, j)?;
                    let b = self.end(&to_p, &spec.to, i, j)?;
                    if a == b {
                        return Err(Located::at(&spec.to, "a link cannot join a device to itself"));
                    }
                    let (kind, bw) = link_shape(spec, j)?;
                    self.plan.links.push((a, b, placeholder_link(kind, bw, spec.latency_ns)));
                }
            }
        }
        Ok(())
    }

    fn end(&mut self, p: &Pattern, s: &Spanned<String>, i: u64, j: u64) -> Result<End, Located> {
        p.render_into(i, j, &mut self.buf).map_err(|e| Located::at(s, e))?;
        if let Some(f) = self.buf.strip_prefix("fabric/") {
            return self
                .fabric
                .get(f)
                .map(|&d| End::Fabric(d))
                .ok_or_else(|| Located::at(s, format!("link end `{}` is not a fabric-level switch", self.buf)));
        }
        self.lookup(&self.buf).map(End::Local).ok_or_else(|| {
            Located::at(s, format!("link end `{}` is not a device of template {}", self.buf, self.template))
        })
    }

    pub fn regions(&mut self, t: &Template) -> Result<(), Located> {
        let regions = cxl::compile_regions(self, &t.cxl_region)?;
        self.plan.regions = regions;
        Ok(())
    }

    pub fn finish(self) -> NodePlan {
        self.plan
    }
}

fn pcie_kind(r#gen: Option<u8>, width: Option<u8>) -> LinkKind {
    LinkKind::Pcie { gen_current: r#gen, width_current: width, gen_max: r#gen, width_max: width }
}

fn pcie_link(r#gen: Option<u8>, width: Option<u8>) -> Link {
    Link::pcie(DeviceIdx(0), DeviceIdx(0), (r#gen, width), (r#gen, width))
}

fn cxl_link(r#gen: Option<u8>, width: Option<u8>) -> Link {
    let bw = r#gen.zip(width).and_then(|(g, w)| pcie_mbps(g, w)).map_or_else(Bandwidth::default, Bandwidth::full);
    placeholder_link(LinkKind::Cxl { width }, bw, None)
}

/// Builds a template's plan.
pub(crate) fn compile(name: &str, t: &Template, fabric: &HashMap<String, DeviceIdx>) -> Result<NodePlan, Located> {
    let mut c = Compiler::new(name, fabric);
    c.numa_and_bridges(t)?;
    c.switches(&t.pcie_switch, false)?;
    c.switches(&t.cxl_switch, true)?;
    super::kinds::endpoints(&mut c, t)?;
    c.links(&t.link)?;
    c.regions(t)?;
    Ok(c.finish())
}
