//! The data path: every interposed read and write of a socket (`read`,
//! `recv*`, `write`, `send*`, `readv`/`writev`, `sendfile`, `splice`). On an
//! accelerated connection the bytes move through its ring (`Conn::recv`,
//! `Conn::send`); everywhere else, and whenever the ring hands a call back
//! (the peer closed, a reset, out-of-band data), libc's own call runs
//! unchanged.
//!
//! Must never: touch a descriptor that is not accelerated beyond one table
//! lookup, or read or write the program's buffers outside what it passed.
//!
//! # Safety (every `pub unsafe fn` here)
//! The arguments are what the program passed to the libc call of the same
//! name, under that call's contract (buffers valid for the lengths given).

use crate::conn::{Conn, Out};
use crate::handshake::active;
use crate::real;
use crate::sys::{guard, set_errno};
use libc::{c_int, c_uint, c_void, iovec, msghdr, size_t, sockaddr, socklen_t, ssize_t};
use std::sync::atomic::Ordering;

/// An interposed data call on `fd`: through the ring when the connection is
/// accelerated (`ring`), else — or when the ring hands the call back to the
/// kernel — libc's (`kernel`).
fn dispatch(fd: c_int, ring: impl FnOnce(&Conn) -> Out, kernel: impl Fn() -> ssize_t) -> ssize_t {
    match active(fd) {
        None => kernel(),
        Some(c) => finish(ring(&c), kernel),
    }
}

fn finish(o: Out, kernel: impl FnOnce() -> ssize_t) -> ssize_t {
    match o {
        Out::Done(n) => n as ssize_t,
        Out::Err(e) => {
            set_errno(e);
            -1
        }
        Out::Kernel => kernel(),
    }
}

/// The program's `iovec` array as slices (`None` when `cnt` is out of range).
///
/// # Safety
/// As for `readv(2)`: `iov` points to `cnt` entries, each naming memory the
/// caller may write, none overlapping, alive for `'a`.
unsafe fn iov_mut<'a>(iov: *const iovec, cnt: c_int) -> Option<Vec<&'a mut [u8]>> {
    if !(0..=libc::UIO_MAXIOV).contains(&cnt) || (cnt > 0 && iov.is_null()) {
        return None;
    }
    let mut v = Vec::with_capacity(cnt as usize);
    for i in 0..cnt as usize {
        // SAFETY: the caller passes `cnt` iovecs describing writable buffers.
        let e = unsafe { &*iov.add(i) };
        if e.iov_len > 0 {
            // SAFETY: as above.
            v.push(unsafe { std::slice::from_raw_parts_mut(e.iov_base as *mut u8, e.iov_len) });
        }
    }
    Some(v)
}

/// The program's `iovec` array as read-only slices.
///
/// # Safety
/// As for `writev(2)`: `iov` points to `cnt` entries naming readable memory
/// alive for `'a`.
unsafe fn iov_ref<'a>(iov: *const iovec, cnt: c_int) -> Option<Vec<&'a [u8]>> {
    if !(0..=libc::UIO_MAXIOV).contains(&cnt) || (cnt > 0 && iov.is_null()) {
        return None;
    }
    let mut v = Vec::with_capacity(cnt as usize);
    for i in 0..cnt as usize {
        // SAFETY: the caller passes `cnt` iovecs describing readable buffers.
        let e = unsafe { &*iov.add(i) };
        if e.iov_len > 0 {
            // SAFETY: as above.
            v.push(unsafe { std::slice::from_raw_parts(e.iov_base as *const u8, e.iov_len) });
        }
    }
    Some(v)
}

fn do_recv(c: &Conn, fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> Out {
    if flags & (libc::MSG_OOB | libc::MSG_ERRQUEUE) != 0 {
        return Out::Kernel;
    }
    if n > 0 && buf.is_null() {
        return Out::Err(libc::EFAULT);
    }
    let mut bufs: Vec<&mut [u8]> = if n == 0 {
        Vec::new()
    } else {
        // SAFETY: the caller's buffer of `n` bytes.
        vec![unsafe { std::slice::from_raw_parts_mut(buf as *mut u8, n) }]
    };
    guard(Out::Err(libc::EIO), || c.recv(fd, &mut bufs, flags))
}

fn do_send(c: &Conn, fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> Out {
    if flags & libc::MSG_OOB != 0 {
        return Out::Err(libc::EOPNOTSUPP);
    }
    if n > 0 && buf.is_null() {
        return Out::Err(libc::EFAULT);
    }
    let bufs: Vec<&[u8]> = if n == 0 {
        Vec::new()
    } else {
        // SAFETY: the caller's buffer of `n` bytes.
        vec![unsafe { std::slice::from_raw_parts(buf as *const u8, n) }]
    };
    guard(Out::Err(libc::EIO), || c.send(fd, &bufs, flags))
}

pub unsafe fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    dispatch(
        fd,
        |c| do_recv(c, fd, buf, n, 0),
        // SAFETY: forwarding the caller's arguments.
        || unsafe { real::read(fd, buf, n) },
    )
}

pub unsafe fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    dispatch(
        fd,
        |c| do_recv(c, fd, buf, n, flags),
        // SAFETY: forwarding the caller's arguments.
        || unsafe { real::recv(fd, buf, n, flags) },
    )
}

pub unsafe fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    match active(fd) {
        // SAFETY: forwarding.
        None => unsafe { real::recvfrom(fd, buf, n, flags, addr, alen) },
        Some(c) => {
            let r = finish(do_recv(&c, fd, buf, n, flags), || {
                // SAFETY: forwarding.
                unsafe { real::recvfrom(fd, buf, n, flags, addr, alen) }
            });
            if r >= 0 && !addr.is_null() && !alen.is_null() {
                // TCP reports no source address.
                // SAFETY: the caller's length out-pointer.
                unsafe { *alen = 0 };
            }
            r
        }
    }
}

pub unsafe fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    let Some(c) = active(fd) else {
        // SAFETY: forwarding.
        return unsafe { real::readv(fd, iov, cnt) };
    };
    // SAFETY: the caller's iovecs.
    let Some(mut bufs) = (unsafe { iov_mut(iov, cnt) }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    let o = guard(Out::Err(libc::EIO), || c.recv(fd, &mut bufs, 0));
    // SAFETY: forwarding.
    finish(o, || unsafe { real::readv(fd, iov, cnt) })
}

pub unsafe fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    let Some(c) = active(fd) else {
        // SAFETY: forwarding.
        return unsafe { real::recvmsg(fd, msg, flags) };
    };
    if msg.is_null() || flags & (libc::MSG_OOB | libc::MSG_ERRQUEUE) != 0 {
        // SAFETY: forwarding.
        return unsafe { real::recvmsg(fd, msg, flags) };
    }
    // SAFETY: the caller's msghdr.
    let m = unsafe { &mut *msg };
    // SAFETY: the caller's iovecs.
    let Some(mut bufs) = (unsafe { iov_mut(m.msg_iov, m.msg_iovlen as c_int) }) else {
        set_errno(libc::EMSGSIZE);
        return -1;
    };
    let o = guard(Out::Err(libc::EIO), || c.recv(fd, &mut bufs, flags));
    // SAFETY: forwarding.
    let r = finish(o, || unsafe { real::recvmsg(fd, msg, flags) });
    if r >= 0 {
        m.msg_namelen = 0;
        m.msg_controllen = 0;
        m.msg_flags = 0;
    }
    r
}

pub unsafe fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    dispatch(
        fd,
        |c| do_send(c, fd, buf, n, 0),
        // SAFETY: forwarding the caller's arguments.
        || unsafe { real::write(fd, buf, n) },
    )
}

pub unsafe fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    dispatch(
        fd,
        |c| do_send(c, fd, buf, n, flags),
        // SAFETY: forwarding the caller's arguments.
        || unsafe { real::send(fd, buf, n, flags) },
    )
}

pub unsafe fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    alen: socklen_t,
) -> ssize_t {
    dispatch(
        fd,
        |c| do_send(c, fd, buf, n, flags),
        // SAFETY: forwarding the caller's arguments.
        || unsafe { real::sendto(fd, buf, n, flags, addr, alen) },
    )
}

pub unsafe fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    let Some(c) = active(fd) else {
        // SAFETY: forwarding.
        return unsafe { real::writev(fd, iov, cnt) };
    };
    // SAFETY: the caller's iovecs.
    let Some(bufs) = (unsafe { iov_ref(iov, cnt) }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    let o = guard(Out::Err(libc::EIO), || c.send(fd, &bufs, 0));
    // SAFETY: forwarding.
    finish(o, || unsafe { real::writev(fd, iov, cnt) })
}

pub unsafe fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    let Some(c) = active(fd) else {
        // SAFETY: forwarding.
        return unsafe { real::sendmsg(fd, msg, flags) };
    };
    if msg.is_null() || flags & libc::MSG_OOB != 0 {
        // SAFETY: forwarding.
        return unsafe { real::sendmsg(fd, msg, flags) };
    }
    // SAFETY: the caller's msghdr.
    let m = unsafe { &*msg };
    // SAFETY: the caller's iovecs.
    let Some(bufs) = (unsafe { iov_ref(m.msg_iov, m.msg_iovlen as c_int) }) else {
        set_errno(libc::EMSGSIZE);
        return -1;
    };
    let o = guard(Out::Err(libc::EIO), || c.send(fd, &bufs, flags));
    // SAFETY: forwarding.
    finish(o, || unsafe { real::sendmsg(fd, msg, flags) })
}

/// `sendmmsg`, which a TCP socket takes too (each message's bytes appended
/// to the stream): on an accelerated socket each message goes through
/// [`sendmsg`] — the kernel would put them on the TCP stream, where the
/// peer takes them for doorbells. As the kernel does, the count of messages
/// sent is returned, or the first one's error.
///
/// # Safety
/// Same contract as `sendmmsg(2)`.
pub unsafe fn sendmmsg(fd: c_int, msgs: *mut libc::mmsghdr, n: libc::c_uint, flags: c_int) -> c_int {
    if msgs.is_null() || active(fd).is_none() {
        // SAFETY: forwarding.
        return unsafe { real::sendmmsg(fd, msgs, n, flags) };
    }
    let mut sent = 0;
    for i in 0..n as usize {
        // SAFETY: the caller's array of `n` messages.
        let h = unsafe { &mut *msgs.add(i) };
        // SAFETY: the caller's msghdr.
        let r = unsafe { sendmsg(fd, &h.msg_hdr, flags) };
        if r < 0 {
            return if sent > 0 { sent } else { -1 };
        }
        h.msg_len = r as libc::c_uint;
        sent += 1;
    }
    sent
}

/// `recvmmsg` on an accelerated socket: each message through [`recvmsg`],
/// `MSG_WAITFORONE` turning on `MSG_DONTWAIT` after the first, and the
/// timeout checked after each message and updated, as the kernel does.
///
/// # Safety
/// Same contract as `recvmmsg(2)`.
pub unsafe fn recvmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    n: libc::c_uint,
    flags: c_int,
    timeout: *mut libc::timespec,
) -> c_int {
    if msgs.is_null() || active(fd).is_none() {
        // SAFETY: forwarding.
        return unsafe { real::recvmmsg(fd, msgs, n, flags, timeout) };
    }
    // SAFETY: the caller's timespec, if any.
    let deadline = unsafe { timeout.as_ref() }.map(|t| {
        std::time::Instant::now()
            + std::time::Duration::new(t.tv_sec.max(0) as u64, t.tv_nsec.clamp(0, 999_999_999) as u32)
    });
    let mut f = flags & !libc::MSG_WAITFORONE;
    let mut got = 0;
    for i in 0..n as usize {
        // SAFETY: the caller's array of `n` messages.
        let h = unsafe { &mut *msgs.add(i) };
        // SAFETY: the caller's msghdr.
        let r = unsafe { recvmsg(fd, &mut h.msg_hdr, f) };
        if r < 0 {
            if got > 0 {
                break;
            }
            return -1;
        }
        h.msg_len = r as libc::c_uint;
        got += 1;
        if flags & libc::MSG_WAITFORONE != 0 {
            f |= libc::MSG_DONTWAIT;
        }
        if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            break;
        }
    }
    // SAFETY: the caller's timespec, if any (the kernel writes it back too).
    let timeout = unsafe { timeout.as_mut() };
    if let (Some(d), Some(t)) = (deadline, timeout) {
        let left = d.saturating_duration_since(std::time::Instant::now());
        t.tv_sec = left.as_secs() as libc::time_t;
        t.tv_nsec = left.subsec_nanos() as libc::c_long;
    }
    got
}

/// `sendfile` into an accelerated socket: the file's bytes go on the ring.
pub unsafe fn sendfile(out: c_int, inp: c_int, off: *mut libc::off_t, count: size_t) -> ssize_t {
    let Some(c) = active(out) else {
        // SAFETY: forwarding.
        return unsafe { real::sendfile(out, inp, off, count) };
    };
    // Read at an explicit offset so bytes the socket did not take are not
    // consumed from the file.
    let mut pos = if off.is_null() {
        // SAFETY: lseek on the caller's descriptor.
        let p = unsafe { libc::lseek(inp, 0, libc::SEEK_CUR) };
        if p < 0 {
            return -1;
        }
        p
    } else {
        // SAFETY: the caller's offset pointer.
        unsafe { *off }
    };
    let mut buf = Vec::new();
    let mut done: usize = 0;
    while done < count {
        // Straight from the file into the ring while it has room.
        match guard(Err(Out::Err(libc::EIO)), || {
            c.send_file_now(out, inp, pos, count - done)
        }) {
            Ok((k, eof)) => {
                done += k;
                pos += k as libc::off_t;
                if eof {
                    break;
                }
                if k > 0 {
                    continue;
                }
            }
            Err(Out::Err(e)) => {
                if done > 0 {
                    break;
                }
                set_errno(e);
                return -1;
            }
            Err(_) => {
                if done > 0 {
                    break;
                }
                // SAFETY: forwarding (the kernel reports EPIPE and friends).
                return unsafe { real::sendfile(out, inp, off, count) };
            }
        }
        if done > 0 {
            break; // the ring is full: a partial write, as TCP returns one
        }
        // Full ring before the first byte: wait for room through `send`
        // (blocking, or EAGAIN when non-blocking) with one bounce buffer.
        if buf.is_empty() {
            buf = vec![0u8; count.min(64 << 10)];
        }
        let want = (count - done).min(buf.len());
        // SAFETY: pread into our buffer.
        let n = unsafe { libc::pread(inp, buf.as_mut_ptr() as *mut c_void, want, pos) };
        if n < 0 {
            if done > 0 {
                break;
            }
            return -1;
        }
        if n == 0 {
            break;
        }
        let flags = if done > 0 { libc::MSG_DONTWAIT } else { 0 };
        let o = guard(Out::Err(libc::EIO), || {
            c.send(out, &[&buf[..n as usize]], flags)
        });
        let k = match o {
            Out::Done(k) => k,
            Out::Err(e) => {
                if done > 0 {
                    break;
                }
                set_errno(e);
                return -1;
            }
            Out::Kernel => {
                if done > 0 {
                    break;
                }
                // SAFETY: forwarding (the kernel reports EPIPE and friends).
                return unsafe { real::sendfile(out, inp, off, count) };
            }
        };
        done += k;
        pos += k as libc::off_t;
        if k < n as usize {
            break;
        }
    }
    if off.is_null() {
        // SAFETY: advancing the caller's file offset by what was sent.
        unsafe { libc::lseek(inp, pos, libc::SEEK_SET) };
    } else {
        // SAFETY: the caller's offset pointer.
        unsafe { *off = pos };
    }
    done as ssize_t
}

/// `splice` to or from an accelerated socket: the kernel would move the bytes
/// on the TCP stream (where only doorbells travel), so they go through the
/// ring instead. Into the socket: at most what the ring can take is read
/// from the pipe (nothing read is lost). Out of the socket: the bytes are
/// peeked, written to the pipe, and only what the pipe took is consumed.
pub unsafe fn splice(
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    flags: c_uint,
) -> ssize_t {
    let nb = flags & libc::SPLICE_F_NONBLOCK != 0;
    if let Some(c) = active(fd_out) {
        if !off_in.is_null() || !off_out.is_null() {
            set_errno(libc::ESPIPE);
            return -1;
        }
        let room = c.free_space();
        if room == 0 && (nb || c.nonblock.load(Ordering::Relaxed)) {
            set_errno(libc::EAGAIN);
            return -1;
        }
        let want = len
            .min(64 << 10)
            .min(if room == 0 { 64 << 10 } else { room });
        let mut buf = vec![0u8; want];
        // SAFETY: reading the caller's pipe into our buffer.
        let n = unsafe { real::read(fd_in, buf.as_mut_ptr() as *mut c_void, want) };
        if n <= 0 {
            return n;
        }
        let o = guard(Out::Err(libc::EIO), || {
            c.send(fd_out, &[&buf[..n as usize]], 0)
        });
        return match o {
            Out::Done(k) => k as ssize_t,
            Out::Err(e) => {
                set_errno(e);
                -1
            }
            Out::Kernel => {
                // The peer is gone: let the kernel report it on the socket.
                // SAFETY: writing our buffer to the caller's socket.
                unsafe {
                    real::send(
                        fd_out,
                        buf.as_ptr() as *const c_void,
                        n as usize,
                        libc::MSG_NOSIGNAL,
                    )
                }
            }
        };
    }
    if let Some(c) = active(fd_in) {
        if !off_in.is_null() || !off_out.is_null() {
            set_errno(libc::ESPIPE);
            return -1;
        }
        let want = len.min(64 << 10);
        let mut buf = vec![0u8; want];
        let peek = if nb {
            libc::MSG_PEEK | libc::MSG_DONTWAIT
        } else {
            libc::MSG_PEEK
        };
        let n = match guard(Out::Err(libc::EIO), || {
            c.recv(fd_in, &mut [&mut buf[..]], peek)
        }) {
            Out::Done(n) => n,
            Out::Err(e) => {
                set_errno(e);
                return -1;
            }
            Out::Kernel => {
                // SAFETY: forwarding.
                return unsafe { real::splice(fd_in, off_in, fd_out, off_out, len, flags) };
            }
        };
        if n == 0 {
            return 0;
        }
        // SAFETY: writing our buffer to the caller's pipe.
        let w = unsafe { real::write(fd_out, buf.as_ptr() as *const c_void, n) };
        if w <= 0 {
            return w;
        }
        let mut scratch = vec![0u8; w as usize];
        let _ = guard(Out::Err(libc::EIO), || {
            c.recv(fd_in, &mut [&mut scratch[..]], libc::MSG_DONTWAIT)
        });
        return w;
    }
    // SAFETY: forwarding.
    unsafe { real::splice(fd_in, off_in, fd_out, off_out, len, flags) }
}
