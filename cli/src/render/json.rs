//! JSON output: the `fabric.topology/v1` and `fabric.devices/v1` documents.

use std::io::{self, Write};

use fabric_proto::{DevicesDoc, TopologyDoc, TopologyOptions};

use crate::view::View;

/// The topology document of the view.
pub fn topology_doc(view: &View) -> TopologyDoc {
    TopologyDoc::build(&view.fabric, &view.order, &view.labels, &TopologyOptions { node: view.node.clone() })
}

/// Writes the topology document.
pub fn render_topology(view: &View, w: &mut dyn Write) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *w, &topology_doc(view))?;
    writeln!(w)
}

/// Writes the devices document.
pub fn render_devices(view: &View, w: &mut dyn Write) -> io::Result<()> {
    let doc = DevicesDoc::from_fabric(&view.fabric, view.node.as_deref());
    serde_json::to_writer_pretty(&mut *w, &doc)?;
    writeln!(w)
}
