//! Regions of memory sorted for one question: which region, if any, covers a whole range?
//! Regions may overlap (the same memory registered twice); each lookup is a binary search.

/// Regions keyed by `K` (e.g. memory type and device id), each with a value `T`.
#[derive(Debug, Clone)]
pub(crate) struct RegionIndex<K, T> {
    /// Sorted by key, then start.
    entries: Vec<Entry<K>>,
    values: Vec<T>,
}

#[derive(Debug, Clone)]
struct Entry<K> {
    key: K,
    start: usize,
    end: usize,
    value: usize,
    /// The furthest end of this and the earlier regions of the same key, and the value of
    /// the region that reaches it.
    reach: usize,
    reach_value: usize,
}

impl<K: Ord + Copy, T> RegionIndex<K, T> {
    /// Indexes `(key, start, end, value)` regions (`end` exclusive).
    pub(crate) fn new(regions: impl IntoIterator<Item = (K, usize, usize, T)>) -> Self {
        let mut sorted: Vec<(K, usize, usize, usize)> = Vec::new();
        let mut values = Vec::new();
        for (key, start, end, value) in regions {
            sorted.push((key, start, end, values.len()));
            values.push(value);
        }
        sorted.sort_unstable_by_key(|&(key, start, _, _)| (key, start));
        let mut entries: Vec<Entry<K>> = Vec::with_capacity(sorted.len());
        for (key, start, end, value) in sorted {
            let (reach, reach_value) = match entries.last() {
                Some(last) if last.key == key && last.reach >= end => {
                    (last.reach, last.reach_value)
                }
                _ => (end, value),
            };
            entries.push(Entry {
                key,
                start,
                end,
                value,
                reach,
                reach_value,
            });
        }
        RegionIndex { entries, values }
    }

    /// The value of a region of `key` that covers all of `start..end`.
    pub(crate) fn covering(&self, key: K, start: usize, end: usize) -> Option<&T> {
        let before = self
            .entries
            .partition_point(|e| (e.key, e.start) <= (key, start));
        let last = self.entries.get(before.checked_sub(1)?)?;
        (last.key == key && last.reach >= end).then(|| &self.values[last.reach_value])
    }

    /// The regions as `(key, start, end, value)`, sorted by key and start.
    pub(crate) fn regions(&self) -> impl Iterator<Item = (K, usize, usize, &T)> + '_ {
        self.entries
            .iter()
            .map(|e| (e.key, e.start, e.end, &self.values[e.value]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_covering_region_among_overlapping_ones() {
        let index = RegionIndex::new([
            (0u64, 100, 200, 'a'),
            (0, 150, 400, 'b'),
            (0, 160, 170, 'c'),
            (1, 100, 1000, 'd'),
        ]);
        assert_eq!(index.covering(0, 100, 200), Some(&'a'));
        assert_eq!(index.covering(0, 165, 300), Some(&'b'));
        assert_eq!(index.covering(0, 199, 201), Some(&'b'));
        assert_eq!(index.covering(0, 100, 201), None, "no one region covers it");
        assert_eq!(index.covering(0, 50, 60), None);
        assert_eq!(index.covering(0, 399, 401), None);
        assert_eq!(index.covering(1, 500, 600), Some(&'d'));
        assert_eq!(index.covering(2, 500, 600), None);
        let values: String = index.regions().map(|(_, _, _, v)| *v).collect();
        assert_eq!(values, "abcd");
        assert!(RegionIndex::<u8, ()>::new([]).covering(0, 0, 1).is_none());
    }
}
