//! Graphviz DOT: one graph node per device (named by its id), one cluster per fabric node,
//! edges labelled with link kind and bandwidth; degraded links dashed red, down links dotted.

use std::collections::HashMap;
use std::io::{self, Write};

use fabric_topology::{Bandwidth, DeviceIdx, DeviceKind, LinkState};

use crate::render::{bandwidth, link_shape};
use crate::view::View;

/// Quotes a string as a DOT ID.
pub fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn shape(kind: DeviceKind) -> &'static str {
    match kind {
        DeviceKind::Cpu => "box3d",
        DeviceKind::HostBridge | DeviceKind::PciBridge => "ellipse",
        DeviceKind::NvSwitch | DeviceKind::CxlSwitch | DeviceKind::UalinkSwitch | DeviceKind::NetworkSwitch => {
            "hexagon"
        }
        DeviceKind::CxlMemdev | DeviceKind::MemoryNode => "cylinder",
        _ => "box",
    }
}

fn node_stmt(view: &View, idx: DeviceIdx) -> String {
    let d = view.fabric.device(idx);
    let mut label = view.labels.label(idx).unwrap_or_else(|| d.kind.label()).to_owned();
    if let Some(a) = d.pci_address() {
        label.push_str(&format!("\n{a}"));
    } else if view.labels.label(idx).is_none() {
        label.push_str(&format!("\n{}", d.id.as_str().rsplit('/').next().unwrap_or(d.id.as_str())));
    }
    if let Some(n) = &d.name {
        label.push_str(&format!("\n{n}"));
    }
    format!("{} [label={}, shape={}];", quote(d.id.as_str()), quote(&label), shape(d.kind))
}

/// Renders the DOT graph.
pub fn render(view: &View, w: &mut dyn Write) -> io::Result<()> {
    let f = &view.fabric;
    let devices = view.devices();
    writeln!(w, "graph fabric {{")?;
    writeln!(w, "  graph [rankdir=TB, fontname=\"Helvetica\"];")?;
    writeln!(w, "  node [fontname=\"Helvetica\", fontsize=10];")?;
    writeln!(w, "  edge [fontname=\"Helvetica\", fontsize=8];")?;
    let mut by_node: HashMap<&str, Vec<DeviceIdx>> = HashMap::new();
    let mut fabric_level = Vec::new();
    for &i in &devices {
        match f.device(i).node.as_deref() {
            Some(n) => by_node.entry(n).or_default().push(i),
            None => fabric_level.push(i),
        }
    }
    for n in &view.nodes {
        let Some(devs) = by_node.get(n.as_str()) else { continue };
        writeln!(w, "  subgraph {} {{", quote(&format!("cluster_{n}")))?;
        writeln!(w, "    label={};", quote(n))?;
        for &i in devs {
            writeln!(w, "    {}", node_stmt(view, i))?;
        }
        writeln!(w, "  }}")?;
    }
    for &i in &fabric_level {
        writeln!(w, "  {}", node_stmt(view, i))?;
    }
    for li in fabric_proto::topology::links_among(f, &devices) {
        let l = f.link(li);
        let mut label = link_shape(&l.kind);
        if l.bandwidth != Bandwidth::default() {
            label.push_str(&format!("\n{}", bandwidth(&l.bandwidth)));
        }
        let style = match l.state {
            LinkState::Up => String::new(),
            LinkState::Degraded => ", style=dashed, color=red, fontcolor=red".to_owned(),
            LinkState::Down => ", style=dotted, color=gray".to_owned(),
        };
        writeln!(
            w,
            "  {} -- {} [label={}{style}];",
            quote(f.device(l.a).id.as_str()),
            quote(f.device(l.b).id.as_str()),
            quote(&label)
        )?;
    }
    writeln!(w, "}}")
}
