//! Building arguments and results in our own arena, and reading the peer's.
//!
//! A [`Frame`] is a bump allocator over buffers of our arena: arguments (or
//! results) are written straight into memory the peer will read, and the
//! buffers travel as the segments of the call (or reply) message, so they are
//! freed when the peer releases it. A [`View`] is the receiving side: every
//! handle is checked against the sender's grant, once per range.

use crate::error::{Fault, RpcError};
use crate::wire::{ShmSlice, ShmStr, HEADER_LEN};
use bytemuck::Pod;
use fido::{Buf, PeerSlice, PeerSliceOf};
use fido_shm::Arena;
use std::sync::Arc;

/// First chunk: header plus a small root (a null call allocates only this).
const FIRST_CHUNK: usize = 256;
/// Later chunks start at this size and double.
const MIN_CHUNK: usize = 4096;
/// Largest alignment a frame hands out (the allocator's).
const MAX_ALIGN: usize = 64;

/// Memory being prepared for the peer: a list of arena buffers, the first one
/// starting with the header. Nothing is allocated until something is built in
/// it (a call or reply that builds nothing travels inline, see
/// [`crate::wire::INLINE_ROOT`]). Dropping an unsent frame frees its buffers.
pub struct Frame {
    arena: Arc<Arena>,
    chunks: Vec<Buf>,
    /// Buffers built elsewhere (ShmVec) that travel with the frame.
    adopted: Vec<Buf>,
    /// Bytes used in the last chunk.
    used: usize,
    next_chunk: usize,
    /// The last chunk's local address, length and global address, cached:
    /// a VarSeq reserves one string per element, and asking the `Buf` each
    /// time costs a chain of dependent loads (arena, mapping, base).
    cur: Cursor,
}

#[derive(Clone, Copy)]
struct Cursor {
    local: *mut u8,
    len: usize,
    global: u64,
}

impl Cursor {
    const NONE: Cursor = Cursor { local: std::ptr::null_mut(), len: 0, global: 0 };
}

// SAFETY: the cursor points into the last of `chunks`, which the frame owns
// exclusively (a `Buf` is `Send`); it is only dereferenced through `&mut self`.
unsafe impl Send for Frame {}
// SAFETY: `&Frame` never writes through the cursor (only `&mut self` methods do).
unsafe impl Sync for Frame {}

impl Frame {
    /// A frame in `arena` (a domain's: `Domain::arena()`).
    #[inline]
    pub fn new(arena: &Arc<Arena>) -> Result<Frame, RpcError> {
        Self::with_capacity(arena, 0)
    }

    /// A frame whose first buffer has room for `bytes` beyond the header, so
    /// arguments of known size need one allocation.
    #[inline]
    pub fn with_capacity(arena: &Arc<Arena>, bytes: usize) -> Result<Frame, RpcError> {
        let mut f = Frame { arena: arena.clone(), chunks: Vec::new(), adopted: Vec::new(), used: 0, next_chunk: MIN_CHUNK, cur: Cursor::NONE };
        if bytes > 0 {
            f.first_chunk(bytes)?;
        }
        Ok(f)
    }

    /// Allocates the first chunk: the header, then room for `bytes`.
    #[cold]
    fn first_chunk(&mut self, bytes: usize) -> Result<(), RpcError> {
        let size = HEADER_LEN.checked_add(bytes).ok_or_else(|| RpcError::Invalid("frame too large".into()))?.max(FIRST_CHUNK);
        let buf = self.arena.alloc(size).map_err(|e| RpcError::Memory(e.to_string()))?;
        self.chunks.push(buf);
        self.used = HEADER_LEN;
        self.refresh_cursor();
        Ok(())
    }

    /// Points the cursor at the last chunk (after one was added).
    fn refresh_cursor(&mut self) {
        self.cur = match self.chunks.last_mut() {
            Some(b) => Cursor { local: b.as_mut_ptr(), len: b.len(), global: b.gptr().addr() },
            None => Cursor::NONE,
        };
    }

    /// Like `reserve`, but returns where the bytes are: their local address
    /// (writable: in a chunk this frame owns, handed out once) and global
    /// address. The hot path of building slices and strings.
    #[inline(always)]
    fn reserve_raw(&mut self, len: usize, align: usize) -> Result<(*mut u8, u64), RpcError> {
        let (c, off) = self.reserve(len, align)?;
        debug_assert_eq!(c, self.chunks.len() - 1);
        // SAFETY: `reserve` hands out room in the last chunk, the one under
        // the cursor, with `off + len` ≤ its length.
        Ok((unsafe { self.cur.local.add(off) }, self.cur.global + off as u64))
    }

    /// True while nothing was built in the frame or adopted by it: a call or
    /// reply of it may travel inline.
    pub(crate) fn is_untouched(&self) -> bool {
        self.chunks.is_empty() && self.adopted.is_empty()
    }

    /// Reserves `len` bytes aligned to `align` (a power of two ≤ 64); returns
    /// the chunk index and offset. Inlined: a VarSeq reserves one string per
    /// element, and with the alignment known the rounding is one mask.
    #[inline(always)]
    fn reserve(&mut self, len: usize, align: usize) -> Result<(usize, usize), RpcError> {
        if align > MAX_ALIGN || !align.is_power_of_two() {
            return Err(RpcError::Invalid(format!("alignment {align} (must be a power of two ≤ {MAX_ALIGN})")));
        }
        // `used` ≤ the chunk's length, far below usize::MAX: no overflow.
        let at = (self.used + align - 1) & !(align - 1);
        if let Some(last) = self.chunks.len().checked_sub(1) {
            // `cur.len` is the last chunk's length (cached: see `cur`).
            if at.checked_add(len).is_some_and(|end| end <= self.cur.len) {
                self.used = at + len;
                return Ok((last, at));
            }
        }
        self.new_chunk(len)
    }

    /// `reserve`'s slow path: a new chunk for `len` bytes.
    #[cold]
    fn new_chunk(&mut self, len: usize) -> Result<(usize, usize), RpcError> {
        if self.chunks.is_empty() {
            // The header takes the first 64 bytes; `len` follows, aligned
            // for anything (MAX_ALIGN = HEADER_LEN).
            self.first_chunk(len)?;
            self.used = HEADER_LEN + len;
            return Ok((0, HEADER_LEN));
        }
        let last = self.chunks.len() - 1;
        // A new chunk: the last one keeps only what it used (its tail is not
        // sent).
        let size = len.max(self.next_chunk);
        self.next_chunk = (self.next_chunk * 2).min(16 << 20);
        let buf = self.arena.alloc(size).map_err(|e| RpcError::Memory(e.to_string()))?;
        let used = self.used;
        self.chunks[last].truncate(used);
        self.chunks.push(buf);
        self.used = len;
        self.refresh_cursor();
        Ok((self.chunks.len() - 1, 0))
    }

    #[inline]
    fn gaddr(&self, chunk: usize, off: usize) -> u64 {
        self.chunks[chunk].gptr().addr() + off as u64
    }

    /// `n` elements of `T` in the frame, zeroed, to fill in place.
    pub fn alloc_slice<T: Pod>(&mut self, n: usize) -> Result<(ShmSlice<T>, &mut [T]), RpcError> {
        let bytes = n.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| RpcError::Invalid("slice too large".into()))?;
        if bytes == 0 {
            return Ok((ShmSlice::from_raw(0, n as u64), &mut []));
        }
        let (c, off) = self.reserve(bytes, std::mem::align_of::<T>())?;
        let addr = self.gaddr(c, off);
        let dst = &mut self.chunks[c][off..off + bytes];
        dst.fill(0);
        let dst: &mut [T] = bytemuck::cast_slice_mut(dst);
        Ok((ShmSlice::from_raw(addr, n as u64), dst))
    }

    /// `n` elements, element `i` being `f(i)`, written straight into the
    /// frame: like [`Frame::alloc_slice`] followed by a loop over it, without
    /// zeroing the memory first (one pass over it instead of two).
    pub fn fill_slice<T: Pod>(&mut self, n: usize, mut f: impl FnMut(usize) -> T) -> Result<ShmSlice<T>, RpcError> {
        let bytes = n.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| RpcError::Invalid("slice too large".into()))?;
        if bytes == 0 {
            return Ok(ShmSlice::from_raw(0, n as u64));
        }
        let (c, off) = self.reserve(bytes, std::mem::align_of::<T>())?;
        let addr = self.gaddr(c, off);
        // The arena's bytes are plain memory (any value is a valid `u8`, and
        // so a valid `T: Pod`); every element is overwritten below.
        let dst: &mut [T] = bytemuck::cast_slice_mut(&mut self.chunks[c][off..off + bytes]);
        for (i, e) in dst.iter_mut().enumerate() {
            *e = f(i);
        }
        Ok(ShmSlice::from_raw(addr, n as u64))
    }

    /// A copy of `data` in the frame. Always inlined: with the length known
    /// at the call site (a VarSeq's fixed-size strings) the copy is a couple
    /// of moves instead of a `memmove` call per string.
    #[inline(always)]
    pub fn slice<T: Pod>(&mut self, data: &[T]) -> Result<ShmSlice<T>, RpcError> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if bytes.is_empty() {
            return Ok(ShmSlice::from_raw(0, data.len() as u64));
        }
        let (dst, addr) = self.reserve_raw(bytes.len(), std::mem::align_of::<T>())?;
        // SAFETY: `reserve_raw` handed out `bytes.len()` writable bytes at
        // `dst`, in our own chunk, to nobody else; `bytes` is our caller's
        // memory, not the frame's, so they do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) };
        Ok(ShmSlice::from_raw(addr, data.len() as u64))
    }

    /// `n` elements built one by one by `f`, which may itself allocate in the
    /// frame (e.g. the string of each element of a VarSeq).
    pub fn slice_with<T: Pod>(
        &mut self,
        n: usize,
        mut f: impl FnMut(usize, &mut Frame) -> Result<T, RpcError>,
    ) -> Result<ShmSlice<T>, RpcError> {
        let size = std::mem::size_of::<T>();
        let bytes = n.checked_mul(size).ok_or_else(|| RpcError::Invalid("slice too large".into()))?;
        if bytes == 0 {
            for i in 0..n {
                f(i, self)?;
            }
            return Ok(ShmSlice::from_raw(0, n as u64));
        }
        let (dst, addr) = self.reserve_raw(bytes, std::mem::align_of::<T>())?;
        let dst = dst as *mut T;
        for i in 0..n {
            let v = f(i, self)?;
            // SAFETY: element `i` < n lies in the `n * size` bytes reserved
            // above, which are never handed out again; chunk memory never
            // moves (arena buffers), whatever `f` adds to the frame (it may
            // add chunks, or shorten this one's logical length to what is
            // used, which includes this range). Aligned for `T`: chunks are
            // 64-byte aligned, `reserve_raw` aligned the offset, and
            // `align_of::<T>()` ≤ 64 (checked). A typed store, not a
            // `memmove` call per element.
            unsafe { dst.add(i).write(v) };
        }
        Ok(ShmSlice::from_raw(addr, n as u64))
    }

    /// A copy of `s`.
    #[inline]
    pub fn str(&mut self, s: &str) -> Result<ShmStr, RpcError> {
        let h = self.slice(s.as_bytes())?;
        Ok(ShmStr { addr: h.addr(), len: h.len() })
    }

    /// A copy of `b`.
    #[inline(always)]
    pub fn bytes(&mut self, b: &[u8]) -> Result<ShmSlice<u8>, RpcError> {
        self.slice(b)
    }

    /// Moves a vector built in the arena into the frame (no copy): it travels
    /// with the message and is freed when the peer releases it.
    pub fn adopt<T: Pod>(&mut self, v: ShmVec<T>) -> ShmSlice<T> {
        let h = v.handle();
        if let Some(mut buf) = v.buf {
            buf.truncate((v.len * std::mem::size_of::<T>()).max(1));
            self.adopted.push(buf);
        }
        h
    }

    /// Payload bytes in the frame so far (the header included once anything
    /// was built; 0 before).
    pub fn len(&self) -> usize {
        let full = self.chunks.len().saturating_sub(1);
        self.chunks[..full].iter().chain(&self.adopted).map(|b| b.len()).sum::<usize>() + self.used
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The arena this frame allocates in.
    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    /// Writes the root and the header, and gives up the buffers (first one
    /// first) for sending. `header` gets the root's address and length.
    pub(crate) fn finish(mut self, root: &[u8], header: impl FnOnce(u64, u64) -> [u8; HEADER_LEN]) -> Result<Vec<Buf>, RpcError> {
        let root_addr = if root.is_empty() {
            0
        } else {
            let (c, off) = self.reserve(root.len(), 16)?;
            self.chunks[c][off..off + root.len()].copy_from_slice(root);
            self.gaddr(c, off)
        };
        if self.chunks.is_empty() {
            self.first_chunk(0)?;
        }
        let h = header(root_addr, root.len() as u64);
        self.chunks[0][..HEADER_LEN].copy_from_slice(&h);
        let last = self.chunks.len() - 1;
        let used = self.used;
        self.chunks[last].truncate(used);
        let mut out = std::mem::take(&mut self.chunks);
        self.cur = Cursor::NONE;
        out.append(&mut self.adopted);
        Ok(out)
    }
}

impl std::fmt::Debug for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Frame {{ chunks: {}, len: {} }}", self.chunks.len(), self.len())
    }
}

/// A growable vector in our arena (for results or arguments whose length is
/// not known up front). [`Frame::adopt`] sends it without copying.
pub struct ShmVec<T: Pod> {
    arena: Arc<Arena>,
    buf: Option<Buf>,
    len: usize,
    cap: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: Pod> ShmVec<T> {
    pub fn new(arena: &Arc<Arena>) -> Self {
        ShmVec { arena: arena.clone(), buf: None, len: 0, cap: 0, _t: std::marker::PhantomData }
    }
    pub fn with_capacity(arena: &Arc<Arena>, cap: usize) -> Result<Self, RpcError> {
        let mut v = Self::new(arena);
        v.reserve(cap)?;
        Ok(v)
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Room for `more` further elements (grows by doubling: one copy per
    /// doubling, in our own arena).
    pub fn reserve(&mut self, more: usize) -> Result<(), RpcError> {
        let size = std::mem::size_of::<T>().max(1);
        let need = self.len.checked_add(more).ok_or_else(|| RpcError::Invalid("vector too large".into()))?;
        if need <= self.cap {
            return Ok(());
        }
        if std::mem::align_of::<T>() > MAX_ALIGN {
            return Err(RpcError::Invalid("alignment > 64".into()));
        }
        let cap = need.max(self.cap * 2).max(64 / size).max(1);
        let bytes = cap.checked_mul(size).ok_or_else(|| RpcError::Invalid("vector too large".into()))?;
        let mut nb = self.arena.alloc(bytes).map_err(|e| RpcError::Memory(e.to_string()))?;
        if let Some(old) = &self.buf {
            let n = self.len * std::mem::size_of::<T>();
            nb[..n].copy_from_slice(&old[..n]);
        }
        self.buf = Some(nb);
        self.cap = cap;
        Ok(())
    }
    pub fn push(&mut self, v: T) -> Result<(), RpcError> {
        self.reserve(1)?;
        let len = self.len;
        self.len += 1;
        self.as_mut_slice()[len] = v;
        Ok(())
    }
    pub fn extend_from_slice(&mut self, s: &[T]) -> Result<(), RpcError> {
        self.reserve(s.len())?;
        let len = self.len;
        self.len += s.len();
        self.as_mut_slice()[len..].copy_from_slice(s);
        Ok(())
    }
    pub fn as_slice(&self) -> &[T] {
        match &self.buf {
            Some(b) if std::mem::size_of::<T>() > 0 => bytemuck::cast_slice(&b[..self.len * std::mem::size_of::<T>()]),
            _ => &[],
        }
    }
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        let n = self.len * std::mem::size_of::<T>();
        match &mut self.buf {
            Some(b) if n > 0 => bytemuck::cast_slice_mut(&mut b[..n]),
            _ => &mut [],
        }
    }
    /// The handle a peer resolves (valid while the vector's memory is alive:
    /// send it with [`Frame::adopt`]).
    pub fn handle(&self) -> ShmSlice<T> {
        match &self.buf {
            Some(b) => ShmSlice::from_raw(b.gptr().addr(), self.len as u64),
            None => ShmSlice::from_raw(0, self.len as u64),
        }
    }
}

/// Memory of the peer that sent a message: resolves global ranges to views
/// of its bytes after checking them against the peer's grant.
pub trait PeerMemory {
    /// The bytes, or `None` if `[addr, addr+len)` is not inside the grant.
    fn bytes(&self, addr: u64, len: u64) -> Option<PeerSlice<'_>>;
    /// The whole grant as one contiguous window (its global address and its
    /// bytes), when there is one: [`View`] then checks ranges inline instead
    /// of calling [`PeerMemory::bytes`] for each.
    fn window(&self) -> Option<(u64, PeerSlice<'_>)> {
        None
    }
}

impl PeerMemory for fido::Msg {
    #[inline]
    fn bytes(&self, addr: u64, len: u64) -> Option<PeerSlice<'_>> {
        self.resolve(fido::GPtr(addr), len)
    }
    #[inline]
    fn window(&self) -> Option<(u64, PeerSlice<'_>)> {
        let (g, b) = self.peer_arena();
        Some((g.addr(), b))
    }
}

/// Read-only access to the handles a peer sent: each handle is checked once
/// (range inside the sender's arena, alignment of `T`), then read in place
/// through a [`PeerSlice`] / [`PeerSliceOf`] (the sender can still write its
/// memory: every value is read once, never referenced).
#[derive(Clone, Copy)]
pub struct View<'a> {
    mem: &'a dyn PeerMemory,
    /// The sender's grant as one window (global base, bytes), if it is one.
    window: Option<(u64, PeerSlice<'a>)>,
}

impl<'a> View<'a> {
    pub fn new(mem: &'a dyn PeerMemory) -> Self {
        View { mem, window: mem.window() }
    }

    /// `[addr, addr+len)` of the sender's grant (`len` > 0), checked: inline
    /// against the window when there is one (a VarSeq checks one string per
    /// element: no indirect call), else by the memory itself.
    #[inline]
    fn range(&self, addr: u64, len: u64) -> Option<PeerSlice<'a>> {
        match self.window {
            Some((base, bytes)) => {
                let off = addr.checked_sub(base)?;
                bytes.subslice(usize::try_from(off).ok()?, usize::try_from(len).ok()?)
            }
            None => self.mem.bytes(addr, len),
        }
    }

    /// The elements of `h`, in place. One range check for the whole slice.
    #[inline]
    pub fn slice<T: Pod>(&self, h: ShmSlice<T>) -> Result<PeerSliceOf<'a, T>, Fault> {
        let size = std::mem::size_of::<T>() as u64;
        if h.is_empty() {
            return Ok(PeerSliceOf::empty());
        }
        if size == 0 {
            return Err(Fault::BadPointer);
        }
        let bytes = h.len().checked_mul(size).ok_or(Fault::BadPointer)?;
        let b = self.range(h.addr(), bytes).ok_or(Fault::BadPointer)?;
        b.cast::<T>().ok_or(Fault::BadPointer)
    }

    /// The bytes of a string, in place.
    #[inline]
    pub fn str(&self, s: ShmStr) -> Result<ShmStrRef<'a>, Fault> {
        if s.len == 0 {
            return Ok(ShmStrRef(PeerSlice::empty()));
        }
        self.range(s.addr, s.len).map(ShmStrRef).ok_or(Fault::BadPointer)
    }

    /// Raw bytes of the sender's arena.
    pub fn bytes(&self, addr: u64, len: u64) -> Result<PeerSlice<'a>, Fault> {
        if len == 0 {
            return Ok(PeerSlice::empty());
        }
        self.range(addr, len).ok_or(Fault::BadPointer)
    }
}

/// A string read in place from the sender's arena. Its bytes are a
/// [`PeerSlice`]; UTF-8 is checked on a copy ([`ShmStrRef::to_string`])
/// because the sender could change bytes after an in-place check.
#[derive(Clone, Copy, Debug)]
pub struct ShmStrRef<'a>(PeerSlice<'a>);

impl<'a> ShmStrRef<'a> {
    pub fn as_bytes(&self) -> PeerSlice<'a> {
        self.0
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// Copies (counted in `bytes_copied`), then checks UTF-8.
    #[allow(clippy::inherent_to_string_shadow_display, clippy::inherent_to_string)]
    pub fn to_string(&self) -> Result<String, Fault> {
        String::from_utf8(self.0.to_vec()).map_err(|_| Fault::BadArguments)
    }
}

impl PartialEq<&str> for ShmStrRef<'_> {
    fn eq(&self, o: &&str) -> bool {
        self.0.eq_bytes(o.as_bytes())
    }
}
