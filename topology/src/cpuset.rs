//! CPU sets in the kernel's cpulist format (`0-3,8-11`), as found in `local_cpulist`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A set of CPU numbers stored as sorted, disjoint, non-adjacent inclusive ranges.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct CpuSet {
    ranges: Vec<(u32, u32)>,
}

/// A cpulist that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid cpulist {0:?}")]
pub struct CpuSetError(pub String);

/// The largest CPU number we accept; the kernel's NR_CPUS maximum is 8192.
const MAX_CPU: u32 = 1 << 20;

impl CpuSet {
    /// Builds a set from ranges in any order, merging overlaps.
    pub fn from_ranges(mut ranges: Vec<(u32, u32)>) -> Self {
        ranges.retain(|(a, b)| a <= b);
        ranges.sort_unstable();
        let mut out: Vec<(u32, u32)> = Vec::with_capacity(ranges.len());
        for (a, b) in ranges {
            match out.last_mut() {
                Some(last) if a <= last.1.saturating_add(1) => last.1 = last.1.max(b),
                _ => out.push((a, b)),
            }
        }
        Self { ranges: out }
    }

    /// Parses the hexadecimal mask format of `local_cpus` (`ffff,0000ffff`).
    pub fn from_mask(s: &str) -> Result<Self, CpuSetError> {
        let bad = || CpuSetError(s.to_owned());
        let s = s.trim();
        if s.is_empty() {
            return Err(bad());
        }
        let mut ranges = Vec::new();
        let words: Vec<&str> = s.split(',').collect();
        for (i, w) in words.iter().rev().enumerate() {
            if w.is_empty() || w.len() > 8 {
                return Err(bad());
            }
            let v = u32::from_str_radix(w, 16).map_err(|_| bad())?;
            let base = u32::try_from(i).ok().and_then(|i| i.checked_mul(32)).ok_or_else(bad)?;
            if base > MAX_CPU {
                return Err(bad());
            }
            for bit in 0..32 {
                if v & (1 << bit) != 0 {
                    ranges.push((base + bit, base + bit));
                }
            }
        }
        Ok(Self::from_ranges(ranges))
    }

    /// True when no CPU is in the set.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Number of CPUs in the set.
    pub fn len(&self) -> usize {
        self.ranges.iter().map(|(a, b)| (b - a + 1) as usize).sum()
    }

    /// True when `cpu` is in the set.
    pub fn contains(&self, cpu: u32) -> bool {
        self.ranges.iter().any(|&(a, b)| a <= cpu && cpu <= b)
    }

    /// The inclusive ranges.
    pub fn ranges(&self) -> &[(u32, u32)] {
        &self.ranges
    }
}

impl fmt::Display for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (a, b)) in self.ranges.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            if a == b {
                write!(f, "{a}")?;
            } else {
                write!(f, "{a}-{b}")?;
            }
        }
        Ok(())
    }
}

impl FromStr for CpuSet {
    type Err = CpuSetError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || CpuSetError(s.to_owned());
        let t = s.trim();
        if t.is_empty() {
            return Ok(Self::default());
        }
        let num = |x: &str| -> Result<u32, CpuSetError> {
            let v: u32 = x.trim().parse().map_err(|_| bad())?;
            if v > MAX_CPU { Err(bad()) } else { Ok(v) }
        };
        let mut ranges = Vec::new();
        for part in t.split(',') {
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (num(a)?, num(b)?);
                    if a > b {
                        return Err(bad());
                    }
                    ranges.push((a, b));
                }
                None => {
                    let a = num(part)?;
                    ranges.push((a, a));
                }
            }
        }
        Ok(Self::from_ranges(ranges))
    }
}

impl Serialize for CpuSet {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for CpuSet {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_cpulists() {
        let c: CpuSet = "0-3,8-11,4".parse().unwrap();
        assert_eq!(c.to_string(), "0-4,8-11");
        assert_eq!(c.len(), 9);
        assert!(c.contains(10) && !c.contains(7));
        assert!("".parse::<CpuSet>().unwrap().is_empty());
        for bad in ["a", "3-1", "1,,2", "-1", "99999999999"] {
            assert!(bad.parse::<CpuSet>().is_err(), "{bad}");
        }
    }

    #[test]
    fn parses_masks() {
        assert_eq!(CpuSet::from_mask("00000000,0000ff00").unwrap().to_string(), "8-15");
        assert_eq!(CpuSet::from_mask("1,00000001").unwrap().to_string(), "0,32");
        assert!(CpuSet::from_mask("xyz").is_err());
        assert!(CpuSet::from_mask("").is_err());
    }
}
