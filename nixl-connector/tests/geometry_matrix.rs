//! The connector's KV geometries, as real models have them: {prefill TP → decode TP: 1 → 2,
//! 2 → 1, 4 → 2, 2 → 4} × {MHA in HND, MLA} × {the same block size, the prefill's twice the
//! decode's, the decode's twice the prefill's}, with regions of different lengths (K and V
//! of different head sizes, FlashInfer-style K and V halves in one block; MLA latents of two
//! sizes), plus replicated KV heads (TP larger than the KV heads) on either side.
//!
//! Every case moves data: each decode rank loads two requests (the whole prompt, ending
//! inside a block; then the same prompt with its first decode block in the prefix cache),
//! and every byte of every decode rank's cache is checked against the independent model of
//! `common::geometry` (each byte read once: the bytes moved are exactly the model's);
//! every prefill rank holding a request is notified and frees it. Every geometry the
//! mapping does not support is refused by name before any READ: nothing is read, the
//! decode's cache keeps every byte, and the message names what differs.
//!
//! A hybrid model of two KV cache groups (full attention and a sliding window sharing every
//! region) runs through the same model, each group's blocks as the model's own reading of
//! the window says, with blocks of as many tokens on both engines or decode blocks of a
//! multiple of the prefill's; so does one of full attention and an SSM (Mamba) group, its
//! state blocks checked against the test's own reading of vLLM's state page, pulled and
//! pushed (the prefill ranks WRITE it, in push mode).
//!
//! The ranks of both engines run in this process, on one runtime (the two-process cases
//! are in hetero_tp.rs); the caches are small, so the whole matrix runs in seconds.

mod common;

use nixl_connector::{Error, KvAttention, KvConnectorWorker, KvLayout, KvRegionKind, Protocol};

use common::geometry::{engine, Model, Request, Side};
use common::hybrid::{
    run_hybrid_cases, run_hybrid_cases_per_id, run_hybrid_cases_with_region_groups, PerId,
    HYBRID_BLOCKS,
};
use common::matrix::{run_cases_speaking, BLOCKS, WAIT};
use common::poll_until;
use common::ssm::{
    another_state_is_refused, run_ssm_cases, run_ssm_cases_per_id,
    run_ssm_cases_with_region_groups, run_ssm_push_cases, SSM_BLOCKS,
};

/// MHA, 4 KV heads, HND: K with 16-byte head tokens, V with 8-byte ones (separate regions
/// of different lengths), and a layer with K and V halves in each block.
fn mha(total_kv_heads: usize) -> Model {
    Model {
        attention: KvAttention::Mha { total_kv_heads },
        layout: KvLayout::Hnd,
        regions: vec![
            (KvRegionKind::Tensor, 16),
            (KvRegionKind::Tensor, 8),
            (KvRegionKind::KvHalves, 8),
        ],
    }
}

/// MLA: two layers' latents of different sizes.
fn mla() -> Model {
    Model {
        attention: KvAttention::Mla,
        layout: KvLayout::Hnd,
        regions: vec![(KvRegionKind::Tensor, 24), (KvRegionKind::Tensor, 8)],
    }
}

/// Runs every case of `cases` for `model`, both engines speaking the native protocol.
async fn run_cases(model: &Model, cases: &[(Side, Side)]) {
    run_cases_speaking(model, cases, Protocol::Native).await
}

/// The matrix's cases: TP pairs × block sizes.
fn matrix() -> Vec<(Side, Side)> {
    let side = |tp, block_size| Side {
        tp,
        block_size,
        num_blocks: BLOCKS,
    };
    let mut cases = Vec::new();
    for (p, d) in [(1, 2), (2, 1), (4, 2), (2, 4)] {
        for (pb, db) in [(4, 4), (8, 4), (4, 8)] {
            cases.push((side(p, pb), side(d, db)));
        }
    }
    cases
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mha_in_hnd_moves_every_byte_where_the_model_says() {
    common::init_tracing();
    run_cases(&mha(4), &matrix()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mla_moves_every_byte_where_the_model_says() {
    common::init_tracing();
    run_cases(&mla(), &matrix()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_kv_heads_are_read_once_each() {
    common::init_tracing();
    let side = |tp, block_size| Side {
        tp,
        block_size,
        num_blocks: BLOCKS,
    };
    // 2 KV heads: TP 4 holds each head on two ranks (prefill, decode, or both); one KV head
    // (MQA) on every rank of a TP-2 prefill.
    run_cases(
        &mha(2),
        &[
            (side(1, 4), side(4, 4)),
            (side(4, 4), side(2, 8)),
            (side(2, 4), side(4, 4)),
            (side(4, 8), side(1, 4)),
        ],
    )
    .await;
    run_cases(
        &mha(1),
        &[(side(2, 4), side(1, 4)), (side(1, 4), side(2, 8))],
    )
    .await;
}

/// A hybrid model of two KV cache groups sharing every region (full attention and a
/// sliding window, as vLLM 0.33 serves them), handed over by the schedulers one list per
/// group: the window group reads only its last blocks, every group's decode blocks pair
/// with its prefill blocks at their tokens of the prompt, over TP both ways, MHA (regions
/// of different lengths, K and V halves) and MLA, with blocks of as many tokens or decode
/// blocks of twice the prefill's (vLLM's `block_size_ratio`: each group's blocks read a
/// prefill block at a time, the window clipped by each engine in its own blocks; vLLM's
/// protocol in vllm_mode.rs); a prefill of larger blocks than the decode's is refused by
/// name (vLLM 0.33 asserts the decode's block size is a multiple of the prefill's). The
/// native handshake says each rank's kernel blocks per block id and each region's group, as
/// vLLM's metadata does: block ids of two kernel blocks on either engine, and regions of
/// each group's own (a group's blocks read only in its regions and the shared ones, vLLM's
/// `_compute_desc_ids` with region group mapping).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_kv_cache_groups_move_every_byte_where_the_model_says() {
    common::init_tracing();
    let side = |tp, block_size| Side {
        tp,
        block_size,
        num_blocks: HYBRID_BLOCKS,
    };
    let mut cases: Vec<(Side, Side)> = [(1, 2), (2, 1), (4, 2), (2, 4)]
        .map(|(p, d)| (side(p, 4), side(d, 4)))
        .to_vec();
    cases.push((side(1, 4), side(2, 8)));
    cases.push((side(4, 4), side(2, 8)));
    cases.push((side(2, 4), side(1, 16)));
    cases.push((side(2, 8), side(1, 4)));
    run_hybrid_cases(&mha(4), &cases, Protocol::Native).await;
    let mla_cases = [cases[0], cases[1], cases[4], cases[7]];
    run_hybrid_cases(&mla(), &mla_cases, Protocol::Native).await;
    let per_id = |prefill, decode| PerId { prefill, decode };
    let kernel = [(side(1, 4), side(2, 4)), (side(2, 4), side(1, 8))];
    for ids in [per_id(2, 1), per_id(1, 2), per_id(2, 2)] {
        run_hybrid_cases_per_id(&mha(4), &kernel, Protocol::Native, ids).await;
    }
    // Three regions: the window's, a shared one, the full attention's.
    let three = Model {
        regions: vec![
            (KvRegionKind::Tensor, 16),
            (KvRegionKind::Tensor, 8),
            (KvRegionKind::Tensor, 12),
        ],
        ..mha(4)
    };
    for protocol in [Protocol::Native, Protocol::Vllm] {
        run_hybrid_cases_with_region_groups(&three, &cases[..5], protocol, &[1, -1, 0]).await;
    }
}

/// A side of the attention and SSM model's cases: TP `tp`, blocks of `block_size` tokens.
fn ssm_side(tp: usize, block_size: usize) -> Side {
    Side {
        tp,
        block_size,
        num_blocks: SSM_BLOCKS,
    }
}

/// The attention of the attention and SSM model: MHA of 4 KV heads, two regions.
fn ssm_model() -> Model {
    Model {
        attention: KvAttention::Mha { total_kv_heads: 4 },
        layout: KvLayout::Hnd,
        regions: vec![(KvRegionKind::Tensor, 16), (KvRegionKind::Tensor, 8)],
    }
}

/// MLA's replicated latent beside the state.
fn ssm_mla() -> Model {
    Model {
        attention: KvAttention::Mla,
        layout: KvLayout::Hnd,
        regions: vec![(KvRegionKind::Tensor, 24), (KvRegionKind::Tensor, 16)],
    }
}

/// [`ssm_model`] of three regions, for regions of their own.
fn ssm_three_regions() -> Model {
    Model {
        regions: vec![
            (KvRegionKind::Tensor, 16),
            (KvRegionKind::Tensor, 8),
            (KvRegionKind::Tensor, 12),
        ],
        ..ssm_model()
    }
}

/// A hybrid model of a full-attention group and an SSM (Mamba) group sharing every region,
/// in both protocols (vLLM 0.33's Mamba2-style models: three conv sub-projections and a
/// temporal state, padded to the attention page): the SSM group reads only its
/// state-bearing block, in every region only the state's bytes, each part where vLLM's
/// `_build_mamba_local` puts it, a decode of a larger TP its slice of each part, one of a
/// smaller TP each prefill rank's whole parts as its slices; over TP 1, 2 and 4, MHA with
/// regions of two lengths, MLA, and MHA of heads replicated over the prefill's ranks: from a
/// larger prefill TP, the state is read from every prefill rank of a decode rank's group,
/// the attention from the ranks vLLM reads it from (MLA's latent from one, each replicated
/// head from its first rank), as vLLM's `source_ranks_per_group`. Decode blocks of 2
/// and 4 times the prefill's, and block ids of one or two kernel blocks on either engine,
/// move the state block whole (vLLM's Mamba pages move 1:1), each engine's page its block
/// id's kernel blocks; and regions of their own, the state only in the SSM group's and the
/// shared ones. Each in both protocols.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attention_and_ssm_model_moves_every_byte_where_the_model_says() {
    common::init_tracing();
    let side = ssm_side;
    let model = ssm_model();
    let cases = [
        (side(1, 4), side(1, 4)),
        (side(2, 4), side(2, 4)),
        (side(1, 4), side(2, 4)),
        (side(2, 4), side(4, 4)),
        (side(2, 4), side(1, 4)),
        (side(4, 4), side(2, 4)),
        (side(2, 8), side(2, 4)),
        // Decode blocks of 2 and 4 times the prefill's tokens: the state block whole.
        (side(1, 4), side(1, 8)),
        (side(1, 4), side(2, 8)),
        (side(2, 4), side(1, 16)),
    ];
    for protocol in [Protocol::Vllm, Protocol::Native] {
        run_ssm_cases(&model, &cases, protocol).await;
    }
    // MLA's replicated latent beside the state split across the ranks.
    let mla = ssm_mla();
    let mla_cases: Vec<(Side, Side)> = cases[..6].iter().chain(&cases[7..8]).copied().collect();
    for protocol in [Protocol::Vllm, Protocol::Native] {
        run_ssm_cases(&mla, &mla_cases, protocol).await;
    }
    // KV heads replicated over a prefill TP larger than their count: the attention read
    // from one prefill rank of each head, the state from every rank.
    let replicated = Model {
        attention: KvAttention::Mha { total_kv_heads: 2 },
        ..model.clone()
    };
    let replicated_cases = [(side(4, 4), side(1, 4)), (side(4, 4), side(2, 4))];
    for protocol in [Protocol::Vllm, Protocol::Native] {
        run_ssm_cases(&replicated, &replicated_cases, protocol).await;
    }
    // Regions of their own (each handshake says each region's group): one shared, one the
    // SSM group's, one the attention's; the state only where Mamba layers are, the
    // attention in every region.
    let three = ssm_three_regions();
    for protocol in [Protocol::Vllm, Protocol::Native] {
        run_ssm_cases_with_region_groups(&three, &cases[..6], protocol, &[-1, 1, 0]).await;
    }
    // Block ids of two kernel blocks each on both engines: a state page is an id's two.
    let paired = |tp, block_size| Side {
        tp,
        block_size,
        num_blocks: 2 * SSM_BLOCKS,
    };
    let per_id = |prefill, decode| PerId { prefill, decode };
    let two = [
        (paired(1, 4), paired(1, 4)),
        (paired(1, 4), paired(2, 8)),
        (paired(2, 4), paired(1, 4)),
    ];
    // Other counts on the two engines too: the state page is each engine's block id, the
    // attention paired at its tokens, past a prefix hit too (vLLM 0.33 reads these only
    // without prefix caching, from the prompt's first block).
    for protocol in [Protocol::Vllm, Protocol::Native] {
        for ids in [per_id(2, 2), per_id(2, 1), per_id(1, 2)] {
            run_ssm_cases_per_id(&model, &two, protocol, ids).await;
            run_ssm_cases_per_id(&mla, &two[..1], protocol, ids).await;
        }
    }
}

/// The attention and SSM model in push mode, in both protocols: prefill TP 1 → 1, 2 → 2,
/// 2 → 1 and 4 → 2 (each prefill rank WRITEs its share of the state into the decode rank's
/// page and its heads into its blocks), MLA's latent beside the state, KV heads replicated
/// over the prefill's ranks, and regions of their own; every byte of every decode rank, each
/// written once, past a prefix hit on the decode too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attention_and_ssm_model_is_pushed_where_the_model_says() {
    common::init_tracing();
    let side = ssm_side;
    let model = ssm_model();
    let cases = [
        (side(1, 4), side(1, 4)),
        (side(2, 4), side(2, 4)),
        (side(2, 4), side(1, 4)),
        (side(4, 4), side(2, 4)),
    ];
    let mla = ssm_mla();
    let replicated = Model {
        attention: KvAttention::Mha { total_kv_heads: 2 },
        ..model.clone()
    };
    let three = ssm_three_regions();
    for protocol in [Protocol::Vllm, Protocol::Native] {
        run_ssm_push_cases(&model, &cases, protocol, &[]).await;
        run_ssm_push_cases(&mla, &cases[..3], protocol, &[]).await;
        run_ssm_push_cases(&replicated, &[(side(4, 4), side(1, 4))], protocol, &[]).await;
        run_ssm_push_cases(&three, &cases[..3], protocol, &[-1, 1, 0]).await;
    }
}

/// A decode whose SSM state is not the prefill's is refused in the handshake by name, and
/// reads nothing: in vLLM's protocol by the state's sums (`ssm_sizes`, all its metadata
/// says), in the native one part by part, so also a state of the same sums split otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_of_another_ssm_state_is_refused_by_name() {
    common::init_tracing();
    let model = ssm_model();
    let other = |protocol, state, reason| another_state_is_refused(&model, protocol, state, reason);
    other(
        Protocol::Vllm,
        (&[16, 4, 4], 16),
        "ssm_sizes (24, 32) (source, TP 1) vs the reader's (24, 16)",
    )
    .await
    .unwrap();
    other(
        Protocol::Native,
        (&[16, 4, 4], 16),
        "SSM (Mamba) state of conv_bytes [16, 4, 4] and temporal_bytes 32 per rank at TP 1 (source) vs conv_bytes [16, 4, 4] and temporal_bytes 16",
    )
    .await
    .unwrap();
    // The same sums, split otherwise: vLLM's metadata could not tell.
    other(
        Protocol::Native,
        (&[8, 8, 8], 32),
        "vs conv_bytes [8, 8, 8] and temporal_bytes 32 at TP 1 (reader)",
    )
    .await
    .unwrap();
}

/// A geometry the decode cannot read: the load is refused naming `reason`, before any READ
/// (nothing read, every byte of the decode's cache as it was).
async fn refused(
    case: usize,
    (prefill_model, prefill): (&Model, Side),
    (decode_model, decode): (&Model, Side),
    (num_tokens, local): (Option<usize>, usize),
    reason: &str,
) {
    let tag = format!("refused-{case}");
    let engine_id = format!("pf-{tag}");
    let prefills = engine(&engine_id, prefill_model, &prefill);
    let decodes = engine(&format!("dc-{tag}"), decode_model, &decode);
    for (rank, worker) in prefills.iter().enumerate() {
        prefill_model.fill_prefill(worker, &prefill, rank);
    }
    let request = Request {
        id: tag.clone(),
        remote: vec![1, 2],
        local: (0..local).collect(),
        num_tokens,
    };
    let port = prefills[0].side_channel_addr().unwrap().port();
    for (rank, worker) in decodes.iter().enumerate() {
        decode_model.fill_sentinel(worker, &decode);
        let from = Model::remote(&request, &engine_id, port, prefill.tp);
        match worker.start_load(&request.id, &request.local, &from) {
            Err(Error::InvalidArgument { reason: why, .. }) => {
                assert!(why.contains(reason), "{why}");
                continue;
            }
            Err(other) => panic!("{other}"),
            Ok(()) => {}
        }
        poll_until(worker, WAIT, |f| !f.recving.is_empty()).await;
        let metrics = worker.metrics();
        let failure = metrics[0].failure.clone().expect("the load is refused");
        assert!(failure.contains(reason), "decode rank {rank}: {failure}");
        assert_eq!(
            (metrics[0].bytes, metrics[0].descriptors),
            (0, 0),
            "nothing read"
        );
        assert_eq!(worker.load_errors().len(), local);
        decode_model
            .check_decode(worker, &prefill, &decode, rank, &[])
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_geometries_are_refused_by_name_before_any_read() {
    common::init_tracing();
    let side = |tp, block_size| Side {
        tp,
        block_size,
        num_blocks: BLOCKS,
    };
    let mut nhd = mha(4);
    nhd.layout = KvLayout::Nhd;
    let mut other_v = mha(4);
    other_v.regions[1].1 = 16;
    let mut unsplit = mha(4);
    unsplit.regions[2].0 = KvRegionKind::Tensor;
    unsplit.regions[2].1 = 16;
    let mut fewer = mha(4);
    fewer.regions.pop();
    let one = |p: &Model,
               d: &Model,
               (pt, pb): (usize, usize),
               (dt, db): (usize, usize),
               reason: &'static str| {
        (p.clone(), side(pt, pb), d.clone(), side(dt, db), reason)
    };
    let cases = [
        one(
            &mha(6),
            &mha(6),
            (2, 4),
            (3, 4),
            "one TP size must divide the other",
        ),
        one(
            &mha(4),
            &mha(4),
            (1, 4),
            (1, 6),
            "block size 6 (reader) vs 4 (source): one must divide the other",
        ),
        one(
            &mha(4),
            &mla(),
            (1, 4),
            (1, 4),
            "attention: MLA (reader) vs MHA with 4 KV heads (source)",
        ),
        one(
            &nhd,
            &nhd,
            (1, 4),
            (2, 4),
            "NHD blocks keep a head's tokens apart",
        ),
        one(
            &mha(4),
            &other_v,
            (1, 4),
            (1, 4),
            "region 1: block length 256 (reader, TP 1, 4 tokens) vs 128 (source, TP 1, 4 tokens)",
        ),
        one(
            &mha(4),
            &unsplit,
            (1, 4),
            (1, 4),
            "region 2: one tensor (reader) vs K and V halves (source)",
        ),
        one(
            &mha(4),
            &fewer,
            (1, 4),
            (1, 4),
            "regions: 2 (reader) vs 3 (source)",
        ),
    ];
    for (case, (p, ps, d, ds, reason)) in cases.iter().enumerate() {
        refused(case, (p, *ps), (d, *ds), (None, 2), reason).await;
    }
    // Larger prefill blocks, a prefix hit and no token count: where the decode's blocks
    // start in the prompt is not known.
    let model = mha(4);
    let (p, d) = ((&model, side(1, 8)), (&model, side(1, 4)));
    refused(cases.len(), p, d, (None, 3), "pass num_tokens").await;
    // Heads that do not split over the TP are refused at registration.
    let err = KvConnectorWorker::new(common::geometry::rank_config("dc-six", 0, 4, 0))
        .unwrap()
        .register_host_kv_caches(mha(6).spec(&side(4, 4)))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("TP 4 and 6 KV heads: one must divide the other"),
        "{err}"
    );
}
