//! Fido's data path: descriptor rings and doorbells.
//!
//! A connection is two single-producer/single-consumer rings, one per direction.
//! Each side keeps everything it writes in a **block** inside its own arena
//! (`block`): its outgoing descriptors and publish index, its consume index, its
//! sleep words and the cookies of messages it has finished with (releases). The
//! peer maps that memory read-only. So no side ever writes the other's memory,
//! and a side's view of its peer is a handful of untrusted numbers that this
//! crate checks before use (an index that jumps is an error, not a wild read).
//!
//! Signalling is batched: a side wakes its peer only when the peer said it is
//! going to sleep (`protocol`), and the way the peer said: a `FUTEX_WAKE` on a
//! bell word in our own block (`futex`, for short sleeps) or one byte on its
//! socket doorbell (`doorbell`, for long ones). A busy stream costs no system
//! calls.
//!
//! This crate must never write a peer's block, never read a descriptor slot that
//! was not published, and never trust an index, cookie or length read from peer
//! memory without checking it. It knows nothing about arenas or pointers:
//! validating a descriptor's segments is the caller's job (`fido`).

pub mod block;
pub mod desc;
pub mod doorbell;
pub mod futex;
pub mod protocol;
mod sync;
pub mod wait;

pub use block::{block_len, BlockError, LocalBlock, PeerBlock, FLAG_OTHER_KERNEL};
pub use desc::{inline_area, Descriptor, Segment, FLAG_INLINE, FLAG_SG_LIST, INLINE_BYTES, INLINE_SEGMENTS, MAX_SEGMENTS};
pub use wait::{quick_spin, wait_until, SleepSite, WaitOutcome, WaitStrategy};

use protocol::Wake;

/// Wakes a peer the way its sleep word asked: `bell` is our own bell word
/// beside the index we just published, `socket` the ring end of its doorbell.
/// The common case (nobody sleeps) is decided inline; the rest is not.
#[inline]
fn wake(how: Wake, bell: &sync::AtomicU32, socket: &doorbell::RingEnd) -> std::io::Result<Notify> {
    match how {
        Wake::None => Ok(Notify::Suppressed),
        _ => wake_sleeper(how, bell, socket),
    }
}

#[cold]
fn wake_sleeper(how: Wake, bell: &sync::AtomicU32, socket: &doorbell::RingEnd) -> std::io::Result<Notify> {
    match how {
        Wake::None => Ok(Notify::Suppressed),
        Wake::Futex => {
            protocol::bump(bell);
            futex::wake_all(bell);
            Ok(Notify::Rung)
        }
        Wake::Socket => {
            socket.ring()?;
            Ok(Notify::Rung)
        }
    }
}

/// Wakes a peer however it sleeps (for state changes, e.g. a close).
fn wake_any(bell: &sync::AtomicU32, socket: &doorbell::RingEnd) {
    protocol::bump(bell);
    futex::wake_all(bell);
    let _ = socket.ring();
}

/// A peer broke the ring protocol. The connection is unusable; nothing outside
/// it is affected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RingError {
    #[error("peer's {what} index jumped from {from} to {to} (ring of {entries})")]
    IndexJump { what: &'static str, from: u64, to: u64, entries: u32 },
    #[error("ring is full")]
    Full,
}

/// Whether publishing needed a doorbell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notify {
    Rung,
    Suppressed,
}

#[inline]
fn check_advance(what: &'static str, from: u64, to: u64, entries: u32) -> Result<u64, RingError> {
    match to.checked_sub(from) {
        Some(n) if n <= entries as u64 => Ok(n),
        _ => Err(RingError::IndexJump { what, from, to, entries }),
    }
}

/// Sending half: produces descriptors into our block, reaps the peer's releases.
pub struct TxRing {
    local: LocalBlock,
    peer: PeerBlock,
    prod: u64,
    rel_cons: u64,
    last_rung: u64,
    peer_data_bell: doorbell::RingEnd,
}

impl TxRing {
    pub fn new(local: LocalBlock, peer: PeerBlock, peer_data_bell: doorbell::RingEnd) -> TxRing {
        TxRing { local, peer, prod: 0, rel_cons: 0, last_rung: 0, peer_data_bell }
    }

    /// Messages that may still be sent before the peer releases some.
    ///
    /// The window is the ring size counted in *unreleased* messages, not just
    /// unconsumed descriptors: that bounds the peer's release ring too (it can
    /// never hold more releases than we have messages out), and since an honest
    /// peer consumes a descriptor before it releases it, every slot we reuse has
    /// been consumed. A peer that releases what it never consumed only makes us
    /// overwrite its own unread descriptors. So the hot path never reads the
    /// peer's consume index (a cache line the peer writes on every receive).
    #[inline]
    pub fn free_slots(&self) -> u64 {
        let entries = self.local.entries() as u64;
        // `rel_cons <= prod` always: `releases_ready` rejects more releases than
        // messages out.
        entries - (self.prod - self.rel_cons).min(entries)
    }

    /// Messages sent and not yet released.
    #[inline]
    pub fn in_flight(&self) -> u64 {
        self.prod - self.rel_cons
    }

    /// Writes a descriptor into the next slot. A polling consumer may take it
    /// at once (the slot carries its publication mark); a sleeping one is
    /// woken only by [`TxRing::publish`], so push a batch, then publish once.
    #[inline]
    pub fn push(&mut self, desc: &Descriptor) -> Result<(), RingError> {
        if self.free_slots() == 0 {
            return Err(RingError::Full);
        }
        self.local.write_descriptor(self.prod, desc);
        self.prod += 1;
        Ok(())
    }

    /// Makes pushed descriptors visible and wakes the peer only if it sleeps.
    #[inline]
    pub fn publish(&mut self) -> std::io::Result<Notify> {
        let how = protocol::publish(self.local.data_prod(), self.prod, self.peer.data_sleep(), &mut self.last_rung);
        wake(how, self.local.data_bell(), &self.peer_data_bell)
    }

    /// Takes the next cookie the peer released, if any.
    #[inline]
    pub fn poll_release(&mut self) -> Result<Option<u64>, RingError> {
        if self.releases_ready()? == 0 {
            return Ok(None);
        }
        let cookie = self.pending_release(0);
        self.consume_releases(1);
        Ok(Some(cookie))
    }

    /// How many releases the peer published that we have not reaped
    /// (checked: never more than the messages out). Read them with
    /// [`TxRing::pending_release`], then mark them reaped with
    /// [`TxRing::consume_releases`]: one look at the peer's index and one
    /// store of ours per batch, not per release.
    #[inline]
    pub fn releases_ready(&self) -> Result<u64, RingError> {
        let published = protocol::observe(self.peer.rel_prod());
        let available = check_advance("release", self.rel_cons, published, self.local.entries())?;
        // More releases than messages out: the peer is lying.
        if self.rel_cons + available > self.prod {
            return Err(RingError::IndexJump { what: "release", from: self.rel_cons, to: published, entries: self.local.entries() });
        }
        Ok(available)
    }

    /// The cookie of pending release `k` (`k` below what
    /// [`TxRing::releases_ready`] returned).
    #[inline]
    pub fn pending_release(&self, k: u64) -> u64 {
        self.peer.read_release(self.rel_cons + k)
    }

    /// Marks the first `n` pending releases reaped (`n` at most what
    /// [`TxRing::releases_ready`] returned).
    #[inline]
    pub fn consume_releases(&mut self, n: u64) {
        self.rel_cons += n;
        self.local.rel_cons().store(self.rel_cons, std::sync::atomic::Ordering::Release);
    }

    /// The ring end of the peer's data doorbell.
    pub fn peer_data_bell(&self) -> &doorbell::RingEnd {
        &self.peer_data_bell
    }

    /// Wakes the peer's data waiter unconditionally, however it sleeps (to make
    /// it look at the connection state, e.g. after we closed it).
    pub fn wake_peer(&self) {
        wake_any(self.local.data_bell(), &self.peer_data_bell);
    }

    /// The peer's release bell (its memory, read-only here): where we sleep on
    /// a futex for window space.
    pub fn peer_space_bell(&self) -> &sync::AtomicU32 {
        self.peer.space_bell()
    }

    pub fn published(&self) -> u64 {
        self.prod
    }

    /// The peer's sleep word we last woke (diagnostics).
    pub fn last_woken(&self) -> u64 {
        self.last_rung
    }

    #[inline]
    pub fn peer_closed(&self) -> bool {
        self.peer.is_closed()
    }

    pub fn local(&self) -> &LocalBlock {
        &self.local
    }
}

/// Receiving half: consumes the peer's descriptors.
pub struct RxRing {
    local: LocalBlock,
    peer: PeerBlock,
    cons: u64,
    /// Empty looks since the publish index was last checked (`pending`).
    idle_looks: std::cell::Cell<u32>,
}

/// A waiting consumer checks the peer's publish index once per this many
/// empty looks at the next slot (see [`RxRing::pending`]).
const INDEX_CHECK_EVERY: u32 = 64;

impl RxRing {
    pub fn new(local: LocalBlock, peer: PeerBlock) -> RxRing {
        RxRing { local, peer, cons: 0, idle_looks: std::cell::Cell::new(0) }
    }

    /// Copies out the next published descriptor, if any. The caller validates
    /// its contents.
    #[inline]
    pub fn poll(&mut self) -> Result<Option<Descriptor>, RingError> {
        if !self.peer.slot_published(self.cons) {
            self.idle_look()?;
            return Ok(None);
        }
        // The mark is the ring's, not the message's.
        let desc = Descriptor { seq: 0, ..self.peer.read_descriptor(self.cons) };
        self.cons += 1;
        self.local.data_cons().store(self.cons, std::sync::atomic::Ordering::Release);
        Ok(Some(desc))
    }

    /// True when a descriptor is waiting.
    ///
    /// Looks at the next slot's publication mark (the slot is the line the
    /// message arrives in). One empty look in `INDEX_CHECK_EVERY` (64), this
    /// one's or [`RxRing::poll`]'s, also checks the publish index, so a
    /// spinning waiter does not keep a second line the producer writes in
    /// its cache.
    #[inline]
    pub fn pending(&self) -> Result<bool, RingError> {
        if self.peer.slot_published(self.cons) {
            return Ok(true);
        }
        self.idle_look()?;
        Ok(false)
    }

    /// Counts an empty look; one in `INDEX_CHECK_EVERY` checks the index.
    #[inline]
    fn idle_look(&self) -> Result<(), RingError> {
        let looks = self.idle_looks.get().wrapping_add(1);
        self.idle_looks.set(looks);
        if looks % INDEX_CHECK_EVERY == 0 {
            self.check_index()?;
        }
        Ok(())
    }

    /// Catches a peer whose publish index went wild: it may trail what we
    /// consumed (a producer marks slots before it publishes them as a batch),
    /// but never by more than a ring, and never lead by more.
    fn check_index(&self) -> Result<(), RingError> {
        let published = protocol::observe(self.peer.data_prod());
        let entries = self.local.entries();
        if !protocol::index_plausible(published, self.cons, entries) {
            return Err(RingError::IndexJump { what: "publish", from: self.cons, to: published, entries });
        }
        Ok(())
    }

    pub fn local(&self) -> &LocalBlock {
        &self.local
    }

    #[inline]
    pub fn peer_closed(&self) -> bool {
        self.peer.is_closed()
    }

    pub fn consumed(&self) -> u64 {
        self.cons
    }

    /// The peer's data bell (its memory, read-only here): where we sleep on a
    /// futex for descriptors.
    pub fn peer_data_bell(&self) -> &sync::AtomicU32 {
        self.peer.data_bell()
    }

    /// The peer's block (read-only, untrusted).
    pub fn peer(&self) -> PeerBlock {
        self.peer
    }
}

/// Publishes releases (cookies of messages we are done with) to the peer. Shared
/// by every thread that may drop a received message, behind a lock.
pub struct Releaser {
    local: LocalBlock,
    peer: PeerBlock,
    prod: u64,
    /// The peer's reap index as last read: a lower bound of the real one
    /// (it only grows), so the room it implies is never more than there is.
    reaped: u64,
    last_rung: u64,
    peer_space_bell: doorbell::RingEnd,
}

impl Releaser {
    /// Wakes the peer's space waiter unconditionally, however it sleeps.
    pub fn wake_peer(&self) {
        wake_any(self.local.space_bell(), &self.peer_space_bell);
    }

    pub fn new(local: LocalBlock, peer: PeerBlock, peer_space_bell: doorbell::RingEnd) -> Releaser {
        Releaser { local, peer, prod: 0, reaped: 0, last_rung: 0, peer_space_bell }
    }

    /// Publishes one release. `Full` means the peer stopped reaping releases
    /// while holding more messages in flight than the ring has slots: a
    /// misbehaving peer.
    #[inline]
    pub fn release(&mut self, cookie: u64) -> Result<Notify, RingError> {
        // Read the peer's reap index only when our last reading says the
        // ring is full: it is a line the peer writes whenever it reaps, so
        // reading it on every release would cost a cache miss each time.
        let entries = self.local.entries() as u64;
        if self.prod - self.reaped == entries {
            let reaped = self.peer.rel_cons().load(std::sync::atomic::Ordering::Acquire);
            // The index may only grow, and never past what we published.
            if reaped < self.reaped || reaped > self.prod {
                return Err(RingError::IndexJump { what: "release-consume", from: self.reaped, to: reaped, entries: self.local.entries() });
            }
            self.reaped = reaped;
            if self.prod - reaped == entries {
                return Err(RingError::Full);
            }
        }
        self.local.write_release(self.prod, cookie);
        self.prod += 1;
        let how = protocol::publish(self.local.rel_prod(), self.prod, self.peer.space_sleep(), &mut self.last_rung);
        // A doorbell error is the waiter's problem (its liveness socket
        // reports its departure); the release itself is published.
        Ok(wake(how, self.local.space_bell(), &self.peer_space_bell).unwrap_or(Notify::Rung))
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
