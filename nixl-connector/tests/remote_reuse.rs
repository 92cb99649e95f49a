//! A live peer handshaken with again (after a failed load) is not loaded into NIXL again
//! when its metadata is unchanged, so the process's file descriptors stay flat (NIXL 1.5.1
//! keeps two per load and invalidation of a live peer); changed metadata replaces the loaded
//! agent, and only the peer that loaded an agent may replace it.

mod common;

use std::time::Duration;

use common::{block, fill, pattern, poll_until, remote, spec, worker, worker_with};
use nixl_connector::{KvCacheSpec, KvConnectorWorker};

/// Loads `far` into local blocks `[4, 5]` (cleared first) from `engine` and checks every
/// byte against [`pattern`], with block `far[0]`'s first byte `first` (the pattern's unless a
/// test changed it).
async fn load_and_check(
    decode: &KvConnectorWorker,
    prefill: &KvConnectorWorker,
    spec: &KvCacheSpec,
    engine: &str,
    request: &str,
    far: [usize; 2],
    first: u8,
) {
    let local = [4, 5];
    let zeros = vec![0u8; spec.block_len()];
    for layer in 0..spec.num_layers {
        for b in local {
            let cache = decode.kv_caches().unwrap();
            cache.write(layer, b * spec.block_len(), &zeros).unwrap();
        }
    }
    let from = remote(prefill, engine, request, far.to_vec(), 1);
    decode.start_load(request, &local, &from).unwrap();
    let done = poll_until(decode, Duration::from_secs(10), |f| !f.recving.is_empty()).await;
    let metrics = decode.metrics();
    assert_eq!(done.recving, [request], "{metrics:?}");
    assert!(decode.load_errors().is_empty(), "{request}: {metrics:?}");
    for layer in 0..spec.num_layers {
        for (l, f) in local.into_iter().zip(far) {
            let mut want: Vec<u8> = (0..spec.block_len())
                .map(|o| pattern(layer, f, o))
                .collect();
            if f == far[0] && layer == 0 {
                want[0] = first;
            }
            assert_eq!(
                block(decode, spec, layer, l),
                want,
                "{request} layer {layer}"
            );
        }
    }
}

/// A load that fails before its READ (a remote block out of range); the decode then
/// forgets the remote rank and handshakes again at its next load. Returns the failure.
async fn fail_a_load(
    decode: &KvConnectorWorker,
    prefill: &KvConnectorWorker,
    spec: &KvCacheSpec,
    engine: &str,
    request: &str,
) -> String {
    let bad = remote(prefill, engine, request, vec![spec.num_blocks], 1);
    decode.start_load(request, &[0], &bad).unwrap();
    let done = poll_until(decode, Duration::from_secs(10), |f| !f.recving.is_empty()).await;
    assert_eq!(done.recving, [request]);
    assert_eq!(decode.load_errors(), [0]);
    failure_of(decode, request)
}

/// Why `request`'s load failed, from the metrics since the last call.
fn failure_of(decode: &KvConnectorWorker, request: &str) -> String {
    let metrics = decode.metrics();
    let load = metrics.iter().find(|m| m.request_id == request);
    load.and_then(|m| m.failure.clone())
        .unwrap_or_else(|| panic!("{request} did not fail: {metrics:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_failed_then_retried_loads_keep_the_fds_flat() {
    common::init_tracing();
    let spec = spec(2);
    let prefill = worker("pf-reuse", 0, 1, spec);
    fill(&prefill, &spec);
    let decode = worker("dc-reuse", 0, 1, spec);
    let first = pattern(0, 1, 0);
    load_and_check(&decode, &prefill, &spec, "pf-reuse", "first", [1, 2], first).await;
    let before = decode.remote_stats();
    let fds_before = before.open_fds.expect("/proc/self/fd");

    for i in 0..200 {
        let failure = fail_a_load(&decode, &prefill, &spec, "pf-reuse", &format!("bad-{i}")).await;
        assert!(
            failure.contains("remote block 16 of 16 blocks"),
            "{failure}"
        );
        let far = [i % spec.num_blocks, (i + 5) % spec.num_blocks];
        let first = pattern(0, far[0], 0);
        load_and_check(
            &decode,
            &prefill,
            &spec,
            "pf-reuse",
            &format!("req-{i}"),
            far,
            first,
        )
        .await;
    }
    let after = decode.remote_stats();
    let fds_after = after.open_fds.unwrap();
    eprintln!("fds {fds_before} -> {fds_after}; {before:?} -> {after:?}");
    // One handshake per retried load, each reusing the agent loaded by the first.
    assert_eq!((before.handshakes, before.loaded, before.reused), (1, 1, 0));
    assert_eq!(
        (after.handshakes, after.loaded, after.reused, after.replaced),
        (201, 1, 200, 0)
    );
    // Reloading would have taken about 400 more (two per cycle).
    assert!(
        fds_after <= fds_before + 8,
        "open fds grew from {fds_before} to {fds_after} over 200 handshakes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_restarted_under_the_same_name_is_loaded_anew() {
    common::init_tracing();
    let spec = spec(2);
    let named = |config: &mut nixl_connector::WorkerConfig| {
        config.agent_name = Some(format!("pf-restart-agent-{}", std::process::id()));
    };
    let decode = worker("dc-restart", 0, 1, spec);
    let old = worker_with("pf-restart", 0, 1, spec, named);
    fill(&old, &spec);
    load_and_check(
        &decode,
        &old,
        &spec,
        "pf-restart",
        "old",
        [1, 2],
        pattern(0, 1, 0),
    )
    .await;
    drop(old);

    // The same engine and agent name, new memory, a new port, one changed byte.
    let new = worker_with("pf-restart", 0, 1, spec, named);
    fill(&new, &spec);
    new.kv_caches()
        .unwrap()
        .write(0, spec.block_len(), &[0xAB])
        .unwrap();
    // After a failed load the decode handshakes again, with the new prefill, whose metadata
    // replaces the old one's.
    fail_a_load(&decode, &new, &spec, "pf-restart", "failed").await;
    load_and_check(&decode, &new, &spec, "pf-restart", "new", [1, 2], 0xAB).await;
    let stats = decode.remote_stats();
    assert_eq!(
        (stats.handshakes, stats.loaded, stats.replaced),
        (2, 2, 1),
        "{stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_naming_another_peers_agent_cannot_replace_it() {
    common::init_tracing();
    let spec = spec(2);
    let decode = worker("dc-claim", 0, 1, spec);
    let honest = worker("pf-honest", 0, 1, spec);
    fill(&honest, &spec);
    load_and_check(
        &decode,
        &honest,
        &spec,
        "pf-honest",
        "honest-1",
        [1, 2],
        pattern(0, 1, 0),
    )
    .await;

    // Another engine whose agent bears the honest one's name (its own metadata).
    let honest_agent = honest.agent().name().to_string();
    let claimant = worker_with("pf-claimant", 0, 1, spec, |config| {
        config.agent_name = Some(honest_agent.clone());
    });
    let from = remote(&claimant, "pf-claimant", "claim", vec![1], 1);
    decode.start_load("claim", &[0], &from).unwrap();
    let done = poll_until(&decode, Duration::from_secs(10), |f| !f.recving.is_empty()).await;
    assert_eq!(done.recving, ["claim"]);
    let failure = failure_of(&decode, "claim");
    assert!(
        failure.contains(&format!(
            "its handshake names agent {honest_agent:?}, loaded from other metadata for engine \"pf-honest\" rank 0"
        )),
        "{failure}"
    );
    decode.load_errors();

    // The honest peer's agent was left alone.
    let first = pattern(0, 3, 0);
    load_and_check(
        &decode,
        &honest,
        &spec,
        "pf-honest",
        "honest-2",
        [3, 4],
        first,
    )
    .await;
    let stats = decode.remote_stats();
    assert_eq!((stats.loaded, stats.replaced), (1, 0), "{stats:?}");
}
