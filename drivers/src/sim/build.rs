//! Builds an [`Inventory`] from a parsed sim file: fabric-level switches, then every node
//! stamped from its compiled template, then the cluster network, fabric-level links and
//! degradations. Deterministic: the order of everything follows the file.

use std::collections::{HashMap, HashSet};

use fabric_topology::{BackendReport, Device, DeviceId, DeviceIdx, DeviceKind, Inventory, Link, UalinkInfo};
use toml::Spanned;

use super::degrade;
use super::error::Located;
use super::r#gen::{self, MAX_COUNT};
use super::network;
use super::plan::{self, End, Ident, NodePlan, Proto, count_of, link_shape, pattern, placeholder_link, render_name};
use super::schema::{FabricSwitchKind, SimFile};

/// Most devices (and twice as many links) one sim fabric may hold: 2.5 times the
/// 100,000-GPU cluster (~790,000 devices), so a hostile or mistyped file cannot make the
/// parser allocate more than a few GiB.
// Fuzzing builds (`--cfg fuzzing`, set by scripts/fuzz.sh) use a lower cap so a mutated
// count cannot spend the fuzzer's memory limit on one input.
pub(crate) const MAX_DEVICES: u64 = if cfg!(fuzzing) { 20_000 } else { 2_000_000 };

/// A node to build.
pub(crate) struct NodeEntry<'a> {
    pub name: String,
    pub template: &'a str,
    pub span: std::ops::Range<usize>,
}

/// Where each node's devices start, for `NODE/NAME` lookups.
pub(crate) struct Placed<'a> {
    pub nodes: Vec<(NodeEntry<'a>, u32)>,
    pub plans: HashMap<&'a str, NodePlan>,
    pub fabric: HashMap<String, DeviceIdx>,
    by_name: HashMap<String, usize>,
}

impl Placed<'_> {
    /// Resolves `NODE/NAME` or a fabric-level name.
    pub fn resolve(&self, path: &str) -> Option<DeviceIdx> {
        match path.split_once('/') {
            Some(("fabric", name)) => self.fabric.get(name).copied(),
            Some((node, name)) => {
                let (entry, base) = &self.nodes[*self.by_name.get(node)?];
                let local = self.plans.get(entry.template)?.names.get(name)?;
                Some(DeviceIdx(base + local))
            }
            None => self.fabric.get(path).copied(),
        }
    }
}

/// Builds the inventory.
pub(crate) fn build(file: &SimFile) -> Result<Inventory, Located> {
    let fabric_name = file.fabric.name.get_ref().as_str();
    r#gen::check_name(fabric_name).map_err(|e| Located::at(&file.fabric.name, e))?;
    let mut inv = Inventory::new();

    let fabric = fabric_switches(file, &mut inv)?;
    let mut plans = HashMap::new();
    for (name, t) in &file.templates {
        plans.insert(name.as_str(), plan::compile(name, t, &fabric)?);
    }
    check_node_counts(file, &plans)?;
    let nodes = node_entries(file, &plans)?;

    // Refuse sizes that would not fit before allocating anything big.
    let net_size = match &file.cluster {
        Some(c) => c.network.as_ref().map(|n| network::size(n, c)).transpose()?.unwrap_or((0, 0)),
        None => (0, 0),
    };
    let mut devices = inv.devices.len() as u64 + net_size.0;
    let mut links = net_size.1;
    for n in &nodes {
        let p = &plans[n.template];
        devices += p.protos.len() as u64;
        links += p.links.len() as u64;
    }
    if devices > MAX_DEVICES || links > 2 * MAX_DEVICES {
        let at = nodes.last().map_or(file.fabric.name.span(), |n| n.span.clone());
        return Err(Located::new(
            at,
            format!("the fabric would have {devices} devices and {links} links (limit {MAX_DEVICES})"),
        ));
    }
    inv.devices.reserve(devices as usize);
    inv.links.reserve(links as usize + file.link.len());

    let mut ualink = UalinkIds::new(file)?;
    let mut placed_nodes = Vec::with_capacity(nodes.len());
    let mut ids = Vec::new();
    let mut serials = HashSet::new();
    for entry in nodes {
        let base = inv.devices.len() as u32;
        let p = &plans[entry.template];
        let node = entry.name.as_str();
        let keep_ids = !p.regions.is_empty();
        ids.clear();
        for proto in &p.protos {
            let id = match &proto.ident {
                Ident::Named => DeviceId::named(node, &proto.local),
                Ident::Pci(a) => DeviceId::pci(node, *a),
                Ident::GpuUuid => DeviceId::uuid(&r#gen::gpu_uuid(fabric_name, node, &proto.local)),
                Ident::CxlSerial(s) => {
                    let serial = s.unwrap_or_else(|| r#gen::serial(fabric_name, node, &proto.local));
                    DeviceId::cxl(serial)
                }
            };
            if let Ident::CxlSerial(_) = proto.ident
                && !serials.insert(id.clone())
            {
                return Err(Located::new(entry.span.clone(), format!("duplicate device id {id} on node {node}")));
            }
            let ualink_info = if proto.device.kind == DeviceKind::Accelerator { ualink.next(&entry)? } else { None };
            if keep_ids {
                ids.push(id.clone());
            }
            // Devices are pushed directly and indexed once at the end: identities are unique
            // by construction (unique node names; unique names and PCI addresses within a
            // template; hashed UUIDs; serials checked above).
            inv.devices.push(stamp(proto, id, &entry.name, ualink_info));
        }
        for (a, b, link) in &p.links {
            let end = |e: &End| match *e {
                End::Local(x) => DeviceIdx(base + x),
                End::Fabric(d) => d,
            };
            inv.add_link(Link { a: end(a), b: end(b), ..link.clone() });
        }
        if keep_ids {
            super::cxl::instantiate(p, &ids, fabric_name, node, &mut inv.cxl.decoders, &mut inv.cxl.regions);
        }
        placed_nodes.push((entry, base));
    }
    let by_name = placed_nodes.iter().enumerate().map(|(i, (e, _))| (e.name.clone(), i)).collect();
    let placed = Placed { nodes: placed_nodes, plans, fabric, by_name };

    if let Some(c) = &file.cluster
        && let Some(net) = &c.network
    {
        network::build(net, c, &placed, &mut inv)?;
    }
    fabric_links(file, &placed, &mut inv)?;
    for d in &file.degraded {
        degrade::apply(d, &placed, &mut inv)?;
    }
    inv.reindex();
    let mut report = BackendReport::present("sim");
    report.devices = inv.devices.len();
    inv.backends.push(report);
    Ok(inv)
}

/// A node's copy of a prototype device, built field by field so that nothing is allocated
/// twice (the prototype's placeholder id is never cloned).
fn stamp(proto: &Proto, id: DeviceId, node: &str, ualink: Option<UalinkInfo>) -> Device {
    let p = &proto.device;
    let mut gpu = p.gpu.clone();
    if let Some(g) = gpu.as_mut() {
        g.uuid = id.as_str().strip_prefix("uuid:").map(str::to_owned);
    }
    let mut cxl = p.cxl.clone();
    if let (Ident::CxlSerial(None), Some(c)) = (&proto.ident, cxl.as_mut()) {
        c.serial = id.as_str().strip_prefix("serial:cxl/0x").and_then(|s| u64::from_str_radix(s, 16).ok());
    }
    Device {
        id,
        kind: p.kind,
        node: Some(node.to_owned()),
        name: p.name.clone(),
        numa_node: p.numa_node,
        local_cpus: p.local_cpus.clone(),
        pci: p.pci.clone(),
        gpu,
        cxl,
        ualink: ualink.or_else(|| p.ualink.clone()),
        memory: p.memory.clone(),
        sources: p.sources.clone(),
        attrs: p.attrs.clone(),
        dma_mask_bits: p.dma_mask_bits,
        rdma: p.rdma.clone(),
        numa_memory: p.numa_memory.clone(),
    }
}

/// `[[switch]]`: fabric-level switches, named `name:fabric/NAME`.
fn fabric_switches(file: &SimFile, inv: &mut Inventory) -> Result<HashMap<String, DeviceIdx>, Located> {
    let mut names = HashMap::new();
    let mut ualink_switch = 0u16;
    let mut buf = String::new();
    for spec in &file.switch {
        let n = count_of(spec.count.as_ref(), "count")?;
        let name_p = pattern(&spec.name)?;
        let tray_p = spec.tray.as_ref().map(pattern).transpose()?;
        for i in 0..n {
            render_name(&name_p, &spec.name, i, 0, &mut buf)?;
            let kind = match spec.kind {
                FabricSwitchKind::Nvswitch => DeviceKind::NvSwitch,
                FabricSwitchKind::Ualink => DeviceKind::UalinkSwitch,
                FabricSwitchKind::Network => DeviceKind::NetworkSwitch,
            };
            let mut d = Device::new(DeviceId::named("fabric", &buf), kind, None);
            d.name = Some(spec.model.clone().unwrap_or_else(|| buf.clone()));
            d.sources = vec!["sim".to_owned()];
            if let Some(p) = spec.ports {
                d.attrs.insert("ports".to_owned(), p.to_string());
            }
            if let (Some(tp), Some(ts)) = (&tray_p, &spec.tray) {
                d.attrs.insert("tray".to_owned(), tp.render(i, 0).map_err(|e| Located::at(ts, e))?);
            }
            if kind == DeviceKind::UalinkSwitch {
                d.ualink = Some(UalinkInfo {
                    pod: file.ualink.as_ref().map(|u| *u.pod.get_ref()),
                    switch_id: Some(ualink_switch),
                    ports: spec.ports,
                    ..UalinkInfo::default()
                });
                ualink_switch = ualink_switch.saturating_add(1);
            }
            let idx = inv.add_device(d).map_err(|e| Located::at(&spec.name, e.to_string()))?;
            if names.insert(buf.clone(), idx).is_some() {
                return Err(Located::at(&spec.name, format!("duplicate fabric switch `{buf}`")));
            }
        }
    }
    Ok(names)
}

/// Refuses node generators whose devices alone would pass [`MAX_DEVICES`], before any
/// node name is generated.
fn check_node_counts(file: &SimFile, plans: &HashMap<&str, NodePlan>) -> Result<(), Located> {
    let mut devices = 0u64;
    let size = |t: &Spanned<String>| plans.get(t.get_ref().as_str()).map_or(0, |p| p.protos.len() as u64);
    let mut check = |n: u64, t: &Spanned<String>, at: &Spanned<String>| {
        devices = devices.saturating_add(n.saturating_mul(size(t)));
        if devices > MAX_DEVICES {
            return Err(Located::at(at, format!("the fabric would have more devices than the limit of {MAX_DEVICES}")));
        }
        Ok(())
    };
    for spec in &file.node {
        check(count_of(spec.count.as_ref(), "count")?, &spec.template, &spec.name)?;
    }
    if let Some(c) = &file.cluster {
        let at = Spanned::new(c.nodes.span(), String::new());
        check(count_of(Some(&c.nodes), "nodes")?, &c.template, &at)?;
    }
    Ok(())
}

/// Nodes from `[[node]]` entries, then the `[cluster]`, with unique names.
fn node_entries<'a>(file: &'a SimFile, plans: &HashMap<&'a str, NodePlan>) -> Result<Vec<NodeEntry<'a>>, Located> {
    let template = |t: &'a Spanned<String>| -> Result<&'a str, Located> {
        let name = t.get_ref().as_str();
        if plans.contains_key(name) {
            Ok(name)
        } else {
            let known: Vec<&str> = file.templates.keys().map(String::as_str).collect();
            Err(Located::at(t, format!("unknown template `{name}` (defined: {})", known.join(", "))))
        }
    };
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let mut add = |out: &mut Vec<NodeEntry<'a>>, p: &r#gen::Pattern, s: &Spanned<String>, i: u64, t: &'a str| {
        let mut name = String::new();
        render_name(p, s, i, 0, &mut name)?;
        if name == "fabric" {
            return Err(Located::at(s, "`fabric` is reserved for fabric-level devices"));
        }
        if !seen.insert(name.clone()) {
            return Err(Located::at(s, format!("duplicate node name `{name}`")));
        }
        out.push(NodeEntry { name, template: t, span: s.span() });
        Ok(())
    };
    for spec in &file.node {
        let t = template(&spec.template)?;
        let p = pattern(&spec.name)?;
        for i in 0..count_of(spec.count.as_ref(), "count")? {
            add(&mut out, &p, &spec.name, i, t)?;
        }
    }
    if let Some(c) = &file.cluster {
        let t = template(&c.template)?;
        let n = count_of(Some(&c.nodes), "nodes")?;
        let default = Spanned::new(c.nodes.span(), "node{i}".to_owned());
        let s = c.name.as_ref().unwrap_or(&default);
        let p = pattern(s)?;
        if p.is_literal() && n > 1 {
            return Err(Located::at(s, "a cluster of several nodes needs `{i}` in its node name"));
        }
        out.reserve(n as usize);
        for i in 0..n {
            add(&mut out, &p, s, i, t)?;
        }
    }
    Ok(out)
}

/// Assigns UALink accelerator ids in build order.
struct UalinkIds {
    pod: Option<(u32, u64, std::ops::Range<usize>)>,
    next: u64,
}

impl UalinkIds {
    fn new(file: &SimFile) -> Result<Self, Located> {
        let pod = match &file.ualink {
            None => None,
            Some(u) => {
                let size = match &u.vpod_size {
                    None => 1024,
                    Some(v) if (1..=1024).contains(v.get_ref()) => *v.get_ref() as u64,
                    Some(v) => return Err(Located::at(v, "vpod_size must be between 1 and 1024")),
                };
                Some((*u.pod.get_ref(), size, u.pod.span()))
            }
        };
        Ok(Self { pod, next: 0 })
    }

    fn next(&mut self, node: &NodeEntry<'_>) -> Result<Option<UalinkInfo>, Located> {
        let Some((pod, vpod_size, span)) = &self.pod else { return Ok(None) };
        let id = self.next;
        if id >= 1024 {
            let msg = format!("node {} brings the pod past 1,024 accelerators (10-bit accelerator ids)", node.name);
            return Err(Located::new(span.clone(), msg));
        }
        self.next += 1;
        Ok(Some(UalinkInfo {
            pod: Some(*pod),
            vpod: Some((id / vpod_size) as u32),
            accelerator_id: Some(id as u16),
            ..UalinkInfo::default()
        }))
    }
}

/// `[[link]]` at fabric level: ends are `NODE/NAME` or fabric switch names.
fn fabric_links(file: &SimFile, placed: &Placed<'_>, inv: &mut Inventory) -> Result<(), Located> {
    let mut buf = String::new();
    for spec in &file.link {
        let ni = count_of(spec.i.as_ref(), "i")?;
        let nj = count_of(spec.j.as_ref(), "j")?;
        if ni * nj > MAX_COUNT as u64 {
            return Err(Located::at(&spec.from, format!("i x j must be at most {MAX_COUNT}")));
        }
        let (fp, tp) = (pattern(&spec.from)?, pattern(&spec.to)?);
        for i in 0..ni {
            for j in 0..nj {
                let mut end = |p: &r#gen::Pattern, s: &Spanned<String>| -> Result<DeviceIdx, Located> {
                    p.render_into(i, j, &mut buf).map_err(|e| Located::at(s, e))?;
                    placed.resolve(&buf).ok_or_else(|| Located::at(s, format!("link end `{buf}` is not a device")))
                };
                let a = end(&fp, &spec.from)?;
                let b = end(&tp, &spec.to)?;
                if a == b {
                    return Err(Located::at(&spec.to, "a link cannot join a device to itself"));
                }
                let (kind, bw) = link_shape(spec, j)?;
                inv.add_link(Link { a, b, ..placeholder_link(kind, bw, spec.latency_ns) });
            }
        }
    }
    Ok(())
}
