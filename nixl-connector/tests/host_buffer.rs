//! Host-buffer mode: refused with a clear message where it cannot work (no GPU here, or
//! the wrong kv-buffer device).

mod common;

use std::sync::Arc;

use nixl::platform::BuiltinPlatform;
use nixl::RegDesc;
use nixl_connector::{Error, KvConnectorWorker, WorkerConfig};

fn worker(device: &str) -> KvConnectorWorker {
    let mut kv = common::cpu_config();
    kv.kv_buffer_device = device.to_string();
    let mut config = WorkerConfig::new("hb", 0, 1, kv);
    config.platform = Arc::new(BuiltinPlatform::CUDA);
    KvConnectorWorker::new(config).unwrap()
}

fn fake_vram(len: usize) -> Vec<RegDesc> {
    (0..3)
        .map(|layer| RegDesc {
            addr: 0x7000_0000_0000 + layer * len,
            len,
            dev_id: 0,
            metadata: Vec::new(),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_gpu_host_buffer_mode_says_so() {
    if nixl::platform::current_platform().is_ok_and(|p| p.device_type() == "cuda") {
        common::skip(
            "host_buffer::without_a_gpu_host_buffer_mode_says_so",
            "a CUDA device is present; this test covers machines without one",
        );
        return;
    }
    let spec = common::spec(2);
    let worker = worker("cpu");
    // SAFETY: the registration fails before NIXL sees the (fake) device addresses.
    let err =
        unsafe { worker.register_kv_caches_host_buffer(&fake_vram(spec.region_len(0)), spec) }
            .unwrap_err();
    assert!(matches!(err, Error::HostBufferNeedsGpu { .. }), "{err}");
    assert!(err.to_string().contains("needs a CUDA device"), "{err}");
    assert!(
        matches!(worker.kv_caches(), Err(Error::NotRegistered { .. })),
        "nothing registered"
    );
    let staged = worker.stage_to_host(&[0]).await.unwrap_err();
    assert!(matches!(staged, Error::NotRegistered { .. }), "{staged}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_buffer_mode_needs_the_cpu_kv_buffer_device() {
    let spec = common::spec(2);
    // kv_buffer_device "cuda" is not host-buffer mode (and needs a GPU to create here).
    let mut kv = common::cpu_config();
    kv.kv_buffer_device = "cuda".to_string();
    let mut config = WorkerConfig::new("hb-cpu", 0, 1, kv);
    config.platform = Arc::new(BuiltinPlatform::CPU);
    let err = KvConnectorWorker::new(config).unwrap_err().to_string();
    assert!(err.contains("cuda"), "{err}");
    let cpu_platform = {
        let mut config = WorkerConfig::new("hb-cpu2", 0, 1, common::cpu_config());
        config.platform = Arc::new(BuiltinPlatform::CPU);
        KvConnectorWorker::new(config).unwrap()
    };
    // SAFETY: refused before any registration.
    let err = unsafe {
        cpu_platform.register_kv_caches_host_buffer(&fake_vram(spec.region_len(0)), spec)
    }
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("needs kv_buffer_device \"cpu\" on the cuda platform"),
        "{err}"
    );
}
