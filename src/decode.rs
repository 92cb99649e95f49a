//! The decode worker: connects to a prefill worker, and for every announced request READs
//! the request's blocks of every layer into free blocks of its own cache through NIXL, with
//! the request id as the notification, then checks every byte.

use std::collections::{HashSet, VecDeque};
use std::net::SocketAddr;
use std::thread;
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use nixl::kv_config::NixlSetup;
use nixl::{MetadataPeer, PreparedLocal, PreparedRemote, XferOp, XferOptions, XferRequest};
use tokio::sync::mpsc;

use crate::block_pool::BlockPool;
use crate::config::MetadataMode;
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::framing::{progress, FrameError, DEFAULT_MAX_FRAME};
use crate::kv_cache::{remote_desc_list, KvCache, KvLayout, Mismatch};
use crate::side_channel::{self, Hello, Message, Welcome, PROTOCOL_VERSION};
use crate::stats::{DecodeSummary, Progress};

/// How the decode worker runs.
#[derive(Debug, Clone)]
pub struct DecodeOptions {
    /// The prefill worker's side channel.
    pub prefill: SocketAddr,
    /// How agent metadata is exchanged.
    pub mode: MetadataMode,
    /// Requests to pull.
    pub requests: u64,
    /// Blocks per request (in every layer).
    pub blocks_per_request: u32,
    /// Requests in flight at once.
    pub in_flight: u32,
    /// How long, in all, reaching prefill and the handshake may take.
    pub connect_timeout: Duration,
    /// How long one READ may take before the run fails.
    pub xfer_timeout: Duration,
    /// Largest side-channel frame accepted.
    pub max_frame: usize,
    /// How often the progress callback runs.
    pub progress_interval: Duration,
}

impl DecodeOptions {
    /// Options with the demo's defaults for everything but the prefill address.
    pub fn new(prefill: SocketAddr) -> Self {
        DecodeOptions {
            prefill,
            mode: MetadataMode::SideChannel,
            requests: 64,
            blocks_per_request: 16,
            in_flight: 4,
            connect_timeout: Duration::from_secs(30),
            xfer_timeout: Duration::from_secs(20),
            max_frame: DEFAULT_MAX_FRAME,
            progress_interval: Duration::from_millis(500),
        }
    }
}

/// Side-channel input, forwarded by the reader thread.
enum Incoming {
    Message(Message),
    Closed(Error),
}

/// An announced request waiting for free local blocks.
struct Pending {
    request: u64,
    remote: Vec<u32>,
    announced: Instant,
}

/// A READ in flight: what it moves (the request itself is awaited on its own).
struct Pull {
    request: u64,
    local: Vec<u32>,
    remote: Vec<u32>,
    announced: Instant,
}

/// A posted READ and where it goes.
type Started = (Pull, XferRequest);

/// A READ's outcome: done, failed, or not done by the deadline.
type Finished = (
    Pull,
    std::result::Result<nixl::Result<XferRequest>, tokio::time::error::Elapsed>,
);

/// The prefill side of a session once the handshake is done.
struct Connected {
    welcome: Welcome,
    tx: side_channel::Sender,
    incoming: mpsc::Receiver<Incoming>,
}

/// Pulls `options.requests` requests from prefill into `cache`, verifying every byte, and
/// calls `on_progress` every `options.progress_interval`.
///
/// Returns the summary even when blocks mismatch (see [`DecodeSummary::ok`]).
///
/// # Errors
/// [`Error::Config`] when the cache cannot hold `in_flight` requests; handshake errors
/// ([`Error::Rejected`] when prefill refuses); [`Error::PeerGone`] as soon as prefill's side
/// channel closes before the run is complete; [`Error::Timeout`] for a READ slower than
/// `xfer_timeout`; NIXL errors of failed transfers.
pub fn run(
    setup: &NixlSetup,
    cache: &KvCache,
    options: &DecodeOptions,
    mut on_progress: impl FnMut(&Progress),
) -> Result<DecodeSummary> {
    let layout = cache.layout();
    check_options(options, layout)?;
    let mut session = connect(setup, cache, options)?;
    let prefill_agent = session.welcome.agent.clone();
    let result = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|err| Error::io("start the async runtime", err))
        .and_then(|runtime| {
            runtime.block_on(pull_all(
                setup,
                cache,
                options,
                &mut session,
                &mut on_progress,
            ))
        });
    if let Err(err) = &result {
        let _ = session.tx.send(&Message::Error {
            message: err.to_string(),
        });
    }
    session.tx.shutdown();
    let agent = setup.agent();
    if let Err(err) = agent.invalidate_remote_metadata(&prefill_agent) {
        tracing::debug!(%err, "could not forget prefill's metadata");
    }
    if options.mode == MetadataMode::Etcd {
        withdraw_metadata(agent);
    }
    result
}

fn check_options(options: &DecodeOptions, layout: KvLayout) -> Result<()> {
    if options.blocks_per_request == 0 || options.in_flight == 0 {
        return Err(Error::Config(
            "blocks per request and requests in flight must be at least 1".into(),
        ));
    }
    let needed = options.blocks_per_request as usize * options.in_flight as usize;
    if needed > layout.blocks {
        return Err(Error::Config(format!(
            "{} requests in flight of {} blocks need {needed} blocks; the decode cache has {}",
            options.in_flight, options.blocks_per_request, layout.blocks
        )));
    }
    Ok(())
}

/// Takes this agent's metadata (publishes it in etcd mode), then runs the [`handshake`].
///
/// Publishing first lets an unreachable etcd end the run before prefill hears of it; the
/// metadata is withdrawn again if the handshake fails.
fn connect(setup: &NixlSetup, cache: &KvCache, options: &DecodeOptions) -> Result<Connected> {
    let agent = setup.agent();
    let metadata = match options.mode {
        MetadataMode::SideChannel => agent.local_metadata()?,
        MetadataMode::Etcd => {
            crate::etcd_metadata::publish(agent)?;
            Vec::new()
        }
    };
    let connected = handshake(setup, cache, options, metadata);
    if connected.is_err() && options.mode == MetadataMode::Etcd {
        withdraw_metadata(agent);
    }
    connected
}

/// Withdraws this agent's metadata from etcd.
fn withdraw_metadata(agent: &nixl::Agent) {
    if let Err(err) = agent.invalidate_local_metadata(&MetadataPeer::Etcd) {
        tracing::warn!(%err, "could not withdraw the metadata from etcd");
    }
}

/// Connects to prefill, exchanges Hello (carrying `metadata`) and Welcome and loads prefill's
/// metadata, all by the connect deadline, and starts the side-channel reader.
fn handshake(
    setup: &NixlSetup,
    cache: &KvCache,
    options: &DecodeOptions,
    metadata: Vec<u8>,
) -> Result<Connected> {
    let agent = setup.agent();
    let layout = cache.layout();
    let deadline = Deadline::after(options.connect_timeout);
    let stream = side_channel::connect(options.prefill, deadline)?;
    let (mut tx, mut rx) = side_channel::split(stream, options.max_frame)?;
    let hello = Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        agent: agent.name().to_string(),
        metadata,
        layers: u32::try_from(layout.layers).unwrap_or(u32::MAX),
        block_bytes: layout.block_bytes as u64,
        requests: options.requests,
        blocks_per_request: options.blocks_per_request,
        in_flight: options.in_flight,
    });
    tx.send_by(&hello, deadline).map_err(|err| match err {
        Error::Timeout(what) => Error::Timeout(format!("prefill at {}: {what}", options.prefill)),
        other => other,
    })?;
    rx.set_deadline(Some(deadline));
    let welcome = match rx.recv() {
        Ok(Message::Welcome(welcome)) => welcome,
        Ok(Message::Error { message }) => return Err(Error::Rejected(message)),
        Ok(other) => {
            return Err(Error::Protocol(format!(
                "expected Welcome, got {}",
                other.kind()
            )))
        }
        Err(Error::Frame(FrameError::Closed)) => {
            return Err(Error::PeerGone(format!(
                "prefill at {} closed the side channel during the handshake",
                options.prefill
            )))
        }
        Err(Error::Frame(FrameError::Stalled { got: 0, .. })) => {
            return Err(Error::Timeout(format!(
                "prefill at {} accepted the connection but sent no handshake within {:?}",
                options.prefill,
                deadline.limit()
            )))
        }
        Err(Error::Frame(FrameError::Stalled { got, expected })) => {
            return Err(Error::Timeout(format!(
                "prefill at {} sent only {} of its handshake frame, then the {:?} deadline passed",
                options.prefill,
                progress(got, expected),
                deadline.limit()
            )))
        }
        Err(Error::Frame(err)) => {
            return Err(Error::PeerGone(format!(
                "prefill at {} broke off the handshake: {err}",
                options.prefill
            )))
        }
        Err(err) => return Err(err),
    };
    check_welcome(&welcome, layout)?;
    match options.mode {
        MetadataMode::SideChannel => {
            let name = agent.load_remote_metadata(&welcome.metadata)?;
            if name != welcome.agent {
                return Err(Error::Protocol(format!(
                    "the metadata is agent {name:?}'s, but the Welcome came from {:?}",
                    welcome.agent
                )));
            }
        }
        MetadataMode::Etcd => crate::etcd_metadata::fetch(agent, &welcome.agent, deadline)?,
    }
    rx.set_deadline(None);
    // Bounded: a reader that gets ahead of the pull loop waits for it.
    let (incoming_tx, incoming) = mpsc::channel(64);
    thread::Builder::new()
        .name("side-channel".into())
        .spawn(move || loop {
            let (event, closed) = match rx.recv() {
                Ok(message) => (Incoming::Message(message), false),
                Err(err) => (Incoming::Closed(err), true),
            };
            if incoming_tx.blocking_send(event).is_err() || closed {
                break;
            }
        })
        .map_err(|err| Error::io("spawn the side-channel reader", err))?;
    tracing::info!(prefill = %welcome.agent, addr = %options.prefill, "connected to prefill");
    Ok(Connected {
        welcome,
        tx,
        incoming,
    })
}

fn check_welcome(welcome: &Welcome, layout: KvLayout) -> Result<()> {
    let c = &welcome.cache;
    if c.bases.len() != layout.layers || c.block_bytes != layout.block_bytes as u64 {
        return Err(Error::Protocol(format!(
            "prefill's cache has {} layers of {}-byte blocks, decode's {} of {}",
            c.bases.len(),
            c.block_bytes,
            layout.layers,
            layout.block_bytes
        )));
    }
    if c.blocks == 0 {
        return Err(Error::Protocol("prefill's cache has no blocks".into()));
    }
    Ok(())
}

/// The main loop, on the async API: take announcements, start READs when local blocks are
/// free, and await them (each with its deadline), checking what landed. Nothing polls or
/// naps here: the agent's completion driver wakes the loop when a READ is done. If the run
/// fails, the READs still in flight are handed to the driver, which keeps their memory until
/// NIXL is done with it.
async fn pull_all(
    setup: &NixlSetup,
    cache: &KvCache,
    options: &DecodeOptions,
    session: &mut Connected,
    on_progress: &mut impl FnMut(&Progress),
) -> Result<DecodeSummary> {
    let agent = setup.agent();
    let layout = cache.layout();
    let welcome = &session.welcome;
    let local_list = agent.prepare_local(&cache.local_desc_list()?, &[])?;
    let remote_list =
        agent.prepare_remote(&welcome.agent, &remote_desc_list(&welcome.cache)?, &[])?;
    let mut state = RunState {
        options,
        layout,
        remote_blocks: welcome.cache.blocks,
        pool: BlockPool::new(u32::try_from(layout.blocks).unwrap_or(u32::MAX)),
        pending: VecDeque::new(),
        in_flight: 0,
        seen: HashSet::new(),
        complete: false,
        latencies: Vec::new(),
        mismatches: Vec::new(),
        progress: Progress {
            requests_done: 0,
            requests_total: options.requests,
            blocks: 0,
            bytes: 0,
            elapsed: Duration::ZERO,
        },
    };
    let start = Instant::now();
    let mut reads = FuturesUnordered::new();
    let mut report = tokio::time::interval_at(
        tokio::time::Instant::now() + options.progress_interval,
        options.progress_interval,
    );
    report.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut channel_open = true;
    loop {
        for started in state.start_pulls(agent, &local_list, &remote_list)? {
            reads.push(awaited(started, options.xfer_timeout));
        }
        state.progress.elapsed = start.elapsed();
        if state.finished() {
            break;
        }
        // Finished READs first: the driver saw a READ done before NIXL sent its notification,
        // so prefill's next announcement never overtakes the completion it follows.
        tokio::select! {
            biased;
            Some(finished) = reads.next() => state.finish_pull(finished, cache)?,
            incoming = session.incoming.recv(), if channel_open => match incoming {
                Some(incoming) => state.handle(incoming)?,
                // Prefill closes the channel after Complete; only READs are left then.
                None if state.complete => channel_open = false,
                None => return Err(Error::PeerGone("the side-channel reader stopped".into())),
            },
            _ = report.tick() => on_progress(&state.progress),
        }
    }
    Ok(DecodeSummary {
        prefill_agent: welcome.agent.clone(),
        progress: state.progress,
        latencies: state.latencies,
        mismatches: state.mismatches,
    })
}

/// A posted READ awaited until `timeout`.
async fn awaited((pull, xfer): Started, timeout: Duration) -> Finished {
    (pull, tokio::time::timeout(timeout, xfer).await)
}

/// Where a decode run stands.
struct RunState<'o> {
    options: &'o DecodeOptions,
    layout: KvLayout,
    remote_blocks: u32,
    pool: BlockPool,
    pending: VecDeque<Pending>,
    /// READs posted and not yet finished.
    in_flight: usize,
    seen: HashSet<u64>,
    complete: bool,
    latencies: Vec<Duration>,
    mismatches: Vec<Mismatch>,
    progress: Progress,
}

impl RunState<'_> {
    fn finished(&self) -> bool {
        self.complete && self.progress.requests_done == self.options.requests
    }

    fn handle(&mut self, incoming: Incoming) -> Result<()> {
        let total = self.options.requests;
        match incoming {
            Incoming::Message(Message::Announce { request, blocks }) => {
                self.check_announce(request, &blocks)?;
                self.pending.push_back(Pending {
                    request,
                    remote: blocks,
                    announced: Instant::now(),
                });
                Ok(())
            }
            Incoming::Message(Message::Complete { requests }) if requests == total => {
                self.complete = true;
                Ok(())
            }
            Incoming::Message(Message::Complete { requests }) => Err(Error::Protocol(format!(
                "prefill reports {requests} requests complete; {total} were asked for"
            ))),
            Incoming::Message(Message::Error { message }) => Err(Error::PeerGone(format!(
                "prefill aborted the session after {}/{total} requests: {message}",
                self.progress.requests_done
            ))),
            Incoming::Message(other) => Err(Error::Protocol(format!(
                "unexpected {} from prefill during the session",
                other.kind()
            ))),
            // Prefill closes the channel right after Complete; only local polling is left.
            Incoming::Closed(_) if self.complete => Ok(()),
            Incoming::Closed(Error::Frame(FrameError::Closed)) => Err(Error::PeerGone(format!(
                "prefill closed the side channel after {}/{total} requests (did it die?)",
                self.progress.requests_done
            ))),
            Incoming::Closed(err) => Err(Error::PeerGone(format!(
                "lost the side channel to prefill after {}/{total} requests: {err}",
                self.progress.requests_done
            ))),
        }
    }

    fn check_announce(&mut self, request: u64, blocks: &[u32]) -> Result<()> {
        let bad = |reason: String| {
            Err(Error::Protocol(format!(
                "announcement of request {request}: {reason}"
            )))
        };
        if blocks.len() != self.options.blocks_per_request as usize {
            return bad(format!(
                "{} blocks, {} expected",
                blocks.len(),
                self.options.blocks_per_request
            ));
        }
        if let Some(b) = blocks.iter().find(|&&b| b >= self.remote_blocks) {
            return bad(format!(
                "block {b} is outside prefill's {} blocks",
                self.remote_blocks
            ));
        }
        if !self.seen.insert(request) {
            return bad("announced twice".into());
        }
        if self.seen.len() as u64 > self.options.requests {
            return bad(format!(
                "more than the {} requests asked for",
                self.options.requests
            ));
        }
        // Prefill may announce the next request as soon as a notification reaches it, a
        // little before this side sees the READ done; anything beyond that is a bug.
        let limit = 2 * self.options.in_flight as usize + 1;
        if self.pending.len() + self.in_flight >= limit {
            return bad(format!("more than {limit} requests outstanding"));
        }
        Ok(())
    }

    /// Posts a READ for every pending request that free local blocks allow.
    fn start_pulls(
        &mut self,
        agent: &nixl::Agent,
        local_list: &PreparedLocal,
        remote_list: &PreparedRemote,
    ) -> Result<Vec<Started>> {
        let mut started = Vec::new();
        while !self.pending.is_empty() {
            let Some(local) = self.pool.alloc(self.options.blocks_per_request as usize) else {
                break;
            };
            let Some(p) = self.pending.pop_front() else {
                self.pool.free(&local);
                break;
            };
            let remote_layout = KvLayout {
                blocks: self.remote_blocks as usize,
                ..self.layout
            };
            let mut local_idx = Vec::with_capacity(local.len() * self.layout.layers);
            let mut remote_idx = Vec::with_capacity(local.len() * self.layout.layers);
            for layer in 0..self.layout.layers {
                for (&lb, &rb) in local.iter().zip(&p.remote) {
                    local_idx.push(self.layout.desc_index(layer, lb as usize));
                    remote_idx.push(remote_layout.desc_index(layer, rb as usize));
                }
            }
            let notification = XferOptions::new().notification(p.request.to_string());
            let mut xfer = agent.make_xfer_req(
                XferOp::Read,
                local_list,
                &local_idx,
                remote_list,
                &remote_idx,
                &notification,
            )?;
            xfer.post().map_err(|err| read_failed(p.request, err))?;
            self.in_flight += 1;
            let pull = Pull {
                request: p.request,
                local,
                remote: p.remote,
                announced: p.announced,
            };
            started.push((pull, xfer));
        }
        Ok(started)
    }

    /// Checks the blocks of a finished READ and frees them; a failed or late READ ends the run.
    fn finish_pull(&mut self, (pull, outcome): Finished, cache: &KvCache) -> Result<()> {
        self.in_flight -= 1;
        match outcome {
            Err(_) => {
                return Err(Error::Timeout(format!(
                    "the READ of request {} is not done after {:?}",
                    pull.request, self.options.xfer_timeout
                )))
            }
            Ok(Err(err)) => return Err(read_failed(pull.request, err)),
            Ok(Ok(_done)) => {}
        }
        self.latencies.push(pull.announced.elapsed());
        let bad = cache.verify_blocks(&pull.local, &pull.remote, pull.request)?;
        if !bad.is_empty() {
            tracing::error!(request = pull.request, blocks = bad.len(), "data mismatch");
        }
        self.mismatches.extend(bad);
        self.pool.free(&pull.local);
        let blocks = (pull.local.len() * self.layout.layers) as u64;
        self.progress.requests_done += 1;
        self.progress.blocks += blocks;
        self.progress.bytes += blocks * self.layout.block_bytes as u64;
        Ok(())
    }
}

fn read_failed(request: u64, err: nixl::Error) -> Error {
    Error::PeerGone(format!(
        "the READ of request {request} from prefill failed: {err}"
    ))
}
