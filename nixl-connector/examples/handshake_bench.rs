//! What authentication costs a handshake: the side-channel exchange of a decode rank with a
//! prefill rank, with and without a shared secret, on loopback in one process, the two
//! alternating in every round; prints each round's medians and the median ratio
//! (authenticated / plain). The NIXL side of a handshake (loading the metadata, preparing
//! the lists) is the same either way and is not in it.
//!
//! ```sh
//! cargo run --release -p nixl-connector --example handshake_bench -- --rounds 10 --exchanges 200
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use nixl::kv_config::KvTransferConfig;
use nixl::platform::BuiltinPlatform;
use nixl_connector::side_channel::fetch_handshake_with;
use nixl_connector::{
    ChannelLimits, KvAttention, KvCacheSpec, KvConnectorWorker, KvLayout, SharedSecret,
    WorkerConfig,
};

/// 32 layers of 512 blocks of 16 tokens of 8 KV heads of 64 two-byte elements (the demo's
/// shape: the handshake message's size is that of a real one).
fn spec() -> KvCacheSpec {
    let heads = KvAttention::Mha { total_kv_heads: 8 };
    KvCacheSpec::uniform(32, 512, 16, heads, KvLayout::Hnd, 16 * 8 * 64 * 2)
}

fn worker(engine: &str, secret: Option<SharedSecret>) -> nixl_connector::Result<KvConnectorWorker> {
    let kv = KvTransferConfig {
        kv_buffer_device: "cpu".into(),
        ..Default::default()
    };
    let mut config = WorkerConfig::new(engine, 0, 1, kv);
    config.platform = Arc::new(BuiltinPlatform::CPU);
    config.secret = secret;
    let worker = KvConnectorWorker::new(config)?;
    worker.register_host_kv_caches(spec())?;
    Ok(worker)
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn flag(name: &str, default: usize) -> usize {
    let words: Vec<String> = std::env::args().collect();
    words
        .iter()
        .position(|w| w == name)
        .and_then(|i| words.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} needs a number"))
        })
        .unwrap_or(default)
}

#[tokio::main]
async fn main() -> nixl_connector::Result<()> {
    let rounds = flag("--rounds", 10);
    let exchanges = flag("--exchanges", 200);
    let secret = SharedSecret::new(*b"0123456789abcdef0123456789abcdef")?;
    let plain = worker("hs-plain", None)?;
    let authed = worker("hs-auth", Some(secret.clone()))?;
    let reader = worker("hs-reader", None)?;
    let ours = reader.handshake()?;
    let limits = ChannelLimits::default();
    let targets = [
        ("plain", plain.side_channel_addr()?, None),
        ("authenticated", authed.side_channel_addr()?, Some(&secret)),
    ];
    // Warm-up of both.
    for (_, addr, secret) in &targets {
        fetch_handshake_with(*addr, &ours, limits, *secret).await?;
    }
    let mut ratios = Vec::new();
    for round in 0..rounds {
        let mut medians = [Duration::ZERO; 2];
        // Alternate which goes first.
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let (_, addr, secret) = targets[i];
            let mut samples = Vec::with_capacity(exchanges);
            for _ in 0..exchanges {
                let start = Instant::now();
                fetch_handshake_with(addr, &ours, limits, secret).await?;
                samples.push(start.elapsed());
            }
            medians[i] = median(samples);
        }
        let ratio = medians[1].as_secs_f64() / medians[0].as_secs_f64();
        println!(
            "round {round}: plain {:.1} us, authenticated {:.1} us, ratio {ratio:.3}",
            medians[0].as_secs_f64() * 1e6,
            medians[1].as_secs_f64() * 1e6
        );
        ratios.push(ratio);
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "handshake exchange (side channel, {} B message, loopback): authenticated / plain, median of {rounds} rounds of {exchanges}: {:.3}",
        rmp_serde::to_vec_named(&ours).map_or(0, |m| m.len()),
        ratios[ratios.len() / 2]
    );
    Ok(())
}
