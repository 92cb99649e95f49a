//! UCX transfers between two agents of one process, over DRAM: WRITE and READ with 1 and
//! 4096 descriptors, reposting, telemetry, cost estimates, backend queries, connections,
//! and the remote-metadata calls (full, partial, check, invalidate).

mod common;

use common::{contents, local_whole, pattern, remote_whole, transfer, unique_name, Pair, WAIT};
use nixl::{
    Agent, Error, LocalDescList, MemType, RemoteDescList, Status, XferDesc, XferOp, XferOptions,
};

#[test]
fn write_one_descriptor() {
    let pair = Pair::new("w1");
    let data = pattern(8192, 1);
    let (src, dst) = pair.source_and_destination(data.clone());
    pair.exchange();
    transfer(&pair.a, XferOp::Write, &src, &dst, pair.b.name()).unwrap();
    assert_eq!(contents(&dst), data);
    assert_eq!(contents(&src), data, "a WRITE leaves the source as it was");
}

#[test]
fn read_one_descriptor() {
    let pair = Pair::new("r1");
    let data = pattern(8192, 2);
    let (dst, src) = pair.register(vec![0u8; 8192], data.clone());
    pair.exchange();
    transfer(&pair.a, XferOp::Read, &dst, &src, pair.b.name()).unwrap();
    assert_eq!(contents(&dst), data);
    assert_eq!(
        contents(&src),
        data,
        "a READ leaves the remote side as it was"
    );
}

/// Moves 4096 descriptors of `DESC` bytes, each at a stride of `2 * DESC` so that NIXL
/// cannot merge neighbours; the gaps between descriptors must stay untouched.
fn many_descriptors(op: XferOp, seed: u8) {
    const COUNT: usize = 4096;
    const DESC: usize = 32;
    const STRIDE: usize = 2 * DESC;
    const LEN: usize = COUNT * STRIDE;
    let pair = Pair::new(if op == XferOp::Read { "r4096" } else { "w4096" });
    let data = pattern(LEN, seed);
    let filler = 0x5a;
    // `a` initiates. The side that is written to starts as all `filler`.
    let (a_mem, b_mem) = match op {
        XferOp::Write => (data.clone(), vec![filler; LEN]),
        XferOp::Read => (vec![filler; LEN], data.clone()),
    };
    let (a_reg, b_reg) = pair.register(a_mem, b_mem);
    pair.exchange();

    // Local descriptor i is at offset i*STRIDE; remote descriptor i is at the mirrored slot
    // (COUNT-1-i)*STRIDE, so a mix-up of the pairing would show in the data.
    let mut local = LocalDescList::with_capacity(MemType::Dram, COUNT).unwrap();
    let mut remote = RemoteDescList::new(MemType::Dram).unwrap();
    let b_base = b_reg.regions()[0].addr;
    for i in 0..COUNT {
        local.push(&a_reg, 0, i * STRIDE, DESC).unwrap();
        remote
            .push(XferDesc::new(b_base + (COUNT - 1 - i) * STRIDE, DESC, 0))
            .unwrap();
    }
    assert_eq!(local.len(), COUNT);
    assert_eq!(remote.len(), COUNT);
    let mut req = pair
        .request(op, &local, &remote, &XferOptions::new())
        .unwrap();
    req.post_and_wait(WAIT).unwrap();

    let (written, source) = match op {
        XferOp::Write => (contents(&b_reg), contents(&a_reg)),
        XferOp::Read => (contents(&a_reg), contents(&b_reg)),
    };
    assert_eq!(source, data, "the source side is unchanged");
    let mut expected = vec![filler; LEN];
    for i in 0..COUNT {
        let (a_off, b_off) = (i * STRIDE, (COUNT - 1 - i) * STRIDE);
        let (from, to) = match op {
            XferOp::Write => (a_off, b_off),
            XferOp::Read => (b_off, a_off),
        };
        expected[to..to + DESC].copy_from_slice(&data[from..from + DESC]);
    }
    assert!(
        written == expected,
        "4096-descriptor {op:?} moved the wrong bytes"
    );
}

#[test]
fn write_4096_descriptors() {
    many_descriptors(XferOp::Write, 3);
}

#[test]
fn read_4096_descriptors() {
    many_descriptors(XferOp::Read, 4);
}

#[test]
fn repost_finished_request_moves_new_data() {
    let pair = Pair::new("repost");
    let first = pattern(4096, 5);
    let (src, dst) = pair.source_and_destination(first.clone());
    pair.exchange();
    let mut req = pair
        .whole_request(XferOp::Write, &src, &dst, &XferOptions::new())
        .unwrap();
    req.post_and_wait(WAIT).unwrap();
    assert!(!req.is_in_flight());
    assert_eq!(contents(&dst), first);

    for round in 0..3u8 {
        let next = pattern(4096, 100 + round);
        src.write(0, 0, &next).unwrap();
        req.post_and_wait(WAIT).unwrap();
        assert_eq!(
            contents(&dst),
            next,
            "repost {round} moved the new source bytes"
        );
    }
    // A partial change of the source shows up in place after one more repost.
    src.write(0, 1000, b"changed in the middle").unwrap();
    req.post_and_wait(WAIT).unwrap();
    assert_eq!(contents(&dst), contents(&src));
}

#[test]
fn telemetry_when_enabled() {
    let pair = Pair::with(
        Agent::builder(&common::unique_name("tel-a"))
            .telemetry(true)
            .build()
            .unwrap(),
        Agent::new(&common::unique_name("tel-b")).unwrap(),
    );
    let data = pattern(3 * 1024, 6);
    let (src, dst) = pair.source_and_destination(data.clone());
    pair.exchange();
    let mut local = LocalDescList::new(MemType::Dram).unwrap();
    let mut remote = RemoteDescList::new(MemType::Dram).unwrap();
    // Three separate descriptors, in reverse order so that NIXL cannot merge them.
    for i in 0..3 {
        local.push(&src, 0, i * 1024, 1024).unwrap();
        remote
            .push(XferDesc::new(
                dst.regions()[0].addr + (2 - i) * 1024,
                1024,
                0,
            ))
            .unwrap();
    }
    let mut req = pair
        .request(XferOp::Write, &local, &remote, &XferOptions::new())
        .unwrap();
    req.post_and_wait(WAIT).unwrap();
    let moved = contents(&dst);
    for i in 0..3 {
        assert_eq!(
            moved[(2 - i) * 1024..(3 - i) * 1024],
            data[i * 1024..(i + 1) * 1024]
        );
    }
    let telemetry = req.telemetry().unwrap();
    assert_eq!(telemetry.total_bytes, 3 * 1024);
    assert_eq!(telemetry.desc_count, 3);
}

#[test]
fn telemetry_when_disabled_is_a_typed_error() {
    let pair = Pair::new("notel");
    let (src, dst) = pair.source_and_destination(pattern(512, 7));
    pair.exchange();
    let mut req = pair
        .whole_request(XferOp::Write, &src, &dst, &XferOptions::new())
        .unwrap();
    req.post_and_wait(WAIT).unwrap();
    assert_eq!(contents(&dst), pattern(512, 7));
    match req.telemetry() {
        Err(Error::Nixl {
            status: Status::NoTelemetry,
            hint: Some(hint),
            ..
        }) => assert!(hint.contains("telemetry(true)"), "{hint}"),
        other => panic!("expected NoTelemetry, got {other:?}"),
    }
}

#[test]
fn estimate_cost_and_chosen_backend() {
    let pair = Pair::new("cost");
    let (src, dst) = pair.source_and_destination(pattern(1 << 16, 8));
    pair.exchange();
    let mut req = pair
        .whole_request(XferOp::Write, &src, &dst, &XferOptions::new())
        .unwrap();
    assert_eq!(req.backend().unwrap(), "UCX");
    // UCX implements NIXL's analytical cost model; its value is not asserted (no timing).
    match req.estimate_cost() {
        Ok(estimate) => assert_eq!(estimate.method, nixl::CostMethod::AnalyticalBackend),
        Err(err) => panic!("estimate_cost failed: {err}"),
    }
    req.post_and_wait(WAIT).unwrap();
    assert_eq!(contents(&dst), pattern(1 << 16, 8));
    assert_eq!(req.backend().unwrap(), "UCX");
}

#[test]
fn make_connection_before_transfer() {
    let pair = Pair::new("conn");
    let (src, dst) = pair.source_and_destination(pattern(2048, 9));
    pair.exchange();
    pair.a.make_connection(pair.b.name(), &[]).unwrap();
    pair.a
        .make_connection(pair.b.name(), &[&pair.ucx_a])
        .unwrap();
    transfer(&pair.a, XferOp::Write, &src, &dst, pair.b.name()).unwrap();
    assert_eq!(contents(&dst), pattern(2048, 9));
}

#[test]
fn check_and_invalidate_remote_metadata() {
    let pair = Pair::new("chk");
    let (src, dst) = pair.source_and_destination(pattern(4096, 10));
    let b = pair.b.name().to_string();
    assert!(!pair.a.has_remote_metadata(&b).unwrap());
    assert!(!pair.a.check_remote_metadata(&b, None).unwrap());
    pair.exchange();
    assert!(pair.a.has_remote_metadata(&b).unwrap());
    assert!(pair.a.check_remote_metadata(&b, None).unwrap());

    let inside = remote_whole(&dst);
    assert!(pair.a.check_remote_metadata(&b, Some(&inside)).unwrap());
    let base = dst.regions()[0].addr;
    let beyond =
        RemoteDescList::from_descs(MemType::Dram, &[XferDesc::new(base + 4096, 4096, 0)]).unwrap();
    assert!(
        !pair.a.check_remote_metadata(&b, Some(&beyond)).unwrap(),
        "a range outside b's registrations is not covered"
    );

    pair.a.invalidate_remote_metadata(&b).unwrap();
    assert!(!pair.a.has_remote_metadata(&b).unwrap());
    match pair.a.create_xfer_req(
        XferOp::Write,
        &local_whole(&src),
        &inside,
        &b,
        &XferOptions::new(),
    ) {
        Err(Error::Nixl {
            hint: Some(hint), ..
        }) => assert!(hint.contains("load_remote_metadata"), "{hint}"),
        other => panic!("expected a NIXL error with a hint, got {other:?}"),
    }
    // Invalidating again: nothing is loaded any more.
    match pair.a.invalidate_remote_metadata(&b) {
        Err(Error::Nixl {
            status: Status::NotFound,
            hint: Some(hint),
            ..
        }) => assert!(hint.contains("no metadata of that agent"), "{hint}"),
        other => panic!("expected NotFound for a second invalidation, got {other:?}"),
    }

    // Loading again restores everything.
    pair.exchange();
    transfer(&pair.a, XferOp::Write, &src, &dst, &b).unwrap();
    assert_eq!(contents(&dst), pattern(4096, 10));
}

#[test]
fn partial_metadata_covers_only_the_named_registrations() {
    let pair = Pair::new("partial");
    let (src, shared) = pair.source_and_destination(pattern(4096, 11));
    let private = pair
        .b
        .register_memory(vec![0u8; 4096], &[&pair.ucx_b])
        .unwrap();
    let b = pair.b.name().to_string();

    // Connection info only: the agent is known, none of its memory is.
    let conn_only = pair.b.local_partial_metadata(&[], &[]).unwrap();
    assert_eq!(pair.a.load_remote_metadata(&conn_only).unwrap(), b);
    assert!(pair.a.has_remote_metadata(&b).unwrap());
    assert!(!pair
        .a
        .check_remote_metadata(&b, Some(&remote_whole(&shared)))
        .unwrap());

    let md = pair
        .b
        .local_partial_metadata(&[&shared], &[&pair.ucx_b])
        .unwrap();
    assert_eq!(pair.a.load_remote_metadata(&md).unwrap(), b);
    assert!(pair
        .a
        .check_remote_metadata(&b, Some(&remote_whole(&shared)))
        .unwrap());
    assert!(!pair
        .a
        .check_remote_metadata(&b, Some(&remote_whole(&private)))
        .unwrap());

    transfer(&pair.a, XferOp::Write, &src, &shared, &b).unwrap();
    assert_eq!(contents(&shared), pattern(4096, 11));
    match transfer(&pair.a, XferOp::Write, &src, &private, &b) {
        Err(Error::Nixl {
            operation: "create transfer request",
            // NIXL 1.5.1 finds no backend that knows the remote range.
            status: Status::Backend,
            hint: Some(hint),
        }) => assert!(hint.contains("inside memory registered"), "{hint}"),
        other => panic!("memory left out of the partial metadata cannot be reached; got {other:?}"),
    }
    assert_eq!(contents(&private), vec![0u8; 4096]);
}

#[test]
fn ucx_worker_threads_split_a_multi_descriptor_write() {
    // num_threads and split_batch_size are read by NIXL's UCX plugin without being advertised.
    let a = Agent::builder(&unique_name("split-a"))
        .telemetry(true)
        .build()
        .unwrap();
    let b = Agent::new(&unique_name("split-b")).unwrap();
    // SAFETY: NIXL 1.5.1's worker-thread race needs a request reposted while the threads
    // complete it; this test posts its one request once, and a crash would fail the suite.
    let ucx_a = unsafe {
        a.create_backend_with_unchecked("UCX", [("num_threads", "2"), ("split_batch_size", "1")])
    }
    .unwrap();
    assert_eq!(
        ucx_a
            .params()
            .unwrap()
            .get("num_threads")
            .map(String::as_str),
        Some("2")
    );
    let pair = Pair {
        ucx_b: b.create_backend("UCX").unwrap(),
        a,
        b,
        ucx_a,
    };
    const LEN: usize = 4 << 20;
    let data = pattern(LEN, 91);
    let (src, dst) = pair.source_and_destination(data.clone());
    pair.exchange();
    let halves = [(0, LEN / 2), (LEN / 2, LEN / 2)];
    let mut local = LocalDescList::with_capacity(MemType::Dram, 2).unwrap();
    let mut remote = RemoteDescList::new(MemType::Dram).unwrap();
    for (offset, len) in halves {
        local.push(&src, 0, offset, len).unwrap();
        remote
            .push(XferDesc::new(dst.regions()[0].addr + offset, len, 0))
            .unwrap();
    }
    let options = XferOptions::new().skip_desc_merge(true);
    let mut req = pair
        .request(XferOp::Write, &local, &remote, &options)
        .unwrap();
    req.post_and_wait(WAIT).unwrap();
    assert_eq!(contents(&dst), data);
    // NIXL kept the two descriptors apart (split_batch_size=1 gives each worker thread one).
    let telemetry = req.telemetry().unwrap();
    assert_eq!(
        (telemetry.desc_count, telemetry.total_bytes),
        (2, LEN as u64)
    );
}

#[test]
fn large_descriptors_are_cut_in_two_for_the_ucx_worker_threads() {
    // Two UCX worker threads splitting requests of 2+ descriptors (not the default).
    let a = Agent::builder(&common::unique_name("cut-a"))
        .telemetry(true)
        .build()
        .unwrap();
    let b = Agent::new(&common::unique_name("cut-b")).unwrap();
    let threads = [("num_threads", "2"), ("split_batch_size", "2")];
    // SAFETY: as in ucx_worker_threads_split_a_multi_descriptor_write: two requests, each
    // posted once and waited for.
    let (ucx_a, ucx_b) = unsafe {
        (
            a.create_backend_with_unchecked("UCX", threads),
            b.create_backend_with_unchecked("UCX", threads),
        )
    };
    let pair = Pair {
        ucx_a: ucx_a.unwrap(),
        ucx_b: ucx_b.unwrap(),
        a,
        b,
    };
    // 16 MiB + 1 byte: cut into a page-aligned half and the rest.
    const LEN: usize = (16 << 20) + 1;
    let data = pattern(LEN, 92);
    let (src, dst) = pair.source_and_destination(data.clone());
    pair.exchange();
    for op in [XferOp::Write, XferOp::Read] {
        let (from, to) = if op == XferOp::Write {
            (&src, &dst)
        } else {
            (&dst, &src)
        };
        from.write(0, 0, &data).unwrap();
        to.write(0, 0, &vec![0u8; LEN]).unwrap();
        let mut req = pair
            .request(
                op,
                &local_whole(&src),
                &remote_whole(&dst),
                &XferOptions::new(),
            )
            .unwrap();
        req.post_and_wait(WAIT).unwrap();
        assert!(
            contents(to) == data,
            "{op:?} of a cut descriptor moved the wrong bytes"
        );
        let telemetry = req.telemetry().unwrap();
        assert_eq!(telemetry.total_bytes, LEN as u64);
        assert_eq!(
            telemetry.desc_count, 2,
            "one user descriptor, moved as two halves"
        );
    }
}

#[test]
fn create_backend_keeps_the_plugin_defaults_and_asks_for_the_ucx_mutex() {
    let agent = Agent::new(&unique_name("plugin-defaults")).unwrap();
    let mut expected = agent.plugin_info("UCX").unwrap().params;
    expected.insert("engine_config".into(), "USE_MT_MUTEX=y".into());
    let ucx = agent.create_backend("UCX").unwrap();
    assert_eq!(ucx.params().unwrap(), expected);
}

#[test]
fn lists_reused_for_many_requests_are_prepared_once() {
    let pair = Pair::with(
        Agent::builder(&common::unique_name("reuse-a"))
            .telemetry(true)
            .build()
            .unwrap(),
        Agent::new(&common::unique_name("reuse-b")).unwrap(),
    );
    const BLOCK: usize = 1024;
    let (src, dst) = pair.source_and_destination(pattern(5 * BLOCK, 0));
    pair.exchange();
    let b = pair.b.name().to_string();
    let base = dst.regions()[0].addr;
    let mut local = LocalDescList::new(MemType::Dram).unwrap();
    local.push_blocks(&src, 0, BLOCK, 0..3).unwrap();
    let mut remote = RemoteDescList::from_vec(
        MemType::Dram,
        (0..3)
            .map(|i| XferDesc::new(base + i * BLOCK, BLOCK, 0))
            .collect(),
    )
    .unwrap();
    let write = |local: &LocalDescList, remote: &RemoteDescList, seed: u8| {
        let data = pattern(5 * BLOCK, seed);
        src.write(0, 0, &data).unwrap();
        let mut req = pair
            .a
            .create_xfer_req(XferOp::Write, local, remote, &b, &XferOptions::new())
            .unwrap();
        req.post_and_wait(WAIT).unwrap();
        let blocks = local.len() * BLOCK;
        assert_eq!(contents(&dst)[..blocks], data[..blocks], "seed {seed}");
        req.telemetry().unwrap().desc_count
    };
    // The first request looks every descriptor up; from the second on, the prepared handles
    // serve, and NIXL merges the three adjacent blocks into one descriptor.
    assert_eq!(write(&local, &remote, 1), 3);
    assert_eq!(write(&local, &remote, 2), 1);
    assert_eq!(write(&local, &remote, 3), 1);
    // New metadata of the peer: the prepared remote handle is stale and is replaced.
    pair.a.invalidate_remote_metadata(&b).unwrap();
    pair.a
        .load_remote_metadata(&pair.b.local_metadata().unwrap())
        .unwrap();
    assert_eq!(write(&local, &remote, 4), 3);
    assert_eq!(write(&local, &remote, 5), 1);
    // A changed list starts over.
    local.push(&src, 0, 3 * BLOCK, BLOCK).unwrap();
    remote
        .push(XferDesc::new(base + 3 * BLOCK, BLOCK, 0))
        .unwrap();
    assert_eq!(write(&local, &remote, 6), 4);
    assert_eq!(write(&local, &remote, 7), 1);
}
