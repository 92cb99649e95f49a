//! The scheduler for hybrid models (vLLM's `SupportsHMA`): a request's block ids as one
//! list per KV cache group, clipped to what each group needs (see [`KvCacheGroups`](crate::KvCacheGroups)).

use super::{KvConnectorScheduler, RequestFinished};
use crate::error::{Error, Result};
use crate::geometry::groups::{flatten, split, KvCacheGroups};
use crate::scheduler::FinishStatus;
use crate::transport::params::KvTransferParams;

impl KvConnectorScheduler {
    /// The scheduler with the engine's KV cache `groups` (one full-attention group without
    /// it; see [`KvCacheGroups::from_kv_transfer_config`]).
    pub fn with_kv_cache_groups(mut self, groups: KvCacheGroups) -> Self {
        self.groups = groups;
        self
    }

    /// The engine's KV cache groups.
    pub fn kv_cache_groups(&self) -> &KvCacheGroups {
        &self.groups
    }

    /// [`update_state_after_alloc`](Self::update_state_after_alloc) for a hybrid model: the
    /// local blocks the engine still needs, one list per KV cache group in the groups'
    /// order (vLLM's `blocks.get_unhashed_block_ids_all_groups()`; none at all, or only
    /// empty lists, for a full prefix hit).
    ///
    /// Each list is clipped to what its group needs (vLLM's `get_exchange_clipped_blocks`:
    /// a sliding-window group keeps its last blocks, in this engine's blocks; an SSM group
    /// its state block, which the workers pair with the prefill's), and the workers pair it
    /// with the same group's remote blocks by token (vLLM's `_apply_prefix_caching` group
    /// by group; see
    /// [`LoadSpec::local_group_lens`](crate::LoadSpec::local_group_lens)): the decode's
    /// blocks may hold a multiple of the prefill's kernel blocks (vLLM's
    /// `block_size_ratio`), and the prefill's block ids several kernel blocks each (its
    /// `physical_blocks_per_logical_kv_block`), which needs the prompt's token count
    /// (`remote_num_tokens`, which vLLM and this crate's prefills send). With one
    /// full-attention group this is `update_state_after_alloc`.
    ///
    /// # Errors
    /// Those of `update_state_after_alloc`, and [`Error::InvalidArgument`] when the lists
    /// are not one per group, or when the params hold another number of groups (or counts
    /// that do not add up to their block ids); nothing is scheduled then. What depends on
    /// the prefill's blocks (a group with more local blocks than the prompt fills, a
    /// prefill whose blocks are larger than this engine's) fails the load in the workers.
    pub fn update_state_after_alloc_groups<G: AsRef<[usize]>>(
        &mut self,
        request_id: &str,
        local_block_ids: &[G],
        params: &KvTransferParams,
    ) -> Result<()> {
        const OP: &str = "schedule a remote prefill";
        let local = self.groups.clip(request_id, local_block_ids)?;
        if self.groups.is_single_full_attention() {
            return self.update_state_after_alloc(request_id, local[0], params);
        }
        let (local_ids, local_lens) = flatten(&local);
        if local_ids.is_empty() {
            // A full prefix hit: the prefill is only notified.
            return self.schedule_load(request_id, &[], params);
        }
        let remote = split(&params.remote_block_ids, &params.remote_block_group_lens)
            .map_err(|err| Error::invalid(OP, format!("request {request_id:?}: {err}")))?;
        if remote.len() != local.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "request {request_id:?}: kv_transfer_params hold the blocks of {} KV cache groups, this engine has {}; both engines must serve the same model with the same groups",
                    remote.len(),
                    local.len()
                ),
            ));
        }
        self.schedule_load(request_id, &local_ids, params)?;
        if let Some(load) = self.loads.get_mut(request_id) {
            load.local_group_lens = local_lens;
        }
        Ok(())
    }

    /// [`request_finished`](Self::request_finished) for a hybrid model (vLLM's
    /// `request_finished_all_groups`): `block_ids` holds the request's blocks, one list per
    /// KV cache group in the groups' order. A prefill keeps them all until the decode is
    /// done (freed together, as vLLM's scheduler frees a request's groups), and hands the
    /// decode each group's blocks clipped to what it needs (vLLM's
    /// `get_exchange_clipped_blocks`: a sliding-window group's last ones, the engine having
    /// freed or nulled those before its window), in
    /// [`KvTransferParams::remote_block_group_lens`] when there are several groups.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the lists are not one per group (none at all is
    /// every group empty); nothing is recorded then.
    pub fn request_finished_all_groups<G: AsRef<[usize]>>(
        &mut self,
        request_id: &str,
        block_ids: &[G],
        num_computed_tokens: usize,
        params: Option<&KvTransferParams>,
        status: FinishStatus,
    ) -> Result<RequestFinished> {
        let clipped = self.groups.clip(request_id, block_ids)?;
        let (ids, lens) = flatten(&clipped);
        let mut finished =
            self.request_finished(request_id, &ids, num_computed_tokens, params, status);
        if lens.len() > 1 {
            if let Some(send) = self.sends.get_mut(request_id) {
                send.group_lens = lens.clone();
            }
        }
        if let Some(params) = finished
            .kv_transfer_params
            .as_mut()
            .filter(|_| lens.len() > 1)
        {
            params.remote_block_group_lens = lens;
        }
        Ok(finished)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::{LoadFailurePolicy, Protocol};
    use crate::geometry::groups::KvCacheGroupKind;
    use crate::lease::Lease;
    use crate::scheduler::SchedulerConfig;

    /// Full attention, and a sliding window of 12 tokens over blocks of 8 (3 blocks).
    fn hybrid(engine: &str, protocol: Protocol) -> KvConnectorScheduler {
        let config = SchedulerConfig {
            engine_id: engine.into(),
            host: "10.0.0.1".into(),
            port: 5600,
            tp_size: 1,
            pp_size: 1,
            dcp_size: 1,
            lease: Lease::new(Duration::from_secs(3)).unwrap(),
            load_failure_policy: LoadFailurePolicy::Fail,
            multi_turn: crate::multi_turn::MultiTurn::default(),
            protocol,
            transfer_mode: crate::transfer_mode::TransferMode::Pull,
            #[cfg(feature = "vllm")]
            vllm_side_channel: None,
        };
        let groups = KvCacheGroups::new(
            8,
            vec![
                KvCacheGroupKind::FullAttention,
                KvCacheGroupKind::SlidingWindow { window_tokens: 12 },
            ],
        )
        .unwrap();
        KvConnectorScheduler::new(config).with_kv_cache_groups(groups)
    }

    fn for_decode() -> KvTransferParams {
        KvTransferParams {
            do_remote_decode: true,
            ..Default::default()
        }
    }

    /// The params a hybrid prefill hands for a prompt of 6 blocks, its window group's first
    /// two freed (vLLM's null block 0).
    fn handed(protocol: Protocol) -> KvTransferParams {
        let blocks = [vec![1, 2, 3, 4, 5, 6], vec![0, 0, 13, 14, 15, 16]];
        let done = hybrid("p", protocol)
            .request_finished_all_groups(
                "r",
                &blocks,
                44,
                Some(&for_decode()),
                FinishStatus::LengthCapped,
            )
            .unwrap();
        assert!(done.delay_free_blocks);
        done.kv_transfer_params.unwrap()
    }

    #[test]
    fn a_prefill_hands_each_groups_blocks_clipped_to_its_window() {
        let params = handed(Protocol::Native);
        assert_eq!(params.remote_block_ids, [1, 2, 3, 4, 5, 6, 14, 15, 16]);
        assert_eq!(params.remote_block_group_lens, [6, 3]);
        assert_eq!(params.remote_num_tokens, Some(44));
        #[cfg(feature = "vllm")]
        {
            let json: serde_json::Value =
                serde_json::from_str(&handed(Protocol::Vllm).to_vllm_json()).unwrap();
            assert_eq!(
                json["remote_block_ids"],
                serde_json::json!([[1, 2, 3, 4, 5, 6], [14, 15, 16]])
            );
        }
        let err = hybrid("p", Protocol::Native)
            .request_finished_all_groups(
                "r",
                &[vec![1]],
                8,
                Some(&for_decode()),
                FinishStatus::LengthCapped,
            )
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("1 lists of block ids for 2 KV cache groups"),
            "{err}"
        );
    }

    #[test]
    fn an_ssm_group_hands_over_its_state_block_in_either_protocol() {
        let groups = KvCacheGroups::new(
            8,
            vec![
                KvCacheGroupKind::FullAttention,
                KvCacheGroupKind::Ssm {
                    speculative_blocks: 1,
                },
            ],
        )
        .unwrap();
        let mut prefill = hybrid("p", Protocol::Native).with_kv_cache_groups(groups.clone());
        let done = prefill
            .request_finished_all_groups(
                "r",
                &[vec![1, 2, 3], vec![0, 21, 22]],
                23,
                Some(&for_decode()),
                FinishStatus::LengthCapped,
            )
            .unwrap();
        let params = KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            ..done.kv_transfer_params.unwrap()
        };
        // The running state's block, not the scratch block after it.
        assert_eq!(params.remote_block_ids, [1, 2, 3, 21]);
        assert_eq!(params.remote_block_group_lens, [3, 1]);
        let local = [vec![11, 12], vec![31, 32]];
        for protocol in [Protocol::Native, Protocol::Vllm] {
            let mut decode = hybrid("d", protocol).with_kv_cache_groups(groups.clone());
            decode.on_new_request("r", Some(&params));
            decode
                .update_state_after_alloc_groups("r", &local, &params)
                .unwrap();
            let load = &decode.build_connector_meta().loads[0];
            // Each group's state block clipped on both sides; the workers pair them.
            assert_eq!(load.local_block_ids, [11, 12, 31]);
            assert_eq!(load.local_group_lens, [2, 1]);
            assert_eq!(load.remote.block_ids, [1, 2, 3, 21]);
            assert_eq!(load.remote.group_lens, [3, 1]);
        }
    }

    #[test]
    fn one_sliding_window_group_clips_its_blocks_and_keeps_the_token_count() {
        let groups = KvCacheGroups::new(
            8,
            vec![KvCacheGroupKind::SlidingWindow { window_tokens: 12 }],
        )
        .unwrap();
        let mut prefill = hybrid("p", Protocol::Native).with_kv_cache_groups(groups.clone());
        let done = prefill
            .request_finished_all_groups(
                "r",
                &[vec![1, 2, 3, 4, 5]],
                40,
                Some(&for_decode()),
                FinishStatus::Stopped,
            )
            .unwrap();
        let params = KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            ..done.kv_transfer_params.unwrap()
        };
        // One group: the params keep vLLM's one-group shape.
        assert_eq!(params.remote_block_ids, [3, 4, 5]);
        assert!(params.remote_block_group_lens.is_empty());
        let mut decode = hybrid("d", Protocol::Native).with_kv_cache_groups(groups);
        decode.on_new_request("r", Some(&params));
        decode
            .update_state_after_alloc_groups("r", &[vec![11, 12, 13, 14, 15]], &params)
            .unwrap();
        let load = &decode.build_connector_meta().loads[0];
        assert_eq!(load.local_block_ids, [13, 14, 15]);
        assert_eq!(load.local_group_lens, [3]);
        assert_eq!(load.remote.block_ids, [3, 4, 5]);
        // Where the window's blocks are in the prompt, for blocks of other sizes.
        assert_eq!(load.remote.num_tokens, Some(40));
    }

    #[test]
    fn a_decode_hands_its_workers_each_groups_blocks_and_the_prompts_tokens() {
        let params = KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            ..handed(Protocol::Native)
        };
        let mut s = hybrid("d", Protocol::Native);
        s.on_new_request("r", Some(&params));
        // The first two blocks in the prefix cache; the window group's list is clipped.
        let local = [vec![23, 24, 25, 26], vec![31, 32, 33, 34]];
        s.update_state_after_alloc_groups("r", &local, &params)
            .unwrap();
        let meta = s.build_connector_meta();
        let load = &meta.loads[0];
        assert_eq!(load.local_block_ids, [23, 24, 25, 26, 32, 33, 34]);
        assert_eq!(load.local_group_lens, [4, 3]);
        // The workers pair them with the prefill's by token (geometry::block_map).
        assert_eq!(load.remote.block_ids, [1, 2, 3, 4, 5, 6, 14, 15, 16]);
        assert_eq!(load.remote.group_lens, [6, 3]);
        assert_eq!(load.remote.num_tokens, Some(44));

        // The one-group API refuses params of several groups; so does a count of lists
        // that is not the groups'.
        let mut s = hybrid("d", Protocol::Native);
        s.on_new_request("r", Some(&params));
        let err = s
            .update_state_after_alloc("r", &[1, 2], &params)
            .unwrap_err()
            .to_string();
        assert!(err.contains("update_state_after_alloc_groups"), "{err}");
        let err = s
            .update_state_after_alloc_groups("r", &[vec![1]], &params)
            .unwrap_err()
            .to_string();
        assert!(err.contains("1 lists of block ids for 2"), "{err}");
        // A full prefix hit only notifies, with the prefill's blocks as they are.
        s.update_state_after_alloc_groups("r", &[Vec::<usize>::new(), Vec::new()], &params)
            .unwrap();
        let load = &s.build_connector_meta().loads[0];
        assert!(load.local_block_ids.is_empty());
        assert_eq!(load.remote.block_ids, params.remote_block_ids);
    }

    #[test]
    fn a_hybrid_decode_keeps_each_groups_blocks_and_a_prefill_reads_them_back_by_group() {
        let read_backs = crate::multi_turn::MultiTurn {
            bidirectional: true,
            recompute_threshold: 0,
            ..Default::default()
        };
        let with_read_backs = |engine| {
            let mut s = hybrid(engine, Protocol::Native);
            s.config.multi_turn = read_backs;
            s
        };
        // Turn 1 on the decode, a full prefix hit (its load only notifies).
        let from_prefill = KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            ..handed(Protocol::Native)
        };
        let mut d = with_read_backs("d");
        d.on_new_request("r", Some(&from_prefill));
        d.update_state_after_alloc_groups("r", &[Vec::<usize>::new(), Vec::new()], &from_prefill)
            .unwrap();
        // It answered: 7 blocks of 8 tokens, the window group's first four freed.
        let blocks = [vec![1, 2, 3, 4, 5, 6, 7], vec![0, 0, 0, 0, 15, 16, 17]];
        let done = d
            .request_finished_all_groups("r", &blocks, 52, None, FinishStatus::Stopped)
            .unwrap();
        assert!(done.delay_free_blocks);
        let kept = done.kv_transfer_params.unwrap();
        assert!(kept.do_remote_decode && !kept.do_remote_prefill);
        assert_eq!(kept.remote_block_ids, [1, 2, 3, 4, 5, 6, 7, 15, 16, 17]);
        assert_eq!(kept.remote_block_group_lens, [7, 3]);
        assert_eq!(kept.remote_num_tokens, Some(52));

        // Turn 2 on the prefill: its prefix cache holds the first two blocks.
        let mut p = with_read_backs("p");
        assert_eq!(p.read_back_tokens(Some(&kept), 60, 16), 36);
        p.on_new_request("t2", Some(&kept));
        let local = [vec![43, 44, 45, 46, 47], vec![51, 52, 53, 54, 55]];
        p.update_state_after_alloc_groups("t2", &local, &kept)
            .unwrap();
        let load = &p.build_connector_meta().loads[0];
        assert_eq!(load.local_block_ids, [43, 44, 45, 46, 47, 53, 54, 55]);
        assert_eq!(load.local_group_lens, [5, 3]);
        assert!(load.remote.kept, "a read-back claims before it reads");
        assert_eq!(load.remote.group_lens, [7, 3]);
        assert_eq!(p.kept_stats().read_backs, 1);
    }
}
