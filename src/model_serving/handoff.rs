//! The file through which the demo's model-mode prefill hands its request to the decode.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// What the prefill hands the decode once its blocks hold the prompt's KV.
#[derive(Debug, Serialize, Deserialize)]
pub struct Handoff {
    /// The first token: the argmax of the prompt's last logits.
    pub first_token: usize,
    /// The request's `kv_transfer_params`, in the protocol's JSON.
    pub params: String,
    /// Seconds the prefill took to compute the prompt.
    pub prefill_compute_s: f64,
}

impl Handoff {
    /// Writes the handoff to `path` whole: to a file beside it, then renamed, so that a
    /// reader waiting for `path` never sees half of it.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let partial = path.with_extension("partial");
        std::fs::write(&partial, serde_json::to_vec(self)?)?;
        std::fs::rename(partial, path)
    }

    /// Reads the handoff [`write`](Self::write) wrote at `path`.
    pub fn read(path: &Path) -> std::io::Result<Self> {
        Ok(serde_json::from_slice(&std::fs::read(path)?)?)
    }
}
