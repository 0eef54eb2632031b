//! Fuzzes the `/proc/PID/smaps` parser that DMA registration trusts to say whether a
//! client's memory is mapped and locked: any text yields mappings with `start < end`, a
//! locked flag only from a `VmFlags:` line, never a panic.
#![no_main]

use fabricd::dma::sys::parse_smaps;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let vmas = parse_smaps(&text);
    let flag_lines = text.lines().filter(|l| l.starts_with("VmFlags:")).count();
    assert!(vmas.iter().filter(|v| v.locked).count() <= flag_lines);
    for v in &vmas {
        assert!(v.start < v.end);
    }
});
