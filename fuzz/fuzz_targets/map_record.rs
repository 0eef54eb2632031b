//! Fuzzes fabricd's map record decoder (`fabricd::store::decode_record`): arbitrary bytes
//! are refused with a typed error or decode to a record that encodes back to bytes that
//! decode to the same record, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(record) = fabricd::store::decode_record(data) {
        let bytes = fabricd::store::encode_record(&record);
        let again = fabricd::store::decode_record(&bytes).expect("a re-encoded record decodes");
        assert_eq!(again, record);
    }
});
