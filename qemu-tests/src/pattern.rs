//! The test pattern both sides of a memory check compute: 64-bit words derived from a seed
//! and the word's offset, so that a misplaced, stale or torn word is caught and named.

/// The word at byte offset `offset` (a multiple of 8) for `seed`.
pub fn word(seed: u64, offset: u64) -> u64 {
    // splitmix64 of (seed, word index): cheap, and no two nearby words are alike.
    let mut z = seed.wrapping_add((offset / 8).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Where byte `offset` of an interleave set (`ways` members, `granularity` bytes per
/// chunk, modulo interleave) lands: the member position and the offset within the member.
pub fn interleave(offset: u64, ways: u64, granularity: u64) -> (u64, u64) {
    let chunk = offset / granularity;
    (chunk % ways, (chunk / ways) * granularity + offset % granularity)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_differ_by_seed_and_offset() {
        assert_ne!(word(1, 0), word(1, 8));
        assert_ne!(word(1, 0), word(2, 0));
        assert_eq!(word(7, 64), word(7, 64));
    }

    #[test]
    fn two_way_256_byte_interleave() {
        assert_eq!(interleave(0, 2, 256), (0, 0));
        assert_eq!(interleave(255, 2, 256), (0, 255));
        assert_eq!(interleave(256, 2, 256), (1, 0));
        assert_eq!(interleave(512, 2, 256), (0, 256));
        assert_eq!(interleave(512 + 300, 2, 256), (1, 256 + 44));
    }
}
