//! How a remote engine is split over its ranks: its TP size, pipeline stages and DCP size,
//! as a decode names a prefill it handshakes with before any load
//! ([`KvConnectorWorker::handshake_with_layout`](crate::KvConnectorWorker::handshake_with_layout)).

/// A remote engine's parallel layout: TP size, pipeline stages, DCP size (the sizes its
/// params carry as `tp_size`, `pp_size` and `dcp_size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineLayout {
    /// Its TP size.
    pub tp_size: usize,
    /// Its pipeline stages.
    pub pp_size: usize,
    /// Its decode-context-parallel size.
    pub dcp_size: usize,
}

impl EngineLayout {
    /// An engine of TP `tp_size`, one pipeline stage, no DCP.
    pub const fn tp(tp_size: usize) -> Self {
        EngineLayout {
            tp_size,
            pp_size: 1,
            dcp_size: 1,
        }
    }

    /// This layout with `pp_size` pipeline stages.
    pub const fn with_pp(self, pp_size: usize) -> Self {
        EngineLayout { pp_size, ..self }
    }

    /// This layout with DCP size `dcp_size`.
    pub const fn with_dcp(self, dcp_size: usize) -> Self {
        EngineLayout { dcp_size, ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_is_built_from_its_tp_then_its_stages_and_dcp() {
        let layout = EngineLayout::tp(4).with_pp(2).with_dcp(2);
        assert_eq!(
            layout,
            EngineLayout {
                tp_size: 4,
                pp_size: 2,
                dcp_size: 2
            }
        );
        assert_eq!(EngineLayout::tp(2).pp_size, 1);
        assert_eq!(EngineLayout::tp(2).dcp_size, 1);
    }
}
