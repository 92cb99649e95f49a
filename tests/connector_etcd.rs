//! The connector's etcd mode against a real etcd: a peer's metadata is fetched from NIXL's
//! key by the connector and loaded through the validated `load_remote_metadata`, so garbage,
//! an oversized value or a missing key in etcd end the load with a clear error, and the
//! peer's real metadata loads again afterwards. Alone in its binary: it sets
//! `NIXL_ETCD_ENDPOINTS` and `NIXL_ETCD_NAMESPACE`, which NIXL reads when an agent is created.
//!
//! Needs the `etcd` binary (Debian package etcd-server, installed by scripts/setup.sh);
//! without it the test fails under CI, and elsewhere is skipped and listed in the summary.

#[path = "../nixl-connector/tests/common/mod.rs"]
mod connector;
mod demo_support;
mod etcd_loads;

use std::time::Duration;

use base64::prelude::{Engine, BASE64_STANDARD};
use connector::{fill, spec, worker_with};
use demo_support::Etcd;
use etcd_loads::{load, put};
use nixl_connector::etcd::{fetch_metadata, metadata_key};
use nixl_connector::{KvConnectorWorker, MetadataExchange};

fn delete(etcd: &Etcd, key: &str) {
    let body = format!(r#"{{"key":"{}"}}"#, BASE64_STANDARD.encode(key));
    etcd.request("/v3/kv/deleterange", &body);
}

/// The decode's frame cap, which also caps the metadata it fetches from etcd.
const MAX_FRAME: usize = 64 << 10;

fn etcd_worker(engine: &str) -> KvConnectorWorker {
    worker_with(engine, 0, 1, &spec(2), |config| {
        config.metadata_exchange = MetadataExchange::Etcd;
        config.limits.max_frame = MAX_FRAME;
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_from_etcd_is_fetched_by_the_connector_and_validated() {
    let etcd = match Etcd::start() {
        Ok(etcd) => etcd,
        Err(reason) => {
            connector::skip(
                "metadata_from_etcd_is_fetched_by_the_connector_and_validated",
                &reason,
            );
            return;
        }
    };
    let namespace = format!("/nixl-rs-connector-{}", std::process::id());
    // Set before any agent exists; this process has no other test.
    std::env::set_var("NIXL_ETCD_ENDPOINTS", &etcd.endpoint);
    std::env::set_var("NIXL_ETCD_NAMESPACE", &namespace);
    connector::init_tracing();

    let prefill = etcd_worker("pf-etcd");
    fill(&prefill, &spec(2));
    let decode = etcd_worker("dc-etcd");
    load(&decode, &prefill, "real").await.unwrap();
    // NIXL stored the agent's metadata under the key the connector read.
    let key = metadata_key(&namespace, prefill.agent().name());
    let stored = fetch_metadata(&etcd.endpoint, &key, 1 << 20, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(stored, prefill.agent().local_metadata().unwrap());

    // A second prefill, whose entry in etcd is then tampered with.
    let victim = etcd_worker("pf-etcd-tampered");
    fill(&victim, &spec(2));
    let key = metadata_key(&namespace, victim.agent().name());
    let real = fetch_metadata(&etcd.endpoint, &key, 1 << 20, Duration::from_secs(10))
        .await
        .unwrap();

    put(&etcd, &key, b"nixlSerDes|garbage that is not metadata");
    let failure = load(&decode, &victim, "garbage").await.unwrap_err();
    assert!(failure.contains("invalid metadata at byte"), "{failure}");

    put(&etcd, &key, &vec![7u8; 4 * MAX_FRAME]);
    let failure = load(&decode, &victim, "oversized").await.unwrap_err();
    assert!(
        failure.contains(&format!("{MAX_FRAME}-byte cap")),
        "{failure}"
    );
    assert!(failure.contains(&key), "{failure}");

    delete(&etcd, &key);
    let failure = load(&decode, &victim, "absent").await.unwrap_err();
    assert!(failure.contains("no metadata under it after"), "{failure}");
    assert!(failure.contains(&format!("key {key:?}")), "{failure}");

    // The real metadata back: it loads, and nothing of the refused bytes stuck.
    put(&etcd, &key, &real);
    load(&decode, &victim, "restored").await.unwrap();
    let stats = decode.remote_stats();
    assert_eq!((stats.loaded, stats.replaced), (2, 0), "{stats:?}");
}
