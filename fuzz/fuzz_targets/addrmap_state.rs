//! Fuzzes the address-map state file decoder: arbitrary bytes are rejected with a typed
//! error or decode to a state, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = fabric_addrmap::decode_state(data);
});
