//! A prefill counts a finish notification only from an agent that a handshake with it named
//! as a reader, and only with that reader's TP (native protocol), over real NIXL/UCX: a
//! third agent that has the prefill's metadata, and the real reader claiming a count beyond
//! its TP, both leave the request held; each refusal is counted; the reader's own
//! notification then frees it.

mod common;

use std::time::{Duration, Instant};

use common::{fill, handshake, spec, wait_for, worker, worker_with, WAIT};
use nixl::Agent;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_reader_with_its_tp_frees_a_held_request() {
    common::init_tracing();
    let spec = spec(2);
    let prefill = worker_with("pf-readers", 0, 1, &spec, |_| {});
    fill(&prefill, &spec);
    let decode = worker("dc-readers", 0, 1, &spec);
    handshake(
        &decode,
        "pf-readers",
        prefill.side_channel_addr().unwrap().port(),
    )
    .await;
    prefill.hold_for_decode(
        "req",
        Instant::now() + Duration::from_secs(60),
        Some(&common::capability()),
    );
    let to = prefill.agent().name().to_string();

    // A third agent with the prefill's metadata (from wherever), never a reader.
    let third = Agent::new("third-agent-of-pf-readers").unwrap();
    third.create_backend("UCX").unwrap();
    let metadata = prefill.handshake().unwrap().agent_metadata;
    third.load_remote_metadata(&metadata).unwrap();
    let third_name = "third-agent-of-pf-readers";
    // Even with the request's capability, it is not a reader.
    let message = common::finish_message(third_name, "req", 1);
    third.send_notification(&to, &message).unwrap();
    // The reader, with counts beyond its TP (1): a huge one that does not parse, and the
    // largest that does.
    let name = decode.agent().name().to_string();
    let send = |count: usize| {
        let message = common::finish_message(&name, "req", count);
        decode.agent().send_notification(&to, &message).unwrap()
    };
    send(4294967295);
    send(4096);
    wait_for("the refused notifications", WAIT, || {
        let notes = prefill.notification_stats();
        notes.refused >= 2 && notes.malformed >= 1
    })
    .await;
    let notes = prefill.notification_stats();
    assert_eq!((notes.refused, notes.malformed), (2, 1), "{notes:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(prefill.finished().sending.is_empty(), "the request is held");
    assert_eq!(prefill.send_stats().freed_on_notification, 0);

    send(1);
    let freed = common::poll_until(&prefill, WAIT, |f| !f.sending.is_empty()).await;
    assert_eq!(
        freed.sending,
        ["req"],
        "the reader's own notification frees it"
    );
    assert_eq!(prefill.notification_stats().refused, 2);
}
