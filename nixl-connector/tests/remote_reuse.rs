//! A live peer handshaken with again (after a failed load) is not loaded into NIXL again
//! when its metadata is unchanged, so the process's file descriptors stay flat (NIXL 1.5.1
//! keeps two per load and invalidation of a live peer); changed metadata replaces the loaded
//! agent, and only the peer that loaded an agent may replace it.

mod common;

use common::loads::{fail_a_load, load};
use common::{fill, spec, worker, worker_with};
use nixl_connector::KvConnectorWorker;

/// Loads blocks `far` of `prefill` into the decode's 4 and 5; every byte checked.
async fn load_and_check(
    decode: &KvConnectorWorker,
    prefill: &KvConnectorWorker,
    engine: &str,
    request: &str,
    far: [usize; 2],
) {
    let spec = spec(2);
    load(decode, prefill, &spec, engine, request, (&[4, 5], &far))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_failed_then_retried_loads_keep_the_fds_flat() {
    common::init_tracing();
    let spec = spec(2);
    let prefill = worker("pf-reuse", 0, 1, &spec);
    fill(&prefill, &spec);
    let decode = worker("dc-reuse", 0, 1, &spec);
    load_and_check(&decode, &prefill, "pf-reuse", "first", [1, 2]).await;
    let before = decode.remote_stats();
    let fds_before = before.open_fds.expect("/proc/self/fd");

    for i in 0..200 {
        fail_a_load(&decode, &prefill, &spec, "pf-reuse", &format!("bad-{i}")).await;
        let far = [i % spec.num_blocks, (i + 5) % spec.num_blocks];
        load_and_check(&decode, &prefill, "pf-reuse", &format!("req-{i}"), far).await;
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
    let decode = worker("dc-restart", 0, 1, &spec);
    let old = worker_with("pf-restart", 0, 1, &spec, named);
    fill(&old, &spec);
    load_and_check(&decode, &old, "pf-restart", "old", [1, 2]).await;
    drop(old);

    // The same engine and agent name, new memory, a new port, one changed byte.
    let new = worker_with("pf-restart", 0, 1, &spec, named);
    fill(&new, &spec);
    new.kv_caches()
        .unwrap()
        .write(0, spec.block_len(0), &[0xAB])
        .unwrap();
    // After a failed load the decode handshakes again, with the new prefill, whose metadata
    // replaces the old one's.
    fail_a_load(&decode, &new, &spec, "pf-restart", "failed").await;
    // Checked against the new prefill, whose block 1 differs from the old one's.
    load_and_check(&decode, &new, "pf-restart", "new", [1, 2]).await;
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
    let decode = worker("dc-claim", 0, 1, &spec);
    let honest = worker("pf-honest", 0, 1, &spec);
    fill(&honest, &spec);
    load_and_check(&decode, &honest, "pf-honest", "honest-1", [1, 2]).await;

    // Another engine whose agent bears the honest one's name (its own metadata).
    let honest_agent = honest.agent().name().to_string();
    let claimant = worker_with("pf-claimant", 0, 1, &spec, |config| {
        config.agent_name = Some(honest_agent.clone());
    });
    let failure = load(
        &decode,
        &claimant,
        &spec,
        "pf-claimant",
        "claim",
        (&[0], &[1]),
    )
    .await
    .unwrap_err();
    assert!(
        failure.contains(&format!(
            "its handshake names agent {honest_agent:?}, loaded from other metadata for engine \"pf-honest\" rank 0"
        )),
        "{failure}"
    );

    // The honest peer's agent was left alone.
    load_and_check(&decode, &honest, "pf-honest", "honest-2", [3, 4]).await;
    let stats = decode.remote_stats();
    assert_eq!((stats.loaded, stats.replaced), (1, 0), "{stats:?}");
}
