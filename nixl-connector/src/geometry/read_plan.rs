//! How a reader rank's blocks take their bytes from one source rank, region by region: the
//! pieces of a unit (see [`block_map`](crate::geometry::block_map)) on both sides, and the prepared
//! descriptor lists and indices built from them.
//!
//! A piece is a run of bytes contiguous on both sides. With equal block sizes a head slice
//! is one piece per K/V half in HND (vLLM's `_build_fa_remote`: the heads at the rank's
//! offset); with different block sizes, one piece per head and half, since a head's tokens
//! of a smaller block are a contiguous run inside the larger block's head (where vLLM
//! instead reads blocks whole and permutes them on the GPU afterwards). MLA and NHD blocks
//! with every head give one piece per unit: tokens are outermost. Adjacent pieces are
//! merged, so a homogeneous geometry reads whole blocks, as the registration's own list
//! describes them.

use nixl::XferDesc;

use crate::geometry::block_map::BlockSizes;
use crate::geometry::dcp::DcpSizes;
use crate::geometry::region_layers::LayerRoute;
use crate::geometry::spec::{KvAttention, KvCacheSpec, KvLayout};
use crate::geometry::tp_mapping::{Share, TpMapping};

/// A run of bytes read in one descriptor: at `local_offset` of a local block and
/// `remote_offset` of a remote block (for a block's first unit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Offset in the local block.
    pub local_offset: usize,
    /// Offset in the remote block.
    pub remote_offset: usize,
    /// Bytes.
    pub len: usize,
}

/// How one region is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionPlan {
    /// The pieces of a block's first unit, in order; unit `s` of a block adds
    /// `s * local_unit_stride` and `s * remote_unit_stride` to the offsets.
    pub pieces: Vec<Piece>,
    /// Bytes from one local unit to the next inside a block.
    pub local_unit_stride: usize,
    /// Bytes from one remote unit to the next inside a block.
    pub remote_unit_stride: usize,
    /// The local block length.
    pub local_block_len: usize,
    /// The remote block length.
    pub remote_block_len: usize,
}

/// How this (reader) rank reads one compatible source rank, from
/// [`check_compatible`](crate::check_compatible).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadPlan {
    /// What the reader takes from the source ([`Share::NotifiedOnly`]: nothing, and
    /// `regions` is empty).
    pub share: Share,
    /// Tokens per local block.
    pub local_block_size: usize,
    /// Tokens per remote block.
    pub remote_block_size: usize,
    /// The source's blocks per region.
    pub remote_num_blocks: usize,
    /// Each region's pieces.
    pub regions: Vec<RegionPlan>,
    /// The reader's region that `regions[0]` is (not 0 when the reader's pipeline stage
    /// holds layers before those the source holds).
    pub local_first_region: usize,
    /// The source's region that `regions[0]` is (not 0 when the source's pipeline stage
    /// holds layers before those the reader holds).
    pub remote_first_region: usize,
    /// When the two ranks' regions pair by layer name (a pipeline stage of a hybrid model):
    /// `regions[k]` is layer `layer_routes[k]`, between the regions it names (and the two
    /// first regions above are not used). Empty: regions pair in order from the first ones.
    pub layer_routes: Vec<LayerRoute>,
}

impl ReadPlan {
    /// The plan for reader rank `reader_tp.0` of TP `reader_tp.1` holding `reader` to read
    /// from source rank `source_tp.0` of TP `source_tp.1` holding `source`, the two engines
    /// of DCP sizes `dcp`: what must match is compared region by region (vLLM's
    /// `_validate_remote_agent_handshake`), the first difference named; the pieces follow
    /// the [`TpMapping`] of the two TP and DCP sizes.
    ///
    /// # Errors
    /// Why the two cannot be read from one another.
    pub(crate) fn new(
        reader: &KvCacheSpec,
        reader_tp: (usize, usize),
        source: &KvCacheSpec,
        source_tp: (usize, usize),
        dcp: DcpSizes,
    ) -> std::result::Result<ReadPlan, String> {
        check_same_model(reader, source)?;
        let sizes = checked_block_sizes(reader, source)?;
        check_layouts(reader, source)?;
        let share = share_of_source(reader, reader_tp, source_tp, dcp)?;
        let mut regions = (0..reader.regions.len())
            .map(|index| {
                let region = Region::checked(index, (reader, reader_tp.1), (source, source_tp.1))?;
                region.plan(share, reader, source, sizes)
            })
            .collect::<std::result::Result<Vec<_>, String>>()?;
        if !share.reads() {
            regions.clear();
        }
        Ok(ReadPlan {
            share,
            local_block_size: sizes.local,
            remote_block_size: sizes.remote,
            remote_num_blocks: source.num_blocks,
            regions,
            local_first_region: 0,
            remote_first_region: 0,
            layer_routes: Vec::new(),
        })
    }

    /// The local region that `regions[k]` is.
    fn local_region(&self, k: usize) -> usize {
        self.layer_routes
            .get(k)
            .map_or(self.local_first_region + k, |r| r.local_region)
    }

    /// The source's region that `regions[k]` is.
    fn remote_region(&self, k: usize) -> usize {
        self.layer_routes
            .get(k)
            .map_or(self.remote_first_region + k, |r| r.remote_region)
    }

    /// The two sides' block sizes.
    pub(crate) fn block_sizes(&self) -> BlockSizes {
        BlockSizes {
            local: self.local_block_size,
            remote: self.remote_block_size,
        }
    }

    /// Whether every local block is read whole in one piece per region: then the local
    /// list is the registration's own (descriptor `region * num_blocks + block`).
    pub(crate) fn reads_whole_local_blocks(&self) -> bool {
        self.local_first_region == 0
            && self.layer_routes.is_empty()
            && self.block_sizes().local_units() == 1
            && self.regions.iter().all(|r| {
                r.pieces
                    == [Piece {
                        local_offset: 0,
                        remote_offset: r.pieces[0].remote_offset,
                        len: r.local_block_len,
                    }]
            })
    }

    /// Descriptors of the remote list: region by region, block by block, unit by unit, piece
    /// by piece, from the source's region base addresses (every region's; those of the
    /// plan's regions are read from `remote_first_region` on, or where `layer_routes` say).
    pub(crate) fn remote_descs(&self, bases: &[u64], device_id: u64) -> Vec<XferDesc> {
        let units = self.block_sizes().remote_units();
        let mut descs = Vec::with_capacity(self.remote_descriptors());
        let bases = (0..self.regions.len()).map_while(|k| bases.get(self.remote_region(k)));
        for (region, &base) in self.regions.iter().zip(bases) {
            for block in 0..self.remote_num_blocks {
                for unit in 0..units {
                    let start = base as usize
                        + block * region.remote_block_len
                        + unit * region.remote_unit_stride;
                    descs.extend(
                        region
                            .pieces
                            .iter()
                            .map(|p| XferDesc::new(start + p.remote_offset, p.len, device_id)),
                    );
                }
            }
        }
        descs
    }

    /// Descriptors of the local list, as (local region, offset in the region, length):
    /// region by region, block by block, unit by unit, piece by piece, over `num_blocks`
    /// local blocks, from `local_first_region` on (or where `layer_routes` say).
    pub(crate) fn local_descs(
        &self,
        num_blocks: usize,
    ) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let units = self.block_sizes().local_units();
        self.regions
            .iter()
            .enumerate()
            .flat_map(move |(index, region)| {
                (0..num_blocks * units).flat_map(move |unit| {
                    let start = unit / units * region.local_block_len
                        + unit % units * region.local_unit_stride;
                    region
                        .pieces
                        .iter()
                        .map(move |p| (self.local_region(index), start + p.local_offset, p.len))
                })
            })
    }

    /// Descriptors of the local list over `num_blocks` local blocks.
    pub(crate) fn local_descriptors(&self, num_blocks: usize) -> usize {
        self.descriptors(num_blocks.saturating_mul(self.block_sizes().local_units()))
    }

    /// Descriptors of the remote list.
    pub(crate) fn remote_descriptors(&self) -> usize {
        let units = self.block_sizes().remote_units();
        self.descriptors(self.remote_num_blocks.saturating_mul(units))
    }

    /// Descriptors of a list of `units` units per region (saturating: a peer's claims).
    fn descriptors(&self, units: usize) -> usize {
        self.regions.iter().fold(0usize, |sum, r| {
            sum.saturating_add(units.saturating_mul(r.pieces.len()))
        })
    }

    /// The descriptor indices of a READ of unit pairs `pairs` (local unit, remote unit) over
    /// the lists above, region by region, with `local_num_blocks` local blocks; and the
    /// bytes it moves.
    pub(crate) fn descriptor_ids(
        &self,
        local_num_blocks: usize,
        pairs: &[(usize, usize)],
    ) -> (Vec<usize>, Vec<usize>, usize) {
        self.descriptor_ids_in(local_num_blocks, |_| pairs)
    }

    /// [`descriptor_ids`](Self::descriptor_ids) with the unit pairs of each region its own:
    /// `pairs_of(region)` (the KV cache groups of a hybrid model whose regions are not all
    /// shared read only in their regions).
    pub(crate) fn descriptor_ids_in<'a>(
        &self,
        local_num_blocks: usize,
        pairs_of: impl Fn(usize) -> &'a [(usize, usize)],
    ) -> (Vec<usize>, Vec<usize>, usize) {
        let sizes = self.block_sizes();
        let (local_units, remote_units) = (
            local_num_blocks * sizes.local_units(),
            self.remote_num_blocks * sizes.remote_units(),
        );
        let descriptors: usize = (0..self.regions.len())
            .map(|r| self.regions[r].pieces.len() * pairs_of(r).len())
            .sum();
        let mut local = Vec::with_capacity(descriptors);
        let mut remote = Vec::with_capacity(descriptors);
        let mut bytes = 0;
        let (mut local_at, mut remote_at) = (0, 0);
        for (index, region) in self.regions.iter().enumerate() {
            let pairs = pairs_of(index);
            let n = region.pieces.len();
            for &(l, r) in pairs {
                local.extend((0..n).map(|k| local_at + l * n + k));
                remote.extend((0..n).map(|k| remote_at + r * n + k));
            }
            bytes += pairs.len() * region.pieces.iter().map(|p| p.len).sum::<usize>();
            local_at += local_units * n;
            remote_at += remote_units * n;
        }
        (local, remote, bytes)
    }
}

/// What a refusal of two engines that do not serve the same model adds.
const SAME_MODEL: &str = "both engines must serve the same model";

/// Refuses a source of another attention or region count than the reader's.
fn check_same_model(reader: &KvCacheSpec, source: &KvCacheSpec) -> std::result::Result<(), String> {
    if reader.attention != source.attention {
        return Err(format!(
            "attention: {} (reader) vs {} (source); {SAME_MODEL}",
            reader.attention, source.attention
        ));
    }
    if reader.regions.len() != source.regions.len() {
        return Err(format!(
            "regions: {} (reader) vs {} (source); {SAME_MODEL} with the same registration",
            reader.regions.len(),
            source.regions.len()
        ));
    }
    Ok(())
}

/// The two sides' block sizes, one of which must divide the other.
fn checked_block_sizes(
    reader: &KvCacheSpec,
    source: &KvCacheSpec,
) -> std::result::Result<BlockSizes, String> {
    let sizes = BlockSizes {
        local: reader.block_size,
        remote: source.block_size,
    };
    if sizes.local.max(sizes.remote) % sizes.unit().max(1) != 0 {
        return Err(format!(
            "block size {} (reader) vs {} (source): one must divide the other",
            sizes.local, sizes.remote
        ));
    }
    Ok(sizes)
}

/// Refuses MHA caches of different layouts (MLA has one latent per token: its layout does
/// not matter).
fn check_layouts(reader: &KvCacheSpec, source: &KvCacheSpec) -> std::result::Result<(), String> {
    let mha = matches!(reader.attention, KvAttention::Mha { .. });
    if mha && reader.layout != source.layout {
        return Err(format!(
            "layout {} (reader) vs {} (source); use the same on both engines",
            reader.layout, source.layout
        ));
    }
    Ok(())
}

/// What reader rank `reader_tp.0` of TP `reader_tp.1` takes from source rank `source_tp.0`
/// of TP `source_tp.1`, by the [`TpMapping`] of the two TP and DCP sizes; refused when the
/// mapping does not name the source rank.
fn share_of_source(
    reader: &KvCacheSpec,
    reader_tp: (usize, usize),
    source_tp: (usize, usize),
    dcp: DcpSizes,
) -> std::result::Result<Share, String> {
    let mapping = TpMapping::with_dcp(reader_tp.0, reader_tp.1, source_tp.1, reader.attention, dcp)
        .map_err(|err| err.to_string())?;
    mapping.share_of(source_tp.0).ok_or_else(|| {
        format!(
            "rank {} of TP {} reads from remote ranks {:?}, not from rank {}",
            reader_tp.0,
            reader_tp.1,
            mapping.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(),
            source_tp.0
        )
    })
}

/// `n` for a message, or "a fraction of".
fn shown(bytes: Option<usize>) -> String {
    bytes.map_or_else(|| "no whole number of".to_string(), |b| b.to_string())
}

/// One region of the two caches, as checked.
struct Region {
    index: usize,
    /// K/V halves per block.
    parts: usize,
    /// Block lengths (local, remote).
    lens: (usize, usize),
    /// Bytes of one head's (or the latent's) token.
    token: usize,
}

impl Region {
    /// Region `index` of the reader's cache (`reader`: its spec and TP size) and the
    /// source's (`source`: likewise), refused when the two hold different content or
    /// different bytes per token of a head (or of the latent).
    fn checked(
        index: usize,
        (reader, reader_tp): (&KvCacheSpec, usize),
        (source, source_tp): (&KvCacheSpec, usize),
    ) -> std::result::Result<Region, String> {
        let (local, remote) = (&reader.regions[index], &source.regions[index]);
        if local.kind != remote.kind {
            return Err(format!(
                "region {index}: {} (reader) vs {} (source); {SAME_MODEL} with the same registration",
                local.kind, remote.kind
            ));
        }
        let token_bytes = (
            reader.token_bytes(index, reader_tp),
            source.token_bytes(index, source_tp),
        );
        let token = match token_bytes {
            (Some(l), Some(r)) if l == r => l,
            _ => {
                let mha = matches!(reader.attention, KvAttention::Mha { .. });
                let what = if mha { "head" } else { "latent" };
                return Err(format!(
                    "region {index}: block length {} (reader, TP {reader_tp}, {} tokens) vs {} (source, TP {source_tp}, {} tokens): \
                     a {what}'s token holds {} vs {} bytes; {SAME_MODEL}",
                    local.block_len,
                    reader.block_size,
                    remote.block_len,
                    source.block_size,
                    shown(token_bytes.0),
                    shown(token_bytes.1),
                ));
            }
        };
        Ok(Region {
            index,
            parts: local.kind.parts(),
            lens: (local.block_len, remote.block_len),
            token,
        })
    }

    /// The pieces of a unit for `share`.
    fn plan(
        &self,
        share: Share,
        reader: &KvCacheSpec,
        source: &KvCacheSpec,
        sizes: BlockSizes,
    ) -> std::result::Result<RegionPlan, String> {
        let unit = sizes.unit();
        let (local_len, remote_len) = self.lens;
        let (local_part, remote_part) = (local_len / self.parts, remote_len / self.parts);
        let mut plan = RegionPlan {
            pieces: Vec::new(),
            local_unit_stride: unit * self.token,
            remote_unit_stride: unit * self.token,
            local_block_len: local_len,
            remote_block_len: remote_len,
        };
        let Share::Heads {
            local_first,
            remote_first,
            count,
        } = share
        else {
            // The latent (or nothing): tokens outermost, one piece per unit.
            if share.reads() {
                plan.pieces.push(Piece {
                    local_offset: 0,
                    remote_offset: 0,
                    len: unit * self.token,
                });
            }
            return Ok(plan);
        };
        // Heads per rank on each side: a part holds heads × tokens × token bytes.
        let local_heads = local_part / (reader.block_size * self.token);
        let remote_heads = remote_part / (source.block_size * self.token);
        match reader.layout {
            KvLayout::Hnd => {
                for part in 0..self.parts {
                    for head in 0..count {
                        plan.pieces.push(Piece {
                            local_offset: part * local_part
                                + (local_first + head) * reader.block_size * self.token,
                            remote_offset: part * remote_part
                                + (remote_first + head) * source.block_size * self.token,
                            len: unit * self.token,
                        });
                    }
                }
            }
            KvLayout::Nhd if count == local_heads && count == remote_heads => {
                plan.local_unit_stride = unit * local_heads * self.token;
                plan.remote_unit_stride = unit * remote_heads * self.token;
                for part in 0..self.parts {
                    plan.pieces.push(Piece {
                        local_offset: part * local_part,
                        remote_offset: part * remote_part,
                        len: unit * count * self.token,
                    });
                }
            }
            KvLayout::Nhd => {
                return Err(format!(
                    "region {}: NHD blocks keep a head's tokens apart, so {count} of the source's {remote_heads} heads per rank \
                     cannot be read into {local_heads} per rank; use HND",
                    self.index
                ))
            }
        }
        plan.pieces = merged(&plan.pieces);
        Ok(plan)
    }
}

/// `pieces` with each run of pieces contiguous on both sides merged into one.
fn merged(pieces: &[Piece]) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::with_capacity(pieces.len());
    for &p in pieces {
        match out.last_mut() {
            Some(last)
                if last.local_offset + last.len == p.local_offset
                    && last.remote_offset + last.len == p.remote_offset =>
            {
                last.len += p.len
            }
            _ => out.push(p),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::spec::{KvRegion, KvRegionKind};

    /// An HND cache of one region: `heads` per rank of 4 bytes per token.
    fn hnd(total: usize, heads: usize, block_size: usize, kind: KvRegionKind) -> KvCacheSpec {
        let block_len = kind.parts() * heads * block_size * 4;
        KvCacheSpec {
            num_blocks: 8,
            block_size,
            attention: KvAttention::Mha {
                total_kv_heads: total,
            },
            layout: KvLayout::Hnd,
            regions: vec![KvRegion { block_len, kind }],
        }
    }

    /// `spec` in the NHD layout.
    fn nhd(spec: KvCacheSpec) -> KvCacheSpec {
        KvCacheSpec {
            layout: KvLayout::Nhd,
            ..spec
        }
    }

    fn piece(local_offset: usize, remote_offset: usize, len: usize) -> Piece {
        Piece {
            local_offset,
            remote_offset,
            len,
        }
    }

    #[test]
    fn homogeneous_geometry_reads_whole_blocks() {
        let spec = hnd(4, 4, 16, KvRegionKind::KvHalves);
        let plan = ReadPlan::new(&spec, (0, 1), &spec, (0, 1), DcpSizes::NONE).unwrap();
        assert_eq!(plan.regions[0].pieces, [piece(0, 0, 512)]);
        assert!(plan.reads_whole_local_blocks());
    }

    #[test]
    fn a_head_slice_of_k_and_v_halves_is_two_pieces() {
        // Prefill TP 1 (4 heads), decode rank 1 of TP 2 (heads 2 and 3).
        let (prefill, decode) = (
            hnd(4, 4, 16, KvRegionKind::KvHalves),
            hnd(4, 2, 16, KvRegionKind::KvHalves),
        );
        let plan = ReadPlan::new(&decode, (1, 2), &prefill, (0, 1), DcpSizes::NONE).unwrap();
        // A half is 2 heads × 64 bytes locally, 4 × 64 remotely.
        assert_eq!(
            plan.regions[0].pieces,
            [piece(0, 128, 128), piece(128, 384, 128)]
        );
    }

    #[test]
    fn different_block_sizes_read_one_piece_per_head_and_unit() {
        // Decode blocks of 32 tokens from prefill blocks of 16: a unit is 16 tokens.
        let plan = ReadPlan::new(
            &hnd(2, 2, 32, KvRegionKind::Tensor),
            (0, 1),
            &hnd(2, 2, 16, KvRegionKind::Tensor),
            (0, 1),
            DcpSizes::NONE,
        )
        .unwrap();
        let region = &plan.regions[0];
        assert_eq!(region.pieces, [piece(0, 0, 64), piece(128, 64, 64)]);
        assert_eq!(
            (region.local_unit_stride, region.remote_unit_stride),
            (64, 64)
        );
        assert!(!plan.reads_whole_local_blocks());
        let (local, remote, bytes) = plan.descriptor_ids(8, &[(3, 5)]);
        assert_eq!((local, remote, bytes), (vec![6, 7], vec![10, 11], 128));
        // Local block 1, unit 1: offset 256 + 64 for head 0, + 128 for head 1.
        let descs: Vec<_> = plan.local_descs(8).collect();
        assert_eq!(&descs[6..8], [(0, 320, 64), (0, 448, 64)]);
    }

    #[test]
    fn mismatches_name_the_first_region_that_differs() {
        let mut source = hnd(2, 2, 16, KvRegionKind::Tensor);
        source.regions.push(KvRegion {
            block_len: 128,
            kind: KvRegionKind::Tensor,
        });
        let mut reader = source.clone();
        reader.regions[1].block_len = 256;
        let err = ReadPlan::new(&reader, (0, 1), &source, (0, 1), DcpSizes::NONE).unwrap_err();
        assert!(
            err.starts_with("region 1: block length 256 (reader"),
            "{err}"
        );
        assert!(err.contains("holds 8 vs 4 bytes"), "{err}");
        reader.regions[1].kind = KvRegionKind::KvHalves;
        let err = ReadPlan::new(&reader, (0, 1), &source, (0, 1), DcpSizes::NONE).unwrap_err();
        assert!(
            err.starts_with("region 1: K and V halves (reader) vs one tensor"),
            "{err}"
        );
    }

    #[test]
    fn nhd_with_the_same_heads_reads_token_runs() {
        let (prefill, decode) = (
            nhd(hnd(2, 2, 8, KvRegionKind::KvHalves)),
            nhd(hnd(2, 2, 4, KvRegionKind::KvHalves)),
        );
        let plan = ReadPlan::new(&decode, (0, 1), &prefill, (0, 1), DcpSizes::NONE).unwrap();
        // A unit is 4 tokens × 2 heads × 4 bytes, once per half.
        let region = &plan.regions[0];
        assert_eq!(region.pieces, [piece(0, 0, 32), piece(32, 64, 32)]);
        assert_eq!(
            (region.local_unit_stride, region.remote_unit_stride),
            (32, 32)
        );
    }

    #[test]
    fn nhd_with_a_head_slice_is_refused() {
        let (prefill, decode) = (
            nhd(hnd(4, 4, 16, KvRegionKind::Tensor)),
            nhd(hnd(4, 2, 16, KvRegionKind::Tensor)),
        );
        let err = ReadPlan::new(&decode, (0, 2), &prefill, (0, 1), DcpSizes::NONE).unwrap_err();
        assert!(
            err.contains("NHD blocks keep a head's tokens apart"),
            "{err}"
        );
    }
}
