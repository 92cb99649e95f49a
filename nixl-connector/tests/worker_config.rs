//! Worker settings a caller chooses: the agent's name (and what the worker reports of its
//! setup), and the agent settings `kv_connector_extra_config` carries.

mod common;

#[tokio::test]
async fn a_chosen_agent_name_is_the_agents() {
    let worker = common::worker_with("named", 0, 1, &common::spec(2), |config| {
        config.agent_name = Some("prefill-chosen-7".into());
    });
    assert_eq!(worker.agent().name(), "prefill-chosen-7");
    assert_eq!(worker.handshake().unwrap().agent_name, "prefill-chosen-7");
    assert_eq!(worker.mem_type(), nixl::MemType::Dram);
    let backends: Vec<_> = worker.backends().iter().map(|b| b.plugin()).collect();
    assert_eq!(backends, ["UCX"]);
}

#[tokio::test]
async fn refuse_same_host_transports_comes_from_the_extra_config() {
    let default = common::worker_with("same-host-default", 0, 1, &common::spec(2), |_| {});
    assert!(!default.agent().config().refuse_same_host_transports);
    let strict = common::worker_with("same-host-strict", 0, 1, &common::spec(2), |config| {
        config
            .kv_transfer_config
            .kv_connector_extra_config
            .insert("refuse_same_host_transports".into(), true.into());
    });
    assert!(strict.agent().config().refuse_same_host_transports);
}

/// A native worker whose `kv_cache_groups` count larger blocks than it registers (block ids
/// of several registered blocks, vLLM's `physical_blocks_per_logical_kv_block`) says so in
/// its handshake, as a vLLM-mode rank does in its metadata, with each region's group.
#[tokio::test]
async fn a_native_handshake_says_kernel_blocks_per_id_and_region_groups() {
    let spec = common::spec(2);
    let config = nixl_connector::WorkerConfig::new("native-groups", 0, 1, common::cpu_config());
    let worker = register_with_groups(
        config,
        serde_json::json!({"block_size": 2 * spec.block_size,
            "groups": ["full_attention", {"sliding_window": {"window_tokens": 64}}],
            "region_groups": vec![-1; spec.num_regions()]}),
        &spec,
    )
    .expect("native groups of larger blocks than the registered ones");
    let handshake = worker.handshake().unwrap();
    assert_eq!(handshake.blocks_per_id, 2);
    assert_eq!(handshake.region_groups, vec![-1; spec.num_regions()]);
}

/// vLLM moves an SSM (Mamba) group's state block whole, never expanded into kernel blocks: a
/// vLLM-mode worker with SSM groups whose `kv_cache_groups` count larger blocks than it
/// registers (block ids of several kernel blocks, as vLLM's hybrid Mamba models have them)
/// registers: its state pages are whole block ids.
#[cfg(feature = "vllm")]
#[tokio::test]
async fn vllm_ssm_groups_of_larger_blocks_than_the_registered_ones_register() {
    let spec = common::spec(2);
    let config = nixl_connector::WorkerConfig::new(
        "vllm-ssm-groups",
        0,
        1,
        common::vllm_config(common::vllm_factors()),
    );
    let registered = register_with_groups(
        config,
        serde_json::json!({
            "block_size": 2 * spec.block_size,
            "groups": ["full_attention", {"ssm": {"speculative_blocks": 0}}],
            "ssm_state": {"conv_bytes": [8], "temporal_bytes": 8},
        }),
        &spec,
    );
    if let Err(err) = registered {
        panic!("a vLLM-mode worker of SSM groups over kernel blocks is refused: {err}");
    }
}

/// A CPU worker made from `config` with `kv_cache_groups` set to `groups`, once it registered
/// `spec`'s blocks, or why it could not.
fn register_with_groups(
    mut config: nixl_connector::WorkerConfig,
    groups: serde_json::Value,
    spec: &nixl_connector::KvCacheSpec,
) -> nixl_connector::Result<nixl_connector::KvConnectorWorker> {
    config.platform = std::sync::Arc::new(nixl::platform::BuiltinPlatform::CPU);
    config
        .kv_transfer_config
        .kv_connector_extra_config
        .insert(nixl_connector::KV_CACHE_GROUPS_KEY.into(), groups);
    let worker = nixl_connector::KvConnectorWorker::new(config).unwrap();
    worker.register_host_kv_caches(spec.clone())?;
    Ok(worker)
}
