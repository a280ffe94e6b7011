//! Wait strategies: how a side waits for its peer.
//!
//! On a virtual machine the cost of IPC is the wake-up, not the copy (an eventfd
//! wake across vCPUs is 13–16 µs here; a polled cache line 0.4 µs), so the default
//! spins for a bounded time and then sleeps. Pure spinning is available for
//! dedicated cores; it checks the peer's liveness every few milliseconds and
//! yields now and then so two spinners sharing one vCPU cannot livelock.
//!
//! Sleeping has two stages. First a **futex** sleep on the peer's bell word
//! (`futex`), for at most [`FUTEX_PHASE`]: the cheapest wake-up there is (a
//! futex round trip between two processes costs about half a Unix-socket one
//! here), which is what a waiter for a reply or the next request of a busy
//! client needs. Then the **socket doorbell** together with the peer's liveness
//! socket, for as long as it takes: a futex cannot see a peer die, so nobody
//! ever sleeps on one for longer than a phase, and a peer that never wakes us
//! (hostile, or dead) or that wakes us for nothing costs at most one phase.

use crate::doorbell::{block_on, peer_hung_up};
use crate::futex::{self, FutexWait};
use crate::protocol::{self, Sleep};
use crate::sync::{AtomicU32, AtomicU64};
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

/// How to wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitStrategy {
    /// Spin until the condition holds (or the deadline passes); never sleeps.
    BusyPoll,
    /// Spin for at most `spin`, then sleep (futex, then doorbell). The default
    /// (50 µs). How long it really spins is learned from the peer's recent
    /// response times ([`SpinBudget`]).
    Adaptive { spin: Duration },
    /// Sleep at once (futex, then doorbell).
    Block,
}

impl Default for WaitStrategy {
    fn default() -> Self {
        WaitStrategy::Adaptive { spin: Duration::from_micros(50) }
    }
}

/// How a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitOutcome {
    Ready,
    TimedOut,
    /// The peer's liveness socket hung up and the condition still does not hold.
    PeerGone,
}

/// Where a waiter sleeps: its own sleep word and epoch, its own doorbell, the
/// liveness socket shared with the peer, and the peer's bell word (in the
/// peer's memory, read-only here) for futex sleeps.
pub struct SleepSite<'a> {
    pub sleep: &'a AtomicU64,
    pub epoch: &'a mut u64,
    pub bell: BorrowedFd<'a>,
    pub liveness: Option<BorrowedFd<'a>>,
    /// `None`: skip the futex stage.
    pub futex: Option<&'a AtomicU32>,
    /// What this waiter learned about its peer's response time (kept by the
    /// caller from one wait to the next; only `Adaptive` uses it).
    pub learned: &'a mut SpinBudget,
    /// The longest one doorbell sleep lasts before the condition is looked
    /// at again (`None`: until rung). For doorbells that arrive as emulated
    /// interrupts (a VM guest, [`GUEST_RECHECK`]), so a lost interrupt costs
    /// a bounded delay, never a hang.
    pub recheck: Option<Duration>,
}

/// How often a waiter inside a VM guest looks at its ring while asleep on a
/// doorbell. Its doorbells arrive as interrupts through the emulated
/// ivshmem device, the IOMMU and VFIO, which the ring protocol cannot
/// watch. The one loss seen (docs/VM.md §3) was not one: QEMU 7.2's TCG
/// dropped the fences of a guest with one possible CPU, which every guest
/// now avoids. This bounds any other to a delay: a second, long enough to
/// stand out in a latency tail, and one wake-up a second per sleeping
/// waiter in an idle guest.
pub const GUEST_RECHECK: Duration = Duration::from_secs(1);

/// How long an `Adaptive { spin }` waiter spins before it sleeps, learned from
/// its recent waits: spinning only pays when the peer answers within the spin
/// (a wake-up costs ~10 µs here, a polled hand-off under 1 µs), and every
/// microsecond spun for a peer that answers later is CPU burnt for nothing.
///
/// * A wait that ended after `t` < `spin` (caught spinning, or woken soon
///   after sleeping): spin about 4·`t` next time (at most `spin`), falling
///   from a longer budget by a quarter per wait, so a request/response peer
///   on an idle core is caught spinning, as a polled channel would.
/// * A wait that lasted `spin` or longer (the peer answered later than any
///   spin would have waited): halve the budget, down to [`MIN_SPIN`]. A
///   channel whose peer answers every millisecond spins a couple of
///   microseconds per message instead of `spin`; a quiet channel sleeps at once.
///
/// Starts at `spin` (nothing learned yet).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpinBudget {
    /// The budget in ns; 0 = not learned yet (use the whole `spin`).
    ns: u64,
}

/// The least an `Adaptive` waiter spins once it learned its peer is slow: a
/// peer that becomes fast again is caught within this, and its wait teaches
/// the longer budget back.
pub const MIN_SPIN: Duration = Duration::from_micros(2);

impl SpinBudget {
    /// The spin for the next wait under `Adaptive { spin }`.
    pub fn spin(&self, spin: Duration) -> Duration {
        if self.ns == 0 {
            spin
        } else {
            spin.min(Duration::from_nanos(self.ns))
        }
    }

    /// Learns from a wait that ended, ready, `took` after it began.
    pub fn learn(&mut self, took: Duration, spin: Duration) {
        let max = spin.as_nanos() as u64;
        let min = (MIN_SPIN.as_nanos() as u64).min(max);
        let cur = if self.ns == 0 { max } else { self.ns };
        let t = took.as_nanos() as u64;
        self.ns = if t < max {
            t.saturating_mul(4).max(cur - cur / 4).clamp(min, max)
        } else {
            (cur / 2).max(min)
        };
        // 0 means "not learned": a zero spin budget is stored as 1 ns.
        self.ns = self.ns.max(1);
    }
}

const LIVENESS_CHECK_EVERY: Duration = Duration::from_millis(2);

/// Longest a waiter sleeps on a futex before it moves to the doorbell and the
/// liveness socket. Also bounds how late a waiter notices a wake-up it can miss
/// in this stage: one of its own (`Channel` state changes from another thread,
/// which cannot bump the peer's bell), or a peer that stopped waking it.
pub const FUTEX_PHASE: Duration = Duration::from_millis(2);

/// Futex sleeps per stage that may end without the condition holding (wake-ups
/// for nothing — a third domain mapping the same arena can cause them — or a
/// peer bumping its bell without publishing) before the waiter moves on to the
/// doorbell instead of spinning through them.
const FUTEX_ROUNDS: u32 = 64;

/// Looks this many times before a spinning waiter first reads the clock
/// (a few microseconds at most). A polled round trip's reply usually comes
/// within them, and reading the clock first cost it: on this project's
/// virtual machines `clock_gettime` took about 8% of a polled RPC's time
/// on each side (docs/BENCHMARKS.md), and a reply arriving during the read
/// waits for it.
pub const QUICK_LOOKS: u32 = 128;

/// Looks at `ready()` up to [`QUICK_LOOKS`] times without reading the clock,
/// for a strategy that spins (`Block` does not look again). True once ready.
#[inline]
pub fn quick_spin<E>(strategy: WaitStrategy, mut ready: impl FnMut() -> Result<bool, E>) -> Result<bool, E> {
    if strategy == WaitStrategy::Block {
        return Ok(false);
    }
    for _ in 0..QUICK_LOOKS {
        if ready()? {
            return Ok(true);
        }
        std::hint::spin_loop();
    }
    Ok(false)
}

/// Waits until `ready()` returns true, following `strategy`.
///
/// `ready` is evaluated after every wake-up and once more after arming the sleep
/// word, so a publish racing with the decision to sleep is never missed.
/// A spinning strategy first looks [`QUICK_LOOKS`] times without reading
/// the clock, so the deadline and the spin time may be overrun by that much.
pub fn wait_until<E>(
    strategy: WaitStrategy,
    deadline: Option<Instant>,
    site: SleepSite<'_>,
    mut ready: impl FnMut() -> Result<bool, E>,
) -> Result<WaitOutcome, E> {
    if ready()? || quick_spin(strategy, &mut ready)? {
        return Ok(WaitOutcome::Ready);
    }
    let start = Instant::now();
    let spin_for = match strategy {
        WaitStrategy::BusyPoll => None,
        WaitStrategy::Adaptive { spin } => Some(site.learned.spin(spin)),
        WaitStrategy::Block => Some(Duration::ZERO),
    };
    let learned = &mut *site.learned;
    let outcome = wait_stages(deadline, start, spin_for, SleepSite { learned: &mut SpinBudget::default(), ..site }, ready);
    if let (Ok(WaitOutcome::Ready), WaitStrategy::Adaptive { spin }) = (&outcome, strategy) {
        learned.learn(start.elapsed(), spin);
    }
    outcome
}

/// [`wait_until`]'s spin, futex and doorbell stages.
fn wait_stages<E>(
    deadline: Option<Instant>,
    start: Instant,
    spin_for: Option<Duration>,
    site: SleepSite<'_>,
    mut ready: impl FnMut() -> Result<bool, E>,
) -> Result<WaitOutcome, E> {
    // Spin phase.
    let mut spins: u32 = 0;
    let mut last_liveness = start;
    loop {
        let now_needed = spins % 64 == 0;
        if now_needed {
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(WaitOutcome::TimedOut);
            }
            if spin_for.is_some_and(|s| now.duration_since(start) >= s) {
                break;
            }
            if now.duration_since(last_liveness) >= LIVENESS_CHECK_EVERY {
                last_liveness = now;
                if site.liveness.is_some_and(peer_hung_up) {
                    return Ok(if ready()? { WaitOutcome::Ready } else { WaitOutcome::PeerGone });
                }
                // Give a co-scheduled peer on the same vCPU a chance to run.
                std::thread::yield_now();
            }
        }
        if ready()? {
            return Ok(WaitOutcome::Ready);
        }
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
    }
    let SleepSite { sleep, epoch, bell, liveness, futex: word, recheck, .. } = site;
    // Futex stage.
    if let Some(word) = word {
        let now = Instant::now();
        let until = deadline.map_or(now + FUTEX_PHASE, |d| d.min(now + FUTEX_PHASE));
        let mut rounds = 0;
        loop {
            // The bell before arming: a wake-up for this sleep bumps it
            // after, so `FUTEX_WAIT` cannot miss it (read after arming, the
            // bump could already be in `seen`: `tests/loom.rs` finds that).
            let seen = protocol::bell_value(word);
            protocol::arm(sleep, epoch, Sleep::Futex);
            if ready()? {
                protocol::disarm(sleep, *epoch);
                return Ok(WaitOutcome::Ready);
            }
            let now = Instant::now();
            if now >= until || rounds >= FUTEX_ROUNDS {
                protocol::disarm(sleep, *epoch);
                break;
            }
            let r = futex::wait(word, seen, until - now);
            protocol::disarm(sleep, *epoch);
            if ready()? {
                return Ok(WaitOutcome::Ready);
            }
            if matches!(r, FutexWait::Failed(_)) {
                break;
            }
            rounds += 1;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(WaitOutcome::TimedOut);
        }
    }
    // Doorbell stage.
    loop {
        protocol::arm(sleep, epoch, Sleep::Socket);
        if ready()? {
            protocol::disarm(sleep, *epoch);
            return Ok(WaitOutcome::Ready);
        }
        let timeout = match deadline {
            Some(d) => {
                let now = Instant::now();
                if now >= d {
                    protocol::disarm(sleep, *epoch);
                    return Ok(WaitOutcome::TimedOut);
                }
                Some(d - now)
            }
            None => None,
        };
        let timeout = match (timeout, recheck) {
            (Some(t), Some(r)) => Some(t.min(r)),
            (t, r) => t.or(r),
        };
        let woke = block_on(bell, liveness, timeout);
        protocol::disarm(sleep, *epoch);
        let woke = match woke {
            Ok(w) => w,
            Err(_) => crate::doorbell::Wakeup { rung: false, peer_hangup: false },
        };
        if ready()? {
            return Ok(WaitOutcome::Ready);
        }
        if woke.peer_hangup {
            return Ok(WaitOutcome::PeerGone);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPIN: Duration = Duration::from_micros(50);

    #[test]
    fn a_slow_peer_shrinks_the_spin_and_a_fast_one_grows_it_back() {
        let mut b = SpinBudget::default();
        assert_eq!(b.spin(SPIN), SPIN, "nothing learned: the whole spin");
        // Answers after 1 ms: halved each time, down to the minimum.
        for _ in 0..10 {
            b.learn(Duration::from_millis(1), SPIN);
        }
        assert_eq!(b.spin(SPIN), MIN_SPIN);
        // Woken 12 µs after it began (slept through a fast answer): spins 48 µs.
        b.learn(Duration::from_micros(12), SPIN);
        assert_eq!(b.spin(SPIN), Duration::from_micros(48));
        // Caught after 1 µs, again and again: down a quarter at a time, never
        // below 4x the answer time.
        for _ in 0..50 {
            b.learn(Duration::from_micros(1), SPIN);
        }
        assert_eq!(b.spin(SPIN), Duration::from_micros(4));
        // Never above the strategy's spin, whatever was learned.
        assert_eq!(b.spin(Duration::from_micros(3)), Duration::from_micros(3));
        b.learn(Duration::from_micros(40), SPIN);
        assert_eq!(b.spin(SPIN), SPIN);
    }

    #[test]
    fn a_zero_spin_stays_zero() {
        let mut b = SpinBudget::default();
        b.learn(Duration::from_micros(5), Duration::ZERO);
        assert_eq!(b.spin(Duration::ZERO), Duration::ZERO);
    }
}
