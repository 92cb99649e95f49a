//! Attention over a paged cache (every packing, HND and NHD, two block sizes, blocks out
//! of order, TP 1 and 2; a hybrid model's two KV cache groups in regions of their own or
//! shared) gives bit for bit the tokens and logits of the same model over a plain
//! contiguous cache.

use kv_model::{
    argmax, greedy, kv_heads_of_rank, ContiguousKv, GroupRegions, KvPacking, Model, ModelConfig,
    PagedKv, PagedLayout,
};
use nixl_connector::KvLayout;

const PROMPT: usize = 37;
const STEPS: usize = 12;

fn prompt(vocab: usize) -> Vec<usize> {
    (0..PROMPT).map(|i| (i * 37 + 11) % vocab).collect()
}

/// The run of one process over a contiguous cache: the prompt's last logits, then the
/// generation.
fn contiguous_run(model: &Model, tp: usize) -> (Vec<f32>, kv_model::Generation) {
    let c = model.config();
    let mut ranks: Vec<ContiguousKv> = (0..tp)
        .map(|r| {
            ContiguousKv::new(
                c.layers,
                kv_heads_of_rank(c.kv_heads, r, tp),
                c.cached_dim(),
            )
        })
        .collect();
    let logits = model.prefill(&prompt(c.vocab), &mut ranks);
    let generation = greedy(model, argmax(&logits), PROMPT, STEPS, &mut ranks);
    (logits, generation)
}

fn paged_run(
    model: &Model,
    (packing, regions): (KvPacking, GroupRegions),
    layout: KvLayout,
    block_size: usize,
    tp: usize,
) -> (Vec<f32>, kv_model::Generation) {
    let c = model.config();
    let blocks = (PROMPT + STEPS).div_ceil(block_size);
    let groups = c.kv_cache_groups();
    let num_blocks = blocks * groups + 3;
    let spec = PagedLayout::spec(c, packing, regions, layout, block_size, num_blocks, tp);
    // Blocks out of order, skipping some; each group's blocks its own (one block pool).
    let tables: Vec<Vec<usize>> = (0..groups)
        .map(|g| {
            (0..blocks)
                .map(|i| ((i * groups + g) * 5 + 2) % num_blocks)
                .collect()
        })
        .collect();
    let mut ranks: Vec<PagedKv<Vec<Vec<u8>>>> = (0..tp)
        .map(|r| {
            let layout = PagedLayout::new(c, &spec, packing, regions, r, tp).unwrap();
            let memory = (0..spec.num_regions())
                .map(|region| vec![0u8; spec.region_len(region)])
                .collect();
            PagedKv::new(layout, memory, tables.clone())
        })
        .collect();
    let logits = model.prefill(&prompt(c.vocab), &mut ranks);
    let generation = greedy(model, argmax(&logits), PROMPT, STEPS, &mut ranks);
    (logits, generation)
}

#[test]
fn paged_attention_equals_contiguous_attention() {
    let model = Model::seeded(ModelConfig::small(), 44);
    for tp in [1, 2] {
        let want = contiguous_run(&model, tp);
        for packing in [KvPacking::Packed, KvPacking::Halves, KvPacking::Separate] {
            for layout in [KvLayout::Hnd, KvLayout::Nhd] {
                for block_size in [4, 16] {
                    let got =
                        paged_run(&model, (packing, GroupRegions::Own), layout, block_size, tp);
                    assert!(
                        got == want,
                        "TP {tp}, {packing:?} {layout} blocks of {block_size}"
                    );
                }
            }
        }
    }
}

#[test]
fn hybrid_paged_attention_equals_contiguous_attention() {
    let config = ModelConfig {
        sliding_window: Some(6),
        ..ModelConfig::small()
    };
    let model = Model::seeded(config, 44);
    // The window changes what the model computes.
    assert_ne!(
        contiguous_run(&model, 1),
        contiguous_run(&Model::seeded(ModelConfig::small(), 44), 1)
    );
    for tp in [1, 2] {
        let want = contiguous_run(&model, tp);
        for packing in [KvPacking::Packed, KvPacking::Separate] {
            for regions in [GroupRegions::Own, GroupRegions::Shared] {
                let got = paged_run(&model, (packing, regions), KvLayout::Hnd, 4, tp);
                assert!(got == want, "TP {tp}, {packing:?}, {regions:?} regions");
            }
        }
    }
}

#[test]
fn mla_like_paged_attention_equals_contiguous_attention() {
    let config = ModelConfig {
        kv_heads: 1,
        latent_dim: Some(24),
        ..ModelConfig::small()
    };
    let model = Model::seeded(config, 44);
    for tp in [1, 2] {
        let want = contiguous_run(&model, tp);
        for layout in [KvLayout::Hnd, KvLayout::Nhd] {
            for block_size in [4, 16] {
                let packing = (KvPacking::Latent, GroupRegions::Own);
                let got = paged_run(&model, packing, layout, block_size, tp);
                assert!(got == want, "TP {tp}, {layout} blocks of {block_size}");
            }
        }
    }
}

#[test]
fn tp_ranks_summed_match_one_rank() {
    let model = Model::seeded(ModelConfig::small(), 44);
    let (one_logits, one) = contiguous_run(&model, 1);
    let (two_logits, two) = contiguous_run(&model, 2);
    assert_eq!(one.tokens, two.tokens);
    for (a, b) in
        std::iter::once((&one_logits, &two_logits)).chain(one.logits.iter().zip(&two.logits))
    {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-4 * y.abs().max(1.0), "{x} against {y}");
        }
    }
}

#[test]
fn the_generation_depends_on_the_cache() {
    // A cache with one position's K and V changed changes the logits: the tests' oracle
    // sees the KV it reads.
    let model = Model::seeded(ModelConfig::small(), 44);
    let c = model.config();
    let (_, want) = contiguous_run(&model, 1);
    let mut cache = vec![ContiguousKv::new(c.layers, 0..c.kv_heads, c.cached_dim())];
    let logits = model.prefill(&prompt(c.vocab), &mut cache);
    let (mut key, mut value) = (vec![0.0; c.head_dim], vec![0.0; c.head_dim]);
    kv_model::KvCache::load(&cache[0], 0, 1, 5, &mut key, &mut value);
    value[0] += 0.5;
    kv_model::KvCache::store(&mut cache[0], 0, 1, 5, &key, &value);
    let got = greedy(&model, argmax(&logits), PROMPT, STEPS, &mut cache);
    assert_ne!(got.logits[0], want.logits[0]);
    let distinct: std::collections::BTreeSet<_> = want.tokens.iter().collect();
    assert!(distinct.len() > 2, "a varied generation: {:?}", want.tokens);
}
