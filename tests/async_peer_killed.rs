//! A peer process killed mid-transfer: every pending future resolves to an error within
//! 5 s, and the memory of the failed requests stays allocated (leaked, counted).

mod common;

use std::future::IntoFuture;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{after_tag, hex, role_process, stdout_lines, unhex, unique_name};
use nixl::{
    Agent, Error, LocalDescList, MemType, RemoteDescList, Status, XferDesc, XferOp, XferOptions,
};

const PEER_ENV: &str = "NIXL_RS_TEST_PEER";
const LEN: usize = 4 << 20;
const REQUESTS: usize = 16;

/// The peer's side, run in a child process: registers a buffer, prints its metadata and
/// address, then waits to be killed.
#[test]
#[ignore = "the peer process of a_killed_peer_fails_every_pending_future_within_five_seconds, which starts it"]
fn peer_role() {
    assert!(
        std::env::var_os(PEER_ENV).is_some(),
        "run only as the child of the killed-peer test"
    );
    // No progress thread, and it never polls: the reader's transfers cannot complete the
    // wire-up, so they are all in flight when the peer dies.
    let agent = Agent::builder(&unique_name("killed-peer"))
        .progress_thread(false)
        .build()
        .unwrap();
    agent.create_backend("UCX").unwrap();
    let reg = agent.register_memory(vec![7u8; LEN], &[]).unwrap();
    println!(
        "PEER {} {}",
        reg.regions()[0].addr,
        hex(&agent.local_metadata().unwrap())
    );
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn a_killed_peer_fails_every_pending_future_within_five_seconds() {
    let mut child = role_process("peer_role", &[(PEER_ENV, "1")], Stdio::null());
    // The pipe stays open until the peer is reaped.
    let mut lines = stdout_lines(&mut child);
    let line = after_tag(&mut lines, "PEER ").expect("the peer prints its metadata");
    let mut fields = line.split(' ');
    let addr: usize = fields.next().unwrap().parse().unwrap();
    let metadata = unhex(fields.next().unwrap());

    let agent = Agent::new(&unique_name("killed-reader")).unwrap();
    agent.create_backend("UCX").unwrap();
    let peer = agent.load_remote_metadata(&metadata).unwrap();
    let local = agent
        .register_memory(vec![0u8; REQUESTS * LEN / 4], &[])
        .unwrap();
    let rt = common::runtime();
    // READs of the peer buffer in quarters, all in flight.
    let mut requests = Vec::new();
    for r in 0..REQUESTS {
        let mut list = LocalDescList::new(MemType::Dram).unwrap();
        list.push(&local, 0, r * LEN / 4, LEN / 4).unwrap();
        let remote = RemoteDescList::from_descs(
            MemType::Dram,
            &[XferDesc::new(addr + (r % 4) * LEN / 4, LEN / 4, 0)],
        )
        .unwrap();
        let mut req = agent
            .create_xfer_req(XferOp::Read, &list, &remote, &peer, &XferOptions::new())
            .unwrap();
        req.post().unwrap();
        requests.push(req);
    }
    let outcomes = rt.block_on(async {
        let pending: Vec<_> = requests
            .into_iter()
            .map(|r| tokio::spawn(r.into_future()))
            .collect();
        child.kill().expect("kill the peer");
        let killed = Instant::now();
        let mut outcomes = Vec::new();
        for task in pending {
            let left = Duration::from_secs(5).saturating_sub(killed.elapsed());
            let outcome = tokio::time::timeout(left, task)
                .await
                .expect("every pending future resolves within 5 s of the kill")
                .expect("task");
            outcomes.push(outcome.map(drop));
        }
        outcomes
    });
    child.wait().expect("reap the peer");
    drop(lines);
    // Every transfer was cut off, and NIXL said so: its status poll failed in the backend.
    for (r, outcome) in outcomes.iter().enumerate() {
        assert!(
            matches!(
                outcome,
                Err(Error::Nixl {
                    operation: "transfer",
                    status: Status::Backend,
                    ..
                })
            ),
            "request {r}: {outcome:?}"
        );
    }
    // Failed requests are never treated as done: they were leaked with their memory.
    assert_eq!(agent.leak_stats().requests, REQUESTS as u64);
}
