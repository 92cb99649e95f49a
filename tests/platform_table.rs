//! The (device type, kv_buffer_device, override) → memory type table, built-in and
//! out-of-tree platforms (defined here, in another crate than `nixl`).

use std::collections::BTreeMap;
use std::sync::Arc;

use nixl::platform::{BuiltinPlatform, Platform, PlatformRegistry};
use nixl::{Error, MemType};

/// An HPU-like platform: DRAM to NIXL unless device-to-device mode is on.
#[derive(Debug)]
struct Hpu {
    device_to_device: bool,
}

impl Platform for Hpu {
    fn device_type(&self) -> &str {
        "hpu"
    }
    fn nixl_supported_devices(&self) -> BTreeMap<String, Vec<String>> {
        BTreeMap::from([("hpu".into(), vec!["cpu".into(), "hpu".into()])])
    }
    fn nixl_memory_type(&self) -> Option<MemType> {
        Some(if self.device_to_device {
            MemType::Vram
        } else {
            MemType::Dram
        })
    }
}

/// An RBLN-like platform that adds two rows, one of them replacing the built-in `cpu` row.
#[derive(Debug)]
struct Rbln;

impl Platform for Rbln {
    fn device_type(&self) -> &str {
        "rbln"
    }
    fn nixl_supported_devices(&self) -> BTreeMap<String, Vec<String>> {
        BTreeMap::from([
            ("cpu".into(), vec!["cpu".into(), "rbln".into()]),
            ("rbln".into(), vec!["rbln".into(), "cpu".into()]),
        ])
    }
}

/// vLLM's fake out-of-tree platform: device `oot`, override VRAM.
#[derive(Debug)]
struct Oot;

impl Platform for Oot {
    fn device_type(&self) -> &str {
        "oot"
    }
    fn nixl_supported_devices(&self) -> BTreeMap<String, Vec<String>> {
        BTreeMap::from([("oot".into(), vec!["oot".into()])])
    }
    fn nixl_memory_type(&self) -> Option<MemType> {
        Some(MemType::Vram)
    }
}

/// Expected outcome of one resolution.
#[derive(Debug)]
enum Expect {
    Mem(MemType),
    Unsupported,
    NoMemoryType,
}

fn assert_row(registry: &PlatformRegistry, platform: &dyn Platform, kv: &str, expect: Expect) {
    let got = registry.nixl_memory_type(platform, kv);
    let ok = match (&expect, &got) {
        (Expect::Mem(want), Ok(mem)) => want == mem,
        (
            Expect::Unsupported,
            Err(Error::UnsupportedKvBufferDevice {
                device_type,
                kv_buffer_device,
                ..
            }),
        ) => device_type == platform.device_type() && kv_buffer_device == kv,
        (Expect::NoMemoryType, Err(Error::NoMemoryType { kv_buffer_device })) => {
            kv_buffer_device == kv
        }
        _ => false,
    };
    assert!(
        ok,
        "{} with {kv}: expected {expect:?}, got {got:?}",
        platform.device_type()
    );
}

#[test]
fn builtin_table() {
    use Expect::*;
    let r = PlatformRegistry::new();
    let (cuda, tpu, xpu, cpu) = (
        BuiltinPlatform::CUDA,
        BuiltinPlatform::TPU,
        BuiltinPlatform::XPU,
        BuiltinPlatform::CPU,
    );
    assert_row(&r, &cuda, "cuda", Mem(MemType::Vram));
    assert_row(&r, &cuda, "cpu", Mem(MemType::Dram));
    assert_row(&r, &cuda, "xpu", Unsupported);
    assert_row(&r, &tpu, "cpu", Mem(MemType::Dram));
    assert_row(&r, &tpu, "cuda", Unsupported);
    assert_row(&r, &tpu, "tpu", Unsupported);
    assert_row(&r, &xpu, "cpu", Mem(MemType::Dram));
    // xpu is listed but neither the default rule nor an override gives it a memory type.
    assert_row(&r, &xpu, "xpu", NoMemoryType);
    assert_row(&r, &xpu, "cuda", Unsupported);
    assert_row(&r, &cpu, "cpu", Mem(MemType::Dram));
    assert_row(&r, &cpu, "cuda", Unsupported);
    assert_eq!(r.device_types(), ["cpu", "cuda", "tpu", "xpu"]);
}

#[test]
fn unsupported_message_lists_what_is_supported() {
    let r = PlatformRegistry::new();
    let err = r
        .nixl_memory_type(&BuiltinPlatform::CPU, "cuda")
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "cpu with cuda kv_buffer is not supported; supported kv_buffer devices: [cpu]"
    );
}

#[test]
fn unknown_device_type_is_an_error() {
    let r = PlatformRegistry::new();
    match r.platform("gaudi") {
        Err(Error::UnknownDeviceType { device_type, known }) => {
            assert_eq!(device_type, "gaudi");
            assert_eq!(known, ["cpu", "cuda", "tpu", "xpu"]);
        }
        other => panic!("expected UnknownDeviceType, got {other:?}"),
    }
    // A platform object whose device type has no table row fails the same way.
    #[derive(Debug)]
    struct Rowless;
    impl Platform for Rowless {
        fn device_type(&self) -> &str {
            "rowless"
        }
    }
    assert!(matches!(
        r.nixl_memory_type(&Rowless, "cpu"),
        Err(Error::UnknownDeviceType { .. })
    ));
}

#[test]
fn hpu_platform_dram_unless_device_to_device() {
    use Expect::*;
    let mut r = PlatformRegistry::new();
    r.register(Arc::new(Hpu {
        device_to_device: false,
    }));
    let hpu = r.platform("hpu").unwrap();
    assert_row(&r, hpu.as_ref(), "cpu", Mem(MemType::Dram));
    assert_row(&r, hpu.as_ref(), "hpu", Mem(MemType::Dram));
    assert_row(&r, hpu.as_ref(), "cuda", Unsupported);

    // Re-registering replaces the platform of that device type.
    let old = r.register(Arc::new(Hpu {
        device_to_device: true,
    }));
    assert!(old.is_some());
    let hpu = r.platform("hpu").unwrap();
    assert_row(&r, hpu.as_ref(), "hpu", Mem(MemType::Vram));
    assert_row(&r, hpu.as_ref(), "cpu", Mem(MemType::Vram));
}

#[test]
fn rbln_platform_extends_and_replaces_rows() {
    use Expect::*;
    let mut r = PlatformRegistry::new();
    r.register(Arc::new(Rbln));
    assert_eq!(r.supported_devices("cpu").unwrap(), ["cpu", "rbln"]);
    assert_eq!(r.supported_devices("rbln").unwrap(), ["rbln", "cpu"]);
    let rbln = r.platform("rbln").unwrap();
    assert_row(&r, rbln.as_ref(), "cpu", Mem(MemType::Dram));
    // Listed, but RBLN gives no override and `rbln` has no default memory type.
    assert_row(&r, rbln.as_ref(), "rbln", NoMemoryType);
    assert_row(&r, rbln.as_ref(), "cuda", Unsupported);
    // The replaced cpu row now allows rbln for the built-in cpu platform too (vLLM's dict.update).
    assert_row(&r, &BuiltinPlatform::CPU, "rbln", NoMemoryType);
    // Other rows are untouched.
    assert_eq!(r.supported_devices("cuda").unwrap(), ["cuda", "cpu"]);
}

#[test]
fn fake_platform_with_override() {
    use Expect::*;
    let mut r = PlatformRegistry::new();
    r.register(Arc::new(Oot));
    let oot = r.platform("oot").unwrap();
    assert_row(&r, oot.as_ref(), "oot", Mem(MemType::Vram));
    assert_row(&r, oot.as_ref(), "cpu", Unsupported);
}

#[test]
fn global_registry_takes_out_of_tree_platforms() {
    #[derive(Debug)]
    struct Neuron;
    impl Platform for Neuron {
        fn device_type(&self) -> &str {
            "neuron-test"
        }
        fn nixl_supported_devices(&self) -> BTreeMap<String, Vec<String>> {
            BTreeMap::from([("neuron-test".into(), vec!["cpu".into()])])
        }
    }
    nixl::platform::register_platform(Arc::new(Neuron));
    let platform = nixl::platform::global()
        .read()
        .unwrap()
        .platform("neuron-test")
        .unwrap();
    assert_eq!(
        nixl::platform::nixl_memory_type(platform.as_ref(), "cpu").unwrap(),
        MemType::Dram
    );
}
