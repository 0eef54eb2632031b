//! An hwloc-like indented tree: per node, CPU → host bridge → bridges → endpoints with link
//! shape, bandwidth and memory; devices outside the PCI tree; fabric-level switches. Large
//! fabrics print the first node in full and summarise the others by their makeup.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};

use fabric_proto::topology::kind_name;
use fabric_topology::{Bandwidth, DeviceIdx, DeviceKind, LinkKind, MemoryKind};

use crate::render::{bytes, link_summary};
use crate::view::View;

/// Above this many devices in scope, only the first node is printed in full.
pub const TREE_FULL_LIMIT: usize = 2000;
/// Above this many fabric-level devices, they are counted instead of listed.
pub const FABRIC_LIST_LIMIT: usize = 64;

fn memory_name(k: MemoryKind) -> &'static str {
    match k {
        MemoryKind::Hbm => "HBM",
        MemoryKind::Dram => "DRAM",
        MemoryKind::CxlVolatile => "CXL ram",
        MemoryKind::CxlPersistent => "CXL pmem",
        MemoryKind::CxlDynamic => "CXL dynamic",
        MemoryKind::HostExported => "exported",
    }
}

struct Tree<'a> {
    view: &'a View,
    pos: Vec<u32>,
    seen: Vec<bool>,
}

impl<'a> Tree<'a> {
    fn new(view: &'a View) -> Self {
        let mut pos = vec![u32::MAX; view.fabric.len()];
        for (p, &i) in view.order.iter().enumerate() {
            pos[i.get()] = p as u32;
        }
        Self { view, pos, seen: vec![false; view.fabric.len()] }
    }

    fn line(&self, idx: DeviceIdx) -> String {
        let f = &self.view.fabric;
        let d = f.device(idx);
        let tag = self.view.labels.label(idx).unwrap_or_else(|| d.kind.label());
        let ident = d.pci_address().map_or_else(|| d.id.to_string(), |a| a.to_string());
        let mut s = format!("{tag} {ident}");
        if let Some(n) = &d.name {
            s.push_str(&format!(" \"{n}\""));
        }
        if let Some(li) = f.parent_link(idx) {
            let l = f.link(li);
            if !(l.kind == LinkKind::HostAttach && l.bandwidth == Bandwidth::default()) {
                s.push_str(&format!(" [{}]", link_summary(l)));
            }
        }
        if matches!(d.kind, DeviceKind::Cpu | DeviceKind::MemoryNode) {
            if let Some(n) = d.numa_node {
                s.push_str(&format!(" numa {n}"));
            }
            if let Some(c) = &d.local_cpus {
                s.push_str(&format!(" cpus {c}"));
            }
        }
        if let Some(m) = &d.numa_memory {
            s.push_str(&numa_memory_summary(m));
        }
        for r in &d.rdma {
            s.push_str(&rdma_summary(r));
        }
        let mut mem: BTreeMap<MemoryKind, u64> = BTreeMap::new();
        for m in &d.memory {
            let e = mem.entry(m.kind).or_insert(0);
            *e = e.saturating_add(m.size);
        }
        for (k, v) in mem {
            s.push_str(&format!(" {} {}", memory_name(k), bytes(v)));
        }
        let mut peers: BTreeMap<&str, (usize, u32)> = BTreeMap::new();
        for (_, li) in f.neighbors(idx) {
            let l = f.link(li);
            if l.kind.is_hierarchical() {
                continue;
            }
            let e = peers.entry(l.kind.name()).or_insert((0, 0));
            e.0 += 1;
            e.1 += match l.kind {
                LinkKind::NvLink { count, .. } | LinkKind::Xgmi { count } => u32::from(count),
                LinkKind::Ualink { ports, .. } => u32::from(ports),
                _ => 0,
            };
        }
        for (k, (n, units)) in peers {
            let peers = if n == 1 { "1 peer".to_owned() } else { format!("{n} peers") };
            if units > 0 {
                s.push_str(&format!(" {{{k} to {peers}, {units} links}}"));
            } else {
                s.push_str(&format!(" {{{k} to {peers}}}"));
            }
        }
        s
    }

    fn subtree(&mut self, idx: DeviceIdx, depth: usize, w: &mut dyn Write) -> io::Result<()> {
        if self.seen[idx.get()] {
            return Ok(());
        }
        self.seen[idx.get()] = true;
        writeln!(w, "{:indent$}{}", "", self.line(idx), indent = depth * 2)?;
        let f = &self.view.fabric;
        let own = f.device(idx).node.is_some();
        // Below a node's port, a device of no node (a CXL device of a pool several hosts
        // share) is the fabric's: its hierarchy has one parent, but every host's port
        // names it, and it is shown whole with the fabric-level devices — or here, the
        // first time, when one node is shown (`--node`: no fabric-level list).
        let whole_here = self.view.node.is_some();
        let shared = f.neighbors(idx).filter(|&(n, li)| {
            let l = f.link(li);
            own && l.a == idx && l.kind.is_hierarchical() && f.device(n).node.is_none()
        });
        let mut kids: Vec<DeviceIdx> = f.children(idx).chain(shared.map(|(n, _)| n)).collect();
        kids.sort_by_key(|k| self.pos[k.get()]);
        kids.dedup();
        for k in kids {
            if own && f.device(k).node.is_none() && !whole_here {
                let d = f.device(k);
                let tag = self.view.labels.label(k).unwrap_or_else(|| d.kind.label());
                writeln!(
                    w,
                    "{:indent$}{tag} {} (shared: with the fabric-level devices)",
                    "",
                    d.id,
                    indent = (depth + 1) * 2
                )?;
                continue;
            }
            self.subtree(k, depth + 1, w)?;
        }
        Ok(())
    }

    fn node(&mut self, name: &str, devs: &[DeviceIdx], w: &mut dyn Write) -> io::Result<()> {
        writeln!(w, "node {name}")?;
        let f = &self.view.fabric;
        for &i in devs.iter().filter(|&&i| f.device(i).kind == DeviceKind::Cpu) {
            self.subtree(i, 1, w)?;
        }
        // Memory-only nodes hang off no PCI tree: they are the node's memory, listed next.
        let memory: Vec<DeviceIdx> = devs
            .iter()
            .copied()
            .filter(|&i| f.device(i).kind == DeviceKind::MemoryNode && !self.seen[i.get()])
            .collect();
        for i in memory {
            self.subtree(i, 1, w)?;
        }
        let orphans: Vec<DeviceIdx> = devs
            .iter()
            .copied()
            .filter(|&i| !self.seen[i.get()])
            .filter(|&i| f.parent(i).is_none_or(|p| f.device(p).node.as_deref() != Some(name)))
            .collect();
        if !orphans.is_empty() {
            writeln!(w, "  outside the PCI tree:")?;
            for i in orphans {
                self.subtree(i, 2, w)?;
            }
        }
        Ok(())
    }
}

/// ` origin cxl tier 22 hmat 20000/15000 MB/s 400/450 ns from 0 cache 4.0 GiB`: what the
/// kernel says about a NUMA node's memory (HMAT: access class 1, else 0; read/write).
/// ` rdma mlx5_0 port1 active/link_up 400 Gb/s infiniband roce_v2 eth0`: an RDMA device's
/// ports, each with what the kernel says (unknown parts left out).
fn rdma_summary(r: &fabric_topology::rdma::RdmaDevice) -> String {
    let mut s = format!(" rdma {}", r.name);
    for p in &r.ports {
        s.push_str(&format!(" port{}", p.number));
        let state = p.state.map(|x| format!("{x:?}"));
        let phys = p.phys_state.map(|x| format!("{x:?}"));
        match (state, phys) {
            (Some(a), Some(b)) => s.push_str(&format!(" {}/{}", a.to_lowercase(), b.to_lowercase())),
            (Some(a), None) | (None, Some(a)) => s.push_str(&format!(" {}", a.to_lowercase())),
            (None, None) => {}
        }
        if let Some(m) = p.rate_mbps {
            s.push_str(&format!(" {} Gb/s", m / 1000));
        }
        if let Some(l) = p.link_layer {
            s.push_str(match l {
                fabric_topology::rdma::LinkLayer::Infiniband => " infiniband",
                fabric_topology::rdma::LinkLayer::Ethernet => " ethernet",
            });
        }
        if p.gids.iter().any(|g| g.kind == Some(fabric_topology::rdma::GidType::RoceV2)) {
            s.push_str(" roce_v2");
        }
        if let Some(n) = &p.netdev {
            s.push_str(&format!(" {n}"));
        }
    }
    if let Some(pm) = &r.peer_memory {
        s.push_str(&format!(" gpudirect {pm}"));
    }
    s
}

fn numa_memory_summary(m: &fabric_topology::NumaMemoryInfo) -> String {
    let mut s = String::new();
    if m.memory_only {
        s.push_str(&format!(" origin {}", m.origin.name()));
    }
    if let Some(t) = m.tier {
        s.push_str(&format!(" tier {t}"));
    }
    let opt = |v: Option<u64>| v.map_or_else(|| "?".to_owned(), |v| v.to_string());
    if let Some(a) = m.access.iter().find(|a| a.class == 1).or_else(|| m.access.first()) {
        let from: Vec<String> = a.initiators.iter().map(u32::to_string).collect();
        s.push_str(&format!(
            " hmat {}/{} MB/s {}/{} ns from {}",
            opt(a.read_bandwidth_mbps),
            opt(a.write_bandwidth_mbps),
            opt(a.read_latency_ns),
            opt(a.write_latency_ns),
            if from.is_empty() { "?".to_owned() } else { from.join(",") }
        ));
    }
    for c in &m.caches {
        s.push_str(&format!(" cache{} {}", c.level, c.size.map_or_else(|| "?".to_owned(), bytes)));
    }
    s
}

fn makeup(view: &View, devs: &[DeviceIdx]) -> String {
    let mut m: BTreeMap<DeviceKind, usize> = BTreeMap::new();
    for &i in devs {
        *m.entry(view.fabric.device(i).kind).or_insert(0) += 1;
    }
    m.iter().map(|(k, v)| format!("{v} {}", kind_name(*k))).collect::<Vec<_>>().join(", ")
}

/// Renders the tree.
pub fn render(view: &View, w: &mut dyn Write) -> io::Result<()> {
    let f = &view.fabric;
    let all = view.devices();
    let mut by_node: HashMap<&str, Vec<DeviceIdx>> = HashMap::new();
    let mut fabric_level = Vec::new();
    for &i in &all {
        match f.device(i).node.as_deref() {
            Some(n) => by_node.entry(n).or_default().push(i),
            None => fabric_level.push(i),
        }
    }
    let nodes: Vec<&str> = view.nodes.iter().map(String::as_str).filter(|n| by_node.contains_key(n)).collect();
    let mut tree = Tree::new(view);
    let full = all.len() <= TREE_FULL_LIMIT || nodes.len() <= 1;
    let shown = if full { nodes.len() } else { 1 };
    for (k, n) in nodes.iter().take(shown).enumerate() {
        if k > 0 {
            writeln!(w)?;
        }
        tree.node(n, &by_node[n], w)?;
    }
    if shown < nodes.len() {
        // Group the other nodes by their makeup, largest groups first.
        let mut groups: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        for n in &nodes[shown..] {
            groups.entry(makeup(view, &by_node[n])).or_default().push(n);
        }
        let mut groups: Vec<(String, Vec<&str>)> = groups.into_iter().collect();
        groups.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then_with(|| a.0.cmp(&b.0)));
        writeln!(w)?;
        writeln!(w, "{} more nodes (not expanded; use --node NAME for one of them):", nodes.len() - shown)?;
        for (m, ns) in groups {
            let range = if ns.len() == 1 { ns[0].to_owned() } else { format!("{} .. {}", ns[0], ns[ns.len() - 1]) };
            writeln!(w, "  {} nodes ({range}), each: {m}", ns.len())?;
        }
    }
    if !fabric_level.is_empty() {
        writeln!(w)?;
        writeln!(w, "fabric-level devices ({}):", fabric_level.len())?;
        if fabric_level.len() <= FABRIC_LIST_LIMIT {
            for i in fabric_level {
                tree.subtree(i, 1, w)?;
            }
        } else {
            let mut links: BTreeMap<&str, usize> = BTreeMap::new();
            for &i in &fabric_level {
                for (_, li) in f.neighbors(i) {
                    *links.entry(f.link(li).kind.name()).or_insert(0) += 1;
                }
            }
            writeln!(w, "  {}", makeup(view, &fabric_level))?;
            let l: Vec<String> = links.iter().map(|(k, v)| format!("{v} {k}")).collect();
            writeln!(w, "  link ends: {}", l.join(", "))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use fabric_topology::rdma::{GidType, LinkLayer, PhysState, PortState, RdmaDevice, RdmaGid, RdmaPort};

    use super::rdma_summary;

    #[test]
    fn rdma_ports_are_summarised_with_what_is_known() {
        let port = |number, state, phys, rate, layer, v2: bool, netdev: Option<&str>| RdmaPort {
            number,
            state,
            phys_state: phys,
            rate_mbps: rate,
            rate: None,
            link_layer: layer,
            lid: None,
            sm_lid: None,
            port_guid: None,
            gids: if v2 {
                vec![RdmaGid { index: 1, gid: "::ffff:10.0.0.1".into(), kind: Some(GidType::RoceV2), netdev: None }]
            } else {
                Vec::new()
            },
            netdev: netdev.map(str::to_owned),
        };
        let r = RdmaDevice {
            name: "mlx5_0".into(),
            node_type: None,
            node_guid: None,
            sys_image_guid: None,
            firmware: None,
            ports: vec![
                port(
                    1,
                    Some(PortState::Active),
                    Some(PhysState::LinkUp),
                    Some(400_000),
                    Some(LinkLayer::Ethernet),
                    true,
                    Some("eth0"),
                ),
                port(2, Some(PortState::Down), None, None, None, false, None),
            ],
            peer_memory: None,
        };
        assert_eq!(rdma_summary(&r), " rdma mlx5_0 port1 active/linkup 400 Gb/s ethernet roce_v2 eth0 port2 down");
    }
}
