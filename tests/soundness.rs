//! Safe code cannot free memory under a transfer (issue: soundness): leaks, failed posts,
//! in-process targets, racing copies, overflowing descriptors, lost errors.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};

use common::{
    assert_pair_works, contents, finish, in_flight_write, local_whole, pattern, remote_whole,
    stalled_pair, tracked_pair, unique_name, Pair, WAIT,
};
use nixl::{
    Agent, Error, HostBuffer, MemType, RegDesc, RemoteDescList, Status, XferDesc, XferOp,
    XferOptions,
};

#[test]
fn a_request_holds_the_in_process_target_it_writes_into() {
    let pair = stalled_pair("target");
    let (src, _src_freed, dst, dst_freed) = tracked_pair(&pair, 1 << 20);
    let mut req = in_flight_write(&pair, &src, &dst);
    // b lets go of its memory while a's WRITE into it is in flight.
    drop(dst);
    assert!(
        !dst_freed.load(Ordering::SeqCst),
        "the in-flight request must keep the target alive"
    );
    finish(&pair, &mut req);
    assert!(!dst_freed.load(Ordering::SeqCst));
    drop(req);
    assert!(
        dst_freed.load(Ordering::SeqCst),
        "the target is freed once the request is gone"
    );
    assert_eq!(pair.a.leak_stats(), nixl::LeakStats::default());
}

/// A request made from prepared lists holds what they describe: the local memory it reads
/// and the in-process target it writes, with the lists and registrations themselves gone.
#[test]
fn a_request_from_prepared_lists_holds_its_memory_and_target() {
    let pair = stalled_pair("prepared-hold");
    let (src, src_freed, dst, dst_freed) = tracked_pair(&pair, 1 << 20);
    let local = pair.a.prepare_local(&local_whole(&src), &[]).unwrap();
    let remote = pair
        .a
        .prepare_remote(pair.b.name(), &remote_whole(&dst), &[])
        .unwrap();
    let mut req = pair
        .a
        .make_xfer_req(
            XferOp::Write,
            &local,
            &[0],
            &remote,
            &[0],
            &XferOptions::new(),
        )
        .unwrap();
    assert_eq!(req.post().unwrap(), nixl::XferStatus::InProgress);
    drop((local, remote, src, dst));
    assert!(
        !src_freed.load(Ordering::SeqCst) && !dst_freed.load(Ordering::SeqCst),
        "the in-flight request must keep its source and target alive"
    );
    finish(&pair, &mut req);
    drop(req);
    assert!(
        src_freed.load(Ordering::SeqCst) && dst_freed.load(Ordering::SeqCst),
        "both are freed once the request is gone"
    );
    assert_eq!(pair.a.leak_stats(), nixl::LeakStats::default());
}

#[test]
fn an_in_process_peer_target_that_is_gone_is_refused() {
    let pair = Pair::with(
        Agent::new(&unique_name("gone-a")).unwrap(),
        Agent::new(&unique_name("gone-b")).unwrap(),
    );
    let (src, dst) = pair.source_and_destination(pattern(4096, 5));
    pair.exchange();
    let stale = remote_whole(&dst);
    // a still has b's metadata describing `dst`, but b deregistered (and freed) it.
    dst.deregister().unwrap();
    for result in [
        pair.request(
            XferOp::Write,
            &local_whole(&src),
            &stale,
            &XferOptions::new(),
        )
        .map(drop),
        pair.a.prepare_remote(pair.b.name(), &stale, &[]).map(drop),
    ] {
        match result {
            Err(Error::InvalidArgument { reason, .. }) => {
                assert!(
                    reason.contains("lies in no live DRAM registration"),
                    "{reason}"
                );
                assert!(reason.contains("lives in this process"), "{reason}");
            }
            other => panic!("expected the stale target to be refused, got {other:?}"),
        }
    }
    assert_pair_works(&pair, 6);

    // An agent of this process that is gone altogether is refused the same way.
    let c = Agent::new(&unique_name("gone-c")).unwrap();
    c.create_backend("UCX").unwrap();
    let on_c = c.register_memory(vec![0u8; 4096], &[]).unwrap();
    pair.a
        .load_remote_metadata(&c.local_metadata().unwrap())
        .unwrap();
    let c_name = c.name().to_string();
    let target = remote_whole(&on_c);
    drop(on_c);
    drop(c);
    match pair.a.create_xfer_req(
        XferOp::Write,
        &local_whole(&src),
        &target,
        &c_name,
        &XferOptions::new(),
    ) {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("lies in no live"), "{reason}")
        }
        other => panic!("expected a dropped agent's memory to be refused, got {other:?}"),
    }
}

#[test]
fn a_local_list_of_another_agents_memory_is_refused() {
    let pair = Pair::with(
        Agent::new(&unique_name("foreign-a")).unwrap(),
        Agent::new(&unique_name("foreign-b")).unwrap(),
    );
    let (src, dst) = pair.source_and_destination(pattern(4096, 8));
    pair.exchange();
    // b's memory in a list that a uses as its local side.
    let foreign = local_whole(&dst);
    let refused = |result: nixl::Result<()>| match result {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("register it on the agent"), "{reason}")
        }
        other => panic!("expected the foreign list to be refused, got {other:?}"),
    };
    refused(
        pair.request(
            XferOp::Write,
            &foreign,
            &remote_whole(&dst),
            &XferOptions::new(),
        )
        .map(drop),
    );
    refused(pair.a.prepare_local(&foreign, &[]).map(drop));
    drop(src);
    assert_pair_works(&pair, 9);
}

#[test]
fn a_failed_post_leaves_the_request_in_flight_and_its_memory_leaked() {
    let pair = Pair::with(
        Agent::new(&unique_name("failpost-a")).unwrap(),
        Agent::new(&unique_name("failpost-b")).unwrap(),
    );
    let (src, src_freed, dst, _dst_freed) = tracked_pair(&pair, 4096);
    let mut req = pair
        .whole_request(XferOp::Write, &src, &dst, &XferOptions::new())
        .unwrap();
    pair.a.invalidate_remote_metadata(pair.b.name()).unwrap();
    match req.post() {
        Err(Error::Nixl {
            status: Status::NotFound,
            hint: Some(hint),
            ..
        }) => assert!(hint.contains("make a new request"), "{hint}"),
        other => panic!("expected NotFound for a post after invalidation, got {other:?}"),
    }
    // An error is never "done": the request may be partly in flight.
    assert!(req.is_in_flight() && req.has_failed());
    match req.post() {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("make a new request"), "{reason}")
        }
        other => panic!("expected a repost of a failed request to be refused, got {other:?}"),
    }
    drop(req);
    drop(src);
    assert!(
        !src_freed.load(Ordering::SeqCst),
        "memory of a failed request is never freed"
    );
    let leaks = pair.a.leak_stats();
    assert_eq!((leaks.requests, leaks.failed_releases), (1, 0));
    assert_pair_works(&pair, 7);
}

#[test]
fn abandon_and_forget_never_free_memory_in_flight() {
    for forget in [false, true] {
        let pair = stalled_pair(if forget { "forget" } else { "abandon" });
        let (src, src_freed, dst, dst_freed) = tracked_pair(&pair, 1 << 20);
        let req = in_flight_write(&pair, &src, &dst);
        if forget {
            std::mem::forget(req);
        } else {
            req.abandon();
        }
        drop(src);
        // b moves the data now, out of memory that must still be there: the transfer
        // finishes (its bytes land in dst) ...
        common::wait_until("the WRITE to land", || {
            pair.b.notifications().unwrap();
            contents(&dst) == pattern(1 << 20, 3)
        });
        assert!(!src_freed.load(Ordering::SeqCst), "forget={forget}");
        // ... and the leaked request still holds its target too.
        drop(dst);
        assert!(!dst_freed.load(Ordering::SeqCst), "forget={forget}");
        // `abandon` counts its leak; a forgotten request is invisible to the crate. Neither
        // went to the completion driver, which would release it once done.
        assert_eq!(pair.a.leak_stats().requests, u64::from(!forget));
        assert_eq!(pair.a.driver_stats(), nixl::DriverStats::default());
    }
}

/// Reads, writes at other offsets and NIXL WRITEs racing on one region: nothing crashes and
/// every byte read is one that some writer wrote (torn, not garbage). A test cannot show
/// that no undefined behaviour happened (a data race may well produce plausible bytes);
/// that claim rests on `Registration::read` / `write` accessing each byte with one atomic
/// size, which `scripts/miri.sh` checks under Miri on the copies themselves.
#[test]
fn racing_reads_and_writes_see_only_bytes_some_writer_wrote() {
    let pair = Pair::with(
        Agent::new(&unique_name("race-a")).unwrap(),
        Agent::new(&unique_name("race-b")).unwrap(),
    );
    const LEN: usize = 64 << 10;
    let (src, dst) = pair.register(vec![0xAAu8; LEN], vec![0u8; LEN]);
    pair.exchange();
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        // Two writers with different bytes, at different alignments.
        for (byte, offset) in [(0x11u8, 0usize), (0x22, 3)] {
            let (dst, stop) = (&dst, &stop);
            scope.spawn(move || {
                let data = vec![byte; LEN - offset];
                while !stop.load(Ordering::Relaxed) {
                    dst.write(0, offset, &data).unwrap();
                }
            });
        }
        // NIXL WRITEs into the same bytes meanwhile.
        let (pair, src, dst_ref, stop_ref) = (&pair, &src, &dst, &stop);
        scope.spawn(move || {
            let mut req = pair
                .whole_request(XferOp::Write, src, dst_ref, &XferOptions::new())
                .unwrap();
            for _ in 0..50 {
                req.post_and_wait(WAIT).unwrap();
            }
            stop_ref.store(true, Ordering::Relaxed);
        });
        let mut out = vec![0u8; LEN];
        while !stop.load(Ordering::Relaxed) {
            dst.read(0, 0, &mut out).unwrap();
            assert!(
                out.iter().all(|b| [0, 0x11, 0x22, 0xAA].contains(b)),
                "every byte read is one that some writer wrote"
            );
        }
    });
}

/// The `VmFlags` of the mapping of this process that holds `addr`, from /proc/self/smaps.
fn vm_flags(addr: usize) -> Vec<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("read /proc/self/smaps");
    let mut inside = false;
    for line in smaps.lines() {
        let range = line.split(' ').next().unwrap_or_default();
        if let Some((start, end)) = range.split_once('-') {
            if let (Ok(start), Ok(end)) = (
                usize::from_str_radix(start, 16),
                usize::from_str_radix(end, 16),
            ) {
                inside = (start..end).contains(&addr);
                continue;
            }
        }
        if let Some(flags) = line.strip_prefix("VmFlags:").filter(|_| inside) {
            return flags.split_whitespace().map(String::from).collect();
        }
    }
    panic!("no mapping of this process holds {addr:#x}");
}

/// What `HostBuffer` promises for 2 MiB and more: a 2 MiB-aligned start and the advice for
/// transparent huge pages (`hg` in the mapping's `VmFlags`). Whether the kernel then backs
/// it with huge pages (`AnonHugePages`) is its policy and free memory, not ours to assert.
#[test]
fn huge_host_buffers_are_aligned_and_advised_for_huge_pages() {
    let agent = Agent::new(&unique_name("huge")).unwrap();
    agent.create_backend("UCX").unwrap();
    for len in [2 << 20, (2 << 20) + 1, 5 << 20] {
        let reg = agent
            .register_memory(HostBuffer::zeroed(len).unwrap(), &[])
            .unwrap();
        let region = &reg.regions()[0];
        assert_eq!((region.addr % (2 << 20), region.len), (0, len));
        for at in [region.addr, region.addr + len - 1] {
            let flags = vm_flags(at);
            assert!(
                flags.iter().any(|f| f == "hg"),
                "{len} bytes, at {at:#x}: {flags:?}"
            );
        }
        reg.write(0, len - 1, &[7]).unwrap();
        assert_eq!(contents(&reg)[len - 1], 7);
    }
    // Smaller buffers are neither aligned nor advised.
    let small = HostBuffer::zeroed(4096).unwrap();
    assert!(!vm_flags(small.as_ptr() as usize).iter().any(|f| f == "hg"));
}

/// How many of the pages of `buf` are backed by memory now (`mincore`).
fn resident_pages(buf: &[u8]) -> usize {
    let page = 4096;
    let start = buf.as_ptr() as usize / page * page;
    let len = buf.as_ptr() as usize + buf.len() - start;
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: `start..start + len` lies in the buffer's mapping (page-aligned down to its
    // own first page); `vec` holds one byte per page of it.
    let rc = unsafe { libc::mincore(start as *mut libc::c_void, len, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    vec.iter().filter(|&&v| v & 1 == 1).count()
}

/// `populate` (and `backed`) back every page now (a KV cache's first loads then take no page
/// faults), and the bytes stay zero; a buffer not populated is backed only where touched.
#[test]
fn populated_host_buffers_are_backed_and_still_zero() {
    for len in [3 * 4096 + 1, 5usize << 20] {
        let pages = len.div_ceil(4096);
        let fresh = HostBuffer::zeroed(len).unwrap();
        assert!(resident_pages(&fresh) < pages, "{len} bytes, fresh");
        let mut buf = HostBuffer::zeroed(len).unwrap();
        buf.populate().unwrap();
        assert_eq!(resident_pages(&buf), pages, "{len} bytes, populated");
        assert!(buf.iter().all(|&b| b == 0), "{len} bytes");
        let backed = HostBuffer::backed(len).unwrap();
        assert_eq!(resident_pages(&backed), pages, "{len} bytes, backed");
    }
}

#[test]
fn descriptors_ending_past_the_address_space_are_refused() {
    let agent = Agent::new(&unique_name("overflow")).unwrap();
    let past = XferDesc::new(usize::MAX - 10, 100, 0);
    match RemoteDescList::from_descs(MemType::Dram, &[past]) {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(
                reason.contains("past the end of the address space"),
                "{reason}"
            )
        }
        other => panic!("expected the descriptor to be refused, got {other:?}"),
    }
    let mut list = RemoteDescList::new(MemType::Dram).unwrap();
    assert!(matches!(
        list.push(past),
        Err(Error::InvalidArgument { .. })
    ));
    // SAFETY: refused before NIXL sees the address (asserted).
    let registered = unsafe {
        agent.register_raw(
            MemType::Dram,
            &[RegDesc {
                addr: usize::MAX - 10,
                len: 100,
                dev_id: 0,
                metadata: Vec::new(),
            }],
            &[],
        )
    };
    assert!(matches!(registered, Err(Error::InvalidArgument { .. })));
}

#[test]
fn errors_are_reported_not_swallowed() {
    let agent = Agent::new(&unique_name("errors")).unwrap();
    // A name NIXL cannot take is an error, not "not loaded".
    assert!(matches!(
        agent.has_remote_metadata("bad\0name"),
        Err(Error::InvalidName { .. })
    ));
    assert!(!agent.has_remote_metadata("nobody").unwrap());
    // A plugin NIXL has but refuses to start is NIXL's error, not "unknown plugin".
    match agent.create_backend_with("POSIX", [("use_uring", "maybe")]) {
        Err(Error::Nixl {
            status: Status::Backend,
            ..
        }) => {}
        other => panic!("expected NIXL's error, got {other:?}"),
    }
    match agent.create_backend("NO_SUCH_PLUGIN") {
        Err(Error::UnknownPlugin { available, .. }) => {
            assert!(available.iter().any(|p| p == "UCX"), "{available:?}")
        }
        other => panic!("expected UnknownPlugin, got {other:?}"),
    }
}

#[test]
fn without_a_gpu_vram_is_refused_the_same_way_every_time() {
    if std::path::Path::new("/dev/nvidia0").exists() {
        common::skip(
            "soundness::without_a_gpu_vram_is_refused_the_same_way_every_time",
            "a GPU is present; this covers machines without one",
        );
        return;
    }
    let agent = Agent::new(&unique_name("no-gpu")).unwrap();
    // The CUDA driver is looked up once; asking again gives the same answer, not a crash.
    // SAFETY: no GPU is present (checked above).
    let vram = || unsafe { common::register_fake_vram(&agent, &[]) };
    let (first, second) = (vram(), vram());
    match (first, second) {
        (
            Err(Error::NoCudaDevice { detail: a, .. }),
            Err(Error::NoCudaDevice { detail: b, .. }),
        ) => {
            assert_eq!(a, b)
        }
        other => panic!("expected NoCudaDevice twice, got {other:?}"),
    }
}

#[test]
fn names_that_would_come_back_altered_are_refused_before_loading() {
    let agent = Agent::new(&unique_name("names")).unwrap();
    agent.create_backend("UCX").unwrap();
    let peer_name = unique_name("name-xyz");
    let peer = Agent::new(&peer_name).unwrap();
    peer.create_backend("UCX").unwrap();
    let good = peer.local_metadata().unwrap();
    let at = good
        .windows(peer_name.len())
        .position(|w| w == peer_name.as_bytes())
        .expect("the name is in the metadata");
    // Same length, so only the name's bytes differ: a NUL (NIXL would hand back a cut name,
    // and invalidating by that name would miss) and a byte that is not UTF-8.
    for (byte, why) in [(0u8, "NUL"), (0xff, "not UTF-8")] {
        let mut bad = good.clone();
        bad[at + 1] = byte;
        match agent.load_remote_metadata(&bad) {
            Err(Error::InvalidMetadata { offset, reason }) => {
                assert_eq!(offset, at + 1, "{reason}");
                assert!(reason.contains(why), "{reason}");
            }
            other => panic!("expected the {why} name to be refused, got {other:?}"),
        }
    }
    // The exact name comes back, and invalidating by it works.
    assert_eq!(agent.load_remote_metadata(&good).unwrap(), peer_name);
    agent.invalidate_remote_metadata(&peer_name).unwrap();
}
