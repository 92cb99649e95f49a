//! Pipeline-parallel stages: which layers each stage of an engine holds (vLLM's
//! `get_pp_indices`, or an explicit partition as `VLLM_PP_LAYER_PARTITION` gives it), and,
//! for a stage of one engine, which stage of another holds each of its layers and at which
//! of that stage's regions (vLLM's `_remote_region_offset`).
//!
//! vLLM's rule: every stage gets `layers / stages` layers, and the `layers % stages` left
//! over go one each to the stages before the last, from the second-to-last backwards (the
//! first stage holds the embeddings and the last the head, so they are spared where they
//! can be).

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
        // from the second-to-last backwards.
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
}
