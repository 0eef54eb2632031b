//! Fuzzes the kernel uevent parser: arbitrary bytes parse to a uevent or a typed error,
//! never a panic; what parses is consistent (the header's action and devpath agree with
//! the fields, the field count is bounded) and re-serialises to bytes that parse to the
//! same uevent (when it fits the size limit).
#![no_main]

use fabricd::tasks::uevent::parse::{MAX_FIELDS, MAX_MESSAGE, parse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(ev) = parse(data) else { return };
    assert!(ev.fields.len() <= MAX_FIELDS);
    assert!(ev.devpath.starts_with('/'));
    for (key, header) in [("ACTION", &ev.action), ("DEVPATH", &ev.devpath)] {
        if let Some(v) = ev.get(key) {
            assert_eq!(v, header);
        }
    }
    assert_eq!(ev.subsystem.as_deref(), ev.get("SUBSYSTEM"));
    let mut again = format!("{}@{}\0", ev.action, ev.devpath).into_bytes();
    for (k, v) in &ev.fields {
        again.extend_from_slice(format!("{k}={v}\0").as_bytes());
    }
    // The form written here ends with a NUL, which the input may not have.
    if again.len() <= MAX_MESSAGE {
        assert_eq!(parse(&again).ok(), Some(ev));
    }
});
