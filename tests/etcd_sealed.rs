//! The connector's etcd mode with a shared secret, against a real etcd: the metadata each
//! engine publishes is sealed under a key derived from the secret, so whoever reads etcd
//! learns neither the agent's name nor its metadata and cannot load it into an agent of its
//! own; engines sharing the secret still load each other's; a value changed in etcd, moved
//! from another key, or put there in the clear is refused by name. Alone in its binary: it
//! sets `NIXL_ETCD_ENDPOINTS` and `NIXL_ETCD_NAMESPACE`, which NIXL reads when an agent is
//! created.
//!
//! Needs the `etcd` binary (Debian package etcd-server, installed by scripts/setup.sh);
//! without it the test fails under CI, and elsewhere is skipped and listed in the summary.

#[path = "../nixl-connector/tests/common/mod.rs"]
mod connector;
mod demo_support;
mod etcd_loads;

use std::time::Duration;

use connector::{fill, spec, worker_with};
use demo_support::Etcd;
use etcd_loads::{load, put};
use nixl::Agent;
use nixl_connector::etcd::{fetch_metadata, metadata_key};
use nixl_connector::{KvConnectorWorker, MetadataExchange, SharedSecret};

const SECRET: &str = "the etcd deployment's shared secret";

fn sealed_worker(engine: &str) -> KvConnectorWorker {
    worker_with(engine, 0, 1, &spec(2), |config| {
        config.metadata_exchange = MetadataExchange::Etcd;
        config.secret = Some(SharedSecret::new(SECRET.as_bytes()).unwrap());
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_in_etcd_is_sealed_under_the_shared_secret() {
    let etcd = match Etcd::start() {
        Ok(etcd) => etcd,
        Err(reason) => {
            connector::skip(
                "metadata_in_etcd_is_sealed_under_the_shared_secret",
                &reason,
            );
            return;
        }
    };
    let namespace = format!("/nixl-rs-sealed-{}", std::process::id());
    // Set before any agent exists; this process has no other test.
    std::env::set_var("NIXL_ETCD_ENDPOINTS", &etcd.endpoint);
    std::env::set_var("NIXL_ETCD_NAMESPACE", &namespace);
    connector::init_tracing();

    let prefill = sealed_worker("pf-sealed");
    fill(&prefill, &spec(2));
    let decode = sealed_worker("dc-sealed");
    load(&decode, &prefill, "real").await.unwrap();

    // What etcd holds: neither the metadata nor the agent's name, and no agent loads it.
    let key = metadata_key(&namespace, prefill.agent().name());
    let stored = fetch_metadata(&etcd.endpoint, &key, 1 << 20, Duration::from_secs(5))
        .await
        .unwrap();
    let metadata = prefill.agent().local_metadata().unwrap();
    assert_ne!(stored, metadata);
    let name = prefill.agent().name().as_bytes();
    assert!(
        !stored.windows(name.len()).any(|w| w == name),
        "the name in clear"
    );
    assert!(!stored
        .windows(16)
        .any(|w| metadata.windows(16).any(|m| m == w)));
    let thief = Agent::new("etcd-reader").unwrap();
    assert!(thief.load_remote_metadata(&stored).is_err());

    // A second prefill, never loaded yet, whose value is changed in etcd, replaced by
    // another engine's (moved from its key), or put there in the clear: refused by name.
    let victim = sealed_worker("pf-sealed-victim");
    fill(&victim, &spec(2));
    let key = metadata_key(&namespace, victim.agent().name());
    let sealed = fetch_metadata(&etcd.endpoint, &key, 1 << 20, Duration::from_secs(10))
        .await
        .unwrap();
    let mut changed = sealed.clone();
    *changed.last_mut().unwrap() ^= 1;
    let clear = victim.agent().local_metadata().unwrap();
    for (what, value, says) in [
        ("changed", changed, "does not open"),
        ("moved", stored, "does not open"),
        ("in the clear", clear, "not sealed"),
    ] {
        put(&etcd, &key, &value);
        let failure = load(&decode, &victim, what).await.unwrap_err();
        assert!(failure.contains(says), "{what}: {failure}");
        assert!(failure.contains(&key), "{what}: {failure}");
    }

    // The sealed value back: it loads.
    put(&etcd, &key, &sealed);
    load(&decode, &victim, "restored").await.unwrap();
}
