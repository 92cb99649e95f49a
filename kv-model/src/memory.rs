//! The bytes a paged KV cache lives in: the registered regions themselves.

/// Regions of bytes a [`PagedKv`](crate::PagedKv) reads and writes in place.
pub trait KvMemory {
    /// Copies `out.len()` bytes of region `region` from `offset` into `out`.
    ///
    /// # Panics
    /// If the range lies outside the region.
    fn read(&self, region: usize, offset: usize, out: &mut [u8]);

    /// Copies `data` into region `region` at `offset`.
    ///
    /// # Panics
    /// If the range lies outside the region.
    fn write(&mut self, region: usize, offset: usize, data: &[u8]);
}

/// Plain regions in this process's heap (the unit tests' pages).
impl KvMemory for Vec<Vec<u8>> {
    fn read(&self, region: usize, offset: usize, out: &mut [u8]) {
        out.copy_from_slice(&self[region][offset..offset + out.len()]);
    }

    fn write(&mut self, region: usize, offset: usize, data: &[u8]) {
        self[region][offset..offset + data.len()].copy_from_slice(data);
    }
}

/// A worker's registered DRAM regions (`KvConnectorWorker::kv_caches`): the bytes NIXL
/// moves are the bytes attention reads.
impl KvMemory for &nixl::Registration {
    fn read(&self, region: usize, offset: usize, out: &mut [u8]) {
        nixl::Registration::read(self, region, offset, out)
            .unwrap_or_else(|err| panic!("read KV region {region} at {offset}: {err}"));
    }

    fn write(&mut self, region: usize, offset: usize, data: &[u8]) {
        nixl::Registration::write(self, region, offset, data)
            .unwrap_or_else(|err| panic!("write KV region {region} at {offset}: {err}"));
    }
}
