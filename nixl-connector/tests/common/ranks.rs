//! The ranks of one engine in this process, in either protocol: native, each rank's side
//! channel at rank 0's port + its number (the whole run tried again on other ports when one
//! is taken); vLLM's, every rank served by one side channel of the engine.

use std::net::SocketAddr;
use std::sync::Arc;

use nixl_connector::vllm::{MetadataServer, VllmChannelLimits};
use nixl_connector::{KvCacheSpec, KvConnectorWorker, Protocol, WorkerConfig};

/// `count` ranks of engine `id` speaking `protocol`, rank `n` created from `rank(n)`'s config
/// (its side channel set here) and registering its spec in host memory; and the engine's
/// port (rank 0's, or the vLLM side channel's).
pub fn engine_ranks(
    id: &str,
    protocol: Protocol,
    count: usize,
    rank: impl Fn(usize) -> (WorkerConfig, KvCacheSpec),
) -> (Vec<KvConnectorWorker>, u16) {
    let server = (protocol == Protocol::Vllm).then(|| {
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        Arc::new(MetadataServer::bind_now(any, VllmChannelLimits::default()).unwrap())
    });
    'ports: for _ in 0..20 {
        let mut workers: Vec<KvConnectorWorker> = Vec::new();
        let mut base = server.as_ref().map_or(0, |s| s.local_addr().port());
        for n in 0..count {
            let (mut config, spec) = rank(n);
            if let Some(server) = &server {
                config.vllm_side_channel = Some(server.clone());
            } else if n > 0 {
                let Some(port) = base.checked_add(n as u16) else {
                    continue 'ports;
                };
                config.side_channel.set_port(port);
            }
            let worker = KvConnectorWorker::new(config).unwrap();
            if worker.register_host_kv_caches(spec).is_err() {
                continue 'ports;
            }
            if n == 0 && server.is_none() {
                base = worker.side_channel_addr().unwrap().port();
            }
            workers.push(worker);
        }
        return (workers, base);
    }
    panic!("no run of free ports for engine {id}");
}
