//! Views of peer memory: [`PeerSlice`] and its typed form [`PeerSliceOf`].
//!
//! A peer's arena is mapped read-only here, but its owner — another process —
//! can still write it. A Rust reference (`&[u8]`, `&T`) to such memory would
//! promise the compiler that the bytes do not change while the reference
//! lives; a peer that writes after sending breaks that promise, and the
//! receiver's behaviour is undefined (the optimiser may, for instance, load a
//! length it has just validated a second time and use the new value). That
//! would let a peer crash us by lying, not only by dying.
//!
//! So, as rust-vmm's `vm-memory` does for guest memory with `VolatileSlice`,
//! the safe API hands out no reference to peer memory: a view is a pointer, a
//! length and the lifetime of the mapping that keeps the pages, and every read
//! goes through it.
//!
//! **How bytes are read.** Every read of peer memory is a *volatile* load —
//! 16 bytes at a time (8 off x86-64) where the alignment allows, single bytes
//! at the edges — into memory we own: a register for [`PeerSlice::read_obj`]
//! and the element reads, a small stack buffer for [`PeerSlice::read_chunks`]
//! and the folds, the caller's buffer for [`PeerSlice::copy_to`]. A volatile
//! load is performed exactly once and is never merged, repeated or elided, so
//! a value that was checked is the value that is used; a peer that writes
//! meanwhile can only make us read some mix of old and new bytes, which every
//! `Pod` type accepts. `vm-memory` copies objects larger than a word with
//! `memcpy`; we do not, because the compiler may replace a later read of the
//! copy by a second read of its source (it assumes no other writer), which
//! reopens the check-then-use race the copy was meant to close. The price is
//! that the copy loop is not vectorised beyond 16 bytes per load:
//! docs/ARCHITECTURE.md ("Views of peer memory") has the measured cost.
//!
//! **Trusting callers** may take a plain slice with the `unsafe`
//! [`PeerSlice::as_slice_unchecked`], whose contract is that nobody writes the
//! bytes while the slice lives.
//!
//! **Counting.** A view made by a message carries its domain's
//! `bytes_copied` counter: [`PeerSlice::copy_to`] and [`PeerSlice::to_vec`]
//! (and their typed forms) — the copies a caller keeps — add to it. Reading
//! values in place ([`PeerSlice::read_obj`], the iterators, folds,
//! [`PeerSlice::read_chunks`], comparisons) does not: that is the reading a
//! zero-copy path does, made sound.

use bytemuck::Pod;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes [`PeerSlice::read_chunks`] stages at a time: small enough to stay in
/// L1 with what the caller does with them, large enough that the per-chunk
/// call is noise.
pub const READ_CHUNK: usize = 512;

/// A read-only view of `len` bytes of a peer's memory that stays mapped for
/// `'a`. Cheap to copy (a pointer, a length and an optional counter); see the
/// [module documentation](self) for why it is not a `&[u8]`.
#[derive(Clone, Copy)]
pub struct PeerSlice<'a> {
    ptr: NonNull<u8>,
    len: usize,
    /// The domain counter that copies out of this view add to.
    copied: Option<&'a AtomicU64>,
    _mapping: PhantomData<&'a [u8]>,
}

// SAFETY: a PeerSlice only reads (volatile loads of mapped, readable memory,
// valid for 'a by its constructor's contract) and its counter is atomic;
// reading from several threads at once is what the memory is for.
unsafe impl Send for PeerSlice<'_> {}
// SAFETY: as above: `&PeerSlice` offers nothing more than reads.
unsafe impl Sync for PeerSlice<'_> {}

impl<'a> PeerSlice<'a> {
    /// A view of `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be mapped readable, and stay mapped, for all of
    /// `'a` (another process may write it; that is what this type is for).
    /// `len` must not exceed `isize::MAX`.
    #[inline]
    pub unsafe fn new(ptr: NonNull<u8>, len: usize) -> PeerSlice<'a> {
        PeerSlice { ptr, len, copied: None, _mapping: PhantomData }
    }

    /// A view of our own bytes (an inline message's copy, say), so that code
    /// reading either kind takes one type. Sound without `unsafe`: the
    /// borrow keeps anyone from writing them while the view lives.
    #[inline]
    pub fn from_own(bytes: &'a [u8]) -> PeerSlice<'a> {
        PeerSlice { ptr: NonNull::from(bytes).cast(), len: bytes.len(), copied: None, _mapping: PhantomData }
    }

    /// An empty view (of no memory).
    #[inline]
    pub fn empty() -> PeerSlice<'a> {
        PeerSlice { ptr: NonNull::dangling(), len: 0, copied: None, _mapping: PhantomData }
    }

    /// The same view, adding the bytes later copied out of it (and out of
    /// its subslices) to `counter`.
    #[inline]
    pub fn counting(self, counter: &'a AtomicU64) -> PeerSlice<'a> {
        PeerSlice { copied: Some(counter), ..self }
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the view starts in this process (for comparing addresses; read
    /// through the view, not through this pointer).
    #[inline]
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// `len` bytes at `offset`, or `None` if that is not inside this view.
    #[inline]
    pub fn subslice(&self, offset: usize, len: usize) -> Option<PeerSlice<'a>> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        // SAFETY: `offset ≤ self.len`, so the pointer stays inside (or one
        // past) the view, which is never null.
        let ptr = unsafe { NonNull::new_unchecked(self.ptr.as_ptr().add(offset)) };
        Some(PeerSlice { ptr, len, ..*self })
    }

    /// The view split at `mid`, or `None` if `mid > len`.
    #[inline]
    pub fn split_at(&self, mid: usize) -> Option<(PeerSlice<'a>, PeerSlice<'a>)> {
        Some((self.subslice(0, mid)?, self.subslice(mid, self.len - mid)?))
    }

    fn count(&self, bytes: usize) {
        if let Some(c) = self.copied {
            c.fetch_add(bytes as u64, Ordering::Relaxed);
        }
    }

    /// Copies the first `min(len, dst.len())` bytes into `dst`; returns how
    /// many. Counted as copied.
    pub fn copy_to(&self, dst: &mut [u8]) -> usize {
        let n = self.len.min(dst.len());
        // SAFETY: the first `n` bytes of the view are readable (constructor
        // contract); `dst` is our own memory of at least `n` bytes, which the
        // peer's read-only mapping cannot overlap.
        unsafe { volatile_copy(self.ptr.as_ptr(), dst.as_mut_ptr(), n) };
        self.count(n);
        n
    }

    /// The bytes, copied into a new vector. Counted as copied.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.append_to(&mut v);
        v
    }

    /// Appends the bytes to `v`. Counted as copied.
    pub fn append_to(&self, v: &mut Vec<u8>) {
        v.reserve(self.len);
        let old = v.len();
        // SAFETY: the view's `len` bytes are readable; the vector's spare
        // capacity is ours and at least `len` bytes; every one of them is
        // written before `set_len`.
        unsafe {
            volatile_copy(self.ptr.as_ptr(), v.as_mut_ptr().add(old), self.len);
            v.set_len(old + self.len);
        }
        self.count(self.len);
    }

    /// The `T` at byte `offset` (any alignment), read once, or `None` if it
    /// is not entirely inside the view. Not counted: a value read in place.
    #[inline]
    pub fn read_obj<T: Pod>(&self, offset: usize) -> Option<T> {
        let size = std::mem::size_of::<T>();
        let end = offset.checked_add(size)?;
        if end > self.len {
            return None;
        }
        // SAFETY: `offset + size ≤ len`: inside the view.
        let src = unsafe { self.ptr.as_ptr().add(offset) };
        if src.align_offset(std::mem::align_of::<T>()) == 0 {
            // SAFETY: readable (above), aligned for `T` (checked), and every
            // bit pattern is a valid `T: Pod`.
            Some(unsafe { src.cast::<T>().read_volatile() })
        } else {
            let mut v = T::zeroed();
            // SAFETY: `size` readable bytes at `src`; `v` is our own `T`, and
            // any bytes make a valid `Pod`.
            unsafe { volatile_copy(src, (&mut v as *mut T).cast(), size) };
            Some(v)
        }
    }

    /// Hands the bytes to `f` in order, [`READ_CHUNK`] at a time, each chunk
    /// a private copy on the stack: the way to run a parser or a checksum
    /// over peer bytes that takes `&[u8]`. Not counted (the copies are
    /// transient); a caller that keeps them should use [`PeerSlice::to_vec`].
    #[inline]
    pub fn read_chunks(&self, mut f: impl FnMut(&[u8])) {
        // Not zeroed first: a short view (a 10-byte string) must not pay for
        // clearing READ_CHUNK bytes; only the `n` bytes written are handed out.
        let mut buf = std::mem::MaybeUninit::<[u64; READ_CHUNK / 8]>::uninit();
        let dst = buf.as_mut_ptr().cast::<u8>();
        let mut at = 0;
        while at < self.len {
            let n = (self.len - at).min(READ_CHUNK);
            // SAFETY: `at + n ≤ len`: inside the view; `dst` is our stack
            // buffer of READ_CHUNK ≥ n bytes.
            unsafe { volatile_copy(self.ptr.as_ptr().add(at), dst, n) };
            // SAFETY: the first `n` bytes of the buffer were just written.
            f(unsafe { std::slice::from_raw_parts(dst, n) });
            at += n;
        }
    }

    /// Folds the bytes as native-endian `u64` words (offsets 0, 8, 16, …; a
    /// last partial word is zero-padded): the fast path for checksums. Not
    /// counted.
    #[inline]
    pub fn fold_u64<A>(&self, init: A, mut f: impl FnMut(A, u64) -> A) -> A {
        if self.ptr.as_ptr().align_offset(8) == 0 {
            // Aligned (every arena buffer is): each word loaded straight
            // into a register, no staging copy.
            let words = self.ptr.as_ptr().cast::<u64>();
            let mut acc = init;
            for i in 0..self.len / 8 {
                // SAFETY: word `i` ends at or before `len`: inside the view;
                // 8-aligned (checked); any bits are a valid u64.
                acc = f(acc, unsafe { words.add(i).read_volatile() });
            }
            let tail = self.len % 8;
            if tail != 0 {
                let mut last = [0u8; 8];
                self.subslice(self.len - tail, tail).expect("inside").read_chunks(|c| last[..tail].copy_from_slice(c));
                acc = f(acc, u64::from_ne_bytes(last));
            }
            return acc;
        }
        let mut acc = Some(init);
        self.read_chunks(|chunk| {
            let mut a = acc.take().expect("set between chunks");
            let mut words = chunk.chunks_exact(8);
            for w in &mut words {
                a = f(a, u64::from_ne_bytes(w.try_into().expect("8 bytes")));
            }
            let tail = words.remainder();
            if !tail.is_empty() {
                let mut last = [0u8; 8];
                last[..tail.len()].copy_from_slice(tail);
                a = f(a, u64::from_ne_bytes(last));
            }
            acc = Some(a);
        });
        acc.expect("set after the last chunk")
    }

    /// The bytes one at a time (each a volatile load). For short views; use
    /// [`PeerSlice::read_chunks`] or [`PeerSlice::fold_u64`] for long ones.
    #[inline]
    pub fn iter(&self) -> impl Iterator<Item = u8> + 'a {
        let view = *self;
        // SAFETY: `i < len`: inside the view; any byte is a valid `u8`.
        (0..view.len).map(move |i| unsafe { view.ptr.as_ptr().add(i).read_volatile() })
    }

    /// True if the view holds exactly `other`'s bytes (compared chunk by
    /// chunk on private copies).
    pub fn eq_bytes(&self, other: &[u8]) -> bool {
        if other.len() != self.len {
            return false;
        }
        let mut at = 0;
        let mut same = true;
        self.read_chunks(|c| {
            same &= c == &other[at..at + c.len()];
            at += c.len();
        });
        same
    }

    /// The view as `len / size_of::<T>()` elements of `T`, or `None` if its
    /// length is not a multiple of `T`'s size, its start is not aligned for
    /// `T`, or `T` is zero-sized.
    #[inline]
    pub fn cast<T: Pod>(self) -> Option<PeerSliceOf<'a, T>> {
        let size = std::mem::size_of::<T>();
        if size == 0 || self.len % size != 0 || self.ptr.as_ptr().align_offset(std::mem::align_of::<T>()) != 0 {
            return None;
        }
        Some(PeerSliceOf { bytes: self, _t: PhantomData })
    }

    /// The bytes as a plain slice, for a caller that trusts its peer.
    ///
    /// # Safety
    /// No one — in particular not the peer that owns the memory — may write
    /// these bytes while the returned slice (or anything derived from it)
    /// lives. Fido cannot check this: a peer that breaks it makes the
    /// caller's behaviour undefined, not merely its result wrong.
    #[inline]
    pub unsafe fn as_slice_unchecked(&self) -> &'a [u8] {
        // SAFETY: readable for 'a (constructor contract); not written while
        // the slice lives (this function's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for PeerSlice<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const SHOWN: usize = 64;
        let head = self.subslice(0, self.len.min(SHOWN)).expect("inside").uncounted().to_vec();
        write!(f, "PeerSlice({} bytes: {:?}{})", self.len, head, if self.len > SHOWN { " …" } else { "" })
    }
}

impl PeerSlice<'_> {
    /// The same view without its counter: for `Debug` only.
    fn uncounted(self) -> Self {
        PeerSlice { copied: None, ..self }
    }
}

impl PartialEq<[u8]> for PeerSlice<'_> {
    fn eq(&self, other: &[u8]) -> bool {
        self.eq_bytes(other)
    }
}
impl PartialEq<&[u8]> for PeerSlice<'_> {
    fn eq(&self, other: &&[u8]) -> bool {
        self.eq_bytes(other)
    }
}
impl<const N: usize> PartialEq<[u8; N]> for PeerSlice<'_> {
    fn eq(&self, other: &[u8; N]) -> bool {
        self.eq_bytes(other)
    }
}
impl<const N: usize> PartialEq<&[u8; N]> for PeerSlice<'_> {
    fn eq(&self, other: &&[u8; N]) -> bool {
        self.eq_bytes(*other)
    }
}

/// A read-only view of a peer's array of `T`: a [`PeerSlice`] whose length
/// is a multiple of `T`'s size and whose start is aligned for `T` (checked by
/// [`PeerSlice::cast`]). Elements are read by value, each once.
pub struct PeerSliceOf<'a, T: Pod> {
    bytes: PeerSlice<'a>,
    _t: PhantomData<T>,
}

impl<T: Pod> Clone for PeerSliceOf<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: Pod> Copy for PeerSliceOf<'_, T> {}

impl<'a, T: Pod> PeerSliceOf<'a, T> {
    /// An empty array.
    #[inline]
    pub fn empty() -> PeerSliceOf<'a, T> {
        PeerSliceOf { bytes: PeerSlice::empty(), _t: PhantomData }
    }

    /// Number of elements.
    #[inline]
    pub fn len(&self) -> usize {
        // `cast` refused zero-sized `T`.
        self.bytes.len / std::mem::size_of::<T>().max(1)
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The view as bytes.
    #[inline]
    pub fn as_bytes(&self) -> PeerSlice<'a> {
        self.bytes
    }

    /// Element `i`, read once, or `None` past the end.
    #[inline]
    pub fn get(&self, i: usize) -> Option<T> {
        if i >= self.len() {
            return None;
        }
        // SAFETY: `i < len`: inside the view; aligned for `T` (`cast`
        // checked the start, and the size of `T` is a multiple of its
        // alignment); any bits are a valid `T: Pod`.
        Some(unsafe { self.bytes.ptr.as_ptr().cast::<T>().add(i).read_volatile() })
    }

    /// The elements in order, each read once.
    #[inline]
    pub fn iter(&self) -> impl Iterator<Item = T> + 'a {
        let view = *self;
        let base = self.bytes.ptr.as_ptr().cast::<T>();
        // SAFETY: as in `get`: `i < len`, aligned, any bits valid.
        (0..view.len()).map(move |i| unsafe { base.add(i).read_volatile() })
    }

    /// `len / size_of::<T>()` elements starting at element `start`, or `None`
    /// past the end.
    #[inline]
    pub fn subslice(&self, start: usize, len: usize) -> Option<PeerSliceOf<'a, T>> {
        let size = std::mem::size_of::<T>();
        let bytes = self.bytes.subslice(start.checked_mul(size)?, len.checked_mul(size)?)?;
        Some(PeerSliceOf { bytes, _t: PhantomData })
    }

    /// Copies the first `min(len, dst.len())` elements into `dst`; returns
    /// how many. Counted as copied.
    pub fn copy_to(&self, dst: &mut [T]) -> usize {
        let n = self.len().min(dst.len());
        self.bytes.subslice(0, n * std::mem::size_of::<T>()).expect("inside").copy_to(bytemuck::cast_slice_mut(&mut dst[..n]))
            / std::mem::size_of::<T>()
    }

    /// The elements, copied into a new vector. Counted as copied.
    pub fn to_vec(&self) -> Vec<T> {
        let mut v = vec![T::zeroed(); self.len()];
        self.copy_to(&mut v);
        v
    }

    /// The elements as a plain slice, for a caller that trusts its peer.
    ///
    /// # Safety
    /// As [`PeerSlice::as_slice_unchecked`]: nobody writes the memory while
    /// the slice lives.
    #[inline]
    pub unsafe fn as_slice_unchecked(&self) -> &'a [T] {
        // SAFETY: readable for 'a, aligned and a whole number of `T`
        // (`cast`), any bits valid for `Pod`, and not written while the
        // slice lives (this function's contract).
        unsafe { std::slice::from_raw_parts(self.bytes.ptr.as_ptr().cast::<T>(), self.len()) }
    }
}

impl<T: Pod + std::fmt::Debug> std::fmt::Debug for PeerSliceOf<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const SHOWN: usize = 16;
        f.debug_list().entries(self.iter().take(SHOWN)).finish()?;
        if self.len() > SHOWN {
            write!(f, " ({} elements)", self.len())?;
        }
        Ok(())
    }
}

impl<T: Pod + PartialEq> PartialEq<[T]> for PeerSliceOf<'_, T> {
    fn eq(&self, other: &[T]) -> bool {
        self.len() == other.len() && self.iter().zip(other).all(|(a, b)| a == *b)
    }
}
impl<T: Pod + PartialEq> PartialEq<&[T]> for PeerSliceOf<'_, T> {
    fn eq(&self, other: &&[T]) -> bool {
        *self == **other
    }
}
impl<T: Pod + PartialEq, const N: usize> PartialEq<&[T; N]> for PeerSliceOf<'_, T> {
    fn eq(&self, other: &&[T; N]) -> bool {
        *self == other[..]
    }
}

/// The widest load the copy loop uses: one SSE2 register on x86-64 (every
/// x86-64 has SSE2), a machine word elsewhere.
#[cfg(target_arch = "x86_64")]
type Word = std::arch::x86_64::__m128i;
#[cfg(not(target_arch = "x86_64"))]
type Word = u64;

/// Copies `len` bytes from peer memory at `src` to our memory at `dst`,
/// reading every source byte exactly once with a volatile load: bytes up to
/// the first `Word`-aligned source address, then aligned `Word`s (four per
/// iteration, so the loads overlap), then the last bytes.
///
/// # Safety
/// `src..src + len` readable, `dst..dst + len` writable and ours, not
/// overlapping.
#[inline]
unsafe fn volatile_copy(src: *const u8, dst: *mut u8, len: usize) {
    const W: usize = std::mem::size_of::<Word>();
    let head = src.align_offset(W).min(len);
    let mut i = 0;
    // Why every block below is sound: `i` (plus the width read) stays below
    // `len`, so reads are inside `src..src+len` and writes inside
    // `dst..dst+len`; `Word` loads start at `head`, where `src` is aligned
    // for `Word`, and advance by whole words; stores are unaligned writes to
    // our own memory.
    while i < head {
        // SAFETY: `i < head <= len` (see above).
        unsafe { dst.add(i).write(src.add(i).read_volatile()) };
        i += 1;
    }
    while i + 4 * W <= len {
        // SAFETY: four aligned words from `i`, all below `len` (see above).
        unsafe {
            let s = src.add(i).cast::<Word>();
            let (a, b, c, d) = (s.read_volatile(), s.add(1).read_volatile(), s.add(2).read_volatile(), s.add(3).read_volatile());
            let t = dst.add(i).cast::<Word>();
            t.write_unaligned(a);
            t.add(1).write_unaligned(b);
            t.add(2).write_unaligned(c);
            t.add(3).write_unaligned(d);
        }
        i += 4 * W;
    }
    while i + W <= len {
        // SAFETY: one aligned word from `i`, below `len` (see above).
        unsafe { dst.add(i).cast::<Word>().write_unaligned(src.add(i).cast::<Word>().read_volatile()) };
        i += W;
    }
    while i < len {
        // SAFETY: `i < len` (see above).
        unsafe { dst.add(i).write(src.add(i).read_volatile()) };
        i += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytemuck::Zeroable;

    /// A view of `bytes` (test memory the test owns and does not write
    /// while the view lives).
    fn view(bytes: &[u8]) -> PeerSlice<'_> {
        PeerSlice::from_own(bytes)
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn copies_are_exact_at_every_length_and_alignment() {
        let data = pattern(3 * READ_CHUNK + 77);
        for start in 0..17 {
            for len in [0, 1, 7, 15, 16, 17, 63, 64, 65, 200, READ_CHUNK, READ_CHUNK + 1, 2 * READ_CHUNK + 70] {
                let want = &data[start..start + len];
                let v = view(&data).subslice(start, len).unwrap();
                assert_eq!(v.to_vec(), want, "to_vec start {start} len {len}");
                let mut out = vec![0xEEu8; len + 3];
                assert_eq!(v.copy_to(&mut out), len);
                assert_eq!(&out[..len], want);
                assert_eq!(&out[len..], &[0xEE; 3], "copy_to wrote past the view");
                let mut chunked = Vec::new();
                v.read_chunks(|c| {
                    assert!(c.len() <= READ_CHUNK && !c.is_empty());
                    chunked.extend_from_slice(c)
                });
                assert_eq!(chunked, want, "read_chunks start {start} len {len}");
                assert_eq!(v.iter().collect::<Vec<u8>>(), want);
                assert!(v == want && v.eq_bytes(want));
                let sum = v.fold_u64(0u64, |a, w| a.wrapping_add(w));
                let expect = want.chunks(8).fold(0u64, |a, w| {
                    let mut b = [0u8; 8];
                    b[..w.len()].copy_from_slice(w);
                    a.wrapping_add(u64::from_ne_bytes(b))
                });
                assert_eq!(sum, expect, "fold_u64 start {start} len {len}");
            }
        }
    }

    #[test]
    fn bounds_are_checked() {
        let data = pattern(100);
        let v = view(&data);
        assert!(v.subslice(100, 0).is_some_and(|s| s.is_empty()));
        assert!(v.subslice(100, 1).is_none());
        assert!(v.subslice(1, usize::MAX).is_none());
        assert!(v.subslice(usize::MAX, 2).is_none());
        assert_eq!(v.read_obj::<u64>(92), Some(u64::from_ne_bytes(data[92..100].try_into().unwrap())));
        assert_eq!(v.read_obj::<u64>(93), None);
        assert_eq!(v.read_obj::<u8>(usize::MAX), None);
        let (a, b) = v.split_at(40).unwrap();
        assert_eq!((a.len(), b.len()), (40, 60));
        assert!(b == data[40..]);
        assert!(v.split_at(101).is_none());
        assert!(v != data[..99]);
        let mut other = data.clone();
        other[57] ^= 1;
        assert!(v != other[..]);
    }

    #[test]
    fn read_obj_reads_aligned_and_unaligned_values() {
        #[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
        #[repr(C)]
        struct Pair {
            a: u64,
            b: u32,
            c: u32,
        }
        let words: Vec<u64> = (0..8).map(|i| 0x0101_0101_0101_0101 * i).collect();
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        let v = view(bytes);
        let at8: Pair = v.read_obj(8).unwrap();
        assert_eq!(at8, bytemuck::pod_read_unaligned(&bytes[8..24]));
        let at3: Pair = v.read_obj(3).unwrap();
        assert_eq!(at3, bytemuck::pod_read_unaligned(&bytes[3..19]));
    }

    #[test]
    fn typed_views_check_alignment_and_length_and_read_elements() {
        let words: Vec<u32> = (0..64).map(|i| i * 3).collect();
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        let v = view(bytes);
        let t = v.cast::<u32>().unwrap();
        assert_eq!(t.len(), 64);
        assert_eq!(t.get(5), Some(15));
        assert_eq!(t.get(64), None);
        assert_eq!(t.iter().collect::<Vec<u32>>(), words);
        assert_eq!(t.to_vec(), words);
        assert!(t == words[..]);
        assert_eq!(t.subslice(60, 4).unwrap().to_vec(), &words[60..]);
        assert!(t.subslice(61, 4).is_none());
        assert!(v.subslice(1, 8).unwrap().cast::<u32>().is_none(), "misaligned start");
        assert!(v.subslice(0, 7).unwrap().cast::<u32>().is_none(), "not a whole number of elements");
        assert!(v.cast::<()>().is_none(), "zero-sized");
        // SAFETY: `words` is not written while the slice lives.
        assert_eq!(unsafe { t.as_slice_unchecked() }, &words[..]);
        // SAFETY: as above.
        assert_eq!(unsafe { v.as_slice_unchecked() }, bytes);
    }

    #[test]
    fn copies_kept_are_counted_and_reads_in_place_are_not() {
        let counter = AtomicU64::new(0);
        let words: Vec<u64> = (0..125).collect();
        let data: &[u8] = bytemuck::cast_slice(&words);
        let v = view(data).counting(&counter);
        let _ = (v.read_obj::<u64>(8), v.iter().count(), v.fold_u64(0u64, |a, w| a ^ w), v == data);
        v.read_chunks(|_| {});
        assert_eq!(counter.load(Ordering::Relaxed), 0, "reads in place are not copies");
        assert_eq!(v.to_vec().len(), 1000);
        assert_eq!(counter.load(Ordering::Relaxed), 1000, "to_vec");
        let mut kept = vec![1u8];
        v.subslice(0, 10).unwrap().append_to(&mut kept);
        assert_eq!(kept, [&[1u8][..], &data[..10]].concat());
        counter.fetch_sub(10, Ordering::Relaxed);
        let sub = v.subslice(10, 100).unwrap();
        assert_eq!(sub.copy_to(&mut [0u8; 64]), 64);
        assert_eq!(counter.load(Ordering::Relaxed), 1064, "copy_to of a subslice: what it copied");
        let t = v.subslice(0, 800).unwrap().cast::<u64>().unwrap();
        assert_eq!(t.to_vec().len(), 100);
        assert_eq!(counter.load(Ordering::Relaxed), 1864, "typed to_vec");
        assert_eq!(t.copy_to(&mut [0u64; 3]), 3);
        assert_eq!(counter.load(Ordering::Relaxed), 1888, "typed copy_to");
        let _ = format!("{v:?}");
        assert_eq!(counter.load(Ordering::Relaxed), 1888, "Debug is not a copy the caller keeps");
    }
}
