//! Loads of random block tables over the real NIXL, every byte of the decode's cache
//! checked: the blocks loaded hold the prefill's blocks they pair with, and no other byte
//! changed. The tables mix runs of blocks contiguous on both sides (whole runs, sorted random
//! ids) with scattered ids; NIXL 1.5.1 merges a run's consecutive descriptors into one
//! (its `makeXferReq` over prepared lists), which the loads' descriptor counts (NIXL's
//! telemetry) show: one per run and region, or fewer where a run crosses from one region into
//! the next in contiguous memory. A run listed last first on both sides merges too: the
//! connector lists a load's blocks by local block.

mod common;

use std::time::Duration;

use common::{block, fill, poll_until, remote, spec, worker};

/// Loads per test.
const LOADS: usize = 40;

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// `n` distinct ids of `0..blocks`: a run at a random start, random ids, or random ids
    /// sorted; the run and the sorted ids half the time last first, as an engine that frees
    /// a request's blocks last first (vLLM) hands them out again.
    fn table(&mut self, n: usize, blocks: usize) -> Vec<usize> {
        let mut table = self.ascending(n, blocks);
        if self.below(2) == 0 {
            table.reverse();
        }
        table
    }

    fn ascending(&mut self, n: usize, blocks: usize) -> Vec<usize> {
        if self.below(3) == 0 {
            let start = self.below(blocks - n + 1);
            return (start..start + n).collect();
        }
        let mut all: Vec<usize> = (0..blocks).collect();
        for i in (1..blocks).rev() {
            all.swap(i, self.below(i + 1));
        }
        all.truncate(n);
        if self.below(2) == 0 {
            all.sort_unstable();
        }
        all
    }
}

/// Runs of blocks consecutive on both sides, the block pairs (`local[i]`, `far[i]`) taken
/// in the order of their local blocks, as the connector lists them.
fn runs(local: &[usize], far: &[usize]) -> usize {
    let mut pairs: Vec<_> = local.iter().copied().zip(far.iter().copied()).collect();
    pairs.sort_unstable();
    1 + pairs
        .windows(2)
        .filter(|p| !(p[1].0 == p[0].0 + 1 && p[1].1 == p[0].1 + 1))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_block_tables_load_every_byte_and_runs_post_one_descriptor_each() {
    common::init_tracing();
    let spec = spec(2);
    let prefill = worker("pf-runs", 0, 1, &spec);
    fill(&prefill, &spec);
    let decode = worker("dc-runs", 0, 1, &spec);
    let cache = decode.kv_caches().unwrap();
    let regions = spec.num_regions();
    let mut rng = Rng(45);
    for i in 0..LOADS {
        let n = 1 + rng.below(spec.num_blocks);
        let (local, far) = (rng.table(n, spec.num_blocks), rng.table(n, spec.num_blocks));
        for layer in 0..regions {
            let zeros = vec![0u8; spec.num_blocks * spec.block_len(layer)];
            cache.write(layer, 0, &zeros).unwrap();
        }
        let request = format!("runs-{i}");
        let from = remote(&prefill, "pf-runs", &request, far.clone(), 1);
        decode.start_load(&request, &local, &from).unwrap();
        let done = poll_until(&decode, Duration::from_secs(20), |f| !f.recving.is_empty()).await;
        let what = format!("load {i}: local {local:?} remote {far:?}");
        assert_eq!(done.recving, std::slice::from_ref(&request), "{what}");
        assert!(decode.load_errors().is_empty(), "{what}");
        for layer in 0..regions {
            for b in 0..spec.num_blocks {
                let want = match local.iter().position(|&l| l == b) {
                    Some(at) => block(&prefill, &spec, layer, far[at]),
                    None => vec![0u8; spec.block_len(layer)],
                };
                assert!(
                    block(&decode, &spec, layer, b) == want,
                    "{what}: layer {layer} block {b}"
                );
            }
        }
        let metrics = decode.metrics();
        assert_eq!(metrics.len(), 1, "{what}");
        assert!(metrics[0].failure.is_none(), "{what}");
        assert_eq!(
            metrics[0].bytes as usize,
            n * (0..regions).map(|l| spec.block_len(l)).sum::<usize>(),
            "{what}"
        );
        let per_region = runs(&local, &far);
        let posted = metrics[0].descriptors;
        assert!(
            posted <= per_region * regions && posted + regions > per_region * regions,
            "{what}: NIXL posted {posted} descriptors for {per_region} runs in each of {regions} regions"
        );
    }
}
