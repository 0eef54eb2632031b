//! Fuzzes the domain's etcd record decoders: the first byte picks the record type
//! (settings, member, slot claim, placements, topology, partition, share table), the rest is the value as read from etcd. Any bytes
//! decode to a record or a typed error, never a panic; what decodes re-encodes to bytes
//! that decode to the same record.
#![no_main]

use fabric_domain::records::{self, Record, RecordLimits};
use fabric_domain::{
    DomainSettings, MemberRecord, PartitionRecord, PlacementsRecord, ShareTable, SlotClaim, TopologyRecord,
};
use libfuzzer_sys::fuzz_target;

fn round_trip<R: Record + PartialEq + std::fmt::Debug>(value: &[u8], limits: RecordLimits) {
    let Ok(record) = records::decode::<R>(value, limits) else { return };
    let again = records::decode::<R>(&records::encode(&record), RecordLimits::default()).expect("a decoded record re-decodes");
    assert_eq!(again, record);
}

fuzz_target!(|data: &[u8]| {
    let Some((kind, value)) = data.split_first() else { return };
    // A small bound as well as the default, so that the size refusal is reached too.
    let limits = if kind & 0x80 != 0 { RecordLimits::new(64) } else { RecordLimits::default() };
    match kind % 7 {
        0 => round_trip::<DomainSettings>(value, limits),
        1 => round_trip::<MemberRecord>(value, limits),
        2 => round_trip::<SlotClaim>(value, limits),
        3 => round_trip::<PlacementsRecord>(value, limits),
        4 => round_trip::<TopologyRecord>(value, limits),
        5 => round_trip::<PartitionRecord>(value, limits),
        _ => round_trip::<ShareTable>(value, limits),
    }
});
