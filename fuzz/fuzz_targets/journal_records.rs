//! Fuzzes the journal segment decoder: arbitrary bytes decode to intact records or a typed
//! error, never a panic; what decodes re-encodes to the same bytes, with gap-free sequence
//! numbers, a snapshot's records (one, or as many as the header says) lead a snapshot
//! segment only, and a torn tail covers exactly the bytes after the last intact record.
#![no_main]

use fabricd::journal::{KIND_SNAPSHOT, decode_segment};
use fabricd::journal::format::{HEADER_LEN, encode_record};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(segment) = decode_segment(data) else { return };
    let mut image = segment.header.encode().to_vec();
    assert_eq!(&image[..], &data[..HEADER_LEN]);
    for (i, r) in segment.records.iter().enumerate() {
        assert_eq!(r.seq, segment.header.first_seq + i as u64);
        assert_eq!(r.offset, image.len() as u64);
        encode_record(&mut image, r.seq, r.kind, r.payload);
    }
    // A snapshot's records, all of them, lead a snapshot segment and appear nowhere else.
    let snapshot = segment.records.iter().filter(|r| r.kind == KIND_SNAPSHOT).count();
    let leading = segment.records.iter().take_while(|r| r.kind == KIND_SNAPSHOT).count();
    assert_eq!((snapshot, leading), (segment.header.snapshot_records(), snapshot));
    assert_eq!(image.len() as u64, segment.valid_len);
    assert_eq!(&image[..], &data[..image.len()]);
    match segment.torn {
        Some(t) => assert_eq!((t.offset, t.offset + t.len), (segment.valid_len, data.len() as u64)),
        None => assert_eq!(segment.valid_len, data.len() as u64),
    }
});
