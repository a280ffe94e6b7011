//! Records, tables, JSON lines, percentiles, peer processes, CPU placement and the
//! payload "touch" helpers shared by every baseline.

use std::collections::HashMap;
use std::fmt;
use std::io::Write as _;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use rustix::thread::CpuSet;

/// One measured figure. Serialized (JSON lines) with exactly these field names.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Record {
    pub suite: String,
    pub case: String,
    pub system: String,
    pub metric: String,
    pub value: f64,
    pub unit: String,
    pub p50: Option<f64>,
    pub p99: Option<f64>,
    pub n: u64,
}

impl Record {
    /// A latency record: value = p50, percentiles filled, `n` = iterations.
    pub fn latency(suite: &str, case: &str, system: &str, p50: f64, p99: f64, n: u64) -> Self {
        Record {
            suite: suite.into(),
            case: case.into(),
            system: system.into(),
            metric: "one_way_ns".into(),
            value: p50,
            unit: "ns".into(),
            p50: Some(p50),
            p99: Some(p99),
            n,
        }
    }

    /// A throughput record: value = mean bytes/s over the run, no percentiles, `n` = messages.
    pub fn throughput(suite: &str, case: &str, system: &str, bytes_per_s: f64, n: u64) -> Self {
        Record {
            suite: suite.into(),
            case: case.into(),
            system: system.into(),
            metric: "bytes_per_s".into(),
            value: bytes_per_s,
            unit: "B/s".into(),
            p50: None,
            p99: None,
            n,
        }
    }
}

/// Options of a suite run.
#[derive(Debug, Clone, Default)]
pub struct Opts {
    /// ≈0.3 s per point instead of ≈2 s.
    pub quick: bool,
    /// Where the caller wants JSON lines. `channel_baselines` does not write it: the caller
    /// merges its own records with the baselines and calls [`write_json`] once.
    pub json: Option<PathBuf>,
    /// Substring matched against the system or the case; `None` runs everything.
    pub filter: Option<String>,
}

impl Opts {
    /// Whether the point (`system`, `case`) passes the filter: the system or the
    /// case contains one of its comma-separated parts (a part ending in `$` must
    /// end it), as docs/BENCHMARKS.md says.
    pub fn wants(&self, system: &str, case: &str) -> bool {
        let Some(f) = &self.filter else { return true };
        f.split(',').filter(|p| !p.is_empty()).any(|part| match part.strip_suffix('$') {
            Some(end) => system.ends_with(end) || case.ends_with(end),
            None => system.contains(part) || case.contains(part),
        })
    }

    /// Measured time per point.
    pub fn duration(&self) -> Duration {
        if self.quick {
            Duration::from_millis(300)
        } else {
            Duration::from_secs(2)
        }
    }

    /// Warm-up time per point (not measured).
    pub fn warmup(&self) -> Duration {
        if self.quick {
            Duration::from_millis(80)
        } else {
            Duration::from_millis(400)
        }
    }
}

// ---------------------------------------------------------------------------------------
// Percentiles and histogram
// ---------------------------------------------------------------------------------------

// Exact percentiles and the monotonic clock: the demo's, one copy for both.
pub use fido_demo::measure::{mono_ns, percentiles, quantile};

/// Log-linear histogram of nanosecond values: exact below 128, then 128 sub-buckets per
/// power of two (relative error < 1 %). Constant memory, O(1) record; for runs whose
/// sample vectors would be too large.
#[derive(Clone)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    max: u64,
}

const SUB_BITS: u32 = 7;
const SUB: u64 = 1 << SUB_BITS;

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

impl Histogram {
    pub fn new() -> Self {
        Histogram {
            counts: vec![0; ((64 - SUB_BITS as usize) + 1) * SUB as usize],
            total: 0,
            max: 0,
        }
    }

    fn index(v: u64) -> usize {
        if v < SUB {
            return v as usize;
        }
        let e = 63 - v.leading_zeros(); // >= SUB_BITS
        let shift = e - SUB_BITS;
        let sub = (v >> shift) & (SUB - 1);
        ((shift as u64 + 1) * SUB + sub) as usize
    }

    fn lower_bound(i: usize) -> u64 {
        let i = i as u64;
        if i < SUB {
            return i;
        }
        let shift = i / SUB - 1;
        let sub = i % SUB;
        (SUB | sub) << shift
    }

    pub fn record(&mut self, v: u64) {
        self.counts[Self::index(v)] += 1;
        self.total += 1;
        self.max = self.max.max(v);
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    /// Nearest-rank quantile (lower bound of the bucket holding it).
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Self::lower_bound(i);
            }
        }
        self.max
    }
}

// ---------------------------------------------------------------------------------------
// Table and JSON lines
// ---------------------------------------------------------------------------------------

fn fmt_value(v: f64, unit: &str) -> String {
    match unit {
        "ns" if v < 10_000.0 => format!("{v:.0} ns"),
        "ns" if v < 10_000_000.0 => format!("{:.1} µs", v / 1e3),
        "ns" => format!("{:.1} ms", v / 1e6),
        "B/s" if v >= 1e9 => format!("{:.2} GB/s", v / 1e9),
        "B/s" => format!("{:.1} MB/s", v / 1e6),
        u if v != 0.0 && v.abs() < 0.01 => format!("{v:.2e} {u}"),
        u => format!("{v:.3} {u}"),
    }
}

/// Prints where it ran ([`crate::Machine`]: CPU, cores, placement, virtualization,
/// kernel), then an aligned table grouped by case (cases in order of first appearance). The
/// `vs fido` column is each value divided by the value of the first record of the same
/// case and metric whose system starts with `fido` (latency: >1 means slower than fido;
/// throughput: >1 means faster than fido).
pub fn print_table(records: &[Record]) {
    print_table_on(records, &crate::Machine::pinned());
}

/// [`print_table`] with the suite's own machine description (its placement).
pub fn print_table_on(records: &[Record], machine: &crate::Machine) {
    println!("{}", machine.header());
    print_rows(records);
}

/// [`print_table`] without the placement line (for suites whose processes
/// are not placed by [`Placement`], such as the `vm` suite's guests).
pub fn print_rows(records: &[Record]) {
    let mut cases: Vec<&str> = Vec::new();
    let mut by_case: HashMap<&str, Vec<&Record>> = HashMap::new();
    for r in records {
        by_case
            .entry(r.case.as_str())
            .or_insert_with(|| {
                cases.push(r.case.as_str());
                Vec::new()
            })
            .push(r);
    }
    let header = [
        "case", "system", "metric", "value", "p50", "p99", "n", "vs fido",
    ];
    let mut rows: Vec<[String; 8]> = Vec::new();
    for case in &cases {
        let recs = &by_case[case];
        for r in recs {
            let fido = recs
                .iter()
                .find(|f| f.system.starts_with("fido") && f.metric == r.metric);
            let ratio = match fido {
                Some(f) if f.value != 0.0 => format!("{:.2}x", r.value / f.value),
                _ => String::new(),
            };
            rows.push([
                r.case.clone(),
                r.system.clone(),
                r.metric.clone(),
                fmt_value(r.value, &r.unit),
                r.p50.map(|v| fmt_value(v, &r.unit)).unwrap_or_default(),
                r.p99.map(|v| fmt_value(v, &r.unit)).unwrap_or_default(),
                r.n.to_string(),
                ratio,
            ]);
        }
    }
    let mut w = [0usize; 8];
    for (i, h) in header.iter().enumerate() {
        w[i] = h.chars().count();
    }
    for row in &rows {
        for (i, c) in row.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let out = std::io::stdout();
    let mut out = out.lock();
    let line = |cells: &[String]| -> String {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            let pad = w[i] - c.chars().count();
            // left-align text columns, right-align numbers
            if i < 3 {
                s.push_str(c);
                s.push_str(&" ".repeat(pad));
            } else {
                s.push_str(&" ".repeat(pad));
                s.push_str(c);
            }
            s.push_str("  ");
        }
        s.trim_end().to_string()
    };
    let hdr: Vec<String> = header.iter().map(|s| s.to_string()).collect();
    let _ = writeln!(out, "{}", line(&hdr));
    let _ = writeln!(out, "{}", "-".repeat(w.iter().sum::<usize>() + 2 * 7));
    let mut prev_case: Option<&str> = None;
    for row in &rows {
        if prev_case.is_some() && prev_case != Some(row[0].as_str()) {
            let _ = writeln!(out);
        }
        prev_case = Some(row[0].as_str());
        let _ = writeln!(out, "{}", line(row));
    }
}

/// Writes one JSON object per line, fields as [`Record`] plus `machine` (where it ran:
/// [`crate::Machine::pinned`], the placement of the suites that pin with [`Placement`]).
pub fn write_json(path: &Path, records: &[Record]) -> anyhow::Result<()> {
    write_json_on(path, records, &crate::Machine::pinned())
}

/// [`write_json`] with the suite's own machine description (its placement, its tools).
pub fn write_json_on(path: &Path, records: &[Record], machine: &crate::Machine) -> anyhow::Result<()> {
    let machine = machine.to_json();
    let f = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut w = std::io::BufWriter::new(f);
    for r in records {
        let mut v = serde_json::to_value(r)?;
        v["machine"] = machine.clone();
        serde_json::to_writer(&mut w, &v)?;
        w.write_all(b"\n")?;
    }
    w.flush()?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Placement (CPU pinning)
// ---------------------------------------------------------------------------------------

/// Where the measuring parent and its peer run. Detected from the affinity mask this
/// process started with: the first allowed CPU for the parent, the second for the peer
/// (cross-CPU); if only one CPU is allowed both share it.
///
/// The mask is read once, before any pinning ([`PinGuard::pin`] and [`pin_to`] make
/// sure of it), and kept: read again from a thread already pinned to the parent's CPU
/// it would allow one CPU and put the peer on the parent's CPU too. That is what the
/// `uds` and `tcp` baselines did until 2026-11-26 (they detected the placement a second
/// time after pinning): their "cross-CPU" ping-pongs ran on one CPU, where a wake-up
/// needs no inter-processor interrupt, and looked 3.6× faster than the eventfd floor
/// on a 16-core machine (issue #20, docs/ARCHITECTURE.md §5.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub parent: usize,
    pub peer: usize,
}

static PLACEMENT: std::sync::OnceLock<Placement> = std::sync::OnceLock::new();

impl Placement {
    pub fn detect() -> Placement {
        *PLACEMENT.get_or_init(Self::from_current_mask)
    }

    fn from_current_mask() -> Placement {
        let set = rustix::thread::sched_getaffinity(None).unwrap_or_else(|_| {
            let mut s = CpuSet::new();
            s.set(0);
            s
        });
        let cpus: Vec<usize> = (0..CpuSet::MAX_CPU)
            .filter(|&c| set.is_set(c))
            .take(2)
            .collect();
        match cpus.as_slice() {
            [a, b, ..] => Placement {
                parent: *a,
                peer: *b,
            },
            [a] => Placement {
                parent: *a,
                peer: *a,
            },
            [] => Placement { parent: 0, peer: 0 },
        }
    }

    pub fn cross(&self) -> bool {
        self.parent != self.peer
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ping-pong/throughput: parent on CPU{}, peer on CPU{} ({}); ucx-posix: server CPU{}, client CPU{}; \
             pipeline-*: unpinned (hops+1 processes)",
            self.parent,
            self.peer,
            if self.cross() { "cross-CPU" } else { "same CPU" },
            self.peer,
            self.parent,
        )
    }
}

/// Pins the calling thread to `cpu`.
pub fn pin_to(cpu: usize) -> anyhow::Result<()> {
    // The placement is read from the mask before the first pinning narrows it.
    Placement::detect();
    let mut set = CpuSet::new();
    set.set(cpu);
    rustix::thread::sched_setaffinity(None, &set).with_context(|| format!("pinning to CPU{cpu}"))
}

/// Pins the calling thread while alive; restores its previous mask on drop.
pub struct PinGuard {
    saved: Option<CpuSet>,
}

impl PinGuard {
    pub fn pin(cpu: usize) -> anyhow::Result<PinGuard> {
        let saved = rustix::thread::sched_getaffinity(None).ok();
        pin_to(cpu)?;
        Ok(PinGuard { saved })
    }
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        if let Some(s) = &self.saved {
            let _ = rustix::thread::sched_setaffinity(None, s);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Peer processes
// ---------------------------------------------------------------------------------------

/// Environment variable carrying the spawning parent's pid to its peers.
pub(crate) const PARENT_ENV: &str = "FIDO_BENCH_PARENT";
/// First descriptor number handed to a peer (`fds[i]` arrives as `PEER_FD0 + i`).
pub const PEER_FD0: RawFd = 3;

/// Spawns `std::env::current_exe()` with `["__bench-peer", args...]`, stdout null.
pub fn spawn_peer(args: &[&str]) -> anyhow::Result<Child> {
    spawn_peer_with(args, &[], Stdio::null())
}

/// Like [`spawn_peer`], but the peer receives `fds[i]` as descriptor `PEER_FD0 + i`
/// (every other descriptor of ours stays close-on-exec) and `stdout` as its stdout.
pub fn spawn_peer_with(
    args: &[&str],
    fds: &[BorrowedFd<'_>],
    stdout: Stdio,
) -> anyhow::Result<Child> {
    if fds.len() > 16 {
        bail!("at most 16 descriptors per peer");
    }
    let exe = std::env::current_exe().context("current_exe")?;
    let mut cmd = Command::new(exe);
    cmd.arg("__bench-peer")
        .args(args)
        .env(PARENT_ENV, std::process::id().to_string())
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::inherit());
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    if !raw.is_empty() {
        // SAFETY: the closure runs in the forked child before exec and only calls
        // async-signal-safe system calls (fcntl, dup2, close) on descriptors we own;
        // it allocates nothing (the Vec was built before fork and is only read).
        unsafe {
            cmd.pre_exec(move || {
                // First move every source above the target range, so dup2 below can
                // never clobber a source that happens to sit at a target number.
                let mut high: [Option<OwnedFd>; 16] = Default::default();
                for (i, &fd) in raw.iter().enumerate().take(16) {
                    let b = BorrowedFd::borrow_raw(fd);
                    high[i] = Some(rustix::io::fcntl_dupfd_cloexec(b, 64)?);
                }
                for (i, h) in high.iter().enumerate().take(raw.len()) {
                    let mut target = OwnedFd::from_raw_fd(PEER_FD0 + i as RawFd);
                    let r = rustix::io::dup2(h.as_ref().unwrap(), &mut target);
                    std::mem::forget(target); // dup2 cleared CLOEXEC on it; keep it open
                    r?;
                }
                Ok(())
            });
        }
    }
    cmd.spawn().context("spawning bench peer")
}

/// A spawned peer that is always killed and reaped: by [`Peer::finish`] on success, by
/// `Drop` on any error path.
pub struct Peer {
    child: Option<Child>,
    what: String,
}

impl Peer {
    pub fn spawn(args: &[&str], fds: &[BorrowedFd<'_>]) -> anyhow::Result<Peer> {
        Self::spawn_stdout(args, fds, Stdio::null())
    }

    pub fn spawn_stdout(
        args: &[&str],
        fds: &[BorrowedFd<'_>],
        stdout: Stdio,
    ) -> anyhow::Result<Peer> {
        let child = spawn_peer_with(args, fds, stdout)?;
        Ok(Peer {
            child: Some(child),
            what: args.join(" "),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    pub fn child_mut(&mut self) -> &mut Child {
        self.child.as_mut().expect("peer already finished")
    }

    /// Waits up to `timeout` for a clean exit; kills it (and fails) otherwise.
    pub fn finish(mut self, timeout: Duration) -> anyhow::Result<()> {
        let mut child = self.child.take().expect("peer already finished");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = child.try_wait()? {
                if !st.success() {
                    bail!("bench peer `{}` exited with {st}", self.what);
                }
                return Ok(());
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "bench peer `{}` did not exit within {timeout:?}; killed",
                    self.what
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Watches a peer's pid with a pidfd on a helper thread. If the peer exits before the
/// watchdog is dropped, it sets [`Watchdog::aborted`] and runs `wake` (e.g. write an
/// eventfd the parent may be blocked on), so a dead peer never hangs the parent.
pub struct Watchdog {
    stop: Arc<OwnedFd>,
    aborted: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    pub fn new(pid: u32, wake: impl FnOnce() + Send + 'static) -> anyhow::Result<Watchdog> {
        use rustix::event::{poll, EventfdFlags, PollFd, PollFlags};
        let pid = rustix::process::Pid::from_raw(pid as i32).context("bad pid")?;
        let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())?;
        let stop = Arc::new(rustix::event::eventfd(0, EventfdFlags::CLOEXEC)?);
        let aborted = Arc::new(AtomicBool::new(false));
        let (stop2, aborted2) = (stop.clone(), aborted.clone());
        let thread = std::thread::Builder::new()
            .name("bench-watchdog".into())
            .spawn(move || loop {
                let mut fds = [
                    PollFd::new(&pidfd, PollFlags::IN),
                    PollFd::new(&*stop2, PollFlags::IN),
                ];
                if poll(&mut fds, None).is_err() {
                    continue;
                }
                if !fds[1].revents().is_empty() {
                    return;
                }
                if !fds[0].revents().is_empty() {
                    aborted2.store(true, Ordering::SeqCst);
                    wake();
                    return;
                }
            })?;
        Ok(Watchdog {
            stop,
            aborted,
            thread: Some(thread),
        })
    }

    pub fn aborted(&self) -> bool {
        self.aborted.load(Ordering::Relaxed)
    }

    pub fn flag(&self) -> Arc<AtomicBool> {
        self.aborted.clone()
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let _ = rustix::io::write(&*self.stop, &1u64.to_ne_bytes());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Peer side: die with the parent, refuse to run orphaned, optionally pin.
pub(crate) fn peer_prologue() -> anyhow::Result<()> {
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
    if let Ok(p) = std::env::var(PARENT_ENV) {
        let want: i32 = p.parse().context("bad FIDO_BENCH_PARENT")?;
        let ppid = rustix::process::getppid().map(|p| p.as_raw_nonzero().get());
        if ppid != Some(want) {
            bail!("bench peer: parent {want} already gone");
        }
    }
    Ok(())
}

/// Takes ownership of inherited descriptor `PEER_FD0 + i`.
pub(crate) fn peer_fd(i: usize) -> OwnedFd {
    // SAFETY: the parent dup2'ed a descriptor to this number just before exec
    // (spawn_peer_with); nothing else in this process owns it.
    unsafe { OwnedFd::from_raw_fd(PEER_FD0 + i as RawFd) }
}

/// `key=value` arguments of a peer process (also used by the suites' own role
/// processes): the demo's role arguments, one parser for both.
pub use fido_demo::pipeline::Args as PeerArgs;

/// Pins the calling peer to the CPU its `cpu=` argument names, if any.
pub fn pin_peer(a: &PeerArgs) -> anyhow::Result<()> {
    if let Some(c) = a.opt("cpu") {
        pin_to(c.parse()?)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Payload touch, timing loops
// ---------------------------------------------------------------------------------------

/// The sender's write: every byte of `buf` becomes `seq as u8`, then `seq` goes into the
/// first 8 bytes (little endian) when there is room.
#[inline]
pub fn fill(buf: &mut [u8], seq: u64) {
    buf.fill(seq as u8);
    if buf.len() >= 8 {
        buf[..8].copy_from_slice(&seq.to_le_bytes());
    }
}

/// [`fill`] through a raw pointer (shared memory).
///
/// # Safety
/// `ptr..ptr+len` must be writable and not concurrently accessed.
#[inline]
pub unsafe fn fill_raw(ptr: *mut u8, len: usize, seq: u64) {
    // SAFETY: the caller's contract above.
    fill(unsafe { std::slice::from_raw_parts_mut(ptr, len) }, seq)
}

/// The receiver's read: folds every byte (as u64 words) and returns the sequence number
/// carried in the first 8 bytes (0 if the message is shorter).
#[inline]
pub fn fold(buf: &[u8]) -> u64 {
    // SAFETY: u64 has no invalid bit patterns; align_to handles the unaligned ends.
    let (pre, words, post) = unsafe { buf.align_to::<u64>() };
    let mut acc = 0u64;
    for &b in pre.iter().chain(post) {
        acc = acc.wrapping_add(b as u64);
    }
    for &w in words {
        acc = acc.wrapping_add(w).rotate_left(1);
    }
    std::hint::black_box(acc);
    if buf.len() >= 8 {
        u64::from_le_bytes(buf[..8].try_into().unwrap())
    } else {
        0
    }
}

/// Runs `round_trip(seq)` for `warmup` (discarded), then for `duration`, timing each
/// call; returns the round-trip times in ns. `seq` starts at 1 and increases by one.
pub fn time_round_trips(
    warmup: Duration,
    duration: Duration,
    round_trip: impl FnMut(u64) -> anyhow::Result<()>,
) -> anyhow::Result<Vec<u64>> {
    Ok(time_round_trips_cpu(warmup, duration, None, round_trip)?.0)
}

/// [`time_round_trips`] that also measures the CPU time both sides spent in the
/// measured window (not the warm-up): this thread's and, with `peer`, every
/// thread's of that process ([`CpuUse`]).
pub fn time_round_trips_cpu(
    warmup: Duration,
    duration: Duration,
    peer: Option<u32>,
    mut round_trip: impl FnMut(u64) -> anyhow::Result<()>,
) -> anyhow::Result<(Vec<u64>, CpuUse)> {
    let mut seq = 1u64;
    let start = Instant::now();
    while start.elapsed() < warmup {
        round_trip(seq)?;
        seq += 1;
    }
    let mut samples = Vec::with_capacity(1 << 16);
    let cpu0 = CpuUse::now(peer);
    let start = Instant::now();
    let mut t0 = start;
    loop {
        round_trip(seq)?;
        seq += 1;
        let t1 = Instant::now();
        samples.push((t1 - t0).as_nanos() as u64);
        if t1 - start >= duration {
            break;
        }
        t0 = t1;
    }
    let cpu = CpuUse::now(peer).since(&cpu0);
    Ok((samples, cpu))
}

/// CPU time (ns on a CPU, user + system, from the scheduler's own accounting
/// in `/proc/.../schedstat`: nanosecond resolution, unlike the tick-based
/// `getrusage`) of the measuring thread and of the peer process.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CpuUse {
    /// The measuring thread (`/proc/thread-self/schedstat`): the parent process
    /// may hold other threads (an embedded broker) that are not the measured side.
    pub parent_ns: u64,
    /// Every thread of the peer process (`/proc/<pid>/task/*/schedstat`), what a
    /// user of that side pays; 0 without a peer.
    pub peer_ns: u64,
}

impl CpuUse {
    fn now(peer: Option<u32>) -> CpuUse {
        let first = |path: &Path| -> u64 {
            std::fs::read_to_string(path)
                .ok()
                .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
                .unwrap_or(0)
        };
        let peer_ns = peer.map_or(0, |pid| {
            std::fs::read_dir(format!("/proc/{pid}/task"))
                .map(|d| d.flatten().map(|t| first(&t.path().join("schedstat"))).sum())
                .unwrap_or(0)
        });
        CpuUse {
            parent_ns: first(Path::new("/proc/thread-self/schedstat")),
            peer_ns,
        }
    }

    fn since(&self, earlier: &CpuUse) -> CpuUse {
        CpuUse {
            parent_ns: self.parent_ns.saturating_sub(earlier.parent_ns),
            peer_ns: self.peer_ns.saturating_sub(earlier.peer_ns),
        }
    }

    /// Both sides' CPU time per message of `round_trips` ping-pongs (two
    /// messages each), in ns.
    pub fn ns_per_msg(&self, round_trips: usize) -> f64 {
        (self.parent_ns + self.peer_ns) as f64 / (2 * round_trips.max(1)) as f64
    }
}

/// The `cpu_ns_per_msg` record beside a latency record of the same case: both
/// sides' CPU time over the measured window per message ([`CpuUse::ns_per_msg`]);
/// p50 / p99 empty, `n` = messages.
pub fn cpu_record(suite: &str, system: &str, case: &str, cpu: &CpuUse, round_trips: usize) -> Record {
    Record {
        suite: suite.into(),
        case: case.into(),
        system: system.into(),
        metric: "cpu_ns_per_msg".into(),
        value: cpu.ns_per_msg(round_trips),
        unit: "ns".into(),
        p50: None,
        p99: None,
        n: 2 * round_trips as u64,
    }
}

/// Latency record from round-trip samples: one-way = RTT/2.
pub fn latency_record(system: &str, case: &str, mut rtts: Vec<u64>) -> Record {
    let (p50, p99) = percentiles(&mut rtts);
    Record::latency(
        "channel",
        case,
        system,
        p50 as f64 / 2.0,
        p99 as f64 / 2.0,
        rtts.len() as u64,
    )
}

/// Bounded spin, then `sched_yield` (a peer sharing our vCPU gets to run). Fails if
/// `abort` is set or nothing happened for `stall`.
#[inline]
pub fn spin_until(
    mut ready: impl FnMut() -> bool,
    abort: &AtomicBool,
    stall: Duration,
) -> anyhow::Result<()> {
    const SPINS: u32 = 1 << 14;
    for _ in 0..SPINS {
        if ready() {
            return Ok(());
        }
        std::hint::spin_loop();
    }
    let since = Instant::now();
    let mut n = 0u32;
    loop {
        if ready() {
            return Ok(());
        }
        rustix::thread::sched_yield();
        n = n.wrapping_add(1);
        if n.is_multiple_of(256) {
            if abort.load(Ordering::Relaxed) {
                bail!("bench peer died");
            }
            if since.elapsed() > stall {
                bail!("bench peer stalled for {stall:?}");
            }
        }
    }
}

/// Size label of a case suffix: 64B, 4KiB, 64KiB, 1MiB.
pub fn size_label(size: usize) -> String {
    if size >= 1 << 20 && size.is_multiple_of(1 << 20) {
        format!("{}MiB", size >> 20)
    } else if size >= 1 << 10 && size.is_multiple_of(1 << 10) {
        format!("{}KiB", size >> 10)
    } else {
        format!("{size}B")
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_parts_and_anchors() {
        let o = |f: &str| Opts { filter: Some(f.into()), ..Opts::default() };
        assert!(o("latency-polled-64B,latency-adaptive-64B").wants("fido", "latency-adaptive-64B"));
        assert!(o("latency-polled-64B,latency-adaptive-64B").wants("uds", "latency-polled-64B"));
        assert!(!o("latency-polled-64B,latency-adaptive-64B").wants("uds", "latency-notified-64B"));
        assert!(o("4KiB$").wants("uds", "latency-notified-4KiB"));
        assert!(!o("4KiB$").wants("uds", "throughput-4KiB-touch"));
        assert!(o("uds").wants("uds", "anything"));
        assert!(Opts::default().wants("x", "y"));
    }

    /// The placement a suite reads after pinning its measuring thread is the one
    /// it read before: the peer still goes to another CPU (the `uds`/`tcp`
    /// baselines read it again after pinning and put both ends on one CPU).
    #[test]
    fn placement_is_the_same_from_a_pinned_thread() {
        let cpus = rustix::thread::sched_getaffinity(None).unwrap().count();
        let before = Placement::detect();
        assert_eq!(before.cross(), cpus >= 2, "{before:?} with {cpus} CPUs allowed");
        std::thread::spawn(move || {
            let _pin = PinGuard::pin(before.parent).unwrap();
            assert_eq!(rustix::thread::sched_getaffinity(None).unwrap().count(), 1);
            assert_eq!(Placement::detect(), before, "placement read from a pinned thread");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn percentiles_nearest_rank() {
        let mut v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentiles(&mut v), (50, 99));
        assert_eq!(percentiles(&mut []), (0, 0));
        assert_eq!(percentiles(&mut [7]), (7, 7));
    }

    #[test]
    fn histogram_close_to_exact() {
        let mut h = Histogram::new();
        let mut v: Vec<u64> = (0..100_000u64)
            .map(|i| (i * 7919) % 1_000_003 + 50)
            .collect();
        for &x in &v {
            h.record(x);
        }
        let (p50, p99) = percentiles(&mut v);
        for (exact, q) in [(p50, 0.5), (p99, 0.99)] {
            let approx = h.quantile(q);
            assert!(
                approx <= exact && exact - approx <= exact / 64 + 1,
                "{approx} vs {exact}"
            );
        }
        assert_eq!(h.count(), 100_000);
        for x in [0u64, 1, 127, 128, 129, 255, 256, 1 << 40, u64::MAX] {
            let i = Histogram::index(x);
            assert!(Histogram::lower_bound(i) <= x);
        }
    }

    #[test]
    fn fill_fold_roundtrip() {
        for len in [1usize, 8, 63, 64, 4096 + 3] {
            let mut b = vec![0u8; len];
            fill(&mut b, 0x1234);
            assert_eq!(fold(&b), if len >= 8 { 0x1234 } else { 0 });
        }
    }

    #[test]
    fn labels_and_json() {
        assert_eq!(size_label(64), "64B");
        assert_eq!(size_label(4096), "4KiB");
        assert_eq!(size_label(65536), "64KiB");
        assert_eq!(size_label(1 << 20), "1MiB");
        let r = Record::latency(
            "channel",
            "latency-polled-64B",
            "spin-floor",
            105.0,
            140.5,
            10,
        );
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(
            s,
            r#"{"suite":"channel","case":"latency-polled-64B","system":"spin-floor","metric":"one_way_ns","value":105.0,"unit":"ns","p50":105.0,"p99":140.5,"n":10}"#
        );
        assert_eq!(serde_json::from_str::<Record>(&s).unwrap(), r);
    }

    #[test]
    fn filter() {
        let o = Opts {
            filter: Some("uds".into()),
            ..Default::default()
        };
        assert!(o.wants("uds", "pipeline-1hop"));
        assert!(!o.wants("tcp", "latency-notified-64B"));
        assert!(Opts::default().wants("x", "y"));
    }
}
