//! The receive side of a channel: polling the peer's ring, waiting for it,
//! and turning a descriptor into a [`Msg`] once every range in it checks out.

use super::conn::{ConnShared, ConnState};
use super::message::{Body, InlineArea, Msg, Seg, SegList};
use super::Channel;
use crate::error::{Error, ProtocolError, Result};
use crate::validate::{check_inline, validate, Resolver};
use fido_proto::GoneReason;
use fido_ring::{wait::SpinBudget, wait_until, Descriptor, RingError, RxRing, SleepSite, WaitOutcome, WaitStrategy, FLAG_INLINE};
use fido_shm::{GPtr, Mapping, ShmError};
use std::os::fd::AsFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a receiver blocked with forwarded messages in flight collects
/// their releases.
const REAP_INTERVAL: Duration = Duration::from_micros(200);

pub(super) struct RxState {
    pub(super) ring: RxRing,
    pub(super) epoch: u64,
    pub(super) wait: WaitStrategy,
    /// How long an adaptive wait for a message spins, learned from the last ones.
    pub(super) learned: SpinBudget,
    /// Messages handed out (each a `Msg`), for `ReleaseState`.
    pub(super) delivered: u64,
}

/// Where one receive is in its wait: the caller's timeout, the deadline
/// (resolved on the first real wait, after the quick spin), and whether it
/// has spun yet.
struct RecvWait {
    timeout: Option<Duration>,
    deadline: Option<Option<Instant>>,
    spun: bool,
}

/// Resolves peer pointers. The common case — a pointer into the peer's own
/// arena — is a bounds check against the connection's mapping, which the
/// message keeps alive through the connection; any other arena (a forwarded
/// message) goes through the domain's address space, mapping it (lazily
/// granted by the broker) the first time one shows up.
struct ConnResolver<'a>(&'a ConnShared);

/// The local address of `len` bytes at `g` if they lie inside `map`.
#[inline]
pub(super) fn within(map: &Mapping, g: GPtr, len: u64) -> Option<NonNull<u8>> {
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
        let domain = &*self.0.conns.local;
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

impl Channel {
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
        if sh.state.is(ConnState::Broken) {
            return Ok(None);
        }
        match rx.ring.poll() {
            Ok(Some(desc)) => self.accept_descriptor(&mut rx, &desc).map(Some),
            Ok(None) => Ok(None),
            Err(e) => Err(sh.mark_broken(ProtocolError::Ring(e.to_string()))),
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
            if !sh.state.is(ConnState::Broken) {
                match rx.ring.poll() {
                    Ok(Some(desc)) => return self.accept_descriptor(&mut rx, &desc),
                    Ok(None) => {}
                    Err(e) => return Err(sh.mark_broken(ProtocolError::Ring(e.to_string()))),
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
                    if fido_ring::quick_spin(rx.wait, ready).map_err(|e| sh.mark_broken(ProtocolError::Ring(e.to_string())))? {
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
        let forwarded_in_flight = sh.conns.reap_forwarded();
        let step_deadline = if forwarded_in_flight {
            let step = Instant::now() + REAP_INTERVAL;
            Some(deadline.map_or(step, |d| d.min(step)))
        } else {
            deadline
        };
        let local = *rx.ring.local();
        let wait = rx.wait;
        let mut epoch = rx.epoch;
        let mut learned = rx.learned;
        let ring = &rx.ring;
        let outcome = wait_until(
            wait,
            step_deadline,
            SleepSite {
                sleep: local.data_sleep(),
                epoch: &mut epoch,
                bell: sh.data_bell.wait.as_fd(),
                liveness: Some(sh.liveness.as_fd()),
                futex: sh.futex_reaches.then(|| sh.peer_block.data_bell()),
                learned: &mut learned,
                recheck: sh.doorbell_recheck,
            },
            || -> std::result::Result<bool, RingError> { Ok(ring.pending()? || !sh.is_open() || ring.peer_closed()) },
        );
        rx.epoch = epoch;
        rx.learned = learned;
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
            Err(e) => Err(sh.mark_broken(ProtocolError::Ring(e.to_string()))),
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
                let err = sh.mark_broken(ProtocolError::Descriptor(e));
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

}
