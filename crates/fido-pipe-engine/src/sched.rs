//! The weighted-credit scheduler: which domain moves the engine's next chunk.
//!
//! Each domain has a weight and a credit balance in bytes. Credits are
//! refilled from the engine's capacity in proportion to the weights of the
//! domains that are *busy* (a chunk waits to be dispatched, or one holds a
//! lane), and charged with the bytes actually delivered. A domain may start a
//! chunk while its balance is positive; with `work_conserving` a domain out
//! of credits may still start one when no domain with credits waits. Among
//! the eligible domains the one with the least weighted service so far (its
//! virtual time, bytes / weight) goes first; a domain that becomes busy is
//! brought forward to the least virtual time of the running domains, so
//! idling banks nothing. Without a capacity there are no credits: the
//! virtual time alone orders the domains.
//!
//! Pure: no clock reads and no I/O. Time comes in as `now` arguments, so the
//! engine feeds it `Instant::now()` and tests feed it a fake clock.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use fido_proto::DomainId;

/// How often the engine refills credits (a refill sooner than half of this
/// after the previous one is skipped).
pub const REFILL_PERIOD: Duration = Duration::from_millis(5);
/// A busy domain banks at most this much of its share (or one chunk), so a
/// burst after a stall stays short.
pub const BURST: Duration = Duration::from_millis(20);
/// Rates are sampled no more often than this; each sample weighs a quarter
/// in a moving average (about one second).
pub const RATE_WINDOW: Duration = Duration::from_millis(250);

/// A transfer, as the engine numbers it.
pub type JobId = u64;

/// One domain's share of the engine.
#[derive(Debug, Clone)]
struct Share {
    weight: u32,
    credits: f64,
    /// Weighted service so far: bytes / weight.
    vtime: f64,
    /// Transfers whose next chunk waits for dispatch, oldest first.
    queue: VecDeque<JobId>,
    /// Transfers submitted and not finished.
    running: u32,
    /// Chunks of this domain that hold a lane.
    lanes: u32,
    bytes_total: u64,
    /// Bytes since the last rate sample.
    window: u64,
    rate: f64,
    /// The broker forgot the domain; it goes once its transfers finished.
    gone: bool,
}

impl Share {
    fn new(weight: u32) -> Share {
        Share {
            weight: weight.max(1),
            credits: 0.0,
            vtime: 0.0,
            queue: VecDeque::new(),
            running: 0,
            lanes: 0,
            bytes_total: 0,
            window: 0,
            rate: 0.0,
            gone: false,
        }
    }

    fn busy(&self) -> bool {
        !self.queue.is_empty() || self.lanes > 0
    }
}

/// What the scheduler knows of one domain, for `Status`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figures {
    pub weight: u32,
    /// Credit balance in bytes (negative: in debt for a chunk started on its last credits).
    pub credits: f64,
    /// Moving average of the delivery rate, as of the last sample.
    pub bytes_per_s: f64,
    pub bytes_total: u64,
    /// Transfers submitted and not finished.
    pub running: u32,
}

/// The scheduler's state: capacity, lanes, and every domain's share.
#[derive(Debug, Clone)]
pub struct Scheduler {
    /// Bytes per second shared by weight; `None`: unlimited (no credits).
    capacity: Option<u64>,
    work_conserving: bool,
    lanes: u32,
    lanes_used: u32,
    /// The least a busy domain may bank, whatever its share.
    chunk: f64,
    last_refill: Instant,
    last_sample: Instant,
    domains: BTreeMap<DomainId, Share>,
}

impl Scheduler {
    /// A scheduler with no domains; `now` starts the refill and rate clocks.
    pub fn new(
        capacity: Option<u64>,
        work_conserving: bool,
        lanes: u32,
        chunk: u32,
        now: Instant,
    ) -> Scheduler {
        Scheduler {
            capacity,
            work_conserving,
            lanes: lanes.max(1),
            lanes_used: 0,
            chunk: chunk as f64,
            last_refill: now,
            last_sample: now,
            domains: BTreeMap::new(),
        }
    }

    pub fn capacity(&self) -> Option<u64> {
        self.capacity
    }

    /// A new capacity (calibration measured one): used from the next refill.
    pub fn set_capacity(&mut self, capacity: Option<u64>) {
        self.capacity = capacity;
    }

    /// A transfer of `dom` arrives; its first chunk waits for dispatch.
    /// `weight` is used if the scheduler does not know the domain yet.
    pub fn submit(&mut self, dom: DomainId, weight: u32, job: JobId) {
        // A domain that becomes busy starts at the current virtual time: idling banks nothing.
        let least_running = self
            .domains
            .values()
            .filter(|d| d.running > 0)
            .map(|d| d.vtime)
            .fold(f64::INFINITY, f64::min);
        let d = self
            .domains
            .entry(dom)
            .or_insert_with(|| Share::new(weight));
        if d.running == 0 && least_running.is_finite() {
            d.vtime = d.vtime.max(least_running);
        }
        d.gone = false;
        d.running += 1;
        d.queue.push_back(job);
    }

    /// `job`'s next chunk may go (the last one was delivered, or its
    /// descriptor is ready again).
    pub fn ready(&mut self, dom: DomainId, job: JobId) {
        if let Some(d) = self.domains.get_mut(&dom) {
            d.queue.push_back(job);
        }
    }

    /// `job` ended. Returns true when this also dropped its domain (forgotten
    /// and with nothing left running).
    pub fn finished(&mut self, dom: DomainId, job: JobId) -> bool {
        if let Some(d) = self.domains.get_mut(&dom) {
            d.running = d.running.saturating_sub(1);
            d.queue.retain(|q| *q != job);
        }
        self.drop_if_gone(dom)
    }

    /// A new weight for a known domain (an unknown one brings its weight
    /// with its first transfer).
    pub fn set_weight(&mut self, dom: DomainId, weight: u32) {
        if let Some(d) = self.domains.get_mut(&dom) {
            d.weight = weight.max(1);
        }
    }

    /// The domain is gone: it is dropped once its transfers finished (at
    /// once if none runs; then this returns true).
    pub fn forget(&mut self, dom: DomainId) -> bool {
        if let Some(d) = self.domains.get_mut(&dom) {
            d.gone = true;
        }
        self.drop_if_gone(dom)
    }

    fn drop_if_gone(&mut self, dom: DomainId) -> bool {
        let gone = self
            .domains
            .get(&dom)
            .is_some_and(|d| d.gone && d.running == 0);
        if gone {
            self.domains.remove(&dom);
        }
        gone
    }

    /// `bytes` of `dom` reached their sink.
    pub fn charge(&mut self, dom: DomainId, bytes: u64) {
        if let Some(d) = self.domains.get_mut(&dom) {
            d.credits -= bytes as f64;
            d.vtime += bytes as f64 / d.weight as f64;
            d.bytes_total += bytes;
            d.window += bytes;
        }
    }

    /// Credits flow from the capacity to busy domains by weight, for the
    /// time since the last refill. A domain that is not busy gets nothing: its
    /// share goes to those that can use it.
    pub fn refill(&mut self, now: Instant) {
        let dt = now.duration_since(self.last_refill).as_secs_f64();
        if dt < REFILL_PERIOD.as_secs_f64() / 2.0 {
            return;
        }
        self.last_refill = now;
        let Some(cap) = self.capacity else { return };
        let sum: f64 = self
            .domains
            .values()
            .filter(|d| d.busy())
            .map(|d| d.weight as f64)
            .sum();
        if sum == 0.0 {
            return;
        }
        let burst = BURST.as_secs_f64();
        for d in self.domains.values_mut() {
            let share = cap as f64 * d.weight as f64 / sum;
            let ceiling = (share * burst).max(self.chunk);
            if d.busy() {
                d.credits = (d.credits + share * dt).min(ceiling);
            } else {
                d.credits = d.credits.min(ceiling);
            }
        }
    }

    /// The domain whose chunk goes next, if any may go now (lanes aside).
    fn pick(&self) -> Option<DomainId> {
        let best = |need_credit: bool| {
            self.domains
                .iter()
                .filter(|(_, d)| !d.queue.is_empty() && (!need_credit || d.credits > 0.0))
                .min_by(|a, b| a.1.vtime.total_cmp(&b.1.vtime).then(a.0.cmp(b.0)))
                .map(|(id, _)| *id)
        };
        if self.capacity.is_none() {
            return best(false);
        }
        best(true).or_else(|| self.work_conserving.then(|| best(false)).flatten())
    }

    /// The next chunk to move: a lane is free and some domain may go. The
    /// transfer leaves its domain's queue; the caller issues the chunk and
    /// calls [`take_lane`](Self::take_lane) (or [`finished`](Self::finished)
    /// if the transfer was cancelled meanwhile).
    pub fn next_chunk(&mut self) -> Option<(DomainId, JobId)> {
        if self.lanes_used >= self.lanes {
            return None;
        }
        let dom = self.pick()?;
        let job = self.domains.get_mut(&dom)?.queue.pop_front()?;
        Some((dom, job))
    }

    /// A chunk of `dom` occupies a lane.
    pub fn take_lane(&mut self, dom: DomainId) {
        self.lanes_used += 1;
        if let Some(d) = self.domains.get_mut(&dom) {
            d.lanes += 1;
        }
    }

    /// A chunk of `dom` left its lane (delivered, waiting on a descriptor,
    /// or slow enough that it no longer holds the others up).
    pub fn release_lane(&mut self, dom: DomainId) {
        self.lanes_used = self.lanes_used.saturating_sub(1);
        if let Some(d) = self.domains.get_mut(&dom) {
            d.lanes = d.lanes.saturating_sub(1);
        }
    }

    pub fn lanes_used(&self) -> u32 {
        self.lanes_used
    }

    /// One domain's figures now (its rate as of the last sample).
    pub fn figures(&self, dom: DomainId) -> Option<Figures> {
        self.domains.get(&dom).map(Share::figures)
    }

    /// Every live (not forgotten) domain's figures, with the rates updated,
    /// once [`RATE_WINDOW`] passed since the last sample; else `None`.
    pub fn sample(&mut self, now: Instant) -> Option<Vec<(DomainId, Figures)>> {
        let dt = now.duration_since(self.last_sample).as_secs_f64();
        if dt < RATE_WINDOW.as_secs_f64() {
            return None;
        }
        self.last_sample = now;
        let mut out = Vec::with_capacity(self.domains.len());
        for (id, d) in self.domains.iter_mut() {
            let instant_rate = d.window as f64 / dt;
            d.window = 0;
            d.rate = d.rate * 0.75 + instant_rate * 0.25;
            if !d.gone {
                out.push((*id, d.figures()));
            }
        }
        Some(out)
    }
}

impl Share {
    fn figures(&self) -> Figures {
        Figures {
            weight: self.weight,
            credits: self.credits,
            bytes_per_s: self.rate,
            bytes_total: self.bytes_total,
            running: self.running,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1 MiB/s and a refill every 1/256 s: 4096 bytes of credit per tick.
    /// Binary fractions keep every credit figure exact in `f64`.
    const CAP: u64 = 1 << 20;
    const TICK: Duration = Duration::from_nanos(3_906_250);
    const CHUNK: u64 = 4096;
    const A: DomainId = 1;
    const B: DomainId = 2;

    fn at(t0: Instant, tick: u32) -> Instant {
        t0 + TICK * tick
    }

    fn capped(work_conserving: bool, t0: Instant) -> Scheduler {
        Scheduler::new(Some(CAP), work_conserving, 4, CHUNK as u32, t0)
    }

    /// Moves chunks as the engine would if each were delivered at once
    /// (dispatch, deliver `CHUNK` bytes, back in the queue), at most `max`.
    fn move_chunks(s: &mut Scheduler, max: usize) -> Vec<DomainId> {
        let mut order = Vec::new();
        while order.len() < max {
            let Some((dom, job)) = s.next_chunk() else {
                break;
            };
            s.take_lane(dom);
            s.charge(dom, CHUNK);
            s.release_lane(dom);
            s.ready(dom, job);
            order.push(dom);
        }
        order
    }

    /// Ticks `from..to` of the fake clock: refill, then move what may move.
    fn run_ticks(s: &mut Scheduler, t0: Instant, ticks: std::ops::Range<u32>) {
        for tick in ticks {
            s.refill(at(t0, tick));
            move_chunks(s, 10_000);
        }
    }

    fn total(s: &Scheduler, dom: DomainId) -> u64 {
        s.figures(dom).map_or(0, |f| f.bytes_total)
    }

    #[test]
    fn strict_shares_follow_the_weights_exactly() {
        let t0 = Instant::now();
        let mut s = capped(false, t0);
        s.submit(A, 1, 10);
        s.submit(B, 3, 20);
        // One second: A is owed 1/4 of 1 MiB, B 3/4; a chunk starts only on
        // positive credit, and the debt it leaves is paid back first.
        run_ticks(&mut s, t0, 1..257);
        assert_eq!(total(&s, A), CAP / 4);
        assert_eq!(total(&s, B), CAP / 4 * 3);
        assert_eq!(s.figures(A).unwrap().credits, 0.0);
        assert_eq!(s.figures(B).unwrap().credits, 0.0);
    }

    #[test]
    fn strict_mode_idles_a_domain_out_of_credits() {
        let t0 = Instant::now();
        let mut s = capped(false, t0);
        s.submit(A, 1, 10);
        assert_eq!(s.next_chunk(), None, "no credits before the first refill");
        s.refill(at(t0, 1));
        assert_eq!(s.next_chunk(), Some((A, 10)));
        s.take_lane(A);
        s.charge(A, CHUNK);
        s.release_lane(A);
        s.ready(A, 10);
        assert_eq!(s.figures(A).unwrap().credits, 0.0);
        assert_eq!(
            s.next_chunk(),
            None,
            "out of credits, although a lane is free"
        );
    }

    #[test]
    fn work_conserving_lets_the_neediest_run_only_when_nobody_with_credits_waits() {
        let t0 = Instant::now();
        let mut s = capped(true, t0);
        s.submit(A, 1, 10);
        assert_eq!(
            s.next_chunk(),
            Some((A, 10)),
            "out of credits, but nobody else waits"
        );
        s.take_lane(A);
        s.charge(A, CHUNK);
        s.release_lane(A);
        s.ready(A, 10);
        s.submit(B, 1, 20);
        // B starts at A's virtual time, without credits either: the least
        // virtual time goes, a tie to the lower id.
        assert_eq!(s.next_chunk(), Some((A, 10)));
        s.ready(A, 10);
        s.refill(at(t0, 1));
        // Both busy: 2048 credits each. A is still in debt, B has credits:
        // B goes although their virtual times tie.
        assert_eq!(s.figures(A).unwrap().credits, -2048.0);
        assert_eq!(s.figures(B).unwrap().credits, 2048.0);
        assert_eq!(s.next_chunk(), Some((B, 20)));
    }

    #[test]
    fn unlimited_capacity_orders_by_weighted_service() {
        let t0 = Instant::now();
        let mut s = Scheduler::new(None, false, 4, CHUNK as u32, t0);
        s.submit(A, 1, 10);
        s.submit(B, 2, 20);
        assert_eq!(move_chunks(&mut s, 9), [A, B, B, A, B, B, A, B, B]);
        // Deliveries are charged all the same; without a capacity nothing refills.
        assert_eq!(s.figures(A).unwrap().credits, -3.0 * CHUNK as f64);
        s.refill(at(t0, 1));
        assert_eq!(s.figures(A).unwrap().credits, -3.0 * CHUNK as f64);
    }

    #[test]
    fn a_joining_domain_starts_at_the_current_virtual_time() {
        let t0 = Instant::now();
        let mut s = Scheduler::new(None, false, 4, CHUNK as u32, t0);
        s.submit(A, 1, 10);
        assert_eq!(move_chunks(&mut s, 100).len(), 100);
        // B was never busy: it banks nothing and shares from here on.
        s.submit(B, 1, 20);
        assert_eq!(move_chunks(&mut s, 6), [A, B, A, B, A, B]);
        // B idles (its transfer ends) while A works on; coming back, it is
        // brought forward again instead of replaying its idle time.
        assert!(!s.finished(B, 20));
        assert_eq!(move_chunks(&mut s, 10), [A; 10]);
        s.submit(B, 1, 21);
        assert_eq!(move_chunks(&mut s, 4), [A, B, A, B]);
    }

    #[test]
    fn a_leaving_domain_hands_its_share_over() {
        let t0 = Instant::now();
        let mut s = capped(false, t0);
        s.submit(A, 1, 10);
        s.submit(B, 1, 20);
        run_ticks(&mut s, t0, 1..257);
        assert_eq!((total(&s, A), total(&s, B)), (CAP / 2, CAP / 2));
        // B's transfer ends: from the next refill A has the whole capacity.
        assert!(!s.finished(B, 20));
        run_ticks(&mut s, t0, 257..513);
        assert_eq!((total(&s, A), total(&s, B)), (CAP / 2 + CAP, CAP / 2));
        // Forgotten while a transfer runs: kept until it ends, hidden from status.
        assert!(!s.forget(A));
        assert!(s.figures(A).is_some());
        let sampled = s.sample(at(t0, 600)).unwrap();
        assert_eq!(sampled.iter().map(|(d, _)| *d).collect::<Vec<_>>(), [B]);
        assert!(s.finished(A, 10), "its last transfer ended: dropped");
        assert_eq!(s.figures(A), None);
        // With nothing running it goes at once.
        assert!(s.forget(B));
        assert_eq!(s.figures(B), None);
    }

    #[test]
    fn a_stalled_domain_is_not_busy() {
        let t0 = Instant::now();
        let mut s = capped(false, t0);
        s.submit(A, 1, 10);
        s.submit(B, 1, 20);
        s.refill(at(t0, 1));
        // A's chunk leaves the queue and waits on its descriptor (no lane):
        // B alone is busy and gets the whole refill.
        assert_eq!(s.next_chunk(), Some((A, 10)));
        s.refill(at(t0, 2));
        assert_eq!(s.figures(A).unwrap().credits, 2048.0);
        assert_eq!(s.figures(B).unwrap().credits, 2048.0 + 4096.0);
        // A chunk in a lane is busy even with an empty queue.
        s.take_lane(A);
        s.refill(at(t0, 3));
        assert_eq!(s.figures(A).unwrap().credits, 4096.0);
    }

    #[test]
    fn banked_credits_stop_at_the_burst_ceiling() {
        let t0 = Instant::now();
        let mut s = Scheduler::new(Some(CAP), false, 1, CHUNK as u32, t0);
        s.submit(A, 1, 10);
        s.submit(A, 1, 11);
        assert_eq!(s.next_chunk(), None);
        s.refill(at(t0, 1));
        assert_eq!(s.next_chunk(), Some((A, 10)));
        s.take_lane(A);
        // The only lane is held (a chunk in flight): A stays busy and banks,
        // up to 20 ms of its share.
        for tick in 2..100 {
            s.refill(at(t0, tick));
        }
        assert_eq!(s.next_chunk(), None, "every lane is taken");
        let ceiling = CAP as f64 * BURST.as_secs_f64();
        assert_eq!(s.figures(A).unwrap().credits, ceiling);
        // A domain with little share may still bank one chunk.
        let mut slow = Scheduler::new(Some(1000), false, 1, CHUNK as u32, t0);
        slow.submit(A, 1, 10);
        for tick in 1..=40_000 {
            slow.refill(at(t0, tick));
        }
        assert_eq!(slow.figures(A).unwrap().credits, CHUNK as f64);
    }

    #[test]
    fn refills_closer_than_half_a_period_are_skipped() {
        let t0 = Instant::now();
        let mut s = capped(false, t0);
        s.submit(A, 1, 10);
        s.refill(t0 + Duration::from_millis(2));
        assert_eq!(s.figures(A).unwrap().credits, 0.0);
        // The skipped time is not lost: the next refill covers it.
        s.refill(t0 + Duration::from_micros(3_906));
        let owed = CAP as f64 * 0.003_906;
        assert!((s.figures(A).unwrap().credits - owed).abs() < 1e-6);
    }

    #[test]
    fn capacity_changes_apply_from_the_next_refill() {
        let t0 = Instant::now();
        let mut s = capped(false, t0);
        s.submit(A, 1, 10);
        run_ticks(&mut s, t0, 1..257);
        assert_eq!(total(&s, A), CAP);
        s.set_capacity(Some(2 * CAP));
        run_ticks(&mut s, t0, 257..513);
        assert_eq!(total(&s, A), 3 * CAP);
        // Unlimited: credits no longer gate.
        s.set_capacity(None);
        assert_eq!(move_chunks(&mut s, 50).len(), 50);
        assert_eq!(s.capacity(), None);
    }

    #[test]
    fn weight_changes_apply_from_the_next_refill() {
        let t0 = Instant::now();
        let mut s = capped(false, t0);
        s.submit(A, 1, 10);
        s.submit(B, 1, 20);
        run_ticks(&mut s, t0, 1..257);
        s.set_weight(B, 3);
        s.set_weight(7, 9); // unknown: ignored, it brings its weight with its first transfer
        run_ticks(&mut s, t0, 257..513);
        assert_eq!(total(&s, A), CAP / 2 + CAP / 4);
        assert_eq!(total(&s, B), CAP / 2 + CAP / 4 * 3);
        assert_eq!(s.figures(7), None);
        s.set_weight(A, 0);
        assert_eq!(s.figures(A).unwrap().weight, 1, "a weight is at least 1");
    }

    #[test]
    fn lanes_bound_the_chunks_in_flight() {
        let t0 = Instant::now();
        let mut s = Scheduler::new(None, false, 2, CHUNK as u32, t0);
        for job in 10..13 {
            s.submit(A, 1, job);
        }
        assert_eq!(s.next_chunk(), Some((A, 10)));
        s.take_lane(A);
        assert_eq!(s.next_chunk(), Some((A, 11)));
        s.take_lane(A);
        assert_eq!(s.lanes_used(), 2);
        assert_eq!(s.next_chunk(), None);
        s.release_lane(A);
        assert_eq!(s.next_chunk(), Some((A, 12)));
        // A transfer that ends with chunks queued leaves the queue.
        s.ready(A, 10);
        assert!(!s.finished(A, 10));
        assert_eq!(s.figures(A).unwrap().running, 2);
        assert_eq!(s.next_chunk(), None, "job 10 is no longer queued");
    }

    #[test]
    fn rates_are_sampled_every_window_as_a_moving_average() {
        let t0 = Instant::now();
        let mut s = Scheduler::new(None, false, 4, CHUNK as u32, t0);
        s.submit(A, 2, 10);
        s.charge(A, CAP / 4);
        assert_eq!(s.sample(t0 + Duration::from_millis(249)), None);
        let first = s.sample(t0 + RATE_WINDOW).unwrap();
        // 256 KiB in 250 ms is 1 MiB/s; a quarter of it enters the average.
        assert_eq!(
            first,
            [(
                A,
                Figures {
                    weight: 2,
                    credits: -((CAP / 4) as f64),
                    bytes_per_s: (CAP / 4) as f64,
                    bytes_total: CAP / 4,
                    running: 1,
                }
            )]
        );
        let second = s.sample(t0 + RATE_WINDOW * 2).unwrap();
        assert_eq!(second[0].1.bytes_per_s, (CAP / 4) as f64 * 0.75);
    }
}
