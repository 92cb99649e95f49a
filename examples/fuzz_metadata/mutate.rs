//! Mutations: generic (bit flips, overwrites, inserts, deletes, splices, truncation) and
//! structure-aware (lengths, counts, memory types, UCX address and rkey bytes).

use crate::fields::{spots, Kind};
use crate::rng::Rng;

/// Byte values that hit flag bits and length escapes of the UCX formats.
const INTERESTING: &[u8] = &[
    0, 1, 2, 0x0f, 0x1f, 0x20, 0x3f, 0x40, 0x7f, 0x80, 0x81, 0xc0, 0xe0, 0xfe, 0xff,
];
/// 8-byte values for lengths and counts.
const INTERESTING_U64: &[u64] = &[
    0,
    1,
    2,
    7,
    8,
    24,
    255,
    256,
    65535,
    1 << 31,
    u32::MAX as u64,
    1 << 40,
    i64::MAX as u64,
    u64::MAX,
];

/// One mutant of `input`, with `corpus` as the source of splices.
pub fn mutate(rng: &mut Rng, input: &[u8], corpus: &[Vec<u8>]) -> Vec<u8> {
    let mut out = input.to_vec();
    let rounds = 1 + rng.below(3);
    for _ in 0..rounds {
        if rng.below(2) == 0 {
            structured(rng, &mut out);
        } else {
            generic(rng, &mut out, corpus);
        }
    }
    out
}

fn generic(rng: &mut Rng, out: &mut Vec<u8>, corpus: &[Vec<u8>]) {
    if out.is_empty() {
        out.push(rng.byte());
        return;
    }
    let at = rng.below(out.len());
    match rng.below(7) {
        0 => out[at] ^= 1 << rng.below(8),
        1 => out[at] = rng.byte(),
        2 => out[at] = *rng.pick(INTERESTING),
        3 => {
            let n = 1 + rng.below(16);
            for _ in 0..n {
                out.insert(at, rng.byte());
            }
        }
        4 => {
            let end = (at + 1 + rng.below(32)).min(out.len());
            out.drain(at..end);
        }
        5 => {
            let other = rng.pick(corpus);
            if !other.is_empty() {
                let from = rng.below(other.len());
                let end = (from + 1 + rng.below(64)).min(other.len());
                let piece = other[from..end].to_vec();
                let stop = (at + piece.len()).min(out.len());
                out.splice(at..stop, piece);
            }
        }
        _ => out.truncate(at),
    }
}

fn structured(rng: &mut Rng, out: &mut [u8]) {
    let found = spots(out);
    if found.is_empty() {
        return;
    }
    let spot = *rng.pick(&found);
    let field = &mut out[spot.offset..spot.offset + spot.len];
    match spot.kind {
        Kind::Length | Kind::Count => {
            let old = u64::from_le_bytes(field[..8].try_into().unwrap());
            let new = match rng.below(3) {
                0 => *rng.pick(INTERESTING_U64),
                1 => old.wrapping_add(1 + rng.below(4) as u64),
                _ => old.wrapping_sub(1 + rng.below(4) as u64),
            };
            field.copy_from_slice(&new.to_le_bytes());
        }
        Kind::MemType => {
            let new = if rng.below(2) == 0 {
                rng.below(16) as u32
            } else {
                rng.next() as u32
            };
            field.copy_from_slice(&new.to_le_bytes());
        }
        Kind::UcxHeader => {
            field[0] = (field[0] & 0xf0)
                | rng.below(16) as u8
                | ((rng.below(2) as u8) << (4 + rng.below(4)))
        }
        Kind::UcxAddress | Kind::Rkey => {
            let at = rng.below(field.len());
            field[at] = match rng.below(3) {
                0 => *rng.pick(INTERESTING),
                1 => field[at] ^ (1 << rng.below(8)),
                _ => rng.byte(),
            };
        }
    }
}
