//! The weights' random numbers: SplitMix64, so a seed gives the same model everywhere.

/// A SplitMix64 generator.
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    /// The generator of `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number uniform in `[-1, 1)`.
    pub(crate) fn symmetric(&mut self) -> f32 {
        // The top 24 bits: every value exact in f32.
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        2.0 * unit - 1.0
    }
}
