//! The `nvidia-smi topo -m`-style matrix: hop classes between GPUs/accelerators, NICs and
//! CXL memdevs, CPU and NUMA affinity, the legend, the label key and degraded links.

use std::collections::HashMap;
use std::io::{self, Write};

use fabric_topology::{BackendState, DOMAIN_NODE_ATTR, DOMAIN_NODE_DOWN, DeviceIdx, DeviceKind, HopClass, LinkState};

use crate::render::{bandwidth, summary};
use crate::view::View;

/// Up to this many matrix devices the full matrix is printed; above it, a summary.
pub const FULL_MATRIX_LIMIT: usize = 32;

/// Renders the matrix (or, for large fabrics, the summary).
pub fn render(view: &View, w: &mut dyn Write) -> io::Result<()> {
    let devs = view.matrix_devices();
    if devs.is_empty() {
        writeln!(w, "No GPU, accelerator, NIC or CXL memory device found ({} devices in all).", view.devices().len())?;
        writeln!(w, "Use `-o tree` to see the whole hierarchy.")?;
        return write_backend_notes(view, w);
    }
    if devs.len() > FULL_MATRIX_LIMIT {
        summary::render(view, &devs, w)?;
        return write_backend_notes(view, w);
    }
    write_matrix(view, &devs, w)?;
    writeln!(w)?;
    write_legend(w)?;
    writeln!(w)?;
    write_labels(view, &devs, w)?;
    write_degraded(view, &devs, usize::MAX, w)?;
    write_backend_notes(view, w)
}

/// Backends that were not present or failed, so that a missing device has an explanation.
pub fn write_backend_notes(view: &View, w: &mut dyn Write) -> io::Result<()> {
    let notes: Vec<String> = view
        .fabric
        .inventory()
        .backends
        .iter()
        .filter_map(|b| match &b.state {
            BackendState::Present => None,
            BackendState::NotPresent(why) => Some(format!("  {}: not present ({why})", b.backend)),
            BackendState::Failed(why) => Some(format!("  {}: failed ({why})", b.backend)),
        })
        .collect();
    if notes.is_empty() {
        return Ok(());
    }
    writeln!(w)?;
    writeln!(w, "Discovery:")?;
    writeln!(w)?;
    for n in notes {
        writeln!(w, "{n}")?;
    }
    Ok(())
}

/// The CPUs local to a device: its own, else those of the CPU it hangs off; none for a
/// device of no node (a fabric-level one, such as a CXL device hosts share: its hierarchy
/// parent is one host's of several).
pub fn cpu_affinity(view: &View, idx: DeviceIdx) -> Option<String> {
    let d = view.fabric.device(idx);
    d.node.as_ref()?;
    d.local_cpus
        .as_ref()
        .filter(|c| !c.is_empty())
        .or_else(|| view.fabric.cpu_of(idx).and_then(|c| view.fabric.device(c).local_cpus.as_ref()))
        .map(ToString::to_string)
}

/// The NUMA node of a device: its own, else that of the CPU it hangs off; none for a
/// device of no node (as [`cpu_affinity`]).
pub fn numa_affinity(view: &View, idx: DeviceIdx) -> Option<u32> {
    let d = view.fabric.device(idx);
    d.node.as_ref()?;
    d.numa_node.or_else(|| view.fabric.cpu_of(idx).and_then(|c| view.fabric.device(c).numa_node))
}

/// The class grid with affinity columns.
pub fn write_matrix(view: &View, devs: &[(&str, DeviceIdx)], w: &mut dyn Write) -> io::Result<()> {
    let cells: Vec<Vec<String>> = devs
        .iter()
        .map(|&(_, a)| devs.iter().map(|&(_, b)| view.fabric.classify(a, b).to_string()).collect())
        .collect();
    let first = devs.iter().map(|(l, _)| l.len()).max().unwrap_or(0) + 2;
    let widths: Vec<usize> = (0..devs.len())
        .map(|j| cells.iter().map(|r| r[j].len()).chain([devs[j].0.len()]).max().unwrap_or(0) + 2)
        .collect();
    let cpu: Vec<String> = devs.iter().map(|&(_, i)| cpu_affinity(view, i).unwrap_or_else(|| "N/A".into())).collect();
    let cpu_w = cpu.iter().map(String::len).chain(["CPU Affinity".len()]).max().unwrap_or(0) + 2;
    let mut line = format!("{:first$}", "");
    for (j, (l, _)) in devs.iter().enumerate() {
        line.push_str(&format!("{l:w$}", w = widths[j]));
    }
    line.push_str(&format!("{:cpu_w$}NUMA Affinity", "CPU Affinity"));
    writeln!(w, "{}", line.trim_end())?;
    for (i, (l, idx)) in devs.iter().enumerate() {
        let mut line = format!("{l:first$}");
        for (j, c) in cells[i].iter().enumerate() {
            line.push_str(&format!("{c:w$}", w = widths[j]));
        }
        let numa = numa_affinity(view, *idx).map_or_else(|| "N/A".to_owned(), |n| n.to_string());
        line.push_str(&format!("{:cpu_w$}{numa}", cpu[i]));
        writeln!(w, "{line}")?;
    }
    Ok(())
}

/// The legend of hop classes.
pub fn write_legend(w: &mut dyn Write) -> io::Result<()> {
    writeln!(w, "Legend:")?;
    writeln!(w)?;
    for (k, v) in HopClass::LEGEND {
        writeln!(w, "  {k:<5} = {v}")?;
    }
    Ok(())
}

/// The label key: label, identity and name.
pub fn write_labels(view: &View, devs: &[(&str, DeviceIdx)], w: &mut dyn Write) -> io::Result<()> {
    writeln!(w, "Labels:")?;
    writeln!(w)?;
    let lw = devs.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    let iw = devs.iter().map(|&(_, i)| view.fabric.device(i).id.as_str().len()).max().unwrap_or(0);
    for &(l, i) in devs {
        let d = view.fabric.device(i);
        let mut extra = d.name.clone().unwrap_or_default();
        // A domain's fabric: which node, and whether it is down.
        if let (Some(node), Some(state)) = (&d.node, d.attrs.get(DOMAIN_NODE_ATTR)) {
            let down = if state == DOMAIN_NODE_DOWN { " (down)" } else { "" };
            extra = if extra.is_empty() { format!("{node}{down}") } else { format!("{node}{down}, {extra}") };
        }
        if d.kind == DeviceKind::Nic
            && let Some(ib) = nic_port_name(d)
        {
            extra = if extra.is_empty() { ib.to_owned() } else { format!("{ib}, {extra}") };
        }
        writeln!(w, "  {l:lw$}  {:iw$}  {extra}", d.id.as_str())?;
    }
    Ok(())
}

/// The RDMA or network interface name a NIC backend recorded, if any.
pub fn nic_port_name(d: &fabric_topology::Device) -> Option<&str> {
    ["ib_device", "rdma_device", "netdev", "ifname"].iter().find_map(|k| d.attrs.get(*k)).map(String::as_str)
}

/// Links in scope that are degraded or down, each with the matrix labels whose routes to the
/// host cross it (or that are one of its ends), the worst first by label order.
pub fn degraded_lines(view: &View, devs: &[(&str, DeviceIdx)]) -> Vec<String> {
    let f = &view.fabric;
    let mut labels_of: HashMap<usize, Vec<&str>> = HashMap::new();
    let mut first_pos: HashMap<usize, usize> = HashMap::new();
    for (pos, &(label, idx)) in devs.iter().enumerate() {
        let up = f.ancestors(idx).filter_map(|a| f.parent_link(a));
        let own = f.neighbors(idx).map(|(_, li)| li).filter(|&li| !f.link(li).kind.is_hierarchical());
        for li in up.chain(own) {
            if f.link(li).state != LinkState::Up {
                let v = labels_of.entry(li).or_default();
                if !v.contains(&label) {
                    v.push(label);
                }
                first_pos.entry(li).or_insert(pos);
            }
        }
    }
    // The links of a domain node that is down are all down: the labels say the node is.
    let node_down = |i: DeviceIdx| f.device(i).attrs.get(DOMAIN_NODE_ATTR).is_some_and(|s| s == DOMAIN_NODE_DOWN);
    let mut bad: Vec<usize> = f
        .inventory()
        .links
        .iter()
        .enumerate()
        .filter(|(_, l)| l.state != LinkState::Up && (view.in_scope(l.a) || view.in_scope(l.b)))
        .filter(|(_, l)| !node_down(l.a) && !node_down(l.b))
        .map(|(li, _)| li)
        .collect();
    bad.sort_by_key(|li| (first_pos.get(li).copied().unwrap_or(usize::MAX), *li));
    bad.into_iter()
        .map(|li| {
            let l = f.link(li);
            let who = labels_of.get(&li).map_or_else(|| "-".to_owned(), |v| v.join(","));
            let state = if l.state == LinkState::Down { "down".to_owned() } else { bandwidth(&l.bandwidth) };
            format!("{who} {} link {} -> {}: {state}", l.kind.name(), end_name(view, l.a), end_name(view, l.b))
        })
        .collect()
}

fn end_name(view: &View, idx: DeviceIdx) -> String {
    let d = view.fabric.device(idx);
    d.pci_address().map_or_else(|| d.id.to_string(), |a| a.to_string())
}

/// The degraded-links section (at most `limit` lines).
pub fn write_degraded(view: &View, devs: &[(&str, DeviceIdx)], limit: usize, w: &mut dyn Write) -> io::Result<()> {
    let lines = degraded_lines(view, devs);
    writeln!(w)?;
    if lines.is_empty() {
        return writeln!(w, "Degraded links: none");
    }
    writeln!(w, "Degraded links ({}):", lines.len())?;
    writeln!(w)?;
    for l in lines.iter().take(limit) {
        writeln!(w, "  {l}")?;
    }
    if lines.len() > limit {
        writeln!(w, "  ... and {} more", lines.len() - limit)?;
    }
    Ok(())
}
