//! Pure parsers for the heterogeneous-memory attributes: node lists, directory names
//! (`memory_tierN`, `accessC`, `indexK`, `daxX.Y`, `memoryN`) and the origin of a DAX
//! device from its place in the device tree. Total functions over untrusted text (fuzzed).

use fabric_topology::MemoryOrigin;

use crate::sysfs::parse_dec_u64;

/// The highest NUMA node number accepted (the kernel's MAX_NUMNODES is at most 1024).
pub const MAX_NODE: u32 = 1023;

/// Why a node list did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeListError {
    /// A part is not `N` or `A-B` with `A <= B <= MAX_NODE`.
    #[error("bad node list part {0:?}")]
    Part(String),
}

/// Parses a kernel node list (`0-1,4`; empty for none) into sorted, distinct node numbers.
pub fn parse_nodelist(text: &str) -> Result<Vec<u32>, NodeListError> {
    let t = text.trim();
    let mut out = Vec::new();
    if t.is_empty() {
        return Ok(out);
    }
    let num = |s: &str| parse_dec_u64(s).and_then(|v| u32::try_from(v).ok()).filter(|&v| v <= MAX_NODE);
    for part in t.split(',') {
        let bad = || NodeListError::Part(part.chars().take(32).collect());
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (num(a).ok_or_else(bad)?, num(b).ok_or_else(bad)?),
            None => {
                let v = num(part).ok_or_else(bad)?;
                (v, v)
            }
        };
        if a > b {
            return Err(bad());
        }
        // Bounded: every value is at most MAX_NODE, so the list holds at most 1,024 entries
        // once deduplicated below; overlapping parts are merged rather than refused.
        out.extend(a..=b);
        out.sort_unstable();
        out.dedup();
    }
    Ok(out)
}

/// `prefix` followed by a decimal number at most `max` (`memory_tier4`, `access0`).
pub fn parse_indexed_name(name: &str, prefix: &str, max: u64) -> Option<u32> {
    let rest = name.strip_prefix(prefix)?;
    // No leading zeros or signs: the kernel writes plain decimals.
    if rest.len() > 1 && rest.starts_with('0') {
        return None;
    }
    parse_dec_u64(rest).filter(|&v| v <= max).and_then(|v| u32::try_from(v).ok())
}

/// A DAX device name `daxX.Y` as (X, Y).
pub fn parse_dax_name(name: &str) -> Option<(u32, u32)> {
    let (a, b) = name.strip_prefix("dax")?.split_once('.')?;
    let n = |s: &str| parse_dec_u64(s).and_then(|v| u32::try_from(v).ok());
    Some((n(a)?, n(b)?))
}

/// Where a DAX device's memory comes from, from its path below `sys/devices`:
///
/// - under a CXL region (`…/root0/decoder0.0/region0/dax_region0/dax0.0`): the region;
/// - under an NVDIMM bus (`…/ACPI0012:00/ndbus0/region1/dax1.0/dax1.3`): NVDIMM;
/// - under an `hmem.N` platform device (`platform/hmem.0/dax0.0`, dax_hmem's soft-reserved
///   ranges): soft-reserved;
/// - anything else: unknown.
///
/// The second element is the CXL region's kernel name (`region0`), when it is one.
pub fn dax_origin_from_path(rel: &str) -> (MemoryOrigin, Option<String>) {
    let parts: Vec<&str> = rel.split('/').filter(|p| !p.is_empty()).take(64).collect();
    let is_decoder = |p: &str| {
        p.strip_prefix("decoder")
            .and_then(|r| r.split_once('.'))
            .is_some_and(|(a, b)| parse_dec_u64(a).is_some() && parse_dec_u64(b).is_some())
    };
    // A CXL region sits directly inside its root decoder; NVDIMM regions (`ndbus0/region1`)
    // sit inside a bus, so the decoder check tells them apart.
    for w in parts.windows(2) {
        if is_decoder(w[0]) && parse_indexed_name(w[1], "region", u64::from(u32::MAX)).is_some() {
            return (
                MemoryOrigin::CxlRegion { region: None, kernel_name: Some(w[1].to_owned()) },
                Some(w[1].to_owned()),
            );
        }
    }
    if parts.iter().any(|p| parse_indexed_name(p, "ndbus", u64::from(u32::MAX)).is_some()) {
        return (MemoryOrigin::Nvdimm, None);
    }
    if parts.iter().any(|p| p.strip_prefix("hmem.").is_some_and(|r| parse_dec_u64(r).is_some())) {
        return (MemoryOrigin::SoftReserved, None);
    }
    (MemoryOrigin::Unknown, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_lists_follow_the_kernels_format() {
        assert_eq!(parse_nodelist("").unwrap(), Vec::<u32>::new());
        assert_eq!(parse_nodelist("0-1,4\n").unwrap(), [0, 1, 4]);
        assert_eq!(parse_nodelist("2,0-2").unwrap(), [0, 1, 2]);
        for bad in ["x", "1-", "3-1", "1024", "0-99999999999", ",", "1,,2"] {
            assert!(parse_nodelist(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names() {
        assert_eq!(parse_indexed_name("memory_tier4", "memory_tier", 1 << 16), Some(4));
        assert_eq!(parse_indexed_name("access1", "access", 1), Some(1));
        assert_eq!(parse_indexed_name("access2", "access", 1), None);
        assert_eq!(parse_indexed_name("access01", "access", 9), None);
        assert_eq!(parse_indexed_name("index", "index", 9), None);
        assert_eq!(parse_dax_name("dax1.4"), Some((1, 4)));
        assert_eq!(parse_dax_name("dax_region0"), None);
    }

    #[test]
    fn dax_origins_come_from_the_device_path() {
        let (o, r) = dax_origin_from_path("platform/ACPI0017:00/root0/decoder0.0/region0/dax_region0/dax0.0");
        assert_eq!(o.name(), "cxl");
        assert_eq!(r.as_deref(), Some("region0"));
        let nd = "LNXSYSTM:00/LNXSYBUS:00/ACPI0012:00/ndbus0/region1/dax1.0/dax1.3";
        assert_eq!(dax_origin_from_path(nd).0, MemoryOrigin::Nvdimm);
        assert_eq!(dax_origin_from_path("platform/hmem.0/dax0.0").0, MemoryOrigin::SoftReserved);
        assert_eq!(dax_origin_from_path("virtual/misc/dax9.0").0, MemoryOrigin::Unknown);
    }
}
