//! The SSM (Mamba) side of [`KvCacheGroups`]: the state its SSM groups' blocks hold
//! ([`SsmState`], given with [`KvCacheGroups::with_ssm_state`]), which of its groups are SSM
//! groups, the prompt tokens a prefill backs off for them (vLLM's `_prefill_backoff`), and
//! the groups they are refused with. What a state block is and how it is read is
//! `ssm.rs`'s, which knows nothing of groups.

use crate::error::{Error, Result};
use crate::geometry::groups::{KvCacheGroupKind, KvCacheGroups, SHARED_REGION};
use crate::geometry::ssm::SsmState;

const OP: &str = "SSM state of KV cache groups";

impl KvCacheGroups {
    /// The groups with `state`, what a block of their SSM groups holds in each region (see
    /// [`SsmState`]) in each region that holds SSM state (every region, vLLM's registration
    /// with each KV cache tensor shared by a layer of every group; with
    /// [`region_groups`](Self::region_groups), those of SSM groups and the shared ones), per
    /// rank of this engine's TP. A decode checks it against the prefill's (vLLM's
    /// `ssm_sizes`), scaled by the TP sizes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when no group is an SSM group.
    pub fn with_ssm_state(mut self, state: SsmState) -> Result<Self> {
        if !self.has_ssm_groups() {
            return Err(Error::invalid(
                OP,
                "ssm_state is given, but no KV cache group is an ssm group",
            ));
        }
        self.ssm_state = Some(state);
        Ok(self)
    }

    /// What a block of the SSM groups holds; `None` without it.
    pub fn ssm_state(&self) -> Option<&SsmState> {
        self.ssm_state.as_ref()
    }

    /// Whether some group is an SSM (Mamba) group.
    pub fn has_ssm_groups(&self) -> bool {
        self.kinds()
            .iter()
            .any(|k| matches!(k, KvCacheGroupKind::Ssm { .. }))
    }

    /// Trailing prompt tokens the prefill must not compute, which the decode computes
    /// itself (vLLM's `_prefill_backoff` for Mamba): 1 with SSM groups, so that the state
    /// handed over is the one before the prompt's last token (vLLM's h(N-1)) and the
    /// decode's first step, running that token, yields the state after it; 0 without. The
    /// engine applies it: its prefill schedules `num_prompt_tokens - backoff` tokens
    /// (vLLM's `_truncate_request_for_prefill`), its decode loads
    /// [`remote_prefill_tokens`](Self::remote_prefill_tokens).
    pub fn prefill_backoff_tokens(&self) -> usize {
        usize::from(self.has_ssm_groups())
    }

    /// The prompt tokens a decode loads from the prefill of a prompt of `num_prompt_tokens`
    /// (vLLM's `_get_remote_prefill_token_count`): all but the
    /// [`prefill_backoff_tokens`](Self::prefill_backoff_tokens), or all of a prompt no
    /// longer than those.
    pub fn remote_prefill_tokens(&self, num_prompt_tokens: usize) -> usize {
        let backoff = self.prefill_backoff_tokens();
        if backoff > 0 && num_prompt_tokens > backoff {
            num_prompt_tokens - backoff
        } else {
            num_prompt_tokens
        }
    }

    /// Whether group `group` is an SSM group.
    pub fn is_ssm(&self, group: usize) -> bool {
        matches!(self.kinds().get(group), Some(KvCacheGroupKind::Ssm { .. }))
    }

    /// The SSM state, which groups with SSM groups must have to be read.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for SSM groups without an [`SsmState`].
    pub(crate) fn checked_ssm_state(&self) -> Result<Option<&SsmState>> {
        if self.has_ssm_groups() && self.ssm_state.is_none() {
            return Err(Error::invalid(
                OP,
                "ssm groups need an ssm_state ({\"conv_bytes\": [..], \"temporal_bytes\": n}): the bytes of each conv sub-projection and of the temporal state per rank, vLLM's ssm_sizes",
            ));
        }
        Ok(self.ssm_state.as_ref())
    }

    /// The regions of `regions` that hold SSM state (vLLM's `_ssm_region_indices`, the
    /// regions its Mamba layers registered): every region, or with
    /// [`region_groups`](Self::region_groups) each whose group is an SSM group and each
    /// shared one ([`SHARED_REGION`]: as vLLM's hybrid allocator shares a tensor, a layer
    /// of every group); none without SSM groups.
    pub(crate) fn ssm_regions(&self, regions: usize) -> Vec<usize> {
        if !self.has_ssm_groups() {
            return Vec::new();
        }
        let groups = self.region_groups();
        if groups.is_empty() {
            return (0..regions).collect();
        }
        (0..regions)
            .filter(|&r| {
                groups.get(r).is_some_and(|&g| {
                    g == SHARED_REGION || usize::try_from(g).is_ok_and(|g| self.is_ssm(g))
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `kv_connector_extra_config.kv_cache_groups` holding `json`, parsed.
    fn parsed(json: serde_json::Value) -> Result<KvCacheGroups> {
        let mut kv = nixl::kv_config::KvTransferConfig::default();
        kv.kv_connector_extra_config
            .insert(crate::geometry::groups::KV_CACHE_GROUPS_KEY.into(), json);
        KvCacheGroups::from_kv_transfer_config(&kv)
    }

    #[test]
    fn ssm_groups_parse_with_their_state_and_keep_the_state_bearing_block() {
        let groups = parsed(serde_json::json!({
            "block_size": 16,
            "groups": ["full_attention", {"ssm": {"speculative_blocks": 2}}, {"ssm": {}}],
            "ssm_state": {"conv_bytes": [24, 8, 8], "temporal_bytes": 64},
        }))
        .unwrap();
        assert!(groups.has_ssm_groups());
        assert!(!groups.is_ssm(0) && groups.is_ssm(1) && groups.is_ssm(2));
        assert_eq!(
            groups.ssm_state(),
            Some(&SsmState::new(vec![24, 8, 8], 64).unwrap())
        );
        assert_eq!(
            groups.kinds()[1],
            KvCacheGroupKind::Ssm {
                speculative_blocks: 2
            }
        );
        assert_eq!(groups.kinds()[1].to_string(), "SSM (Mamba) state");
        // The decode recomputes the prompt's last token (vLLM's h(N-1) hand-over).
        assert_eq!(groups.prefill_backoff_tokens(), 1);
        assert_eq!(groups.remote_prefill_tokens(100), 99);
        assert_eq!(groups.remote_prefill_tokens(1), 1);
        assert_eq!(KvCacheGroups::default().remote_prefill_tokens(100), 100);
        let ids = [vec![1, 2, 3], vec![0, 7, 8, 9], vec![0, 0, 5]];
        assert_eq!(
            groups.clip("r", &ids).unwrap(),
            [&[1, 2, 3][..], &[7][..], &[5][..]]
        );
        // Round trip through JSON.
        let json = serde_json::to_value(&groups).unwrap();
        assert_eq!(
            serde_json::from_value::<KvCacheGroups>(json).unwrap(),
            groups
        );
    }

    #[test]
    fn the_state_is_in_every_region_or_those_of_ssm_groups_and_the_shared_ones() {
        let groups = parsed(serde_json::json!({
            "block_size": 16,
            "groups": ["full_attention", {"ssm": {}}],
            "ssm_state": {"conv_bytes": [8], "temporal_bytes": 8},
        }))
        .unwrap();
        assert_eq!(groups.ssm_regions(3), [0, 1, 2]);
        let own = groups.with_region_groups(vec![-1, 1, 0]).unwrap();
        assert_eq!(own.ssm_regions(3), [0, 1]);
        // Attention groups alone hold no state.
        assert!(KvCacheGroups::default().ssm_regions(3).is_empty());
    }

    #[test]
    fn ssm_groups_without_what_they_need_are_refused_by_name() {
        for (json, want) in [
            (
                serde_json::json!({"block_size": 16, "groups": ["full_attention", {"ssm": {}}]}),
                "ssm groups need an ssm_state",
            ),
            (
                serde_json::json!({"block_size": 16, "groups": ["full_attention"],
                    "ssm_state": {"conv_bytes": [8], "temporal_bytes": 8}}),
                "no KV cache group is an ssm group",
            ),
            (
                serde_json::json!({"block_size": 16, "groups": [{"ssm": {}}],
                    "ssm_state": {"conv_bytes": [8], "temporal_bytes": 8}}),
                "SSM (Mamba) groups only is not supported",
            ),
            (
                serde_json::json!({"block_size": 16, "groups": ["full_attention", {"ssm": {}}],
                    "ssm_state": {"conv_bytes": [], "temporal_bytes": 8}}),
                "at least one conv sub-projection",
            ),
        ] {
            let err = parsed(json).unwrap_err().to_string();
            assert!(err.contains(want), "{err}");
        }
    }
}
