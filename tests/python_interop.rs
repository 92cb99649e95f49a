//! Interop with NIXL's official Python API (the vendored wheel) in a child process:
//! metadata loaded both ways, a 1 MiB WRITE and a 1 MiB READ checked byte for byte, and
//! non-UTF-8 notifications both ways.

mod common;
mod py;

use common::{contents, pattern, unique_name, wait_notifications};
use nixl::{Agent, RemoteDescList, XferDesc, XferOp, XferOptions};
use py::{hex, peer_pattern, unhex, Peer};

const MIB: usize = 1 << 20;

#[test]
fn rust_and_python_agents_move_data_and_notifications_both_ways() {
    let py_name = unique_name("py-peer");
    let mut peer = Peer::start(&py_name, MIB);
    let agent = Agent::new(&unique_name("rust-peer")).unwrap();
    let ucx = agent.create_backend("UCX").unwrap();

    // Metadata both ways: Rust validates and loads Python's, Python loads Rust's.
    assert_eq!(
        agent.load_remote_metadata(&peer.info.full).unwrap(),
        py_name
    );
    let local = agent.register_memory(vec![0u8; MIB], &[&ucx]).unwrap();
    assert_eq!(peer.load(&agent.local_metadata().unwrap()), agent.name());

    let remote = RemoteDescList::from_descs(
        nixl::MemType::Dram,
        &[XferDesc::new(peer.info.addr, peer.info.len, 0)],
    )
    .unwrap();
    let whole = common::local_whole(&local);

    // 1 MiB READ of the Python agent's buffer.
    agent
        .create_xfer_req(XferOp::Read, &whole, &remote, &py_name, &XferOptions::new())
        .unwrap()
        .post_and_wait(common::WAIT)
        .unwrap();
    assert!(
        contents(&local) == peer_pattern(MIB),
        "READ from Python: bytes differ"
    );

    // 1 MiB WRITE into it.
    let data = pattern(MIB, 99);
    local.write(0, 0, &data).unwrap();
    agent
        .create_xfer_req(
            XferOp::Write,
            &whole,
            &remote,
            &py_name,
            &XferOptions::new(),
        )
        .unwrap()
        .post_and_wait(common::WAIT)
        .unwrap();
    assert!(peer.dump() == data, "WRITE to Python: bytes differ");

    // Non-UTF-8 notifications both ways.
    let to_python = b"\xff\xfe\x00rust\x80".to_vec();
    agent.send_notification(&py_name, &to_python).unwrap();
    assert_eq!(
        unhex(&peer.call(&format!("wait_notif {}", agent.name()))),
        to_python
    );
    let to_rust = b"\x80\x81\x00py\xc3\x28".to_vec();
    assert_eq!(
        peer.call(&format!("notify {} {}", agent.name(), hex(&to_rust))),
        "ok"
    );
    assert_eq!(wait_notifications(&agent, &py_name, 1), vec![to_rust]);
}

#[test]
fn python_metadata_of_every_kind_validates_and_loads() {
    let py_name = unique_name("py-kinds");
    let peer = Peer::start(&py_name, 4096);
    let info = &peer.info;
    for (kind, md) in [
        ("full", &info.full),
        ("partial with connection info", &info.partial_conn),
        ("partial without connection info", &info.partial),
        ("connection only", &info.conn),
    ] {
        nixl::validate_metadata(md).unwrap_or_else(|e| panic!("{kind}: {e}"));
    }
    let loader = |label: &str| {
        let agent = Agent::new(&unique_name(label)).unwrap();
        let ucx = agent.create_backend("UCX").unwrap();
        (agent, ucx)
    };
    for md in [&info.full, &info.partial_conn, &info.conn] {
        let (agent, _ucx) = loader("py-kinds-loader");
        assert_eq!(agent.load_remote_metadata(md).unwrap(), py_name);
    }
    // Descriptors without connection info load once the connection info is there.
    let (agent, _ucx) = loader("py-kinds-partial");
    agent.load_remote_metadata(&info.conn).unwrap();
    assert_eq!(agent.load_remote_metadata(&info.partial).unwrap(), py_name);
}

#[test]
fn python_metadata_with_other_ucx_address_formats_validates_and_loads() {
    for env in [
        &[("UCX_ADDRESS_VERSION", "v2")][..],
        &[("UCX_ADDRESS_DEBUG_INFO", "y")],
        &[
            ("UCX_ADDRESS_VERSION", "v2"),
            ("UCX_ADDRESS_DEBUG_INFO", "y"),
        ],
        &[("UCX_TLS", "tcp")],
    ] {
        let py_name = unique_name("py-ucx-env");
        let peer = Peer::start_with_env(&py_name, 4096, env);
        for md in [&peer.info.full, &peer.info.conn] {
            nixl::validate_metadata(md).unwrap_or_else(|e| panic!("{env:?}: {e}"));
            let agent = Agent::new(&unique_name("py-ucx-env-loader")).unwrap();
            let _ucx = agent.create_backend("UCX").unwrap();
            assert_eq!(agent.load_remote_metadata(md).unwrap(), py_name, "{env:?}");
        }
    }
}
