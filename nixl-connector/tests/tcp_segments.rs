//! Over TCP, an engine with the connector's UCX defaults and one that keeps UCX's own (as
//! a vLLM engine's NIXL does) READ from each other, either one the prefill, every byte
//! checked.
//!
//! UCX's TCP transport trusts its peer's messages to fit its receive segment: a prefill
//! whose send segment (256 KiB) exceeded the decode's receive segment (UCX's 64 KiB)
//! corrupted the decode's heap (`malloc(): corrupted top size`, or a segmentation fault).
//! The connector's send segment therefore stays at UCX's default receive segment; raised
//! past it, this test aborts.

mod common;

use std::time::{Duration, Instant};

use common::{block, capability, fill, pattern, poll_until, remote, worker_with};
use nixl_connector::{KvAttention, KvCacheSpec, KvConnectorWorker, KvLayout};

/// UCX over TCP on loopback only, every other setting the connector's default.
const CONNECTOR_DEFAULTS: &str = "TLS=tcp,NET_DEVICES=lo";
/// UCX over TCP on loopback with UCX's own segment sizes.
const UCX_DEFAULTS: &str = "TLS=tcp,NET_DEVICES=lo,TCP_TX_SEG_SIZE=8k,TCP_RX_SEG_SIZE=64k";

/// A worker of `engine` whose UCX backend has `engine_config`, its cache of `spec`.
fn tcp_worker(engine: &str, spec: &KvCacheSpec, engine_config: &str) -> KvConnectorWorker {
    worker_with(engine, 0, 1, spec, |config| {
        config.kv_transfer_config.kv_connector_extra_config.insert(
            "backend_params".into(),
            serde_json::json!({"UCX": {"engine_config": engine_config}}),
        );
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connector_defaults_and_ucx_defaults_read_from_each_other_over_tcp() {
    common::init_tracing();
    // Blocks of 256 KiB, read four at a time: runs of 1 MiB, many segments of either size.
    let spec = KvCacheSpec::uniform(
        2,
        8,
        4,
        KvAttention::Mha { total_kv_heads: 1 },
        KvLayout::Hnd,
        256 << 10,
    );
    let pairs = [
        ("defaults", CONNECTOR_DEFAULTS, "ucx-own", UCX_DEFAULTS),
        ("ucx-own", UCX_DEFAULTS, "defaults", CONNECTOR_DEFAULTS),
    ];
    for (prefill_name, prefill_config, decode_name, decode_config) in pairs {
        let prefill_engine = format!("tcp-seg-pf-{prefill_name}");
        let prefill = tcp_worker(&prefill_engine, &spec, prefill_config);
        fill(&prefill, &spec);
        let decode = tcp_worker(&format!("tcp-seg-dc-{decode_name}"), &spec, decode_config);
        prefill.hold_for_decode(
            "req",
            Instant::now() + Duration::from_secs(30),
            Some(&capability()),
        );
        let (far, near) = ([4, 5, 6, 7], [0, 1, 2, 3]);
        decode
            .start_load(
                "dec",
                &near,
                &remote(&prefill, &prefill_engine, "req", far.to_vec(), 1),
            )
            .unwrap();
        let done = poll_until(&decode, Duration::from_secs(20), |f| !f.recving.is_empty()).await;
        assert_eq!(
            done.recving,
            ["dec"],
            "prefill {prefill_name} -> decode {decode_name}: {:?}",
            decode.load_errors()
        );
        for layer in 0..spec.num_regions() {
            for (&local, &remote_block) in near.iter().zip(&far) {
                let want: Vec<u8> = (0..spec.block_len(layer))
                    .map(|o| pattern(layer, remote_block, o))
                    .collect();
                assert!(
                    block(&decode, &spec, layer, local) == want,
                    "prefill {prefill_name} -> decode {decode_name}: layer {layer} block {local}"
                );
            }
        }
    }
}
