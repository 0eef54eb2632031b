//! Fuzzes fabricd's foreign-range record decoder (`fabricd::memory::foreign::decode`):
//! arbitrary bytes are refused with a typed error or decode to ranges that encode back to
//! bytes that decode to the same ranges, never a panic.
#![no_main]

use fabricd::memory::foreign;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = foreign::decode(data) {
        let again = foreign::decode(&foreign::encode(1, &r)).expect("re-encoded ranges decode");
        assert_eq!(again, r);
    }
});
