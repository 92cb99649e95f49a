//! Pipeline-parallel stages: which layers each stage of an engine holds (vLLM's
//! `get_pp_indices`, or an explicit partition as `VLLM_PP_LAYER_PARTITION` gives it), and,
//! for a stage of one engine, which stage of another holds each of its layers and at which
//! of that stage's regions (vLLM's `_remote_region_offset`).
//!
//! vLLM's rule: every stage gets `layers / stages` layers, and the `layers % stages` left
//! over go one each to the stages before the last, from the second-to-last backwards (the
//! first stage holds the embeddings and the last the head, so they are spared where they
//! can be).
//!
//! A rank learns its peer's stages from the handshake ([`shared_regions`]): the regions
//! two ranks have in common are those of the layers both hold, each side's counted from the
//! first layer of its stage, so that a decode of any PP size reads each of its layers from
//! the prefill stage holding it.

use std::ops::Range;

use crate::error::{Error, Result};

/// The most pipeline stages an engine may have.
pub const MAX_PP_SIZE: usize = 1 << 8;

/// How an engine's layers are split over its pipeline stages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineStages {
    /// Layers of each stage, in order.
    partitions: Vec<usize>,
}

/// The layers one local stage takes from one remote stage: local regions
/// `local_regions` are the remote stage's regions from `remote_first_region` on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageSource {
    /// The remote stage (its `pp_rank`).
    pub remote_stage: usize,
    /// The model's layers read from it.
    pub layers: Range<usize>,
    /// Where they are among the local stage's regions (one region per layer).
    pub local_regions: Range<usize>,
    /// The remote stage's region of the first of them.
    pub remote_first_region: usize,
}

impl PipelineStages {
    /// `num_layers` split over `pp_size` stages by vLLM's rule (see the module).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no stage, more than [`MAX_PP_SIZE`], or fewer layers
    /// than stages.
    pub fn even(num_layers: usize, pp_size: usize) -> Result<Self> {
        if pp_size == 0 || pp_size > MAX_PP_SIZE || num_layers < pp_size {
            return Err(invalid(format!(
                "{num_layers} layers over {pp_size} pipeline stages; give 1 to {MAX_PP_SIZE} stages, each with a layer at least"
            )));
        }
        let mut partitions = vec![num_layers / pp_size; pp_size];
        for extra in 0..num_layers % pp_size {
            partitions[pp_size - 2 - extra] += 1;
        }
        Ok(PipelineStages { partitions })
    }

    /// An explicit partition: `partitions[s]` layers on stage `s` (vLLM's
    /// `VLLM_PP_LAYER_PARTITION`), which must add up to `num_layers`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no stage, more than [`MAX_PP_SIZE`], a stage without
    /// a layer, or a sum other than `num_layers`.
    pub fn explicit(partitions: Vec<usize>, num_layers: usize) -> Result<Self> {
        let sum: usize = partitions.iter().sum();
        if partitions.is_empty() || partitions.len() > MAX_PP_SIZE || partitions.contains(&0) {
            return Err(invalid(format!(
                "the partition {partitions:?}: give 1 to {MAX_PP_SIZE} stages, each with a layer at least"
            )));
        }
        if sum != num_layers {
            return Err(invalid(format!(
                "the partition {partitions:?} holds {sum} layers, the model {num_layers}"
            )));
        }
        Ok(PipelineStages { partitions })
    }

    /// The partition of vLLM's `VLLM_PP_LAYER_PARTITION` (layers per stage, comma-separated,
    /// e.g. `"10,22"`) for an engine of `pp_size` stages and `num_layers` layers, refused
    /// as vLLM refuses it: a value that is not a number, another count of stages than
    /// `pp_size`, or another sum than `num_layers` (and, as [`explicit`](Self::explicit),
    /// a stage without a layer).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming what is wrong.
    pub fn from_vllm_partition(partition: &str, pp_size: usize, num_layers: usize) -> Result<Self> {
        let partitions = partition
            .split(',')
            .map(|layers| layers.trim().parse::<usize>())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| invalid(format!("Invalid partition string: {partition:?}")))?;
        if partitions.len() != pp_size {
            return Err(invalid(format!(
                "the partition {partition:?} has {} stages, the engine {pp_size} (vLLM: len(partitions) does not match pp_size)",
                partitions.len()
            )));
        }
        Self::explicit(partitions, num_layers)
    }

    /// How many stages.
    pub fn pp_size(&self) -> usize {
        self.partitions.len()
    }

    /// How many layers in all.
    pub fn num_layers(&self) -> usize {
        self.partitions.iter().sum()
    }

    /// The layers of stage `stage` (empty past the last stage).
    pub fn layers(&self, stage: usize) -> Range<usize> {
        let Some(&len) = self.partitions.get(stage) else {
            return 0..0;
        };
        let start: usize = self.partitions[..stage].iter().sum();
        start..start + len
    }

    /// The stage holding `layer`, if any does.
    pub fn stage_of(&self, layer: usize) -> Option<usize> {
        (0..self.pp_size()).find(|&s| self.layers(s).contains(&layer))
    }

    /// Where local stage `local_stage` of this engine reads its layers from on `remote`'s
    /// stages: one [`StageSource`] per remote stage holding some of them, in layer order.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the engines split different numbers of layers (they
    /// serve different models), or `local_stage` is not one of this engine's.
    pub fn sources(&self, local_stage: usize, remote: &PipelineStages) -> Result<Vec<StageSource>> {
        if self.num_layers() != remote.num_layers() {
            return Err(invalid(format!(
                "this engine's stages hold {} layers, the remote's {}: both must serve the same model",
                self.num_layers(),
                remote.num_layers()
            )));
        }
        if local_stage >= self.pp_size() {
            return Err(invalid(format!(
                "stage {local_stage} of an engine of {} stages",
                self.pp_size()
            )));
        }
        let ours = self.layers(local_stage);
        let mut sources = Vec::new();
        for remote_stage in 0..remote.pp_size() {
            let theirs = remote.layers(remote_stage);
            let layers = ours.start.max(theirs.start)..ours.end.min(theirs.end);
            if layers.is_empty() {
                continue;
            }
            sources.push(StageSource {
                remote_stage,
                local_regions: layers.start - ours.start..layers.end - ours.start,
                remote_first_region: layers.start - theirs.start,
                layers,
            });
        }
        Ok(sources)
    }
}

/// A rank's place in its engine's pipeline: the engine's stages and the one it is (its
/// `pp_rank`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineRank {
    stages: PipelineStages,
    pp_rank: usize,
}

impl PipelineRank {
    /// Stage `pp_rank` of `stages`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a `pp_rank` past the last stage.
    pub fn new(stages: PipelineStages, pp_rank: usize) -> Result<Self> {
        if pp_rank >= stages.pp_size() {
            return Err(invalid(format!(
                "pp_rank {pp_rank} of an engine of {} stages",
                stages.pp_size()
            )));
        }
        Ok(PipelineRank { stages, pp_rank })
    }

    /// The engine's stages.
    pub fn stages(&self) -> &PipelineStages {
        &self.stages
    }

    /// This rank's stage.
    pub fn pp_rank(&self) -> usize {
        self.pp_rank
    }

    /// How many regions each layer of this rank's stage has, of `regions` registered
    /// (vLLM's `regions_per_layer`, which it asserts is whole).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `regions` is not a whole number per layer.
    pub fn regions_per_layer(&self, regions: usize) -> Result<usize> {
        let layers = self.stages.layers(self.pp_rank).len();
        if regions == 0 || regions % layers != 0 {
            return Err(invalid(format!(
                "{regions} regions for the {layers} layers of stage {}: give each layer as many regions",
                self.pp_rank
            )));
        }
        Ok(regions / layers)
    }

    /// The layers per stage, as a handshake carries them.
    pub(crate) fn partition(&self) -> Vec<u64> {
        self.stages.partitions.iter().map(|&n| n as u64).collect()
    }
}

/// One rank's stage as its handshake says it: its engine's layers per stage (empty: one
/// stage, holding every layer), its `pp_rank`, and how many regions it registered.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StageOfRank<'a> {
    /// Layers per stage.
    pub(crate) partition: &'a [u64],
    /// Its stage.
    pub(crate) pp_rank: u64,
    /// Its regions.
    pub(crate) regions: usize,
}

/// The regions of two ranks that hold the same layers: `local` of the reader's and
/// `remote` of the source's, as many on each side (both empty when they hold no layer in
/// common: the reader only notifies the source).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SharedRegions {
    /// The reader's regions.
    pub(crate) local: Range<usize>,
    /// The source's regions.
    pub(crate) remote: Range<usize>,
}

/// Which regions of `reader` and `source` hold the same layers (vLLM's
/// `_remote_region_offset`: the regions of a layer follow one another, as many per layer on
/// both sides). Two ranks of one stage each share every region. A side of one stage holds
/// every layer the other's stages hold.
///
/// # Errors
/// Why they cannot be paired: a partition that is not one (no stage, a stage without a
/// layer, more than [`MAX_PP_SIZE`] stages, a `pp_rank` past the last stage), different
/// numbers of layers, regions that are not a whole number per layer of the stage, or
/// different numbers of regions per layer.
pub(crate) fn shared_regions(
    reader: StageOfRank<'_>,
    source: StageOfRank<'_>,
) -> std::result::Result<SharedRegions, String> {
    if reader.partition.len() <= 1 && source.partition.len() <= 1 {
        return Ok(SharedRegions {
            local: 0..reader.regions,
            remote: 0..source.regions,
        });
    }
    let stages = |whose: &str, of: StageOfRank<'_>, other: StageOfRank<'_>| {
        // A peer's partition: its stages are bounded before anything is summed, and so is
        // the sum.
        let layers_of = |partition: &[u64]| {
            (partition.len() <= MAX_PP_SIZE)
                .then(|| {
                    partition
                        .iter()
                        .try_fold(0usize, |sum, &n| sum.checked_add(usize::try_from(n).ok()?))
                })
                .flatten()
                .ok_or_else(|| {
                    format!(
                        "a partition of {} stages (at most {MAX_PP_SIZE}, whose layers add up)",
                        partition.len()
                    )
                })
        };
        let partition: Vec<usize> = if of.partition.is_empty() {
            vec![layers_of(other.partition)?]
        } else {
            layers_of(of.partition)?;
            of.partition.iter().map(|&n| n as usize).collect()
        };
        let layers = partition.iter().sum();
        let stages = PipelineStages::explicit(partition, layers)
            .map_err(|err| format!("the {whose}'s pipeline stages: {err}"))?;
        let rank = usize::try_from(of.pp_rank)
            .ok()
            .filter(|&rank| rank < stages.pp_size())
            .ok_or_else(|| {
                format!(
                    "the {whose}'s pp_rank {} of {} stages",
                    of.pp_rank,
                    stages.pp_size()
                )
            })?;
        let stage_layers = stages.layers(rank).len();
        if of.regions % stage_layers != 0 {
            return Err(format!(
                "the {whose}'s {} regions for the {stage_layers} layers of its stage {rank}: give each layer as many regions",
                of.regions
            ));
        }
        Ok((stages, rank, of.regions / stage_layers))
    };
    let (ours, our_rank, our_per_layer) = stages("reader", reader, source)?;
    let (theirs, their_rank, their_per_layer) = stages("source", source, reader)?;
    if our_per_layer != their_per_layer {
        return Err(format!(
            "{our_per_layer} regions per layer (reader) vs {their_per_layer} (source): both engines must register each layer alike"
        ));
    }
    let sources = ours
        .sources(our_rank, &theirs)
        .map_err(|err| err.to_string())?;
    let per_layer = our_per_layer;
    Ok(sources
        .into_iter()
        .find(|s| s.remote_stage == their_rank)
        .map_or(
            SharedRegions {
                local: 0..0,
                remote: 0..0,
            },
            |s| {
                let count = s.layers.len() * per_layer;
                let (local, remote) = (
                    s.local_regions.start * per_layer,
                    s.remote_first_region * per_layer,
                );
                SharedRegions {
                    local: local..local + count,
                    remote: remote..remote + count,
                }
            },
        ))
}

fn invalid(reason: String) -> Error {
    Error::invalid("split layers over pipeline stages", reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stages(num_layers: usize, pp_size: usize) -> Vec<Range<usize>> {
        let stages = PipelineStages::even(num_layers, pp_size).unwrap();
        (0..pp_size).map(|s| stages.layers(s)).collect()
    }

    #[test]
    fn layers_split_as_vllms_get_pp_indices_splits_them() {
        // Worked by hand from vLLM's rule: the rest goes to the stages before the last,
        // from the second-to-last backwards. `even` agreed with vLLM 0.33's own
        // `get_pp_indices` on every model of 1 to 129 layers over 1 to 16 stages (run when
        // this was written).
        assert_eq!(stages(32, 1), vec![Range { start: 0, end: 32 }]);
        assert_eq!(stages(32, 2), [0..16, 16..32]);
        assert_eq!(stages(5, 2), [0..3, 3..5]);
        assert_eq!(stages(7, 4), [0..2, 2..4, 4..6, 6..7]);
        assert_eq!(stages(6, 4), [0..1, 1..3, 3..5, 5..6]);
        assert_eq!(stages(61, 4), [0..15, 15..30, 30..46, 46..61]);
        assert_eq!(stages(10, 3), [0..3, 3..7, 7..10]);
        for bad in [(3, 4), (8, 0), (1000, MAX_PP_SIZE + 1)] {
            assert!(PipelineStages::even(bad.0, bad.1).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn an_explicit_partition_is_taken_when_it_adds_up() {
        let stages = PipelineStages::explicit(vec![10, 22], 32).unwrap();
        assert_eq!((stages.layers(0), stages.layers(1)), (0..10, 10..32));
        assert_eq!(stages.stage_of(10), Some(1));
        assert_eq!(stages.stage_of(32), None);
        for (bad, layers) in [(vec![10, 21], 32), (vec![], 0), (vec![0, 32], 32)] {
            let err = PipelineStages::explicit(bad.clone(), layers).unwrap_err();
            assert!(err.to_string().contains("partition"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn each_local_layer_is_read_once_from_the_stage_that_holds_it() {
        // Local and remote stage counts, and the model's layers: equal, 2 -> 1, 1 -> 2,
        // uneven splits, and more stages on either side.
        for (layers, local_pp, remote_pp) in [
            (32, 1, 1),
            (32, 2, 2),
            (32, 1, 2),
            (32, 2, 1),
            (5, 2, 1),
            (5, 1, 2),
            (7, 4, 2),
            (7, 2, 4),
            (61, 4, 3),
            (61, 3, 4),
            (10, 3, 2),
            (12, 4, 4),
        ] {
            let local = PipelineStages::even(layers, local_pp).unwrap();
            let remote = PipelineStages::even(layers, remote_pp).unwrap();
            let mut seen = vec![0; layers];
            for stage in 0..local_pp {
                let ours = local.layers(stage);
                for source in local.sources(stage, &remote).unwrap() {
                    let theirs = remote.layers(source.remote_stage);
                    for (i, layer) in source.layers.clone().enumerate() {
                        seen[layer] += 1;
                        assert_eq!(source.local_regions.start + i, layer - ours.start);
                        assert_eq!(source.remote_first_region + i, layer - theirs.start);
                        assert_eq!(remote.stage_of(layer), Some(source.remote_stage));
                    }
                }
            }
            assert!(
                seen.iter().all(|&n| n == 1),
                "{layers} layers, {local_pp} <- {remote_pp}: {seen:?}"
            );
        }
    }

    #[test]
    fn engines_of_different_models_are_refused() {
        let local = PipelineStages::even(32, 2).unwrap();
        let remote = PipelineStages::even(30, 2).unwrap();
        let err = local.sources(0, &remote).unwrap_err().to_string();
        assert!(err.contains("32 layers, the remote's 30"), "{err}");
        assert!(local.sources(2, &local).is_err());
    }

    fn rank(partition: &[u64], pp_rank: u64, regions: usize) -> StageOfRank<'_> {
        StageOfRank {
            partition,
            pp_rank,
            regions,
        }
    }

    fn shared(reader: StageOfRank<'_>, source: StageOfRank<'_>) -> (Range<usize>, Range<usize>) {
        let shared = shared_regions(reader, source).unwrap();
        (shared.local, shared.remote)
    }

    #[test]
    fn ranks_share_the_regions_of_the_layers_both_hold() {
        let halves = [16, 16];
        // No pipeline on either side: every region.
        assert_eq!(shared(rank(&[], 0, 32), rank(&[], 0, 32)), (0..32, 0..32));
        // Prefill PP 2 -> decode PP 1: each stage fills its half of the decode's regions.
        assert_eq!(
            shared(rank(&[], 0, 32), rank(&halves, 1, 16)),
            (16..32, 0..16)
        );
        assert_eq!(
            shared(rank(&[], 0, 32), rank(&halves, 0, 16)),
            (0..16, 0..16)
        );
        // Prefill PP 1 -> decode PP 2, two regions per layer (K and V apart).
        assert_eq!(
            shared(rank(&halves, 1, 32), rank(&[], 0, 64)),
            (0..32, 32..64)
        );
        // Equal PP: the same stage is read whole, the other shares nothing.
        assert_eq!(
            shared(rank(&halves, 1, 16), rank(&halves, 1, 16)),
            (0..16, 0..16)
        );
        assert_eq!(
            shared(rank(&halves, 1, 16), rank(&halves, 0, 16)),
            (0..0, 0..0)
        );
        // An explicit partition against an even one: layers 10..16.
        assert_eq!(
            shared(rank(&[10, 22], 1, 22), rank(&halves, 0, 16)),
            (0..6, 10..16)
        );
    }

    #[test]
    fn stages_that_cannot_pair_are_refused_by_name() {
        let halves = [16, 16];
        for (reader, source, named) in [
            (rank(&[], 0, 31), rank(&halves, 0, 16), "31 regions"),
            (
                rank(&[], 0, 64),
                rank(&halves, 0, 16),
                "2 regions per layer (reader) vs 1",
            ),
            (
                rank(&halves, 2, 16),
                rank(&[], 0, 32),
                "pp_rank 2 of 2 stages",
            ),
            (
                rank(&[16, 15], 0, 16),
                rank(&halves, 0, 16),
                "31 layers, the remote's 32",
            ),
            (rank(&[], 0, 32), rank(&[0, 32], 1, 32), "each with a layer"),
            (
                rank(&[], 0, 32),
                rank(&[u64::MAX, 2], 1, 2),
                "whose layers add up",
            ),
        ] {
            let err = shared_regions(reader, source).unwrap_err();
            assert!(err.contains(named), "{named}: {err}");
        }
        let many = vec![1; MAX_PP_SIZE + 1];
        let err = shared_regions(rank(&[], 0, 1), rank(&many, 0, 1)).unwrap_err();
        assert!(err.contains("stages"), "{err}");
    }

    #[test]
    fn vllms_partition_string_is_read_as_vllm_reads_it() {
        let stages = PipelineStages::from_vllm_partition("10, 22", 2, 32).unwrap();
        assert_eq!((stages.layers(0), stages.layers(1)), (0..10, 10..32));
        for (bad, named) in [
            ("10,x", "Invalid partition string"),
            ("10,11,11", "has 3 stages, the engine 2"),
            ("10,21", "holds 31 layers"),
        ] {
            let err = PipelineStages::from_vllm_partition(bad, 2, 32).unwrap_err();
            assert!(err.to_string().contains(named), "{bad}: {err}");
        }
    }

    #[test]
    fn a_rank_is_one_of_its_engines_stages() {
        let stages = PipelineStages::even(5, 2).unwrap();
        let rank = PipelineRank::new(stages.clone(), 1).unwrap();
        assert_eq!((rank.pp_rank(), rank.partition()), (1, vec![3, 2]));
        assert_eq!(rank.regions_per_layer(4).unwrap(), 2);
        for bad in [0, 3] {
            let err = rank.regions_per_layer(bad).unwrap_err().to_string();
            assert!(err.contains("layers of stage 1"), "{err}");
        }
        assert!(PipelineRank::new(stages, 2).is_err());
    }
}
