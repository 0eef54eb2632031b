//! Fuzzes fabricd's quarantine record decoder (`fabricd::memory::holds::decode`): arbitrary
//! bytes are refused with a typed error or decode to holds that encode back to bytes that
//! decode to the same holds, never a panic.
#![no_main]

use fabricd::memory::holds;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = holds::decode(data) {
        let again = holds::decode(&holds::encode(1, &h)).expect("re-encoded holds decode");
        assert_eq!(again, h);
    }
});
