//! What both engines share: the model, the prompt, the registered cache's spec, and an
//! engine's rank and scheduler with its block table; the KV of a run of positions read,
//! cleared and recomputed through a paged view of the registered cache.

use std::time::{Duration, Instant};

use kv_model::{GroupRegions, KvCache, KvPacking, Model, PagedKv, PagedLayout};
use nixl_connector::{KvCacheSpec, KvConnectorScheduler, KvConnectorWorker, KvLayout};
use nixl_rs::model_serving::engine::{engine, scheduler};
use nixl_rs::model_serving::scenario::{model, Scenario};

/// Tokens per block: the demo's and the model tests'.
pub const BLOCK: usize = 16;

/// The model and the prompt both engines serve, and the cache each registers.
pub struct Setup {
    /// The native protocol, TP 1 → 1, the model's layers, the prompt's length.
    pub scenario: Scenario,
    /// The seeded model.
    pub model: Model,
    /// Tokens both engines hold before the N.
    pub prefix: usize,
    /// The prompt: the prefix, then the largest N.
    pub prompt: Vec<usize>,
    /// What each engine registers.
    pub spec: KvCacheSpec,
}

impl Setup {
    /// A model of `layers` layers serving a prompt of `prefix` tokens and then `max_n`
    /// (each a multiple of [`BLOCK`]).
    pub fn new(layers: usize, prefix: usize, max_n: usize) -> Self {
        let tokens = prefix + max_n;
        let scenario = Scenario {
            layers,
            prompt_len: tokens,
            ..Scenario::tp1(false)
        };
        let model = model(&scenario);
        let prompt = scenario.prompt(model.config().vocab);
        // Room for the prompt and a few blocks more, not a multiple of 7 (the decode's table).
        let num_blocks = (tokens / BLOCK + 5..).find(|b| b % 7 != 0).unwrap();
        let spec = PagedLayout::spec(
            model.config(),
            KvPacking::Packed,
            GroupRegions::Own,
            KvLayout::Hnd,
            BLOCK,
            num_blocks,
            1,
        );
        Setup {
            scenario,
            model,
            prefix,
            prompt,
            spec,
        }
    }

    /// Engine `name`, its cache registered, its prompt in the blocks of `table`.
    pub fn engine(&self, name: &str, table: Vec<usize>) -> Engine {
        let ranks = engine(&self.scenario, name, &self.spec, 1);
        let scheduler = scheduler(&self.scenario, name, BLOCK, &ranks);
        Engine {
            ranks,
            scheduler,
            table,
        }
    }

    /// The model's weights, counted: embedding and output head, and each layer's
    /// projections, MLP and norms.
    pub fn parameters(&self) -> usize {
        let c = self.model.config();
        let (d, q, kv) = (c.hidden, c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
        let layer = d * q + 2 * d * kv + q * d + 3 * d * c.ffn + 2 * d;
        2 * c.vocab * d + d + c.layers * layer
    }

    /// Bytes of KV one token takes in every layer.
    pub fn kv_bytes_per_token(&self) -> usize {
        let c = self.model.config();
        2 * c.layers * c.kv_heads * c.cached_dim() * std::mem::size_of::<f32>()
    }
}

/// One engine of TP 1: its rank, its scheduler and the blocks of its prompt.
pub struct Engine {
    /// Its one rank.
    pub ranks: Vec<KvConnectorWorker>,
    /// Its scheduler.
    pub scheduler: KvConnectorScheduler,
    /// The blocks of its prompt, in order.
    pub table: Vec<usize>,
}

impl Engine {
    /// Its paged view of its registered cache.
    pub fn cache(&self, setup: &Setup) -> PagedKv<&nixl::Registration> {
        let layout = PagedLayout::new(
            setup.model.config(),
            &setup.spec,
            KvPacking::Packed,
            GroupRegions::Own,
            0,
            1,
        )
        .expect("the model's layout of the spec it registered");
        let regions = self.ranks[0].kv_caches().expect("a registered KV cache");
        PagedKv::new(layout, regions, vec![self.table.clone()])
    }

    /// The K and V of positions `tokens`, every layer and head.
    pub fn snapshot(&self, setup: &Setup, tokens: &[usize]) -> Vec<f32> {
        let cache = self.cache(setup);
        let c = setup.model.config();
        let (mut key, mut value) = (vec![0.0; c.head_dim], vec![0.0; c.head_dim]);
        let mut all = Vec::new();
        for layer in 0..c.layers {
            for head in 0..c.kv_heads {
                for &position in tokens {
                    cache.load(layer, head, position, &mut key, &mut value);
                    all.extend_from_slice(&key);
                    all.extend_from_slice(&value);
                }
            }
        }
        all
    }

    /// Zeroes the K and V of positions `tokens`, so that what a load or a recompute leaves
    /// there is its own.
    pub fn zero(&self, setup: &Setup, tokens: &[usize]) {
        let mut cache = self.cache(setup);
        let c = setup.model.config();
        let zeros = vec![0.0; c.head_dim];
        for layer in 0..c.layers {
            for head in 0..c.kv_heads {
                for &position in tokens {
                    cache.store(layer, head, position, &zeros, &zeros);
                }
            }
        }
    }

    /// Computes the prompt's `tokens` into the cache (every earlier position already
    /// there), and how long that took.
    pub fn recompute(&self, setup: &Setup, tokens: &[usize]) -> Duration {
        let mut cache = [self.cache(setup)];
        let start = Instant::now();
        for &position in tokens {
            setup
                .model
                .forward(setup.prompt[position], position, &mut cache);
        }
        start.elapsed()
    }
}
