//! The connector's etcd mode against a real etcd with authentication enabled: with the etcd
//! user and password (`NIXL_CONNECTOR_ETCD_USER`, `NIXL_CONNECTOR_ETCD_PASSWORD`) the prefill
//! publishes its metadata and the decode fetches it, authenticated, and loads every byte;
//! without credentials, or with a wrong password, etcd answers nothing but the refusal; the
//! prefill's metadata is withdrawn when it is dropped. Alone in its binary: it sets the
//! environment NIXL and the connector read when a worker is created.
//!
//! Needs the `etcd` binary (Debian package etcd-server, installed by scripts/setup.sh);
//! without it the test fails under CI, and elsewhere is skipped and listed in the summary.

#[path = "../nixl-connector/tests/common/mod.rs"]
mod connector;
mod demo_support;

use std::time::Duration;

use connector::{fill, spec, worker_with};
use demo_support::Etcd;
use nixl_connector::etcd::{
    fetch_metadata, fetch_metadata_as, metadata_key, EtcdCredentials, ETCD_PASSWORD_ENV,
    ETCD_USER_ENV,
};
use nixl_connector::{KvConnectorWorker, MetadataExchange};

const PASSWORD: &str = "etcd password of the test";

fn etcd_worker(engine: &str) -> KvConnectorWorker {
    worker_with(engine, 0, 1, &spec(2), |config| {
        config.metadata_exchange = MetadataExchange::Etcd;
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_goes_through_an_etcd_with_authentication() {
    let etcd = match Etcd::start() {
        Ok(etcd) => etcd,
        Err(reason) => {
            connector::skip("metadata_goes_through_an_etcd_with_authentication", &reason);
            return;
        }
    };
    etcd.enable_auth(PASSWORD);
    let namespace = format!("/nixl-rs-etcd-auth-{}", std::process::id());
    // Set before any worker exists; this process has no other test.
    std::env::set_var("NIXL_ETCD_ENDPOINTS", &etcd.endpoint);
    std::env::set_var("NIXL_ETCD_NAMESPACE", &namespace);
    std::env::set_var(ETCD_USER_ENV, "root");
    std::env::set_var(ETCD_PASSWORD_ENV, PASSWORD);
    connector::init_tracing();

    let prefill = etcd_worker("pf-etcd-auth");
    fill(&prefill, &spec(2));
    let decode = etcd_worker("dc-etcd-auth");
    let engine = prefill.handshake().unwrap().engine_id;
    let blocks: (&[usize], &[usize]) = (&[4, 5], &[1, 2]);
    connector::loads::load(&decode, &prefill, &spec(2), &engine, "authed", blocks)
        .await
        .unwrap();

    let key = metadata_key(&namespace, prefill.agent().name());
    let root = EtcdCredentials::new("root", PASSWORD);
    let deadline = Duration::from_secs(5);
    let stored = fetch_metadata_as(&etcd.endpoint, &key, 1 << 20, deadline, Some(&root))
        .await
        .unwrap();
    assert_eq!(stored, prefill.agent().local_metadata().unwrap());

    // Without credentials, or with a wrong password: etcd's refusal, and no value.
    let err = fetch_metadata(&etcd.endpoint, &key, 1 << 20, deadline)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("/v3/kv/range answered"), "{err}");
    let wrong = EtcdCredentials::new("root", "not the password");
    let err = fetch_metadata_as(&etcd.endpoint, &key, 1 << 20, deadline, Some(&wrong))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("authenticate as etcd user \"root\""), "{err}");

    // Dropped, the prefill withdraws its metadata.
    drop(prefill);
    let err = fetch_metadata_as(
        &etcd.endpoint,
        &key,
        1 << 20,
        Duration::from_millis(500),
        Some(&root),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("no metadata under it"), "{err}");
}
