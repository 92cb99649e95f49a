//! The UCX backend's descriptor blob: a packed UCP remote key (UCX 1.23).
//!
//! ```text
//! md map     u64, one bit per remote memory domain
//! mem type   u8, below 10 (UCS memory types)
//! per set bit of the md map: u8 length + that many bytes of transport key
//! when the md map is not 0: u8 system device; unless it is 0xff (unknown), 3-byte
//!   distance entries follow, ended by a 0xff byte
//! ```
//! NIXL hands UCX the key without its length, so every part must lie inside the blob.

use super::reader::{Parsed, Reader};

/// UCS memory types (host .. gaudi); the value 10 is "unknown".
const MEM_TYPES: u8 = 10;
const UNKNOWN_SYS_DEV: u8 = 0xff;
/// Bytes of one distance entry: system device, latency, bandwidth.
const DISTANCE_LEN: usize = 3;

/// Checks the remote key `bytes`, which start at `base` of the whole metadata.
pub(crate) fn check(bytes: &[u8], base: usize) -> Parsed<()> {
    let mut r = Reader::new(bytes, base);
    let md_map = r.u64("UCX rkey md map")?;
    let type_at = r.offset();
    let mem_type = r.u8("UCX rkey memory type")?;
    if mem_type >= MEM_TYPES {
        return Err(r.reject_at(
            type_at,
            format!("UCX rkey memory type {mem_type} is not below {MEM_TYPES}"),
        ));
    }
    if md_map == 0 {
        return r.finish("the UCX rkey");
    }
    for _ in 0..md_map.count_ones() {
        let len = r.u8("UCX transport rkey length")?;
        r.take(usize::from(len), "UCX transport rkey")?;
    }
    if r.u8("UCX rkey system device")? != UNKNOWN_SYS_DEV {
        while r.u8("UCX rkey distance list (no 0xff end)")? != UNKNOWN_SYS_DEV {
            r.take(DISTANCE_LEN - 1, "UCX rkey distance")?;
        }
    }
    r.finish("the UCX rkey")
}
