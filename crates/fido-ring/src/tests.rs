use super::*;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Two blocks in ordinary heap memory standing in for two arenas.
struct Pair {
    a: NonNull<u8>,
    b: NonNull<u8>,
    layout: Layout,
}

impl Pair {
    fn new(entries: u32) -> Pair {
        let layout = Layout::from_size_align(block_len(entries), 64).unwrap();
        // SAFETY: non-zero size layout.
        let a = NonNull::new(unsafe { alloc_zeroed(layout) }).unwrap();
        // SAFETY: non-zero size layout.
        let b = NonNull::new(unsafe { alloc_zeroed(layout) }).unwrap();
        Pair { a, b, layout }
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe {
            dealloc(self.a.as_ptr(), self.layout);
            dealloc(self.b.as_ptr(), self.layout);
        }
    }
}

struct Side {
    tx: TxRing,
    rx: RxRing,
    rel: Releaser,
    data_bell: Arc<OwnedFd>,
    /// Kept open for the peer's releaser, which rings it.
    _space_bell: Arc<OwnedFd>,
}

fn connect(pair: &Pair, entries: u32) -> (Side, Side) {
    let len = pair.layout.size();
    // SAFETY: both buffers are ours, `len` bytes, 64-aligned, alive as long as `pair`.
    let (la, lb) = unsafe {
        (LocalBlock::init(pair.a, len, entries).unwrap(), LocalBlock::init(pair.b, len, entries).unwrap())
    };
    // SAFETY: the same buffers, initialised just above.
    let (pa, pb) = unsafe { (PeerBlock::open(pair.a, len, entries).unwrap(), PeerBlock::open(pair.b, len, entries).unwrap()) };
    // Ring ends go to the ring/releaser that wakes the other side; wait ends stay.
    let bells: Vec<doorbell::Doorbell> = (0..4).map(|_| doorbell::new_doorbell().unwrap()).collect();
    let ring_end = |i: usize| doorbell::RingEnd::socket(bells[i].ring.try_clone().unwrap());
    let wait_end = |i: usize| Arc::new(bells[i].wait.try_clone().unwrap());
    let a = Side {
        tx: TxRing::new(la, pb, ring_end(2)),
        rx: RxRing::new(la, pb),
        rel: Releaser::new(la, pb, ring_end(3)),
        data_bell: wait_end(0),
        _space_bell: wait_end(1),
    };
    let b = Side {
        tx: TxRing::new(lb, pa, ring_end(0)),
        rx: RxRing::new(lb, pa),
        rel: Releaser::new(lb, pa, ring_end(1)),
        data_bell: wait_end(2),
        _space_bell: wait_end(3),
    };
    (a, b)
}

fn desc(cookie: u64) -> Descriptor {
    Descriptor { cookie, tag: cookie * 10, total_len: 5, nseg: 1, ..Default::default() }
}

#[test]
fn send_receive_release() {
    let pair = Pair::new(8);
    let (mut a, mut b) = connect(&pair, 8);
    assert_eq!(b.rx.poll().unwrap(), None);
    for i in 0..8 {
        a.tx.push(&desc(i)).unwrap();
    }
    assert_eq!(a.tx.push(&desc(99)), Err(RingError::Full));
    // A polling consumer sees pushed slots at once (each carries its
    // publication mark); publishing is what wakes a sleeping one.
    assert!(b.rx.pending().unwrap());
    a.tx.publish().unwrap();
    for i in 0..8 {
        let d = b.rx.poll().unwrap().unwrap();
        assert_eq!(d, desc(i));
        b.rel.release(d.cookie).unwrap();
    }
    assert_eq!(b.rx.poll().unwrap(), None);
    let mut got = vec![];
    while let Some(c) = a.tx.poll_release().unwrap() {
        got.push(c);
    }
    assert_eq!(got, (0..8).collect::<Vec<_>>());
    // Slots were freed by the consumer: the ring wraps.
    for i in 8..16 {
        a.tx.push(&desc(i)).unwrap();
    }
    a.tx.publish().unwrap();
    assert_eq!(b.rx.poll().unwrap().unwrap().cookie, 8);
    // Releases taken as a batch: counted, read in order, consumed at once.
    for i in 9..12 {
        assert_eq!(b.rx.poll().unwrap().unwrap().cookie, i);
    }
    for c in [8, 10, 9] {
        b.rel.release(c).unwrap();
    }
    assert_eq!(a.tx.releases_ready().unwrap(), 3);
    assert_eq!((0..3).map(|k| a.tx.pending_release(k)).collect::<Vec<_>>(), [8, 10, 9]);
    a.tx.consume_releases(2);
    assert_eq!(a.tx.releases_ready().unwrap(), 1);
    assert_eq!(a.tx.pending_release(0), 9);
    a.tx.consume_releases(1);
    assert_eq!(a.tx.releases_ready().unwrap(), 0);
    assert_eq!(a.tx.in_flight(), 5);
}

#[test]
fn forged_indices_are_errors() {
    let pair = Pair::new(8);
    let (_a, mut b) = connect(&pair, 8);
    // Forge A's publish index far ahead, as a lying peer would.
    // SAFETY: test-only write into A's block, which this test owns.
    let forged = unsafe { LocalBlock::init(pair.a, pair.layout.size(), 8).unwrap() };
    // A receiver checks the index once per `INDEX_CHECK_EVERY` empty looks.
    let poll_until_error = |rx: &mut RxRing| (0..INDEX_CHECK_EVERY).find_map(|_| rx.poll().err());
    forged.data_prod().store(1000, Ordering::Release);
    assert!(matches!(poll_until_error(&mut b.rx), Some(RingError::IndexJump { .. })));
    forged.data_prod().store(u64::MAX, Ordering::Release);
    assert!(matches!(poll_until_error(&mut b.rx), Some(RingError::IndexJump { .. })));
    forged.rel_prod().store(9, Ordering::Release);
    assert!(matches!(b.tx.poll_release(), Err(RingError::IndexJump { .. })));
    // Releases of messages never sent.
    forged.rel_prod().store(3, Ordering::Release);
    assert!(matches!(b.tx.poll_release(), Err(RingError::IndexJump { .. })));
    assert!(matches!(b.tx.releases_ready(), Err(RingError::IndexJump { .. })));
}

#[test]
fn uninitialised_peer_block_refused() {
    let layout = Layout::from_size_align(block_len(8), 64).unwrap();
    // SAFETY: non-zero size layout.
    let p = NonNull::new(unsafe { alloc_zeroed(layout) }).unwrap();
    // SAFETY: valid zeroed memory of the right size.
    let r = unsafe { PeerBlock::open(p, layout.size(), 8) };
    assert_eq!(r.err(), Some(BlockError::NotInitialised));
    // SAFETY: `p` is valid zeroed memory of at least that size.
    let r = unsafe { PeerBlock::open(p, layout.size() - 64, 8) };
    assert!(matches!(r, Err(BlockError::TooSmall { .. })));
    // SAFETY: `p` is valid zeroed memory of that size.
    let r = unsafe { PeerBlock::open(p, layout.size(), 6) };
    assert_eq!(r.err(), Some(BlockError::BadEntries(6)));
    // SAFETY: allocated above with this layout; no block handle outlives it.
    unsafe { dealloc(p.as_ptr(), layout) };
}

#[test]
fn doorbell_only_when_asleep() {
    let pair = Pair::new(64);
    let (mut a, mut b) = connect(&pair, 64);
    // Consumer awake: publishing rings nothing.
    a.tx.push(&desc(1)).unwrap();
    assert_eq!(a.tx.publish().unwrap(), Notify::Suppressed);
    b.rx.poll().unwrap().unwrap();
    // Consumer arms: the next publish rings exactly once.
    let mut epoch = 0;
    protocol::arm(b.rx.local().data_sleep(), &mut epoch, protocol::Sleep::Socket);
    a.tx.push(&desc(2)).unwrap();
    assert_eq!(a.tx.publish().unwrap(), Notify::Rung);
    a.tx.push(&desc(3)).unwrap();
    assert_eq!(a.tx.publish().unwrap(), Notify::Suppressed);
    let w = doorbell::block_on(b.data_bell.as_fd(), None, Some(Duration::from_secs(1))).unwrap();
    assert!(w.rung);
}

#[test]
fn futex_sleeper_is_woken_through_the_bell() {
    let pair = Pair::new(64);
    let (mut a, b) = connect(&pair, 64);
    let before = b.rx.peer_data_bell().load(Ordering::Relaxed);
    let mut epoch = 0;
    protocol::arm(b.rx.local().data_sleep(), &mut epoch, protocol::Sleep::Futex);
    a.tx.push(&desc(1)).unwrap();
    assert_eq!(a.tx.publish().unwrap(), Notify::Rung);
    // The bell moved (the futex word the sleeper waits on) and no socket
    // doorbell was rung.
    assert_eq!(b.rx.peer_data_bell().load(Ordering::Relaxed), before.wrapping_add(1));
    assert!(!doorbell::block_on(b.data_bell.as_fd(), None, Some(Duration::ZERO)).unwrap().rung);
    // Woken once per sleep.
    a.tx.push(&desc(2)).unwrap();
    assert_eq!(a.tx.publish().unwrap(), Notify::Suppressed);
    assert_eq!(b.rx.peer_data_bell().load(Ordering::Relaxed), before.wrapping_add(1));
    // A waiter gone back to its doorbell is rung there instead.
    protocol::arm(b.rx.local().data_sleep(), &mut epoch, protocol::Sleep::Socket);
    a.tx.push(&desc(3)).unwrap();
    assert_eq!(a.tx.publish().unwrap(), Notify::Rung);
    assert!(doorbell::block_on(b.data_bell.as_fd(), None, Some(Duration::from_secs(1))).unwrap().rung);
    assert_eq!(b.rx.peer_data_bell().load(Ordering::Relaxed), before.wrapping_add(1));
}

#[test]
fn blocking_wait_across_threads_never_loses_a_wakeup() {
    blocking_wait_across_threads(false);
}

#[test]
fn futex_wait_across_threads_never_loses_a_wakeup() {
    blocking_wait_across_threads(true);
}

fn blocking_wait_across_threads(futex: bool) {
    let pair = Pair::new(16);
    let (mut a, mut b) = connect(&pair, 16);
    const N: u64 = 20_000;
    let consumer = std::thread::spawn(move || {
        let mut next = 0;
        let mut epoch = 0;
        while next < N {
            let (outcome, got) =
                wait_recv(&mut b, &mut epoch, &mut Default::default(), WaitStrategy::Block, futex, None, Duration::from_secs(10));
            assert_eq!(outcome, WaitOutcome::Ready, "lost wake-up at {next}");
            let d = got.unwrap();
            assert_eq!(d.cookie, next);
            b.rel.release(d.cookie).unwrap();
            next += 1;
        }
    });
    let mut rung = 0;
    for i in 0..N {
        loop {
            while a.tx.poll_release().unwrap().is_some() {}
            if a.tx.push(&desc(i)).is_ok() {
                break;
            }
            // A consumer that failed must fail the test, not hang it.
            assert!(!consumer.is_finished(), "consumer stopped early");
            std::thread::yield_now();
        }
        if a.tx.publish().unwrap() == Notify::Rung {
            rung += 1;
        }
        if i % 7 == 0 {
            std::thread::yield_now();
        }
    }
    consumer.join().unwrap();
    assert!(rung <= N);
}

#[test]
fn the_release_ring_fills_when_the_peer_stops_reaping_and_a_lying_reap_index_is_caught() {
    let pair = Pair::new(8);
    let (a, mut b) = connect(&pair, 8);
    // B releases to A, which never reaps: 8 fit, the 9th does not.
    for i in 0..8 {
        b.rel.release(i).unwrap();
    }
    assert_eq!(b.rel.release(8), Err(RingError::Full));
    // A reaps three (its reap index is what B reads): three more fit.
    a.tx.local().rel_cons().store(3, Ordering::Release);
    for i in 8..11 {
        b.rel.release(i).unwrap();
    }
    assert_eq!(b.rel.release(11), Err(RingError::Full));
    // A reap index that goes back is a lie, caught when read.
    a.tx.local().rel_cons().store(2, Ordering::Release);
    assert!(matches!(b.rel.release(11), Err(RingError::IndexJump { what: "release-consume", .. })));
    // So is one past everything released.
    a.tx.local().rel_cons().store(100, Ordering::Release);
    assert!(matches!(b.rel.release(11), Err(RingError::IndexJump { what: "release-consume", .. })));
}

/// A producer that bumps and wakes its bell without ever publishing (hostile,
/// or a third domain waking the same word) cannot keep a waiter spinning in
/// the futex stage: it moves to its doorbell, and a real publish still wakes
/// it there.
#[test]
fn a_bell_storm_moves_the_waiter_to_its_doorbell_and_a_publish_still_wakes_it() {
    let pair = Pair::new(16);
    let (mut a, mut b) = connect(&pair, 16);
    let storm_block = *a.tx.local();
    let waiter_block = *b.rx.local();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let storm = s.spawn(|| {
            while !stop.load(Ordering::Acquire) {
                protocol::bump(storm_block.data_bell());
                futex::wake_all(storm_block.data_bell());
            }
        });
        let waiter = s.spawn(move || {
            let mut epoch = 0;
            wait_recv(&mut b, &mut epoch, &mut Default::default(), WaitStrategy::Block, true, None, Duration::from_secs(60))
        });
        // The waiter reaches its doorbell despite the storm.
        let started = Instant::now();
        while waiter_block.data_sleep().load(Ordering::Acquire) & 3 != protocol::ON_SOCKET {
            assert!(started.elapsed() < Duration::from_secs(30), "waiter never left the futex stage");
            assert!(!waiter.is_finished(), "waiter returned early");
            std::thread::sleep(Duration::from_millis(1));
        }
        a.tx.push(&desc(7)).unwrap();
        assert_eq!(a.tx.publish().unwrap(), Notify::Rung);
        let (outcome, got) = waiter.join().unwrap();
        assert_eq!(outcome, WaitOutcome::Ready);
        assert_eq!(got.unwrap().cookie, 7);
        stop.store(true, Ordering::Release);
        storm.join().unwrap();
    });
}

/// A slot holds this lap's descriptor or the previous lap's; their marks must
/// differ for every ring size, also where the `u16` lap counter wraps, and a
/// zeroed slot must not carry the first lap's mark.
#[test]
fn lap_marks_tell_a_slots_lap_from_the_previous_one() {
    use crate::block::lap_mark;
    for shift in [0u32, 3, 6, 16] {
        let entries = 1u32 << shift;
        for lap in [0u64, 1, 2, 65_534, 65_535, 65_536, 65_537, 1 << 40] {
            let index = lap * entries as u64 + (entries as u64 - 1);
            let mark = lap_mark(index, entries);
            if lap == 0 {
                assert_ne!(mark, 0, "entries {entries}");
            }
            if index >= entries as u64 {
                assert_ne!(mark, lap_mark(index - entries as u64, entries), "entries {entries}, lap {lap}");
            }
        }
    }
}

/// CPU time the calling thread has used (user + system).
fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// One adaptive wait (the default strategy) for the next descriptor, with the
/// waiter's futex stage and its learned spin; returns the descriptor.
fn adaptive_recv(side: &mut Side, epoch: &mut u64, learned: &mut wait::SpinBudget, timeout: Duration) -> Option<Descriptor> {
    let (outcome, got) = wait_recv(side, epoch, learned, WaitStrategy::default(), true, None, timeout);
    assert!(outcome == WaitOutcome::Ready || got.is_none(), "{outcome:?}");
    got
}

/// One wait for one descriptor, as `recv` makes it: sleeping on the data
/// doorbell (and the peer's futex word if `futex`), looking again every
/// `recheck` if given.
fn wait_recv(
    side: &mut Side,
    epoch: &mut u64,
    learned: &mut wait::SpinBudget,
    strategy: WaitStrategy,
    futex: bool,
    recheck: Option<Duration>,
    timeout: Duration,
) -> (WaitOutcome, Option<Descriptor>) {
    let bell = side.data_bell.clone();
    let local = *side.rx.local();
    let peer = side.rx.peer();
    let rx = &mut side.rx;
    let mut got = None;
    let outcome = wait_until(
        strategy,
        Some(Instant::now() + timeout),
        SleepSite {
            sleep: local.data_sleep(),
            epoch,
            bell: bell.as_fd(),
            liveness: None,
            futex: futex.then(|| peer.data_bell()),
            learned,
            recheck,
        },
        || -> Result<bool, RingError> {
            if got.is_none() {
                got = rx.poll()?;
            }
            Ok(got.is_some())
        },
    )
    .unwrap();
    (outcome, got)
}

/// A quiet channel burns no CPU: a waiter with the default strategy that
/// nobody sends to for a second spins once (at most its 50 µs), then sleeps.
#[test]
fn an_idle_adaptive_waiter_uses_almost_no_cpu() {
    let pair = Pair::new(16);
    let (_a, mut b) = connect(&pair, 16);
    let (mut epoch, mut learned) = (0, wait::SpinBudget::default());
    let cpu = thread_cpu();
    let started = Instant::now();
    assert!(adaptive_recv(&mut b, &mut epoch, &mut learned, Duration::from_secs(1)).is_none());
    let (cpu, wall) = (thread_cpu() - cpu, started.elapsed());
    assert!(wall >= Duration::from_secs(1), "{wall:?}");
    assert!(cpu < Duration::from_millis(20), "an idle waiter used {cpu:?} of CPU in {wall:?}");
}

/// A peer that answers every millisecond (slower than any spin would wait):
/// the adaptive waiter learns to sleep almost at once instead of spinning its
/// whole 50 µs for nothing before every message.
#[test]
fn an_adaptive_waiter_learns_how_long_its_peer_takes() {
    const N: u64 = 200;
    let pair = Pair::new(16);
    let (mut a, mut b) = connect(&pair, 16);
    let (tx, rx) = std::sync::mpsc::channel::<Duration>();
    let consumer = std::thread::spawn(move || {
        let (mut epoch, mut learned) = (0, wait::SpinBudget::default());
        // Slow phase: the producer sends one descriptor per millisecond.
        let mut cpu = Duration::ZERO;
        for i in 0..N {
            let before = thread_cpu();
            let d = adaptive_recv(&mut b, &mut epoch, &mut learned, Duration::from_secs(10)).expect("lost wake-up");
            if i >= 10 {
                cpu += thread_cpu() - before; // after learning
            }
            assert_eq!(d.cookie, i);
            b.rel.release(d.cookie).unwrap();
        }
        tx.send(cpu).unwrap();
        learned
    });
    for i in 0..N {
        std::thread::sleep(Duration::from_millis(1));
        while a.tx.poll_release().unwrap().is_some() {}
        while a.tx.push(&desc(i)).is_err() {
            assert!(!consumer.is_finished(), "consumer stopped early");
            std::thread::yield_now();
            while a.tx.poll_release().unwrap().is_some() {}
        }
        a.tx.publish().unwrap();
    }
    let cpu = rx.recv_timeout(Duration::from_secs(60)).expect("consumer stalled");
    let learned = consumer.join().unwrap();
    // Spinning 50 µs before each of the 190 sleeps would be 9.5 ms on its own;
    // a sleep and a wake-up cost a few µs of CPU each (tens in a nested guest).
    let per_msg = cpu / (N as u32 - 10);
    eprintln!("adaptive waiter, peer answering every ms: {per_msg:?} of CPU per message");
    assert!(per_msg < Duration::from_micros(35), "{per_msg:?} of CPU per message waited for (spin not learned)");
    assert!(learned.spin(Duration::from_micros(50)) <= Duration::from_micros(4), "{learned:?}");
}

/// A waiter whose doorbell can lose a ring (a VM guest's: an emulated
/// interrupt) and which looks again every `recheck` finds a message whose
/// ring never came within about that; without `recheck` it sleeps until its
/// deadline. The lost ring is a descriptor pushed (visible) but never
/// published (nobody rang).
#[test]
fn a_lost_ring_costs_a_recheck_not_a_hang() {
    let pair = Pair::new(16);
    let (mut a, mut b) = connect(&pair, 16);
    let mut epoch = 0;
    let wait_for_one = |b: &mut Side, epoch: &mut u64, recheck: Option<Duration>, timeout: Duration| {
        let started = Instant::now();
        let (outcome, got) = wait_recv(b, epoch, &mut Default::default(), WaitStrategy::Block, false, recheck, timeout);
        (outcome, got, started.elapsed())
    };
    std::thread::scope(|s| {
        let pusher = s.spawn(|| {
            // Pushed while the waiter sleeps; `publish` (the ring) never called.
            std::thread::sleep(Duration::from_millis(50));
            a.tx.push(&desc(1)).unwrap();
        });
        let (outcome, got, took) = wait_for_one(&mut b, &mut epoch, Some(Duration::from_millis(20)), Duration::from_secs(10));
        pusher.join().unwrap();
        assert_eq!(outcome, WaitOutcome::Ready);
        assert_eq!(got.map(|d| d.cookie), Some(1));
        assert!(took < Duration::from_secs(2), "found after {took:?}");
    });
    // The same without a recheck: nothing wakes it before its deadline.
    a.tx.push(&desc(2)).unwrap_or_else(|e| panic!("{e}"));
    // (The slot is visible at once: look before sleeping finds it.)
    let (outcome, got, _) = wait_for_one(&mut b, &mut epoch, None, Duration::from_millis(300));
    assert_eq!((outcome, got.map(|d| d.cookie)), (WaitOutcome::Ready, Some(2)));
    std::thread::scope(|s| {
        let pusher = s.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            a.tx.push(&desc(3)).unwrap();
        });
        let (_, _, took) = wait_for_one(&mut b, &mut epoch, None, Duration::from_millis(500));
        pusher.join().unwrap();
        // Found (if at all) by the last look at its deadline, not before.
        assert!(took >= Duration::from_millis(500), "woken without a ring after {took:?}");
    });
}
