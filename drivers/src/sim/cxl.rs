//! CXL windows, regions and HDM decoders of a template, kept consistent with the devices:
//! a region's members share one CXL host bridge with a fixed memory window; the region is
//! placed in that window; the host bridge, every CXL switch on the way and every member
//! memdev get a decoder programmed for it, as the kernel's CXL core would show.

use std::collections::HashMap;

use fabric_topology::cxl::{CxlDax, CxlDecoder, CxlDecoderLevel, CxlMode, CxlRegion};
use fabric_topology::{DeviceId, DeviceKind};

use super::error::Located;
use super::r#gen::gpu_uuid;
use super::plan::{Compiler, End, NodePlan};
use super::schema::{RegionMode, RegionSpec, WindowSpec};

/// HDM decoders size regions in multiples of 256 MiB per way.
const HDM_QUANTUM: u64 = 256 << 20;

/// A CXL fixed memory window of a host bridge.
#[derive(Debug, Clone)]
pub(crate) struct WindowPlan {
    pub host_bridge: u32,
    pub base: u64,
    pub size: u64,
    pub capabilities: Vec<String>,
    next: u64,
}

/// A decoder with node-relative owner and targets.
#[derive(Debug, Clone)]
pub(crate) struct DecoderPlan {
    pub owner: Option<u32>,
    pub targets: Vec<u32>,
    pub decoder: CxlDecoder,
}

/// A region with node-relative members.
#[derive(Debug, Clone)]
pub(crate) struct RegionPlan {
    pub targets: Vec<u32>,
    pub region: CxlRegion,
    pub decoders: Vec<DecoderPlan>,
}

pub(crate) fn add_window(plan: &mut NodePlan, hb: u32, w: &WindowSpec) {
    plan.windows.push(WindowPlan {
        host_bridge: hb,
        base: w.base,
        size: w.size.0,
        capabilities: w.capabilities.clone(),
        next: w.base,
    });
}

fn mode_name(m: RegionMode) -> &'static str {
    match m {
        RegionMode::Ram => "ram",
        RegionMode::Pmem => "pmem",
    }
}

/// Parent of each plan device along hierarchical links.
fn parents(plan: &NodePlan) -> Vec<Option<u32>> {
    let mut p = vec![None; plan.protos.len()];
    for (a, b, l) in &plan.links {
        if let (End::Local(a), End::Local(b)) = (a, b)
            && l.kind.is_hierarchical()
            && p[*b as usize].is_none()
        {
            p[*b as usize] = Some(*a);
        }
    }
    p
}

/// Display port numbers: the CXL root is port 0, then CXL host bridges, switches and
/// memdevs in plan order.
fn port_numbers(plan: &NodePlan) -> HashMap<u32, u32> {
    let mut ports = HashMap::new();
    let cxl_hbs: Vec<u32> = plan.windows.iter().map(|w| w.host_bridge).collect();
    let order = [DeviceKind::HostBridge, DeviceKind::CxlSwitch, DeviceKind::CxlMemdev];
    for kind in order {
        for (i, p) in plan.protos.iter().enumerate() {
            let i = i as u32;
            if p.device.kind == kind && (kind != DeviceKind::HostBridge || cxl_hbs.contains(&i)) {
                let n = ports.len() as u32 + 1;
                ports.insert(i, n);
            }
        }
    }
    ports
}

pub(crate) fn compile_regions(c: &Compiler<'_>, specs: &[RegionSpec]) -> Result<Vec<DecoderOrRegion>, Located> {
    let plan = c.plan();
    let parent = parents(plan);
    let ports = port_numbers(plan);
    let mut windows = plan.windows.clone();
    let mut next_decoder: HashMap<u32, u32> = HashMap::new();
    let mut used: HashMap<(u32, bool), u64> = HashMap::new();
    let mut out = Vec::new();
    for (w, win) in windows.iter().enumerate() {
        let decoder = CxlDecoder {
            kernel_name: format!("decoder0.{w}"),
            level: CxlDecoderLevel::Root,
            owner: None,
            start: Some(win.base),
            size: Some(win.size),
            ways: Some(1),
            granularity: Some(256),
            mode: None,
            dpa_start: None,
            dpa_size: None,
            targets: Vec::new(),
            capabilities: win.capabilities.clone(),
            qos_class: None,
            region: None,
            locked: None,
        };
        out.push(DecoderOrRegion::Decoder(DecoderPlan { owner: None, targets: vec![win.host_bridge], decoder }));
    }
    for (r, spec) in specs.iter().enumerate() {
        let mode = spec.mode;
        let mut targets = Vec::with_capacity(spec.targets.get_ref().len());
        for t in spec.targets.get_ref() {
            let idx = c
                .lookup(t.get_ref())
                .filter(|&i| plan.protos[i as usize].device.kind == DeviceKind::CxlMemdev)
                .ok_or_else(|| Located::at(t, format!("region target `{}` is not a CXL memdev", t.get_ref())))?;
            if targets.contains(&idx) {
                return Err(Located::at(t, format!("`{}` appears twice in the region", t.get_ref())));
            }
            targets.push(idx);
        }
        let ways = targets.len() as u64;
        if ![1, 2, 3, 4, 6, 8, 12, 16].contains(&ways) {
            return Err(Located::at(
                &spec.targets,
                format!("{ways} targets is not a CXL interleave (1,2,3,4,6,8,12,16)"),
            ));
        }
        let g = *spec.granularity.get_ref();
        if !g.is_power_of_two() || !(256..=16384).contains(&g) {
            return Err(Located::at(
                &spec.granularity,
                format!("granularity {g} is not a power of two in 256..=16384"),
            ));
        }
        // All members must decode through one host bridge that has a window.
        let mut hb = None;
        for &t in &targets {
            let mut x = t;
            while plan.protos[x as usize].device.kind != DeviceKind::HostBridge {
                x = parent[x as usize]
                    .ok_or_else(|| Located::at(&spec.targets, "region target is not below a host bridge"))?;
            }
            if hb.is_some_and(|h| h != x) {
                return Err(Located::at(&spec.targets, "region targets must share one CXL host bridge"));
            }
            hb = Some(x);
        }
        let hb = hb.ok_or_else(|| Located::at(&spec.targets, "a region needs targets"))?;
        let w = windows
            .iter()
            .position(|w| w.host_bridge == hb)
            .ok_or_else(|| Located::at(&spec.targets, "the targets' host bridge has no CXL `window`"))?;
        let win = &mut windows[w];
        if !win.capabilities.is_empty() && !win.capabilities.iter().any(|c| c == mode_name(mode)) {
            return Err(Located::at(
                &spec.name,
                format!("window of the host bridge does not decode {}", mode_name(mode)),
            ));
        }
        let pmem = mode == RegionMode::Pmem;
        let mut avail = u64::MAX;
        for &t in &targets {
            let info = plan.protos[t as usize].device.cxl.as_ref();
            let cap = info.and_then(|i| if pmem { i.pmem_size } else { i.ram_size }).unwrap_or(0);
            avail = avail.min(cap.saturating_sub(used.get(&(t, pmem)).copied().unwrap_or(0)));
        }
        let per_way = match &spec.size {
            Some(s) => {
                let size = s.get_ref().0;
                if size == 0 || size % (ways * HDM_QUANTUM) != 0 {
                    return Err(Located::at(s, format!("region size must be a non-zero multiple of {ways} x 256MiB")));
                }
                if size / ways > avail {
                    return Err(Located::at(s, "region is larger than its members' free capacity"));
                }
                size / ways
            }
            None => avail / HDM_QUANTUM * HDM_QUANTUM,
        };
        if per_way == 0 {
            return Err(Located::at(&spec.name, format!("members have no free {} capacity", mode_name(mode))));
        }
        let Some(size) = per_way.checked_mul(ways) else {
            return Err(Located::at(&spec.name, "region is larger than the address space"));
        };
        let base = win.next;
        if base.checked_add(size).is_none_or(|end| end > win.base.saturating_add(win.size)) {
            return Err(Located::at(&spec.name, "region does not fit in the host bridge's window"));
        }
        win.next = base + size;
        let cxl_mode = if pmem { CxlMode::Pmem } else { CxlMode::Ram };
        let mut decoders = Vec::new();
        let mut decoder = |owner: u32, level, targets: Vec<u32>, ways: u64, dpa: Option<u64>| {
            let port = ports.get(&owner).copied().unwrap_or(0);
            let k = next_decoder.entry(owner).or_insert(0);
            let d = CxlDecoder {
                kernel_name: format!("decoder{port}.{k}"),
                level,
                owner: None,
                start: Some(base),
                size: Some(size),
                ways: Some(ways as u32),
                granularity: Some(g),
                mode: (level == CxlDecoderLevel::Endpoint).then_some(cxl_mode),
                dpa_start: dpa,
                dpa_size: dpa.map(|_| per_way),
                targets: Vec::new(),
                capabilities: Vec::new(),
                qos_class: None,
                region: Some(spec.name.get_ref().clone()),
                locked: Some(false),
            };
            *k += 1;
            DecoderPlan { owner: Some(owner), targets, decoder: d }
        };
        // Ports on the way, top down, each with its distinct downstream ports in target order.
        let mut port_targets: Vec<(u32, Vec<u32>)> = Vec::new();
        for &t in &targets {
            let mut child = t;
            while let Some(p) = parent[child as usize] {
                let kind = plan.protos[p as usize].device.kind;
                if matches!(kind, DeviceKind::HostBridge | DeviceKind::CxlSwitch) {
                    match port_targets.iter_mut().find(|(x, _)| *x == p) {
                        Some((_, v)) if !v.contains(&child) => v.push(child),
                        Some(_) => {}
                        None => port_targets.push((p, vec![child])),
                    }
                }
                if p == hb {
                    break;
                }
                child = p;
            }
        }
        port_targets.sort_by_key(|(p, _)| if *p == hb { 0 } else { 1 + *p });
        for (p, ts) in port_targets {
            let n = ts.len() as u64;
            decoders.push(decoder(p, CxlDecoderLevel::Switch, ts, n, None));
        }
        for &t in &targets {
            let cursor = used.entry((t, pmem)).or_insert(0);
            let ram_before = if pmem {
                plan.protos[t as usize].device.cxl.as_ref().and_then(|i| i.ram_size).unwrap_or(0)
            } else {
                0
            };
            let dpa = ram_before.checked_add(*cursor).filter(|d| d.checked_add(per_way).is_some());
            let Some(dpa) = dpa else {
                return Err(Located::at(&spec.name, "region's device addresses overflow the device's capacity"));
            };
            *cursor += per_way;
            decoders.push(decoder(t, CxlDecoderLevel::Endpoint, Vec::new(), ways, Some(dpa)));
        }
        let region = CxlRegion {
            kernel_name: spec.name.get_ref().clone(),
            uuid: None,
            mode: Some(cxl_mode),
            resource: Some(base),
            size: Some(size),
            ways: Some(ways as u32),
            granularity: Some(g),
            targets: Vec::new(),
            committed: Some(true),
            dax: vec![CxlDax { name: format!("dax{r}.0"), size: Some(size), numa_node: spec.numa }],
            root_decoder: Some(format!("decoder0.{w}")),
        };
        out.push(DecoderOrRegion::Region(RegionPlan { targets, region, decoders }));
    }
    Ok(out)
}

/// Root decoders and regions, in the order they are emitted.
#[derive(Debug, Clone)]
pub(crate) enum DecoderOrRegion {
    Decoder(DecoderPlan),
    Region(RegionPlan),
}

/// Emits the node's decoders and regions with identities resolved.
pub(crate) fn instantiate(
    plan: &NodePlan,
    ids: &[DeviceId],
    fabric: &str,
    node: &str,
    decoders: &mut Vec<CxlDecoder>,
    regions: &mut Vec<CxlRegion>,
) {
    let id = |l: u32| ids[l as usize].clone();
    let emit = |d: &DecoderPlan, decoders: &mut Vec<CxlDecoder>| {
        let mut x = d.decoder.clone();
        x.owner = d.owner.map(id);
        x.targets = d.targets.iter().map(|&t| ids[t as usize].to_string()).collect();
        decoders.push(x);
    };
    for item in &plan.regions {
        match item {
            DecoderOrRegion::Decoder(d) => emit(d, decoders),
            DecoderOrRegion::Region(r) => {
                for d in &r.decoders {
                    emit(d, decoders);
                }
                let mut x = r.region.clone();
                x.targets = r.targets.iter().map(|&t| id(t)).collect();
                if x.mode == Some(CxlMode::Pmem) {
                    // Persistent regions carry a UUID in their label; derive it stably.
                    let u = gpu_uuid(fabric, node, &x.kernel_name);
                    x.uuid = Some(u.trim_start_matches("GPU-").to_owned());
                }
                regions.push(x);
            }
        }
    }
}
