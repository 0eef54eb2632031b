//! `fabricctl path`: the route between two devices with its links, bottleneck, latency,
//! hop class and degradation.

use std::io::{self, Write};

use fabric_proto::PathDoc;
use fabric_proto::topology::kind_name;

use crate::render::{bandwidth, gbs, link_shape};

/// Renders a path document as text.
pub fn render_table(doc: &PathDoc, w: &mut dyn Write) -> io::Result<()> {
    let name = |h: &fabric_proto::PathHopDoc| match &h.label {
        Some(l) => format!("{l} ({})", h.id),
        None => h.id.to_string(),
    };
    writeln!(w, "path {} -> {}", name(&doc.from), name(&doc.to))?;
    writeln!(w)?;
    writeln!(w, "  class       {}", doc.class)?;
    let bw = match (doc.bandwidth_mbps, doc.max_bandwidth_mbps) {
        (Some(c), Some(m)) => bandwidth(&fabric_topology::Bandwidth { current_mbps: Some(c), max_mbps: Some(m) }),
        (Some(c), None) => gbs(c),
        (None, Some(m)) => format!("? of {}", gbs(m)),
        (None, None) => "unknown".to_owned(),
    };
    writeln!(w, "  bottleneck  {bw}")?;
    writeln!(w, "  latency     {}", doc.latency_ns.map_or_else(|| "unknown".to_owned(), |l| format!("{l} ns")))?;
    writeln!(w, "  hops        {}", doc.hops.len().saturating_sub(1))?;
    writeln!(w, "  degraded    {}", if doc.degraded { "yes" } else { "no" })?;
    writeln!(w)?;
    for (k, h) in doc.hops.iter().enumerate() {
        let label = h.label.as_deref().map(|l| format!(" {l}")).unwrap_or_default();
        let nm = h.name.as_deref().map(|n| format!(" \"{n}\"")).unwrap_or_default();
        writeln!(w, "  [{k}] {}{label} {}{nm}", h.id, kind_name(h.kind))?;
        if let Some(l) = doc.links.get(k) {
            let lat = l.latency_ns.map(|n| format!(", {n} ns")).unwrap_or_default();
            let state = match l.state {
                fabric_topology::LinkState::Up => "",
                fabric_topology::LinkState::Degraded => " DEGRADED",
                fabric_topology::LinkState::Down => " DOWN",
            };
            writeln!(w, "       | {}, {}{lat}{state}", link_shape(&l.kind), bandwidth(&l.bandwidth))?;
        }
    }
    Ok(())
}

/// Renders a path document as JSON.
pub fn render_json(doc: &PathDoc, w: &mut dyn Write) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *w, doc)?;
    writeln!(w)
}
