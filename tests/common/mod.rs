//! Helpers shared by the integration tests: unique agent names, connected agent pairs,
//! byte patterns, bounded waits for notifications and metadata, free TCP ports, child
//! processes that run a role test.
//!
//! Every test binary compiles this module and uses a different part of it.
#![allow(dead_code)]

pub mod executor;
mod netns;
mod role;
mod skip;
mod tracked;

// Not every test binary uses each.
#[allow(unused_imports)]
pub use netns::netns_unavailable;
#[allow(unused_imports)]
pub use role::{after_tag, hex, role_process, stdout_lines, unhex, ChildLines};
#[allow(unused_imports)]
pub use skip::skip;
#[allow(unused_imports)]
pub use tracked::Tracked;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl::{
    Agent, Backend, LocalDescList, RegisterMemory, Registration, RemoteDescList, XferDesc, XferOp,
    XferOptions, XferRequest, XferStatus,
};

/// Upper bound for any single wait in the tests. Only a guard against hangs: nothing asserts
/// how fast anything is.
pub const WAIT: Duration = Duration::from_secs(60);

/// A tokio runtime with two worker threads, as a small service would run.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// A name no other agent in this process (or in a parallel test process) uses.
pub fn unique_name(prefix: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// `len` bytes that differ from position to position and from seed to seed.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
        .collect()
}

/// Copies all of DRAM region 0 of `reg`.
pub fn contents(reg: &Registration) -> Vec<u8> {
    let mut out = vec![0u8; reg.regions()[0].len];
    reg.read(0, 0, &mut out).expect("read registered memory");
    out
}

/// Two agents with a UCX backend each, each holding the other's metadata.
pub struct Pair {
    pub a: Agent,
    pub b: Agent,
    pub ucx_a: Backend,
    pub ucx_b: Backend,
}

impl Pair {
    /// Creates the agents and backends; metadata is exchanged by [`Pair::exchange`].
    pub fn new(prefix: &str) -> Pair {
        Pair::with(
            Agent::new(&unique_name(&format!("{prefix}-a"))).expect("create agent a"),
            Agent::new(&unique_name(&format!("{prefix}-b"))).expect("create agent b"),
        )
    }

    /// Wraps two agents, adding a UCX backend to each.
    pub fn with(a: Agent, b: Agent) -> Pair {
        let ucx_a = a.create_backend("UCX").expect("UCX backend on a");
        let ucx_b = b.create_backend("UCX").expect("UCX backend on b");
        Pair { a, b, ucx_a, ucx_b }
    }

    /// Loads each agent's full metadata into the other (call after registering memory).
    pub fn exchange(&self) {
        let b_name = self
            .a
            .load_remote_metadata(&self.b.local_metadata().expect("b metadata"))
            .expect("a loads b");
        assert_eq!(b_name, self.b.name());
        let a_name = self
            .b
            .load_remote_metadata(&self.a.local_metadata().expect("a metadata"))
            .expect("b loads a");
        assert_eq!(a_name, self.a.name());
    }

    /// Registers `a_mem` on `a` with its UCX backend and `b_mem` on `b` with its; metadata
    /// is not exchanged.
    pub fn register<M: RegisterMemory + 'static>(
        &self,
        a_mem: M,
        b_mem: M,
    ) -> (Registration, Registration) {
        let on_a = self
            .a
            .register_memory(a_mem, &[&self.ucx_a])
            .expect("register on a");
        let on_b = self
            .b
            .register_memory(b_mem, &[&self.ucx_b])
            .expect("register on b");
        (on_a, on_b)
    }

    /// A request of `a` moving `local` to/from `remote`, memory of `b`, with `options`.
    pub fn request(
        &self,
        op: XferOp,
        local: &LocalDescList,
        remote: &RemoteDescList,
        options: &XferOptions,
    ) -> nixl::Result<XferRequest> {
        self.a
            .create_xfer_req(op, local, remote, self.b.name(), options)
    }

    /// A request of `a` moving all of `local` (a registration of `a`) to/from all of
    /// `remote` (a registration of `b`), with `options`.
    pub fn whole_request(
        &self,
        op: XferOp,
        local: &Registration,
        remote: &Registration,
        options: &XferOptions,
    ) -> nixl::Result<XferRequest> {
        whole_xfer_req(&self.a, op, local, remote, self.b.name(), options)
    }

    /// `data` registered on `a` as the source of a WRITE and as many zeroed bytes on `b` as
    /// its destination (see [`Pair::register`]); returns (source, destination).
    pub fn source_and_destination(&self, data: Vec<u8>) -> (Registration, Registration) {
        let len = data.len();
        self.register(data, vec![0u8; len])
    }
}

/// A remote list covering all of region 0 of `reg`.
pub fn remote_whole(reg: &Registration) -> RemoteDescList {
    let r = &reg.regions()[0];
    RemoteDescList::from_descs(reg.mem_type(), &[XferDesc::new(r.addr, r.len, r.dev_id)])
        .expect("remote list")
}

/// A local list covering all of region 0 of `reg`.
pub fn local_whole(reg: &Registration) -> LocalDescList {
    let mut list = LocalDescList::new(reg.mem_type()).expect("local list");
    list.push_region(reg, 0).expect("push region");
    list
}

/// A request of `agent` moving all of `local` to/from all of `remote` (a registration of
/// `remote_agent`) with `options`.
pub fn whole_xfer_req(
    agent: &Agent,
    op: XferOp,
    local: &Registration,
    remote: &Registration,
    remote_agent: &str,
    options: &XferOptions,
) -> nixl::Result<XferRequest> {
    agent.create_xfer_req(
        op,
        &local_whole(local),
        &remote_whole(remote),
        remote_agent,
        options,
    )
}

/// Runs one transfer of all of `local` to/from all of `remote` (a registration of
/// `remote_agent`) and waits for it.
pub fn transfer(
    agent: &Agent,
    op: XferOp,
    local: &Registration,
    remote: &Registration,
    remote_agent: &str,
) -> nixl::Result<()> {
    whole_xfer_req(agent, op, local, remote, remote_agent, &XferOptions::new())?.post_and_wait(WAIT)
}

/// Proves that `pair.a` still moves data to `pair.b` correctly: a fresh WRITE of a fresh
/// pattern, checked byte for byte. Used after every bad-input case.
pub fn assert_pair_works(pair: &Pair, seed: u8) {
    let data = pattern(4096, seed);
    let (src, dst) = pair.source_and_destination(data.clone());
    pair.a
        .load_remote_metadata(&pair.b.local_metadata().expect("metadata"))
        .expect("reload metadata");
    transfer(&pair.a, XferOp::Write, &src, &dst, pair.b.name()).expect("good transfer");
    assert_eq!(contents(&dst), data, "data moved after the bad input");
}

/// Polls `agent` until `count` notifications from `sender` arrived; returns them in order.
pub fn wait_notifications(agent: &Agent, sender: &str, count: usize) -> Vec<Vec<u8>> {
    let deadline = Instant::now() + WAIT;
    let mut got = Vec::new();
    while got.len() < count {
        let mut notes = agent.notifications().expect("get notifications");
        if let Some(mut from) = notes.remove(sender) {
            got.append(&mut from);
        }
        assert!(
            notes.is_empty(),
            "notifications from unexpected agents: {notes:?}"
        );
        if got.len() >= count {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {count} notifications from {sender} arrived",
            got.len()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    got
}

/// Polls `done` every 10 ms until it holds; panics, naming `what` was awaited, after [`WAIT`].
pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "waited in vain for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Polls until `agent` holds `remote`'s metadata. Panics if it never arrives.
pub fn wait_metadata(agent: &Agent, remote: &str) {
    wait_until(
        &format!("{}: metadata of {remote} to arrive", agent.name()),
        || {
            agent
                .has_remote_metadata(remote)
                .expect("check remote metadata")
        },
    );
}

/// All of `file`, read from its start.
pub fn file_contents(mut file: &std::fs::File) -> Vec<u8> {
    use std::io::{Read, Seek, SeekFrom};
    let mut out = Vec::new();
    file.seek(SeekFrom::Start(0))
        .expect("seek to the start of the file");
    file.read_to_end(&mut out).expect("read the file");
    out
}

/// Asserts that block `k` of `moved` is block `blocks - 1 - k` of `data` (blocks of `block`
/// bytes): a transfer that reversed the order of `blocks` blocks.
pub fn assert_blocks_reversed(moved: &[u8], data: &[u8], block: usize, blocks: usize) {
    for k in 0..blocks {
        let from = blocks - 1 - k;
        assert_eq!(
            moved[k * block..(k + 1) * block],
            data[from * block..(from + 1) * block],
            "block {k} should be source block {from}"
        );
    }
}

/// A TCP port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local address").port()
}

/// Asks `agent` to register 4 KiB of VRAM at a fake, non-null device address, with
/// `backends`.
///
/// # Safety
/// Only where no GPU is present: the registration is then refused before NIXL or UCX touch
/// the address.
pub unsafe fn register_fake_vram(
    agent: &Agent,
    backends: &[&Backend],
) -> nixl::Result<Registration> {
    let fake = nixl::RegDesc {
        addr: 0x7f00_dead_0000,
        len: 4096,
        dev_id: 0,
        metadata: Vec::new(),
    };
    // SAFETY: the caller's promise: no GPU, so refused before anything uses the address.
    unsafe { agent.register_raw(nixl::MemType::Vram, &[fake], backends) }
}

/// A pair whose `b` runs no progress thread: a's first transfer to b cannot finish (UCX
/// needs b for the wire-up) until b polls, so it is deterministically in flight.
pub fn stalled_pair(prefix: &str) -> Pair {
    Pair::with(
        Agent::new(&unique_name(&format!("{prefix}-a"))).unwrap(),
        Agent::builder(&unique_name(&format!("{prefix}-b")))
            .progress_thread(false)
            .build()
            .unwrap(),
    )
}

/// Runs `f` while another thread lets the stalled `pair.b` progress, polling it every
/// millisecond from the moment `ready` holds; returns what `f` returns.
pub fn resume_b_when<R>(pair: &Pair, ready: impl Fn() -> bool + Sync, f: impl FnOnce() -> R) -> R {
    /// Stops the polling thread when `f` returns or panics.
    struct Stop<'a>(&'a AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Ordering::SeqCst) && !ready() {
                std::thread::sleep(Duration::from_millis(1));
            }
            while !stop.load(Ordering::SeqCst) {
                pair.b.notifications().expect("b polls");
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        let _stop = Stop(&stop);
        f()
    })
}

/// Polls b (which progresses its workers) until `req` is done.
pub fn finish(pair: &Pair, req: &mut XferRequest) {
    let deadline = Instant::now() + WAIT;
    loop {
        pair.b.notifications().unwrap();
        if req.status().unwrap() == XferStatus::Done {
            return;
        }
        assert!(Instant::now() < deadline, "the transfer never finished");
        std::thread::yield_now();
    }
}

/// Tracked memory on `a` (the local side) and on `b` (the remote side), metadata exchanged.
pub fn tracked_pair(
    pair: &Pair,
    len: usize,
) -> (Registration, Arc<AtomicBool>, Registration, Arc<AtomicBool>) {
    let (a_mem, a_freed) = Tracked::new(pattern(len, 3));
    let (b_mem, b_freed) = Tracked::new(vec![0u8; len]);
    let on_a = pair.a.register_memory(a_mem, &[&pair.ucx_a]).unwrap();
    let on_b = pair.b.register_memory(b_mem, &[&pair.ucx_b]).unwrap();
    pair.exchange();
    (on_a, a_freed, on_b, b_freed)
}

/// A WRITE of all of `src` into all of `dst`, posted and in flight.
pub fn in_flight_write(pair: &Pair, src: &Registration, dst: &Registration) -> XferRequest {
    let mut req = pair
        .whole_request(XferOp::Write, src, dst, &XferOptions::new())
        .unwrap();
    assert_eq!(
        req.post().unwrap(),
        XferStatus::InProgress,
        "the first transfer to a stalled peer is in flight"
    );
    req
}
