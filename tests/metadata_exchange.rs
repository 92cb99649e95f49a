//! Metadata exchange through NIXL's own socket listener (agents built with
//! `listener_thread(true)`), then transfers that use what was exchanged.

mod common;

use std::time::Duration;

use common::{contents, free_port, pattern, transfer, unique_name, wait_metadata, Pair};
use nixl::{Agent, MetadataPeer, XferOp};

/// An agent listening for metadata on a free port of 127.0.0.1.
fn listening(prefix: &str) -> (Agent, u16) {
    let port = free_port();
    let agent = Agent::builder(&unique_name(prefix))
        .listener_thread(true)
        .listen_port(port)
        .listener_delay(Duration::from_millis(10))
        .build()
        .unwrap();
    (agent, port)
}

fn local_peer(port: u16) -> MetadataPeer {
    MetadataPeer::Socket {
        ip: "127.0.0.1".into(),
        port,
    }
}

#[test]
fn send_local_metadata_to_a_listener() {
    let (b, port) = listening("sock-send-b");
    let pair = Pair::with(Agent::new(&unique_name("sock-send-a")).unwrap(), b);
    let (src, dst) = pair.source_and_destination(pattern(4096, 71));
    // a pushes its metadata to b's listener; b then READs from a.
    pair.a.send_local_metadata(&local_peer(port)).unwrap();
    wait_metadata(&pair.b, pair.a.name());
    transfer(&pair.b, XferOp::Read, &dst, &src, pair.a.name()).unwrap();
    assert_eq!(contents(&dst), pattern(4096, 71));
}

#[test]
fn fetch_remote_metadata_from_a_listener() {
    let (b, port) = listening("sock-fetch-b");
    let (a, _) = listening("sock-fetch-a");
    let pair = Pair::with(a, b);
    let (src, dst) = pair.source_and_destination(pattern(4096, 72));
    // Without a listener of its own, a would never receive the answer: refused up front.
    let deaf = Agent::new(&unique_name("sock-fetch-deaf")).unwrap();
    match deaf.fetch_remote_metadata(pair.b.name(), &local_peer(port)) {
        Err(nixl::Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("listener_thread(true)"), "{reason}")
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    // a asks b's listener for b's metadata, then WRITEs into b.
    pair.a
        .fetch_remote_metadata(pair.b.name(), &local_peer(port))
        .unwrap();
    wait_metadata(&pair.a, pair.b.name());
    transfer(&pair.a, XferOp::Write, &src, &dst, pair.b.name()).unwrap();
    assert_eq!(contents(&dst), pattern(4096, 72));
}

#[test]
fn both_listening_exchange_both_ways() {
    let (a, port_a) = listening("sock-both-a");
    let (b, port_b) = listening("sock-both-b");
    let pair = Pair::with(a, b);
    let (a_reg, b_reg) = pair.register(pattern(2048, 73), pattern(2048, 74));
    pair.a.send_local_metadata(&local_peer(port_b)).unwrap();
    pair.b.send_local_metadata(&local_peer(port_a)).unwrap();
    wait_metadata(&pair.a, pair.b.name());
    wait_metadata(&pair.b, pair.a.name());
    // Swap halves: a READs b's first half into its second half, b READs a's first half
    // into its second half.
    let mut a_local = nixl::LocalDescList::new(nixl::MemType::Dram).unwrap();
    a_local.push(&a_reg, 0, 1024, 1024).unwrap();
    let b_first = nixl::RemoteDescList::from_descs(
        nixl::MemType::Dram,
        &[nixl::XferDesc::new(b_reg.regions()[0].addr, 1024, 0)],
    )
    .unwrap();
    pair.request(XferOp::Read, &a_local, &b_first, &nixl::XferOptions::new())
        .unwrap()
        .post_and_wait(common::WAIT)
        .unwrap();
    let mut expected = pattern(2048, 73);
    expected[1024..].copy_from_slice(&pattern(2048, 74)[..1024]);
    assert_eq!(contents(&a_reg), expected);
    // And the other way: b READs a's first half into its own second half.
    let mut b_local = nixl::LocalDescList::new(nixl::MemType::Dram).unwrap();
    b_local.push(&b_reg, 0, 1024, 1024).unwrap();
    let a_first = nixl::RemoteDescList::from_descs(
        nixl::MemType::Dram,
        &[nixl::XferDesc::new(a_reg.regions()[0].addr, 1024, 0)],
    )
    .unwrap();
    pair.b
        .create_xfer_req(
            XferOp::Read,
            &b_local,
            &a_first,
            pair.a.name(),
            &nixl::XferOptions::new(),
        )
        .unwrap()
        .post_and_wait(common::WAIT)
        .unwrap();
    let mut expected = pattern(2048, 74);
    expected[1024..].copy_from_slice(&pattern(2048, 73)[..1024]);
    assert_eq!(contents(&b_reg), expected);

    // Partial metadata over the socket too: connection info only, then b's memory.
    pair.b
        .send_local_partial_metadata(&[&b_reg], &[&pair.ucx_b], &local_peer(port_a))
        .unwrap();
    // b may also withdraw its metadata from a; a then forgets b (eventually).
    pair.b
        .invalidate_local_metadata(&local_peer(port_a))
        .unwrap();
    common::wait_until("a to drop b's metadata", || {
        !pair.a.has_remote_metadata(pair.b.name()).unwrap()
    });
}
