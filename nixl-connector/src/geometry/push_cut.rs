//! Which of a prefill's blocks a push writes: in each KV cache group, the last as many as
//! the decode registered (the decode's prefix cache holds the first ones, as vLLM's push
//! cuts its list to the last `len(decode blocks)`), checked against what the prefill holds.
//! The pairing of the blocks left is then a READ's ([`load_reads`](crate::geometry::load_reads)),
//! with the prefill as the reader of the decode's geometry.

/// The prefill's blocks a push of the decode's `(ids, group_lens)` writes, with their
/// group lengths (the decode's; empty for one group, as given).
///
/// # Errors
/// Why it is refused: another number of groups than the prefill's, a group with more
/// blocks than the prefill holds in it, or no block at all.
pub(crate) fn cut_to_decode(
    (prefill, prefill_lens): (&[usize], &[usize]),
    (decode, decode_lens): (&[usize], &[usize]),
) -> Result<(Vec<usize>, Vec<usize>), String> {
    let whole = |ids: &[usize], lens: &[usize]| match lens.is_empty() {
        true => vec![ids.len()],
        false => lens.to_vec(),
    };
    let (theirs, ours) = (whole(decode, decode_lens), whole(prefill, prefill_lens));
    if theirs.len() != ours.len() {
        return Err(format!(
            "the decode registered {} KV cache groups, the request here has {}",
            theirs.len(),
            ours.len()
        ));
    }
    if ours.iter().sum::<usize>() != prefill.len() || theirs.iter().sum::<usize>() != decode.len() {
        return Err("group lengths that do not add up to the blocks".to_string());
    }
    if decode.is_empty() {
        return Err("a registration of no block".to_string());
    }
    let mut cut = Vec::with_capacity(decode.len());
    let mut at = 0;
    for (group, (&want, &have)) in theirs.iter().zip(&ours).enumerate() {
        if want > have {
            return Err(format!(
                "the decode registered {want} blocks in KV cache group {group}, more than the {have} the request holds here"
            ));
        }
        cut.extend_from_slice(&prefill[at + have - want..at + have]);
        at += have;
    }
    Ok((cut, decode_lens.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_hit_writes_the_last_blocks_of_each_group() {
        let one = cut_to_decode((&[7, 8, 9, 10], &[]), (&[1, 2], &[])).unwrap();
        assert_eq!(one, (vec![9, 10], vec![]));
        let whole = cut_to_decode((&[7, 8], &[]), (&[1, 2], &[])).unwrap();
        assert_eq!(whole.0, [7, 8]);
        let groups = cut_to_decode((&[1, 2, 3, 4, 5], &[3, 2]), (&[9, 8], &[1, 1])).unwrap();
        assert_eq!(groups, (vec![3, 5], vec![1, 1]));
    }

    #[test]
    fn what_the_prefill_cannot_write_is_refused_by_name() {
        let refused = |p: (&[usize], &[usize]), d: (&[usize], &[usize]), want: &str| {
            let why = cut_to_decode(p, d).unwrap_err();
            assert!(why.contains(want), "{why}");
        };
        refused((&[1], &[]), (&[1, 2], &[]), "more than the 1");
        refused(
            (&[1, 2], &[1, 1]),
            (&[1], &[]),
            "1 KV cache groups, the request here has 2",
        );
        refused((&[1, 2], &[]), (&[], &[]), "no block");
        refused((&[1, 2], &[1, 1]), (&[1], &[5, 0]), "add up");
    }
}
