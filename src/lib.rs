//! Shared code for the workspace's integration tests and the prefill/decode examples.
//!
//! The libraries themselves are `nixl-sys` (raw bindings) and `nixl` (the safe API).
