//! Choosing the current platform from the environment (own process: it sets a variable).

use nixl::platform::{PlatformRegistry, PLATFORM_ENV};
use nixl::Error;

#[test]
fn current_platform_from_env_then_default() {
    let registry = PlatformRegistry::new();

    std::env::set_var(PLATFORM_ENV, "tpu");
    assert_eq!(registry.current().unwrap().device_type(), "tpu");

    std::env::set_var(PLATFORM_ENV, "quantum");
    assert!(matches!(
        registry.current(),
        Err(Error::UnknownDeviceType { .. })
    ));

    std::env::remove_var(PLATFORM_ENV);
    let detected = registry.current().unwrap();
    let has_gpu = std::path::Path::new("/dev/nvidia0").exists();
    assert_eq!(detected.device_type(), if has_gpu { "cuda" } else { "cpu" });
}
