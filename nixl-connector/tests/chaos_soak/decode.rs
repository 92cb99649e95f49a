//! The decode engine of the soak (TP 2, in the test process): its requests, their
//! allocation, prefix hits and aborts, its loads, and the checks of every loaded block.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use nixl_connector::{
    Capability, FailureKind, FinishStatus, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker,
    KvTransferParams, LoadOutcome, Protocol, TransferMode,
};

use crate::pool::{byte, Pool, POISON};
use crate::prefill_child::monotonic;
use crate::report::Report;
use crate::rng::Rng;
use crate::settings::{Wire, ARRIVED_LATE, LONG_WAIT};

/// A decode request: its params, when to allocate it, its request seed and remote blocks,
/// and which prefill process made it.
pub struct Queued {
    pub id: String,
    pub params: Box<KvTransferParams>,
    pub at_step: u64,
    /// Not before then either: some wait for blocks longer than a lease, kept by the
    /// heartbeats that start at `on_new_request`.
    pub ready_at: Instant,
    pub seed: u64,
    pub remote_len: usize,
    pub generation: u64,
    /// Loaded, neither aborted nor a full hit (one of a killed prefill's, which must fail).
    pub plain: bool,
    /// Its lease kept while it waits by the third agent's vLLM heartbeats, not the
    /// decode's (`on_new_request` only at allocation).
    pub vllm_heartbeats: bool,
}

/// A decode request under way: its local blocks and which of the request's blocks they are.
pub struct Loading {
    pub local: Vec<usize>,
    pub seed: u64,
    pub first_index: usize,
    pub generation: u64,
    pub plain: bool,
}

/// The decode engine: its ranks, scheduler, pool and requests, and what it saw.
pub struct DecodeEngine {
    pub ranks: Vec<KvConnectorWorker>,
    pub scheduler: KvConnectorScheduler,
    pub wire: Wire,
    pub pool: Pool,
    pub spec: KvCacheSpec,
    pub rng: Rng,
    pub queued: Vec<Queued>,
    pub loading: HashMap<String, Loading>,
    pub aborted: HashSet<String>,
    /// The prefill's ids of the requests the third agent heartbeats (as a vLLM decode), and
    /// their capabilities (none in vLLM's protocol).
    pub vllm_waiting: HashMap<String, Option<Capability>>,
    /// Requests whose load a rank failed as outlived (its READ may have outlived the lease),
    /// until their outcome.
    pub outlived: HashSet<String>,
    pub r: Report,
}

impl DecodeEngine {
    /// Takes a request of prefill process `generation`, made at `made` (nobody reads some
    /// of them: their leases end); `past_lease` if its lease may end before the decode
    /// reads it, as it may if it arrives late (the decode starved on a loaded machine): it
    /// then gets no long wait.
    pub fn receive(
        &mut self,
        step: u64,
        generation: u64,
        mut past_lease: bool,
        (seed, blocks, made, params): (u64, usize, Duration, Box<KvTransferParams>),
    ) {
        self.r.requests += 1;
        if !past_lease && monotonic().saturating_sub(made) > ARRIVED_LATE {
            self.r.arrived_late += 1;
            past_lease = true;
        }
        // Nothing would tell the READ of a lease that ended before it: not read.
        if past_lease && !self.wire.lease_checked() {
            self.r.never_read += 1;
            return;
        }
        if self.rng.chance(8) {
            self.r.never_read += 1;
            return;
        }
        // In vLLM's protocol the prefill's id's base and a suffix of its own, as vLLM's
        // proxy and engines name them (its push matches a registration by the base).
        let id = match self.wire.protocol {
            Protocol::Vllm => {
                let remote = params.remote_request_id.as_deref().unwrap();
                let base = remote.rsplit_once('-').map_or(remote, |(base, _)| base);
                format!("{base}-{:08x}", self.r.requests)
            }
            _ => format!("d{}", self.r.requests),
        };
        // Long waits come between long decode stalls (which would end their leases too):
        // after the first of every four stalls (the long one), before the third.
        let mut ready_at = Instant::now();
        let window = self.r.decode_stalls % 4;
        let mut vllm_heartbeats = false;
        // (The first two in a run, then 8 % of them.)
        let long = self.r.waited_past_lease < 2 || self.rng.chance(8);
        if (1..3).contains(&window) && !past_lease && long {
            ready_at += LONG_WAIT;
            self.r.waited_past_lease += 1;
            // Every second one is kept by a vLLM decode's heartbeats instead (the third agent's
            // unsplit ones), the engine telling the connector only when it allocates.
            vllm_heartbeats = self.r.waited_past_lease % 2 == 1;
        }
        if vllm_heartbeats {
            self.r.waited_on_vllm_heartbeats += 1;
            let remote = params.remote_request_id.clone().unwrap();
            let capability = params.remote_capability.clone();
            self.vllm_waiting.insert(remote, capability);
        } else {
            self.scheduler.on_new_request(&id, Some(&params));
        }
        self.queued.push(Queued {
            id,
            params,
            at_step: step + self.rng.below(4) as u64,
            ready_at,
            seed,
            remote_len: blocks,
            generation,
            plain: vllm_heartbeats,
            vllm_heartbeats,
        });
    }

    /// Whether every load still under way is one that only a prefill killed before
    /// `generation` could end: none in pull mode (each READ ends, by NIXL or the transfer
    /// timeout) or in vLLM's push protocol (its blocks go back two leases after the
    /// registration timeout); in native push mode the loads registered with a killed
    /// prefill, which never answered, keep their blocks.
    pub fn held_by_dead(&self, generation: u64) -> bool {
        self.loading
            .values()
            .all(|load| self.wire.holds_for_the_dead() && load.generation < generation)
    }

    /// Whether a queued request is due to get its blocks, and its load posted, this step.
    pub fn loads_due(&self, step: u64) -> bool {
        let now = Instant::now();
        self.queued
            .iter()
            .any(|q| q.at_step <= step && q.ready_at <= now)
    }

    /// One engine step: queued requests get their blocks (a random prefix hit, or an
    /// abort), loads start, some are aborted while loading, and the outcomes are checked.
    pub fn step(&mut self, step: u64, generation: u64) {
        let mut later = Vec::new();
        for q in std::mem::take(&mut self.queued) {
            if q.at_step > step || q.ready_at > Instant::now() {
                later.push(q);
                continue;
            }
            if !q.plain && self.rng.chance(5) {
                self.scheduler
                    .request_finished(&q.id, &[], 0, None, FinishStatus::Aborted);
                self.r.aborted_while_waiting += 1;
                continue;
            }
            let hit = if !q.plain && self.rng.chance(15) {
                q.remote_len
            } else {
                self.rng.below(q.remote_len)
            };
            let Some(local) =
                self.pool
                    .take(&self.ranks, q.remote_len - hit, &mut self.r.late_writes)
            else {
                later.push(q);
                continue;
            };
            if q.vllm_heartbeats {
                self.vllm_waiting
                    .remove(q.params.remote_request_id.as_deref().unwrap());
                self.scheduler.on_new_request(&q.id, Some(&q.params));
            }
            // Now and then (the first time in a run, then 2 %) the engine passes params without
            // remote blocks: refused, and the request waits for nothing (the engine computes
            // its blocks).
            // (Pull mode only: a push decode registers its own blocks, and vLLM's clears
            // the remote ones.)
            let bare = self.wire.mode == TransferMode::Pull
                && !q.plain
                && !local.is_empty()
                && (self.r.without_remote_blocks == 0 || self.rng.chance(2));
            let mut params = q.params.clone();
            if bare {
                params.remote_block_ids.clear();
            }
            let scheduled = self
                .scheduler
                .update_state_after_alloc(&q.id, &local, &params);
            if bare && scheduled.is_err() {
                self.r.without_remote_blocks += 1;
                let done =
                    self.scheduler
                        .request_finished(&q.id, &local, 0, None, FinishStatus::Stopped);
                assert!(!done.delay_free_blocks, "{}: nothing to load", q.id);
                self.pool.give(&self.ranks, &local, &mut self.r.freed_twice);
                continue;
            }
            scheduled.unwrap();
            if local.is_empty() {
                self.r.full_hits += 1;
                self.scheduler
                    .request_finished(&q.id, &[], 0, None, FinishStatus::Stopped);
                continue;
            }
            self.r.loads += 1;
            self.loading.insert(
                q.id,
                Loading {
                    local,
                    seed: q.seed,
                    first_index: hit,
                    generation: q.generation,
                    plain: q.plain,
                },
            );
        }
        self.queued = later;
        let meta = self.scheduler.build_connector_meta();
        for rank in &self.ranks {
            rank.start_load_kv(&meta);
        }
        // Aborts while loading: the blocks stay until the load ends.
        let running: Vec<String> = self
            .loading
            .iter()
            .filter(|(id, load)| !load.plain && !self.aborted.contains(*id))
            .map(|(id, _)| id)
            .cloned()
            .collect();
        for id in running {
            if self.rng.chance(1) {
                let done =
                    self.scheduler
                        .request_finished(&id, &[], 0, None, FinishStatus::Aborted);
                assert!(done.delay_free_blocks, "{id}");
                self.aborted.insert(id);
                self.r.aborted_while_loading += 1;
            }
        }
        // The outcomes: loaded blocks checked, then every block poisoned and freed.
        // Every rank's output, aggregated as vLLM's engine does.
        let outputs: Vec<_> = self.ranks.iter().map(|rank| rank.output()).collect();
        let outlived = outputs
            .iter()
            .flat_map(|output| &output.load_errors)
            .filter(|failed| failed.kind == FailureKind::LeaseOutlived);
        self.outlived
            .extend(outlived.map(|failed| failed.request_id.clone()));
        for rank in &self.ranks {
            self.r.overdue += rank.overdue_loads().len() as u64;
            rank.metrics();
        }
        let outcomes = self
            .scheduler
            .update_connector_output(&outputs)
            .unwrap()
            .load_outcomes;
        for outcome in outcomes {
            self.ended(outcome, generation);
        }
    }

    /// Checks every rank's blocks of `load` against its request's pattern: rank `d` holds
    /// the `d`th slice of the prefill's block (its head). Counts (poisoned, mismatched).
    pub fn check(&self, load: &Loading) -> (u64, u64) {
        let (mut poisoned, mut mismatched) = (0, 0);
        for (d, rank) in self.ranks.iter().enumerate() {
            let cache = rank.kv_caches().unwrap();
            for (k, &b) in load.local.iter().enumerate() {
                for region in 0..self.spec.num_regions() {
                    let len = self.spec.block_len(region);
                    let mut got = vec![0u8; len];
                    cache.read(region, b * len, &mut got).unwrap();
                    let want: Vec<u8> = (0..len)
                        .map(|o| byte(load.seed, load.first_index + k, region, d * len + o))
                        .collect();
                    if got.iter().all(|&x| x == POISON) {
                        poisoned += 1;
                    } else if got != want {
                        mismatched += 1;
                    }
                }
            }
        }
        (poisoned, mismatched)
    }

    /// Checks and frees a load that ended with `outcome` (`generation`: the live prefill).
    pub fn ended(&mut self, outcome: LoadOutcome, generation: u64) {
        let (id, loaded) = match &outcome {
            LoadOutcome::Loaded { request_id } => {
                self.r.loaded += 1;
                (request_id, true)
            }
            LoadOutcome::Failed { request_id, .. } => {
                self.r.failed += 1;
                (request_id, false)
            }
            LoadOutcome::Recompute { request_id, .. } => {
                self.r.recompute += 1;
                (request_id, false)
            }
            LoadOutcome::AbortedLoadEnded { request_id } => (request_id, false),
        };
        let load = self
            .loading
            .remove(id)
            .expect("an outcome for a load under way");
        self.aborted.remove(id);
        let aborted = matches!(outcome, LoadOutcome::AbortedLoadEnded { .. });
        if load.generation < generation && !aborted {
            match loaded {
                true => self.r.dead_loaded += 1,
                false => self.r.dead_failed += 1,
            }
        }
        if loaded && load.generation > 0 {
            self.r.loaded_after_restart += 1;
        }
        // Every load reported loaded is checked, whatever its lease did: a READ that may have
        // outlived it fails instead.
        if loaded {
            let (poisoned, mismatched) = self.check(&load);
            self.r.poisoned_blocks += poisoned;
            self.r.mismatched_blocks += mismatched;
            self.r.blocks_verified += (load.local.len() * self.ranks.len()) as u64;
        }
        if self.outlived.remove(id) {
            assert!(!loaded, "{id}: failed as outlived on a rank, yet loaded");
            self.r.lease_outlived += 1;
        }
        if !aborted {
            let done =
                self.scheduler
                    .request_finished(id, &load.local, 0, None, FinishStatus::Stopped);
            assert!(!done.delay_free_blocks, "{id}: its load ended");
        }
        self.pool
            .give(&self.ranks, &load.local, &mut self.r.freed_twice);
    }
}
