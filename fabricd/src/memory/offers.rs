//! Which memory backs each resource's regions, saved at every start in `offers.record`
//! (the checksummed whole-file frame of [`fabric_addrmap::durable`], magic `FBRCOFFR`,
//! JSON). A journaled region names its resource by (device, kind, ordinal) only, and an
//! ordinal is a position: a BAR dropped from `memory.bars` moves the next one of its
//! function into its place, and a resource that served a file per region may serve a BAR
//! after a configuration change. At start a region whose resource's memory is not what
//! it was when the record was saved is dropped, never restored onto another tenant's
//! bytes; then the record is saved again, before anything is allocated. Decoding is
//! total: a value or a typed [`HoldsError`].

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::State;
use super::backings::Offer;
use super::durable::ResourceKey;
use super::holds::HoldsError;

/// The file's name in the memory root.
pub const FILE: &str = "offers.record";
/// File magic.
pub const MAGIC: [u8; 8] = *b"FBRCOFFR";
/// Largest payload accepted.
const MAX_PAYLOAD: u64 = 16 << 20;
/// Most resources a record may list.
pub const MAX_OFFERS: usize = 1 << 16;

/// What backs one resource's regions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Memory {
    /// A file per region in the resource's directory.
    Files,
    /// Ranges of a device file (a BAR's `resourceN`).
    Device {
        /// The configured name (`0000:00:05.0/2`).
        name: String,
        /// The file.
        path: PathBuf,
        /// Offset in the resource of the file's first byte.
        start: u64,
    },
    /// A tmpfs file per region, its pages bound to a NUMA node.
    Node {
        /// The node.
        node: u32,
    },
    /// Only its driver allocates it.
    Driver,
}

impl Memory {
    fn of(offer: &Offer) -> Self {
        match offer {
            Offer::Files => Memory::Files,
            Offer::Device(b) => Memory::Device { name: b.name.clone(), path: b.path.clone(), start: b.start },
            Offer::Node(n) => Memory::Node { node: n.node },
            Offer::Driver => Memory::Driver,
        }
    }
}

/// One resource and what backs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedOffer {
    /// The resource, as region records name it.
    pub resource: ResourceKey,
    /// What backs its regions.
    pub memory: Memory,
}

/// The record's bytes.
pub fn encode(offers: &[SavedOffer]) -> Vec<u8> {
    super::holds::encode_json(&MAGIC, 1, offers)
}

/// The offers in `bytes`, checked.
pub fn decode(bytes: &[u8]) -> Result<Vec<SavedOffer>, HoldsError> {
    let offers: Vec<SavedOffer> = super::holds::decode_json(&MAGIC, MAX_PAYLOAD, bytes)?;
    if offers.len() > MAX_OFFERS {
        return Err(HoldsError::Invalid(format!("{} resources, more than {MAX_OFFERS}", offers.len())));
    }
    Ok(offers)
}

/// What the last start saved; `None` when there is no record (the first start, or one
/// from before the record existed) or (logged) when it cannot be read: nothing to check
/// against then.
pub(super) fn read(path: &Path) -> Option<Vec<SavedOffer>> {
    let bytes = super::holds::read_record(path, "the offers record")?;
    decode(&bytes)
        .inspect_err(|e| {
            tracing::error!(path = %path.display(), error = %crate::error_chain(e), "the offers record is unreadable; regions are restored without checking what backs them");
        })
        .ok()
}

impl State {
    /// What backs every resource now.
    pub(super) fn offers(&self) -> Vec<SavedOffer> {
        (0..self.resources.len())
            .map(|i| SavedOffer { resource: self.resource_key(i), memory: Memory::of(&self.resources[i].offer) })
            .collect()
    }

    /// Why a region on `key` cannot come back, when its resource's memory is not what
    /// `saved` says it was. A resource the record does not list came after that start (a
    /// device added by a rescan), served as every resource is before the configuration
    /// puts a device file or a NUMA node behind it: a file each, or only its driver.
    pub(super) fn offer_changed(&self, saved: &[SavedOffer], key: &ResourceKey) -> Option<String> {
        let now = Memory::of(&self.resources[self.find_resource(key)?].offer);
        let changed = match saved.iter().find(|s| s.resource == *key) {
            Some(s) => (s.memory != now).then(|| format!("was {:?}, is {now:?}", s.memory)),
            None => matches!(now, Memory::Device { .. } | Memory::Node { .. })
                .then(|| format!("it came after the last start, is {now:?}")),
        };
        changed.map(|how| format!("its resource's memory changed since it was allocated ({how})"))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use fabric_proto::wire::{DeviceName, MemoryClass};

    use super::*;

    fn key(ordinal: u16) -> ResourceKey {
        ResourceKey { device: DeviceName::truncated("pci:0000:00:05.0"), kind: MemoryClass::HostExported, ordinal }
    }

    #[test]
    fn offers_round_trip_and_hostile_records_are_refused() {
        let offers = vec![
            SavedOffer { resource: key(0), memory: Memory::Files },
            SavedOffer {
                resource: key(1),
                memory: Memory::Device { name: "0000:00:05.0/2".into(), path: "/sys/x/resource2".into(), start: 0 },
            },
            SavedOffer { resource: key(2), memory: Memory::Node { node: 3 } },
            SavedOffer { resource: key(3), memory: Memory::Driver },
        ];
        assert_eq!(decode(&encode(&offers)).unwrap(), offers);
        assert!(decode(b"FBRCOFFR").is_err(), "a torn frame");
        assert!(decode(&super::super::holds::encode(1, &[])).is_err(), "another record's magic");
        let unknown = super::super::holds::encode_json(
            &MAGIC,
            1,
            &[serde_json::json!({"resource": key(0), "memory": {"kind": "tape"}})],
        );
        assert!(decode(&unknown).is_err(), "an unknown kind of memory");
    }
}
