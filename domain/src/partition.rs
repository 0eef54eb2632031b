//! `partitions/<name>`: a partition of the domain — devices of any nodes, and the uids and
//! gids it binds — defined once in etcd by an admin (a fenced write of the node that took
//! the request), read by every node, which scopes a bound client's view of the domain's
//! map and topology to it.

use std::collections::HashSet;

use fabric_topology::DeviceId;
use serde::{Deserialize, Serialize};

use crate::records::{RECORD_VERSION, Record, RecordError, invalid, is_token_byte};
use crate::topology::MAX_DEVICE_ID_LEN;

/// Longest partition name (the client protocol's bound).
pub const MAX_PARTITION_NAME: usize = 64;
/// Most devices one partition names.
pub const MAX_PARTITION_DEVICES: usize = 4096;
/// Most uids, and most gids, a partition binds (the client protocol's bound).
pub const MAX_PARTITION_IDS: usize = 64;

/// A partition of the domain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartitionRecord {
    /// Format version.
    pub version: u32,
    /// The partition's name (the key's last part).
    pub name: String,
    /// Its devices, on any nodes of the domain; unique.
    pub devices: Vec<DeviceId>,
    /// Users it binds, sorted, unique.
    pub uids: Vec<u32>,
    /// Groups it binds (primary or supplementary), sorted, unique.
    pub gids: Vec<u32>,
}

impl PartitionRecord {
    /// A record of the current version, ids sorted and deduplicated.
    pub fn new(name: &str, devices: Vec<DeviceId>, uids: &[u32], gids: &[u32]) -> Self {
        let set = |v: &[u32]| {
            let mut v = v.to_vec();
            v.sort_unstable();
            v.dedup();
            v
        };
        Self { version: RECORD_VERSION, name: name.to_owned(), devices, uids: set(uids), gids: set(gids) }
    }

    /// Whether it binds a client with `uid` and `groups` (primary and supplementary).
    pub fn binds(&self, uid: u32, groups: &[u32]) -> bool {
        self.uids.binary_search(&uid).is_ok() || groups.iter().any(|g| self.gids.binary_search(g).is_ok())
    }

    fn check(&self) -> Result<(), RecordError> {
        if !is_partition_name(&self.name) {
            return Err(invalid("name", format!("must be 1 to {MAX_PARTITION_NAME} of [A-Za-z0-9._:-]")));
        }
        if self.devices.len() > MAX_PARTITION_DEVICES {
            return Err(invalid("devices", format!("more than {MAX_PARTITION_DEVICES}")));
        }
        let mut seen = HashSet::with_capacity(self.devices.len());
        for d in &self.devices {
            if d.as_str().len() > MAX_DEVICE_ID_LEN {
                return Err(invalid("devices", format!("an identity longer than {MAX_DEVICE_ID_LEN} bytes")));
            }
            if !seen.insert(d) {
                return Err(invalid("devices", format!("{d} is listed twice")));
            }
        }
        for (field, ids) in [("uids", &self.uids), ("gids", &self.gids)] {
            if ids.len() > MAX_PARTITION_IDS {
                return Err(invalid(field, format!("more than {MAX_PARTITION_IDS}")));
            }
            if !ids.windows(2).all(|w| w[0] < w[1]) {
                return Err(invalid(field, "must be sorted, without duplicates".into()));
            }
        }
        Ok(())
    }
}

/// Whether `name` may name a partition (and so an etcd key's last part).
pub fn is_partition_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_PARTITION_NAME && name.bytes().all(is_token_byte)
}

impl Record for PartitionRecord {
    fn validate(&self) -> Result<(), RecordError> {
        self.check()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::records::{RecordLimits, decode, encode};

    fn record() -> PartitionRecord {
        let devices = vec![DeviceId::uuid("GPU-a"), DeviceId::named("tray1", "numa0")];
        PartitionRecord::new("tenant-a", devices, &[61001, 61000, 61001], &[7])
    }

    #[test]
    fn records_round_trip_and_bind() {
        let r = record();
        assert_eq!(r.uids, [61000, 61001]);
        assert_eq!(decode::<PartitionRecord>(&encode(&r), RecordLimits::default()), Ok(r.clone()));
        assert!(r.binds(61000, &[]) && r.binds(5, &[9, 7]) && !r.binds(5, &[9]));
    }

    #[test]
    fn hostile_records_are_refused_with_the_field() {
        let limits = RecordLimits::default();
        let field = |r: &PartitionRecord| match decode::<PartitionRecord>(&encode(r), limits) {
            Err(RecordError::Invalid { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        for name in ["", "a/b", "a b", &"x".repeat(65)] {
            assert_eq!(field(&PartitionRecord { name: name.into(), ..record() }), "name", "{name:?}");
        }
        let mut r = record();
        r.devices.push(r.devices[0].clone());
        assert_eq!(field(&r), "devices");
        assert_eq!(field(&PartitionRecord { uids: vec![2, 1], ..record() }), "uids");
        assert_eq!(field(&PartitionRecord { gids: vec![1, 1], ..record() }), "gids");
        assert_eq!(field(&PartitionRecord { gids: (0..65).collect(), ..record() }), "gids");
        let text = String::from_utf8(encode(&record())).unwrap();
        let bad_id = text.replacen("uuid:GPU-a", "GPU-a", 1);
        assert!(matches!(decode::<PartitionRecord>(bad_id.as_bytes(), limits), Err(RecordError::Malformed(_))));
        let v2 = text.replacen("\"version\":1", "\"version\":2", 1);
        assert_eq!(decode::<PartitionRecord>(v2.as_bytes(), limits), Err(RecordError::WrongVersion { found: 2 }));
    }

    #[test]
    fn the_view_keeps_partitions_under_their_own_key() {
        let k = crate::records::Keys::new("d");
        let mut v = crate::view::DomainView::new(k.clone(), RecordLimits::default());
        v.apply(k.partition("tenant-a").as_bytes(), Some(&encode(&record())), 2).unwrap();
        let err = v.apply(k.partition("tenant-b").as_bytes(), Some(&encode(&record())), 3).unwrap_err();
        assert!(err.contains("under the key"), "{err}");
        let err = v.apply(k.partition("tenant-a").as_bytes(), Some(b"{"), 4).unwrap_err();
        assert!(err.contains("truncated"), "{err}");
        assert_eq!(v.partitions().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["tenant-a"]);
        v.apply(k.partition("tenant-a").as_bytes(), None, 5).unwrap();
        assert_eq!(v.partitions().count(), 0);
    }

    proptest! {
        #[test]
        fn any_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode::<PartitionRecord>(&bytes, RecordLimits::new(256));
        }
    }
}
