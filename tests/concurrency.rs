//! Eight threads share one agent and run 500 transfers each on disjoint memory.

mod common;

use common::{contents, pattern, whole_xfer_req, Pair, WAIT};
use nixl::{Agent, XferOp, XferOptions};

const THREADS: usize = 8;
const TRANSFERS: usize = 500;
const LEN: usize = 512;

/// One thread's work on the shared agent `a`: half the threads make a fresh request per
/// transfer, the other half repost one request; odd threads READ, even threads WRITE.
fn worker(pair: &Pair, a: &Agent, thread: usize) {
    let ucx_a = &pair.ucx_a;
    // The initiator's buffer and the peer's buffer of this thread only.
    let mine = a.register_memory(vec![0u8; LEN], &[ucx_a]).unwrap();
    let theirs = pair
        .b
        .register_memory(vec![0u8; LEN], &[&pair.ucx_b])
        .unwrap();
    // `a` must see the new registration of `b`. Loading metadata is a control-path call
    // that runs alongside other threads' transfers.
    a.load_remote_metadata(&pair.b.local_metadata().unwrap())
        .unwrap();
    let op = if thread % 2 == 0 {
        XferOp::Write
    } else {
        XferOp::Read
    };
    let (src, dst) = match op {
        XferOp::Write => (&mine, &theirs),
        XferOp::Read => (&theirs, &mine),
    };
    let request =
        || whole_xfer_req(a, op, &mine, &theirs, pair.b.name(), &XferOptions::new()).unwrap();
    let reuse = thread % 4 < 2;
    let mut kept = reuse.then(request);
    for i in 0..TRANSFERS {
        let seed = (thread * 31 + i) as u8;
        let data = pattern(LEN, seed);
        src.write(0, 0, &data).unwrap();
        match kept.as_mut() {
            Some(req) => req.post_and_wait(WAIT).unwrap(),
            None => request().post_and_wait(WAIT).unwrap(),
        }
        assert!(
            contents(dst) == data,
            "thread {thread} transfer {i}: wrong bytes at the destination"
        );
    }
}

#[test]
fn eight_threads_share_one_agent() {
    let pair = Pair::new("conc");
    pair.exchange();
    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            let pair = &pair;
            if thread % 2 == 0 {
                // By reference.
                scope.spawn(move || worker(pair, &pair.a, thread));
            } else {
                // By clone, moved into the thread.
                let a = pair.a.clone();
                scope.spawn(move || worker(pair, &a, thread));
            }
        }
    });
}

#[test]
fn threads_send_notifications_concurrently() {
    let pair = Pair::new("concnotif");
    pair.exchange();
    const PER_THREAD: usize = 50;
    // All four threads start sending together, so their calls really overlap.
    let start = std::sync::Barrier::new(4);
    std::thread::scope(|scope| {
        for thread in 0..4u8 {
            let a = pair.a.clone();
            let b = pair.b.name().to_string();
            let start = &start;
            scope.spawn(move || {
                start.wait();
                for i in 0..PER_THREAD as u8 {
                    a.send_notification(&b, &[0xff, thread, i]).unwrap();
                }
            });
        }
    });
    let mut got = common::wait_notifications(&pair.b, pair.a.name(), 4 * PER_THREAD);
    // Each thread's messages keep their order; threads interleave.
    for thread in 0..4u8 {
        let seq: Vec<u8> = got
            .iter()
            .filter(|m| m[1] == thread)
            .map(|m| m[2])
            .collect();
        assert_eq!(
            seq,
            (0..PER_THREAD as u8).collect::<Vec<_>>(),
            "thread {thread}"
        );
    }
    got.sort();
    got.dedup();
    assert_eq!(got.len(), 4 * PER_THREAD);
}
