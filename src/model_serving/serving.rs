//! The two engines of a run, each a sequence of steps its caller times. One process
//! serving the prompt alone is a decode engine that computes the whole prompt itself.

use std::ops::Range;
use std::time::Duration;

use kv_model::{greedy, Generation, Model, PagedKv, PagedLayout};
use nixl_connector::{
    FinishStatus, KvCacheSpec, KvConnectorScheduler, KvConnectorWorker, KvTransferParams,
};

use super::engine::{engine, scheduler};
use super::params;
use super::scenario::{model, num_blocks, scattered, Scenario, Side};
use super::steps;

/// The request's id on the prefill.
pub(super) const PREFILL_REQUEST: &str = "model-prefill-req";
/// The request's id on the decode.
pub(super) const DECODE_REQUEST: &str = "model-decode-req";

/// The spec every rank of `side` registers.
fn spec(scenario: &Scenario, side: &Side) -> KvCacheSpec {
    let model = model(scenario);
    PagedLayout::spec(
        model.config(),
        scenario.packing(),
        scenario.group_regions(),
        scenario.layout(),
        side.block_size,
        num_blocks(scenario, side.block_size),
        side.tp,
    )
}

/// Each rank's paged view of its own registered regions, through `block_tables` (one per
/// KV cache group).
pub(super) fn paged<'a>(
    scenario: &Scenario,
    spec: &KvCacheSpec,
    ranks: &'a [KvConnectorWorker],
    block_tables: &[Vec<usize>],
) -> Vec<PagedKv<&'a nixl::Registration>> {
    let model = model(scenario);
    ranks
        .iter()
        .enumerate()
        .map(|(rank, worker)| {
            let layout = PagedLayout::new(
                model.config(),
                spec,
                scenario.packing(),
                scenario.group_regions(),
                rank,
                ranks.len(),
            )
            .expect("the model's layout of the spec it registered");
            let regions = worker.kv_caches().expect("a registered KV cache");
            PagedKv::new(layout, regions, block_tables.to_vec())
        })
        .collect()
}

/// The prefill engine: its ranks, each with a registered cache, and its scheduler.
pub struct PrefillEngine {
    pub(super) scenario: Scenario,
    pub(super) model: Model,
    pub(super) spec: KvCacheSpec,
    pub(super) ranks: Vec<KvConnectorWorker>,
    /// Each KV cache group's blocks of the turn's prompt (the second turn's once
    /// [`read_back`](Self::read_back) has read it).
    pub(super) blocks: Vec<Vec<usize>>,
}

impl PrefillEngine {
    /// The prefill engine of `scenario`, its caches registered.
    ///
    /// # Panics
    /// As [`engine`].
    pub fn new(scenario: &Scenario) -> Self {
        let model = model(scenario);
        let side = scenario.prefill;
        let spec = spec(scenario, &side);
        let ranks = engine(scenario, "model-prefill", &spec, side.tp);
        let blocks = scattered(
            model.config().kv_cache_groups(),
            scenario.prompt_len.div_ceil(side.block_size),
            spec.num_blocks,
        );
        PrefillEngine {
            scenario: scenario.clone(),
            model,
            spec,
            ranks,
            blocks,
        }
    }

    /// Computes the prompt into the engine's blocks and returns its last logits.
    pub fn compute(&self) -> Vec<f32> {
        let mut caches = paged(&self.scenario, &self.spec, &self.ranks, &self.blocks);
        let prompt = self.scenario.prompt(self.model.config().vocab);
        self.model.prefill(&prompt, &mut caches)
    }

    /// Finishes the request through the scheduler (which holds its blocks until a decode
    /// has read them) and returns the params for the decode, in the scenario's protocol's
    /// JSON, and the scheduler.
    ///
    /// # Panics
    /// If the connector refuses to finish the request.
    pub fn finish(&self) -> (String, KvConnectorScheduler) {
        let side = self.scenario.prefill;
        let mut scheduler = scheduler(
            &self.scenario,
            "model-prefill",
            side.block_size,
            &self.ranks,
        );
        let asked = KvTransferParams {
            do_remote_decode: true,
            ..Default::default()
        };
        // Each group's blocks, a sliding window's clipped to its last.
        let finished = scheduler
            .request_finished_all_groups(
                PREFILL_REQUEST,
                &self.blocks,
                self.scenario.prompt_len,
                Some(&asked),
                FinishStatus::LengthCapped,
            )
            .expect("the connector finishes the request");
        scheduler.step(&self.ranks).expect("a scheduler step");
        let params = finished.kv_transfer_params.expect("params for the decode");
        (params::to_json(&self.scenario, &params), scheduler)
    }

    /// Steps `scheduler` until a decode's read released the request, or `wait` passed;
    /// whether it was released.
    ///
    /// # Panics
    /// If a scheduler step fails.
    pub async fn released(&self, scheduler: &mut KvConnectorScheduler, wait: Duration) -> bool {
        steps::released(scheduler, &self.ranks, PREFILL_REQUEST, wait).await
    }
}

/// The decode engine: its ranks, each with a registered cache, its scheduler, and the
/// request's block tables (the prompt's and the generation's blocks).
pub struct DecodeEngine {
    pub(super) scenario: Scenario,
    pub(super) model: Model,
    pub(super) spec: KvCacheSpec,
    pub(super) ranks: Vec<KvConnectorWorker>,
    pub(super) scheduler: KvConnectorScheduler,
    pub(super) tables: Vec<Vec<usize>>,
}

impl DecodeEngine {
    /// The decode engine named `name` of `scenario`, its caches registered.
    ///
    /// # Panics
    /// As [`engine`].
    pub fn new(scenario: &Scenario, name: &str) -> Self {
        let model = model(scenario);
        let side = scenario.decode;
        let spec = spec(scenario, &side);
        let ranks = engine(scenario, name, &spec, side.tp);
        let scheduler = scheduler(scenario, "model-decode", side.block_size, &ranks);
        let tables = scattered(
            model.config().kv_cache_groups(),
            (scenario.prompt_len + scenario.steps).div_ceil(side.block_size),
            spec.num_blocks,
        );
        DecodeEngine {
            scenario: scenario.clone(),
            model,
            spec,
            ranks,
            scheduler,
            tables,
        }
    }

    /// Computes the prompt's first `tokens` tokens itself (its prefix hit, or the whole
    /// prompt in one process) and returns the logits after the last (empty for none).
    pub fn compute_prompt(&self, tokens: usize) -> Vec<f32> {
        let mut caches = paged(&self.scenario, &self.spec, &self.ranks, &self.tables);
        let prompt = self.scenario.prompt(self.model.config().vocab);
        let mut logits = Vec::new();
        for (position, &token) in prompt.iter().enumerate().take(tokens) {
            logits = self.model.forward(token, position, &mut caches);
        }
        logits
    }

    /// Loads the rest of the prompt's blocks from the prefill of `params` (JSON in the
    /// scenario's protocol) through the connector, waiting at most `wait`.
    ///
    /// # Errors
    /// Why the params were refused, or the load failed or did not end in time.
    pub async fn load(&mut self, params: &str, wait: Duration) -> Result<(), String> {
        let params = params::from_json(&self.scenario, params)?;
        // Each group's blocks the prompt fills past the prefix hit (a sliding window's
        // clipped to its last by the scheduler).
        let prompt_blocks = self.scenario.prefix_blocks
            ..self
                .scenario
                .prompt_len
                .div_ceil(self.scenario.decode.block_size);
        self.load_blocks(DECODE_REQUEST, &params, prompt_blocks, wait)
            .await
    }

    /// Loads the blocks at `blocks` of each KV cache group's table as request `id` from the
    /// prefill of `params`, waiting at most `wait`.
    ///
    /// # Errors
    /// As [`steps::load`].
    pub(super) async fn load_blocks(
        &mut self,
        id: &str,
        params: &KvTransferParams,
        blocks: Range<usize>,
        wait: Duration,
    ) -> Result<(), String> {
        let local: Vec<&[usize]> = self.tables.iter().map(|t| &t[blocks.clone()]).collect();
        steps::load(&mut self.scheduler, &self.ranks, id, &local, params, wait).await
    }

    /// Generates `steps` tokens greedily ([`greedy`]), feeding `token` first at `position`
    /// (every earlier position in the cache).
    pub fn generate(&self, token: usize, position: usize, steps: usize) -> Generation {
        let mut caches = paged(&self.scenario, &self.spec, &self.ranks, &self.tables);
        greedy(&self.model, token, position, steps, &mut caches)
    }

    /// Bytes of KV the prompt's loaded blocks hold on all ranks: every region's block
    /// length times the blocks past the prefix hit.
    pub fn loaded_bytes(&self) -> usize {
        let side = self.scenario.decode;
        let blocks =
            self.scenario.prompt_len.div_ceil(side.block_size) - self.scenario.prefix_blocks;
        let block_bytes: usize = self.spec.regions.iter().map(|r| r.block_len).sum();
        blocks * block_bytes * self.ranks.len()
    }
}
