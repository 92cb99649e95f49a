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

/// The pattern word at position `index` of a block with `seed`. Distinct positions get
/// distinct words (the multiplier is odd), and the plain arithmetic lets the compiler
/// vectorise fills and checks.
fn word(seed: u64, index: usize) -> u64 {
    seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Fills `buf` with the pattern of (layer, block, request).
pub fn fill(buf: &mut [u8], layer: u32, block: u32, request: u64) {
    let seed = block_seed(layer, block, request);
    let mut words = buf.chunks_exact_mut(8);
    let mut count = 0;
    for (i, chunk) in (&mut words).enumerate() {
        chunk.copy_from_slice(&word(seed, i).to_le_bytes());
        count = i + 1;
    }
    let tail = words.into_remainder();
    let last = word(seed, count).to_le_bytes();
    tail.copy_from_slice(&last[..tail.len()]);
}

/// The offset of the first byte of `buf` that differs from the pattern of
/// (layer, block, request), or `None` when every byte matches.
pub fn first_mismatch(buf: &[u8], layer: u32, block: u32, request: u64) -> Option<usize> {
    let seed = block_seed(layer, block, request);
    let as_word = |chunk: &[u8]| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(chunk);
        u64::from_le_bytes(bytes)
    };
    // Fast path: OR of all differences, without early exit, so it vectorises.
    let full = buf.len() / 8 * 8;
    let diff = buf[..full]
        .chunks_exact(8)
        .enumerate()
        .fold(0, |acc, (i, chunk)| acc | (as_word(chunk) ^ word(seed, i)));
    let tail = &buf[full..];
    let last = word(seed, full / 8).to_le_bytes();
    if diff == 0 && tail == &last[..tail.len()] {
        return None;
    }
    buf.chunks(8).enumerate().find_map(|(i, chunk)| {
        let expected = word(seed, i).to_le_bytes();
        chunk
            .iter()
            .zip(expected.iter())
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
        buf[1001] ^= 1;
        buf[8] ^= 0x80;
        assert_eq!(first_mismatch(&buf, 3, 17, 42), Some(8));
    }

    #[test]
    fn shifted_data_does_not_match() {
        let mut buf = vec![0u8; 64];
        fill(&mut buf, 0, 0, 0);
        let mut shifted = buf[8..].to_vec();
        shifted.extend_from_slice(&[0; 8]);
        assert_eq!(first_mismatch(&shifted, 0, 0, 0), Some(0));
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
