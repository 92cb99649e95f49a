//! Choosing backends: memory registered with one backend only cannot be moved by another
//! (a typed error), the registered one works, and an empty backend list means every
//! backend that supports the memory type.

mod common;

use common::{contents, file_contents, local_whole, pattern, unique_name, Pair, WAIT};
use nixl::{
    Agent, Backend, Error, FileRegion, MemType, Registration, RemoteDescList, XferDesc, XferOp,
    XferOptions, XferRequest,
};

const LEN: usize = 8192;

/// An agent `a` with UCX and POSIX, and a peer `b` with UCX, metadata exchanged later.
fn setup(prefix: &str) -> (Pair, Backend) {
    let pair = Pair::new(prefix);
    let posix = pair.a.create_backend("POSIX").unwrap();
    let mut plugins: Vec<_> = pair
        .a
        .backends()
        .iter()
        .map(|b| b.plugin().to_string())
        .collect();
    plugins.sort();
    assert_eq!(plugins, ["POSIX", "UCX"]);
    (pair, posix)
}

/// A temp file of `LEN` bytes registered as FILE memory of `agent` with `backends`.
fn file_of(agent: &Agent, backends: &[&Backend]) -> (Registration, std::fs::File) {
    let file = tempfile::tempfile().unwrap();
    file.set_len(LEN as u64).unwrap();
    let reader = file.try_clone().unwrap();
    let reg = agent
        .register_memory(FileRegion::new(file, 0, LEN).unwrap(), backends)
        .unwrap();
    (reg, reader)
}

fn file_list(reg: &Registration) -> RemoteDescList {
    RemoteDescList::from_descs(
        MemType::File,
        &[XferDesc::new(0, LEN, reg.regions()[0].dev_id)],
    )
    .unwrap()
}

/// A WRITE by `agent` of all of `src` into the file of `file_reg`, also of `agent`.
fn to_file(
    agent: &Agent,
    src: &Registration,
    file_reg: &Registration,
    options: &XferOptions,
) -> nixl::Result<XferRequest> {
    agent.create_xfer_req(
        XferOp::Write,
        &local_whole(src),
        &file_list(file_reg),
        agent.name(),
        options,
    )
}

/// Asserts that NIXL refused to create a request because none of the backends it could use
/// holds the registrations.
fn assert_unregistered(result: nixl::Result<XferRequest>) {
    match result {
        // NIXL 1.5.1's C API reports "no backend had the registrations" as a backend error.
        Err(Error::Nixl {
            status: nixl::Status::Backend,
            hint: Some(hint),
            ..
        }) => assert!(hint.contains("registered"), "{hint}"),
        other => panic!("expected a NIXL backend error, got {other:?}"),
    }
}

/// Asserts that NIXL chose `backend` for `req`, then runs it to the end.
fn run_on(backend: &str, mut req: XferRequest) {
    assert_eq!(req.backend().unwrap(), backend);
    req.post_and_wait(WAIT).unwrap();
}

#[test]
fn dram_registered_with_posix_only_cannot_go_over_ucx() {
    let (pair, posix) = setup("posixonly");
    let data = pattern(LEN, 51);
    let src = pair.a.register_memory(data.clone(), &[&posix]).unwrap();
    assert_eq!(src.backends(), std::slice::from_ref(&posix));
    let dst = pair
        .b
        .register_memory(vec![0u8; LEN], &[&pair.ucx_b])
        .unwrap();
    pair.exchange();

    // Over UCX, explicitly or by NIXL's own choice: UCX has no registration of `src`.
    for options in [XferOptions::new().backend(&pair.ucx_a), XferOptions::new()] {
        assert_unregistered(pair.whole_request(XferOp::Write, &src, &dst, &options));
    }
    assert_eq!(contents(&dst), vec![0u8; LEN], "nothing moved");

    // Over POSIX, to a file of the same agent: served.
    let (file_reg, file) = file_of(&pair.a, &[&posix]);
    run_on(
        "POSIX",
        to_file(
            &pair.a,
            &src,
            &file_reg,
            &XferOptions::new().backend(&posix),
        )
        .unwrap(),
    );
    assert_eq!(file_contents(&file), data);
}

#[test]
fn dram_registered_with_ucx_only_cannot_go_to_a_file() {
    let (pair, posix) = setup("ucxonly");
    let data = pattern(LEN, 52);
    let src = pair
        .a
        .register_memory(data.clone(), &[&pair.ucx_a])
        .unwrap();
    let (file_reg, file) = file_of(&pair.a, &[&posix]);

    for options in [XferOptions::new().backend(&posix), XferOptions::new()] {
        assert_unregistered(to_file(&pair.a, &src, &file_reg, &options));
    }
    assert_eq!(
        file_contents(&file),
        vec![0u8; LEN],
        "nothing reached the file"
    );

    // The UCX registration works over UCX.
    let dst = pair
        .b
        .register_memory(vec![0u8; LEN], &[&pair.ucx_b])
        .unwrap();
    pair.exchange();
    run_on(
        "UCX",
        pair.whole_request(
            XferOp::Write,
            &src,
            &dst,
            &XferOptions::new().backend(&pair.ucx_a),
        )
        .unwrap(),
    );
    assert_eq!(contents(&dst), data);
}

#[test]
fn empty_backend_list_registers_with_every_capable_backend() {
    let (pair, _posix) = setup("allbackends");
    let data = pattern(LEN, 53);
    // One registration, no backend named: both UCX and POSIX can move it.
    let src = pair.a.register_memory(data.clone(), &[]).unwrap();
    assert!(src.backends().is_empty());
    let (file_reg, file) = file_of(&pair.a, &[]);
    let dst = pair.b.register_memory(vec![0u8; LEN], &[]).unwrap();
    pair.exchange();

    run_on(
        "POSIX",
        to_file(&pair.a, &src, &file_reg, &XferOptions::new()).unwrap(),
    );
    assert_eq!(file_contents(&file), data);

    run_on(
        "UCX",
        pair.whole_request(XferOp::Write, &src, &dst, &XferOptions::new())
            .unwrap(),
    );
    assert_eq!(contents(&dst), data);
}

#[test]
fn backend_of_another_agent_is_rejected() {
    let (pair, _posix) = setup("foreign");
    let other = Agent::new(&unique_name("foreign-other")).unwrap();
    let other_ucx = other.create_backend("UCX").unwrap();
    match pair.a.register_memory(vec![1u8; 64], &[&other_ucx]) {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains(other.name()), "{reason}")
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    let (src, dst) = pair.source_and_destination(pattern(LEN, 54));
    pair.exchange();
    match pair.whole_request(
        XferOp::Write,
        &src,
        &dst,
        &XferOptions::new().backend(&other_ucx),
    ) {
        Err(Error::InvalidArgument { .. }) => {}
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    common::transfer(&pair.a, XferOp::Write, &src, &dst, pair.b.name()).unwrap();
    assert_eq!(contents(&dst), pattern(LEN, 54));
}
