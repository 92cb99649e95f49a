//! Release marks (native protocol): how a decode knows, once its READ has ended, that the
//! prefill did not release the blocks it read before that end (see [`ReleaseMarks`]).

use serde::{Deserialize, Serialize};

/// Bytes of one release mark: a little-endian `u64` per block id.
pub const MARK_LEN: usize = 8;

/// Most marks a peer may declare (one per block id); a handshake declaring more is refused.
pub const MAX_MARKS: u64 = 1 << 24;

/// Where a rank keeps its release marks: `count` words of [`MARK_LEN`] bytes from `addr`,
/// DRAM registered with its agent (device 0), word `b` that of block id `b`; its handshake
/// names them (native protocol).
///
/// They tell a decode, once its READ has ended, that the prefill did not release the blocks
/// it read before that end. A lease can end while a READ is still to land (a partition, a stalled decode): the
/// prefill then hands the blocks back to its engine, which may give them to another request
/// before the READ reads them. The READ still succeeds in NIXL, and its bytes are another
/// request's KV. Release marks turn that into a failed load:
///
/// - the scheduler numbers every request it holds for readers with a *lease epoch*, larger
///   than any it gave before, and hands it to the readers in the params
///   ([`KvTransferParams::remote_lease_epoch`](crate::KvTransferParams::remote_lease_epoch));
/// - each rank keeps one little-endian `u64` word per block id in registered DRAM, the
///   region its handshake names; when it releases a held request (every reader notified,
///   its lease ended, or an eviction) it raises the word of each of the request's blocks
///   to the request's epoch, before the engine learns that they are free;
/// - the reader, once its data READs from a rank have all ended, READs the words of the
///   blocks it read from that rank and fails the load if any is at or past the epoch. Its
///   finish notification goes to the rank once that READ ended (not with the data READ),
///   so that its own release never fails its check.
///
/// A block given to the request was released by its earlier holders before the request
/// finished, so their epochs are smaller, and every later holder's epoch is larger: a word
/// below the epoch proves that the request's blocks were not released before the words were
/// read, hence not before the data READ ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseMarks {
    /// The address of the first word, in the rank's process.
    pub addr: u64,
    /// How many words (block ids) there are.
    pub count: u64,
}

impl ReleaseMarks {
    /// Why a peer's marks cannot be read, if they cannot: none, more than [`MAX_MARKS`], a
    /// null address, or an end past the address space.
    pub(crate) fn invalid(&self) -> Option<String> {
        let end = self
            .count
            .checked_mul(MARK_LEN as u64)
            .and_then(|len| self.addr.checked_add(len));
        if self.count == 0 || self.count > MAX_MARKS || self.addr == 0 || end.is_none() {
            return Some(format!(
                "release marks of {} words at {:#x} (1 to {MAX_MARKS} words, at a non-null address)",
                self.count, self.addr
            ));
        }
        None
    }
}

/// The words a reader READs to check `block_ids` against `marks`: the distinct block ids,
/// sorted, as runs of consecutive ids (`(first id, how many)`), and how many words they are
/// in all.
///
/// # Errors
/// The first block id that has no word, as a message.
pub(crate) fn runs(
    block_ids: &[usize],
    marks: &ReleaseMarks,
) -> Result<(Vec<(usize, usize)>, usize), String> {
    let mut ids = block_ids.to_vec();
    ids.sort_unstable();
    ids.dedup();
    if let Some(&past) = ids.iter().find(|&&id| id as u64 >= marks.count) {
        return Err(format!(
            "block id {past} has no release mark (the rank has {})",
            marks.count
        ));
    }
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &id in &ids {
        match runs.last_mut() {
            Some((first, len)) if *first + *len == id => *len += 1,
            _ => runs.push((id, 1)),
        }
    }
    Ok((runs, ids.len()))
}

/// The first word of `words` (as [`runs`] laid them out) at or past `epoch`, with its value:
/// a block released since the request was held.
pub(crate) fn first_released(words: &[u8], epoch: u64) -> Option<(usize, u64)> {
    words
        .chunks_exact(MARK_LEN)
        .map(|word| u64::from_le_bytes(word.try_into().unwrap_or([u8::MAX; MARK_LEN])))
        .enumerate()
        .find(|&(_, mark)| mark >= epoch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_words_of_a_load_are_its_distinct_ids_in_runs() {
        let marks = ReleaseMarks {
            addr: 4096,
            count: 16,
        };
        let (runs, words) = runs(&[9, 3, 4, 3, 5, 10, 0], &marks).unwrap();
        assert_eq!(runs, [(0, 1), (3, 3), (9, 2)]);
        assert_eq!(words, 6);
        let err = super::runs(&[1, 16], &marks).unwrap_err();
        assert!(err.contains("block id 16"), "{err}");
    }

    #[test]
    fn a_word_at_or_past_the_epoch_is_a_release() {
        let words: Vec<u8> = [3u64, 6, 7, 9]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        assert_eq!(first_released(&words, 10), None);
        assert_eq!(first_released(&words, 7), Some((2, 7)));
        assert_eq!(first_released(&words, 1), Some((0, 3)));
    }

    #[test]
    fn a_peers_marks_are_bounded() {
        let ok = ReleaseMarks {
            addr: 4096,
            count: 64,
        };
        assert_eq!(ok.invalid(), None);
        for bad in [
            ReleaseMarks { count: 0, ..ok },
            ReleaseMarks { addr: 0, ..ok },
            ReleaseMarks {
                count: MAX_MARKS + 1,
                ..ok
            },
            ReleaseMarks {
                addr: u64::MAX - 8,
                ..ok
            },
        ] {
            assert!(bad.invalid().is_some(), "{bad:?}");
        }
    }
}
