//! Copies into and out of registered memory that NIXL or a peer may write at the same time.
//!
//! A plain `memcpy` racing with another thread's write is a data race, which is undefined
//! behaviour in Rust whatever the bytes turn out to be. These copies use relaxed atomic
//! loads and stores instead (word-sized where the address allows, byte-sized at the edges),
//! so a racing transfer can only make the result *torn*: each byte is either its old or its
//! new value, with no ordering between bytes.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

const WORD: usize = std::mem::size_of::<usize>();

/// Copies `out.len()` bytes starting at `src` into `out`.
///
/// # Safety
/// `src..src + out.len()` is readable memory that stays allocated during the call and that
/// other code only accesses atomically or from outside the Rust abstract machine (NIXL, a
/// NIC, another process).
pub(crate) unsafe fn copy_out(src: *const u8, out: &mut [u8]) {
    let mut done = 0;
    while done < out.len() {
        // SAFETY: `src + done` lies inside the range the caller vouches for.
        let at = unsafe { src.add(done) };
        if at as usize % WORD == 0 && out.len() - done >= WORD {
            // SAFETY: aligned, in range, accessed atomically only (see the contract).
            let word =
                unsafe { AtomicUsize::from_ptr(at.cast_mut().cast()) }.load(Ordering::Relaxed);
            out[done..done + WORD].copy_from_slice(&word.to_ne_bytes());
            done += WORD;
        } else {
            // SAFETY: in range, accessed atomically only (see the contract).
            out[done] = unsafe { AtomicU8::from_ptr(at.cast_mut()) }.load(Ordering::Relaxed);
            done += 1;
        }
    }
}

/// Copies `data` into memory starting at `dst`.
///
/// # Safety
/// `dst..dst + data.len()` is writable memory that stays allocated during the call and that
/// other code only accesses atomically or from outside the Rust abstract machine.
pub(crate) unsafe fn copy_in(dst: *mut u8, data: &[u8]) {
    let mut done = 0;
    while done < data.len() {
        // SAFETY: `dst + done` lies inside the range the caller vouches for.
        let at = unsafe { dst.add(done) };
        if at as usize % WORD == 0 && data.len() - done >= WORD {
            let mut word = [0u8; WORD];
            word.copy_from_slice(&data[done..done + WORD]);
            // SAFETY: aligned, in range, accessed atomically only (see the contract).
            unsafe { AtomicUsize::from_ptr(at.cast()) }
                .store(usize::from_ne_bytes(word), Ordering::Relaxed);
            done += WORD;
        } else {
            // SAFETY: in range, accessed atomically only (see the contract).
            unsafe { AtomicU8::from_ptr(at) }.store(data[done], Ordering::Relaxed);
            done += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_alignment_and_length() {
        let source: Vec<u8> = (0..64u8).collect();
        for start in 0..9 {
            for len in 0..40 {
                let mut out = vec![0u8; len];
                // SAFETY: in bounds of `source`, which nothing else touches.
                unsafe { copy_out(source[start..].as_ptr(), &mut out) };
                assert_eq!(out, source[start..start + len]);

                let mut target = [0xAAu8; 64];
                // SAFETY: in bounds of `target`, which nothing else touches.
                unsafe { copy_in(target[start..].as_mut_ptr(), &source[..len]) };
                assert_eq!(target[start..start + len], source[..len]);
                assert!(target[..start].iter().all(|&b| b == 0xAA));
                assert!(target[start + len..].iter().all(|&b| b == 0xAA));
            }
        }
    }
}
