//! The two TCP options whose meaning the ring changes: Nagle (`TCP_NODELAY`)
//! and corking (`TCP_CORK`).
//!
//! Once a connection is accelerated its TCP stream carries only one-byte
//! doorbells. Left to Nagle's algorithm, a doorbell sent while the previous one
//! is unacknowledged waits for that acknowledgement — and the receiver delays
//! acknowledgements (up to 40 ms): the writer sleeps waiting for space the
//! reader freed long ago, and a reader's drain waits for a byte "on its way"
//! (measured: iperf3 moved 2.5 Gbit/s with both ends idle 95 % of the time).
//! A cork holds doorbells back the same way (up to 200 ms). So an accelerated
//! socket runs with `TCP_NODELAY` on and `TCP_CORK` off, and the program's own
//! settings of the two are remembered and answered back: they would only have
//! shaped the segments of data that no longer travels on TCP.
//!
//! Also here: `linger`, how the library makes a close send a RST (as TCP
//! does when data is left unread) or not.
//!
//! Must never: change the options of a socket that is not (yet) accelerated —
//! a connection that falls back to TCP keeps exactly what the program set.

use crate::real;
use libc::{c_int, c_void, socklen_t};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// One accelerated connection's owned options: the program's view of them.
#[derive(Default)]
pub struct TcpOpts {
    /// The program's `TCP_NODELAY`/`TCP_CORK`, answered back while the real
    /// socket runs with Nagle and the cork off.
    pub app_nodelay: AtomicI32,
    pub app_cork: AtomicI32,
    /// `take_over` ran: the real socket's options are ours.
    pub taken: AtomicBool,
}

/// Whether `(level, name)` is one of the options we own on an accelerated
/// socket.
pub fn owned(level: c_int, name: c_int) -> bool {
    level == libc::IPPROTO_TCP && (name == libc::TCP_NODELAY || name == libc::TCP_CORK)
}

fn get_int(fd: c_int, name: c_int) -> Option<c_int> {
    let mut v: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: getsockopt into a local int of the length passed.
    let r = unsafe {
        real::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            name,
            &mut v as *mut c_int as *mut c_void,
            &mut len,
        )
    };
    (r == 0).then_some(v)
}

fn set_int(fd: c_int, name: c_int, v: c_int) {
    // SAFETY: setsockopt from a local int of the length passed.
    unsafe {
        real::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            name,
            &v as *const c_int as *const c_void,
            std::mem::size_of::<c_int>() as socklen_t,
        )
    };
}

/// Called once the connection is known to be accelerated, before its first
/// doorbell: remembers the program's settings and turns Nagle and the cork off
/// on the real socket. Idempotent (another descriptor of the same connection,
/// or the other thread that raced us, finds it done).
pub fn take_over(fd: c_int, c: &TcpOpts) {
    // Under a seccomp filter getsockopt/setsockopt may be forbidden: Nagle
    // stays as the program set it (doorbells may be slower, never wrong).
    if c.taken.load(Ordering::Acquire) || crate::config::restricted() {
        return;
    }
    if let Some(v) = get_int(fd, libc::TCP_NODELAY) {
        c.app_nodelay.store(v, Ordering::Relaxed);
    }
    if let Some(v) = get_int(fd, libc::TCP_CORK) {
        c.app_cork.store(v, Ordering::Relaxed);
    }
    set_int(fd, libc::TCP_NODELAY, 1);
    set_int(fd, libc::TCP_CORK, 0);
    c.taken.store(true, Ordering::Release);
}

fn slot(c: &TcpOpts, name: c_int) -> &std::sync::atomic::AtomicI32 {
    if name == libc::TCP_NODELAY {
        &c.app_nodelay
    } else {
        &c.app_cork
    }
}

/// `setsockopt` of an owned option on an accelerated socket: validated as the
/// kernel does (`EFAULT` for a null value, `EINVAL` for a short one), then
/// remembered. Returns the errno to report, or 0.
///
/// # Safety
/// `val` is null or valid for reads of `len` bytes (the program's contract).
pub unsafe fn set(c: &TcpOpts, name: c_int, val: *const c_void, len: socklen_t) -> c_int {
    if (len as usize) < std::mem::size_of::<c_int>() {
        return libc::EINVAL;
    }
    if val.is_null() {
        return libc::EFAULT;
    }
    // SAFETY: non-null and at least an int long (checked above); the program
    // may pass an unaligned pointer.
    let v = unsafe { std::ptr::read_unaligned(val as *const c_int) };
    slot(c, name).store((v != 0) as c_int, Ordering::Relaxed);
    0
}

/// `getsockopt` of an owned option on an accelerated socket, answered as the
/// kernel would: the value truncated to the caller's length, the length
/// written back. Returns the errno to report, or 0.
///
/// # Safety
/// `val`/`len` are what the program passed to `getsockopt(2)`.
pub unsafe fn get(c: &TcpOpts, name: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int {
    if len.is_null() {
        return libc::EFAULT;
    }
    // SAFETY: non-null length pointer from the program.
    let want = unsafe { len.read_unaligned() } as i32;
    if want < 0 {
        return libc::EINVAL;
    }
    let n = (want as usize).min(std::mem::size_of::<c_int>());
    if n > 0 && val.is_null() {
        return libc::EFAULT;
    }
    let v = slot(c, name).load(Ordering::Relaxed).to_ne_bytes();
    // SAFETY: the program gave `want` >= n writable bytes at `val`.
    unsafe {
        std::ptr::copy_nonoverlapping(v.as_ptr(), val as *mut u8, n);
        len.write_unaligned(n as socklen_t);
    }
    0
}

/// `SO_LINGER` with a zero timeout on (the close sends a RST) or off.
pub fn linger(fd: c_int, on: bool) {
    if crate::config::restricted() {
        // setsockopt may be forbidden: the close stays a FIN.
        return;
    }
    let l = libc::linger {
        l_onoff: on as c_int,
        l_linger: 0,
    };
    // SAFETY: setsockopt with a linger struct.
    unsafe {
        real::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &l as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
}
