//! Fuzzes the KFD `properties` parser and the grouping of KFD nodes into physical GPUs:
//! the input is split at `%%` lines into property files; a file with `node_to` is an
//! io_link of the node before it, any other file a new node.
#![no_main]

use fabric_drivers::amd::assemble;
use fabric_drivers::amd::kfd::{self, KfdLink, KfdNode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    let mut nodes: Vec<KfdNode> = Vec::new();
    for part in s.split("%%\n").take(64) {
        let Ok(p) = kfd::parse_properties(part) else { continue };
        // What parsed prints back to the same properties.
        let text: String = p.iter().map(|(k, v)| format!("{k} {v}\n")).collect();
        assert_eq!(kfd::parse_properties(&text).as_ref(), Ok(&p));
        for (_, v) in p.iter() {
            let _ = kfd::gfx_target(v);
        }
        match (p.get("node_to"), nodes.last_mut()) {
            (Some(_), Some(n)) => n.io_links.extend(KfdLink::from_properties(&p)),
            _ => {
                let id = u32::try_from(nodes.len()).unwrap_or(u32::MAX);
                let banks = p.get("size_in_bytes").map(|s| (1, s)).into_iter().collect();
                nodes.push(KfdNode { id, props: p, mem_banks: banks, ..KfdNode::default() });
            }
        }
    }
    let mut notes = Vec::new();
    let gpus = assemble::group(nodes, &mut notes);
    let conns = assemble::connect(&gpus);
    for &(a, b) in conns.xgmi.keys() {
        assert!(a < b && b < gpus.len());
    }
    for g in &gpus {
        assert!(!g.nodes.is_empty());
        for (_, n) in &g.nodes {
            let _ = assemble::PhysicalGpu::node_compute_units(n);
            let _ = assemble::PhysicalGpu::node_memory(n);
        }
    }
});
