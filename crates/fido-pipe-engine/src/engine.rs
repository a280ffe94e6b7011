//! The engine: one thread, one io_uring, every transfer a small state
//! machine moving a chunk at a time; the broker's main loop talks to it
//! through [`Engine`].

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fido_proto::{DomainId, PipeDomainStatus, PipeEnd, PipeEngineStatus, PipeOp, PipeResult};
use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;
use rustix::io::Errno;

use crate::calibrate::calibrate;
use crate::caller::Caller;
use crate::files::{Copied, FileChunk, FileWorkers};
use crate::sched::{self, Scheduler};
use crate::{Capacity, PipeConfig};

/// A chunk in flight longer than this no longer occupies a lane.
pub const SLOW: Duration = Duration::from_millis(20);
/// How often the engine wakes while it has work (credits are refilled, slow
/// chunks released, rates sampled).
const TICK: Duration = sched::REFILL_PERIOD;
/// How long a cancelled splice may take to return before the transfer is
/// reported cancelled anyway.
const CANCEL_GRACE: Duration = Duration::from_secs(2);
/// The most a splice on a stream may wait inside the kernel. The engine only
/// issues one after a poll said the stream is ready, but readiness can be
/// taken back (the application reads the bytes first) or be partial (a
/// socket with room for less than the chunk): then the splice would park
/// an io_uring worker until the peer moves. A linked timeout interrupts it;
/// the bytes it moved count, and the transfer polls again.
const STREAM_SPLICE_LIMIT: Duration = Duration::from_millis(50);
/// Most io_uring workers the engine's ring may use: for regular files
/// ("bounded" work) and for streams ("unbounded"). Without a cap the kernel
/// starts one per blocked request, up to the broker's RLIMIT_NPROC, which
/// for root is no limit at all. Requests beyond the cap wait in the kernel's
/// queue; none blocks on a stream that is not ready (poll first, non-blocking
/// splices, [`STREAM_SPLICE_LIMIT`]), so the cap delays, never starves.
pub const IOWQ_MAX_WORKERS: [u32; 2] = [16, 32];
/// Splices of one caller (uid) in the kernel at once. Some waits cannot be
/// interrupted (a read from a FUSE file whose daemon never answers holds its
/// worker until the daemon does): this many is all one uid can hold, so the
/// workers ([`IOWQ_MAX_WORKERS`]) stay for the others. A caller's further
/// splices wait in the engine until one of its own returns.
pub const MAX_SPLICES_PER_CALLER: usize = 4;
/// Callers (credentials) whose io_uring personality the engine keeps
/// registered; beyond it, those with no transfer running are dropped.
const MAX_PERSONALITIES: usize = 256;

/// User data of a stream splice's linked timeout (its completion is ignored).
const TAG_TIMEOUT: u64 = 0;
const TAG_SPLICE: u64 = 1;
const TAG_POLL: u64 = 2;
const TAG_CANCEL: u64 = 3;
const WAKE: u64 = u64::MAX;

// ----- the engine handle (main loop side) -------------------------------------

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{what}: {source}")]
    Sys {
        what: &'static str,
        #[source]
        source: Errno,
    },
    #[error("starting the pipe engine thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// A transfer handed to the engine.
pub struct JobSpec {
    pub id: u64,
    pub domain: DomainId,
    /// The domain's weight, used if the engine does not know the domain yet.
    pub weight: u32,
    pub src: Arc<OwnedFd>,
    pub dst: Arc<OwnedFd>,
    pub op: PipeOp,
    /// Whom the transfer is for: it reads and writes with these credentials.
    pub caller: Caller,
    /// The caller's `RLIMIT_FSIZE` (soft), when the sink is a file: nothing
    /// is written at or past this offset; a transfer that would is cut there
    /// and fails with `EFBIG`, as the caller's own write would.
    pub fsize_limit: Option<u64>,
}

/// A finished transfer.
pub struct Done {
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

/// The broker's handle on the engine thread: commands in, finished
/// transfers out (signalled on [`done_fd`](Engine::done_fd)). Dropping it
/// cancels every transfer and joins the thread.
pub struct Engine {
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

pub(crate) fn ring_bell(fd: &OwnedFd) {
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

impl Engine {
    /// Starts the engine thread; without io_uring (or with the engine
    /// disabled) an engine that refuses every transfer, see [`unavailable`](Engine::unavailable).
    pub fn start(cfg: PipeConfig) -> Result<Engine, StartError> {
        let sys = |what| move |source| StartError::Sys { what, source };
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
            Ok(r) => {
                let mut max = IOWQ_MAX_WORKERS;
                if let Err(e) = r.submitter().register_iowq_max_workers(&mut max) {
                    tracing::warn!(error = %e, "cannot cap the pipe engine's io_uring workers");
                }
                r
            }
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
        let capacity = match cfg.capacity {
            Capacity::Unlimited | Capacity::Auto => None,
            Capacity::BytesPerSec(n) => Some(n),
        };
        shared.lock().capacity = capacity;
        let sched = Scheduler::new(
            capacity,
            cfg.work_conserving,
            cfg.lanes,
            cfg.chunk,
            Instant::now(),
        );
        let mut core = Core {
            ring,
            wake_buf: Box::new([0u8; 8]),
            wake: wake.clone(),
            rx,
            done_tx,
            done_fd: done_fd.clone(),
            shared: shared.clone(),
            cfg: cfg.clone(),
            sched,
            jobs: HashMap::new(),
            files: FileWorkers::new(wake.clone()),
            calibration_done: false,
            personalities: HashMap::new(),
            stream_limit: Box::new(types::Timespec::from(STREAM_SPLICE_LIMIT)),
            splicing: HashMap::new(),
            deferred: HashMap::new(),
        };
        let thread = std::thread::Builder::new()
            .name("fido-pipe".into())
            .spawn(move || core.run())
            .map_err(StartError::Thread)?;
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
    pub fn unavailable(&self) -> Option<&str> {
        self.unavailable.as_deref()
    }

    fn cmd(&self, c: Cmd) {
        if self.tx.send(c).is_ok() {
            ring_bell(&self.wake);
        }
    }

    pub fn submit(&self, job: JobSpec) {
        self.cmd(Cmd::Start(job))
    }

    pub fn cancel(&self, job: u64) {
        self.cmd(Cmd::Cancel(job))
    }

    pub fn set_weight(&self, dom: DomainId, weight: u32) {
        self.cmd(Cmd::Weight(dom, weight))
    }

    /// The domain is gone: cancel its transfers and drop its figures.
    pub fn forget(&self, dom: DomainId) {
        self.cmd(Cmd::Forget(dom))
    }

    /// The eventfd that becomes readable when transfers finished.
    pub fn done_fd(&self) -> BorrowedFd<'_> {
        self.done_fd.as_fd()
    }

    /// Finished transfers since the last call.
    pub fn completions(&self) -> Vec<Done> {
        let mut b = [0u8; 8];
        let _ = rustix::io::read(self.done_fd.as_fd(), &mut b);
        self.done_rx.try_iter().collect()
    }

    pub fn status(&self) -> (PipeEngineStatus, Vec<PipeDomainStatus>) {
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

/// How a transfer the caller's file size limit cut short ends: `EFBIG` as
/// the caller's own write there would, unless a file source had nothing
/// more to give (then it simply reached the source's end).
fn cut_at_limit(j: &Job, limit: u64) -> PipeEnd {
    let source_done =
        !j.src_stream && rustix::fs::fstat(&*j.spec.src).is_ok_and(|st| j.src_off >= st.st_size);
    if source_done {
        return PipeEnd::Eof;
    }
    PipeEnd::Failed {
        errno: libc::EFBIG,
        message: format!(
            "sink: {} (the caller's RLIMIT_FSIZE is {limit} bytes)",
            Errno::FBIG
        ),
    }
}

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
    /// The caller's io_uring personality (its credentials), set on every
    /// splice; `None` where the engine need not act as someone else.
    personality: Option<u16>,
    /// Whom the file workers act as for this job (`None`: as the broker).
    file_caller: Option<Caller>,
    /// Source / sink is a stream (socket or pipe): polled before each splice.
    src_stream: bool,
    dst_stream: bool,
    /// A poll said the stream is ready, and no splice ran on it since.
    src_ready: bool,
    dst_ready: bool,
    /// The caller's file size limit cut this transfer short (the limit).
    fsize_cut: Option<u64>,
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
    /// Which domain's chunk goes next (pure: fed the time by this thread).
    sched: Scheduler,
    jobs: HashMap<u64, Job>,
    files: FileWorkers,
    calibration_done: bool,
    /// The io_uring personality registered for each caller acted as.
    personalities: HashMap<Caller, u16>,
    /// [`STREAM_SPLICE_LIMIT`] for the linked timeouts (read by the kernel
    /// when they are submitted, so it lives as long as the ring).
    stream_limit: Box<types::Timespec>,
    /// Splices in the kernel per caller uid ([`MAX_SPLICES_PER_CALLER`]).
    splicing: HashMap<u32, usize>,
    /// Per caller uid, the jobs whose next splice waits for one of the
    /// caller's own to return (true: a drain, false: a fill).
    deferred: HashMap<u32, std::collections::VecDeque<(u64, bool)>>,
}

fn ud(job: u64, tag: u64) -> u64 {
    (job << 2) | tag
}

/// Splices on a stream never wait for it inside the kernel where the kernel
/// lets us say so (pipes, Unix sockets); TCP ignores the flag, hence the
/// poll before and the linked timeout.
fn splice_flags(stream: bool) -> u32 {
    if stream {
        libc::SPLICE_F_NONBLOCK
    } else {
        0
    }
}

fn with_personality(
    sqe: io_uring::squeue::Entry,
    personality: Option<u16>,
) -> io_uring::squeue::Entry {
    match personality {
        Some(p) => sqe.personality(p),
        None => sqe,
    }
}

/// A splice that returned without moving anything because it was
/// interrupted (its linked timeout) or would have had to wait: the
/// transfer polls and tries again. `ERESTART*` are the kernel's internal
/// "interrupted" codes, which a splice in an io_uring worker can return as is.
fn not_ready(res: i32) -> bool {
    const ERESTARTSYS: i32 = 512;
    const ERESTARTNOINTR: i32 = 513;
    const ERESTARTNOHAND: i32 = 514;
    matches!(
        -res,
        libc::EAGAIN
            | libc::EINTR
            | libc::ECANCELED
            | ERESTARTSYS
            | ERESTARTNOINTR
            | ERESTARTNOHAND
    )
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
                self.sched.set_capacity(Some(n));
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
            self.sched.refill(now);
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
                    TAG_SPLICE | TAG_POLL => self.completed(job, tag, res),
                    // TAG_CANCEL, TAG_TIMEOUT: the request they aimed at reports.
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
            // A domain the engine has not seen yet brings its weight with
            // its first transfer (JobSpec::weight).
            Cmd::Weight(dom, w) => self.sched.set_weight(dom, w),
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
                if self.sched.forget(dom) {
                    self.shared.lock().stats.remove(&dom);
                }
            }
            Cmd::Stop => {}
        }
    }

    /// Reports a transfer that failed before it started.
    fn refuse(&self, id: u64, errno: i32, message: String) {
        let result = PipeResult {
            moved: 0,
            consumed: 0,
            end: PipeEnd::Failed { errno, message },
        };
        let _ = self.done_tx.send(Done { id, result });
        ring_bell(&self.done_fd);
    }

    /// The io_uring personality that carries `caller`'s credentials,
    /// registered by a short-lived thread that became the caller (a
    /// personality is the registering thread's credentials). `None`: the
    /// engine need not act as someone else for this caller.
    fn personality_for(&mut self, caller: &Caller) -> Result<Option<u16>, std::io::Error> {
        if !caller.needs_own_credentials() {
            return Ok(None);
        }
        if let Some(id) = self.personalities.get(caller) {
            return Ok(Some(*id));
        }
        if self.personalities.len() >= MAX_PERSONALITIES {
            let in_use: std::collections::HashSet<u16> =
                self.jobs.values().filter_map(|j| j.personality).collect();
            let ring = &self.ring;
            self.personalities.retain(|_, id| {
                in_use.contains(id) || ring.submitter().unregister_personality(*id).is_err()
            });
        }
        let ring = &self.ring;
        let id = std::thread::scope(|s| {
            std::thread::Builder::new()
                .name("fido-pipe-cred".into())
                .spawn_scoped(s, || {
                    caller.become_on_this_thread()?;
                    ring.submitter().register_personality()
                })?
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("the thread panicked")))
        })?;
        self.personalities.insert(caller.clone(), id);
        Ok(Some(id))
    }

    fn start(&mut self, spec: JobSpec) {
        self.ensure_capacity();
        let personality = match self.personality_for(&spec.caller) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(caller = ?spec.caller, error = %e, "cannot act with a caller's credentials; its transfer fails");
                let errno = e.raw_os_error().unwrap_or(libc::EPERM);
                return self.refuse(
                    spec.id,
                    errno,
                    format!("engine: cannot act as uid {} ({e})", spec.caller.uid),
                );
            }
        };
        let (pr, pw) = match rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC) {
            Ok(p) => p,
            Err(e) => return self.refuse(spec.id, e.raw_os_error(), format!("engine pipe: {e}")),
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
        // Nothing is written at or past the caller's file size limit.
        let mut to_read = spec.op.len();
        let mut fsize_cut = None;
        if let (Some(limit), true) = (spec.fsize_limit, dst_off >= 0) {
            let room = limit.saturating_sub(dst_off as u64);
            if to_read > room {
                to_read = room;
                fsize_cut = Some(limit);
            }
        }
        let id = spec.id;
        let spec_op = spec.op;
        let dom_id = spec.domain;
        let weight = spec.weight;
        let file_caller = spec
            .caller
            .needs_own_credentials()
            .then(|| spec.caller.clone());
        let job = Job {
            to_read,
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
            personality,
            file_caller,
            src_stream: !spec_op.source_is_file(),
            dst_stream: !spec_op.sink_is_file(),
            src_ready: false,
            dst_ready: false,
            fsize_cut,
        };
        self.jobs.insert(id, job);
        self.sched.submit(dom_id, weight, id);
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

    fn release_slow(&mut self, now: Instant) {
        let mut give_up = Vec::new();
        for (id, j) in self.jobs.iter_mut() {
            if j.lane && now.duration_since(j.issued) > SLOW {
                j.lane = false;
                self.sched.release_lane(j.spec.domain);
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

    /// Starts chunks while the scheduler has a lane and a domain for them.
    fn dispatch(&mut self) {
        while let Some((dom, id)) = self.sched.next_chunk() {
            let Some(j) = self.jobs.get_mut(&id) else {
                continue;
            };
            if j.cancel {
                self.finish(id);
                continue;
            }
            j.lane = true;
            self.sched.take_lane(dom);
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
            self.files.submit(j.file_caller.as_ref(), chunk);
            return;
        }
        if j.src_stream && !j.src_ready {
            // Poll first: a splice from a stream with nothing to read would
            // hold an io_uring worker until the peer writes. The poll holds
            // no thread, and the job leaves its lane while it waits.
            self.drop_lane(id);
            return self.issue_poll(id, false);
        }
        if !self.may_splice(id, false) {
            return;
        }
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        let len = j.to_read.min(j.chunk as u64) as u32;
        let stream = j.src_stream;
        let sqe = opcode::Splice::new(
            types::Fd(j.spec.src.as_raw_fd()),
            j.src_off,
            types::Fd(j.pw.as_raw_fd()),
            -1,
            len,
        )
        .flags(splice_flags(stream))
        .build()
        .user_data(ud(id, TAG_SPLICE));
        let sqe = with_personality(sqe, j.personality);
        j.state = State::Fill;
        j.inflight = true;
        j.src_ready = false;
        j.issued = Instant::now();
        self.push_splice(sqe, id, stream);
    }

    fn issue_drain(&mut self, id: u64) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        if j.dst_stream && !j.dst_ready {
            // Poll first, as for a source (see `issue_fill`).
            return self.issue_poll(id, true);
        }
        if !self.may_splice(id, true) {
            return;
        }
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        let len = j.in_pipe.min(u32::MAX as u64) as u32;
        let stream = j.dst_stream;
        let sqe = opcode::Splice::new(
            types::Fd(j.pr.as_raw_fd()),
            -1,
            types::Fd(j.spec.dst.as_raw_fd()),
            j.dst_off,
            len,
        )
        .flags(splice_flags(stream))
        .build()
        .user_data(ud(id, TAG_SPLICE));
        let sqe = with_personality(sqe, j.personality);
        j.state = State::Drain;
        j.inflight = true;
        j.dst_ready = false;
        self.push_splice(sqe, id, stream);
    }

    /// May job `id` issue a splice now (its caller is under
    /// [`MAX_SPLICES_PER_CALLER`])? If so it is counted; if not, the job waits
    /// for one of its caller's splices to return.
    fn may_splice(&mut self, id: u64, drain: bool) -> bool {
        let Some(j) = self.jobs.get(&id) else {
            return false;
        };
        let uid = j.spec.caller.uid;
        let n = self.splicing.entry(uid).or_default();
        if *n < MAX_SPLICES_PER_CALLER {
            *n += 1;
            return true;
        }
        self.deferred.entry(uid).or_default().push_back((id, drain));
        false
    }

    /// A splice of `uid` returned: the next one waiting may go.
    fn splice_returned(&mut self, uid: u32) {
        if let Some(n) = self.splicing.get_mut(&uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.splicing.remove(&uid);
            }
        }
    }

    /// Issues waiting splices of `uid` while it has room.
    fn resume_deferred(&mut self, uid: u32) {
        while self.splicing.get(&uid).copied().unwrap_or(0) < MAX_SPLICES_PER_CALLER {
            let Some(q) = self.deferred.get_mut(&uid) else {
                return;
            };
            let Some((id, drain)) = q.pop_front() else {
                self.deferred.remove(&uid);
                return;
            };
            // A job cancelled while it waited is already finished and gone.
            if self.jobs.get(&id).is_some_and(|j| !j.cancel) {
                if drain {
                    self.issue_drain(id);
                } else {
                    self.issue_fill(id);
                }
            }
        }
    }

    /// Queues a splice; one touching a stream gets a linked timeout of
    /// [`STREAM_SPLICE_LIMIT`], so it cannot hold a worker while its peer sleeps.
    fn push_splice(&mut self, sqe: io_uring::squeue::Entry, id: u64, stream: bool) {
        if !stream {
            return self.push(sqe);
        }
        let timeout = opcode::LinkTimeout::new(&*self.stream_limit)
            .build()
            .user_data(ud(id, TAG_TIMEOUT));
        // The two must be in one submission queue, adjacent: make room first.
        let room = {
            let sq = self.ring.submission();
            sq.capacity() - sq.len()
        };
        if room < 2 {
            if let Err(e) = self.ring.submit() {
                tracing::warn!(error = %e, "io_uring submit failed while the queue was full");
            }
        }
        self.push(sqe.flags(io_uring::squeue::Flags::IO_LINK));
        self.push(timeout);
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
                self.sched.release_lane(j.spec.domain);
            }
        }
    }

    /// A file worker finished a `copy_file_range` chunk.
    fn file_done(&mut self, id: u64, res: Copied) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        j.in_worker = false;
        let dom = j.spec.domain;
        let Some(res) = res else {
            // No worker ran it (its caller's last one had just ended): again.
            self.drop_lane(id);
            let Some(j) = self.jobs.get_mut(&id) else {
                return;
            };
            if j.cancel {
                return self.finish(id);
            }
            j.state = State::Queued;
            return self.sched.ready(dom, id);
        };
        match res {
            Ok(0) => j.eof = true,
            Ok(n) => {
                let n = n as u64;
                j.moved += n;
                j.consumed += n;
                j.to_read -= n;
                j.src_off += n as i64;
                j.dst_off += n as i64;
                self.sched.charge(dom, n);
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
        self.sched.ready(dom, id);
    }

    /// A splice or poll of job `id` completed with `res` (bytes, or `-errno`).
    fn completed(&mut self, id: u64, tag: u64, res: i32) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        j.inflight = false;
        let uid = j.spec.caller.uid;
        if tag == TAG_SPLICE {
            self.splice_returned(uid);
        }
        match (tag, self.jobs[&id].state) {
            (TAG_POLL, _) => self.poll_done(id, res),
            (_, State::Fill) => self.fill_done(id, res),
            (_, State::Drain) => self.drain_done(id, res),
            _ => {}
        }
        if tag == TAG_SPLICE {
            self.resume_deferred(uid);
        }
    }

    /// The descriptor a job waited on is ready (or the poll failed).
    fn poll_done(&mut self, id: u64, res: i32) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        if j.cancel {
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
            j.dst_ready = true;
            return self.issue_drain(id);
        }
        // Source readable again: back to the scheduler for its next chunk.
        j.src_ready = true;
        j.state = State::Queued;
        let dom = j.spec.domain;
        self.sched.ready(dom, id);
    }

    /// `splice(source → engine pipe)` returned.
    fn fill_done(&mut self, id: u64, res: i32) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        if res > 0 {
            let n = res as u64;
            j.consumed += n;
            j.to_read -= n;
            j.in_pipe = n;
            if j.src_off >= 0 {
                j.src_off += n as i64;
            }
            if j.cancel {
                self.drop_lane(id);
                return self.finish(id);
            }
            self.issue_drain(id);
        } else if res == 0 {
            j.eof = true;
            self.drop_lane(id);
            self.finish(id);
        } else if j.cancel {
            self.drop_lane(id);
            self.finish(id);
        } else if not_ready(res) {
            self.drop_lane(id);
            self.issue_poll(id, false);
        } else {
            j.failed = Some((-res, format!("source: {}", Errno::from_raw_os_error(-res))));
            self.drop_lane(id);
            self.finish(id);
        }
    }

    /// `splice(engine pipe → sink)` returned: delivered bytes are charged.
    fn drain_done(&mut self, id: u64, res: i32) {
        let Some(j) = self.jobs.get_mut(&id) else {
            return;
        };
        let dom = j.spec.domain;
        if res > 0 {
            let n = res as u64;
            j.moved += n;
            j.in_pipe -= n;
            if j.dst_off >= 0 {
                j.dst_off += n as i64;
            }
            let (more, done, cancelled) = (j.in_pipe > 0, j.to_read == 0, j.cancel);
            self.sched.charge(dom, n);
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
            self.sched.ready(dom, id);
        } else if j.cancel {
            self.drop_lane(id);
            self.finish(id);
        } else if not_ready(res) {
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

    /// Reports the job and forgets it. Only called with no SQE of it in flight.
    fn finish(&mut self, id: u64) {
        let Some(j) = self.jobs.get(&id) else { return };
        if j.inflight {
            return;
        }
        let mut j = self.jobs.remove(&id).expect("present");
        if j.lane {
            j.lane = false;
            self.sched.release_lane(j.spec.domain);
        }
        let end = if let Some((errno, message)) = j.failed.take() {
            PipeEnd::Failed { errno, message }
        } else if j.cancel && !(j.to_read == 0 && j.in_pipe == 0) && !j.eof {
            PipeEnd::Cancelled
        } else if j.eof {
            PipeEnd::Eof
        } else if let Some(limit) = j.fsize_cut {
            cut_at_limit(&j, limit)
        } else {
            PipeEnd::Done
        };
        let dom = j.spec.domain;
        let domain_dropped = self.sched.finished(dom, id);
        if !j.reported {
            let result = PipeResult {
                moved: j.moved,
                consumed: j.consumed,
                end,
            };
            let _ = self.done_tx.send(Done { id, result });
            ring_bell(&self.done_fd);
        }
        if domain_dropped {
            self.shared.lock().stats.remove(&dom);
        }
    }

    /// Copies the scheduler's figures for `Status` when it sampled new rates.
    fn publish(&mut self, now: Instant) {
        let Some(figures) = self.sched.sample(now) else {
            return;
        };
        let mut s = self.shared.lock();
        s.stats = figures
            .into_iter()
            .map(|(id, f)| {
                let stat = DomStat {
                    weight: f.weight,
                    credits: f.credits as i64,
                    bytes_per_s: f.bytes_per_s as u64,
                    bytes_total: f.bytes_total,
                    running: f.running,
                };
                (id, stat)
            })
            .collect();
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
                if data != WAKE && matches!(data & 3, TAG_SPLICE | TAG_POLL) {
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
