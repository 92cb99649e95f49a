//! An independent model of KV geometry for the tests: what byte every prefill rank holds
//! (a hash of its region, K/V half, model-wide head, block, token and byte), where it sits in
//! a rank's block (HND, NHD or an MLA latent), and so what every byte of a decode rank's
//! cache must hold after a load: the prefill's byte for the same region, half, head and
//! token of the prompt, or, where nothing was read, what was there before. It shares no code
//! with the connector's mapping: heads, offsets and token positions are computed here from
//! the model's definition.

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;

use nixl_connector::vllm::{MetadataServer, VllmChannelLimits};
use nixl_connector::{
    KvAttention, KvCacheGroups, KvCacheSpec, KvConnectorWorker, KvLayout, KvRegion, KvRegionKind,
    Protocol, RemoteBlocks, WorkerConfig, KV_CACHE_GROUPS_KEY,
};

use super::{cpu_config, vllm_config, vllm_factors, SERVER_DEADLINE};

/// A model's KV cache: its attention, layout and regions.
#[derive(Debug, Clone)]
pub struct Model {
    /// MHA with its KV heads, or MLA.
    pub attention: KvAttention,
    /// Byte order of a block.
    pub layout: KvLayout,
    /// Each region: K/V halves in a block or one tensor, and the bytes of one head's token
    /// (one latent's, for MLA).
    pub regions: Vec<(KvRegionKind, usize)>,
}

/// One engine's side of a model: TP, tokens per block, blocks.
#[derive(Debug, Clone, Copy)]
pub struct Side {
    /// TP size.
    pub tp: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks per region.
    pub num_blocks: usize,
}

/// One request's load: the prefill's blocks (the whole prompt), the decode's (the tail it
/// lacks), the prompt's tokens if given.
#[derive(Debug, Clone)]
pub struct Request {
    /// The request id on both engines.
    pub id: String,
    /// Prefill block ids, from the prompt's first token; [`NOT_LISTED`] for a block the
    /// load does not name (a KV cache group that needs only the prompt's last blocks).
    pub remote: Vec<usize>,
    /// Decode block ids the load fills.
    pub local: Vec<usize>,
    /// Tokens in the prompt, if the load is told.
    pub num_tokens: Option<usize>,
}

/// A [`Request::remote`] entry for a prefill block the load does not name: its tokens are
/// not read.
pub const NOT_LISTED: usize = usize::MAX;

fn parts(kind: KvRegionKind) -> usize {
    match kind {
        KvRegionKind::Tensor => 1,
        KvRegionKind::KvHalves => 2,
    }
}

/// A byte of a prefill cache: a hash of where it belongs in the model.
pub fn value(
    region: usize,
    part: usize,
    head: usize,
    block: usize,
    token: usize,
    byte: usize,
) -> u8 {
    let mut x = (region as u64) << 56
        ^ (part as u64) << 52
        ^ (head as u64) << 40
        ^ (block as u64) << 24
        ^ (token as u64) << 12
        ^ byte as u64;
    x = (x ^ (x >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (x ^ (x >> 32)) as u8
}

/// A byte of a decode cache before any load.
pub fn sentinel(region: usize, offset: usize) -> u8 {
    (region * 29 + offset * 13 + 0x5A) as u8
}

impl Model {
    /// The model-wide heads rank `rank` of TP `tp` holds (`0..1` for MLA's latent): `total /
    /// tp` consecutive heads, or the one head `rank * total / tp` when TP is larger.
    pub fn heads(&self, rank: usize, tp: usize) -> Range<usize> {
        match self.attention {
            KvAttention::Mla => 0..1,
            KvAttention::Mha { total_kv_heads } if tp <= total_kv_heads => {
                let per = total_kv_heads / tp;
                rank * per..(rank + 1) * per
            }
            KvAttention::Mha { total_kv_heads } => {
                let head = rank * total_kv_heads / tp;
                head..head + 1
            }
        }
    }

    /// Bytes of one block of region `region` on `side`.
    pub fn block_len(&self, region: usize, side: &Side) -> usize {
        let (kind, token_bytes) = self.regions[region];
        parts(kind) * self.heads(0, side.tp).len() * side.block_size * token_bytes
    }

    /// The spec a rank of `side` registers.
    pub fn spec(&self, side: &Side) -> KvCacheSpec {
        KvCacheSpec {
            num_blocks: side.num_blocks,
            block_size: side.block_size,
            attention: self.attention,
            layout: self.layout,
            regions: (0..self.regions.len())
                .map(|r| KvRegion {
                    block_len: self.block_len(r, side),
                    kind: self.regions[r].0,
                })
                .collect(),
        }
    }

    /// Where the byte (`part`, model-wide `head`, `token`, `byte`) sits in a block of region
    /// `region` of rank `rank` of `side`.
    fn offset(
        &self,
        region: usize,
        side: &Side,
        rank: usize,
        at: (usize, usize, usize, usize),
    ) -> usize {
        let (part, head, token, byte) = at;
        let token_bytes = self.regions[region].1;
        let heads = self.heads(rank, side.tp);
        let part_len = self.block_len(region, side) / parts(self.regions[region].0);
        let head = head - heads.start;
        part * part_len
            + match (self.attention, self.layout) {
                (KvAttention::Mla, _) => token * token_bytes,
                (_, KvLayout::Hnd) => (head * side.block_size + token) * token_bytes,
                (_, KvLayout::Nhd) => (token * heads.len() + head) * token_bytes,
            }
            + byte
    }

    /// Every (part, head, token, byte) of a block of region `region` of rank `rank`.
    fn coordinates(
        &self,
        region: usize,
        side: &Side,
        rank: usize,
    ) -> impl Iterator<Item = (usize, usize, usize, usize)> {
        let (kind, token_bytes) = self.regions[region];
        let heads = self.heads(rank, side.tp);
        let tokens = side.block_size;
        (0..parts(kind)).flat_map(move |part| {
            heads.clone().flat_map(move |head| {
                (0..tokens)
                    .flat_map(move |token| (0..token_bytes).map(move |b| (part, head, token, b)))
            })
        })
    }

    /// Region `region` of prefill rank `rank`, as [`value`] fills it.
    pub fn prefill_region(&self, region: usize, side: &Side, rank: usize) -> Vec<u8> {
        let len = self.block_len(region, side);
        let mut out = vec![0u8; len * side.num_blocks];
        for block in 0..side.num_blocks {
            for at in self.coordinates(region, side, rank) {
                let (part, head, token, byte) = at;
                out[block * len + self.offset(region, side, rank, at)] =
                    value(region, part, head, block, token, byte);
            }
        }
        out
    }

    /// Fills every region of prefill rank `rank`'s `worker`.
    pub fn fill_prefill(&self, worker: &KvConnectorWorker, side: &Side, rank: usize) {
        let cache = worker.kv_caches().unwrap();
        for region in 0..self.regions.len() {
            cache
                .write(region, 0, &self.prefill_region(region, side, rank))
                .unwrap();
        }
    }

    /// Region `region` of a decode cache before any load.
    pub fn sentinel_region(&self, region: usize, side: &Side) -> Vec<u8> {
        let len = self.block_len(region, side) * side.num_blocks;
        (0..len).map(|o| sentinel(region, o)).collect()
    }

    /// Fills every region of a decode `worker` with [`sentinel`].
    pub fn fill_sentinel(&self, worker: &KvConnectorWorker, side: &Side) {
        let cache = worker.kv_caches().unwrap();
        for region in 0..self.regions.len() {
            cache
                .write(region, 0, &self.sentinel_region(region, side))
                .unwrap();
        }
    }

    /// The tokens of the prompt a load of `request` moves: whole units of the smaller block
    /// size up to `num_tokens`, or every token of the prefill's blocks without it.
    fn moved_tokens(request: &Request, prefill: &Side, decode: &Side) -> usize {
        let unit = prefill.block_size.min(decode.block_size);
        request
            .num_tokens
            .map_or(request.remote.len() * prefill.block_size, |n| {
                n.div_ceil(unit) * unit
            })
    }

    /// Region `region` of decode rank `rank` after loads of `requests` (each from a prefill
    /// of `prefill`) into a cache that held [`sentinel`].
    pub fn expected_decode_region(
        &self,
        region: usize,
        prefill: &Side,
        decode: &Side,
        rank: usize,
        requests: &[&Request],
    ) -> Vec<u8> {
        let mut out = self.sentinel_region(region, decode);
        let len = self.block_len(region, decode);
        for request in requests {
            let moved = Self::moved_tokens(request, prefill, decode);
            // The decode's blocks for the whole prompt; `local` are the last of them.
            let first = moved.div_ceil(decode.block_size) - request.local.len();
            for (i, &block) in request.local.iter().enumerate() {
                for at in self.coordinates(region, decode, rank) {
                    let (part, head, token, byte) = at;
                    let position = (first + i) * decode.block_size + token;
                    if position >= moved {
                        continue;
                    }
                    let far = request.remote[position / prefill.block_size];
                    if far == NOT_LISTED {
                        continue;
                    }
                    out[block * len + self.offset(region, decode, rank, at)] =
                        value(region, part, head, far, position % prefill.block_size, byte);
                }
            }
        }
        out
    }

    /// Bytes a load of `request` moves into decode rank `rank`: every byte of its heads for
    /// each moved token of its blocks.
    pub fn moved_bytes(
        &self,
        prefill: &Side,
        decode: &Side,
        rank: usize,
        request: &Request,
    ) -> usize {
        (0..self.regions.len())
            .map(|r| self.moved_bytes_in(r, (prefill, decode), rank, request))
            .sum()
    }

    /// [`moved_bytes`](Self::moved_bytes) in region `region` alone.
    pub fn moved_bytes_in(
        &self,
        region: usize,
        (prefill, decode): (&Side, &Side),
        rank: usize,
        request: &Request,
    ) -> usize {
        let moved = Self::moved_tokens(request, prefill, decode);
        let first = moved.div_ceil(decode.block_size) - request.local.len();
        let tokens = (first * decode.block_size..moved)
            .filter(|&p| request.remote[p / prefill.block_size] != NOT_LISTED)
            .count();
        let (kind, token_bytes) = self.regions[region];
        tokens * parts(kind) * self.heads(rank, decode.tp).len() * token_bytes
    }

    /// Checks every byte of decode rank `rank`'s cache against [`expected_decode_region`].
    pub fn check_decode(
        &self,
        worker: &KvConnectorWorker,
        prefill: &Side,
        decode: &Side,
        rank: usize,
        requests: &[&Request],
    ) -> Result<(), String> {
        for region in 0..self.regions.len() {
            let want = self.expected_decode_region(region, prefill, decode, rank, requests);
            compare_region(worker, rank, region, self.block_len(region, decode), &want)?;
        }
        Ok(())
    }

    /// Where to read `request` from a prefill engine `engine` whose rank 0 listens on `port`
    /// with TP `tp`.
    pub fn remote(request: &Request, engine: &str, port: u16, tp: usize) -> RemoteBlocks {
        RemoteBlocks {
            engine_id: engine.to_string(),
            host: "127.0.0.1".to_string(),
            port,
            block_ids: request.remote.clone(),
            group_lens: Vec::new(),
            request_id: request.id.clone(),
            tp_size: tp,
            pp_size: 1,
            dcp_size: 1,
            num_tokens: request.num_tokens,
            blocks_expiry_time: None,
            registration_generation: None,
            capability: Some(super::capability()),
            lease_epoch: None,
            kept: false,
        }
    }
}

/// Reads decode rank `rank`'s region `region` from `worker` and compares it with `want`, in
/// blocks of `len` bytes: the first byte that differs, by block and offset.
pub fn compare_region(
    worker: &KvConnectorWorker,
    rank: usize,
    region: usize,
    len: usize,
    want: &[u8],
) -> Result<(), String> {
    let mut got = vec![0u8; want.len()];
    worker
        .kv_caches()
        .unwrap()
        .read(region, 0, &mut got)
        .unwrap();
    if let Some(at) = (0..want.len()).find(|&i| got[i] != want[i]) {
        return Err(format!(
            "decode rank {rank} region {region}: byte {} of block {} is {:#04x}, the model wants {:#04x}",
            at % len,
            at / len,
            got[at],
            want[at]
        ));
    }
    Ok(())
}

/// The config of rank `rank` of TP `tp` of engine `engine`, its side channel on `port` (0:
/// any).
pub fn rank_config(engine: &str, rank: usize, tp: usize, port: u16) -> WorkerConfig {
    let mut config = WorkerConfig::new(engine, rank, tp, cpu_config());
    config.platform = Arc::new(nixl::platform::BuiltinPlatform::CPU);
    config.limits.deadline = SERVER_DEADLINE;
    config.side_channel.set_port(port);
    config
}

/// The ranks of an engine of TP `side.tp` in this process speaking `protocol`, each with
/// `model`'s cache and its config naming `groups` when given: see [`engine`], and in vLLM's
/// protocol every rank publishing to one side channel (the engine's ROUTER) shared in its
/// config.
pub fn engine_speaking(
    engine_id: &str,
    model: &Model,
    side: &Side,
    protocol: Protocol,
    groups: Option<&KvCacheGroups>,
) -> Vec<KvConnectorWorker> {
    if protocol == Protocol::Native {
        return engine_with(engine_id, model, side, |config| {
            if let Some(groups) = groups {
                with_groups(config, groups);
            }
        });
    }
    engine_speaking_vllm(engine_id, model, side, groups)
}

/// `config` naming `groups` in its `kv_connector_extra_config`.
pub fn with_groups(config: &mut WorkerConfig, groups: &KvCacheGroups) {
    config.kv_transfer_config.kv_connector_extra_config.insert(
        KV_CACHE_GROUPS_KEY.into(),
        serde_json::to_value(groups).unwrap(),
    );
}

/// The ranks of an engine of TP `side.tp` in this process speaking vLLM's protocol (see
/// [`engine_speaking`]), their config naming `groups` when given (a vLLM-mode rank
/// publishes its `region_group_ids` and kernel blocks per block id from them).
pub fn engine_speaking_vllm(
    engine_id: &str,
    model: &Model,
    side: &Side,
    groups: Option<&KvCacheGroups>,
) -> Vec<KvConnectorWorker> {
    engine_speaking_vllm_with(engine_id, model, side, groups, |_| {})
}

/// As [`engine_speaking_vllm`], with `adjust` applied to each rank's config last.
pub fn engine_speaking_vllm_with(
    engine_id: &str,
    model: &Model,
    side: &Side,
    groups: Option<&KvCacheGroups>,
    adjust: impl Fn(&mut WorkerConfig),
) -> Vec<KvConnectorWorker> {
    let spec = model.spec(side);
    let server = Arc::new(
        MetadataServer::bind_now(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            VllmChannelLimits::default(),
        )
        .unwrap(),
    );
    (0..side.tp)
        .map(|rank| {
            let mut config = rank_config(engine_id, rank, side.tp, 0);
            config.kv_transfer_config = vllm_config(vllm_factors());
            if let Some(groups) = groups {
                with_groups(&mut config, groups);
            }
            config.vllm_side_channel = Some(server.clone());
            adjust(&mut config);
            let worker = KvConnectorWorker::new(config).unwrap();
            worker.register_host_kv_caches(spec.clone()).unwrap();
            worker
        })
        .collect()
}

/// The ranks of an engine of TP `side.tp` in this process, rank `r` listening on rank 0's
/// port + `r` (tried again on other ports when one is taken), each with `model`'s cache.
pub fn engine(engine: &str, model: &Model, side: &Side) -> Vec<KvConnectorWorker> {
    engine_with(engine, model, side, |_| {})
}

/// [`engine`], with `adjust` applied to each rank's config.
pub fn engine_with(
    engine: &str,
    model: &Model,
    side: &Side,
    adjust: impl Fn(&mut WorkerConfig),
) -> Vec<KvConnectorWorker> {
    let spec = model.spec(side);
    let config = |rank, port| {
        let mut config = rank_config(engine, rank, side.tp, port);
        adjust(&mut config);
        config
    };
    for _ in 0..20 {
        let rank0 = KvConnectorWorker::new(config(0, 0)).unwrap();
        rank0.register_host_kv_caches(spec.clone()).unwrap();
        let port = rank0.side_channel_addr().unwrap().port();
        let mut ranks = vec![rank0];
        for rank in 1..side.tp {
            let Some(at) = port.checked_add(rank as u16) else {
                break;
            };
            let worker = KvConnectorWorker::new(config(rank, at)).unwrap();
            // The port may be taken: then try another run of ports.
            if worker.register_host_kv_caches(spec.clone()).is_err() {
                break;
            }
            ranks.push(worker);
        }
        if ranks.len() == side.tp {
            return ranks;
        }
    }
    panic!("no {} free ports in a row in 20 tries", side.tp);
}
