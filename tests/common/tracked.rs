//! DRAM that records when it is freed (shared with the connector's tests).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use nixl::{MemType, RegDesc, RegisterMemory};

/// DRAM that records when it is freed.
pub struct Tracked {
    bytes: Vec<u8>,
    freed: Arc<AtomicBool>,
}

impl Tracked {
    /// `bytes` as DRAM to register, and the flag its drop sets.
    pub fn new(bytes: Vec<u8>) -> (Self, Arc<AtomicBool>) {
        let freed = Arc::new(AtomicBool::new(false));
        let tracked = Tracked {
            bytes,
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

// SAFETY: the Vec's heap buffer does not move with the value and is freed only on drop;
// the address comes from `&mut self`.
unsafe impl RegisterMemory for Tracked {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn regions(&mut self) -> Vec<RegDesc> {
        vec![RegDesc {
            addr: self.bytes.as_mut_ptr() as usize,
            len: self.bytes.len(),
            dev_id: 0,
            metadata: Vec::new(),
        }]
    }
}
