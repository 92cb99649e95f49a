//! Many awaited READs at once against the same READs one after another, where a READ waits
//! on the network: each of N requests READs its own 16 KiB block of the target, and every
//! byte is checked. Concurrent: a tokio task per request posts it, awaits it and checks it,
//! on a multi-thread runtime of `--workers` threads. Sequential: one thread posts each
//! request, `wait`s for it and checks it. The two alternate `--reps` times, after one
//! untimed round of each; prints the medians and the median of the per-repetition ratios:
//!
//! ```text
//! tcp-probe sequential ms 412.0
//! tcp-probe concurrent ms 96.3
//! tcp-probe concurrent/sequential 0.234
//! ```

use std::sync::Arc;
use std::time::Instant;

use nixl::{
    Agent, LocalDescList, MemType, Registration, RemoteDescList, XferDesc, XferOp, XferOptions,
    XferRequest, XferStatus,
};

use super::{fill, Args, PASS_LIMIT};

/// Bytes each request reads.
const BLOCK: usize = 16 << 10;

/// Runs `reads` READs of the target's buffer at `addr` of agent `name` into `local` both
/// ways, alternating, and prints their times and ratio.
pub fn ratio(
    args: &Args,
    reads: usize,
    agent: &Agent,
    local: &Arc<Registration>,
    (name, addr): (&str, usize),
) {
    assert!(
        args.bytes >= reads * BLOCK,
        "--bytes must hold --concurrent-reads blocks of 16 KiB"
    );
    let mut requests: Vec<XferRequest> = (0..reads)
        .map(|i| {
            let mut mine = LocalDescList::new(MemType::Dram).expect("list");
            mine.push(local, 0, i * BLOCK, BLOCK).expect("local");
            let theirs = RemoteDescList::from_descs(
                MemType::Dram,
                &[XferDesc::new(addr + i * BLOCK, BLOCK, 0)],
            )
            .expect("remote");
            agent
                .create_xfer_req(XferOp::Read, &mine, &theirs, name, &XferOptions::new())
                .expect("request")
        })
        .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.workers)
        .build()
        .expect("tokio runtime");
    let (mut sequential, mut concurrent) = (Vec::new(), Vec::new());
    for rep in 0..=args.reps {
        // The order alternates, so that drift on a shared machine falls on both.
        for at_once in [rep % 2 == 0, rep % 2 != 0] {
            local
                .write(0, 0, &vec![0u8; reads * BLOCK])
                .expect("clear the blocks");
            let start = Instant::now();
            requests = if at_once {
                all_at_once(&runtime, requests, local)
            } else {
                one_after_another(requests, local)
            };
            let ms = start.elapsed().as_secs_f64() * 1e3;
            if rep > 0 {
                if at_once {
                    &mut concurrent
                } else {
                    &mut sequential
                }
                .push(ms);
            }
        }
    }
    let ratios: Vec<f64> = concurrent
        .iter()
        .zip(&sequential)
        .map(|(c, s)| c / s)
        .collect();
    println!("tcp-probe sequential ms {:.1}", median(&sequential));
    println!("tcp-probe concurrent ms {:.1}", median(&concurrent));
    println!("tcp-probe concurrent/sequential {:.3}", median(&ratios));
}

/// Posts each request, waits for it and checks its block; gives the requests back.
fn one_after_another(requests: Vec<XferRequest>, local: &Registration) -> Vec<XferRequest> {
    requests
        .into_iter()
        .enumerate()
        .map(|(i, mut request)| {
            if request.post().expect("post") == XferStatus::InProgress {
                request.wait(PASS_LIMIT).expect("READ");
            }
            check(local, i);
            request
        })
        .collect()
}

/// A task per request that posts it, awaits it and checks its block, spawned from a task
/// of `runtime` as a server's handlers would be; gives the requests back.
fn all_at_once(
    runtime: &tokio::runtime::Runtime,
    requests: Vec<XferRequest>,
    local: &Arc<Registration>,
) -> Vec<XferRequest> {
    let local = Arc::clone(local);
    let batch = runtime.spawn(async move {
        let tasks: Vec<_> = requests
            .into_iter()
            .enumerate()
            .map(|(i, mut request)| {
                let local = Arc::clone(&local);
                tokio::spawn(async move {
                    if request.post().expect("post") == XferStatus::InProgress {
                        request = request.await.expect("READ");
                    }
                    check(&local, i);
                    request
                })
            })
            .collect();
        let mut done = Vec::with_capacity(tasks.len());
        for task in tasks {
            done.push(task.await.expect("a READ's task"));
        }
        done
    });
    runtime.block_on(batch).expect("the batch's task")
}

/// Checks that block `i` of `local` holds the target's bytes.
fn check(local: &Registration, i: usize) {
    let mut got = vec![0u8; BLOCK];
    local.read(0, i * BLOCK, &mut got).expect("read back");
    let first_wrong = (0..BLOCK).find(|&o| got[o] != fill(i * BLOCK + o));
    assert_eq!(
        first_wrong, None,
        "block {i}: a byte differs from the target's"
    );
}

/// The median of `values`.
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}
