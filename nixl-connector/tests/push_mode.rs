//! Push mode in the native protocol (and vLLM's at TP above 1), over real NIXL and UCX,
//! both engines in this process: the decode registers its blocks with the prefill ranks,
//! which WRITE the KV into them.
//! Every byte is checked against the model of `common::geometry` (MHA, 4 KV heads, HND; K
//! and V regions of different head sizes and a region with K and V halves in each block):
//! - TP 1 → 1 and prefill TP 2 → decode TP 1 (each prefill rank writes its head slice);
//! - a prefix hit on the decode (it registers the last blocks only);
//! - a registration that arrives before the prefill holds the request;
//! - the registration timeout: the load fails by the policy once the prefill answered the
//!   cancel, and nothing is written afterwards;
//! - a registration of more blocks than the prefill holds, refused with a typed error;
//! - a full prefix hit, which cancels so that the prefill frees at once;
//! - push and pull engines refuse each other;
//! - the schedulers' steps drive push as they drive pull;
//! - vLLM's push protocol between the two engines at TP above 1 (2 → 1, 4 → 2, 2 → 2, MLA
//!   2 → 1), and with the hybrid model (the params crossing as vLLM's JSON).

mod common;

use std::time::{Duration, Instant};

use nixl_connector::{
    ConnectorMetadata, Error, FailedBlock, FailureKind, FinishStatus, KvAttention,
    KvCacheGroupKind, KvCacheGroups, KvConnectorScheduler, KvConnectorWorker, KvLayout,
    KvRegionKind, KvTransferParams, LoadOutcome, Protocol, RequestFinished, SchedulerConfig,
    SendSpec, TransferMode, WorkerConfig,
};

use common::geometry::{engine_speaking_vllm_with, engine_with, with_groups, Model, Request, Side};
use common::{capability, poll_until, WAIT};

const BLOCKS: usize = 12;

fn model() -> Model {
    Model {
        attention: KvAttention::Mha { total_kv_heads: 4 },
        layout: KvLayout::Hnd,
        regions: vec![
            (KvRegionKind::Tensor, 16),
            (KvRegionKind::Tensor, 8),
            (KvRegionKind::KvHalves, 8),
        ],
    }
}

fn side(tp: usize) -> Side {
    Side {
        tp,
        block_size: 4,
        num_blocks: BLOCKS,
    }
}

/// `config` in push mode, with `timeout` as its registration timeout if given.
fn push(config: &mut WorkerConfig, timeout: Option<f64>) {
    let extra = &mut config.kv_transfer_config.kv_connector_extra_config;
    extra.insert("transfer_mode".into(), "push".into());
    if let Some(timeout) = timeout {
        extra.insert("push_registration_timeout".into(), timeout.into());
    }
}

/// An engine of TP `tp` in push mode.
fn engine(id: &str, tp: usize, timeout: Option<f64>) -> Vec<KvConnectorWorker> {
    engine_with(id, &model(), &side(tp), |config| push(config, timeout))
}

/// A request of `prefill` blocks, of which the decode loads the last `decode` (a prefix
/// hit when fewer).
fn request(id: &str, prefill: usize, decode: usize) -> Request {
    Request {
        id: id.to_string(),
        remote: (0..prefill).map(|i| (i * 5 + 3) % BLOCKS).collect(),
        local: (0..decode).map(|i| (i * 7 + 1) % BLOCKS).collect(),
        num_tokens: None,
    }
}

/// The prefill engine and a decode engine, the prefill's every rank filled and the
/// decode's blocks sentinels.
fn pair(
    prefill_tp: usize,
    decode_timeout: Option<f64>,
) -> (Vec<KvConnectorWorker>, KvConnectorWorker) {
    let prefills = engine("pf-push", prefill_tp, None);
    for (rank, worker) in prefills.iter().enumerate() {
        model().fill_prefill(worker, &side(prefill_tp), rank);
    }
    let decode = engine("dc-push", 1, decode_timeout).remove(0);
    model().fill_sentinel(&decode, &side(1));
    (prefills, decode)
}

/// As [`pair`] (TP 1 on both sides), the engines' config naming `groups`.
fn pair_of_groups(groups: &KvCacheGroups) -> (Vec<KvConnectorWorker>, KvConnectorWorker) {
    let config = |config: &mut WorkerConfig| {
        push(config, None);
        with_groups(config, groups);
    };
    let prefills = engine_with("pf-push", &model(), &side(1), config);
    model().fill_prefill(&prefills[0], &side(1), 0);
    let decode = engine_with("dc-push", &model(), &side(1), config).remove(0);
    model().fill_sentinel(&decode, &side(1));
    (prefills, decode)
}

/// Holds `request` for push on every prefill rank, its lease `lease` long.
fn hold(prefills: &[KvConnectorWorker], request: &Request, lease: Duration) {
    for worker in prefills {
        worker
            .hold_for_push(
                &request.id,
                Instant::now() + lease,
                &capability(),
                (&request.remote, &[]),
                request.num_tokens,
            )
            .unwrap();
    }
}

/// Starts the decode's push load of `request` from the prefill engine.
fn start(decode: &KvConnectorWorker, prefills: &[KvConnectorWorker], request: &Request) {
    let port = prefills[0].side_channel_addr().unwrap().port();
    let from = Model::remote(request, "pf-push", port, prefills.len());
    decode
        .start_load(&request.id, &request.local, &from)
        .unwrap();
}

/// Waits until `worker` reports `request` received.
async fn loaded(worker: &KvConnectorWorker, request: &str) {
    let done = poll_until(worker, WAIT, |f| f.recving.iter().any(|r| r == request)).await;
    assert!(
        done.recving.iter().any(|r| r == request),
        "no outcome for {request}"
    );
}

/// Waits until every prefill rank released `request`.
async fn released(prefills: &[KvConnectorWorker], request: &str) {
    for worker in prefills {
        let done = poll_until(worker, WAIT, |f| f.sending.iter().any(|r| r == request)).await;
        assert!(
            done.sending.iter().any(|r| r == request),
            "{request} not released"
        );
    }
}

/// Checks every byte of the decode after `requests` were written.
fn check(decode: &KvConnectorWorker, prefill_tp: usize, requests: &[&Request]) {
    model()
        .check_decode(decode, &side(prefill_tp), &side(1), 0, requests)
        .unwrap();
}

async fn push_and_check(prefill_tp: usize, request: Request) {
    let (prefills, decode) = pair(prefill_tp, None);
    hold(&prefills, &request, Duration::from_secs(30));
    start(&decode, &prefills, &request);
    loaded(&decode, &request.id).await;
    assert!(decode.load_errors().is_empty());
    check(&decode, prefill_tp, &[&request]);
    released(&prefills, &request.id).await;
    let written: u64 = prefills.iter().map(|p| p.push_stats().bytes_written).sum();
    let moved = model().moved_bytes(&side(prefill_tp), &side(1), 0, &request);
    assert_eq!(written, moved as u64, "each byte written once");
    for worker in &prefills {
        let stats = worker.push_stats();
        assert_eq!(
            (stats.writes, stats.registrations_matched),
            (1, 1),
            "{stats:?}"
        );
    }
    assert_eq!(decode.push_stats().registrations_sent, prefill_tp as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp1_to_tp1_writes_every_byte() {
    push_and_check(1, request("req-1", 5, 5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_tp2_writes_each_head_slice_into_decode_tp1() {
    push_and_check(2, request("req-2", 4, 4)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_hit_writes_the_last_blocks_only() {
    push_and_check(2, request("req-hit", 5, 2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_before_the_hold_waits_for_it() {
    let (prefills, decode) = pair(1, None);
    let request = request("req-early", 3, 3);
    start(&decode, &prefills, &request);
    // The registration reaches the prefill first, and waits there.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        decode.finished().recving.is_empty(),
        "nothing written before the hold"
    );
    hold(&prefills, &request, Duration::from_secs(30));
    loaded(&decode, &request.id).await;
    assert!(decode.load_errors().is_empty());
    check(&decode, 1, &[&request]);
    assert_eq!(prefills[0].push_stats().registrations_waited, 1);
    released(&prefills, &request.id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registration_timeout_fails_the_load_and_nothing_is_written_after() {
    let (prefills, decode) = pair(1, Some(0.5));
    let request = request("req-late", 3, 3);
    let started = Instant::now();
    start(&decode, &prefills, &request);
    loaded(&decode, &request.id).await;
    assert!(started.elapsed() >= Duration::from_millis(500));
    let failed = decode.load_errors();
    assert_eq!(failed.len(), request.local.len());
    assert!(
        failed.iter().all(|f| f.kind == FailureKind::Timeout),
        "{failed:?}"
    );
    assert_eq!(decode.push_stats().registration_timeouts, 1);
    assert_eq!(decode.overdue_loads().len(), 1);
    // The prefill holds the request only now: the cancel dropped the registration.
    hold(&prefills, &request, Duration::from_millis(300));
    tokio::time::sleep(Duration::from_millis(300)).await;
    check(&decode, 1, &[]);
    released(&prefills, &request.id).await;
    assert_eq!(prefills[0].push_stats().writes, 0);
    assert_eq!(prefills[0].send_stats().freed_on_timeout, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_of_more_blocks_than_held_is_refused() {
    let (prefills, decode) = pair(1, None);
    let mut request = request("req-big", 5, 5);
    hold(&prefills, &request, Duration::from_secs(30));
    // The decode registers 6 blocks for a request of 5 here.
    request.local.push(11);
    start(&decode, &prefills, &request);
    loaded(&decode, &request.id).await;
    let failed = decode.load_errors();
    assert_eq!(failed.len(), 6);
    assert!(
        failed.iter().all(|f| f.reason.contains("refused")),
        "{failed:?}"
    );
    assert_eq!(prefills[0].push_stats().registrations_oversized, 1);
    released(&prefills, &request.id).await;
    check(&decode, 1, &[]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_prefix_hit_lets_the_prefill_free_at_once() {
    let (prefills, decode) = pair(1, None);
    let request = request("req-full-hit", 3, 0);
    hold(&prefills, &request, Duration::from_secs(30));
    let started = Instant::now();
    start(&decode, &prefills, &request);
    released(&prefills, &request.id).await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "not by its lease"
    );
    assert_eq!(prefills[0].send_stats().freed_on_timeout, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_and_pull_refuse_each_other() {
    // A pull worker refuses to hold for push.
    let pull = engine_with("pf-pull", &model(), &side(1), |_| {}).remove(0);
    let err = pull
        .hold_for_push("r", Instant::now(), &capability(), (&[1], &[]), None)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    // Params say their mode; a decode of the other one refuses them.
    let mut params = KvTransferParams {
        transfer_mode: Some("push".into()),
        ..Default::default()
    };
    assert!(TransferMode::Push.check_params(&params).is_ok());
    assert!(
        params.check_supported().is_ok(),
        "read alike by either mode's engine"
    );
    let err = TransferMode::Pull.check_params(&params).unwrap_err();
    assert!(err.to_string().contains("\"push\""), "{err}");
    params.transfer_mode = Some("pull".into());
    let err = TransferMode::Push.check_params(&params).unwrap_err();
    assert!(err.to_string().contains("\"pull\""), "{err}");
    // In vLLM's protocol the compatibility factors name the mode too (vLLM hashes it).
    let mut config = common::geometry::rank_config("dc", 0, 1, 0);
    push(&mut config, None);
    let extra = &mut config.kv_transfer_config.kv_connector_extra_config;
    extra.insert("protocol".into(), "vllm".into());
    extra.insert(
        "vllm_compat_factors".into(),
        serde_json::json!({"vllm_version": "0.33.0", "model": "m", "dtype": "torch.bfloat16",
            "num_kv_heads": 8, "head_size": 128, "num_hidden_layers": 2,
            "attn_backend_name": "FLASH_ATTN", "cache_dtype": "auto", "is_hma_enabled": true}),
    );
    let err = KvConnectorWorker::new(config.clone()).unwrap_err();
    assert!(
        err.to_string().contains(
            "transfer_mode is \"pull\" (\"pull\" when left out), but this engine is in push mode"
        ),
        "{err}"
    );
    // With push factors it is built; a hold with a capability is the native protocol's.
    let extra = &mut config.kv_transfer_config.kv_connector_extra_config;
    extra["vllm_compat_factors"]["transfer_mode"] = "push".into();
    let worker = KvConnectorWorker::new(config).unwrap();
    let err = worker
        .hold_for_push("r", Instant::now(), &capability(), (&[1], &[]), None)
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("vLLM's protocol has no capabilities"),
        "{err}"
    );
}

/// The `kv_transfer_config` of a push engine (host memory).
/// The scheduler configs of the prefill engine `pf-push` (reached at its first rank's side
/// channel) and of the decode `dc-push`, both TP 1 with `kv`.
fn scheduler_configs(
    prefills: &[KvConnectorWorker],
    decode: &KvConnectorWorker,
    kv: &nixl::kv_config::KvTransferConfig,
) -> (SchedulerConfig, SchedulerConfig) {
    let config = |engine: &str, worker: &KvConnectorWorker| {
        let port = worker.side_channel_addr().unwrap().port();
        SchedulerConfig::new(engine, "127.0.0.1", port, 1, kv).unwrap()
    };
    (config("pf-push", &prefills[0]), config("dc-push", decode))
}

/// The schedulers of [`scheduler_configs`].
fn schedulers(
    prefills: &[KvConnectorWorker],
    decode: &KvConnectorWorker,
    kv: &nixl::kv_config::KvTransferConfig,
) -> (KvConnectorScheduler, KvConnectorScheduler) {
    let (prefill, decode) = scheduler_configs(prefills, decode, kv);
    (
        KvConnectorScheduler::new(prefill),
        KvConnectorScheduler::new(decode),
    )
}

/// The prefill finishes `request` (4 tokens a block), to be handed to a decode.
fn finish_for_decode(prefill: &mut KvConnectorScheduler, request: &Request) -> RequestFinished {
    prefill.request_finished(
        &request.id,
        &request.remote,
        request.remote.len() * 4,
        Some(&common::for_decode()),
        FinishStatus::Stopped,
    )
}

fn push_config() -> nixl::kv_config::KvTransferConfig {
    let mut config = common::cpu_config();
    config
        .kv_connector_extra_config
        .insert("transfer_mode".into(), "push".into());
    config
}

/// The engines' schedulers drive both halves as an engine does (the same calls as in pull
/// mode): the prefill's params say push, the decode's step registers, the prefill's step
/// holds and writes, the decode's outcome is `Loaded` and the prefill's `finished_sending`
/// frees; every byte checked, a prefix hit included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_steps_are_those_of_pull_mode() {
    let (prefills, decode) = pair(1, None);
    let kv = push_config();
    let (config, _) = scheduler_configs(&prefills, &decode, &kv);
    assert_eq!(config.transfer_mode, TransferMode::Push);
    let (mut prefill, mut decode_s) = schedulers(&prefills, &decode, &kv);
    let request = request("req-steps", 5, 3);
    let done = finish_for_decode(&mut prefill, &request);
    assert!(done.delay_free_blocks);
    let params = done.kv_transfer_params.unwrap();
    assert_eq!(params.transfer_mode.as_deref(), Some("push"));
    decode_s.on_new_request(&request.id, Some(&params));
    decode_s
        .update_state_after_alloc(&request.id, &request.local, &params)
        .unwrap();
    let (mut loaded, mut freed) = (false, false);
    let start = Instant::now();
    while !(loaded && freed) && start.elapsed() < WAIT {
        let out = prefill.step(&prefills).unwrap();
        freed |= out.finished_sending.contains(&request.id);
        let out = decode_s.step(std::slice::from_ref(&decode)).unwrap();
        for outcome in out.load_outcomes {
            match outcome {
                LoadOutcome::Loaded { request_id } if request_id == request.id => loaded = true,
                other => panic!("unexpected outcome {other:?}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(loaded && freed, "loaded {loaded}, freed {freed}");
    check(&decode, 1, &[&request]);
    // A pull decode refuses these params by name.
    let mut pull = KvConnectorScheduler::new(
        SchedulerConfig::new("dc-pull", "127.0.0.1", 1, 1, &common::cpu_config()).unwrap(),
    );
    pull.on_new_request("r", Some(&params));
    let err = pull
        .update_state_after_alloc("r", &[1], &params)
        .unwrap_err();
    assert!(
        err.to_string().contains("push engine and a pull engine"),
        "{err}"
    );
}

/// The decode aborts a request after registering, before the prefill holds it: its cancel
/// drops the registration, the prefill answers, and the load ends as aborted with no
/// failed block; nothing is written when the prefill holds the request later, and a
/// held request whose decode aborts before registering is released at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_after_registering_cancels_and_nothing_is_written() {
    let (prefills, decode) = pair(1, None);
    let request = request("req-abort", 3, 3);
    start(&decode, &prefills, &request);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(decode.abort_load(&request.id));
    loaded(&decode, &request.id).await;
    assert!(
        decode.load_errors().is_empty(),
        "an aborted load fails no block"
    );
    hold(&prefills, &request, Duration::from_millis(300));
    tokio::time::sleep(Duration::from_millis(300)).await;
    check(&decode, 1, &[]);
    released(&prefills, &request.id).await;
    assert_eq!(prefills[0].push_stats().writes, 0);
}

/// MLA: two layers' latents of different sizes (replicated on every rank).
fn mla() -> Model {
    Model {
        attention: KvAttention::Mla,
        layout: KvLayout::Hnd,
        regions: vec![(KvRegionKind::Tensor, 24), (KvRegionKind::Tensor, 8)],
    }
}

/// A prefill of TP `prefill_tp` pushes `request` into a decode of TP `decode_tp` of
/// `model`: every byte of every decode rank checked, every prefill rank released.
async fn push_between(model: &Model, prefill_tp: usize, decode_tp: usize, request: Request) {
    let (prefill, decode) = (side(prefill_tp), side(decode_tp));
    let prefills = engine_with("pf-push", model, &prefill, |c| push(c, None));
    for (rank, worker) in prefills.iter().enumerate() {
        model.fill_prefill(worker, &prefill, rank);
    }
    let decodes = engine_with("dc-push", model, &decode, |c| push(c, None));
    for worker in &decodes {
        model.fill_sentinel(worker, &decode);
    }
    hold(&prefills, &request, Duration::from_secs(30));
    for worker in &decodes {
        start(worker, &prefills, &request);
    }
    for (rank, worker) in decodes.iter().enumerate() {
        loaded(worker, &request.id).await;
        assert!(worker.load_errors().is_empty());
        model
            .check_decode(worker, &prefill, &decode, rank, &[&request])
            .unwrap_or_else(|err| panic!("TP {prefill_tp} -> {decode_tp}: {err}"));
    }
    released(&prefills, &request.id).await;
    // Each byte written once: of the prefill ranks holding a copy of a decode rank's heads
    // (MLA's latent), one writes it; each rank ends.
    let written: u64 = prefills.iter().map(|p| p.push_stats().bytes_written).sum();
    let moved: usize = (0..decode_tp)
        .map(|rank| model.moved_bytes(&prefill, &decode, rank, &request))
        .sum();
    assert_eq!(written, moved as u64, "TP {prefill_tp} -> {decode_tp}");
    assert!(prefills.iter().all(|p| p.push_stats().writes == 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_tp4_writes_into_decode_tp2_and_tp2_into_tp2() {
    push_between(&model(), 4, 2, request("req-4-2", 4, 3)).await;
    push_between(&model(), 2, 2, request("req-2-2", 3, 3)).await;
}

/// [`model`] as vLLM registers it: each layer one region (no K and V halves in a block).
fn vllm_model() -> Model {
    Model {
        regions: vec![(KvRegionKind::Tensor, 16), (KvRegionKind::Tensor, 8)],
        ..model()
    }
}

/// `config` speaking vLLM's push protocol (its compatibility factors saying push).
fn vllm_push(config: &mut WorkerConfig) {
    push(config, None);
    let extra = &mut config.kv_transfer_config.kv_connector_extra_config;
    extra["vllm_compat_factors"]["transfer_mode"] = "push".into();
}

/// As [`push_between`], both engines speaking vLLM 0.33's push protocol (`PUSH_REG:`
/// registrations by request id, `id:world` completions, the prefill holding through its
/// step's send, without a capability): each decode rank registers with the prefill ranks
/// of its TP mapping and counts one WRITE from each.
async fn vllm_push_between(model: &Model, prefill_tp: usize, decode_tp: usize, request: Request) {
    let sides = (side(prefill_tp), side(decode_tp));
    vllm_push_of_groups(model, sides, &request, (None, None), &request).await;
}

/// [`vllm_push_between`] of engines of `sides` (prefill, decode) whose configs name
/// `groups` where given (prefill's, decode's), the decode checked to hold `written` (in
/// kernel blocks).
async fn vllm_push_of_groups(
    model: &Model,
    (prefill, decode): (Side, Side),
    request: &Request,
    groups: (Option<&KvCacheGroups>, Option<&KvCacheGroups>),
    written: &Request,
) {
    let (prefill_tp, decode_tp) = (prefill.tp, decode.tp);
    let prefills = engine_speaking_vllm_with("pf-vpush", model, &prefill, groups.0, vllm_push);
    for (rank, worker) in prefills.iter().enumerate() {
        model.fill_prefill(worker, &prefill, rank);
    }
    let decodes = engine_speaking_vllm_with("dc-vpush", model, &decode, groups.1, vllm_push);
    for worker in &decodes {
        model.fill_sentinel(worker, &decode);
    }
    let send = SendSpec {
        request_id: request.id.clone(),
        deadline: Instant::now() + Duration::from_secs(30),
        capability: None,
        block_ids: request.remote.clone(),
        lease_epoch: None,
        group_lens: Vec::new(),
        num_tokens: request.num_tokens,
    };
    let meta = ConnectorMetadata {
        sends: vec![send],
        ..ConnectorMetadata::default()
    };
    for worker in &prefills {
        worker.start_load_kv(&meta);
    }
    let port = prefills[0].vllm_side_channel().unwrap().local_addr().port();
    let mut from = Model::remote(request, "pf-vpush", port, prefill_tp);
    from.capability = None;
    for worker in &decodes {
        worker
            .start_load(&request.id, &request.local, &from)
            .unwrap();
    }
    for (rank, worker) in decodes.iter().enumerate() {
        loaded(worker, &request.id).await;
        let errors = worker.load_errors();
        assert!(errors.is_empty(), "{errors:?}");
        model
            .check_decode(worker, &prefill, &decode, rank, &[written])
            .unwrap_or_else(|err| panic!("vLLM push TP {prefill_tp} -> {decode_tp}: {err}"));
        let stats = worker.push_stats();
        let per_rank = (prefill_tp / decode_tp) as u64;
        assert_eq!(stats.registrations_sent, per_rank, "{stats:?}");
    }
    released(&prefills, &request.id).await;
    for worker in &prefills {
        assert_eq!(
            worker.push_stats().writes,
            1,
            "each prefill rank writes once"
        );
    }
    // Each byte once: of the ranks holding a copy of a decode rank's heads, one writes it.
    let bytes: u64 = prefills.iter().map(|p| p.push_stats().bytes_written).sum();
    let moved: usize = (0..decode_tp)
        .map(|rank| model.moved_bytes(&prefill, &decode, rank, written))
        .sum();
    assert_eq!(bytes, moved as u64, "TP {prefill_tp} -> {decode_tp}");
}

/// vLLM's push protocol at TP above 1: prefill TP 2 into decode TP 1 (each prefill rank its
/// head slice), TP 4 into TP 2 and TP 2 into TP 2, and MLA's replicated latent from TP 2
/// into TP 1; every byte of every decode rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_vllms_push_protocol_prefill_ranks_write_their_slices_at_any_tp() {
    vllm_push_between(&vllm_model(), 2, 1, request("vreq-2-1", 4, 3)).await;
    vllm_push_between(&vllm_model(), 4, 2, request("vreq-4-2", 4, 4)).await;
    vllm_push_between(&vllm_model(), 2, 2, request("vreq-2-2", 3, 2)).await;
    vllm_push_between(&mla(), 2, 1, request("vreq-mla-2-1", 4, 4)).await;
}

/// MLA's latent, replicated on every rank: of the prefill ranks of a decode rank's group,
/// one writes it and the others only notify (vLLM's push has each write the same bytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mla_latents_are_written_once_and_every_prefill_rank_ends() {
    push_between(&mla(), 2, 1, request("req-mla-2-1", 4, 4)).await;
    push_between(&mla(), 4, 2, request("req-mla-4-2", 4, 3)).await;
    push_between(&mla(), 1, 1, request("req-mla-1-1", 4, 2)).await;
}

/// A decode shut down while a push load waits: its ends are still taken (and its side
/// channel still answers the prefill rank that handshakes to answer), so `shutdown` does
/// not return while the load waits, and returns once the load timed out, the prefill
/// answered its cancel, and the prefill (which loaded the decode's agent to answer, in
/// this process) is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_a_registered_load_to_end() {
    let (prefills, decode) = pair(1, Some(0.5));
    let request = request("req-shutdown", 3, 3);
    start(&decode, &prefills, &request);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let shutdown = tokio::spawn(decode.shutdown());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!shutdown.is_finished(), "shut down while a load waited");
    // The load times out at 0.5 s and its cancel is answered soon after.
    tokio::time::sleep(Duration::from_millis(700)).await;
    drop(prefills);
    tokio::time::timeout(WAIT, shutdown)
        .await
        .expect("shutdown ends once the load ended")
        .unwrap();
}

/// A third agent that handshook with the prefill but never got the request's params sends
/// push messages: a registration under a made-up tag (naming its own blocks), a cancel, an
/// end, and bytes that do not parse. Each is refused and counted, nothing is written into
/// it or released, and the real decode's push then writes every byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_push_messages_are_refused_and_counted() {
    let (prefills, decode) = pair(1, None);
    let third = engine("dc-third", 1, None).remove(0);
    model().fill_sentinel(&third, &side(1));
    let port = prefills[0].side_channel_addr().unwrap().port();
    third
        .handshake_with("pf-push", "127.0.0.1", port, 1)
        .await
        .unwrap();
    let request = request("req-forged", 3, 3);
    hold(&prefills, &request, Duration::from_secs(30));
    let to = prefills[0].agent().name().to_string();
    let third_port = third.side_channel_addr().unwrap().port();
    let body = rmp_serde::to_vec_named(&serde_json::json!({
        "request_id": request.id, "decode_request_id": request.id, "engine_id": "dc-third",
        "host": "127.0.0.1", "port": third_port, "tp_size": 1, "tp_rank": 0,
        "block_ids": request.local, "group_lens": [],
    }))
    .unwrap();
    let tag = "ab".repeat(32);
    let forged = [format!("PUSHREG:{tag}:").as_bytes(), &body].concat();
    let cancel = [format!("PUSHX:{tag}:").as_bytes(), &body].concat();
    for message in [
        forged,
        cancel,
        format!("PUSHED:{}:written:{tag}", request.id).into_bytes(),
        b"PUSHREG:not a registration".to_vec(),
        b"PUSHREG:".to_vec(),
    ] {
        third.agent().send_notification(&to, &message).unwrap();
    }
    common::wait_for("the forged messages to be refused", WAIT, || {
        prefills[0].push_stats().registrations_refused >= 4
    })
    .await;
    assert_eq!(prefills[0].push_stats().writes, 0);
    assert!(
        prefills[0].finished().sending.is_empty(),
        "nothing released"
    );
    assert_eq!(
        prefills[0].push_stats().refused_ends,
        1,
        "an end the prefill waits for not"
    );
    check(&third, 1, &[]);
    start(&decode, &prefills, &request);
    loaded(&decode, &request.id).await;
    assert!(decode.load_errors().is_empty());
    check(&decode, 1, &[&request]);
    released(&prefills, &request.id).await;
}

/// The decode's request waits for blocks past the prefill's lease (1 s): the decode's
/// heartbeats, sent from `on_new_request` on as in pull mode, keep the request held, and
/// the push then writes every byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_the_request_held_past_the_lease() {
    let (prefills, decode) = pair(1, None);
    let mut kv = push_config();
    kv.kv_connector_extra_config
        .insert("kv_lease_duration".into(), 1.into());
    let (mut prefill, mut decode_s) = schedulers(&prefills, &decode, &kv);
    let request = request("req-heartbeats", 4, 4);
    let done = finish_for_decode(&mut prefill, &request);
    let params = done.kv_transfer_params.unwrap();
    decode_s.on_new_request(&request.id, Some(&params));
    // 2.5 leases of waiting for blocks, both engines stepping.
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(2500) {
        let out = prefill.step(&prefills).unwrap();
        assert!(
            out.finished_sending.is_empty(),
            "released while the decode waited"
        );
        decode_s.step(std::slice::from_ref(&decode)).unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    decode_s
        .update_state_after_alloc(&request.id, &request.local, &params)
        .unwrap();
    let (mut loaded, mut freed) = (false, false);
    while !(loaded && freed) && start.elapsed() < WAIT {
        freed |= prefill
            .step(&prefills)
            .unwrap()
            .finished_sending
            .contains(&request.id);
        let out = decode_s.step(std::slice::from_ref(&decode)).unwrap();
        loaded |= out
            .load_outcomes
            .iter()
            .any(|o| matches!(o, LoadOutcome::Loaded { request_id } if *request_id == request.id));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(loaded && freed, "loaded {loaded}, freed {freed}");
    check(&decode, 1, &[&request]);
    assert_eq!(prefills[0].send_stats().freed_on_timeout, 0);
}

/// Block ids of two kernel blocks each on both engines (vLLM's
/// `physical_blocks_per_logical_kv_block`), a prefix hit of one id on the decode: the
/// prefill writes the kernel blocks of its last two ids into the decode's, every byte, in
/// both protocols.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_ids_of_two_kernel_blocks_are_written_whole() {
    let groups = KvCacheGroups::new(8, vec![KvCacheGroupKind::FullAttention]).unwrap();
    let (prefills, decode) = pair_of_groups(&groups);
    // Block ids (of 8 tokens): the prefill's 0, 2 and 5; the decode lacks the last two.
    let ids = Request {
        id: "req-kernel".into(),
        remote: vec![0, 2, 5],
        local: vec![1, 3],
        num_tokens: None,
    };
    hold(&prefills, &ids, Duration::from_secs(30));
    start(&decode, &prefills, &ids);
    loaded(&decode, &ids.id).await;
    let errors = decode.load_errors();
    assert!(errors.is_empty(), "{errors:?}");
    // In kernel blocks (of 4 tokens): ids 2 and 5 into ids 1 and 3.
    let kernel = Request {
        remote: vec![4, 5, 10, 11],
        local: vec![2, 3, 6, 7],
        ..ids.clone()
    };
    check(&decode, 1, &[&kernel]);
    released(&prefills, &ids.id).await;
    // The same in vLLM's push protocol.
    let groups = (Some(&groups), Some(&groups));
    vllm_push_of_groups(&vllm_model(), (side(1), side(1)), &ids, groups, &kernel).await;
}

/// `config` in push mode, naming `groups` if given.
fn push_of(config: &mut WorkerConfig, groups: Option<&KvCacheGroups>) {
    push(config, None);
    if let Some(groups) = groups {
        with_groups(config, groups);
    }
}

/// A prefill whose blocks hold `sizes.0` tokens pushes `request` (its `num_tokens` given
/// or not) into a decode of blocks of `sizes.1`, both of TP 1 and of `groups` (in kernel
/// blocks) where given; the decode's bytes checked against `written` once loaded, and
/// its failed blocks returned.
async fn push_across_block_sizes(
    sizes: (usize, usize),
    request: &Request,
    groups: (Option<&KvCacheGroups>, Option<&KvCacheGroups>),
    written: &Request,
) -> Vec<FailedBlock> {
    let (prefill, decode) = (
        Side {
            block_size: sizes.0,
            ..side(1)
        },
        Side {
            block_size: sizes.1,
            ..side(1)
        },
    );
    let prefills = engine_with("pf-sizes", &model(), &prefill, |c| push_of(c, groups.0));
    model().fill_prefill(&prefills[0], &prefill, 0);
    let decode_worker =
        engine_with("dc-sizes", &model(), &decode, |c| push_of(c, groups.1)).remove(0);
    model().fill_sentinel(&decode_worker, &decode);
    hold(&prefills, request, Duration::from_secs(30));
    let port = prefills[0].side_channel_addr().unwrap().port();
    let from = Model::remote(request, "pf-sizes", port, 1);
    decode_worker
        .start_load(&request.id, &request.local, &from)
        .unwrap();
    loaded(&decode_worker, &request.id).await;
    model()
        .check_decode(&decode_worker, &prefill, &decode, 0, &[written])
        .unwrap_or_else(|err| panic!("blocks of {sizes:?} tokens: {err}"));
    released(&prefills, &request.id).await;
    decode_worker.load_errors()
}

/// Engines whose blocks hold different numbers of tokens, both ways, with a prefix hit on
/// the decode: the prefill writes the prompt's tokens where the decode's blocks hold them
/// (by the prompt's tokens its hold gives), every byte; without those tokens the WRITE is
/// refused by name, and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_of_different_block_sizes_push_at_the_prompts_tokens() {
    // Prefill blocks of 8 tokens, decode blocks of 4: 30 tokens are 4 prefill blocks and 8
    // decode blocks, of which the decode's prefix cache holds the first 3.
    let larger = Request {
        id: "req-8-4".into(),
        remote: vec![3, 9, 1, 6],
        local: vec![2, 11, 5, 0, 7],
        num_tokens: Some(30),
    };
    let failed = push_across_block_sizes((8, 4), &larger, (None, None), &larger).await;
    assert!(failed.is_empty(), "{failed:?}");
    // Prefill blocks of 4, decode blocks of 8: 26 tokens are 7 prefill blocks and 4 decode
    // blocks, the first of them cached; the last decode block's second half is no token.
    let smaller = Request {
        id: "req-4-8".into(),
        remote: vec![0, 4, 8, 1, 5, 9, 2],
        local: vec![10, 3, 6],
        num_tokens: Some(26),
    };
    let failed = push_across_block_sizes((4, 8), &smaller, (None, None), &smaller).await;
    assert!(failed.is_empty(), "{failed:?}");
    // Both in vLLM's push protocol (between Rust engines: vLLM 0.33's own push decode
    // cannot complete a push of other block sizes).
    let sized = |block_size| Side {
        block_size,
        ..side(1)
    };
    let model = vllm_model();
    vllm_push_of_groups(&model, (sized(8), sized(4)), &larger, (None, None), &larger).await;
    vllm_push_of_groups(
        &model,
        (sized(4), sized(8)),
        &smaller,
        (None, None),
        &smaller,
    )
    .await;
    // Without the prompt's tokens, where the decode's blocks start is unknown: refused.
    let untold = Request {
        id: "req-untold".into(),
        num_tokens: None,
        ..larger.clone()
    };
    let nothing = Request {
        local: Vec::new(),
        ..untold.clone()
    };
    let failed = push_across_block_sizes((8, 4), &untold, (None, None), &nothing).await;
    assert_eq!(failed.len(), untold.local.len(), "{failed:?}");
    assert!(
        failed.iter().all(|f| f.reason.contains("refused")),
        "{failed:?}"
    );
}

/// Block ids of 8 tokens on the prefill, of two kernel blocks of 4 each, and of 4 tokens
/// (one kernel block) on the decode: 18 tokens are 3 prefill ids (6 kernel blocks, the
/// last holding no token) and 5 decode ids, of which the decode's prefix cache holds the
/// first 2. The prefill's third to fifth kernel blocks land in the decode's 3 (vLLM 0.33
/// cuts the last 3 of the 6 instead, one block late).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_ids_of_other_kernel_blocks_on_each_side_are_written_at_the_prompts_tokens() {
    let prefill_groups = KvCacheGroups::new(8, vec![KvCacheGroupKind::FullAttention]).unwrap();
    let ids = Request {
        id: "req-kernels".into(),
        remote: vec![1, 4, 0],
        local: vec![7, 2, 9],
        num_tokens: Some(18),
    };
    // In kernel blocks of 4 tokens on both sides.
    let kernel = Request {
        remote: vec![2, 3, 8, 9, 0, 1],
        ..ids.clone()
    };
    let groups = (Some(&prefill_groups), None);
    let failed = push_across_block_sizes((4, 4), &ids, groups, &kernel).await;
    assert!(failed.is_empty(), "{failed:?}");
    // The same in vLLM's push protocol, the prefill's step giving the prompt's tokens.
    let sides = (side(1), side(1));
    vllm_push_of_groups(&vllm_model(), sides, &ids, groups, &kernel).await;
}

/// The hybrid model of the push tests: full attention and a 6-token sliding window,
/// sharing every region.
fn hybrid_groups() -> KvCacheGroups {
    KvCacheGroups::new(
        4,
        vec![
            KvCacheGroupKind::FullAttention,
            KvCacheGroupKind::SlidingWindow { window_tokens: 6 },
        ],
    )
    .unwrap()
}

/// A hybrid model (full attention and a 6-token sliding window, sharing every region)
/// through both schedulers: each group's blocks are written into the decode's of the same
/// group, the window's clipped to its last 3 blocks on both sides, the full-attention
/// group's with a prefix hit of 2 blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hybrid_model_writes_each_group_into_its_own_blocks() {
    let groups = hybrid_groups();
    let (prefills, decode) = pair_of_groups(&groups);
    let kv = push_config();
    let (prefill, decode_s) = schedulers(&prefills, &decode, &kv);
    let engines = (&prefills[..], &decode);
    let schedulers = (prefill, decode_s);
    push_hybrid(&model(), engines, schedulers, &groups, Protocol::Native).await;
}

/// The same in vLLM's push protocol (its registration names each group's blocks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_vllms_push_protocol_a_hybrid_model_writes_each_group_into_its_own_blocks() {
    let (groups, model) = (hybrid_groups(), vllm_model());
    let engine = |id| engine_speaking_vllm_with(id, &model, &side(1), Some(&groups), vllm_push);
    let prefills = engine("pf-vpush");
    model.fill_prefill(&prefills[0], &side(1), 0);
    let decode = engine("dc-vpush").remove(0);
    model.fill_sentinel(&decode, &side(1));
    let mut config = common::geometry::rank_config("any", 0, 1, 0);
    config.kv_transfer_config = common::vllm_config(common::vllm_factors());
    vllm_push(&mut config);
    let scheduler = |id: &str, worker: &KvConnectorWorker| {
        let server = worker.vllm_side_channel().unwrap();
        let port = server.local_addr().port();
        let kv = &config.kv_transfer_config;
        let mut config = SchedulerConfig::new(id, "127.0.0.1", port, 1, kv).unwrap();
        config.vllm_side_channel = Some(server);
        KvConnectorScheduler::new(config)
    };
    let schedulers = (
        scheduler("pf-vpush", &prefills[0]),
        scheduler("dc-vpush", &decode),
    );
    // The params cross as vLLM's JSON.
    push_hybrid(
        &model,
        (&prefills, &decode),
        schedulers,
        &groups,
        Protocol::Vllm,
    )
    .await;
}

/// Pushes a request of the hybrid model `groups` from `prefills` into `decode` through
/// their schedulers, its params crossing as `protocol` sends them, and checks each group's
/// blocks.
async fn push_hybrid(
    model: &Model,
    (prefills, decode): (&[KvConnectorWorker], &KvConnectorWorker),
    (prefill, decode_s): (KvConnectorScheduler, KvConnectorScheduler),
    groups: &KvCacheGroups,
    protocol: Protocol,
) {
    let mut prefill = prefill.with_kv_cache_groups(groups.clone());
    let mut decode_s = decode_s.with_kv_cache_groups(groups.clone());
    let id = "req-hybrid";
    let (full, window) = (vec![0, 1, 2, 3, 4], vec![5, 6, 7, 8, 9]);
    let done = prefill
        .request_finished_all_groups(
            id,
            &[full.clone(), window],
            20,
            Some(&common::for_decode()),
            FinishStatus::Stopped,
        )
        .unwrap();
    let params = common::as_sent(protocol, done.kv_transfer_params.unwrap());
    assert_eq!(params.remote_block_group_lens, [5, 3]);
    decode_s.on_new_request(id, Some(&params));
    decode_s
        .update_state_after_alloc_groups(id, &[vec![1, 3, 5], vec![7, 9, 11]], &params)
        .unwrap();
    let (mut loaded, mut freed) = (false, false);
    let start = Instant::now();
    while !(loaded && freed) && start.elapsed() < WAIT {
        freed |= prefill
            .step(prefills)
            .unwrap()
            .finished_sending
            .iter()
            .any(|r| r == id);
        let out = decode_s.step(std::slice::from_ref(decode)).unwrap();
        for outcome in out.load_outcomes {
            match outcome {
                LoadOutcome::Loaded { request_id } if request_id == id => loaded = true,
                other => panic!("unexpected outcome {other:?}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(loaded && freed, "loaded {loaded}, freed {freed}");
    let full = Request {
        id: id.into(),
        remote: full,
        local: vec![1, 3, 5],
        num_tokens: None,
    };
    let window = Request {
        id: id.into(),
        remote: vec![7, 8, 9],
        local: vec![7, 9, 11],
        num_tokens: None,
    };
    model
        .check_decode(decode, &side(1), &side(1), 0, &[&full, &window])
        .unwrap();
}
