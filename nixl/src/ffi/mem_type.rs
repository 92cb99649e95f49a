//! The kinds of memory NIXL moves.

use std::fmt;
use std::str::FromStr;

use nixl_capi_sys::nixl_capi_mem_type_t as raw;

/// A NIXL memory type: what the addresses in a descriptor list mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MemType {
    /// Host memory; addresses are virtual addresses in this process.
    Dram,
    /// Device (GPU) memory; `dev_id` is the device index.
    Vram,
    /// Block device; `dev_id` names the device, addresses are offsets.
    Block,
    /// Object store; `dev_id` names the object, metadata carries its key.
    Object,
    /// File; `dev_id` is the file descriptor, addresses are offsets.
    File,
}

impl MemType {
    /// Every memory type, in NIXL's order.
    pub const ALL: [MemType; 5] = [
        MemType::Dram,
        MemType::Vram,
        MemType::Block,
        MemType::Object,
        MemType::File,
    ];

    /// NIXL's spelling: `DRAM`, `VRAM`, `BLOCK`, `OBJECT` or `FILE`.
    pub fn as_str(self) -> &'static str {
        match self {
            MemType::Dram => "DRAM",
            MemType::Vram => "VRAM",
            MemType::Block => "BLOCK",
            MemType::Object => "OBJECT",
            MemType::File => "FILE",
        }
    }

    pub(crate) fn to_raw(self) -> raw::Type {
        match self {
            MemType::Dram => raw::NIXL_CAPI_MEM_DRAM,
            MemType::Vram => raw::NIXL_CAPI_MEM_VRAM,
            MemType::Block => raw::NIXL_CAPI_MEM_BLOCK,
            MemType::Object => raw::NIXL_CAPI_MEM_OBJECT,
            MemType::File => raw::NIXL_CAPI_MEM_FILE,
        }
    }

    pub(crate) fn from_raw(value: raw::Type) -> Option<Self> {
        MemType::ALL.into_iter().find(|t| t.to_raw() == value)
    }
}

impl fmt::Display for MemType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is not one of NIXL's memory types (see [`MemType::from_str`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a NIXL memory type (DRAM, VRAM, BLOCK, OBJECT, FILE)")]
pub struct ParseMemTypeError(pub String);

impl FromStr for MemType {
    type Err = ParseMemTypeError;

    /// Parses NIXL's spelling, ignoring case.
    fn from_str(s: &str) -> std::result::Result<Self, ParseMemTypeError> {
        MemType::ALL
            .into_iter()
            .find(|t| t.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| ParseMemTypeError(s.to_string()))
    }
}
