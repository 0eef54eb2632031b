//! Fuzzes the partition bindings file decoder (`fabricd::partitions::decode`): arbitrary
//! bytes are refused with a typed error or decode to bindings that encode back to the same
//! bytes' meaning, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(bindings) = fabricd::partitions::decode(data) {
        let bytes = fabricd::partitions::encode(&bindings);
        let again = fabricd::partitions::decode(&bytes).expect("re-encoded bindings decode");
        assert_eq!(again, bindings);
    }
});
