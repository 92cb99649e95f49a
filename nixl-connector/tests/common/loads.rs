//! Loads from a prefill worker whose bytes are checked, and loads made to fail.

use std::time::Duration;

use nixl_connector::{KvCacheSpec, KvConnectorWorker};

use super::{block, poll_until, remote};

/// Loads blocks `far` of `prefill` (engine `engine`) into the decode's `local`, cleared
/// first, and checks that every byte landed as prefill holds it; the load's failure if it
/// failed.
pub async fn load(
    decode: &KvConnectorWorker,
    prefill: &KvConnectorWorker,
    spec: &KvCacheSpec,
    engine: &str,
    request: &str,
    (local, far): (&[usize], &[usize]),
) -> Result<(), String> {
    let cache = decode.kv_caches().unwrap();
    for layer in 0..spec.num_regions() {
        let zeros = vec![0u8; spec.block_len(layer)];
        for &b in local {
            cache.write(layer, b * zeros.len(), &zeros).unwrap();
        }
    }
    let from = remote(prefill, engine, request, far.to_vec(), 1);
    decode.start_load(request, local, &from).unwrap();
    let done = poll_until(decode, Duration::from_secs(20), |f| !f.recving.is_empty()).await;
    let metrics = decode.metrics();
    assert_eq!(done.recving, [request], "{metrics:?}");
    let errors = decode.load_errors();
    if let Some(failure) = metrics.iter().find_map(|m| m.failure.clone()) {
        return Err(failure);
    }
    assert!(errors.is_empty(), "{request}: {errors:?} {metrics:?}");
    for layer in 0..spec.num_regions() {
        for (&l, &f) in local.iter().zip(far) {
            let want = block(prefill, spec, layer, f);
            assert_eq!(
                block(decode, spec, layer, l),
                want,
                "{request} layer {layer}"
            );
        }
    }
    Ok(())
}

/// A load that fails before its READ (a remote block out of range), after which the decode
/// forgets the remote rank and handshakes again at its next load; returns the failure.
pub async fn fail_a_load(
    decode: &KvConnectorWorker,
    prefill: &KvConnectorWorker,
    spec: &KvCacheSpec,
    engine: &str,
    request: &str,
) -> String {
    let out_of_range = [spec.num_blocks];
    let failure = load(
        decode,
        prefill,
        spec,
        engine,
        request,
        (&[0], &out_of_range),
    )
    .await
    .expect_err("a remote block out of range");
    let expected = format!("remote block {0} of {0} blocks", spec.num_blocks);
    assert!(failure.contains(&expected), "{failure}");
    failure
}
