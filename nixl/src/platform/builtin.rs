//! The platforms vLLM knows: cuda, tpu, xpu and cpu.

use super::Platform;

/// A built-in platform: its table row comes from the registry's built-in table, and it has
/// no memory-type override.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuiltinPlatform {
    device_type: &'static str,
}

impl BuiltinPlatform {
    /// NVIDIA GPUs.
    pub const CUDA: BuiltinPlatform = BuiltinPlatform {
        device_type: "cuda",
    };
    /// Google TPUs.
    pub const TPU: BuiltinPlatform = BuiltinPlatform { device_type: "tpu" };
    /// Intel GPUs.
    pub const XPU: BuiltinPlatform = BuiltinPlatform { device_type: "xpu" };
    /// CPU only.
    pub const CPU: BuiltinPlatform = BuiltinPlatform { device_type: "cpu" };

    /// Every built-in platform.
    pub const ALL: [BuiltinPlatform; 4] = [Self::CUDA, Self::TPU, Self::XPU, Self::CPU];

    /// The built-in device table: device type → supported kv-buffer devices.
    pub const TABLE: [(&'static str, &'static [&'static str]); 4] = [
        ("cuda", &["cuda", "cpu"]),
        ("tpu", &["cpu"]),
        ("xpu", &["cpu", "xpu"]),
        ("cpu", &["cpu"]),
    ];
}

impl Platform for BuiltinPlatform {
    fn device_type(&self) -> &str {
        self.device_type
    }
}
