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
//! "not readable" while data waits. Stale doorbells (for data already read) are
//! drained only when the ring is empty and re-armed, and never the byte of the
//! current arm, so at worst readiness is spurious, never missing.
//! Writers waiting for space arm `space_arm` the same way (bytes 128..=255).
//!
//! Closing and errors are the kernel's: FIN and RST travel on the real socket,
//! so EOF, EPOLLRDHUP, EPOLLHUP, ECONNRESET, EPIPE and SIGPIPE come from TCP
//! itself. Before its socket is closed the last holder drains its doorbells
//! (unread doorbells would turn the FIN into a RST) or, if application data is
//! unread, closes with a RST exactly as TCP does.

use crate::real;
use crate::seg::{Segment, ShmLock};
use libc::c_int;
use std::sync::atomic::{fence, AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a blocking call spins on the ring before sleeping on the socket.
fn spin_budget() -> Duration {
    static NS: AtomicU64 = AtomicU64::new(u64::MAX);
    let mut v = NS.load(Ordering::Relaxed);
    if v == u64::MAX {
        v = std::env::var("FIDO_NET_SPIN_US")
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(20)
            * 1000;
        NS.store(v, Ordering::Relaxed);
    }
    Duration::from_nanos(v)
}

/// Reads the environment once (at load).
pub fn read_config() {
    spin_budget();
    attach_wait();
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
    /// What a call that stops early returns: the bytes it already moved
    /// (POSIX: a partial count hides the error), else the error `e`.
    fn partial(n: usize, e: c_int) -> Out {
        if n > 0 {
            Out::Done(n)
        } else {
            Out::Err(e)
        }
    }
}

pub struct Conn {
    pub seg: Segment,
    /// Our side (seg::CLIENT or seg::SERVER).
    pub me: usize,
    /// O_NONBLOCK of the open file description, as last set through us.
    pub nonblock: AtomicBool,
    /// Descriptors of this process naming the connection.
    pub local_refs: AtomicU32,
    /// Client: the segment's memfd, kept until the fate is decided (-1 after).
    pub memfd: AtomicI32,
    /// Client: the registry key of the request (deleted if never attached).
    pub request_key: Option<String>,
    /// Set when the segment was found corrupt: the connection was reset.
    pub broken: AtomicBool,
    /// Client: the TCP connection completed (a non-blocking connect may still
    /// be in progress; until then the kernel answers every call).
    pub connected: AtomicBool,
    pub local: String,
    pub peer: String,
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

/// How one [`nap`] ended.
enum Nap {
    /// The socket's timeout (SO_RCVTIMEO/SO_SNDTIMEO) passed before the nap.
    TimedOut,
    /// A signal interrupted the poll (errno EINTR, read straight after it).
    Interrupted,
    /// Readable (a doorbell), the slice ran out, or another poll error: the
    /// caller looks at the ring again.
    Woke,
}

/// A blocking recv/send's sleep: at most 100 ms (less near the deadline) in
/// poll for `fd` readable, the doorbell of both directions. `deadline` holds
/// the socket's `opt` timeout, read on the first nap of the call.
fn nap(fd: c_int, opt: c_int, deadline: &mut Option<Option<Instant>>) -> Nap {
    let dl = *deadline.get_or_insert_with(|| timeout_opt(fd, opt).map(|d| Instant::now() + d));
    let mut slice = 100i32;
    if let Some(dl) = dl {
        let now = Instant::now();
        if now >= dl {
            return Nap::TimedOut;
        }
        slice = slice.min((dl - now).as_millis() as i32 + 1);
    }
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll on one pollfd we own.
    let r = unsafe { real::poll(&mut p, 1, slice) };
    if r < 0 && errno() == libc::EINTR {
        Nap::Interrupted
    } else {
        Nap::Woke
    }
}

fn timeout_opt(fd: c_int, opt: c_int) -> Option<Duration> {
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
        // SAFETY: one byte from a local onto the real socket.
        let r = unsafe {
            real::send(
                fd,
                &b as *const u8 as *const libc::c_void,
                1,
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
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

    /// Drains doorbell bytes that no longer cover anything: those of arms
    /// older than the current one, while our ring is empty. The byte of the
    /// current arm (and of a blocked writer's space arm) stays.
    fn drain_stale(&self, fd: c_int) {
        // Only with our ring empty: with data waiting, the oldest queued
        // doorbell may be the only one covering it.
        if self.used_rx().unwrap_or(1) != 0 {
            return;
        }
        let me = self.seg.side(self.me);
        let peer = self.seg.side(self.peer_side());
        let pend = peer
            .doorbells_sent
            .load(Ordering::SeqCst)
            .wrapping_sub(me.doorbells_drained.load(Ordering::SeqCst));
        if pend == 0 {
            return;
        }
        let mut buf = [0u8; 256];
        // A doorbell counted but not yet landed (the peer is between its count
        // and its send) would land after this drain and make the socket
        // readable with nothing to read — programs such as wrk treat that
        // EAGAIN as an error. Give in-flight doorbells a moment to land.
        let t0 = Instant::now();
        let n = loop {
            let pend = peer
                .doorbells_sent
                .load(Ordering::SeqCst)
                .wrapping_sub(me.doorbells_drained.load(Ordering::SeqCst));
            let want = pend.min(buf.len() as u64) as isize;
            // SAFETY: peek into a local buffer.
            let n = unsafe {
                real::recv(
                    fd,
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            if n >= want || n == 0 || t0.elapsed() > Duration::from_millis(2) {
                break n;
            }
            if n < 0 && errno() != libc::EAGAIN {
                break n;
            }
            std::thread::yield_now();
        };
        if n <= 0 {
            return;
        }
        let data_gen = me.data_gen.load(Ordering::SeqCst) as u8;
        let waiters = me.space_waiters.load(Ordering::SeqCst) > 0;
        let space_gen = me.space_gen.load(Ordering::SeqCst) as u8;
        let keep = |b: u8| b == data_gen || (waiters && b == space_gen);
        let k = buf[..n as usize].iter().take_while(|&&b| !keep(b)).count();
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
        }
    }

    /// What the kernel says about the socket, without consuming it.
    fn kernel_state(&self, fd: c_int) -> KState {
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
                e => KState::Err(e),
            },
        }
    }

    /// The segment lied (an index out of range): reset the TCP connection so
    /// the peer gets ECONNRESET, and hand the socket to the kernel from now on.
    fn reset(&self, fd: c_int) {
        self.broken.store(true, Ordering::SeqCst);
        let sa = libc::sockaddr {
            sa_family: libc::AF_UNSPEC as libc::sa_family_t,
            sa_data: [0; 14],
        };
        // SAFETY: connect(AF_UNSPEC) disconnects a TCP socket (sending RST).
        unsafe {
            real::connect(
                fd,
                &sa,
                std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
            )
        };
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
        let entry = if crate::debug_on() {
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
                    return Out::partial(got, libc::ECONNRESET);
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
                    // Leave only after arming on an empty ring (so data that
                    // comes next rings the socket: an edge for EPOLLET users).
                    match self.used_rx() {
                        Ok(0) => {
                            self.arm_data();
                            if self.used_rx().unwrap_or(0) > 0 && got < total {
                                continue;
                            }
                            self.drain_stale(fd);
                        }
                        Ok(_) => {}
                        Err(_) => {}
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
            self.arm_data();
            if self.used_rx().unwrap_or(0) > 0 {
                continue;
            }
            self.drain_stale(fd);
            match self.kernel_state(fd) {
                KState::Eof => {
                    if self.used_rx().unwrap_or(0) > 0 {
                        continue;
                    }
                    crate::debug!("recv fd {fd}: EOF after {got}");
                    return Out::Done(got);
                }
                KState::Err(e) => {
                    if self.used_rx().unwrap_or(0) > 0 {
                        continue;
                    }
                    return Out::partial(got, e);
                }
                KState::Empty | KState::Bytes => {}
            }
            if nonblock {
                if got == 0 && crate::debug_on() {
                    let k = self.kernel_state(fd);
                    let me = self.seg.side(self.me);
                    let peer = self.seg.side(self.peer_side());
                    crate::debug!(
                        "recv fd {fd}: EAGAIN (at entry {entry}, now {}, gen {}, arm {}, sent {} drained {})",
                        match k { KState::Bytes => "bytes", KState::Empty => "empty", KState::Eof => "eof", KState::Err(_) => "err" },
                        me.data_gen.load(Ordering::SeqCst),
                        self.seg.ring(rx).data_arm.0.load(Ordering::SeqCst),
                        peer.doorbells_sent.load(Ordering::SeqCst),
                        me.doorbells_drained.load(Ordering::SeqCst)
                    );
                }
                return Out::partial(got, libc::EAGAIN);
            }
            // Blocking: spin on the ring, then sleep on the socket. We stay
            // armed while spinning: reclaiming the arm would let data arrive
            // without a doorbell, and a later return with data still in the
            // ring would leave the socket unreadable (a lost wake-up).
            if !spun {
                spun = true;
                let t0 = Instant::now();
                let budget = spin_budget();
                while t0.elapsed() < budget {
                    if self.used_rx().unwrap_or(1) > 0 {
                        break;
                    }
                    std::hint::spin_loop();
                }
                continue; // re-arms above if still empty
            }
            match nap(fd, libc::SO_RCVTIMEO, &mut deadline) {
                Nap::TimedOut => return Out::partial(got, libc::EAGAIN),
                Nap::Interrupted => return Out::partial(got, libc::EINTR),
                Nap::Woke => {}
            }
        }
    }

    pub fn send(&self, fd: c_int, bufs: &[&[u8]], flags: c_int) -> Out {
        if self.broken.load(Ordering::Relaxed) {
            return Out::Kernel;
        }
        let me = self.seg.side(self.me);
        let peer = self.seg.side(self.peer_side());
        if me.shut_wr.load(Ordering::Relaxed) != 0 || peer.closed.load(Ordering::SeqCst) != 0 {
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
                    return if sent > 0 {
                        Out::Done(sent)
                    } else {
                        Out::Kernel
                    };
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
                return if sent > 0 {
                    Out::Done(sent)
                } else {
                    Out::Kernel
                };
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
                return if sent > 0 {
                    Out::Done(sent)
                } else {
                    Out::Kernel
                };
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
                    self.drain_stale(fd);
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
                    unsafe { libc::ppoll(&mut p, 1, &ts, std::ptr::null()) };
                    me.space_waiters.fetch_sub(1, Ordering::SeqCst);
                    if self.free_tx().unwrap_or(0) > 0 {
                        continue;
                    }
                }
                return Out::Err(libc::EAGAIN);
            }
            if !spun {
                spun = true;
                let t0 = Instant::now();
                let budget = spin_budget();
                while t0.elapsed() < budget {
                    if self.free_tx().unwrap_or(1) > 0 {
                        break;
                    }
                    std::hint::spin_loop();
                }
                if self.free_tx().unwrap_or(1) > 0 {
                    continue;
                }
            }
            me.space_waiters.fetch_add(1, Ordering::SeqCst);
            self.arm_space();
            if self.free_tx().unwrap_or(1) > 0 {
                me.space_waiters.fetch_sub(1, Ordering::SeqCst);
                continue;
            }
            self.drain_stale(fd);
            let woke = nap(fd, libc::SO_SNDTIMEO, &mut deadline);
            me.space_waiters.fetch_sub(1, Ordering::SeqCst);
            match woke {
                Nap::TimedOut => return Out::partial(sent, libc::EAGAIN),
                Nap::Interrupted => return Out::partial(sent, libc::EINTR),
                Nap::Woke => {}
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
        if self.state() != crate::seg::ATTACHED {
            // Never carried data on the ring: nothing to prepare.
            let m = self.memfd.swap(-1, Ordering::SeqCst);
            if m >= 0 {
                // SAFETY: our own memfd.
                unsafe { real::close(m) };
            }
            return;
        }
        let me = self.seg.side(self.me);
        // Other processes may still hold the socket (fork), or may not (a
        // child that exec'd closed its copy without telling us): drain stale
        // doorbells in any case, so whichever close is the kernel's last one
        // finds no unread bytes and sends a FIN, not a RST.
        self.drain_stale(fd);
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
                let l = libc::linger {
                    l_onoff: 1,
                    l_linger: 0,
                };
                // SAFETY: setsockopt with a linger struct.
                unsafe {
                    libc::setsockopt(
                        fd,
                        libc::SOL_SOCKET,
                        libc::SO_LINGER,
                        &l as *const _ as *const libc::c_void,
                        std::mem::size_of::<libc::linger>() as libc::socklen_t,
                    )
                };
            } else {
                let mut buf = [0u8; 512];
                for _ in 0..1024 {
                    // SAFETY: draining doorbells into a local buffer.
                    let r = unsafe {
                        real::recv(
                            fd,
                            buf.as_mut_ptr() as *mut libc::c_void,
                            buf.len(),
                            libc::MSG_DONTWAIT,
                        )
                    };
                    if r <= 0 {
                        break;
                    }
                }
            }
        }
        let m = self.memfd.swap(-1, Ordering::SeqCst);
        if m >= 0 {
            // SAFETY: our own memfd.
            unsafe { real::close(m) };
        }
    }

    /// The decided state (seg::PENDING, ATTACHED, ABANDONED).
    pub fn state(&self) -> u32 {
        self.seg.hdr().state.load(Ordering::Acquire)
    }

    /// Client, before its first byte: wait (bounded) for the server to
    /// attach; if it does not, abandon so both ends stay plain TCP.
    /// Returns true when the ring is to be used.
    pub fn decide(&self) -> bool {
        let h = self.seg.hdr();
        let mut st = h.state.load(Ordering::Acquire);
        if st == crate::seg::PENDING {
            let t0 = Instant::now();
            let limit = attach_wait();
            let mut i = 0u32;
            while st == crate::seg::PENDING && t0.elapsed() < limit {
                if i < 1000 {
                    std::hint::spin_loop();
                } else {
                    std::thread::sleep(Duration::from_micros(200));
                }
                i += 1;
                st = h.state.load(Ordering::Acquire);
            }
            if st == crate::seg::PENDING {
                st = match h.state.compare_exchange(
                    crate::seg::PENDING,
                    crate::seg::ABANDONED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        crate::debug!(
                            "client {} -> {}: server did not attach in {:?}; plain TCP",
                            self.local,
                            self.peer,
                            limit
                        );
                        crate::broker::count_plain();
                        if let Some(k) = &self.request_key {
                            crate::broker::delete_key(k);
                        }
                        crate::seg::ABANDONED
                    }
                    Err(now) => now,
                };
            }
        }
        if st != crate::seg::PENDING {
            let m = self.memfd.swap(-1, Ordering::SeqCst);
            if m >= 0 {
                if st == crate::seg::ATTACHED {
                    crate::broker::count_accelerated();
                }
                // SAFETY: our own memfd.
                unsafe { real::close(m) };
            }
        }
        st == crate::seg::ATTACHED
    }
}

/// How long a client's first I/O waits for the server to attach
/// (`FIDO_NET_ATTACH_MS`, default 500).
fn attach_wait() -> Duration {
    static MS: AtomicU64 = AtomicU64::new(u64::MAX);
    let mut v = MS.load(Ordering::Relaxed);
    if v == u64::MAX {
        v = std::env::var("FIDO_NET_ATTACH_MS")
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(500);
        MS.store(v, Ordering::Relaxed);
    }
    Duration::from_millis(v)
}
