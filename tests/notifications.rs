//! Notifications between two agents: arbitrary (non-UTF-8) bytes, through a transfer's
//! options, a repost's message, and `send_notification`.

mod common;

use common::{contents, pattern, wait_notifications, Pair, WAIT};
use nixl::{XferOp, XferOptions};

/// Bytes that are not UTF-8, with NULs inside and at the end.
fn binary_message(tag: u8) -> Vec<u8> {
    vec![0xff, 0xfe, 0x00, tag, 0x80, 0xc0, 0xaf, 0x00]
}

#[test]
fn notification_with_a_transfer() {
    let pair = Pair::new("nx");
    let (src, dst) = pair.source_and_destination(pattern(4096, 31));
    pair.exchange();
    let message = binary_message(1);
    assert!(std::str::from_utf8(&message).is_err());
    let mut req = pair
        .whole_request(
            XferOp::Write,
            &src,
            &dst,
            &XferOptions::new().notification(message.clone()),
        )
        .unwrap();
    req.post_and_wait(WAIT).unwrap();
    assert_eq!(
        wait_notifications(&pair.b, pair.a.name(), 1),
        vec![message.clone()]
    );
    // The notification is sent after the data: the data is there when it arrives.
    assert_eq!(contents(&dst), pattern(4096, 31));

    // A repost carries the request's message again; post_with_notification replaces it.
    src.write(0, 0, &pattern(4096, 32)).unwrap();
    req.post_and_wait(WAIT).unwrap();
    assert_eq!(wait_notifications(&pair.b, pair.a.name(), 1), vec![message]);
    assert_eq!(contents(&dst), pattern(4096, 32));

    let replaced = binary_message(2);
    src.write(0, 0, &pattern(4096, 33)).unwrap();
    if req.post_with_notification(&replaced).unwrap() == nixl::XferStatus::InProgress {
        req.wait(WAIT).unwrap();
    }
    assert_eq!(
        wait_notifications(&pair.b, pair.a.name(), 1),
        vec![replaced]
    );
    assert_eq!(contents(&dst), pattern(4096, 33));
}

#[test]
fn notification_on_a_read_goes_to_the_remote_agent() {
    let pair = Pair::new("nr");
    let (dst, src) = pair.register(vec![0u8; 1024], pattern(1024, 34));
    pair.exchange();
    let message = binary_message(3);
    let mut req = pair
        .whole_request(
            XferOp::Read,
            &dst,
            &src,
            &XferOptions::new().notification(message.clone()),
        )
        .unwrap();
    req.post_and_wait(WAIT).unwrap();
    assert_eq!(contents(&dst), pattern(1024, 34));
    assert_eq!(wait_notifications(&pair.b, pair.a.name(), 1), vec![message]);
    assert!(pair.a.notifications().unwrap().is_empty());
}

#[test]
fn send_notification_both_ways_in_order() {
    let pair = Pair::new("ns");
    pair.exchange();
    let messages: Vec<Vec<u8>> = (0..20u8)
        .map(|i| {
            let mut m = binary_message(i);
            m.extend(std::iter::repeat(i).take(usize::from(i) * 7));
            m
        })
        .collect();
    for m in &messages {
        pair.a.send_notification(pair.b.name(), m).unwrap();
    }
    assert_eq!(wait_notifications(&pair.b, pair.a.name(), 20), messages);

    // The other way, and an empty message and a large one.
    let large: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
    pair.b.send_notification(pair.a.name(), &[]).unwrap();
    pair.b.send_notification(pair.a.name(), &large).unwrap();
    assert_eq!(
        wait_notifications(&pair.a, pair.b.name(), 2),
        vec![Vec::new(), large]
    );
    // Nothing left over.
    assert!(pair.a.notifications().unwrap().is_empty());
    assert!(pair.b.notifications().unwrap().is_empty());
}
