//! Simulated fabrics described in TOML (placeholder until the sim backend lands).

use std::path::Path;

use fabric_topology::Inventory;

/// Errors loading a sim fabric.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// Not implemented yet.
    #[error("{0}: sim fabrics are not implemented yet")]
    Unimplemented(String),
}

/// Loads a sim fabric file into an inventory.
pub fn load(path: &Path) -> Result<Inventory, SimError> {
    Err(SimError::Unimplemented(path.display().to_string()))
}
