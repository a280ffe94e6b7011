//! The send side of a channel: the ring we publish descriptors in, the
//! table of messages in flight (by cookie) and the collection of the peer's
//! releases, and the sends themselves.

// `SendError` carries the unsent message back by value: boxing it would cost an
// allocation on every failed `try_send`, the call that polls a full window.
#![allow(clippy::result_large_err)]

use super::conn::{ConnShared, Counter};
use super::message::{inline_too_long, Body, Hold, Message, Msg, Parts, SendError, Undelivered};
use super::Channel;
use crate::error::{Error, InvalidArgument, ProtocolError, Result};
use fido_proto::GoneReason;
use fido_ring::{
    doorbell, wait::SpinBudget, wait_until, Descriptor, Notify, Segment, SleepSite, TxRing, WaitOutcome, WaitStrategy, FLAG_SG_LIST, INLINE_BYTES,
    INLINE_SEGMENTS, MAX_SEGMENTS,
};
use fido_shm::Buf;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One entry of the table of messages in flight. Filled and emptied field
/// by field, in place: built on the stack and copied in as one value, the
/// entry was a 160-byte `memcpy`, ~17% of the samples of a one-thread
/// send-and-receive round trip (`perf record`).
#[derive(Default)]
pub(super) struct Slot {
    /// `None` while the slot is free.
    pub(super) parts: Option<Parts>,
    /// The cookie's high half for this use of the slot.
    pub(super) generation: u32,
    pub(super) tag: u64,
    pub(super) opcode: u16,
    /// Payload bytes, for [`TxState::outstanding`].
    pub(super) len: u64,
    pub(super) hold: Option<Hold>,
    /// The SG list we wrote for this message, if any.
    pub(super) sg_list: Option<Buf>,
}

impl Slot {
    /// Empties the slot, handing back what it held as the message it was.
    pub(super) fn take(&mut self) -> Option<Message> {
        let parts = self.parts.take()?;
        self.sg_list = None;
        Some(Message { tag: self.tag, opcode: self.opcode, parts, hold: self.hold.take() })
    }
}

/// A message's cookie: its slot in the in-flight table (low 32 bits) and
/// the slot's generation when it was taken (high 32 bits), so a release of
/// an earlier occupant is told apart.
#[derive(Clone, Copy)]
pub(super) struct Cookie(pub(super) u64);

impl Cookie {
    fn index(self) -> usize {
        (self.0 & 0xffff_ffff) as usize
    }
    fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

/// Sender state: the ring and the table of messages in flight, by cookie.
pub(super) struct TxState {
    pub(super) ring: TxRing,
    pub(super) table: Vec<Slot>,
    pub(super) free: Vec<u32>,
    pub(super) generation: u32,
    pub(super) epoch: u64,
    pub(super) wait: WaitStrategy,
    /// How long an adaptive wait for space spins, learned from the last ones.
    pub(super) learned: SpinBudget,
    pub(super) undelivered: Vec<Undelivered>,
    /// What the messages in `table` add up to. Written only under the
    /// lock; shared with `ConnShared` so it can be read without taking it.
    pub(super) outstanding: Arc<Outstanding>,
}

/// Messages in flight and their payload bytes (what the peer's releases
/// will give back), written under the send lock, read by anyone.
#[derive(Default)]
pub(super) struct Outstanding {
    pub(super) messages: Counter,
    pub(super) bytes: Counter,
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
    pub(super) fn reap(&mut self) -> std::result::Result<(), ProtocolError> {
        let ready = self.ring.releases_ready().map_err(|e| ProtocolError::Ring(e.to_string()))?;
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
                    return Err(ProtocolError::UnknownRelease { cookie: cookie.0 });
                }
            }
        }
        self.ring.consume_releases(ready);
        Ok(())
    }

    /// Hands every unreleased message back as undelivered.
    pub(super) fn fail_outstanding(&mut self) {
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

/// Fills `desc` with a received message's layout, unchanged: its inline
/// bytes, its SG list, or its segments.
fn forward_as_received(desc: &mut Descriptor, m: &Msg) {
    match &m.body {
        // Validated on receipt: `total_len` ≤ INLINE_BYTES.
        Body::Inline(area) => desc.set_inline(&area.bytes()[..m.total_len as usize]).expect("validated inline length"),
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

/// Puts `segs` (1..=MAX_SEGMENTS, none empty: checked by the caller) in
/// `desc`: in the descriptor itself when they fit, else in an SG list
/// written in our arena, which is returned to be kept while in flight.
fn lay_out_segments(sh: &ConnShared, desc: &mut Descriptor, segs: &[Segment]) -> Result<Option<Buf>> {
    desc.nseg = segs.len() as u16;
    if segs.len() <= INLINE_SEGMENTS {
        desc.segments[..segs.len()].copy_from_slice(segs);
        return Ok(None);
    }
    let bytes = std::mem::size_of_val(segs);
    let mut list = sh.conns.local.arena.alloc(bytes)?;
    list.truncate(bytes);
    for (i, seg) in segs.iter().enumerate() {
        list[i * 16..i * 16 + 8].copy_from_slice(&seg.addr.to_ne_bytes());
        list[i * 16 + 8..i * 16 + 16].copy_from_slice(&seg.len.to_ne_bytes());
    }
    desc.flags = FLAG_SG_LIST;
    desc.segments[0] = Segment { addr: list.gptr().addr(), len: bytes as u64 };
    Ok(Some(list))
}

impl Channel {
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
            let mut learned = tx.learned;
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
                        futex: sh.futex_reaches.then(|| sh.peer_block.space_bell()),
                        learned: &mut learned,
                        recheck: sh.doorbell_recheck,
                    },
                    || -> std::result::Result<bool, ProtocolError> {
                        txr.reap()?;
                        Ok(txr.ring.free_slots() > 0 || !sh.is_open() || txr.ring.peer_closed())
                    },
                )
            };
            tx.epoch = epoch;
            tx.learned = learned;
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
                    return Err(SendError { error: InvalidArgument::TooManySegments { count: bufs.len() }.into(), message: msg });
                }
                total = bufs.iter().map(|b| b.len() as u64).sum::<u64>();
                if bufs.iter().any(|b| b.is_empty()) {
                    return Err(SendError { error: InvalidArgument::EmptyBuffer.into(), message: msg });
                }
                if bufs.len() <= INLINE_SEGMENTS {
                    for (i, b) in bufs.iter().enumerate() {
                        desc.segments[i] = Segment { addr: b.gptr().addr(), len: b.len() as u64 };
                    }
                } else {
                    let segs: Vec<Segment> = bufs.iter().map(|b| Segment { addr: b.gptr().addr(), len: b.len() as u64 }).collect();
                    match lay_out_segments(sh, &mut desc, &segs) {
                        Ok(list) => sg_buf = list,
                        Err(error) => return Err(SendError { error, message: msg }),
                    }
                }
                desc.nseg = bufs.len() as u16;
            }
            Parts::Forward(m) => {
                self.note_forwarding();
                total = m.total_len;
                forward_as_received(&mut desc, m);
            }
            Parts::Shared(shared) => {
                self.note_forwarding();
                if let Some(m) = shared.as_received() {
                    total = m.total_len;
                    forward_as_received(&mut desc, m);
                } else {
                    let segs = shared.segments();
                    if segs.len() > MAX_SEGMENTS {
                        return Err(SendError { error: InvalidArgument::TooManySegments { count: segs.len() }.into(), message: msg });
                    }
                    total = segs.iter().map(|s| s.len).sum();
                    match lay_out_segments(sh, &mut desc, &segs) {
                        Ok(list) => sg_buf = list,
                        Err(error) => return Err(SendError { error, message: msg }),
                    }
                }
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

    /// Remembers that this channel carries forwarded messages, whose
    /// releases must flow upstream even while this domain only receives.
    fn note_forwarding(&self) {
        let sh = &self.shared;
        if !sh.forwarding.swap(true, Ordering::Relaxed) {
            sh.conns.forwarding.lock().push(Arc::downgrade(sh));
        }
    }

    /// Forwards a received message to this channel's peer by pointer while
    /// keeping it shared: `msg` can go to other channels too (one reference
    /// per send), and the upstream sender gets its release once every
    /// downstream peer released it and every `Arc` of it is dropped. What
    /// comes back undelivered holds one reference; dropping it gives that up.
    /// Same as `send(Message::shared(msg))`.
    pub fn forward_shared(&self, msg: &Arc<Msg>) -> std::result::Result<(), SendError> {
        self.send(Message::shared(msg))
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

}
