//! Metadata of an agent of this process, forged (renamed, a descriptor moved, its UCX
//! worker UUID changed), never makes NIXL write into this process's memory: it is refused
//! when it is loaded, and the bytes it aimed at stay as they were. So is the metadata of an
//! agent of another process whose cma or posix address names a thread of this process.
//! Under UCX's unified mode, where a worker address cannot be checked, UCX connection info
//! is refused whole.

mod common;

use std::process::{Child, Stdio};

use common::{after_tag, hex, local_whole, role_process, stdout_lines, unhex, unique_name, WAIT};
use nixl::{Agent, Error, MemType, RemoteDescList, XferDesc, XferOp, XferOptions};

/// Offset of the payload of the first field whose tag and length start right after `marker`.
fn payload(md: &[u8], marker: &[u8]) -> usize {
    let at = md
        .windows(marker.len())
        .position(|w| w == marker)
        .expect("marker in the metadata");
    at + marker.len() + 8
}

/// `md` with the agent name's last byte changed (same length, so nothing else moves).
fn renamed(md: &[u8], name: &str) -> (Vec<u8>, String) {
    let at = payload(md, b"|Agent");
    assert_eq!(&md[at..at + name.len()], name.as_bytes());
    let mut forged = md.to_vec();
    let last = at + name.len() - 1;
    forged[last] = if forged[last] == b'a' { b'b' } else { b'a' };
    let new_name = String::from_utf8(forged[at..at + name.len()].to_vec()).unwrap();
    (forged, new_name)
}

/// Offset of the address of the first descriptor of the first memory section.
fn first_descriptor(md: &[u8]) -> usize {
    // "nixlSDList|", then t (4-byte payload) and n (8-byte payload), then the descriptor.
    payload(md, b"nixlSDList|") - 8 + (1 + 8 + 4 + 1) + (1 + 8 + 8 + 1) + 8
}

/// An agent with a UCX backend.
fn agent(prefix: &str) -> Agent {
    let agent = Agent::new(&unique_name(prefix)).unwrap();
    agent.create_backend("UCX").unwrap();
    agent
}

fn assert_refused(result: nixl::Result<String>, victim: &str) {
    match result {
        Err(err @ Error::MetadataLeadsIntoThisProcess { .. }) => {
            let text = err.to_string();
            assert!(text.contains("leads into this process"), "{text}");
            assert!(text.contains(victim), "names the agent it leads to: {text}");
        }
        other => panic!("expected the forged metadata to be refused, got {other:?}"),
    }
}

/// Tries to WRITE 4096 bytes of 0xEE from `loader` to `addr` on `remote`; must fail.
fn write_must_fail(loader: &Agent, remote: &str, addr: usize) {
    let src = loader.register_memory(vec![0xEEu8; 4096], &[]).unwrap();
    let target = RemoteDescList::from_descs(MemType::Dram, &[XferDesc::new(addr, 4096, 0)]);
    let result = loader
        .create_xfer_req(
            XferOp::Write,
            &local_whole(&src),
            &target.unwrap(),
            remote,
            &XferOptions::new(),
        )
        .and_then(|mut request| request.post_and_wait(WAIT));
    assert!(result.is_err(), "the WRITE through {remote:?} went through");
}

#[test]
fn renamed_metadata_of_an_agent_of_this_process_is_refused() {
    let loader = agent("forged-loader");
    let victim = agent("forged-victim");
    let reg = victim.register_memory(vec![0u8; 4096], &[]).unwrap();
    let addr = reg.regions()[0].addr;
    let (forged, new_name) = renamed(&victim.local_metadata().unwrap(), victim.name());
    // The registration goes, and malloc hands its chunk to the next Vec of that size.
    drop(reg);
    let reused = vec![0x5Au8; 4096];
    assert_refused(loader.load_remote_metadata(&forged), victim.name());
    write_must_fail(&loader, &new_name, addr);
    assert!(
        reused.iter().all(|&b| b == 0x5A),
        "the reused memory was written"
    );
    assert!(!loader.has_remote_metadata(&new_name).unwrap());
}

#[test]
fn a_descriptor_moved_to_unregistered_memory_is_never_reached() {
    let loader = agent("moved-loader");
    let victim = agent("moved-victim");
    let _reg = victim.register_memory(vec![0u8; 4096], &[]).unwrap();
    let unregistered = vec![0x5Au8; 4096];
    let target = unregistered.as_ptr() as usize;
    let mut md = victim.local_metadata().unwrap();
    let at = first_descriptor(&md);
    assert_eq!(
        u64::from_le_bytes(md[at..at + 8].try_into().unwrap()),
        _reg.regions()[0].addr as u64
    );
    md[at..at + 8].copy_from_slice(&(target as u64).to_le_bytes());

    // Under another name: refused at the load.
    let (forged, new_name) = renamed(&md, victim.name());
    assert_refused(loader.load_remote_metadata(&forged), victim.name());
    write_must_fail(&loader, &new_name, target);

    // Under the victim's own name it is that agent of this process, held to its live
    // registrations: the load passes, the WRITE to memory it never registered does not.
    assert_eq!(loader.load_remote_metadata(&md).unwrap(), victim.name());
    let src = loader.register_memory(vec![0xEEu8; 4096], &[]).unwrap();
    let remote = RemoteDescList::from_descs(MemType::Dram, &[XferDesc::new(target, 4096, 0)]);
    match loader.create_xfer_req(
        XferOp::Write,
        &local_whole(&src),
        &remote.unwrap(),
        victim.name(),
        &XferOptions::new(),
    ) {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(
                reason.contains("lies in no live DRAM registration"),
                "{reason}"
            );
            assert!(reason.contains(&format!("{target:#x}")), "{reason}");
        }
        other => panic!("expected the unregistered target to be refused, got {other:?}"),
    }
    assert!(unregistered.iter().all(|&b| b == 0x5A));
}

#[test]
fn a_changed_worker_uuid_does_not_hide_the_worker() {
    let loader = agent("uuid-loader");
    let victim = agent("uuid-victim");
    let _reg = victim.register_memory(vec![0u8; 4096], &[]).unwrap();
    let (mut forged, _) = renamed(&victim.local_metadata().unwrap(), victim.name());
    let address = payload(&forged, b"UCX|c");
    // A v1 address (version nibble 0) always carries the UUID, right after its header.
    assert_eq!(forged[address] & 0x0f, 0);
    for byte in &mut forged[address + 1..address + 9] {
        *byte ^= 0xA5;
    }
    // Its transport addresses (cma to this pid, shared memory, TCP) still lead here.
    assert_refused(loader.load_remote_metadata(&forged), victim.name());
}

#[test]
fn metadata_of_a_dropped_agent_of_this_process_is_refused() {
    let loader = agent("dropped-loader");
    let gone = agent("dropped-victim");
    let md = gone.local_metadata().unwrap();
    let name = gone.name().to_string();
    drop(gone);
    // Its worker is gone, but its cma address is still this process, under a name no
    // agent of this process has any more.
    match loader.load_remote_metadata(&md) {
        Err(Error::MetadataLeadsIntoThisProcess { agent, reason }) => {
            assert_eq!(agent, name);
            assert!(reason.contains("this process"), "{reason}");
        }
        other => panic!("expected the refusal, got {other:?}"),
    }
}

const UNIFIED_ENV: &str = "NIXL_RS_TEST_UNIFIED_MODE";

/// Run in a child process with `UCX_UNIFIED_MODE=y`: metadata with UCX connection info is
/// refused, by the validation and by `load_remote_metadata`, with a reason that names the
/// setting.
#[test]
#[ignore = "the child process of ucx_unified_mode_refuses_ucx_connection_info, which starts it"]
fn unified_mode_role() {
    assert!(
        std::env::var_os(UNIFIED_ENV).is_some(),
        "run only as the child of the unified-mode test"
    );
    let peer = agent("unified-peer");
    let loader = agent("unified-loader");
    let md = peer.local_metadata().unwrap();
    for err in [
        nixl::validate_metadata(&md).unwrap_err(),
        loader.load_remote_metadata(&md).unwrap_err(),
    ] {
        match &err {
            Error::InvalidMetadata { reason, .. } if reason.contains("UCX_UNIFIED_MODE") => {}
            other => panic!("expected InvalidMetadata naming UCX_UNIFIED_MODE, got {other:?}"),
        }
    }
    assert!(
        !loader.has_remote_metadata(peer.name()).unwrap(),
        "nothing was loaded"
    );
    println!("REFUSED");
}

#[test]
fn ucx_unified_mode_refuses_ucx_connection_info() {
    let mut child = common::role_process(
        "unified_mode_role",
        &[(UNIFIED_ENV, "1"), ("UCX_UNIFIED_MODE", "y")],
        std::process::Stdio::inherit(),
    );
    let mut lines = common::stdout_lines(&mut child);
    let refused = common::after_tag(&mut lines, "REFUSED");
    let status = child.wait().unwrap();
    assert!(status.success(), "the unified-mode child failed: {status}");
    assert!(refused.is_some(), "the child reached its end");
}

const PEER_ENV: &str = "NIXL_RS_TEST_FORGED_PEER";

/// An agent of another process, run as a child: registers 4096 bytes, prints its metadata
/// and lives until its parent closes its stdin.
#[test]
#[ignore = "the peer of the tests of other processes' metadata, which start it"]
fn forged_peer_role() {
    let name = std::env::var(PEER_ENV).expect("run by the parent test");
    let agent = Agent::new(&name).unwrap();
    agent.create_backend("UCX").unwrap();
    let _reg = agent.register_memory(vec![0u8; 4096], &[]).unwrap();
    println!("MD {}", hex(&agent.local_metadata().unwrap()));
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// The peer process; dropped, it closes the peer's stdin and waits for it.
struct Peer {
    child: Child,
    name: String,
    metadata: Vec<u8>,
}

impl Peer {
    fn start() -> Peer {
        Peer::start_with(&[])
    }

    /// A peer with `env` set too (UCX settings).
    fn start_with(env: &[(&str, &str)]) -> Peer {
        let name = unique_name("forged-peer");
        let mut env = env.to_vec();
        env.push((PEER_ENV, &name));
        let mut child = role_process("forged_peer_role", &env, Stdio::null());
        let metadata = after_tag(&mut stdout_lines(&mut child), "MD ").map(|hex| unhex(&hex));
        Peer {
            child,
            name,
            metadata: metadata.expect("the peer prints its metadata"),
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// A pid field of a UCX worker address: where it is, its width and how many low bits
/// hold the pid.
struct PidField {
    at: usize,
    width: usize,
    bits: u32,
}

impl PidField {
    fn read(&self, md: &[u8]) -> u64 {
        let mut raw = [0u8; 8];
        raw[..self.width].copy_from_slice(&md[self.at..self.at + self.width]);
        u64::from_le_bytes(raw)
    }

    /// `md` with this field naming `pid` instead, its flags and other bits kept.
    fn set(&self, md: &[u8], pid: u32) -> Vec<u8> {
        let mask = (1u64 << self.bits) - 1;
        let raw = (self.read(md) & !mask) | u64::from(pid);
        let mut forged = md.to_vec();
        forged[self.at..self.at + self.width].copy_from_slice(&raw.to_le_bytes()[..self.width]);
        forged
    }
}

/// The cma pid (a u32, bit 31 a flag) and the posix FIFO's `/proc` segment id (a u64: bit
/// 63 set, the pid in its low 30 bits) that name `pid` in `md`'s UCX worker address.
fn pid_fields(md: &[u8], pid: u32) -> (PidField, PidField) {
    let address = payload(md, b"UCX|c");
    let len = u64::from_le_bytes(md[address - 8..address].try_into().unwrap()) as usize;
    let worker = address..address + len;
    let posix: Vec<usize> = worker
        .clone()
        .filter(|&at| at + 8 <= worker.end)
        .filter(|&at| {
            let v = u64::from_le_bytes(md[at..at + 8].try_into().unwrap());
            v >> 63 == 1
                && v & ((1 << 30) - 1) == u64::from(pid)
                && (v >> 30) & ((1 << 30) - 1) < 1 << 20
        })
        .collect();
    let cma: Vec<usize> = worker
        .clone()
        .filter(|&at| at + 4 <= worker.end && !posix.contains(&at))
        .filter(|&at| u32::from_le_bytes(md[at..at + 4].try_into().unwrap()) & !(1 << 31) == pid)
        .collect();
    assert_eq!(
        (cma.len(), posix.len()),
        (1, 1),
        "one cma and one posix address of pid {pid} in the worker address"
    );
    (
        PidField {
            at: cma[0],
            width: 4,
            bits: 31,
        },
        PidField {
            at: posix[0],
            width: 8,
            bits: 30,
        },
    )
}

#[test]
fn a_thread_id_of_this_process_in_a_peers_address_is_refused() {
    let loader = agent("thread-loader");
    let peer = Peer::start();
    // Memory of this process that no agent registered, advertised as the peer's.
    let secret = vec![0x5Au8; 4096];
    let mut md = peer.metadata.clone();
    let at = first_descriptor(&md);
    md[at..at + 8].copy_from_slice(&(secret.as_ptr() as u64).to_le_bytes());
    let (cma, posix) = pid_fields(&md, peer.child.id());
    let (tx, rx) = std::sync::mpsc::channel();
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        // SAFETY: gettid has no preconditions.
        tx.send(unsafe { libc::gettid() } as u32).unwrap();
        stopped.recv().ok();
    });
    let tid = rx.recv().unwrap();
    assert_ne!(tid, std::process::id());
    for (field, transport) in [(cma, "cma address"), (posix, "posix FIFO")] {
        let forged = field.set(&md, tid);
        match loader.load_remote_metadata(&forged) {
            Err(Error::MetadataLeadsIntoThisProcess { agent, reason }) => {
                assert_eq!(agent, peer.name);
                assert!(reason.contains(transport), "{reason}");
                assert!(
                    reason.contains(&format!("designates thread {tid} of this process")),
                    "names what the address designates: {reason}"
                );
            }
            other => panic!("expected the {transport} naming thread {tid} refused, got {other:?}"),
        }
        write_must_fail(&loader, &peer.name, secret.as_ptr() as usize);
    }
    drop(stop);
    thread.join().unwrap();
    assert!(secret.iter().all(|&b| b == 0x5A), "the secret was written");
    // The peer's own pid is another thread group: its metadata loads.
    assert_eq!(
        loader.load_remote_metadata(&peer.metadata).unwrap(),
        peer.name
    );
}

/// The System V segments process `pid` created, from `/proc/sysvipc/shm`.
fn segments_of(pid: u32) -> Vec<u64> {
    let text = std::fs::read_to_string("/proc/sysvipc/shm").unwrap();
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // key shmid perms size cpid ...
            (fields.get(4)?.parse::<u32>().ok()? == pid).then(|| fields.get(1)?.parse().ok())?
        })
        .collect()
}

#[test]
fn a_sysv_id_beyond_the_c_int_ucx_uses_is_refused() {
    let loader = agent("sysv-loader");
    let peer = Peer::start();
    let md = &peer.metadata;
    let address = payload(md, b"UCX|c");
    let len = u64::from_le_bytes(md[address - 8..address].try_into().unwrap()) as usize;
    let segments = segments_of(peer.child.id());
    let at = (address..address + len - 8)
        .find(|&at| segments.contains(&u64::from_le_bytes(md[at..at + 8].try_into().unwrap())))
        .expect("the peer's sysv FIFO segment in its worker address");
    // UCX's shmat(int) would take the low 32 bits: the peer's own segment, other bytes.
    for high in [1u64 << 32, 1 << 31] {
        let mut forged = md.clone();
        let id = u64::from_le_bytes(md[at..at + 8].try_into().unwrap()) | high;
        forged[at..at + 8].copy_from_slice(&id.to_le_bytes());
        for err in [
            nixl::validate_metadata(&forged).unwrap_err(),
            loader.load_remote_metadata(&forged).unwrap_err(),
        ] {
            match err {
                Error::InvalidMetadata { offset, reason } => {
                    assert_eq!(offset, at);
                    assert!(reason.contains("does not fit the C int"), "{reason}");
                }
                other => panic!("expected InvalidMetadata for sysv id {id:#x}, got {other:?}"),
            }
        }
    }
    assert!(!loader.has_remote_metadata(&peer.name).unwrap());
}

#[test]
fn an_agent_refusing_same_host_transports_refuses_a_peer_offering_them_here() {
    let strict = Agent::builder(&unique_name("strict-loader"))
        .refuse_same_host_transports(true)
        .build()
        .unwrap();
    strict.create_backend("UCX").unwrap();
    // A peer on this host with UCX's default transports.
    let peer = Peer::start();
    match strict.load_remote_metadata(&peer.metadata) {
        Err(err @ Error::SameHostTransportRefused { .. }) => {
            let text = err.to_string();
            assert!(text.contains(&format!("{:?}", peer.name)), "{text}");
            assert!(text.contains("UCX_TLS=^cma,posix,sysv,xpmem"), "{text}");
        }
        other => panic!("expected the same-host peer refused, got {other:?}"),
    }
    assert!(!strict.has_remote_metadata(&peer.name).unwrap());
    // By default it loads.
    let lenient = agent("lenient-loader");
    assert_eq!(
        lenient.load_remote_metadata(&peer.metadata).unwrap(),
        peer.name
    );
    // A peer on this host without them loads, and a READ from it goes through (over TCP).
    let tcp_peer = Peer::start_with(&[("UCX_TLS", "^cma,posix,sysv,xpmem")]);
    assert_eq!(
        strict.load_remote_metadata(&tcp_peer.metadata).unwrap(),
        tcp_peer.name
    );
    let at = first_descriptor(&tcp_peer.metadata);
    let addr = u64::from_le_bytes(tcp_peer.metadata[at..at + 8].try_into().unwrap());
    let dst = strict.register_memory(vec![0xEEu8; 4096], &[]).unwrap();
    let remote =
        RemoteDescList::from_descs(MemType::Dram, &[XferDesc::new(addr as usize, 4096, 0)])
            .unwrap();
    strict
        .create_xfer_req(
            XferOp::Read,
            &local_whole(&dst),
            &remote,
            &tcp_peer.name,
            &XferOptions::new(),
        )
        .and_then(|mut request| request.post_and_wait(WAIT))
        .unwrap();
    assert!(
        common::contents(&dst).iter().all(|&b| b == 0),
        "the READ brought the peer's zeros"
    );
}
