//! Safe NIXL API.
