//! Failed loads: exactly their local blocks appear in `load_errors`, the other loads' do
//! not, and a mismatched peer is refused with a message naming what differs.

mod common;

use std::time::Duration;

use common::{fill, poll_until, remote, spec, worker};
use nixl_connector::side_channel::fetch_handshake;
use nixl_connector::{ChannelLimits, Error, KvLayout};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_load_reports_exactly_its_blocks() {
    common::init_tracing();
    let spec = spec(2);
    let prefill = worker("pf-err", 0, 1, &spec);
    fill(&prefill, &spec);
    let decode = worker("dc-err", 0, 1, &spec);

    // A side channel nobody listens on any more.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut gone = remote(&prefill, "pf-gone", "req-gone", vec![0, 1], 1);
    gone.port = closed.local_addr().unwrap().port();
    drop(closed);

    decode
        .start_load(
            "good",
            &[0, 1],
            &remote(&prefill, "pf-err", "req-good", vec![3, 4], 1),
        )
        .unwrap();
    decode.start_load("unreachable", &[5, 6], &gone).unwrap();
    decode
        .start_load(
            "out-of-range",
            &[9],
            &remote(&prefill, "pf-err", "req-oor", vec![spec.num_blocks], 1),
        )
        .unwrap();

    let done = poll_until(&decode, Duration::from_secs(10), |f| f.recving.len() == 3).await;
    let mut recving = done.recving;
    recving.sort();
    assert_eq!(recving, ["good", "out-of-range", "unreachable"]);
    assert_eq!(decode.load_errors(), [5, 6, 9]);
    assert!(decode.load_errors().is_empty(), "drained");

    let metrics = decode.metrics();
    let failure = |id: &str| {
        metrics
            .iter()
            .find(|m| m.request_id == id)
            .unwrap()
            .failure
            .clone()
    };
    assert_eq!(failure("good"), None);
    let unreachable = failure("unreachable").unwrap();
    assert!(
        unreachable.contains("connect to the side channel"),
        "{unreachable}"
    );
    let oor = failure("out-of-range").unwrap();
    assert!(
        oor.contains(&format!(
            "remote block {} of {} blocks",
            spec.num_blocks, spec.num_blocks
        )),
        "{oor}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mismatched_peer_is_refused_with_a_clear_message() {
    common::init_tracing();
    let prefill_spec = spec(2);
    let prefill = worker("pf-mismatch", 0, 1, &prefill_spec);
    let mut other = prefill_spec.clone();
    other.regions[1].block_len *= 2;
    let decode = worker("dc-mismatch", 0, 1, &other);

    // The prefill refuses it, and says why.
    let addr = prefill.side_channel_addr().unwrap();
    let err = fetch_handshake(addr, &decode.handshake().unwrap(), ChannelLimits::default())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Refused { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains(
            "region 1: block length 256 (reader, TP 1, 4 tokens) vs 128 (source, TP 1, 4 tokens)"
        ),
        "{text}"
    );

    // A load from it fails, with its blocks reported.
    decode
        .start_load(
            "r",
            &[1, 2],
            &remote(&prefill, "pf-mismatch", "r", vec![1, 2], 1),
        )
        .unwrap();
    poll_until(&decode, Duration::from_secs(10), |f| !f.recving.is_empty()).await;
    assert_eq!(decode.load_errors(), [1, 2]);
    let failure = decode.metrics()[0].failure.clone().unwrap();
    assert!(
        failure.contains("refused the handshake") && failure.contains("region 1: block length"),
        "{failure}"
    );

    // NHD cannot serve a larger TP: both sides say so.
    let mut nhd = prefill_spec;
    nhd.layout = KvLayout::Nhd;
    let nhd_prefill = worker("pf-nhd", 0, 1, &nhd);
    let mut half = common::spec_tp(2, 2);
    half.layout = KvLayout::Nhd;
    let nhd_decode = worker("dc-nhd", 1, 2, &half);
    let err = fetch_handshake(
        nhd_prefill.side_channel_addr().unwrap(),
        &nhd_decode.handshake().unwrap(),
        ChannelLimits::default(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("NHD blocks keep a head's tokens apart") && err.contains("use HND"),
        "{err}"
    );

    // Another engine than the params name is refused by the reader.
    decode
        .start_load(
            "w",
            &[3],
            &remote(&prefill, "not-that-engine", "w", vec![3], 1),
        )
        .unwrap();
    poll_until(&decode, Duration::from_secs(10), |f| !f.recving.is_empty()).await;
    assert_eq!(decode.load_errors(), [3]);
}
