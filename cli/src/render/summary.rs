//! The table output for large fabrics: counts, one representative node's matrix, and a hop
//! class histogram over a deterministic sample of device pairs. Linear in the fabric size
//! (plus a bounded number of path queries), so it stays fast on 100,000 GPUs.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};

use fabric_proto::topology::{links_among, summary};
use fabric_topology::{DeviceIdx, HopClass};

use crate::render::matrix::{FULL_MATRIX_LIMIT, write_degraded, write_labels, write_legend, write_matrix};
use crate::view::View;

/// Device pairs classified for the histogram (split between pairs within a node and pairs
/// across nodes); fabrics with fewer pairs are classified exhaustively.
pub const SAMPLE_PAIRS: usize = 2000;
/// Matrix devices of the representative node shown when it has more than the full limit.
pub const PARTIAL_MATRIX: usize = 16;
/// Degraded links listed before the rest are counted.
pub const DEGRADED_LINES: usize = 20;

/// splitmix64: a tiny deterministic generator, so the sample is the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Hop classes of sampled pairs, within a node and across nodes.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Histogram {
    /// Pairs on the same node.
    pub within: BTreeMap<HopClass, usize>,
    /// Pairs on different nodes.
    pub across: BTreeMap<HopClass, usize>,
    /// True when every pair was classified.
    pub exhaustive: bool,
}

/// Classifies a deterministic sample of pairs of `devs`.
pub fn histogram(view: &View, devs: &[(&str, DeviceIdx)]) -> Histogram {
    let f = &view.fabric;
    let node_of = |i: DeviceIdx| f.device(i).node.as_deref();
    let mut h = Histogram::default();
    let record = |h: &mut Histogram, a: DeviceIdx, b: DeviceIdx| {
        let c = f.classify(a, b);
        let m = if node_of(a) == node_of(b) { &mut h.within } else { &mut h.across };
        *m.entry(c).or_insert(0) += 1;
    };
    let n = devs.len();
    if n.saturating_mul(n.saturating_sub(1)) / 2 <= SAMPLE_PAIRS {
        h.exhaustive = true;
        for i in 0..n {
            for j in i + 1..n {
                record(&mut h, devs[i].1, devs[j].1);
            }
        }
        return h;
    }
    let mut groups: HashMap<Option<&str>, Vec<DeviceIdx>> = HashMap::new();
    for &(_, i) in devs {
        groups.entry(node_of(i)).or_default().push(i);
    }
    let multi_node = groups.len() > 1;
    let mut rng = Rng(0x5eed_fab1_c000_0001);
    let half = SAMPLE_PAIRS / 2;
    let mut done = 0;
    for _ in 0..half * 4 {
        if done == half {
            break;
        }
        let a = devs[rng.below(n)].1;
        let g = &groups[&node_of(a)];
        if g.len() < 2 {
            continue;
        }
        let b = g[rng.below(g.len())];
        if a != b {
            record(&mut h, a, b);
            done += 1;
        }
    }
    done = 0;
    for _ in 0..half * 4 {
        if done == half || !multi_node {
            break;
        }
        let (a, b) = (devs[rng.below(n)].1, devs[rng.below(n)].1);
        if node_of(a) != node_of(b) {
            record(&mut h, a, b);
            done += 1;
        }
    }
    h
}

fn write_counts(w: &mut dyn Write, title: &str, m: &BTreeMap<String, usize>) -> io::Result<()> {
    let parts: Vec<String> = m.iter().map(|(k, v)| format!("{k} {v}")).collect();
    writeln!(w, "  {title:<18}{}", if parts.is_empty() { "none".to_owned() } else { parts.join(", ") })
}

fn write_classes(w: &mut dyn Write, title: &str, m: &BTreeMap<HopClass, usize>) -> io::Result<()> {
    let total: usize = m.values().sum();
    if total == 0 {
        return writeln!(w, "  {title:<18}no pairs");
    }
    let parts: Vec<String> = m.iter().map(|(k, v)| format!("{k} {v} ({}%)", (v * 1000 / total + 5) / 10)).collect();
    writeln!(w, "  {title:<18}{} pairs: {}", total, parts.join(", "))
}

/// Renders the summary of a fabric with many matrix devices.
pub fn render(view: &View, devs: &[(&str, DeviceIdx)], w: &mut dyn Write) -> io::Result<()> {
    let f = &view.fabric;
    let devices = view.devices();
    let links = links_among(f, &devices);
    let s = summary(f, &devices, &links);
    writeln!(w, "Fabric summary ({} matrix devices; the full matrix is shown up to {FULL_MATRIX_LIMIT})", devs.len())?;
    writeln!(w)?;
    writeln!(w, "  {:<18}{}", "nodes", s.nodes)?;
    writeln!(w, "  {:<18}{}", "devices", s.devices)?;
    write_counts(w, "devices by kind", &s.devices_by_kind)?;
    writeln!(w, "  {:<18}{}", "links", s.links)?;
    write_counts(w, "links by kind", &s.links_by_kind)?;
    write_counts(w, "links by state", &s.links_by_state)?;
    let domains: Vec<String> = s.scale_up_domains.iter().map(|d| format!("{} x {} devices", d.count, d.size)).collect();
    writeln!(
        w,
        "  {:<18}{}",
        "scale-up domains",
        if domains.is_empty() { "none".to_owned() } else { domains.join(", ") }
    )?;
    let degraded = s.links_by_state.get("degraded").copied().unwrap_or(0);
    let down = s.links_by_state.get("down").copied().unwrap_or(0);
    writeln!(w, "  {:<18}{degraded} degraded, {down} down", "link health")?;

    let h = histogram(view, devs);
    writeln!(w)?;
    let how = if h.exhaustive { "all pairs".to_owned() } else { format!("a fixed sample of {SAMPLE_PAIRS} pairs") };
    writeln!(w, "Hop classes over {how}:")?;
    writeln!(w)?;
    write_classes(w, "within a node", &h.within)?;
    write_classes(w, "across nodes", &h.across)?;

    // One node's matrix: the first node with matrix devices.
    let rep = view.nodes.iter().find(|n| devs.iter().any(|&(_, i)| f.device(i).node.as_deref() == Some(n.as_str())));
    if let Some(rep) = rep {
        let mut shown: Vec<(&str, DeviceIdx)> =
            devs.iter().copied().filter(|&(_, i)| f.device(i).node.as_deref() == Some(rep.as_str())).collect();
        let total = shown.len();
        writeln!(w)?;
        if total > FULL_MATRIX_LIMIT {
            shown.truncate(PARTIAL_MATRIX);
            writeln!(w, "Matrix of node {rep} (first {PARTIAL_MATRIX} of its {total} devices):")?;
        } else {
            writeln!(w, "Matrix of node {rep}:")?;
        }
        writeln!(w)?;
        write_matrix(view, &shown, w)?;
        writeln!(w)?;
        write_legend(w)?;
        writeln!(w)?;
        write_labels(view, &shown, w)?;
    }
    write_degraded(view, devs, DEGRADED_LINES, w)
}
