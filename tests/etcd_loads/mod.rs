//! What the tests of the connector's etcd mode share: writing a key of a real etcd, and a
//! load of a prefill's blocks that waits out the backoff after failed handshakes, so that
//! each load reaches etcd. A test binary using it also includes the connector's test
//! helpers as `connector` and `demo_support`.

use std::time::{Duration, Instant};

use base64::prelude::{Engine, BASE64_STANDARD};
use nixl_connector::KvConnectorWorker;

use crate::connector::{loads, spec};
use crate::demo_support::Etcd;

/// Writes `value` under `key` in `etcd`.
pub fn put(etcd: &Etcd, key: &str, value: &[u8]) {
    let body = format!(
        r#"{{"key":"{}","value":"{}"}}"#,
        BASE64_STANDARD.encode(key),
        BASE64_STANDARD.encode(value)
    );
    etcd.request("/v3/kv/put", &body);
}

/// Loads blocks 1 and 2 of `prefill` into the decode's 4 and 5: every byte checked, or why
/// it failed. An engine whose handshakes failed twice in a row is backed off from for a
/// second, doubling (as vLLM's worker does): this waits that out, up to 30 s.
pub async fn load(
    decode: &KvConnectorWorker,
    prefill: &KvConnectorWorker,
    request: &str,
) -> Result<(), String> {
    let engine = prefill.handshake().unwrap().engine_id;
    let blocks: (&[usize], &[usize]) = (&[4, 5], &[1, 2]);
    let give_up = Instant::now() + Duration::from_secs(30);
    loop {
        let result = loads::load(decode, prefill, &spec(2), &engine, request, blocks).await;
        match result {
            Err(reason) if reason.contains("not tried for another") && Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            result => return result,
        }
    }
}
