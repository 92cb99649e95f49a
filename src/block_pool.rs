//! A free list of KV-cache block indices.

/// Hands out block indices `0..capacity` and takes them back, refusing double frees.
#[derive(Debug, Clone)]
pub struct BlockPool {
    free: Vec<u32>,
    in_use: Vec<bool>,
}

impl BlockPool {
    /// A pool with every block of `0..capacity` free; the lowest indices go out first.
    pub fn new(capacity: u32) -> Self {
        BlockPool {
            free: (0..capacity).rev().collect(),
            in_use: vec![false; capacity as usize],
        }
    }

    /// Takes `count` free blocks, or none when fewer are free.
    pub fn alloc(&mut self, count: usize) -> Option<Vec<u32>> {
        if count > self.free.len() {
            return None;
        }
        let blocks = self.free.split_off(self.free.len() - count);
        for &b in &blocks {
            self.in_use[b as usize] = true;
        }
        Some(blocks.into_iter().rev().collect())
    }

    /// Returns blocks to the pool; an index that is out of range or not in use is skipped
    /// and reported in the returned count of rejected indices.
    pub fn free(&mut self, blocks: &[u32]) -> usize {
        let mut rejected = 0;
        for &b in blocks {
            match self.in_use.get_mut(b as usize) {
                Some(used) if *used => {
                    *used = false;
                    self.free.push(b);
                }
                _ => rejected += 1,
            }
        }
        rejected
    }

    /// Number of free blocks.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// Number of blocks in the pool.
    pub fn capacity(&self) -> usize {
        self.in_use.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_and_free() {
        let mut pool = BlockPool::new(4);
        assert_eq!(pool.alloc(3).unwrap(), [0, 1, 2]);
        assert!(pool.alloc(2).is_none());
        assert_eq!(pool.free(&[1]), 0);
        assert_eq!(pool.available(), 2);
        assert_eq!(pool.free(&[1, 9]), 2, "double free and out of range");
        let mut got = pool.alloc(2).unwrap();
        got.sort_unstable();
        assert_eq!(got, [1, 3]);
        assert_eq!(pool.capacity(), 4);
    }
}
