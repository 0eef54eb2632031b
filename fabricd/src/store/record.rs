//! The map record's bytes: the address map state and the partition bindings in one JSON
//! payload, in the checksummed frame of [`fabric_addrmap::durable`] (magic `FBRCMAPR`,
//! version 1, encoding 1 = JSON, the record's generation). Decoding is total: a value or
//! a typed [`RecordError`], never a panic.

use std::sync::Arc;

use fabric_addrmap::State;
use fabric_addrmap::durable::{self, FrameError};
use fabric_addrmap::state::StateError;
use serde::{Deserialize, Serialize};

use crate::partitions::Binding;

/// File magic.
pub const MAGIC: [u8; 8] = *b"FBRCMAPR";
/// Current format version.
pub const VERSION: u32 = 1;
/// Payload encoding: JSON.
pub const ENCODING_JSON: u32 = 1;
/// Largest payload accepted (a map of a large domain is a few MiB).
pub const MAX_PAYLOAD: u64 = 256 << 20;

/// The address map state and the partition bindings, saved and loaded as one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Counts saves (see [`super::MapStore`]).
    pub generation: u64,
    /// The address map state.
    pub map: Arc<State>,
    /// Who each partition binds, sorted by name.
    pub bindings: Arc<Vec<Binding>>,
}

#[derive(Serialize)]
struct BodyRef<'a> {
    map: &'a State,
    bindings: &'a [Binding],
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    map: State,
    bindings: Vec<Binding>,
}

/// What is wrong with a record's bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// The frame is damaged (truncated, a checksum mismatch, not a record, another
    /// format version or encoding).
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The payload does not parse.
    #[error("payload does not parse: {0}")]
    Payload(String),
    /// The map state breaks an invariant.
    #[error("inconsistent address map state")]
    Map(#[source] StateError),
    /// The bindings break a rule (count, order, bounds).
    #[error("invalid bindings: {0}")]
    Bindings(String),
}

/// The bytes of `record`.
pub fn encode_record(record: &Record) -> Vec<u8> {
    // Serialising plain data with string keys cannot fail.
    let payload = serde_json::to_vec(&BodyRef { map: &record.map, bindings: &record.bindings }).unwrap_or_default();
    durable::encode_frame(&MAGIC, VERSION, ENCODING_JSON, record.generation, &payload)
}

/// Decodes and validates a record. Pure: the fuzz target `map_record` drives it.
pub fn decode_record(bytes: &[u8]) -> Result<Record, RecordError> {
    let (generation, payload) = durable::decode_frame(&MAGIC, VERSION, ENCODING_JSON, MAX_PAYLOAD, bytes)?;
    let body: Body = serde_json::from_slice(payload).map_err(|e| RecordError::Payload(e.to_string()))?;
    body.map.validate().map_err(RecordError::Map)?;
    crate::partitions::validate(&body.bindings).map_err(RecordError::Bindings)?;
    Ok(Record { generation, map: Arc::new(body.map), bindings: Arc::new(body.bindings) })
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Record {
        let inv = fabric_drivers::sim::load(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../configs/sim/cxl-pool.toml"
        )))
        .unwrap();
        let mut map = fabric_addrmap::AddressMap::new(fabric_addrmap::MapConfig::default()).unwrap();
        map.update(&inv).unwrap();
        let dev = inv.devices[0].id.clone();
        map.partition("tenant-a", &[dev]);
        Record {
            generation: 7,
            map: Arc::new(map.state().clone()),
            bindings: Arc::new(vec![Binding::new("tenant-a", &[61001], &[61100])]),
        }
    }

    #[test]
    fn records_round_trip_and_every_damage_is_refused() {
        let r = sample();
        let good = encode_record(&r);
        assert_eq!(decode_record(&good).unwrap(), r);
        for cut in [0, 1, 39, 40, good.len() / 2, good.len() - 1] {
            let e = decode_record(&good[..cut]).unwrap_err();
            assert!(matches!(e, RecordError::Frame(FrameError::Truncated { .. })), "cut at {cut}: {e}");
        }
        for i in (0..good.len()).step_by(7) {
            let mut bad = good.clone();
            bad[i] ^= 0x10;
            assert!(decode_record(&bad).is_err(), "flipping byte {i} went unnoticed");
        }
        let mut newer = good.clone();
        newer[8] = 2;
        let crc = crc32c::crc32c(&newer[..36]).to_le_bytes();
        newer[36..40].copy_from_slice(&crc);
        assert_eq!(decode_record(&newer), Err(RecordError::Frame(FrameError::Version(2))));
        // Well framed, but the bindings break the rules.
        let unsorted = Record {
            bindings: Arc::new(vec![Binding::new("b", &[1], &[]), Binding::new("a", &[1], &[])]),
            ..r.clone()
        };
        assert!(matches!(decode_record(&encode_record(&unsorted)), Err(RecordError::Bindings(_))));
        let legacy_map = fabric_addrmap::encode_state(&r.map);
        assert_eq!(decode_record(&legacy_map), Err(RecordError::Frame(FrameError::BadMagic)));
    }

    /// `fuzz/seeds/map_record` holds records this encoder writes; they must stay decodable
    /// (FABRICD_WRITE_SEEDS=1 rewrites them after a format change).
    #[test]
    fn fuzz_seeds_decode() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/map_record");
        let path = dir.join("sample.record");
        if std::env::var_os("FABRICD_WRITE_SEEDS").is_some() {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, encode_record(&sample())).unwrap();
        }
        assert_eq!(decode_record(&std::fs::read(&path).unwrap()).unwrap(), sample());
    }
}
