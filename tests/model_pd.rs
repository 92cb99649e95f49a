//! A small transformer served prefill → decode through the connector over real NIXL, the
//! prefill in a child process (both engines in this one for the two-turn conversation):
//! the decode's tokens equal one process's, and every logit lies within 1e-4 of it (see
//! `model_support`).

mod common;
mod model_support;

use model_support::{decode_against_prefill, Scenario};

/// The prefill engine of a case, which the case starts in a child process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the prefill engine of the model tests, which start it"]
async fn prefill_role() {
    model_support::prefill_role().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp1_to_tp1_native() {
    decode_against_prefill(&Scenario::tp1(false), "prefill_role").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp1_to_tp1_vllm() {
    decode_against_prefill(&Scenario::tp1(true), "prefill_role").await;
}

/// Case 1 in other layouts: NHD with K and V halves per block, and HND with K and V in
/// regions of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp1_to_tp1_other_layouts() {
    use model_support::{Layout, Packing};
    let halves = Scenario {
        packing: Packing::Halves,
        layout: Layout::Nhd,
        ..Scenario::tp1(false)
    };
    decode_against_prefill(&halves, "prefill_role").await;
    let separate = Scenario {
        packing: Packing::Separate,
        ..Scenario::tp1(true)
    };
    decode_against_prefill(&separate, "prefill_role").await;
}

/// Case 3's MLA-like model: one latent of 24 elements per token and layer, replicated on
/// every rank (K and V its up-projections), TP 1 → 1 and prefill TP 2 → decode TP 1, both
/// protocols.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mla_like_latent() {
    for vllm in [false, true] {
        for (prefill, decode) in [(1, 1), (2, 1)] {
            let scenario = Scenario {
                packing: model_support::Packing::Latent,
                kv_heads: 1,
                latent_dim: Some(24),
                ..Scenario::tp1(vllm).tp(prefill, decode)
            };
            decode_against_prefill(&scenario, "prefill_role").await;
        }
    }
}

/// Case 5: the decode computes its first two blocks (32 tokens) itself and loads the rest
/// of the 53-token prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_hit_inside_the_prompt() {
    for vllm in [false, true] {
        let scenario = Scenario {
            prefix_blocks: 2,
            ..Scenario::tp1(vllm)
        };
        decode_against_prefill(&scenario, "prefill_role").await;
    }
}

/// Case 4: prefill blocks of 16 tokens, decode blocks of 32, and the reverse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_size_ratios() {
    for vllm in [false, true] {
        for (prefill, decode) in [(16, 32), (32, 16)] {
            let scenario = Scenario::tp1(vllm).block_sizes(prefill, decode);
            decode_against_prefill(&scenario, "prefill_role").await;
        }
    }
}

/// Case 2: prefill TP 2 → decode TP 1, and TP 1 → 2 (the decode's ranks in this process,
/// their attention outputs summed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heterogeneous_tp() {
    for vllm in [false, true] {
        for (prefill, decode) in [(2, 1), (1, 2)] {
            let scenario = Scenario::tp1(vllm).tp(prefill, decode);
            decode_against_prefill(&scenario, "prefill_role").await;
        }
    }
}

/// Case 3: 2 KV heads, fewer than the TP of 4 (each head replicated on two ranks), against
/// TP 1 and TP 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_kv_heads() {
    for (prefill, decode) in [(4, 1), (1, 4), (2, 4)] {
        let scenario = Scenario {
            kv_heads: 2,
            ..Scenario::tp1(false).tp(prefill, decode)
        };
        decode_against_prefill(&scenario, "prefill_role").await;
    }
}

/// Case 7: a hybrid model, its second layer attending to a sliding window of 12 tokens (two
/// KV cache groups, vLLM's hybrid KV cache manager): the window group hands over only the
/// last two of the prompt's four blocks, in regions of the groups' own and in regions the
/// groups share; both protocols.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hybrid_sliding_window() {
    for vllm in [false, true] {
        for shared_regions in [false, true] {
            let scenario = Scenario {
                sliding_window: Some(12),
                shared_regions,
                ..Scenario::tp1(vllm)
            };
            decode_against_prefill(&scenario, "prefill_role").await;
        }
    }
}

/// Issue #48 item 6: a two-turn conversation, both engines in this process. The decode
/// keeps turn 1 (a 53-token prompt and 9 tokens of answer); turn 2 (those and 5 new tokens)
/// reads 45 tokens back from it into the prefill, which holds turn 1's first block itself
/// and computes only the last 6 tokens; the decode loads only turn 2's last 2 blocks. Both
/// turns' tokens equal one process's, every logit within 1e-4; TP 1 → 1, 2 → 1 and 1 → 2
/// (the read-back crossing TP sizes the other way), both protocols.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_turn_reads_back() {
    for vllm in [false, true] {
        for (prefill, decode) in [(1, 1), (2, 1), (1, 2)] {
            let scenario = Scenario {
                steps: 8,
                second_turn: Some(5),
                ..Scenario::tp1(vllm).tp(prefill, decode)
            };
            model_support::two_turns(&scenario).await;
        }
    }
}
