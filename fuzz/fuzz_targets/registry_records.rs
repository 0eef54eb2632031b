//! Fuzzes the memory registry's journal record decoder: the first two bytes pick the
//! record kind (or a snapshot), the rest is the payload. Arbitrary bytes decode to a
//! record or a typed error, never a panic; what decodes re-encodes to bytes that decode
//! to the same record; and applying decoded records to the replay model never panics.
#![no_main]

use fabricd::journal::KIND_SNAPSHOT;
use fabricd::memory::durable::{Change, Replayed, Snapshot};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((kind, payload)) = data.split_first_chunk::<2>() else { return };
    let kind = u16::from_le_bytes(*kind);
    if kind == KIND_SNAPSHOT {
        let Ok(s) = Snapshot::decode(payload) else { return };
        let again = Snapshot::decode(&s.encode().expect("a decoded snapshot encodes")).expect("and decodes");
        assert_eq!(again, s);
        let mut model = Replayed::from_snapshot(s);
        let _ = model.apply(Change::RegionFreed { id: 1 });
        let _ = model.snapshot();
        return;
    }
    // Also read the payload as a sequence of records of this kind, split at 0xff bytes,
    // applied in order to one model.
    let mut model = Replayed::default();
    for part in std::iter::once(payload).chain(payload.split(|b| *b == 0xff)) {
        let Ok(c) = Change::decode(kind, part) else { continue };
        let (k, bytes) = c.encode().expect("a decoded record encodes");
        assert_eq!(k, kind);
        assert_eq!(Change::decode(k, &bytes).expect("and decodes"), c);
        let _ = model.apply(c);
    }
    let _ = Replayed::from_snapshot(model.snapshot());
});
