//! Wire types shared by fabricd, libfabric-mm and fabricctl: the versioned JSON documents
//! that describe a fabric (`fabric.topology/v1`), its devices (`fabric.devices/v1`) and a
//! route between two devices (`fabric.path/v1`), and the domain a daemon's node belongs to
//! (`fabric.domain/v1`, [`domain`]).
//!
//! Documents are built from a [`fabric_topology::Fabric`] and never carry inventory
//! indexes: every reference is a stable [`fabric_topology::DeviceId`]. Devices, links and
//! matrix labels come in a stable order (see [`order`]) that does not depend on the order
//! in which discovery enumerated them. The schema and its compatibility policy are in
//! `docs/topology-json.md`.

pub mod domain;
pub mod order;
pub mod path;
pub mod topology;
pub mod wire;

pub use order::{MatrixLabels, device_order, natural_cmp};
pub use path::{PathDoc, PathHopDoc, PathLinkDoc};
pub use topology::{
    BackendDoc, DeviceDoc, DevicesDoc, LabelDoc, LinkDoc, MatrixDoc, SummaryDoc, TopologyDoc, TopologyOptions,
};

/// Schema name and version of [`TopologyDoc`].
pub const TOPOLOGY_SCHEMA: &str = "fabric.topology/v1";
/// Schema name and version of [`DevicesDoc`].
pub const DEVICES_SCHEMA: &str = "fabric.devices/v1";
/// Schema name and version of [`PathDoc`].
pub const PATH_SCHEMA: &str = "fabric.path/v1";

/// Errors reading a document back.
#[derive(Debug, thiserror::Error)]
pub enum DocError {
    /// The text is not valid JSON for the document type.
    #[error("invalid {schema} document")]
    Parse {
        /// The schema that was expected.
        schema: &'static str,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// The document names another schema or an incompatible major version.
    #[error("document has schema {found:?}, expected {expected:?}")]
    Schema {
        /// What the document says.
        found: String,
        /// What the reader understands.
        expected: &'static str,
    },
}

/// Parses a document and checks its `schema` field. Readers accept any document whose
/// schema name and major version match; unknown fields are ignored (additive changes keep
/// the version).
pub fn parse_doc<T: serde::de::DeserializeOwned + HasSchema>(text: &str) -> Result<T, DocError> {
    let doc: T = serde_json::from_str(text).map_err(|source| DocError::Parse { schema: T::SCHEMA, source })?;
    if doc.schema() != T::SCHEMA {
        return Err(DocError::Schema { found: doc.schema().to_owned(), expected: T::SCHEMA });
    }
    Ok(doc)
}

/// A document with a `schema` field.
pub trait HasSchema {
    /// The schema this type reads and writes.
    const SCHEMA: &'static str;
    /// The schema the document carries.
    fn schema(&self) -> &str;
}
