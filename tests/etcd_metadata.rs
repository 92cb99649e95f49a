//! Metadata exchange through etcd. Alone in its file (its own process) because NIXL reads
//! `NIXL_ETCD_ENDPOINTS` from the environment when an agent is created.
//!
//! Needs the `etcd` binary (Debian package etcd-server, installed by scripts/setup.sh);
//! without it the test fails under CI, and elsewhere is skipped and listed in the summary.

mod common;
mod demo_support;

use common::{contents, pattern, transfer, unique_name, wait_metadata, Pair};
use demo_support::Etcd;
use nixl::{Agent, MetadataPeer, XferOp};

#[test]
fn metadata_through_etcd() {
    let etcd = match Etcd::start() {
        Ok(etcd) => etcd,
        Err(reason) => {
            common::skip("metadata_through_etcd", &reason);
            return;
        }
    };
    // Set before any agent exists; this process has no other test that creates agents.
    std::env::set_var("NIXL_ETCD_ENDPOINTS", &etcd.endpoint);
    std::env::set_var(
        "NIXL_ETCD_NAMESPACE",
        format!("/nixl-rs-test-{}", std::process::id()),
    );

    let pair = Pair::with(
        Agent::new(&unique_name("etcd-a")).unwrap(),
        Agent::new(&unique_name("etcd-b")).unwrap(),
    );
    let (src, dst) = pair.source_and_destination(pattern(4096, 81));

    // b publishes; a fetches b's metadata and WRITEs into b.
    pair.b.send_local_metadata(&MetadataPeer::Etcd).unwrap();
    pair.a
        .fetch_remote_metadata(pair.b.name(), &MetadataPeer::Etcd)
        .unwrap();
    wait_metadata(&pair.a, pair.b.name());
    transfer(&pair.a, XferOp::Write, &src, &dst, pair.b.name()).unwrap();
    assert_eq!(contents(&dst), pattern(4096, 81));

    // The other way: a publishes, b fetches and READs from a.
    pair.a.send_local_metadata(&MetadataPeer::Etcd).unwrap();
    pair.b
        .fetch_remote_metadata(pair.a.name(), &MetadataPeer::Etcd)
        .unwrap();
    wait_metadata(&pair.b, pair.a.name());
    let back = pair
        .b
        .register_memory(vec![0u8; 4096], &[&pair.ucx_b])
        .unwrap();
    transfer(&pair.b, XferOp::Read, &back, &src, pair.a.name()).unwrap();
    assert_eq!(contents(&back), pattern(4096, 81));

    pair.a
        .invalidate_local_metadata(&MetadataPeer::Etcd)
        .unwrap();
    pair.b
        .invalidate_local_metadata(&MetadataPeer::Etcd)
        .unwrap();
}
