//! The public framed channel, as an engine's own control traffic uses it: messages round
//! trip, and a closed, cut-short or over-long stream is a typed error naming the peer.

use nixl_connector::{Channel, Error};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Ask {
    request: String,
    blocks: Vec<usize>,
}

#[tokio::test]
async fn messages_round_trip_and_a_closed_stream_is_closed() {
    let (a, b) = tokio::io::duplex(1 << 16);
    let mut left = Channel::new(a, "left".into(), 1024);
    let mut right = Channel::new(b, "right".into(), 1024);
    let ask = Ask {
        request: "r-1".into(),
        blocks: vec![3, 4, 5],
    };
    left.send(&ask).await.unwrap();
    assert_eq!(right.recv::<Ask>().await.unwrap(), ask);
    left.close().await.unwrap();
    let err = right.recv::<Ask>().await.unwrap_err();
    assert!(
        matches!(&err, Error::Closed { peer } if peer == "right"),
        "{err}"
    );
}

#[tokio::test]
async fn cut_short_over_long_and_undecodable_frames_are_refused() {
    // A frame cut short: the header says 100 bytes, 3 arrive, then the stream ends.
    let (mut raw, b) = tokio::io::duplex(1 << 16);
    let mut channel = Channel::new(b, "peer".into(), 1024);
    raw.write_all(&[0, 0, 0, 100, 1, 2, 3]).await.unwrap();
    drop(raw);
    let err = channel.recv::<Ask>().await.unwrap_err();
    assert!(matches!(err, Error::Truncated { .. }), "{err}");
    assert!(err.to_string().contains("inside a frame"), "{err}");

    // Over the cap: refused from the header alone.
    let (mut raw, b) = tokio::io::duplex(1 << 16);
    let mut channel = Channel::new(b, "peer".into(), 1024);
    raw.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
    let err = channel.recv::<Ask>().await.unwrap_err().to_string();
    assert!(
        err.contains("declared a frame longer than the 1024-byte cap"),
        "{err}"
    );

    // Well framed, not a message.
    let (mut raw, b) = tokio::io::duplex(1 << 16);
    let mut channel = Channel::new(b, "peer".into(), 1024);
    raw.write_all(&[0, 0, 0, 3, 99, 1, 2]).await.unwrap();
    let err = channel.recv::<Ask>().await.unwrap_err().to_string();
    assert!(err.contains("undecodable message of 3 bytes"), "{err}");

    // Our own message over the cap is refused before anything is sent.
    let (a, _b) = tokio::io::duplex(1 << 16);
    let mut channel = Channel::new(a, "peer".into(), 16);
    let big = Ask {
        request: "x".repeat(64),
        blocks: vec![],
    };
    let err = channel.send(&big).await.unwrap_err().to_string();
    assert!(err.contains("exceeds the 16-byte frame cap"), "{err}");
}
