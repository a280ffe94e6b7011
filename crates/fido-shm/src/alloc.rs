//! The arena allocator: offsets only, no memory access, no `unsafe`.
//!
//! # Design
//!
//! All metadata lives in the owner's private heap, never in the arena: peers can
//! read the arena, and the allocator must not trust (or leak) anything there.
//!
//! * **Buddy allocator** over the arena in *units* of 64 KiB ([`UNIT`]). Free
//!   blocks of order `k` (2^k units, naturally aligned) sit in one `BTreeSet` of
//!   unit indices per order; taking `first()` serves the lowest address, which
//!   keeps the live set packed at the bottom and large blocks free at the top.
//!   Freeing merges with the buddy (`i ^ 2^k`) while the buddy is free, so the
//!   free sets are always the canonical maximal decomposition of the free space:
//!   freeing everything always gives the initial state back (no long-run drift).
//!   An arena whose length is not a power of two starts as the maximal aligned
//!   decomposition of `[0, units)`; buddies beyond the end are never free, so
//!   they never merge.
//!   Consequence: the largest single buffer is the largest power-of-two-aligned
//!   block, i.e. the whole arena when its length is a power of two (the default),
//!   otherwise the largest power of two ≤ the length.
//! * **Large allocations** (> 32 KiB) take a block of order `ceil(log2(units))`
//!   and immediately give the unused tail back (as aligned blocks), so they
//!   waste < 64 KiB each, not up to 50 %. Freeing gives the used units back the
//!   same way; merging restores the big block. A 512 MiB buffer in a 1 GiB
//!   arena takes exactly 512 MiB.
//! * **Small allocations** (64 B ..= 32 KiB) come from per-size-class slabs. Class
//!   sizes are multiples of 64 (so every object is cache-line aligned): 64, 128,
//!   192, 256, then four classes per power of two (320, 384, 448, 512, 640, ...,
//!   32 KiB). A slab is one buddy block: 64 KiB for classes ≤ 4 KiB, 256 KiB above
//!   (so the slab tail left over is ≤ 6.25 %). Each class is its own
//!   `parking_lot::Mutex` with a map slab → free-index stack, and an ordered
//!   set of slabs with free objects (again lowest address first). A class keeps
//!   at most one empty slab cached; further empty slabs go back to the buddy at
//!   once, and when the buddy is out of memory every class's cached empty slab
//!   is reclaimed and the allocation retried, so cached slabs can never make an
//!   allocation fail.
//!
//! Lock order: a class lock may be held while taking the buddy lock, never the
//! other way round, and never two class locks at once.
//!
//! # Worst-case waste
//!
//! * Internal, small: for requests ≥ 256 B the class is < 25 % (≤ 20 %) larger
//!   than the request; below 256 B the 64-byte alignment dominates (a 65-byte
//!   request takes 128 B). Slab tails: ≤ 6.25 % of a slab. Metadata: ≤ 2 bytes
//!   of private heap per object slot.
//! * Internal, large: < 64 KiB per buffer (rounding up to whole units).
//! * External: the buddy's. Because frees always coalesce fully, a quiescent
//!   arena (nothing live) is always one free decomposition of the whole arena;
//!   with live buffers, a large request can fail while enough scattered free
//!   space exists — the usual buddy bound, mitigated by lowest-address-first
//!   placement.
//!
//! Freed memory is *not* returned to the kernel: `MADV_REMOVE` (a hole punch)
//! is refused with `EPERM` on a memfd carrying `F_SEAL_FUTURE_WRITE`, and that
//! seal is what keeps peers read-only. Pages stay resident until the arena dies;
//! size arenas accordingly (they are sparse until first touched).

use crate::ShmError;
use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};

/// Buddy unit (order 0): 64 KiB.
pub const UNIT: u64 = 64 << 10;
const UNIT_SHIFT: u32 = 16;
/// Every buffer is aligned to this.
pub const ALIGN: u64 = 64;
/// The largest size served by slabs.
pub const MAX_SMALL: u64 = 32 << 10;

/// Size classes (bytes). Multiples of 64; 4 per power of two from 256 on.
const CLASSES: [u32; 32] = [
    64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072,
    3584, 4096, 5120, 6144, 7168, 8192, 10240, 12288, 14336, 16384, 20480, 24576, 28672, 32768,
];

/// Buddy order of the slab for a class: 64 KiB (order 0) up to 4 KiB objects,
/// 256 KiB (order 2) above, to keep the tail waste ≤ 6.25 %.
fn slab_order(class_size: u32) -> u32 {
    if class_size <= 4096 {
        0
    } else {
        2
    }
}

fn class_of(len: u64) -> usize {
    debug_assert!(len > 0 && len <= MAX_SMALL);
    // CLASSES is sorted; 32 entries, a binary search is a handful of compares.
    CLASSES.partition_point(|&c| (c as u64) < len)
}

/// How a live allocation was made; needed to free it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Block {
    Small { class: u8 },
    Large { units: u32 },
}

impl Block {
    /// Bytes this allocation takes from the arena (its accounting size).
    pub(crate) fn size(self) -> u64 {
        match self {
            Block::Small { class } => CLASSES[class as usize] as u64,
            Block::Large { units } => (units as u64) << UNIT_SHIFT,
        }
    }
}

/// Binary buddy allocator over `units` 64 KiB units. Indices are unit numbers.
struct Buddy {
    free: Vec<BTreeSet<u32>>,
    units: u32,
    free_units: u64,
}

impl Buddy {
    fn new(units: u32) -> Buddy {
        let max_order = 31 - units.leading_zeros(); // floor(log2(units)), units > 0
        let mut b = Buddy {
            free: (0..=max_order).map(|_| BTreeSet::new()).collect(),
            units,
            free_units: 0,
        };
        b.release(0, units);
        b
    }

    fn max_order(&self) -> u32 {
        self.free.len() as u32 - 1
    }

    /// Take a block of exactly `order`, splitting a larger one if needed.
    fn alloc_block(&mut self, order: u32) -> Option<u32> {
        if order > self.max_order() {
            return None;
        }
        let mut j = (order..=self.max_order()).find(|&j| !self.free[j as usize].is_empty())?;
        let idx = self.free[j as usize].pop_first()?;
        // Split down: keep the lower half, free the upper half at each level.
        while j > order {
            j -= 1;
            self.free[j as usize].insert(idx + (1 << j));
        }
        self.free_units -= 1u64 << order;
        Some(idx)
    }

    /// Free one aligned block of `order`, merging with free buddies.
    fn free_block(&mut self, mut idx: u32, mut order: u32) {
        debug_assert_eq!(idx & ((1 << order) - 1), 0, "misaligned block");
        self.free_units += 1u64 << order;
        while order < self.max_order() {
            let buddy = idx ^ (1 << order);
            if !self.free[order as usize].remove(&buddy) {
                break;
            }
            idx = idx.min(buddy);
            order += 1;
        }
        let fresh = self.free[order as usize].insert(idx);
        debug_assert!(fresh, "double free of block {idx} order {order}");
    }

    /// Free the unit range `[start, start+n)` as maximal aligned blocks.
    fn release(&mut self, mut start: u32, mut n: u32) {
        debug_assert!(start as u64 + n as u64 <= self.units as u64);
        while n > 0 {
            let align = if start == 0 {
                31
            } else {
                start.trailing_zeros()
            };
            let fit = 31 - n.leading_zeros();
            let order = align.min(fit).min(self.max_order());
            self.free_block(start, order);
            start += 1 << order;
            n -= 1 << order;
        }
    }

    /// Allocate `n` units (not necessarily a power of two): take the enclosing
    /// power-of-two block and give the tail back.
    fn alloc_units(&mut self, n: u32) -> Option<u32> {
        let order = n.next_power_of_two().trailing_zeros();
        let idx = self.alloc_block(order)?;
        let tail = (1u32 << order) - n;
        if tail > 0 {
            self.release(idx + n, tail);
        }
        Some(idx)
    }
}

/// One slab: a buddy block carved into equal objects.
struct Slab {
    /// Freed object indices (LIFO: the most recently freed is cache-warm).
    free: Vec<u16>,
    /// Objects `[bump, cap)` have never been handed out; lets a slab start in O(1).
    bump: u16,
    cap: u16,
    used: u16,
}

impl Slab {
    fn has_room(&self) -> bool {
        self.used < self.cap
    }
}

#[derive(Default)]
struct Class {
    /// Slab base unit index → slab.
    slabs: HashMap<u32, Slab>,
    /// Slabs with at least one free object, lowest address first.
    partial: BTreeSet<u32>,
    /// Number of slabs with `used == 0` (we keep at most one).
    empty: u32,
}

/// Allocation statistics; see [`crate::Arena::stats`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ArenaStats {
    /// Arena length in bytes.
    pub len: u64,
    /// Bytes taken by live buffers (rounded to their size class / 64 KiB units).
    pub bytes_in_use: u64,
    /// `len - bytes_in_use`: what could still be allocated, ignoring fragmentation.
    pub bytes_free: u64,
    /// Live buffers.
    pub allocations: u64,
    /// Bytes the buddy has handed out (large buffers + slabs, incl. partly empty slabs).
    pub bytes_reserved: u64,
}

pub(crate) struct Allocator {
    len: u64,
    buddy: Mutex<Buddy>,
    classes: Box<[Mutex<Class>]>,
    in_use: AtomicU64,
    count: AtomicU64,
}

impl Allocator {
    /// `len` must be a non-zero multiple of [`UNIT`], less than 2^31 units (128 TiB).
    pub(crate) fn new(len: u64) -> Allocator {
        assert!(len > 0 && len % UNIT == 0 && (len >> UNIT_SHIFT) < 1 << 31);
        Allocator {
            len,
            buddy: Mutex::new(Buddy::new((len >> UNIT_SHIFT) as u32)),
            classes: CLASSES
                .iter()
                .map(|_| Mutex::new(Class::default()))
                .collect(),
            in_use: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Allocate `len` bytes; returns the offset in the arena (64-byte aligned).
    pub(crate) fn alloc(&self, len: u64) -> Result<(u64, Block), ShmError> {
        if len == 0 {
            return Err(ShmError::InvalidLength(0));
        }
        if len > self.len {
            return Err(ShmError::OutOfMemory { len });
        }
        let r = match self.try_alloc(len) {
            // Cached empty slabs must never cause an OOM: give them back, retry once.
            Err(ShmError::OutOfMemory { .. }) if self.reclaim_empty_slabs() > 0 => {
                self.try_alloc(len)
            }
            r => r,
        };
        if let Ok((_, block)) = r {
            self.in_use.fetch_add(block.size(), Ordering::Relaxed);
            self.count.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    fn try_alloc(&self, len: u64) -> Result<(u64, Block), ShmError> {
        if len > MAX_SMALL {
            let units = len.div_ceil(UNIT) as u32;
            let idx = self
                .buddy
                .lock()
                .alloc_units(units)
                .ok_or(ShmError::OutOfMemory { len })?;
            return Ok(((idx as u64) << UNIT_SHIFT, Block::Large { units }));
        }
        let ci = class_of(len);
        let size = CLASSES[ci];
        let mut class = self.classes[ci].lock();
        let base = match class.partial.first() {
            Some(&b) => b,
            None => {
                let order = slab_order(size);
                let b = self
                    .buddy
                    .lock()
                    .alloc_block(order)
                    .ok_or(ShmError::OutOfMemory { len })?;
                let cap = (((UNIT << order) / size as u64) as u16).max(1);
                class.slabs.insert(
                    b,
                    Slab {
                        free: Vec::new(),
                        bump: 0,
                        cap,
                        used: 0,
                    },
                );
                class.partial.insert(b);
                class.empty += 1;
                b
            }
        };
        let slab = class
            .slabs
            .get_mut(&base)
            .expect("partial slab is in the map");
        let was_empty = slab.used == 0;
        let obj = match slab.free.pop() {
            Some(i) => i,
            None => {
                slab.bump += 1;
                slab.bump - 1
            }
        };
        slab.used += 1;
        let full = !slab.has_room();
        if was_empty {
            class.empty -= 1;
        }
        if full {
            class.partial.remove(&base);
        }
        let off = ((base as u64) << UNIT_SHIFT) + obj as u64 * size as u64;
        Ok((off, Block::Small { class: ci as u8 }))
    }

    /// Free an allocation made by [`Allocator::alloc`]. Each (off, block) pair
    /// is freed exactly once (guaranteed by `Buf` owning it).
    pub(crate) fn free(&self, off: u64, block: Block) {
        self.in_use.fetch_sub(block.size(), Ordering::Relaxed);
        self.count.fetch_sub(1, Ordering::Relaxed);
        match block {
            Block::Large { units } => {
                self.buddy.lock().release((off >> UNIT_SHIFT) as u32, units);
            }
            Block::Small { class: ci } => {
                let size = CLASSES[ci as usize];
                let order = slab_order(size);
                let slab_bytes = UNIT << order;
                let base = ((off & !(slab_bytes - 1)) >> UNIT_SHIFT) as u32;
                let obj = ((off & (slab_bytes - 1)) / size as u64) as u16;
                let mut class = self.classes[ci as usize].lock();
                let slab = class
                    .slabs
                    .get_mut(&base)
                    .expect("freeing into an unknown slab");
                debug_assert!(obj < slab.bump && !slab.free.contains(&obj), "double free");
                let was_full = !slab.has_room();
                slab.free.push(obj);
                slab.used -= 1;
                let now_empty = slab.used == 0;
                if was_full {
                    class.partial.insert(base);
                }
                if now_empty {
                    if class.empty >= 1 {
                        // Already one cached empty slab in this class: give this one back.
                        class.slabs.remove(&base);
                        class.partial.remove(&base);
                        self.buddy.lock().free_block(base, order);
                    } else {
                        class.empty += 1;
                    }
                }
            }
        }
    }

    /// Return every class's cached empty slabs to the buddy. Takes one class
    /// lock at a time (see the lock order in the module docs).
    fn reclaim_empty_slabs(&self) -> usize {
        let mut n = 0;
        for (ci, m) in self.classes.iter().enumerate() {
            let mut class = m.lock();
            if class.empty == 0 {
                continue;
            }
            let order = slab_order(CLASSES[ci]);
            let empties: Vec<u32> = class
                .slabs
                .iter()
                .filter(|(_, s)| s.used == 0)
                .map(|(&b, _)| b)
                .collect();
            let mut buddy = self.buddy.lock();
            for b in empties {
                class.slabs.remove(&b);
                class.partial.remove(&b);
                buddy.free_block(b, order);
                n += 1;
            }
            class.empty = 0;
        }
        n
    }

    pub(crate) fn stats(&self) -> ArenaStats {
        let in_use = self.in_use.load(Ordering::Relaxed);
        let free_units = self.buddy.lock().free_units;
        ArenaStats {
            len: self.len,
            bytes_in_use: in_use,
            bytes_free: self.len.saturating_sub(in_use),
            allocations: self.count.load(Ordering::Relaxed),
            bytes_reserved: self.len - (free_units << UNIT_SHIFT),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_aligned_and_tight() {
        for w in CLASSES.windows(2) {
            assert!(w[0] < w[1]);
        }
        for &c in &CLASSES {
            assert_eq!(c as u64 % ALIGN, 0);
        }
        // ≤ 25 % internal waste from 256 B up.
        for len in 256..=MAX_SMALL {
            let c = CLASSES[class_of(len)] as u64;
            assert!(c >= len);
            assert!((c - len) * 4 <= c, "len {len} class {c}");
        }
        assert_eq!(class_of(1), 0);
        assert_eq!(class_of(64), 0);
        assert_eq!(class_of(65), 1);
        assert_eq!(class_of(MAX_SMALL), CLASSES.len() - 1);
    }

    #[test]
    fn buddy_non_power_of_two_and_restore() {
        let mut b = Buddy::new(13); // 8 + 4 + 1
        assert_eq!(b.free_units, 13);
        let snapshot: Vec<_> = b.free.clone();
        let a = b.alloc_units(3).unwrap(); // [8,11), tail 11 freed
        let c = b.alloc_units(5).unwrap(); // [0,5), tail [5,8) freed
        assert!(b.alloc_units(4).is_none()); // 5 units free, but no 4-block
        let d = b.alloc_units(2).unwrap();
        let singles: Vec<u32> = (0..3).map(|_| b.alloc_units(1).unwrap()).collect();
        assert_eq!(b.free_units, 0);
        assert!(b.alloc_units(1).is_none());
        b.release(c, 5);
        for s in singles {
            b.release(s, 1);
        }
        b.release(a, 3);
        b.release(d, 2);
        assert_eq!(b.free, snapshot);
        assert_eq!(b.free_units, 13);
    }

    #[test]
    fn tail_trimming() {
        let mut b = Buddy::new(16);
        let a = b.alloc_units(9).unwrap();
        assert_eq!(a, 0);
        // The 7-unit tail is usable.
        let t = b.alloc_units(4).unwrap();
        assert_eq!(t, 12);
        b.release(a, 9);
        b.release(t, 4);
        assert_eq!(b.free[4].len(), 1);
    }
}
