//! The less common parts of NIXL's C API: querying memory, memory views, notifications
//! restricted to a backend, and backend checks on every call that takes backends.

mod common;

use std::io::Write;
use std::os::fd::AsRawFd;

use common::{pattern, unique_name, Pair, WAIT};
use nixl::{Agent, Error, LocalDescList, MemType, PeerDesc, RegDesc, Status, XferDesc};

#[test]
fn query_memory_describes_files_through_posix() {
    let agent = Agent::new(&unique_name("query")).unwrap();
    let posix = agent.create_backend("POSIX").unwrap();
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(&pattern(4096, 3)).unwrap();
    let path = file.path().to_str().unwrap().as_bytes().to_vec();
    let desc = RegDesc {
        addr: 0,
        len: 4096,
        dev_id: file.as_file().as_raw_fd() as u64,
        metadata: path,
    };
    let answers = agent
        .query_memory(MemType::File, &[desc], &[&posix])
        .unwrap();
    assert_eq!(answers.len(), 1, "one answer per descriptor: {answers:?}");
    // POSIX answers with the file's stat: its size and a regular file's mode.
    let stat = answers[0].as_ref().expect("POSIX describes the file");
    assert_eq!(
        stat.get("size").map(String::as_str),
        Some("4096"),
        "{stat:?}"
    );
    let mode: u32 = stat["mode"].parse().expect("numeric mode");
    assert_eq!(mode & libc::S_IFMT, libc::S_IFREG, "{stat:?}");
    // An empty list is refused before NIXL sees it, like everywhere else.
    assert!(matches!(
        agent.query_memory(
            MemType::File,
            &[RegDesc {
                len: 0,
                ..RegDesc::default()
            }],
            &[&posix]
        ),
        Err(Error::ZeroLength { .. })
    ));
}

#[test]
fn memory_views_fail_cleanly_without_device_support() {
    let pair = Pair::new("memview");
    let reg = pair
        .a
        .register_memory(vec![1u8; 4096], &[&pair.ucx_a])
        .unwrap();
    let dst = pair
        .b
        .register_memory(vec![0u8; 4096], &[&pair.ucx_b])
        .unwrap();
    pair.exchange();
    let mut local = LocalDescList::new(MemType::Dram).unwrap();
    local.push_region(&reg, 0).unwrap();
    // This build's UCX has no device API without a GPU: NIXL's backend refuses, with a
    // typed error and no crash. With a GPU a view may be made; it is released on drop.
    let gpu = std::path::Path::new("/dev/nvidia0").exists();
    let check = |made: nixl::Result<nixl::MemView>| match made {
        Ok(view) if gpu => assert!(!view.as_raw().is_null()),
        Err(Error::Nixl {
            status: Status::Backend,
            ..
        }) => {}
        other => panic!("expected NIXL's backend to refuse a memory view, got {other:?}"),
    };
    check(pair.a.prepare_local_mem_view(&local, &[&pair.ucx_a]));
    let peer = PeerDesc {
        desc: XferDesc::new(dst.regions()[0].addr, 4096, 0),
        agent: pair.b.name().to_string(),
    };
    check(
        pair.a
            .prepare_remote_mem_view(MemType::Dram, &[peer], &[&pair.ucx_a]),
    );
    assert!(matches!(
        pair.a.prepare_remote_mem_view(MemType::Dram, &[], &[]),
        Err(Error::EmptyDescList { .. })
    ));
    common::assert_pair_works(&pair, 40);
}

#[test]
fn notifications_through_a_chosen_backend() {
    let pair = Pair::new("notif-via");
    let _ = pair
        .a
        .register_memory(vec![0u8; 64], &[&pair.ucx_a])
        .unwrap();
    let _ = pair
        .b
        .register_memory(vec![0u8; 64], &[&pair.ucx_b])
        .unwrap();
    pair.exchange();
    pair.a
        .send_notification_via(pair.b.name(), b"\xff\x00via-ucx", &[&pair.ucx_a])
        .unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    let got = loop {
        let mut notes = pair.b.notifications_via(&[&pair.ucx_b]).unwrap();
        if let Some(messages) = notes.remove(pair.a.name()) {
            break messages;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "notification never arrived"
        );
        std::thread::yield_now();
    };
    assert_eq!(got, vec![b"\xff\x00via-ucx".to_vec()]);
}

#[test]
fn backends_of_another_agent_are_refused_everywhere() {
    let pair = Pair::new("foreign");
    let reg = pair
        .a
        .register_memory(vec![0u8; 64], &[&pair.ucx_a])
        .unwrap();
    pair.exchange();
    let foreign = [&pair.ucx_b];
    let refused = |result: nixl::Result<()>| matches!(result, Err(Error::InvalidArgument { .. }));
    assert!(refused(pair.a.send_notification_via(
        pair.b.name(),
        b"x",
        &foreign
    )));
    assert!(refused(pair.a.notifications_via(&foreign).map(|_| ())));
    assert!(refused(pair.a.make_connection(pair.b.name(), &foreign)));
    assert!(refused(
        pair.a.local_partial_metadata(&[&reg], &foreign).map(|_| ())
    ));
    assert!(refused(
        pair.a
            .query_memory(MemType::Dram, reg.regions(), &foreign)
            .map(|_| ())
    ));
    assert!(refused(
        pair.a.register_memory(vec![0u8; 64], &foreign).map(|_| ())
    ));
    common::assert_pair_works(&pair, 41);
}
