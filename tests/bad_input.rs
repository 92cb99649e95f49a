//! Bad input: every case returns its specific typed error, and the agent keeps working
//! afterwards (each test ends with a good transfer, checked byte for byte).

mod common;

use std::time::Duration;

use common::{
    assert_pair_works, contents, finish, in_flight_write, local_whole, pattern, remote_whole,
    stalled_pair, unique_name, whole_xfer_req, Pair, WAIT,
};
use nixl::{
    Agent, Error, FileRegion, HostBuffer, LocalDescList, MemType, RegDesc, RemoteDescList, Status,
    XferDesc, XferOp, XferOptions, XferStatus,
};

/// A pair whose metadata is exchanged, with a source on `a` and a destination on `b`.
fn pair_with_buffers(prefix: &str) -> (Pair, nixl::Registration, nixl::Registration) {
    let pair = Pair::new(prefix);
    let (src, dst) = pair.source_and_destination(pattern(4096, 61));
    pair.exchange();
    (pair, src, dst)
}

#[test]
fn unknown_plugin_lists_the_available_ones() {
    let pair = Pair::new("badplugin");
    match pair.a.create_backend("NO_SUCH_PLUGIN") {
        Err(Error::UnknownPlugin { name, available }) => {
            assert_eq!(name, "NO_SUCH_PLUGIN");
            assert!(available.iter().any(|p| p == "UCX"), "{available:?}");
            assert!(available.iter().any(|p| p == "POSIX"), "{available:?}");
        }
        other => panic!("expected UnknownPlugin, got {other:?}"),
    }
    assert!(matches!(
        pair.a.plugin_info("NO_SUCH_PLUGIN"),
        Err(Error::UnknownPlugin { .. })
    ));
    pair.exchange();
    assert_pair_works(&pair, 1);
}

#[test]
fn a_plugin_name_in_another_case_is_suggested() {
    let pair = Pair::new("plugincase");
    match pair.a.create_backend("ucx") {
        Err(err @ Error::UnknownPlugin { .. }) => assert!(
            err.to_string().contains(
                "\"ucx\" is not available (did you mean \"UCX\"? plugin names are case-sensitive)"
            ),
            "{err}"
        ),
        other => panic!("expected UnknownPlugin, got {other:?}"),
    }
    match pair.a.create_backend("NO_SUCH_PLUGIN") {
        Err(err) => assert!(!err.to_string().contains("did you mean"), "{err}"),
        Ok(_) => panic!("a backend of a plugin that does not exist"),
    }
    pair.exchange();
    assert_pair_works(&pair, 2);
}

#[test]
fn a_second_backend_of_the_same_plugin_is_a_typed_error() {
    let pair = Pair::new("twice");
    match pair.a.create_backend("UCX") {
        Err(err @ Error::BackendExists { .. }) => {
            let message = err.to_string();
            assert!(
                message.contains("UCX is already created on this agent"),
                "{message}"
            );
            assert!(message.contains(pair.a.name()), "{message}");
        }
        other => panic!("expected BackendExists, got {other:?}"),
    }
    assert_eq!(pair.a.backends().len(), 1);
    pair.exchange();
    assert_pair_works(&pair, 3);
}

#[test]
fn unknown_backend_param_lists_the_known_keys() {
    let agent = Agent::new(&unique_name("badkey")).unwrap();
    match agent.create_backend_with("UCX", [("no_such_key", "1")]) {
        Err(Error::UnknownBackendParam { plugin, key, known }) => {
            assert_eq!((plugin.as_str(), key.as_str()), ("UCX", "no_such_key"));
            assert!(known.iter().any(|k| k == "num_workers"), "{known:?}");
        }
        other => panic!("expected UnknownBackendParam, got {other:?}"),
    }
    // The agent has no backend yet and can still get one.
    assert!(agent.backends().is_empty());
    let pair = Pair::with(agent, Agent::new(&unique_name("badkey-b")).unwrap());
    pair.exchange();
    assert_pair_works(&pair, 2);
}

#[test]
fn ucx_worker_threads_are_refused_by_the_safe_api() {
    let agent = Agent::new(&unique_name("threads")).unwrap();
    for value in ["2", "1", " 3", "2abc", "-1", "0x1"] {
        match agent.create_backend_with("UCX", [("num_threads", value), ("split_batch_size", "1")])
        {
            Err(err @ Error::RefusedBackendParam { .. }) => {
                let text = err.to_string();
                for needle in [
                    "num_threads",
                    "nixlUcxDedicatedThread::run()",
                    "create_backend_with_unchecked",
                ] {
                    assert!(text.contains(needle), "{value:?}: {text}");
                }
            }
            other => panic!("num_threads={value:?}: expected a refusal, got {other:?}"),
        }
    }
    assert!(agent.backends().is_empty(), "nothing reached NIXL");
    // No worker threads is the default, and asking for none explicitly is fine.
    agent
        .create_backend_with("UCX", [("num_threads", "0")])
        .unwrap();
}

#[test]
fn further_ucx_workers_are_refused_by_the_safe_api() {
    let agent = Agent::new(&unique_name("workers")).unwrap();
    for value in ["2", " 3", "2abc", "-1", "0x1", "abc"] {
        match agent.create_backend_with("UCX", [("num_workers", value)]) {
            Err(err @ Error::RefusedBackendParam { .. }) => {
                let text = err.to_string();
                for needle in ["num_workers", "TCP port", "create_backend_with_unchecked"] {
                    assert!(text.contains(needle), "{value:?}: {text}");
                }
            }
            other => panic!("num_workers={value:?}: expected a refusal, got {other:?}"),
        }
    }
    assert!(agent.backends().is_empty(), "nothing reached NIXL");
    // One worker is the default; NIXL reads 0 as 1.
    for value in ["1", "0"] {
        Agent::new(&unique_name("one-worker"))
            .unwrap()
            .create_backend_with("UCX", [("num_workers", value)])
            .unwrap();
    }
    // The unsafe opt-in makes them.
    let unchecked = Agent::new(&unique_name("workers-unchecked")).unwrap();
    // SAFETY: this agent loads no metadata, so no peer can name its further worker.
    unsafe { unchecked.create_backend_with_unchecked("UCX", [("num_workers", "2")]) }.unwrap();
}

#[test]
fn bad_backend_param_values_are_rejected_by_nixl() {
    let agent = Agent::new(&unique_name("badvalue")).unwrap();
    // Values NIXL 1.5.1's plugins refuse (checked against the real library).
    for (plugin, key, value) in [
        ("UCX", "ucx_num_device_channels", "abc"),
        ("UCX", "ucx_num_device_channels", "-1"),
        ("UCX", "ucx_error_handling_mode", "bogus"),
        ("POSIX", "use_uring", "maybe"),
        ("POSIX", "ios_pool_size", "abc"),
    ] {
        match agent.create_backend_with(plugin, [(key, value)]) {
            Err(Error::Nixl {
                operation: "create backend",
                status: Status::Backend,
                ..
            }) => {}
            other => panic!("{plugin} {key}={value}: expected a NIXL error, got {other:?}"),
        }
    }
    assert!(agent.backends().is_empty(), "no half-made backend is kept");
    // A NUL inside a value never reaches NIXL.
    assert!(matches!(
        agent.create_backend_with("UCX", [("ucx_devices", "a\0b")]),
        Err(Error::InvalidArgument { .. })
    ));
    let pair = Pair::with(agent, Agent::new(&unique_name("badvalue-b")).unwrap());
    pair.exchange();
    assert_pair_works(&pair, 3);
}

#[test]
fn empty_lists() {
    let (pair, src, dst) = pair_with_buffers("empty");
    assert!(matches!(
        pair.a.register_memory(Vec::<Vec<u8>>::new(), &[]),
        Err(Error::EmptyDescList { .. })
    ));
    let empty_local = LocalDescList::new(MemType::Dram).unwrap();
    let empty_remote = RemoteDescList::new(MemType::Dram).unwrap();
    assert!(matches!(
        pair.request(
            XferOp::Write,
            &empty_local,
            &empty_remote,
            &XferOptions::new()
        ),
        Err(Error::EmptyDescList { .. })
    ));
    assert!(matches!(
        pair.a.prepare_local(&empty_local, &[]),
        Err(Error::EmptyDescList { .. })
    ));
    assert!(matches!(
        pair.a.prepare_remote(pair.b.name(), &empty_remote, &[]),
        Err(Error::EmptyDescList { .. })
    ));
    // Empty index slices of prepared lists.
    let pl = pair.a.prepare_local(&local_whole(&src), &[]).unwrap();
    let pr = pair
        .a
        .prepare_remote(pair.b.name(), &remote_whole(&dst), &[])
        .unwrap();
    assert!(matches!(
        pair.a
            .make_xfer_req(XferOp::Write, &pl, &[], &pr, &[], &XferOptions::new()),
        Err(Error::EmptyDescList { .. })
    ));
    let mut good = pair
        .a
        .make_xfer_req(XferOp::Write, &pl, &[0], &pr, &[0], &XferOptions::new())
        .unwrap();
    good.post_and_wait(WAIT).unwrap();
    assert_eq!(contents(&dst), pattern(4096, 61));
    assert_pair_works(&pair, 4);
}

#[test]
fn zero_length_descriptors() {
    let (pair, src, dst) = pair_with_buffers("zero");
    assert!(matches!(
        pair.a.register_memory(Vec::<u8>::new(), &[]),
        Err(Error::ZeroLength { index: 0, .. })
    ));
    assert!(matches!(
        pair.a
            .register_memory(vec![vec![1u8; 8], Vec::new()], &[&pair.ucx_a]),
        Err(Error::ZeroLength { index: 1, .. })
    ));
    let mut local = LocalDescList::new(MemType::Dram).unwrap();
    assert!(matches!(
        local.push(&src, 0, 16, 0),
        Err(Error::ZeroLength { .. })
    ));
    let mut remote = RemoteDescList::new(MemType::Dram).unwrap();
    assert!(matches!(
        remote.push(XferDesc::new(dst.regions()[0].addr, 0, 0)),
        Err(Error::ZeroLength { index: 0, .. })
    ));
    assert!(local.is_empty() && remote.is_empty(), "nothing was added");
    assert!(matches!(
        FileRegion::new(tempfile::tempfile().unwrap(), 0, 0),
        Err(Error::ZeroLength { .. })
    ));
    assert!(matches!(
        HostBuffer::zeroed(0),
        Err(Error::InvalidArgument { .. })
    ));
    assert_pair_works(&pair, 5);
}

#[test]
fn null_addresses() {
    let (pair, _src, _dst) = pair_with_buffers("null");
    // SAFETY: the registration is refused before NIXL sees the address.
    let refused = unsafe {
        pair.a.register_raw(
            MemType::Dram,
            &[RegDesc {
                addr: 0,
                len: 64,
                ..RegDesc::default()
            }],
            &[],
        )
    };
    assert!(matches!(refused, Err(Error::NullAddress { index: 0, .. })));
    assert!(matches!(
        RemoteDescList::from_descs(MemType::Dram, &[XferDesc::new(0, 64, 0)]),
        Err(Error::NullAddress { index: 0, .. })
    ));
    assert!(matches!(
        RemoteDescList::from_vec(
            MemType::Dram,
            vec![XferDesc::new(4096, 64, 0), XferDesc::new(0, 64, 0)]
        ),
        Err(Error::NullAddress { index: 1, .. })
    ));
    // Offset 0 of a file is not a null address.
    assert!(RemoteDescList::from_descs(MemType::File, &[XferDesc::new(0, 64, 3)]).is_ok());
    assert_pair_works(&pair, 6);
}

#[test]
fn remote_range_outside_the_remote_registration() {
    let (pair, src, dst) = pair_with_buffers("outside");
    let base = dst.regions()[0].addr;
    // Starts inside, ends 1 byte past the end; and wholly past the end.
    for addr in [base + 1, base + 4096] {
        let remote =
            RemoteDescList::from_descs(MemType::Dram, &[XferDesc::new(addr, 4096, 0)]).unwrap();
        match pair.request(
            XferOp::Write,
            &local_whole(&src),
            &remote,
            &XferOptions::new(),
        ) {
            // b lives in this process, so the crate resolves the range itself, before NIXL.
            Err(Error::InvalidArgument { reason, .. }) => {
                assert!(
                    reason.contains("lies in no live DRAM registration"),
                    "{reason}"
                )
            }
            other => panic!("expected the range to be refused, got {other:?}"),
        }
        match pair.a.prepare_remote(pair.b.name(), &remote, &[]) {
            Err(Error::InvalidArgument { reason, .. }) => {
                assert!(
                    reason.contains("lies in no live DRAM registration"),
                    "{reason}"
                )
            }
            other => panic!("expected the range to be refused, got {other:?}"),
        }
    }
    assert_eq!(contents(&dst), vec![0u8; 4096]);
    assert_pair_works(&pair, 7);
}

#[test]
fn local_range_outside_a_registration() {
    let (pair, src, _dst) = pair_with_buffers("localout");
    let mut local = LocalDescList::new(MemType::Dram).unwrap();
    match local.push(&src, 0, 4000, 97) {
        Err(Error::OutOfBounds {
            region: 0,
            offset: 4000,
            len: 97,
            region_len: 4096,
            ..
        }) => {}
        other => panic!("expected OutOfBounds, got {other:?}"),
    }
    assert!(matches!(
        local.push(&src, 0, usize::MAX, 2),
        Err(Error::OutOfBounds { .. })
    ));
    match local.push(&src, 1, 0, 1) {
        Err(
            err @ Error::IndexOutOfRange {
                index: 1, len: 1, ..
            },
        ) => {
            let message = err.to_string();
            assert!(
                message.contains("the 1 regions of the registration"),
                "{message}"
            );
            assert!(!message.contains("prepared"), "{message}");
        }
        other => panic!("expected IndexOutOfRange, got {other:?}"),
    }
    assert!(matches!(
        local.push_blocks(&src, 0, 1024, [3, 4]),
        Err(Error::OutOfBounds { offset: 4096, .. })
    ));
    let mut out = [0u8; 8];
    assert!(matches!(
        src.read(0, 4090, &mut out),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        src.write(0, 4095, &[1, 2]),
        Err(Error::OutOfBounds { .. })
    ));
    assert_eq!(contents(&src), pattern(4096, 61), "nothing was written");
    assert_pair_works(&pair, 8);
}

#[test]
fn local_and_remote_lengths_do_not_match() {
    let (pair, src, dst) = pair_with_buffers("mismatch");
    let base = dst.regions()[0].addr;
    let mut two = LocalDescList::new(MemType::Dram).unwrap();
    two.push(&src, 0, 0, 1024).unwrap();
    two.push(&src, 0, 2048, 1024).unwrap();
    let one = RemoteDescList::from_descs(MemType::Dram, &[XferDesc::new(base, 1024, 0)]).unwrap();
    match pair.request(XferOp::Write, &two, &one, &XferOptions::new()) {
        Err(Error::LengthMismatch {
            local: 2,
            remote: 1,
            ..
        }) => {}
        other => panic!("expected LengthMismatch of counts, got {other:?}"),
    }
    let longer = RemoteDescList::from_descs(
        MemType::Dram,
        &[
            XferDesc::new(base, 1024, 0),
            XferDesc::new(base + 1024, 1025, 0),
        ],
    )
    .unwrap();
    match pair.request(XferOp::Read, &two, &longer, &XferOptions::new()) {
        Err(Error::LengthMismatch {
            local: 1024,
            remote: 1025,
            what,
            ..
        }) => assert!(what.contains('1'), "{what}"),
        other => panic!("expected LengthMismatch of lengths, got {other:?}"),
    }
    // The same through prepared lists.
    let pl = pair.a.prepare_local(&two, &[]).unwrap();
    let pr = pair.a.prepare_remote(pair.b.name(), &longer, &[]).unwrap();
    assert!(matches!(
        pair.a
            .make_xfer_req(XferOp::Write, &pl, &[0, 1], &pr, &[0], &XferOptions::new()),
        Err(Error::LengthMismatch {
            local: 2,
            remote: 1,
            ..
        })
    ));
    assert!(matches!(
        pair.a
            .make_xfer_req(XferOp::Write, &pl, &[1], &pr, &[1], &XferOptions::new()),
        Err(Error::LengthMismatch {
            local: 1024,
            remote: 1025,
            ..
        })
    ));
    assert_pair_works(&pair, 9);
}

#[test]
fn memory_type_mismatch() {
    let (pair, src, _dst) = pair_with_buffers("memtype");
    let mut files = LocalDescList::new(MemType::File).unwrap();
    match files.push(&src, 0, 0, 16) {
        Err(Error::MemTypeMismatch {
            expected: MemType::File,
            found: MemType::Dram,
            ..
        }) => {}
        other => panic!("expected MemTypeMismatch, got {other:?}"),
    }
    // Reading a FILE registration as host memory.
    let posix = pair.a.create_backend("POSIX").unwrap();
    let file = tempfile::tempfile().unwrap();
    file.set_len(64).unwrap();
    let file_reg = pair
        .a
        .register_memory(FileRegion::new(file, 0, 64).unwrap(), &[&posix])
        .unwrap();
    let mut out = [0u8; 4];
    assert!(matches!(
        file_reg.read(0, 0, &mut out),
        Err(Error::MemTypeMismatch {
            expected: MemType::Dram,
            found: MemType::File,
            ..
        })
    ));
    // Partial metadata of registrations of two memory types at once.
    assert!(matches!(
        pair.a.local_partial_metadata(&[&src, &file_reg], &[]),
        Err(Error::MemTypeMismatch { .. })
    ));
    assert_eq!(
        "HBM".parse::<MemType>(),
        Err(nixl::ParseMemTypeError("HBM".to_string()))
    );
    assert_eq!("dram".parse::<MemType>(), Ok(MemType::Dram));
    assert_pair_works(&pair, 10);
}

#[test]
fn unknown_remote_agent() {
    let (pair, src, dst) = pair_with_buffers("unknownremote");
    let hint_says_load = |err: Error| match err {
        Error::Nixl {
            hint: Some(hint), ..
        } => assert!(hint.contains("load_remote_metadata"), "{hint}"),
        other => panic!("expected a NIXL error with a hint, got {other:?}"),
    };
    hint_says_load(
        whole_xfer_req(
            &pair.a,
            XferOp::Write,
            &src,
            &dst,
            "nobody-knows-me",
            &XferOptions::new(),
        )
        .unwrap_err(),
    );
    hint_says_load(
        pair.a
            .prepare_remote("nobody-knows-me", &remote_whole(&dst), &[])
            .unwrap_err(),
    );
    hint_says_load(pair.a.make_connection("nobody-knows-me", &[]).unwrap_err());
    assert!(!pair.a.has_remote_metadata("nobody-knows-me").unwrap());
    assert!(matches!(
        pair.a.invalidate_remote_metadata("nobody-knows-me"),
        Err(Error::Nixl { hint: Some(_), .. })
    ));
    assert_pair_works(&pair, 11);
}

#[test]
fn notification_to_an_unknown_agent() {
    let (pair, _src, _dst) = pair_with_buffers("notifunknown");
    match pair.a.send_notification("nobody-knows-me", &[0xff, 0]) {
        Err(Error::Nixl {
            hint: Some(hint), ..
        }) => assert!(hint.contains("load_remote_metadata"), "{hint}"),
        other => panic!("expected a NIXL error with a hint, got {other:?}"),
    }
    // A real notification still goes through.
    pair.a.send_notification(pair.b.name(), &[0xff, 1]).unwrap();
    assert_eq!(
        common::wait_notifications(&pair.b, pair.a.name(), 1),
        vec![vec![0xff, 1]]
    );
    assert_pair_works(&pair, 12);
}

#[test]
fn garbage_truncated_and_empty_metadata() {
    let (pair, _src, _dst) = pair_with_buffers("badmd");
    let c = Agent::new(&unique_name("badmd-c")).unwrap();
    let _ucx_c = c.create_backend("UCX").unwrap();
    let good = c.local_metadata().unwrap();
    // Rejected by the crate's validator before NIXL sees the bytes.
    for bad in [&b"this is not NIXL metadata"[..], &[0xff; 3]] {
        match pair.a.load_remote_metadata(bad) {
            Err(Error::InvalidMetadata { offset: 0, .. }) => {}
            other => panic!("garbage: got {other:?}"),
        }
    }
    // Cut before the end of the connection info.
    for cut in [1, 8, 64] {
        match pair.a.load_remote_metadata(&good[..cut]) {
            Err(Error::InvalidMetadata { .. }) => {}
            other => panic!(
                "metadata cut to {cut} of {} bytes: got {other:?}",
                good.len()
            ),
        }
    }
    assert!(matches!(
        pair.a.load_remote_metadata(&[]),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(!pair.a.has_remote_metadata(c.name()).unwrap());
    // The whole metadata still loads after all that.
    assert_eq!(pair.a.load_remote_metadata(&good).unwrap(), c.name());
    assert_pair_works(&pair, 13);
}

#[test]
fn metadata_truncated_after_the_connection_info() {
    let (pair, _src, _dst) = pair_with_buffers("truncmd");
    let c = Agent::new(&unique_name("truncmd-c")).unwrap();
    let _ucx_c = c.create_backend("UCX").unwrap();
    let good = c.local_metadata().unwrap();
    // NIXL 1.5.1 itself would load the connection info and then fail, leaving that info
    // behind so that every later load of c is refused; the validator refuses the cut
    // metadata before NIXL sees it, so the whole metadata still loads afterwards.
    match pair.a.load_remote_metadata(&good[..good.len() - 1]) {
        Err(Error::InvalidMetadata { offset, reason }) => {
            assert!(offset < good.len(), "{offset}: {reason}")
        }
        other => panic!("metadata missing its last byte: got {other:?}"),
    }
    assert!(!pair.a.has_remote_metadata(c.name()).unwrap());
    assert_eq!(pair.a.load_remote_metadata(&good).unwrap(), c.name());
    assert_pair_works(&pair, 22);
}

#[test]
fn invalid_names() {
    for name in ["", "nul\0inside"] {
        match Agent::new(name) {
            Err(Error::InvalidName {
                what: "agent name", ..
            }) => {}
            other => panic!("agent name {name:?}: expected InvalidName, got {other:?}"),
        }
    }
    let (pair, src, dst) = pair_with_buffers("names");
    assert!(matches!(
        pair.a.create_backend("U\0CX"),
        Err(Error::InvalidName { .. })
    ));
    assert!(matches!(
        pair.a.create_backend(""),
        Err(Error::InvalidName { .. })
    ));
    for remote_agent in ["b\0", ""] {
        assert!(
            matches!(
                whole_xfer_req(
                    &pair.a,
                    XferOp::Write,
                    &src,
                    &dst,
                    remote_agent,
                    &XferOptions::new()
                ),
                Err(Error::InvalidName { .. })
            ),
            "remote agent name {remote_agent:?}"
        );
    }
    assert!(matches!(
        pair.a.send_notification("", b"x"),
        Err(Error::InvalidName { .. })
    ));
    assert!(matches!(
        pair.a.check_remote_metadata("x\0y", None),
        Err(Error::InvalidName { .. })
    ));
    assert!(matches!(
        pair.a.prepare_remote("", &remote_whole(&dst), &[]),
        Err(Error::InvalidName { .. })
    ));
    assert_pair_works(&pair, 14);
}

#[test]
fn requests_made_before_the_remote_metadata_was_invalidated() {
    let (pair, src, dst) = pair_with_buffers("stale");
    let b = pair.b.name();
    let mut req =
        whole_xfer_req(&pair.a, XferOp::Write, &src, &dst, b, &XferOptions::new()).unwrap();
    let pl = pair.a.prepare_local(&local_whole(&src), &[]).unwrap();
    let pr = pair.a.prepare_remote(b, &remote_whole(&dst), &[]).unwrap();
    pair.a.invalidate_remote_metadata(b).unwrap();
    match req.post() {
        Err(Error::Nixl {
            status: Status::NotFound,
            hint: Some(hint),
            ..
        }) => assert!(hint.contains("make a new request"), "{hint}"),
        other => panic!("expected NotFound with a hint, got {other:?}"),
    }
    assert!(matches!(
        pair.a
            .make_xfer_req(XferOp::Write, &pl, &[0], &pr, &[0], &XferOptions::new()),
        Err(Error::Nixl {
            status: Status::NotFound,
            ..
        })
    ));
    assert_eq!(contents(&dst), vec![0u8; 4096], "nothing was moved");
    drop(req);
    assert_pair_works(&pair, 16);
}

#[test]
fn prepared_index_out_of_range() {
    let (pair, src, dst) = pair_with_buffers("index");
    let mut local = LocalDescList::new(MemType::Dram).unwrap();
    local.push_blocks(&src, 0, 1024, 0..4).unwrap();
    let base = dst.regions()[0].addr;
    let remote = RemoteDescList::from_descs(
        MemType::Dram,
        &(0..4)
            .map(|i| XferDesc::new(base + i * 1024, 1024, 0))
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let pl = pair.a.prepare_local(&local, &[]).unwrap();
    let pr = pair.a.prepare_remote(pair.b.name(), &remote, &[]).unwrap();
    match pair.a.make_xfer_req(
        XferOp::Write,
        &pl,
        &[0, 4],
        &pr,
        &[0, 1],
        &XferOptions::new(),
    ) {
        Err(
            err @ Error::IndexOutOfRange {
                index: 4, len: 4, ..
            },
        ) => assert!(
            err.to_string()
                .contains("index 4 is out of range for the 4 descriptors of the prepared list"),
            "{err}"
        ),
        other => panic!("expected IndexOutOfRange, got {other:?}"),
    }
    assert!(matches!(
        pair.a.make_xfer_req(
            XferOp::Write,
            &pl,
            &[0],
            &pr,
            &[usize::MAX],
            &XferOptions::new()
        ),
        Err(Error::IndexOutOfRange { .. })
    ));
    // Prepared lists of another agent.
    let other = Pair::new("index-other");
    let other_reg = other
        .a
        .register_memory(vec![0u8; 1024], &[&other.ucx_a])
        .unwrap();
    let other_pl = other
        .a
        .prepare_local(&local_whole(&other_reg), &[])
        .unwrap();
    assert!(matches!(
        pair.a.make_xfer_req(
            XferOp::Write,
            &other_pl,
            &[0],
            &pr,
            &[0],
            &XferOptions::new()
        ),
        Err(Error::InvalidArgument { .. })
    ));
    let mut good = pair
        .a
        .make_xfer_req(XferOp::Write, &pl, &[3], &pr, &[0], &XferOptions::new())
        .unwrap();
    good.post_and_wait(WAIT).unwrap();
    assert_eq!(contents(&dst)[..1024], pattern(4096, 61)[3072..]);
    assert_pair_works(&pair, 15);
}

#[test]
fn wrong_memory_type_in_a_prepared_remote_list() {
    let (pair, src, dst) = pair_with_buffers("prepmemtype");
    // b registered DRAM; describing the same addresses as VRAM (or FILE) matches nothing.
    for mem_type in [MemType::Vram, MemType::File] {
        let r = &dst.regions()[0];
        let wrong =
            RemoteDescList::from_descs(mem_type, &[XferDesc::new(r.addr, r.len, 0)]).unwrap();
        let refused = |result: nixl::Result<_>| match result {
            Err(Error::InvalidArgument { reason, .. }) => {
                assert!(
                    reason.contains(&format!("lies in no live {mem_type} registration")),
                    "{reason}"
                )
            }
            Err(other) => panic!("{mem_type}: expected the list to be refused, got {other:?}"),
            Ok(_) => panic!("{mem_type}: expected the list to be refused"),
        };
        refused(pair.a.prepare_remote(pair.b.name(), &wrong, &[]).map(drop));
        refused(
            pair.request(
                XferOp::Write,
                &local_whole(&src),
                &wrong,
                &XferOptions::new(),
            )
            .map(drop),
        );
    }
    assert_pair_works(&pair, 16);
}

#[test]
fn status_before_post() {
    let (pair, src, dst) = pair_with_buffers("nopost");
    let mut req = pair
        .whole_request(XferOp::Write, &src, &dst, &XferOptions::new())
        .unwrap();
    assert!(matches!(req.status(), Err(Error::InvalidArgument { .. })));
    assert!(matches!(req.wait(WAIT), Err(Error::InvalidArgument { .. })));
    assert!(!req.is_in_flight());
    req.post_and_wait(WAIT).unwrap();
    assert_eq!(req.status().unwrap(), XferStatus::Done);
    assert_eq!(contents(&dst), pattern(4096, 61));
    assert_pair_works(&pair, 17);
}

#[test]
fn wait_deadline_passes_and_repost_while_in_flight() {
    let pair = stalled_pair("stalled");
    let data = pattern(1 << 20, 62);
    let (src, dst) = pair.source_and_destination(data.clone());
    pair.exchange();
    // The first transfer to a peer without a progress thread is in flight until b polls.
    let mut req = in_flight_write(&pair, &src, &dst);
    match req.wait(Duration::ZERO) {
        Err(Error::Timeout { .. }) => {}
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(req.is_in_flight(), "a timed-out request stays in flight");
    match req.post() {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("in flight"), "{reason}")
        }
        other => panic!("expected InvalidArgument for a repost, got {other:?}"),
    }
    finish(&pair, &mut req);
    assert!(!req.is_in_flight());
    assert_eq!(contents(&dst), data);
    // Reposting once finished is fine.
    src.write(0, 0, &pattern(1 << 20, 63)).unwrap();
    if req.post().unwrap() == XferStatus::InProgress {
        finish(&pair, &mut req);
    }
    assert_eq!(contents(&dst), pattern(1 << 20, 63));
    drop(req);
    pair.b.notifications().unwrap();
    assert_pair_works(&pair, 18);
}

#[test]
fn deregistration_while_a_list_holds_the_registration() {
    let (pair, src, dst) = pair_with_buffers("inuse");
    let list = local_whole(&src);
    match src.deregister() {
        Err(Error::RegistrationInUse { users: 1 }) => {}
        other => panic!("expected RegistrationInUse, got {other:?}"),
    }
    // The list keeps the memory registered: it still transfers.
    let mut req = pair
        .request(
            XferOp::Write,
            &list,
            &remote_whole(&dst),
            &XferOptions::new(),
        )
        .unwrap();
    req.post_and_wait(WAIT).unwrap();
    assert_eq!(contents(&dst), pattern(4096, 61));
    drop(list);
    drop(req);
    // A registration nobody else holds deregisters cleanly, once (a second call does not
    // compile: see the compile_fail example on Registration::deregister).
    let alone = pair.a.register_memory(vec![1u8; 64], &[]).unwrap();
    alone.deregister().unwrap();
    assert_pair_works(&pair, 19);
}

#[test]
fn backend_of_another_agent() {
    let (pair, src, dst) = pair_with_buffers("foreignbackend");
    let pl_err = pair.a.prepare_local(&local_whole(&src), &[&pair.ucx_b]);
    assert!(matches!(pl_err, Err(Error::InvalidArgument { .. })));
    assert!(matches!(
        pair.a.register_memory(vec![0u8; 8], &[&pair.ucx_b]),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        pair.whole_request(
            XferOp::Write,
            &src,
            &dst,
            &XferOptions::new().backend(&pair.ucx_b)
        ),
        Err(Error::InvalidArgument { .. })
    ));
    assert_pair_works(&pair, 20);
}

#[test]
fn vram_without_a_gpu() {
    let (pair, _src, _dst) = pair_with_buffers("vram");
    // A fake, non-null device address: it must be refused before NIXL or UCX touch it.
    if std::path::Path::new("/dev/nvidia0").exists() {
        common::skip(
            "vram_without_a_gpu",
            "a GPU device node exists; the no-GPU case cannot be shown here",
        );
        return;
    }
    // SAFETY: no GPU is present (checked above).
    let refused = unsafe { common::register_fake_vram(&pair.a, &[&pair.ucx_a]) };
    match refused {
        Err(Error::NoCudaDevice { detail, .. }) => assert!(!detail.is_empty()),
        other => panic!("expected NoCudaDevice, got {other:?}"),
    }
    assert_pair_works(&pair, 21);
}

#[test]
fn abandoning_an_in_flight_request_keeps_its_memory_registered() {
    let pair = stalled_pair("abandon");
    let (src, dst) = pair.source_and_destination(pattern(1 << 20, 64));
    pair.exchange();
    let req = in_flight_write(&pair, &src, &dst);
    // Returns at once instead of waiting; the request's hold on `src` is leaked with it.
    req.abandon();
    match src.deregister() {
        Err(Error::RegistrationInUse { users: 1 }) => {}
        other => {
            panic!("expected the abandoned request to keep the memory registered, got {other:?}")
        }
    }
    assert_eq!(pair.a.leak_stats().requests, 1);
    // The abandoned WRITE still lands once b makes progress: its bytes are accounted for.
    common::wait_until("the abandoned WRITE to land", || {
        pair.b.notifications().unwrap();
        contents(&dst) == pattern(1 << 20, 64)
    });
}
