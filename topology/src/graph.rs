//! The fabric graph: an [`Inventory`] indexed for queries — adjacency in compressed rows,
//! the PCI/CXL parent of every device, the node each device lives on and the scale-up
//! domain (NVLink/xGMI/UALink/C2C component) it belongs to — and hop classification.

use std::collections::HashMap;

use crate::class::HopClass;
use crate::device::{DOMAIN_NODE_ATTR, DOMAIN_NODE_LIVE, Device, DeviceKind};
use crate::inventory::{DeviceIdx, Inventory, InventoryError};
use crate::link::{Link, LinkKind, LinkState};

/// Marks "none" in the dense per-device index vectors.
pub(crate) const NONE: u32 = u32::MAX;

/// An inventory plus the indexes that make path queries cheap, even with 10^5 devices.
#[derive(Debug)]
pub struct Fabric {
    inv: Inventory,
    /// `adj[adj_start[i]..adj_start[i+1]]` are `(neighbour, link index)` of device `i`.
    adj_start: Vec<u32>,
    adj: Vec<(u32, u32)>,
    /// Upstream device through a hierarchical link (PCIe, CXL, host attachment).
    parent: Vec<u32>,
    /// The hierarchical link to the parent.
    parent_link: Vec<u32>,
    /// Index into `nodes` of the device's node.
    node_of: Vec<u32>,
    nodes: Vec<String>,
    /// Scale-up component id (union of scale-up links), or `NONE`.
    scale_up: Vec<u32>,
}

impl Fabric {
    /// Indexes an inventory. Fails only if a link names a device that does not exist.
    pub fn build(mut inv: Inventory) -> Result<Self, InventoryError> {
        inv.validate()?;
        inv.ensure_indexed();
        let n = inv.devices.len();
        let mut degree = vec![0u32; n + 1];
        for l in &inv.links {
            degree[l.a.get()] += 1;
            degree[l.b.get()] += 1;
        }
        let mut adj_start = Vec::with_capacity(n + 1);
        let mut acc = 0u32;
        for d in &degree[..n] {
            adj_start.push(acc);
            acc += d;
        }
        adj_start.push(acc);
        let mut fill = adj_start.clone();
        let mut adj = vec![(0u32, 0u32); acc as usize];
        let mut parent = vec![NONE; n];
        let mut parent_link = vec![NONE; n];
        let mut uf = UnionFind::new(n);
        for (li, l) in inv.links.iter().enumerate() {
            let li = li as u32;
            for (x, y) in [(l.a, l.b), (l.b, l.a)] {
                let slot = &mut fill[x.get()];
                adj[*slot as usize] = (y.0, li);
                *slot += 1;
            }
            if l.kind.is_hierarchical() && parent[l.b.get()] == NONE {
                parent[l.b.get()] = l.a.0;
                parent_link[l.b.get()] = li;
            }
            if l.kind.is_scale_up() && l.state != LinkState::Down {
                uf.union(l.a.0, l.b.0);
            }
        }
        let mut names: HashMap<&str, u32> = HashMap::new();
        let mut nodes = Vec::new();
        let node_of = inv
            .devices
            .iter()
            .map(|d| match d.node.as_deref() {
                None => NONE,
                Some(name) => *names.entry(name).or_insert_with(|| {
                    nodes.push(name.to_owned());
                    (nodes.len() - 1) as u32
                }),
            })
            .collect();
        let mut has_scale_up = vec![false; n];
        for l in inv.links.iter().filter(|l| l.kind.is_scale_up() && l.state != LinkState::Down) {
            has_scale_up[l.a.get()] = true;
            has_scale_up[l.b.get()] = true;
        }
        let scale_up = (0..n).map(|i| if has_scale_up[i] { uf.find(i as u32) } else { NONE }).collect();
        Ok(Self { inv, adj_start, adj, parent, parent_link, node_of, nodes, scale_up })
    }

    /// The indexed inventory.
    pub fn inventory(&self) -> &Inventory {
        &self.inv
    }

    /// Gives the inventory back.
    pub fn into_inventory(self) -> Inventory {
        self.inv
    }

    /// The device at an index.
    pub fn device(&self, idx: DeviceIdx) -> &Device {
        self.inv.device(idx)
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.inv.devices.len()
    }

    /// True when there are no devices.
    pub fn is_empty(&self) -> bool {
        self.inv.devices.is_empty()
    }

    /// The link at an index.
    pub fn link(&self, li: usize) -> &Link {
        &self.inv.links[li]
    }

    /// Neighbours of a device with the index of the connecting link.
    pub fn neighbors(&self, idx: DeviceIdx) -> impl Iterator<Item = (DeviceIdx, usize)> + '_ {
        let (s, e) = (self.adj_start[idx.get()] as usize, self.adj_start[idx.get() + 1] as usize);
        self.adj[s..e].iter().map(|&(n, l)| (DeviceIdx(n), l as usize))
    }

    /// The upstream device in the PCI/CXL hierarchy (a host bridge's parent is its CPU).
    pub fn parent(&self, idx: DeviceIdx) -> Option<DeviceIdx> {
        let p = self.parent[idx.get()];
        (p != NONE).then_some(DeviceIdx(p))
    }

    /// The link to the upstream device.
    pub fn parent_link(&self, idx: DeviceIdx) -> Option<usize> {
        let p = self.parent_link[idx.get()];
        (p != NONE).then_some(p as usize)
    }

    /// Devices directly below `idx` in the PCI/CXL hierarchy.
    pub fn children(&self, idx: DeviceIdx) -> impl Iterator<Item = DeviceIdx> + '_ {
        self.neighbors(idx).filter(move |&(n, _)| self.parent(n) == Some(idx)).map(|(n, _)| n)
    }

    /// The CPU (NUMA node) a device hangs off, following the hierarchy up.
    pub fn cpu_of(&self, idx: DeviceIdx) -> Option<DeviceIdx> {
        self.ancestors(idx).find(|&a| self.device(a).kind == DeviceKind::Cpu)
    }

    /// The device and its ancestors, nearest first.
    pub fn ancestors(&self, idx: DeviceIdx) -> impl Iterator<Item = DeviceIdx> + '_ {
        let mut cur = Some(idx);
        let mut steps = 0usize;
        let limit = self.len();
        std::iter::from_fn(move || {
            let c = cur?;
            steps += 1;
            // A malformed inventory could contain a parent cycle; never loop forever.
            cur = if steps > limit { None } else { self.parent(c) };
            Some(c)
        })
    }

    /// Node names, in first-seen order.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// The node index of a device (`None` for fabric-level devices).
    pub(crate) fn node_index(&self, idx: DeviceIdx) -> Option<u32> {
        let n = self.node_of[idx.get()];
        (n != NONE).then_some(n)
    }

    /// The scale-up component of a device.
    pub(crate) fn scale_up_domain(&self, idx: DeviceIdx) -> Option<u32> {
        let s = self.scale_up[idx.get()];
        (s != NONE).then_some(s)
    }

    /// Whether `a` and `b` are in one scale-up domain: joined by NVLink, xGMI, UALink or
    /// NVLink-C2C links that are not down, directly or through switches and other devices
    /// (a Grace CPU's memory and every GPU that reaches its C2C-attached GPUs by NVLink).
    pub fn same_scale_up_domain(&self, a: DeviceIdx, b: DeviceIdx) -> bool {
        self.scale_up_domain(a).is_some_and(|s| self.scale_up_domain(b) == Some(s))
    }

    /// Devices of a kind, in inventory order.
    pub fn devices_of(&self, kind: DeviceKind) -> impl Iterator<Item = DeviceIdx> + '_ {
        self.inv.devices.iter().enumerate().filter(move |(_, d)| d.kind == kind).map(|(i, _)| DeviceIdx(i as u32))
    }

    /// Classifies how `a` reaches `b`, with `nvidia-smi topo -m` semantics on PCI trees.
    pub fn classify(&self, a: DeviceIdx, b: DeviceIdx) -> HopClass {
        if a == b {
            return HopClass::X;
        }
        if let Some(c) = self.scale_up_class(a, b) {
            return c;
        }
        let (na, nb) = (self.node_index(a), self.node_index(b));
        if na.is_some() && nb.is_some() && na != nb {
            let members = self.live_domain_member(a) && self.live_domain_member(b);
            return if members || self.find_hops(a, b).is_some() { HopClass::Net } else { HopClass::None };
        }
        if self.below_cxl(a) || self.below_cxl(b) {
            return HopClass::Cxl;
        }
        self.pci_class(a, b)
    }

    /// Whether the device belongs to a live member of a domain (see [`DOMAIN_NODE_ATTR`]).
    fn live_domain_member(&self, idx: DeviceIdx) -> bool {
        self.device(idx).attrs.get(DOMAIN_NODE_ATTR).is_some_and(|v| v == DOMAIN_NODE_LIVE)
    }

    fn below_cxl(&self, idx: DeviceIdx) -> bool {
        self.ancestors(idx)
            .filter_map(|x| self.parent_link(x))
            .any(|l| matches!(self.link(l).kind, LinkKind::Cxl { .. }))
    }

    /// NVLink/xGMI/UALink/C2C class, if the two are in one scale-up domain.
    fn scale_up_class(&self, a: DeviceIdx, b: DeviceIdx) -> Option<HopClass> {
        let sa = self.scale_up_domain(a)?;
        if self.scale_up_domain(b) != Some(sa) {
            return None;
        }
        let (mut nv_direct, mut xgmi, mut c2c, mut ual_direct) = (0u32, 0u32, false, 0u32);
        // An xGMI link whose count the kernel does not give (count 0, partitioned AMD
        // modes) still makes the pair xGMI peers.
        let mut xgmi_link = false;
        for (n, li) in self.neighbors(a) {
            let l = self.link(li);
            if n != b || l.state == LinkState::Down {
                continue;
            }
            match l.kind {
                LinkKind::NvLink { count, .. } => nv_direct += u32::from(count),
                LinkKind::Xgmi { count } => {
                    xgmi_link = true;
                    xgmi += u32::from(count);
                }
                LinkKind::Ualink { ports, .. } => ual_direct += u32::from(ports),
                LinkKind::C2c => c2c = true,
                _ => {}
            }
        }
        let switched = |x: DeviceIdx, sw: DeviceKind| -> u32 {
            self.neighbors(x)
                .filter(|&(n, li)| self.device(n).kind == sw && self.link(li).state != LinkState::Down)
                .map(|(_, li)| match self.link(li).kind {
                    LinkKind::NvLink { count, .. } => u32::from(count),
                    LinkKind::Ualink { ports, .. } => u32::from(ports),
                    _ => 0,
                })
                .sum()
        };
        let sat = |v: u32| u16::try_from(v).unwrap_or(u16::MAX);
        let nv = nv_direct + switched(a, DeviceKind::NvSwitch).min(switched(b, DeviceKind::NvSwitch));
        if nv > 0 {
            return Some(HopClass::Nv(sat(nv)));
        }
        if xgmi_link {
            return Some(HopClass::Xgmi(sat(xgmi)));
        }
        let ual = ual_direct + switched(a, DeviceKind::UalinkSwitch).min(switched(b, DeviceKind::UalinkSwitch));
        if ual > 0 {
            return Some(HopClass::Ual(sat(ual)));
        }
        c2c.then_some(HopClass::C2c)
    }

    /// PIX/PXB/PHB/NODE/SYS from the PCI hierarchy.
    fn pci_class(&self, a: DeviceIdx, b: DeviceIdx) -> HopClass {
        // Each chain starts at the device itself, so that one device being the other's
        // ancestor gives the same answer both ways round.
        let chain_a: Vec<DeviceIdx> = self.ancestors(a).collect();
        let chain_b: Vec<DeviceIdx> = self.ancestors(b).collect();
        let Some(lca) = chain_a.iter().copied().find(|x| chain_b.contains(x)) else {
            return HopClass::Sys;
        };
        match self.device(lca).kind {
            DeviceKind::Cpu => HopClass::Node,
            DeviceKind::HostBridge => HopClass::Phb,
            _ => {
                // Bridges on the path, with a switch's downstream ports folded into its
                // upstream port: one PCIe switch counts as one bridge, as nvidia-smi does.
                let mut units: Vec<DeviceIdx> = Vec::new();
                for &br in below(&chain_a, lca).iter().chain(below(&chain_b, lca)).chain([&lca]) {
                    let u = self.switch_unit(br);
                    if !units.contains(&u) {
                        units.push(u);
                    }
                }
                if units.len() <= 1 { HopClass::Pix } else { HopClass::Pxb }
            }
        }
    }

    /// The PCIe switch a bridge belongs to: a switch downstream port maps to its upstream
    /// port; root ports and upstream ports map to themselves.
    fn switch_unit(&self, br: DeviceIdx) -> DeviceIdx {
        match self.parent(br) {
            Some(p) if self.bridge_role(p) == BridgeRole::UpstreamPort => p,
            _ => br,
        }
    }

    fn bridge_role(&self, br: DeviceIdx) -> BridgeRole {
        let mut role = BridgeRole::Other;
        // Walk from the top of the chain down, so the role of each bridge follows its parent.
        let chain: Vec<DeviceIdx> = self.ancestors(br).collect();
        for &x in chain.iter().rev() {
            role = match self.device(x).kind {
                DeviceKind::PciBridge | DeviceKind::CxlSwitch => match role {
                    BridgeRole::HostBridge | BridgeRole::Other => BridgeRole::RootPort,
                    BridgeRole::RootPort | BridgeRole::DownstreamPort => BridgeRole::UpstreamPort,
                    BridgeRole::UpstreamPort => BridgeRole::DownstreamPort,
                },
                DeviceKind::HostBridge => BridgeRole::HostBridge,
                _ => BridgeRole::Other,
            };
        }
        role
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BridgeRole {
    HostBridge,
    RootPort,
    UpstreamPort,
    DownstreamPort,
    Other,
}

/// Union-find with path halving, for scale-up components.
struct UnionFind {
    parent: Vec<u32>,
}

impl UnionFind {
    fn new(n: usize) -> Self {
        Self { parent: (0..n as u32).collect() }
    }

    fn find(&mut self, mut x: u32) -> u32 {
        while self.parent[x as usize] != x {
            let gp = self.parent[self.parent[x as usize] as usize];
            self.parent[x as usize] = gp;
            x = gp;
        }
        x
    }

    fn union(&mut self, a: u32, b: u32) {
        let (ra, rb) = (self.find(a), self.find(b));
        if ra != rb {
            self.parent[ra.max(rb) as usize] = ra.min(rb);
        }
    }
}

/// The bridges strictly between a device and `lca` on its `chain` of ancestors (the chain
/// starts at the device itself).
fn below(chain: &[DeviceIdx], lca: DeviceIdx) -> &[DeviceIdx] {
    let to_lca = chain.iter().position(|&x| x == lca).unwrap_or(chain.len());
    chain.get(1..to_lca).unwrap_or_default()
}
