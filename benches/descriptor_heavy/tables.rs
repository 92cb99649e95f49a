//! The block tables of the descriptor-heavy READs and the bytes their blocks hold: the same
//! seeds, draws and pattern as `bench/python/descriptor_heavy.py`, so both languages read the
//! same blocks and check the same bytes.

/// KV cache regions: 64 layers with K and V apart, where vLLM has them.
pub const REGIONS: usize = 128;
/// Blocks per region (the pool block ids are drawn from).
pub const POOL: usize = 4096;
/// Bytes of one block of one region.
pub const BLOCK: usize = 16 << 10;
/// Blocks per request.
pub const PER_REQUEST: usize = 148;
/// Bytes one request moves.
pub const REQUEST_BYTES: usize = REGIONS * PER_REQUEST * BLOCK;

/// The three shapes of block ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    /// (a) one run, contiguous on both sides.
    Contiguous,
    /// (b) random distinct ids from the pool on each side.
    Fragmented,
    /// (c) a run of half the blocks, then random ids outside it.
    Half,
}

impl Case {
    /// Every case, in the order they run.
    pub const ALL: [Case; 3] = [Case::Contiguous, Case::Fragmented, Case::Half];

    /// The case's name in the records.
    pub fn name(self) -> &'static str {
        match self {
            Case::Contiguous => "a-contiguous",
            Case::Fragmented => "b-fragmented",
            Case::Half => "c-half",
        }
    }

    fn index(self) -> u64 {
        match self {
            Case::Contiguous => 0,
            Case::Fragmented => 1,
            Case::Half => 2,
        }
    }

    /// The local (decode) and remote (prefill) block ids of the case's request.
    pub fn tables(self) -> (Vec<usize>, Vec<usize>) {
        let seed = 1000 + 2 * self.index();
        (self.draw(seed), self.draw(seed + 1))
    }

    fn draw(self, seed: u64) -> Vec<usize> {
        let mut rng = SplitMix(seed);
        match self {
            Case::Contiguous => run(&mut rng, PER_REQUEST),
            Case::Fragmented => distinct(&mut rng, PER_REQUEST, Vec::new()),
            Case::Half => {
                let half = run(&mut rng, PER_REQUEST / 2);
                distinct(&mut rng, PER_REQUEST, half)
            }
        }
    }
}

/// `n` consecutive ids at a random start.
fn run(rng: &mut SplitMix, n: usize) -> Vec<usize> {
    let start = (rng.next() % (POOL - n + 1) as u64) as usize;
    (start..start + n).collect()
}

/// `ids` extended to `n` with random ids of the pool that it does not hold yet.
fn distinct(rng: &mut SplitMix, n: usize, mut ids: Vec<usize>) -> Vec<usize> {
    let mut used = vec![false; POOL];
    for &id in &ids {
        used[id] = true;
    }
    while ids.len() < n {
        let id = (rng.next() % POOL as u64) as usize;
        if !used[id] {
            used[id] = true;
            ids.push(id);
        }
    }
    ids
}

/// splitmix64 (identical to the Python bench).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Word `w` of block `block` of region `region` in the prefill's cache.
pub fn word(region: usize, block: usize, w: usize) -> u64 {
    (((region * POOL + block) as u64) << 16 | w as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Fills block `block` (of region `region`) held in `bytes` with its pattern.
pub fn fill(bytes: &mut [u8], region: usize, block: usize) {
    for (w, chunk) in bytes.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&word(region, block, w).to_le_bytes());
    }
}

/// Whether `bytes` hold block `block` of region `region` exactly.
pub fn holds(bytes: &[u8], region: usize, block: usize) -> bool {
    bytes
        .chunks_exact(8)
        .enumerate()
        .all(|(w, chunk)| chunk == word(region, block, w).to_le_bytes())
}

/// The descriptors a request reads, region by region, as (local block, remote block,
/// blocks) runs contiguous on both sides: NIXL merges consecutive indices of a prepared
/// list into such runs, and the CMA probe reads them.
pub fn runs(local: &[usize], remote: &[usize]) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for (&l, &r) in local.iter().zip(remote) {
        match out.last_mut() {
            Some((l0, r0, n)) if *l0 + *n == l && *r0 + *n == r => *n += 1,
            _ => out.push((l, r, 1)),
        }
    }
    out
}
