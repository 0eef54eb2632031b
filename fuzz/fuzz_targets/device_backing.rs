//! Fuzzes what `[memory] bars` and a PCI function's sysfs `resource` table are parsed with
//! (fabricd/src/memory/backing.rs): arbitrary text gives a BAR or a typed refusal, never a
//! panic, and what parses is consistent (index < 6; a memory BAR's range is non-empty and
//! its spec prints back to an equal address).
#![no_main]

use fabricd::memory::backing::{memory_bar, parse_bar};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let (spec, table) = text.split_once('\n').unwrap_or((text, ""));
    if let Ok((address, index)) = parse_bar(spec) {
        assert!(index < 6);
        let again = parse_bar(&format!("{address}/{index}")).expect("a parsed spec prints back");
        assert_eq!(again, (address, index));
    }
    for i in 0..8u8 {
        if let Ok((begin, end)) = memory_bar(table, i) {
            assert!(end > begin);
        }
    }
});
