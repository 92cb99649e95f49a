//! A remote descriptor of an agent in another process must lie in memory that agent's
//! loaded metadata advertises: anything else is refused before NIXL sees it, naming the
//! descriptor.

mod common;

use std::process::{Child, Stdio};

use common::{
    after_tag, hex, local_whole, pattern, role_process, stdout_lines, unhex, unique_name, WAIT,
};
use nixl::{Agent, Error, MemType, RemoteDescList, XferDesc, XferOp, XferOptions};

const ROLE_ENV: &str = "NIXL_RS_TEST_REMOTE_DESCRIPTORS_PEER";
const LEN: usize = 64 << 10;

/// The peer, run in a child process: registers two buffers, prints its metadata and their
/// addresses, and lives until its parent closes its stdin.
#[test]
#[ignore = "the peer of the tests in this file, which start it"]
fn peer_role() {
    assert!(
        std::env::var_os(ROLE_ENV).is_some(),
        "run by the parent test"
    );
    let agent = Agent::new(&std::env::var(ROLE_ENV).unwrap()).unwrap();
    agent.create_backend("UCX").unwrap();
    let regs: Vec<_> = (0..2)
        .map(|i| agent.register_memory(pattern(LEN, i), &[]).unwrap())
        .collect();
    println!("MD {}", hex(&agent.local_metadata().unwrap()));
    println!(
        "ADDR {} {}",
        regs[0].regions()[0].addr,
        regs[1].regions()[0].addr
    );
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// The peer process; dropped, it closes the peer's stdin and waits for it.
struct Peer {
    child: Child,
    name: String,
    metadata: Vec<u8>,
    addrs: [usize; 2],
}

impl Peer {
    fn start() -> Peer {
        let name = unique_name("remote-desc-peer");
        let mut child = role_process("peer_role", &[(ROLE_ENV, &name)], Stdio::null());
        let mut lines = stdout_lines(&mut child);
        let metadata = after_tag(&mut lines, "MD ").map(|hex| unhex(&hex));
        let addrs = after_tag(&mut lines, "ADDR ").map(|rest| {
            let mut it = rest.split(' ').map(|a| a.parse().unwrap());
            [it.next().unwrap(), it.next().unwrap()]
        });
        Peer {
            child,
            name,
            metadata: metadata.expect("the peer prints its metadata"),
            addrs: addrs.expect("the peer prints its addresses"),
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

fn refused(result: nixl::Result<()>, index: usize, desc: XferDesc) {
    match result {
        Err(Error::InvalidArgument { reason, .. }) => {
            let named = format!(
                "remote descriptor {index} ({:#x}, {} bytes, device {})",
                desc.addr, desc.len, desc.dev_id
            );
            assert!(reason.contains(&named), "{reason}");
            assert!(reason.contains("loaded metadata advertises"), "{reason}");
        }
        other => panic!("expected {desc:?} to be refused, got {other:?}"),
    }
}

#[test]
fn descriptors_outside_what_a_peer_advertised_are_refused() {
    let peer = Peer::start();
    let agent = Agent::new(&unique_name("remote-desc")).unwrap();
    agent.create_backend("UCX").unwrap();
    assert_eq!(
        agent.load_remote_metadata(&peer.metadata).unwrap(),
        peer.name
    );
    let dst = agent.register_memory(vec![0u8; 4096], &[]).unwrap();
    let mut local = nixl::LocalDescList::new(MemType::Dram).unwrap();
    local.push_region(&dst, 0).unwrap();
    local.push_region(&dst, 0).unwrap();
    let [first, second] = peer.addrs;
    let good = XferDesc::new(second + 4096, 4096, 0);
    for bad in [
        XferDesc::new(first + LEN - 100, 4096, 0), // runs past the end of a registration
        XferDesc::new(first.min(second) - 8192, 4096, 0), // never registered
        XferDesc::new(first, 4096, 1),             // another device
    ] {
        let remote = RemoteDescList::from_descs(MemType::Dram, &[good, bad]).unwrap();
        let made = agent.create_xfer_req(
            XferOp::Read,
            &local,
            &remote,
            &peer.name,
            &XferOptions::new(),
        );
        refused(made.map(drop), 1, bad);
        refused(
            agent.prepare_remote(&peer.name, &remote, &[]).map(drop),
            1,
            bad,
        );
    }
    // Inside: NIXL gets the request, and the bytes arrive.
    let remote = RemoteDescList::from_descs(MemType::Dram, &[good]).unwrap();
    agent
        .create_xfer_req(
            XferOp::Read,
            &local_whole(&dst),
            &remote,
            &peer.name,
            &XferOptions::new(),
        )
        .unwrap()
        .post_and_wait(WAIT)
        .unwrap();
    assert_eq!(common::contents(&dst), pattern(LEN, 1)[4096..8192]);
}
