//! DRAM that records when it is freed (shared with the connector's tests).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use nixl::{MemType, RegDesc, RegisterMemory};

/// DRAM (one or more regions) that records when it is freed.
pub struct Tracked {
    regions: Vec<Vec<u8>>,
    freed: Arc<AtomicBool>,
}

impl Tracked {
    /// `bytes` as one DRAM region to register, and the flag its drop sets.
    pub fn new(bytes: Vec<u8>) -> (Self, Arc<AtomicBool>) {
        Tracked::regions(vec![bytes])
    }

    /// Each of `regions` as a DRAM region, and the flag their drop sets.
    pub fn regions(regions: Vec<Vec<u8>>) -> (Self, Arc<AtomicBool>) {
        let freed = Arc::new(AtomicBool::new(false));
        let tracked = Tracked {
            regions,
            freed: freed.clone(),
        };
        (tracked, freed)
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.freed.store(true, Ordering::SeqCst);
    }
}

// SAFETY: the Vecs' heap buffers do not move with the value and are freed only on drop;
// the addresses come from `&mut self`.
unsafe impl RegisterMemory for Tracked {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn regions(&mut self) -> Vec<RegDesc> {
        self.regions
            .iter_mut()
            .map(|bytes| RegDesc {
                addr: bytes.as_mut_ptr() as usize,
                len: bytes.len(),
                dev_id: 0,
                metadata: Vec::new(),
            })
            .collect()
    }
}
