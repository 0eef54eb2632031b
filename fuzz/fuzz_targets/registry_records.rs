//! Fuzzes the memory registry's journal record decoder: the first two bytes pick the
//! record kind (or a snapshot), the rest is the payload. Arbitrary bytes decode to a
//! record or a typed error, never a panic; what decodes re-encodes to bytes that decode
//! to the same record; applying decoded records to the replay model never panics; and the
//! journal writer's image, fed the same bytes, writes the snapshot of that model (or
//! refuses to, once a record it was fed does not decode).
#![no_main]

use fabricd::journal::{Image, KIND_SNAPSHOT};
use fabricd::memory::durable::{Change, DurableError, RegistryImage, Replayed, Snapshot};
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
        let image = RegistryImage::of(payload);
        let written = Snapshot::decode(&image.encode().expect("a decoded snapshot's image encodes")).expect("decodes");
        assert_eq!(written, Replayed::from_snapshot(again).snapshot());
        return;
    }
    // Also read the payload as a sequence of records of this kind, split at 0xff bytes,
    // applied in order to one model.
    let mut model = Replayed::default();
    let mut image = RegistryImage::of(&Snapshot::default().encode().expect("an empty snapshot encodes"));
    let mut undecodable = false;
    for part in std::iter::once(payload).chain(payload.split(|b| *b == 0xff)) {
        image.apply(kind, part);
        let c = match Change::decode(kind, part) {
            Ok(c) => c,
            Err(DurableError::UnknownKind(_)) => continue,
            Err(_) => {
                undecodable = true;
                continue;
            }
        };
        let (k, bytes) = c.encode().expect("a decoded record encodes");
        assert_eq!(k, kind);
        assert_eq!(Change::decode(k, &bytes).expect("and decodes"), c);
        let _ = model.apply(c);
    }
    let _ = Replayed::from_snapshot(model.snapshot());
    match image.encode() {
        Ok(bytes) => {
            assert!(!undecodable, "an image fed an undecodable record still encodes");
            assert_eq!(Snapshot::decode(&bytes).expect("the image's snapshot decodes"), model.snapshot());
        }
        Err(_) => assert!(undecodable, "the image refuses to encode a model of decodable records"),
    }
});
