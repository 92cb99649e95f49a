//! Workers and schedulers speaking vLLM's protocol, both engines in this process over real
//! NIXL/UCX: the params handed as vLLM's JSON, every byte checked, the prefill freed by the
//! `request:consumers` notification; a mismatched hash, a rank the engine lacks and a
//! prefill's blocks past their expiry time refused with the reason, and a READ that ends past
//! it failed as outlived; a re-registered prefill
//! (a new worker, or the same one registering again) handshaken with again when its
//! registration generation grows; TP and block sizes both ways through the geometry matrix's
//! model, and a hybrid model of two KV cache groups. (The Python peers
//! speaking the same protocol are in the root package's tests/vllm_protocol.rs.)

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::geometry::{Model, Side};
use common::hybrid::{run_hybrid_cases, run_hybrid_cases_per_id, PerId, HYBRID_BLOCKS};
use common::matrix::{run_cases_speaking, BLOCKS};
use common::{
    block, fill, finish_for_decode, pattern, poll_until, spec, spec_tp, vllm_config, vllm_factors,
    worker_with,
};
use nixl_connector::vllm::clock::perf_counter;
use nixl_connector::vllm::{MetadataServer, VllmChannelLimits};
use nixl_connector::{
    FailureKind, KvAttention, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker, KvLayout,
    KvRegionKind, KvTransferParams, LoadOutcome, Protocol, SchedulerConfig, WorkerOutput,
};

/// A guard against hangs only.
const WAIT: Duration = Duration::from_secs(10);

/// A ROUTER for one engine, on any free port.
fn side_channel() -> Arc<MetadataServer> {
    let addr = SocketAddr::from(([127, 0, 0, 1], 0));
    Arc::new(MetadataServer::bind_now(addr, VllmChannelLimits::default()).unwrap())
}

/// A vLLM-mode worker of `engine` (TP 1) with `factors`, publishing to `server` (its own
/// if `None`).
fn vllm_worker(
    engine: &str,
    spec: &KvCacheSpec,
    factors: serde_json::Value,
    server: Option<Arc<MetadataServer>>,
) -> KvConnectorWorker {
    vllm_rank(engine, (0, 1), spec, factors, server)
}

/// [`vllm_worker`] for rank `rank.0` of TP `rank.1`.
fn vllm_rank(
    engine: &str,
    (rank, tp): (usize, usize),
    spec: &KvCacheSpec,
    factors: serde_json::Value,
    server: Option<Arc<MetadataServer>>,
) -> KvConnectorWorker {
    worker_with(engine, rank, tp, spec, |c| {
        c.kv_transfer_config = vllm_config(factors);
        c.vllm_side_channel = server;
    })
}

/// The scheduler of a vLLM-mode engine whose worker is `worker`.
fn vllm_scheduler(engine: &str, worker: &KvConnectorWorker) -> KvConnectorScheduler {
    let kv = vllm_config(vllm_factors());
    let mut config = SchedulerConfig::new(
        engine,
        "127.0.0.1",
        worker.side_channel_addr().unwrap().port(),
        1,
        &kv,
    )
    .unwrap();
    assert_eq!(config.protocol, Protocol::Vllm);
    config.vllm_side_channel = Some(worker.vllm_side_channel().unwrap());
    KvConnectorScheduler::new(config)
}

/// Finishes `request` in `blocks` on the prefill and returns vLLM's JSON params for it.
fn finish(
    prefill: &KvConnectorWorker,
    scheduler: &mut KvConnectorScheduler,
    request: &str,
    blocks: &[usize],
) -> String {
    finish_for_decode(prefill, scheduler, request, blocks).to_vllm_json()
}

/// Loads vLLM's JSON `params` into `local` through the decode's scheduler and worker, and
/// returns the load's outcome.
async fn load(
    decode: &KvConnectorWorker,
    scheduler: &mut KvConnectorScheduler,
    request: &str,
    local: &[usize],
    params: &str,
) -> LoadOutcome {
    let params = KvTransferParams::from_vllm_json(params).unwrap();
    scheduler.on_new_request(request, Some(&params));
    scheduler
        .update_state_after_alloc(request, local, &params)
        .unwrap();
    decode.start_load_kv(&scheduler.build_connector_meta());
    let done = poll_until(decode, WAIT, |f| f.recving.iter().any(|r| r == request)).await;
    let errors = decode.load_errors();
    let output = WorkerOutput {
        tp_rank: 0,
        pp_rank: 0,
        finished: done,
        load_errors: errors,
    };
    let mut outcomes = scheduler
        .update_connector_output(&[output])
        .unwrap()
        .load_outcomes;
    assert_eq!(outcomes.len(), 1, "{outcomes:?}");
    outcomes.remove(0)
}

/// Whether every block of `local` holds the prefill's `remote` block, in every region.
fn holds(decode: &KvConnectorWorker, spec: &KvCacheSpec, local: &[usize], remote: &[usize]) {
    for layer in 0..spec.num_regions() {
        for (&l, &r) in local.iter().zip(remote) {
            let want: Vec<u8> = (0..spec.block_len(layer))
                .map(|o| pattern(layer, r, o))
                .collect();
            assert!(
                block(decode, spec, layer, l) == want,
                "layer {layer} local {l} remote {r}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_reads_a_prefill_through_vllms_json_and_frees_it() {
    common::init_tracing();
    let spec = spec(4);
    let prefill = vllm_worker("vm-pf", &spec, vllm_factors(), None);
    fill(&prefill, &spec);
    let mut prefill_scheduler = vllm_scheduler("vm-pf", &prefill);
    let decode = vllm_worker("vm-dc", &spec, vllm_factors(), None);
    let mut decode_scheduler = vllm_scheduler("vm-dc", &decode);
    assert_eq!(decode.protocol(), Protocol::Vllm);

    let json = finish(&prefill, &mut prefill_scheduler, "cmpl-1", &[7, 3, 11]);
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(value["remote_block_ids"], serde_json::json!([[7, 3, 11]]));
    assert_eq!(
        value["remote_port"],
        prefill.vllm_side_channel().unwrap().local_addr().port()
    );
    assert_eq!(value["remote_registration_generation"], 1);
    assert_eq!(value["transfer_mode"], "pull");

    let outcome = load(&decode, &mut decode_scheduler, "d-1", &[0, 1, 2], &json).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds(&decode, &spec, &[0, 1, 2], &[7, 3, 11]);
    tokio::time::timeout(WAIT, prefill.notified())
        .await
        .unwrap();
    assert_eq!(prefill.finished().sending, ["cmpl-1"]);
    assert_eq!(prefill.send_stats().freed_on_notification, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mismatched_hash_and_a_missing_rank_fail_the_load_with_the_reason() {
    common::init_tracing();
    let spec = spec(4);
    let prefill = vllm_worker("vm-pf-bad", &spec, vllm_factors(), None);
    let mut prefill_scheduler = vllm_scheduler("vm-pf-bad", &prefill);
    let mut other = vllm_factors();
    other["cache_dtype"] = "fp8".into();
    let ours = prefill.vllm_handshake_payload().unwrap().compatibility_hash;
    let decode = vllm_worker("vm-dc-bad", &spec, other, None);
    let mut decode_scheduler = vllm_scheduler("vm-dc-bad", &decode);
    let json = finish(&prefill, &mut prefill_scheduler, "r-hash", &[1]);
    let outcome = load(&decode, &mut decode_scheduler, "d-hash", &[0], &json).await;
    let LoadOutcome::Failed { reason, .. } = outcome else {
        panic!("{outcome:?}")
    };
    assert!(reason.contains("compatibility hash mismatch"), "{reason}");
    assert!(reason.contains(&ours), "{reason}");
    assert!(block(&decode, &spec, 0, 0).iter().all(|&b| b == 0));

    // Rank 1 of a decode of TP 2 reads rank 1 of a prefill of TP 2 that serves rank 0 only.
    let half = spec_tp(4, 2);
    let rank0 = vllm_rank("vm-pf-rank", (0, 2), &half, vllm_factors(), None);
    let mut params = KvTransferParams::from_vllm_json(&json).unwrap();
    params.remote_engine_id = Some("vm-pf-rank".into());
    params.remote_port = Some(rank0.side_channel_addr().unwrap().port());
    params.remote_tp_size = Some(2);
    let reader = vllm_rank("vm-dc-rank", (1, 2), &half, vllm_factors(), None);
    let mut scheduler = vllm_scheduler("vm-dc-rank", &reader);
    let outcome = load(
        &reader,
        &mut scheduler,
        "d-rank",
        &[0],
        &params.to_vllm_json(),
    )
    .await;
    let LoadOutcome::Failed { reason, .. } = outcome else {
        panic!("{outcome:?}")
    };
    assert!(reason.contains("no pp_rank 0 tp_rank 1"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_past_their_expiry_time_are_not_read() {
    common::init_tracing();
    let spec = spec(4);
    let prefill = vllm_worker("vm-pf-exp", &spec, vllm_factors(), None);
    fill(&prefill, &spec);
    let mut prefill_scheduler = vllm_scheduler("vm-pf-exp", &prefill);
    let decode = vllm_worker("vm-dc-exp", &spec, vllm_factors(), None);
    let mut decode_scheduler = vllm_scheduler("vm-dc-exp", &decode);
    // One process: the prefill's clock is ours, and the handshake measures an offset of
    // about 0.
    let json = finish(&prefill, &mut prefill_scheduler, "r-exp", &[2]);
    let mut params = KvTransferParams::from_vllm_json(&json).unwrap();
    params.remote_blocks_expiry_time = Some(perf_counter() + 60.0);
    let outcome = load(
        &decode,
        &mut decode_scheduler,
        "d-live",
        &[0],
        &params.to_vllm_json(),
    )
    .await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds(&decode, &spec, &[0], &[2]);

    params.remote_blocks_expiry_time = Some(perf_counter() + 1.0);
    params.remote_request_id = Some("r-exp-2".into());
    let json = params.to_vllm_json();
    let outcome = load(&decode, &mut decode_scheduler, "d-expired", &[1], &json).await;
    let LoadOutcome::Failed { reason, .. } = outcome else {
        panic!("{outcome:?}")
    };
    assert!(reason.contains("safety margin; not read"), "{reason}");
    assert!(block(&decode, &spec, 0, 1).iter().all(|&b| b == 0));
    let params = KvTransferParams::from_vllm_json(&json).unwrap();
    decode_scheduler.on_new_request("d-kind", Some(&params));
    decode_scheduler
        .update_state_after_alloc("d-kind", &[2], &params)
        .unwrap();
    decode.start_load_kv(&decode_scheduler.build_connector_meta());
    poll_until(&decode, WAIT, |f| !f.recving.is_empty()).await;
    let failed = decode.load_errors();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].kind, FailureKind::Expired);
}

/// A READ posted well before the blocks' expiry time but ending past it (the prefill's
/// agent does not progress, so the first READ from it stays in flight) fails as outlived,
/// never loaded: the expiry time is checked again once the READ has ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_that_ends_past_the_blocks_expiry_time_fails_as_outlived() {
    common::init_tracing();
    let spec = spec(4);
    let prefill = worker_with("vm-pf-late", 0, 1, &spec, |c| {
        c.kv_transfer_config = vllm_config(vllm_factors());
        c.agent_config.progress_thread = false;
    });
    fill(&prefill, &spec);
    let mut prefill_scheduler = vllm_scheduler("vm-pf-late", &prefill);
    let decode = vllm_worker("vm-dc-late", &spec, vllm_factors(), None);
    let mut decode_scheduler = vllm_scheduler("vm-dc-late", &decode);
    let json = common::finished_for_decode(&mut prefill_scheduler, "r-late", &[2]).to_vllm_json();
    let mut params = KvTransferParams::from_vllm_json(&json).unwrap();
    // Past the 5 s safety margin when posted, not when the READ ends.
    let expiry = perf_counter() + 5.5;
    params.remote_blocks_expiry_time = Some(expiry);
    decode_scheduler.on_new_request("d-late", Some(&params));
    decode_scheduler
        .update_state_after_alloc("d-late", &[1], &params)
        .unwrap();
    decode.start_load_kv(&decode_scheduler.build_connector_meta());
    let in_flight = || decode.agent().driver_stats().held == 1;
    common::wait_for("the READ to be posted", WAIT, in_flight).await;
    while perf_counter() < expiry + 0.2 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(decode.finished().recving.is_empty(), "still in flight");
    // The prefill's agent progresses: the READ ends, past the expiry time.
    common::progress_until(&prefill, "the READ's end", || {
        decode.agent().driver_stats().held == 0
    })
    .await;
    let done = poll_until(&decode, WAIT, |f| !f.recving.is_empty()).await;
    assert_eq!(done.recving, ["d-late"]);
    let failed = decode.load_errors();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].kind, FailureKind::LeaseOutlived, "{}", failed[0]);
    assert!(failed[0].reason.contains("expiry time"), "{}", failed[0]);
    let output = WorkerOutput {
        tp_rank: 0,
        pp_rank: 0,
        finished: done,
        load_errors: failed,
    };
    let outcomes = decode_scheduler
        .update_connector_output(&[output])
        .unwrap()
        .load_outcomes;
    assert!(
        matches!(&outcomes[..], [LoadOutcome::Failed { request_id, .. }] if request_id == "d-late"),
        "{outcomes:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_registered_again_is_handshaken_with_again() {
    common::init_tracing();
    let spec = spec(4);
    let server = side_channel();
    let first = vllm_worker("vm-pf-gen", &spec, vllm_factors(), Some(server.clone()));
    let mut first_scheduler = vllm_scheduler("vm-pf-gen", &first);
    let decode = vllm_worker("vm-dc-gen", &spec, vllm_factors(), None);
    let mut decode_scheduler = vllm_scheduler("vm-dc-gen", &decode);
    let json = finish(&first, &mut first_scheduler, "r-gen-1", &[4]);
    let outcome = load(&decode, &mut decode_scheduler, "d-gen-1", &[0], &json).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");

    // The engine registers its KV cache again (a new agent, new memory) on the same port.
    drop(first_scheduler);
    drop(first);
    let again = vllm_worker("vm-pf-gen", &spec, vllm_factors(), Some(server.clone()));
    fill(&again, &spec);
    let mut again_scheduler = vllm_scheduler("vm-pf-gen", &again);
    let json = finish(&again, &mut again_scheduler, "r-gen-2", &[5]);
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(value["remote_registration_generation"].as_u64().unwrap() > 1);
    let started = Instant::now();
    let outcome = load(&decode, &mut decode_scheduler, "d-gen-2", &[1], &json).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds(&decode, &spec, &[1], &[5]);
    assert!(started.elapsed() < WAIT);
    tokio::time::timeout(WAIT, again.notified()).await.unwrap();
    assert_eq!(again.finished().sending, ["r-gen-2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_registering_its_caches_again_starts_a_generation_its_params_carry() {
    // vLLM's sleep mode: the same worker registers new memory; its side channel serves the
    // changed payload as a new generation, and the decode handshakes again (#32 item 7).
    common::init_tracing();
    let spec = spec(4);
    let mut prefill = vllm_worker("vm-pf-rereg", &spec, vllm_factors(), None);
    fill(&prefill, &spec);
    let mut prefill_scheduler = vllm_scheduler("vm-pf-rereg", &prefill);
    let decode = vllm_worker("vm-dc-rereg", &spec, vllm_factors(), None);
    let mut decode_scheduler = vllm_scheduler("vm-dc-rereg", &decode);
    let json = finish(&prefill, &mut prefill_scheduler, "r-rereg-1", &[5]);
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(value["remote_registration_generation"], 1);
    let outcome = load(&decode, &mut decode_scheduler, "d-rereg-1", &[0], &json).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds(&decode, &spec, &[0], &[5]);
    tokio::time::timeout(WAIT, prefill.notified())
        .await
        .unwrap();
    assert_eq!(prefill.finished().sending, ["r-rereg-1"]);

    let side_channel = prefill.side_channel_addr().unwrap();
    prefill.register_host_kv_caches_again(spec.clone()).unwrap();
    assert_eq!(prefill.side_channel_addr().unwrap(), side_channel);
    // Block 5 of the new memory holds what block 9 held: the old memory's block 5 differs.
    let cache = prefill.kv_caches().unwrap();
    for layer in 0..spec.num_regions() {
        let len = spec.block_len(layer);
        let data: Vec<u8> = (0..len).map(|o| pattern(layer, 9, o)).collect();
        cache.write(layer, 5 * len, &data).unwrap();
    }
    let json = finish(&prefill, &mut prefill_scheduler, "r-rereg-2", &[5]);
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(value["remote_registration_generation"], 2);
    let outcome = load(&decode, &mut decode_scheduler, "d-rereg-2", &[1], &json).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds(&decode, &spec, &[1], &[9]);
    tokio::time::timeout(WAIT, prefill.notified())
        .await
        .unwrap();
    assert_eq!(prefill.finished().sending, ["r-rereg-2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_generation_seen_replaces_ranks_loaded_before_it() {
    // The decode loads the prefill's rank without a generation (as for heartbeats); the
    // prefill registers again; the first load then names a generation the decode never saw,
    // which counts as newer than vLLM's stored default, 0 (#30 item 5).
    common::init_tracing();
    let spec = spec(4);
    let server = side_channel();
    let first = vllm_worker("vm-pf-seen", &spec, vllm_factors(), Some(server.clone()));
    let decode = vllm_worker("vm-dc-seen", &spec, vllm_factors(), None);
    let port = first.side_channel_addr().unwrap().port();
    decode
        .handshake_with("vm-pf-seen", "127.0.0.1", port, 1)
        .await
        .unwrap();
    drop(first);
    let again = vllm_worker("vm-pf-seen", &spec, vllm_factors(), Some(server.clone()));
    fill(&again, &spec);
    let mut again_scheduler = vllm_scheduler("vm-pf-seen", &again);
    let json = finish(&again, &mut again_scheduler, "r-seen", &[5]);
    let mut decode_scheduler = vllm_scheduler("vm-dc-seen", &decode);
    let outcome = load(&decode, &mut decode_scheduler, "d-seen", &[1], &json).await;
    assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    holds(&decode, &spec, &[1], &[5]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_replaced_at_its_address_is_evicted() {
    // Another engine at the same ROUTER: the one before it is released once no load holds
    // it (vLLM's _track_remote_engine_replacement), TTL or not (#30 item 5).
    common::init_tracing();
    let spec = spec(4);
    let server = side_channel();
    let decode = vllm_worker("vm-dc-moved", &spec, vllm_factors(), None);
    let mut decode_scheduler = vllm_scheduler("vm-dc-moved", &decode);
    for (i, engine) in ["vm-pf-before", "vm-pf-after"].into_iter().enumerate() {
        let prefill = vllm_worker(engine, &spec, vllm_factors(), Some(server.clone()));
        fill(&prefill, &spec);
        let mut scheduler = vllm_scheduler(engine, &prefill);
        let json = finish(&prefill, &mut scheduler, &format!("r-moved-{i}"), &[5]);
        let request = format!("d-moved-{i}");
        let outcome = load(&decode, &mut decode_scheduler, &request, &[1], &json).await;
        assert!(matches!(outcome, LoadOutcome::Loaded { .. }), "{outcome:?}");
    }
    let start = Instant::now();
    while decode.remote_stats().evicted == 0 {
        assert!(start.elapsed() < WAIT, "{:?}", decode.remote_stats());
        decode.start_load_kv(&Default::default());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stats = decode.remote_stats();
    assert_eq!(
        (stats.engines, stats.agents, stats.evicted),
        (1, 1, 1),
        "{stats:?}"
    );
}

/// vLLM's protocol through the geometry matrix's model: one ROUTER per engine shared by its
/// ranks, each asked by number, the metadata converted from vLLM's `NixlAgentMetadata`,
/// notifications counting consumers; TP both ways and block sizes both ways, for MHA (one
/// tensor per region, of different lengths, as vLLM 0.33's packed K and V per layer: vLLM's
/// metadata cannot say halves) and MLA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp_and_block_sizes_both_ways_move_every_byte_where_the_model_says() {
    common::init_tracing();
    let side = |tp, block_size| Side {
        tp,
        block_size,
        num_blocks: BLOCKS,
    };
    let mha = Model {
        attention: KvAttention::Mha { total_kv_heads: 4 },
        layout: KvLayout::Hnd,
        regions: vec![(KvRegionKind::Tensor, 16), (KvRegionKind::Tensor, 8)],
    };
    let mla = Model {
        attention: KvAttention::Mla,
        regions: vec![(KvRegionKind::Tensor, 24), (KvRegionKind::Tensor, 8)],
        ..mha.clone()
    };
    let cases = [
        (side(1, 4), side(1, 4)),
        (side(1, 4), side(2, 4)),
        (side(2, 4), side(1, 8)),
        (side(4, 8), side(2, 4)),
        (side(2, 4), side(4, 4)),
    ];
    run_cases_speaking(&mha, &cases, Protocol::Vllm).await;
    run_cases_speaking(&mla, &cases[1..3], Protocol::Vllm).await;
}

/// A hybrid model of two KV cache groups sharing every region (full attention and a
/// sliding window) in vLLM's protocol: the params handed as vLLM's JSON, one list of block
/// ids per group, each group clipped and paired as vLLM 0.33's scheduler and worker do,
/// every byte checked against the geometry matrix's model; TP both ways, blocks of as many
/// tokens or decode blocks of 2 and 4 times the prefill's (vLLM's `block_size_ratio`), a
/// prefill of larger blocks refused by name, and engines whose block ids are two kernel
/// blocks each (`physical_blocks_per_logical_kv_block` 2, from their groups' block size).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_kv_cache_groups_move_every_byte_where_the_model_says() {
    common::init_tracing();
    let side = |tp, block_size| Side {
        tp,
        block_size,
        num_blocks: HYBRID_BLOCKS,
    };
    let mha = Model {
        attention: KvAttention::Mha { total_kv_heads: 4 },
        layout: KvLayout::Hnd,
        regions: vec![(KvRegionKind::Tensor, 16), (KvRegionKind::Tensor, 8)],
    };
    let cases = [
        (side(1, 4), side(2, 4)),
        (side(2, 4), side(1, 4)),
        (side(4, 4), side(2, 8)),
        (side(2, 4), side(1, 16)),
        (side(2, 8), side(1, 4)),
    ];
    run_hybrid_cases(&mha, &cases, Protocol::Vllm).await;
    // Block ids of two kernel blocks each (vLLM's physical_blocks_per_logical_kv_block 2):
    // on the prefill, with decode blocks of as many tokens or twice its kernel's; on the
    // decode; on both.
    let per_id = |prefill, decode| PerId { prefill, decode };
    let kernel = [(side(1, 4), side(2, 4)), (side(2, 4), side(1, 8))];
    run_hybrid_cases_per_id(&mha, &kernel, Protocol::Vllm, per_id(2, 1)).await;
    run_hybrid_cases_per_id(&mha, &kernel[..1], Protocol::Vllm, per_id(1, 2)).await;
    run_hybrid_cases_per_id(
        &mha,
        &[(side(2, 4), side(1, 4))],
        Protocol::Vllm,
        per_id(2, 2),
    )
    .await;
}
