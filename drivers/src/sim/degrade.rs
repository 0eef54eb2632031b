//! `[[degraded]]` entries: links trained below capability (a PCIe link at x8, a NIC at
//! 200G), NVLink/UALink bundles with links down, or whole links down. The maximum stays
//! what the link is built for; the current figure drops, so outputs show the fraction left.

use fabric_topology::link::pcie_mbps;
use fabric_topology::{Inventory, Link, LinkKind, LinkState};

use super::build::Placed;
use super::error::Located;
use super::schema::{DegradedLink, DegradedSpec};

fn matches(kind: DegradedLink, l: &LinkKind) -> bool {
    matches!(
        (kind, l),
        (DegradedLink::Pcie, LinkKind::Pcie { .. })
            | (DegradedLink::Cxl, LinkKind::Cxl { .. })
            | (DegradedLink::Nvlink, LinkKind::NvLink { .. })
            | (DegradedLink::Ualink, LinkKind::Ualink { .. })
            | (DegradedLink::Network, LinkKind::Network { .. })
            | (DegradedLink::Xgmi, LinkKind::Xgmi { .. })
            | (DegradedLink::C2c, LinkKind::C2c)
    )
}

/// Scales the current bandwidth to `num/den` of the maximum.
fn scale(l: &mut Link, num: u64, den: u64) {
    if den > 0 {
        l.bandwidth.current_mbps = l.bandwidth.max_mbps.map(|m| m * num / den);
    }
}

/// Applies one entry.
pub(crate) fn apply(spec: &DegradedSpec, placed: &Placed<'_>, inv: &mut Inventory) -> Result<(), Located> {
    let dev = placed
        .resolve(spec.device.get_ref())
        .ok_or_else(|| Located::at(&spec.device, format!("`{}` is not a device", spec.device.get_ref())))?;
    let peer = match &spec.to {
        Some(t) => Some(
            placed.resolve(t.get_ref()).ok_or_else(|| Located::at(t, format!("`{}` is not a device", t.get_ref())))?,
        ),
        None => None,
    };
    let upstream_only = matches!(spec.link, DegradedLink::Pcie | DegradedLink::Cxl);
    let allowed: &[&str] = match spec.link {
        DegradedLink::Pcie => &["width", "gen"],
        DegradedLink::Cxl => &["width"],
        DegradedLink::Nvlink | DegradedLink::Ualink | DegradedLink::Xgmi => &["down"],
        DegradedLink::Network => &["gbps"],
        DegradedLink::C2c => &[],
    };
    let given = [
        ("width", spec.width.as_ref().map(|s| s.span())),
        ("gen", spec.r#gen.as_ref().map(|s| s.span())),
        ("down", spec.down.as_ref().map(|s| s.span())),
        ("gbps", spec.gbps.as_ref().map(|s| s.span())),
    ];
    for (key, span) in given.clone() {
        if let Some(span) = span
            && !allowed.contains(&key)
        {
            return Err(Located::new(span, format!("`{key}` does not apply to a {:?} link", spec.link)));
        }
    }
    if !spec.link_down && given.iter().all(|(_, s)| s.is_none()) {
        return Err(Located::at(&spec.device, "say how the link is degraded (width, gen, down, gbps or link_down)"));
    }
    let mut hit = 0;
    for l in inv.links.iter_mut() {
        let touches = if upstream_only { l.b == dev } else { l.a == dev || l.b == dev };
        if !touches || !matches(spec.link, &l.kind) || peer.is_some_and(|p| l.other(dev) != p) {
            continue;
        }
        hit += 1;
        let mut ratio = None;
        match &mut l.kind {
            LinkKind::Pcie { gen_current, width_current, gen_max, width_max } => {
                if let Some(w) = &spec.width {
                    if width_max.is_some_and(|m| *w.get_ref() > m) || pcie_mbps(1, *w.get_ref()).is_none() {
                        return Err(Located::at(w, "width must be a PCIe width no wider than the link"));
                    }
                    *width_current = Some(*w.get_ref());
                }
                if let Some(g) = &spec.r#gen {
                    if gen_max.is_some_and(|m| *g.get_ref() > m) || pcie_mbps(*g.get_ref(), 1).is_none() {
                        return Err(Located::at(g, "gen must be a PCIe generation no newer than the link"));
                    }
                    *gen_current = Some(*g.get_ref());
                }
                l.bandwidth.current_mbps = gen_current.zip(*width_current).and_then(|(g, w)| pcie_mbps(g, w));
            }
            LinkKind::Cxl { width } => {
                if let Some(w) = &spec.width {
                    let old = width.unwrap_or(0);
                    if *w.get_ref() == 0 || *w.get_ref() > old {
                        return Err(Located::at(w, "width must be at least 1 and no wider than the link"));
                    }
                    *width = Some(*w.get_ref());
                    ratio = Some((u64::from(*w.get_ref()), u64::from(old)));
                }
            }
            LinkKind::NvLink { count, .. } | LinkKind::Xgmi { count } => {
                if let Some(d) = &spec.down {
                    let total = *count;
                    if *d.get_ref() > total {
                        return Err(Located::at(d, format!("only {total} links in the bundle")));
                    }
                    *count = total - d.get_ref();
                    ratio = Some((u64::from(total - d.get_ref()), u64::from(total)));
                }
            }
            LinkKind::Ualink { ports, .. } => {
                if let Some(d) = &spec.down {
                    let total = *ports;
                    if *d.get_ref() > total {
                        return Err(Located::at(d, format!("only {total} ports in the link")));
                    }
                    *ports = total - d.get_ref();
                    ratio = Some((u64::from(total - d.get_ref()), u64::from(total)));
                }
            }
            LinkKind::Network { gbps } => {
                if let Some(g) = &spec.gbps {
                    if *g.get_ref() == 0 || *g.get_ref() > *gbps {
                        return Err(Located::at(g, format!("gbps must be between 1 and the port speed {gbps}")));
                    }
                    *gbps = *g.get_ref();
                    l.bandwidth.current_mbps = Some(u64::from(*g.get_ref()) * 125);
                }
            }
            _ => {}
        }
        if let Some((num, den)) = ratio {
            scale(l, num, den);
        }
        l.state = if spec.link_down || l.bandwidth.current_mbps == Some(0) {
            LinkState::Down
        } else if l.bandwidth.is_degraded() {
            LinkState::Degraded
        } else {
            LinkState::Up
        };
    }
    if hit == 0 {
        return Err(Located::at(
            &spec.device,
            format!("`{}` has no {:?} link to degrade", spec.device.get_ref(), spec.link),
        ));
    }
    Ok(())
}
