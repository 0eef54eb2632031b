//! Fuzzes fabricd's configuration parser (`fabricd.toml`, the operator's file): any text
//! gives a validated configuration or an error that names the file, never a panic; a
//! configuration it accepts is accepted again from the same text.
#![no_main]

use std::path::Path;

use fabricd::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let (origin, base) = (Path::new("fuzz.toml"), Path::new("/etc/fabric"));
    match Config::parse(text, origin, base) {
        Ok(c) => {
            let again = Config::parse(text, origin, base).expect("accepted once, accepted again");
            assert_eq!(c, again, "the same text, the same configuration");
            // Relative sim paths were resolved against the base directory.
            assert!(c.discovery.sim.iter().all(|p| p.is_absolute()), "{:?}", c.discovery.sim);
        }
        Err(e) => assert!(e.to_string().starts_with("fuzz.toml"), "the error names the file: {e}"),
    }
});
