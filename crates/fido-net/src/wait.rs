//! `poll`, `select` and `epoll` over accelerated sockets (lazy arming).
//!
//! With lazy arming (see `conn`) a reader does not arm its ring when it leaves
//! with the ring empty, so the kernel no longer learns when data arrives: these
//! wrappers compute readability of accelerated sockets from the ring and let
//! the kernel answer for everything else. A wait runs in three steps:
//!
//! 1. **Look**: one non-blocking kernel call on the program's own set, then
//!    fix up the accelerated entries: readable iff the ring holds data, or
//!    the kernel has EOF/an error behind the doorbells (drained: they only
//!    woke a sleeper). Ready now → return.
//! 2. **Spin** (`FIDO_NET_SPIN_US`, default 20 µs, never beyond the timeout):
//!    watch the rings, looking at the kernel every few microseconds. Signals
//!    are blocked meanwhile so one arriving now still interrupts the sleep
//!    below (`EINTR`) instead of being consumed unseen.
//! 3. **Sleep**: arm every watched ring (`Conn::sleep_begin`, which re-checks
//!    it), then sleep in the kernel with the program's signal mask
//!    (`ppoll`/`epoll_pwait`/`pselect`); a writer rings because we armed.
//!    Disarm, fix up, and go back to sleep if the wake-up was only stale
//!    doorbells.
//!
//! A program that waits for an accelerated socket in a way we cannot see
//! (an epoll set nested in another, `EPOLLONESHOT`/`EPOLLEXCLUSIVE`, a wait
//! made through `syscall(2)`, an epoll set shared across `fork` or duplicated)
//! turns the affected connections — or, when we cannot tell which, all of
//! them — back to eager arming, where the kernel's readiness is exact on its
//! own (`Conn::make_eager`). `FIDO_NET_LAZY=0` makes every connection eager.
//!
//! Must never: report an accelerated socket not readable while its ring holds
//! data or the kernel holds EOF, or sleep without every watched ring armed.

use crate::config::{self, lazy_allowed};
use crate::conn::Conn;
use crate::handshake::{attached, first_use};
use crate::sys::{debug, errno, set_errno};
use crate::{real, table};
use libc::{c_int, epoll_event, nfds_t, pollfd, sigset_t, timespec};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The program waits in a way we cannot attribute: every connection of this
/// process, now and later, arms eagerly.
pub fn all_eager(why: &str) {
    if config::give_up_lazy() {
        debug!("lazy arming off for this process: {why}");
    }
    for c in table::all() {
        c.make_eager();
    }
}

// ---- epoll registrations --------------------------------------------------

/// What the program registered for one descriptor in one epoll set.
#[derive(Clone, Copy)]
struct Reg {
    events: u32,
    data: u64,
    /// `rx_head` when we last reported it readable (edge detection).
    last_head: u64,
}

#[derive(Default)]
struct EpollSet {
    regs: HashMap<c_int, Reg>,
    /// Inherited across (or present at) a `fork`: the other process may add
    /// connections we never see, so members are made eager.
    shared: bool,
}

static EPOLLS: Mutex<Option<HashMap<c_int, EpollSet>>> = Mutex::new(None);

pub fn epoll_created(epfd: c_int) {
    if epfd >= 0 {
        EPOLLS
            .lock()
            .get_or_insert_with(HashMap::new)
            .insert(epfd, EpollSet::default());
    }
}

fn is_epoll(fd: c_int) -> bool {
    EPOLLS.lock().as_ref().is_some_and(|m| m.contains_key(&fd))
}

/// The connection behind `fd` if it is accelerated and arms lazily.
fn lazy_conn(fd: c_int) -> Option<Arc<Conn>> {
    let c = attached(fd)?;
    c.is_lazy().then_some(c)
}

/// A connection whose readability a wait through this library must compute:
/// a lazy one, or — under a seccomp filter — one holding a doorbell it read
/// off the socket (`Conn::holds_doorbell`): the kernel no longer shows that
/// byte, so an eager connection's wait left to the kernel slept with data
/// in the ring (sshd's pre-auth child hung waiting for a request it had).
fn watched_conn(fd: c_int) -> Option<Arc<Conn>> {
    let c = attached(fd)?;
    (c.is_lazy() && lazy_allowed() || c.holds_doorbell()).then_some(c)
}

/// After a successful `epoll_ctl`.
pub fn epoll_ctl_done(epfd: c_int, op: c_int, fd: c_int, ev: Option<&epoll_event>) {
    if op != libc::EPOLL_CTL_DEL {
        // Registering a claimed connection is its first use (see `poll_common`).
        first_use(fd);
    }
    if is_epoll(fd) {
        all_eager("an epoll set nested in another");
    }
    let mut g = EPOLLS.lock();
    let Some(set) = g.as_mut().and_then(|m| m.get_mut(&epfd)) else {
        drop(g);
        // A set created before us or through syscall(2): we cannot see it.
        if lazy_conn(fd).is_some() {
            all_eager("epoll_ctl on an epoll set we did not see created");
        }
        return;
    };
    match (op, ev) {
        (libc::EPOLL_CTL_DEL, _) => {
            set.regs.remove(&fd);
        }
        (libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD, Some(ev)) => {
            let events = ev.events;
            let shared = set.shared;
            set.regs.insert(
                fd,
                Reg {
                    events,
                    data: ev.u64,
                    last_head: u64::MAX,
                },
            );
            drop(g);
            let odd = events & (libc::EPOLLONESHOT as u32 | libc::EPOLLEXCLUSIVE as u32) != 0;
            if odd || shared {
                if let Some(c) = lazy_conn(fd) {
                    c.make_eager();
                }
            }
        }
        _ => {}
    }
}

/// `fd` is being closed (or replaced by `dup2`).
pub fn forget(fd: c_int) {
    let mut g = EPOLLS.lock();
    let Some(m) = g.as_mut() else { return };
    m.remove(&fd);
    let mut registered = false;
    for set in m.values_mut() {
        registered |= set.regs.remove(&fd).is_some();
    }
    drop(g);
    // The kernel keeps a registration while another descriptor names the
    // same socket; we no longer know its data: eager from now on.
    if registered {
        if let Some(c) = lazy_conn(fd) {
            if c.local_refs.load(Ordering::SeqCst) > 1 {
                c.make_eager();
            }
        }
    }
}

/// `dup`/`dup2`/`F_DUPFD` of `old`: an epoll set with two names would need
/// its registrations tracked per open file description.
pub fn duplicated(old: c_int) {
    if is_epoll(old) {
        all_eager("an epoll descriptor duplicated");
    }
}

/// `fork` (atfork prepare): hold the registrations' lock across it.
pub fn fork_prepare() {
    std::mem::forget(EPOLLS.lock());
}

/// `fork` (atfork parent and child, after the connection table is unlocked):
/// release the lock; every epoll set is now shared by two processes.
pub fn fork_after() {
    // SAFETY: fork_prepare locked it and forgot the guard, on this thread.
    unsafe { EPOLLS.force_unlock() };
    forked();
}

fn forked() {
    let mut members = Vec::new();
    if let Some(m) = EPOLLS.lock().as_mut() {
        for set in m.values_mut() {
            set.shared = true;
            members.extend(set.regs.keys().copied());
        }
    }
    for fd in members {
        if let Some(c) = lazy_conn(fd) {
            c.make_eager();
        }
    }
}

/// `syscall(2)` with number `n`: a wait we cannot see.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub fn raw_syscall(n: libc::c_long) {
    #[cfg(target_arch = "x86_64")]
    let waits = [
        libc::SYS_poll,
        libc::SYS_ppoll,
        libc::SYS_select,
        libc::SYS_pselect6,
        libc::SYS_epoll_wait,
        libc::SYS_epoll_pwait,
        libc::SYS_epoll_pwait2,
        libc::SYS_epoll_ctl,
    ];
    // AArch64 has no poll, select or epoll_wait system calls.
    #[cfg(not(target_arch = "x86_64"))]
    let waits = [
        libc::SYS_ppoll,
        libc::SYS_pselect6,
        libc::SYS_epoll_pwait,
        libc::SYS_epoll_pwait2,
        libc::SYS_epoll_ctl,
    ];
    // Sticky even before the first accelerated connection: a program that
    // waits this way once likely always does.
    if waits.contains(&n) && lazy_allowed() {
        all_eager("a wait made through syscall(2)");
    }
}

// ---- shared machinery --------------------------------------------------------

/// Blocks every signal for the spin, keeping the program's mask for the sleep.
struct SigBlock {
    old: sigset_t,
}

impl SigBlock {
    fn new() -> SigBlock {
        // SAFETY: sigset_t is plain data; filled/used by libc below.
        let mut all: sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut old: sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid sigset pointers.
        unsafe {
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        }
        SigBlock { old }
    }
}

impl Drop for SigBlock {
    fn drop(&mut self) {
        // SAFETY: restoring the mask saved in `new` on this thread.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut()) };
    }
}

/// Every watched ring armed for one sleep; disarmed on drop.
struct Sleep<'a> {
    armed: Vec<&'a Conn>,
}

impl<'a> Sleep<'a> {
    /// `None` when a ring already holds data (do not sleep).
    fn begin(watches: impl Iterator<Item = (c_int, &'a Conn)>) -> Option<Sleep<'a>> {
        let mut s = Sleep { armed: Vec::new() };
        for (fd, c) in watches {
            if !c.sleep_begin(fd) {
                return None;
            }
            s.armed.push(c);
        }
        Some(s)
    }
}

impl Drop for Sleep<'_> {
    fn drop(&mut self) {
        for c in &self.armed {
            c.sleep_end();
        }
    }
}

/// When the wait must end (`None`: never).
fn deadline_ms(timeout_ms: c_int) -> Option<Instant> {
    (timeout_ms >= 0).then(|| Instant::now() + Duration::from_millis(timeout_ms as u64))
}

fn deadline_ts(ts: *const timespec) -> Option<Instant> {
    if ts.is_null() {
        return None;
    }
    // SAFETY: the program's non-null timespec (validated by `dl_ts`).
    let t = unsafe { *ts };
    Some(Instant::now() + Duration::new(t.tv_sec as u64, t.tv_nsec as u32))
}

fn remaining(dl: Option<Instant>) -> Option<Duration> {
    dl.map(|d| d.saturating_duration_since(Instant::now()))
}

fn to_ms(r: Option<Duration>) -> c_int {
    match r {
        None => -1,
        Some(d) => d.as_nanos().div_ceil(1_000_000).min(c_int::MAX as u128) as c_int,
    }
}

fn to_ts(r: Duration) -> timespec {
    timespec {
        tv_sec: r.as_secs() as libc::time_t,
        tv_nsec: r.subsec_nanos() as libc::c_long,
    }
}

/// Spins until a watched ring holds data, `kernel()` reports something, or the
/// budget (capped by the deadline) is spent.
fn spin(dl: Option<Instant>, any_data: impl Fn() -> bool, kernel: impl FnMut() -> bool) {
    let mut budget = config::spin_budget();
    if let Some(r) = remaining(dl) {
        budget = budget.min(r);
    }
    let i = std::cell::Cell::new(0u32);
    let kernel = std::cell::RefCell::new(kernel);
    crate::conn::spin_until(budget, || {
        i.set(i.get().wrapping_add(1));
        any_data() || (i.get() % 64 == 0 && (kernel.borrow_mut())())
    });
}

// ---- poll ------------------------------------------------------------------

/// Accelerated lazy entries of a pollfd array that ask for readability.
fn poll_watches(fds: &[pollfd]) -> Vec<(usize, Arc<Conn>)> {
    let mut v = Vec::new();
    // With lazy arming off there is nothing to fix up (`all_eager` made every
    // connection eager, and new ones are created eager) but held doorbells.
    if table::count() == 0 {
        return v;
    }
    if !lazy_allowed() {
        for (i, p) in fds.iter().enumerate() {
            if let Some(c) = watched_conn(p.fd).filter(|_| p.events & (libc::POLLIN | libc::POLLRDNORM) != 0) {
                v.push((i, c));
            }
        }
        return v;
    }
    const RD: libc::c_short = libc::POLLIN | libc::POLLRDNORM;
    // One look at the registrations for the whole array (not a lock per entry).
    let epoll_polled = {
        let g = EPOLLS.lock();
        g.as_ref().is_some_and(|m| {
            fds.iter()
                .any(|p| p.events & RD != 0 && m.contains_key(&p.fd))
        })
    };
    if epoll_polled {
        all_eager("an epoll descriptor polled");
        return v;
    }
    for (i, p) in fds.iter().enumerate() {
        if p.events & RD == 0 {
            continue;
        }
        if let Some(c) = watched_conn(p.fd) {
            v.push((i, c));
        }
    }
    v
}

/// Fixes up the readability of the watched entries after a kernel look;
/// returns the number of entries with events.
fn poll_fixup(fds: &mut [pollfd], watches: &[(usize, Arc<Conn>)]) -> c_int {
    const RD: libc::c_short = libc::POLLIN | libc::POLLRDNORM;
    for (i, c) in watches {
        let p = &mut fds[*i];
        let readable = if p.revents & RD != 0 {
            c.kernel_readable(p.fd)
        } else {
            c.has_data()
        };
        if readable {
            p.revents |= p.events & RD;
        } else {
            p.revents &= !RD;
        }
        if c.has_kernel_err() {
            p.revents |= libc::POLLERR;
        }
    }
    fds.iter().filter(|p| p.revents != 0).count() as c_int
}

/// `poll`/`ppoll` with the accelerated entries' readability from their rings.
///
/// # Safety
/// `fds` valid for `n` entries; `sigmask` null or valid (the program's contract).
pub unsafe fn poll_common(
    fds: *mut pollfd,
    n: nfds_t,
    dl: Option<Instant>,
    zero: bool,
    sigmask: *const sigset_t,
    forward: impl FnOnce() -> c_int,
) -> c_int {
    if fds.is_null() || n == 0 || table::count() == 0 {
        return forward();
    }
    // SAFETY: the program's array of `n` pollfds.
    let arr = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
    // Waiting on a claimed connection is its first use: it goes on the ring
    // now (its client waits for that before writing).
    for p in arr.iter() {
        first_use(p.fd);
    }
    let watches = poll_watches(arr);
    if watches.is_empty() {
        return forward();
    }
    let look = |arr: &mut [pollfd]| -> c_int {
        // SAFETY: the program's array.
        let r = unsafe { real::poll(arr.as_mut_ptr(), n, 0) };
        if r < 0 {
            return r;
        }
        poll_fixup(arr, &watches)
    };
    let r = look(arr);
    if r != 0 || zero {
        return r;
    }
    {
        let _b = SigBlock::new();
        let any = || watches.iter().any(|(_, c)| c.has_data());
        spin(dl, any, || {
            // SAFETY: as above.
            unsafe { real::poll(arr.as_mut_ptr(), n, 0) > 0 }
        });
    }
    let r = look(arr);
    if r != 0 {
        return r;
    }
    loop {
        let b = SigBlock::new();
        let mask: *const sigset_t = if sigmask.is_null() { &b.old } else { sigmask };
        let rem = remaining(dl);
        let Some(sleep) = Sleep::begin(watches.iter().map(|(i, c)| (arr[*i].fd, &**c))) else {
            drop(b);
            return look(arr);
        };
        let ts = rem.map(to_ts);
        let tsp = ts
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const timespec);
        // SAFETY: the program's array; a valid timespec and sigmask.
        let r = unsafe { real::ppoll(arr.as_mut_ptr(), n, tsp, mask) };
        let e = errno();
        drop(sleep);
        drop(b);
        if r < 0 {
            set_errno(e);
            return r;
        }
        let k = poll_fixup(arr, &watches);
        if k > 0 || r == 0 || remaining(dl).is_some_and(|d| d.is_zero()) {
            return k;
        }
        // Only stale doorbells woke us: sleep again.
    }
}

// ---- select -------------------------------------------------------------------

/// `select`/`pselect` with accelerated sockets in the read set, done through
/// `poll_common` (same readiness rules as the kernel's select: readable =
/// POLLIN|POLLHUP|POLLERR, writable = POLLOUT|POLLERR, except = POLLPRI).
/// Returns `None` when there is nothing to fix up (the caller forwards).
///
/// # Safety
/// The sets are null or valid `fd_set`s covering `nfds` (the program's contract).
pub unsafe fn select_common(
    nfds: c_int,
    rd: *mut libc::fd_set,
    wr: *mut libc::fd_set,
    ex: *mut libc::fd_set,
    dl: Option<Instant>,
    zero: bool,
    sigmask: *const sigset_t,
) -> Option<c_int> {
    if table::count() == 0 || !(0..=libc::FD_SETSIZE as c_int).contains(&nfds) {
        return None;
    }
    // SAFETY: FD_ISSET on the program's sets below nfds.
    let isset = |s: *mut libc::fd_set, fd: c_int| !s.is_null() && unsafe { libc::FD_ISSET(fd, s) };
    // Waiting on a claimed connection is its first use (see `poll_common`).
    for fd in 0..nfds {
        if isset(rd, fd) || isset(wr, fd) {
            first_use(fd);
        }
    }
    if rd.is_null() {
        return None;
    }
    if !(0..nfds).any(|fd| isset(rd, fd) && watched_conn(fd).is_some()) {
        return None;
    }
    let mut pfds: Vec<pollfd> = Vec::new();
    for fd in 0..nfds {
        let mut ev = 0;
        if isset(rd, fd) {
            ev |= libc::POLLIN;
        }
        if isset(wr, fd) {
            ev |= libc::POLLOUT;
        }
        if isset(ex, fd) {
            ev |= libc::POLLPRI;
        }
        if ev != 0 {
            pfds.push(pollfd {
                fd,
                events: ev,
                revents: 0,
            });
        }
    }
    let np = pfds.len() as nfds_t;
    let ptr = pfds.as_mut_ptr();
    let forward = || {
        let ts = remaining(dl).map(to_ts);
        let tsp = ts
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const timespec);
        // SAFETY: our own array.
        unsafe { real::ppoll(ptr, np, tsp, sigmask) }
    };
    // SAFETY: our own array of np entries.
    let r = unsafe { poll_common(ptr, np, dl, zero, sigmask, forward) };
    if r < 0 {
        return Some(r);
    }
    if pfds.iter().any(|p| p.revents & libc::POLLNVAL != 0) {
        set_errno(libc::EBADF);
        return Some(-1);
    }
    let mut count = 0;
    for s in [rd, wr, ex] {
        if !s.is_null() {
            // SAFETY: the program's set.
            unsafe { libc::FD_ZERO(s) };
        }
    }
    for p in &pfds {
        let set = |s: *mut libc::fd_set, on: bool, count: &mut c_int| {
            if on && !s.is_null() {
                // SAFETY: fd < nfds <= FD_SETSIZE.
                unsafe { libc::FD_SET(p.fd, s) };
                *count += 1;
            }
        };
        let re = p.revents;
        set(
            rd,
            p.events & libc::POLLIN != 0
                && re & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0,
            &mut count,
        );
        set(
            wr,
            p.events & libc::POLLOUT != 0 && re & (libc::POLLOUT | libc::POLLERR) != 0,
            &mut count,
        );
        set(
            ex,
            p.events & libc::POLLPRI != 0 && re & libc::POLLPRI != 0,
            &mut count,
        );
    }
    Some(count)
}

// ---- epoll -----------------------------------------------------------------------

struct EpWatch {
    fd: c_int,
    conn: Arc<Conn>,
    events: u32,
    data: u64,
    last_head: u64,
}

/// The lazy accelerated members of `epfd` that ask for readability; `None`
/// when the set is unknown to us (then, if lazy connections exist, everything
/// turns eager and the kernel answers).
fn ep_watches(epfd: c_int) -> Option<Vec<EpWatch>> {
    let g = EPOLLS.lock();
    let Some(set) = g.as_ref().and_then(|m| m.get(&epfd)) else {
        drop(g);
        if lazy_allowed() {
            all_eager("epoll_wait on an epoll set we did not see created");
        }
        return None;
    };
    let regs: Vec<(c_int, Reg)> = set
        .regs
        .iter()
        .filter(|(_, r)| r.events & libc::EPOLLIN as u32 != 0)
        .map(|(fd, r)| (*fd, *r))
        .collect();
    let shared = set.shared;
    drop(g);
    let mut v = Vec::new();
    for (fd, r) in regs {
        if let Some(c) = watched_conn(fd) {
            // (Checked here too: a connection may have been pending when it
            // was registered, and accelerated since.)
            let odd = r.events & (libc::EPOLLONESHOT as u32 | libc::EPOLLEXCLUSIVE as u32) != 0;
            if shared || odd {
                if c.is_lazy() {
                    c.make_eager();
                }
                continue;
            }
            if v.iter().any(|w: &EpWatch| w.data == r.data) {
                // Two members with the same data: events cannot be told apart.
                all_eager("two epoll members registered with the same data");
                return Some(Vec::new());
            }
            v.push(EpWatch {
                fd,
                conn: c,
                events: r.events,
                data: r.data,
                last_head: r.last_head,
            });
        }
    }
    Some(v)
}

fn ep_save(epfd: c_int, watches: &[EpWatch]) {
    if let Some(set) = EPOLLS.lock().as_mut().and_then(|m| m.get_mut(&epfd)) {
        for w in watches {
            if let Some(r) = set.regs.get_mut(&w.fd) {
                if r.data == w.data {
                    r.last_head = w.last_head;
                }
            }
        }
    }
}

/// Fixes up `n` kernel events and appends events for watched rings with data
/// the kernel did not report; returns the new count.
fn ep_fixup(evs: &mut [epoll_event], n: usize, watches: &mut [EpWatch], start: usize) -> usize {
    const IN: u32 = libc::EPOLLIN as u32 | libc::EPOLLRDNORM as u32;
    let mut seen = vec![false; watches.len()];
    let mut out = 0;
    for i in 0..n {
        let mut e = evs[i];
        let data = e.u64;
        if let Some(k) = watches.iter().position(|w| w.data == data) {
            seen[k] = true;
            let w = &mut watches[k];
            let head = w.conn.rx_head();
            let readable = if e.events & IN != 0 {
                w.conn.kernel_readable(w.fd)
            } else {
                w.conn.has_data()
            };
            let edge =
                w.events & libc::EPOLLET as u32 == 0 || head != w.last_head || !w.conn.has_data();
            if readable && edge {
                e.events |= w.events & IN;
                w.last_head = head;
            } else {
                e.events &= !IN;
            }
            if w.conn.has_kernel_err() {
                e.events |= libc::EPOLLERR as u32;
            }
            if e.events == 0 {
                continue;
            }
        }
        evs[out] = e;
        out += 1;
    }
    let len = watches.len();
    for j in 0..len {
        if out == evs.len() {
            break;
        }
        let k = (start + j) % len;
        if seen[k] {
            continue;
        }
        let w = &mut watches[k];
        if !w.conn.has_data() {
            continue;
        }
        let head = w.conn.rx_head();
        if w.events & libc::EPOLLET as u32 != 0 && head == w.last_head {
            continue;
        }
        w.last_head = head;
        evs[out] = epoll_event {
            events: w.events & (IN | libc::EPOLLOUT as u32 | libc::EPOLLWRNORM as u32),
            u64: w.data,
        };
        out += 1;
    }
    out
}

static ROTATE: AtomicU64 = AtomicU64::new(0);

/// `epoll_wait`/`epoll_pwait`/`epoll_pwait2` with accelerated members'
/// readability from their rings.
///
/// # Safety
/// `evs` valid for `max` entries; `sigmask` null or valid.
pub unsafe fn epoll_common(
    epfd: c_int,
    evs: *mut epoll_event,
    max: c_int,
    dl: Option<Instant>,
    zero: bool,
    sigmask: *const sigset_t,
    forward: impl FnOnce() -> c_int,
) -> c_int {
    // (A held doorbell exists only under a seccomp filter: see `watched_conn`.)
    if table::count() == 0 || !(lazy_allowed() || crate::config::restricted()) || evs.is_null() || max <= 0 {
        return forward();
    }
    let Some(mut watches) = ep_watches(epfd) else {
        return forward();
    };
    if watches.is_empty() {
        return forward();
    }
    // SAFETY: the program's array of `max` events.
    let arr = unsafe { std::slice::from_raw_parts_mut(evs, max as usize) };
    let start = ROTATE.fetch_add(1, Ordering::Relaxed) as usize % watches.len();
    let look = |arr: &mut [epoll_event], watches: &mut [EpWatch]| -> c_int {
        // SAFETY: the program's array.
        let r = unsafe { real::epoll_wait(epfd, arr.as_mut_ptr(), max, 0) };
        if r < 0 {
            return r;
        }
        ep_fixup(arr, r as usize, watches, start) as c_int
    };
    let result = 'done: {
        let r = look(arr, &mut watches);
        if r != 0 || zero {
            break 'done r;
        }
        {
            let _b = SigBlock::new();
            let any = || watches.iter().any(|w| w.conn.has_data());
            // SAFETY: as above.
            spin(dl, any, || unsafe {
                real::epoll_wait(epfd, arr.as_mut_ptr(), max, 0) > 0
            });
        }
        let r = look(arr, &mut watches);
        if r != 0 {
            break 'done r;
        }
        loop {
            let b = SigBlock::new();
            let mask: *const sigset_t = if sigmask.is_null() { &b.old } else { sigmask };
            let rem = remaining(dl);
            let Some(sleep) = Sleep::begin(watches.iter().map(|w| (w.fd, &*w.conn))) else {
                drop(b);
                break 'done look(arr, &mut watches);
            };
            // SAFETY: the program's array; a valid sigmask.
            let r = unsafe { real::epoll_pwait(epfd, arr.as_mut_ptr(), max, to_ms(rem), mask) };
            let e = errno();
            drop(sleep);
            drop(b);
            if r < 0 {
                set_errno(e);
                break 'done r;
            }
            let k = ep_fixup(arr, r as usize, &mut watches, start) as c_int;
            if k > 0 || r == 0 || remaining(dl).is_some_and(|d| d.is_zero()) {
                break 'done k;
            }
        }
    };
    if result > 0 {
        ep_save(epfd, &watches);
    }
    result
}

/// Deadline of an `epoll_wait`-style millisecond timeout.
pub fn dl_ms(timeout: c_int) -> (Option<Instant>, bool) {
    (deadline_ms(timeout), timeout == 0)
}

/// Deadline of a `ppoll`/`epoll_pwait2`-style timespec.
/// `None` for an invalid timespec: the caller forwards the call, so the
/// kernel answers `EINVAL` as it would.
pub fn dl_ts(ts: *const timespec) -> Option<(Option<Instant>, bool)> {
    // SAFETY: the program's timespec, if not null.
    let t = unsafe { ts.as_ref() };
    if t.is_some_and(|t| t.tv_sec < 0 || !(0..1_000_000_000).contains(&t.tv_nsec)) {
        return None;
    }
    let zero = t.is_some_and(|t| t.tv_sec == 0 && t.tv_nsec == 0);
    Some((deadline_ts(ts), zero))
}
