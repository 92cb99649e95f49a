//! A conversation's second turn through a read-back (vLLM 0.33's `bidirectional_kv_xfer`,
//! the scenario's [`second_turn`](super::scenario::Scenario::second_turn)): the decode
//! keeps the first turn's KV (the prompt and its answer) when it finishes; the prefill,
//! whose prefix cache still holds the first turn's first prompt block, reads the rest back
//! from the decode, computes only the tokens past them, and hands the second turn to the
//! decode, which loads only what its own prefix cache (the first turn's full blocks) lacks.
//!
//! One KV cache group only: the read-back pairs one table with the decode's.

use std::time::Duration;

use nixl_connector::{FinishStatus, KvConnectorScheduler};

use super::params;
use super::scenario::fresh;
use super::serving::{paged, DecodeEngine, PrefillEngine, DECODE_REQUEST};
use super::steps;

/// The second turn's request id on the prefill.
const PREFILL_SECOND: &str = "model-prefill-turn-2";
/// The second turn's request id on the decode.
const DECODE_SECOND: &str = "model-decode-turn-2";

/// Blocks of the first turn's prompt the prefill's prefix cache still holds in the second
/// turn (the rest it reads back).
pub const PREFILL_HIT_BLOCKS: usize = 1;

impl PrefillEngine {
    /// The second turn on the prefill: reads back from the decode the KV of the tokens of
    /// `prompt` that its prefix cache lacks, as far as the decode's `kept` params (JSON in the
    /// scenario's protocol) hold them, through the engine's `scheduler`, waiting at most
    /// `wait`; then computes the rest of `prompt`. Its last logits, and the tokens read back.
    ///
    /// # Errors
    /// Why the params were refused, that there was nothing to read, or why the read-back
    /// failed.
    ///
    /// # Panics
    /// If the model has several KV cache groups, or the pool no room for `prompt`.
    pub async fn read_back(
        &mut self,
        scheduler: &mut KvConnectorScheduler,
        kept: &str,
        prompt: &[usize],
        wait: Duration,
    ) -> Result<(Vec<f32>, usize), String> {
        assert_eq!(self.blocks.len(), 1, "a read-back of one KV cache group");
        let kept = params::from_json(&self.scenario, kept)?;
        let block_size = self.scenario.prefill.block_size;
        let hit = PREFILL_HIT_BLOCKS * block_size;
        let read = scheduler.read_back_tokens(Some(&kept), prompt.len(), hit);
        if read == 0 {
            return Err("the scheduler reads nothing back".into());
        }
        let first_turn = &self.blocks[0];
        let mut table = first_turn[..PREFILL_HIT_BLOCKS].to_vec();
        let count = prompt.len().div_ceil(block_size) - PREFILL_HIT_BLOCKS;
        table.extend(fresh(first_turn, count, self.spec.num_blocks));
        let local = &table[PREFILL_HIT_BLOCKS..PREFILL_HIT_BLOCKS + read.div_ceil(block_size)];
        steps::load(
            scheduler,
            &self.ranks,
            PREFILL_SECOND,
            &[local],
            &kept,
            wait,
        )
        .await?;
        self.blocks = vec![table];
        let mut caches = paged(&self.scenario, &self.spec, &self.ranks, &self.blocks);
        let mut logits = Vec::new();
        for (position, &token) in prompt.iter().enumerate().skip(hit + read) {
            logits = self.model.forward(token, position, &mut caches);
        }
        Ok((logits, read))
    }

    /// Finishes the second turn through `scheduler` for the decode (the `kept` params its
    /// request came with); the params for the decode, in the scenario's protocol's JSON.
    ///
    /// # Errors
    /// Why the params were refused or the connector refused to finish the request.
    pub fn finish_second_turn(
        &self,
        scheduler: &mut KvConnectorScheduler,
        kept: &str,
    ) -> Result<String, String> {
        let kept = params::from_json(&self.scenario, kept)?;
        let tokens = self.scenario.second_prompt_len().expect("a second turn");
        let finished = scheduler
            .request_finished_all_groups(
                PREFILL_SECOND,
                &self.blocks,
                tokens,
                Some(&kept),
                FinishStatus::LengthCapped,
            )
            .map_err(|err| err.to_string())?;
        scheduler.step(&self.ranks).map_err(|err| err.to_string())?;
        let params = finished
            .kv_transfer_params
            .ok_or("no params for the decode")?;
        Ok(params::to_json(&self.scenario, &params))
    }

    /// Steps `scheduler` until the decode's read released the second turn, or `wait`
    /// passed; whether it was released.
    ///
    /// # Panics
    /// If a scheduler step fails.
    pub async fn second_turn_released(
        &self,
        scheduler: &mut KvConnectorScheduler,
        wait: Duration,
    ) -> bool {
        steps::released(scheduler, &self.ranks, PREFILL_SECOND, wait).await
    }
}

impl DecodeEngine {
    /// Finishes the first turn, length-capped after the prompt and the scenario's steps, and
    /// keeps its blocks for the next turn's prefill; the params that name them, in the
    /// scenario's protocol's JSON.
    ///
    /// # Errors
    /// Why the connector refused to finish the request or did not keep it.
    pub fn keep(&mut self) -> Result<String, String> {
        let tokens = self.scenario.prompt_len + self.scenario.steps;
        let finished = self
            .scheduler
            .request_finished_all_groups(
                DECODE_REQUEST,
                &self.tables,
                tokens,
                None,
                FinishStatus::LengthCapped,
            )
            .map_err(|err| err.to_string())?;
        self.scheduler
            .step(&self.ranks)
            .map_err(|err| err.to_string())?;
        match finished.kv_transfer_params {
            Some(params) if finished.delay_free_blocks => {
                Ok(params::to_json(&self.scenario, &params))
            }
            _ => Err("the decode did not keep the first turn".into()),
        }
    }

    /// Steps the scheduler until the kept first turn is released (a read-back's finish
    /// notification), or `wait` passed; whether it was.
    ///
    /// # Panics
    /// If a scheduler step fails.
    pub async fn kept_released(&mut self, wait: Duration) -> bool {
        steps::released(&mut self.scheduler, &self.ranks, DECODE_REQUEST, wait).await
    }

    /// The second turn on the decode: its prefix cache holds the first turn's full blocks,
    /// and it loads the rest of the second prompt's blocks from the prefill of `params`
    /// (JSON in the scenario's protocol), waiting at most `wait`; the blocks it loaded.
    /// Then [`generate`](Self::generate) continues the second turn.
    ///
    /// # Errors
    /// Why the params were refused, or the load failed or did not end in time.
    ///
    /// # Panics
    /// If the model has several KV cache groups, or the pool no room for the second turn.
    pub async fn load_second_turn(
        &mut self,
        params: &str,
        wait: Duration,
    ) -> Result<usize, String> {
        assert_eq!(self.tables.len(), 1, "a second turn of one KV cache group");
        let params = params::from_json(&self.scenario, params)?;
        let block_size = self.scenario.decode.block_size;
        let hit = (self.scenario.prompt_len + self.scenario.steps) / block_size;
        let prompt = self.scenario.second_prompt_len().expect("a second turn");
        let count = (prompt + self.scenario.steps).div_ceil(block_size) - hit;
        let first_turn = &self.tables[0];
        let mut table = first_turn[..hit].to_vec();
        table.extend(fresh(first_turn, count, self.spec.num_blocks));
        self.tables = vec![table];
        let blocks = hit..prompt.div_ceil(block_size);
        let loaded = blocks.len();
        self.load_blocks(DECODE_SECOND, &params, blocks, wait)
            .await?;
        Ok(loaded)
    }
}
