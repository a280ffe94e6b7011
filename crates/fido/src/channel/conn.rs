//! A connection's shared state: what the channel, its received messages and
//! the domain's bookkeeping all reach — the rings and doorbells, the
//! connection's state, the release side, and the statistics.

use super::connections::Connections;
use super::message::{Message, Parts};
use super::recv::RxState;
use super::send::{Outstanding, TxState};
use crate::error::{Error, ProtocolError, Result};
use fido_proto::{ConnId, Counters, GoneReason, PeerInfo};
use fido_ring::{doorbell, LocalBlock, Notify, PeerBlock, Releaser};
use fido_shm::{Buf, Mapping};
use parking_lot::Mutex;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

/// What keeps a domain alive, without naming its type (the channel does
/// not depend on the domain).
pub(crate) type DomainHandle = Arc<dyn std::any::Any + Send + Sync>;

/// Where a connection is in its life. It starts `Open` and leaves it once,
/// for good: whatever ends it first is what every later call reports.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ConnState {
    Open = 0,
    /// The peer's process is gone (its liveness socket hung up, or the broker
    /// saw it exit).
    PeerExited = 1,
    /// The peer missed its heartbeats.
    PeerHung = 2,
    /// The peer left the broker.
    PeerLeft = 3,
    /// The peer broke the ring protocol (`ConnShared::broken` says how).
    Broken = 4,
    /// Our `Channel` was dropped.
    ClosedByUs = 5,
    /// The broker's policy evicted the peer.
    PeerEvicted = 6,
    /// The broker's policy revoked this connection (the peer lives on).
    Revoked = 7,
}

impl From<GoneReason> for ConnState {
    fn from(reason: GoneReason) -> ConnState {
        match reason {
            GoneReason::Exited => ConnState::PeerExited,
            GoneReason::MissedHeartbeat => ConnState::PeerHung,
            GoneReason::Left => ConnState::PeerLeft,
            GoneReason::Evicted => ConnState::PeerEvicted,
            GoneReason::Revoked => ConnState::Revoked,
        }
    }
}

impl TryFrom<u8> for ConnState {
    type Error = u8;
    fn try_from(v: u8) -> std::result::Result<ConnState, u8> {
        Ok(match v {
            0 => ConnState::Open,
            1 => ConnState::PeerExited,
            2 => ConnState::PeerHung,
            3 => ConnState::PeerLeft,
            4 => ConnState::Broken,
            5 => ConnState::ClosedByUs,
            6 => ConnState::PeerEvicted,
            7 => ConnState::Revoked,
            other => return Err(other),
        })
    }
}

/// A [`ConnState`] that any thread reads and the first to end the
/// connection sets: an `AtomicU8` holding `ConnState as u8`.
pub(super) struct AtomicConnState(AtomicU8);

impl AtomicConnState {
    pub(super) fn new() -> AtomicConnState {
        AtomicConnState(AtomicU8::new(ConnState::Open as u8))
    }

    pub(super) fn load(&self) -> ConnState {
        let v = self.0.load(Ordering::Acquire);
        ConnState::try_from(v).expect("only ConnState values are stored")
    }

    /// Whether the state is `state` (one load and compare, for the data path).
    #[inline]
    pub(super) fn is(&self, state: ConnState) -> bool {
        self.0.load(Ordering::Acquire) == state as u8
    }

    /// Ends an open connection with `to`; one already ended keeps its state.
    pub(super) fn end(&self, to: ConnState) {
        let _ = self.0.compare_exchange(ConnState::Open as u8, to as u8, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// `ConnShared::deferred` when no release is parked. (A peer's cookie of
/// this value is released at once instead.)
pub(super) const NO_DEFERRED: u64 = u64::MAX;

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
pub(super) struct ReleaseState {
    pub(super) ring: Releaser,
    /// Received messages dropped.
    pub(super) dropped: u64,
    /// Set by the channel's drop: every message it ever delivered.
    pub(super) delivered_in_all: Option<u64>,
}

/// Single-writer counter: written only under its half's lock, read by anyone.
#[derive(Default)]
pub(super) struct Counter(AtomicU64);

impl Counter {
    #[inline]
    pub(super) fn add(&self, n: u64) {
        // One writer (the lock holder): a plain load + store, no locked RMW.
        self.0.store(self.0.load(Ordering::Relaxed) + n, Ordering::Relaxed);
    }
    #[inline]
    pub(super) fn sub(&self, n: u64) {
        self.0.store(self.0.load(Ordering::Relaxed) - n, Ordering::Relaxed);
    }
    pub(super) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The connection's counters, each written under the lock named here and
/// nowhere else.
#[derive(Default)]
pub(super) struct Stats {
    /// Under the send lock (`ConnShared::tx`).
    pub(super) sent: Counter,
    /// Under the receive lock (`ConnShared::rx`).
    pub(super) received: Counter,
    /// Under the send lock.
    pub(super) bytes_sent: Counter,
    /// Under the receive lock.
    pub(super) bytes_received: Counter,
    /// Data doorbells, under the send lock.
    pub(super) rung: Counter,
    pub(super) suppressed: Counter,
    /// Release doorbells, under the release lock (`ConnShared::releaser`).
    pub(super) release_rung: Counter,
    pub(super) release_suppressed: Counter,
}

/// State shared by a channel, its received messages and the domain.
///
/// Drop order: Rust runs [`ConnShared`]'s `Drop::drop` first, then drops the
/// fields in the order they are declared. The two that own ring memory —
/// `peer_map` (the peer's arena, holding its block) and `_block` (our block,
/// back to our allocator when dropped) — are declared last, so that every
/// field that points into them (`local`, `peer_block`, the rings in `tx`, `rx`
/// and `releaser`) is gone before that memory is, whatever drop code those
/// fields are given later. Keep them last (`tests::ring_memory_is_dropped_last`).
pub(crate) struct ConnShared {
    pub(crate) conn: ConnId,
    pub(crate) service: String,
    pub(crate) peer: PeerInfo,
    /// The domain's channels and resources.
    pub(super) conns: Arc<Connections>,
    /// Keeps the domain alive while the connection is: its control thread
    /// routes this connection's events (peer gone, closed).
    pub(super) _domain: DomainHandle,
    /// Our ring block, in `_block`.
    pub(super) local: LocalBlock,
    /// Our doorbells: we wait on `.wait`; the peer holds a copy of `.ring`,
    /// and so do we, to wake our own waiters.
    pub(super) data_bell: doorbell::Doorbell,
    pub(super) space_bell: doorbell::Doorbell,
    pub(super) liveness: OwnedFd,
    /// Whether futexes on the peer's words reach it (both under one kernel):
    /// not across a VM boundary, where only doorbells do.
    pub(super) futex_reaches: bool,
    /// How long one doorbell sleep lasts before the ring is looked at again:
    /// `fido_ring::wait::GUEST_RECHECK` where our doorbells arrive as
    /// emulated interrupts (we are a VM guest), so a lost interrupt is a
    /// delay; `None` (until rung) on the host.
    pub(super) doorbell_recheck: Option<std::time::Duration>,
    /// The peer's block (read-only): its bell words are where our waiters
    /// sleep on a futex.
    pub(super) peer_block: PeerBlock,
    pub(super) releaser: Mutex<ReleaseState>,
    /// The cookie of a dropped message whose release waits for the next
    /// send or receive on this channel ([`Msg::defer_release`]), or
    /// [`NO_DEFERRED`].
    pub(super) deferred: AtomicU64,
    /// Set when the `Channel` is dropped: there is no next send or receive,
    /// so no release waits any more.
    pub(super) channel_dropped: AtomicBool,
    pub(super) state: AtomicConnState,
    pub(super) broken: Mutex<Option<ProtocolError>>,
    pub(super) stats: Stats,
    pub(super) tx: Mutex<TxState>,
    pub(super) rx: Mutex<RxState>,
    /// Set once this channel carried a forwarded message (see `reap_forwarded`).
    pub(super) forwarding: AtomicBool,
    /// `TxState::outstanding`, readable without the tx lock.
    pub(super) outstanding: Arc<Outstanding>,
    // Ring memory: declared last, dropped last (see above).
    /// The peer's arena, mapped read-only: its ring block and the messages
    /// it sends us.
    pub(super) peer_map: Arc<Mapping>,
    /// Our ring block's memory in our arena.
    pub(super) _block: Buf,
}

// SAFETY: the raw pointers inside (ring blocks) point into mappings kept alive
// by `block` and `peer_map`; every access goes through the rings' atomics or
// under the tx/rx/releaser locks.
unsafe impl Send for ConnShared {}
// SAFETY: as for Send: shared access is through atomics or under those locks.
unsafe impl Sync for ConnShared {}

impl ConnShared {
    pub(crate) fn is_open(&self) -> bool {
        self.state.is(ConnState::Open)
    }

    pub(crate) fn mark_gone(&self, reason: GoneReason) {
        self.state.end(reason.into());
        self.wake_local();
    }

    pub(super) fn mark_broken(&self, why: ProtocolError) -> Error {
        tracing::warn!(conn = self.conn, peer = self.peer.domain, "closing connection: {why}");
        *self.broken.lock() = Some(why.clone());
        self.state.end(ConnState::Broken);
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

    fn state_error(&self, state: ConnState) -> Error {
        let domain = self.peer.domain;
        match state {
            ConnState::PeerExited => Error::PeerGone { domain, reason: "exited" },
            ConnState::PeerHung => Error::PeerGone { domain, reason: "missed heartbeats" },
            ConnState::PeerLeft => Error::PeerGone { domain, reason: "left" },
            ConnState::PeerEvicted => Error::PeerGone { domain, reason: "evicted by the broker's policy" },
            ConnState::Revoked => Error::PeerGone { domain, reason: "connection revoked by the broker's policy" },
            ConnState::Broken => Error::Protocol(self.broken.lock().clone().expect("set before the state turns Broken")),
            ConnState::Open | ConnState::ClosedByUs => Error::Closed,
        }
    }

    /// Ok while the connection is usable.
    #[inline]
    pub(super) fn check(&self) -> Result<()> {
        if self.state.is(ConnState::Open) {
            return Ok(());
        }
        Err(self.state_error(self.state.load()))
    }

    /// Releases a dropped message; true when it was the last one the
    /// messages' reference to this connection was kept for (the caller then
    /// gives it up, see `ReleaseState`).
    pub(super) fn release(&self, cookie: u64) -> bool {
        let mut r = self.releaser.lock();
        // Releases keep flowing after either side closed: the peer frees its
        // buffers only once we are done with them (or gone).
        let published = if self.state.is(ConnState::Broken) { Ok(Notify::Suppressed) } else { r.ring.release(cookie) };
        r.dropped += 1;
        let last = r.delivered_in_all == Some(r.dropped);
        // Counted before the unlock: a `Counter` has one writer at a time,
        // the holder of its lock, and messages are dropped on any thread.
        match published {
            Ok(Notify::Rung) => self.stats.release_rung.add(1),
            Ok(Notify::Suppressed) => self.stats.release_suppressed.add(1),
            Err(_) => {}
        }
        drop(r);
        if let Err(e) = published {
            if self.is_open() {
                self.mark_broken(ProtocolError::Ring(format!("cannot publish release: {e}")));
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
    pub(super) fn defer_release(&self, cookie: u64) -> bool {
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
    pub(super) fn publish_deferred(&self) -> bool {
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

impl Drop for ConnShared {
    fn drop(&mut self) {
        // Forwarded messages the downstream never released must not be
        // released upstream now: a release means "delivered", and the upstream
        // sender would believe it. Keep them held for the life of the domain;
        // the upstream sees them in flight, and reported undelivered if this
        // domain dies. (Messages handed to the application through
        // `take_undelivered` are its to resend or drop.)
        let tx = self.tx.get_mut();
        // A shared forward's reference is kept the same way: dropping it
        // could be the last one, a release.
        let held: Vec<Message> = tx
            .table
            .iter_mut()
            .filter_map(|slot| match slot.take() {
                Some(m @ Message { parts: Parts::Forward(_) | Parts::Shared(_), .. }) => Some(m),
                _ => None,
            })
            .collect();
        if !held.is_empty() {
            tracing::warn!(conn = self.conn, held = held.len(), "downstream went away holding forwarded messages; keeping them unreleased");
            self.conns.orphaned.lock().extend(held);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{AtomicConnState, ConnState};
    use fido_proto::GoneReason;

    /// Every state survives the trip through its `u8`; no other byte is a
    /// state; a connection ends once, with whatever ended it first.
    #[test]
    fn connection_states_round_trip_and_end_once() {
        let all = [
            ConnState::Open,
            ConnState::PeerExited,
            ConnState::PeerHung,
            ConnState::PeerLeft,
            ConnState::Broken,
            ConnState::ClosedByUs,
            ConnState::PeerEvicted,
            ConnState::Revoked,
        ];
        for s in all {
            assert_eq!(ConnState::try_from(s as u8), Ok(s));
        }
        assert_eq!(ConnState::try_from(all.len() as u8), Err(all.len() as u8));
        assert_eq!(ConnState::from(GoneReason::MissedHeartbeat), ConnState::PeerHung);
        let state = AtomicConnState::new();
        assert!(state.is(ConnState::Open));
        state.end(ConnState::Broken);
        state.end(ConnState::ClosedByUs);
        assert_eq!(state.load(), ConnState::Broken);
    }

    /// The fields of `struct ConnShared`, in declaration order, read from
    /// this file (the order is the drop order, which the compiler does not
    /// let a test observe otherwise).
    fn conn_shared_fields() -> Vec<String> {
        let src = include_str!("conn.rs");
        let start = src.find("pub(crate) struct ConnShared {").expect("ConnShared declared here");
        let body = &src[start..];
        let end = body.find("\n}").expect("end of ConnShared");
        body[..end]
            .lines()
            .skip(1)
            .map(str::trim)
            .filter(|l| !l.starts_with("//") && !l.starts_with('#'))
            .map(|l| l.strip_prefix("pub(super) ").or_else(|| l.strip_prefix("pub(crate) ")).unwrap_or(l))
            .filter_map(|l| l.split_once(':').map(|(name, _)| name))
            .filter(|name| !name.is_empty() && name.chars().all(|ch| ch == '_' || ch.is_ascii_alphanumeric()))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn ring_memory_is_dropped_last() {
        let fields = conn_shared_fields();
        assert!(fields.len() > 10, "{fields:?}");
        let last_two: Vec<&str> = fields[fields.len() - 2..].iter().map(String::as_str).collect();
        assert_eq!(last_two, ["peer_map", "_block"], "ring memory must be the last fields of ConnShared: {fields:?}");
    }
}
