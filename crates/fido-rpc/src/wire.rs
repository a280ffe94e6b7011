//! What travels: call and reply headers, and the handles (global pointer +
//! length) that arguments and results use to refer to arena memory.
//!
//! Everything here is plain old data ([`bytemuck::Pod`]): no padding, no
//! local pointers, every bit pattern valid. A handle is only a claim about
//! the sender's memory; the receiver checks it against the sender's grant
//! ([`crate::View`]) before it reads a byte.

use bytemuck::{Pod, Zeroable};
use fido::PeerSlice;
use std::marker::PhantomData;

/// First word of every call and reply header ("FRPC").
pub const MAGIC: u32 = 0x4350_5246;
/// Header bytes at the start of a frame's first chunk (the root follows
/// elsewhere in the frame; the header says where).
pub const HEADER_LEN: usize = 64;

/// Descriptor opcodes, client → server.
pub const OP_CALL: u16 = 1;
pub const OP_ONEWAY: u16 = 2;
pub const OP_CANCEL: u16 = 3;
/// Descriptor opcode, server → client.
pub const OP_REPLY: u16 = 1;

/// Signature value that skips the server's signature check (C callers).
pub const SIG_ANY: u32 = 0;

/// Reply status.
pub const STATUS_OK: u32 = 0;
pub const STATUS_APP_ERROR: u32 = 1;
pub const STATUS_FAULT: u32 = 2;

/// The header of a call (client → server). The call id travels in the
/// descriptor's tag, the kind in its opcode.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct CallHeader {
    pub magic: u32,
    /// Index of the method in the service (declaration order).
    pub method: u32,
    /// Hash of the method's declaration; the server refuses a mismatch
    /// ([`SIG_ANY`] skips the check).
    pub sig: u32,
    pub _reserved: u32,
    /// Absolute deadline on CLOCK_MONOTONIC in ns (shared by every process of
    /// the host); 0 = none.
    pub deadline_ns: u64,
    /// Global address and length of the root (the packed arguments).
    pub root_addr: u64,
    pub root_len: u64,
    pub _pad: [u64; 3],
}

/// The header of a reply (server → client).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct ReplyHeader {
    pub magic: u32,
    /// [`STATUS_OK`] (root = result), [`STATUS_APP_ERROR`] (root = the
    /// application error), [`STATUS_FAULT`] (root = a UTF-8 message).
    pub status: u32,
    /// A [`crate::Fault`] code when `status` is [`STATUS_FAULT`].
    pub fault: u32,
    pub _reserved: u32,
    pub root_addr: u64,
    pub root_len: u64,
    pub _pad: [u64; 4],
}

/// The inline forms. A call or reply that built nothing in the arena and
/// whose root is at most [`INLINE_ROOT`] bytes travels inside the ring
/// descriptor ([`fido::Message::inline`]): nothing is allocated, and the
/// receiver has the whole call with the descriptor — one cache line from
/// the peer instead of three (descriptor, header, root). A null call and its
/// reply take this path. Layout, 16-byte header then the root:
///
/// * call:  `method: u32, sig: u32, deadline_ns: u64, root`
/// * reply: `status: u32, fault: u32, flags: u64, root` ([`REPLY_HELD`])
///
/// The kind is known from the descriptor (inline or not), so there is no
/// magic.
pub const INLINE_HEADER_LEN: usize = 16;
/// Inline reply flag: the server holds something for this reply (a cache
/// entry its root points into) until the client releases it, so the client
/// releases it as soon as it is dropped. Without it an inline reply holds
/// nothing of the server's but its ring slot, and the synchronous client
/// lets its release wait for the next call ([`fido::Msg::defer_release`]).
pub const REPLY_HELD: u64 = 1;
/// Largest root of an inline call or reply.
pub const INLINE_ROOT: usize = fido::INLINE_BYTES - INLINE_HEADER_LEN;

/// An inline call's or reply's bytes: its header words (call: method, sig,
/// deadline_ns; reply: status, fault, flags), then the root. Built on the stack
/// and sent with [`fido::Channel::send_inline`] (no `Message` is built).
#[derive(Clone, Copy)]
pub(crate) struct InlineBytes {
    bytes: [u8; fido::INLINE_BYTES],
    len: usize,
}

impl InlineBytes {
    /// `None` if `root` is longer than [`INLINE_ROOT`].
    #[inline]
    pub(crate) fn new(a: u32, b: u32, c: u64, root: &[u8]) -> Option<InlineBytes> {
        let mut bytes = [0u8; fido::INLINE_BYTES];
        bytes[0..4].copy_from_slice(&a.to_ne_bytes());
        bytes[4..8].copy_from_slice(&b.to_ne_bytes());
        bytes[8..16].copy_from_slice(&c.to_ne_bytes());
        if root.len() > INLINE_ROOT {
            return None;
        }
        // At most 16 bytes (none for a null call): a byte loop, not a
        // `memcpy` call.
        for (to, from) in bytes[INLINE_HEADER_LEN..].iter_mut().zip(root) {
            *to = *from;
        }
        Some(InlineBytes { bytes, len: INLINE_HEADER_LEN + root.len() })
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// The header words and root of an inline call or reply (the inverse of
/// [`InlineBytes::new`]); `None` if the bytes are shorter than the header.
pub(crate) fn split_inline(bytes: &[u8]) -> Option<(u32, u32, u64, &[u8])> {
    let (h, root) = bytes.split_first_chunk::<INLINE_HEADER_LEN>()?;
    let word = |i: usize| u32::from_ne_bytes(h[i..i + 4].try_into().expect("4 bytes"));
    Some((word(0), word(4), u64::from_ne_bytes(h[8..16].try_into().expect("8 bytes")), root))
}

const _: () = assert!(std::mem::size_of::<CallHeader>() == HEADER_LEN);
const _: () = assert!(std::mem::size_of::<ReplyHeader>() == HEADER_LEN);

/// A slice of `T` in the sender's arena: a global address and an element
/// count. Built with [`crate::Frame`] (or [`crate::ShmVec`]); read by the
/// receiver with [`crate::View::slice`], which checks the whole range once
/// and then hands out `&[T]` in place.
#[repr(C)]
pub struct ShmSlice<T> {
    addr: u64,
    len: u64,
    _t: PhantomData<T>,
}

impl<T> Clone for ShmSlice<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for ShmSlice<T> {}
impl<T> std::fmt::Debug for ShmSlice<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShmSlice {{ addr: {:#x}, len: {} }}", self.addr, self.len)
    }
}
impl<T> PartialEq for ShmSlice<T> {
    fn eq(&self, o: &Self) -> bool {
        self.addr == o.addr && self.len == o.len
    }
}
impl<T> Eq for ShmSlice<T> {}
// SAFETY: two u64s and a zero-sized marker, repr(C): no padding, no pointers
// the compiler knows of, every bit pattern valid (validity is checked on use).
unsafe impl<T: 'static> Zeroable for ShmSlice<T> {}
// SAFETY: as above.
unsafe impl<T: 'static> Pod for ShmSlice<T> {}

impl<T> ShmSlice<T> {
    /// A handle from raw parts. Nothing is checked here: the receiver checks.
    pub const fn from_raw(addr: u64, len: u64) -> Self {
        ShmSlice { addr, len, _t: PhantomData }
    }
    pub const fn empty() -> Self {
        Self::from_raw(0, 0)
    }
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Element count.
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl ShmSlice<u8> {
    /// The bytes of a buffer in our arena, e.g. a cache entry a server returns
    /// without copying (keep the buffer alive with [`crate::Ctx::hold`]).
    pub fn of_buf(buf: &fido::Buf) -> Self {
        Self::from_raw(buf.gptr().addr(), buf.len() as u64)
    }
    /// `len` bytes at `off` in a buffer of our arena (clamped to the buffer).
    pub fn of_buf_range(buf: &fido::Buf, off: usize, len: usize) -> Self {
        let off = off.min(buf.len());
        let len = len.min(buf.len() - off);
        Self::from_raw(buf.gptr().addr() + off as u64, len as u64)
    }
}

/// A byte string in the sender's arena (the paper's strings; POD fields plus
/// `ShmStr` make its VarSeq). The receiver gets the bytes in place
/// ([`crate::View::str`]); UTF-8 is checked on a copy
/// ([`crate::ShmStrRef::to_string`]), never on memory the sender can still
/// change.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct ShmStr {
    pub addr: u64,
    pub len: u64,
}

impl ShmStr {
    pub const fn empty() -> Self {
        ShmStr { addr: 0, len: 0 }
    }
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The application-error type of methods that cannot fail.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct NoAppError(pub u8);

/// Packs a method's arguments (or a result) into the root: each value at the
/// next offset aligned for its type, in declaration order.
#[derive(Default)]
pub struct RootWriter {
    bytes: RootBytes,
}

/// A root's bytes: inline up to 64 (every root of a few scalars and handles),
/// so packing one allocates nothing.
pub type RootBytes = smallvec::SmallVec<[u8; 64]>;

/// Call ids as map keys (the client's tables of waiting calls and their
/// replies): our own numbers, sequential within each thread's block, so a
/// multiplicative hash spreads them well and costs one multiply instead of
/// SipHash.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ *b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A map keyed by call id.
pub(crate) type IdMap<V> = std::collections::HashMap<u64, V, std::hash::BuildHasherDefault<IdHasher>>;
/// A set of call ids.
pub(crate) type IdSet = std::collections::HashSet<u64, std::hash::BuildHasherDefault<IdHasher>>;

impl RootWriter {
    pub fn new() -> Self {
        RootWriter { bytes: RootBytes::new() }
    }
    pub fn put<T: Pod>(&mut self, v: &T) {
        pack_into(&mut self.bytes, v);
    }
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// Appends `v` to a root, aligned to its type ([`RootWriter::put`]).
#[inline]
pub(crate) fn pack_into<T: Pod>(bytes: &mut RootBytes, v: &T) {
    let at = bytes.len().next_multiple_of(std::mem::align_of::<T>());
    bytes.resize(at, 0);
    bytes.extend_from_slice(bytemuck::bytes_of(v));
}

/// Reads values packed by [`RootWriter`], copying each out once (so a sender
/// changing its memory afterwards cannot change what was read).
pub struct RootReader<'a> {
    bytes: PeerSlice<'a>,
    at: usize,
}

impl<'a> RootReader<'a> {
    /// A reader of `bytes`: a framed root in the peer's memory, or an
    /// inline root ([`PeerSlice::from_own`]). Each value is read once.
    pub fn new(bytes: PeerSlice<'a>) -> Self {
        RootReader { bytes, at: 0 }
    }
    pub fn get<T: Pod>(&mut self) -> Result<T, crate::Fault> {
        let at = self.at.next_multiple_of(std::mem::align_of::<T>());
        let v = self.bytes.read_obj(at).ok_or(crate::Fault::BadArguments)?;
        self.at = at + std::mem::size_of::<T>();
        Ok(v)
    }
    /// Every byte consumed: a longer root means caller and server disagree.
    pub fn finish(self) -> Result<(), crate::Fault> {
        if self.at == self.bytes.len() {
            Ok(())
        } else {
            Err(crate::Fault::BadArguments)
        }
    }
}

/// Nanoseconds on CLOCK_MONOTONIC (the clock deadlines are expressed in).
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// FNV-1a of a method declaration: the signature check's hash (never 0).
pub const fn sig_hash(s: &str) -> u32 {
    let b = s.as_bytes();
    let mut h: u32 = 0x811c_9dc5;
    let mut i = 0;
    while i < b.len() {
        h ^= b[i] as u32;
        h = h.wrapping_mul(0x0100_0193);
        i += 1;
    }
    if h == 0 {
        1
    } else {
        h
    }
}
