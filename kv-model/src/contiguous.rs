//! A plain KV cache: every position's K and V in one growing vector per layer.

use std::ops::Range;

use crate::kv_cache::KvCache;

/// One process's reference KV cache: K and V of `heads`, per layer in position order.
#[derive(Debug, Clone)]
pub struct ContiguousKv {
    heads: Range<usize>,
    head_dim: usize,
    /// Per layer: position, head, K then V, element.
    layers: Vec<Vec<f32>>,
}

impl ContiguousKv {
    /// An empty cache of `layers` layers holding KV heads `heads` of `head_dim` elements (a
    /// latent is stored as a head's K, with an empty V).
    pub fn new(layers: usize, heads: Range<usize>, head_dim: usize) -> Self {
        ContiguousKv {
            heads,
            head_dim,
            layers: vec![Vec::new(); layers],
        }
    }

    /// Where head `head`'s K of `position` starts in a layer's vector.
    fn at(&self, head: usize, position: usize) -> usize {
        (position * self.heads.len() + head - self.heads.start) * 2 * self.head_dim
    }
}

impl KvCache for ContiguousKv {
    fn heads(&self) -> Range<usize> {
        self.heads.clone()
    }

    fn store(&mut self, layer: usize, head: usize, position: usize, key: &[f32], value: &[f32]) {
        let at = self.at(head, position);
        let dim = self.head_dim;
        let needed = (position + 1) * self.heads.len() * 2 * dim;
        let data = &mut self.layers[layer];
        if data.len() < needed {
            data.resize(needed, 0.0);
        }
        data[at..at + dim].copy_from_slice(key);
        data[at + dim..at + dim + value.len()].copy_from_slice(value);
    }

    fn load(&self, layer: usize, head: usize, position: usize, key: &mut [f32], value: &mut [f32]) {
        let at = self.at(head, position);
        let dim = self.head_dim;
        let data = &self.layers[layer];
        key.copy_from_slice(&data[at..at + dim]);
        value.copy_from_slice(&data[at + dim..at + dim + value.len()]);
    }
}
