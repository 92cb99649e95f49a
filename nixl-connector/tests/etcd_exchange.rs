//! Metadata through etcd: without endpoints the worker is refused before its agent exists,
//! and with an etcd that does not answer the registration fails at once, naming it. (The
//! whole path against a real etcd runs in the demo's tests, `tests/demo_etcd.rs`.) Alone in
//! its binary: it sets `NIXL_ETCD_ENDPOINTS`, which NIXL reads when any agent is created.

mod common;

use nixl_connector::{Error, KvConnectorWorker, MetadataExchange, WorkerConfig};

#[tokio::test]
async fn etcd_metadata_needs_endpoints_and_an_etcd_that_answers() {
    let config = || {
        let mut config = WorkerConfig::new("etcd-less", 0, 1, common::cpu_config());
        config.platform = std::sync::Arc::new(nixl::platform::BuiltinPlatform::CPU);
        config.metadata_exchange = MetadataExchange::Etcd;
        config
    };
    std::env::remove_var(nixl_connector::etcd::ETCD_ENDPOINTS_ENV);
    let err = KvConnectorWorker::new(config()).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("etcd metadata mode needs NIXL_ETCD_ENDPOINTS"),
        "{err}"
    );

    // A port nothing listens on: the registration fails at once, naming it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    std::env::set_var(nixl_connector::etcd::ETCD_ENDPOINTS_ENV, &url);
    let worker = KvConnectorWorker::new(config()).unwrap();
    let spec = common::spec(2);
    let err = worker.register_host_kv_caches(spec).unwrap_err();
    assert!(matches!(err, Error::EtcdUnreachable { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("etcd does not answer"), "{text}");
    assert!(text.contains(&format!("{url}: ")), "{text}");
}
