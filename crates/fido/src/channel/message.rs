//! Messages: what a sender hands to a channel ([`Message`]), what comes back
//! when it cannot go or was never released ([`SendError`], [`Undelivered`]),
//! and what a receiver gets ([`Msg`]), a read-only view of the sender's
//! buffers that releases them when dropped.

use super::conn::ConnShared;
use super::recv::within;
use crate::error::{Error, InvalidArgument, Result};
use fido_ring::{Descriptor, Segment, INLINE_BYTES};
use fido_shm::{Buf, GPtr, Mapping, PeerSlice};
use smallvec::SmallVec;
use std::ptr::NonNull;
use std::sync::Arc;

/// What one message is made of.
pub(super) enum Parts {
    Bufs(SmallVec<[Buf; 2]>),
    /// Boxed: a `Msg` is large, and every `Message` is moved a few times.
    Forward(Box<Msg>),
    /// A received message (or a part of it) that other sends share
    /// ([`Message::shared`], [`Message::shared_part`]). Boxed like `Forward`.
    Shared(Box<SharedParts>),
    /// Bytes carried in the descriptor itself (`FLAG_INLINE`).
    Inline { bytes: [u8; INLINE_BYTES], len: u8 },
}

/// What a shared forward sends: our own buffers first (a new header, say),
/// then parts of one or more received messages, by pointer.
pub(super) struct SharedParts {
    pub(super) head: SmallVec<[Buf; 1]>,
    pub(super) pieces: SmallVec<[SharedPiece; 1]>,
}

/// A part of one received message in a shared forward.
pub(super) struct SharedPiece {
    /// One of the references to the received message; the last one dropped,
    /// here or in another send's slot or by the application, releases it
    /// upstream.
    pub(super) msg: Arc<Msg>,
    /// `(offset, len)` in the payload; `None`: all of it, sent exactly as it
    /// was received (inline bytes and SG list included).
    pub(super) part: Option<(u64, u64)>,
}

impl SharedParts {
    /// The received message sent whole and as received, if that is what
    /// this is (its descriptor's layout is reused).
    pub(super) fn as_received(&self) -> Option<&Msg> {
        match (self.head.is_empty(), &self.pieces[..]) {
            (true, [SharedPiece { msg, part: None }]) => Some(msg),
            _ => None,
        }
    }
    /// The global segments this sends, in order.
    pub(super) fn segments(&self) -> SmallVec<[Segment; 4]> {
        let mut out: SmallVec<[Segment; 4]> = self.head.iter().map(|b| Segment { addr: b.gptr().addr(), len: b.len() as u64 }).collect();
        for piece in &self.pieces {
            let (mut skip, mut want) = piece.part.unwrap_or((0, piece.msg.total_len));
            for s in piece.msg.segs() {
                if want == 0 {
                    break;
                }
                let len = s.len as u64;
                if skip >= len {
                    skip -= len;
                    continue;
                }
                let take = (len - skip).min(want);
                out.push(Segment { addr: s.global_addr + skip, len: take });
                want -= take;
                skip = 0;
            }
        }
        out
    }
    fn len(&self) -> u64 {
        let head = self.head.iter().map(|b| b.len() as u64).sum::<u64>();
        head + self.pieces.iter().map(|p| p.part.map_or(p.msg.total_len, |(_, len)| len)).sum::<u64>()
    }
}

/// Why `len` bytes cannot be sent inline.
pub(super) fn inline_too_long(len: usize) -> Error {
    Error::Invalid(InvalidArgument::InlineTooLong { len })
}

/// An outgoing message: buffers from our arena (one, or several gathered), or a
/// received message being forwarded.
pub struct Message {
    pub(super) tag: u64,
    pub(super) opcode: u16,
    pub(super) parts: Parts,
    /// Kept alive until the peer releases the message (see `Message::hold`).
    pub(super) hold: Option<Hold>,
}

/// Something a sender keeps alive while a message is in flight.
pub(super) type Hold = Box<dyn std::any::Any + Send + Sync>;

impl Message {
    /// A message of one buffer.
    pub fn new(buf: Buf) -> Message {
        Message { tag: 0, opcode: 0, parts: Parts::Bufs(SmallVec::from_iter([buf])), hold: None }
    }
    /// A scatter-gather message of several buffers (up to 1024). More than two
    /// travel through an SG list written in our arena.
    pub fn gather(bufs: Vec<Buf>) -> Message {
        Message { tag: 0, opcode: 0, parts: Parts::Bufs(SmallVec::from_vec(bufs)), hold: None }
    }
    /// A message of at most [`INLINE_BYTES`] bytes that travel in the ring
    /// descriptor itself: nothing is allocated in the arena, and the receiver
    /// gets them with the descriptor (one cache line, not two). For headers
    /// and other small control messages. `Invalid` if `bytes` is too long.
    /// A received inline message has one segment (its bytes, copied out of
    /// the ring) and no global pointers: forwarding it copies those bytes.
    pub fn inline(bytes: &[u8]) -> Result<Message> {
        let area = fido_ring::inline_area(bytes).ok_or_else(|| inline_too_long(bytes.len()))?;
        Ok(Message { tag: 0, opcode: 0, parts: Parts::Inline { bytes: area, len: bytes.len() as u8 }, hold: None })
    }
    /// Forwards a received message that several sends share, by pointer:
    /// each send (to as many channels as you like) carries the same global
    /// pointers, and the upstream sender gets its release when the last
    /// reference is gone — every downstream peer released (or its send came
    /// back undelivered and was dropped) and you dropped your own `Arc`.
    /// Same tag and opcode as received (change them with [`Message::tag`]).
    pub fn shared(msg: &Arc<Msg>) -> Message {
        let parts = SharedParts { head: SmallVec::new(), pieces: SmallVec::from_iter([SharedPiece { msg: msg.clone(), part: None }]) };
        Message { tag: msg.tag, opcode: msg.opcode, parts: Parts::Shared(Box::new(parts)), hold: None }
    }
    /// [`Message::shared`] for a part of the payload, after buffers of our
    /// own: `head` (e.g. a new header, possibly none) and then the `len`
    /// bytes of `msg`'s payload that start at `offset`, by pointer (none
    /// copied). For a domain that splits a request (a stripe over several
    /// disks) or replaces its header with one it checked. Tag and opcode 0.
    /// `Invalid` if the range is outside the payload, the message is empty,
    /// a buffer in `head` is empty, or `msg` came inline (its bytes are a
    /// copy in our memory, with no pointer to pass on; send them in a buffer).
    pub fn shared_part(head: Vec<Buf>, msg: &Arc<Msg>, offset: usize, len: usize) -> Result<Message> {
        Message::shared_gather(head, vec![(msg.clone(), offset..offset.saturating_add(len))])
    }
    /// [`Message::shared_part`] of several received messages: `head`, then
    /// each range of each message's payload in turn, all by pointer (e.g.
    /// the pieces of a read that several disks answered, as one reply).
    /// Each message keeps one reference per send, released as for
    /// [`Message::shared`]. `Invalid` as for `shared_part`, for any range.
    pub fn shared_gather(head: Vec<Buf>, parts: Vec<(Arc<Msg>, std::ops::Range<usize>)>) -> Result<Message> {
        let bad = |why: String| Error::Invalid(InvalidArgument::SharedPart(why));
        if head.iter().any(|b| b.is_empty()) {
            return Err(InvalidArgument::EmptyBuffer.into());
        }
        let mut pieces = SmallVec::new();
        let mut total = head.len();
        for (msg, range) in parts {
            if range.start > range.end || range.end > msg.len() {
                return Err(bad(format!("bytes {range:?} of a {}-byte message", msg.len())));
            }
            if range.is_empty() {
                continue;
            }
            if matches!(msg.body, Body::Inline(_)) {
                return Err(bad("an inline message has no pointers to share".into()));
            }
            total += range.len();
            pieces.push(SharedPiece { msg, part: Some((range.start as u64, range.len() as u64)) });
        }
        if total == 0 {
            return Err(bad("nothing to send".into()));
        }
        let parts = SharedParts { head: SmallVec::from_vec(head), pieces };
        Ok(Message { tag: 0, opcode: 0, parts: Parts::Shared(Box::new(parts)), hold: None })
    }
    /// An application-defined 64-bit tag (e.g. a sequence number).
    pub fn tag(mut self, tag: u64) -> Message {
        self.tag = tag;
        self
    }
    pub fn opcode(mut self, opcode: u16) -> Message {
        self.opcode = opcode;
        self
    }
    pub fn get_tag(&self) -> u64 {
        self.tag
    }
    /// Keeps `value` alive until the peer releases this message (or it comes
    /// back undelivered), then drops it. For memory the message points at
    /// without owning it, e.g. an `Arc` of a cache entry a reply refers to:
    /// the entry cannot be freed while the peer may still read it.
    pub fn hold(mut self, value: impl std::any::Any + Send + Sync) -> Message {
        self.hold = Some(Box::new(value));
        self
    }
    /// Takes the buffers back (empty for a forwarded message; our own
    /// buffers, the head, of a shared one, whose reference is dropped).
    pub fn into_bufs(self) -> Vec<Buf> {
        match self.parts {
            Parts::Bufs(b) => b.into_vec(),
            Parts::Shared(s) => s.head.into_vec(),
            Parts::Forward(_) | Parts::Inline { .. } => Vec::new(),
        }
    }
    pub(super) fn len(&self) -> u64 {
        match &self.parts {
            Parts::Bufs(b) => b.iter().map(|b| b.len() as u64).sum(),
            Parts::Forward(m) => m.len() as u64,
            Parts::Shared(s) => s.len(),
            Parts::Inline { len, .. } => *len as u64,
        }
    }
}

impl From<Buf> for Message {
    fn from(buf: Buf) -> Message {
        Message::new(buf)
    }
}

impl From<Msg> for Message {
    fn from(msg: Msg) -> Message {
        Message { tag: msg.tag, opcode: msg.opcode, parts: Parts::Forward(Box::new(msg)), hold: None }
    }
}

/// A message that was sent but never released by the peer (it died or closed),
/// handed back to its sender: nothing is lost silently.
pub struct Undelivered {
    pub tag: u64,
    pub opcode: u16,
    /// The message's buffers (empty when it was a forwarded message; dropping
    /// this releases it upstream).
    pub message: Message,
}

/// `send` failed; the message comes back.
#[derive(Debug)]
pub struct SendError {
    pub error: Error,
    pub message: Message,
}

impl std::fmt::Debug for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Message {{ tag: {}, opcode: {}, len: {} }}", self.tag, self.opcode, self.len())
    }
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for SendError {}

impl From<SendError> for Error {
    fn from(e: SendError) -> Error {
        e.error
    }
}

pub(super) struct Seg {
    pub(super) ptr: NonNull<u8>,
    pub(super) len: usize,
    /// Where the segment is in the global address space, as the peer sent it
    /// (for forwarding unchanged).
    pub(super) global_addr: u64,
    /// Keeps a forwarded arena mapped (`None`: the peer's own arena, kept by
    /// the connection).
    pub(super) _keep: Option<Arc<Mapping>>,
}

impl Seg {
    pub(super) fn global(&self) -> Segment {
        Segment { addr: self.global_addr, len: self.len as u64 }
    }
}

/// A received message: a read-only view into the sender's (or an upstream
/// sender's) arena. Dropping it releases the message to its sender.
///
/// The bytes are the sender's memory, mapped read-only here, which a
/// misbehaving sender could change while you read (Fido's relaxed trust
/// model). So they come as [`PeerSlice`]s, which read each byte once into
/// memory you own: reading is always sound, a liar can only make you read
/// its later bytes. Validate values after reading them, not before.
pub struct Msg {
    /// The connection, kept alive by the messages' shared reference
    /// (`ReleaseState`), not one of its own.
    pub(super) shared: NonNull<ConnShared>,
    pub(super) cookie: u64,
    pub(super) tag: u64,
    pub(super) total_len: u64,
    pub(super) opcode: u16,
    pub(super) nseg: u16,
    /// Dropping parks the release ([`Msg::defer_release`]).
    pub(super) defer: bool,
    pub(super) body: Body,
}

/// What a received message carries.
pub(super) enum Body {
    /// An inline message's bytes (the first `total_len`), copied out of the
    /// ring with its descriptor.
    Inline(InlineArea),
    /// One checked segment in a sender's arena: the common case, kept in
    /// the message.
    One(Seg),
    /// Any other number of segments, and the SG list they came in, if any.
    /// Boxed so that a `Msg` stays small enough to move without a `memcpy`
    /// call (it is moved a few times between the ring and its reader).
    Segs(Box<SegList>),
}

pub(super) struct SegList {
    pub(super) segs: Vec<Seg>,
    /// The SG list pointer, with what keeps the list's arena mapped.
    pub(super) sg: Option<(Segment, Option<Arc<Mapping>>)>,
}

/// An inline message's bytes, 16-byte aligned so a protocol can lay out
/// aligned fields in them (fido-rpc puts a root at offset 16).
#[repr(C, align(16))]
pub(super) struct InlineArea([u64; INLINE_BYTES / 8]);

impl InlineArea {
    /// The inline area of `desc`, copied as the words it arrived in (not
    /// through a byte array: reading those bytes back in wider pieces
    /// stalled on store-to-load forwarding, ~8% of a small receive).
    #[inline]
    pub(super) fn of(desc: &Descriptor) -> InlineArea {
        let [a, b] = desc.segments;
        InlineArea([a.addr, a.len, b.addr, b.len])
    }
    pub(super) fn from_bytes(bytes: [u8; INLINE_BYTES]) -> InlineArea {
        InlineArea(bytemuck::cast(bytes))
    }
    pub(super) fn bytes(&self) -> &[u8; INLINE_BYTES] {
        bytemuck::cast_ref(&self.0)
    }
}

// SAFETY: the segment pointers are into read-only mappings kept alive by the
// `Arc<Mapping>`s this message holds; nothing writes through them. The
// connection pointer is to a `ConnShared` (itself `Send + Sync`) kept alive
// by the messages' reference (`ReleaseState`) wherever the message goes.
unsafe impl Send for Msg {}
// SAFETY: as for Send: a shared `&Msg` only reads the read-only mappings, and
// its release goes through the connection's locks.
unsafe impl Sync for Msg {}

impl Msg {
    /// The connection this message came in on.
    #[inline]
    pub(super) fn conn(&self) -> &ConnShared {
        // SAFETY: the received messages' reference keeps the connection
        // alive until the last of them is dropped (`ReleaseState`); this one
        // is not yet.
        unsafe { self.shared.as_ref() }
    }
    pub fn tag(&self) -> u64 {
        self.tag
    }
    pub fn opcode(&self) -> u16 {
        self.opcode
    }
    /// Total payload length.
    pub fn len(&self) -> usize {
        self.total_len as usize
    }
    pub fn is_empty(&self) -> bool {
        self.total_len == 0
    }
    pub fn segment_count(&self) -> usize {
        match &self.body {
            Body::Inline(_) => (self.total_len > 0) as usize,
            Body::One(_) => 1,
            Body::Segs(list) => list.segs.len(),
        }
    }
    /// Lets this message's release wait, once it is dropped, until the next
    /// send or receive on its channel (or the channel's drop) instead of
    /// being published by the drop itself.
    ///
    /// For request/response protocols: a client that drops a reply and then
    /// sends its next request gets the release published after that send,
    /// while the peer works on the request, not on the round trip's path. A
    /// channel parks one release at a time (parking another publishes the
    /// one before), and a receive that has to wait publishes it first, so a
    /// peer that needs it before it can answer gets it. A side that stops
    /// using the channel without dropping it keeps that one release back
    /// until it sends, waits or drops the channel: use this only for
    /// messages whose release the sender does not need promptly (not one
    /// whose buffers or holds it wants back).
    pub fn defer_release(&mut self) {
        self.defer = true;
    }
    /// An inline message's bytes ([`Message::inline`]): a copy taken with the
    /// descriptor, so the sender cannot change them any more. 16-byte aligned.
    pub fn inline_bytes(&self) -> Option<&[u8]> {
        // `total_len` ≤ INLINE_BYTES for inline messages (validated).
        match &self.body {
            Body::Inline(b) => Some(&b.bytes()[..self.total_len as usize]),
            _ => None,
        }
    }
    /// The payload segments, in order (an inline message: one, its bytes),
    /// as views of the sender's memory ([`PeerSlice`]: read through it, never
    /// as `&[u8]`, because the sender can still write it). Copies out of them
    /// count in the domain's `bytes_copied`.
    pub fn segments(&self) -> impl Iterator<Item = PeerSlice<'_>> {
        let copied = &self.conn().conns.local.bytes_copied;
        let inline = self.inline_bytes().filter(|b| !b.is_empty()).map(PeerSlice::from_own);
        inline
            .into_iter()
            .chain(self.segs().iter().map(|s| {
                // SAFETY: validated against a live mapping that `s._keep` (or
                // the connection) keeps mapped for as long as `self` (and so
                // this borrow) lives.
                unsafe { PeerSlice::new(s.ptr, s.len) }
            }))
            .map(move |v| v.counting(copied))
    }
    /// The payload when it is one segment.
    pub fn as_slice(&self) -> Option<PeerSlice<'_>> {
        if self.segment_count() == 1 {
            self.segments().next()
        } else {
            None
        }
    }
    /// The global pointers of the payload segments (identical in every
    /// domain; none for an inline message).
    pub fn global_segments(&self) -> impl Iterator<Item = (GPtr, usize)> + '_ {
        self.segs().iter().map(|s| (GPtr(s.global_addr), s.len))
    }
    pub(super) fn segs(&self) -> &[Seg] {
        match &self.body {
            Body::Inline(_) => &[],
            Body::One(seg) => std::slice::from_ref(seg),
            Body::Segs(list) => &list.segs,
        }
    }
    /// Copies the payload out (counted in the domain's copied bytes).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len());
        for s in self.segments() {
            s.append_to(&mut v);
        }
        v
    }
    /// The domain that sent this message over this connection.
    pub fn from_domain(&self) -> u64 {
        self.conn().peer.domain
    }
    /// A read-only view of `len` bytes at `g` in the sending peer's arena
    /// (anywhere in it, not only in this message's segments), or `None` if the
    /// range is not entirely inside the arena the peer granted us. One bounds
    /// check; the view lives as long as this message, which keeps the mapping.
    /// For protocols whose payload carries pointers (fido-rpc). The sender can
    /// still write those bytes, hence a [`PeerSlice`].
    pub fn resolve(&self, g: GPtr, len: u64) -> Option<PeerSlice<'_>> {
        let conn = self.conn();
        let p = within(&conn.peer_map, g, len)?;
        // SAFETY: `within` checked the range lies inside the peer's mapping,
        // which the connection keeps alive for at least the borrow of `self`.
        Some(unsafe { PeerSlice::new(p, len as usize) }.counting(&conn.conns.local.bytes_copied))
    }
    /// The sending peer's whole arena, read-only, and its global address:
    /// what [`Msg::resolve`] checks against, for a caller that resolves many
    /// small ranges (fido-rpc's `View`, one string of a VarSeq at a time)
    /// and does the bounds check itself. Lives as long as this message.
    pub fn peer_arena(&self) -> (GPtr, PeerSlice<'_>) {
        let conn = self.conn();
        let m = &conn.peer_map;
        // SAFETY: the whole mapping, which the connection keeps alive for at
        // least the borrow of `self`; mapped readable, never unmapped before.
        let bytes = unsafe { PeerSlice::new(m.local_nonnull(), m.len() as usize) };
        (m.global_base(), bytes.counting(&conn.conns.local.bytes_copied))
    }
}

impl Drop for Msg {
    fn drop(&mut self) {
        let conn = self.conn();
        let last = if self.defer { conn.defer_release(self.cookie) } else { conn.release(self.cookie) };
        if last {
            // SAFETY: the received messages' reference, taken in `assemble`:
            // the channel is gone and this was the last message it delivered
            // (`ReleaseState`), so it is given up once, here, after the last
            // use of the connection above.
            unsafe { Arc::decrement_strong_count(self.shared.as_ptr()) };
        }
    }
}

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Msg {{ tag: {}, opcode: {}, len: {}, segments: {} }}", self.tag, self.opcode, self.total_len, self.segment_count())
    }
}
// A `Msg` is returned through a few `Result`s between the ring and its
// reader: kept small enough that the compiler moves it inline (no `memcpy`).
const _: () = assert!(std::mem::size_of::<Msg>() <= 128);

