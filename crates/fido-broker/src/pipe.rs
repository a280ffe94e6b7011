//! The pipe engine (vPipe): the broker moves bytes between descriptors its
//! clients handed it.
//!
//! One engine thread owns one io_uring. Every transfer is a small state
//! machine that moves a chunk at a time through a kernel pipe of its own:
//! `splice(source → pipe)` then `splice(pipe → sink)` until the chunk is
//! delivered, with explicit offsets on files (the shared file position is never
//! used or moved). The splices run in the kernel's io-wq workers, so a
//! descriptor that stalls forever (a socket nobody reads, a pipe nobody writes)
//! only stalls its own transfer, and it can be cancelled (`IORING_OP_ASYNC_CANCEL`
//! interrupts the blocked worker). A source or sink that the client set
//! `O_NONBLOCK` returns `EAGAIN`: the transfer then waits with a cancellable
//! `IORING_OP_POLL_ADD` and retries; the engine never changes a descriptor's flags.
//!
//! Sharing: every chunk is a scheduling decision. Each domain has a weight and
//! a credit balance in bytes. Credits are refilled from the engine's capacity
//! (calibrated at startup, configured, or unlimited) in proportion to the
//! weights of the domains that have work, and charged with the bytes actually
//! delivered to the sink. A domain may start a chunk while it has credits; with
//! the work-conserving option a domain out of credits may still start one when
//! no domain with credits is waiting (the paper's "very low priority"). Among
//! the eligible domains the one with the least weighted service so far
//! (bytes / weight, a virtual time that is brought forward when a domain becomes
//! busy, so idling banks nothing) goes first. At most `lanes` chunks are moved at
//! once; a chunk that takes longer than [`SLOW`] stops counting against the lanes,
//! so a stalled transfer never holds the others up.
//!
//! The engine never touches the broker's state: the main loop validates
//! requests and descriptors and hands jobs over a channel; results come back
//! over another one, with an eventfd the main loop polls.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fido_proto::{
    DomainId, PipeDomainStatus, PipeEnd, PipeEngineStatus, PipeFdKind, PipeOp, PipeResult,
};
use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;
use rustix::io::Errno;

/// A chunk in flight longer than this no longer occupies a lane.
pub const SLOW: Duration = Duration::from_millis(20);
/// How often credits are refilled and rates updated.
const TICK: Duration = Duration::from_millis(5);
/// How long a cancelled splice may take to return before the transfer is
/// reported cancelled anyway.
const CANCEL_GRACE: Duration = Duration::from_secs(2);
/// How long calibration moves bytes at startup.
const CALIBRATION: Duration = Duration::from_millis(150);

const TAG_SPLICE: u64 = 1;
const TAG_POLL: u64 = 2;
const TAG_CANCEL: u64 = 3;
const WAKE: u64 = u64::MAX;

/// How much the engine may move per second, shared among domains by weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capacity {
    /// No cap; weights decide who goes first when the lanes are busy.
    Unlimited,
    /// Measured when the first transfer arrives (150 ms of file → socket
    /// splice through one lane); unlimited until then.
    Auto,
    /// A fixed figure in bytes per second.
    BytesPerSec(u64),
}

impl std::str::FromStr for Capacity {
    type Err = String;
    fn from_str(s: &str) -> Result<Capacity, String> {
        match s.trim() {
            "auto" => Ok(Capacity::Auto),
            "unlimited" => Ok(Capacity::Unlimited),
            other => {
                let t = other.trim_end_matches("/s");
                crate::policy::parse_size(t)
                    .filter(|n| *n > 0)
                    .map(Capacity::BytesPerSec)
                    .ok_or_else(|| {
                        format!("pipe capacity {s:?}: give auto, unlimited, or bytes per second such as 100M or 1GiB/s")
                    })
            }
        }
    }
}

/// Pipe engine settings.
#[derive(Debug, Clone)]
pub struct PipeConfig {
    pub capacity: Capacity,
    /// May a domain out of credits run when nobody with credits waits?
    pub work_conserving: bool,
    /// Chunks moved at once.
    pub lanes: u32,
    /// Bytes per chunk (the size asked of each engine pipe).
    pub chunk: u32,
    /// Run the engine at all (`false`: pipe requests are refused with `Unavailable`).
    pub enabled: bool,
}

impl Default for PipeConfig {
    fn default() -> Self {
        PipeConfig {
            capacity: Capacity::Auto,
            work_conserving: true,
            lanes: 4,
            chunk: 1 << 20,
            enabled: true,
        }
    }
}

// ----- descriptor checks (run on the main loop; never block) -----------------

/// Classifies a descriptor handed to the engine and checks it can play its
/// role. `source`: it will be read; else written.
pub(crate) fn check_fd(fd: BorrowedFd<'_>, source: bool) -> Result<PipeFdKind, String> {
    let role = if source { "source" } else { "sink" };
    let flags = rustix::fs::fcntl_getfl(fd)
        .map_err(|e| format!("{role}: not a usable descriptor ({e})"))?;
    if flags.contains(rustix::fs::OFlags::PATH) {
        return Err(format!(
            "{role}: an O_PATH descriptor cannot be read or written"
        ));
    }
    let st = rustix::fs::fstat(fd).map_err(|e| format!("{role}: fstat failed ({e})"))?;
    let ft = rustix::fs::FileType::from_raw_mode(st.st_mode);
    let kind = match ft {
        rustix::fs::FileType::RegularFile => PipeFdKind::File,
        rustix::fs::FileType::Fifo => PipeFdKind::Stream,
        rustix::fs::FileType::Socket => {
            let t = rustix::net::sockopt::socket_type(fd)
                .map_err(|e| format!("{role}: socket type unknown ({e})"))?;
            if t != rustix::net::SocketType::STREAM {
                return Err(format!(
                    "{role}: a {t:?} socket; pipes move bytes between stream sockets only"
                ));
            }
            PipeFdKind::Stream
        }
        other => {
            return Err(format!(
                "{role}: a {other:?}; pipes take regular files, stream sockets and pipes"
            ))
        }
    };
    let mode = flags & rustix::fs::OFlags::RWMODE;
    if source && mode == rustix::fs::OFlags::WRONLY {
        return Err(format!(
            "{role}: opened write-only (O_WRONLY); a source must be readable"
        ));
    }
    if !source && mode == rustix::fs::OFlags::RDONLY {
        return Err(format!(
            "{role}: opened read-only (O_RDONLY); a sink must be writable"
        ));
    }
    if !source && kind == PipeFdKind::File && flags.contains(rustix::fs::OFlags::APPEND) {
        return Err(format!(
            "{role}: opened O_APPEND; the engine writes at explicit offsets, which O_APPEND ignores"
        ));
    }
    Ok(kind)
}

/// Does `op` fit a pipe whose descriptors are of these kinds?
pub(crate) fn check_op(op: &PipeOp, source: PipeFdKind, sink: PipeFdKind) -> Result<(), String> {
    let want_src = if op.source_is_file() {
        PipeFdKind::File
    } else {
        PipeFdKind::Stream
    };
    let want_dst = if op.sink_is_file() {
        PipeFdKind::File
    } else {
        PipeFdKind::Stream
    };
    let name = |k: PipeFdKind| match k {
        PipeFdKind::File => "a regular file",
        PipeFdKind::Stream => "a stream (socket or pipe)",
    };
    if source != want_src {
        return Err(format!(
            "{op:?} needs {} as source; this one is {}",
            name(want_src),
            name(source)
        ));
    }
    if sink != want_dst {
        return Err(format!(
            "{op:?} needs {} as sink; this one is {}",
            name(want_dst),
            name(sink)
        ));
    }
    Ok(())
}

/// A file→file copy within one file must not overlap: chunked copies are not
/// `memmove`, the result would repeat data.
pub(crate) fn check_overlap(
    op: &PipeOp,
    src: BorrowedFd<'_>,
    dst: BorrowedFd<'_>,
) -> Result<(), String> {
    let PipeOp::FileToFile {
        in_off,
        len,
        out_off,
    } = *op
    else {
        return Ok(());
    };
    let (Ok(a), Ok(b)) = (rustix::fs::fstat(src), rustix::fs::fstat(dst)) else {
        return Ok(());
    };
    if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
        && len > 0
        && in_off < out_off + len
        && out_off < in_off + len
    {
        return Err(format!(
            "source range {in_off}+{len} and sink range {out_off}+{len} overlap in the same file"
        ));
    }
    Ok(())
}

// ----- the engine handle (main loop side) -------------------------------------

/// A transfer handed to the engine.
pub(crate) struct JobSpec {
    pub id: u64,
    pub domain: DomainId,
    /// The domain's weight, used if the engine does not know the domain yet.
    pub weight: u32,
    pub src: Arc<OwnedFd>,
    pub dst: Arc<OwnedFd>,
    pub op: PipeOp,
}

/// A finished transfer.
pub(crate) struct Done {
    pub id: u64,
    pub result: PipeResult,
}

enum Cmd {
    Start(JobSpec),
    Cancel(u64),
    Weight(DomainId, u32),
    Forget(DomainId),
    Stop,
}

#[derive(Default, Clone)]
struct DomStat {
    weight: u32,
    credits: i64,
    bytes_per_s: u64,
    bytes_total: u64,
    running: u32,
}

#[derive(Default)]
struct Shared {
    stats: BTreeMap<DomainId, DomStat>,
    capacity: Option<u64>,
    calibrated: bool,
}

pub(crate) struct Engine {
    tx: mpsc::Sender<Cmd>,
    wake: Arc<OwnedFd>,
    done_rx: mpsc::Receiver<Done>,
    done_fd: Arc<OwnedFd>,
    shared: Arc<Mutex<Shared>>,
    cfg: PipeConfig,
    thread: Option<JoinHandle<()>>,
    /// Why there is no engine (io_uring unavailable): pipe requests are refused.
    unavailable: Option<String>,
}

fn eventfd() -> Result<OwnedFd, Errno> {
    rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    )
}

fn ring_bell(fd: &OwnedFd) {
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

impl Engine {
    pub(crate) fn start(cfg: PipeConfig) -> Result<Engine, crate::BrokerError> {
        let sys = |what| move |source| crate::BrokerError::Sys { what, source };
        let wake = Arc::new(eventfd().map_err(sys("eventfd"))?);
        let done_fd = Arc::new(eventfd().map_err(sys("eventfd"))?);
        let (tx, rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel();
        let shared = Arc::new(Mutex::new(Shared::default()));
        // Without a ring the engine answers every request with `why` (the rest
        // of the broker works without it).
        let ring = if !cfg.enabled {
            Err("the pipe engine is disabled on this broker (--pipe-disable)".to_string())
        } else {
            IoUring::new(512).map_err(|e| {
                // io_uring may be disabled by sysctl or a seccomp profile.
                let why =
                    format!("the pipe engine needs io_uring, which is unavailable here ({e})");
                tracing::warn!("{why}; pipe requests will be refused");
                why
            })
        };
        let ring = match ring {
            Ok(r) => r,
            Err(why) => {
                return Ok(Engine {
                    tx,
                    wake,
                    done_rx,
                    done_fd,
                    shared,
                    cfg,
                    thread: None,
                    unavailable: Some(why),
                });
            }
        };
        let mut core = Core {
            ring,
            wake_buf: Box::new([0u8; 8]),
            wake: wake.clone(),
            rx,
            done_tx,
            done_fd: done_fd.clone(),
            shared: shared.clone(),
            cfg: cfg.clone(),
            capacity: None,
            doms: HashMap::new(),
            jobs: HashMap::new(),
            lanes_used: 0,
            last_refill: Instant::now(),
            last_rate: Instant::now(),
            files: FileWorkers::new(wake.clone()),
            calibration_done: false,
        };
        let thread = std::thread::Builder::new()
            .name("fido-pipe".into())
            .spawn(move || core.run())
            .map_err(|e| crate::BrokerError::Io {
                path: "<pipe engine thread>".into(),
                source: e,
            })?;
        Ok(Engine {
            tx,
            wake,
            done_rx,
            done_fd,
            shared,
            cfg,
            thread: Some(thread),
            unavailable: None,
        })
    }

    /// Why the engine cannot run, if it cannot.
    pub(crate) fn unavailable(&self) -> Option<&str> {
        self.unavailable.as_deref()
    }

    fn cmd(&self, c: Cmd) {
        if self.tx.send(c).is_ok() {
            ring_bell(&self.wake);
        }
    }

    pub(crate) fn submit(&self, job: JobSpec) {
        self.cmd(Cmd::Start(job))
    }

    pub(crate) fn cancel(&self, job: u64) {
        self.cmd(Cmd::Cancel(job))
    }

    pub(crate) fn set_weight(&self, dom: DomainId, weight: u32) {
        self.cmd(Cmd::Weight(dom, weight))
    }

    /// The domain is gone: cancel its transfers and drop its figures.
    pub(crate) fn forget(&self, dom: DomainId) {
        self.cmd(Cmd::Forget(dom))
    }

    /// The eventfd that becomes readable when transfers finished.
    pub(crate) fn done_fd(&self) -> BorrowedFd<'_> {
        self.done_fd.as_fd()
    }

    /// Finished transfers since the last call.
    pub(crate) fn completions(&self) -> Vec<Done> {
        let mut b = [0u8; 8];
        let _ = rustix::io::read(self.done_fd.as_fd(), &mut b);
        self.done_rx.try_iter().collect()
    }

    pub(crate) fn status(&self) -> (PipeEngineStatus, Vec<PipeDomainStatus>) {
        let s = self.shared.lock();
        let engine = PipeEngineStatus {
            capacity: s.capacity,
            calibrated: s.calibrated,
            work_conserving: self.cfg.work_conserving,
            lanes: self.cfg.lanes,
        };
        let doms = s
            .stats
            .iter()
            .map(|(d, st)| PipeDomainStatus {
                domain: *d,
                weight: st.weight,
                credits: st.credits,
                bytes_per_s: st.bytes_per_s,
                bytes_total: st.bytes_total,
                pipes: 0,
                running: st.running,
            })
            .collect();
        (engine, doms)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.cmd(Cmd::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// ----- the engine thread -------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Waiting for the scheduler to start its next chunk.
    Queued,
    /// `splice(source → engine pipe)` in flight.
    Fill,
    /// `splice(engine pipe → sink)` in flight.
    Drain,
    /// Source returned EAGAIN: polling it.
    PollIn,
    /// Sink returned EAGAIN: polling it.
    PollOut,
}

struct Job {
    spec: JobSpec,
    pr: OwnedFd,
    pw: OwnedFd,
    chunk: u32,
    /// Offsets for file ends, -1 for streams.
    src_off: i64,
    dst_off: i64,
    to_read: u64,
    in_pipe: u64,
    moved: u64,
    consumed: u64,
    state: State,
    /// An SQE of this job is in the ring (its CQE not yet seen).
    inflight: bool,
    cancel: bool,
    /// When the cancel was asked (a splice that ignores it is given up on).
    cancel_at: Option<Instant>,
    /// The result was already reported (given up on); only its CQE is awaited.
    reported: bool,
    lane: bool,
    issued: Instant,
    eof: bool,
    failed: Option<(i32, String)>,
    /// file→file: chunks go to a file worker (`copy_file_range`) until the
    /// kernel says it cannot (then splice, like every other operation).
    copy_range: bool,
    /// A file worker holds a chunk of this job.
    in_worker: bool,
}

struct Dom {
    weight: u32,
    credits: f64,
    vtime: f64,
    queue: VecDeque<u64>,
    running: u32,
    bytes_total: u64,
    window: u64,
    rate: f64,
    gone: bool,
}

impl Dom {
    fn new(weight: u32) -> Dom {
        Dom {
            weight: weight.max(1),
            credits: 0.0,
            vtime: 0.0,
            queue: VecDeque::new(),
            running: 0,
            bytes_total: 0,
            window: 0,
            rate: 0.0,
            gone: false,
        }
    }
}

struct Core {
    // Field order matters: the ring is dropped (its requests cancelled) before
    // the buffer its wake-up read points into.
    ring: IoUring,
    wake_buf: Box<[u8; 8]>,
    wake: Arc<OwnedFd>,
    rx: mpsc::Receiver<Cmd>,
    done_tx: mpsc::Sender<Done>,
    done_fd: Arc<OwnedFd>,
    shared: Arc<Mutex<Shared>>,
    cfg: PipeConfig,
    capacity: Option<u64>,
    doms: HashMap<DomainId, Dom>,
    jobs: HashMap<u64, Job>,
    lanes_used: u32,
    last_refill: Instant,
    last_rate: Instant,
    files: FileWorkers,
    calibration_done: bool,
}

fn ud(job: u64, tag: u64) -> u64 {
    (job << 2) | tag
}

impl Core {
    /// Measures the capacity (`auto`) the first time there is work, so a
    /// broker whose domains never use pipes never pays for it.
    fn ensure_capacity(&mut self) {
        if self.cfg.capacity != Capacity::Auto || self.calibration_done {
            return;
        }
        self.calibration_done = true;
        match calibrate(self.cfg.chunk) {
            Ok(n) => {
                tracing::info!(bytes_per_s = n, "pipe engine calibrated");
                self.capacity = Some(n);
                let mut sh = self.shared.lock();
                sh.calibrated = true;
                sh.capacity = Some(n);
            }
            Err(e) => {
                tracing::warn!(error = %e, "pipe engine calibration failed; capacity unlimited")
            }
        }
    }

    fn run(&mut self) {
        self.capacity = match self.cfg.capacity {
            Capacity::Unlimited | Capacity::Auto => None,
            Capacity::BytesPerSec(n) => Some(n),
        };
        self.shared.lock().capacity = self.capacity;
        self.arm_wake();
        loop {
            loop {
                match self.rx.try_recv() {
                    Ok(Cmd::Stop) | Err(mpsc::TryRecvError::Disconnected) => {
                        self.stop();
                        return;
                    }
                    Ok(c) => self.command(c),
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            for (id, res) in self.files.results() {
                self.file_done(id, res);
            }
            let now = Instant::now();
            self.refill(now);
            self.release_slow(now);
            self.dispatch();
            self.publish(now);
            // Idle: nothing to refill or time out, sleep until a command comes.
            let wait = if self.jobs.is_empty() {
                Duration::from_secs(1)
            } else {
                TICK
            };
            let ts = types::Timespec::from(wait);
            let args = types::SubmitArgs::new().timespec(&ts);
            match self.ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)
                    ) => {}
                Err(e) => {
                    tracing::error!(error = %e, "io_uring_enter failed in the pipe engine");
                    std::thread::sleep(TICK);
                }
            }
            let cqes: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (data, res) in cqes {
                if data == WAKE {
                    self.arm_wake();
                    continue;
                }
                let (job, tag) = (data >> 2, data & 3);
                match tag {
                    TAG_CANCEL => {}
                    TAG_SPLICE | TAG_POLL => self.completed(job, tag, res),
                    _ => {}
                }
            }
        }
    }

    fn push(&mut self, sqe: io_uring::squeue::Entry) {
        loop {
            // SAFETY: every entry we build references only descriptors kept
            // open by the job (or engine) until its completion is reaped, and,
            // for the wake-up read, `wake_buf`, which lives as long as the ring.
            if unsafe { self.ring.submission().push(&sqe) }.is_ok() {
                return;
            }
            if let Err(e) = self.ring.submit() {
                tracing::warn!(error = %e, "io_uring submit failed while the queue was full");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    fn arm_wake(&mut self) {
        let sqe = opcode::Read::new(
            types::Fd(self.wake.as_raw_fd()),
            self.wake_buf.as_mut_ptr(),
            8,
        )
        .build()
        .user_data(WAKE);
        self.push(sqe);
    }

    fn command(&mut self, c: Cmd) {
        match c {
            Cmd::Start(spec) => self.start(spec),
            Cmd::Cancel(id) => self.cancel(id),
            Cmd::Weight(dom, w) => {
                // A domain the engine has not seen yet brings its weight with
                // its first transfer (JobSpec::weight).
                if let Some(d) = self.doms.get_mut(&dom) {
                    d.weight = w.max(1);
                }
            }
            Cmd::Forget(dom) => {
                let ids: Vec<u64> = self
                    .jobs
                    .iter()
                    .filter(|(_, j)| j.spec.domain == dom)
                    .map(|(i, _)| *i)
                    .collect();
                for id in ids {
                    self.cancel(id);
                }
                if let Some(d) = self.doms.get_mut(&dom) {
                    d.gone = true;
                }
                self.gc(dom);
            }
            Cmd::Stop => {}
        }
    }

    fn start(&mut self, spec: JobSpec) {
        self.ensure_capacity();
        let (pr, pw) = match rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC) {
            Ok(p) => p,
            Err(e) => {
                let result = PipeResult {
                    moved: 0,
                    consumed: 0,
                    end: PipeEnd::Failed {
                        errno: e.raw_os_error(),
                        message: format!("engine pipe: {e}"),
                    },
                };
                let _ = self.done_tx.send(Done {
                    id: spec.id,
                    result,
                });
                ring_bell(&self.done_fd);
                return;
            }
        };
        // A bigger pipe moves a bigger chunk per splice; if the per-user pipe
        // budget is spent the kernel refuses and we keep the default size.
        let want = self.cfg.chunk.max(4096) as usize;
        let chunk = match rustix::pipe::fcntl_setpipe_size(&pw, want) {
            Ok(n) => n,
            Err(_) => rustix::pipe::fcntl_getpipe_size(&pw).unwrap_or(65536),
        } as u32;
        let (src_off, dst_off) = match spec.op {
            PipeOp::FileToSocket { off, .. } => (off as i64, -1),
            PipeOp::SocketToSocket { .. } => (-1, -1),
            PipeOp::SocketToFile { off, .. } => (-1, off as i64),
            PipeOp::FileToFile {
                in_off, out_off, ..
            } => (in_off as i64, out_off as i64),
        };
        let id = spec.id;
        let spec_op = spec.op;
        let dom_id = spec.domain;
        let weight = spec.weight;
        let job = Job {
            to_read: spec.op.len(),
            spec,
            pr,
            pw,
            chunk,
            src_off,
            dst_off,
            in_pipe: 0,
            moved: 0,
            consumed: 0,
            state: State::Queued,
            inflight: false,
            cancel: false,
            cancel_at: None,
            reported: false,
            lane: false,
            issued: Instant::now(),
            eof: false,
            failed: None,
            copy_range: matches!(spec_op, PipeOp::FileToFile { .. }),
            in_worker: false,
        };
        self.jobs.insert(id, job);
        // A domain that becomes busy starts at the current virtual time: idling banks nothing.
        let min_v = self
            .doms
            .values()
            .filter(|d| d.running > 0)
            .map(|d| d.vtime)
            .fold(f64::INFINITY, f64::min);
        let d = self.doms.entry(dom_id).or_insert_with(|| Dom::new(weight));
        if d.running == 0 && min_v.is_finite() {
            d.vtime = d.vtime.max(min_v);
        }
        d.gone = false;
        d.running += 1;
        d.queue.push_back(id);
    }

    fn cancel(&mut self, id: u64) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        if j.cancel {
            return;
        }
        j.cancel = true;
        j.cancel_at = Some(Instant::now());
        if j.in_worker {
            // A copy_file_range call cannot be interrupted; report now and
            // ignore its result (the worker keeps the descriptors until it returns).
            j.in_worker = false;
            self.finish(id);
        } else if j.inflight {
            let tag = if matches!(j.state, State::PollIn | State::PollOut) {
                TAG_POLL
            } else {
                TAG_SPLICE
            };
            let sqe = opcode::AsyncCancel::new(ud(id, tag))
                .build()
                .user_data(ud(id, TAG_CANCEL));
            self.push(sqe);
        } else {
            self.finish(id);
        }
    }

    /// Credits flow from the capacity to busy domains by weight.
    fn refill(&mut self, now: Instant) {
        let dt = now.duration_since(self.last_refill).as_secs_f64();
        if dt < TICK.as_secs_f64() / 2.0 {
            return;
        }
        self.last_refill = now;
        let Some(cap) = self.capacity else { return };
        // Busy: a chunk waits for dispatch or moves in a lane. A transfer
        // waiting on a stalled descriptor (polling, or slow past SLOW) is not
        // busy: its share goes to those that can use it.
        let moving: std::collections::HashSet<DomainId> = self
            .jobs
            .values()
            .filter(|j| j.lane)
            .map(|j| j.spec.domain)
            .collect();
        let busy = |id: &DomainId, d: &Dom| !d.queue.is_empty() || moving.contains(id);
        let sum: f64 = self
            .doms
            .iter()
            .filter(|(id, d)| busy(id, d))
            .map(|(_, d)| d.weight as f64)
            .sum();
        if sum == 0.0 {
            return;
        }
        let chunk = self.cfg.chunk as f64;
        for (id, d) in self.doms.iter_mut() {
            let share = cap as f64 * d.weight as f64 / sum;
            // At most ~20 ms of share (or one chunk) banked: bursts stay short.
            let ceiling = (share * 0.02).max(chunk);
            if !d.queue.is_empty() || moving.contains(id) {
                d.credits = (d.credits + share * dt).min(ceiling);
            } else {
                d.credits = d.credits.min(ceiling);
            }
        }
    }

    fn release_slow(&mut self, now: Instant) {
        let mut give_up = Vec::new();
        for (id, j) in self.jobs.iter_mut() {
            if j.lane && now.duration_since(j.issued) > SLOW {
                j.lane = false;
                self.lanes_used -= 1;
            }
            if !j.reported
                && j.inflight
                && j.cancel_at
                    .is_some_and(|t| now.duration_since(t) > CANCEL_GRACE)
            {
                give_up.push(*id);
            }
        }
        for id in give_up {
            self.give_up(id);
        }
    }

    /// A cancelled splice that did not return within [`CANCEL_GRACE`]: report
    /// the transfer cancelled now, so its client is not held; the job stays
    /// (its descriptors open) until the kernel finally completes the request.
    fn give_up(&mut self, id: u64) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        j.reported = true;
        let result = PipeResult {
            moved: j.moved,
            consumed: j.consumed,
            end: PipeEnd::Cancelled,
        };
        let dom = j.spec.domain;
        tracing::warn!(
            job = id,
            domain = dom,
            "a cancelled splice did not return; reported cancelled, still waiting for the kernel"
        );
        let _ = self.done_tx.send(Done { id, result });
        ring_bell(&self.done_fd);
    }

    fn pick(&self) -> Option<DomainId> {
        let capped = self.capacity.is_some();
        let best = |need_credit: bool| {
            self.doms
                .iter()
                .filter(|(_, d)| !d.queue.is_empty() && (!need_credit || d.credits > 0.0))
                .min_by(|a, b| a.1.vtime.total_cmp(&b.1.vtime).then(a.0.cmp(b.0)))
                .map(|(id, _)| *id)
        };
        if !capped {
            return best(false);
        }
        best(true).or_else(|| {
            if self.cfg.work_conserving {
                best(false)
            } else {
                None
            }
        })
    }

    fn dispatch(&mut self) {
        while self.lanes_used < self.cfg.lanes.max(1) {
            let Some(dom) = self.pick() else { return };
            let Some(id) = self.doms.get_mut(&dom).and_then(|d| d.queue.pop_front()) else {
                return;
            };
            let Some(j) = self.jobs.get_mut(&id) else {
                continue;
            };
            if j.cancel {
                self.finish(id);
                continue;
            }
            j.lane = true;
            self.lanes_used += 1;
            self.issue_fill(id);
        }
    }

    fn issue_fill(&mut self, id: u64) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        if j.to_read == 0 || j.eof {
            self.drop_lane(id);
            self.finish(id);
            return;
        }
        if j.copy_range {
            let len = j.to_read.min(j.chunk as u64) as usize;
            j.state = State::Fill;
            j.in_worker = true;
            j.issued = Instant::now();
            let chunk = FileChunk {
                job: id,
                src: j.spec.src.clone(),
                dst: j.spec.dst.clone(),
                in_off: j.src_off as u64,
                out_off: j.dst_off as u64,
                len,
            };
            self.files.submit(chunk);
            return;
        }
        let len = j.to_read.min(j.chunk as u64) as u32;
        let sqe = opcode::Splice::new(
            types::Fd(j.spec.src.as_raw_fd()),
            j.src_off,
            types::Fd(j.pw.as_raw_fd()),
            -1,
            len,
        )
        .build()
        .user_data(ud(id, TAG_SPLICE));
        j.state = State::Fill;
        j.inflight = true;
        j.issued = Instant::now();
        self.push(sqe);
    }

    fn issue_drain(&mut self, id: u64) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        let len = j.in_pipe.min(u32::MAX as u64) as u32;
        let sqe = opcode::Splice::new(
            types::Fd(j.pr.as_raw_fd()),
            -1,
            types::Fd(j.spec.dst.as_raw_fd()),
            j.dst_off,
            len,
        )
        .build()
        .user_data(ud(id, TAG_SPLICE));
        j.state = State::Drain;
        j.inflight = true;
        self.push(sqe);
    }

    fn issue_poll(&mut self, id: u64, out: bool) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        let (fd, mask, st) = if out {
            (j.spec.dst.as_raw_fd(), libc::POLLOUT, State::PollOut)
        } else {
            (j.spec.src.as_raw_fd(), libc::POLLIN, State::PollIn)
        };
        let sqe = opcode::PollAdd::new(types::Fd(fd), mask as u32)
            .build()
            .user_data(ud(id, TAG_POLL));
        j.state = st;
        j.inflight = true;
        self.push(sqe);
    }

    fn drop_lane(&mut self, id: u64) {
        if let Some(j) = self.jobs.get_mut(&id) {
            if j.lane {
                j.lane = false;
                self.lanes_used -= 1;
            }
        }
    }

    /// A file worker finished a `copy_file_range` chunk.
    fn file_done(&mut self, id: u64, res: Result<usize, Errno>) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        j.in_worker = false;
        let dom = j.spec.domain;
        match res {
            Ok(0) => j.eof = true,
            Ok(n) => {
                let n = n as u64;
                j.moved += n;
                j.consumed += n;
                j.to_read -= n;
                j.src_off += n as i64;
                j.dst_off += n as i64;
                self.charge(dom, n);
            }
            // Not possible between these two files (another filesystem on an
            // old kernel, overlapping ranges of one file, a special
            // filesystem): the rest goes through a pipe.
            Err(e) if [Errno::XDEV, Errno::INVAL, Errno::OPNOTSUPP, Errno::NOSYS].contains(&e) => {
                j.copy_range = false;
            }
            Err(e) => j.failed = Some((e.raw_os_error(), format!("copy_file_range: {e}"))),
        }
        self.drop_lane(id);
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        if j.cancel || j.eof || j.failed.is_some() || j.to_read == 0 {
            return self.finish(id);
        }
        j.state = State::Queued;
        if let Some(d) = self.doms.get_mut(&dom) {
            d.queue.push_back(id);
        }
    }

    fn charge(&mut self, dom: DomainId, bytes: u64) {
        if let Some(d) = self.doms.get_mut(&dom) {
            d.credits -= bytes as f64;
            d.vtime += bytes as f64 / d.weight as f64;
            d.bytes_total += bytes;
            d.window += bytes;
        }
    }

    fn completed(&mut self, id: u64, tag: u64, res: i32) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        j.inflight = false;
        let dom = j.spec.domain;
        let cancelled = j.cancel;
        if tag == TAG_POLL {
            if cancelled {
                return self.finish(id);
            }
            if res < 0 {
                let side = if j.state == State::PollIn {
                    "source"
                } else {
                    "sink"
                };
                j.failed = Some((
                    -res,
                    format!("{side}: poll: {}", Errno::from_raw_os_error(-res)),
                ));
                self.drop_lane(id);
                return self.finish(id);
            }
            if j.state == State::PollOut {
                return self.issue_drain(id);
            }
            // Source readable again: back to the scheduler for its next chunk.
            j.state = State::Queued;
            if let Some(d) = self.doms.get_mut(&dom) {
                d.queue.push_back(id);
            }
            return;
        }
        match j.state {
            State::Fill => {
                if res > 0 {
                    let n = res as u64;
                    j.consumed += n;
                    j.to_read -= n;
                    j.in_pipe = n;
                    if j.src_off >= 0 {
                        j.src_off += n as i64;
                    }
                    if cancelled {
                        self.drop_lane(id);
                        return self.finish(id);
                    }
                    self.issue_drain(id);
                } else if res == 0 {
                    j.eof = true;
                    self.drop_lane(id);
                    self.finish(id);
                } else if cancelled {
                    self.drop_lane(id);
                    self.finish(id);
                } else if res == -libc::EAGAIN {
                    self.drop_lane(id);
                    self.issue_poll(id, false);
                } else {
                    j.failed = Some((-res, format!("source: {}", Errno::from_raw_os_error(-res))));
                    self.drop_lane(id);
                    self.finish(id);
                }
            }
            State::Drain => {
                if res > 0 {
                    let n = res as u64;
                    j.moved += n;
                    j.in_pipe -= n;
                    if j.dst_off >= 0 {
                        j.dst_off += n as i64;
                    }
                    let more = j.in_pipe > 0;
                    let done = j.to_read == 0;
                    self.charge(dom, n);
                    if cancelled {
                        self.drop_lane(id);
                        return self.finish(id);
                    }
                    if more {
                        return self.issue_drain(id);
                    }
                    self.drop_lane(id);
                    if done {
                        return self.finish(id);
                    }
                    if let Some(j) = self.jobs.get_mut(&id) {
                        j.state = State::Queued;
                    }
                    if let Some(d) = self.doms.get_mut(&dom) {
                        d.queue.push_back(id);
                    }
                } else if cancelled {
                    self.drop_lane(id);
                    self.finish(id);
                } else if res == -libc::EAGAIN {
                    self.drop_lane(id);
                    self.issue_poll(id, true);
                } else {
                    let (errno, what) = if res == 0 {
                        (libc::EPIPE, "sink accepted no bytes".to_string())
                    } else {
                        (-res, Errno::from_raw_os_error(-res).to_string())
                    };
                    j.failed = Some((errno, format!("sink: {what}")));
                    self.drop_lane(id);
                    self.finish(id);
                }
            }
            _ => {}
        }
    }

    /// Reports the job and forgets it. Only called with no SQE of it in flight.
    fn finish(&mut self, id: u64) {
        let Some(j) = self.jobs.get(&id) else { return };
        if j.inflight {
            return;
        }
        let mut j = self.jobs.remove(&id).expect("present");
        if j.lane {
            j.lane = false;
            self.lanes_used -= 1;
        }
        let end = if let Some((errno, message)) = j.failed.take() {
            PipeEnd::Failed { errno, message }
        } else if j.cancel && !(j.to_read == 0 && j.in_pipe == 0) && !j.eof {
            PipeEnd::Cancelled
        } else if j.eof {
            PipeEnd::Eof
        } else {
            PipeEnd::Done
        };
        let dom = j.spec.domain;
        if let Some(d) = self.doms.get_mut(&dom) {
            d.running = d.running.saturating_sub(1);
            d.queue.retain(|q| *q != id);
        }
        if !j.reported {
            let result = PipeResult {
                moved: j.moved,
                consumed: j.consumed,
                end,
            };
            let _ = self.done_tx.send(Done { id, result });
            ring_bell(&self.done_fd);
        }
        self.gc(dom);
    }

    fn gc(&mut self, dom: DomainId) {
        if self
            .doms
            .get(&dom)
            .is_some_and(|d| d.gone && d.running == 0)
        {
            self.doms.remove(&dom);
            self.shared.lock().stats.remove(&dom);
        }
    }

    fn publish(&mut self, now: Instant) {
        let dt = now.duration_since(self.last_rate).as_secs_f64();
        if dt < 0.25 {
            return;
        }
        self.last_rate = now;
        let mut s = self.shared.lock();
        s.stats.clear();
        for (id, d) in self.doms.iter_mut() {
            let inst = d.window as f64 / dt;
            d.window = 0;
            // ~1 s exponential average.
            d.rate = d.rate * 0.75 + inst * 0.25;
            if d.gone {
                continue;
            }
            s.stats.insert(
                *id,
                DomStat {
                    weight: d.weight,
                    credits: d.credits as i64,
                    bytes_per_s: d.rate as u64,
                    bytes_total: d.bytes_total,
                    running: d.running,
                },
            );
        }
    }

    fn stop(&mut self) {
        let ids: Vec<u64> = self.jobs.keys().copied().collect();
        for id in ids {
            self.cancel(id);
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while self.jobs.values().any(|j| j.inflight) && Instant::now() < deadline {
            let ts = types::Timespec::from(TICK);
            let args = types::SubmitArgs::new().timespec(&ts);
            let _ = self.ring.submitter().submit_with_args(1, &args);
            let cqes: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (data, res) in cqes {
                if data != WAKE && data & 3 != TAG_CANCEL {
                    self.completed(data >> 2, data & 3, res);
                }
            }
        }
        for j in self.jobs.values_mut() {
            j.inflight = false;
        }
        let ids: Vec<u64> = self.jobs.keys().copied().collect();
        for id in ids {
            self.finish(id);
        }
    }
}

/// Measures how fast one lane moves a file to a socket: splice from a 16 MiB
/// memfd through a pipe into a Unix stream socket drained by a helper thread.
fn calibrate(chunk: u32) -> Result<u64, Errno> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let mfd = rustix::fs::memfd_create("fido-pipe-calibrate", rustix::fs::MemfdFlags::CLOEXEC)?;
    let size: usize = 16 << 20;
    let block = vec![0x5au8; 1 << 20];
    for i in 0..(size >> 20) {
        rustix::io::pwrite(&mfd, &block, (i << 20) as u64)?;
    }
    let (a, b) = rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let drain = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 20];
        while matches!(rustix::io::read(&b, &mut buf), Ok(n) if n > 0) {}
    });
    let (pr, pw) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    let _ = rustix::pipe::fcntl_setpipe_size(&pw, chunk as usize);
    let start = Instant::now();
    let mut moved = 0u64;
    let mut off = 0u64;
    let res = (|| {
        while start.elapsed() < CALIBRATION {
            let mut o = off;
            let n = rustix::pipe::splice(
                &mfd,
                Some(&mut o),
                &pw,
                None,
                chunk as usize,
                rustix::pipe::SpliceFlags::empty(),
            )?;
            off = if o as usize >= size { 0 } else { o };
            let mut left = n;
            while left > 0 {
                let m = rustix::pipe::splice(
                    &pr,
                    None,
                    &a,
                    None,
                    left,
                    rustix::pipe::SpliceFlags::empty(),
                )?;
                left -= m;
                moved += m as u64;
            }
        }
        Ok::<(), Errno>(())
    })();
    drop(a);
    let _ = drain.join();
    res?;
    let secs = start.elapsed().as_secs_f64().max(1e-6);
    Ok(((moved as f64 / secs) as u64).max(1 << 20))
}

// ----- file workers: copy_file_range, off the engine thread --------------------

/// One `copy_file_range` chunk for a file worker.
struct FileChunk {
    job: u64,
    src: Arc<OwnedFd>,
    dst: Arc<OwnedFd>,
    in_off: u64,
    out_off: u64,
    len: usize,
}

/// Threads that run `copy_file_range` (which io_uring cannot issue). One more
/// is started whenever every existing one is busy, up to [`MAX_FILE_WORKERS`],
/// so a chunk stuck on a hung filesystem holds one thread, not the others.
struct FileWorkers {
    tx: mpsc::Sender<FileChunk>,
    rx: Arc<std::sync::Mutex<mpsc::Receiver<FileChunk>>>,
    done_tx: mpsc::Sender<(u64, Result<usize, Errno>)>,
    done_rx: mpsc::Receiver<(u64, Result<usize, Errno>)>,
    wake: Arc<OwnedFd>,
    idle: Arc<std::sync::atomic::AtomicUsize>,
    threads: usize,
}

const MAX_FILE_WORKERS: usize = 16;

impl FileWorkers {
    fn new(wake: Arc<OwnedFd>) -> FileWorkers {
        let (tx, rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel();
        FileWorkers {
            tx,
            rx: Arc::new(std::sync::Mutex::new(rx)),
            done_tx,
            done_rx,
            wake,
            idle: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            threads: 0,
        }
    }

    fn submit(&mut self, chunk: FileChunk) {
        use std::sync::atomic::Ordering;
        if self.idle.load(Ordering::Acquire) == 0 && self.threads < MAX_FILE_WORKERS {
            let (rx, done, wake, idle) = (
                self.rx.clone(),
                self.done_tx.clone(),
                self.wake.clone(),
                self.idle.clone(),
            );
            let spawned = std::thread::Builder::new()
                .name("fido-pipe-file".into())
                .spawn(move || loop {
                    idle.fetch_add(1, Ordering::AcqRel);
                    let next = rx.lock().map(|r| r.recv());
                    idle.fetch_sub(1, Ordering::AcqRel);
                    let Ok(Ok(c)) = next else { return };
                    let (mut i, mut o) = (c.in_off, c.out_off);
                    let r = loop {
                        match rustix::fs::copy_file_range(
                            &*c.src,
                            Some(&mut i),
                            &*c.dst,
                            Some(&mut o),
                            c.len,
                        ) {
                            Err(Errno::INTR) => continue,
                            r => break r,
                        }
                    };
                    drop(c.src);
                    drop(c.dst);
                    if done.send((c.job, r)).is_err() {
                        return;
                    }
                    ring_bell(&wake);
                });
            if spawned.is_ok() {
                self.threads += 1;
            }
        }
        let _ = self.tx.send(chunk);
    }

    fn results(&self) -> Vec<(u64, Result<usize, Errno>)> {
        self.done_rx.try_iter().collect()
    }
}
