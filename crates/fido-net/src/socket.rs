//! The life of a socket's descriptors as the program sees it: `listen`
//! (publishing a listener), `connect` and `accept` (running the handshake),
//! `close`, `shutdown`, the `dup` family, `fcntl`, `ioctl` and the socket
//! options the ring changes. Each call runs libc's and keeps this library's
//! tables (`table`, `wait`'s epoll registrations, `seg`'s kept descriptors)
//! in step with the kernel's descriptor table.
//!
//! Must never: change what the kernel does with a descriptor (every call
//! here forwards the program's own), or answer for a socket that is not
//! accelerated.
//!
//! # Safety (every `pub unsafe fn` here)
//! The arguments are what the program passed to the libc call of the same
//! name, under that call's contract.

use crate::addr::{in_our_netns, is_tcp_stream, parse_addr, sock_name};
use crate::conn::Conn;
use crate::handshake::{attach, prepare_connect};
use crate::sys::{errno, guard, set_errno};
use crate::{broker, config, real, seg, sockopt, stats, table, wait};
use libc::{c_int, c_uint, c_ulong, c_void, sockaddr, socklen_t};
use std::sync::atomic::Ordering;
use std::sync::Arc;

pub unsafe fn listen(fd: c_int, backlog: c_int) -> c_int {
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real::listen(fd, backlog) };
    if r == 0 && config::enabled() && !table::is_listener(fd) {
        let e = errno();
        guard((), || {
            if is_tcp_stream(fd) {
                if let Some(a) = sock_name(fd, false) {
                    // Kept unpublished too: a broker that comes back gets it.
                    let key = broker::publish_listener(fd, &a.ip, a.port);
                    table::add_listener(fd, key, broker::epoch());
                }
            }
        });
        set_errno(e);
    }
    r
}

pub unsafe fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // An entry for a descriptor the program connects again is either a
    // connect on a connected socket (the kernel answers EISCONN) or stale:
    // the number was closed where we could not see and names a new socket.
    if table::lookup(fd).is_some() && !table::entry_is_current(fd) {
        guard((), || forget_gone(fd));
    }
    let prepared = if config::enabled() && table::lookup(fd).is_none() {
        guard(None, || {
            let mut dst = parse_addr(addr, len)?;
            // The kernel connects the unspecified address to loopback; the
            // server sees (and looks the request up by) that address.
            if dst.ip == "0.0.0.0" {
                dst.ip = "127.0.0.1".into();
            } else if dst.ip == "::" {
                dst.ip = "::1".into();
            }
            if !is_tcp_stream(fd) {
                return None;
            }
            let same = dst.loopback || in_our_netns(&dst.ip)?;
            prepare_connect(fd, &dst, same)
        })
    } else {
        None
    };
    let Some(c) = prepared else {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { real::connect(fd, addr, len) };
    };
    table::insert(fd, c.clone());
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real::connect(fd, addr, len) };
    let e = errno();
    if r == 0 {
        c.connected.store(true, Ordering::SeqCst);
    } else if e == libc::EINPROGRESS || e == libc::EINTR {
    } else {
        // Refused, unreachable, ...: forget it; the socket is the kernel's.
        if let Some((c, _)) = table::remove(fd) {
            c.release(fd);
            if let Some(o) = c.offer {
                broker::withdraw_offer(o);
            }
            // The holder count went to 0 on a socket that never carried data.
        }
    }
    set_errno(e);
    r
}

/// `accept`/`accept4` for an interposed call.
///
/// # Safety
/// `addr` and `len` are what the program passed to `accept4(2)`: null, or
/// valid for the kernel to write a peer address of `*len` bytes.
pub unsafe fn accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int {
    // SAFETY: forwarding the caller's arguments.
    let mut nfd = unsafe { real::accept4(fd, addr, len, flags) };
    if nfd < 0 && errno() == libc::EMFILE && seg::give_back_kept() {
        // Our kept descriptors yield their numbers to the program.
        // SAFETY: as above (the kernel checks the descriptor budget before
        // taking a connection off the queue: nothing was consumed).
        nfd = unsafe { real::accept4(fd, addr, len, flags) };
    }
    fresh_fd(nfd);
    if nfd >= 0 && config::enabled() {
        let e = errno();
        guard((), || {
            attach(nfd, flags);
            // A broker that came back since we listened knows no listener of ours.
            broker::republish();
        });
        set_errno(e);
    }
    nfd
}

/// The close of `fd` as far as we are concerned (before the real close).
fn forget_fd(fd: c_int) {
    crate::pinned::closing(fd);
    seg::forget_kept(fd);
    wait::forget(fd);
    if let Some((c, last)) = table::remove(fd) {
        if last {
            stats::count_closed(&c);
            if c.me == seg::CLIENT && c.state() == seg::PENDING {
                if let Some(o) = c.offer {
                    broker::withdraw_offer(o);
                }
            }
            c.release(fd);
        }
    }
    if let Some(key) = table::remove_listener(fd) {
        broker::withdraw(&key);
    }
}

/// `fd` was closed where we could not see (a raw system call, io_uring, a
/// helper linked statically): forget what we knew about that number without
/// touching it — it may name one of the program's new descriptors already.
fn forget_gone(fd: c_int) {
    crate::pinned::forget(fd);
    if seg::forget_kept(fd) {
        crate::sys::debug!("fd {fd}: a kept segment descriptor was closed behind our back");
    }
    wait::forget(fd);
    if let Some((c, last)) = table::remove(fd) {
        crate::sys::debug!("fd {fd}: closed without our seeing it; its connection is forgotten");
        if last {
            stats::count_closed(&c);
            if c.me == seg::CLIENT && c.state() == seg::PENDING && !broker::busy_here() {
                if let Some(o) = c.offer {
                    broker::withdraw_offer(o);
                }
            }
            c.release_gone();
        }
    }
    if let Some(key) = table::remove_listener(fd) {
        // Not from inside the broker join (the descriptor is the join's
        // own): the key goes with the domain, an offer after 60 s.
        if !broker::busy_here() {
            broker::withdraw(&key);
        }
    }
}

/// A call that creates descriptors just returned `fd`: the number was free,
/// so anything we remember under it is stale (closed behind our back).
/// Costs two relaxed loads while we remember nothing.
pub fn fresh_fd(fd: c_int) {
    if fd >= 0 && (table::remembers_any() || seg::remembers_any()) {
        guard((), || forget_gone(fd));
    }
}

/// `fd` is being closed by a libc call that closes it internally (`fclose`).
pub fn forget_closed(fd: c_int) {
    if fd >= 0 {
        guard((), || forget_fd(fd));
    }
}

pub unsafe fn close(fd: c_int) -> c_int {
    guard((), || forget_fd(fd));
    // SAFETY: forwarding.
    unsafe { real::close(fd) }
}

pub unsafe fn shutdown(fd: c_int, how: c_int) -> c_int {
    crate::handshake::first_use(fd);
    if let Some(c) = table::lookup(fd) {
        c.shutdown(how);
    }
    // SAFETY: forwarding.
    unsafe { real::shutdown(fd, how) }
}

/// `fd` names accelerated connection `c`: if an exec could now hand it on
/// (not close-on-exec) and no segment descriptor is kept for it, keep one.
fn keep_if_inheritable(c: &Conn, fd: c_int) {
    if c.seg.kept_fd() < 0 && !crate::addr::fd_cloexec(fd) && !c.seg.keep_from_mapping() {
        crate::sys::debug!(
            "fd {fd}: inheritable, but its segment cannot be kept: an exec resets it"
        );
    }
}

fn dup_into(old: c_int, new: c_int) {
    if new < 0 {
        return;
    }
    wait::duplicated(old);
    if let Some(c) = table::lookup(old) {
        keep_if_inheritable(&c, new);
        table::insert(new, c);
    }
    table::dup_listener(old, new);
}

pub unsafe fn dup(fd: c_int) -> c_int {
    // SAFETY: forwarding.
    let r = unsafe { real::dup(fd) };
    fresh_fd(r);
    guard((), || dup_into(fd, r));
    r
}

/// `dup2`/`dup3` for an interposed call.
///
/// # Safety
/// Same contract as `dup3(2)` (any integers are allowed; only the descriptor
/// table is touched).
pub unsafe fn dup3(old: c_int, new: c_int, flags: Option<c_int>) -> c_int {
    // SAFETY: F_GETFD probes `old` (dup2 fails with EBADF if it is invalid).
    let old_ok = unsafe { real::fcntl(old, libc::F_GETFD, 0) } >= 0;
    if old_ok && old != new {
        // dup2 closes `new` first.
        guard((), || forget_fd(new));
    }
    // SAFETY: forwarding.
    let r = unsafe {
        match flags {
            None => real::dup2(old, new),
            Some(f) => real::dup3(old, new, f),
        }
    };
    if r >= 0 && old != new {
        guard((), || dup_into(old, r));
    }
    r
}

/// `fcntl` for an interposed call.
///
/// # Safety
/// `arg` is what the program passed to `fcntl(2)` for `cmd` (for the
/// commands that take a pointer, a valid one).
pub unsafe fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: forwarding.
    let r = unsafe { real::fcntl(fd, cmd, arg) };
    if r >= 0 {
        match cmd {
            libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => {
                fresh_fd(r);
                guard((), || dup_into(fd, r))
            }
            libc::F_SETFD if arg as c_int & libc::FD_CLOEXEC == 0 => {
                if let Some(c) = table::lookup(fd) {
                    guard((), || keep_if_inheritable(&c, fd));
                }
            }
            libc::F_SETFL => {
                if let Some(c) = table::lookup(fd) {
                    c.nonblock
                        .store(arg as c_int & libc::O_NONBLOCK != 0, Ordering::Relaxed);
                    if arg as c_int & libc::O_ASYNC != 0 {
                        // SIGIO readiness is the kernel's alone.
                        c.make_eager();
                    }
                }
            }
            _ => {}
        }
    }
    r
}

/// The accelerated connection behind `fd` whose TCP options we own (see
/// `sockopt`), if any.
fn owns_opts(fd: c_int, level: c_int, name: c_int) -> Option<Arc<Conn>> {
    if !sockopt::owned(level, name) {
        return None;
    }
    table::lookup(fd).filter(|c| c.tcp_opts.taken.load(Ordering::Acquire))
}

pub unsafe fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    if let Some(c) = guard(None, || owns_opts(fd, level, name)) {
        // SAFETY: the program's arguments, under setsockopt's contract.
        let e = unsafe { sockopt::set(&c.tcp_opts, name, val, len) };
        if e != 0 {
            set_errno(e);
            return -1;
        }
        return 0;
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { real::setsockopt(fd, level, name, val, len) }
}

pub unsafe fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    if level == libc::SOL_SOCKET && name == libc::SO_ERROR && !val.is_null() && !len.is_null() {
        // An error one of our peeks took from the kernel is reported here
        // once, as the kernel would have.
        // SAFETY: the program's length pointer (non-null).
        let want = unsafe { *len } as usize;
        if want >= std::mem::size_of::<c_int>() {
            if let Some(e) = table::lookup(fd).and_then(|c| c.take_kernel_err()) {
                // SAFETY: the program gave at least an int's room.
                unsafe {
                    (val as *mut c_int).write_unaligned(e);
                    *len = std::mem::size_of::<c_int>() as socklen_t;
                }
                return 0;
            }
        }
    }
    if let Some(c) = guard(None, || owns_opts(fd, level, name)) {
        // SAFETY: the program's arguments, under getsockopt's contract.
        let e = unsafe { sockopt::get(&c.tcp_opts, name, val, len) };
        if e != 0 {
            set_errno(e);
            return -1;
        }
        return 0;
    }
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { real::getsockopt(fd, level, name, val, len) };
    if r == 0 && level == libc::SOL_SOCKET && name == libc::SO_ERROR && !val.is_null() {
        // SAFETY: the kernel wrote an int there.
        let e = unsafe { (val as *const c_int).read_unaligned() };
        if e == libc::ECONNRESET || e == libc::EPIPE {
            // The program took the reset: later writes are the kernel's
            // (`EPIPE`), as over TCP, instead of filling a dead ring.
            if let Some(c) = table::lookup(fd) {
                c.dead.store(true, Ordering::Relaxed);
            }
        }
    }
    r
}

pub unsafe fn ioctl(fd: c_int, req: c_ulong, arg: *mut c_void) -> c_int {
    if let Some(c) = table::lookup(fd).filter(|c| c.state() == seg::ATTACHED) {
        match req {
            libc::FIONREAD if !arg.is_null() => {
                // SAFETY: FIONREAD's argument is an int out-pointer.
                unsafe {
                    *(arg as *mut c_int) = c.readable_bytes().min(c_int::MAX as usize) as c_int
                };
                return 0;
            }
            libc::TIOCOUTQ if !arg.is_null() => {
                // SAFETY: SIOCOUTQ's argument is an int out-pointer.
                unsafe {
                    *(arg as *mut c_int) = c.unsent_bytes().min(c_int::MAX as usize) as c_int
                };
                return 0;
            }
            libc::FIONBIO if !arg.is_null() => {
                // SAFETY: FIONBIO's argument points to an int.
                let on = unsafe { *(arg as *const c_int) } != 0;
                // SAFETY: forwarding.
                let r = unsafe { real::ioctl(fd, req, arg) };
                if r == 0 {
                    c.nonblock.store(on, Ordering::Relaxed);
                }
                return r;
            }
            _ => {}
        }
    }
    // SAFETY: forwarding.
    unsafe { real::ioctl(fd, req, arg) }
}

pub unsafe fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    if flags & libc::CLOSE_RANGE_CLOEXEC as c_int == 0 {
        guard((), || {
            for fd in table::fds().into_iter().chain(seg::kept_fds()).chain(crate::pinned::fds()) {
                if fd >= 0 && (first..=last).contains(&(fd as c_uint)) {
                    forget_fd(fd);
                }
            }
        });
    }
    // SAFETY: forwarding.
    unsafe { real::close_range(first, last, flags) }
}
