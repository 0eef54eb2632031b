//! The data every renderer works from: the fabric, its devices in the stable order, the
//! matrix labels, and the node the output is restricted to.

use fabric_proto::MatrixLabels;
use fabric_proto::order::{device_order, sorted_nodes};
use fabric_topology::{DeviceId, DeviceIdx, Fabric};

/// Errors building a view or resolving a device name in it.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    /// `--node` names no node of the fabric.
    #[error("no node named {name:?} (nodes: {known})")]
    UnknownNode {
        /// What was asked for.
        name: String,
        /// The first few node names.
        known: String,
    },
    /// A device argument is neither a known id nor a label.
    #[error("no device {0:?} in the fabric")]
    UnknownDevice(String),
    /// The fabric has no node (only fabric-level devices, or nothing at all).
    #[error("the fabric has no node to export")]
    NoNode,
}

impl ViewError {
    /// How to fix it.
    pub fn hint(&self) -> &'static str {
        match self {
            ViewError::UnknownNode { .. } => "pass --node one of the node names listed",
            ViewError::UnknownDevice(_) => {
                "name a device by id (see `fabricctl devices`) or by matrix label (GPU0, NIC1; see `fabricctl topology`)"
            }
            ViewError::NoNode => "check that discovery found devices: `fabricctl devices -v`",
        }
    }
}

/// A fabric prepared for rendering.
#[derive(Debug)]
pub struct View {
    /// The fabric.
    pub fabric: Fabric,
    /// Every device in the stable order.
    pub order: Vec<DeviceIdx>,
    /// Matrix labels over the whole fabric.
    pub labels: MatrixLabels,
    /// Node names in natural order.
    pub nodes: Vec<String>,
    /// The node the output is restricted to.
    pub node: Option<String>,
}

impl View {
    /// Prepares a fabric, checking that `node` (if any) exists.
    pub fn new(fabric: Fabric, node: Option<String>) -> Result<Self, ViewError> {
        let nodes = sorted_nodes(&fabric);
        if let Some(n) = &node
            && !nodes.iter().any(|x| x == n)
        {
            let mut known: Vec<&str> = nodes.iter().take(8).map(String::as_str).collect();
            if nodes.len() > 8 {
                known.push("...");
            }
            let known = if known.is_empty() { "none".to_owned() } else { known.join(", ") };
            return Err(ViewError::UnknownNode { name: n.clone(), known });
        }
        let order = device_order(&fabric);
        let labels = MatrixLabels::from_order(&fabric, &order);
        Ok(Self { fabric, order, labels, nodes, node })
    }

    /// Whether a device is inside the restriction (every device when there is none).
    pub fn in_scope(&self, idx: DeviceIdx) -> bool {
        match &self.node {
            None => true,
            Some(n) => self.fabric.device(idx).node.as_deref() == Some(n.as_str()),
        }
    }

    /// Devices in scope, in the stable order.
    pub fn devices(&self) -> Vec<DeviceIdx> {
        self.order.iter().copied().filter(|&i| self.in_scope(i)).collect()
    }

    /// Matrix devices in scope with their labels, in matrix order.
    pub fn matrix_devices(&self) -> Vec<(&str, DeviceIdx)> {
        self.labels.entries().iter().filter(|(_, i)| self.in_scope(*i)).map(|(l, i)| (l.as_str(), *i)).collect()
    }

    /// The node to export when one is needed: `--node`, else the first node.
    pub fn single_node(&self) -> Result<&str, ViewError> {
        self.node.as_deref().or(self.nodes.first().map(String::as_str)).ok_or(ViewError::NoNode)
    }

    /// Resolves a device argument: a device id or a matrix label.
    pub fn resolve(&self, arg: &str) -> Result<DeviceIdx, ViewError> {
        if let Ok(id) = arg.parse::<DeviceId>()
            && let Some(i) = self.fabric.inventory().find(&id)
        {
            return Ok(i);
        }
        self.labels.find(arg).ok_or_else(|| ViewError::UnknownDevice(arg.to_owned()))
    }

    /// A short name for a device: its label, else its PCI address, else its id.
    pub fn short_name(&self, idx: DeviceIdx) -> String {
        if let Some(l) = self.labels.label(idx) {
            return l.to_owned();
        }
        let d = self.fabric.device(idx);
        match d.pci_address() {
            Some(a) => a.to_string(),
            None => d.id.to_string(),
        }
    }
}
