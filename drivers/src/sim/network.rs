//! The cluster network generator: leaf and spine switches and the cables from every
//! node's rail NICs, either rail-optimized (leaves per rail) or plain leaf/spine.
//!
//! Each leaf has `leaf_radix` ports: half face NICs, half face spines; every leaf has one
//! uplink to each spine. Spines are shared by all rails, so any two NICs are at most
//! leaf-spine-leaf apart.

use fabric_topology::{Device, DeviceId, DeviceIdx, DeviceKind, Inventory, Link, LinkKind};
use toml::Spanned;

use super::build::Placed;
use super::error::Located;
use super::plan::placeholder_link;
use super::schema::{ClusterSpec, NetworkKind, NetworkSpec};

/// Checked shape of a network.
struct Shape {
    nodes: u64,
    rails: u64,
    down: u64,
    spines: u64,
    leaves_per_rail: u64,
    leaves: u64,
}

fn positive(v: &Spanned<i64>, what: &str, max: i64) -> Result<u64, Located> {
    let x = *v.get_ref();
    if (1..=max).contains(&x) {
        Ok(x as u64)
    } else {
        Err(Located::at(v, format!("{what} must be between 1 and {max}, not {x}")))
    }
}

fn shape(net: &NetworkSpec, cluster: &ClusterSpec) -> Result<Shape, Located> {
    let nodes = positive(&cluster.nodes, "nodes", super::r#gen::MAX_COUNT)?;
    let rails = positive(&net.rails, "rails", 64)?;
    let radix = positive(&net.leaf_radix, "leaf_radix", 4096)?;
    if radix < 2 {
        return Err(Located::at(&net.leaf_radix, "leaf_radix must be at least 2"));
    }
    let down = radix / 2;
    let spines = match &net.spines {
        Some(s) => positive(s, "spines", 65_536)?,
        None => down,
    };
    if net.gbps == 0 || net.uplink_gbps == Some(0) {
        return Err(Located::at(&net.rails, "gbps must be at least 1"));
    }
    let (leaves_per_rail, leaves) = match net.kind {
        NetworkKind::RailOptimized => {
            let l = nodes.div_ceil(down);
            (l, l * rails)
        }
        NetworkKind::LeafSpine => {
            let l = (nodes * rails).div_ceil(down);
            (l, l)
        }
    };
    Ok(Shape { nodes, rails, down, spines, leaves_per_rail, leaves })
}

/// Devices and links the network adds.
pub(crate) fn size(net: &NetworkSpec, cluster: &ClusterSpec) -> Result<(u64, u64), Located> {
    let s = shape(net, cluster)?;
    Ok((s.leaves + s.spines, s.nodes * s.rails + s.leaves.saturating_mul(s.spines)))
}

fn switch(name: &str, role: &str, rail: Option<u64>, model: Option<&str>, ports: u64) -> Device {
    let mut d = Device::new(DeviceId::named("fabric", name), DeviceKind::NetworkSwitch, None);
    d.name = Some(model.unwrap_or(name).to_owned());
    d.sources = vec!["sim".to_owned()];
    d.attrs.insert("role".to_owned(), role.to_owned());
    d.attrs.insert("ports".to_owned(), ports.to_string());
    if let Some(r) = rail {
        d.attrs.insert("rail".to_owned(), r.to_string());
    }
    d
}

fn add(inv: &mut Inventory, d: Device, at: &Spanned<i64>) -> Result<DeviceIdx, Located> {
    let expect = inv.devices.len();
    let idx = inv.add_device(d).map_err(|e| Located::at(at, e.to_string()))?;
    if idx.get() != expect {
        return Err(Located::at(at, format!("network switch {} clashes with a fabric switch", inv.device(idx).id)));
    }
    Ok(idx)
}

/// Adds the switches and cables.
pub(crate) fn build(
    net: &NetworkSpec,
    cluster: &ClusterSpec,
    placed: &Placed<'_>,
    inv: &mut Inventory,
) -> Result<(), Located> {
    let s = shape(net, cluster)?;
    let plan = &placed.plans[cluster.template.get_ref().as_str()];
    let mut rail_nic = Vec::with_capacity(s.rails as usize);
    for r in 0..s.rails {
        let nic = plan.rails.iter().find(|&&(x, _)| u64::from(x) == r).map(|&(_, l)| l).ok_or_else(|| {
            Located::at(&net.rails, format!("template {} has no NIC with rail = {r}", cluster.template.get_ref()))
        })?;
        rail_nic.push(nic);
    }
    let radix = s.down * 2;
    let mut leaves = Vec::with_capacity(s.leaves as usize);
    let leaf_model = net.leaf_model.as_deref();
    for k in 0..s.leaves {
        let d = match net.kind {
            NetworkKind::RailOptimized => {
                let (r, x) = (k / s.leaves_per_rail, k % s.leaves_per_rail);
                switch(&format!("leaf-r{r}-{x}"), "leaf", Some(r), leaf_model, radix)
            }
            NetworkKind::LeafSpine => switch(&format!("leaf{k}"), "leaf", None, leaf_model, radix),
        };
        leaves.push(add(inv, d, &net.leaf_radix)?);
    }
    let mut spines = Vec::with_capacity(s.spines as usize);
    for k in 0..s.spines {
        let d = switch(&format!("spine{k}"), "spine", None, net.spine_model.as_deref(), s.leaves);
        spines.push(add(inv, d, &net.leaf_radix)?);
    }
    let nic_link = placeholder_link(LinkKind::Network { gbps: net.gbps }, bw(net.gbps), None);
    let first = placed.nodes.len() - s.nodes as usize;
    for (n, (_, base)) in placed.nodes[first..].iter().enumerate() {
        let n = n as u64;
        for (r, &nic) in rail_nic.iter().enumerate() {
            let r = r as u64;
            let leaf = match net.kind {
                NetworkKind::RailOptimized => r * s.leaves_per_rail + n / s.down,
                NetworkKind::LeafSpine => (n * s.rails + r) / s.down,
            };
            inv.add_link(Link { a: DeviceIdx(base + nic), b: leaves[leaf as usize], ..nic_link.clone() });
        }
    }
    let up = net.uplink_gbps.unwrap_or(net.gbps);
    let up_link = placeholder_link(LinkKind::Network { gbps: up }, bw(up), None);
    for &leaf in &leaves {
        for &spine in &spines {
            inv.add_link(Link { a: leaf, b: spine, ..up_link.clone() });
        }
    }
    Ok(())
}

fn bw(gbps: u32) -> fabric_topology::Bandwidth {
    fabric_topology::Bandwidth::full(u64::from(gbps) * 125)
}
