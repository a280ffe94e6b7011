//! Channels: one connection between two domains, a ring per direction.
//!
//! Sending writes a descriptor into the ring in our own arena (no copy: the
//! descriptor carries global pointers to buffers in our arena, or in an upstream
//! domain's arena when forwarding). Receiving copies the descriptor out of the
//! peer's read-only memory, validates every range in it, and hands out a
//! read-only view. Dropping the view releases the message: its cookie goes into
//! our release ring, and the sender frees the buffer (or, for a forwarded
//! message, releases it upstream in turn).

// `SendError` carries the unsent message back by value: boxing it would cost an
// allocation on every failed `try_send`, the call that polls a full window.
#![allow(clippy::result_large_err)]

use crate::domain::DomainInner;
use crate::error::{Error, Result};
use crate::validate::{check_inline, validate, Resolver};
use fido_proto::{ConnId, Counters, GoneReason, PeerInfo, Reply, Request, RingBlock};
use fido_ring::{
    block_len, doorbell, wait_until, Descriptor, LocalBlock, Notify, PeerBlock, Releaser, RingError, RxRing, Segment,
    SleepSite, TxRing, WaitOutcome, WaitStrategy, FLAG_INLINE, FLAG_SG_LIST, INLINE_BYTES, INLINE_SEGMENTS, MAX_SEGMENTS,
};
use fido_shm::{Buf, GPtr, Mapping, PeerSlice, ShmError};
use parking_lot::Mutex;
use smallvec::SmallVec;
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const OPEN: u8 = 0;
const GONE_EXITED: u8 = 1;
const GONE_HUNG: u8 = 2;
const GONE_LEFT: u8 = 3;
const BROKEN: u8 = 4;
const CLOSED_BY_US: u8 = 5;
const GONE_EVICTED: u8 = 6;
const GONE_REVOKED: u8 = 7;

/// A connection request waiting in a listener's backlog.
pub(crate) struct Incoming {
    pub(crate) conn: ConnId,
    pub(crate) service: String,
    pub(crate) peer: PeerInfo,
    pub(crate) block: RingBlock,
    pub(crate) fds: Vec<OwnedFd>,
}

/// What one message is made of.
enum Parts {
    Bufs(SmallVec<[Buf; 2]>),
    /// Boxed: a `Msg` is large, and every `Message` is moved a few times.
    Forward(Box<Msg>),
    /// Bytes carried in the descriptor itself (`FLAG_INLINE`).
    Inline { bytes: [u8; INLINE_BYTES], len: u8 },
}

/// Why `len` bytes cannot be sent inline.
fn inline_too_long(len: usize) -> Error {
    Error::Invalid(format!("inline message of {len} bytes (at most {INLINE_BYTES})"))
}

/// An outgoing message: buffers from our arena (one, or several gathered), or a
/// received message being forwarded.
pub struct Message {
    tag: u64,
    opcode: u16,
    parts: Parts,
    /// Kept alive until the peer releases the message (see `Message::hold`).
    hold: Option<Hold>,
}

/// Something a sender keeps alive while a message is in flight.
type Hold = Box<dyn std::any::Any + Send + Sync>;

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
    /// Takes the buffers back (empty for a forwarded message).
    pub fn into_bufs(self) -> Vec<Buf> {
        match self.parts {
            Parts::Bufs(b) => b.into_vec(),
            Parts::Forward(_) | Parts::Inline { .. } => Vec::new(),
        }
    }
    fn len(&self) -> u64 {
        match &self.parts {
            Parts::Bufs(b) => b.iter().map(|b| b.len() as u64).sum(),
            Parts::Forward(m) => m.len() as u64,
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

/// One entry of the table of messages in flight. Filled and emptied field
/// by field, in place: built on the stack and copied in as one value, the
/// entry was a 160-byte `memcpy`, ~17% of the samples of a one-thread
/// send-and-receive round trip (`perf record`).
#[derive(Default)]
struct Slot {
    /// `None` while the slot is free.
    parts: Option<Parts>,
    /// The cookie's high half for this use of the slot.
    generation: u32,
    tag: u64,
    opcode: u16,
    /// Payload bytes, for [`TxState::outstanding`].
    len: u64,
    hold: Option<Hold>,
    /// The SG list we wrote for this message, if any.
    sg_list: Option<Buf>,
}

impl Slot {
    /// Empties the slot, handing back what it held as the message it was.
    fn take(&mut self) -> Option<Message> {
        let parts = self.parts.take()?;
        self.sg_list = None;
        Some(Message { tag: self.tag, opcode: self.opcode, parts, hold: self.hold.take() })
    }
}

/// A message's cookie: its slot in the in-flight table (low 32 bits) and
/// the slot's generation when it was taken (high 32 bits), so a release of
/// an earlier occupant is told apart.
#[derive(Clone, Copy)]
struct Cookie(u64);

impl Cookie {
    fn index(self) -> usize {
        (self.0 & 0xffff_ffff) as usize
    }
    fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

/// Sender state: the ring and the table of messages in flight, by cookie.
struct TxState {
    ring: TxRing,
    table: Vec<Slot>,
    free: Vec<u32>,
    generation: u32,
    epoch: u64,
    wait: WaitStrategy,
    undelivered: Vec<Undelivered>,
    /// What the messages in `table` add up to. Written only under the
    /// lock; shared with `ConnShared` so it can be read without taking it.
    outstanding: Arc<Outstanding>,
}

/// Messages in flight and their payload bytes (what the peer's releases
/// will give back), written under the send lock, read by anyone.
#[derive(Default)]
struct Outstanding {
    messages: Counter,
    bytes: Counter,
}

impl Outstanding {
    #[inline]
    fn add(&self, len: u64) {
        self.messages.add(1);
        self.bytes.add(len);
    }
    #[inline]
    fn remove(&self, len: u64) {
        self.messages.sub(1);
        self.bytes.sub(len);
    }
}

/// `ConnShared::deferred` when no release is parked. (A peer's cookie of
/// this value is released at once instead.)
const NO_DEFERRED: u64 = u64::MAX;

struct RxState {
    ring: RxRing,
    epoch: u64,
    wait: WaitStrategy,
    /// Messages handed out (each a `Msg`), for `ReleaseState`.
    delivered: u64,
}

/// The release side, under one lock: the ring releases are published in,
/// and what keeps the connection alive for the messages received on it.
///
/// Received messages hold one reference to the connection between them,
/// not one each (an `Arc` clone and drop per message were two locked
/// instructions on every round trip's path): it is taken when the channel
/// is made, and given up once the channel is gone and every message it
/// delivered has been dropped. Counting needs no atomics: deliveries are
/// counted under the receive lock (`RxState::delivered`), drops under this
/// one; the channel's drop copies the final delivery count here, and
/// whoever then sees `dropped` equal to it — the channel's drop, or the
/// last message's — gives the reference up. Each side of that check holds
/// this lock, so exactly one of them does.
struct ReleaseState {
    ring: Releaser,
    /// Received messages dropped.
    dropped: u64,
    /// Set by the channel's drop: every message it ever delivered.
    delivered_in_all: Option<u64>,
}

/// Where one receive is in its wait: the caller's timeout, the deadline
/// (resolved on the first real wait, after the quick spin), and whether it
/// has spun yet.
struct RecvWait {
    timeout: Option<Duration>,
    deadline: Option<Option<Instant>>,
    spun: bool,
}

/// Single-writer counter: written only under its half's lock, read by anyone.
#[derive(Default)]
struct Counter(AtomicU64);

impl Counter {
    #[inline]
    fn add(&self, n: u64) {
        // One writer (the lock holder): a plain load + store, no locked RMW.
        self.0.store(self.0.load(Ordering::Relaxed) + n, Ordering::Relaxed);
    }
    #[inline]
    fn sub(&self, n: u64) {
        self.0.store(self.0.load(Ordering::Relaxed) - n, Ordering::Relaxed);
    }
    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Default)]
struct Stats {
    sent: Counter,
    received: Counter,
    bytes_sent: Counter,
    bytes_received: Counter,
    rung: Counter,
    suppressed: Counter,
    release_rung: Counter,
    release_suppressed: Counter,
}

/// State shared by a channel, its received messages and the domain.
pub(crate) struct ConnShared {
    pub(crate) conn: ConnId,
    pub(crate) service: String,
    pub(crate) peer: PeerInfo,
    domain: Arc<DomainInner>,
    peer_map: Arc<Mapping>,
    _block: Buf,
    local: LocalBlock,
    /// Our doorbells: we wait on `.wait`; the peer holds a copy of `.ring`,
    /// and so do we, to wake our own waiters.
    data_bell: doorbell::Doorbell,
    space_bell: doorbell::Doorbell,
    liveness: OwnedFd,
    /// The peer's block (read-only): its bell words are where our waiters
    /// sleep on a futex.
    peer_block: PeerBlock,
    releaser: Mutex<ReleaseState>,
    /// The cookie of a dropped message whose release waits for the next
    /// send or receive on this channel ([`Msg::defer_release`]), or
    /// [`NO_DEFERRED`].
    deferred: AtomicU64,
    /// Set when the `Channel` is dropped: there is no next send or receive,
    /// so no release waits any more.
    channel_dropped: std::sync::atomic::AtomicBool,
    state: AtomicU8,
    broken: Mutex<Option<String>>,
    stats: Stats,
    tx: Mutex<TxState>,
    rx: Mutex<RxState>,
    /// Set once this channel carried a forwarded message (see `reap_forwarded`).
    forwarding: std::sync::atomic::AtomicBool,
    /// `TxState::outstanding`, readable without the tx lock.
    outstanding: Arc<Outstanding>,
}

// SAFETY: the raw pointers inside (ring blocks) point into mappings kept alive
// by `block` and `peer_map`; every access goes through the rings' atomics or
// under the tx/rx/releaser locks.
unsafe impl Send for ConnShared {}
unsafe impl Sync for ConnShared {}

impl ConnShared {
    pub(crate) fn is_open(&self) -> bool {
        self.state.load(Ordering::Acquire) == OPEN
    }

    pub(crate) fn mark_gone(&self, reason: GoneReason) {
        let code = match reason {
            GoneReason::Exited => GONE_EXITED,
            GoneReason::MissedHeartbeat => GONE_HUNG,
            GoneReason::Left => GONE_LEFT,
            GoneReason::Evicted => GONE_EVICTED,
            GoneReason::Revoked => GONE_REVOKED,
        };
        let _ = self.state.compare_exchange(OPEN, code, Ordering::AcqRel, Ordering::Acquire);
        self.wake_local();
    }

    fn mark_broken(&self, why: String) -> Error {
        tracing::warn!(conn = self.conn, peer = self.peer.domain, "closing connection: {why}");
        *self.broken.lock() = Some(why.clone());
        let _ = self.state.compare_exchange(OPEN, BROKEN, Ordering::AcqRel, Ordering::Acquire);
        self.wake_local();
        Error::Protocol(why)
    }

    /// Wakes our own waiters so they look at the connection state again:
    /// those on a futex (the peer's bell words, through our read-only mapping:
    /// same key) and those on a doorbell. A futex waiter that is between its
    /// last look at the state and its `FUTEX_WAIT` misses this (we cannot
    /// change the peer's word); it moves to its doorbell, rung here, within
    /// `fido_ring::wait::FUTEX_PHASE`.
    pub(crate) fn wake_local(&self) {
        fido_ring::futex::wake_all(self.peer_block.data_bell());
        fido_ring::futex::wake_all(self.peer_block.space_bell());
        let _ = doorbell::ring(self.data_bell.ring.as_fd());
        let _ = doorbell::ring(self.space_bell.ring.as_fd());
    }

    fn state_error(&self, state: u8) -> Error {
        let domain = self.peer.domain;
        match state {
            GONE_EXITED => Error::PeerGone { domain, reason: "exited" },
            GONE_HUNG => Error::PeerGone { domain, reason: "missed heartbeats" },
            GONE_LEFT => Error::PeerGone { domain, reason: "left" },
            GONE_EVICTED => Error::PeerGone { domain, reason: "evicted by the broker's policy" },
            GONE_REVOKED => Error::PeerGone { domain, reason: "connection revoked by the broker's policy" },
            BROKEN => Error::Protocol(self.broken.lock().clone().unwrap_or_default()),
            _ => Error::Closed,
        }
    }

    /// Ok while the connection is usable.
    #[inline]
    fn check(&self) -> Result<()> {
        match self.state.load(Ordering::Acquire) {
            OPEN => Ok(()),
            s => Err(self.state_error(s)),
        }
    }

    /// Releases a dropped message; true when it was the last one the
    /// messages' reference to this connection was kept for (the caller then
    /// gives it up, see `ReleaseState`).
    fn release(&self, cookie: u64) -> bool {
        let mut r = self.releaser.lock();
        // Releases keep flowing after either side closed: the peer frees its
        // buffers only once we are done with them (or gone).
        let published = if self.state.load(Ordering::Acquire) == BROKEN { Ok(Notify::Suppressed) } else { r.ring.release(cookie) };
        r.dropped += 1;
        let last = r.delivered_in_all == Some(r.dropped);
        drop(r);
        match published {
            Ok(Notify::Rung) => self.stats.release_rung.add(1),
            Ok(Notify::Suppressed) => self.stats.release_suppressed.add(1),
            Err(e) => {
                if self.is_open() {
                    self.mark_broken(format!("cannot publish release: {e}"));
                }
            }
        }
        last
    }

    /// Parks `cookie`'s release until the next send or receive on this
    /// channel ([`ConnShared::publish_deferred`]), publishing the one parked
    /// before, if any: a swap instead of the release lock, a fence and the
    /// unlock. True as for [`ConnShared::release`].
    ///
    /// Why a parked release is never left behind: the `Channel`'s drop sets
    /// `channel_dropped`, then publishes what is parked; a dropper parks,
    /// then reads `channel_dropped`. All four are `SeqCst`, so either the
    /// channel's swap comes after the park (and publishes it) or the dropper
    /// sees the flag (and publishes it itself).
    fn defer_release(&self, cookie: u64) -> bool {
        if cookie == NO_DEFERRED {
            return self.release(cookie);
        }
        let before = self.deferred.swap(cookie, Ordering::SeqCst);
        let mut last = before != NO_DEFERRED && self.release(before);
        if self.channel_dropped.load(Ordering::SeqCst) {
            last |= self.publish_deferred();
        }
        last
    }

    /// Publishes the parked release, if any (one load when there is none).
    /// True as for [`ConnShared::release`] (never while the channel lives).
    #[inline]
    fn publish_deferred(&self) -> bool {
        if self.deferred.load(Ordering::Relaxed) == NO_DEFERRED {
            return false;
        }
        let cookie = self.deferred.swap(NO_DEFERRED, Ordering::SeqCst);
        cookie != NO_DEFERRED && self.release(cookie)
    }

    pub(crate) fn add_counters(&self, c: &mut Counters) {
        let s = &self.stats;
        c.messages_sent += s.sent.get();
        c.messages_received += s.received.get();
        c.bytes_sent += s.bytes_sent.get();
        c.bytes_received += s.bytes_received.get();
        c.doorbells_rung += s.rung.get() + s.release_rung.get();
        c.doorbells_suppressed += s.suppressed.get() + s.release_suppressed.get();
    }
}

impl TxState {
    /// Takes a free slot of the in-flight table for the next message:
    /// returns its cookie. The caller pushes the descriptor and only then
    /// records the message in the slot ([`TxState::insert`],
    /// [`TxState::insert_inline`]): the table is read only under the send
    /// lock, which the caller holds throughout, so the descriptor can go
    /// out first and reach the peer that much sooner.
    #[inline(always)]
    fn claim(&mut self) -> Cookie {
        let index = self.free.pop().expect("window checked before insert");
        self.generation = self.generation.wrapping_add(1);
        Cookie((self.generation as u64) << 32 | index as u64)
    }

    /// Fills the header of `cookie`'s slot (a message of `len` payload
    /// bytes) and returns it for its parts.
    #[inline(always)]
    fn fill(&mut self, cookie: Cookie, tag: u64, opcode: u16, len: u64) -> &mut Slot {
        self.outstanding.add(len);
        let slot = &mut self.table[cookie.index()];
        slot.generation = cookie.generation();
        slot.tag = tag;
        slot.opcode = opcode;
        slot.len = len;
        slot
    }

    /// Records `msg` (of `len` payload bytes, with the SG list written for
    /// it) as in flight under the `cookie` it was pushed with.
    #[inline(always)]
    fn insert(&mut self, cookie: Cookie, msg: Message, len: u64, sg_list: Option<Buf>) {
        let slot = self.fill(cookie, msg.tag, msg.opcode, len);
        slot.parts = Some(msg.parts);
        if msg.hold.is_some() {
            slot.hold = msg.hold;
        }
        if sg_list.is_some() {
            slot.sg_list = sg_list;
        }
    }

    /// [`TxState::insert`] for an inline message: `area` holds its bytes,
    /// padded (`len` of them are its own).
    #[inline(always)]
    fn insert_inline(&mut self, cookie: Cookie, tag: u64, opcode: u16, area: [u8; INLINE_BYTES], len: usize) {
        let slot = self.fill(cookie, tag, opcode, len as u64);
        slot.parts = Some(Parts::Inline { bytes: area, len: len as u8 });
    }

    /// Reaps every release the peer published (one batch: the peer's index
    /// is read once); an unknown cookie is a lie.
    fn reap(&mut self) -> std::result::Result<(), String> {
        let ready = self.ring.releases_ready().map_err(|e| e.to_string())?;
        for k in 0..ready {
            let cookie = Cookie(self.ring.pending_release(k));
            let index = cookie.index();
            match self.table.get_mut(index) {
                Some(slot) if slot.parts.is_some() && slot.generation == cookie.generation() => {
                    // Dropped in place, field by field (see `Slot`).
                    slot.parts = None;
                    if slot.hold.is_some() {
                        slot.hold = None;
                    }
                    if slot.sg_list.is_some() {
                        slot.sg_list = None;
                    }
                    self.outstanding.remove(slot.len);
                    self.free.push(index as u32);
                }
                _ => {
                    self.ring.consume_releases(k);
                    return Err(format!("released unknown message cookie {:#x}", cookie.0));
                }
            }
        }
        self.ring.consume_releases(ready);
        Ok(())
    }

    /// Hands every unreleased message back as undelivered.
    fn fail_outstanding(&mut self) {
        for slot in self.table.iter_mut() {
            let len = slot.len;
            if let Some(message) = slot.take() {
                self.outstanding.remove(len);
                self.undelivered.push(Undelivered { tag: message.tag, opcode: message.opcode, message });
            }
        }
        self.free = (0..self.table.len() as u32).rev().collect();
    }
}

/// How often a receiver blocked with forwarded messages in flight collects
/// their releases.
const REAP_INTERVAL: Duration = Duration::from_micros(200);

/// Collects releases on every channel that forwarded messages; true while any
/// forwarded message is still in flight. Channels whose sender currently holds
/// the lock are skipped: that sender reaps them itself.
pub(crate) fn reap_forwarded(domain: &DomainInner) -> bool {
    let chans: Vec<Arc<ConnShared>> = {
        let mut list = domain.forwarding.lock();
        list.retain(|w| w.strong_count() > 0);
        list.iter().filter_map(std::sync::Weak::upgrade).collect()
    };
    let mut pending = false;
    for c in chans {
        if let Some(mut tx) = c.tx.try_lock() {
            if let Err(why) = tx.reap() {
                c.mark_broken(why);
                continue;
            }
            pending |= tx.ring.in_flight() > 0 && c.is_open();
        } else {
            pending = true;
        }
    }
    pending
}

impl Drop for ConnShared {
    fn drop(&mut self) {
        // Forwarded messages the downstream never released must not be
        // released upstream now: a release means "delivered", and the upstream
        // sender would believe it. Keep them held for the life of the domain;
        // the upstream sees them in flight, and reported undelivered if this
        // domain dies. (Messages handed to the application through
        // `take_undelivered` are its to resend or drop.)
        let tx = self.tx.get_mut();
        let held: Vec<Msg> = tx
            .table
            .iter_mut()
            .filter_map(|slot| match slot.take() {
                Some(Message { parts: Parts::Forward(m), .. }) => Some(*m),
                _ => None,
            })
            .collect();
        if !held.is_empty() {
            tracing::warn!(conn = self.conn, held = held.len(), "downstream went away holding forwarded messages; keeping them unreleased");
            self.domain.orphaned.lock().extend(held);
        }
    }
}

/// A closed channel whose sent buffers the peer may still be reading.
pub(crate) struct Lingering {
    shared: Arc<ConnShared>,
}

/// Frees lingering channels whose peer released everything or is gone.
pub(crate) fn sweep_lingering(domain: &DomainInner) {
    let list = std::mem::take(&mut *domain.lingering.lock());
    let mut keep = Vec::new();
    for l in list {
        let done = {
            let mut tx = l.shared.tx.lock();
            let reaped = tx.reap().is_ok();
            // Not `peer_closed`: a peer that closed may still hold our messages.
            let gone = doorbell::peer_hung_up(l.shared.liveness.as_fd());
            !reaped || gone || tx.ring.in_flight() == 0
        };
        if !done {
            keep.push(l);
        }
    }
    domain.lingering.lock().extend(keep);
}

/// Resolves peer pointers. The common case — a pointer into the peer's own
/// arena — is a bounds check against the connection's mapping, which the
/// message keeps alive through the connection; any other arena (a forwarded
/// message) goes through the domain's address space, mapping it (lazily
/// granted by the broker) the first time one shows up.
struct ConnResolver<'a>(&'a ConnShared);

/// The local address of `len` bytes at `g` if they lie inside `map`.
#[inline]
fn within(map: &Mapping, g: GPtr, len: u64) -> Option<NonNull<u8>> {
    let off = g.addr().checked_sub(map.global_base().addr())?;
    if off.checked_add(len)? > map.len() {
        return None;
    }
    // SAFETY: off + len <= the mapping's length, so the pointer stays inside
    // the live mapping, which the caller keeps alive (an `Arc<Mapping>`).
    NonNull::new(unsafe { map.local_base().add(off as usize) } as *mut u8)
}

impl Resolver for ConnResolver<'_> {
    type Keep = Option<Arc<Mapping>>;
    #[inline]
    fn resolve(&self, g: GPtr, len: u64) -> std::result::Result<(NonNull<u8>, Option<Arc<Mapping>>), String> {
        if let Some(p) = within(&self.0.peer_map, g, len) {
            return Ok((p, None));
        }
        let domain = &self.0.domain;
        match domain.space.resolve(g, len) {
            Ok((p, m)) => Ok((p, Some(m))),
            Err(ShmError::NotMapped { .. }) => {
                let (slot, _) = domain.space.slot_of(g).ok_or("outside the PGVAS window")?;
                let m = domain.ensure_mapped(slot).map_err(|e| format!("slot {slot} not granted: {e}"))?;
                // Resolve against the mapping just made (not the table, which a
                // concurrent sweep could already have emptied).
                let p = within(&m, g, len)
                    .ok_or_else(|| format!("{len} bytes at {:#x} outside slot {slot}'s arena", g.addr()))?;
                Ok((p, Some(m)))
            }
            Err(e) => Err(e.to_string()),
        }
    }
}

/// A connection to another domain. Send and receive from any threads (one
/// sender and one receiver at a time make progress; others queue on a lock).
pub struct Channel {
    shared: Arc<ConnShared>,
}

impl Channel {
    fn new_block(domain: &DomainInner, entries: u32) -> Result<(Buf, LocalBlock)> {
        let len = block_len(entries);
        let mut block = domain.arena.alloc(len)?;
        let base = NonNull::new(block.as_mut_ptr()).ok_or_else(|| Error::Invalid("null block".into()))?;
        // SAFETY: `block` is `len` writable bytes of our arena, 64-aligned (the
        // allocator's guarantee), used for nothing else, and kept alive by the
        // ConnShared that owns both it and every copy of the LocalBlock.
        let local = unsafe { LocalBlock::init(base, len, entries) }.map_err(|e| Error::Invalid(e.to_string()))?;
        Ok((block, local))
    }

    /// Maps the peer's arena and opens its ring block.
    fn open_peer(domain: &DomainInner, peer: &PeerInfo, block: &RingBlock, arena_fd: OwnedFd) -> Result<(Arc<Mapping>, PeerBlock)> {
        let mapping = domain.space.map_peer(peer.slot, peer.domain, arena_fd, peer.arena_len)?;
        domain.register_mapping(peer.slot, peer.domain);
        if block.len < block_len(block.entries) as u64 {
            return Err(Error::protocol("peer ring block too small"));
        }
        let g = mapping.global_base().add(block.offset).ok_or_else(|| Error::protocol("peer ring block offset"))?;
        let (ptr, _) = domain.space.resolve(g, block.len)?;
        // SAFETY: `resolve` checked the range lies inside the peer's mapping,
        // which the ConnShared keeps alive (`peer_map`) as long as any copy of
        // the PeerBlock exists.
        let pb = unsafe { PeerBlock::open(ptr, block.len as usize, block.entries) }.map_err(Error::protocol)?;
        Ok((mapping, pb))
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        domain: &Arc<DomainInner>,
        conn: ConnId,
        service: String,
        peer: PeerInfo,
        mapping: Arc<Mapping>,
        (block, local): (Buf, LocalBlock),
        peer_block: PeerBlock,
        (data_bell, space_bell): (doorbell::Doorbell, doorbell::Doorbell),
        mut peer_fds: Vec<OwnedFd>,
    ) -> Channel {
        let liveness = peer_fds.pop().expect("checked: 3 fds left");
        let peer_space = Arc::new(peer_fds.pop().expect("checked"));
        let peer_data = Arc::new(peer_fds.pop().expect("checked"));
        let entries = local.entries();
        let wait = domain.opts.wait;
        let outstanding = Arc::new(Outstanding::default());
        let shared = Arc::new(ConnShared {
            conn,
            service,
            peer,
            domain: domain.clone(),
            peer_map: mapping,
            _block: block,
            local,
            data_bell,
            space_bell,
            liveness,
            peer_block,
            releaser: Mutex::new(ReleaseState { ring: Releaser::new(local, peer_block, peer_space), dropped: 0, delivered_in_all: None }),
            deferred: AtomicU64::new(NO_DEFERRED),
            channel_dropped: std::sync::atomic::AtomicBool::new(false),
            state: AtomicU8::new(OPEN),
            broken: Mutex::new(None),
            stats: Stats::default(),
            tx: Mutex::new(TxState {
                ring: TxRing::new(local, peer_block, peer_data),
                table: (0..entries).map(|_| Slot::default()).collect(),
                free: (0..entries).rev().collect(),
                generation: 0,
                epoch: 0,
                wait,
                undelivered: Vec::new(),
                outstanding: outstanding.clone(),
            }),
            rx: Mutex::new(RxState { ring: RxRing::new(local, peer_block), epoch: 0, wait, delivered: 0 }),
            forwarding: std::sync::atomic::AtomicBool::new(false),
            outstanding,
        });
        domain.conns.lock().insert(conn, Arc::downgrade(&shared));
        // The received messages' reference (see `ReleaseState`): given up
        // by whoever sees the last of them gone after the channel.
        std::mem::forget(shared.clone());
        Channel { shared }
    }

    pub(crate) fn connect(domain: &Arc<DomainInner>, service: &str) -> Result<Channel> {
        let entries = domain.opts.ring_entries;
        let (block, local) = Self::new_block(domain, entries)?;
        let bells = (doorbell::new_doorbell()?, doorbell::new_doorbell()?);
        let ring = RingBlock { offset: block.offset(), len: block_len(entries) as u64, entries };
        let fds = [bells.0.ring.try_clone()?, bells.1.ring.try_clone()?];
        let (reply, mut peer_fds) = domain.control.request(Request::Connect { service: service.into(), block: ring }, &fds)?;
        drop(fds);
        let (conn, peer, pblock) = match reply {
            Reply::Connected { conn, peer, block } if peer_fds.len() == 4 && block.entries == entries => (conn, peer, block),
            other => return Err(Error::protocol(format!("bad connect reply {other:?} with {} fds", peer_fds.len()))),
        };
        let arena_fd = peer_fds.remove(0);
        let (mapping, peer_block) = Self::open_peer(domain, &peer, &pblock, arena_fd)?;
        Ok(Self::assemble(domain, conn, service.into(), peer, mapping, (block, local), peer_block, bells, peer_fds))
    }

    pub(crate) fn accept(domain: &Arc<DomainInner>, inc: Incoming) -> Result<Channel> {
        let Incoming { conn, service, peer, block: pblock, mut fds } = inc;
        let refuse = |why: String| {
            domain.control.notify(Request::Refuse { conn, reason: why.clone() });
            Error::protocol(why)
        };
        if fds.len() != 4 {
            return Err(refuse(format!("incoming connection with {} descriptors", fds.len())));
        }
        let entries = pblock.entries;
        let (block, local) = Self::new_block(domain, entries)?;
        let (mapping, peer_block) = match Self::open_peer(domain, &peer, &pblock, fds.remove(0)) {
            Ok(x) => x,
            Err(e) => return Err(refuse(e.to_string())),
        };
        let bells = (doorbell::new_doorbell()?, doorbell::new_doorbell()?);
        let ring = RingBlock { offset: block.offset(), len: block_len(entries) as u64, entries };
        let mine = [bells.0.ring.try_clone()?, bells.1.ring.try_clone()?];
        // Runs on the control thread, which reads the broker's replies itself:
        // fire and forget. If the client is gone by now, the liveness socket
        // says so on the first operation.
        domain.control.notify_with(Request::Accept { conn, block: ring }, &mine)?;
        Ok(Self::assemble(domain, conn, service, peer, mapping, (block, local), peer_block, bells, fds))
    }

    pub fn id(&self) -> ConnId {
        self.shared.conn
    }
    pub fn peer(&self) -> &PeerInfo {
        &self.shared.peer
    }
    pub fn service(&self) -> &str {
        &self.shared.service
    }

    /// Sets how this channel waits (both directions).
    pub fn set_wait(&self, wait: WaitStrategy) {
        self.shared.tx.lock().wait = wait;
        self.shared.rx.lock().wait = wait;
    }

    /// Messages sent and not yet released by the peer.
    pub fn in_flight(&self) -> u64 {
        let mut tx = self.shared.tx.lock();
        let _ = tx.reap();
        tx.ring.in_flight()
    }

    /// Like [`Channel::in_flight`], but reports a peer that lied in its
    /// releases instead of hiding it.
    pub fn in_flight_checked(&self) -> Result<u64> {
        let mut tx = self.shared.tx.lock();
        tx.reap().map_err(|why| self.shared.mark_broken(why))?;
        Ok(tx.ring.in_flight())
    }

    /// Collects the releases the peer published (freeing our buffers, and
    /// releasing forwarded messages upstream) without sending anything.
    pub fn reap(&self) -> Result<()> {
        let mut tx = self.shared.tx.lock();
        tx.reap().map_err(|why| self.shared.mark_broken(why))
    }

    /// Collects the peer's releases only if more than `bytes` of payload are
    /// out unreleased. Reaping reads the peer's release index, a cache line
    /// the peer writes on every release: a caller that frees memory before
    /// each request (an RPC client) pays that transfer only when there is
    /// real memory to get back, not for every small message. (Sends collect
    /// anyway once half the window is out.)
    #[inline]
    pub fn reap_if_holding(&self, bytes: u64) -> Result<()> {
        // Read without the lock: a stale value only delays the reap to the
        // next call, or reaps for nothing.
        if self.shared.outstanding.bytes.get() <= bytes {
            return Ok(());
        }
        let mut tx = self.shared.tx.lock();
        tx.reap().map_err(|why| self.shared.mark_broken(why))
    }

    /// Collects the peer's releases now if the next send would (half the
    /// window is out, see [`Channel::send`]), unless another thread is
    /// sending (it collects them itself). For a sender with time to spare —
    /// one that just sent a request and waits for the reply — so that its
    /// next send, on the round trip's critical path, does not pay for a
    /// whole batch of releases.
    pub fn reap_ahead(&self) -> Result<()> {
        let sh = &*self.shared;
        if sh.outstanding.messages.get() * 2 < sh.local.entries() as u64 {
            return Ok(());
        }
        let Some(mut tx) = sh.tx.try_lock() else {
            return Ok(());
        };
        tx.reap().map_err(|why| sh.mark_broken(why))
    }

    /// Sends a message, waiting (per the wait strategy) while the window is full.
    pub fn send(&self, msg: impl Into<Message>) -> std::result::Result<(), SendError> {
        self.send_inner(msg.into(), None, true)
    }

    /// Sends, or returns `WouldBlock` with the message when the window is full.
    pub fn try_send(&self, msg: impl Into<Message>) -> std::result::Result<(), SendError> {
        self.send_inner(msg.into(), None, false)
    }

    /// Sends, giving up with `Timeout` (and the message) after `timeout`.
    pub fn send_timeout(&self, msg: impl Into<Message>, timeout: Duration) -> std::result::Result<(), SendError> {
        self.send_inner(msg.into(), Some(Instant::now() + timeout), true)
    }

    /// Forwards a received message to this channel's peer without copying: the
    /// descriptor carries the same global pointers. The upstream sender gets its
    /// release when this channel's peer releases.
    pub fn forward(&self, msg: Msg) -> std::result::Result<(), SendError> {
        self.send(msg)
    }

    /// Readies the window for one more message, under the send lock:
    /// collects releases when half the window is out, waits (per `block`
    /// and `deadline`) while it is full, and checks the connection. An error
    /// that ends the connection hands every unreleased message back as
    /// undelivered first.
    fn make_room(&self, tx: &mut TxState, deadline: Option<Instant>, block: bool) -> Result<()> {
        let sh = &*self.shared;
        let fail = |tx: &mut TxState, error: Error| {
            // A peer that closed gracefully may still be reading messages it
            // received: those stay outstanding until it releases them (or
            // dies). A dead or lying peer gets everything unreleased reported.
            if matches!(error, Error::PeerGone { .. } | Error::Protocol(_)) {
                // What the peer released before it went is delivered: collect
                // those releases first, so only the rest comes back (a resend
                // of an "undelivered" message must never duplicate one).
                if !matches!(error, Error::Protocol(_)) {
                    let _ = tx.reap();
                }
                tx.fail_outstanding();
            }
            Err(error)
        };
        if let Err(e) = sh.check() {
            return fail(tx, e);
        }
        // Collect releases only once half the window is out: reading the
        // peer's release index costs a cache-line transfer, so batch it.
        if tx.ring.in_flight() * 2 >= tx.table.len() as u64 {
            if let Err(why) = tx.reap() {
                let e = sh.mark_broken(why);
                return fail(tx, e);
            }
        }
        if tx.ring.peer_closed() {
            return fail(tx, Error::Closed);
        }
        let free = tx.ring.free_slots();
        if free == 0 {
            if !block {
                return Err(Error::WouldBlock);
            }
            let local = *tx.ring.local();
            let wait = tx.wait;
            let mut epoch = tx.epoch;
            let outcome = {
                let txr = &mut *tx;
                wait_until(
                    wait,
                    deadline,
                    SleepSite {
                        sleep: local.space_sleep(),
                        epoch: &mut epoch,
                        bell: sh.space_bell.wait.as_fd(),
                        liveness: Some(sh.liveness.as_fd()),
                        futex: Some(sh.peer_block.space_bell()),
                    },
                    || -> std::result::Result<bool, String> {
                        txr.reap()?;
                        Ok(txr.ring.free_slots() > 0 || !sh.is_open() || txr.ring.peer_closed())
                    },
                )
            };
            tx.epoch = epoch;
            match outcome {
                Ok(WaitOutcome::Ready) => {}
                Ok(WaitOutcome::TimedOut) => return Err(Error::Timeout),
                Ok(WaitOutcome::PeerGone) => {
                    // The liveness socket hung up: the peer process is gone.
                    sh.mark_gone(GoneReason::Exited);
                    let e = sh.check().err().unwrap_or(Error::Closed);
                    return fail(tx, e);
                }
                Err(why) => {
                    let e = sh.mark_broken(why);
                    return fail(tx, e);
                }
            }
            if let Err(e) = sh.check() {
                return fail(tx, e);
            }
            if tx.ring.peer_closed() {
                return fail(tx, Error::Closed);
            }
        }
        Ok(())
    }

    /// Writes one descriptor (its cookie already set) into the ring and
    /// publishes it, waking the peer only if it sleeps.
    #[inline]
    fn push_descriptor(&self, tx: &mut TxState, desc: &Descriptor) {
        let sh = &*self.shared;
        tx.ring.push(desc).expect("window checked by make_room");
        match tx.ring.publish() {
            Ok(Notify::Rung) => sh.stats.rung.add(1),
            Ok(Notify::Suppressed) => sh.stats.suppressed.add(1),
            Err(e) => tracing::debug!("doorbell: {e}"),
        }
        sh.stats.sent.add(1);
        sh.stats.bytes_sent.add(desc.total_len);
    }

    /// Sends `bytes` (at most [`INLINE_BYTES`]) inline, as
    /// `send(Message::inline(bytes)?.tag(tag).opcode(opcode))` does, but
    /// without building a `Message` and moving it through the call: the
    /// descriptor is filled straight from `bytes`. For small control
    /// messages on a hot path (fido-rpc's inline calls and replies). On an
    /// error the message comes back in the `SendError` as usual (`Invalid`,
    /// for more than [`INLINE_BYTES`], gives back an empty one).
    pub fn send_inline(&self, tag: u64, opcode: u16, bytes: &[u8]) -> std::result::Result<(), SendError> {
        self.send_inline_inner(tag, opcode, bytes, true)
    }

    /// [`Channel::send_inline`], or `WouldBlock` when the window is full.
    pub fn try_send_inline(&self, tag: u64, opcode: u16, bytes: &[u8]) -> std::result::Result<(), SendError> {
        self.send_inline_inner(tag, opcode, bytes, false)
    }

    fn send_inline_inner(&self, tag: u64, opcode: u16, bytes: &[u8], block: bool) -> std::result::Result<(), SendError> {
        // Padded once; the descriptor and the in-flight table take copies of
        // the whole area (fixed-size moves, not three variable-length copies).
        let Some(area) = fido_ring::inline_area(bytes) else {
            // Such a message cannot be built: an empty one with its tag and
            // opcode comes back.
            let message = Message::inline(&[]).expect("empty fits").tag(tag).opcode(opcode);
            return Err(SendError { error: inline_too_long(bytes.len()), message });
        };
        let mut desc = Descriptor { tag, opcode, ..Default::default() };
        desc.set_inline_area(&area, bytes.len());
        let give_back = |error: Error| SendError { error, message: Message::inline(bytes).expect("checked to fit").tag(tag).opcode(opcode) };
        let mut tx = self.shared.tx.lock();
        if let Err(e) = self.make_room(&mut tx, None, block) {
            return Err(give_back(e));
        }
        let cookie = tx.claim();
        desc.cookie = cookie.0;
        self.push_descriptor(&mut tx, &desc);
        tx.insert_inline(cookie, tag, opcode, area, bytes.len());
        drop(tx);
        // The peer is reading our message now: a good time for the parked
        // release (`Msg::defer_release`).
        self.shared.publish_deferred();
        Ok(())
    }

    fn send_inner(&self, msg: Message, deadline: Option<Instant>, block: bool) -> std::result::Result<(), SendError> {
        let sh = &*self.shared;
        let mut tx = sh.tx.lock();
        if let Err(error) = self.make_room(&mut tx, deadline, block) {
            return Err(SendError { error, message: msg });
        }
        // Build the descriptor.
        let mut desc = Descriptor { tag: msg.tag, opcode: msg.opcode, ..Default::default() };
        let mut sg_buf = None;
        let total;
        match &msg.parts {
            Parts::Bufs(bufs) => {
                if bufs.len() > MAX_SEGMENTS {
                    return Err(SendError { error: Error::Invalid(format!("{} segments (max {MAX_SEGMENTS})", bufs.len())), message: msg });
                }
                total = bufs.iter().map(|b| b.len() as u64).sum::<u64>();
                if bufs.iter().any(|b| b.is_empty()) {
                    return Err(SendError { error: Error::Invalid("empty buffer in message".into()), message: msg });
                }
                if bufs.len() <= INLINE_SEGMENTS {
                    for (i, b) in bufs.iter().enumerate() {
                        desc.segments[i] = Segment { addr: b.gptr().addr(), len: b.len() as u64 };
                    }
                } else {
                    let bytes = bufs.len() * std::mem::size_of::<Segment>();
                    let mut list = match sh.domain.arena.alloc(bytes) {
                        Ok(l) => l,
                        Err(e) => return Err(SendError { error: e.into(), message: msg }),
                    };
                    list.truncate(bytes);
                    for (i, b) in bufs.iter().enumerate() {
                        list[i * 16..i * 16 + 8].copy_from_slice(&b.gptr().addr().to_ne_bytes());
                        list[i * 16 + 8..i * 16 + 16].copy_from_slice(&(b.len() as u64).to_ne_bytes());
                    }
                    desc.flags = FLAG_SG_LIST;
                    desc.segments[0] = Segment { addr: list.gptr().addr(), len: bytes as u64 };
                    sg_buf = Some(list);
                }
                desc.nseg = bufs.len() as u16;
            }
            Parts::Forward(m) => {
                if !sh.forwarding.swap(true, Ordering::Relaxed) {
                    sh.domain.forwarding.lock().push(Arc::downgrade(&self.shared));
                }
                total = m.total_len;
                match &m.body {
                    // Validated on receipt: `total_len` ≤ INLINE_BYTES.
                    Body::Inline(area) => desc.set_inline(&area.bytes()[..total as usize]).expect("validated inline length"),
                    Body::Segs(list) if list.sg.is_some() => {
                        desc.flags = FLAG_SG_LIST;
                        desc.segments[0] = list.sg.as_ref().expect("just matched").0;
                    }
                    _ => {
                        for (i, s) in m.segs().iter().enumerate() {
                            desc.segments[i] = s.global();
                        }
                    }
                }
                desc.nseg = m.nseg;
            }
            Parts::Inline { bytes, len } => {
                total = *len as u64;
                // Padded with zeros by `Message::inline`.
                desc.set_inline_area(bytes, *len as usize);
            }
        }
        desc.total_len = total;
        let cookie = tx.claim();
        desc.cookie = cookie.0;
        self.push_descriptor(&mut tx, &desc);
        tx.insert(cookie, msg, total, sg_buf);
        drop(tx);
        sh.publish_deferred();
        Ok(())
    }

    /// Receives the next message, waiting per the wait strategy.
    pub fn recv(&self) -> Result<Msg> {
        self.recv_inner(None, true)
    }

    /// Receives a message if one is waiting.
    pub fn try_recv(&self) -> Result<Option<Msg>> {
        match self.recv_inner(None, false) {
            Ok(m) => Ok(Some(m)),
            Err(Error::WouldBlock) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Like [`Channel::try_recv`], but returns `None` at once when another
    /// thread is receiving on this channel (e.g. blocked in `recv`) instead
    /// of waiting for it to finish. For a thread that looks for messages in
    /// passing while others wait for them (fido-rpc's running calls look
    /// for cancels this way). Connection errors are left to the receivers.
    pub fn try_recv_if_idle(&self) -> Result<Option<Msg>> {
        let sh = &*self.shared;
        let Some(mut rx) = sh.rx.try_lock() else {
            return Ok(None);
        };
        if sh.state.load(Ordering::Acquire) == BROKEN {
            return Ok(None);
        }
        match rx.ring.poll() {
            Ok(Some(desc)) => self.accept_descriptor(&mut rx, &desc).map(Some),
            Ok(None) => Ok(None),
            Err(e) => Err(sh.mark_broken(e.to_string())),
        }
    }

    pub fn recv_timeout(&self, timeout: Duration) -> Result<Msg> {
        self.recv_inner(Some(timeout), true)
    }

    /// Returns the message itself, not an `Option` of it (a `Msg` is large
    /// enough that the extra wrapping cost a copy on every receive):
    /// `WouldBlock` when not blocking and nothing is there.
    ///
    /// Inlined into each receive, with the waiting out of line
    /// ([`Channel::wait_for_descriptor`]): the message is built where the
    /// caller keeps it, not returned through memory from a call (reading
    /// back what was just stored in narrower pieces stalled a polled round
    /// trip).
    #[inline(always)]
    fn recv_inner(&self, timeout: Option<Duration>, block: bool) -> Result<Msg> {
        let sh = &*self.shared;
        let mut rx = sh.rx.lock();
        // A spinning receiver first looks here, taking a message the moment
        // it is published (a polled reply usually comes within a few looks),
        // before the general wait and its calls; the connection's state is
        // checked when that wait starts.
        let mut quick_looks = if block && rx.wait != WaitStrategy::Block { fido_ring::wait::QUICK_LOOKS } else { 0 };
        let mut waited = RecvWait { timeout, deadline: None, spun: quick_looks > 0 };
        loop {
            // Messages already published are delivered even after the peer died.
            if sh.state.load(Ordering::Acquire) != BROKEN {
                match rx.ring.poll() {
                    Ok(Some(desc)) => return self.accept_descriptor(&mut rx, &desc),
                    Ok(None) => {}
                    Err(e) => return Err(sh.mark_broken(e.to_string())),
                }
            }
            if quick_looks > 0 {
                quick_looks -= 1;
                std::hint::spin_loop();
                continue;
            }
            self.wait_for_descriptor(&mut rx, &mut waited, block)?;
        }
    }

    /// Waits, holding the receive lock, until a descriptor may be there;
    /// an error when the connection ended, the wait timed out or `block` is
    /// false.
    ///
    /// The clock is read only once a spinning receiver has looked
    /// [`fido_ring::wait::QUICK_LOOKS`] times: a polled reply usually comes
    /// sooner, and reading the clock first delayed it (see `quick_spin`).
    #[inline(never)]
    fn wait_for_descriptor(&self, rx: &mut RxState, waited: &mut RecvWait, block: bool) -> Result<()> {
        let sh = &*self.shared;
        // The peer may need that release before it can answer.
        sh.publish_deferred();
        sh.check()?;
        if rx.ring.peer_closed() {
            return Err(Error::Closed);
        }
        if !block {
            return Err(Error::WouldBlock);
        }
        let deadline = match waited.deadline {
            Some(d) => d,
            None => {
                if !waited.spun {
                    waited.spun = true;
                    let ring = &rx.ring;
                    let ready = || -> std::result::Result<bool, RingError> { Ok(ring.pending()? || !sh.is_open()) };
                    if fido_ring::quick_spin(rx.wait, ready).map_err(|e| sh.mark_broken(e.to_string()))? {
                        return Ok(());
                    }
                }
                *waited.deadline.insert(waited.timeout.map(|t| Instant::now() + t))
            }
        };
        // A forwarder blocked here must still pass releases upstream, or a
        // pipeline deadlocks: the source waits for releases that sit in our
        // downstream ring. While forwarded messages are in flight, wake up
        // every REAP_INTERVAL to collect them.
        let forwarded_in_flight = sh.domain.reap_forwarded();
        let step_deadline = if forwarded_in_flight {
            let step = Instant::now() + REAP_INTERVAL;
            Some(deadline.map_or(step, |d| d.min(step)))
        } else {
            deadline
        };
        let local = *rx.ring.local();
        let wait = rx.wait;
        let mut epoch = rx.epoch;
        let ring = &rx.ring;
        let outcome = wait_until(
            wait,
            step_deadline,
            SleepSite {
                sleep: local.data_sleep(),
                epoch: &mut epoch,
                bell: sh.data_bell.wait.as_fd(),
                liveness: Some(sh.liveness.as_fd()),
                futex: Some(sh.peer_block.data_bell()),
            },
            || -> std::result::Result<bool, RingError> { Ok(ring.pending()? || !sh.is_open() || ring.peer_closed()) },
        );
        rx.epoch = epoch;
        match outcome {
            Ok(WaitOutcome::Ready) => Ok(()),
            Ok(WaitOutcome::TimedOut) if deadline.is_none_or(|d| Instant::now() < d) => Ok(()),
            Ok(WaitOutcome::TimedOut) => Err(Error::Timeout),
            Ok(WaitOutcome::PeerGone) => {
                if rx.ring.peer_closed() {
                    return Err(Error::Closed);
                }
                // The liveness socket hung up: the peer process is gone.
                sh.mark_gone(GoneReason::Exited);
                Ok(())
            }
            Err(e) => Err(sh.mark_broken(e.to_string())),
        }
    }

    #[inline(always)]
    fn accept_descriptor(&self, rx: &mut RxState, desc: &Descriptor) -> Result<Msg> {
        let sh = &self.shared;
        // The common small message, without the general validator's
        // segment machinery (the same inline check; one that fails goes on
        // to `validate`, which reports it).
        if desc.flags == FLAG_INLINE && check_inline(desc).is_ok() {
            sh.stats.received.add(1);
            sh.stats.bytes_received.add(desc.total_len);
            rx.delivered += 1;
            return Ok(Msg {
                shared: NonNull::from(&**sh),
                cookie: desc.cookie,
                tag: desc.tag,
                total_len: desc.total_len,
                opcode: desc.opcode,
                nseg: 0,
                defer: false,
                body: Body::Inline(InlineArea::of(desc)),
            });
        }
        self.accept_validated(rx, desc)
    }

    /// Every other descriptor: checked by the general validator.
    #[inline(never)]
    fn accept_validated(&self, rx: &mut RxState, desc: &Descriptor) -> Result<Msg> {
        let sh = &self.shared;
        let v = match validate(desc, &ConnResolver(sh)) {
            Ok(v) => v,
            Err(e) => {
                // Fail the connection; the sender gets its buffers back as
                // undelivered when it notices.
                let err = sh.mark_broken(format!("invalid descriptor: {e}"));
                return Err(err);
            }
        };
        sh.stats.received.add(1);
        sh.stats.bytes_received.add(v.total_len);
        rx.delivered += 1;
        Ok(Msg {
            shared: NonNull::from(&**sh),
            cookie: desc.cookie,
            tag: desc.tag,
            opcode: desc.opcode,
            nseg: desc.nseg,
            defer: false,
            total_len: v.total_len,
            body: match v.inline {
                Some(bytes) => Body::Inline(InlineArea::from_bytes(bytes)),
                None => {
                    let mut segs = v.segments.into_iter().map(|s| Seg { ptr: s.ptr, len: s.len, global_addr: s.global.addr, _keep: s.keep });
                    match (segs.len(), &v.sg_list) {
                        (1, None) => Body::One(segs.next().expect("one segment")),
                        _ => Body::Segs(Box::new(SegList { segs: segs.collect(), sg: v.sg_list })),
                    }
                }
            },
        })
    }

    /// Messages the peer never released before it died or closed. Call after an
    /// error to learn exactly what was not delivered.
    pub fn take_undelivered(&self) -> Vec<Undelivered> {
        let mut tx = self.shared.tx.lock();
        let _ = tx.reap();
        // After a graceful close, only a peer that is also gone (its liveness
        // socket hung up: it dropped everything or died) gives up what it holds.
        let peer_gone = !self.shared.is_open()
            || (tx.ring.peer_closed() && doorbell::peer_hung_up(self.shared.liveness.as_fd()));
        if peer_gone {
            tx.fail_outstanding();
        }
        std::mem::take(&mut tx.undelivered)
    }

    /// Test hook: publishes a raw descriptor as a misbehaving peer would (no
    /// validation, no bookkeeping). Used by the adversarial tests.
    #[doc(hidden)]
    pub fn __send_raw_descriptor(&self, desc: Descriptor) -> Result<()> {
        let mut tx = self.shared.tx.lock();
        tx.ring.push(&desc).map_err(|e| Error::Invalid(e.to_string()))?;
        tx.ring.publish()?;
        Ok(())
    }

    /// Test hook: overwrites our published indices as a lying peer would
    /// (`data`: the descriptor publish index; `releases`: the release index),
    /// and rings the peer. Used by the adversarial tests.
    #[doc(hidden)]
    pub fn __forge_indices(&self, data: Option<u64>, releases: Option<u64>) {
        let local = self.shared.local;
        if let Some(v) = data {
            local.data_prod().store(v, Ordering::Release);
        }
        if let Some(v) = releases {
            local.rel_prod().store(v, Ordering::Release);
        }
        self.shared.tx.lock().ring.wake_peer();
        self.shared.releaser.lock().ring.wake_peer();
    }

    /// Test hook: a duplicate of the ring end of the peer's data doorbell —
    /// exactly what a peer holds of ours. Used by the adversarial tests.
    #[doc(hidden)]
    pub fn __peer_data_bell(&self) -> std::io::Result<OwnedFd> {
        Ok(rustix::io::fcntl_dupfd_cloexec(self.shared.tx.lock().ring.peer_data_bell(), 0)?)
    }

    #[cfg(feature = "tokio")]
    /// Announces that the receiver is about to sleep on its data doorbell.
    /// Returns false (and stays awake) when a message or a state change is
    /// already there. Used by the async flavour; pair with `disarm_rx`.
    pub(crate) fn arm_rx(&self) -> bool {
        let mut rx = self.shared.rx.lock();
        let local = *rx.ring.local();
        fido_ring::protocol::arm(local.data_sleep(), &mut rx.epoch, fido_ring::protocol::Sleep::Socket);
        let ready = rx.ring.pending().unwrap_or(true) || !self.shared.is_open() || rx.ring.peer_closed();
        if ready {
            fido_ring::protocol::disarm(local.data_sleep(), rx.epoch);
        }
        !ready
    }

    #[cfg(feature = "tokio")]
    pub(crate) fn disarm_rx(&self) {
        let rx = self.shared.rx.lock();
        fido_ring::protocol::disarm(rx.ring.local().data_sleep(), rx.epoch);
    }

    #[cfg(feature = "tokio")]
    /// As `arm_rx`, for a sender waiting for window space (releases).
    pub(crate) fn arm_tx(&self) -> bool {
        let mut tx = self.shared.tx.lock();
        let local = *tx.ring.local();
        let mut epoch = tx.epoch;
        fido_ring::protocol::arm(local.space_sleep(), &mut epoch, fido_ring::protocol::Sleep::Socket);
        tx.epoch = epoch;
        let ready = tx.reap().is_err() || tx.ring.free_slots() > 0 || !self.shared.is_open() || tx.ring.peer_closed();
        if ready {
            fido_ring::protocol::disarm(local.space_sleep(), tx.epoch);
        }
        !ready
    }

    #[cfg(feature = "tokio")]
    pub(crate) fn disarm_tx(&self) {
        let tx = self.shared.tx.lock();
        fido_ring::protocol::disarm(tx.ring.local().space_sleep(), tx.epoch);
    }

    #[cfg(feature = "tokio")]
    pub(crate) fn space_doorbell(&self) -> std::os::fd::BorrowedFd<'_> {
        self.shared.space_bell.wait.as_fd()
    }

    #[cfg(feature = "tokio")]
    pub(crate) fn liveness(&self) -> std::os::fd::BorrowedFd<'_> {
        self.shared.liveness.as_fd()
    }

    #[cfg(feature = "tokio")]
    pub(crate) fn note_peer_hangup(&self) {
        self.shared.mark_gone(GoneReason::Exited);
    }

    #[cfg(feature = "tokio")]
    pub(crate) fn forwarded_in_flight(&self) -> bool {
        self.shared.domain.reap_forwarded()
    }

    /// True while the connection is usable.
    pub fn is_open(&self) -> bool {
        // The peer's block directly, not through the send lock: callers
        // check this before every RPC.
        self.shared.is_open() && !self.shared.peer_block.is_closed()
    }

    /// The doorbell wait end this channel's receiver sleeps on. The peer rings it only
    /// after the receiver announced it is going to sleep (blocking `recv`, or
    /// [`crate::AsyncChannel`]), so it is not a readiness signal on its own.
    pub fn data_doorbell(&self) -> std::os::fd::BorrowedFd<'_> {
        self.shared.data_bell.wait.as_fd()
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        let sh = &self.shared;
        // No next send or receive: publish what is parked, and park nothing
        // more (`ConnShared::defer_release`).
        sh.channel_dropped.store(true, Ordering::SeqCst);
        sh.publish_deferred();
        sh.local.set_closed();
        let _ = sh.state.compare_exchange(OPEN, CLOSED_BY_US, Ordering::AcqRel, Ordering::Acquire);
        sh.tx.lock().ring.wake_peer();
        sh.releaser.lock().ring.wake_peer();
        sh.domain.control.notify(Request::Close { conn: sh.conn });
        sh.domain.conns.lock().remove(&sh.conn);
        sh.add_counters(&mut sh.domain.retired.lock());
        let in_flight = sh.tx.lock().ring.in_flight();
        if in_flight > 0 && !doorbell::peer_hung_up(sh.liveness.as_fd()) {
            sh.domain.lingering.lock().push(Lingering { shared: sh.clone() });
        }
        // No message is delivered after this (receiving takes `&self`).
        let delivered = sh.rx.lock().delivered;
        let last = {
            let mut r = sh.releaser.lock();
            r.delivered_in_all = Some(delivered);
            r.dropped == delivered
        };
        if last {
            // SAFETY: the received messages' reference, taken in `assemble`
            // and given up once (`ReleaseState`): all of them are gone, and
            // none will come. `self.shared` still holds the channel's own, so
            // this does not free the connection under it.
            unsafe { Arc::decrement_strong_count(Arc::as_ptr(&self.shared)) };
        }
    }
}

struct Seg {
    ptr: NonNull<u8>,
    len: usize,
    /// Where the segment is in the global address space, as the peer sent it
    /// (for forwarding unchanged).
    global_addr: u64,
    /// Keeps a forwarded arena mapped (`None`: the peer's own arena, kept by
    /// the connection).
    _keep: Option<Arc<Mapping>>,
}

impl Seg {
    fn global(&self) -> Segment {
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
    shared: NonNull<ConnShared>,
    cookie: u64,
    tag: u64,
    total_len: u64,
    opcode: u16,
    nseg: u16,
    /// Dropping parks the release ([`Msg::defer_release`]).
    defer: bool,
    body: Body,
}

/// What a received message carries.
enum Body {
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

struct SegList {
    segs: Vec<Seg>,
    /// The SG list pointer, with what keeps the list's arena mapped.
    sg: Option<(Segment, Option<Arc<Mapping>>)>,
}

/// An inline message's bytes, 16-byte aligned so a protocol can lay out
/// aligned fields in them (fido-rpc puts a root at offset 16).
#[repr(C, align(16))]
struct InlineArea([u64; INLINE_BYTES / 8]);

impl InlineArea {
    /// The inline area of `desc`, copied as the words it arrived in (not
    /// through a byte array: reading those bytes back in wider pieces
    /// stalled on store-to-load forwarding, ~8% of a small receive).
    #[inline]
    fn of(desc: &Descriptor) -> InlineArea {
        let [a, b] = desc.segments;
        InlineArea([a.addr, a.len, b.addr, b.len])
    }
    fn from_bytes(bytes: [u8; INLINE_BYTES]) -> InlineArea {
        InlineArea(bytemuck::cast(bytes))
    }
    fn bytes(&self) -> &[u8; INLINE_BYTES] {
        bytemuck::cast_ref(&self.0)
    }
}

// SAFETY: the segment pointers are into read-only mappings kept alive by the
// `Arc<Mapping>`s this message holds; nothing writes through them. The
// connection pointer is to a `ConnShared` (itself `Send + Sync`) kept alive
// by the messages' reference (`ReleaseState`) wherever the message goes.
unsafe impl Send for Msg {}
unsafe impl Sync for Msg {}

impl Msg {
    /// The connection this message came in on.
    #[inline]
    fn conn(&self) -> &ConnShared {
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
        let copied = &self.conn().domain.bytes_copied;
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
    fn segs(&self) -> &[Seg] {
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
        Some(unsafe { PeerSlice::new(p, len as usize) }.counting(&conn.domain.bytes_copied))
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
        (m.global_base(), bytes.counting(&conn.domain.bytes_copied))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Domain, JoinOptions};
    use std::time::Duration;

    fn pair(socket: &std::path::Path) -> (Domain, Domain, Channel, Channel) {
        let a = Domain::join(JoinOptions::new("a").broker(socket).arena_len(16 << 20).ring_entries(8)).unwrap();
        let b = Domain::join(JoinOptions::new("b").broker(socket).arena_len(16 << 20).ring_entries(8).swizzle(true)).unwrap();
        let l = a.offer("refs").unwrap();
        let cb = b.connect("refs").unwrap();
        let ca = l.accept_timeout(Duration::from_secs(5)).unwrap();
        (a, b, ca, cb)
    }

    /// The received messages' one reference (`ReleaseState`) keeps the
    /// connection alive for exactly as long as the channel or any message
    /// it delivered, whichever order they go in and on whatever thread.
    #[test]
    fn received_messages_keep_their_connection_alive_and_no_longer() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("broker.sock");
        let _broker = fido_broker::Embedded::start(fido_broker::Config::new(&socket, &dir.path().join("state"))).unwrap();
        for channel_first in [true, false] {
            let (_a, _b, rx, tx) = pair(&socket);
            for i in 0..3u64 {
                tx.send_inline(i, 0, b"x").unwrap();
            }
            let msgs: Vec<Msg> = (0..3).map(|_| rx.recv_timeout(Duration::from_secs(5)).unwrap()).collect();
            let conn = Arc::downgrade(&rx.shared);
            if channel_first {
                drop(rx);
                assert!(conn.upgrade().is_some(), "the messages keep the connection");
                assert_eq!(msgs[2].tag(), 2);
                std::thread::spawn(move || drop(msgs)).join().unwrap();
            } else {
                drop(msgs);
                assert!(conn.upgrade().is_some(), "the channel keeps the connection");
                drop(rx);
            }
            assert!(conn.upgrade().is_none(), "the connection outlived its channel and messages (channel first: {channel_first})");
            // The releases reached the sender either way.
            tx.reap().unwrap();
            assert_eq!(tx.in_flight(), 0);
        }
    }
}
