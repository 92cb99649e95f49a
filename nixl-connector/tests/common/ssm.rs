//! The geometry matrix for a hybrid model of a full-attention group and an SSM (Mamba)
//! group sharing every region, in either protocol (vLLM 0.33's Nemotron-H/Qwen3-Next-style
//! models): both engines' schedulers hand the blocks over one list per group, the SSM
//! group's only its state-bearing block, and every byte of every decode rank is checked
//! against the model of [`super::geometry`] for the attention group, and, for the SSM
//! group, against this file's own reading of vLLM's state page: in each region, the
//! block's first `conv + temporal` bytes (the conv sub-projections, then the temporal state,
//! per rank) are the prefill's, its padding keeps what it held.

use nixl_connector::{
    KvCacheGroups, KvConnectorScheduler, KvConnectorWorker, Protocol, SchedulerConfig,
    WorkerConfig, KV_CACHE_GROUPS_KEY,
};

use super::geometry::{
    compare_region, engine_speaking, engine_speaking_vllm_with, engine_with, with_groups, Model,
    Request, Side,
};
use super::hybrid::{kernel_blocks, PerId, WHOLE};
use super::matrix::{
    attention_label, await_freed, fill, hand_over, run_each, GroupsHandover, RankEnd,
};
use super::{cpu_config, in_push_mode, vllm_config, vllm_factors};

/// Blocks per region: room for both groups of two requests.
pub const SSM_BLOCKS: usize = 40;

/// Speculative scratch blocks at the end of each SSM list (vLLM's
/// `num_speculative_blocks`), never read.
const SPECULATIVE: usize = 1;

/// The model-wide SSM state of a layer: the conv sub-projections (Mamba2's x, B, C) and the
/// temporal state, in bytes; a rank of TP `tp` holds a `tp`-th of each.
const CONV: [usize; 3] = [16, 4, 4];
const TEMPORAL: usize = 32;

/// A rank's (conv sub-projections, temporal state) bytes at TP `tp`.
fn rank_state(tp: usize) -> (Vec<usize>, usize) {
    (CONV.iter().map(|c| c / tp).collect(), TEMPORAL / tp)
}

/// Where byte `j` of the model-wide part `part` of the state (the conv sub-projections in
/// turn, then the temporal state) sits at TP `tp`: each rank holds a `tp`-th of every
/// part, in rank order, its parts one after the other from its page's start. The rank
/// holding it, and the offset in that rank's page.
fn state_byte(part: usize, j: usize, tp: usize) -> (usize, usize) {
    let sizes: Vec<usize> = CONV.iter().copied().chain([TEMPORAL]).collect();
    let per_rank = sizes[part] / tp;
    let before: usize = sizes[..part].iter().map(|s| s / tp).sum();
    (j / per_rank, before + j % per_rank)
}

/// Why a decode of `decode` does not read the state from a prefill of `prefill`, as its
/// refusal says; `None` when it reads it: decode blocks of a multiple of the prefill's
/// tokens (the state block moves whole whatever their sizes, and whatever the kernel
/// blocks per block id on either engine). From a larger prefill TP the state is read from
/// every prefill rank of a decode rank's group, whichever of them its attention is read
/// from (MLA's latent, replicated KV heads: vLLM's `source_ranks_per_group`).
fn refusal(prefill: &Side, decode: &Side) -> Option<&'static str> {
    (prefill.block_size > decode.block_size).then_some("block_size_ratio")
}

/// The config of an engine of TP `tp` over blocks of `block_size` tokens speaking
/// `protocol`, in push mode if `push`: its groups and their state in
/// `kv_connector_extra_config`.
fn config(
    tp: usize,
    block_size: usize,
    protocol: Protocol,
    push: bool,
) -> nixl::kv_config::KvTransferConfig {
    let (conv, temporal) = rank_state(tp);
    let mut kv = match protocol {
        Protocol::Vllm => vllm_config(vllm_factors()),
        _ => cpu_config(),
    };
    kv.kv_connector_extra_config.insert(
        KV_CACHE_GROUPS_KEY.into(),
        groups_json(block_size, (&conv, temporal)),
    );
    if push {
        in_push_mode(&mut kv);
    }
    kv
}

/// `kv_cache_groups` of a full-attention and an SSM group over blocks of `block_size`
/// tokens whose state per rank is `(conv, temporal)` bytes.
fn groups_json(block_size: usize, (conv, temporal): (&[usize], usize)) -> serde_json::Value {
    serde_json::json!({
        "block_size": block_size,
        "groups": ["full_attention", {"ssm": {"speculative_blocks": SPECULATIVE}}],
        "ssm_state": {"conv_bytes": conv, "temporal_bytes": temporal},
    })
}

/// The model's groups at TP `tp` over blocks of `block_size` tokens, as [`config`] names
/// them, each region's group `region_groups` (none: every region shared).
fn groups(tp: usize, block_size: usize, region_groups: &[i64]) -> KvCacheGroups {
    KvCacheGroups::from_kv_transfer_config(&config(tp, block_size, Protocol::Native, false))
        .unwrap()
        .with_region_groups(region_groups.to_vec())
        .unwrap()
}

/// The regions of `regions` holding SSM state: every one, or with `region_groups` the SSM
/// group's (1) and the shared ones (-1), as vLLM's Mamba layers register them.
fn ssm_regions(region_groups: &[i64], regions: usize) -> Vec<usize> {
    (0..regions)
        .filter(|&r| region_groups.is_empty() || matches!(region_groups[r], -1 | 1))
        .collect()
}

/// How a case's engines are set up beyond their sides.
#[derive(Clone, Copy)]
struct Setting {
    /// Kernel blocks per block id, each engine.
    per_id: PerId,
    /// The protocol both speak.
    protocol: Protocol,
    /// Each region's KV cache group (vLLM's `region_group_ids`); empty: every region shared.
    region_groups: &'static [i64],
    /// Whether the prefill WRITEs (push mode) rather than the decode READs.
    push: bool,
}

/// A scheduler of an engine of TP `tp` reached at `port` speaking `protocol`, in push mode
/// if `push`, with the model's groups.
fn scheduler(
    engine: &str,
    port: u16,
    (tp, block_size): (usize, usize),
    (protocol, push): (Protocol, bool),
) -> KvConnectorScheduler {
    let kv = config(tp, block_size, protocol, push);
    let config = SchedulerConfig::new(engine, "127.0.0.1", port, tp, &kv).unwrap();
    KvConnectorScheduler::new(config).with_kv_cache_groups(groups(tp, block_size, &[]))
}

/// One request: each group's prefill blocks and decode blocks.
struct SsmRequest {
    id: String,
    remote: [Vec<usize>; 2],
    local: [Vec<usize>; 2],
}

/// The prompt of a prefill of block ids of `block_size` tokens: 7 blocks but the last
/// token (which the decode computes, vLLM's `_prefill_backoff`).
fn prompt_tokens(block_size: usize) -> usize {
    PROMPT_BLOCKS * block_size - 1
}

/// The prefill blocks of a prompt.
const PROMPT_BLOCKS: usize = 7;

/// The whole prompt of 7 prefill block ids, then the same prompt with the decode's first
/// block id in its prefix cache, on a decode that needs `local` block ids for it; the SSM
/// lists of each side end with a scratch block, and begin with a null block (0) on the
/// prefill, as vLLM's Mamba manager leaves them.
fn requests(tag: &str, local: usize) -> [SsmRequest; 2] {
    let ids = |first: usize, n: usize| (first..first + n).collect::<Vec<usize>>();
    let remote = [ids(1, PROMPT_BLOCKS), vec![0, 20, 21, 22]];
    [
        SsmRequest {
            id: format!("{tag}-whole"),
            remote: remote.clone(),
            local: [ids(2, local), vec![35, 36, 37]],
        },
        SsmRequest {
            id: format!("{tag}-hit"),
            remote,
            local: [ids(22, local - 1), vec![38, 39]],
        },
    ]
}

/// The one block of an SSM list that holds the running state: the last before the
/// scratch blocks.
fn state_block(ids: &[usize]) -> usize {
    ids[ids.len() - 1 - SPECULATIVE.min(ids.len() - 1)]
}

/// The attention group's load of `request` from a prefill of `prefill` into a decode of
/// `decode`, `per_id` kernel blocks per block id each, for the model: as kernel blocks, the
/// decode's filled with the prompt's last tokens, one past the prompt's last token holding
/// nothing of it.
fn attention_load(
    request: &SsmRequest,
    (prefill, decode): (&Side, &Side),
    per_id: PerId,
) -> Request {
    let tokens = prompt_tokens(prefill.block_size * per_id.prefill);
    let unit = prefill.block_size.min(decode.block_size);
    let decode_blocks = (tokens.div_ceil(unit) * unit).div_ceil(decode.block_size);
    let dead = decode_blocks.div_ceil(per_id.decode) * per_id.decode - decode_blocks;
    let mut local = kernel_blocks(&request.local[0], per_id.decode);
    local.truncate(local.len() - dead);
    Request {
        id: request.id.clone(),
        remote: kernel_blocks(&request.remote[0], per_id.prefill),
        local,
        num_tokens: Some(tokens),
    }
}

/// Checks every byte of decode rank `rank`: the attention group's as the model says, each
/// byte of the rank's share of the SSM state in each of `ssm_regions` the prefill's (from the
/// prefill rank holding it, see [`state_byte`]), the state page (a block id's `per_id`
/// kernel blocks) past the state and every other byte as it was; and the bytes read, each
/// once (`None`: a push, whose decode reads nothing). The bytes the model moves into it:
/// the attention's, and the state's.
fn check_rank(
    model: &Model,
    worker: &KvConnectorWorker,
    (prefill, decode): (&Side, &Side),
    (rank, per_id): (usize, PerId),
    (requests, ssm_regions): (&[SsmRequest], &[usize]),
    read: Option<u64>,
) -> Result<(usize, usize), String> {
    let (conv, temporal) = rank_state(decode.tp);
    let state: usize = conv.iter().sum::<usize>() + temporal;
    let loads: Vec<Request> = requests
        .iter()
        .map(|r| attention_load(r, (prefill, decode), per_id))
        .collect();
    let refs: Vec<&Request> = loads.iter().collect();
    for region in 0..model.regions.len() {
        let mut want = model.expected_decode_region(region, prefill, decode, rank, &refs);
        let sources: Vec<Vec<u8>> = (0..prefill.tp)
            .map(|p| model.prefill_region(region, prefill, p))
            .collect();
        let (len, far_len) = (
            model.block_len(region, decode),
            model.block_len(region, prefill),
        );
        assert!(state < len, "the state leaves padding to check");
        let state_here = if ssm_regions.contains(&region) {
            requests
        } else {
            &[]
        };
        for request in state_here {
            let (l, r) = (
                state_block(&request.local[1]),
                state_block(&request.remote[1]),
            );
            let sizes = CONV.iter().copied().chain([TEMPORAL]);
            for (part, size) in sizes.enumerate() {
                for j in 0..size {
                    let (holder, local) = state_byte(part, j, decode.tp);
                    if holder != rank {
                        continue;
                    }
                    let (p, far) = state_byte(part, j, prefill.tp);
                    want[l * per_id.decode * len + local] =
                        sources[p][r * per_id.prefill * far_len + far];
                }
            }
        }
        compare_region(worker, rank, region, len, &want)?;
    }
    let attention: usize = loads
        .iter()
        .map(|r| model.moved_bytes(prefill, decode, rank, r))
        .sum();
    let state = requests.len() * ssm_regions.len() * state;
    let moved = attention + state;
    if let Some(read) = read.filter(|&read| read != moved as u64) {
        return Err(format!(
            "decode rank {rank} read {read} bytes, the model moves {moved} (each byte once)"
        ));
    }
    Ok((attention, state))
}

/// A case's prefill ranks, decode ranks and requests, their loads started.
type Started = (
    Vec<KvConnectorWorker>,
    Vec<KvConnectorWorker>,
    [SsmRequest; 2],
);

/// The ranks of engine `engine_id` of `side` of `model` speaking `protocol` with `groups`,
/// in push mode if `push`.
fn engine(
    engine_id: &str,
    (model, side): (&Model, &Side),
    groups: &KvCacheGroups,
    (protocol, push): (Protocol, bool),
) -> Vec<KvConnectorWorker> {
    let push_mode = |config: &mut WorkerConfig| {
        with_groups(config, groups);
        in_push_mode(&mut config.kv_transfer_config);
    };
    match (push, protocol) {
        (false, _) => engine_speaking(engine_id, model, side, protocol, Some(groups)),
        (true, Protocol::Vllm) => {
            engine_speaking_vllm_with(engine_id, model, side, Some(groups), push_mode)
        }
        (true, _) => engine_with(engine_id, model, side, push_mode),
    }
}

/// The engines of case `tag` speaking `protocol`, in push mode if `push`, prefill and
/// decode `sides` of `model`, their KV cache groups `groups` over block ids of `sizes`
/// tokens (prefill, decode): both requests handed over by the prefill's scheduler to the
/// decode's, and every rank's loads started. The prefill's ranks, the decode's, and the
/// requests.
fn start(
    tag: &str,
    model: &Model,
    (prefill, decode): (&Side, &Side),
    (groups, sizes): (&(KvCacheGroups, KvCacheGroups), (usize, usize)),
    (protocol, push): (Protocol, bool),
) -> Result<Started, String> {
    let engine_id = format!("pf-{tag}");
    let mode = (protocol, push);
    let prefills = engine(&engine_id, (model, prefill), &groups.0, mode);
    let decodes = engine(&format!("dc-{tag}"), (model, decode), &groups.1, mode);
    fill(model, (prefill, &prefills), (decode, &decodes));
    let port = prefills[0].side_channel_addr().unwrap().port();
    let mut prefill_scheduler = scheduler(&engine_id, port, (prefill.tp, sizes.0), mode);
    let mut decode_scheduler = scheduler("dc", 0, (decode.tp, sizes.1), mode);
    let requests = requests(tag, prompt_tokens(sizes.0).div_ceil(sizes.1));
    let handovers = requests.iter().map(|r| GroupsHandover {
        id: &r.id,
        tokens: prompt_tokens(sizes.0),
        remote: &r.remote,
        local: &r.local,
    });
    hand_over(
        tag,
        protocol,
        (&mut prefill_scheduler, &mut decode_scheduler),
        handovers,
        (&prefills, &decodes),
    )?;
    Ok((prefills, decodes, requests))
}

/// One case: both requests handed over by the prefill's scheduler and loaded through the
/// decode's by every decode rank, every byte checked, every prefill rank freeing both; with
/// a case whose state is not read (see [`refusal`]), refused by name before any
/// READ. In push mode the prefill ranks WRITE the same bytes, each once (of the ranks
/// holding a copy of a decode rank's heads, one writes it).
async fn ssm_case(
    model: &Model,
    (prefill, decode): (Side, Side),
    setting: Setting,
) -> Result<(), String> {
    let Setting {
        per_id,
        protocol,
        region_groups,
        push,
    } = setting;
    let mode = if push { "push" } else { "pull" };
    let tag = format!(
        "ssm-{protocol:?}-{mode}-{}-p{}b{}x{}-d{}b{}x{}-rg{region_groups:?}",
        attention_label(model),
        prefill.tp,
        prefill.block_size,
        per_id.prefill,
        decode.tp,
        decode.block_size,
        per_id.decode
    );
    // The schedulers' block ids, of `per_id` registered blocks each.
    let sizes = (
        prefill.block_size * per_id.prefill,
        decode.block_size * per_id.decode,
    );
    let groups = (
        groups(prefill.tp, sizes.0, region_groups),
        groups(decode.tp, sizes.1, region_groups),
    );
    let (prefills, decodes, requests) = start(
        &tag,
        model,
        (&prefill, &decode),
        (&groups, sizes),
        (protocol, push),
    )?;
    let ssm_regions = ssm_regions(region_groups, model.regions.len());
    let mut moved = 0;
    for (rank, worker) in decodes.iter().enumerate() {
        let end = RankEnd::of(worker, rank, requests.len()).await;
        if let Some(reason) = refusal(&prefill, &decode) {
            let named = end.recving.len() == requests.len()
                && end.errors.len() >= requests.len()
                && end.errors.iter().all(|e| e.reason.contains(reason));
            end.check_refused(&tag, model, worker, (&prefill, &decode), named)?;
            continue;
        }
        let RankEnd {
            recving,
            metrics,
            errors,
            ..
        } = end;
        if recving.len() != requests.len() || !errors.is_empty() {
            return Err(format!(
                "{tag}: decode rank {rank} ended {recving:?}; errors {errors:?}; {metrics:?}"
            ));
        }
        let read = (!push).then(|| metrics.iter().map(|m| m.bytes).sum());
        let (attention, state) = check_rank(
            model,
            worker,
            (&prefill, &decode),
            (rank, per_id),
            (&requests, &ssm_regions),
            read,
        )
        .map_err(|err| format!("{tag}: {err}"))?;
        moved += attention + state;
    }
    if refusal(&prefill, &decode).is_some() {
        // Nothing read, nothing notified: the prefill's lease frees the blocks.
        return Ok(());
    }
    let ids: Vec<&str> = requests.iter().map(|r| r.id.as_str()).collect();
    await_freed(&prefills, &ids, &tag).await?;
    let written: u64 = prefills.iter().map(|p| p.push_stats().bytes_written).sum();
    if push && written != moved as u64 {
        return Err(format!(
            "{tag}: the prefill ranks wrote {written} bytes, the model moves {moved}"
        ));
    }
    Ok(())
}

/// Runs every case of `cases` (prefill and decode sides) for `model` as a hybrid model of a
/// full-attention and an SSM group, both engines speaking `protocol`: cases whose state is
/// read (no [`refusal`]) move every byte the models say; others are refused by name and
/// move nothing.
pub async fn run_ssm_cases(model: &Model, cases: &[(Side, Side)], protocol: Protocol) {
    let setting = Setting {
        per_id: WHOLE,
        protocol,
        region_groups: &[],
        push: false,
    };
    run_ssm_cases_speaking(model, cases, setting).await
}

/// [`run_ssm_cases`] with regions of their own, each region's group `region_groups` (the
/// full-attention group 0, the SSM group 1, or -1 shared; the same on both engines): the
/// state read only in the SSM group's and the shared regions, the attention in every region
/// (vLLM's `_compute_desc_ids` with Mamba groups, its `_ssm_region_indices`).
pub async fn run_ssm_cases_with_region_groups(
    model: &Model,
    cases: &[(Side, Side)],
    protocol: Protocol,
    region_groups: &'static [i64],
) {
    let setting = Setting {
        per_id: WHOLE,
        protocol,
        region_groups,
        push: false,
    };
    run_ssm_cases_speaking(model, cases, setting).await
}

/// [`run_ssm_cases`] with block ids of `per_id` registered (kernel) blocks each, on each
/// engine.
pub async fn run_ssm_cases_per_id(
    model: &Model,
    cases: &[(Side, Side)],
    protocol: Protocol,
    per_id: PerId,
) {
    let setting = Setting {
        per_id,
        protocol,
        region_groups: &[],
        push: false,
    };
    run_ssm_cases_speaking(model, cases, setting).await
}

/// [`run_ssm_cases`] in push mode, regions of their own as `region_groups` says (empty:
/// every region shared): the prefill ranks WRITE into the blocks the decode's scheduler
/// registered, the attention group's past the decode's prefix hit and the SSM group's state
/// block whole (vLLM's push pairs a state slot with a state slot), every byte the models
/// say, each byte written once. Push writes a decode of at most the prefill's TP, of the
/// same block size (the cases must be such).
pub async fn run_ssm_push_cases(
    model: &Model,
    cases: &[(Side, Side)],
    protocol: Protocol,
    region_groups: &'static [i64],
) {
    assert!(cases
        .iter()
        .all(|(p, d)| p.tp >= d.tp && p.block_size == d.block_size));
    let setting = Setting {
        per_id: WHOLE,
        protocol,
        region_groups,
        push: true,
    };
    run_ssm_cases_speaking(model, cases, setting).await
}

/// The cases of [`run_ssm_cases`] set up as `setting` says.
async fn run_ssm_cases_speaking(model: &Model, cases: &[(Side, Side)], setting: Setting) {
    let Setting {
        per_id,
        protocol,
        region_groups,
        push,
    } = setting;
    let mode = if push { "push" } else { "pull" };
    let what = format!(
        ", full attention and SSM groups, {} and {} kernel blocks per id, {protocol:?} protocol, {mode} mode, region groups {region_groups:?}",
        per_id.prefill, per_id.decode
    );
    run_each(cases, &what, |prefill, decode| {
        let outcome = match refusal(&prefill, &decode) {
            None => "every byte as the model says",
            Some(_) => "refused by name, nothing read",
        };
        (outcome, ssm_case(model, (prefill, decode), setting))
    })
    .await
}

/// A decode of TP 1 whose SSM state per rank is `state` (conv sub-projections, temporal
/// bytes), not the prefill's, both speaking `protocol`: both requests' loads are refused in
/// the handshake naming `reason`, nothing is read, and every byte of its cache is as it
/// was.
pub async fn another_state_is_refused(
    model: &Model,
    protocol: Protocol,
    state: (&[usize], usize),
    reason: &str,
) -> Result<(), String> {
    let side = Side {
        tp: 1,
        block_size: 4,
        num_blocks: SSM_BLOCKS,
    };
    let tag = format!("ssm-other-{protocol:?}-{state:?}");
    let theirs: KvCacheGroups = serde_json::from_value(groups_json(4, state)).unwrap();
    let groups = (groups(1, 4, &[]), theirs);
    let (_prefills, decodes, requests) = start(
        &tag,
        model,
        (&side, &side),
        (&groups, (4, 4)),
        (protocol, false),
    )?;
    let end = RankEnd::of(&decodes[0], 0, requests.len()).await;
    let named = end.recving.len() == requests.len()
        && !end.errors.is_empty()
        && end.errors.iter().all(|e| e.reason.contains(reason));
    if !named {
        return Err(format!("{tag}: {:?}", end.errors));
    }
    end.check_refused(&tag, model, &decodes[0], (&side, &side), named)
}
