//! Renderers: each turns a [`View`](crate::view::View) into one output format, writing to
//! an `io::Write` so that large fabrics stream instead of building one huge string.

pub mod devices;
pub mod dot;
pub mod json;
pub mod matrix;
pub mod nccl;
pub mod path;
pub mod summary;
pub mod tree;

use fabric_topology::{Bandwidth, Link, LinkKind};
use unicode_width::UnicodeWidthStr;

/// Terminal columns `s` takes (a CJK character two, a combining mark none), which is
/// neither its bytes nor its characters.
pub fn columns(s: &str) -> usize {
    s.width()
}

/// `s` followed by spaces up to `width` terminal columns (as is when it is wider).
pub fn pad(s: &str, width: usize) -> String {
    format!("{s}{:1$}", "", width.saturating_sub(columns(s)))
}

/// Bandwidth in MB/s as GB/s with one decimal (`63.0 GB/s`).
pub fn gbs(mbps: u64) -> String {
    format!("{} GB/s", gb(mbps))
}

/// MB/s as a GB/s number with one decimal, rounded (`63.0`).
pub fn gb(mbps: u64) -> String {
    let tenths = mbps.saturating_add(50) / 100;
    format!("{}.{}", tenths / 10, tenths % 10)
}

/// Bandwidth as `current` or `current of max (NN%)` when degraded; `?` when unknown.
pub fn bandwidth(bw: &Bandwidth) -> String {
    match (bw.current_mbps, bw.max_mbps) {
        (Some(c), Some(m)) if c < m => format!("{} of {} GB/s ({}%)", gb(c), gb(m), percent(c, m)),
        (Some(c), _) => gbs(c),
        (None, Some(m)) => format!("? of {}", gbs(m)),
        (None, None) => "? GB/s".to_owned(),
    }
}

/// `c / m` as a rounded whole percentage; a link below its capability never shows 100%.
pub fn percent(c: u64, m: u64) -> u64 {
    if m == 0 {
        return 0;
    }
    // In u128: exact for any pair of u64 figures.
    let p = u64::try_from((u128::from(c) * 100 + u128::from(m) / 2) / u128::from(m)).unwrap_or(u64::MAX);
    if c < m { p.min(99) } else { p }
}

/// Bytes in binary units (`80 GiB`, `1.5 TiB`).
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut u = 0;
    let mut v = n as f64;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if (v - v.round()).abs() < 0.05 { format!("{} {}", v.round(), UNITS[u]) } else { format!("{v:.1} {}", UNITS[u]) }
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "?".to_owned(), |v| v.to_string())
}

/// A link's kind and shape (`pcie gen5 x16`, `nvlink4 x18`, `network 400 Gb/s`).
pub fn link_shape(kind: &LinkKind) -> String {
    match *kind {
        LinkKind::Pcie { gen_current, width_current, gen_max, width_max } => {
            let cur = format!("pcie gen{} x{}", opt(gen_current), opt(width_current));
            if (gen_current, width_current) != (gen_max, width_max) && (gen_max.is_some() || width_max.is_some()) {
                format!("{cur} (max gen{} x{})", opt(gen_max), opt(width_max))
            } else {
                cur
            }
        }
        LinkKind::HostAttach => "host".to_owned(),
        LinkKind::Smp => "smp".to_owned(),
        LinkKind::NvLink { generation, count } => format!("nvlink{generation} x{count}"),
        LinkKind::Xgmi { count } => format!("xgmi x{count}"),
        LinkKind::Cxl { width } => format!("cxl x{}", opt(width)),
        LinkKind::Ualink { ports, lanes, gts } => format!("ualink {ports}x{lanes} {gts} GT/s"),
        LinkKind::C2c => "c2c".to_owned(),
        LinkKind::Network { gbps } => format!("network {gbps} Gb/s"),
    }
}

/// A link's shape with its bandwidth and, when not up, its state.
pub fn link_summary(l: &Link) -> String {
    let bw = if l.bandwidth == Bandwidth::default() { String::new() } else { format!(", {}", bandwidth(&l.bandwidth)) };
    let state = match l.state {
        fabric_topology::LinkState::Down => ", DOWN",
        _ => "",
    };
    format!("{}{bw}{state}", link_shape(&l.kind))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_units() {
        assert_eq!(gbs(63_015), "63.0 GB/s");
        assert_eq!(gbs(31_507), "31.5 GB/s");
        assert_eq!(bytes(80 << 30), "80 GiB");
        assert_eq!(bytes(1536 << 30), "1.5 TiB");
        assert_eq!(percent(31_507, 63_015), 50);
        assert_eq!(percent(999, 1000), 99);
        let bw = Bandwidth { current_mbps: Some(31_507), max_mbps: Some(63_015) };
        assert_eq!(bandwidth(&bw), "31.5 of 63.0 GB/s (50%)");
    }

    #[test]
    fn figures_at_the_edge_of_u64_do_not_overflow() {
        assert_eq!(gb(u64::MAX), "18446744073709551.6");
        assert_eq!(percent(u64::MAX / 50, u64::MAX), 2, "exact, not wrapped or a panic");
        assert_eq!(percent(u64::MAX, u64::MAX), 100);
    }
}
