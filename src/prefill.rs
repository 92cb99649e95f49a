//! The prefill worker: holds KV-cache blocks, announces each request's blocks to a decode
//! worker over the side channel, and frees them when that worker's NIXL notification says
//! they were pulled.
//!
//! It serves any number of decode workers, concurrently, one thread per connection. A
//! decode worker that dies or misbehaves ends only its own session: its blocks go back to
//! the pool and its metadata is forgotten.

use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use nixl::kv_config::NixlSetup;
use nixl::{MetadataPeer, Notification, NotificationFilter, NotificationStream};

use crate::admission::{Admission, Ticket};
use crate::block_pool::BlockPool;
use crate::config::MetadataMode;
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::framing::{progress, write_frame, FrameError, DEFAULT_MAX_FRAME};
use crate::kv_cache::KvCache;
use crate::side_channel::{self, Hello, Message, Welcome, PROTOCOL_VERSION, SHUTDOWN_GRACE};

/// Default of [`PrefillOptions::max_pending_handshakes`].
pub const DEFAULT_MAX_PENDING_HANDSHAKES: usize = 16;

/// Default of [`PrefillOptions::max_pending_handshake_bytes`] (64 MiB).
pub const DEFAULT_MAX_PENDING_HANDSHAKE_BYTES: usize = 64 << 20;

/// How the prefill worker runs.
#[derive(Debug, Clone)]
pub struct PrefillOptions {
    /// How agent metadata is exchanged.
    pub mode: MetadataMode,
    /// Largest side-channel frame accepted.
    pub max_frame: usize,
    /// How long a new connection may take, in all, to complete its handshake.
    pub handshake_timeout: Duration,
    /// Most connections in their handshake at once; more are refused at once.
    pub max_pending_handshakes: usize,
    /// Most bytes the frames of pending handshakes may hold together, beyond
    /// [`FREE_BYTES_PER_HANDSHAKE`](crate::admission::FREE_BYTES_PER_HANDSHAKE) each; a
    /// handshake whose frame would pass it is refused.
    pub max_pending_handshake_bytes: usize,
    /// Sessions to serve before [`PrefillServer::serve`] returns (`None`: forever).
    pub max_sessions: Option<u64>,
    /// Fault injection: corrupt one byte of the request with this id after filling it.
    pub corrupt_request: Option<u64>,
}

impl Default for PrefillOptions {
    fn default() -> Self {
        PrefillOptions {
            mode: MetadataMode::SideChannel,
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
}

/// Events a session thread waits on.
enum SessionEvent {
    Notification(Vec<u8>),
    Message(Message),
    Closed(Error),
}

/// State shared by the accept loop, the notification pump and the sessions.
struct Shared {
    setup: NixlSetup,
    cache: KvCache,
    options: PrefillOptions,
    pool: Mutex<BlockPool>,
    next_request: AtomicU64,
    /// Notification routes: decode agent name → its session.
    sessions: Mutex<HashMap<String, mpsc::Sender<SessionEvent>>>,
    /// This agent's metadata for the Welcome (empty in etcd mode).
    metadata: Vec<u8>,
    /// The bounds on pending handshakes.
    admission: Arc<Admission>,
}

/// A bound prefill worker, ready to [`serve`](Self::serve).
pub struct PrefillServer {
    shared: Arc<Shared>,
    listener: TcpListener,
}

impl std::fmt::Debug for PrefillServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillServer")
            .field("agent", &self.shared.setup.agent().name())
            .field("listener", &self.listener)
            .finish_non_exhaustive()
    }
}

impl PrefillServer {
    /// Publishes the agent's metadata (etcd mode) or snapshots it for the handshake
    /// (side-channel mode), and listens on `addr`.
    ///
    /// # Errors
    /// NIXL metadata errors; [`Error::Io`] when etcd does not answer (etcd mode) or `addr`
    /// cannot be bound.
    pub fn bind(
        setup: NixlSetup,
        cache: KvCache,
        addr: SocketAddr,
        options: PrefillOptions,
    ) -> Result<Self> {
        let metadata = match options.mode {
            MetadataMode::SideChannel => setup.agent().local_metadata()?,
            MetadataMode::Etcd => {
                crate::etcd_metadata::publish(setup.agent())?;
                Vec::new()
            }
        };
        let listener =
            TcpListener::bind(addr).map_err(|err| Error::io(format!("listen on {addr}"), err))?;
        let blocks = u32::try_from(cache.layout().blocks).unwrap_or(u32::MAX);
        let admission = Admission::new(
            options.max_pending_handshakes,
            options.max_pending_handshake_bytes,
        );
        Ok(PrefillServer {
            shared: Arc::new(Shared {
                setup,
                cache,
                options,
                pool: Mutex::new(BlockPool::new(blocks)),
                next_request: AtomicU64::new(0),
                sessions: Mutex::new(HashMap::new()),
                metadata,
                admission,
            }),
            listener,
        })
    }

    /// The address the side channel listens on.
    ///
    /// # Errors
    /// [`Error::Io`] if the socket cannot say.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|err| Error::io("query the listening address", err))
    }

    /// Serves decode workers until [`PrefillOptions::max_sessions`] sessions have ended
    /// (forever without a limit), reporting every session and refused connection.
    ///
    /// # Errors
    /// [`Error::Io`] when the listener cannot be set up or a helper thread cannot start.
    pub fn serve(self, mut on_event: impl FnMut(PrefillEvent)) -> Result<ServeStats> {
        self.listener
            .set_nonblocking(true)
            .map_err(|err| Error::io("make the listener non-blocking", err))?;
        // Subscribed before any session starts, so no notification is missed.
        let notes = self
            .shared
            .setup
            .agent()
            .notification_stream(NotificationFilter::any())?;
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let pump = {
            let shared = self.shared.clone();
            thread::Builder::new()
                .name("notifications".into())
                .spawn(move || pump_notifications(&shared, notes, stopped))
                .map_err(|err| Error::io("spawn the notification thread", err))?
        };
        let (events_tx, events) = mpsc::channel();
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
            let mut busy = false;
            if !limit_reached {
                match self.listener.accept() {
                    Ok((stream, peer)) => {
                        busy = true;
                        let deadline = Deadline::after(self.shared.options.handshake_timeout);
                        let Some(ticket) = self.shared.admission.admit() else {
                            let error = refuse_over_count(&self.shared, stream, peer);
                            let _ = events_tx.send(PrefillEvent::Rejected { peer, error });
                            continue;
                        };
                        let (shared, events_tx) = (self.shared.clone(), events_tx.clone());
                        let spawned = thread::Builder::new()
                            .name(format!("session-{peer}"))
                            .spawn(move || {
                                run_session(&shared, stream, peer, ticket, deadline, &events_tx)
                            });
                        if let Err(err) = spawned {
                            tracing::error!(%peer, %err, "cannot spawn a session thread");
                        }
                    }
                    Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {}
                    // Aborted handshakes, descriptor exhaustion: keep serving the others.
                    Err(err) => tracing::warn!(%err, "accepting a side-channel connection failed"),
                }
            }
            while let Ok(event) = events.try_recv() {
                busy = true;
                match &event {
                    PrefillEvent::SessionStarted { .. } => stats.sessions += 1,
                    PrefillEvent::SessionEnded(report) => {
                        ended += 1;
                        stats.requests += report.requests_acked;
                        stats.failed_sessions += u64::from(report.outcome.is_err());
                    }
                    PrefillEvent::Rejected { .. } => stats.rejected += 1,
                }
                on_event(event);
            }
            if !busy {
                thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = stop.send(());
        if pump.join().is_err() {
            tracing::error!("the notification thread panicked");
        }
        if self.shared.options.mode == MetadataMode::Etcd {
            if let Err(err) = self
                .shared
                .setup
                .agent()
                .invalidate_local_metadata(&MetadataPeer::Etcd)
            {
                tracing::warn!(%err, "could not withdraw the metadata from etcd");
            }
        }
        Ok(stats)
    }
}

/// Routes every NIXL notification to the session of the agent that sent it, awaiting them
/// on the async API until `stopped` fires.
fn pump_notifications(
    shared: &Shared,
    mut notes: NotificationStream,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            tracing::error!(%err, "cannot start the notification runtime");
            return;
        }
    };
    runtime.block_on(async {
        loop {
            tokio::select! {
                note = notes.recv() => route(shared, note),
                _ = &mut stopped => return,
            }
        }
    });
}

/// Hands one notification to the session of its sender.
fn route(shared: &Shared, note: Notification) {
    let sender = String::from_utf8_lossy(&note.sender);
    let sessions = shared.sessions.lock().unwrap_or_else(|p| p.into_inner());
    match sessions.get(sender.as_ref()) {
        // A session that just ended has dropped its receiver; nothing to do.
        Some(session) => {
            let _ = session.send(SessionEvent::Notification(note.message));
        }
        None => tracing::warn!(
            %sender,
            "a notification from an agent without a session; ignored"
        ),
    }
}

/// Refuses a connection because [`PrefillOptions::max_pending_handshakes`] are pending:
/// logs it, tells the peer why and closes the connection.
fn refuse_over_count(shared: &Shared, stream: TcpStream, peer: SocketAddr) -> Error {
    let max = shared.admission.max_pending();
    let error = Error::Busy(format!(
        "prefill is busy: {max} handshakes are already pending, the most it allows; try again later"
    ));
    tracing::warn!(
        %peer,
        max_pending_handshakes = max,
        "refused a side-channel connection: {max} handshakes already pending"
    );
    // The connection is fresh, so this short frame fits its send buffer; never block on it.
    let _ = stream.set_nonblocking(true);
    let refusal = Message::Error {
        message: error.to_string(),
    };
    let _ = write_frame(&mut &stream, &refusal.encode(), shared.options.max_frame);
    let _ = stream.shutdown(Shutdown::Both);
    error
}

/// Runs one connection from handshake to end and reports it.
fn run_session(
    shared: &Shared,
    stream: TcpStream,
    peer: SocketAddr,
    ticket: Ticket,
    deadline: Deadline,
    events: &mpsc::Sender<PrefillEvent>,
) {
    let event = match Session::handshake(shared, stream, peer, ticket, deadline) {
        Err(error) => {
            if let Error::Frame(FrameError::OverBudget(reason)) = &error {
                tracing::warn!(%peer, "refused a side-channel connection: {reason}");
            }
            PrefillEvent::Rejected { peer, error }
        }
        Ok(mut session) => {
            let _ = events.send(PrefillEvent::SessionStarted {
                peer,
                decode_agent: session.hello.agent.clone(),
                requests: session.hello.requests,
            });
            let start = Instant::now();
            let outcome = session.serve();
            if let Err(err) = &outcome {
                let _ = session.tx.send(&Message::Error {
                    message: err.to_string(),
                });
            }
            session.tx.shutdown();
            PrefillEvent::SessionEnded(SessionReport {
                peer,
                decode_agent: session.hello.agent.clone(),
                requests_wanted: session.hello.requests,
                requests_acked: session.acked,
                bytes: session.acked_bytes(),
                duration: start.elapsed(),
                outcome,
            })
        }
    };
    let _ = events.send(event);
}

/// The registration of a decode agent with the prefill worker; undone on drop.
struct Route<'a> {
    shared: &'a Shared,
    agent: String,
    metadata_loaded: bool,
}

impl Drop for Route<'_> {
    fn drop(&mut self) {
        self.shared
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.agent);
        if self.metadata_loaded {
            if let Err(err) = self
                .shared
                .setup
                .agent()
                .invalidate_remote_metadata(&self.agent)
            {
                tracing::warn!(agent = %self.agent, %err, "could not forget the decode agent's metadata");
            }
        }
    }
}

/// One decode worker's session.
struct Session<'a> {
    shared: &'a Shared,
    hello: Hello,
    tx: side_channel::Sender,
    events: mpsc::Receiver<SessionEvent>,
    outstanding: HashMap<u64, Vec<u32>>,
    acked: u64,
    _route: Route<'a>,
}

impl<'a> Session<'a> {
    /// Reads the Hello, checks it, loads the decode agent's metadata and answers with the
    /// Welcome. On failure, tells the peer why when it still can.
    fn handshake(
        shared: &'a Shared,
        stream: TcpStream,
        peer: SocketAddr,
        ticket: Ticket,
        deadline: Deadline,
    ) -> Result<Self> {
        stream
            .set_nonblocking(false)
            .map_err(|err| Error::io("make the connection blocking", err))?;
        let (mut tx, mut rx) = side_channel::split(stream, shared.options.max_frame)?;
        match Self::accept(shared, &mut tx, &mut rx, ticket, deadline) {
            Ok((hello, route, events)) => {
                spawn_reader(rx, route.agent.clone(), peer, shared)?;
                Ok(Session {
                    shared,
                    hello,
                    tx,
                    events,
                    outstanding: HashMap::new(),
                    acked: 0,
                    _route: route,
                })
            }
            Err(err) => {
                let refusal = Message::Error {
                    message: err.to_string(),
                };
                // The deadline may have passed: give the refusal a moment of its own.
                let _ = tx.send_by(&refusal, Deadline::after(SHUTDOWN_GRACE));
                tx.shutdown();
                Err(err)
            }
        }
    }

    fn accept(
        shared: &'a Shared,
        tx: &mut side_channel::Sender,
        rx: &mut side_channel::Receiver,
        mut ticket: Ticket,
        deadline: Deadline,
    ) -> Result<(Hello, Route<'a>, mpsc::Receiver<SessionEvent>)> {
        rx.set_deadline(Some(deadline));
        let received = rx.recv_charged(&mut ticket);
        let hello = match received.map_err(|err| handshake_timeout(err, deadline))? {
            Message::Hello(hello) => hello,
            other => {
                return Err(Error::Protocol(format!(
                    "expected Hello, got {}",
                    other.kind()
                )))
            }
        };
        check_hello(shared, &hello)?;
        let (events_tx, events) = mpsc::channel();
        let mut route = {
            let mut sessions = shared.sessions.lock().unwrap_or_else(|p| p.into_inner());
            if sessions.contains_key(&hello.agent) {
                return Err(Error::Protocol(format!(
                    "agent {:?} already has a session",
                    hello.agent
                )));
            }
            sessions.insert(hello.agent.clone(), events_tx.clone());
            Route {
                shared,
                agent: hello.agent.clone(),
                metadata_loaded: false,
            }
        };
        let agent = shared.setup.agent();
        match shared.options.mode {
            MetadataMode::SideChannel => {
                let name = agent.load_remote_metadata(&hello.metadata)?;
                route.metadata_loaded = true;
                if name != hello.agent {
                    return Err(Error::Protocol(format!(
                        "the metadata is agent {name:?}'s, but the Hello came from {:?}",
                        hello.agent
                    )));
                }
            }
            MetadataMode::Etcd => {
                crate::etcd_metadata::fetch(agent, &hello.agent, deadline)?;
                route.metadata_loaded = true;
            }
        }
        let welcome = Message::Welcome(Welcome {
            agent: agent.name().to_string(),
            metadata: shared.metadata.clone(),
            cache: shared.cache.describe(),
        });
        tx.send_by(&welcome, deadline)?;
        rx.set_deadline(None);
        // Keep a sender alive in the route table only; the reader thread gets its own.
        drop(events_tx);
        Ok((hello, route, events))
    }

    /// Announces requests while the in-flight limit and free blocks allow, frees blocks as
    /// notifications arrive, and ends with Complete.
    fn serve(&mut self) -> Result<()> {
        let result = self.serve_inner();
        let mut pool = self.shared.pool.lock().unwrap_or_else(|p| p.into_inner());
        for (_, blocks) in self.outstanding.drain() {
            pool.free(&blocks);
        }
        result
    }

    fn serve_inner(&mut self) -> Result<()> {
        let requests = self.hello.requests;
        let mut issued = 0;
        loop {
            let mut starved = false;
            while self.outstanding.len() < self.hello.in_flight as usize && issued < requests {
                if !self.announce()? {
                    starved = true;
                    break;
                }
                issued += 1;
            }
            if self.acked == requests {
                return self.tx.send(&Message::Complete { requests });
            }
            let wait = if starved {
                Duration::from_millis(2)
            } else {
                Duration::from_millis(100)
            };
            match self.events.recv_timeout(wait) {
                Ok(SessionEvent::Notification(message)) => self.acknowledge(&message),
                Ok(SessionEvent::Message(Message::Error { message })) => {
                    return Err(Error::PeerGone(format!(
                        "decode {} gave up: {message}",
                        self.hello.agent
                    )))
                }
                Ok(SessionEvent::Message(other)) => {
                    return Err(Error::Protocol(format!(
                        "unexpected {} from decode during the session",
                        other.kind()
                    )))
                }
                Ok(SessionEvent::Closed(Error::Frame(FrameError::Closed))) => {
                    return Err(Error::PeerGone(format!(
                        "decode {} disconnected after {}/{requests} requests",
                        self.hello.agent, self.acked
                    )))
                }
                Ok(SessionEvent::Closed(err)) => return Err(err),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(Error::PeerGone(
                        "the session's event sources are gone".into(),
                    ))
                }
            }
        }
    }

    /// Fills free blocks for a new request and announces it; `false` when no blocks are free.
    fn announce(&mut self) -> Result<bool> {
        let count = self.hello.blocks_per_request as usize;
        let Some(blocks) = self
            .shared
            .pool
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .alloc(count)
        else {
            return Ok(false);
        };
        let request = self.shared.next_request.fetch_add(1, Ordering::Relaxed);
        self.outstanding.insert(request, blocks.clone());
        self.shared.cache.fill_blocks(&blocks, request)?;
        if self.shared.options.corrupt_request == Some(request) {
            tracing::warn!(
                request,
                "fault injection: corrupting the request's first block"
            );
            self.shared.cache.corrupt_block(blocks[0])?;
        }
        self.tx.send(&Message::Announce { request, blocks })?;
        Ok(true)
    }

    /// Frees the blocks of the request a notification names.
    fn acknowledge(&mut self, message: &[u8]) {
        let request = std::str::from_utf8(message)
            .ok()
            .and_then(|s| s.parse::<u64>().ok());
        match request.and_then(|r| self.outstanding.remove(&r)) {
            Some(blocks) => {
                self.shared
                    .pool
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .free(&blocks);
                self.acked += 1;
            }
            None => tracing::warn!(
                agent = %self.hello.agent,
                message = %String::from_utf8_lossy(message),
                "notification names no outstanding request of this session; ignored"
            ),
        }
    }

    fn acked_bytes(&self) -> u64 {
        let l = self.shared.cache.layout();
        self.acked
            .saturating_mul(u64::from(self.hello.blocks_per_request))
            .saturating_mul((l.layers * l.block_bytes) as u64)
    }
}

/// Turns a Hello that did not arrive by the handshake deadline into [`Error::Timeout`].
fn handshake_timeout(err: Error, deadline: Deadline) -> Error {
    match err {
        Error::Frame(FrameError::Stalled { got: 0, .. }) => {
            Error::Timeout(format!("no Hello within {:?}", deadline.limit()))
        }
        Error::Frame(FrameError::Stalled { got, expected }) => Error::Timeout(format!(
            "decode sent only {} of its Hello frame, then the {:?} handshake deadline passed",
            progress(got, expected),
            deadline.limit()
        )),
        other => other,
    }
}

/// Checks a Hello against this worker's cache.
fn check_hello(shared: &Shared, hello: &Hello) -> Result<()> {
    let layout = shared.cache.layout();
    let refuse = |reason: String| Err(Error::Protocol(reason));
    if hello.version != PROTOCOL_VERSION {
        return refuse(format!(
            "protocol version {} is not {PROTOCOL_VERSION}",
            hello.version
        ));
    }
    if hello.agent.is_empty() || hello.agent == shared.setup.agent().name() {
        return refuse(format!("bad decode agent name {:?}", hello.agent));
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
    if shared.options.mode == MetadataMode::SideChannel && hello.metadata.is_empty() {
        return refuse("the Hello carries no metadata (is decode in etcd mode?)".into());
    }
    Ok(())
}

/// Forwards the decode worker's messages to its session until the connection ends.
fn spawn_reader(
    mut rx: side_channel::Receiver,
    agent: String,
    peer: SocketAddr,
    shared: &Shared,
) -> Result<()> {
    let route = shared
        .sessions
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&agent)
        .cloned()
        .ok_or_else(|| Error::PeerGone(format!("the session of {agent} is gone")))?;
    thread::Builder::new()
        .name(format!("reader-{peer}"))
        .spawn(move || loop {
            let event = match rx.recv() {
                Ok(message) => SessionEvent::Message(message),
                Err(err) => SessionEvent::Closed(err),
            };
            let closed = matches!(event, SessionEvent::Closed(_));
            if route.send(event).is_err() || closed {
                break;
            }
        })
        .map_err(|err| Error::io("spawn the side-channel reader", err))?;
    Ok(())
}
