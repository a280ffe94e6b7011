//! The interposed waits — `poll`, `ppoll`, `select`, `pselect` and the
//! `epoll` calls — as entry points: the program's timeout turned into a
//! deadline, a panic fenced, and `wait`'s lazy-readiness machinery run with
//! libc's own call as the kernel's answer (see `wait` for the algorithm).
//!
//! Must never: change what a wait reports for descriptors that are not
//! accelerated, or report a timeout other than the program's.
//!
//! # Safety (every `pub unsafe fn` here)
//! The arguments are what the program passed to the libc call of the same
//! name, under that call's contract.

use crate::real;
use crate::sys::{errno, guard, set_errno};
use crate::wait;
use libc::c_int;

/// Runs a wait wrapper; a bug in it (a panic) must not unwind into C: the
/// program sees an interrupted call, which every caller of these retries.
fn wait_guard(f: impl FnOnce() -> c_int) -> c_int {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        set_errno(libc::EINTR);
        -1
    })
}

pub unsafe fn epoll_create(size: c_int) -> c_int {
    // SAFETY: forwarding.
    let r = unsafe { real::epoll_create(size) };
    crate::socket::fresh_fd(r);
    guard((), || wait::epoll_created(r));
    r
}

pub unsafe fn epoll_create1(flags: c_int) -> c_int {
    // SAFETY: forwarding.
    let r = unsafe { real::epoll_create1(flags) };
    crate::socket::fresh_fd(r);
    guard((), || wait::epoll_created(r));
    r
}

pub unsafe fn epoll_ctl(epfd: c_int, op: c_int, fd: c_int, ev: *mut libc::epoll_event) -> c_int {
    // SAFETY: forwarding.
    let r = unsafe { real::epoll_ctl(epfd, op, fd, ev) };
    if r == 0 {
        let e = errno();
        // SAFETY: the kernel accepted `ev` (null only for EPOLL_CTL_DEL).
        let evr = unsafe { ev.as_ref() };
        guard((), || wait::epoll_ctl_done(epfd, op, fd, evr));
        set_errno(e);
    }
    r
}

pub unsafe fn epoll_wait(
    epfd: c_int,
    evs: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    let (dl, zero) = wait::dl_ms(timeout);
    wait_guard(|| {
        // SAFETY: the program's arguments; forwarding them unchanged.
        unsafe {
            wait::epoll_common(epfd, evs, max, dl, zero, std::ptr::null(), || {
                real::epoll_wait(epfd, evs, max, timeout)
            })
        }
    })
}

pub unsafe fn epoll_pwait(
    epfd: c_int,
    evs: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const libc::sigset_t,
) -> c_int {
    let (dl, zero) = wait::dl_ms(timeout);
    wait_guard(|| {
        // SAFETY: the program's arguments; forwarding them unchanged.
        unsafe {
            wait::epoll_common(epfd, evs, max, dl, zero, mask, || {
                real::epoll_pwait(epfd, evs, max, timeout, mask)
            })
        }
    })
}

pub unsafe fn epoll_pwait2(
    epfd: c_int,
    evs: *mut libc::epoll_event,
    max: c_int,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    let Some((dl, zero)) = wait::dl_ts(ts) else {
        // SAFETY: forwarding (the kernel reports the bad timeout).
        return unsafe { real::epoll_pwait2(epfd, evs, max, ts, mask) };
    };
    wait_guard(|| {
        // SAFETY: the program's arguments; forwarding them unchanged.
        unsafe {
            wait::epoll_common(epfd, evs, max, dl, zero, mask, || {
                real::epoll_pwait2(epfd, evs, max, ts, mask)
            })
        }
    })
}

pub unsafe fn poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int {
    let (dl, zero) = wait::dl_ms(timeout);
    wait_guard(|| {
        // SAFETY: the program's arguments; forwarding them unchanged.
        unsafe {
            wait::poll_common(fds, n, dl, zero, std::ptr::null(), || {
                real::poll(fds, n, timeout)
            })
        }
    })
}

pub unsafe fn ppoll(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    let Some((dl, zero)) = wait::dl_ts(ts) else {
        // SAFETY: forwarding (the kernel reports the bad timeout).
        return unsafe { real::ppoll(fds, n, ts, mask) };
    };
    wait_guard(|| {
        // SAFETY: the program's arguments; forwarding them unchanged.
        unsafe { wait::poll_common(fds, n, dl, zero, mask, || real::ppoll(fds, n, ts, mask)) }
    })
}

pub unsafe fn select(
    nfds: c_int,
    rd: *mut libc::fd_set,
    wr: *mut libc::fd_set,
    ex: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    // SAFETY: the program's timeval, if any.
    let tvv = unsafe { tv.as_ref() }.copied();
    let valid = tvv.is_none_or(|t| t.tv_sec >= 0 && (0..1_000_000).contains(&t.tv_usec));
    if valid {
        let dl = tvv.map(|t| {
            std::time::Instant::now()
                + std::time::Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000)
        });
        let zero = tvv.is_some_and(|t| t.tv_sec == 0 && t.tv_usec == 0);
        let mut fixed = None;
        let r = wait_guard(|| {
            // SAFETY: the program's sets.
            fixed = unsafe { wait::select_common(nfds, rd, wr, ex, dl, zero, std::ptr::null()) };
            fixed.unwrap_or(0)
        });
        if fixed.is_some() || r < 0 {
            if let (Some(dl), false) = (dl, tv.is_null()) {
                // Linux select reports the time left.
                let left = dl.saturating_duration_since(std::time::Instant::now());
                // SAFETY: the program's non-null timeval.
                unsafe {
                    (*tv).tv_sec = left.as_secs() as libc::time_t;
                    (*tv).tv_usec = left.subsec_micros() as libc::suseconds_t;
                }
            }
            return r;
        }
    }
    // SAFETY: forwarding.
    unsafe { real::select(nfds, rd, wr, ex, tv) }
}

pub unsafe fn pselect(
    nfds: c_int,
    rd: *mut libc::fd_set,
    wr: *mut libc::fd_set,
    ex: *mut libc::fd_set,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    if let Some((dl, zero)) = wait::dl_ts(ts) {
        let mut fixed = None;
        let r = wait_guard(|| {
            // SAFETY: the program's sets and mask.
            fixed = unsafe { wait::select_common(nfds, rd, wr, ex, dl, zero, mask) };
            fixed.unwrap_or(0)
        });
        if fixed.is_some() || r < 0 {
            return r;
        }
    }
    // SAFETY: forwarding.
    unsafe { real::pselect(nfds, rd, wr, ex, ts, mask) }
}
