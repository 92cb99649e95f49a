//! The registry of platforms and of the device table they share.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock, RwLock};

use super::{default_memory_type, BuiltinPlatform, Platform};
use crate::error::{Error, Result};
use crate::ffi::mem_type::MemType;

/// Environment variable naming the current platform's device type.
pub const PLATFORM_ENV: &str = "NIXL_RS_PLATFORM";

/// Platforms by device type, and the device table (device type → kv-buffer devices).
#[derive(Debug, Clone)]
pub struct PlatformRegistry {
    platforms: BTreeMap<String, Arc<dyn Platform>>,
    devices: BTreeMap<String, Vec<String>>,
}

impl Default for PlatformRegistry {
    fn default() -> Self {
        Self::new()
    }
}

impl PlatformRegistry {
    /// A registry holding the built-in platforms and table.
    pub fn new() -> Self {
        let mut registry = PlatformRegistry {
            platforms: BTreeMap::new(),
            devices: BTreeMap::new(),
        };
        for (device_type, kv_devices) in BuiltinPlatform::TABLE {
            registry.devices.insert(
                device_type.to_string(),
                kv_devices.iter().map(|d| d.to_string()).collect(),
            );
        }
        for platform in BuiltinPlatform::ALL {
            registry
                .platforms
                .insert(platform.device_type().to_string(), Arc::new(platform));
        }
        registry
    }

    /// Adds `platform`, replacing any platform of the same device type (returned), and
    /// merges its [`Platform::nixl_supported_devices`] rows into the table, each row
    /// replacing the row of the same device type.
    pub fn register(&mut self, platform: Arc<dyn Platform>) -> Option<Arc<dyn Platform>> {
        self.devices.extend(platform.nixl_supported_devices());
        tracing::debug!(device_type = platform.device_type(), "registered platform");
        self.platforms
            .insert(platform.device_type().to_string(), platform)
    }

    /// The platform of `device_type`.
    ///
    /// # Errors
    /// [`Error::UnknownDeviceType`] listing the registered device types.
    pub fn platform(&self, device_type: &str) -> Result<Arc<dyn Platform>> {
        self.platforms
            .get(device_type)
            .cloned()
            .ok_or_else(|| Error::UnknownDeviceType {
                device_type: device_type.to_string(),
                known: self.platforms.keys().cloned().collect(),
            })
    }

    /// Registered device types.
    pub fn device_types(&self) -> Vec<String> {
        self.platforms.keys().cloned().collect()
    }

    /// The kv-buffer devices NIXL may use on `device_type` (its table row).
    pub fn supported_devices(&self, device_type: &str) -> Option<&[String]> {
        self.devices.get(device_type).map(Vec::as_slice)
    }

    /// The whole device table.
    pub fn device_table(&self) -> &BTreeMap<String, Vec<String>> {
        &self.devices
    }

    /// How NIXL sees a KV cache on `kv_buffer_device` under `platform` (rules in the
    /// [module docs](super)).
    pub fn nixl_memory_type(
        &self,
        platform: &dyn Platform,
        kv_buffer_device: &str,
    ) -> Result<MemType> {
        let device_type = platform.device_type();
        let supported = self
            .devices
            .get(device_type)
            .ok_or_else(|| Error::UnknownDeviceType {
                device_type: device_type.to_string(),
                known: self.devices.keys().cloned().collect(),
            })?;
        if !supported.iter().any(|d| d == kv_buffer_device) {
            return Err(Error::UnsupportedKvBufferDevice {
                device_type: device_type.to_string(),
                kv_buffer_device: kv_buffer_device.to_string(),
                supported: supported.clone(),
            });
        }
        platform
            .nixl_memory_type()
            .or_else(|| default_memory_type(kv_buffer_device))
            .ok_or_else(|| Error::NoMemoryType {
                kv_buffer_device: kv_buffer_device.to_string(),
            })
    }

    /// The current platform: `NIXL_RS_PLATFORM` if set, else `cuda` when a CUDA device is
    /// present, else `cpu`.
    pub fn current(&self) -> Result<Arc<dyn Platform>> {
        match std::env::var(PLATFORM_ENV) {
            Ok(device_type) if !device_type.is_empty() => self.platform(&device_type),
            _ if crate::memory::cuda::require_device("detect platform").is_ok() => {
                self.platform("cuda")
            }
            _ => self.platform("cpu"),
        }
    }
}

/// The process-wide registry, starting with the built-in platforms.
pub fn global() -> &'static RwLock<PlatformRegistry> {
    static GLOBAL: OnceLock<RwLock<PlatformRegistry>> = OnceLock::new();
    GLOBAL.get_or_init(|| RwLock::new(PlatformRegistry::new()))
}

/// Registers an out-of-tree platform in the [global] registry (see [`PlatformRegistry::register`]).
pub fn register_platform(platform: Arc<dyn Platform>) -> Option<Arc<dyn Platform>> {
    global()
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .register(platform)
}

/// The current platform from the [global] registry (see [`PlatformRegistry::current`]).
pub fn current_platform() -> Result<Arc<dyn Platform>> {
    global().read().unwrap_or_else(|p| p.into_inner()).current()
}
