//! The geometry matrix for a hybrid model of two KV cache groups sharing every region (a
//! full-attention group and a sliding-window one, as vLLM 0.33 serves them): both engines'
//! schedulers hand the blocks over one list per group, and every byte of every decode rank
//! is checked against the model of [`super::geometry`], given which blocks each group needs
//! as computed here from the window's definition.

use nixl_connector::{
    KvCacheGroupKind, KvCacheGroups, KvConnectorScheduler, Protocol, SchedulerConfig,
};

use super::geometry::{engine_speaking, Model, Request, Side, NOT_LISTED};
use super::matrix::{
    attention_label, await_freed, fill, hand_over, run_each, GroupsHandover, RankEnd,
};
use super::{cpu_config, vllm_config, vllm_factors};

/// Blocks per region of the hybrid cases: room for two groups of two requests of up to 15
/// blocks.
pub const HYBRID_BLOCKS: usize = 64;

/// The sliding window's tokens: with blocks of `block_size` tokens the group needs the last
/// `window / block_size` blocks that hold it whole, and one more for a window that begins
/// inside a block.
const WINDOW_TOKENS: usize = 6;

/// The groups of the hybrid model over blocks of `block_size` tokens, each region's group
/// `region_groups` (none: every region shared).
fn groups(block_size: usize, region_groups: &[i64]) -> KvCacheGroups {
    KvCacheGroups::new(
        block_size,
        vec![
            KvCacheGroupKind::FullAttention,
            KvCacheGroupKind::SlidingWindow {
                window_tokens: WINDOW_TOKENS,
            },
        ],
    )
    .unwrap()
    .with_region_groups(region_groups.to_vec())
    .unwrap()
}

/// The blocks of `ids` (a prompt's, from its first token or from the first the decode
/// lacks, in order) that group `group` needs: all of them for full attention; for the
/// window, the blocks holding the last [`WINDOW_TOKENS`] tokens of a prompt that could end
/// anywhere in its last block, and so at most one block more than those tokens fill.
fn needed(group: usize, ids: &[usize], block_size: usize) -> Vec<usize> {
    if group == 0 {
        return ids.to_vec();
    }
    let whole = WINDOW_TOKENS.div_ceil(block_size);
    ids[ids.len().saturating_sub(whole + 1)..].to_vec()
}

/// A scheduler of an engine of TP `tp` speaking `protocol`, reached at `port`, with the
/// hybrid model's groups.
fn scheduler(
    engine: &str,
    port: u16,
    tp: usize,
    block_size: usize,
    protocol: Protocol,
) -> KvConnectorScheduler {
    let kv = match protocol {
        Protocol::Native => cpu_config(),
        Protocol::Vllm => vllm_config(vllm_factors()),
    };
    let config = SchedulerConfig::new(engine, "127.0.0.1", port, tp, &kv).unwrap();
    KvConnectorScheduler::new(config).with_kv_cache_groups(groups(block_size, &[]))
}

/// One request of the case: each group's prefill blocks for the whole prompt, and each
/// group's decode blocks (the tail the decode lacks), for a prompt of `tokens`.
struct HybridRequest {
    id: String,
    tokens: usize,
    remote: [Vec<usize>; 2],
    local: [Vec<usize>; 2],
}

/// Kernel blocks per block id of each engine (vLLM's `physical_blocks_per_logical_kv_block`:
/// an engine's scheduler counts blocks of that many of its registered ones).
#[derive(Debug, Clone, Copy)]
pub struct PerId {
    /// The prefill's.
    pub prefill: usize,
    /// The decode's.
    pub decode: usize,
}

/// One kernel block per block id on both engines.
pub const WHOLE: PerId = PerId {
    prefill: 1,
    decode: 1,
};

/// The two requests of a case, a prompt of 7 prefill block ids ending one token short of
/// the last's end: the whole prompt, then the same prompt with the decode's first block id
/// in its prefix cache; each group's blocks apart from the other's (one block pool).
fn requests(tag: &str, prefill: &Side, decode: &Side, per_id: PerId) -> [HybridRequest; 2] {
    let ids = |first: usize, n: usize| (first..first + n).collect::<Vec<usize>>();
    let tokens = 7 * prefill.block_size * per_id.prefill - 1;
    let local = tokens.div_ceil(decode.block_size * per_id.decode);
    let remote = [ids(1, 7), ids(11, 7)];
    [
        HybridRequest {
            id: format!("{tag}-whole"),
            tokens,
            remote: remote.clone(),
            local: [ids(1, local), ids(1 + local, local)],
        },
        HybridRequest {
            id: format!("{tag}-hit"),
            tokens,
            remote,
            local: [ids(1 + 2 * local, local - 1), ids(3 * local, local - 1)],
        },
    ]
}

/// The kernel blocks of block `ids`, `per_id` each.
pub fn kernel_blocks(ids: &[usize], per_id: usize) -> Vec<usize> {
    ids.iter()
        .flat_map(|&id| (0..per_id).map(move |k| id * per_id + k))
        .collect()
}

/// What the model reads for `request`: per group, the blocks each side needs (each clipped
/// in its own block ids), as kernel blocks, the prefill's others not named, at their tokens
/// of the prompt; a decode kernel block past the prompt's last token holds nothing of it.
fn model_loads(
    request: &HybridRequest,
    prefill: &Side,
    decode: &Side,
    per_id: PerId,
) -> Vec<Request> {
    let unit = prefill.block_size.min(decode.block_size);
    let moved = request.tokens.div_ceil(unit) * unit;
    let decode_blocks = moved.div_ceil(decode.block_size);
    let dead = decode_blocks.div_ceil(per_id.decode) * per_id.decode - decode_blocks;
    (0..2)
        .map(|group| {
            let all = &request.remote[group];
            let listed = needed(group, all, prefill.block_size * per_id.prefill);
            let remote = all
                .iter()
                .flat_map(|b| {
                    let kept = listed.contains(b);
                    kernel_blocks(&[*b], per_id.prefill)
                        .into_iter()
                        .map(move |k| if kept { k } else { NOT_LISTED })
                })
                .collect();
            let needed_local = needed(
                group,
                &request.local[group],
                decode.block_size * per_id.decode,
            );
            let mut local = kernel_blocks(&needed_local, per_id.decode);
            local.truncate(local.len() - dead);
            Request {
                id: request.id.clone(),
                remote,
                local,
                num_tokens: Some(request.tokens),
            }
        })
        .collect()
}

/// One case: both requests handed over by the prefill's scheduler and loaded through the
/// decode's by every decode rank, every byte checked (each group's in its regions, of
/// `region_groups`, and the shared ones), every prefill rank freeing both.
async fn hybrid_case(
    model: &Model,
    (prefill, decode): (Side, Side),
    protocol: Protocol,
    (per_id, region_groups): (PerId, &[i64]),
) -> Result<(), String> {
    let tag = format!(
        "hybrid-{protocol}-{}-p{}-d{}-b{}x{}-{}x{}-rg{region_groups:?}",
        attention_label(model),
        prefill.tp,
        decode.tp,
        prefill.block_size,
        per_id.prefill,
        decode.block_size,
        per_id.decode,
    );
    let (prefill_size, decode_size) = (
        prefill.block_size * per_id.prefill,
        decode.block_size * per_id.decode,
    );
    // Each rank says its kernel blocks per block id (from its groups' block size) and its
    // regions' groups in its handshake.
    let engine_id = format!("pf-{tag}");
    let prefills = engine_speaking(
        &engine_id,
        model,
        &prefill,
        protocol,
        Some(&groups(prefill_size, region_groups)),
    );
    let decodes = engine_speaking(
        &format!("dc-{tag}"),
        model,
        &decode,
        protocol,
        Some(&groups(decode_size, region_groups)),
    );
    fill(model, (&prefill, &prefills), (&decode, &decodes));
    let port = prefills[0].side_channel_addr().unwrap().port();
    let mut prefill_scheduler = scheduler(&engine_id, port, prefill.tp, prefill_size, protocol);
    let mut decode_scheduler = scheduler("dc", 0, decode.tp, decode_size, protocol);
    let requests = requests(&tag, &prefill, &decode, per_id);
    let handovers = requests.iter().map(|r| GroupsHandover {
        id: &r.id,
        tokens: r.tokens,
        remote: &r.remote,
        local: &r.local,
    });
    hand_over(
        &tag,
        protocol,
        (&mut prefill_scheduler, &mut decode_scheduler),
        handovers,
        (&prefills, &decodes),
    )?;
    let model_requests: Vec<Request> = requests
        .iter()
        .flat_map(|r| model_loads(r, &prefill, &decode, per_id))
        .collect();
    // Group `i % 2`'s loads in each region of that group, and in the shared ones.
    let by_region: Vec<Vec<&Request>> = (0..model.regions.len())
        .map(|region| {
            model_requests
                .iter()
                .enumerate()
                .filter(|&(i, _)| {
                    region_groups.is_empty()
                        || [-1, (i % 2) as i64].contains(&region_groups[region])
                })
                .map(|(_, r)| r)
                .collect()
        })
        .collect();
    for (rank, worker) in decodes.iter().enumerate() {
        let end = RankEnd::of(worker, rank, requests.len()).await;
        if refused(&prefill, &decode) {
            // Refused by name before any READ: every block failed, nothing moved.
            let RankEnd {
                recving, errors, ..
            } = &end;
            let named = recving.len() == requests.len()
                && requests
                    .iter()
                    .all(|r| errors.iter().any(|e| e.request_id == r.id))
                && errors.iter().all(|e| {
                    e.reason.contains("vLLM 0.33 reads a hybrid model's blocks only when the decode's block size is a multiple of the prefill's")
                });
            end.check_refused(&tag, model, worker, (&prefill, &decode), named)?;
            continue;
        }
        end.check_moved_by_region(
            &tag,
            model,
            worker,
            (&prefill, &decode),
            requests.len(),
            &by_region,
        )?;
    }
    if refused(&prefill, &decode) {
        // Nothing read, nothing notified: the prefill's lease frees the blocks.
        return Ok(());
    }
    let ids: Vec<&str> = requests.iter().map(|r| r.id.as_str()).collect();
    await_freed(&prefills, &ids, &tag).await
}

/// Whether a load of the hybrid model from `prefill` into `decode` is refused: vLLM 0.33
/// reads several KV cache groups only into blocks of a multiple of the prefill's
/// (`TransferTopology.block_size_ratio`).
fn refused(prefill: &Side, decode: &Side) -> bool {
    prefill.block_size > decode.block_size
}

/// Runs every case of `cases` (prefill and decode sides) for `model` as a hybrid model of
/// two groups, both engines speaking `protocol`: sides whose decode blocks hold a multiple
/// of the prefill's tokens move every byte the model says; others are refused by name and
/// move nothing. Fails naming each case that failed.
pub async fn run_hybrid_cases(model: &Model, cases: &[(Side, Side)], protocol: Protocol) {
    run_hybrid_cases_per_id(model, cases, protocol, WHOLE).await
}

/// [`run_hybrid_cases`] with engines whose block ids are `per_id` of their registered
/// (kernel) blocks each.
pub async fn run_hybrid_cases_per_id(
    model: &Model,
    cases: &[(Side, Side)],
    protocol: Protocol,
    per_id: PerId,
) {
    run_hybrid(model, cases, protocol, (per_id, &[])).await
}

/// [`run_hybrid_cases`] with regions of their own: each region's group `region_groups`
/// (the full-attention group 0, the window's 1, or -1 shared), the same on both engines.
pub async fn run_hybrid_cases_with_region_groups(
    model: &Model,
    cases: &[(Side, Side)],
    protocol: Protocol,
    region_groups: &'static [i64],
) {
    run_hybrid(model, cases, protocol, (WHOLE, region_groups)).await
}

/// The cases of [`run_hybrid_cases`] with `per_id` kernel blocks per block id and regions of
/// the groups `region_groups`.
async fn run_hybrid(
    model: &Model,
    cases: &[(Side, Side)],
    protocol: Protocol,
    (per_id, region_groups): (PerId, &'static [i64]),
) {
    let what = format!(", two KV cache groups, region groups {region_groups:?}");
    run_each(cases, &what, |prefill, decode| {
        let outcome = if refused(&prefill, &decode) {
            "refused by name, nothing read"
        } else {
            "every byte as the model says"
        };
        (
            outcome,
            hybrid_case(model, (prefill, decode), protocol, (per_id, region_groups)),
        )
    })
    .await
}
