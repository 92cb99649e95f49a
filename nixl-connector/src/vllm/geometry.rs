//! A vLLM rank's KV geometry as the connector models it: [`NixlAgentMetadata`] converted
//! into a [`KvCacheSpec`] (each region's block length, blocks, tokens per block, layout),
//! which [`check_compatible`](crate::check_compatible) and the [`TpMapping`](crate::TpMapping)
//! work on with the TP sizes of the two engines.

use super::payload::NixlAgentMetadata;
use crate::error::{Error, Result};
use crate::spec::{KvAttention, KvCacheSpec, KvLayout, KvRegion, KvRegionKind};

const OP: &str = "convert vLLM's NixlAgentMetadata";

impl NixlAgentMetadata {
    /// The [`KvCacheSpec`] this rank's metadata describes, for a model serving `attention`.
    /// vLLM's handshake names neither the KV heads nor MLA: both engines serve the same
    /// model (the compatibility hash checks it), so the decode's own `attention` holds for
    /// the prefill too.
    ///
    /// `block_size` and `num_blocks` are the kernel's (vLLM already multiplied the blocks by
    /// `physical_blocks_per_logical_kv_block`); a logical block id `b` of the prefill's
    /// `kv_transfer_params` is its kernel blocks `b * ratio .. (b + 1) * ratio`
    /// (`_logical_to_kernel_block_ids`). Each region is one tensor (vLLM 0.33 registers K
    /// and V apart, or one latent).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for what the connector does not read: Mamba state
    /// (`ssm_sizes`), decode or prefill context parallelism, regions of different block
    /// counts, padded blocks (a stride other than the length), a layout other than HND or
    /// NHD (`"HND"`, `"LBHNC"`; `"NHD"`, `"LBNHC"`), or counts that do not fit.
    pub fn kv_cache_spec(&self, attention: KvAttention) -> Result<KvCacheSpec> {
        let refuse = |why: String| Error::invalid(OP, why);
        if self.ssm_sizes != (0, 0) {
            return Err(refuse(format!(
                "Mamba state (ssm_sizes {:?}) is not supported",
                self.ssm_sizes
            )));
        }
        if self.dcp_size != 1 || self.pcp_size != 1 {
            return Err(refuse(format!(
                "context parallelism (dcp_size {}, pcp_size {}) is not supported",
                self.dcp_size, self.pcp_size
            )));
        }
        let regions = self.kv_caches_base_addr.len();
        if self.block_lens.len() != regions || self.block_strides.len() != regions {
            return Err(refuse(format!(
                "{} block lengths and {} strides for {regions} regions",
                self.block_lens.len(),
                self.block_strides.len()
            )));
        }
        if let Some(counts) = &self.region_num_blocks {
            if counts.iter().any(|&n| n != self.num_blocks) || counts.len() != regions {
                return Err(refuse(format!(
                    "regions of different block counts ({counts:?}) are not supported"
                )));
            }
        }
        if let Some(region) = (0..regions).find(|&r| self.block_strides[r] != self.block_lens[r]) {
            return Err(refuse(format!(
                "region {region}: blocks {} bytes apart holding {} bytes (padded blocks) are not supported",
                self.block_strides[region], self.block_lens[region]
            )));
        }
        let layout = match self.kv_cache_layout.as_str() {
            "HND" | "LBHNC" => KvLayout::Hnd,
            "NHD" | "LBNHC" => KvLayout::Nhd,
            other => {
                return Err(refuse(format!(
                    "kv_cache_layout {other:?} is not supported (HND or NHD)"
                )))
            }
        };
        let size = |what: &str, n: u64| {
            usize::try_from(n).map_err(|_| refuse(format!("{what} {n} does not fit")))
        };
        let spec = KvCacheSpec {
            num_blocks: size("num_blocks", self.num_blocks)?,
            block_size: size("block_size", self.block_size)?,
            attention,
            layout,
            regions: self
                .block_lens
                .iter()
                .map(|&len| {
                    Ok(KvRegion {
                        block_len: size("a block length", len)?,
                        kind: KvRegionKind::Tensor,
                    })
                })
                .collect::<Result<_>>()?,
        };
        spec.validate()?;
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata() -> NixlAgentMetadata {
        NixlAgentMetadata {
            kv_caches_base_addr: vec![1 << 20, 2 << 20],
            num_blocks: 64,
            block_lens: vec![8192, 4096],
            block_strides: vec![8192, 4096],
            kv_cache_layout: "HND".to_string(),
            block_size: 16,
            ..NixlAgentMetadata::default()
        }
    }

    #[test]
    fn the_metadata_of_a_rank_is_a_spec_of_its_regions() {
        let spec = metadata().kv_cache_spec(KvAttention::Mla).unwrap();
        assert_eq!((spec.num_blocks, spec.block_size), (64, 16));
        assert_eq!((spec.block_len(0), spec.block_len(1)), (8192, 4096));
        assert_eq!(spec.layout, KvLayout::Hnd);
        let nhd = NixlAgentMetadata {
            kv_cache_layout: "LBNHC".to_string(),
            ..metadata()
        };
        let mha = KvAttention::Mha { total_kv_heads: 8 };
        assert_eq!(nhd.kv_cache_spec(mha).unwrap().layout, KvLayout::Nhd);
    }

    #[test]
    fn what_the_connector_does_not_read_is_refused_by_name() {
        let cases = [
            (
                NixlAgentMetadata {
                    ssm_sizes: (1, 2),
                    ..metadata()
                },
                "Mamba state",
            ),
            (
                NixlAgentMetadata {
                    dcp_size: 2,
                    ..metadata()
                },
                "context parallelism",
            ),
            (
                NixlAgentMetadata {
                    block_strides: vec![8192, 8192],
                    ..metadata()
                },
                "region 1: blocks 8192 bytes apart holding 4096 bytes",
            ),
            (
                NixlAgentMetadata {
                    region_num_blocks: Some(vec![64, 32]),
                    ..metadata()
                },
                "different block counts",
            ),
            (
                NixlAgentMetadata {
                    kv_cache_layout: "XYZ".to_string(),
                    ..metadata()
                },
                "kv_cache_layout \"XYZ\"",
            ),
            (
                NixlAgentMetadata {
                    block_lens: vec![8192],
                    ..metadata()
                },
                "1 block lengths and 2 strides for 2 regions",
            ),
        ];
        for (meta, reason) in cases {
            let err = meta
                .kv_cache_spec(KvAttention::Mla)
                .unwrap_err()
                .to_string();
            assert!(err.contains(reason), "{err}");
        }
    }
}
