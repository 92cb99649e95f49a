//! kv_transfer_config parsing, and from config + platform to a real NIXL agent.

use nixl::kv_config::{KvRole, KvTransferConfig, NixlSetup};
use nixl::platform::{BuiltinPlatform, Platform, PlatformRegistry};
mod common;

use std::os::unix::fs::FileExt;
use std::time::Duration;

use nixl::{
    Agent, Backend, Error, FileRegion, LocalDescList, MemType, RegDesc, Registration,
    RemoteDescList, XferDesc, XferOp, XferOptions,
};

fn config_error(json: &str) -> String {
    match KvTransferConfig::from_json(json) {
        Err(Error::Config { reason }) => reason,
        other => panic!("expected a config error for {json}, got {other:?}"),
    }
}

#[test]
fn defaults() {
    let config = KvTransferConfig::from_json("{}").unwrap();
    assert_eq!(config.kv_connector, None);
    assert_eq!(config.kv_role, None);
    assert_eq!(config.kv_buffer_device, "cuda");
    assert_eq!(config.backends().unwrap(), ["UCX"]);
    assert_eq!(KvTransferConfig::default(), config);
}

#[test]
fn full_config_and_roles() {
    for (role, want) in [
        ("kv_producer", KvRole::Producer),
        ("kv_consumer", KvRole::Consumer),
        ("kv_both", KvRole::Both),
    ] {
        let json = format!(
            r#"{{"kv_connector":"NixlConnector","kv_role":"{role}","kv_buffer_device":"cpu",
                "kv_connector_extra_config":{{"backends":["UCX","POSIX"]}}}}"#
        );
        let config = KvTransferConfig::from_json(&json).unwrap();
        assert_eq!(config.kv_connector.as_deref(), Some("NixlConnector"));
        assert_eq!(config.kv_role, Some(want));
        assert_eq!(config.kv_buffer_device, "cpu");
        assert_eq!(config.backends().unwrap(), ["UCX", "POSIX"]);
    }
}

#[test]
fn unknown_keys_are_kept_and_written_back() {
    let json = r#"{"kv_role":"kv_both","kv_rank":1,"kv_parallel_size":2,"engine_id":"e0",
                   "kv_connector_extra_config":{"backends":["UCX"],"num_threads":4}}"#;
    let config = KvTransferConfig::from_json(json).unwrap();
    assert_eq!(config.other["kv_rank"], 1);
    assert_eq!(config.other["engine_id"], "e0");
    assert_eq!(config.kv_connector_extra_config["num_threads"], 4);
    let again = KvTransferConfig::from_json(&config.to_json()).unwrap();
    assert_eq!(again, config);
}

#[test]
fn malformed_json() {
    let reason = config_error(r#"{"kv_role": "kv_both""#);
    assert!(reason.contains("line 1"), "{reason}");
    config_error("not json");
    config_error("[1, 2]");
}

#[test]
fn wrong_types() {
    let reason = config_error(r#"{"kv_buffer_device": 5}"#);
    assert!(reason.contains("invalid type"), "{reason}");
    config_error(r#"{"kv_connector": ["a"]}"#);
    config_error(r#"{"kv_connector_extra_config": "UCX"}"#);
    let reason = config_error(r#"{"kv_connector_extra_config": {"backends": "UCX"}}"#);
    assert!(reason.contains("must be a list"), "{reason}");
    let reason = config_error(r#"{"kv_connector_extra_config": {"backends": ["UCX", 3]}}"#);
    assert!(reason.contains("non-empty strings"), "{reason}");
}

#[test]
fn unknown_role() {
    let reason = config_error(r#"{"kv_role": "kv_prefill"}"#);
    assert!(
        reason.contains("kv_prefill") && reason.contains("kv_producer"),
        "{reason}"
    );
}

#[test]
fn empty_backend_list() {
    let reason = config_error(r#"{"kv_connector_extra_config": {"backends": []}}"#);
    assert!(reason.contains("at least one backend"), "{reason}");
}

#[test]
fn refuse_same_host_transports_comes_from_the_extra_config() {
    let reason =
        config_error(r#"{"kv_connector_extra_config": {"refuse_same_host_transports": "yes"}}"#);
    assert!(
        reason.contains("refuse_same_host_transports must be true or false"),
        "{reason}"
    );
    let config = KvTransferConfig::from_json(
        r#"{"kv_buffer_device":"cpu","kv_connector_extra_config":{"refuse_same_host_transports":true}}"#,
    )
    .unwrap();
    assert_eq!(config.refuse_same_host_transports().unwrap(), Some(true));
    let strict = setup_on("kvcfg-strict", &config, &BuiltinPlatform::CPU).unwrap();
    assert!(strict.agent().config().refuse_same_host_transports);
    // Unset: the builder's setting, off by default.
    let default = setup_on(
        "kvcfg-default",
        &cpu_config(r#"["UCX"]"#),
        &BuiltinPlatform::CPU,
    )
    .unwrap();
    assert!(!default.agent().config().refuse_same_host_transports);
}

fn cpu_config(backends: &str) -> KvTransferConfig {
    KvTransferConfig::from_json(&format!(
        r#"{{"kv_role":"kv_both","kv_buffer_device":"cpu","kv_connector_extra_config":{{"backends":{backends}}}}}"#
    ))
    .unwrap()
}

/// `{"kv_buffer_device":"cuda"}`: VRAM on a CUDA platform, refused on others.
fn cuda_config() -> KvTransferConfig {
    KvTransferConfig::from_json(r#"{"kv_buffer_device":"cuda"}"#).unwrap()
}

/// [`NixlSetup::new`] of agent `name` on `platform`, resolved with the built-in table only.
fn setup_on(
    name: &str,
    config: &KvTransferConfig,
    platform: &dyn Platform,
) -> nixl::Result<NixlSetup> {
    NixlSetup::new(
        Agent::builder(name),
        config,
        platform,
        &PlatformRegistry::new(),
    )
}

fn plugins(backends: &[Backend]) -> Vec<String> {
    backends.iter().map(|b| b.plugin().to_string()).collect()
}

/// Moves all of `src` (a registration of `setup`'s agent) into `dst` (one of `remote`) with
/// a WRITE restricted to `backend`; returns the plugin NIXL used.
fn write_over(
    setup: &NixlSetup,
    src: &Registration,
    dst: &Registration,
    remote: &str,
    backend: &Backend,
) -> String {
    let mut local = LocalDescList::new(src.mem_type()).unwrap();
    local.push_region(src, 0).unwrap();
    let d = &dst.regions()[0];
    let remote_list =
        RemoteDescList::from_descs(dst.mem_type(), &[XferDesc::new(d.addr, d.len, d.dev_id)])
            .unwrap();
    let mut req = setup
        .agent()
        .create_xfer_req(
            XferOp::Write,
            &local,
            &remote_list,
            remote,
            &XferOptions::new().backend(backend),
        )
        .unwrap();
    req.post_and_wait(Duration::from_secs(60)).unwrap();
    req.backend().unwrap()
}

/// A second agent with `backends`, whose metadata `setup`'s agent has loaded, holding
/// `len` zeroed bytes of DRAM.
fn peer_of(setup: &NixlSetup, name: &str, backends: &str, len: usize) -> (NixlSetup, Registration) {
    let peer = setup_on(name, &cpu_config(backends), &BuiltinPlatform::CPU).unwrap();
    let reg = peer.register_memory(vec![0u8; len]).unwrap();
    setup
        .agent()
        .load_remote_metadata(&peer.agent().local_metadata().unwrap())
        .unwrap();
    (peer, reg)
}

#[test]
fn ucx_only_creates_and_registers_with_ucx() {
    let setup = setup_on(
        "kvcfg-ucx",
        &cpu_config(r#"["UCX"]"#),
        &BuiltinPlatform::CPU,
    )
    .unwrap();
    assert_eq!(setup.mem_type(), MemType::Dram);
    assert_eq!(plugins(setup.backends()), ["UCX"]);
    assert_eq!(plugins(&setup.agent().backends()), ["UCX"]);
    let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    let reg = setup.register_memory(data.clone()).unwrap();
    assert_eq!(plugins(reg.backends()), ["UCX"]);
    // The registration really is usable over UCX: a WRITE to a peer moves every byte.
    let (peer, dst) = peer_of(&setup, "kvcfg-ucx-peer", r#"["UCX"]"#, data.len());
    let used = write_over(
        &setup,
        &reg,
        &dst,
        peer.agent().name(),
        &setup.backends()[0],
    );
    assert_eq!(used, "UCX");
    let mut moved = vec![0u8; data.len()];
    dst.read(0, 0, &mut moved).unwrap();
    assert_eq!(moved, data);
}

#[test]
fn ucx_and_posix_create_both_and_register_with_both() {
    let setup = setup_on(
        "kvcfg-ucx-posix",
        &cpu_config(r#"["UCX", "POSIX"]"#),
        &BuiltinPlatform::CPU,
    )
    .unwrap();
    assert_eq!(plugins(setup.backends()), ["UCX", "POSIX"]);
    let (ucx, posix) = (&setup.backends()[0], &setup.backends()[1]);
    let data: Vec<u8> = (0..8192u32).map(|i| (i % 241) as u8).collect();
    let reg = setup.register_memory(data.clone()).unwrap();
    assert_eq!(plugins(reg.backends()), ["UCX", "POSIX"]);

    // Over POSIX: the DRAM registration WRITEs into a file this agent registered.
    let file = tempfile::tempfile().unwrap();
    file.set_len(data.len() as u64).unwrap();
    let file_reg = setup
        .agent()
        .register_memory(
            FileRegion::new(file.try_clone().unwrap(), 0, data.len()).unwrap(),
            &[posix],
        )
        .unwrap();
    let used = write_over(&setup, &reg, &file_reg, setup.agent().name(), posix);
    assert_eq!(used, "POSIX");
    let mut on_disk = vec![0u8; data.len()];
    file.read_exact_at(&mut on_disk, 0).unwrap();
    assert_eq!(on_disk, data);

    // Over UCX: the same registration WRITEs to a peer.
    let (peer, dst) = peer_of(&setup, "kvcfg-ucx-posix-peer", r#"["UCX"]"#, data.len());
    assert_eq!(
        write_over(&setup, &reg, &dst, peer.agent().name(), ucx),
        "UCX"
    );
    let mut moved = vec![0u8; data.len()];
    dst.read(0, 0, &mut moved).unwrap();
    assert_eq!(moved, data);
    drop(file_reg);
}

#[test]
fn unknown_backend_lists_available_plugins() {
    let err = setup_on(
        "kvcfg-nope",
        &cpu_config(r#"["NOPE"]"#),
        &BuiltinPlatform::CPU,
    )
    .unwrap_err();
    match &err {
        Error::UnknownPlugin { name, available } => {
            assert_eq!(name, "NOPE");
            assert!(
                available.iter().any(|p| p == "UCX") && available.iter().any(|p| p == "POSIX"),
                "{available:?}"
            );
        }
        other => panic!("expected UnknownPlugin, got {other:?}"),
    }
    assert!(err.to_string().contains("UCX"), "{err}");
}

#[test]
fn platform_rejects_kv_buffer_device_before_creating_an_agent() {
    let err = setup_on("kvcfg-cpu-cuda", &cuda_config(), &BuiltinPlatform::CPU).unwrap_err();
    assert!(
        matches!(err, Error::UnsupportedKvBufferDevice { .. }),
        "{err:?}"
    );
}

#[test]
fn dram_memory_is_refused_for_a_vram_setup() {
    let setup = setup_on("kvcfg-vram-dram", &cuda_config(), &BuiltinPlatform::CUDA).unwrap();
    assert!(matches!(
        setup.register_memory(vec![0u8; 64]),
        Err(Error::MemTypeMismatch {
            expected: MemType::Vram,
            found: MemType::Dram,
            ..
        })
    ));
}

#[test]
fn cuda_kv_buffer_resolves_to_vram_then_fails_cleanly_without_a_gpu() {
    if std::path::Path::new("/dev/nvidia0").exists() {
        common::skip(
            "cuda_kv_buffer_resolves_to_vram_then_fails_cleanly_without_a_gpu",
            "this machine has a GPU, so VRAM registration would not fail",
        );
        return;
    }
    let setup = setup_on("kvcfg-cuda", &cuda_config(), &BuiltinPlatform::CUDA).unwrap();
    assert_eq!(setup.mem_type(), MemType::Vram);
    let desc = RegDesc {
        addr: 0x7000_0000_0000,
        len: 1 << 20,
        dev_id: 0,
        metadata: Vec::new(),
    };
    // SAFETY: the registration is refused before NIXL sees the (fake) device address.
    let err = unsafe { setup.register_raw(&[desc]) }.unwrap_err();
    assert!(matches!(err, Error::NoCudaDevice { .. }), "{err:?}");
    assert!(
        err.to_string().contains("no CUDA device is present"),
        "{err}"
    );
    // The agent still works: DRAM registers with the configured UCX backend.
    let ucx = &setup.backends()[0];
    setup
        .agent()
        .register_memory(vec![0u8; 4096], &[ucx])
        .unwrap();
}
