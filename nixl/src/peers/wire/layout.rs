//! The fields of NIXL 1.5.1 agent metadata (full, partial or connection-only), in order:
//!
//! ```text
//! Agent      <name>                     non-empty
//! Conns      <u64 count>                then count x { t <backend>, c <connection info> }
//! ""         "MemSection"
//! nixlSecElms <u64 count>               then count x section:
//!   bknd      <backend>
//!   nixlDList "nixlSDList"
//!   t         <u32 memory type>         DRAM, VRAM, BLK, OBJ or FILE (0..=4)
//!   n         <u64 descriptors>         then n x "" <addr u64, len u64, dev u64, blob>
//! ```

use super::reader::Parsed;
use super::serdes::Fields;
use super::ucx_address;
use super::ucx_rkey;
use super::ucx_transports::{self, Worker};

/// The backend whose connection info and descriptor blobs are checked in depth.
const UCX: &[u8] = b"UCX";

/// Highest memory type NIXL 1.5.1 defines (FILE_SEG).
const MAX_MEM_TYPE: u32 = 4;

/// Bytes of a descriptor before its backend blob: address, length, device id.
const BASIC_DESC_LEN: usize = 24;

/// What a walk over metadata reports as it checks it, field by field. A walk that fails
/// may have reported fields before the failure.
pub(crate) trait Visitor<'a> {
    /// The agent's name (valid UTF-8 without NUL bytes).
    fn agent_name(&mut self, _name: &'a str) {}
    /// The UCX backend's connection info: the worker its address describes.
    fn ucx_worker(&mut self, _worker: Worker) {}
    /// One descriptor of a memory section of memory type `mem_type` (0..=4).
    fn descriptor(&mut self, _mem_type: u32, _basic: BasicDesc) {}
}

/// Plain validation: nothing is reported.
impl Visitor<'_> for () {}

/// The address, length and device id that start every descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BasicDesc {
    /// Start address (or offset).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Device id.
    pub dev_id: u64,
}

/// Checks a whole metadata blob.
pub(crate) fn check(bytes: &[u8]) -> Parsed<()> {
    walk(bytes, &mut ())
}

/// Checks a whole metadata blob, reporting its fields to `visitor`.
pub(crate) fn walk<'a>(bytes: &'a [u8], visitor: &mut impl Visitor<'a>) -> Parsed<()> {
    let mut fields = Fields::open(bytes)?;
    agent_name(&mut fields, visitor)?;
    connections(&mut fields, visitor)?;
    let marker = fields.field("")?;
    if marker.bytes != b"MemSection" {
        return Err(fields.reject_at(marker.offset, "expected the \"MemSection\" marker"));
    }
    let (sections, at) = fields.count("nixlSecElms")?;
    for _ in 0..sections {
        if fields.remaining() == 0 {
            return Err(fields.reject_at(
                at,
                format!("{sections} memory sections announced, fewer present"),
            ));
        }
        section(&mut fields, visitor)?;
    }
    fields.finish()
}

/// The agent's name, which comes back from NIXL as a C string and is then used as a Rust
/// `str`: one with a NUL byte would be cut short (and its metadata could not be invalidated
/// by name), one that is not UTF-8 could not be named at all, so both are refused.
fn agent_name<'a>(fields: &mut Fields<'a>, visitor: &mut impl Visitor<'a>) -> Parsed<()> {
    let name = fields.non_empty("Agent", "the agent name")?;
    if let Some(at) = name.bytes.iter().position(|&b| b == 0) {
        return Err(fields.reject_at(
            name.offset + at,
            "the agent name contains a NUL byte, which NIXL's C API would cut it at",
        ));
    }
    match std::str::from_utf8(name.bytes) {
        Ok(name) => {
            visitor.agent_name(name);
            Ok(())
        }
        Err(err) => Err(fields.reject_at(
            name.offset + err.valid_up_to(),
            "the agent name is not UTF-8, so it could not be named from Rust",
        )),
    }
}

/// The connection info of each backend.
fn connections<'a>(fields: &mut Fields<'a>, visitor: &mut impl Visitor<'a>) -> Parsed<()> {
    let (count, at) = fields.count("Conns")?;
    let mut seen: Vec<&[u8]> = Vec::new();
    for _ in 0..count {
        if fields.remaining() == 0 {
            return Err(fields.reject_at(
                at,
                format!("{count} connection entries announced, fewer present"),
            ));
        }
        let backend = fields.non_empty("t", "a backend name")?;
        if seen.contains(&backend.bytes) {
            return Err(fields.reject_at(backend.offset, "a backend's connection info twice"));
        }
        seen.push(backend.bytes);
        let info = fields.non_empty("c", "the connection info")?;
        if backend.bytes == UCX {
            let address = ucx_address::parse(info.bytes, info.offset)?;
            let destinations = address.transports.iter().map(ucx_transports::destination);
            visitor.ucx_worker(Worker {
                uuid: address.uuid,
                destinations: destinations.collect::<Parsed<_>>()?,
            });
        }
    }
    Ok(())
}

/// One memory section: a backend and its descriptor list.
fn section<'a>(fields: &mut Fields<'a>, visitor: &mut impl Visitor<'a>) -> Parsed<()> {
    let backend = fields.non_empty("bknd", "a section's backend name")?;
    let kind = fields.field("nixlDList")?;
    if kind.bytes != b"nixlSDList" {
        return Err(fields.reject_at(kind.offset, "expected a \"nixlSDList\" descriptor list"));
    }
    let (raw_type, type_at) = fields.fixed::<4>("t")?;
    let mem_type = u32::from_le_bytes(raw_type);
    if mem_type > MAX_MEM_TYPE {
        return Err(fields.reject_at(
            type_at,
            format!("memory type {mem_type} is not one of 0..={MAX_MEM_TYPE} (DRAM, VRAM, BLK, OBJ, FILE)"),
        ));
    }
    let (count, count_at) = fields.count("n")?;
    for _ in 0..count {
        if fields.remaining() == 0 {
            return Err(fields.reject_at(
                count_at,
                format!("{count} descriptors announced, fewer present"),
            ));
        }
        let desc = fields.field("")?;
        let blob = desc.bytes.get(BASIC_DESC_LEN..).ok_or_else(|| {
            fields.reject_at(
                desc.offset,
                format!(
                    "a descriptor of {} bytes, shorter than the {BASIC_DESC_LEN} of address, length and device",
                    desc.bytes.len()
                ),
            )
        })?;
        if backend.bytes == UCX {
            ucx_rkey::check(blob, desc.offset.saturating_add(BASIC_DESC_LEN))?;
        }
        if let Some(basic) = basic_desc(desc.bytes) {
            visitor.descriptor(mem_type, basic);
        }
    }
    Ok(())
}

/// The address, length and device id at the start of a descriptor (checked to be there).
fn basic_desc(desc: &[u8]) -> Option<BasicDesc> {
    let word = |at: usize| {
        desc.get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    Some(BasicDesc {
        addr: word(0)?,
        len: word(8)?,
        dev_id: word(16)?,
    })
}
