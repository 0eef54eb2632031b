//! JSON output: the `fabric.topology/v1` and `fabric.devices/v1` documents.

use std::io::{self, Write};

use fabric_proto::{TopologyDoc, TopologyOptions};

use crate::view::View;

/// The topology document of the view.
pub fn topology_doc(view: &View) -> TopologyDoc {
    TopologyDoc::build(&view.fabric, &view.order, &view.labels, &TopologyOptions { node: view.node.clone() })
}

/// Writes the topology document, streaming devices and links.
pub fn render_topology(view: &View, w: &mut dyn Write) -> io::Result<()> {
    let opts = TopologyOptions { node: view.node.clone() };
    fabric_proto::topology::write_topology(&mut *w, &view.fabric, &view.order, &view.labels, &opts)?;
    writeln!(w)
}

/// Writes the devices document.
pub fn render_devices(view: &View, w: &mut dyn Write) -> io::Result<()> {
    fabric_proto::topology::write_devices(&mut *w, &view.fabric, view.node.as_deref())?;
    writeln!(w)
}
