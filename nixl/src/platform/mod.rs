//! Platforms: which kv-buffer devices NIXL may use on a hardware platform, and whether NIXL
//! sees that memory as DRAM or VRAM.
//!
//! This follows vLLM's NIXL connector. A table maps each platform device type to the
//! kv-buffer devices it supports:
//!
//! | device type | kv-buffer devices |
//! | --- | --- |
//! | `cuda` | `cuda`, `cpu` |
//! | `tpu` | `cpu` |
//! | `xpu` | `cpu`, `xpu` |
//! | `cpu` | `cpu` |
//!
//! Resolving `(platform, kv_buffer_device)` to a [`MemType`]:
//! 1. the platform's device type must be in the table, else [`Error::UnknownDeviceType`](crate::Error::UnknownDeviceType);
//! 2. `kv_buffer_device` must be listed for it, else [`Error::UnsupportedKvBufferDevice`](crate::Error::UnsupportedKvBufferDevice)
//!    ("`<device>` with `<kv_buffer_device>` kv_buffer is not supported");
//! 3. the memory type is the platform's [`Platform::nixl_memory_type`] override when it gives
//!    one, else `cuda` → VRAM and `cpu` → DRAM, else [`Error::NoMemoryType`](crate::Error::NoMemoryType).
//!
//! # Choosing the current platform
//! [`current_platform`] returns, from the [global registry](global):
//! - the platform named by the environment variable `NIXL_RS_PLATFORM` (e.g. `cuda`,
//!   `cpu`, or an out-of-tree device type), when it is set;
//! - otherwise `cuda` when the CUDA driver reports a device, and `cpu` on a machine without
//!   accelerators.
//!
//! Or pick one explicitly with [`PlatformRegistry::platform`].
//!
//! # Adding an out-of-tree platform
//! A platform defined in another crate implements [`Platform`] and registers itself at run
//! time with [`register_platform`]. Its [`Platform::nixl_supported_devices`] entries extend
//! or replace rows of the table, exactly like vLLM's
//! `_NIXL_SUPPORTED_DEVICE.update(current_platform.get_nixl_supported_devices())`.
//!
//! A complete example: an HPU-like platform whose KV cache lives in DRAM as far as NIXL is
//! concerned, unless device-to-device transfers are on.
//! ```
//! use std::collections::BTreeMap;
//! use std::sync::Arc;
//! use nixl::platform::{self, Platform};
//! use nixl::MemType;
//!
//! #[derive(Debug)]
//! struct Hpu {
//!     device_to_device: bool,
//! }
//!
//! impl Platform for Hpu {
//!     fn device_type(&self) -> &str {
//!         "hpu"
//!     }
//!     fn nixl_supported_devices(&self) -> BTreeMap<String, Vec<String>> {
//!         BTreeMap::from([("hpu".to_string(), vec!["cpu".to_string(), "hpu".to_string()])])
//!     }
//!     fn nixl_memory_type(&self) -> Option<MemType> {
//!         Some(if self.device_to_device { MemType::Vram } else { MemType::Dram })
//!     }
//! }
//!
//! # fn main() -> nixl::Result<()> {
//! // Once, at start-up (e.g. from the plugin crate's init function):
//! platform::register_platform(Arc::new(Hpu { device_to_device: false }));
//!
//! let registry = platform::global().read().unwrap();
//! let hpu = registry.platform("hpu")?;
//! assert_eq!(registry.nixl_memory_type(hpu.as_ref(), "hpu")?, MemType::Dram);
//! assert!(registry.nixl_memory_type(hpu.as_ref(), "cuda").is_err());
//! # Ok(())
//! # }
//! ```
//! With the platform registered, set `NIXL_RS_PLATFORM=hpu` (or pass it explicitly) and use
//! it with [`crate::kv_config::NixlSetup`] as with the built-in ones.

mod builtin;
mod registry;

use std::collections::BTreeMap;

use crate::error::Result;
use crate::ffi::mem_type::MemType;

pub use builtin::BuiltinPlatform;
pub use registry::{current_platform, global, register_platform, PlatformRegistry, PLATFORM_ENV};

/// A hardware platform as NIXL's KV-cache transfer sees it.
pub trait Platform: Send + Sync + std::fmt::Debug {
    /// The platform's device type (`cuda`, `cpu`, `hpu`, ...).
    fn device_type(&self) -> &str;

    /// Rows this platform adds to (or replaces in) the device table: device type →
    /// supported kv-buffer devices. Built-in platforms add none.
    fn nixl_supported_devices(&self) -> BTreeMap<String, Vec<String>> {
        BTreeMap::new()
    }

    /// The memory type NIXL should use for this platform's KV cache, overriding the
    /// `cuda` → VRAM / `cpu` → DRAM default. `None` keeps the default.
    fn nixl_memory_type(&self) -> Option<MemType> {
        None
    }
}

/// The memory type for a kv-buffer device when the platform gives no override.
pub fn default_memory_type(kv_buffer_device: &str) -> Option<MemType> {
    match kv_buffer_device {
        "cuda" => Some(MemType::Vram),
        "cpu" => Some(MemType::Dram),
        _ => None,
    }
}

/// Resolves with the global registry; see [`PlatformRegistry::nixl_memory_type`].
pub fn nixl_memory_type(platform: &dyn Platform, kv_buffer_device: &str) -> Result<MemType> {
    global()
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .nixl_memory_type(platform, kv_buffer_device)
}
