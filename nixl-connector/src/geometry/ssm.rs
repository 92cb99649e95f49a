//! SSM (Mamba) KV cache groups (vLLM's `MambaSpec`): the state a block of such a group
//! holds ([`SsmState`]), the one block of a request that bears it, and how a reader rank
//! reads it from a source rank ([`SsmReads`]).
//!
//! A block of an SSM group is not tokens but a layer's whole recurrent state after the
//! request's tokens: the conv state, whose sub-projections (Mamba1's `x`; Mamba2's `x`,
//! `B`, `C`; GDN's `Q`, `K`, `V`) lie one after the other in vLLM's DS conv layout, then the
//! temporal (SSM) state; the page may be padded past them to the attention page size.
//! vLLM 0.33 reads each sub-projection and the temporal state as regions of their own
//! (`_build_mamba_local`, `_build_mamba_remote`), their descriptors after every attention
//! descriptor (`[descs_fa | descs_ssm]` in `_compute_desc_ids`), each block read whole,
//! whatever the attention geometry; every rank holds a TP-th of each part, so a decode of
//! a larger TP reads its slice of each from the prefill rank it reads from, and one of a
//! smaller TP each of its prefill ranks' parts as its slices. Only the state-bearing block
//! of a request moves (`clip_ssm_state_blocks`).

use nixl::XferDesc;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::geometry::spec::KvCacheSpec;
use crate::geometry::tp_mapping::MAX_TP_SIZE;

const OP: &str = "SSM state of KV cache groups";

/// The per-rank state one block of an SSM (Mamba) group holds in each region that
/// registers an SSM layer (vLLM's `MambaConvSplitInfo`): the conv state's sub-projections,
/// in bytes and in order, then the temporal state. Their sums are vLLM's `ssm_sizes`
/// (`(conv_state_bytes, ssm_state_bytes)`), which its metadata carries.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "SsmStateJson", into = "SsmStateJson")]
pub struct SsmState {
    conv_bytes: Vec<usize>,
    temporal_bytes: usize,
}

/// The JSON shape of [`SsmState`], checked on the way in.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SsmStateJson {
    conv_bytes: Vec<usize>,
    temporal_bytes: usize,
}

impl TryFrom<SsmStateJson> for SsmState {
    type Error = Error;

    fn try_from(json: SsmStateJson) -> Result<Self> {
        SsmState::new(json.conv_bytes, json.temporal_bytes)
    }
}

impl From<SsmState> for SsmStateJson {
    fn from(state: SsmState) -> Self {
        SsmStateJson {
            conv_bytes: state.conv_bytes,
            temporal_bytes: state.temporal_bytes,
        }
    }
}

impl SsmState {
    /// A state of `conv_bytes` sub-projections (one for Mamba1, three for Mamba2 and GDN,
    /// as vLLM's `derive_mamba_conv_split` decomposes them: columns × `conv_kernel - 1`
    /// rows × element size, per rank) followed by `temporal_bytes` of temporal state.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no sub-projection, a part of 0 bytes, or sizes whose
    /// sum times [`MAX_TP_SIZE`](crate::MAX_TP_SIZE) overflows.
    pub fn new(conv_bytes: Vec<usize>, temporal_bytes: usize) -> Result<Self> {
        if conv_bytes.is_empty() {
            return Err(Error::invalid(
                OP,
                "ssm_state.conv_bytes: at least one conv sub-projection is needed",
            ));
        }
        if conv_bytes.contains(&0) || temporal_bytes == 0 {
            return Err(Error::invalid(
                OP,
                format!(
                    "ssm_state: conv sub-projections {conv_bytes:?} and temporal state {temporal_bytes} must each hold at least 1 byte"
                ),
            ));
        }
        // Reads from another TP place slices at up to the state times the TP ratio.
        let total = conv_bytes
            .iter()
            .try_fold(temporal_bytes, |sum, &n| sum.checked_add(n))
            .and_then(|sum| sum.checked_mul(MAX_TP_SIZE));
        if total.is_none() {
            return Err(Error::invalid(
                OP,
                format!("ssm_state: the sizes overflow (their sum times the largest TP, {MAX_TP_SIZE}, must fit in memory)"),
            ));
        }
        Ok(SsmState {
            conv_bytes,
            temporal_bytes,
        })
    }

    /// The conv sub-projections' bytes, in order.
    pub fn conv_bytes(&self) -> &[usize] {
        &self.conv_bytes
    }

    /// The temporal state's bytes.
    pub fn temporal_bytes(&self) -> usize {
        self.temporal_bytes
    }

    /// vLLM's `ssm_sizes`: the conv state's bytes and the temporal state's.
    pub fn ssm_sizes(&self) -> (usize, usize) {
        (self.conv_bytes.iter().sum(), self.temporal_bytes)
    }

    /// Bytes of a block the state occupies, from its start (the rest is padding).
    pub fn state_bytes(&self) -> usize {
        let (conv, temporal) = self.ssm_sizes();
        conv + temporal
    }

    /// The state a rank of TP `to` holds of the model whose rank of TP `from` holds this
    /// one: each part times `from / to`, every rank holding a TP-th of each part; `None`
    /// when a part does not split so, or for a TP size of 0.
    pub(crate) fn scaled(&self, from: usize, to: usize) -> Option<SsmState> {
        let scale = |bytes: usize| {
            let total = bytes as u128 * from as u128;
            let to = to as u128;
            (to > 0 && total % to == 0)
                .then(|| usize::try_from(total / to).ok())
                .flatten()
        };
        let conv = self
            .conv_bytes
            .iter()
            .map(|&bytes| scale(bytes))
            .collect::<Option<Vec<usize>>>()?;
        SsmState::new(conv, scale(self.temporal_bytes)?).ok()
    }

    /// Each part read as one descriptor, as (offset in the block, bytes): the conv
    /// sub-projections in turn, then the temporal state right after the conv state.
    pub(crate) fn parts(&self) -> Vec<(usize, usize)> {
        let mut offset = 0;
        let mut parts: Vec<(usize, usize)> = self
            .conv_bytes
            .iter()
            .map(|&len| {
                let part = (offset, len);
                offset += len;
                part
            })
            .collect();
        parts.push((offset, self.temporal_bytes));
        parts
    }
}

impl std::fmt::Display for SsmState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "conv_bytes {:?} and temporal_bytes {}",
            self.conv_bytes, self.temporal_bytes
        )
    }
}

/// The block of `ids` (one SSM group's blocks of a request, in order) that bears the
/// running state, as a list of at most one (vLLM's `clip_ssm_state_blocks`): the trailing
/// `speculative_blocks` scratch slots go (all but one block at most), then everything
/// before the last block left.
pub(crate) fn state_block(ids: &[usize], speculative_blocks: usize) -> &[usize] {
    let scratch = speculative_blocks.min(ids.len().saturating_sub(1));
    let kept = &ids[..ids.len() - scratch];
    &kept[kept.len().saturating_sub(1)..]
}

/// Each part of `state` (the reader's, per rank) as (offset in a local block, offset in a
/// remote block, bytes), for reader rank `reader_tp.0` of TP `reader_tp.1` reading source
/// rank `source_tp.0` of TP `source_tp.1` (see [`SsmReads`]).
///
/// # Errors
/// TP sizes neither of which divides the other, or parts of the state that do not split
/// over a larger source TP.
fn part_offsets(
    state: &SsmState,
    (reader_rank, reader_tp): (usize, usize),
    (source_rank, source_tp): (usize, usize),
) -> std::result::Result<Vec<(usize, usize, usize)>, String> {
    let divides = |a: usize, b: usize| a > 0 && b > 0 && b % a == 0;
    if divides(source_tp, reader_tp) {
        // Each source part holds `ratio` readers' slices; ours is the rank's place among
        // the readers of that source rank.
        let ratio = reader_tp / source_tp;
        let slice = reader_rank % ratio;
        return Ok(state
            .parts()
            .into_iter()
            .map(|(offset, len)| (offset, offset * ratio + slice * len, len))
            .collect());
    }
    if !divides(reader_tp, source_tp) {
        return Err(format!(
            "SSM (Mamba) state between a prefill of TP {source_tp} and a decode of TP {reader_tp}: one TP size must divide the other"
        ));
    }
    // Each of our parts is `ratio` source ranks' whole parts, in rank order.
    let ratio = source_tp / reader_tp;
    let piece = source_rank % ratio;
    if let Some(&len) = state
        .parts()
        .iter()
        .map(|(_, len)| len)
        .find(|&&l| l % ratio != 0)
    {
        return Err(format!(
            "a part of {len} bytes of the SSM state (ssm_sizes {:?}) does not split over the source's {ratio} ranks per reader rank",
            state.ssm_sizes()
        ));
    }
    Ok(state
        .parts()
        .into_iter()
        .map(|(offset, len)| (offset + piece * len / ratio, offset / ratio, len / ratio))
        .collect())
}

/// Each region holding SSM state, with its state page length (local, remote): a block id's
/// registered blocks (vLLM's page of `physical_blocks_per_logical_kv_block` kernel blocks).
type StatePages = Vec<(usize, (usize, usize))>;

/// Each region of `regions` with its state page length (local, remote): a block id's
/// registered blocks, `blocks_per_id` (local, remote) of them, in the reader's and the
/// source's (of TP `source_tp`) caches, which must hold every part read (`parts`, as
/// [`part_offsets`] gives them) of `state`.
///
/// # Errors
/// A region past either cache's, or a region whose pages cannot hold the state read.
fn state_pages(
    (state, regions): (&SsmState, &[usize]),
    (reader, source): (&KvCacheSpec, &KvCacheSpec),
    parts: &[(usize, usize, usize)],
    (local_per_id, remote_per_id): (usize, usize),
    source_tp: usize,
) -> std::result::Result<StatePages, String> {
    let (local_end, remote_end) = parts.iter().fold((0, 0), |(l, r), &(lo, ro, len)| {
        (l.max(lo + len), r.max(ro + len))
    });
    let mut block_lens = Vec::with_capacity(regions.len());
    for &index in regions {
        let (Some(local), Some(remote)) = (reader.regions.get(index), source.regions.get(index))
        else {
            return Err(format!(
                "SSM state in region {index}, of {} regions (reader) and {} (source)",
                reader.regions.len(),
                source.regions.len()
            ));
        };
        let pages = (
            local.block_len.saturating_mul(local_per_id),
            remote.block_len.saturating_mul(remote_per_id),
        );
        if pages.0 < local_end || pages.1 < remote_end {
            return Err(format!(
                "region {index}: state pages of {} bytes (reader) and {} (source of TP {source_tp}) cannot hold the SSM state read, up to byte {local_end} and {remote_end} (ssm_sizes {:?} per reader rank)",
                pages.0,
                pages.1,
                state.ssm_sizes()
            ));
        }
        block_lens.push((index, pages));
    }
    Ok(block_lens)
}

/// How a reader rank reads the SSM state from one source rank: one descriptor per region,
/// part ([`SsmState::parts`]) and block, region by region, part by part, block by block,
/// appended to the lists after the attention descriptors (vLLM's `[descs_fa | descs_ssm]`).
/// Every rank holds a TP-th of each part. From a source TP `ratio` times smaller, each
/// source part is `ratio` reader parts, and the reader takes its slice of each, the
/// `reader_rank % ratio`-th (vLLM's `_build_mamba_remote` and `remote_conv_offsets` with
/// `tp_ratio` of 1 or more); from a source TP `ratio` times larger, each of the `ratio`
/// source ranks of the reader's group gives its whole parts, which land as the
/// `source_rank % ratio`-th slice of the reader's (vLLM's `remote_conv_offsets` with a
/// negative `tp_ratio` and `_build_local_splits_from_plan`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SsmReads {
    /// Each part's offset in a local block, offset in a remote block, and bytes.
    parts: Vec<(usize, usize, usize)>,
    /// Each region holding SSM state, with its state page length (local, remote).
    block_lens: StatePages,
    /// Block ids per region (local, remote).
    num_blocks: (usize, usize),
    /// The attention descriptors before the SSM ones (local, remote).
    first: (usize, usize),
}

impl SsmReads {
    /// The reads of `state` (the reader's, per rank) in regions `regions` of the reader's
    /// cache (`reader`: its spec, and its rank and TP size) from the source's (`source`: its
    /// spec, and its rank and TP size), a block id `blocks_per_id` registered blocks (local,
    /// remote) whose first bytes hold the state, whose lists hold `first` attention
    /// descriptors (local, remote) before.
    ///
    /// # Errors
    /// Why the state cannot be read: TP sizes neither of which divides the other, parts of
    /// the reader's state that do not split over a larger source TP, a region past either
    /// cache's, or a region whose blocks cannot hold the state.
    pub(crate) fn new(
        (state, regions): (&SsmState, &[usize]),
        reader: (&KvCacheSpec, (usize, usize)),
        source: (&KvCacheSpec, (usize, usize)),
        blocks_per_id: (usize, usize),
        first: (usize, usize),
    ) -> std::result::Result<Self, String> {
        let ((reader, reader_tp), (source, source_tp)) = (reader, source);
        let parts = part_offsets(state, reader_tp, source_tp)?;
        let block_lens = state_pages(
            (state, regions),
            (reader, source),
            &parts,
            blocks_per_id,
            source_tp.1,
        )?;
        let (local_per_id, remote_per_id) = blocks_per_id;
        Ok(SsmReads {
            parts,
            block_lens,
            num_blocks: (
                reader.num_blocks / local_per_id.max(1),
                source.num_blocks / remote_per_id.max(1),
            ),
            first,
        })
    }

    /// Descriptors per block: one per region and part.
    fn per_block(&self) -> usize {
        self.block_lens.len() * self.parts.len()
    }

    /// The local descriptors, as (region, offset in the region, length).
    pub(crate) fn local_descs(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let blocks = self.num_blocks.0;
        self.block_lens
            .iter()
            .flat_map(move |&(region, (block_len, _))| {
                self.parts.iter().flat_map(move |&(offset, _, len)| {
                    (0..blocks).map(move |block| (region, block * block_len + offset, len))
                })
            })
    }

    /// Local descriptors.
    pub(crate) fn local_descriptors(&self) -> usize {
        self.per_block().saturating_mul(self.num_blocks.0)
    }

    /// Remote descriptors.
    pub(crate) fn remote_descriptors(&self) -> usize {
        self.per_block().saturating_mul(self.num_blocks.1)
    }

    /// The remote descriptors, from the source's region base addresses.
    pub(crate) fn remote_descs(&self, bases: &[u64], device_id: u64) -> Vec<XferDesc> {
        let blocks = self.num_blocks.1;
        let mut descs = Vec::with_capacity(self.per_block().saturating_mul(blocks));
        for &(region, (_, block_len)) in &self.block_lens {
            // As many bases as the source's regions, checked in the handshake.
            let Some(&base) = bases.get(region) else {
                continue;
            };
            for &(_, offset, len) in &self.parts {
                descs.extend((0..blocks).map(|block| {
                    XferDesc::new(base as usize + block * block_len + offset, len, device_id)
                }));
            }
        }
        descs
    }

    /// The descriptor indices of a READ of block pairs `pairs` (local block id, remote
    /// block id) of SSM groups, and the bytes it moves.
    ///
    /// # Errors
    /// A block id past either engine's.
    pub(crate) fn descriptor_ids(
        &self,
        pairs: &[(usize, usize)],
    ) -> std::result::Result<(Vec<usize>, Vec<usize>, usize), String> {
        let (blocks, far_blocks) = self.num_blocks;
        if let Some((l, r)) = pairs.iter().find(|&&(l, r)| l >= blocks || r >= far_blocks) {
            return Err(format!(
                "SSM state block {l} of {blocks} (local) or {r} of {far_blocks} (remote) is past the cache"
            ));
        }
        let n = self.per_block() * pairs.len();
        let (mut local, mut remote) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let mut bytes = 0;
        for slot in 0..self.per_block() {
            let len = self.parts[slot % self.parts.len()].2;
            for &(l, r) in pairs {
                local.push(self.first.0 + slot * self.num_blocks.0 + l);
                remote.push(self.first.1 + slot * self.num_blocks.1 + r);
                bytes += len;
            }
        }
        Ok((local, remote, bytes))
    }
}

/// Block pairs (local, remote) of a READ.
type Pairs = Vec<(usize, usize)>;

/// `pairs` of a load of several KV cache groups (each group's in turn, `group_lens` of
/// them) as those of the attention groups and those of the SSM groups (`is_ssm(group)`).
///
/// # Errors
/// [`Error::InvalidArgument`] when the counts do not add up to the pairs.
pub(crate) fn split_state_pairs(
    pairs: &[(usize, usize)],
    group_lens: &[usize],
    is_ssm: impl Fn(usize) -> bool,
) -> Result<(Pairs, Pairs)> {
    let total = group_lens
        .iter()
        .try_fold(0usize, |sum, &n| sum.checked_add(n));
    if total != Some(pairs.len()) {
        return Err(Error::invalid(
            "read the blocks of KV cache groups",
            format!("group counts {group_lens:?} for {} pairs", pairs.len()),
        ));
    }
    let (mut attention, mut ssm) = (Vec::new(), Vec::new());
    let mut rest = pairs;
    for (group, &n) in group_lens.iter().enumerate() {
        let (these, tail) = rest.split_at(n);
        rest = tail;
        if is_ssm(group) {
            ssm.extend_from_slice(these);
        } else {
            attention.extend_from_slice(these);
        }
    }
    Ok((attention, ssm))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::spec::{KvAttention, KvLayout, KvRegion, KvRegionKind};

    fn mamba2() -> SsmState {
        SsmState::new(vec![24, 8, 8], 64).unwrap()
    }

    fn spec(block_len: usize, regions: usize) -> KvCacheSpec {
        KvCacheSpec {
            num_blocks: 4,
            block_size: 16,
            attention: KvAttention::Mha { total_kv_heads: 2 },
            layout: KvLayout::Hnd,
            regions: vec![
                KvRegion {
                    block_len,
                    kind: KvRegionKind::Tensor,
                };
                regions
            ],
        }
    }

    #[test]
    fn the_state_is_its_conv_parts_then_the_temporal_state() {
        let state = mamba2();
        assert_eq!(state.ssm_sizes(), (40, 64));
        assert_eq!(state.state_bytes(), 104);
        assert_eq!(state.parts(), [(0, 24), (24, 8), (32, 8), (40, 64)]);
        for (conv, temporal, want) in [
            (vec![], 1, "at least one conv sub-projection"),
            (vec![1, 0], 1, "must each hold at least 1 byte"),
            (vec![1], 0, "must each hold at least 1 byte"),
            (vec![usize::MAX], 1, "overflow"),
        ] {
            let err = SsmState::new(conv, temporal).unwrap_err().to_string();
            assert!(err.contains(want), "{err}");
        }
    }

    #[test]
    fn a_state_scales_part_by_part_between_tp_sizes() {
        let state = mamba2();
        let halves = state.scaled(1, 2).unwrap();
        assert_eq!(halves.scaled(2, 1), Some(state.clone()));
        assert_eq!(
            halves.ssm_sizes(),
            (state.ssm_sizes().0 / 2, state.ssm_sizes().1 / 2)
        );
        assert_eq!(state.scaled(4, 4), Some(state.clone()));
        // A part of an odd count of bytes does not split in two; no TP is 0.
        let odd = SsmState::new(vec![3, 4], 8).unwrap();
        assert_eq!(odd.scaled(1, 2), None);
        assert_eq!(odd.scaled(1, 0), None);
        assert_eq!(odd.scaled(usize::MAX, 1), None);
    }

    #[test]
    fn a_state_too_large_to_scale_over_the_largest_tp_is_refused() {
        // Parts of 2^62 bytes: a decode of TP 2 reading a prefill of TP 1 (whose ssm_sizes
        // a peer can claim) would place the temporal state's slice past usize::MAX.
        let err = SsmState::new(vec![1 << 62], 1 << 62)
            .unwrap_err()
            .to_string();
        assert!(err.contains("times the largest TP"), "{err}");
        // The largest state accepted is read from any TP without overflowing: refused by
        // name, its blocks too small.
        let part = (usize::MAX / MAX_TP_SIZE / 2) & !(MAX_TP_SIZE - 1);
        let state = SsmState::new(vec![part], part).unwrap();
        let largest = (MAX_TP_SIZE - 1, MAX_TP_SIZE);
        for (reader, source) in [(largest, (0, 1)), ((0, 1), largest)] {
            let err = SsmReads::new(
                (&state, &[0]),
                (&spec(128, 1), reader),
                (&spec(128, 1), source),
                (1, 1),
                (0, 0),
            )
            .unwrap_err();
            assert!(err.contains("cannot hold the SSM state"), "{err}");
        }
    }

    #[test]
    fn a_state_page_is_a_block_ids_registered_blocks() {
        // Two registered blocks of 64 bytes per id: pages of 128, half as many.
        let reads = SsmReads::new(
            (&mamba2(), &[0, 1]),
            (&spec(64, 2), (0, 1)),
            (&spec(64, 2), (0, 1)),
            (2, 2),
            (0, 0),
        )
        .unwrap();
        let local: Vec<_> = reads.local_descs().collect();
        assert_eq!(local.len(), 2 * 4 * 2);
        // Region 0, temporal state, block id 1: 128 + 40.
        assert_eq!(local[3 * 2 + 1], (0, 168, 64));
        assert!(reads.descriptor_ids(&[(1, 1)]).is_ok());
        let err = reads.descriptor_ids(&[(2, 0)]).unwrap_err();
        assert!(err.contains("state block 2 of 2"), "{err}");
    }

    #[test]
    fn only_the_state_bearing_block_is_kept() {
        assert_eq!(state_block(&[1, 2, 3], 0), [3]);
        // Two speculative scratch slots at the end.
        assert_eq!(state_block(&[1, 2, 3, 4], 2), [2]);
        // Never fewer than the running slot.
        assert_eq!(state_block(&[5], 3), [5]);
        assert_eq!(state_block(&[5, 6], 3), [5]);
        assert!(state_block(&[], 1).is_empty());
    }

    #[test]
    fn reads_follow_the_attention_descriptors_part_by_part() {
        let reads = SsmReads::new(
            (&mamba2(), &[0, 1]),
            (&spec(128, 2), (1, 2)),
            (&spec(128, 2), (1, 2)),
            (1, 1),
            (8, 10),
        )
        .unwrap();
        assert_eq!(reads.local_descriptors(), 2 * 4 * 4);
        let local: Vec<_> = reads.local_descs().collect();
        assert_eq!(local.len(), 32);
        // Region 0, part 1 (B), block 2: 2 × 128 + 24.
        assert_eq!(local[4 + 2], (0, 280, 8));
        // Region 1, temporal state, block 3.
        assert_eq!(local[31], (1, 3 * 128 + 40, 64));
        let remote = reads.remote_descs(&[1000, 5000], 0);
        assert_eq!(remote.len(), 32);
        let (l, r, bytes) = reads.descriptor_ids(&[(1, 3)]).unwrap();
        assert_eq!(l, [9, 13, 17, 21, 25, 29, 33, 37]);
        assert_eq!(r, [13, 17, 21, 25, 29, 33, 37, 41]);
        assert_eq!(bytes, 2 * 104);
    }

    #[test]
    fn a_decode_of_a_larger_tp_reads_its_slice_of_each_part() {
        // Decode rank 3 of TP 4 from a prefill of TP 2: the second half of each part.
        let reads = SsmReads::new(
            (&mamba2(), &[0]),
            (&spec(128, 1), (3, 4)),
            (&spec(256, 1), (1, 2)),
            (1, 1),
            (0, 0),
        )
        .unwrap();
        assert_eq!(
            reads.parts,
            [(0, 24, 24), (24, 56, 8), (32, 72, 8), (40, 144, 64)]
        );
        let remote = reads.remote_descs(&[1 << 20], 0);
        // Block 1 of the source, its temporal state's second half.
        assert_eq!(
            remote[3 * 4 + 1],
            XferDesc::new((1 << 20) + 256 + 144, 64, 0)
        );
    }

    #[test]
    fn a_decode_of_a_smaller_tp_takes_whole_parts_from_each_source_rank() {
        // Decode rank 0 of TP 1 from prefill rank 1 of TP 2: the second half of each of its
        // parts, from the start of the source's.
        let reads = SsmReads::new(
            (&mamba2(), &[0]),
            (&spec(128, 1), (0, 1)),
            (&spec(64, 1), (1, 2)),
            (1, 1),
            (0, 0),
        )
        .unwrap();
        assert_eq!(
            reads.parts,
            [(12, 0, 12), (28, 12, 4), (36, 16, 4), (72, 20, 32)]
        );
        assert_eq!(reads.descriptor_ids(&[(0, 0)]).unwrap().2, 52);
    }

    #[test]
    fn other_tp_sizes_and_small_blocks_are_refused_by_name() {
        for (reader, source) in [((0, 3), (0, 2)), ((0, 2), (0, 0))] {
            let err = SsmReads::new(
                (&mamba2(), &[0]),
                (&spec(128, 1), reader),
                (&spec(128, 1), source),
                (1, 1),
                (0, 0),
            )
            .unwrap_err();
            assert!(err.contains("one TP size must divide the other"), "{err}");
        }
        // 8 bytes do not split over 16 source ranks per reader rank.
        let err = SsmReads::new(
            (&mamba2(), &[0]),
            (&spec(128, 1), (0, 1)),
            (&spec(128, 1), (0, 16)),
            (1, 1),
            (0, 0),
        )
        .unwrap_err();
        assert!(
            err.contains("does not split over the source's 16 ranks"),
            "{err}"
        );
        let err = SsmReads::new(
            (&mamba2(), &[0]),
            (&spec(128, 1), (0, 1)),
            (&spec(64, 1), (0, 1)),
            (1, 1),
            (0, 0),
        )
        .unwrap_err();
        assert!(err.contains("cannot hold the SSM state read"), "{err}");
        // A source of half the TP holds twice the state per block.
        let err = SsmReads::new(
            (&mamba2(), &[0]),
            (&spec(128, 1), (0, 2)),
            (&spec(128, 1), (0, 1)),
            (1, 1),
            (0, 0),
        )
        .unwrap_err();
        assert!(err.contains("up to byte 104 and 144"), "{err}");
    }

    #[test]
    fn pairs_split_into_attention_and_state() {
        let pairs = [(1, 7), (2, 8), (3, 9), (4, 10)];
        let (attention, ssm) = split_state_pairs(&pairs, &[2, 1, 1], |g| g == 1).unwrap();
        assert_eq!(attention, [(1, 7), (2, 8), (4, 10)]);
        assert_eq!(ssm, [(3, 9)]);
        assert!(split_state_pairs(&pairs, &[2, 1], |_| false).is_err());
    }
}
