//! A fixed-size set of region numbers, changed and read from any thread
//! without a lock (the RAID-1 dirty regions of one mirror).

use std::sync::atomic::{AtomicU64, Ordering};

pub(crate) struct Bitmap {
    words: Vec<AtomicU64>,
    bits: u64,
}

impl Bitmap {
    pub(crate) fn new(bits: u64) -> Bitmap {
        Bitmap { words: (0..bits.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(), bits }
    }

    /// Sets regions `first..=last` (clamped to the map).
    pub(crate) fn set_range(&self, first: u64, last: u64) {
        let last = last.min(self.bits.saturating_sub(1));
        for r in first..=last {
            self.words[(r / 64) as usize].fetch_or(1 << (r % 64), Ordering::SeqCst);
        }
    }

    pub(crate) fn set_all(&self) {
        if self.bits > 0 {
            self.set_range(0, self.bits - 1);
        }
    }

    pub(crate) fn clear(&self, r: u64) {
        if r < self.bits {
            self.words[(r / 64) as usize].fetch_and(!(1 << (r % 64)), Ordering::SeqCst);
        }
    }

    /// Whether none of regions `first..=last` is set.
    pub(crate) fn is_clean(&self, first: u64, last: u64) -> bool {
        let last = last.min(self.bits.saturating_sub(1));
        (first..=last).all(|r| self.words[(r / 64) as usize].load(Ordering::SeqCst) & (1 << (r % 64)) == 0)
    }

    pub(crate) fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.load(Ordering::SeqCst).count_ones())).sum()
    }

    /// The lowest region set.
    pub(crate) fn first_set(&self) -> Option<u64> {
        self.words.iter().enumerate().find_map(|(k, w)| {
            let v = w.load(Ordering::SeqCst);
            (v != 0).then(|| k as u64 * 64 + u64::from(v.trailing_zeros()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Bitmap;

    #[test]
    fn set_clear_count_and_find() {
        let b = Bitmap::new(130);
        assert_eq!((b.count(), b.first_set()), (0, None));
        b.set_range(63, 65);
        assert_eq!((b.count(), b.first_set()), (3, Some(63)));
        assert!(b.is_clean(0, 62) && !b.is_clean(60, 63) && b.is_clean(66, 129));
        b.clear(63);
        assert_eq!(b.first_set(), Some(64));
        b.set_range(129, 500);
        assert_eq!(b.count(), 3);
        b.set_all();
        assert_eq!(b.count(), 130);
        for r in 0..130 {
            b.clear(r);
        }
        assert_eq!(b.first_set(), None);
    }
}
