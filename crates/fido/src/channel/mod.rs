//! Channels: one connection between two domains, a ring per direction.
//!
//! Sending writes a descriptor into the ring in our own arena (no copy: the
//! descriptor carries global pointers to buffers in our arena, or in an upstream
//! domain's arena when forwarding). Receiving copies the descriptor out of the
//! peer's read-only memory, validates every range in it, and hands out a
//! read-only view. Dropping the view releases the message: its cookie goes into
//! our release ring, and the sender frees the buffer (or, for a forwarded
//! message, releases it upstream in turn).
//!
//! `message` holds what travels, `send` and `recv` the two directions, `conn`
//! the state they share, `connections` the domain's set of channels. The
//! domain's resources come in through [`crate::local_domain`]: nothing here
//! depends on the domain itself.

mod conn;
mod connections;
mod message;
mod recv;
mod send;
#[cfg(feature = "test-hooks")]
mod test_hooks;

pub(crate) use conn::{ConnShared, DomainHandle};
pub(crate) use connections::Connections;
pub use message::{Message, Msg, SendError, Undelivered};

use crate::error::{Error, InvalidArgument, ProtocolError, Result};
use crate::local_domain::LocalDomain;
use conn::{AtomicConnState, ConnState, ReleaseState, Stats, NO_DEFERRED};
use connections::Lingering;
use fido_proto::{ConnId, PeerInfo, Reply, Request, RingBlock};
use fido_ring::{block_len, doorbell, LocalBlock, PeerBlock, Releaser, RxRing, TxRing, WaitStrategy};
use fido_shm::{Buf, Mapping};
use parking_lot::Mutex;
use recv::RxState;
use send::{Outstanding, Slot, TxState};
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// What we wake the peer and learn of its death through.
struct PeerEnds {
    data: fido_ring::doorbell::RingEnd,
    space: fido_ring::doorbell::RingEnd,
    liveness: OwnedFd,
}

/// A connection request waiting in a listener's backlog.
pub(crate) struct Incoming {
    pub(crate) conn: ConnId,
    pub(crate) service: String,
    pub(crate) peer: PeerInfo,
    pub(crate) block: RingBlock,
    pub(crate) fds: Vec<OwnedFd>,
}

/// A connection to another domain. Send and receive from any threads (one
/// sender and one receiver at a time make progress; others queue on a lock).
pub struct Channel {
    shared: Arc<ConnShared>,
}

impl Channel {
    fn new_block(domain: &LocalDomain, entries: u32) -> Result<(Buf, LocalBlock)> {
        let len = block_len(entries);
        let mut block = domain.arena.alloc(len)?;
        let base = NonNull::new(block.as_mut_ptr()).ok_or_else(|| InvalidArgument::RingBlock("the arena gave a null pointer".into()))?;
        // SAFETY: `block` is `len` writable bytes of our arena, 64-aligned (the
        // allocator's guarantee), used for nothing else, and kept alive by the
        // ConnShared that owns both it and every copy of the LocalBlock.
        let local = unsafe { LocalBlock::init_with_flags(base, len, entries, domain.platform.block_flags()) }.map_err(|e| InvalidArgument::RingBlock(e.to_string()))?;
        Ok((block, local))
    }

    /// The peer's doorbell ring ends and the liveness socket, the last three
    /// descriptors of a connection (checked: exactly three are left).
    fn peer_ends(domain: &LocalDomain, mut fds: Vec<OwnedFd>) -> Result<PeerEnds> {
        let liveness = fds.pop().expect("checked: 3 fds left");
        let space = domain.platform.ring_end(fds.pop().expect("checked"))?;
        let data = domain.platform.ring_end(fds.pop().expect("checked"))?;
        Ok(PeerEnds { data, space, liveness })
    }

    /// Maps the peer's arena and opens its ring block.
    fn open_peer(domain: &LocalDomain, peer: &PeerInfo, block: &RingBlock, arena_fd: OwnedFd) -> Result<(Arc<Mapping>, PeerBlock)> {
        let mapping = domain.platform.map_peer(&domain.space, peer.slot, peer.domain, arena_fd, peer.arena_len)?;
        domain.register_mapping(peer.slot, peer.domain);
        if block.len < block_len(block.entries) as u64 {
            return Err(ProtocolError::PeerBlock("too small".into()).into());
        }
        let g = mapping.global_base().add(block.offset).ok_or_else(|| ProtocolError::PeerBlock("offset outside the arena".into()))?;
        let (ptr, _) = domain.space.resolve(g, block.len)?;
        // SAFETY: `resolve` checked the range lies inside the peer's mapping,
        // which the ConnShared keeps alive (`peer_map`) as long as any copy of
        // the PeerBlock exists.
        let pb = unsafe { PeerBlock::open(ptr, block.len as usize, block.entries) }.map_err(|e| ProtocolError::PeerBlock(e.to_string()))?;
        Ok((mapping, pb))
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        (conns, domain): (&Arc<Connections>, DomainHandle),
        conn: ConnId,
        service: String,
        peer: PeerInfo,
        mapping: Arc<Mapping>,
        (block, local): (Buf, LocalBlock),
        peer_block: PeerBlock,
        (data_bell, space_bell): (doorbell::Doorbell, doorbell::Doorbell),
        PeerEnds { data: peer_data, space: peer_space, liveness }: PeerEnds,
    ) -> Channel {
        let futex_reaches = conns.local.platform.futex_reaches(&peer_block);
        let entries = local.entries();
        let wait = conns.local.wait;
        let outstanding = Arc::new(Outstanding::default());
        let shared = Arc::new(ConnShared {
            conn,
            service,
            peer,
            conns: conns.clone(),
            _domain: domain,
            peer_map: mapping,
            _block: block,
            local,
            data_bell,
            space_bell,
            liveness,
            peer_block,
            futex_reaches,
            doorbell_recheck: conns.local.platform.is_guest().then_some(fido_ring::wait::GUEST_RECHECK),
            releaser: Mutex::new(ReleaseState { ring: Releaser::new(local, peer_block, peer_space), dropped: 0, delivered_in_all: None }),
            deferred: AtomicU64::new(NO_DEFERRED),
            channel_dropped: AtomicBool::new(false),
            state: AtomicConnState::new(),
            broken: Mutex::new(None),
            stats: Stats::default(),
            tx: Mutex::new(TxState {
                ring: TxRing::new(local, peer_block, peer_data),
                table: (0..entries).map(|_| Slot::default()).collect(),
                free: (0..entries).rev().collect(),
                generation: 0,
                epoch: 0,
                wait,
                learned: Default::default(),
                undelivered: Vec::new(),
                outstanding: outstanding.clone(),
            }),
            rx: Mutex::new(RxState { ring: RxRing::new(local, peer_block), epoch: 0, wait, learned: Default::default(), delivered: 0 }),
            forwarding: AtomicBool::new(false),
            outstanding,
        });
        conns.live.lock().insert(conn, Arc::downgrade(&shared));
        // The received messages' reference (see `ReleaseState`): given up
        // by whoever sees the last of them gone after the channel.
        std::mem::forget(shared.clone());
        Channel { shared }
    }

    /// Connects to `service` for the domain that `domain` keeps alive.
    pub(crate) fn connect(conns: &Arc<Connections>, domain: DomainHandle, service: &str) -> Result<Channel> {
        let local_domain = &*conns.local;
        let entries = local_domain.ring_entries;
        let (block, local) = Self::new_block(local_domain, entries)?;
        let bells = (local_domain.platform.new_bell()?, local_domain.platform.new_bell()?);
        let ring = RingBlock { offset: block.offset(), len: block_len(entries) as u64, entries };
        let fds = [bells.0.ring.try_clone()?, bells.1.ring.try_clone()?];
        let (reply, mut peer_fds) = local_domain.control.request(Request::Connect { service: service.into(), block: ring }, &fds)?;
        drop(fds);
        let (conn, peer, pblock) = match reply {
            Reply::Connected { conn, peer, block } if peer_fds.len() == 4 && block.entries == entries => (conn, peer, block),
            other => return Err(Error::broker_protocol(format!("bad connect reply {other:?} with {} fds", peer_fds.len()))),
        };
        let arena_fd = peer_fds.remove(0);
        let (mapping, peer_block) = Self::open_peer(local_domain, &peer, &pblock, arena_fd)?;
        let ends = Self::peer_ends(local_domain, peer_fds)?;
        Ok(Self::assemble((conns, domain), conn, service.into(), peer, mapping, (block, local), peer_block, bells, ends))
    }

    /// Completes an incoming connection for the domain that `domain` keeps alive.
    pub(crate) fn accept(conns: &Arc<Connections>, domain: DomainHandle, inc: Incoming) -> Result<Channel> {
        let local_domain = &*conns.local;
        let Incoming { conn, service, peer, block: pblock, mut fds } = inc;
        let refuse = |error: Error| {
            local_domain.control.notify(Request::Refuse { conn, reason: error.to_string() });
            error
        };
        // Whatever fails before we accept is a refusal, so the connecting
        // side hears of it at once instead of waiting out its timeout.
        let prepared = (|| -> Result<_> {
            if fds.len() != 4 {
                return Err(Error::broker_protocol(format!("incoming connection with {} descriptors", fds.len())));
            }
            let entries = pblock.entries;
            let (block, local) = Self::new_block(local_domain, entries)?;
            let (mapping, peer_block) = Self::open_peer(local_domain, &peer, &pblock, fds.remove(0))?;
            let ends = Self::peer_ends(local_domain, fds)?;
            let bells = (local_domain.platform.new_bell()?, local_domain.platform.new_bell()?);
            let ring = RingBlock { offset: block.offset(), len: block_len(entries) as u64, entries };
            let mine = [bells.0.ring.try_clone()?, bells.1.ring.try_clone()?];
            Ok(((block, local), (mapping, peer_block), ends, bells, ring, mine))
        })();
        let ((block, local), (mapping, peer_block), ends, bells, ring, mine) = prepared.map_err(refuse)?;
        // Runs on the control thread, which reads the broker's replies itself:
        // fire and forget. If the client is gone by now, the liveness socket
        // says so on the first operation.
        local_domain.control.notify_with(Request::Accept { conn, block: ring }, &mine)?;
        Ok(Self::assemble((conns, domain), conn, service, peer, mapping, (block, local), peer_block, bells, ends))
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

    /// True while the connection is usable.
    pub fn is_open(&self) -> bool {
        // The peer's block directly, not through the send lock: callers
        // check this before every RPC.
        self.shared.is_open() && !self.shared.peer_block.is_closed()
    }

    /// What both sides of this connection last wrote in their ring blocks,
    /// for diagnosing a stalled channel: per side, descriptors published
    /// (`sent`) and consumed of the other's (`taken`), releases published
    /// (`released`) and reaped of the other's (`reaped`), the two sleep words
    /// (`epoch << 2 | how`: 0 awake, 1 on its socket doorbell, 3 on a futex)
    /// and the two bell words; how often we rang the peer, and the peer's
    /// data sleep word we last woke. Takes no lock that a stalled sender or
    /// receiver may hold (the last is left out while the send lock is held);
    /// the peer's numbers are whatever its memory says.
    pub fn ring_state(&self) -> String {
        use std::sync::atomic::Ordering::Acquire;
        // Our block and the peer's view of its own: the same words, two types.
        // A sleep word is printed as epoch:state.
        macro_rules! words {
            ($b:expr) => {{
                let (data_sleep, space_sleep) = ($b.data_sleep().load(Acquire), $b.space_sleep().load(Acquire));
                format!(
                    "sent={} taken={} released={} reaped={} data_sleep={}:{} space_sleep={}:{} data_bell={} space_bell={}",
                    $b.data_prod().load(Acquire),
                    $b.data_cons().load(Acquire),
                    $b.rel_prod().load(Acquire),
                    $b.rel_cons().load(Acquire),
                    data_sleep >> 2,
                    data_sleep & 3,
                    space_sleep >> 2,
                    space_sleep & 3,
                    $b.data_bell().load(Acquire),
                    $b.space_bell().load(Acquire),
                )
            }};
        }
        let st = &self.shared.stats;
        let woken = match self.shared.tx.try_lock() {
            Some(tx) => {
                let w = tx.ring.last_woken();
                format!("{}:{}", w >> 2, w & 3)
            }
            None => "(send lock held)".into(),
        };
        format!(
            "we last woke the peer's data sleep {woken}, rang data {} and release {} times, suppressed {} and {}; ours: {}; peer's: {}",
            st.rung.get(),
            st.release_rung.get(),
            st.suppressed.get(),
            st.release_suppressed.get(),
            words!(self.shared.local),
            words!(self.shared.peer_block)
        )
    }

    /// The doorbell wait end this channel's receiver sleeps on. The peer rings it only
    /// after the receiver announced it is going to sleep (blocking `recv`, or
    /// [`crate::AsyncChannel`]), so it is not a readiness signal on its own.
    pub fn data_doorbell(&self) -> std::os::fd::BorrowedFd<'_> {
        self.shared.data_bell.wait.as_fd()
    }
}

impl Channel {
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

    /// How often a doorbell sleep must look at the ring again: in a VM
    /// guest, whose doorbells are emulated interrupts that can be lost.
    #[cfg(feature = "tokio")]
    pub(crate) fn doorbell_recheck(&self) -> Option<std::time::Duration> {
        self.shared.doorbell_recheck
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
        self.shared.mark_gone(fido_proto::GoneReason::Exited);
    }

    #[cfg(feature = "tokio")]
    pub(crate) fn forwarded_in_flight(&self) -> bool {
        self.shared.conns.reap_forwarded()
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
        sh.state.end(ConnState::ClosedByUs);
        sh.tx.lock().ring.wake_peer();
        sh.releaser.lock().ring.wake_peer();
        sh.conns.local.control.notify(Request::Close { conn: sh.conn });
        sh.conns.live.lock().remove(&sh.conn);
        sh.add_counters(&mut sh.conns.retired.lock());
        let in_flight = sh.tx.lock().ring.in_flight();
        if in_flight > 0 && !doorbell::peer_hung_up(sh.liveness.as_fd()) {
            sh.conns.lingering.lock().push(Lingering { shared: sh.clone() });
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
        let _broker = fido_broker::Embedded::start(fido_broker::Config::new(&socket, dir.path().join("state"))).unwrap();
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

