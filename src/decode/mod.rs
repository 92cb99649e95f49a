//! The decode worker: a thin client of the KV connector. It connects to a prefill worker's
//! control channel, and for every announced request hands the request's transfer params to
//! the connector's scheduler and worker, which READ the request's blocks of every layer into
//! free local blocks (the notification naming the request, so prefill frees it); then it
//! checks every byte. With several turns per
//! [`conversation`](crate::conversation) it answers each turn but the last and keeps the
//! answered conversation for prefill to read back.

mod turns;

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nixl_connector::side_channel::RetryBackoff;
use nixl_connector::{
    Channel, FinishStatus, KvConnectorScheduler, KvTransferParams, LoadOutcome, Protocol,
    SchedulerConfig,
};
use tokio::net::TcpStream;
use tokio::time::Instant as Deadline;

use crate::block_pool::BlockPool;
use crate::config::Worker;
use crate::conversation::{longest_prompt, TurnId};
use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, KvLayout, Mismatch};
use crate::metered::Metered;
use crate::not_a_prefill::{not_a_prefill, Answer};
use crate::parallel::MAX_RANKS;
use crate::protocol::{Hello, Message, Welcome, DEFAULT_MAX_FRAME, PROTOCOL_VERSION};
use crate::stats::{DecodeSummary, FirstLoad, Lifecycle, Progress};

/// How the decode worker runs.
#[derive(Debug, Clone)]
pub struct DecodeOptions {
    /// The prefill worker's control channel.
    pub prefill: SocketAddr,
    /// Requests to pull.
    pub requests: u64,
    /// Blocks per request (in every layer).
    pub blocks_per_request: u32,
    /// Requests in flight at once.
    pub in_flight: u32,
    /// How long, in all, reaching prefill and the handshake may take.
    pub connect_timeout: Duration,
    /// How long the run may go without news (an announcement, a load that ended) before it
    /// fails: a prefill that stops announcing cannot hold decode forever.
    pub idle_timeout: Duration,
    /// Largest control-channel frame accepted.
    pub max_frame: usize,
    /// How often the progress callback runs.
    pub progress_interval: Duration,
    /// Blocks at the start of every request that decode's own prefix cache holds: it
    /// computes them itself and loads only the rest (all of them: nothing is read, prefill
    /// is only notified).
    pub prefix_hit_blocks: u32,
    /// Abort every `K`th announced request: alternately before its load starts (prefill is
    /// only notified) and once its load is with the connector (its blocks are freed when
    /// the load ends).
    pub abort_every: Option<u64>,
    /// Turns per conversation: each request is a conversation of this many turns (1: a
    /// request stands alone; see [`conversation`](crate::conversation)).
    pub turns: u32,
    /// With several turns, the most blocks decode answers a turn with.
    pub answer_blocks: u32,
    /// Fault injection: corrupt one byte of the first answer of this conversation, which
    /// prefill reads back.
    pub corrupt_answer: Option<u64>,
}

impl DecodeOptions {
    /// Options with the demo's defaults for everything but the prefill address.
    pub fn new(prefill: SocketAddr) -> Self {
        DecodeOptions {
            prefill,
            requests: 64,
            blocks_per_request: 16,
            in_flight: 4,
            connect_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(20),
            max_frame: DEFAULT_MAX_FRAME,
            progress_interval: Duration::from_millis(500),
            prefix_hit_blocks: 0,
            abort_every: None,
            turns: 1,
            answer_blocks: 4,
            corrupt_answer: None,
        }
    }

    /// Requests of the run: every turn of every conversation.
    pub fn total_requests(&self) -> u64 {
        self.requests.saturating_mul(u64::from(self.turns))
    }

    /// The most blocks a request's prompt takes (its last turn's, with several turns).
    fn longest_prompt(&self) -> u64 {
        if self.turns > 1 {
            longest_prompt(self.turns, self.blocks_per_request, self.answer_blocks)
        } else {
            u64::from(self.blocks_per_request)
        }
    }
}

/// An announced request waiting for free local blocks.
struct Pending {
    /// The request's number, the seed of its pattern (its conversation's, with turns).
    request: u64,
    /// The turn, with several turns.
    turn: Option<TurnId>,
    params: KvTransferParams,
    announced: Instant,
    /// Aborted once its load is with the connector (`--abort-every`).
    abort_during_load: bool,
}

/// A load in flight: what it moves.
struct Pull {
    request: u64,
    turn: Option<TurnId>,
    local: Vec<u32>,
    /// The pattern key of each local block: prefill's block, or with turns its position in
    /// the conversation.
    remote: Vec<u32>,
    /// Local blocks decode computed or held itself (its prefix cache), not loaded.
    held: usize,
    announced: Instant,
    /// The request was aborted: its blocks are freed, unchecked, when the load ends.
    aborted: bool,
}

/// Pulls `options.requests` requests from prefill into `worker`'s cache, verifying every
/// byte, and calls `on_progress` every `options.progress_interval`. The worker's transfer
/// timeout bounds each READ, and its side-channel deadline each handshake.
///
/// Returns the summary even when blocks mismatch (see [`DecodeSummary::ok`]).
///
/// # Errors
/// [`Error::Config`] when the cache cannot hold `in_flight` requests; handshake errors
/// ([`Error::Rejected`] when prefill refuses); [`Error::PeerGone`] as soon as prefill's
/// control channel closes before the run is complete (also when a READ fails and the channel
/// closes within a second: prefill died); [`Error::LoadFailed`] for a READ that failed or
/// passed its timeout; [`Error::Timeout`] after `idle_timeout` without news.
pub async fn run(
    worker: &Worker,
    options: &DecodeOptions,
    mut on_progress: impl FnMut(&Progress),
) -> Result<DecodeSummary> {
    if options.turns > 1 && !worker.parallel.is_single() {
        return Err(Error::Config(format!(
            "--turns {} with --tp {} --pp {}: conversations of several turns run on one rank (the read-backs of a parallel engine are tested in nixl-connector/tests/pipeline.rs)",
            options.turns, worker.parallel.tp, worker.parallel.pp
        )));
    }
    check_options(options, worker.layout)?;
    let began = Instant::now();
    let (mut channel, welcome) = connect(worker, options).await?;
    let first = FirstLoad {
        handshake: began.elapsed(),
        loaded: None,
    };
    let result = pull_all(
        worker,
        options,
        (&mut channel, &welcome),
        (began, first),
        &mut on_progress,
    )
    .await;
    if let Err(err) = &result {
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            channel
                .send(&Message::Error {
                    message: err.to_string(),
                })
                .await
        })
        .await;
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), channel.close()).await;
    result
}

fn check_options(options: &DecodeOptions, layout: KvLayout) -> Result<()> {
    if options.blocks_per_request == 0 || options.in_flight == 0 {
        return Err(Error::Config(
            "blocks per request and requests in flight must be at least 1".into(),
        ));
    }
    if options.prefix_hit_blocks > options.blocks_per_request {
        return Err(Error::Config(format!(
            "{} prefix-hit blocks of requests of {} blocks; at most all of them can be hits",
            options.prefix_hit_blocks, options.blocks_per_request
        )));
    }
    if options.abort_every == Some(0) {
        return Err(Error::Config("--abort-every must be at least 1".into()));
    }
    if options.turns == 0 {
        return Err(Error::Config("--turns must be at least 1".into()));
    }
    if options.turns > 1 && (options.prefix_hit_blocks > 0 || options.abort_every.is_some()) {
        return Err(Error::Config(
            "--turns runs without --prefix-hit-blocks and --abort-every (its turns hit decode's prefix cache themselves)".into(),
        ));
    }
    if options.turns > 1 && options.answer_blocks == 0 {
        return Err(Error::Config("--answer-blocks must be at least 1".into()));
    }
    let prompt = options.longest_prompt();
    let needed = prompt.saturating_mul(u64::from(options.in_flight));
    if needed > layout.blocks as u64 {
        return Err(Error::Config(format!(
            "{} requests in flight of {prompt} blocks need {needed} blocks; the decode cache has {}",
            options.in_flight, layout.blocks
        )));
    }
    Ok(())
}

/// How far ahead [`after`] puts a deadline that the clock cannot represent: 30 years.
const FAR_FUTURE: Duration = Duration::from_secs(86_400 * 365 * 30);

/// The deadline `limit` from now; a limit past what the clock can represent (e.g.
/// `--connect-timeout-s 18446744073709551615`) is [`FAR_FUTURE`] from now, no limit in
/// practice, instead of a panic.
fn after(limit: Duration) -> Deadline {
    let now = Deadline::now();
    now.checked_add(limit).unwrap_or_else(|| now + FAR_FUTURE)
}

/// Connects to prefill (retrying while it starts, and after a busy answer), sends the Hello,
/// takes the Welcome and runs the connector's handshake with prefill's side channel, all by
/// one deadline.
async fn connect(worker: &Worker, options: &DecodeOptions) -> Result<(Channel<Metered>, Welcome)> {
    let addr = options.prefill;
    let limit = options.connect_timeout;
    let deadline = after(limit);
    let mut backoff = RetryBackoff::default();
    let mut tries = 0;
    let (channel, welcome) = loop {
        tries += 1;
        let busy = match greet(worker, options, deadline).await? {
            Greeting::Welcome(session) => break *session,
            Greeting::Busy(busy) => busy,
        };
        let pause = backoff.next_pause();
        if after(pause) >= deadline {
            return Err(Error::Rejected(format!(
                "{busy} (still busy after {tries} tries within {limit:?})"
            )));
        }
        tracing::info!(%addr, tries, "prefill is busy; trying again: {busy}");
        tokio::time::sleep(pause).await;
    };
    // The connector's handshake with prefill (metadata, cache layout), within the same
    // deadline, so that the run's timing starts with both workers connected.
    // A prefill of several stages is handshaken with by the first load, stage by stage.
    let host = addr.ip().to_string();
    let (tp, port) = (welcome.tp as usize, welcome.side_channel_port);
    let handshakes = worker
        .ranks
        .iter()
        .filter(|_| welcome.pp <= 1)
        .map(|rank| rank.handshake_with(&welcome.engine, &host, port, tp));
    match tokio::time::timeout_at(deadline, futures_util::future::try_join_all(handshakes)).await {
        Ok(done) => {
            done?;
        }
        Err(_) => {
            return Err(Error::Timeout(format!(
                "the connector's handshake with prefill {} did not finish within {limit:?}",
                welcome.engine
            )))
        }
    }
    tracing::info!(prefill = %welcome.engine, %addr, "connected to prefill");
    Ok((channel, welcome))
}

/// What prefill answered a Hello with.
enum Greeting {
    /// The session is on.
    Welcome(Box<(Channel<Metered>, Welcome)>),
    /// No room now; prefill's reason.
    Busy(String),
}

/// One try: reaches prefill, sends the Hello and takes the Welcome (or a busy answer), by
/// `deadline`.
async fn greet(worker: &Worker, options: &DecodeOptions, deadline: Deadline) -> Result<Greeting> {
    let addr = options.prefill;
    let limit = options.connect_timeout;
    let stream = reach(addr, deadline, limit).await?;
    let mut channel = Channel::new(
        Metered::new(stream, None),
        addr.to_string(),
        options.max_frame,
    );
    let layout = worker.layout;
    let hello = Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        agent: worker.name.clone(),
        layers: u32::try_from(layout.layers).unwrap_or(u32::MAX),
        block_bytes: layout.block_bytes as u64,
        requests: options.total_requests(),
        turns: options.turns,
        answer_blocks: if options.turns > 1 {
            options.answer_blocks
        } else {
            0
        },
        blocks_per_request: options.blocks_per_request,
        in_flight: options.in_flight,
        connector_protocol: worker.connector().protocol().to_string(),
    });
    let exchange = async {
        channel.send(&hello).await?;
        channel.recv::<Message>().await
    };
    let answer = match tokio::time::timeout_at(deadline, exchange).await {
        Ok(answer) => answer,
        Err(_) if channel.get_ref().received() == 0 => {
            return Err(Error::Timeout(format!(
                "prefill at {addr} accepted the connection but sent no handshake within {limit:?}"
            )))
        }
        Err(_) => {
            return Err(Error::Timeout(format!(
                "prefill at {addr} sent only {} of its handshake frame, then the {limit:?} deadline passed",
                channel.get_ref().first_frame_progress()
            )))
        }
    };
    let welcome = match answer {
        Ok(Message::Welcome(welcome)) => welcome,
        Ok(Message::Busy { message }) => return Ok(Greeting::Busy(message)),
        Ok(Message::Error { message }) => return Err(Error::Rejected(message)),
        Ok(other) => {
            return Err(Error::Protocol(format!(
                "expected Welcome, got {}",
                other.kind()
            )))
        }
        Err(nixl_connector::Error::Closed { .. }) if channel.get_ref().received() == 0 => {
            return Err(not_a_prefill(addr, Answer::ClosedSilently, &[]))
        }
        Err(nixl_connector::Error::Closed { .. }) => {
            return Err(Error::PeerGone(format!(
                "prefill at {addr} closed the control channel during the handshake"
            )))
        }
        Err(nixl_connector::Error::Truncated { .. }) => {
            return Err(Error::PeerGone(format!(
                "prefill at {addr} closed the control channel after {} of its first frame",
                channel.get_ref().first_frame_progress()
            )))
        }
        Err(nixl_connector::Error::Protocol { reason, .. }) => {
            let first = channel.get_ref().first_bytes();
            return Err(not_a_prefill(addr, Answer::NotAFrame(&reason), first));
        }
        Err(err) => return Err(err.into()),
    };
    check_welcome(&welcome, layout, worker.parallel.kv_heads)?;
    Ok(Greeting::Welcome(Box::new((channel, welcome))))
}

/// A TCP connection to `addr`, retried every 100 ms until `deadline` (prefill may still be
/// starting).
async fn reach(addr: SocketAddr, deadline: Deadline, limit: Duration) -> Result<TcpStream> {
    let mut last = None;
    loop {
        match tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                return Ok(stream);
            }
            Ok(Err(err)) => {
                tracing::debug!(%addr, %err, "prefill's control channel not reachable yet; retrying");
                last = Some(err);
            }
            Err(_) => {}
        }
        if Deadline::now() + Duration::from_millis(100) >= deadline {
            let why = last.map_or_else(String::new, |err| format!(": {err}"));
            return Err(Error::Timeout(format!(
                "could not connect to prefill's control channel at {addr} within {limit:?}{why}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn check_welcome(welcome: &Welcome, layout: KvLayout, kv_heads: usize) -> Result<()> {
    if welcome.layers as usize != layout.layers || welcome.block_bytes != layout.block_bytes as u64
    {
        return Err(Error::Protocol(format!(
            "prefill's cache has {} layers of {}-byte blocks, decode's {} of {}",
            welcome.layers, welcome.block_bytes, layout.layers, layout.block_bytes
        )));
    }
    if welcome.blocks == 0 {
        return Err(Error::Protocol("prefill's cache has no blocks".into()));
    }
    let ranks = u64::from(welcome.tp) * u64::from(welcome.pp);
    if welcome.tp == 0 || welcome.pp == 0 || ranks > MAX_RANKS as u64 {
        return Err(Error::Protocol(format!(
            "prefill says it runs TP {} x PP {}: a demo prefill runs 1 to {MAX_RANKS} ranks",
            welcome.tp, welcome.pp
        )));
    }
    if welcome.kv_heads as usize != kv_heads {
        return Err(Error::Protocol(format!(
            "prefill's blocks are {} KV heads, decode's {kv_heads}: give both the same --kv-heads",
            welcome.kv_heads
        )));
    }
    Ok(())
}

/// The main loop: take announcements, start loads through the scheduler and worker when
/// local blocks are free, and check what landed as loads end. Nothing polls or naps here:
/// the connector wakes the loop when a load has ended. If the run fails, loads still in
/// flight are left to the connector, whose NIXL completion driver keeps their memory until
/// NIXL is done with it. `first` is when the run began and how long its connection took.
async fn pull_all(
    worker: &Worker,
    options: &DecodeOptions,
    (channel, welcome): (&mut Channel<Metered>, &Welcome),
    first: (Instant, FirstLoad),
    on_progress: &mut impl FnMut(&Progress),
) -> Result<DecodeSummary> {
    // Where a prefill reads back the blocks this engine keeps (with several turns).
    let side_channel = worker.connector().side_channel_addr()?;
    let mut scheduler_config = SchedulerConfig::new(
        &worker.name,
        &side_channel.ip().to_string(),
        side_channel.port(),
        worker.parallel.tp,
        &worker.kv_transfer_config,
    )?;
    // A load ends once every rank of every stage has read its share.
    scheduler_config.pp_size = worker.parallel.pp;
    if worker.connector().protocol() == Protocol::Vllm {
        scheduler_config.vllm_side_channel = Some(worker.connector().vllm_side_channel()?);
    }
    let heartbeat_interval = scheduler_config.lease.heartbeat_interval();
    let scheduler = KvConnectorScheduler::new(scheduler_config);
    let mut state = RunState::new(worker, options, welcome, scheduler, first)?;
    let start = Instant::now();
    let mut report = ticks_every(options.progress_interval);
    // Engine steps without news still carry the scheduler's heartbeats to prefill.
    let mut step = ticks_every(heartbeat_interval);
    let mut channel_open = true;
    let idle = tokio::time::sleep(options.idle_timeout);
    tokio::pin!(idle);
    loop {
        state.advance(worker, channel, channel_open).await?;
        state.progress.elapsed = start.elapsed();
        if state.finished() {
            break;
        }
        // Ended loads first, then their checks, then announcements: a load ends before
        // NIXL's notification reaches prefill, so prefill's next announcement never
        // overtakes the load it follows. Ended loads are checked one per turn, so loads
        // already announced are posted (at the top of the loop) between the checks.
        tokio::select! {
            biased;
            () = worker.load_ended() => {
                idle.as_mut().reset(after(options.idle_timeout));
                state.step_due = true;
            }
            () = std::future::ready(()), if !state.ended.is_empty() => {
                state.check_one(worker)?;
                // Answered turns go to prefill for their next turn.
                for message in state.outbox.drain(..) {
                    channel.send(&message).await?;
                }
                // Let the connector's tasks (READs awaited past their post) run between checks.
                tokio::task::yield_now().await;
            }
            incoming = channel.recv::<Message>(), if channel_open => match incoming {
                Ok(message) => {
                    idle.as_mut().reset(after(options.idle_timeout));
                    state.handle(message)?
                }
                // Prefill closes the channel after Complete; only loads are left then.
                Err(_) if state.complete => channel_open = false,
                Err(err) => return Err(Error::PeerGone(channel_lost(err, &state.progress))),
            },
            _ = report.tick() => on_progress(&state.progress),
            _ = step.tick() => state.step_due = true,
            () = &mut idle => return Err(Error::Timeout(format!(
                "no announcement from prefill and no load ended for {:?}, with {}/{} requests done",
                options.idle_timeout, state.progress.requests_done, options.total_requests()
            ))),
        }
    }
    Ok(state.summary(welcome))
}

/// A timer that first ticks `period` from now and then every `period`, a late tick
/// delaying the ones after it.
fn ticks_every(period: Duration) -> tokio::time::Interval {
    let mut ticks = tokio::time::interval_at(after(period), period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks
}

/// How long a decode whose load failed watches prefill's control channel before it blames
/// the load: a prefill that dies takes its memory and its connections down together (the
/// memory a moment first), so a load from it fails just before its channel closes.
const DEATH_GRACE: Duration = Duration::from_secs(1);

/// Why prefill's control channel failed with `err` before the run was complete.
fn channel_lost(err: nixl_connector::Error, done: &Progress) -> String {
    let (done, total) = (done.requests_done, done.requests_total);
    match err {
        nixl_connector::Error::Closed { .. } => {
            format!(
                "prefill closed the control channel after {done}/{total} requests (did it die?)"
            )
        }
        err => format!("lost the control channel to prefill after {done}/{total} requests: {err}"),
    }
}

/// The error of a run whose load failed with `failed`: prefill is gone
/// ([`Error::PeerGone`]) if its control channel fails within [`DEATH_GRACE`] (after the
/// messages it sent before), else the load failed on its own.
async fn blame(failed: Error, channel: &mut Channel<Metered>, done: &Progress) -> Error {
    let until = Deadline::now() + DEATH_GRACE;
    loop {
        match tokio::time::timeout_at(until, channel.recv::<Message>()).await {
            Ok(Ok(_)) => continue,
            Ok(Err(err)) => {
                return Error::PeerGone(format!(
                    "{}; a load failed with it: {failed}",
                    channel_lost(err, done)
                ))
            }
            Err(_) => return failed,
        }
    }
}

/// Where `--abort-every` aborts a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AbortPoint {
    /// On its announcement: the scheduler only notifies prefill.
    BeforeLoad,
    /// Once its load is with the connector: its blocks wait for the load's end.
    DuringLoad,
}

/// Where a decode run stands.
struct RunState<'w> {
    options: &'w DecodeOptions,
    cache: KvCache<'w>,
    scheduler: KvConnectorScheduler,
    remote_blocks: u32,
    /// The prefill this run reads from: engine id, host and side-channel port.
    source: (String, String, u16),
    /// Its TP ranks per stage and its stages.
    source_sizes: (usize, usize),
    pool: BlockPool,
    pending: VecDeque<Pending>,
    /// Loads started and not yet checked, by request id.
    in_flight: HashMap<String, Pull>,
    /// Loads that ended, oldest first, waiting to be checked.
    ended: VecDeque<String>,
    /// Request ids announced so far.
    seen: HashSet<String>,
    complete: bool,
    latencies: Vec<Duration>,
    /// When the run began (its first try to reach prefill), for `first_load`.
    began: Instant,
    first_load: FirstLoad,
    mismatches: Vec<Mismatch>,
    lifecycle: Lifecycle,
    progress: Progress,
    /// Whether the loop runs an engine step next: the scheduler has news for the worker, a
    /// load ended, or heartbeats are due.
    step_due: bool,
    /// How the loads the steps reported ended, for the loop to handle.
    outcomes: Vec<LoadOutcome>,
    /// With several turns: the conversations.
    conversations: Option<turns::Conversations>,
    /// Messages for prefill: answered turns.
    outbox: Vec<Message>,
}

impl<'w> RunState<'w> {
    /// A run of `options` into `worker`'s cache from the prefill that sent `welcome`,
    /// with `scheduler` (this engine's), before any announcement.
    fn new(
        worker: &'w Worker,
        options: &'w DecodeOptions,
        welcome: &Welcome,
        scheduler: KvConnectorScheduler,
        (began, first_load): (Instant, FirstLoad),
    ) -> Result<Self> {
        Ok(RunState {
            options,
            cache: worker.cache()?,
            scheduler,
            remote_blocks: welcome.blocks,
            source_sizes: (welcome.tp as usize, welcome.pp as usize),
            source: (
                welcome.engine.clone(),
                options.prefill.ip().to_string(),
                welcome.side_channel_port,
            ),
            pool: BlockPool::new(u32::try_from(worker.layout.blocks).unwrap_or(u32::MAX)),
            pending: VecDeque::new(),
            in_flight: HashMap::new(),
            ended: VecDeque::new(),
            seen: HashSet::new(),
            complete: false,
            latencies: Vec::new(),
            began,
            first_load,
            mismatches: Vec::new(),
            lifecycle: Lifecycle::default(),
            progress: Progress {
                requests_done: 0,
                requests_total: options.total_requests(),
                blocks: 0,
                bytes: 0,
                elapsed: Duration::ZERO,
            },
            step_due: false,
            outcomes: Vec::new(),
            conversations: (options.turns > 1).then(|| {
                turns::Conversations::new(
                    options.turns,
                    options.blocks_per_request,
                    options.answer_blocks,
                    options.corrupt_answer,
                )
            }),
            outbox: Vec::new(),
        })
    }

    /// What the run did, reading from the prefill that sent `welcome`.
    fn summary(mut self, welcome: &Welcome) -> DecodeSummary {
        if let Some(conversations) = &self.conversations {
            self.lifecycle.turns = Some(crate::stats::Turns {
                conversations: self.options.requests,
                turns: self.options.turns,
                loaded_blocks: self.progress.blocks / self.cache.layout().layers.max(1) as u64,
                answers_kept: conversations.answers,
                answer_blocks: conversations.answer_blocks,
            });
        }
        DecodeSummary {
            prefill_agent: welcome.engine.clone(),
            progress: self.progress,
            latencies: self.latencies,
            first_load: self.first_load,
            mismatches: self.mismatches,
            lifecycle: self.lifecycle,
        }
    }

    /// The loop's work before it waits: starts the loads that have free blocks, runs the
    /// engine step when one is due, and handles how loads ended. A load that failed ends
    /// the run, blamed on prefill if its control channel (still `channel_open`) fails
    /// within [`DEATH_GRACE`] (see [`blame`]).
    async fn advance(
        &mut self,
        worker: &Worker,
        channel: &mut Channel<Metered>,
        channel_open: bool,
    ) -> Result<()> {
        self.start_loads(worker)?;
        if self.step_due {
            self.step(worker)?;
        }
        let outcomes = std::mem::take(&mut self.outcomes);
        if let Err(failed) = self.loads_ended(outcomes) {
            if !channel_open {
                return Err(failed);
            }
            return Err(blame(failed, channel, &self.progress).await);
        }
        Ok(())
    }

    /// One engine step of the connector, exactly as the crate runs it
    /// ([`KvConnectorScheduler::step`]: the scheduler's metadata to the worker, the worker's
    /// output aggregated back); the load outcomes wait in `outcomes` for the loop.
    fn step(&mut self, worker: &Worker) -> Result<()> {
        self.step_due = false;
        let output = self.scheduler.step(&worker.ranks)?;
        worker.drop_metrics();
        self.outcomes.extend(output.load_outcomes);
        Ok(())
    }

    fn finished(&self) -> bool {
        self.complete && self.progress.requests_done == self.progress.requests_total
    }

    fn handle(&mut self, message: Message) -> Result<()> {
        let total = self.progress.requests_total;
        match message {
            Message::Announce(params) => self.announce(*params),
            Message::AnnounceVllm(json) => {
                let params = KvTransferParams::from_vllm_json(&json).map_err(|err| {
                    Error::Protocol(format!("prefill's vLLM kv_transfer_params: {err}"))
                })?;
                self.announce(params)
            }
            Message::Complete { requests } if requests == total => {
                self.complete = true;
                Ok(())
            }
            Message::Complete { requests } => Err(Error::Protocol(format!(
                "prefill reports {requests} requests complete; {total} were asked for"
            ))),
            Message::Error { message } => Err(Error::PeerGone(format!(
                "prefill aborted the session after {}/{total} requests: {message}",
                self.progress.requests_done
            ))),
            other => Err(Error::Protocol(format!(
                "unexpected {} from prefill during the session",
                other.kind()
            ))),
        }
    }

    /// Takes an announced request: aborts it at once (`--abort-every`), or queues it for
    /// free blocks.
    fn announce(&mut self, mut params: KvTransferParams) -> Result<()> {
        let (request, turn) = self.check_announce(&params)?;
        // Read from the prefill this run connected to, wherever the params point.
        params.remote_host = Some(self.source.1.clone());
        params.remote_port = Some(self.source.2);
        let id = turn.map_or_else(|| request.to_string(), |turn| turn.to_string());
        // Heartbeats keep its lease while it waits for free blocks.
        self.scheduler.on_new_request(&id, Some(&params));
        let abort = self.abort_point();
        if abort == Some(AbortPoint::BeforeLoad) {
            let done =
                self.scheduler
                    .request_finished(&id, &[], 0, Some(&params), FinishStatus::Aborted);
            debug_assert!(!done.delay_free_blocks);
            // The next step tells the worker, which notifies prefill.
            self.step_due = true;
            self.lifecycle.aborted_before_load += 1;
            self.progress.requests_done += 1;
            return Ok(());
        }
        self.pending.push_back(Pending {
            request,
            turn,
            params,
            announced: Instant::now(),
            abort_during_load: abort == Some(AbortPoint::DuringLoad),
        });
        Ok(())
    }

    /// Checks an announcement and returns its request number (the seed of its pattern: its
    /// conversation's, with several turns) and its turn.
    fn check_announce(&mut self, params: &KvTransferParams) -> Result<(u64, Option<TurnId>)> {
        let id = params.remote_request_id.as_deref().unwrap_or("");
        let bad = |reason: String| {
            Err(Error::Protocol(format!(
                "announcement of request {id:?}: {reason}"
            )))
        };
        let (request, turn) = if self.conversations.is_some() {
            let turn = TurnId::parse(id)?;
            (turn.conversation, Some(turn))
        } else {
            let Ok(request) = id.parse::<u64>() else {
                return bad("the request id is not a number".into());
            };
            (request, None)
        };
        let Some(from) = params.remote_blocks() else {
            return bad("the transfer params lack where to read".into());
        };
        let (tp, pp) = self.source_sizes;
        let from_pp = params.remote_pp_size.unwrap_or(1);
        if from.engine_id != self.source.0 || from.tp_size != tp || from_pp != pp {
            return bad(format!(
                "the params name engine {:?} of TP {} x PP {from_pp}; this run reads from {:?} of TP {tp} x PP {pp}",
                from.engine_id, from.tp_size, self.source.0
            ));
        }
        let blocks = &params.remote_block_ids;
        if let (Some(turn), Some(conversations)) = (turn, self.conversations.as_mut()) {
            conversations.announced(turn, blocks.len())?;
        } else if blocks.len() != self.options.blocks_per_request as usize {
            return bad(format!(
                "{} blocks, {} expected",
                blocks.len(),
                self.options.blocks_per_request
            ));
        }
        if let Some(b) = blocks.iter().find(|&&b| b >= self.remote_blocks as usize) {
            return bad(format!(
                "block {b} is outside prefill's {} blocks",
                self.remote_blocks
            ));
        }
        if !self.seen.insert(id.to_string()) {
            return bad("announced twice".into());
        }
        if self.seen.len() as u64 > self.progress.requests_total {
            return bad(format!(
                "more than the {} requests asked for",
                self.progress.requests_total
            ));
        }
        // Prefill may announce the next request as soon as a notification reaches it, a
        // little before this side sees the load end; anything beyond that is a bug.
        let limit = 2 * self.options.in_flight as usize + 1;
        // Loads that ended but are not yet checked were acknowledged already.
        let outstanding = self.pending.len() + self.in_flight.len() - self.ended.len();
        if outstanding >= limit {
            return bad(format!("more than {limit} requests outstanding"));
        }
        Ok((request, turn))
    }

    /// Where the next announced request is aborted, if `--abort-every` picks it: every
    /// `K`th announcement, alternately before and during its load.
    fn abort_point(&self) -> Option<AbortPoint> {
        let every = self.options.abort_every?;
        let n = self.seen.len() as u64;
        if n % every != 0 {
            return None;
        }
        Some(if (n / every) % 2 == 1 {
            AbortPoint::BeforeLoad
        } else {
            AbortPoint::DuringLoad
        })
    }

    /// Starts a load for every pending request that free local blocks allow: decode computes
    /// the blocks its prefix cache holds, the scheduler pairs the rest with the tail of
    /// prefill's blocks, the worker reads them.
    fn start_loads(&mut self, worker: &Worker) -> Result<()> {
        let hits = self.options.prefix_hit_blocks as usize;
        while let Some(next) = self.pending.front() {
            let count = match (next.turn, &self.conversations) {
                (Some(turn), Some(conversations)) => conversations.blocks_for(turn),
                _ => self.options.blocks_per_request as usize,
            };
            let Some(local) = self.pool.alloc(count) else {
                break;
            };
            let Some(pending) = self.pending.pop_front() else {
                break;
            };
            let (id, local, remote, held) = match (pending.turn, self.conversations.as_mut()) {
                (Some(turn), Some(conversations)) => {
                    // The conversation so far is in decode's cache: its prefix cache holds it.
                    let load = conversations.load(turn, &local);
                    (turn.to_string(), load.local, load.keys, load.held)
                }
                _ => {
                    let remote: Vec<u32> = pending
                        .params
                        .remote_block_ids
                        .iter()
                        .map(|&b| b as u32)
                        .collect();
                    self.cache
                        .compute_blocks(&local[..hits], &remote[..hits], pending.request)?;
                    (pending.request.to_string(), local, remote, hits)
                }
            };
            self.lifecycle.prefix_hit_blocks += held as u64;
            let missing: Vec<usize> = local[held..].iter().map(|&b| b as usize).collect();
            self.scheduler
                .update_state_after_alloc(&id, &missing, &pending.params)?;
            self.step_due = true;
            let mut pull = Pull {
                request: pending.request,
                turn: pending.turn,
                local,
                remote,
                held,
                announced: pending.announced,
                aborted: false,
            };
            if pending.abort_during_load {
                // The abort comes as vLLM's async scheduling can bring it: after the worker
                // started the load and before that step's output is taken (the next step
                // takes it), so the load is the connector's until it ends. A whole step
                // here would often see the load end within its post, and nothing to abort.
                let meta = self.scheduler.build_connector_meta();
                for rank in &worker.ranks {
                    rank.start_load_kv(&meta);
                }
                let done = self.scheduler.request_finished(
                    &id,
                    &missing,
                    0,
                    Some(&pending.params),
                    FinishStatus::Aborted,
                );
                self.lifecycle.aborted_during_load += 1;
                if !done.delay_free_blocks {
                    // Nothing is read (a full prefix hit): the blocks are free at once.
                    self.pool.free(&pull.local);
                    self.progress.requests_done += 1;
                    continue;
                }
                pull.aborted = true;
            } else if missing.is_empty() {
                // A full prefix hit: nothing to wait for.
                self.ended.push_back(id.clone());
            }
            self.in_flight.insert(id, pull);
        }
        Ok(())
    }

    /// Queues the loads that ended for checking, computes locally the blocks of loads that
    /// failed under the `recompute` policy, and frees the blocks of aborted requests; a load
    /// that failed under the `fail` policy ends the run.
    fn loads_ended(&mut self, outcomes: Vec<LoadOutcome>) -> Result<()> {
        for outcome in outcomes {
            match outcome {
                LoadOutcome::Loaded { request_id } => {
                    if self.first_load.loaded.is_none() {
                        self.first_load.loaded = Some(self.began.elapsed());
                    }
                    self.ended.push_back(request_id);
                }
                LoadOutcome::Recompute {
                    request_id,
                    block_ids,
                    reason,
                } => {
                    tracing::warn!(request = %request_id, blocks = block_ids.len(), %reason, "load failed; computing its blocks locally");
                    if let Some(pull) = self.in_flight.get(&request_id) {
                        let pairs: Vec<(u32, u32)> = pull
                            .local
                            .iter()
                            .zip(&pull.remote)
                            .filter(|(l, _)| block_ids.contains(&(**l as usize)))
                            .map(|(&l, &r)| (l, r))
                            .collect();
                        let (local, remote): (Vec<u32>, Vec<u32>) = pairs.into_iter().unzip();
                        self.cache.compute_blocks(&local, &remote, pull.request)?;
                        self.lifecycle.recomputed_blocks += local.len() as u64;
                    }
                    self.ended.push_back(request_id);
                }
                LoadOutcome::Failed { request_id, reason } => {
                    return Err(Error::LoadFailed(format!(
                        "loading request {request_id} from prefill {} failed: {reason}",
                        self.source.0
                    )))
                }
                LoadOutcome::AbortedLoadEnded { request_id } => {
                    if let Some(pull) = self.in_flight.remove(&request_id) {
                        self.pool.free(&pull.local);
                        self.progress.requests_done += 1;
                    }
                }
            }
        }
        Ok(())
    }

    /// Checks the blocks of the oldest ended load and frees them; with several turns, ends
    /// the turn instead ([`answer`](Self::answer)).
    fn check_one(&mut self, worker: &Worker) -> Result<()> {
        let Some(id) = self.ended.pop_front() else {
            return Ok(());
        };
        let Some(pull) = self.in_flight.remove(&id) else {
            tracing::warn!(request = %id, "a load ended that this run did not start");
            return Ok(());
        };
        let bad = self
            .cache
            .verify_blocks(&pull.local, &pull.remote, pull.request)?;
        self.mismatches.extend(bad);
        self.latencies.push(pull.announced.elapsed());
        let layout = self.cache.layout();
        let pulled = pull.local.len() - pull.held;
        let blocks = (pulled * layout.layers) as u64;
        self.progress.requests_done += 1;
        self.progress.blocks += blocks;
        self.progress.bytes += blocks * layout.block_bytes as u64;
        match pull.turn {
            Some(turn) => self.answer(turn, worker),
            None => {
                self.pool.free(&pull.local);
                Ok(())
            }
        }
    }

    /// Ends turn `turn`, loaded and checked: the last one frees its conversation; any other
    /// is answered and kept, and a step hands the kept blocks to the worker before the
    /// params that name them go to prefill.
    fn answer(&mut self, turn: TurnId, worker: &Worker) -> Result<()> {
        let Some(conversations) = self.conversations.as_mut() else {
            return Ok(());
        };
        let Some(params) =
            conversations.answered(turn, &self.cache, &mut self.pool, &mut self.scheduler)?
        else {
            return Ok(());
        };
        self.step(worker)?;
        self.outbox.push(match worker.connector().protocol() {
            Protocol::Vllm => Message::TurnVllm(params.to_vllm_json()),
            _ => Message::Turn(Box::new(params)),
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_welcome_of_other_heads_or_rank_counts_out_of_bounds_is_refused() {
        let layout = KvLayout {
            layers: 4,
            blocks: 8,
            block_bytes: 64,
        };
        let welcome = Welcome {
            engine: "p".into(),
            side_channel_port: 1,
            layers: 4,
            block_bytes: 64,
            blocks: 8,
            tp: 2,
            pp: 2,
            kv_heads: 2,
        };
        check_welcome(&welcome, layout, 2).unwrap();
        let heads = check_welcome(&welcome, layout, 1).unwrap_err().to_string();
        assert!(heads.contains("same --kv-heads"), "{heads}");
        for (tp, pp) in [(0, 1), (1, 0), (u32::MAX, u32::MAX), (65, 1)] {
            let bad = Welcome {
                tp,
                pp,
                ..welcome.clone()
            };
            let err = check_welcome(&bad, layout, 2).unwrap_err().to_string();
            assert!(err.contains("1 to 64 ranks"), "{err}");
        }
    }
}
