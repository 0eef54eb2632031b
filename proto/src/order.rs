//! The stable order of devices and the matrix labels (`GPU0`, `NIC3`, ...) derived from it.
//!
//! Discovery order depends on the kernel's enumeration and on backend order, so nothing
//! shown to users may follow it. Devices are ordered by node (natural order of node names,
//! fabric-level devices last), then PCI address (the order CUDA and NVML use with
//! `CUDA_DEVICE_ORDER=PCI_BUS_ID`), then identity in natural order.

use std::cmp::Ordering;
use std::collections::HashMap;

use fabric_topology::{DeviceIdx, DeviceKind, Fabric};

/// Compares strings so that runs of digits compare as numbers (`node2` < `node10`).
/// Ties are broken by plain byte order, so the order is total.
pub fn natural_cmp(a: &str, b: &str) -> Ordering {
    let (ab, bb) = (a.as_bytes(), b.as_bytes());
    let (mut i, mut j) = (0, 0);
    while i < ab.len() && j < bb.len() {
        if ab[i].is_ascii_digit() && bb[j].is_ascii_digit() {
            let (si, sj) = (i, j);
            while i < ab.len() && ab[i].is_ascii_digit() {
                i += 1;
            }
            while j < bb.len() && bb[j].is_ascii_digit() {
                j += 1;
            }
            let na = trim_zeros(&ab[si..i]);
            let nb = trim_zeros(&bb[sj..j]);
            let c = na.len().cmp(&nb.len()).then_with(|| na.cmp(nb));
            if c != Ordering::Equal {
                return c;
            }
        } else {
            let c = ab[i].cmp(&bb[j]);
            if c != Ordering::Equal {
                return c;
            }
            i += 1;
            j += 1;
        }
    }
    (ab.len() - i).cmp(&(bb.len() - j)).then_with(|| a.cmp(b))
}

fn trim_zeros(s: &[u8]) -> &[u8] {
    let n = s.iter().take_while(|&&c| c == b'0').count();
    &s[n.min(s.len().saturating_sub(1))..]
}

/// Node names in natural order.
pub fn sorted_nodes(fabric: &Fabric) -> Vec<String> {
    let mut nodes = fabric.nodes().to_vec();
    nodes.sort_by(|a, b| natural_cmp(a, b));
    nodes
}

/// Every device in the stable order.
pub fn device_order(fabric: &Fabric) -> Vec<DeviceIdx> {
    let nodes = sorted_nodes(fabric);
    let rank: HashMap<&str, usize> = nodes.iter().enumerate().map(|(i, n)| (n.as_str(), i)).collect();
    let mut keyed: Vec<(usize, Option<fabric_topology::PciAddress>, DeviceIdx)> = (0..fabric.len())
        .map(|i| {
            let idx = DeviceIdx(i as u32);
            let d = fabric.device(idx);
            let node_rank = d.node.as_deref().and_then(|n| rank.get(n).copied()).unwrap_or(usize::MAX);
            (node_rank, d.pci_address(), idx)
        })
        .collect();
    keyed.sort_by(|x, y| {
        x.0.cmp(&y.0)
            // Devices with a PCI address first, in address order.
            .then_with(|| match (x.1, y.1) {
                (Some(a), Some(b)) => a.cmp(&b),
                (Some(_), None) => Ordering::Less,
                (None, Some(_)) => Ordering::Greater,
                (None, None) => Ordering::Equal,
            })
            .then_with(|| natural_cmp(fabric.device(x.2).id.as_str(), fabric.device(y.2).id.as_str()))
    });
    keyed.into_iter().map(|k| k.2).collect()
}

/// The kinds shown in the topology matrix, in column-group order.
pub fn is_matrix_kind(kind: DeviceKind) -> bool {
    kind.is_compute() || matches!(kind, DeviceKind::Nic | DeviceKind::CxlMemdev)
}

fn group(kind: DeviceKind) -> u8 {
    match kind {
        DeviceKind::Gpu => 0,
        DeviceKind::Accelerator => 1,
        DeviceKind::Nic => 2,
        _ => 3,
    }
}

/// Labels of the matrix devices (GPUs, accelerators, NICs, CXL memdevs): `GPU0..`, `ACC0..`,
/// `NIC0..`, `CXL0..`, numbered per prefix across the whole fabric in the stable order, so a
/// label names the same device whatever subset of the fabric is shown.
#[derive(Debug, Clone, Default)]
pub struct MatrixLabels {
    entries: Vec<(String, DeviceIdx)>,
    by_label: HashMap<String, usize>,
    by_idx: HashMap<DeviceIdx, usize>,
}

impl MatrixLabels {
    /// Labels every matrix device of the fabric.
    pub fn new(fabric: &Fabric) -> Self {
        Self::from_order(fabric, &device_order(fabric))
    }

    /// Labels from an already computed [`device_order`].
    pub fn from_order(fabric: &Fabric, order: &[DeviceIdx]) -> Self {
        let mut picked: Vec<DeviceIdx> =
            order.iter().copied().filter(|&i| is_matrix_kind(fabric.device(i).kind)).collect();
        // Stable sort keeps the device order within each group.
        picked.sort_by_key(|&i| group(fabric.device(i).kind));
        let mut counters: HashMap<&'static str, usize> = HashMap::new();
        let mut out = Self::default();
        for idx in picked {
            let prefix = fabric.device(idx).kind.label();
            let n = counters.entry(prefix).or_insert(0);
            let label = format!("{prefix}{n}");
            *n += 1;
            out.by_label.insert(label.clone(), out.entries.len());
            out.by_idx.insert(idx, out.entries.len());
            out.entries.push((label, idx));
        }
        out
    }

    /// Labels and devices, in matrix order.
    pub fn entries(&self) -> &[(String, DeviceIdx)] {
        &self.entries
    }

    /// Number of labelled devices.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when the fabric has no matrix device.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The label of a device, if it is a matrix device.
    pub fn label(&self, idx: DeviceIdx) -> Option<&str> {
        self.by_idx.get(&idx).map(|&p| self.entries[p].0.as_str())
    }

    /// The device a label names (case-insensitive).
    pub fn find(&self, label: &str) -> Option<DeviceIdx> {
        self.by_label.get(&label.to_ascii_uppercase()).map(|&p| self.entries[p].1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn natural_order_compares_numbers_by_value() {
        let mut v = vec!["node10", "node2", "node1", "node02", "a", "node"];
        v.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(v, ["a", "node", "node1", "node02", "node2", "node10"]);
        assert_eq!(natural_cmp("x", "x"), Ordering::Equal);
        assert_eq!(natural_cmp("uuid:GPU-9", "uuid:GPU-10"), Ordering::Less);
    }
}
