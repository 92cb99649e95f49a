//! The completion driver at capacity: it holds 4096 requests in flight, the futures past
//! them wait for room (each woken by its own waker when room is made), and every one
//! completes. Alone in its binary: thousands of requests in flight at once.

mod common;

use common::executor::Executor;
use common::{pattern, resume_b_when, stalled_pair};
use nixl::{LocalDescList, MemType, RemoteDescList, XferDesc, XferOp, XferOptions, XferStatus};

/// The driver's capacity per agent (`agent/driver.rs`).
const CAPACITY: u64 = 4096;
/// Requests past the capacity.
const OVER: usize = 100;
const COUNT: usize = CAPACITY as usize + OVER;
/// Bytes each request writes.
const SLICE: usize = 64;

#[test]
fn futures_past_the_drivers_capacity_wait_for_room_and_all_complete() {
    let pair = stalled_pair("capacity");
    let data = pattern(COUNT * SLICE, 11);
    let (src, dst) = pair.source_and_destination(data.clone());
    pair.exchange();
    let dst_addr = dst.regions()[0].addr;
    // b makes no progress yet, so every request stays in flight.
    let requests = (0..COUNT).map(|i| {
        let mut local = LocalDescList::new(MemType::Dram).unwrap();
        local.push(&src, 0, i * SLICE, SLICE).unwrap();
        let remote = RemoteDescList::from_descs(
            MemType::Dram,
            &[XferDesc::new(dst_addr + i * SLICE, SLICE, 0)],
        )
        .unwrap();
        let mut req = pair
            .request(XferOp::Write, &local, &remote, &XferOptions::new())
            .unwrap();
        assert_eq!(req.post().unwrap(), XferStatus::InProgress, "request {i}");
        req.completion()
    });
    let mut executor = Executor::new(requests.collect::<Vec<_>>());
    assert_eq!(executor.poll_all(), COUNT, "nothing can finish yet");
    let stats = pair.a.driver_stats();
    assert_eq!(
        (stats.held, stats.awaited, stats.waited_for_room),
        (CAPACITY, CAPACITY, OVER as u64),
        "the driver took as many as it holds; the rest wait: {stats:?}"
    );

    // b resumes: the held requests finish, and the waiting futures take their room.
    let outcomes = resume_b_when(&pair, || true, || executor.run());
    for (i, outcome) in outcomes.into_iter().enumerate() {
        let req = outcome.unwrap_or_else(|err| panic!("request {i}: {err}"));
        assert!(!req.is_in_flight(), "request {i}");
    }
    assert_eq!(common::contents(&dst), data);
    // The driver counts requests finished just after handing them back.
    common::wait_until("the driver to count every request finished", || {
        pair.a.driver_stats().held == 0
    });
}
