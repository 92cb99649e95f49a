//! The KV cache: `layers x blocks x block_bytes` of host memory, one registered region per
//! layer (as vLLM registers one tensor per layer), registered with exactly the configured
//! backends in a single call.

use nixl::kv_config::NixlSetup;
use nixl::{HostBuffer, LocalDescList, MemType, Registration, RemoteDescList, XferDesc};

use crate::error::{Error, Result};
use crate::pattern;
use crate::side_channel::CacheDescription;

/// Geometry of a KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Layers, one registered region each.
    pub layers: usize,
    /// Blocks per layer.
    pub blocks: usize,
    /// Bytes per block.
    pub block_bytes: usize,
}

impl KvLayout {
    /// Checks that every dimension is non-zero and fits the wire protocol.
    ///
    /// # Errors
    /// [`Error::Config`] naming the bad dimension.
    pub fn validate(&self) -> Result<()> {
        if self.layers == 0 || self.blocks == 0 || self.block_bytes == 0 {
            return Err(Error::Config(format!(
                "layers, blocks and block size must be non-zero, got {self:?}"
            )));
        }
        if self.layers > crate::side_channel::MAX_LAYERS {
            return Err(Error::Config(format!(
                "at most {} layers, got {}",
                crate::side_channel::MAX_LAYERS,
                self.layers
            )));
        }
        if u32::try_from(self.blocks).is_err() || self.layer_bytes().is_none() {
            return Err(Error::Config(format!("cache too large: {self:?}")));
        }
        Ok(())
    }

    /// Bytes of one layer's region.
    pub fn layer_bytes(&self) -> Option<usize> {
        self.blocks.checked_mul(self.block_bytes)
    }

    /// Bytes of the whole cache.
    pub fn total_bytes(&self) -> usize {
        self.layer_bytes()
            .unwrap_or(usize::MAX)
            .saturating_mul(self.layers)
    }

    /// Index of (layer, block) in a descriptor list laid out layer by layer.
    pub fn desc_index(&self, layer: usize, block: usize) -> usize {
        layer * self.blocks + block
    }
}

/// A registered KV cache in host memory.
#[derive(Debug)]
pub struct KvCache {
    layout: KvLayout,
    registration: Registration,
}

impl KvCache {
    /// Allocates one zeroed [`HostBuffer`] per layer and registers them all in one call
    /// through `setup`, i.e. with exactly the configured backends.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad layout or a setup whose memory type is not DRAM (the
    /// demo keeps its cache in host memory); allocation and registration errors.
    pub fn allocate(setup: &NixlSetup, layout: KvLayout) -> Result<Self> {
        layout.validate()?;
        if setup.mem_type() != MemType::Dram {
            return Err(Error::Config(format!(
                "the kv_transfer_config resolves to {} memory on this platform, but this demo \
                 keeps its KV cache in host memory: use \"kv_buffer_device\": \"cpu\"",
                setup.mem_type()
            )));
        }
        let layer_bytes = layout.layer_bytes().unwrap_or_default();
        let buffers = (0..layout.layers)
            .map(|_| HostBuffer::zeroed(layer_bytes))
            .collect::<nixl::Result<Vec<_>>>()?;
        let registration = setup.register_memory(buffers)?;
        tracing::info!(
            agent = setup.agent().name(),
            layers = layout.layers,
            blocks = layout.blocks,
            block_bytes = layout.block_bytes,
            "registered KV cache"
        );
        Ok(KvCache {
            layout,
            registration,
        })
    }

    /// The cache geometry.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The registration of all layers (region `i` is layer `i`).
    pub fn registration(&self) -> &Registration {
        &self.registration
    }

    /// What a peer needs to address this cache.
    pub fn describe(&self) -> CacheDescription {
        CacheDescription {
            blocks: u32::try_from(self.layout.blocks).unwrap_or(u32::MAX),
            block_bytes: self.layout.block_bytes as u64,
            bases: self
                .registration
                .regions()
                .iter()
                .map(|r| r.addr as u64)
                .collect(),
        }
    }

    /// One descriptor per (layer, block), layer by layer: index
    /// [`KvLayout::desc_index`]`(layer, block)`.
    pub fn local_desc_list(&self) -> Result<LocalDescList> {
        let l = self.layout;
        let mut list = LocalDescList::with_capacity(MemType::Dram, l.layers * l.blocks)?;
        for layer in 0..l.layers {
            list.push_blocks(&self.registration, layer, l.block_bytes, 0..l.blocks)?;
        }
        Ok(list)
    }

    /// Writes the pattern of `request` into `blocks` of every layer.
    pub fn fill_blocks(&self, blocks: &[u32], request: u64) -> Result<()> {
        let mut scratch = vec![0u8; self.layout.block_bytes];
        for layer in 0..self.layout.layers {
            for &block in blocks {
                pattern::fill(&mut scratch, layer as u32, block, request);
                self.registration
                    .write(layer, self.offset(block), &scratch)?;
            }
        }
        Ok(())
    }

    /// Flips one byte of `block` in layer 0, to show that corruption is caught.
    pub fn corrupt_block(&self, block: u32) -> Result<()> {
        let mut byte = [0u8; 1];
        self.registration.read(0, self.offset(block), &mut byte)?;
        byte[0] ^= 0xff;
        self.registration.write(0, self.offset(block), &byte)?;
        Ok(())
    }

    /// Checks local blocks `local[i]` of every layer against the pattern that prefill wrote
    /// into its block `remote[i]` for `request`; returns every mismatching block.
    pub fn verify_blocks(
        &self,
        local: &[u32],
        remote: &[u32],
        request: u64,
    ) -> Result<Vec<Mismatch>> {
        let mut scratch = vec![0u8; self.layout.block_bytes];
        let mut bad = Vec::new();
        for layer in 0..self.layout.layers {
            for (&lb, &rb) in local.iter().zip(remote) {
                self.registration
                    .read(layer, self.offset(lb), &mut scratch)?;
                if let Some(offset) = pattern::first_mismatch(&scratch, layer as u32, rb, request) {
                    bad.push(Mismatch {
                        request,
                        layer: layer as u32,
                        remote_block: rb,
                        offset,
                    });
                }
            }
        }
        Ok(bad)
    }

    fn offset(&self, block: u32) -> usize {
        block as usize * self.layout.block_bytes
    }
}

/// A block whose bytes differ from the expected pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mismatch {
    /// The request.
    pub request: u64,
    /// The layer.
    pub layer: u32,
    /// The prefill block the data came from.
    pub remote_block: u32,
    /// Offset of the first wrong byte in the block.
    pub offset: usize,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "request {} layer {} prefill block {}: first wrong byte at offset {}",
            self.request, self.layer, self.remote_block, self.offset
        )
    }
}

/// One remote descriptor per (layer, block) of a peer's cache, in the same order as
/// [`KvCache::local_desc_list`].
///
/// # Errors
/// [`Error::Protocol`] when the description's addresses overflow.
pub fn remote_desc_list(cache: &CacheDescription) -> Result<RemoteDescList> {
    let block_bytes = usize::try_from(cache.block_bytes)
        .map_err(|_| Error::Protocol("block size does not fit this machine".into()))?;
    let mut list = RemoteDescList::new(MemType::Dram)?;
    for &base in &cache.bases {
        for block in 0..cache.blocks as usize {
            let addr = block
                .checked_mul(block_bytes)
                .and_then(|off| usize::try_from(base).ok()?.checked_add(off))
                .ok_or_else(|| Error::Protocol("remote cache addresses overflow".into()))?;
            list.push(XferDesc::new(addr, block_bytes, 0))?;
        }
    }
    Ok(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_checks() {
        let ok = KvLayout {
            layers: 2,
            blocks: 3,
            block_bytes: 4,
        };
        ok.validate().unwrap();
        assert_eq!(ok.total_bytes(), 24);
        assert_eq!(ok.desc_index(1, 2), 5);
        assert!(KvLayout { layers: 0, ..ok }.validate().is_err());
        assert!(KvLayout {
            block_bytes: usize::MAX,
            ..ok
        }
        .validate()
        .is_err());
    }
}
