//! `fabricctl devices`: every device with identity, kind, node, name, NUMA node, PCI address,
//! links (count and kinds) and memory.

use std::collections::BTreeMap;
use std::io::{self, Write};

use fabric_proto::topology::kind_name;

use crate::render::{bytes, columns, pad};
use crate::view::View;

const HEADER: [&str; 9] = ["LABEL", "ID", "KIND", "NODE", "NAME", "NUMA", "PCI", "LINKS", "MEMORY"];

/// Renders the device table.
pub fn render(view: &View, w: &mut dyn Write) -> io::Result<()> {
    let f = &view.fabric;
    let rows: Vec<[String; 9]> = view
        .devices()
        .into_iter()
        .map(|i| {
            let d = f.device(i);
            let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
            for (_, li) in f.neighbors(i) {
                *kinds.entry(f.link(li).kind.name()).or_insert(0) += 1;
            }
            let n: usize = kinds.values().sum();
            let links = if n == 0 {
                "0".to_owned()
            } else {
                let k: Vec<String> = kinds.iter().map(|(k, v)| format!("{k}:{v}")).collect();
                format!("{n} ({})", k.join(","))
            };
            let mem = d.memory_bytes();
            [
                view.labels.label(i).unwrap_or("-").to_owned(),
                d.id.to_string(),
                kind_name(d.kind),
                d.node.clone().unwrap_or_else(|| "-".into()),
                d.name.clone().unwrap_or_else(|| "-".into()),
                d.numa_node.map_or_else(|| "N/A".into(), |n| n.to_string()),
                d.pci_address().map_or_else(|| "-".into(), |a| a.to_string()),
                links,
                if mem == 0 { "-".to_owned() } else { bytes(mem) },
            ]
        })
        .collect();
    let mut widths = HEADER.map(columns);
    for r in &rows {
        for (k, c) in r.iter().enumerate() {
            widths[k] = widths[k].max(columns(c));
        }
    }
    let line = |cells: &[&str]| {
        let mut s = String::new();
        for (k, c) in cells.iter().enumerate() {
            if k + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&pad(c, widths[k]));
                s.push_str("  ");
            }
        }
        s
    };
    writeln!(w, "{}", line(&HEADER))?;
    for r in &rows {
        let cells: Vec<&str> = r.iter().map(String::as_str).collect();
        writeln!(w, "{}", line(&cells))?;
    }
    Ok(())
}
