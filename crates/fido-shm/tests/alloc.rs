//! Allocator correctness: overlap, alignment, OOM + recovery, coalescing,
//! huge buffers, and a long fragmentation soak.

use fido_shm::{AddressSpace, Arena, Buf, ModeRequest, PgvasGeometry, ShmError, UnplacedArena};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Tiny deterministic PRNG (xorshift64*), so tests need no extra crates.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Mixed sizes: mostly small, some medium, a few large.
    fn size(&mut self, max_large: u64) -> usize {
        (match self.below(100) {
            0..=69 => 1 + self.below(4096),
            70..=94 => 1 + self.below(64 << 10),
            _ => 1 + self.below(max_large),
        }) as usize
    }
}

/// An arena placed in slot 0 of a swizzle-mode space (no address reservation,
/// so tests running in parallel never collide).
fn arena(len: u64) -> Arc<Arena> {
    let geo = PgvasGeometry {
        base: 0x6000_0000_0000,
        slot_size: 4 << 30,
        slots: 4,
    };
    let space = Arc::new(AddressSpace::new(geo, ModeRequest::ForceSwizzle).unwrap());
    UnplacedArena::create(len, false)
        .unwrap()
        .place(&space, 0, 1)
        .unwrap()
}

fn assert_idle(a: &Arena) {
    let s = a.stats();
    assert_eq!(s.bytes_in_use, 0, "{s:?}");
    assert_eq!(s.allocations, 0, "{s:?}");
    assert_eq!(s.bytes_free, a.len());
}

#[test]
fn alignment_and_contents() {
    let a = arena(8 << 20);
    let mut bufs = Vec::new();
    for len in (1..70_000usize)
        .step_by(97)
        .chain([64, 65, 32768, 32769, 65536, 65537])
    {
        let mut b = a.alloc(len).unwrap();
        assert_eq!(b.len(), len);
        assert!(b.capacity() >= len);
        assert_eq!(b.gptr().addr() % 64, 0, "len {len}");
        assert_eq!(b.as_ptr() as usize % 64, 0, "len {len}");
        assert!(a.contains(b.gptr(), len as u64));
        b.fill(len as u8);
        bufs.push(b);
        if bufs.len() > 40 {
            let b = bufs.remove(0);
            assert!(b.iter().all(|&x| x == b.len() as u8));
        }
    }
    for b in &bufs {
        assert!(b.iter().all(|&x| x == b.len() as u8));
    }
    let mut b = bufs.pop().unwrap();
    b.truncate(10);
    assert_eq!(b.len(), 10);
    b.truncate(1000);
    assert_eq!(b.len(), 10);
    drop(b);
    drop(bufs);
    assert_idle(&a);
    assert!(matches!(a.alloc(0), Err(ShmError::InvalidLength(0))));
}

#[test]
fn no_overlap_many_threads() {
    let a = arena(64 << 20);
    // Live ranges (offset → end) across all threads: every insert checks neighbours.
    let live: Arc<Mutex<BTreeMap<u64, u64>>> = Arc::default();
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let a = a.clone();
            let live = live.clone();
            std::thread::spawn(move || {
                let mut rng = Rng(0x9E37_79B9 + t);
                let mut mine: Vec<(Buf, u8)> = Vec::new();
                for i in 0..20_000u32 {
                    if mine.len() < 64 && rng.below(3) != 0 {
                        let len = rng.size(1 << 20);
                        let mut b = match a.alloc(len) {
                            Ok(b) => b,
                            Err(ShmError::OutOfMemory { .. }) => continue,
                            Err(e) => panic!("{e}"),
                        };
                        let (s, e) = (b.offset(), b.offset() + b.capacity() as u64);
                        {
                            let mut l = live.lock();
                            if let Some((&ps, &pe)) = l.range(..e).next_back() {
                                assert!(pe <= s || ps >= e, "overlap [{s},{e}) with [{ps},{pe})");
                            }
                            l.insert(s, e);
                        }
                        let tag = (t as u8) << 6 | (i as u8 & 0x3f);
                        b.fill(tag);
                        mine.push((b, tag));
                    } else if !mine.is_empty() {
                        let (b, tag) = mine.swap_remove(rng.below(mine.len() as u64) as usize);
                        assert!(b.iter().all(|&x| x == tag), "buffer clobbered");
                        live.lock().remove(&b.offset());
                    }
                }
                for (b, tag) in mine {
                    assert!(b.iter().all(|&x| x == tag), "buffer clobbered");
                    live.lock().remove(&b.offset());
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_idle(&a);
}

#[test]
fn oom_then_recovery() {
    let a = arena(4 << 20);
    let big: Vec<Buf> = (0..4).map(|_| a.alloc(1 << 20).unwrap()).collect();
    assert!(matches!(a.alloc(1), Err(ShmError::OutOfMemory { .. })));
    assert!(matches!(
        a.alloc(1 << 20),
        Err(ShmError::OutOfMemory { .. })
    ));
    assert!(matches!(
        a.alloc((4 << 20) + 1),
        Err(ShmError::OutOfMemory { .. })
    ));
    drop(big);
    // Fill with small buffers until OOM, then free half and allocate again.
    let mut small = Vec::new();
    loop {
        match a.alloc(1000) {
            Ok(b) => small.push(b),
            Err(ShmError::OutOfMemory { .. }) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(small.len() > 3000);
    let n = small.len();
    small.truncate(n / 2);
    assert!(a.alloc(1000).is_ok());
    drop(small);
    assert_idle(&a);
    let whole = a.alloc(4 << 20).unwrap();
    assert_eq!(whole.offset(), 0);
}

#[test]
fn exhaustive_coalescing() {
    const LEN: u64 = 16 << 20;
    let a = arena(LEN);
    let mut rng = Rng(42);
    let mut bufs = Vec::new();
    // Every small class, then 64 KiB blocks, until nothing fits.
    for &len in &[64usize, 100, 640, 3000, 5000, 20000, 32768, 65536, 1] {
        let mut misses = 0;
        while misses < 3 {
            match a.alloc(len + rng.below(8) as usize) {
                Ok(b) => bufs.push(b),
                Err(ShmError::OutOfMemory { .. }) => misses += 1,
                Err(e) => panic!("{e}"),
            }
            if bufs.len() % 997 == 0 {
                break; // move on to the next size now and then so all classes get slabs
            }
        }
    }
    while let Ok(b) = a.alloc(1 + rng.below(32768) as usize) {
        bufs.push(b);
    }
    assert!(a.stats().bytes_reserved == LEN, "{:?}", a.stats());
    // Free in random order.
    while !bufs.is_empty() {
        let i = rng.below(bufs.len() as u64) as usize;
        bufs.swap_remove(i);
    }
    assert_idle(&a);
    let whole = a.alloc(LEN as usize).unwrap();
    assert_eq!((whole.offset(), whole.capacity() as u64), (0, LEN));
    drop(whole);
    // And the same in whole 64 KiB units.
    let units: Vec<Buf> = (0..LEN / 65536).map(|_| a.alloc(65536).unwrap()).collect();
    assert!(a.alloc(1).is_err());
    drop(units);
    assert!(a.alloc(LEN as usize).is_ok());
}

#[test]
fn huge_buffers() {
    let a = arena(1 << 30);
    let mut x = a.alloc(512 << 20).unwrap();
    let y = a.alloc(512 << 20).unwrap();
    assert_eq!(a.stats().bytes_free, 0);
    assert!(a.alloc(1).is_err());
    // Touch only the ends: the arena is sparse.
    x[0] = 1;
    let n = x.len();
    x[n - 1] = 2;
    drop(y);
    // Non-power-of-two large sizes waste < 64 KiB each.
    let z = a.alloc((300 << 20) + 1).unwrap();
    assert_eq!(z.capacity(), (300 << 20) + 65536);
    // The tail behind it is reusable (as aligned buddy blocks: 128 MiB fits,
    // 200 MiB would need a free 256 MiB block).
    let w = a.alloc(128 << 20).unwrap();
    assert_eq!(w.offset(), 896 << 20);
    drop((x, z, w));
    assert_idle(&a);
    assert!(a.alloc(1 << 30).is_ok());
}

#[test]
fn non_power_of_two_arena() {
    // 1 MiB + 64 KiB: largest single buffer is 1 MiB, every byte still usable.
    let a = arena((1 << 20) + 65536);
    let b = a.alloc(1 << 20).unwrap();
    let c = a.alloc(65536).unwrap();
    assert!(a.alloc(1).is_err());
    drop((b, c));
    let all: Vec<Buf> = (0..17).map(|_| a.alloc(65536).unwrap()).collect();
    drop(all);
    assert_idle(&a);
}

#[test]
fn fragmentation_soak() {
    const LEN: u64 = 256 << 20;
    let a = arena(LEN);
    let mut rng = Rng(7);
    let mut live: Vec<Buf> = Vec::new();
    let mut ooms = 0u32;
    for _ in 0..1_000_000u32 {
        if live.len() < 2000 && (live.len() < 500 || rng.below(2) == 0) {
            match a.alloc(rng.size(1 << 20)) {
                Ok(mut b) => {
                    b[0] = 0xAA;
                    live.push(b);
                }
                Err(ShmError::OutOfMemory { .. }) => ooms += 1,
                Err(e) => panic!("{e}"),
            }
        } else {
            let i = rng.below(live.len() as u64) as usize;
            let b = live.swap_remove(i);
            assert_eq!(b[0], 0xAA);
        }
    }
    // Live set ≤ ~2000 × ~27 KiB average ≪ 256 MiB: the soak must never OOM.
    assert_eq!(ooms, 0);
    // With a quarter of the live set still present, a large buffer still fits.
    live.truncate(500);
    let big = a.alloc(64 << 20).unwrap();
    drop(big);
    drop(live);
    assert_idle(&a);
    assert!(a.alloc(LEN as usize).is_ok());
}

#[test]
fn stats_track_allocations() {
    let a = arena(1 << 20);
    let b1 = a.alloc(100).unwrap();
    let b2 = a.alloc(100_000).unwrap();
    let s = a.stats();
    assert_eq!(s.allocations, 2);
    assert_eq!(s.bytes_in_use, 128 + 128 * 1024);
    assert_eq!(s.bytes_in_use + s.bytes_free, 1 << 20);
    drop((b1, b2));
    assert_idle(&a);
}
