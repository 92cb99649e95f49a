//! The connector's `vllm:nixl_*` series through the demo's Prometheus endpoint, scraped over
//! HTTP on loopback: in this process around real loads (the series move: NIXL telemetry of
//! each READ, handshake time, failures by kind, expired leases, late notifications), and
//! from the prefill example started with `--metrics-addr` (heartbeats move).

mod demo_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use demo_support::{run_decode, Prefill};
use nixl::kv_config::KvTransferConfig;
use nixl_connector::{
    KvAttention, KvCacheSpec, KvConnectorWorker, KvLayout, RemoteBlocks, WorkerConfig,
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
        request_id: request.into(),
        tp_size: 1,
        num_tokens: None,
        blocks_expiry_time: None,
        registration_generation: None,
    };
    prefill.hold_for_decode("expires", Instant::now() + Duration::from_millis(300));
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
    while (ended < 4 || !expired) && start.elapsed() < Duration::from_secs(10) {
        ended += decode.finished().recving.len();
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
    // per layer and load (6) and one per block and layer (12).
    let descriptors = value(&after, "vllm:nixl_num_descriptors_sum", &[dc]);
    assert!((6.0..=12.0).contains(&descriptors), "{descriptors}");
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
    // vLLM's buckets: the bytes histogram starts at 2 KiB.
    assert!(
        after.contains(
            r#"vllm:nixl_bytes_transferred_bucket{engine="dc-metrics",rank="0",le="2048"}"#
        ),
        "{after}"
    );
}

#[test]
fn the_prefill_example_serves_its_series_to_prometheus() {
    let mut prefill = Prefill::start(&["--metrics-addr", "127.0.0.1:0"]);
    let line = prefill.proc.expect_line("the metrics address", |l| {
        l.contains("Prometheus metrics on http://")
    });
    let endpoint: SocketAddr = line
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    let before = scrape(endpoint);
    assert_eq!(value(&before, "vllm:nixl_num_heartbeats", &[]), 0.0);
    assert_eq!(value(&before, "vllm:nixl_num_kv_expired_reqs", &[]), 0.0);
    // A decode heartbeats prefill in its first step with requests waiting.
    let (status, out) = run_decode(
        prefill.addr,
        &["--requests", "4", "--blocks-per-request", "2"],
    );
    assert!(status.success(), "{out}");
    let after = scrape(endpoint);
    assert!(
        value(&after, "vllm:nixl_num_heartbeats", &[]) >= 1.0,
        "{after}"
    );
    // Anything but GET /metrics is turned away.
    let mut stream = TcpStream::connect(endpoint).unwrap();
    stream.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 404"), "{response}");
    prefill.proc.kill();
}
