//! Multi-turn conversations (vLLM 0.33's bidirectional KV transfer), the scheduler's part.
//!
//! - **The decode keeps.** A request whose KV came from a remote prefill keeps its blocks
//!   when it finishes ([`MultiTurn::kept_ttl`](crate::multi_turn::MultiTurn::kept_ttl), or until a reader's finish notification),
//!   and its params name them for the next turn: `do_remote_decode`, this engine, the block
//!   ids, `remote_num_tokens` (its computed tokens) and, in vLLM mode,
//!   `remote_blocks_expiry_time` on this process's clock.
//! - **The prefill reads back.** A request whose params name kept blocks reads the tokens
//!   its own prefix cache lacks ([`KvConnectorScheduler::read_back_tokens`]) through the
//!   load path of a decode: [`on_new_request`](KvConnectorScheduler::on_new_request), then
//!   [`update_state_after_alloc`](KvConnectorScheduler::update_state_after_alloc) with the
//!   blocks allocated for them. Fewer than [`MultiTurn::recompute_threshold`](crate::multi_turn::MultiTurn::recompute_threshold) tokens are not
//!   read: pass no blocks, and the decode is told at once. A read-back that fails is always
//!   recomputed, whatever the load failure policy: the prefill holds the whole prompt.
//! - **Bounded.** Past [`MultiTurn::kept_blocks_cap`](crate::multi_turn::MultiTurn::kept_blocks_cap) the oldest kept requests are released
//!   first, in the native protocol, where a reader claims a request before it reads and a
//!   claimed request is never released early ([`ConnectorMetadata::evict`]); vLLM's readers
//!   do not claim, so in vLLM mode new requests are not kept past the cap.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::config::Protocol;
use crate::lease::MAX_LEASE;
use crate::scheduler::{ConnectorMetadata, KvConnectorScheduler};
use crate::transport::params::KvTransferParams;

/// What an engine's scheduler did with multi-turn conversations
/// ([`KvConnectorScheduler::kept_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MultiTurnStats {
    /// Decode side: requests kept for a read-back now.
    pub kept_requests: usize,
    /// Decode side: their blocks.
    pub kept_blocks: usize,
    /// Decode side: requests kept so far.
    pub kept_total: u64,
    /// Decode side: kept requests whose release ([`ConnectorMetadata::evict`]) the cap asked
    /// for, oldest first.
    pub evictions: u64,
    /// Decode side (vLLM mode): finished requests not kept because the cap was reached.
    pub not_kept_over_cap: u64,
    /// Prefill side: read-backs scheduled (blocks to read).
    pub read_backs: u64,
    /// Prefill side: read-backs not made, fewer tokens than the recompute threshold.
    pub below_threshold: u64,
}

/// The requests a decode keeps, oldest first, and their blocks.
#[derive(Debug, Default)]
pub(crate) struct Kept {
    /// Each kept request by the order it was kept in.
    order: BTreeMap<u64, String>,
    /// Each kept request's place in `order` and block count.
    requests: HashMap<String, (u64, usize)>,
    next: u64,
    blocks: usize,
    /// Kept requests whose release was asked for; still kept until the workers release them.
    evicting: HashSet<String>,
    evicting_blocks: usize,
}

impl Kept {
    fn keep(&mut self, request_id: &str, blocks: usize) {
        if self.requests.contains_key(request_id) {
            return;
        }
        self.order.insert(self.next, request_id.to_string());
        self.requests
            .insert(request_id.to_string(), (self.next, blocks));
        self.next += 1;
        self.blocks += blocks;
    }

    /// `request_id`'s blocks went back to the engine: it is no longer kept.
    pub(crate) fn released(&mut self, request_id: &str) -> bool {
        let Some((seq, blocks)) = self.requests.remove(request_id) else {
            return false;
        };
        self.order.remove(&seq);
        self.blocks -= blocks;
        if self.evicting.remove(request_id) {
            self.evicting_blocks -= blocks;
        }
        true
    }

    /// The oldest kept requests to release so that what stays (releases asked for aside)
    /// fits in `cap` blocks.
    fn over(&mut self, cap: usize) -> Vec<String> {
        let mut evict = Vec::new();
        let mut oldest = self.order.values();
        while self.blocks - self.evicting_blocks > cap {
            let Some(request_id) = oldest.next() else {
                break;
            };
            if self.evicting.insert(request_id.clone()) {
                self.evicting_blocks += self.requests[request_id].1;
                evict.push(request_id.clone());
            }
        }
        evict
    }
}

impl KvConnectorScheduler {
    /// How many of a new request's tokens to read back from the decode its params name
    /// (vLLM's `get_num_new_matched_tokens` for params with `do_remote_decode`): the decode's
    /// `remote_num_tokens`, at most `num_prompt_tokens`, less the `num_computed_tokens` this
    /// engine's prefix cache holds. 0 when read-backs are off, the params name no kept
    /// blocks, or the count is below [`MultiTurn::recompute_threshold`](crate::multi_turn::MultiTurn::recompute_threshold) (counted; the
    /// engine computes those tokens, and passes no blocks to
    /// [`update_state_after_alloc`](Self::update_state_after_alloc) so that the decode is
    /// told at once).
    pub fn read_back_tokens(
        &mut self,
        params: Option<&KvTransferParams>,
        num_prompt_tokens: usize,
        num_computed_tokens: usize,
    ) -> usize {
        let Some(params) = params.filter(|p| self.is_read_back(p)) else {
            return 0;
        };
        let remote_tokens = params.remote_num_tokens.unwrap_or(0);
        let count = remote_tokens
            .min(num_prompt_tokens)
            .saturating_sub(num_computed_tokens);
        let threshold = self.config.multi_turn.recompute_threshold;
        if count > 0 && count < threshold {
            self.multi_turn.below_threshold += 1;
            crate::metrics::series::below_recompute_threshold(&self.config.engine_id);
            return 0;
        }
        count
    }

    /// What this engine's scheduler did with multi-turn conversations so far.
    pub fn kept_stats(&self) -> MultiTurnStats {
        MultiTurnStats {
            kept_requests: self.kept.requests.len(),
            kept_blocks: self.kept.blocks,
            ..self.multi_turn
        }
    }

    /// Whether `params` name a decode's kept blocks for this engine to read back.
    pub(crate) fn is_read_back(&self, params: &KvTransferParams) -> bool {
        self.config.multi_turn.bidirectional
            && params.do_remote_decode
            && !params.remote_block_ids.is_empty()
            && params.remote_blocks().is_some()
    }

    /// A read-back was scheduled with blocks to read.
    pub(crate) fn read_back_scheduled(&mut self) {
        self.multi_turn.read_backs += 1;
        crate::metrics::series::read_back(&self.config.engine_id);
    }

    /// A decode request that loaded from a remote prefill finished with `status` complete:
    /// keeps `block_ids` for the next turn's prefill if read-backs are on, and returns the
    /// params that name them; `None`: the blocks are freed now.
    pub(crate) fn keep_for_read_back(
        &mut self,
        request_id: &str,
        block_ids: &[usize],
        num_computed_tokens: usize,
    ) -> Option<KvTransferParams> {
        let settings = self.config.multi_turn;
        if !settings.bidirectional || block_ids.is_empty() {
            return None;
        }
        let vllm = self.config.protocol == Protocol::Vllm;
        if vllm
            && settings
                .kept_blocks_cap
                .is_some_and(|cap| self.kept.blocks + block_ids.len() > cap)
        {
            self.multi_turn.not_kept_over_cap += 1;
            tracing::info!(
                request = request_id,
                kept_blocks = self.kept.blocks,
                "kept blocks at their cap: the request's blocks are freed, not kept for a read-back"
            );
            return None;
        }
        let capability = self.reader_capability(request_id)?;
        // At most a day, as the config's key allows: a TTL set in code cannot overflow.
        let ttl = settings.kept_ttl.min(MAX_LEASE);
        let held = (block_ids, num_computed_tokens);
        let lease_epoch =
            self.hold_for_readers(request_id, held, Instant::now() + ttl, &capability);
        self.kept.keep(request_id, block_ids.len());
        self.multi_turn.kept_total += 1;
        crate::metrics::series::kept_blocks(&self.config.engine_id, self.kept.blocks);
        let params = self.params_for_decode(request_id, block_ids, Some(num_computed_tokens));
        Some(KvTransferParams {
            do_remote_prefill: false,
            do_remote_decode: true,
            remote_capability: capability,
            remote_lease_epoch: lease_epoch,
            remote_blocks_expiry_time: vllm.then(|| expiry_time(ttl)),
            vllm_extra: serde_json::Map::new(),
            ..params
        })
    }

    /// Adds to `meta` the kept requests to release early, oldest first, so that the rest
    /// fits the cap (native protocol).
    pub(crate) fn evict_over_cap(&mut self, meta: &mut ConnectorMetadata) {
        let Some(cap) = self.config.multi_turn.kept_blocks_cap else {
            return;
        };
        if self.config.protocol != Protocol::Native {
            return;
        }
        for request_id in self.kept.over(cap) {
            self.multi_turn.evictions += 1;
            crate::metrics::series::kept_eviction(&self.config.engine_id);
            tracing::info!(request = %request_id, "kept blocks over their cap: the oldest kept request is released unless a reader claimed it");
            meta.evict.push(request_id);
        }
    }

    /// Requests whose blocks went back to the engine: no longer kept.
    pub(crate) fn kept_released(&mut self, finished_sending: &[String]) {
        let mut changed = false;
        for request_id in finished_sending {
            changed |= self.kept.released(request_id);
        }
        if changed {
            crate::metrics::series::kept_blocks(&self.config.engine_id, self.kept.blocks);
        }
    }
}

/// vLLM mode: when kept blocks expire, on this process's clock (seconds of vLLM's
/// `time.perf_counter()`), which the side channel sends with each handshake so that a
/// reader reads it on its own.
#[cfg(feature = "vllm")]
fn expiry_time(ttl: Duration) -> f64 {
    crate::vllm::clock::perf_counter() + ttl.as_secs_f64()
}

/// Without the `vllm` feature there is no vLLM mode.
#[cfg(not(feature = "vllm"))]
fn expiry_time(_ttl: Duration) -> f64 {
    f64::INFINITY
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::LoadFailurePolicy;
    use crate::failure::{FailedBlock, FailureKind};
    use crate::lease::Lease;
    use crate::multi_turn::MultiTurn;
    use crate::scheduler::aggregate::WorkerOutput;
    use crate::scheduler::outcomes::Finished;
    use crate::scheduler::{FinishStatus, LoadOutcome, SchedulerConfig};

    fn engine(id: &str, protocol: Protocol, multi_turn: MultiTurn) -> KvConnectorScheduler {
        KvConnectorScheduler::new(SchedulerConfig {
            engine_id: id.into(),
            host: "10.0.0.1".into(),
            port: 5600,
            tp_size: 1,
            pp_size: 1,
            dcp_size: 1,
            lease: Lease::new(Duration::from_secs(30)).unwrap(),
            load_failure_policy: LoadFailurePolicy::Fail,
            multi_turn,
            protocol,
            transfer_mode: crate::transfer_mode::TransferMode::Pull,
            #[cfg(feature = "vllm")]
            vllm_side_channel: None,
        })
    }

    fn on(cap: Option<usize>) -> MultiTurn {
        MultiTurn {
            bidirectional: true,
            kept_blocks_cap: cap,
            ..MultiTurn::default()
        }
    }

    /// One rank's output: `recving` loads ended, `sending` requests released.
    fn step(s: &mut KvConnectorScheduler, recving: &[&str], sending: &[&str]) -> Vec<LoadOutcome> {
        step_failed(s, recving, sending, &[])
    }

    fn step_failed(
        s: &mut KvConnectorScheduler,
        recving: &[&str],
        sending: &[&str],
        failed: &[FailedBlock],
    ) -> Vec<LoadOutcome> {
        let output = WorkerOutput {
            tp_rank: 0,
            pp_rank: 0,
            finished: Finished {
                sending: sending.iter().map(|s| s.to_string()).collect(),
                recving: recving.iter().map(|s| s.to_string()).collect(),
            },
            load_errors: failed.to_vec(),
        };
        s.update_connector_output(&[output]).unwrap().load_outcomes
    }

    /// Turn 1 on `decode`: request `id` loads `blocks` from a prefill and finishes after
    /// `tokens` computed tokens; what its request_finished answers.
    fn turn_one(
        decode: &mut KvConnectorScheduler,
        id: &str,
        blocks: &[usize],
        tokens: usize,
    ) -> crate::scheduler::RequestFinished {
        let mut prefill = engine("p", decode.config.protocol, MultiTurn::default());
        let for_decode = KvTransferParams {
            do_remote_decode: true,
            ..KvTransferParams::default()
        };
        let params = prefill
            .request_finished(
                id,
                blocks,
                tokens,
                Some(&for_decode),
                FinishStatus::LengthCapped,
            )
            .kv_transfer_params
            .unwrap();
        decode.on_new_request(id, Some(&params));
        decode
            .update_state_after_alloc(id, blocks, &params)
            .unwrap();
        decode.build_connector_meta();
        assert_eq!(
            step(decode, &[id], &[]),
            [LoadOutcome::Loaded {
                request_id: id.into()
            }]
        );
        decode.request_finished(id, blocks, tokens + 10, None, FinishStatus::Stopped)
    }

    #[test]
    fn a_decode_keeps_a_loaded_request_only_with_read_backs_on() {
        let mut off = engine("d", Protocol::Native, MultiTurn::default());
        let done = turn_one(&mut off, "r", &[1, 2], 20);
        assert!(!done.delay_free_blocks && done.kv_transfer_params.is_none());

        let mut d = engine("d", Protocol::Native, on(None));
        let done = turn_one(&mut d, "r", &[1, 2], 20);
        assert!(done.delay_free_blocks);
        let params = done.kv_transfer_params.unwrap();
        assert!(params.do_remote_decode && !params.do_remote_prefill);
        assert_eq!(params.remote_engine_id.as_deref(), Some("d"));
        assert_eq!(params.remote_request_id.as_deref(), Some("r"));
        assert_eq!(params.remote_block_ids, [1, 2]);
        assert_eq!(params.remote_num_tokens, Some(30), "its computed tokens");
        assert!(params.remote_capability.is_some(), "native: a capability");
        assert_eq!(params.remote_blocks_expiry_time, None, "native: no clock");
        let meta = d.build_connector_meta();
        assert_eq!(meta.sends.len(), 1);
        assert!(meta.sends[0].deadline > Instant::now() + Duration::from_secs(470));
        assert_eq!(
            d.kept_stats(),
            MultiTurnStats {
                kept_requests: 1,
                kept_blocks: 2,
                kept_total: 1,
                ..MultiTurnStats::default()
            }
        );
        step(&mut d, &[], &["r"]);
        assert_eq!(d.kept_stats().kept_blocks, 0, "released");
        // An aborted one is not kept.
        let mut d = engine("d", Protocol::Native, on(None));
        let params = KvTransferParams {
            do_remote_prefill: true,
            remote_engine_id: Some("p".into()),
            remote_host: Some("h".into()),
            remote_port: Some(1),
            remote_block_ids: vec![4],
            remote_request_id: Some("y".into()),
            remote_tp_size: Some(1),
            ..KvTransferParams::default()
        };
        d.on_new_request("y", Some(&params));
        d.update_state_after_alloc("y", &[], &params).unwrap();
        let done = d.request_finished("y", &[4], 8, None, FinishStatus::Aborted);
        assert!(!done.delay_free_blocks && done.kv_transfer_params.is_none());
    }

    #[test]
    #[cfg(feature = "vllm")]
    fn in_vllm_mode_the_kept_params_are_vllms_with_an_expiry_time() {
        let mut d = engine("d", Protocol::Vllm, on(None));
        let before = crate::vllm::clock::perf_counter();
        let params = turn_one(&mut d, "r", &[1, 2], 20)
            .kv_transfer_params
            .unwrap();
        let json: serde_json::Value = serde_json::from_str(&params.to_vllm_json()).unwrap();
        let expiry = json["remote_blocks_expiry_time"].as_f64().unwrap();
        assert!(
            expiry >= before + 480.0 && expiry < before + 490.0,
            "{json}"
        );
        // vLLM 0.33's request_finished on a decode (is_d_node), bidirectional.
        let expect = serde_json::json!({
            "do_remote_prefill": false, "do_remote_decode": true,
            "remote_block_ids": [[1, 2]], "remote_engine_id": "d",
            "remote_request_id": "r", "remote_host": "10.0.0.1", "remote_port": 5600,
            "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 30,
            "remote_blocks_expiry_time": expiry,
            "remote_registration_generation": 0, "transfer_mode": "pull",
        });
        assert_eq!(json, expect);
    }

    /// The params a decode kept request `id` with.
    fn kept_params(id: &str, blocks: &[usize], tokens: usize) -> KvTransferParams {
        let mut d = engine("d", Protocol::Native, on(None));
        turn_one(&mut d, id, blocks, tokens - 10)
            .kv_transfer_params
            .unwrap()
    }

    #[test]
    fn a_prefill_reads_back_what_its_prefix_cache_lacks_above_the_threshold() {
        let params = kept_params("r", &[1, 2, 3, 4, 5, 6, 7, 8], 128);
        let mut p = engine("p", Protocol::Native, on(None));
        assert_eq!(p.read_back_tokens(Some(&params), 200, 0), 128);
        assert_eq!(p.read_back_tokens(Some(&params), 200, 48), 80);
        assert_eq!(
            p.read_back_tokens(Some(&params), 100, 32),
            68,
            "the prompt caps it"
        );
        assert_eq!(p.read_back_tokens(Some(&params), 200, 65), 0, "63 < 64");
        assert_eq!(p.read_back_tokens(Some(&params), 200, 64), 64, "64 is read");
        assert_eq!(p.read_back_tokens(Some(&params), 200, 128), 0, "all cached");
        assert_eq!(p.read_back_tokens(None, 200, 0), 0);
        assert_eq!(p.kept_stats().below_threshold, 1);
        let mut zero = engine(
            "p",
            Protocol::Native,
            MultiTurn {
                recompute_threshold: 0,
                ..on(None)
            },
        );
        assert_eq!(zero.read_back_tokens(Some(&params), 200, 127), 1);
        let mut off = engine("p", Protocol::Native, MultiTurn::default());
        assert_eq!(
            off.read_back_tokens(Some(&params), 200, 0),
            0,
            "read-backs off"
        );
    }

    #[test]
    fn a_read_back_loads_then_the_request_is_held_for_its_decode() {
        let params = kept_params("r", &[1, 2, 3], 48);
        let mut p = engine("p", Protocol::Native, on(None));
        p.on_new_request("t2", Some(&params));
        p.update_state_after_alloc("t2", &[7, 8], &params).unwrap();
        let meta = p.build_connector_meta();
        assert_eq!(meta.loads.len(), 1);
        assert_eq!(meta.loads[0].local_block_ids, [7, 8]);
        assert_eq!(meta.loads[0].remote.request_id, "r");
        assert_eq!(
            meta.heartbeats.len(),
            1,
            "native: the decode's hold is extended"
        );
        assert_eq!(p.kept_stats().read_backs, 1);
        // A failed read-back is recomputed, whatever the policy (here: fail).
        let failed = FailedBlock {
            block_id: 8,
            request_id: "t2".into(),
            kind: FailureKind::Transfer,
            reason: "gone".into(),
        };
        let outcomes = step_failed(&mut p, &["t2"], &[], &[failed]);
        assert!(
            matches!(&outcomes[..], [LoadOutcome::Recompute { block_ids, .. }] if block_ids == &[8]),
            "{outcomes:?}"
        );
        // The prompt computed, the request goes to a decode as any prefill request.
        let done = p.request_finished(
            "t2",
            &[5, 7, 8, 9],
            60,
            Some(&params),
            FinishStatus::LengthCapped,
        );
        assert!(done.delay_free_blocks);
        let handed = done.kv_transfer_params.unwrap();
        assert!(handed.do_remote_prefill && !handed.do_remote_decode);
        assert_eq!(handed.remote_engine_id.as_deref(), Some("p"));
        assert_eq!(handed.remote_block_ids, [5, 7, 8, 9]);
    }

    #[test]
    fn a_read_back_not_made_tells_the_decode_at_once() {
        let params = kept_params("r", &[1, 2], 32);
        // Below the threshold: no blocks to read, the decode is only notified.
        let mut p = engine("p", Protocol::Native, on(None));
        assert_eq!(p.read_back_tokens(Some(&params), 40, 0), 0);
        p.on_new_request("t2", Some(&params));
        p.update_state_after_alloc("t2", &[], &params).unwrap();
        let meta = p.build_connector_meta();
        assert_eq!(meta.loads.len(), 1);
        assert!(meta.loads[0].local_block_ids.is_empty());
        assert!(meta.heartbeats.is_empty(), "nothing waits");
        assert_eq!(p.kept_stats().read_backs, 0);
        // Never started (the engine did not take it): notified when it finishes.
        let mut p = engine("p", Protocol::Native, on(None));
        p.request_finished("t3", &[4], 40, Some(&params), FinishStatus::Aborted);
        let meta = p.build_connector_meta();
        assert_eq!(meta.loads.len(), 1);
        assert!(meta.loads[0].local_block_ids.is_empty());
        // Aborted while waiting.
        let mut p = engine("p", Protocol::Native, on(None));
        p.on_new_request("t4", Some(&params));
        let done = p.request_finished("t4", &[], 0, Some(&params), FinishStatus::Aborted);
        assert!(!done.delay_free_blocks);
        assert_eq!(p.build_connector_meta().loads.len(), 1);
    }

    #[test]
    fn past_the_cap_the_oldest_are_evicted_natively_and_new_ones_not_kept_in_vllm_mode() {
        let mut d = engine("d", Protocol::Native, on(Some(5)));
        turn_one(&mut d, "a", &[1, 2], 20);
        turn_one(&mut d, "b", &[3, 4], 20);
        assert!(d.build_connector_meta().evict.is_empty(), "4 of 5");
        turn_one(&mut d, "c", &[5, 6], 20);
        assert_eq!(d.build_connector_meta().evict, ["a"]);
        assert!(d.build_connector_meta().evict.is_empty(), "asked once");
        step(&mut d, &[], &["a"]);
        let stats = d.kept_stats();
        assert_eq!((stats.kept_blocks, stats.evictions), (4, 1));

        #[cfg(feature = "vllm")]
        {
            let mut d = engine("d", Protocol::Vllm, on(Some(3)));
            assert!(turn_one(&mut d, "a", &[1, 2], 20).delay_free_blocks);
            let over = turn_one(&mut d, "b", &[3, 4], 20);
            assert!(!over.delay_free_blocks && over.kv_transfer_params.is_none());
            assert!(d.build_connector_meta().evict.is_empty());
            assert_eq!(d.kept_stats().not_kept_over_cap, 1);
        }
    }

    #[test]
    fn kept_requests_over_the_cap_are_released_oldest_first_once() {
        let mut kept = Kept::default();
        kept.keep("a", 4);
        kept.keep("b", 4);
        kept.keep("c", 4);
        assert_eq!(kept.over(12), Vec::<String>::new());
        assert_eq!(kept.over(7), ["a", "b"]);
        assert_eq!(kept.over(7), Vec::<String>::new(), "asked once");
        assert!(kept.released("b"));
        assert!(!kept.released("b"));
        kept.keep("d", 8);
        assert_eq!(kept.over(7), ["c", "d"], "a still being released");
        assert!(kept.released("a") && kept.released("c") && kept.released("d"));
        assert_eq!((kept.blocks, kept.evicting_blocks), (0, 0));
    }
}
