//! Owned buffers in our own arena. The slice views need `unsafe`; it is sound
//! because the allocator hands each byte range to exactly one live `Buf`.

use crate::alloc::Block;
use crate::{Arena, GPtr};
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

/// An owned buffer in our arena, freed back to the allocator on drop.
/// Send + Sync; derefs to `[u8]` (its logical length). Contents are whatever
/// the memory held before (zero for never-used memory), never uninitialised.
pub struct Buf {
    arena: Arc<Arena>,
    off: u64,
    len: usize,
    block: Block,
}

// SAFETY: a Buf exclusively owns its byte range (allocator invariant); `&Buf` only
// gives shared reads, `&mut Buf` the only writes, exactly like `Vec<u8>`.
unsafe impl Send for Buf {}
// SAFETY: as above.
unsafe impl Sync for Buf {}

impl Buf {
    pub(crate) fn new(arena: Arc<Arena>, off: u64, len: usize, block: Block) -> Buf {
        debug_assert!(off + block.size() <= arena.len() && len as u64 <= block.size());
        Buf {
            arena,
            off,
            len,
            block,
        }
    }

    /// The global pointer of the first byte (valid in every domain that maps us).
    pub fn gptr(&self) -> GPtr {
        GPtr(self.arena.base().0 + self.off)
    }
    /// Offset in the arena.
    pub fn offset(&self) -> u64 {
        self.off
    }
    /// Logical length.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Bytes actually reserved for this buffer (≥ the requested length).
    pub fn capacity(&self) -> usize {
        self.block.size() as usize
    }
    pub fn as_ptr(&self) -> *const u8 {
        self.local()
    }
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.local()
    }
    fn local(&self) -> *mut u8 {
        // In bounds of our own RW mapping (checked at construction); no deref here.
        self.arena
            .mapping()
            .local_nonnull()
            .as_ptr()
            .wrapping_add(self.off as usize)
    }
    /// Shrink the logical length (not the allocation), e.g. after filling fewer
    /// bytes. Growing is ignored.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }
}

impl Deref for Buf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `local()..+len` is inside our arena's live RW mapping (the Arc
        // keeps the Mapping alive), owned exclusively by this Buf; the memory is
        // always initialised (memfd pages read as zero). Peers only read it.
        unsafe { std::slice::from_raw_parts(self.local(), self.len) }
    }
}

impl DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.local(), self.len) }
    }
}

impl AsRef<[u8]> for Buf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl AsMut<[u8]> for Buf {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}

impl std::fmt::Debug for Buf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buf")
            .field("gptr", &self.gptr())
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        self.arena.free(self.off, self.block);
    }
}
