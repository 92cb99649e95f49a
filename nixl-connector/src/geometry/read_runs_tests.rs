//! Random block tables through the planner ([`plan_read`]), every byte checked: the READ's
//! descriptors, taken from both prepared lists by the plan's indices and merged as NIXL 1.5.1's
//! `makeXferReq` merges them (consecutive indices whose descriptors are contiguous on both
//! sides become one), are copied on a model of both caches, and each byte of the local cache
//! is compared with an independent model of where every head's token goes. Runs of blocks
//! contiguous on both sides must come out as one descriptor per region.

use nixl::XferDesc;

use crate::geometry::groups::KvCacheGroups;
use crate::geometry::load_reads::{plan_read, ReadInputs, SideBlocks};
use crate::geometry::read_plan::ReadPlan;
use crate::geometry::spec::{KvAttention, KvCacheSpec, KvLayout, KvRegion, KvRegionKind};

/// Bytes of one head's token.
const TOKEN: usize = 4;
/// Blocks of each cache.
const BLOCKS: usize = 8;
/// Where the model puts each remote region (far apart: regions never touch).
const REGION_SPAN: usize = 1 << 32;
/// A local byte no READ wrote.
const UNTOUCHED: u64 = u64::MAX;

/// An HND cache of `heads` heads per rank of `total`, `block_size` tokens per block: one
/// region of one tensor, one of K and V halves.
fn cache(total: usize, heads: usize, block_size: usize) -> KvCacheSpec {
    let tensor = heads * block_size * TOKEN;
    KvCacheSpec {
        num_blocks: BLOCKS,
        block_size,
        attention: KvAttention::Mha {
            total_kv_heads: total,
        },
        layout: KvLayout::Hnd,
        regions: vec![
            KvRegion {
                block_len: tensor,
                kind: KvRegionKind::Tensor,
            },
            KvRegion {
                block_len: 2 * tensor,
                kind: KvRegionKind::KvHalves,
            },
        ],
    }
}

/// One geometry: both caches, the reader's rank and TP, and the first remote head of the
/// reader's heads.
struct Geometry {
    local: KvCacheSpec,
    remote: KvCacheSpec,
    reader_tp: (usize, usize),
    first_head: usize,
}

impl Geometry {
    fn plan(&self) -> ReadPlan {
        ReadPlan::new(
            &self.local,
            self.reader_tp,
            &self.remote,
            (0, 1),
            crate::geometry::dcp::DcpSizes::NONE,
        )
        .unwrap()
    }

    fn heads(spec: &KvCacheSpec, region: usize) -> usize {
        let parts = spec.regions[region].kind.parts();
        spec.regions[region].block_len / parts / spec.block_size / TOKEN
    }
}

/// The geometries: one of whole blocks, one of head slices (decode rank 1 of TP 2 reading
/// a TP 1 prefill), one of decode blocks twice the prefill's.
fn geometries() -> Vec<Geometry> {
    vec![
        Geometry {
            local: cache(2, 2, 16),
            remote: cache(2, 2, 16),
            reader_tp: (0, 1),
            first_head: 0,
        },
        Geometry {
            local: cache(4, 2, 16),
            remote: cache(4, 4, 16),
            reader_tp: (1, 2),
            first_head: 2,
        },
        Geometry {
            local: cache(2, 2, 32),
            remote: cache(2, 2, 16),
            reader_tp: (0, 1),
            first_head: 0,
        },
    ]
}

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// `n` distinct block ids: a run at a random start, random ids, or random ids sorted
    /// (sorted tables hold runs); or either of the first and third last first, as an
    /// engine that frees a request's blocks last first hands them out again.
    fn table(&mut self, n: usize) -> Vec<usize> {
        let mut table = self.table_ascending(n);
        if self.below(2) == 1 {
            table.reverse();
        }
        table
    }

    fn table_ascending(&mut self, n: usize) -> Vec<usize> {
        match self.below(3) {
            0 => {
                let start = self.below(BLOCKS - n + 1);
                (start..start + n).collect()
            }
            shape => {
                let mut all: Vec<usize> = (0..BLOCKS).collect();
                for i in (1..BLOCKS).rev() {
                    all.swap(i, self.below(i + 1));
                }
                all.truncate(n);
                if shape == 2 {
                    all.sort_unstable();
                }
                all
            }
        }
    }
}

/// The value of byte `offset` of remote region `region`.
fn remote_byte(region: usize, offset: usize) -> u64 {
    (region as u64) << 40 | offset as u64
}

/// The local cache after copying `pairs` of (local descriptor, remote descriptor).
fn copied(spec: &KvCacheSpec, pairs: &[((usize, usize, usize), XferDesc)]) -> Vec<Vec<u64>> {
    let mut cache: Vec<Vec<u64>> = spec
        .regions
        .iter()
        .map(|r| vec![UNTOUCHED; BLOCKS * r.block_len])
        .collect();
    for &((region, offset, len), far) in pairs {
        assert_eq!(len, far.len, "paired descriptors of one length");
        let (far_region, far_offset) = (far.addr / REGION_SPAN, far.addr % REGION_SPAN);
        assert_eq!(far_region, region, "a region reads its own region");
        for k in 0..len {
            cache[region][offset + k] = remote_byte(region, far_offset + k);
        }
    }
    cache
}

/// `pairs` with each run of consecutive indices whose descriptors are contiguous on both
/// sides merged into one, as NIXL merges a prepared request's descriptors.
fn merged(
    pairs: &[(usize, usize)],
    local: &[(usize, usize, usize)],
    remote: &[XferDesc],
) -> Vec<((usize, usize, usize), XferDesc)> {
    let mut out: Vec<((usize, usize, usize), XferDesc)> = Vec::new();
    let mut last: Option<(usize, usize)> = None;
    for &(l, r) in pairs {
        let (next_local, next_remote) = (local[l], remote[r]);
        match (last, out.last_mut()) {
            (Some((pl, pr)), Some(((region, offset, len), far)))
                if l == pl + 1
                    && r == pr + 1
                    && next_local.0 == *region
                    && next_local.1 == *offset + *len
                    && next_remote.addr == far.addr + far.len =>
            {
                *len += next_local.2;
                far.len += next_remote.len;
            }
            _ => out.push((next_local, next_remote)),
        }
        last = Some((l, r));
    }
    out
}

/// The local cache an independent model expects: token `t` of every head the reader holds
/// goes from remote block `remote[t / remote block size]` to local block
/// `local[t / local block size]`, in each K/V part, for the `tokens` tokens of the blocks.
fn expected(
    geometry: &Geometry,
    local: &[usize],
    remote: &[usize],
    tokens: usize,
) -> Vec<Vec<u64>> {
    let (ls, rs) = (&geometry.local, &geometry.remote);
    let mut cache: Vec<Vec<u64>> = ls
        .regions
        .iter()
        .map(|r| vec![UNTOUCHED; BLOCKS * r.block_len])
        .collect();
    for (region, bytes) in cache.iter_mut().enumerate() {
        let parts = ls.regions[region].kind.parts();
        let (local_part, remote_part) = (
            ls.regions[region].block_len / parts,
            rs.regions[region].block_len / parts,
        );
        for t in 0..tokens {
            let (lb, lk) = (local[t / ls.block_size], t % ls.block_size);
            let (rb, rk) = (remote[t / rs.block_size], t % rs.block_size);
            for part in 0..parts {
                for h in 0..Geometry::heads(ls, region) {
                    let far_head = h + geometry.first_head;
                    let at = lb * ls.regions[region].block_len
                        + part * local_part
                        + (h * ls.block_size + lk) * TOKEN;
                    let from = rb * rs.regions[region].block_len
                        + part * remote_part
                        + (far_head * rs.block_size + rk) * TOKEN;
                    for k in 0..TOKEN {
                        bytes[at + k] = remote_byte(region, from + k);
                    }
                }
            }
        }
    }
    cache
}

/// Runs of blocks consecutive on both sides, the block pairs (`local[i]`, `remote[i]`)
/// taken in the order of their local blocks, as the planner lists them.
fn block_runs(local: &[usize], remote: &[usize]) -> usize {
    let mut pairs: Vec<_> = local.iter().copied().zip(remote.iter().copied()).collect();
    pairs.sort_unstable();
    1 + pairs
        .windows(2)
        .filter(|p| !(p[1].0 == p[0].0 + 1 && p[1].1 == p[0].1 + 1))
        .count()
}

#[test]
fn random_block_tables_move_every_byte_right_and_runs_merge_into_one_descriptor_per_region() {
    let mut rng = Rng(45);
    let groups = KvCacheGroups::default();
    let mut reversed_runs = 0;
    for (g, geometry) in geometries().iter().enumerate() {
        let plan = geometry.plan();
        let (ls, rs) = (geometry.local.block_size, geometry.remote.block_size);
        let local_list: Vec<_> = plan.local_descs(BLOCKS).collect();
        let bases: Vec<u64> = (0..plan.regions.len())
            .map(|r| (r * REGION_SPAN) as u64)
            .collect();
        let remote_list = plan.remote_descs(&bases, 0);
        for case in 0..300 {
            // Tokens the local blocks hold in full; the remote blocks follow.
            let local_blocks = 1 + rng.below(BLOCKS * rs.min(ls) / ls);
            let tokens = local_blocks * ls;
            let (local, remote) = (rng.table(local_blocks), rng.table(tokens / rs));
            let reads = plan_read(&ReadInputs {
                request_id: "r",
                local: SideBlocks {
                    ids: &local,
                    group_lens: &[],
                    per_id: 1,
                },
                remote: SideBlocks {
                    ids: &remote,
                    group_lens: &[],
                    per_id: 1,
                },
                num_tokens: Some(tokens),
                local_num_blocks: BLOCKS,
                plan: &plan,
                groups: &groups,
                ssm: None,
                reads_attention: true,
            })
            .unwrap();
            let pairs: Vec<(usize, usize)> = reads
                .local
                .iter()
                .copied()
                .zip(reads.remote.iter().copied())
                .collect();
            let one_by_one: Vec<_> = pairs
                .iter()
                .map(|&(l, r)| (local_list[l], remote_list[r]))
                .collect();
            let merged = merged(&pairs, &local_list, &remote_list);
            let want = expected(geometry, &local, &remote, tokens);
            let what = format!("geometry {g} case {case}: local {local:?} remote {remote:?}");
            assert!(copied(&geometry.local, &one_by_one) == want, "{what}");
            assert!(copied(&geometry.local, &merged) == want, "{what}, merged");
            let moved: usize = one_by_one.iter().map(|(l, _)| l.2).sum();
            assert_eq!(reads.bytes, moved, "{what}");
            if plan.reads_whole_local_blocks() {
                let runs = block_runs(&local, &remote);
                assert_eq!(merged.len(), runs * plan.regions.len(), "{what}");
                let reversed = local.windows(2).all(|w| w[1] + 1 == w[0])
                    && remote.windows(2).all(|w| w[1] + 1 == w[0]);
                if reversed {
                    // A run listed last first on both sides is one descriptor per region.
                    assert_eq!(merged.len(), plan.regions.len(), "{what}");
                    reversed_runs += 1;
                }
            }
        }
    }
    assert!(
        reversed_runs > 0,
        "no case listed a run last first on both sides"
    );
}
