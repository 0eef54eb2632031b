//! Whether a PCI function has failed, from what sysfs says without root: its AER fatal
//! error counters (`aer_dev_fatal`), whether it still answers config reads (the first four
//! bytes of `config`, vendor and device ID, read `ff ff ff ff` from a function that fell
//! off the bus or is dead), and whether its link status can be read at all
//! (`current_link_speed` fails with an I/O error once the kernel has marked the function
//! disconnected). The verdict is a reason in words, set as the device's `failed`
//! attribute ([`fabric_topology::FAILED_ATTR`]).
//!
//! `config` is read only from a function whose runtime PM status is active (or not
//! reported): reading config space resumes a runtime-suspended function, and a rescan must
//! not wake every idle GPU.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use super::attrs::AttrParseError;
use crate::sysfs::{self, AttrError};

/// The most counter lines an `aer_dev_fatal` file may have (kernels write about 20).
pub const MAX_AER_LINES: usize = 64;

/// Parses an AER counter file (`aer_dev_fatal`, `aer_dev_nonfatal`, `aer_dev_correctable`):
/// one `NAME COUNT` line per error kind, the last one a `TOTAL_ERR_*` line. Returns the
/// lines in order.
pub fn parse_aer_counters(text: &str) -> Result<Vec<(String, u64)>, AttrParseError> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        if out.len() == MAX_AER_LINES {
            return Err(AttrParseError::Range(format!("more than {MAX_AER_LINES} lines")));
        }
        let bad = || AttrParseError::Number(line.chars().take(64).collect());
        let mut it = line.split_whitespace();
        let (Some(name), Some(count), None) = (it.next(), it.next(), it.next()) else { return Err(bad()) };
        if name.len() > 64 || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Err(bad());
        }
        out.push((name.to_owned(), sysfs::parse_dec_u64(count).ok_or_else(bad)?));
    }
    Ok(out)
}

/// The failure an `aer_dev_fatal` file reports: a non-zero `TOTAL_ERR_FATAL`, with the
/// kinds counted. `None` when there were no fatal errors (or no total line).
pub fn aer_fatal(counters: &[(String, u64)]) -> Option<String> {
    let total = counters.iter().find(|(n, _)| n == "TOTAL_ERR_FATAL").map(|(_, c)| *c)?;
    if total == 0 {
        return None;
    }
    let kinds: Vec<String> =
        counters.iter().filter(|(n, c)| *c > 0 && !n.starts_with("TOTAL_")).map(|(n, c)| format!("{n} {c}")).collect();
    let which = if kinds.is_empty() { String::new() } else { format!(": {}", kinds.join(", ")) };
    Some(format!("PCIe AER reports {total} fatal uncorrectable error(s) since boot{which}"))
}

/// Whether the first bytes of config space say the function no longer answers.
pub fn config_dead(head: &[u8]) -> bool {
    head.len() >= 4 && head[..4] == [0xff; 4]
}

/// Why the function in `dir` is failed, if it is. `link_speed` is what reading its
/// `current_link_speed` came to (read once, by the attribute reader).
pub fn failure<T>(dir: &Path, link_speed: &Result<T, AttrError>) -> Option<String> {
    if let Some(why) = read_aer_fatal(dir) {
        return Some(why);
    }
    if let Err(AttrError::Unreadable { source, .. }) = link_speed {
        return Some(format!("its link status cannot be read (current_link_speed: {source}): disconnected"));
    }
    if awake(dir) && read_config_head(dir).is_some_and(|h| config_dead(&h)) {
        return Some("it no longer answers config reads (vendor and device ID read 0xffff): off the bus".to_owned());
    }
    None
}

fn read_aer_fatal(dir: &Path) -> Option<String> {
    let path = dir.join("aer_dev_fatal");
    let text = match std::fs::metadata(&path) {
        Ok(m) if m.is_file() => sysfs::read_attr(&path).ok()?,
        _ => return None,
    };
    match parse_aer_counters(&text) {
        Ok(c) => aer_fatal(&c),
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "AER counters do not parse; not a failure");
            None
        }
    }
}

/// Runtime PM lets config space be read without waking the function.
fn awake(dir: &Path) -> bool {
    match sysfs::read_attr(&dir.join("power/runtime_status")) {
        Ok(s) => matches!(s.trim(), "active" | "unsupported"),
        Err(e) => e.is_missing(),
    }
}

/// The first four bytes of `config`, when it is a regular file that gives them.
fn read_config_head(dir: &Path) -> Option<[u8; 4]> {
    let path = dir.join("config");
    if !std::fs::metadata(&path).is_ok_and(|m| m.is_file()) {
        return None;
    }
    let mut head = [0u8; 4];
    File::open(&path).ok()?.read_exact(&mut head).ok()?;
    Some(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FATAL_ZERO: &str = "Undefined 0\nDLP 0\nSDES 0\nTLP 0\nFCP 0\nCmpltTO 0\nCmpltAbrt 0\nUnxCmplt 0\n\
                              RxOF 0\nMalfTLP 0\nECRC 0\nUnsupReq 0\nACSViol 0\nUncorrIntErr 0\nBlockedTLP 0\n\
                              AtomicOpBlocked 0\nTLPBlockedErr 0\nPoisonTLPBlocked 0\nTOTAL_ERR_FATAL 0\n";

    #[test]
    fn aer_counters_parse_and_only_a_nonzero_fatal_total_is_a_failure() {
        let c = parse_aer_counters(FATAL_ZERO).unwrap();
        assert_eq!(c.len(), 19);
        assert_eq!(aer_fatal(&c), None);
        let two = FATAL_ZERO.replace("DLP 0", "DLP 1").replace("UncorrIntErr 0", "UncorrIntErr 1");
        let two = two.replace("TOTAL_ERR_FATAL 0", "TOTAL_ERR_FATAL 2");
        let why = aer_fatal(&parse_aer_counters(&two).unwrap()).unwrap();
        assert!(why.contains("2 fatal") && why.contains("DLP 1, UncorrIntErr 1"), "{why}");
        // No total line: nothing to go by.
        assert_eq!(aer_fatal(&parse_aer_counters("DLP 3\n").unwrap()), None);
        for bad in ["DLP", "DLP x", "DLP 1 2", "D-P 1", "DLP -1"] {
            assert!(parse_aer_counters(bad).is_err(), "{bad}");
        }
        assert!(parse_aer_counters(&"A 0\n".repeat(MAX_AER_LINES + 1)).is_err());
        assert_eq!(parse_aer_counters("").unwrap(), vec![]);
    }

    #[test]
    fn each_source_fails_a_function_and_a_healthy_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let ok: Result<(), AttrError> = Ok(());
        assert_eq!(failure(d, &ok), None, "nothing to read is not a failure");
        std::fs::write(d.join("config"), [0x86, 0x80, 0x3c, 0xe8, 0, 0]).unwrap();
        std::fs::write(d.join("aer_dev_fatal"), FATAL_ZERO).unwrap();
        assert_eq!(failure(d, &ok), None);

        std::fs::write(d.join("config"), [0xff; 64]).unwrap();
        assert!(failure(d, &ok).unwrap().contains("config reads"));
        // A suspended function is not woken to look.
        std::fs::create_dir(d.join("power")).unwrap();
        std::fs::write(d.join("power/runtime_status"), "suspended\n").unwrap();
        assert_eq!(failure(d, &ok), None);
        std::fs::write(d.join("power/runtime_status"), "active\n").unwrap();
        assert!(failure(d, &ok).is_some());

        let gone: Result<(), AttrError> = Err(AttrError::Unreadable {
            path: d.join("current_link_speed"),
            source: std::io::Error::from_raw_os_error(libc_einval()),
        });
        std::fs::write(d.join("config"), [0x86, 0x80, 0x3c, 0xe8]).unwrap();
        assert!(failure(d, &gone).unwrap().contains("current_link_speed"));
        let missing: Result<(), AttrError> = Err(AttrError::Missing { path: d.join("current_link_speed") });
        assert_eq!(failure(d, &missing), None, "a function without a PCIe link is not failed");

        std::fs::write(d.join("aer_dev_fatal"), FATAL_ZERO.replace("TOTAL_ERR_FATAL 0", "TOTAL_ERR_FATAL 1")).unwrap();
        assert!(failure(d, &ok).unwrap().contains("AER"), "AER is named first");
        std::fs::write(d.join("aer_dev_fatal"), "garbage").unwrap();
        assert_eq!(failure(d, &ok), None, "unparsable counters are not a failure");
    }

    /// EINVAL, what the kernel returns for the link status of a disconnected function.
    fn libc_einval() -> i32 {
        22
    }
}
