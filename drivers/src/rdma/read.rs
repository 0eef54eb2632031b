//! Reads one RDMA device directory (`…/infiniband/mlx5_0`) into an [`RdmaDevice`], with
//! bounded listings and every attribute parsed strictly; what cannot be read is left
//! unknown and named in a note.

use std::path::Path;

use fabric_topology::{LinkLayer, RdmaDevice, RdmaGid, RdmaPort};

use super::attrs;
use crate::sysfs::{AttrError, list_dir, read_attr};

/// Ports read per device: host adapters have one or two, switches show only port 0.
pub const MAX_PORTS: usize = 32;
/// GID table entries looked at per port (mlx5 RoCE tables have 255, mlx4 IB 128).
pub const MAX_GIDS: usize = 1024;

/// Reads an attribute; a missing one is `None` silently, a bad or unreadable one is `None`
/// with a note (the kernel answers `EINVAL` for some attributes of ports that are down).
fn attr<T>(
    dir: &Path,
    rel: &str,
    parse: impl FnOnce(&str) -> Option<T>,
    who: &str,
    notes: &mut Vec<String>,
) -> Option<T> {
    match read_attr(&dir.join(rel)) {
        Ok(s) => {
            let v = parse(&s);
            if v.is_none() {
                notes.push(format!("{who}: {rel}: invalid value {:?}", s.chars().take(64).collect::<String>()));
            }
            v
        }
        Err(AttrError::Missing { .. }) => None,
        Err(e) => {
            notes.push(format!("{who}: {rel}: unreadable ({})", e.source_kind()));
            None
        }
    }
}

trait SourceKind {
    fn source_kind(&self) -> String;
}

impl SourceKind for AttrError {
    fn source_kind(&self) -> String {
        match self {
            AttrError::Unreadable { source, .. } => source.kind().to_string(),
            AttrError::Invalid { .. } => "not text".to_owned(),
            AttrError::TooLong { .. } => "too long".to_owned(),
            AttrError::Missing { .. } => "missing".to_owned(),
        }
    }
}

/// Numeric entries of a directory (`ports/1`, `gids/17`) in number order, at most `max`;
/// the second value counts entries left out.
fn numbered_entries(dir: &Path, max: usize) -> (Vec<u32>, usize) {
    let mut v: Vec<u32> = list_dir(dir)
        .unwrap_or_default()
        .iter()
        .filter(|n| n.len() <= 5 && n.bytes().all(|b| b.is_ascii_digit()))
        .filter_map(|n| n.parse().ok())
        .collect();
    v.sort_unstable();
    let more = v.len().saturating_sub(max);
    v.truncate(max);
    (v, more)
}

/// Reads the device at `dir` (the real directory, links already resolved), named `name`.
/// `function_netdevs` are the netdevs of its PCI function (`device/net/`), used for a
/// one-port device whose GIDs name none (an InfiniBand port's IPoIB interface).
pub fn device(dir: &Path, name: &str, function_netdevs: &[String], notes: &mut Vec<String>) -> RdmaDevice {
    let mut d = RdmaDevice {
        name: name.to_owned(),
        node_type: attr(dir, "node_type", attrs::node_type, name, notes),
        node_guid: attr(dir, "node_guid", attrs::guid, name, notes).map(|(_, t)| t),
        sys_image_guid: attr(dir, "sys_image_guid", attrs::guid, name, notes).map(|(_, t)| t),
        firmware: attr(dir, "fw_ver", |s| attrs::name(s).filter(|s| s.len() <= 32), name, notes),
        ports: Vec::new(),
        peer_memory: None,
    };
    let (ports, more) = numbered_entries(&dir.join("ports"), MAX_PORTS);
    if more > 0 {
        notes.push(format!("{name}: {more} port(s) beyond the first {MAX_PORTS} not read"));
    }
    for n in ports {
        d.ports.push(port(&dir.join(format!("ports/{n}")), n, &format!("{name} port {n}"), notes));
    }
    if let [p] = d.ports.as_mut_slice()
        && p.netdev.is_none()
        && let [only] = function_netdevs
    {
        p.netdev = Some(only.clone());
    }
    d
}

fn port(dir: &Path, number: u32, who: &str, notes: &mut Vec<String>) -> RdmaPort {
    let rate_text = read_attr(&dir.join("rate")).ok().filter(|s| s.len() <= 64 && s.is_ascii());
    let mut p = RdmaPort {
        number,
        state: attr(dir, "state", attrs::port_state, who, notes),
        phys_state: attr(dir, "phys_state", attrs::phys_state, who, notes),
        rate_mbps: attr(dir, "rate", attrs::rate_mbps, who, notes),
        rate: None,
        link_layer: attr(dir, "link_layer", attrs::link_layer, who, notes),
        lid: None,
        sm_lid: None,
        port_guid: None,
        gids: Vec::new(),
        netdev: None,
    };
    p.rate = rate_text.filter(|_| p.rate_mbps.is_some());
    // LIDs exist only on InfiniBand; RoCE ports show 0x0, which is no LID.
    if p.link_layer != Some(LinkLayer::Ethernet) {
        p.lid = attr(dir, "lid", attrs::lid, who, notes);
        p.sm_lid = attr(dir, "sm_lid", attrs::lid, who, notes);
    }
    let (idx, more) = numbered_entries(&dir.join("gids"), MAX_GIDS);
    if more > 0 {
        notes.push(format!("{who}: {more} GID entries beyond the first {MAX_GIDS} not read"));
    }
    for i in idx {
        let Some((value, text)) = attr(dir, &format!("gids/{i}"), attrs::gid, who, notes) else { continue };
        // An unused slot: all zero on recent kernels, the subnet prefix with a zero interface
        // identifier on older ones (the 32em64t dump's mlx4_0 has 127 such). No port or
        // RoCE address has a zero interface identifier.
        if value as u64 == 0 {
            continue;
        }
        if i == 0 && p.link_layer == Some(LinkLayer::Infiniband) {
            p.port_guid = Some(attrs::gid_interface_id(value));
        }
        // Types and netdevs of unused or IB entries answer EINVAL on recent kernels: no note.
        let kind = read_attr(&dir.join(format!("gid_attrs/types/{i}"))).ok().and_then(|s| attrs::gid_type(&s));
        let netdev = read_attr(&dir.join(format!("gid_attrs/ndevs/{i}"))).ok().and_then(|s| attrs::name(&s));
        p.gids.push(RdmaGid { index: i, gid: text, kind, netdev });
    }
    p.netdev = p.gids.iter().find_map(|g| g.netdev.clone());
    p
}
