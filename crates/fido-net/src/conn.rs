//! One accelerated connection as seen by one process: the shared segment, our
//! side, and the byte-stream algorithms (send, receive, close) that keep the
//! kernel's readiness of the real TCP socket truthful.
//!
//! Readiness design. The application's descriptor stays the real, connected
//! TCP socket, so poll/select/epoll (level or edge), fork, dup and exec keep
//! their kernel meaning. Data travels on the ring; the TCP stream carries only
//! one-byte *doorbells*. A reader that finds its ring empty *arms* (stores a
//! generation in the ring's `data_arm`); a writer that publishes data swaps the
//! arm to 0 and, if it was set, sends that generation byte over TCP, which makes
//! the reader's socket readable (and fires an epoll edge). Invariant: whenever
//! the ring holds data and its reader is outside this library, a doorbell byte
//! is queued on the reader's socket or on its way — so the kernel never reports
//! "not readable" while data waits. Conversely, before a call that leaves the
//! ring empty returns, the reader *settles* (`Conn::settle`): it re-arms, waits
//! for every counted doorbell to land and drains the stale ones, never the
//! byte of the current arm — so a socket the kernel reports readable has data
//! (or EOF/an error), and readiness is neither missing nor spurious.
//! Writers waiting for space arm `space_arm` the same way (bytes 128..=255).
//!
//! Lazy arming. Arming on every empty ring costs the writer a doorbell (a TCP
//! send) and the reader a drain (two receives) per message — more system
//! calls than TCP itself. When every way the program waits for this socket
//! goes through this library (`wait`: poll, select, epoll, and the blocking
//! receive here), readiness can be computed from the ring instead, and the
//! reader arms only around its own sleeps: `sleep_begin` arms (and drains
//! stale bytes) before a thread sleeps in the kernel, `sleep_end` takes the arm
//! back. A busy connection then moves messages with no system call at all.
//! While any thread sleeps (`data_sleepers`), or once the side is *eager*
//! (the program waited in a way we cannot see: see `wait`), the side arms on
//! every empty ring as described above.
//!
//! Closing and errors are the kernel's: FIN and RST travel on the real socket,
//! so EOF, EPOLLRDHUP, EPOLLHUP, ECONNRESET, EPIPE and SIGPIPE come from TCP
//! itself. Before its socket is closed the last holder drains its doorbells
//! (unread doorbells would turn the FIN into a RST) or, if application data is
//! unread, closes with a RST exactly as TCP does.

use crate::seg::{Segment, ShmLock};
use crate::sockopt::{self, TcpOpts};
use crate::{config, real};
use libc::c_int;
use std::sync::atomic::{fence, AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Spins until `ready()` or the spin budget is spent; returns `ready()`.
///
/// Every few iterations it yields the CPU: on a machine with more runnable
/// threads than CPUs the peer we wait for may be queued behind us on this
/// very CPU, and a pure spin would only delay it (measured with two vCPUs
/// and compilers running: sockperf one-way latency grew by the whole budget).
pub(crate) fn spin_until(budget: Duration, ready: impl Fn() -> bool) -> bool {
    let t0 = Instant::now();
    let mut i = 0u32;
    while t0.elapsed() < budget {
        if ready() {
            return true;
        }
        i = i.wrapping_add(1);
        if i % 16 == 0 && !config::restricted() {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    ready()
}

/// Result of a data operation.
pub enum Out {
    Done(usize),
    Err(c_int),
    /// Let the kernel do it: the peer closed (TCP will RST/EPIPE), we shut down
    /// writing, or the connection was reset.
    Kernel,
}

impl Out {
    /// What a call that moved `n` bytes before meeting `otherwise` returns:
    /// the bytes if any (the error comes with the next call), else `otherwise`.
    fn moved_or(n: usize, otherwise: Out) -> Out {
        if n > 0 {
            Out::Done(n)
        } else {
            otherwise
        }
    }
}

/// How long the next sleep of a blocking call may last: 100 ms slices (so a
/// vanished peer or a missed doorbell costs at most one), cut to the socket's
/// `SO_RCVTIMEO`/`SO_SNDTIMEO` (`opt`), whose deadline is computed on the
/// first sleep and kept in `deadline`. `Err(EAGAIN)` once it has passed.
fn sleep_slice(
    fd: c_int,
    opt: c_int,
    deadline: &mut Option<Option<Instant>>,
) -> Result<c_int, c_int> {
    let dl = *deadline.get_or_insert_with(|| timeout_opt(fd, opt).map(|d| Instant::now() + d));
    let Some(dl) = dl else { return Ok(100) };
    let now = Instant::now();
    if now >= dl {
        return Err(libc::EAGAIN);
    }
    Ok(100.min((dl - now).as_millis() as c_int + 1))
}

/// Sleeps in the kernel until `fd` is readable (data, a doorbell, EOF) or
/// `slice_ms` passes. `Err(EINTR)` when a signal interrupted it.
fn sleep_readable(fd: c_int, slice_ms: c_int) -> Result<(), c_int> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll on one pollfd we own.
    let r = unsafe { real::poll(&mut p, 1, slice_ms) };
    if r < 0 && errno() == libc::EINTR {
        return Err(libc::EINTR);
    }
    Ok(())
}

pub struct Conn {
    pub seg: Segment,
    /// Our side (seg::CLIENT or seg::SERVER).
    pub me: usize,
    /// O_NONBLOCK of the open file description, as last set through us.
    pub nonblock: AtomicBool,
    /// Descriptors of this process naming the connection.
    pub local_refs: AtomicU32,
    /// The real socket's inode (set when its first descriptor is recorded):
    /// a descriptor number whose inode differs no longer names it.
    pub sock_ino: AtomicU64,
    /// Client: the server's decision (attach or not) has not been seen yet.
    /// (The segment's memfd itself is closed once offered: the mapping is
    /// what both ends use, and a descriptor per pending connection would
    /// eat the program's descriptor budget.)
    pub undecided: AtomicBool,
    /// Client: the broker's id of its offer (withdrawn if never attached).
    pub offer: Option<u64>,
    /// Set when the segment was found corrupt: the connection was reset.
    pub broken: AtomicBool,
    /// The peer's `doorbells_sent` when our last wait for its in-flight
    /// doorbells gave up (a stopped or dying peer): not waited for again.
    pub stuck_at: AtomicU64,
    /// Client: the TCP connection completed (a non-blocking connect may still
    /// be in progress; until then the kernel answers every call).
    pub connected: AtomicBool,
    pub local: String,
    pub peer: String,
    /// The program's view of the TCP options the ring changes (`sockopt`).
    pub tcp_opts: TcpOpts,
    /// A socket error (e.g. `ECONNRESET`) one of our own peeks took from the
    /// kernel, which reports an error once: kept for the program's next
    /// receive (or `SO_ERROR`), which would otherwise see a plain EOF.
    pub kernel_err: AtomicI32,
    /// The kernel reported the real socket reset: no more bytes go into the
    /// ring (the kernel answers every later write: `EPIPE`, as TCP).
    pub dead: AtomicBool,
    /// Under a seccomp filter (`config::restricted`) doorbells cannot be
    /// peeked at (`recv` may be forbidden; `read` consumes): a current
    /// doorbell read off the socket is held here (-1: none) as if it were
    /// still queued in front of it, until a later drain finds it stale.
    held: AtomicI32,
}

/// Disconnects TCP socket `fd` with a RST (`connect(AF_UNSPEC)`): the peer
/// reads `ECONNRESET`.
pub(crate) fn send_reset(fd: c_int) {
    let sa = libc::sockaddr {
        sa_family: libc::AF_UNSPEC as libc::sa_family_t,
        sa_data: [0; 14],
    };
    // SAFETY: connect(AF_UNSPEC) on a descriptor, with a sockaddr of the size given.
    unsafe {
        real::connect(
            fd,
            &sa,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
}

fn errno() -> c_int {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

enum KState {
    Empty,
    Bytes,
    Eof,
    Err(c_int),
}

/// Skips the first `n` bytes of a list of buffers.
fn advance_mut(bufs: &mut Vec<&mut [u8]>, mut n: usize) {
    while n > 0 && !bufs.is_empty() {
        let first = std::mem::take(&mut bufs[0]);
        if first.len() <= n {
            n -= first.len();
            bufs.remove(0);
        } else {
            bufs[0] = &mut first[n..];
            n = 0;
        }
    }
}

fn advance(bufs: &mut Vec<&[u8]>, mut n: usize) {
    while n > 0 && !bufs.is_empty() {
        let first = bufs[0];
        if first.len() <= n {
            n -= first.len();
            bufs.remove(0);
        } else {
            bufs[0] = &first[n..];
            n = 0;
        }
    }
}

fn timeout_opt(fd: c_int, opt: c_int) -> Option<Duration> {
    if config::restricted() {
        // getsockopt may be forbidden: no SO_RCVTIMEO/SO_SNDTIMEO deadline.
        return None;
    }
    let mut tv = libc::timeval {
        tv_sec: 0,
        tv_usec: 0,
    };
    let mut len = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
    // SAFETY: getsockopt into a timeval of the right size.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            opt,
            &mut tv as *mut _ as *mut libc::c_void,
            &mut len,
        )
    };
    if r != 0 || (tv.tv_sec == 0 && tv.tv_usec == 0) {
        return None;
    }
    Some(Duration::new(tv.tv_sec as u64, tv.tv_usec as u32 * 1000))
}

impl Conn {
    /// A connection record for our side `me` of segment `seg` (both ends
    /// make one: the client before its SYN, the server at accept, an image
    /// after exec). A process that gave up lazy arming makes it eager.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        seg: Segment,
        me: usize,
        nonblock: bool,
        undecided: bool,
        offer: Option<u64>,
        connected: bool,
        local: String,
        peer: String,
    ) -> Conn {
        if !config::lazy_allowed() {
            seg.side(me).eager.store(1, Ordering::SeqCst);
        }
        Conn {
            seg,
            me,
            nonblock: AtomicBool::new(nonblock),
            local_refs: AtomicU32::new(0),
            sock_ino: AtomicU64::new(0),
            undecided: AtomicBool::new(undecided),
            offer,
            broken: AtomicBool::new(false),
            stuck_at: AtomicU64::new(u64::MAX),
            connected: AtomicBool::new(connected),
            local,
            peer,
            tcp_opts: TcpOpts::default(),
            kernel_err: AtomicI32::new(0),
            dead: AtomicBool::new(false),
            held: AtomicI32::new(-1),
        }
    }

    fn tx(&self) -> usize {
        self.me
    }
    fn rx(&self) -> usize {
        1 - self.me
    }
    fn peer_side(&self) -> usize {
        1 - self.me
    }

    pub fn bytes_sent(&self) -> u64 {
        self.seg.ring(self.tx()).head.0.load(Ordering::Relaxed)
    }
    pub fn bytes_received(&self) -> u64 {
        self.seg.ring(self.rx()).tail.0.load(Ordering::Relaxed)
    }

    /// Doorbell bytes our side sent (each a TCP send).
    pub fn doorbells_sent(&self) -> u64 {
        self.seg
            .side(self.me)
            .doorbells_sent
            .load(Ordering::Relaxed)
    }

    /// Bytes waiting for us (FIONREAD).
    pub fn readable_bytes(&self) -> usize {
        self.seg.used(self.rx()).unwrap_or(0)
    }
    /// Free bytes in our sending ring.
    pub fn free_space(&self) -> usize {
        self.free_tx().unwrap_or(0)
    }

    /// Bytes we sent that the peer has not read (SIOCOUTQ).
    pub fn unsent_bytes(&self) -> usize {
        self.seg.used(self.tx()).unwrap_or(0)
    }

    /// Sends one doorbell byte. The byte was already counted in
    /// `doorbells_sent` (before the arm was taken, so a reader draining in
    /// between knows one is on its way); a failed send uncounts it.
    fn doorbell(&self, fd: c_int, b: u8) {
        let s = self.seg.side(self.me);
        let r = loop {
            let r = if config::restricted() {
                // Under a seccomp filter only what the program itself does
                // to its socket is safe: `write` (sshd's filter kills on
                // `sendto`). A doorbell goes only to a reader that armed,
                // and at most one per arm, so the send buffer never fills;
                // `SIGPIPE` could come only from a peer that died armed
                // after our check of `closed`, where TCP would raise it on
                // the program's own next write.
                // SAFETY: one byte from a local onto the real socket.
                unsafe { real::write(fd, &b as *const u8 as *const libc::c_void, 1) }
            } else {
                // SAFETY: one byte from a local onto the real socket.
                unsafe {
                    real::send(
                        fd,
                        &b as *const u8 as *const libc::c_void,
                        1,
                        libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                    )
                }
            };
            // Interrupted before anything was queued: the armed reader
            // still needs its byte (as fido-ring's `doorbell::ring`).
            if r < 0 && errno() == libc::EINTR {
                continue;
            }
            break r;
        };
        if r != 1 {
            s.doorbells_sent.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Takes an arm word: announces a possible doorbell first, then swaps;
    /// withdraws the announcement if nobody was armed.
    fn take_arm(&self, arm: &AtomicU32) -> u32 {
        let s = self.seg.side(self.me);
        s.doorbells_sent.fetch_add(1, Ordering::SeqCst);
        let g = arm.swap(0, Ordering::SeqCst);
        if g == 0 {
            s.doorbells_sent.fetch_sub(1, Ordering::SeqCst);
        }
        g
    }

    /// After publishing data up to `head`: wake the reader if it armed —
    /// unless it already read everything up to `head` (it re-armed after
    /// consuming our bytes: a doorbell now would announce data that is gone,
    /// a spurious readiness that programs such as wrk count as an error).
    fn notify_data(&self, fd: c_int, mut head: u64) {
        fence(Ordering::SeqCst);
        let ring = self.seg.ring(self.tx());
        let arm = &ring.data_arm.0;
        loop {
            if arm.load(Ordering::SeqCst) == 0 {
                return;
            }
            let g = self.take_arm(arm);
            if g == 0 {
                return;
            }
            let tail = ring.tail.0.load(Ordering::SeqCst);
            if (tail.wrapping_sub(head) as i64) < 0 {
                let d = config::doorbell_delay();
                if !d.is_zero() {
                    std::thread::sleep(d);
                }
                self.doorbell(fd, g as u8);
                return;
            }
            // The reader has it all: no doorbell; give the arm back if the
            // reader has not re-armed meanwhile.
            self.seg
                .side(self.me)
                .doorbells_sent
                .fetch_sub(1, Ordering::SeqCst);
            if self
                .seg
                .side(self.peer_side())
                .data_gen
                .load(Ordering::SeqCst)
                == g
            {
                let _ = arm.compare_exchange(0, g, Ordering::SeqCst, Ordering::SeqCst);
            }
            // Another writer (thread or process) may have published while we
            // held the arm: cover its bytes.
            let h = ring.head.0.load(Ordering::SeqCst);
            if h != head && (ring.tail.0.load(Ordering::SeqCst).wrapping_sub(h) as i64) < 0 {
                head = h;
                continue;
            }
            return;
        }
    }

    /// After consuming data: wake a writer waiting for space.
    fn notify_space(&self, fd: c_int) {
        fence(Ordering::SeqCst);
        let arm = &self.seg.ring(self.rx()).space_arm.0;
        if arm.load(Ordering::SeqCst) != 0 {
            let g = self.take_arm(arm);
            if g != 0 {
                self.doorbell(fd, g as u8);
            }
        }
    }

    fn arm_data(&self) {
        let s = self.seg.side(self.me);
        let g = s.data_gen.load(Ordering::Relaxed) % 127 + 1; // 1..=127
        s.data_gen.store(g, Ordering::SeqCst);
        self.seg
            .ring(self.rx())
            .data_arm
            .0
            .store(g, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    fn arm_space(&self) {
        let s = self.seg.side(self.me);
        let prev = s.space_gen.load(Ordering::Relaxed);
        let g = if (128..255).contains(&prev) {
            prev + 1
        } else {
            128
        }; // 128..=255
        s.space_gen.store(g, Ordering::SeqCst);
        self.seg
            .ring(self.tx())
            .space_arm
            .0
            .store(g, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    fn used_rx(&self) -> Result<usize, ()> {
        self.seg.used(self.rx()).map_err(|_| ())
    }

    fn free_tx(&self) -> Result<usize, ()> {
        self.seg
            .used(self.tx())
            .map(|u| self.seg.ring_len() - u)
            .map_err(|_| ())
    }

    /// Leaves the receive side *settled* before control returns to the
    /// program. Returns false (and drains nothing) when our ring holds data;
    /// otherwise arms a fresh generation, waits until every doorbell the peer
    /// has counted has landed on our socket, drains the stale ones and
    /// returns true.
    ///
    /// Why readiness is then exact for readers (a socket the kernel reports
    /// readable has data in its ring, or EOF/an error):
    ///
    /// 1. A writer counts a doorbell (`doorbells_sent`) *before* it takes the
    ///    arm, and sends it only if, after taking the arm, the reader has not
    ///    read everything published (`tail < head`); otherwise it uncounts it.
    ///    So every byte that is or will be on our socket is counted by the
    ///    time we read the count (SeqCst), and its sending no longer depends
    ///    on anything we do.
    /// 2. Here, under the ring's read lock (no consumer runs meanwhile), we
    ///    arm generation `g` and then find the ring empty. A byte of an older
    ///    generation announced data published before its arm was taken, thus
    ///    before our arm store, hence visible to our emptiness check (fences
    ///    on both sides): that data is already read, the byte is stale. A byte
    ///    of generation `g` was taken after our arm, and sent because data
    ///    published after our last read was unread: it is current, and stays
    ///    current until the program reads again (through us, settling again).
    /// 3. The old, 2 ms-bounded version gave up on bytes counted but not yet
    ///    landed (a writer preempted between its count and its `send`); they
    ///    landed later, stale, making the socket readable with nothing to
    ///    read (`EAGAIN` after readiness: wrk counts a read error). We now
    ///    wait until every counted byte has landed and drain every byte
    ///    before the first current one. The wait ends when the peer sends (it
    ///    is between two instructions), uncounts, hangs up (FIN/RST: nothing
    ///    more comes), or — for a stopped peer — after 1 s (then readiness
    ///    may be spurious once; remembered in `stuck_at`, not waited again).
    /// 4. Returning with data still in the ring drains nothing: the byte
    ///    that announced that data (or a later one) is still queued or
    ///    counted, so the socket stays readable while data waits.
    ///
    /// Space doorbells (bytes 128..=255) are kept only while a writer of
    /// ours waits for space; `send` disarms before returning, so none lands
    /// later unannounced (see `disarm_space`).
    pub(crate) fn settle_armed(&self, fd: c_int) -> bool {
        let _l = ShmLock::lock(&self.seg.ring(self.rx()).rlock.0);
        if self.used_rx().unwrap_or(1) != 0 {
            return false;
        }
        self.arm_data();
        if self.used_rx().unwrap_or(1) != 0 {
            return false;
        }
        self.drain_locked(fd, true, true);
        true
    }

    /// `settle_armed` when our side arms on leaving; otherwise (lazy, nobody
    /// asleep) only drains the doorbells that already landed — all stale, as
    /// no data arm is out but one a writer took before its sleeper left —
    /// without arming or waiting. Returns whether the ring is empty.
    fn settle(&self, fd: c_int) -> bool {
        if self.arms_on_leave() {
            return self.settle_armed(fd);
        }
        let _l = ShmLock::lock(&self.seg.ring(self.rx()).rlock.0);
        if self.used_rx().unwrap_or(1) != 0 {
            return false;
        }
        if self.arms_on_leave() {
            // A sleeper came meanwhile: it arms itself under this lock.
            return true;
        }
        self.drain_locked(fd, false, false);
        true
    }

    /// Whether our side must arm whenever it leaves with an empty ring:
    /// always when eager, and while a thread of ours sleeps on the socket.
    fn arms_on_leave(&self) -> bool {
        let s = self.seg.side(self.me);
        s.eager.load(Ordering::SeqCst) != 0 || s.data_sleepers.load(Ordering::SeqCst) != 0
    }

    /// Whether readiness of this connection is the library's to compute (lazy
    /// arming; see the module documentation).
    /// Under a seccomp filter: a doorbell read off the socket is held (see
    /// `held`), which the kernel's readiness no longer shows.
    pub fn holds_doorbell(&self) -> bool {
        self.held.load(Ordering::SeqCst) >= 0
    }

    pub fn is_lazy(&self) -> bool {
        self.seg.side(self.me).eager.load(Ordering::Relaxed) == 0
    }

    /// Switches our side to eager arming for good (the program may wait in a
    /// way we cannot see). Data already buffered is announced by the next
    /// arrival.
    pub fn make_eager(&self) {
        let s = self.seg.side(self.me);
        if s.eager.swap(1, Ordering::SeqCst) == 0 {
            let _l = ShmLock::lock(&self.seg.ring(self.rx()).rlock.0);
            if self.used_rx().unwrap_or(1) == 0 {
                self.arm_data();
            }
        }
    }

    /// Total bytes ever published to us (moves on every arrival: edge
    /// detection for `EPOLLET`).
    pub fn rx_head(&self) -> u64 {
        self.seg.ring(self.rx()).head.0.load(Ordering::Acquire)
    }

    /// Data waits in our ring (a corrupt ring counts: the read reports it).
    pub fn has_data(&self) -> bool {
        self.used_rx().map_or(true, |u| u > 0)
    }

    /// Before a thread sleeps in the kernel until this connection is
    /// readable: count it as a sleeper, arm, and drain stale doorbells.
    /// Returns false (not counted) when data is already there.
    pub fn sleep_begin(&self, fd: c_int) -> bool {
        self.seg
            .side(self.me)
            .data_sleepers
            .fetch_add(1, Ordering::SeqCst);
        if !self.settle_armed(fd) {
            self.sleep_end();
            return false;
        }
        true
    }

    /// After such a sleep: the last sleeper takes the arm back (by compare
    /// and swap, so an arm a newer sleeper just set stays).
    pub fn sleep_end(&self) {
        let s = self.seg.side(self.me);
        let g = s.data_gen.load(Ordering::SeqCst);
        if s.data_sleepers.fetch_sub(1, Ordering::SeqCst) == 1
            && s.eager.load(Ordering::SeqCst) == 0
        {
            let _ = self.seg.ring(self.rx()).data_arm.0.compare_exchange(
                g,
                0,
                Ordering::SeqCst,
                Ordering::SeqCst,
            );
        }
    }

    /// The kernel reported the socket readable to a lazy waiter: is it
    /// readable for the program? Yes with data in the ring, or EOF/an error
    /// queued behind the doorbells (which only woke us: they are drained).
    pub fn kernel_readable(&self, fd: c_int) -> bool {
        if self.broken.load(Ordering::Relaxed) || self.has_data() {
            return true;
        }
        self.settle(fd);
        if self.has_data() {
            return true;
        }
        matches!(self.kernel_state(fd), KState::Eof | KState::Err(_))
    }

    /// Drains stale doorbells, waiting for counted ones to land (see
    /// `settle`). Caller holds the receive ring's read lock (which also keeps
    /// two drains from consuming the same bytes) and found the ring empty
    /// after arming.
    fn drain_locked(&self, fd: c_int, keep_data: bool, wait: bool) {
        if config::restricted() {
            return self.drain_restricted(fd, keep_data, wait);
        }
        let me = self.seg.side(self.me);
        let peer = self.seg.side(self.peer_side());
        let mut buf = [0u8; 256];
        let t0 = Instant::now();
        let mut waits = 0u32;
        loop {
            let sent = peer.doorbells_sent.load(Ordering::SeqCst);
            let pend = sent.wrapping_sub(me.doorbells_drained.load(Ordering::SeqCst));
            if pend == 0 || pend > 1 << 40 {
                return;
            }
            // SAFETY: peek into a local buffer.
            let n = unsafe {
                real::recv(
                    fd,
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            let n = if n > 0 {
                n as usize
            } else if n == 0 {
                return; // EOF: nothing more can land
            } else {
                match errno() {
                    libc::EAGAIN | libc::EINTR => 0,
                    e if self.is_artifact_reset(e) => return,
                    e => {
                        // Reset: the error is the program's to see.
                        self.dead.store(true, Ordering::Relaxed);
                        let _ = self.kernel_err.compare_exchange(
                            0,
                            e,
                            Ordering::SeqCst,
                            Ordering::SeqCst,
                        );
                        return;
                    }
                }
            };
            let data_gen = me.data_gen.load(Ordering::SeqCst) as u8;
            let waiters = me.space_waiters.load(Ordering::SeqCst) > 0;
            let space_gen = me.space_gen.load(Ordering::SeqCst) as u8;
            let keep = |b: u8| (keep_data && b == data_gen) || (waiters && b == space_gen);
            let k = buf[..n].iter().take_while(|&&b| !keep(b)).count();
            if k > 0 {
                // SAFETY: consuming exactly the peeked stale prefix.
                let r = unsafe {
                    real::recv(
                        fd,
                        buf.as_mut_ptr() as *mut libc::c_void,
                        k,
                        libc::MSG_DONTWAIT,
                    )
                };
                if r > 0 {
                    me.doorbells_drained.fetch_add(r as u64, Ordering::SeqCst);
                }
                if r != k as isize {
                    return;
                }
            }
            if k < n {
                // A current byte: it and everything after it stay.
                return;
            }
            if n as u64 >= pend || n == buf.len() {
                continue; // drained all we saw; re-read the count
            }
            // Counted bytes still on their way.
            if !wait || self.stuck_at.load(Ordering::Relaxed) == sent {
                return;
            }
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLRDHUP,
                revents: 0,
            };
            // SAFETY: poll on one pollfd we own, not waiting.
            unsafe { real::poll(&mut p, 1, 0) };
            if p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
                return; // FIN/RST queued: bytes sent before it have landed
            }
            if t0.elapsed() > Duration::from_secs(1) {
                crate::sys::debug!("fd {fd}: doorbell not landed after 1 s (peer stopped?)");
                self.stuck_at.store(sent, Ordering::Relaxed);
                return;
            }
            waits += 1;
            if waits < 20 && !config::restricted() {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// `drain_locked` under a seccomp filter: with only `poll` and `read`
    /// (no peek), bytes are read one at a time; a current one is held in
    /// `held` as though still queued (see there).
    fn drain_restricted(&self, fd: c_int, keep_data: bool, wait: bool) {
        let me = self.seg.side(self.me);
        let peer = self.seg.side(self.peer_side());
        let t0 = Instant::now();
        loop {
            let sent = peer.doorbells_sent.load(Ordering::SeqCst);
            let pend = sent.wrapping_sub(me.doorbells_drained.load(Ordering::SeqCst));
            if pend == 0 || pend > 1 << 40 {
                return;
            }
            let b = match self.held.swap(-1, Ordering::SeqCst) {
                h if h >= 0 => h as u8,
                _ => {
                    let mut p = libc::pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: poll on one pollfd we own, not waiting.
                    unsafe { real::poll(&mut p, 1, 0) };
                    if p.revents & libc::POLLIN == 0 {
                        // Counted bytes still on their way (see drain_locked).
                        if !wait
                            || self.stuck_at.load(Ordering::Relaxed) == sent
                            || p.revents & (libc::POLLHUP | libc::POLLERR) != 0
                        {
                            return;
                        }
                        if t0.elapsed() > Duration::from_secs(1) {
                            self.stuck_at.store(sent, Ordering::Relaxed);
                            return;
                        }
                        std::thread::sleep(Duration::from_micros(50));
                        continue;
                    }
                    let mut b = 0u8;
                    // SAFETY: one byte into a local; the socket is readable
                    // and we hold the read lock, so this does not block.
                    let r = unsafe { real::read(fd, &mut b as *mut u8 as *mut libc::c_void, 1) };
                    if r == 0 {
                        return; // EOF: nothing more can land
                    }
                    if r < 0 {
                        match errno() {
                            libc::EAGAIN | libc::EINTR => continue,
                            e if self.is_artifact_reset(e) => return,
                            e => {
                                self.dead.store(true, Ordering::Relaxed);
                                let _ = self.kernel_err.compare_exchange(
                                    0,
                                    e,
                                    Ordering::SeqCst,
                                    Ordering::SeqCst,
                                );
                                return;
                            }
                        }
                    }
                    b
                }
            };
            let data_gen = me.data_gen.load(Ordering::SeqCst) as u8;
            let waiters = me.space_waiters.load(Ordering::SeqCst) > 0;
            let space_gen = me.space_gen.load(Ordering::SeqCst) as u8;
            if (keep_data && b == data_gen) || (waiters && b == space_gen) {
                self.held.store(b as i32, Ordering::SeqCst);
                return;
            }
            me.doorbells_drained.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Before a `send` that armed for space returns complete: take the space
    /// arm back so no space doorbell lands once nobody waits for it (it would
    /// make the socket readable with nothing to read). If the reader already took it,
    /// its byte is counted: settle, which waits for it and drains it (or
    /// leaves it when our ring holds data, where it is harmless). Another
    /// thread still waiting keeps the arm.
    fn disarm_space(&self, fd: c_int) {
        let me = self.seg.side(self.me);
        if me.space_waiters.load(Ordering::SeqCst) != 0 {
            return;
        }
        if self
            .seg
            .ring(self.tx())
            .space_arm
            .0
            .swap(0, Ordering::SeqCst)
            == 0
        {
            self.settle(fd);
        }
    }

    /// What the kernel says about the socket, without consuming it.
    /// A reset the kernel reports, as TCP would have reported the close:
    /// a peer that died (or closed) having read everything we sent left
    /// only doorbell bytes unread — TCP would have sent a FIN, so it is EOF.
    /// A reset made on purpose (`Side::reset`) or with our data unread
    /// stays a reset.
    fn is_artifact_reset(&self, e: c_int) -> bool {
        e == libc::ECONNRESET
            && self.seg.side(self.peer_side()).reset.load(Ordering::SeqCst) == 0
            && self.seg.used(self.tx()).is_ok_and(|u| u == 0)
    }

    fn kernel_state(&self, fd: c_int) -> KState {
        let kept = self.kernel_err.load(Ordering::SeqCst);
        if kept != 0 {
            return KState::Err(kept);
        }
        if config::restricted() {
            return self.kernel_state_restricted(fd);
        }
        let mut b = 0u8;
        // SAFETY: peek one byte into a local.
        let n = unsafe {
            real::recv(
                fd,
                &mut b as *mut u8 as *mut libc::c_void,
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match n {
            1 => KState::Bytes,
            0 => KState::Eof,
            _ => match errno() {
                libc::EAGAIN => KState::Empty,
                libc::EINTR => KState::Empty,
                e if self.is_artifact_reset(e) => KState::Eof,
                e => {
                    // A peer that died with our bytes unread reset the
                    // connection as TCP would; its FIN may have come first
                    // (no doorbell was unread), turning the RST our probe
                    // drew into `EPIPE`. TCP says `ECONNRESET`.
                    let e = if e == libc::EPIPE && self.seg.used(self.tx()).is_ok_and(|u| u > 0) {
                        libc::ECONNRESET
                    } else {
                        e
                    };
                    self.dead.store(true, Ordering::Relaxed);
                    // Taken from the kernel by this peek: keep it until a
                    // receive reports it (`take_kernel_err`).
                    let _ =
                        self.kernel_err
                            .compare_exchange(0, e, Ordering::SeqCst, Ordering::SeqCst);
                    KState::Err(e)
                }
            },
        }
    }

    /// A writer found the real socket reset (or hung up) with the ring full.
    /// When the peer left our bytes unread, TCP's answer is `ECONNRESET`
    /// (a close with unread data is a RST), then `EPIPE`: but a peer killed
    /// while it had no doorbell unread closed its socket with a FIN, and our
    /// probe's RST then arrived in `CLOSE_WAIT`, where the kernel says
    /// `EPIPE` (with `SIGPIPE`). So with our data unread, the socket's
    /// pending error is taken and `ECONNRESET` reported once; later writes
    /// go to the kernel (`EPIPE`, `SIGPIPE`). Otherwise the kernel answers.
    fn peer_gone(&self, fd: c_int) -> Out {
        self.dead.store(true, Ordering::Relaxed);
        if self.seg.used(self.tx()).unwrap_or(0) == 0 {
            return Out::Kernel;
        }
        let kept = self.kernel_err.swap(0, Ordering::SeqCst);
        if config::restricted() {
            // No getsockopt under a filter: the kernel's error stays queued
            // (the next call reports it); ours is TCP's first answer.
            return Out::Err(if kept != 0 { kept } else { libc::ECONNRESET });
        }
        let mut err: c_int = 0;
        let mut len = std::mem::size_of::<c_int>() as libc::socklen_t;
        // SAFETY: getsockopt(SO_ERROR) into an int (takes the pending error).
        unsafe {
            real::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                &mut err as *mut c_int as *mut libc::c_void,
                &mut len,
            )
        };
        match if kept != 0 { kept } else { err } {
            0 | libc::EPIPE | libc::ECONNRESET => Out::Err(libc::ECONNRESET),
            e => Out::Err(e),
        }
    }

    /// Whether an error taken from the kernel by one of our peeks waits for
    /// the program (poll and epoll report it as `POLLERR`, as the kernel
    /// would have before the peek).
    pub fn has_kernel_err(&self) -> bool {
        self.kernel_err.load(Ordering::Relaxed) != 0
    }

    /// `kernel_state` under a seccomp filter, from `poll` alone (no peek):
    /// a held doorbell or one queued is `Bytes`; `POLLIN` with the peer's
    /// FIN and no doorbell outstanding is `Eof`; an error is read (`read`
    /// returns it, taking it from the kernel) and kept for the program.
    fn kernel_state_restricted(&self, fd: c_int) -> KState {
        if self.held.load(Ordering::SeqCst) >= 0 {
            return KState::Bytes;
        }
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: poll on one pollfd we own, not waiting.
        unsafe { real::poll(&mut p, 1, 0) };
        if p.revents & libc::POLLERR != 0 {
            let mut b = 0u8;
            // SAFETY: one byte into a local (the pending error returns at once).
            let r = unsafe { real::read(fd, &mut b as *mut u8 as *mut libc::c_void, 1) };
            if r == 1 {
                self.held.store(b as i32, Ordering::SeqCst);
                return KState::Bytes;
            }
            if r == 0 {
                return KState::Eof;
            }
            let e = errno();
            if self.is_artifact_reset(e) {
                return KState::Eof;
            }
            let e = if e == libc::EPIPE && self.seg.used(self.tx()).is_ok_and(|u| u > 0) {
                libc::ECONNRESET
            } else {
                e
            };
            self.dead.store(true, Ordering::Relaxed);
            let _ = self
                .kernel_err
                .compare_exchange(0, e, Ordering::SeqCst, Ordering::SeqCst);
            return KState::Err(e);
        }
        if p.revents & libc::POLLIN == 0 {
            return KState::Empty;
        }
        let me = self.seg.side(self.me);
        let peer = self.seg.side(self.peer_side());
        let pend = peer
            .doorbells_sent
            .load(Ordering::SeqCst)
            .wrapping_sub(me.doorbells_drained.load(Ordering::SeqCst));
        if p.revents & (libc::POLLRDHUP | libc::POLLHUP) != 0 && pend == 0 {
            return KState::Eof;
        }
        KState::Bytes
    }

    /// The kept socket error, reported once (like the kernel's `sk_err`).
    pub fn take_kernel_err(&self) -> Option<c_int> {
        match self.kernel_err.swap(0, Ordering::SeqCst) {
            0 => None,
            e => Some(e),
        }
    }

    /// The segment lied (an index out of range): reset the TCP connection so
    /// the peer gets ECONNRESET, and hand the socket to the kernel from now on.
    pub(crate) fn reset(&self, fd: c_int) {
        self.broken.store(true, Ordering::SeqCst);
        self.seg.side(self.me).reset.store(1, Ordering::SeqCst);
        send_reset(fd);
    }

    pub fn recv(&self, fd: c_int, bufs: &mut [&mut [u8]], flags: c_int) -> Out {
        if self.broken.load(Ordering::Relaxed) {
            return Out::Kernel;
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Out::Done(0);
        }
        let peek = flags & libc::MSG_PEEK != 0;
        let trunc = flags & libc::MSG_TRUNC != 0;
        let waitall = flags & libc::MSG_WAITALL != 0 && !peek;
        let nonblock = flags & libc::MSG_DONTWAIT != 0 || self.nonblock.load(Ordering::Relaxed);
        let mut bufs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut **b).collect();
        let rx = self.rx();
        let mut got = 0usize;
        let mut spun = false;
        let mut deadline: Option<Option<Instant>> = None;
        let entry = if crate::config::debug_on() {
            match self.kernel_state(fd) {
                KState::Bytes => "bytes",
                KState::Empty => "empty",
                KState::Eof => "eof",
                KState::Err(_) => "err",
            }
        } else {
            ""
        };
        loop {
            let n = {
                let _l = ShmLock::lock(&self.seg.ring(rx).rlock.0);
                if trunc && !peek {
                    self.seg.discard(rx, total - got)
                } else {
                    self.seg.read_into(rx, &mut bufs, peek)
                }
            };
            let n = match n {
                Ok(n) => n,
                Err(_) => {
                    self.reset(fd);
                    return Out::moved_or(got, Out::Err(libc::ECONNRESET));
                }
            };
            if n > 0 {
                got += n;
                if peek {
                    return Out::Done(got);
                }
                if !trunc {
                    advance_mut(&mut bufs, n);
                }
                self.notify_space(fd);
                if got == total || !waitall {
                    if !self.arms_on_leave() {
                        // Lazy: readiness is computed from the ring.
                        return Out::Done(got);
                    }
                    // Leave only settled: armed on an empty ring (so data
                    // that comes next rings the socket: an edge for EPOLLET
                    // users) with no stale doorbell left to land.
                    if !self.settle(fd) && got < total && self.used_rx().unwrap_or(0) > 0 {
                        continue;
                    }
                    return Out::Done(got);
                }
                continue;
            }
            // Ring empty.
            if peek && got > 0 {
                return Out::Done(got);
            }
            if self.seg.side(self.me).shut_rd.load(Ordering::Relaxed) != 0 {
                return Out::Done(got);
            }
            if !self.settle(fd) {
                continue;
            }
            match self.kernel_state(fd) {
                KState::Eof => {
                    if self.used_rx().unwrap_or(0) > 0 {
                        continue;
                    }
                    crate::sys::debug!("recv fd {fd}: EOF after {got}");
                    return Out::Done(got);
                }
                KState::Err(e) => {
                    if self.used_rx().unwrap_or(0) > 0 {
                        continue;
                    }
                    if got > 0 {
                        return Out::Done(got); // the error comes next time
                    }
                    self.take_kernel_err();
                    return Out::Err(e);
                }
                KState::Empty | KState::Bytes => {}
            }
            if nonblock {
                if got == 0 && crate::config::debug_on() {
                    let k = self.kernel_state(fd);
                    let me = self.seg.side(self.me);
                    let peer = self.seg.side(self.peer_side());
                    crate::sys::debug!(
                        "recv fd {fd}: EAGAIN (at entry {entry}, now {}, gen {}, arm {}, sent {} drained {})",
                        match k { KState::Bytes => "bytes", KState::Empty => "empty", KState::Eof => "eof", KState::Err(_) => "err" },
                        me.data_gen.load(Ordering::SeqCst),
                        self.seg.ring(rx).data_arm.0.load(Ordering::SeqCst),
                        peer.doorbells_sent.load(Ordering::SeqCst),
                        me.doorbells_drained.load(Ordering::SeqCst)
                    );
                }
                return Out::moved_or(got, Out::Err(libc::EAGAIN));
            }
            // Blocking: spin on the ring, then sleep on the socket. We stay
            // armed while spinning: reclaiming the arm would let data arrive
            // without a doorbell, and a later return with data still in the
            // ring would leave the socket unreadable (a lost wake-up).
            if !spun {
                spun = true;
                spin_until(config::spin_budget(), || self.used_rx().unwrap_or(1) > 0);
                continue; // re-arms above if still empty
            }
            let slice = match sleep_slice(fd, libc::SO_RCVTIMEO, &mut deadline) {
                Ok(s) => s,
                Err(e) => return Out::moved_or(got, Out::Err(e)),
            };
            let lazy = self.is_lazy();
            if lazy && !self.sleep_begin(fd) {
                continue;
            }
            let slept = sleep_readable(fd, slice);
            if lazy {
                self.sleep_end();
            }
            if let Err(e) = slept {
                return Out::moved_or(got, Out::Err(e));
            }
        }
    }

    pub fn send(&self, fd: c_int, bufs: &[&[u8]], flags: c_int) -> Out {
        let mut armed = false;
        let out = self.send_inner(fd, bufs, flags, &mut armed);
        // A program that got less than it asked for may wait for
        // writability: the space doorbell is its wake-up (with EPOLLET it is
        // the only new event on the socket, as the kernel's EPOLLOUT never
        // changes), so the arm stays. A completed write needs none.
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if armed && matches!(out, Out::Done(n) if n == total) {
            self.disarm_space(fd);
        }
        out
    }

    /// `sendfile` fast path: up to `max` bytes of `file` at `pos` straight
    /// into the ring, without waiting. `Ok((moved, eof))`; moved 0 and not
    /// eof means the ring is full (the caller waits through `send`).
    /// `Err(Out::Kernel)` when the kernel must answer (peer gone, shut down).
    pub fn send_file_now(
        &self,
        fd: c_int,
        file: c_int,
        pos: i64,
        max: usize,
    ) -> Result<(usize, bool), Out> {
        let me = self.seg.side(self.me);
        if self.broken.load(Ordering::Relaxed)
            || me.shut_wr.load(Ordering::Relaxed) != 0
            || self
                .seg
                .side(self.peer_side())
                .closed
                .load(Ordering::SeqCst)
                != 0
        {
            return Err(Out::Kernel);
        }
        let fill = {
            let _l = ShmLock::lock(&self.seg.ring(self.tx()).wlock.0);
            self.seg
                .write_from_file(self.tx(), file, pos, max)
                .map(|f| (f, self.seg.ring(self.tx()).head.0.load(Ordering::Relaxed)))
        };
        let (fill, head) = match fill {
            Ok(v) => v,
            Err(_) => {
                self.reset(fd);
                return Err(Out::Kernel);
            }
        };
        if fill.moved > 0 {
            self.notify_data(fd, head);
        }
        if let Some(e) = fill.err {
            return Err(Out::Err(e));
        }
        Ok((fill.moved, fill.eof))
    }

    fn send_inner(&self, fd: c_int, bufs: &[&[u8]], flags: c_int, armed: &mut bool) -> Out {
        if self.broken.load(Ordering::Relaxed) {
            return Out::Kernel;
        }
        let me = self.seg.side(self.me);
        let peer = self.seg.side(self.peer_side());
        if me.shut_wr.load(Ordering::Relaxed) != 0
            || peer.closed.load(Ordering::SeqCst) != 0
            || self.dead.load(Ordering::Relaxed)
        {
            return Out::Kernel;
        }
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Out::Done(0);
        }
        let nonblock = flags & libc::MSG_DONTWAIT != 0 || self.nonblock.load(Ordering::Relaxed);
        let mut bufs: Vec<&[u8]> = bufs.to_vec();
        let tx = self.tx();
        let mut sent = 0usize;
        let mut spun = false;
        let mut probed = false;
        let mut deadline: Option<Option<Instant>> = None;
        loop {
            let n = {
                let _l = ShmLock::lock(&self.seg.ring(tx).wlock.0);
                self.seg
                    .write_from(tx, &bufs)
                    .map(|n| (n, self.seg.ring(tx).head.0.load(Ordering::Relaxed)))
            };
            let (n, head) = match n {
                Ok(v) => v,
                Err(_) => {
                    self.reset(fd);
                    return Out::moved_or(sent, Out::Kernel);
                }
            };
            if n > 0 {
                sent += n;
                advance(&mut bufs, n);
                self.notify_data(fd, head);
            }
            if sent == total {
                return Out::Done(sent);
            }
            if peer.closed.load(Ordering::SeqCst) != 0 {
                return Out::moved_or(sent, Out::Kernel);
            }
            if nonblock && sent > 0 {
                return Out::Done(sent);
            }
            // A full ring. Is the peer still there? (A peer whose every
            // holder closed, or that died, never frees space: let the kernel
            // report EPIPE/ECONNRESET instead of waiting forever.)
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLIN | libc::POLLRDHUP,
                revents: 0,
            };
            // SAFETY: poll on one pollfd we own, not waiting.
            unsafe { real::poll(&mut p, 1, 0) };
            if p.revents & (libc::POLLERR | libc::POLLHUP) != 0 {
                if sent > 0 {
                    // The error comes with the next call, as over TCP.
                    return Out::Done(sent);
                }
                return self.peer_gone(fd);
            }
            if p.revents & libc::POLLRDHUP != 0 && !probed {
                // The peer shut down or exited. A probe byte makes a dead
                // peer's kernel answer with a RST (then POLLERR above).
                probed = true;
                me.doorbells_sent.fetch_add(1, Ordering::SeqCst);
                self.doorbell(fd, 0);
            }
            if nonblock {
                if sent > 0 {
                    return Out::Done(sent);
                }
                *armed = true;
                self.arm_space();
                if self.free_tx().unwrap_or(0) > 0 {
                    continue;
                }
                if !spun {
                    // The kernel reports the socket writable whatever the
                    // ring holds, so a program polling for POLLOUT would spin
                    // on EAGAIN. Give the reader a moment (sleeping, until its
                    // space doorbell) before saying EAGAIN.
                    spun = true;
                    me.space_waiters.fetch_add(1, Ordering::SeqCst);
                    // Doorbells nobody reads (a program that only writes)
                    // would keep the socket readable and the wait short.
                    self.settle(fd);
                    let mut p = libc::pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    let ts = libc::timespec {
                        tv_sec: 0,
                        tv_nsec: 200_000,
                    };
                    // SAFETY: ppoll on one pollfd we own, no signal mask change.
                    unsafe { real::ppoll(&mut p, 1, &ts, std::ptr::null()) };
                    me.space_waiters.fetch_sub(1, Ordering::SeqCst);
                    if self.free_tx().unwrap_or(0) > 0 {
                        continue;
                    }
                }
                return Out::Err(libc::EAGAIN);
            }
            if !spun {
                spun = true;
                if spin_until(config::spin_budget(), || self.free_tx().unwrap_or(1) > 0) {
                    continue;
                }
            }
            me.space_waiters.fetch_add(1, Ordering::SeqCst);
            *armed = true;
            self.arm_space();
            if self.free_tx().unwrap_or(1) > 0 {
                me.space_waiters.fetch_sub(1, Ordering::SeqCst);
                continue;
            }
            self.settle(fd);
            // The space doorbell arrives on our socket, as data would.
            let slept = sleep_slice(fd, libc::SO_SNDTIMEO, &mut deadline)
                .and_then(|slice| sleep_readable(fd, slice));
            me.space_waiters.fetch_sub(1, Ordering::SeqCst);
            if let Err(e) = slept {
                return Out::moved_or(sent, Out::Err(e));
            }
        }
    }

    /// `shutdown(2)` bookkeeping; the caller then shuts down the real socket
    /// (the FIN is the peer's EOF, after the ring's bytes).
    pub fn shutdown(&self, how: c_int) {
        let s = self.seg.side(self.me);
        if how == libc::SHUT_WR || how == libc::SHUT_RDWR {
            s.shut_wr.store(1, Ordering::SeqCst);
        }
        if how == libc::SHUT_RD || how == libc::SHUT_RDWR {
            s.shut_rd.store(1, Ordering::SeqCst);
        }
    }

    /// The last descriptor of this process naming the connection is being
    /// closed (`fd` is still open). If we were the last holder anywhere,
    /// prepare the socket so its close is a FIN (or a RST when data is unread).
    pub fn release(&self, fd: c_int) {
        if self.me == crate::seg::SERVER && self.state() == crate::seg::PENDING {
            // Claimed and never used: the last holder gives it up at once,
            // so the client does not wait for an attach.
            if self.seg.side(self.me).holders.fetch_sub(1, Ordering::SeqCst) == 1 {
                let _ = self.seg.hdr().state.compare_exchange(
                    crate::seg::PENDING,
                    crate::seg::ABANDONED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
            return;
        }
        if self.state() != crate::seg::ATTACHED {
            // Never carried data on the ring: nothing to prepare.
            return;
        }
        let me = self.seg.side(self.me);
        // Other processes may still hold the socket (fork), or may not (a
        // child that exec'd closed its copy without telling us): drain stale
        // doorbells in any case, so whichever close is the kernel's last one
        // finds no unread bytes and sends a FIN, not a RST.
        self.settle_armed(fd);
        if me.holders.fetch_sub(1, Ordering::SeqCst) == 1 {
            me.closed.store(1, Ordering::SeqCst);
            // No more doorbells towards us.
            self.seg
                .ring(self.rx())
                .data_arm
                .0
                .store(0, Ordering::SeqCst);
            self.seg
                .ring(self.tx())
                .space_arm
                .0
                .store(0, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if !self.broken.load(Ordering::Relaxed) && self.used_rx().unwrap_or(0) > 0 {
                // TCP resets a connection closed with unread data.
                sockopt::linger(fd, true);
            } else {
                let mut buf = [0u8; 512];
                for _ in 0..1024 {
                    let r = if config::restricted() {
                        let mut p = libc::pollfd {
                            fd,
                            events: libc::POLLIN,
                            revents: 0,
                        };
                        // SAFETY: poll on one pollfd we own, not waiting;
                        // then a read that cannot block (readable).
                        unsafe {
                            real::poll(&mut p, 1, 0);
                            if p.revents & libc::POLLIN == 0 {
                                break;
                            }
                            real::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len())
                        }
                    } else {
                        // SAFETY: draining doorbells into a local buffer.
                        unsafe {
                            real::recv(
                                fd,
                                buf.as_mut_ptr() as *mut libc::c_void,
                                buf.len(),
                                libc::MSG_DONTWAIT,
                            )
                        }
                    };
                    if r <= 0 {
                        break;
                    }
                }
            }
        }
    }

    /// The last descriptor of this process naming the connection was closed
    /// in a way we did not see (a raw system call, io_uring): the socket is
    /// gone from this process, and its number may already name something
    /// else, so nothing is done through it. Only the shared bookkeeping
    /// follows: our holder count, and `closed` (so the peer's writes go to
    /// the kernel, which reports what TCP reports) when we were the last.
    pub fn release_gone(&self) {
        if self.state() == crate::seg::ATTACHED {
            let me = self.seg.side(self.me);
            if me.holders.fetch_sub(1, Ordering::SeqCst) == 1 {
                me.closed.store(1, Ordering::SeqCst);
                self.seg
                    .ring(self.rx())
                    .data_arm
                    .0
                    .store(0, Ordering::SeqCst);
                self.seg
                    .ring(self.tx())
                    .space_arm
                    .0
                    .store(0, Ordering::SeqCst);
            }
        }
    }

    /// The decided state (seg::PENDING, ATTACHED, ABANDONED).
    pub fn state(&self) -> u32 {
        self.seg.hdr().state.load(Ordering::Acquire)
    }
}
