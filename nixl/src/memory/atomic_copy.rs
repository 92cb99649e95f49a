//! Copies into and out of registered memory that NIXL or a peer may write at the same time.
//!
//! A plain `memcpy` racing with another thread's write is a data race, which is undefined
//! behaviour in Rust whatever the bytes turn out to be. These copies use relaxed atomic
//! loads and stores instead, so a racing transfer can only make the result *torn*: each
//! byte is either its old or its new value, with no ordering between bytes.
//!
//! Atomic accesses of different sizes that overlap and race are undefined behaviour too
//! (see `core::sync::atomic`, "Memory model"), so every byte of a region is accessed with
//! one size, whatever the offset and length of a copy: the aligned 8-byte words that lie
//! wholly inside the region are always accessed as whole `AtomicU64` words (a copy that
//! covers part of a word reads the whole word, or updates its part with compare-exchange),
//! and the bytes before the first and after the last such word (at most 7 at each end of an
//! unaligned region, whose words reach outside it) always as `AtomicU8`.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

const WORD: usize = std::mem::size_of::<u64>();

/// A region of registered memory: `len` bytes at `base`.
#[derive(Clone, Copy)]
pub(crate) struct Region {
    base: *mut u8,
    len: usize,
}

/// The parts of a copy, as offsets into the region: bytes accessed one at a time (`head`
/// and `tail`, outside the region's whole words) and bytes inside whole words, split into
/// part of a first word, whole words, and part of a last word.
struct Parts {
    head: Range<usize>,
    tail: Range<usize>,
    first_word: Range<usize>,
    whole_words: Range<usize>,
    last_word: Range<usize>,
}

impl Region {
    /// The region of `len` bytes at `base`.
    ///
    /// # Safety
    /// `base..base + len` is memory that stays allocated while the region is used, that is
    /// readable (and writable, for [`copy_in`]), and that other code accesses only through
    /// the copies of this module with the same bounds, or from outside the Rust abstract
    /// machine (NIXL, a NIC, another process).
    pub(crate) unsafe fn new(base: *mut u8, len: usize) -> Self {
        Region { base, len }
    }

    /// How far `offset` lies past the start of its aligned word.
    fn misalignment(&self, offset: usize) -> usize {
        (self.base as usize).wrapping_add(offset) % WORD
    }

    /// Splits `at..at + len` (inside the region) into the parts each access covers.
    fn parts(&self, at: usize, len: usize) -> Parts {
        // Offsets of the first and past the last aligned word wholly inside the region.
        let first = ((WORD - self.misalignment(0)) % WORD).min(self.len);
        let last = first + (self.len - first) / WORD * WORD;
        let end = at + len;
        let (start, stop) = (at.clamp(first, last), end.clamp(first, last));
        let words = if start < stop { start..stop } else { at..at };
        let first_end =
            (words.start + (WORD - self.misalignment(words.start)) % WORD).min(words.end);
        let whole_end = first_end + (words.end - first_end) / WORD * WORD;
        Parts {
            head: at.min(first)..end.min(first),
            tail: at.max(last)..end.max(last),
            first_word: words.start..first_end,
            whole_words: first_end..whole_end,
            last_word: whole_end..words.end,
        }
    }

    /// The byte at `offset` as an atomic.
    ///
    /// # Safety
    /// `offset` is inside the region and outside its whole words.
    unsafe fn byte(&self, offset: usize) -> &AtomicU8 {
        // SAFETY: in bounds (caller), accessed atomically only, and only at this size.
        unsafe { AtomicU8::from_ptr(self.base.add(offset)) }
    }

    /// The whole word that holds the byte at `offset` as an atomic.
    ///
    /// # Safety
    /// `offset` is inside one of the region's whole words.
    unsafe fn word(&self, offset: usize) -> &AtomicU64 {
        let start = offset - self.misalignment(offset);
        // SAFETY: aligned, and the word lies inside the region (caller); accessed
        // atomically only, and only at this size.
        unsafe { AtomicU64::from_ptr(self.base.add(start).cast()) }
    }
}

/// Copies `out.len()` bytes starting at `offset` of `region` into `out`.
///
/// # Safety
/// `offset..offset + out.len()` lies inside the region.
pub(crate) unsafe fn copy_out(region: &Region, offset: usize, out: &mut [u8]) {
    let parts = region.parts(offset, out.len());
    for at in parts.head.chain(parts.tail) {
        // SAFETY: inside the region, outside its whole words.
        out[at - offset] = unsafe { region.byte(at) }.load(Ordering::Relaxed);
    }
    for part in [parts.first_word, parts.last_word] {
        if part.is_empty() {
            continue;
        }
        // SAFETY: inside one of the region's whole words.
        let word = unsafe { region.word(part.start) }.load(Ordering::Relaxed);
        let skip = region.misalignment(part.start);
        out[part.start - offset..part.end - offset]
            .copy_from_slice(&word.to_ne_bytes()[skip..skip + part.len()]);
    }
    let whole = parts.whole_words;
    let chunks = out[whole.start - offset..whole.end - offset].chunks_exact_mut(WORD);
    for (at, chunk) in (whole.start..).step_by(WORD).zip(chunks) {
        // SAFETY: one of the region's whole words.
        let word = unsafe { region.word(at) }.load(Ordering::Relaxed);
        chunk.copy_from_slice(&word.to_ne_bytes());
    }
}

/// Copies `data` into `region` starting at `offset`.
///
/// # Safety
/// `offset..offset + data.len()` lies inside the region, which is writable.
pub(crate) unsafe fn copy_in(region: &Region, offset: usize, data: &[u8]) {
    let parts = region.parts(offset, data.len());
    for at in parts.head.chain(parts.tail) {
        // SAFETY: inside the region, outside its whole words.
        unsafe { region.byte(at) }.store(data[at - offset], Ordering::Relaxed);
    }
    for part in [parts.first_word, parts.last_word] {
        if part.is_empty() {
            continue;
        }
        let skip = region.misalignment(part.start);
        let new = &data[part.start - offset..part.end - offset];
        // Part of a word: its other bytes keep what they hold, even if a transfer writes
        // them meanwhile (the update is retried until no write came between).
        // SAFETY: inside one of the region's whole words.
        let _ = unsafe { region.word(part.start) }.fetch_update(
            Ordering::Relaxed,
            Ordering::Relaxed,
            |old| {
                let mut bytes = old.to_ne_bytes();
                bytes[skip..skip + new.len()].copy_from_slice(new);
                Some(u64::from_ne_bytes(bytes))
            },
        );
    }
    let whole = parts.whole_words;
    let chunks = data[whole.start - offset..whole.end - offset].chunks_exact(WORD);
    for (at, chunk) in (whole.start..).step_by(WORD).zip(chunks) {
        let mut bytes = [0u8; WORD];
        bytes.copy_from_slice(chunk);
        // SAFETY: one of the region's whole words.
        unsafe { region.word(at) }.store(u64::from_ne_bytes(bytes), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A region over `buf[start..start + len]`.
    fn region(buf: &mut [u8], start: usize, len: usize) -> Region {
        assert!(start + len <= buf.len());
        // SAFETY: in bounds of `buf`, which the test accesses only through the region.
        unsafe { Region::new(buf.as_mut_ptr().add(start), len) }
    }

    #[test]
    fn copies_every_alignment_and_length() {
        let source: Vec<u8> = (0..64u8).collect();
        for start in 0..9 {
            for region_len in [0, 5, 23, 40, 47] {
                for offset in 0..=region_len.min(9) {
                    for len in [0, 1, 3, 8, 9, 17, 31] {
                        if offset + len > region_len {
                            continue;
                        }
                        let mut target = [0xAAu8; 64];
                        let r = region(&mut target, start, region_len);
                        // SAFETY: inside the region.
                        unsafe { copy_in(&r, offset, &source[..len]) };
                        let mut out = vec![0u8; len];
                        // SAFETY: inside the region.
                        unsafe { copy_out(&r, offset, &mut out) };
                        assert_eq!(out, source[..len]);
                        let at = start + offset;
                        assert_eq!(target[at..at + len], source[..len]);
                        assert!(target[..at].iter().all(|&b| b == 0xAA));
                        assert!(target[at + len..].iter().all(|&b| b == 0xAA));
                    }
                }
            }
        }
    }

    /// A region shared by the threads of a test.
    struct Shared(Region);
    // SAFETY: the region is only accessed atomically.
    unsafe impl Sync for Shared {}

    /// Reads and writes at every offset racing on one region: torn, never undefined (Miri
    /// checks the last part, with `scripts/miri.sh`: mixed access sizes would be reported).
    #[test]
    fn racing_copies_at_different_offsets_are_torn() {
        const LEN: usize = 45;
        let mut buf = vec![0u8; LEN + 3];
        let r = Shared(region(&mut buf, 3, LEN));
        let rounds = if cfg!(miri) { 3 } else { 200 };
        std::thread::scope(|scope| {
            for (byte, offset) in [(0x11u8, 0usize), (0x22, 3), (0x33, 13)] {
                let r = &r;
                scope.spawn(move || {
                    let r = &r.0;
                    let data = vec![byte; LEN - offset];
                    for _ in 0..rounds {
                        // SAFETY: inside the region.
                        unsafe { copy_in(r, offset, &data) };
                    }
                });
            }
            let mut out = vec![0u8; LEN - 1];
            for _ in 0..rounds {
                // SAFETY: inside the region.
                unsafe { copy_out(&r.0, 1, &mut out) };
                assert!(out.iter().all(|b| [0, 0x11, 0x22, 0x33].contains(b)));
            }
        });
    }
}
