//! One engine's block pool: every block freed is poisoned, and checked to be still poisoned
//! (or never used) when it is taken again; the pattern each request's blocks hold.

use nixl_connector::{KvCacheSpec, KvConnectorWorker};

/// Blocks per cache: enough for a few dozen requests in flight.
pub const BLOCKS: usize = 64;
/// The byte every freed block is filled with.
pub const POISON: u8 = 0xEE;

/// The byte at `offset` of the `index`th block of request `seed`, region `region`: never
/// the poison.
pub fn byte(seed: u64, index: usize, region: usize, offset: usize) -> u8 {
    let x = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((index * 7919 + region * 104_729 + offset * 31) as u64);
    match (x ^ (x >> 29)) as u8 {
        POISON => 0x11,
        b => b,
    }
}

/// One engine's blocks: the free ones, and the cache they live in.
pub struct Pool {
    pub free: Vec<usize>,
    spec: KvCacheSpec,
}

impl Pool {
    pub fn new(spec: &KvCacheSpec) -> Pool {
        Pool {
            free: (0..BLOCKS).rev().collect(),
            spec: spec.clone(),
        }
    }

    /// `n` free blocks of the engine of `ranks`; counts in `late` each rank's block that
    /// something wrote since it was poisoned (a READ that landed after its load's outcome
    /// handed the block back).
    pub fn take(
        &mut self,
        ranks: &[KvConnectorWorker],
        n: usize,
        late: &mut u64,
    ) -> Option<Vec<usize>> {
        if self.free.len() < n {
            return None;
        }
        let blocks = self.free.split_off(self.free.len() - n);
        for rank in ranks {
            let cache = rank.kv_caches().unwrap();
            for &b in &blocks {
                // (A pipeline stage's rank holds its layers only.)
                for region in 0..cache.regions().len() {
                    let len = self.spec.block_len(region);
                    let mut got = vec![0u8; len];
                    cache.read(region, b * len, &mut got).unwrap();
                    // Never used (zero) or poisoned when freed, and untouched since.
                    if !(got.iter().all(|&x| x == POISON) || got.iter().all(|&x| x == 0)) {
                        *late += 1;
                    }
                }
            }
        }
        Some(blocks)
    }

    /// Poisons `blocks` in every rank's cache and gives them back; counts a block freed
    /// twice.
    pub fn give(&mut self, ranks: &[KvConnectorWorker], blocks: &[usize], twice: &mut u64) {
        for &b in blocks {
            if self.free.contains(&b) {
                *twice += 1;
                continue;
            }
            for rank in ranks {
                let cache = rank.kv_caches().unwrap();
                for region in 0..cache.regions().len() {
                    let len = self.spec.block_len(region);
                    cache.write(region, b * len, &vec![POISON; len]).unwrap();
                }
            }
            self.free.push(b);
        }
    }

    /// Writes request `seed`'s pattern into `blocks` of `worker`, whose first region is the
    /// model's region `first` (a pipeline stage's first layer).
    pub fn fill(&self, (worker, first): (&KvConnectorWorker, usize), seed: u64, blocks: &[usize]) {
        let cache = worker.kv_caches().unwrap();
        for (index, &b) in blocks.iter().enumerate() {
            for region in 0..cache.regions().len() {
                let len = self.spec.block_len(region);
                let global = first + region;
                let data: Vec<u8> = (0..len).map(|o| byte(seed, index, global, o)).collect();
                cache.write(region, b * len, &data).unwrap();
            }
        }
    }
}
