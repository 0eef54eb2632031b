//! The per-region DAX test's host side (guest/daxsplit.sh, the probe's `split`): the seeds
//! the client stores, and the comparison of what the guest reported — the client's regions
//! (`split-regions`, `split-c`) and the DAX region's devices at each step (`dax-devices-N`) —
//! with the address map and the kernel's region.

use std::collections::BTreeMap;

/// Seeds of the patterns stored in regions A, B and C.
pub const SEEDS: [u64; 3] = [0x5eed_00a0, 0x5eed_00b0, 0x5eed_00c0];

/// One of the client's regions: `NAME DEVICE GFA LEN [FD_OFFSET]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitRegion {
    /// `A`, `B` or `C`.
    pub name: String,
    /// The DAX device behind its descriptor (`dax0.1`).
    pub device: String,
    /// Its GFA.
    pub gfa: u64,
    /// Bytes.
    pub len: u64,
}

/// One device of the DAX region as the guest listed it: `NAME SIZE START END DRIVER`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// Bytes.
    pub size: u64,
    /// First HPA of its first range (`None`: no range).
    pub start: Option<u64>,
    /// Last HPA of its first range.
    pub end: Option<u64>,
    /// Driver (`-`: none).
    pub driver: String,
}

fn num(s: &str) -> Option<u64> {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

/// Parses `split-regions` / `split-c` lines.
pub fn regions(text: &str) -> Result<Vec<SplitRegion>, String> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (Some(name), Some(dev), Some(gfa), Some(len)) = (f.first(), f.get(1), f.get(2), f.get(3)) else {
            return Err(format!("region line {line:?}"));
        };
        let (Some(gfa), Some(len)) = (num(gfa), num(len)) else { return Err(format!("region line {line:?}")) };
        let device = dev.trim_start_matches("/dev/").to_owned();
        out.push(SplitRegion { name: (*name).to_owned(), device, gfa, len });
    }
    Ok(out)
}

/// Parses a `dax-devices-N` listing.
pub fn listing(text: &str) -> Result<BTreeMap<String, Listed>, String> {
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [name, size, start, end, driver] = f[..] else { return Err(format!("device line {line:?}")) };
        let size = num(size).ok_or_else(|| format!("device line {line:?}"))?;
        out.insert(name.to_owned(), Listed { size, start: num(start), end: num(end), driver: driver.to_owned() });
    }
    Ok(out)
}

/// Every way `devices` differs from exactly: the region's first device `seed` empty and
/// unbound, and one device per region of `regions`, bound to `device_dax`, whose one range
/// is the region's HPAs — `hpa_of_gfa(gfa)`, what the address map says the GFA is.
pub fn check_listing(
    step: &str,
    devices: &BTreeMap<String, Listed>,
    seed: &str,
    regions: &[&SplitRegion],
    hpa_of_gfa: impl Fn(u64) -> Option<u64>,
) -> Vec<String> {
    let mut diffs = Vec::new();
    match devices.get(seed) {
        Some(s) if s.size == 0 && s.driver == "-" => {}
        other => diffs.push(format!("{step}: the first device {seed} is {other:?}, not empty and unbound")),
    }
    for r in regions {
        let Some(d) = devices.get(&r.device) else {
            diffs.push(format!("{step}: region {} has no device {}", r.name, r.device));
            continue;
        };
        let want = hpa_of_gfa(r.gfa);
        let end = want.map(|s| s + r.len - 1);
        if d.size != r.len || d.start != want || d.end != end || d.driver != "device_dax" {
            diffs.push(format!(
                "{step}: region {} ({} bytes at HPA {want:x?}) has device {} = {d:?}",
                r.name, r.len, r.device
            ));
        }
    }
    let expected: Vec<&str> = std::iter::once(seed).chain(regions.iter().map(|r| r.device.as_str())).collect();
    for name in devices.keys().filter(|n| !expected.contains(&n.as_str())) {
        diffs.push(format!("{step}: device {name} belongs to no region"));
    }
    diffs
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn listings_are_checked_against_the_regions() {
        let regs = regions("A /dev/dax0.1 0x10200000 0x400000 0x0\nB /dev/dax0.2 0x10600000 0x800000 0x0\n").unwrap();
        let hpa = |g: u64| Some(g - 0x1000_0000 + 0x3_9000_0000);
        let good = "dax0.0 0 - - -\ndax0.1 4194304 0x390200000 0x3905fffff device_dax\n\
                    dax0.2 8388608 0x390600000 0x390dfffff device_dax\n";
        let l = listing(good).unwrap();
        assert!(check_listing("s", &l, "dax0.0", &regs.iter().collect::<Vec<_>>(), hpa).is_empty());
        // A device at the wrong place, a stray one, a seed still full: each is reported.
        let bad = "dax0.0 8 0x0 0x7 device_dax\ndax0.1 4194304 0x390000000 0x3903fffff device_dax\n\
                   dax0.2 8388608 0x390600000 0x390dfffff device_dax\ndax0.3 2097152 0x0 0x1fffff -\n";
        let d = check_listing("s", &listing(bad).unwrap(), "dax0.0", &regs.iter().collect::<Vec<_>>(), hpa);
        assert_eq!(d.len(), 3, "{d:?}");
        assert!(regions("A dax0.1 zz 1").is_err());
        assert!(listing("dax0.1 4").is_err());
    }
}
