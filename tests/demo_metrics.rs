//! The connector's `vllm:nixl_*` series through the demo's Prometheus endpoint, scraped over
//! HTTP on loopback: in this process around real loads (the series move: NIXL telemetry of
//! each READ, one descriptor count, handshake time, loads by outcome, failures by kind,
//! expired leases, late notifications, failed handshakes, evicted engines), and from the prefill and decode examples started
//! with `--metrics-addr`, each exporting only its own side's series (loads by outcome,
//! aborts, prefix hits, heartbeats sent and received, releases, gauges back at zero).

mod demo_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use demo_support::{Prefill, Proc};
use nixl::kv_config::KvTransferConfig;
use nixl_connector::{
    Capability, ConnectorMetadata, KvAttention, KvCacheSpec, KvConnectorWorker, KvLayout,
    RemoteBlocks, WorkerConfig,
};

/// `GET /metrics` on `addr`: the response's body (panics on anything but 200).
fn scrape(addr: SocketAddr) -> String {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .expect("read the scrape");
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

/// The value of the series line starting with `series{` that holds every `labels` pair.
fn value(body: &str, series: &str, labels: &[&str]) -> f64 {
    body.lines()
        .filter(|l| l.starts_with(&format!("{series}{{")))
        .find(|l| labels.iter().all(|label| l.contains(label)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {series} {labels:?} in:\n{body}"))
}

fn worker(engine: &str, spec: KvCacheSpec, lease_s: f64) -> KvConnectorWorker {
    let mut kv = KvTransferConfig {
        kv_buffer_device: "cpu".to_string(),
        ..Default::default()
    };
    kv.kv_connector_extra_config
        .insert("kv_lease_duration".into(), lease_s.into());
    // Remote engines idle for a second are evicted (at the next step past it).
    kv.kv_connector_extra_config
        .insert("engine_ttl".into(), 1.0.into());
    let mut config = WorkerConfig::new(engine, 0, 1, kv);
    config.platform = Arc::new(nixl::platform::BuiltinPlatform::CPU);
    let worker = KvConnectorWorker::new(config).expect("create worker");
    worker.register_host_kv_caches(spec).expect("register");
    worker
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connectors_series_move_in_a_scrape() {
    // Before any worker exists: workers take their handles from the installed recorder.
    let endpoint = nixl_rs::prometheus::serve("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let heads = KvAttention::Mha { total_kv_heads: 2 };
    let spec = KvCacheSpec::uniform(2, 8, 4, heads, KvLayout::Hnd, 4 * 2 * 8 * 2);
    let prefill = worker("pf-metrics", spec.clone(), 0.3);
    let decode = worker("dc-metrics", spec.clone(), 30.0);
    let dc = r#"engine="dc-metrics""#;
    let pf = r#"engine="pf-metrics""#;
    let before = scrape(endpoint);
    assert_eq!(
        value(&before, "vllm:nixl_xfer_time_seconds_count", &[dc]),
        0.0
    );
    assert_eq!(
        value(
            &before,
            "vllm:nixl_num_failed_transfers",
            &[dc, r#"kind="handshake""#]
        ),
        0.0
    );
    assert_eq!(value(&before, "vllm:nixl_num_kv_expired_reqs", &[pf]), 0.0);
    assert!(
        before.contains("# HELP vllm:nixl_xfer_time_seconds"),
        "{before}"
    );

    // Three good loads, one from a side channel nobody listens on; one request expires.
    let port = prefill.side_channel_addr().unwrap().port();
    let remote = |request: &str, blocks: Vec<usize>, port: u16| RemoteBlocks {
        engine_id: "pf-metrics".into(),
        host: "127.0.0.1".into(),
        port,
        block_ids: blocks,
        group_lens: Vec::new(),
        request_id: request.into(),
        tp_size: 1,
        pp_size: 1,
        dcp_size: 1,
        num_tokens: None,
        blocks_expiry_time: None,
        registration_generation: None,
        // Requests the prefill never holds: their (tagged) notifications come after expiry.
        capability: Some(Capability::random().unwrap()),
        lease_epoch: None,
        kept: false,
    };
    prefill.hold_for_decode("expires", Instant::now() + Duration::from_millis(300), None);
    for (i, blocks) in [vec![1, 2], vec![3], vec![4, 5, 6]].into_iter().enumerate() {
        let local: Vec<usize> = (0..blocks.len()).collect();
        decode
            .start_load(
                &format!("d{i}"),
                &local,
                &remote(&format!("p{i}"), blocks, port),
            )
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = closed.local_addr().unwrap().port();
    drop(closed);
    let mut gone = remote("p9", vec![7], dead);
    gone.engine_id = "pf-gone".into();
    decode.start_load("d9", &[7], &gone).unwrap();
    let start = Instant::now();
    let mut ended = 0;
    let mut expired = false;
    let mut metrics = Vec::new();
    while (ended < 4 || !expired) && start.elapsed() < Duration::from_secs(10) {
        ended += decode.finished().recving.len();
        metrics.extend(decode.metrics());
        expired |= !prefill.finished().sending.is_empty();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!((ended, expired), (4, true));
    // The three good loads notify p0..p2, which the prefill never held: late once stale
    // (a lease after they arrived).
    let start = Instant::now();
    while prefill.notification_stats().late_notifications < 3
        && start.elapsed() < Duration::from_secs(10)
    {
        prefill.finished();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let after = scrape(endpoint);
    assert_eq!(
        value(&after, "vllm:nixl_xfer_time_seconds_count", &[dc]),
        3.0
    );
    assert_eq!(
        value(&after, "vllm:nixl_post_time_seconds_count", &[dc]),
        3.0
    );
    // NIXL counts descriptors after joining those contiguous on both sides: between one
    // per layer and load (6) and one per block and layer (12). The loads' own metrics
    // report the same count.
    let descriptors = value(&after, "vllm:nixl_num_descriptors_sum", &[dc]);
    assert!((6.0..=12.0).contains(&descriptors), "{descriptors}");
    let loaded: Vec<_> = metrics.iter().filter(|m| m.failure.is_none()).collect();
    assert_eq!(loaded.len(), 3);
    let counted: usize = loaded.iter().map(|m| m.descriptors).sum();
    assert_eq!(counted as f64, descriptors);
    for (outcome, count) in [("loaded", 3.0), ("failed", 1.0), ("aborted", 0.0)] {
        let label = format!(r#"outcome="{outcome}""#);
        assert_eq!(value(&after, "vllm:nixl_num_loads", &[dc, &label]), count);
    }
    assert_eq!(value(&after, "vllm:nixl_loads_in_flight", &[dc]), 0.0);
    assert_eq!(
        value(
            &after,
            "vllm:nixl_num_released_reqs",
            &[pf, r#"by="lease""#]
        ),
        1.0
    );
    assert_eq!(value(&after, "vllm:nixl_requests_held", &[pf]), 0.0);
    let bytes = (6 * spec.num_regions() * spec.block_len(0)) as f64;
    assert_eq!(
        value(&after, "vllm:nixl_bytes_transferred_sum", &[dc]),
        bytes
    );
    assert_eq!(
        value(&after, "vllm:nixl_handshake_time_seconds_count", &[dc]),
        1.0
    );
    assert_eq!(
        value(
            &after,
            "vllm:nixl_num_failed_transfers",
            &[dc, r#"kind="handshake""#]
        ),
        1.0
    );
    assert_eq!(
        value(
            &after,
            "vllm:nixl_num_failed_transfers",
            &[dc, r#"kind="transfer""#]
        ),
        0.0
    );
    assert_eq!(value(&after, "vllm:nixl_num_kv_expired_reqs", &[pf]), 1.0);
    assert_eq!(
        value(&after, "vllm:nixl_num_notifications_after_expiry", &[pf]),
        3.0
    );
    // The load from the closed port failed its handshake, counted once as a handshake.
    assert_eq!(
        value(&after, "vllm:nixl_num_handshake_failures", &[dc]),
        1.0
    );
    assert_eq!(value(&after, "vllm:nixl_num_evicted_engines", &[dc]), 0.0);
    // Idle past the engine TTL, the prefill is evicted at the next step.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    decode.start_load_kv(&ConnectorMetadata::default());
    let evicted = value(&scrape(endpoint), "vllm:nixl_num_evicted_engines", &[dc]);
    assert!(evicted >= 1.0, "{evicted}");
    assert_eq!(decode.remote_stats().evicted as f64, evicted);
    // vLLM's buckets: the bytes histogram starts at 2 KiB.
    assert!(
        after.contains(
            r#"vllm:nixl_bytes_transferred_bucket{engine="dc-metrics",rank="0",le="2048"}"#
        ),
        "{after}"
    );
}

/// The endpoint a demo process printed (`...: Prometheus metrics on http://ADDR/metrics`).
fn endpoint_of(proc: &Proc) -> SocketAddr {
    let line = proc.expect_line("the metrics address", |l| {
        l.contains("Prometheus metrics on http://")
    });
    line.split("http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
}

/// Runs decode against `prefill` with its own endpoint and `extra` flags; scrapes it after
/// the run, while it lingers, and returns the scrape once decode exited successfully.
fn decode_scrape(prefill: SocketAddr, extra: &[&str]) -> String {
    let mut args = vec!["--metrics-addr", "127.0.0.1:0", "--metrics-linger-s", "30"];
    args.extend(extra);
    let mut decode = demo_support::decode(prefill, &args);
    let endpoint = endpoint_of(&decode);
    decode.expect_line("the end of its run", |l| {
        l.contains("run ended; serving metrics")
    });
    let body = scrape(endpoint);
    decode.kill();
    assert!(
        decode.output().contains("every byte verified"),
        "{}",
        decode.output()
    );
    body
}

/// Series only a prefill exports, and series only a decode exports.
const PREFILL_ONLY: [&str; 5] = [
    "vllm:nixl_requests_held{",
    "vllm:nixl_num_released_reqs{",
    "vllm:nixl_num_heartbeats{",
    "vllm:nixl_num_heartbeats_refused{",
    "vllm:nixl_num_notifications_after_expiry{",
];
const DECODE_ONLY: [&str; 8] = [
    "vllm:nixl_xfer_time_seconds",
    "vllm:nixl_num_descriptors",
    "vllm:nixl_num_failed_transfers{",
    "vllm:nixl_loads_in_flight{",
    "vllm:nixl_num_loads{",
    "vllm:nixl_handshakes_pending{",
    "vllm:nixl_num_heartbeats_sent{",
    "vllm:nixl_num_aborted_reqs{",
];

#[test]
fn prefill_and_decode_examples_each_serve_their_own_series() {
    let mut prefill = Prefill::start(&["--metrics-addr", "127.0.0.1:0"]);
    let endpoint = endpoint_of(&prefill.proc);
    let before = scrape(endpoint);
    assert_eq!(value(&before, "vllm:nixl_num_heartbeats", &[]), 0.0);
    assert_eq!(value(&before, "vllm:nixl_num_kv_expired_reqs", &[]), 0.0);
    assert_eq!(value(&before, "vllm:nixl_requests_held", &[]), 0.0);

    // 16 requests of 2 blocks, every 4th aborted (2 before their load, 2 during it); a
    // decode heartbeats prefill in its first step with requests waiting.
    let decode = decode_scrape(
        prefill.addr,
        &[
            "--requests",
            "16",
            "--blocks-per-request",
            "2",
            "--abort-every",
            "4",
        ],
    );
    let loads = |outcome: &str| {
        value(
            &decode,
            "vllm:nixl_num_loads",
            &[&format!(r#"outcome="{outcome}""#)],
        )
    };
    assert_eq!(value(&decode, "vllm:nixl_num_aborted_reqs", &[]), 4.0);
    assert_eq!(loads("failed"), 0.0);
    assert_eq!(loads("loaded") + loads("aborted"), 14.0, "{decode}");
    assert_eq!(
        value(&decode, "vllm:nixl_xfer_time_seconds_count", &[]),
        14.0
    );
    assert_eq!(value(&decode, "vllm:nixl_loads_in_flight", &[]), 0.0);
    assert_eq!(value(&decode, "vllm:nixl_handshakes_pending", &[]), 0.0);
    assert_eq!(value(&decode, "vllm:nixl_leaked_requests", &[]), 0.0);
    assert!(value(&decode, "vllm:nixl_num_heartbeats_sent", &[]) >= 1.0);
    for series in PREFILL_ONLY {
        assert!(
            !decode.contains(series),
            "a decode exports {series}:\n{decode}"
        );
    }

    // Every block of the 4 requests is in decode's prefix cache: nothing is read.
    let hits = decode_scrape(
        prefill.addr,
        &[
            "--requests",
            "4",
            "--blocks-per-request",
            "2",
            "--prefix-hit-blocks",
            "2",
        ],
    );
    assert_eq!(value(&hits, "vllm:nixl_num_prefix_hits", &[]), 4.0);
    assert_eq!(
        value(&hits, "vllm:nixl_num_loads", &[r#"outcome="loaded""#]),
        0.0
    );

    let after = scrape(endpoint);
    assert_eq!(
        value(
            &after,
            "vllm:nixl_num_released_reqs",
            &[r#"by="notification""#]
        ),
        20.0
    );
    assert_eq!(
        value(&after, "vllm:nixl_num_released_reqs", &[r#"by="lease""#]),
        0.0
    );
    assert_eq!(value(&after, "vllm:nixl_requests_held", &[]), 0.0);
    assert_eq!(value(&after, "vllm:nixl_leaked_requests", &[]), 0.0);
    assert!(
        value(&after, "vllm:nixl_num_heartbeats", &[]) >= 1.0,
        "{after}"
    );
    for series in DECODE_ONLY {
        assert!(
            !after.contains(series),
            "a prefill exports {series}:\n{after}"
        );
    }
    // Anything but GET /metrics is turned away.
    let mut stream = TcpStream::connect(endpoint).unwrap();
    stream.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 404"), "{response}");
    prefill.proc.kill();
}
