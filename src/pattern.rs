//! The fill pattern: every byte of a block is a function of (layer, block, request, offset),
//! so the receiver can check each byte without any copy of the original.

/// SplitMix64's finaliser: a cheap, well-mixing 64-bit hash.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of one block of one request: distinct for every (layer, block, request).
pub fn block_seed(layer: u32, block: u32, request: u64) -> u64 {
    mix(request ^ mix((u64::from(layer) << 32) | u64::from(block)))
}

/// The 8 pattern bytes at word `word` of a block with `seed`.
fn word(seed: u64, word: usize) -> [u8; 8] {
    mix(seed.wrapping_add((word as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))).to_le_bytes()
}

/// Fills `buf` with the pattern of (layer, block, request).
pub fn fill(buf: &mut [u8], layer: u32, block: u32, request: u64) {
    let seed = block_seed(layer, block, request);
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let w = word(seed, i);
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// The offset of the first byte of `buf` that differs from the pattern of
/// (layer, block, request), or `None` when every byte matches.
pub fn first_mismatch(buf: &[u8], layer: u32, block: u32, request: u64) -> Option<usize> {
    let seed = block_seed(layer, block, request);
    buf.chunks(8).enumerate().find_map(|(i, chunk)| {
        let w = word(seed, i);
        chunk
            .iter()
            .zip(w.iter())
            .position(|(a, b)| a != b)
            .map(|p| i * 8 + p)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_check() {
        let mut buf = vec![0u8; 1003];
        fill(&mut buf, 3, 17, 42);
        assert_eq!(first_mismatch(&buf, 3, 17, 42), None);
        assert!(first_mismatch(&buf, 3, 17, 43).is_some());
        assert!(first_mismatch(&buf, 4, 17, 42).is_some());
        assert!(first_mismatch(&buf, 3, 18, 42).is_some());
        buf[1001] ^= 1;
        assert_eq!(first_mismatch(&buf, 3, 17, 42), Some(1001));
    }

    #[test]
    fn seeds_differ() {
        let mut seen = std::collections::HashSet::new();
        for layer in 0..8 {
            for block in 0..64 {
                for request in 0..8 {
                    assert!(seen.insert(block_seed(layer, block, request)));
                }
            }
        }
    }
}
