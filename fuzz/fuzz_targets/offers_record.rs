//! Fuzzes fabricd's offers record decoder (`fabricd::memory::offers::decode`): arbitrary
//! bytes are refused with a typed error or decode to offers that encode back to bytes that
//! decode to the same offers, never a panic.
#![no_main]

use fabricd::memory::offers;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(o) = offers::decode(data) {
        let again = offers::decode(&offers::encode(&o)).expect("re-encoded offers decode");
        assert_eq!(again, o);
    }
});
