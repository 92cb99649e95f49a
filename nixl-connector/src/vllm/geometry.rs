//! A vLLM rank's KV geometry as the connector models it: [`NixlAgentMetadata`] converted
//! into a [`KvCacheSpec`] (each region's block length, blocks, tokens per block, layout),
//! which [`check_compatible`](crate::check_compatible) and the [`TpMapping`](crate::TpMapping)
//! work on with the TP sizes of the two engines.

use super::payload::NixlAgentMetadata;
use crate::error::{Error, Result};
use crate::geometry::groups::SHARED_REGION;
use crate::geometry::spec::{KvAttention, KvCacheSpec, KvLayout, KvRegion, KvRegionKind};
use crate::geometry::ssm::SsmState;

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
    /// (`_logical_to_kernel_block_ids`). Each region is one tensor: vLLM 0.33 registers one
    /// region per layer, K and V packed per head and token in `LBHNC`
    /// ([`KvCacheSpec::lbhnc`]), or one latent for MLA.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for what the connector does not read: Mamba state
    /// (`ssm_sizes`; read for KV cache groups with an SSM group), PLE state (`ple_block_len`), regions packing several layers
    /// (`packed_member_layouts`), decode or prefill context parallelism, regions of different block
    /// counts, padded blocks (a stride other than the length), a layout other than HND or
    /// NHD (`"HND"`, `"LBHNC"`; `"NHD"`, `"LBNHC"`), regions of different KV cache groups
    /// (`region_group_ids` that differ: groups sharing every region are read, see
    /// [`crate::KvCacheGroups`]), or counts that do not fit.
    pub fn kv_cache_spec(&self, attention: KvAttention) -> Result<KvCacheSpec> {
        self.kv_cache_spec_for(attention, &[], None)
    }

    /// [`kv_cache_spec`](Self::kv_cache_spec) for a reader whose KV cache groups have
    /// regions of their own, `ours` each region's group
    /// ([`KvCacheGroups::region_groups`](crate::KvCacheGroups::region_groups); empty: none):
    /// the rank's `region_group_ids` must be the same (vLLM's `_read_blocks_for_req` reads
    /// region-mapped groups only between equal layouts). With SSM groups, `ssm` is this
    /// engine's state ([`KvCacheGroups::ssm_state`](crate::KvCacheGroups::ssm_state)), its
    /// TP size and the rank's: the rank's `ssm_sizes` must be the state scaled from one TP
    /// to the other (every rank holds a TP-th of each part; vLLM's reads of each rank's
    /// slice); without, the rank must have no Mamba state.
    pub(crate) fn kv_cache_spec_for(
        &self,
        attention: KvAttention,
        ours: &[i64],
        ssm: Option<(&SsmState, usize, usize)>,
    ) -> Result<KvCacheSpec> {
        self.check_ssm_sizes(ssm)?;
        self.check_no_other_state()?;
        let regions = self.checked_regions()?;
        self.check_region_groups(regions, ours)?;
        self.check_region_blocks(regions)?;
        let layout = self.layout()?;
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

    /// Refuses `ssm_sizes` that are not `ssm`'s state scaled from the reader's TP to the
    /// rank's (`ssm`: the reader's state, its TP size and the rank's), or any Mamba state
    /// without `ssm`.
    fn check_ssm_sizes(&self, ssm: Option<(&SsmState, usize, usize)>) -> Result<()> {
        let scaled = |bytes: usize, (reader_tp, source_tp): (usize, usize)| {
            let total = bytes.checked_mul(reader_tp)?;
            (source_tp > 0 && total % source_tp == 0).then(|| (total / source_tp) as u64)
        };
        let expected = ssm.map_or(Some((0, 0)), |(state, reader_tp, source_tp)| {
            let (conv, temporal) = state.ssm_sizes();
            let tp = (reader_tp, source_tp);
            Some((scaled(conv, tp)?, scaled(temporal, tp)?))
        });
        if expected == Some(self.ssm_sizes) {
            return Ok(());
        }
        Err(refuse(match ssm {
            None => format!(
                "Mamba state (ssm_sizes {:?}) needs KV cache groups with an ssm group and its ssm_state here",
                self.ssm_sizes
            ),
            Some((state, reader_tp, source_tp)) => format!(
                "ssm_sizes {:?} (source, TP {source_tp}) vs the reader's {:?} at TP {reader_tp}: every rank holds a TP-th of the state, so both engines must serve the same model",
                self.ssm_sizes,
                state.ssm_sizes()
            ),
        }))
    }

    /// Refuses the state the connector does not read: PLE state, and regions packing
    /// several layers. (Context parallelism is checked against the reader's: see
    /// `pcp_refusal` and the handshake's check.)
    fn check_no_other_state(&self) -> Result<()> {
        if let Some(len) = self.ple_block_len {
            return Err(refuse(format!(
                "PLE short-conv state (ple_block_len {len}) is not supported"
            )));
        }
        if !self.packed_member_layouts.is_empty() {
            return Err(refuse(format!(
                "regions packing several layers ({} packed members) are not supported",
                self.packed_member_layouts.len()
            )));
        }
        Ok(())
    }

    /// The number of regions (base addresses), once every region has a block length and a
    /// stride.
    fn checked_regions(&self) -> Result<usize> {
        let regions = self.kv_caches_base_addr.len();
        if self.block_lens.len() != regions || self.block_strides.len() != regions {
            return Err(refuse(format!(
                "{} block lengths and {} strides for {regions} regions",
                self.block_lens.len(),
                self.block_strides.len()
            )));
        }
        Ok(regions)
    }

    /// Refuses `region_group_ids` that are not one per region of `regions`, or that differ
    /// from `ours` (the reader's, empty when its groups share every region): without
    /// `ours`, the rank's must all be the same.
    fn check_region_groups(&self, regions: usize, ours: &[i64]) -> Result<()> {
        let Some(groups) = &self.region_group_ids else {
            if ours.is_empty() {
                return Ok(());
            }
            return Err(refuse(format!(
                "no region_group_ids, while this engine's KV cache groups have regions of their own ({ours:?})"
            )));
        };
        let uniform = groups.windows(2).all(|w| w[0] == w[1]);
        if groups.len() != regions || (ours.is_empty() && !uniform) {
            return Err(refuse(format!(
                "regions of different KV cache groups (region_group_ids {groups:?}) need the same groups here: give kv_cache_groups the region_groups of the prefill's layers (without them, only one group, or groups sharing every region, {SHARED_REGION} for each, are read)"
            )));
        }
        if !ours.is_empty() && groups != ours {
            return Err(refuse(format!(
                "region_group_ids {groups:?} (source) vs {ours:?} (reader): both engines must register the same layers per KV cache group"
            )));
        }
        Ok(())
    }

    /// Refuses regions of different block counts, and padded blocks (a stride other than
    /// the block length).
    fn check_region_blocks(&self, regions: usize) -> Result<()> {
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
        Ok(())
    }

    /// The layout `kv_cache_layout` names (`"HND"`, `"LBHNC"`; `"NHD"`, `"LBNHC"`).
    fn layout(&self) -> Result<KvLayout> {
        match self.kv_cache_layout.as_str() {
            "HND" | "LBHNC" => Ok(KvLayout::Hnd),
            "NHD" | "LBNHC" => Ok(KvLayout::Nhd),
            other => Err(refuse(format!(
                "kv_cache_layout {other:?} is not supported (HND or NHD)"
            ))),
        }
    }
}

/// The refusal of metadata the connector does not read, saying `why`.
fn refuse(why: String) -> Error {
    Error::invalid(OP, why)
}

/// `n`, a count named `what`, as a `usize`.
fn size(what: &str, n: u64) -> Result<usize> {
    usize::try_from(n).map_err(|_| refuse(format!("{what} {n} does not fit")))
}

/// What a rank of this connector tells vLLM decodes about its KV cache.
pub(crate) struct RankRegistration<'a> {
    /// The engine's id.
    pub engine_id: &'a str,
    /// The agent's full metadata.
    pub agent_metadata: Vec<u8>,
    /// Each region's base address.
    pub base_addrs: Vec<u64>,
    /// The registered geometry.
    pub spec: &'a KvCacheSpec,
    /// The device id NIXL describes the memory with.
    pub device_id: u64,
    /// The memory type's name, e.g. `"DRAM"`.
    pub mem_type: String,
    /// The attention backend's name vLLM would give (from the compatibility factors).
    pub attn_backend_name: String,
    /// Each region's KV cache group, as vLLM's `region_group_ids`
    /// ([`KvCacheGroups`](crate::KvCacheGroups)).
    pub region_group_ids: Vec<i64>,
    /// Kernel blocks (the registered ones) per block id of the engine's scheduler (vLLM's
    /// `physical_blocks_per_logical_kv_block`).
    pub blocks_per_logical: usize,
    /// The engine's DCP size (vLLM's `dcp_size`; 1: none).
    pub dcp_size: u64,
    /// The engine's PCP size (vLLM's `pcp_size`; 1: none).
    pub pcp_size: u64,
}

impl NixlAgentMetadata {
    /// The metadata of a rank registered with `rank.spec`, as vLLM 0.33's prefill writes it:
    /// every region of all the blocks, each with its KV cache group (`region_group_ids`: 0
    /// for one group; for a hybrid model each region's group, or vLLM's
    /// `_SHARED_REGION_GROUP_ID`, -1, as its `register_kv_caches` marks a tensor that layers
    /// of several groups use), unpadded
    /// (`block_strides` = `block_lens`), the layout by vLLM's name (`"LBHNC"` for HND,
    /// `"LBNHC"` for NHD), the kernel blocks per block id it gives, no Mamba state (the
    /// registration adds the `ssm_sizes` of SSM groups), the DCP size of its handshake
    /// (vLLM's `dcp_size`), its PCP size (`pcp_size`), and no region names (a vLLM decode
    /// compares them with its layer names only when they are given).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for regions holding K and V halves
    /// ([`KvRegionKind::KvHalves`]), which vLLM's metadata cannot say.
    pub(crate) fn of_rank(rank: RankRegistration<'_>) -> Result<Self> {
        let spec = rank.spec;
        if let Some(r) = spec
            .regions
            .iter()
            .position(|region| region.kind == KvRegionKind::KvHalves)
        {
            return Err(Error::invalid(
                "describe the KV caches to vLLM",
                format!("region {r} holds K and V halves in one block, which vLLM's NixlAgentMetadata cannot say; register each layer as one region with K and V packed per head and token (vLLM's LBHNC, KvCacheSpec::lbhnc)"),
            ));
        }
        let regions = spec.num_regions();
        let lens: Vec<u64> = spec.regions.iter().map(|r| r.block_len as u64).collect();
        Ok(NixlAgentMetadata {
            engine_id: rank.engine_id.to_string(),
            agent_metadata: rank.agent_metadata,
            kv_caches_base_addr: rank.base_addrs,
            device_id: rank.device_id,
            num_blocks: spec.num_blocks as u64,
            block_strides: lens.clone(),
            block_lens: lens,
            kv_cache_layout: match spec.layout {
                KvLayout::Hnd => "LBHNC",
                KvLayout::Nhd => "LBNHC",
            }
            .to_string(),
            block_size: spec.block_size as u64,
            ssm_sizes: (0, 0),
            attn_backend_name: rank.attn_backend_name,
            physical_blocks_per_logical_kv_block: rank.blocks_per_logical as u64,
            region_num_blocks: Some(vec![spec.num_blocks as u64; regions]),
            region_group_ids: Some(rank.region_group_ids),
            region_names: None,
            region_mem_types: Some(vec![rank.mem_type; regions]),
            dcp_size: rank.dcp_size,
            pcp_size: rank.pcp_size,
            ..NixlAgentMetadata::default()
        })
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
    fn a_ranks_own_metadata_is_the_spec_it_registered() {
        let heads = KvAttention::Mha { total_kv_heads: 8 };
        for (layout, group_id) in [
            (KvLayout::Hnd, 0),
            (KvLayout::Nhd, 0),
            (KvLayout::Hnd, SHARED_REGION),
        ] {
            let spec = KvCacheSpec::uniform(3, 64, 16, heads, layout, 4096);
            let meta = NixlAgentMetadata::of_rank(RankRegistration {
                engine_id: "e",
                agent_metadata: vec![1],
                base_addrs: vec![1 << 20, 2 << 20, 3 << 20],
                spec: &spec,
                device_id: 0,
                mem_type: "DRAM".into(),
                attn_backend_name: "FLASH_ATTN".into(),
                region_group_ids: vec![group_id; 3],
                blocks_per_logical: 1,
                dcp_size: 1,
                pcp_size: 1,
            })
            .unwrap();
            assert_eq!(meta.kv_cache_spec(heads).unwrap(), spec);
            assert_eq!(meta.region_group_ids, Some(vec![group_id; 3]));
            assert_eq!(meta.region_names, None);
        }
        let halves = KvCacheSpec {
            regions: vec![KvRegion {
                block_len: 4096,
                kind: KvRegionKind::KvHalves,
            }],
            ..KvCacheSpec::uniform(1, 8, 16, heads, KvLayout::Hnd, 4096)
        };
        let err = NixlAgentMetadata::of_rank(RankRegistration {
            engine_id: "e",
            agent_metadata: vec![],
            base_addrs: vec![1 << 20],
            spec: &halves,
            device_id: 0,
            mem_type: "DRAM".into(),
            attn_backend_name: String::new(),
            region_group_ids: vec![0],
            blocks_per_logical: 1,
            dcp_size: 1,
            pcp_size: 1,
        })
        .unwrap_err();
        assert!(err.to_string().contains("K and V halves"), "{err}");
    }

    #[test]
    fn regions_of_different_groups_are_read_only_between_equal_layouts() {
        let own = NixlAgentMetadata {
            region_group_ids: Some(vec![0, 1]),
            ..metadata()
        };
        assert!(own
            .kv_cache_spec_for(KvAttention::Mla, &[0, 1], None)
            .is_ok());
        let err = own
            .kv_cache_spec_for(KvAttention::Mla, &[1, 0], None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("region_group_ids [0, 1] (source) vs [1, 0] (reader)"),
            "{err}"
        );
        let err = own.kv_cache_spec(KvAttention::Mla).unwrap_err().to_string();
        assert!(
            err.contains("give kv_cache_groups the region_groups"),
            "{err}"
        );
        let shared = NixlAgentMetadata {
            region_group_ids: Some(vec![-1, -1]),
            ..metadata()
        };
        assert!(shared.kv_cache_spec(KvAttention::Mla).is_ok());
        assert!(shared
            .kv_cache_spec_for(KvAttention::Mla, &[0, 1], None)
            .is_err());
        let err = metadata()
            .kv_cache_spec_for(KvAttention::Mla, &[0, 1], None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no region_group_ids"), "{err}");
    }

    #[test]
    fn mamba_state_is_read_only_with_the_same_ssm_sizes() {
        let state = SsmState::new(vec![24, 8, 8], 64).unwrap();
        let mamba = NixlAgentMetadata {
            ssm_sizes: (40, 64),
            ..metadata()
        };
        assert!(mamba
            .kv_cache_spec_for(KvAttention::Mla, &[], Some((&state, 1, 1)))
            .is_ok());
        // A decode of twice the TP reads half of each part.
        let half = SsmState::new(vec![12, 4, 4], 32).unwrap();
        assert!(mamba
            .kv_cache_spec_for(KvAttention::Mla, &[], Some((&half, 2, 1)))
            .is_ok());
        // A decode of half the TP reads twice each part, from two ranks.
        let double = SsmState::new(vec![48, 16, 16], 128).unwrap();
        assert!(mamba
            .kv_cache_spec_for(KvAttention::Mla, &[], Some((&double, 1, 2)))
            .is_ok());
        // Parts that do not split over the TP sizes.
        let odd = SsmState::new(vec![49, 16, 16], 128).unwrap();
        assert!(mamba
            .kv_cache_spec_for(KvAttention::Mla, &[], Some((&odd, 1, 2)))
            .is_err());
        let err = mamba
            .kv_cache_spec(KvAttention::Mla)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("needs KV cache groups with an ssm group"),
            "{err}"
        );
        let other = SsmState::new(vec![12, 4, 4], 32).unwrap();
        let err = mamba
            .kv_cache_spec_for(KvAttention::Mla, &[], Some((&other, 1, 1)))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("ssm_sizes (40, 64) (source, TP 1) vs the reader's (20, 32) at TP 1"),
            "{err}"
        );
        let err = metadata()
            .kv_cache_spec_for(KvAttention::Mla, &[], Some((&state, 1, 1)))
            .unwrap_err()
            .to_string();
        assert!(err.contains("ssm_sizes (0, 0) (source, TP 1)"), "{err}");
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
                    ple_block_len: Some(64),
                    ..metadata()
                },
                "PLE short-conv state",
            ),
            (
                NixlAgentMetadata {
                    packed_member_layouts: [("l".to_string(), (0, 1))].into(),
                    ..metadata()
                },
                "packing several layers",
            ),
            (
                NixlAgentMetadata {
                    region_group_ids: Some(vec![0, -1]),
                    ..metadata()
                },
                "regions of different KV cache groups (region_group_ids [0, -1]) need the same groups here",
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
