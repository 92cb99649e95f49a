//! The geometry matrix's supported cases, run for either protocol: both engines' ranks in
//! this process, each decode rank loading two requests (the whole prompt, then the same
//! prompt with a prefix hit), every byte checked against the model of [`super::geometry`],
//! every prefill rank freeing both.

use std::time::{Duration, Instant};

use nixl_connector::capability::Capability;
use nixl_connector::{
    FailedBlock, FinishStatus, KvAttention, KvConnectorScheduler, KvConnectorWorker,
    KvTransferParams, Protocol, RemoteBlocks, TransferMetrics,
};

use super::geometry::{compare_region, engine_speaking, Model, Request, Side};
use super::{for_decode, poll_until};

/// How one decode rank's loads ended: the requests it reported received, what it read and
/// the blocks that failed.
pub struct RankEnd {
    /// The decode rank.
    pub rank: usize,
    /// The requests whose loads ended.
    pub recving: Vec<String>,
    /// What each load read.
    pub metrics: Vec<TransferMetrics>,
    /// The blocks that failed.
    pub errors: Vec<FailedBlock>,
}

impl RankEnd {
    /// Waits (at most [`WAIT`]) until decode rank `rank` reports `loads` loads ended, then
    /// takes what it read and what failed.
    pub async fn of(worker: &KvConnectorWorker, rank: usize, loads: usize) -> RankEnd {
        let done = poll_until(worker, WAIT, |f| f.recving.len() == loads).await;
        RankEnd {
            rank,
            recving: done.recving,
            metrics: worker.metrics(),
            errors: worker.load_errors(),
        }
    }

    /// Checks that the loads were refused before any READ (`named`: each ended failed, as the
    /// refusal says), read nothing and left every byte of the decode's cache as it was
    /// (prefill and decode `sides` of `model`).
    pub fn check_refused(
        &self,
        tag: &str,
        model: &Model,
        worker: &KvConnectorWorker,
        (prefill, decode): (&Side, &Side),
        named: bool,
    ) -> Result<(), String> {
        if !(named && self.metrics.iter().all(|m| m.bytes == 0)) {
            return Err(format!(
                "{tag}: decode rank {} was not refused: ended {:?}; errors {:?}; {:?}",
                self.rank, self.recving, self.errors, self.metrics
            ));
        }
        model
            .check_decode(worker, prefill, decode, self.rank, &[])
            .map_err(|err| format!("{tag}: {err}"))
    }

    /// Checks that `loads` loads ended without a failed block, and that they moved every
    /// byte of `requests` (prefill and decode `sides`) where `model` says, each byte once.
    pub fn check_moved(
        &self,
        tag: &str,
        model: &Model,
        worker: &KvConnectorWorker,
        sides: (&Side, &Side),
        loads: usize,
        requests: &[Request],
    ) -> Result<(), String> {
        let refs: Vec<&Request> = requests.iter().collect();
        let by_region = vec![refs; model.regions.len()];
        self.check_moved_by_region(tag, model, worker, sides, loads, &by_region)
    }

    /// [`check_moved`](Self::check_moved) with each region's own requests, `by_region`
    /// (regions of KV cache groups of their own: a group's blocks read only in its regions).
    pub fn check_moved_by_region(
        &self,
        tag: &str,
        model: &Model,
        worker: &KvConnectorWorker,
        (prefill, decode): (&Side, &Side),
        loads: usize,
        by_region: &[Vec<&Request>],
    ) -> Result<(), String> {
        let RankEnd {
            rank,
            recving,
            metrics,
            errors,
        } = self;
        if recving.len() != loads || !errors.is_empty() {
            return Err(format!(
                "{tag}: decode rank {rank} ended {recving:?}; errors {errors:?}; {metrics:?}"
            ));
        }
        let mut moved = 0;
        for (region, requests) in by_region.iter().enumerate() {
            let want = model.expected_decode_region(region, prefill, decode, *rank, requests);
            let len = model.block_len(region, decode);
            compare_region(worker, *rank, region, len, &want)
                .map_err(|err| format!("{tag}: {err}"))?;
            moved += requests
                .iter()
                .map(|r| model.moved_bytes_in(region, (prefill, decode), *rank, r))
                .sum::<usize>();
        }
        let read: u64 = metrics.iter().map(|m| m.bytes).sum();
        if read != moved as u64 {
            return Err(format!("{tag}: decode rank {rank} read {read} bytes, the model moves {moved} (each byte once)"));
        }
        Ok(())
    }
}

/// Blocks per region on both sides.
pub const BLOCKS: usize = 12;

/// A bound on each wait, against hangs only.
pub const WAIT: Duration = Duration::from_secs(30);

/// The two requests of a case: the whole prompt (ending inside a unit), then the same prompt
/// with the decode's first block in its prefix cache.
fn requests(tag: &str, prefill: &Side, decode: &Side) -> [Request; 2] {
    let unit = prefill.block_size.min(decode.block_size);
    let tokens = 2 * prefill.block_size.max(decode.block_size) + 3;
    let remote: Vec<usize> = (0..tokens.div_ceil(prefill.block_size))
        .map(|i| (i * 5 + 3) % BLOCKS)
        .collect();
    let local_blocks = (tokens.div_ceil(unit) * unit).div_ceil(decode.block_size);
    // Without the token count the prefill's last block counts whole, which only a prefill
    // whose blocks are no larger than the decode's allows for a prefix hit.
    let hit_tokens = (prefill.block_size > decode.block_size).then_some(tokens);
    [
        Request {
            id: format!("{tag}-whole"),
            remote: remote.clone(),
            local: (0..local_blocks).map(|i| (i * 7 + 1) % BLOCKS).collect(),
            num_tokens: Some(tokens),
        },
        Request {
            id: format!("{tag}-hit"),
            remote,
            local: (0..local_blocks - 1)
                .map(|i| (i * 5 + 6) % BLOCKS)
                .collect(),
            num_tokens: hit_tokens,
        },
    ]
}

/// The requests each rank of `workers` reports as sent, waiting until each has all of `ids`.
pub async fn await_freed(
    workers: &[KvConnectorWorker],
    ids: &[&str],
    what: &str,
) -> Result<(), String> {
    for (rank, worker) in workers.iter().enumerate() {
        let freed = poll_until(worker, WAIT, |f| {
            ids.iter().all(|id| f.sending.iter().any(|s| s == id))
        })
        .await;
        if !ids.iter().all(|id| freed.sending.iter().any(|s| s == id)) {
            return Err(format!(
                "{what}: prefill rank {rank} freed only {:?} of {ids:?}",
                freed.sending
            ));
        }
    }
    Ok(())
}

/// One supported case: both requests loaded by every decode rank, every byte checked, every
/// prefill rank freeing both; both engines speaking `protocol`.
async fn supported(
    model: &Model,
    prefill: Side,
    decode: Side,
    protocol: Protocol,
) -> Result<(), String> {
    let tag = format!(
        "{protocol}-{}-p{}x{}-d{}x{}",
        attention_label(model),
        prefill.tp,
        prefill.block_size,
        decode.tp,
        decode.block_size
    );
    let (engine_id, prefills, decodes) = filled_engines(&tag, model, &prefill, &decode, protocol);
    let requests = requests(&tag, &prefill, &decode);
    // One capability per request, as the scheduler draws it: every rank holds with it.
    let capabilities: Vec<Capability> = requests
        .iter()
        .map(|_| Capability::random().unwrap())
        .collect();
    for worker in &prefills {
        for (request, capability) in requests.iter().zip(&capabilities) {
            let deadline = Instant::now() + Duration::from_secs(600);
            worker.hold_for_decode(&request.id, deadline, Some(capability));
        }
    }
    let port = prefills[0].side_channel_addr().unwrap().port();
    for worker in &decodes {
        for (request, capability) in requests.iter().zip(&capabilities) {
            let from = RemoteBlocks {
                capability: Some(capability.clone()),
                lease_epoch: None,
                ..Model::remote(request, &engine_id, port, prefill.tp)
            };
            worker
                .start_load(&request.id, &request.local, &from)
                .map_err(|err| format!("{tag}: {err}"))?;
        }
    }
    for (rank, worker) in decodes.iter().enumerate() {
        RankEnd::of(worker, rank, requests.len())
            .await
            .check_moved(
                &tag,
                model,
                worker,
                (&prefill, &decode),
                requests.len(),
                &requests,
            )?;
    }
    let ids: Vec<&str> = requests.iter().map(|r| r.id.as_str()).collect();
    await_freed(&prefills, &ids, &tag).await
}

/// Runs every case of `cases` (prefill and decode sides) for `model`, both engines speaking
/// `protocol`; fails naming each case that failed.
pub async fn run_cases_speaking(model: &Model, cases: &[(Side, Side)], protocol: Protocol) {
    run_each(cases, "", |prefill, decode| {
        let outcome = "every byte as the model says";
        (outcome, supported(model, prefill, decode, protocol))
    })
    .await
}

/// Runs `case` for each prefill and decode side of `cases`, one after the other, saying
/// each passing case's outcome (`what` after its sides, e.g. the model's kind); fails naming
/// each case that failed. `case` gives the outcome a pass means, and the case to run.
pub async fn run_each<F, C>(cases: &[(Side, Side)], what: &str, mut case: C)
where
    C: FnMut(Side, Side) -> (&'static str, F),
    F: std::future::Future<Output = Result<(), String>>,
{
    let mut failed = Vec::new();
    for &(prefill, decode) in cases {
        let started = Instant::now();
        let (outcome, run) = case(prefill, decode);
        match run.await {
            Ok(()) => eprintln!(
                "{prefill:?} -> {decode:?}{what}: {outcome}, in {:?}",
                started.elapsed()
            ),
            Err(err) => failed.push(err),
        }
    }
    assert!(
        failed.is_empty(),
        "{} cases failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

/// The model's attention, for case tags: `mla`, or `mha` and its KV heads.
pub fn attention_label(model: &Model) -> String {
    match model.attention {
        KvAttention::Mla => "mla".to_string(),
        KvAttention::Mha { total_kv_heads } => format!("mha{total_kv_heads}"),
    }
}

/// The engines of case `tag`, both speaking `protocol`: the prefill's id, its ranks with
/// their caches filled as the model says, and the decode's ranks with theirs filled with
/// the sentinel.
pub fn filled_engines(
    tag: &str,
    model: &Model,
    prefill: &Side,
    decode: &Side,
    protocol: Protocol,
) -> (String, Vec<KvConnectorWorker>, Vec<KvConnectorWorker>) {
    let engine_id = format!("pf-{tag}");
    let prefills = engine_speaking(&engine_id, model, prefill, protocol, None);
    let decodes = engine_speaking(&format!("dc-{tag}"), model, decode, protocol, None);
    fill(model, (prefill, &prefills), (decode, &decodes));
    (engine_id, prefills, decodes)
}

/// Fills each prefill rank's cache as `model` says, and each decode rank's with the
/// sentinel.
pub fn fill(
    model: &Model,
    (prefill, prefills): (&Side, &[KvConnectorWorker]),
    (decode, decodes): (&Side, &[KvConnectorWorker]),
) {
    for (rank, worker) in prefills.iter().enumerate() {
        model.fill_prefill(worker, prefill, rank);
    }
    for worker in decodes {
        model.fill_sentinel(worker, decode);
    }
}

/// A request a case hands over one block list per KV cache group.
pub struct GroupsHandover<'a> {
    /// The request's id.
    pub id: &'a str,
    /// The prompt's tokens the prefill computed.
    pub tokens: usize,
    /// Each group's prefill blocks.
    pub remote: &'a [Vec<usize>],
    /// Each group's decode blocks.
    pub local: &'a [Vec<usize>],
}

/// Hands `requests` from `prefill_scheduler` over to `decode_scheduler` (through vLLM's JSON,
/// as a proxy does, when `protocol` is vLLM's), then starts the loads of both engines'
/// ranks: the prefill's `prefills` hold the blocks, the decode's `decodes` read them.
pub fn hand_over<'a>(
    tag: &str,
    protocol: Protocol,
    (prefill_scheduler, decode_scheduler): (&mut KvConnectorScheduler, &mut KvConnectorScheduler),
    requests: impl IntoIterator<Item = GroupsHandover<'a>>,
    (prefills, decodes): (&[KvConnectorWorker], &[KvConnectorWorker]),
) -> Result<(), String> {
    for request in requests {
        let done = prefill_scheduler
            .request_finished_all_groups(
                request.id,
                request.remote,
                request.tokens,
                Some(&for_decode()),
                FinishStatus::LengthCapped,
            )
            .map_err(|err| format!("{tag}: {err}"))?;
        let mut params = done.kv_transfer_params.unwrap();
        if protocol == Protocol::Vllm {
            // Through a proxy, as vLLM's JSON.
            params = KvTransferParams::from_vllm_json(&params.to_vllm_json()).unwrap();
        }
        decode_scheduler.on_new_request(request.id, Some(&params));
        decode_scheduler
            .update_state_after_alloc_groups(request.id, request.local, &params)
            .map_err(|err| format!("{tag}: {err}"))?;
    }
    let held = prefill_scheduler.build_connector_meta();
    for worker in prefills {
        worker.start_load_kv(&held);
    }
    let loads = decode_scheduler.build_connector_meta();
    for worker in decodes {
        worker.start_load_kv(&loads);
    }
    Ok(())
}
