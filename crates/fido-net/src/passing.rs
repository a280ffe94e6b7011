//! Sockets handed between processes over a Unix socket (`SCM_RIGHTS`):
//! Node's `cluster`, preforked workers, socket activation. The process that
//! receives a descriptor may not know the ring (or not run the library at
//! all), and would read doorbell bytes as data; so a connection never leaves
//! on the ring:
//!
//! - one not yet decided (a server's claimed connection before its first
//!   use — the usual case: accept, then pass at once — or a client's before
//!   its first byte) is abandoned by the sender: plain TCP on both ends,
//!   decided by one CAS, before the descriptor leaves;
//! - one already on the ring is reset (RST: the peer and the receiver see
//!   `ECONNRESET`, never a wrong byte or a hang);
//! - a process under `fido run` that receives a TCP socket nobody claimed
//!   (its sender does not run the library) claims it, as `accept` would:
//!   it is accelerated at its first use here.
//!
//! Must never: change the message the program sends or receives.

use crate::handshake::attach;
use crate::sys::{debug, errno, guard, set_errno};
use crate::{broker, config, seg, stats, table};
use libc::{c_int, msghdr};
use std::sync::atomic::Ordering;

/// The descriptors an `SCM_RIGHTS` message of `msg` carries.
///
/// # Safety
/// `msg` is null or a valid `msghdr` whose control buffer is readable for
/// `msg_controllen` bytes (sendmsg's contract; after recvmsg, what the kernel
/// filled in).
unsafe fn passed_fds(msg: *const msghdr) -> Vec<c_int> {
    let mut out = Vec::new();
    // SAFETY: the caller's msghdr.
    let Some(m) = (unsafe { msg.as_ref() }) else {
        return out;
    };
    if m.msg_control.is_null() || m.msg_controllen < std::mem::size_of::<libc::cmsghdr>() {
        return out;
    }
    // SAFETY: walking the control buffer with libc's own macros, which stay
    // within msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(m);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let len = (*c).cmsg_len as usize - (data as usize - c as usize);
                for i in 0..len / std::mem::size_of::<c_int>() {
                    out.push(std::ptr::read_unaligned(
                        (data as *const c_int).add(i),
                    ));
                }
            }
            c = libc::CMSG_NXTHDR(m, c);
        }
    }
    out
}

/// Before `sendmsg`: no connection leaves this process on the ring.
///
/// # Safety
/// As [`passed_fds`].
pub unsafe fn before_send(msg: *const msghdr) {
    if table::count() == 0 && !crate::pinned::any() {
        return;
    }
    // SAFETY: the caller's contract.
    let fds = unsafe { passed_fds(msg) };
    for &fd in &fds {
        // Another process will hold it: never ours alone to shut down.
        crate::pinned::forget(fd);
    }
    let e = errno();
    for fd in fds {
        leave_ring(fd, "passed over a Unix socket");
    }
    set_errno(e);
}

/// Connection `fd` is about to carry bytes the library will not see (passed
/// to another process, or wrapped in a stdio stream whose reads and writes
/// glibc makes internally): an undecided connection stays plain TCP (one
/// CAS, for both ends), one already on the ring is reset — the peer and the
/// program see `ECONNRESET`, never a doorbell read as data or bytes lost.
pub fn leave_ring(fd: c_int, why: &str) {
    let Some(c) = table::lookup(fd) else { return };
    guard((), || {
        let undecided = c
            .seg
            .hdr()
            .state
            .compare_exchange(seg::PENDING, seg::ABANDONED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if undecided {
            debug!("fd {fd} {why} before any I/O: plain TCP");
            stats::count_plain();
            // (A process that may not talk to the broker any more lets
            // the offer expire there.)
            if let Some(o) = c.offer.filter(|_| config::enabled()) {
                broker::withdraw_offer(o);
            }
        } else if c.state() == seg::ATTACHED && !c.broken.load(Ordering::Relaxed) {
            debug!("fd {fd} {why} while on the ring: reset");
            c.reset(fd);
        }
    });
}

/// After `recvmsg` returned `n`: claim the TCP sockets received that nobody
/// claimed (their sender does not run the library).
///
/// # Safety
/// As [`passed_fds`], for the msghdr the kernel just filled in.
pub unsafe fn after_recv(msg: *const msghdr, n: isize) {
    if n < 0 {
        return;
    }
    // SAFETY: the caller's contract.
    let fds = unsafe { passed_fds(msg) };
    // Descriptors just installed: whatever we remember under their numbers
    // is stale (closed where we could not see), as for any creating call.
    for &fd in &fds {
        crate::socket::fresh_fd(fd);
    }
    if fds.is_empty() || !config::enabled() {
        return;
    }
    let e = errno();
    for fd in fds {
        if table::lookup(fd).is_some() || !crate::addr::is_tcp_stream(fd) {
            continue;
        }
        // SAFETY: F_GETFL on a descriptor we were just given.
        let fl = unsafe { crate::real::fcntl(fd, libc::F_GETFL, 0) };
        let flags = if fl >= 0 && fl & libc::O_NONBLOCK != 0 {
            libc::SOCK_NONBLOCK
        } else {
            0
        };
        guard((), || attach(fd, flags));
    }
    set_errno(e);
}
