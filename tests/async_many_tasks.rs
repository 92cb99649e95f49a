//! 64 tasks x 200 awaited transfers on a 2-thread tokio runtime: every byte checked, no
//! thread per request (the process's thread count stays the same), and the completion
//! driver carried requests (each task's first is in flight until the driver holds them all).
//! Alone in its binary, so that no other test's threads change the count.

mod common;

use std::sync::Arc;

use common::{pattern, resume_b_when, stalled_pair, WAIT};
use nixl::{LocalDescList, MemType, RemoteDescList, XferDesc, XferOp, XferOptions};

const TASKS: usize = 64;
const ROUNDS: usize = 200;
const BLOCK: usize = 16 << 10;

/// Threads of this process, from /proc.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("read /proc/self/task")
        .count()
}

#[test]
fn sixty_four_tasks_times_two_hundred_requests() {
    // b progresses only from the moment the driver holds every task's first request.
    let pair = stalled_pair("many");
    let (src, dst) = pair.register(vec![0u8; TASKS * BLOCK], vec![0u8; TASKS * BLOCK]);
    pair.exchange();
    let rt = common::runtime();
    let shared = Arc::new((pair, src, dst));
    // Task t owns block t of both buffers; round r writes pattern (t, r) and checks it.
    let task = |t: usize, rounds: std::ops::Range<usize>| {
        let shared = shared.clone();
        async move {
            let (pair, src, dst) = (&shared.0, &shared.1, &shared.2);
            let mut local = LocalDescList::new(MemType::Dram).unwrap();
            local.push(src, 0, t * BLOCK, BLOCK).unwrap();
            let remote = RemoteDescList::from_descs(
                MemType::Dram,
                &[XferDesc::new(dst.regions()[0].addr + t * BLOCK, BLOCK, 0)],
            )
            .unwrap();
            let mut req = pair
                .request(XferOp::Write, &local, &remote, &XferOptions::new())
                .unwrap();
            let mut got = vec![0u8; BLOCK];
            for round in rounds {
                let data = pattern(BLOCK, (t * 7 + round) as u8);
                src.write(0, t * BLOCK, &data).unwrap();
                req.post().unwrap();
                req = tokio::time::timeout(WAIT, req).await.unwrap().unwrap();
                dst.read(0, t * BLOCK, &mut got).unwrap();
                assert_eq!(got, data, "task {t} round {round}");
            }
        }
    };
    let run = |rounds: std::ops::Range<usize>| {
        rt.block_on(async {
            let tasks: Vec<_> = (0..TASKS)
                .map(|t| tokio::spawn(task(t, rounds.clone())))
                .collect();
            for joined in futures::future::join_all(tasks).await {
                joined.expect("task panicked");
            }
        })
    };
    let a = &shared.0.a;
    resume_b_when(
        &shared.0,
        || a.driver_stats().held == TASKS as u64,
        || {
            // The first round starts the runtime's and the driver's threads.
            run(0..1);
            let before = threads();
            run(1..ROUNDS);
            assert_eq!(threads(), before, "no thread per request or per task");
        },
    );
    let stats = a.driver_stats();
    assert!(
        stats.awaited >= TASKS as u64,
        "every task's first request went through the driver: {stats:?}"
    );
}
