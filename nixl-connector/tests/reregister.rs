//! Registering the KV caches again (vLLM's sleep mode) in the native protocol, over real
//! NIXL/UCX: a prefill registered again in new memory keeps its side channel, its
//! scheduler's params carry a newer registration generation, and a decode that knew the
//! old registration handshakes again and reads the new bytes; a rank with a READ in flight
//! (its own, or a decode's from it) refuses to register again, and the READ lands in the
//! memory it started with. (vLLM mode: tests/vllm_mode.rs.)

mod common;

use common::{
    block, fill, finish_for_decode, poll_until, progress_until, remote, spec, stalled_worker,
    worker, WAIT,
};
use nixl_connector::{
    Error, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker, RemoteBlocks, SchedulerConfig,
};

/// The byte at `offset` of block `block`, region `layer`, of the second registration: not
/// [`common::pattern`] anywhere.
fn second_pattern(layer: usize, block: usize, offset: usize) -> u8 {
    !common::pattern(layer, block, offset)
}

/// Fills every block of `worker` with [`second_pattern`].
fn fill_second(worker: &KvConnectorWorker, spec: &KvCacheSpec) {
    let cache = worker.kv_caches().unwrap();
    for layer in 0..spec.num_regions() {
        let len = spec.block_len(layer);
        for b in 0..spec.num_blocks {
            let data: Vec<u8> = (0..len).map(|o| second_pattern(layer, b, o)).collect();
            cache.write(layer, b * len, &data).unwrap();
        }
    }
}

/// The native scheduler of prefill engine `engine`, whose rank 0 is `worker`.
fn scheduler(engine: &str, worker: &KvConnectorWorker) -> KvConnectorScheduler {
    let port = worker.side_channel_addr().unwrap().port();
    let kv = common::cpu_config();
    KvConnectorScheduler::new(SchedulerConfig::new(engine, "127.0.0.1", port, 1, &kv).unwrap())
}

/// Loads `from` into the decode's `local` blocks and waits for its end; the load's
/// failure, if any.
async fn load(
    decode: &KvConnectorWorker,
    request: &str,
    local: &[usize],
    from: &RemoteBlocks,
) -> Option<String> {
    decode.start_load(request, local, from).unwrap();
    let done = poll_until(decode, WAIT, |f| f.recving.iter().any(|r| r == request)).await;
    assert!(done.recving.iter().any(|r| r == request), "{request} ended");
    let failure = decode.metrics().into_iter().find_map(|m| m.failure);
    let errors = decode.load_errors();
    assert_eq!(
        failure.is_some(),
        !errors.is_empty(),
        "{failure:?} {errors:?}"
    );
    failure
}

/// Whether the decode's `local` blocks hold `pattern` of the prefill's `far` blocks.
fn holds(
    decode: &KvConnectorWorker,
    spec: &KvCacheSpec,
    (local, far): (&[usize], &[usize]),
    pattern: fn(usize, usize, usize) -> u8,
) -> bool {
    (0..spec.num_regions()).all(|layer| {
        local.iter().zip(far).all(|(&l, &f)| {
            let want: Vec<u8> = (0..spec.block_len(layer))
                .map(|o| pattern(layer, f, o))
                .collect();
            block(decode, spec, layer, l) == want
        })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_that_knew_the_old_registration_handshakes_again_and_reads_the_new_bytes() {
    common::init_tracing();
    let spec = spec(2);
    let mut prefill = worker("rr-pf", 0, 1, &spec);
    fill(&prefill, &spec);
    let mut prefill_scheduler = scheduler("rr-pf", &prefill);
    let decode = worker("rr-dc", 0, 1, &spec);
    assert_eq!(prefill.registration_generation(), 1);

    // A load from the first registration: its params carry no generation yet.
    let params = finish_for_decode(&prefill, &mut prefill_scheduler, "p-1", &[4, 5]);
    assert_eq!(params.remote_registration_generation, None);
    let first = params.remote_blocks().unwrap();
    assert_eq!(load(&decode, "d-1", &[0, 1], &first).await, None);
    assert!(holds(&decode, &spec, (&[0, 1], &[4, 5]), common::pattern));
    progress_until(&prefill, "the prefill's release", || {
        prefill.finished().sending == ["p-1"]
    })
    .await;
    let old_addrs = prefill.handshake().unwrap().region_base_addrs;
    let side_channel = prefill.side_channel_addr().unwrap();

    // The engine sleeps and wakes: its cache is registered again, in new memory with new
    // bytes, at the same side channel; its scheduler is told.
    let again = prefill.register_host_kv_caches_again(spec.clone());
    again.unwrap();
    fill_second(&prefill, &spec);
    assert_eq!(prefill.registration_generation(), 2);
    assert_eq!(prefill.side_channel_addr().unwrap(), side_channel);
    assert_ne!(prefill.handshake().unwrap().region_base_addrs, old_addrs);
    prefill_scheduler.kv_caches_registered_again();

    let params = finish_for_decode(&prefill, &mut prefill_scheduler, "p-2", &[4, 5]);
    assert_eq!(params.remote_registration_generation, Some(1));
    let loaded_before = decode.remote_stats();
    assert_eq!(
        load(&decode, "d-2", &[2, 3], &params.remote_blocks().unwrap()).await,
        None
    );
    assert!(
        holds(&decode, &spec, (&[2, 3], &[4, 5]), second_pattern),
        "the decode read the new registration's bytes"
    );
    let loaded_after = decode.remote_stats();
    assert!(
        loaded_after.handshakes > loaded_before.handshakes && loaded_after.replaced > 0,
        "the decode handshook again and loaded the new metadata: {loaded_before:?} then {loaded_after:?}"
    );
    progress_until(&prefill, "the prefill's release", || {
        prefill.finished().sending == ["p-2"]
    })
    .await;

    // The same generation again: the decode keeps what it learned, and still reads right.
    let params = finish_for_decode(&prefill, &mut prefill_scheduler, "p-3", &[6]);
    assert_eq!(
        load(&decode, "d-3", &[7], &params.remote_blocks().unwrap()).await,
        None
    );
    assert!(holds(&decode, &spec, (&[7], &[6]), second_pattern));
    assert_eq!(decode.remote_stats().handshakes, loaded_after.handshakes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_registered_again_reads_into_its_new_memory() {
    common::init_tracing();
    let spec = spec(2);
    let prefill = worker("rr-pf-d", 0, 1, &spec);
    fill(&prefill, &spec);
    let mut decode = worker("rr-dc-d", 0, 1, &spec);
    let from = remote(&prefill, "rr-pf-d", "p-1", vec![3], 1);
    assert_eq!(load(&decode, "d-1", &[0], &from).await, None);

    // Its lists of the prefill were prepared over the old registration: it handshakes again.
    decode.register_host_kv_caches_again(spec.clone()).unwrap();
    assert!(block(&decode, &spec, 0, 1).iter().all(|&b| b == 0));
    let from = remote(&prefill, "rr-pf-d", "p-2", vec![9, 10], 1);
    assert_eq!(load(&decode, "d-2", &[1, 2], &from).await, None);
    assert!(holds(&decode, &spec, (&[1, 2], &[9, 10]), common::pattern));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_with_a_read_in_flight_refuses_to_register_again() {
    common::init_tracing();
    let spec = spec(2);
    // The prefill's agent makes no progress of its own: the decode's READ stays in flight.
    let mut prefill = stalled_worker("rr-pf-busy", 0, 1, &spec);
    fill(&prefill, &spec);
    let mut prefill_scheduler = scheduler("rr-pf-busy", &prefill);
    let mut decode = worker("rr-dc-busy", 0, 1, &spec);

    let params = finish_for_decode(&prefill, &mut prefill_scheduler, "p-busy", &[2, 3]);
    decode
        .start_load("d-busy", &[4, 5], &params.remote_blocks().unwrap())
        .unwrap();
    let refused = |result: Result<(), Error>, what: &str| match result {
        Err(Error::InvalidArgument { reason, .. }) => assert!(reason.contains(what), "{reason}"),
        other => panic!("registering again with a READ in flight: {other:?}"),
    };
    // The decode's READ may write its memory; the decode may read the prefill's.
    refused(
        decode.register_host_kv_caches_again(spec.clone()),
        "1 load(s) under way",
    );
    refused(
        prefill.register_host_kv_caches_again(spec.clone()),
        "1 request(s) held",
    );
    assert_eq!(decode.registration_generation(), 1);
    assert_eq!(prefill.registration_generation(), 1);

    // The READ ends in the memory it started with, every byte as the prefill holds it.
    progress_until(&prefill, "the READ's end", || {
        let done = decode.finished();
        assert!(done.recving.len() <= 1);
        !done.recving.is_empty()
    })
    .await;
    assert!(decode.load_errors().is_empty());
    assert!(holds(&decode, &spec, (&[4, 5], &[2, 3]), common::pattern));
    progress_until(&prefill, "the prefill's release", || {
        prefill.finished().sending == ["p-busy"]
    })
    .await;

    // Drained, both register again.
    decode.register_host_kv_caches_again(spec.clone()).unwrap();
    prefill.register_host_kv_caches_again(spec.clone()).unwrap();
    assert_eq!(decode.registration_generation(), 2);
    assert_eq!(prefill.registration_generation(), 2);
}
