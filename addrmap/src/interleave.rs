//! Interleave geometry with CXL HDM decoder semantics: ways 1, 2, 3, 4, 6, 8, 12, 16 and
//! granularity 256 B..16 KiB, including the modulo-3 arithmetic of 3, 6 and 12 ways.
//!
//! The encoding follows the CXL specification (HDM decoder control register, "device decode
//! logic" note) as the Linux kernel's `cxl_dpa_to_hpa` applies it: `eiw` is 0..=4 for
//! 1/2/4/8/16 ways and 8..=10 for 3/6/12 ways; `eig` is `log2(granularity) - 8`.
//! With `ways = 2^eiw` (or `3 * 2^(eiw-8)`) and `g = 256 << eig`, DPA offset `d` of the member
//! at position `pos` sits at HPA offset `((d / g) * ways + pos) * g + d % g`; the fast paths
//! below compute exactly that with shifts and, for the 3-way family, one division by the
//! constant 3 (which compiles to a multiply).

use serde::{Deserialize, Serialize};

/// Legal interleave ways.
pub const WAYS: [u8; 8] = [1, 2, 3, 4, 6, 8, 12, 16];
/// Legal interleave granularities.
pub const GRANULARITIES: [u32; 7] = [256, 512, 1024, 2048, 4096, 8192, 16384];

/// Errors from building an interleave geometry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InterleaveError {
    /// Ways not in 1, 2, 3, 4, 6, 8, 12, 16.
    #[error("{0} interleave ways (legal: 1, 2, 3, 4, 6, 8, 12, 16)")]
    Ways(u32),
    /// Granularity not a power of two in 256..=16384.
    #[error("interleave granularity {0} (legal: powers of two from 256 to 16384)")]
    Granularity(u64),
}

/// An interleave geometry: how many members and how many bytes per stripe chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "GeometryRepr", into = "GeometryRepr")]
pub struct Geometry {
    ways: u8,
    /// log2(granularity).
    gran_shift: u8,
    /// `eiw` encoding.
    eiw: u8,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct GeometryRepr {
    ways: u32,
    granularity: u64,
}

impl TryFrom<GeometryRepr> for Geometry {
    type Error = InterleaveError;
    fn try_from(r: GeometryRepr) -> Result<Self, Self::Error> {
        Geometry::new(r.ways, r.granularity)
    }
}

impl From<Geometry> for GeometryRepr {
    fn from(g: Geometry) -> Self {
        GeometryRepr { ways: g.ways(), granularity: g.granularity() }
    }
}

impl Geometry {
    /// Checks and encodes `ways` and `granularity`.
    pub fn new(ways: u32, granularity: u64) -> Result<Self, InterleaveError> {
        let eiw = match ways {
            1 => 0,
            2 => 1,
            4 => 2,
            8 => 3,
            16 => 4,
            3 => 8,
            6 => 9,
            12 => 10,
            _ => return Err(InterleaveError::Ways(ways)),
        };
        if !granularity.is_power_of_two() || !(256..=16384).contains(&granularity) {
            return Err(InterleaveError::Granularity(granularity));
        }
        Ok(Self { ways: ways as u8, gran_shift: granularity.trailing_zeros() as u8, eiw })
    }

    /// Number of members.
    pub fn ways(&self) -> u32 {
        u32::from(self.ways)
    }

    /// Bytes per chunk.
    pub fn granularity(&self) -> u64 {
        1 << self.gran_shift
    }

    /// The CXL `eiw` (encoded interleave ways).
    pub fn eiw(&self) -> u8 {
        self.eiw
    }

    /// The CXL `eig` (encoded interleave granularity).
    pub fn eig(&self) -> u8 {
        self.gran_shift - 8
    }

    /// HPA offset (within the set) to (member position, DPA offset within the member).
    #[inline]
    pub fn hpa_to_dpa(&self, hpa: u64) -> (u32, u64) {
        let g = self.gran_shift;
        let low = hpa & ((1u64 << g) - 1);
        let chunk = hpa >> g;
        if self.eiw < 8 {
            let pos = chunk & ((1u64 << self.eiw) - 1);
            let dchunk = chunk >> self.eiw;
            (pos as u32, (dchunk << g) | low)
        } else {
            let k = self.eiw - 8;
            let hi = chunk >> k;
            let q = hi / 3;
            let r = hi - q * 3;
            let pos = (r << k) | (chunk & ((1u64 << k) - 1));
            (pos as u32, (q << g) | low)
        }
    }

    /// (member position, DPA offset) to HPA offset within the set; `pos < ways`.
    #[inline]
    pub fn dpa_to_hpa(&self, pos: u32, dpa: u64) -> u64 {
        let g = self.gran_shift;
        let low = dpa & ((1u64 << g) - 1);
        let dchunk = dpa >> g;
        let hchunk = if self.eiw < 8 {
            (dchunk << self.eiw) | u64::from(pos)
        } else {
            ((dchunk * 3) << (self.eiw - 8)) + u64::from(pos)
        };
        (hchunk << g) | low
    }

    /// The same mapping by plain division: the reference the fast paths are tested against.
    pub fn hpa_to_dpa_naive(&self, hpa: u64) -> (u32, u64) {
        let g = self.granularity();
        let w = u64::from(self.ways);
        let chunk = hpa / g;
        ((chunk % w) as u32, (chunk / w) * g + hpa % g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's `cxl_dpa_to_hpa` bit manipulation, transcribed for comparison.
    fn kernel_dpa_to_hpa(g: &Geometry, pos: u64, dpa: u64) -> u64 {
        let eig = u32::from(g.eig());
        let eiw = u32::from(g.eiw());
        let mask_upper = (u64::MAX >> 12) & !((1u64 << (eig + 8)) - 1); // GENMASK_ULL(51, eig + 8)
        let mut hpa = if eiw < 8 {
            ((dpa & mask_upper) << eiw) | (pos << (eig + 8))
        } else {
            let bits_upper = ((dpa & mask_upper) >> (eig + 8)) * 3;
            ((bits_upper << (eiw - 8)) + pos) << (eig + 8)
        };
        hpa |= dpa & ((1u64 << (eig + 8)) - 1);
        hpa
    }

    #[test]
    fn encodings_match_the_cxl_spec() {
        let eiws: Vec<u8> = WAYS.iter().map(|&w| Geometry::new(w.into(), 256).unwrap().eiw()).collect();
        assert_eq!(eiws, [0, 1, 8, 2, 9, 3, 10, 4]);
        assert_eq!(Geometry::new(1, 16384).unwrap().eig(), 6);
        for bad in [0, 5, 7, 9, 10, 24, 32] {
            assert_eq!(Geometry::new(bad, 256), Err(InterleaveError::Ways(bad)));
        }
        for bad in [0, 128, 300, 32768] {
            assert_eq!(Geometry::new(2, bad), Err(InterleaveError::Granularity(bad)));
        }
    }

    #[test]
    fn fast_path_matches_kernel_and_naive_for_every_geometry() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for &w in &WAYS {
            for &gr in &GRANULARITIES {
                let g = Geometry::new(w.into(), gr.into()).unwrap();
                for _ in 0..2000 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let hpa = x >> 14; // below 2^50
                    let (pos, dpa) = g.hpa_to_dpa(hpa);
                    assert_eq!((pos, dpa), g.hpa_to_dpa_naive(hpa), "ways {w} gran {gr} hpa {hpa:#x}");
                    assert_eq!(g.dpa_to_hpa(pos, dpa), hpa);
                    assert_eq!(kernel_dpa_to_hpa(&g, pos.into(), dpa), hpa);
                }
            }
        }
    }
}
