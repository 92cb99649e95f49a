//! The UCX backend's connection info: a packed UCP worker address (UCX 1.23, as bundled in
//! the NIXL 1.5.1 wheel; UCX's default non-unified mode).
//!
//! ```text
//! header     u8: low 4 bits version (0 = v1, 1 = v2); v1: high 4 bits flags;
//!            v2: high 4 bits release version, then a u8 of flags
//! uuid       u64, always in v1, in v2 when flag 0x2
//! client id  u64 when flag 0x4
//! name       u8 length + bytes when flag 0x1 (debug info)
//! devices    one byte 0xff for none, else per device:
//!   md       u8: 0x80 device without transports, low 7 bits md index (v2: 0x7f -> next u8)
//!   dev len  u8: 0x80 last device, 0x40 path count follows, 0x20 system device follows,
//!            low 5 bits address length (v2: 0x1f -> next u8)
//!   [paths u8] [sys dev u8] device address
//!   per transport (until one has the last flag):
//!     u16 transport name checksum, attributes (v1: 16 bytes, v2: 8 bytes),
//!     len u8: 0x80 last, 0x40 endpoint addresses follow, low 6 bits length
//!     (v2: 0x3f -> next u8), interface address
//! ```
//! A worker address never carries endpoint addresses, and v1 ends with an empty last
//! device whose md field holds the release version. In UCX's unified mode
//! (`UCX_UNIFIED_MODE=y` in this process) interface entries have no lengths on the wire, so
//! neither their bounds nor where they lead can be checked: every worker address is refused.

use std::sync::OnceLock;

use super::reader::{Parsed, Reader};

/// UCX's cap on transport addresses in one worker address.
const MAX_TRANSPORTS: usize = 128;
/// UCX's cap on memory domains (md index must be below it).
const MAX_MDS: u8 = 64;
/// Header flags UCX defines: debug info, worker uuid, client id, AM only.
const KNOWN_FLAGS: u8 = 0x0f;
const FLAG_DEBUG_INFO: u8 = 0x1;
const FLAG_UUID: u8 = 0x2;
const FLAG_CLIENT_ID: u8 = 0x4;
const NO_DEVICES: u8 = 0xff;

/// Address format version.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Version {
    V1,
    V2,
}

/// A checked worker address: what identifies the worker and how to reach it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct WorkerAddress<'a> {
    /// The worker's UUID (always in v1, optional in v2).
    pub uuid: Option<u64>,
    /// Its transport addresses, in order.
    pub transports: Vec<TransportAddress<'a>>,
}

/// One transport address in a worker address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TransportAddress<'a> {
    /// Checksum of the transport's name (UCX's CRC-16 of e.g. "tcp").
    pub checksum: u16,
    /// The device address it shares with the other transports of its device.
    pub device: &'a [u8],
    /// Offset of the device address within the whole metadata.
    pub device_at: usize,
    /// The interface address.
    pub iface: &'a [u8],
    /// Offset of the interface address within the whole metadata.
    pub iface_at: usize,
}

/// Checks the worker address `bytes`, which start at `base` of the whole metadata, and
/// returns what it holds.
pub(crate) fn parse(bytes: &[u8], base: usize) -> Parsed<WorkerAddress<'_>> {
    let mut r = Reader::new(bytes, base);
    if unified_mode() {
        return Err(r.reject_at(base, UNIFIED_MODE_REFUSED));
    }
    let header = r.u8("UCX address header")?;
    let (version, flags) = match header & 0x0f {
        0 => (Version::V1, header >> 4),
        1 => (Version::V2, r.u8("UCX address flags")?),
        other => {
            return Err(r.reject_at(
                base,
                format!("UCX address version {other} is neither 0 (v1) nor 1 (v2)"),
            ))
        }
    };
    if flags & !KNOWN_FLAGS != 0 {
        return Err(r.reject_at(base, format!("unknown UCX address flags {flags:#x}")));
    }
    let mut address = WorkerAddress::default();
    if version == Version::V1 || flags & FLAG_UUID != 0 {
        address.uuid = Some(r.u64("UCX worker uuid")?);
    }
    if flags & FLAG_CLIENT_ID != 0 {
        r.take(8, "UCX client id")?;
    }
    if flags & FLAG_DEBUG_INFO != 0 {
        let len = r.u8("UCX worker name length")?;
        r.take(usize::from(len), "UCX worker name")?;
    }
    if r.peek("UCX device list")? == NO_DEVICES {
        r.u8("UCX empty device list")?;
        r.finish("the UCX worker address")?;
        return Ok(address);
    }
    while !device(&mut r, version, &mut address.transports)? {}
    r.finish("the UCX worker address")?;
    Ok(address)
}

/// Why a worker address is refused in UCX's unified mode, and what to do instead.
const UNIFIED_MODE_REFUSED: &str = "this process runs UCX in unified mode \
(UCX_UNIFIED_MODE is on), where a UCX worker address carries no lengths, so neither its \
bounds nor the process it leads to can be checked before UCX reads it; UCX connection info is \
refused in that mode: unset UCX_UNIFIED_MODE";

/// Whether this process runs UCX in unified mode (`UCX_UNIFIED_MODE`, read once), where
/// UCX unpacks interface entries differently.
fn unified_mode() -> bool {
    static UNIFIED: OnceLock<bool> = OnceLock::new();
    *UNIFIED.get_or_init(|| {
        std::env::var("UCX_UNIFIED_MODE").is_ok_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "y" | "yes" | "on" | "1" | "true"
            )
        })
    })
}

/// A value of `mask` bits in `byte`; in v2 the all-ones value means "in the next byte".
fn extended(r: &mut Reader<'_>, byte: u8, mask: u8, version: Version, what: &str) -> Parsed<u8> {
    let value = byte & mask;
    if version == Version::V2 && value == mask {
        r.u8(what)
    } else {
        Ok(value)
    }
}

/// One device and its transports, added to `transports`; returns whether it was the last
/// device.
fn device<'a>(
    r: &mut Reader<'a>,
    version: Version,
    transports: &mut Vec<TransportAddress<'a>>,
) -> Parsed<bool> {
    let md_at = r.offset();
    let md = r.u8("UCX md index")?;
    let empty = md & 0x80 != 0;
    let md_index = extended(r, md, 0x7f, version, "UCX extended md index")?;
    let dev = r.u8("UCX device address length")?;
    let last = dev & 0x80 != 0;
    let dev_len = extended(r, dev, 0x1f, version, "UCX extended device address length")?;
    if dev & 0x40 != 0 {
        r.u8("UCX device path count")?;
    }
    if dev & 0x20 != 0 {
        r.u8("UCX system device")?;
    }
    let device_at = r.offset();
    let device = r.take(usize::from(dev_len), "UCX device address")?;
    // An empty last device carries the release version in its md field.
    if !(empty && last) && md_index >= MAX_MDS {
        return Err(r.reject_at(
            md_at,
            format!("UCX md index {md_index} is not below {MAX_MDS}"),
        ));
    }
    if empty {
        return Ok(last);
    }
    loop {
        if transports.len() == MAX_TRANSPORTS {
            return Err(r.reject(format!(
                "more than {MAX_TRANSPORTS} UCX transport addresses"
            )));
        }
        let checksum = r.u16("UCX transport name checksum")?;
        r.take(
            if version == Version::V1 { 16 } else { 8 },
            "UCX interface attributes",
        )?;
        let len_at = r.offset();
        let len = r.u8("UCX interface address length")?;
        if len & 0x40 != 0 {
            return Err(r.reject_at(len_at, "a UCX worker address with endpoint addresses"));
        }
        let iface_len = extended(
            r,
            len,
            0x3f,
            version,
            "UCX extended interface address length",
        )?;
        let iface_at = r.offset();
        let iface = r.take(usize::from(iface_len), "UCX interface address")?;
        transports.push(TransportAddress {
            checksum,
            device,
            device_at,
            iface,
            iface_at,
        });
        if len & 0x80 != 0 {
            return Ok(last);
        }
    }
}
