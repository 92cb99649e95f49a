//! The prefill worker: a thin client of the KV connector. It fills KV-cache blocks for each
//! request a decode worker asks for, finishes the request through the connector's scheduler
//! (which keeps its blocks for the decode), hands the decode the request's transfer params
//! over the control channel, and frees the blocks when the connector reports the decode's
//! notification.
//!
//! It serves any number of decode workers at once, one task per connection on tokio. A
//! decode worker that dies or misbehaves ends only its own session: its blocks go back to
//! the pool.
//!
//! With several turns per [`conversation`](crate::conversation) it also reads back, through
//! the connector, the answers the decode keeps, and prefills each next turn.

mod turns;

pub use turns::ReadBackStats;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use nixl_connector::{
    Channel, FinishStatus, KvConnectorScheduler, KvTransferParams, LoadOutcome, Protocol,
    SchedulerConfig,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify};

use crate::admission::{Admission, Ticket};
use crate::block_pool::BlockPool;
use crate::config::Worker;
use crate::conversation::{longest_prompt, TurnId};
use crate::error::{Error, Result};
use crate::metered::Metered;
use crate::protocol::{Hello, Message, Welcome, DEFAULT_MAX_FRAME, PROTOCOL_VERSION};

/// Default of [`PrefillOptions::max_pending_handshakes`].
pub const DEFAULT_MAX_PENDING_HANDSHAKES: usize = 16;

/// Default of [`PrefillOptions::max_pending_handshake_bytes`] (64 MiB).
pub const DEFAULT_MAX_PENDING_HANDSHAKE_BYTES: usize = 64 << 20;

/// How long a refusal may take to leave once the session is over.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// How often held requests are checked for the end of their lease.
const EXPIRY_CHECK: Duration = Duration::from_millis(500);

/// How the prefill worker runs.
#[derive(Debug, Clone)]
pub struct PrefillOptions {
    /// Largest control-channel frame accepted.
    pub max_frame: usize,
    /// How long a new connection may take, in all, to complete its handshake.
    pub handshake_timeout: Duration,
    /// Most connections in their handshake at once; when all are taken, the oldest is
    /// closed with a busy answer to make room for a new one (decode retries a busy answer).
    pub max_pending_handshakes: usize,
    /// Most bytes pending handshakes may have received together, beyond
    /// [`FREE_BYTES_PER_HANDSHAKE`](crate::admission::FREE_BYTES_PER_HANDSHAKE) each; a
    /// handshake that would pass it is refused.
    pub max_pending_handshake_bytes: usize,
    /// Sessions to serve before [`PrefillServer::serve`] returns (`None`: forever).
    pub max_sessions: Option<u64>,
    /// Fault injection: corrupt one byte of the request with this id after filling it.
    pub corrupt_request: Option<u64>,
}

impl Default for PrefillOptions {
    fn default() -> Self {
        PrefillOptions {
            max_frame: DEFAULT_MAX_FRAME,
            handshake_timeout: Duration::from_secs(10),
            max_pending_handshakes: DEFAULT_MAX_PENDING_HANDSHAKES,
            max_pending_handshake_bytes: DEFAULT_MAX_PENDING_HANDSHAKE_BYTES,
            max_sessions: None,
            corrupt_request: None,
        }
    }
}

/// What happened to one decode session.
#[derive(Debug)]
pub struct SessionReport {
    /// The decode worker's address.
    pub peer: SocketAddr,
    /// The decode agent's name.
    pub decode_agent: String,
    /// Requests the decode worker asked for.
    pub requests_wanted: u64,
    /// Requests pulled and acknowledged by notification.
    pub requests_acked: u64,
    /// Bytes of the acknowledged requests.
    pub bytes: u64,
    /// How long the session lasted.
    pub duration: Duration,
    /// With several turns per conversation, what prefill read back and computed.
    pub read_backs: Option<ReadBackStats>,
    /// `Ok` when every request was served, else why the session ended early.
    pub outcome: Result<()>,
}

/// Something the prefill worker wants its operator to know.
#[derive(Debug)]
pub enum PrefillEvent {
    /// A decode worker completed the handshake.
    SessionStarted {
        /// Its address.
        peer: SocketAddr,
        /// Its agent name.
        decode_agent: String,
        /// Requests it asked for.
        requests: u64,
    },
    /// A session ended, served in full or not.
    SessionEnded(SessionReport),
    /// A connection was refused before or during the handshake (bad input, wrong geometry,
    /// too many pending handshakes).
    Rejected {
        /// The peer's address.
        peer: SocketAddr,
        /// Why.
        error: Error,
    },
}

/// Totals of a [`PrefillServer::serve`] run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServeStats {
    /// Sessions that completed the handshake.
    pub sessions: u64,
    /// Of those, sessions that ended before serving every request.
    pub failed_sessions: u64,
    /// Connections refused.
    pub rejected: u64,
    /// Requests acknowledged over all sessions.
    pub requests: u64,
    /// Of those, requests released by the end of their lease rather than by the decode's
    /// notification.
    pub freed_on_lease_end: u64,
    /// Blocks read back from decodes whose bytes were wrong.
    pub read_back_mismatches: u64,
}

/// What the engine step hands a session about one of its requests.
#[derive(Debug)]
enum Routed {
    /// The connector released the request (the decode's notification came, or its lease
    /// ended): its blocks are free.
    Released(String),
    /// The request's read-back ended.
    LoadEnded(LoadOutcome),
}

/// State shared by the accept loop, the release router and the sessions.
struct Shared {
    worker: Worker,
    options: PrefillOptions,
    pool: Mutex<BlockPool>,
    /// Woken whenever blocks go back to the pool.
    blocks_freed: Notify,
    next_request: AtomicU64,
    scheduler: Mutex<KvConnectorScheduler>,
    /// Which session each announced request belongs to.
    owners: Mutex<HashMap<String, mpsc::UnboundedSender<Routed>>>,
    /// The blocks of read-backs still in flight when their session ended, freed when the
    /// read ends (it may still write them).
    orphans: Mutex<HashMap<String, Vec<u32>>>,
    admission: Arc<Admission>,
}

/// Locks `mutex`, taking over its data if a holder panicked.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// A bound prefill worker, ready to [`serve`](Self::serve).
pub struct PrefillServer {
    shared: Arc<Shared>,
    listener: TcpListener,
}

impl std::fmt::Debug for PrefillServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillServer")
            .field("agent", &self.shared.worker.name)
            .field("listener", &self.listener)
            .finish_non_exhaustive()
    }
}

impl PrefillServer {
    /// Listens on `addr` for decode workers; `worker`'s connector serves the KV cache.
    /// Call it inside a tokio runtime.
    ///
    /// # Errors
    /// [`Error::Io`] when `addr` cannot be bound.
    pub async fn bind(worker: Worker, addr: SocketAddr, options: PrefillOptions) -> Result<Self> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|err| Error::io(format!("listen on {addr}"), err))?;
        let blocks = u32::try_from(worker.layout.blocks).unwrap_or(u32::MAX);
        let admission = Admission::new(
            options.max_pending_handshakes,
            options.max_pending_handshake_bytes,
        );
        // A request announced to a connected decode keeps its blocks under the lease of the
        // kv_transfer_config (the decode's heartbeats extend it); one released by the end of
        // its lease counts as served. In vLLM's protocol the port is the engine's ROUTER, and
        // the params carry its registration generation.
        let mut config = SchedulerConfig::new(
            &worker.name,
            &addr.ip().to_string(),
            worker.connector().side_channel_addr()?.port(),
            worker.parallel.tp,
            &worker.kv_transfer_config,
        )?;
        // Every rank of every stage reports before a request counts as sent (vLLM's
        // KVOutputAggregator over the world size), and the params say the stages.
        config.pp_size = worker.parallel.pp;
        if worker.connector().protocol() == Protocol::Vllm {
            config.vllm_side_channel = Some(worker.connector().vllm_side_channel()?);
        }
        let scheduler = KvConnectorScheduler::new(config);
        Ok(PrefillServer {
            shared: Arc::new(Shared {
                worker,
                options,
                pool: Mutex::new(BlockPool::new(blocks)),
                blocks_freed: Notify::new(),
                next_request: AtomicU64::new(0),
                scheduler: Mutex::new(scheduler),
                owners: Mutex::new(HashMap::new()),
                orphans: Mutex::new(HashMap::new()),
                admission,
            }),
            listener,
        })
    }

    /// The address the control channel listens on.
    ///
    /// # Errors
    /// [`Error::Io`] if the socket cannot say.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|err| Error::io("query the listening address", err))
    }

    /// Serves decode workers until [`PrefillOptions::max_sessions`] sessions have ended
    /// (forever without a limit), reporting every session and refused connection. A failed
    /// accept is logged and serving goes on.
    pub async fn serve(self, mut on_event: impl FnMut(PrefillEvent)) -> ServeStats {
        let router = tokio::spawn(route_releases(self.shared.clone()));
        let (events_tx, mut events) = mpsc::unbounded_channel();
        let mut stats = ServeStats::default();
        let mut ended = 0;
        loop {
            let limit_reached = self
                .shared
                .options
                .max_sessions
                .is_some_and(|max| stats.sessions >= max);
            if limit_reached && ended >= stats.sessions {
                break;
            }
            tokio::select! {
                accepted = self.listener.accept(), if !limit_reached => match accepted {
                    Ok((stream, peer)) => {
                        let Some(ticket) = self.shared.admission.admit().await else {
                            let error = refuse_over_count(&self.shared, stream, peer);
                            let _ = events_tx.send(PrefillEvent::Rejected { peer, error });
                            continue;
                        };
                        let (shared, events_tx) = (self.shared.clone(), events_tx.clone());
                        tokio::spawn(async move {
                            run_session(shared, stream, peer, ticket, &events_tx).await;
                        });
                    }
                    // Aborted handshakes, descriptor exhaustion: keep serving the others.
                    Err(err) => {
                        tracing::warn!(%err, "accepting a control-channel connection failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                },
                Some(event) = events.recv() => {
                    match &event {
                        PrefillEvent::SessionStarted { .. } => stats.sessions += 1,
                        PrefillEvent::SessionEnded(report) => {
                            ended += 1;
                            stats.requests += report.requests_acked;
                            stats.failed_sessions += u64::from(report.outcome.is_err());
                            stats.read_back_mismatches += report
                                .read_backs
                                .as_ref()
                                .map_or(0, |r| r.mismatches.len() as u64);
                        }
                        PrefillEvent::Rejected { .. } => stats.rejected += 1,
                    }
                    on_event(event);
                }
            }
        }
        router.abort();
        stats.freed_on_lease_end = self.shared.worker.connector().send_stats().freed_on_timeout;
        stats
    }
}

/// Runs an engine step ([`engine_step`]) whenever a decode notification arrives or a
/// read-back ends, and now and then for the leases that end, so that every request the
/// connector released, and every read-back that ended, reaches the session it belongs to.
async fn route_releases(shared: Arc<Shared>) {
    let worker = &shared.worker;
    let mut expiry = tokio::time::interval(EXPIRY_CHECK);
    loop {
        tokio::select! {
            () = worker.notified() => {}
            () = worker.load_ended() => {}
            _ = expiry.tick() => {}
        }
        engine_step(&shared, &mut lock(&shared.scheduler));
    }
}

/// One engine step of the connector, exactly as the crate runs it
/// ([`KvConnectorScheduler::step`]: the scheduler's metadata to the worker, which holds the
/// requests just finished, and the worker's output aggregated back); hands every request
/// released (the decode's notification arrived, or its lease ended) to the session that
/// announced it, and every read-back that ended to the session that started it.
fn engine_step(shared: &Shared, scheduler: &mut KvConnectorScheduler) {
    let output = match scheduler.step(&shared.worker.ranks) {
        Ok(output) => output,
        Err(err) => {
            tracing::error!(%err, "the connector's output was refused");
            return;
        }
    };
    for outcome in output.load_outcomes {
        let request = match &outcome {
            LoadOutcome::Loaded { request_id }
            | LoadOutcome::Recompute { request_id, .. }
            | LoadOutcome::Failed { request_id, .. }
            | LoadOutcome::AbortedLoadEnded { request_id } => request_id.clone(),
        };
        if let Some(session) = lock(&shared.owners).get(&request) {
            let _ = session.send(Routed::LoadEnded(outcome));
        } else if let Some(blocks) = lock(&shared.orphans).remove(&request) {
            // Its session ended during the read: nothing writes the blocks any more.
            lock(&shared.pool).free(&blocks);
            shared.blocks_freed.notify_waiters();
        }
    }
    for request in output.finished_sending {
        match lock(&shared.owners).remove(&request) {
            Some(session) => {
                let _ = session.send(Routed::Released(request));
            }
            None => tracing::debug!(
                %request,
                "released request of a session that has ended; its blocks are already free"
            ),
        }
    }
}

/// Refuses a connection because no place of the [`PrefillOptions::max_pending_handshakes`]
/// came free (the handshake evicted for it did not end within the eviction grace): logs it,
/// tells the peer it is busy if the socket takes the frame at once (it is fresh, so it does),
/// and closes it; nothing waits on the peer, so a flood of connections costs no tasks.
fn refuse_over_count(shared: &Shared, stream: TcpStream, peer: SocketAddr) -> Error {
    let max = shared.admission.max_pending();
    let error = Error::Busy(format!(
        "prefill is busy: {max} handshakes are pending, the most it allows, and none ended \
         in time to make room; try again later"
    ));
    tracing::warn!(
        %peer,
        max_pending_handshakes = max,
        "refused a control-channel connection: {max} handshakes pending and none made room"
    );
    let mut channel = Channel::new(
        Metered::new(stream, None),
        peer.to_string(),
        shared.options.max_frame,
    );
    refuse_now(&mut channel, &error);
    error
}

/// The message that tells a peer why it is turned away: [`Message::Busy`] for [`Error::Busy`]
/// (decode tries again), else [`Message::Error`].
fn refusal(error: &Error) -> Message {
    let message = error.to_string();
    match error {
        Error::Busy(_) => Message::Busy { message },
        _ => Message::Error { message },
    }
}

/// Sends `error`'s refusal if the socket takes it in one poll: written now or never.
fn refuse_now(channel: &mut Channel<Metered>, error: &Error) {
    let _ = channel.send(&refusal(error)).now_or_never();
}

/// Sends `message` as the session's last word and closes, within [`SHUTDOWN_GRACE`].
async fn refuse(mut channel: Channel<Metered>, message: Message) {
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, async {
        channel.send(&message).await?;
        channel.close().await
    })
    .await;
}

/// Runs one connection from handshake to end and reports it.
async fn run_session(
    shared: Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    ticket: Ticket,
    events: &mpsc::UnboundedSender<PrefillEvent>,
) {
    let local_ip = stream
        .local_addr()
        .map_or(IpAddr::from([127, 0, 0, 1]), |a| a.ip());
    let _ = stream.set_nodelay(true);
    let Some((channel, hello)) = handshake(&shared, stream, peer, ticket, events).await else {
        return;
    };
    let _ = events.send(PrefillEvent::SessionStarted {
        peer,
        decode_agent: hello.agent.clone(),
        requests: hello.requests,
    });
    let report = serve_session(&shared, peer, local_ip, channel, hello).await;
    let _ = events.send(PrefillEvent::SessionEnded(report));
}

/// The connection's handshake, within the handshake timeout, holding `ticket`'s place
/// among the pending handshakes until the Hello is accepted: the channel and the decode's
/// Hello, or `None` once the peer was refused (its refusal sent if it reads, and reported
/// to `events`).
async fn handshake(
    shared: &Shared,
    stream: TcpStream,
    peer: SocketAddr,
    ticket: Ticket,
    events: &mpsc::UnboundedSender<PrefillEvent>,
) -> Option<(Channel<Metered>, Hello)> {
    // The handshake gives its place to a newer one when evicted: it waits only for the
    // Hello (the check and the Welcome finish in the poll the Hello arrives in), and its
    // refusal does not wait for a peer that does not read.
    let evicted = ticket.evicted();
    tokio::pin!(evicted);
    let mut channel = Channel::new(
        Metered::new(stream, Some(ticket)),
        peer.to_string(),
        shared.options.max_frame,
    );
    let limit = shared.options.handshake_timeout;
    let accepted = tokio::select! {
        biased;
        accepted = tokio::time::timeout(limit, accept(shared, &mut channel)) => {
            accepted.unwrap_or_else(|_| Err(handshake_timeout(channel.get_ref(), limit)))
        }
        () = &mut evicted => {
            let error = evicted_error(shared);
            tracing::warn!(%peer, "closed a pending control-channel handshake to make room: {error}");
            refuse_now(&mut channel, &error);
            let _ = events.send(PrefillEvent::Rejected { peer, error });
            return None;
        }
    };
    match accepted {
        Ok(hello) => {
            channel.get_mut().release();
            Some((channel, hello))
        }
        Err(error) => {
            if let Error::Busy(reason) = &error {
                tracing::warn!(%peer, "refused a control-channel connection: {reason}");
            }
            tokio::select! {
                biased;
                () = refuse(channel, refusal(&error)) => {}
                () = evicted => {}
            }
            let _ = events.send(PrefillEvent::Rejected { peer, error });
            None
        }
    }
}

/// Serves the session `hello` opened on `channel` (from `peer`, which reached us at
/// `local_ip`) to its end, then closes the channel, with the refusal of the error that
/// ended it if one did; and what the session did.
async fn serve_session(
    shared: &Shared,
    peer: SocketAddr,
    local_ip: IpAddr,
    channel: Channel<Metered>,
    hello: Hello,
) -> SessionReport {
    let start = Instant::now();
    let mut session = Session {
        shared,
        turns: (hello.turns > 1).then(|| turns::Turns::new(&hello)),
        hello,
        local_ip,
        peer_ip: peer.ip(),
        channel,
        outstanding: HashMap::new(),
        acked: 0,
        acked_blocks: 0,
    };
    let outcome = session.serve().await;
    session.end();
    let report = SessionReport {
        peer,
        decode_agent: session.hello.agent.clone(),
        requests_wanted: session.hello.requests,
        requests_acked: session.acked,
        bytes: session.acked_bytes(),
        duration: start.elapsed(),
        read_backs: session.turns.take().map(|t| t.stats),
        outcome,
    };
    match &report.outcome {
        Ok(()) => {
            let _ = tokio::time::timeout(SHUTDOWN_GRACE, session.channel.close()).await;
        }
        Err(err) => refuse(session.channel, refusal(err)).await,
    }
    report
}

/// Why a pending handshake was closed for a newer one.
fn evicted_error(shared: &Shared) -> Error {
    Error::Busy(format!(
        "prefill is busy: this handshake was the oldest of the {} pending, the most it allows, \
         and was closed for a newer connection; try again",
        shared.admission.max_pending()
    ))
}

/// Reads the Hello, checks it and answers with the Welcome.
async fn accept(shared: &Shared, channel: &mut Channel<Metered>) -> Result<Hello> {
    let received = channel.recv::<Message>().await;
    if let Some(reason) = channel.get_ref().refusal() {
        return Err(Error::Busy(reason.to_string()));
    }
    if let Err(nixl_connector::Error::Truncated { .. }) = &received {
        return Err(Error::Protocol(format!(
            "truncated frame: decode closed the connection after {} of its Hello frame",
            channel.get_ref().first_frame_progress()
        )));
    }
    let hello = match received? {
        Message::Hello(hello) => hello,
        other => {
            return Err(Error::Protocol(format!(
                "expected Hello, got {}",
                other.kind()
            )))
        }
    };
    check_hello(shared, &hello)?;
    let layout = shared.worker.layout;
    let welcome = Message::Welcome(Welcome {
        engine: shared.worker.name.clone(),
        side_channel_port: shared.worker.connector().side_channel_addr()?.port(),
        tp: u32::try_from(shared.worker.parallel.tp).unwrap_or(u32::MAX),
        pp: u32::try_from(shared.worker.parallel.pp).unwrap_or(u32::MAX),
        kv_heads: u32::try_from(shared.worker.parallel.kv_heads).unwrap_or(u32::MAX),
        layers: u32::try_from(layout.layers).unwrap_or(u32::MAX),
        block_bytes: layout.block_bytes as u64,
        blocks: u32::try_from(layout.blocks).unwrap_or(u32::MAX),
    });
    channel.send(&welcome).await?;
    Ok(hello)
}

/// The error for a Hello that did not arrive by the handshake deadline.
fn handshake_timeout(stream: &Metered, limit: Duration) -> Error {
    if stream.received() == 0 {
        return Error::Timeout(format!("no Hello within {limit:?}"));
    }
    Error::Timeout(format!(
        "decode sent only {} of its Hello frame, then the {limit:?} handshake deadline passed",
        stream.first_frame_progress()
    ))
}

/// Checks a Hello against this worker's cache.
fn check_hello(shared: &Shared, hello: &Hello) -> Result<()> {
    let layout = shared.worker.layout;
    let refuse = |reason: String| Err(Error::Protocol(reason));
    if hello.version != PROTOCOL_VERSION {
        return refuse(format!(
            "protocol version {} is not {PROTOCOL_VERSION}",
            hello.version
        ));
    }
    if hello.agent.is_empty() || hello.agent == shared.worker.name {
        return refuse(format!("bad decode agent name {:?}", hello.agent));
    }
    let ours = shared.worker.connector().protocol();
    if hello.connector_protocol != ours.as_str() {
        return refuse(format!(
            "decode's connector speaks the {:?} protocol, prefill's {ours}: give both the same --protocol",
            hello.connector_protocol
        ));
    }
    if hello.layers as usize != layout.layers || hello.block_bytes != layout.block_bytes as u64 {
        return refuse(format!(
            "cache geometry differs: decode has {} layers of {}-byte blocks, prefill {} of {}",
            hello.layers, hello.block_bytes, layout.layers, layout.block_bytes
        ));
    }
    if hello.blocks_per_request == 0 || hello.blocks_per_request as usize > layout.blocks {
        return refuse(format!(
            "{} blocks per request; prefill has {} blocks",
            hello.blocks_per_request, layout.blocks
        ));
    }
    if hello.in_flight == 0 {
        return refuse("in-flight limit of 0".into());
    }
    if hello.turns == 0 {
        return refuse("conversations of 0 turns".into());
    }
    if hello.turns > 1 {
        if !shared.worker.multi_turn.bidirectional {
            return refuse(
                "conversations of several turns need read-backs, which prefill's kv_transfer_config turns off (bidirectional_kv_xfer)".into(),
            );
        }
        if hello.answer_blocks == 0 || hello.requests % u64::from(hello.turns) != 0 {
            return refuse(format!(
                "{} requests in conversations of {} turns answered with at most {} blocks",
                hello.requests, hello.turns, hello.answer_blocks
            ));
        }
        let longest = longest_prompt(hello.turns, hello.blocks_per_request, hello.answer_blocks);
        if longest > layout.blocks as u64 {
            return refuse(format!(
                "the last turn's prompt takes up to {longest} blocks; prefill has {}",
                layout.blocks
            ));
        }
    }
    Ok(())
}

/// One decode worker's session after the handshake.
struct Session<'a> {
    shared: &'a Shared,
    hello: Hello,
    /// The address the decode reached us at: the host its transfer params name.
    local_ip: IpAddr,
    /// The decode's address: the host of the blocks it keeps for read-backs.
    peer_ip: IpAddr,
    channel: Channel<Metered>,
    /// The blocks of each request announced (or reading back) and not yet released.
    outstanding: HashMap<String, Vec<u32>>,
    acked: u64,
    /// Blocks of the acknowledged requests.
    acked_blocks: u64,
    /// With several turns per conversation: the conversations and read-backs.
    turns: Option<turns::Turns>,
}

impl Session<'_> {
    /// Announces requests while the in-flight limit and free blocks allow, frees blocks as
    /// the connector releases them, and ends with Complete.
    async fn serve(&mut self) -> Result<()> {
        let (released_tx, mut released) = mpsc::unbounded_channel();
        let requests = self.hello.requests;
        let mut issued = 0;
        loop {
            let blocks_freed = self.shared.blocks_freed.notified();
            tokio::pin!(blocks_freed);
            blocks_freed.as_mut().enable();
            let mut starved = !self.next_turns(&released_tx).await?;
            while !starved && self.may_start(issued) {
                if !self.announce(&released_tx).await? {
                    starved = true;
                    break;
                }
                issued += 1;
            }
            if self.acked == requests {
                return self
                    .channel
                    .send(&Message::Complete { requests })
                    .await
                    .map_err(Error::from);
            }
            tokio::select! {
                Some(routed) = released.recv() => match routed {
                    Routed::Released(request) => self.acknowledge(&request),
                    Routed::LoadEnded(outcome) => self.read_back_ended(outcome, &released_tx).await?,
                },
                message = self.channel.recv::<Message>() => match message {
                    Ok(Message::Turn(params)) if self.turns.is_some() => self.turn_answered(*params)?,
                    Ok(Message::TurnVllm(json)) if self.turns.is_some() => {
                        let params = KvTransferParams::from_vllm_json(&json).map_err(|err| {
                            Error::Protocol(format!("decode's vLLM kv_transfer_params: {err}"))
                        })?;
                        self.turn_answered(params)?
                    }
                    other => return Err(self.unexpected(other)),
                },
                () = &mut blocks_freed, if starved => {}
            }
        }
    }

    /// Whether a new request (a new conversation, with several turns) may be announced,
    /// `issued` of them so far: the in-flight limit and the session's count allow it.
    fn may_start(&self, issued: u64) -> bool {
        let in_flight = self.hello.in_flight as usize;
        match &self.turns {
            Some(turns) => turns.may_start(issued, in_flight),
            None => self.outstanding.len() < in_flight && issued < self.hello.requests,
        }
    }

    /// Why a message from decode ends the session (decode sends nothing after its Hello
    /// unless it gives up).
    fn unexpected(&self, message: nixl_connector::Result<Message>) -> Error {
        let agent = &self.hello.agent;
        match message {
            Ok(Message::Error { message }) => {
                Error::PeerGone(format!("decode {agent} gave up: {message}"))
            }
            Ok(other) => Error::Protocol(format!(
                "unexpected {} from decode during the session",
                other.kind()
            )),
            Err(nixl_connector::Error::Closed { .. }) => Error::PeerGone(format!(
                "decode {agent} disconnected after {}/{} requests",
                self.acked, self.hello.requests
            )),
            Err(err) => err.into(),
        }
    }

    /// Fills free blocks for a new request, finishes it through the scheduler (the
    /// connector holds it for the decode) and announces its params; `false` when no blocks
    /// are free.
    async fn announce(&mut self, released: &mpsc::UnboundedSender<Routed>) -> Result<bool> {
        let count = self.hello.blocks_per_request as usize;
        let Some(blocks) = lock(&self.shared.pool).alloc(count) else {
            return Ok(false);
        };
        let request = self.shared.next_request.fetch_add(1, Ordering::Relaxed);
        let cache = self.shared.worker.cache()?;
        let id = match &mut self.turns {
            Some(turns) => {
                // The conversation's first turn; its number seeds the pattern of its blocks.
                let keys = turns.started(request, self.hello.blocks_per_request);
                cache.compute_blocks(&blocks, &keys, request)?;
                TurnId {
                    conversation: request,
                    turn: 1,
                }
                .to_string()
            }
            None => {
                cache.fill_blocks(&blocks, request)?;
                request.to_string()
            }
        };
        if self.shared.options.corrupt_request == Some(request) {
            tracing::warn!(
                request,
                "fault injection: corrupting the request's first block"
            );
            cache.corrupt_block(blocks[0])?;
        }
        let decode = KvTransferParams {
            do_remote_decode: true,
            ..Default::default()
        };
        self.finish_and_announce(id, blocks, &decode, released)
            .await?;
        Ok(true)
    }

    /// Finishes request `id`, prefilled in `blocks`, through the scheduler with `asked` (the
    /// params it arrived with: `do_remote_decode`), so that the connector holds it for the
    /// decode, and announces its params.
    async fn finish_and_announce(
        &mut self,
        id: String,
        blocks: Vec<u32>,
        asked: &KvTransferParams,
        released: &mpsc::UnboundedSender<Routed>,
    ) -> Result<()> {
        lock(&self.shared.owners).insert(id.clone(), released.clone());
        let block_ids: Vec<usize> = blocks.iter().map(|&b| b as usize).collect();
        self.outstanding.insert(id.clone(), blocks);
        let mut params = {
            let mut scheduler = lock(&self.shared.scheduler);
            let finished = scheduler.request_finished(
                &id,
                &block_ids,
                block_ids.len(),
                Some(asked),
                FinishStatus::LengthCapped,
            );
            engine_step(self.shared, &mut scheduler);
            finished.kv_transfer_params
        }
        .ok_or_else(|| Error::Protocol("the scheduler gave no transfer params".into()))?;
        params.remote_host = Some(self.local_ip.to_string());
        let announce = match self.shared.worker.connector().protocol() {
            Protocol::Vllm => Message::AnnounceVllm(params.to_vllm_json()),
            _ => Message::Announce(Box::new(params)),
        };
        self.channel.send(&announce).await?;
        Ok(())
    }

    /// Frees the blocks of a request the connector released.
    fn acknowledge(&mut self, request: &str) {
        match self.outstanding.remove(request) {
            Some(blocks) => {
                lock(&self.shared.pool).free(&blocks);
                self.shared.blocks_freed.notify_waiters();
                self.acked += 1;
                self.acked_blocks += blocks.len() as u64;
                if let Some(turns) = &mut self.turns {
                    turns.released(request);
                }
            }
            None => tracing::warn!(
                agent = %self.hello.agent,
                request,
                "released request is not outstanding in this session; ignored"
            ),
        }
    }

    /// Gives back the blocks of every request still outstanding, and forgets them; a
    /// read-back still in flight is aborted, and its blocks wait for its end.
    fn end(&mut self) {
        let reading = self.turns.as_mut().map(|t| t.abandon()).unwrap_or_default();
        let mut still_read = Vec::new();
        {
            let mut scheduler = lock(&self.shared.scheduler);
            for request in reading {
                let done =
                    scheduler.request_finished(&request, &[], 0, None, FinishStatus::Aborted);
                if done.delay_free_blocks {
                    still_read.push(request);
                }
            }
        }
        let mut owners = lock(&self.shared.owners);
        let mut orphans = lock(&self.shared.orphans);
        let mut pool = lock(&self.shared.pool);
        for (request, blocks) in self.outstanding.drain() {
            owners.remove(&request);
            if still_read.contains(&request) {
                orphans.insert(request, blocks);
            } else {
                pool.free(&blocks);
            }
        }
        self.shared.blocks_freed.notify_waiters();
    }

    fn acked_bytes(&self) -> u64 {
        let l = self.shared.worker.layout;
        self.acked_blocks
            .saturating_mul((l.layers * l.block_bytes) as u64)
    }
}
