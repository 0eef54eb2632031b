//! Fuzzes the partition bindings file decoder (`fabricd::partitions::decode`): arbitrary
//! bytes are refused with a typed error or decode to bindings that encode back to the same
//! bytes' meaning, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(bindings) = fabricd::partitions::decode(data) {
        let again = fabricd::partitions::decode(&fabricd::partitions::encode(&bindings)).expect("re-encoded bindings decode");
        assert_eq!(again, bindings);
    }
});
