//! Topology queries a runtime needs to place memory: the devices and their memory, from
//! the daemon's devices document.

use fabric_proto::wire::{MemoryClass, Opcode, Request, Response, TopologyRequest};

use crate::error::{Error, Result};
use crate::session::Session;

/// A device and the memory it exposes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Stable identity (`uuid:…`, `serial:…`, `pci:…`, `name:…`).
    pub id: String,
    /// Kind (`gpu`, `cxl_memdev`, `accelerator`, …).
    pub kind: String,
    /// Node (host) name.
    pub node: Option<String>,
    /// Memory resources: class and bytes, in the device's order.
    pub memory: Vec<(MemoryClass, u64)>,
}

fn class(name: &str) -> Option<MemoryClass> {
    Some(match name {
        "hbm" => MemoryClass::Hbm,
        "dram" => MemoryClass::Dram,
        "cxl_volatile" => MemoryClass::CxlVolatile,
        "cxl_persistent" => MemoryClass::CxlPersistent,
        "cxl_dynamic" => MemoryClass::CxlDynamic,
        "host_exported" => MemoryClass::HostExported,
        _ => return None,
    })
}

/// The devices of a `fabric.devices/v1` document (unknown memory kinds are skipped).
pub fn parse_devices(json: &str) -> Result<Vec<DeviceInfo>> {
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| Error::InvalidArgument(format!("devices document is not JSON: {e}")))?;
    let list = v["devices"].as_array().ok_or(Error::Unexpected(Opcode::Devices))?;
    Ok(list
        .iter()
        .filter_map(|d| {
            Some(DeviceInfo {
                id: d["id"].as_str()?.to_owned(),
                kind: d["kind"].as_str().unwrap_or("other").to_owned(),
                node: d["node"].as_str().map(str::to_owned),
                memory: d["memory"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|m| Some((class(m["kind"].as_str()?)?, m["size"].as_u64()?)))
                    .collect(),
            })
        })
        .collect())
}

impl Session {
    /// The devices the daemon shows this session (all nodes).
    pub fn devices(&self) -> Result<Vec<DeviceInfo>> {
        match self.call(Request::Devices(TopologyRequest { node: None }))? {
            Response::Devices(doc) => parse_devices(&doc.json),
            _ => Err(Error::Unexpected(Opcode::Devices)),
        }
    }

    /// The first device with memory of `class`, if any.
    pub fn first_device_with(&self, class: MemoryClass) -> Result<Option<DeviceInfo>> {
        Ok(self.devices()?.into_iter().find(|d| d.memory.iter().any(|(c, _)| *c == class)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_documents_parse_and_unknowns_are_skipped() {
        let json = r#"{"schema":"fabric.devices/v1","devices":[
            {"id":"uuid:GPU-1","kind":"gpu","node":"n0","memory":[{"kind":"hbm","size":80},{"kind":"future","size":1}]},
            {"id":"pci:n0/0000:00:01.0","kind":"pci_bridge","node":"n0","memory":[]},
            {"kind":"gpu"}
        ]}"#;
        let d = parse_devices(json).unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].memory, vec![(MemoryClass::Hbm, 80)]);
        assert_eq!(d[1].node.as_deref(), Some("n0"));
        assert!(parse_devices("not json").is_err());
        assert!(parse_devices("{}").is_err());
    }
}
