//! `fido-net` (MMNet): a preload library (`libfido_net.so`, loaded by
//! `fido run -- CMD`) that moves the bytes of TCP connections between two
//! co-located programs, both running under Fido, onto shared-memory rings,
//! while every descriptor stays the real kernel TCP socket.
//!
//! Because the socket stays real, everything the kernel answers keeps its
//! meaning — `getsockname`/`getpeername`/socket options (Nagle and the cork
//! are answered back: `sockopt`), fork, dup, close, FIN and RST — and
//! readiness stays exact: poll/select/epoll compute it from the ring for
//! waits they see (`wait`, lazy arming), and one-byte doorbells on the TCP
//! stream make the kernel's own readiness exact otherwise (`conn`). Only the
//! payload takes the ring. Co-location is confirmed through the broker's
//! registry by both ends before the first byte (`broker`).
//!
//! What it must never do: change the behaviour of a connection it did not
//! accelerate (every call on such a descriptor goes straight to libc after one
//! table lookup), block or fail a program because the broker is missing or
//! slow (no broker: plain TCP), let a peer's corrupt segment touch memory
//! outside the ring (indices are validated; the connection is reset), or
//! panic across the C ABI.
//!
//! Layout. This file holds only the interposed C entry points, each a few
//! lines that call into the module that owns the logic. The modules form
//! layers; each uses only those below it:
//!
//! 1. `config` (settings, process-wide switches), `sys` (errno, the
//!    library's own raw system calls, debug log, panic fence), `real`
//!    (libc's definitions of what we interpose);
//! 2. `addr` (what the kernel says about a socket), `netns` (routes and
//!    namespaces), `seg` (the shared segment), `sockopt` (Nagle and the
//!    cork), `broker` (the registry: listeners and requests);
//! 3. `conn` (one connection's byte-stream algorithms), then `table` (which
//!    descriptors are accelerated), then `stats` (published counters);
//! 4. `handshake` (setting up a connection and learning its fate), then
//!    `wait` (lazy readiness for poll/select/epoll);
//! 5. the entry points' logic: `socket` (descriptors), `io` (data),
//!    `poll` (waits), `inherit` (exec), `process` (load, fork, `syscall`).

#![allow(clippy::missing_safety_doc)]

mod addr;
mod broker;
mod config;
mod conn;
mod handshake;
mod inherit;
mod io;
mod netns;
mod passing;
mod pinned;
mod poll;
mod process;
mod real;
mod seg;
mod socket;
mod sockopt;
mod stats;
mod sys;
mod table;
mod wait;

use libc::{
    c_char, c_int, c_uint, c_ulong, c_void, iovec, msghdr, size_t, sockaddr, socklen_t, ssize_t,
};

// Every `unsafe` call below forwards the program's arguments, unchanged, to
// the module function of the same name, which has the libc call's contract.

// ---- load, fork ---------------------------------------------------------------

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

extern "C" fn init() {
    process::load();
}

#[no_mangle]
pub unsafe extern "C" fn fork() -> libc::pid_t {
    process::fork()
}

// ---- listen / connect / accept ----------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    // SAFETY: the program's arguments, under listen(2)'s contract.
    unsafe { socket::listen(fd, backlog) }
}

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // SAFETY: the program's arguments, under connect(2)'s contract.
    unsafe { socket::connect(fd, addr, len) }
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: the program's arguments, under accept(2)'s contract.
    unsafe { socket::accept4(fd, addr, len, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    // SAFETY: the program's arguments, under accept4(2)'s contract.
    unsafe { socket::accept4(fd, addr, len, flags) }
}

// ---- data path ----------------------------------------------------------------

/// glibc's fortify check of the `_chk` variants: a read longer than the
/// buffer the compiler knows of aborts, as libc's own check does.
fn fortify(n: size_t, buflen: size_t) {
    if n > buflen {
        // SAFETY: glibc's fortify failure path.
        unsafe { libc::abort() };
    }
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    // SAFETY: the program's arguments, under read(2)'s contract.
    unsafe { io::read(fd, buf, n) }
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
) -> ssize_t {
    fortify(n, buflen);
    // SAFETY: as for read.
    unsafe { io::read(fd, buf, n) }
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    // SAFETY: the program's arguments, under recv(2)'s contract.
    unsafe { io::recv(fd, buf, n, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
) -> ssize_t {
    fortify(n, buflen);
    // SAFETY: as for recv.
    unsafe { io::recv(fd, buf, n, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    // SAFETY: the program's arguments, under recvfrom(2)'s contract.
    unsafe { io::recvfrom(fd, buf, n, flags, addr, alen) }
}

#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    fortify(n, buflen);
    // SAFETY: as for recvfrom.
    unsafe { io::recvfrom(fd, buf, n, flags, addr, alen) }
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    // SAFETY: the program's arguments, under readv(2)'s contract.
    unsafe { io::readv(fd, iov, cnt) }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    // SAFETY: the program's arguments, under recvmsg(2)'s contract.
    let n = unsafe { io::recvmsg(fd, msg, flags) };
    // SAFETY: the msghdr the kernel just filled in (descriptors received).
    unsafe { passing::after_recv(msg, n) };
    n
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    // SAFETY: the program's arguments, under write(2)'s contract.
    unsafe { io::write(fd, buf, n) }
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    // SAFETY: the program's arguments, under send(2)'s contract.
    unsafe { io::send(fd, buf, n, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    alen: socklen_t,
) -> ssize_t {
    // SAFETY: the program's arguments, under sendto(2)'s contract.
    unsafe { io::sendto(fd, buf, n, flags, addr, alen) }
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    // SAFETY: the program's arguments, under writev(2)'s contract.
    unsafe { io::writev(fd, iov, cnt) }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    // SAFETY: the program's msghdr (descriptors it passes leave the ring first).
    unsafe { passing::before_send(msg) };
    // SAFETY: the program's arguments, under sendmsg(2)'s contract.
    unsafe { io::sendmsg(fd, msg, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn sendmmsg(fd: c_int, msgs: *mut libc::mmsghdr, n: c_uint, flags: c_int) -> c_int {
    if !msgs.is_null() {
        for i in 0..n as usize {
            // SAFETY: the program's array of `n` messages (descriptors it
            // passes leave the ring first).
            unsafe { passing::before_send(&(*msgs.add(i)).msg_hdr) };
        }
    }
    // SAFETY: the program's arguments, under sendmmsg(2)'s contract.
    unsafe { io::sendmmsg(fd, msgs, n, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn recvmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    n: c_uint,
    flags: c_int,
    timeout: *mut libc::timespec,
) -> c_int {
    // SAFETY: the program's arguments, under recvmmsg(2)'s contract.
    let got = unsafe { io::recvmmsg(fd, msgs, n, flags, timeout) };
    for i in 0..got.max(0) as usize {
        // SAFETY: the messages the call just filled in (descriptors received).
        unsafe { passing::after_recv(&(*msgs.add(i)).msg_hdr, (*msgs.add(i)).msg_len as isize) };
    }
    got
}

#[no_mangle]
pub unsafe extern "C" fn sendfile(
    out: c_int,
    inp: c_int,
    off: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    // SAFETY: the program's arguments, under sendfile(2)'s contract.
    unsafe { io::sendfile(out, inp, off, count) }
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(
    out: c_int,
    inp: c_int,
    off: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    // SAFETY: as for sendfile (off_t is 64-bit here).
    unsafe { io::sendfile(out, inp, off, count) }
}

#[no_mangle]
pub unsafe extern "C" fn splice(
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    flags: c_uint,
) -> ssize_t {
    // SAFETY: the program's arguments, under splice(2)'s contract.
    unsafe { io::splice(fd_in, off_in, fd_out, off_out, len, flags) }
}

// ---- descriptors ----------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    // SAFETY: the program's argument, under close(2)'s contract.
    unsafe { socket::close(fd) }
}

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    // SAFETY: the program's arguments, under shutdown(2)'s contract.
    unsafe { socket::shutdown(fd, how) }
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // SAFETY: the program's argument, under dup(2)'s contract.
    unsafe { socket::dup(fd) }
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    // SAFETY: the program's arguments, under dup2(2)'s contract.
    unsafe { socket::dup3(old, new, None) }
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    // SAFETY: the program's arguments, under dup3(2)'s contract.
    unsafe { socket::dup3(old, new, Some(flags)) }
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: the program's arguments, under fcntl(2)'s contract.
    unsafe { socket::fcntl(fd, cmd, arg) }
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    // SAFETY: as for fcntl.
    unsafe { socket::fcntl(fd, cmd, arg) }
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    // SAFETY: the program's arguments, under setsockopt(2)'s contract.
    unsafe { socket::setsockopt(fd, level, name, val, len) }
}

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    // SAFETY: the program's arguments, under getsockopt(2)'s contract.
    unsafe { socket::getsockopt(fd, level, name, val, len) }
}

#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: *mut c_void) -> c_int {
    // SAFETY: the program's arguments, under ioctl(2)'s contract.
    unsafe { socket::ioctl(fd, req, arg) }
}

#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    // SAFETY: the program's arguments, under close_range(2)'s contract.
    unsafe { socket::close_range(first, last, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn closefrom(low: c_int) {
    // SAFETY: same semantics as close_range(low, ~0, 0).
    unsafe { socket::close_range(low.max(0) as c_uint, c_uint::MAX, 0) };
}

// ---- calls that create descriptors ------------------------------------------------
//
// A number they return was free: whatever the library remembers under it is
// stale (closed where we could not see: a raw system call, io_uring, a static
// helper) and is forgotten (`socket::fresh_fd`) before the program can use it.

/// Makes a descriptor-creating call and forgets stale state under the
/// number it returned. When the program is out of descriptor numbers
/// (`EMFILE`) while the library keeps some, they are given back and the
/// call made again: the library never costs a program a descriptor TCP
/// alone would have left it (the calls fail with `EMFILE` before creating
/// anything, so a retry is the same call).
fn fresh(call: impl Fn() -> c_int) -> c_int {
    let mut r = call();
    if r < 0 && sys::errno() == libc::EMFILE && seg::give_back_kept() {
        r = call();
    }
    socket::fresh_fd(r);
    r
}

/// As `fresh` for calls that fill a two-descriptor array.
///
/// # Safety
/// `fds` points to two ints when `r == 0`.
unsafe fn fresh_pair(call: impl Fn() -> c_int, fds: *mut c_int) -> c_int {
    let mut r = call();
    if r < 0 && sys::errno() == libc::EMFILE && seg::give_back_kept() {
        r = call();
    }
    if r == 0 && !fds.is_null() {
        // SAFETY: the call succeeded and filled both.
        let (a, b) = unsafe { (*fds, *fds.add(1)) };
        socket::fresh_fd(a);
        socket::fresh_fd(b);
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, proto: c_int) -> c_int {
    // SAFETY: the program's arguments, under socket(2)'s contract.
    fresh(|| unsafe { real::socket(domain, ty, proto) })
}

#[no_mangle]
pub unsafe extern "C" fn socketpair(
    domain: c_int,
    ty: c_int,
    proto: c_int,
    sv: *mut c_int,
) -> c_int {
    // SAFETY: the program's arguments, under socketpair(2)'s contract.
    unsafe { fresh_pair(|| real::socketpair(domain, ty, proto, sv), sv) }
}

#[no_mangle]
pub unsafe extern "C" fn pipe(fds: *mut c_int) -> c_int {
    // SAFETY: the program's arguments, under pipe(2)'s contract.
    unsafe { fresh_pair(|| real::pipe(fds), fds) }
}

#[no_mangle]
pub unsafe extern "C" fn pipe2(fds: *mut c_int, flags: c_int) -> c_int {
    // SAFETY: the program's arguments, under pipe2(2)'s contract.
    unsafe { fresh_pair(|| real::pipe2(fds, flags), fds) }
}

#[no_mangle]
pub unsafe extern "C" fn eventfd(init: c_uint, flags: c_int) -> c_int {
    // SAFETY: the program's arguments, under eventfd(2)'s contract.
    fresh(|| unsafe { real::eventfd(init, flags) })
}

#[no_mangle]
pub unsafe extern "C" fn memfd_create(name: *const c_char, flags: c_uint) -> c_int {
    // SAFETY: the program's arguments, under memfd_create(2)'s contract.
    fresh(|| unsafe { real::memfd_create(name, flags) })
}

/// As `fresh` for calls that return a stream (`FILE *`, `DIR *`): the
/// descriptor under it (`fd_of`) is the fresh number.
fn fresh_stream<T>(call: impl Fn() -> *mut T, fd_of: impl Fn(*mut T) -> c_int) -> *mut T {
    let mut r = call();
    if r.is_null() && sys::errno() == libc::EMFILE && seg::give_back_kept() {
        r = call();
    }
    if !r.is_null() {
        socket::fresh_fd(fd_of(r));
    }
    r
}

/// The descriptor of a stream the call just returned.
fn file_fd(f: *mut libc::FILE) -> c_int {
    // SAFETY: a stream libc just opened.
    unsafe { libc::fileno(f) }
}

/// Calls that create descriptors inside libc, where no interposed `open`
/// sees them (glibc's own `__open`): their number is just as fresh.
macro_rules! fresh_fns {
    ($( $name:ident ( $($arg:ident : $ty:ty),* ); )*) => {
        $(
            #[no_mangle]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_int {
                // SAFETY: the program's arguments, under the call's contract.
                fresh(|| unsafe { real::$name($($arg),*) })
            }
        )*
    };
}
fresh_fns! {
    timerfd_create(clock: c_int, flags: c_int);
    inotify_init();
    inotify_init1(flags: c_int);
    fanotify_init(flags: c_uint, event_flags: c_uint);
    creat(path: *const c_char, mode: libc::mode_t);
    creat64(path: *const c_char, mode: libc::mode_t);
    mkstemp(template: *mut c_char);
    mkstemp64(template: *mut c_char);
    mkostemp(template: *mut c_char, flags: c_int);
    mkostemp64(template: *mut c_char, flags: c_int);
    mkstemps(template: *mut c_char, suffix: c_int);
    mkstemps64(template: *mut c_char, suffix: c_int);
    mkostemps(template: *mut c_char, suffix: c_int, flags: c_int);
    mkostemps64(template: *mut c_char, suffix: c_int, flags: c_int);
}

#[no_mangle]
pub unsafe extern "C" fn signalfd(fd: c_int, mask: *const libc::sigset_t, flags: c_int) -> c_int {
    if fd != -1 {
        // Changes the mask of an existing signalfd: no new number.
        // SAFETY: the program's arguments, under signalfd(2)'s contract.
        return unsafe { real::signalfd(fd, mask, flags) };
    }
    // SAFETY: as above.
    fresh(|| unsafe { real::signalfd(fd, mask, flags) })
}

macro_rules! fresh_file_fns {
    ($( $name:ident ( $($arg:ident : $ty:ty),* ); )*) => {
        $(
            #[no_mangle]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> *mut libc::FILE {
                // SAFETY: the program's arguments, under the call's contract.
                fresh_stream(|| unsafe { real::$name($($arg),*) }, file_fd)
            }
        )*
    };
}
fresh_file_fns! {
    fopen(path: *const c_char, mode: *const c_char);
    fopen64(path: *const c_char, mode: *const c_char);
    freopen(path: *const c_char, mode: *const c_char, f: *mut libc::FILE);
    freopen64(path: *const c_char, mode: *const c_char, f: *mut libc::FILE);
    tmpfile();
    tmpfile64();
}

/// `fdopen`: glibc's stream reads and writes the descriptor with its own
/// internal calls, which no preload sees, so the connection leaves the ring
/// (`passing::leave_ring`): plain TCP when undecided (the usual case, a
/// stream made right after `accept` or `connect`), reset when on the ring.
#[no_mangle]
pub unsafe extern "C" fn fdopen(fd: c_int, mode: *const c_char) -> *mut libc::FILE {
    // Only for the socket the entry was made for: a number closed where we
    // could not see may name a file or a pipe now (sshd makes streams of
    // those). Under a seccomp filter the check itself may be refused, and
    // such a process makes no new connections: leave it alone.
    if table::lookup(fd).is_some() && !config::restricted() && table::entry_is_current(fd) {
        let e = sys::errno();
        passing::leave_ring(fd, "wrapped in a stdio stream");
        sys::set_errno(e);
    }
    // SAFETY: the program's arguments, under fdopen(3)'s contract.
    unsafe { real::fdopen(fd, mode) }
}

/// `fclose` closes the stream's descriptor with glibc's internal `close`:
/// forget it as `close` does.
#[no_mangle]
pub unsafe extern "C" fn fclose(f: *mut libc::FILE) -> c_int {
    if !f.is_null() && (table::count() != 0 || pinned::any()) {
        socket::forget_closed(file_fd(f));
    }
    // SAFETY: the program's arguments, under fclose(3)'s contract.
    unsafe { real::fclose(f) }
}

#[no_mangle]
pub unsafe extern "C" fn opendir(path: *const c_char) -> *mut libc::DIR {
    // SAFETY: the program's arguments, under opendir(3)'s contract; dirfd
    // on the stream it just returned.
    fresh_stream(|| unsafe { real::opendir(path) }, |d| unsafe { libc::dirfd(d) })
}

/// `open` and friends are C-variadic (the mode); they take it as a fixed
/// third word, sound on the ABIs the `syscall` shim below explains, and
/// built only there.
macro_rules! open_like {
    ($name:ident) => {
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        #[no_mangle]
        pub unsafe extern "C" fn $name(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
            static SLOT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            // SAFETY: the program's arguments, under open(2)'s contract.
            fresh(|| unsafe {
                real::open_named(&SLOT, concat!(stringify!($name), "\0"), path, flags, mode)
            })
        }
    };
}
open_like!(open);
open_like!(open64);

macro_rules! openat_like {
    ($name:ident) => {
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            dirfd: c_int,
            path: *const c_char,
            flags: c_int,
            mode: c_uint,
        ) -> c_int {
            static SLOT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            // SAFETY: the program's arguments, under openat(2)'s contract.
            fresh(|| unsafe {
                real::openat_named(
                    &SLOT,
                    concat!(stringify!($name), "\0"),
                    dirfd,
                    path,
                    flags,
                    mode,
                )
            })
        }
    };
}
openat_like!(openat);
openat_like!(openat64);

#[no_mangle]
pub unsafe extern "C" fn __open_2(path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: the program's arguments (fortified open without a mode).
    fresh(|| unsafe { real::__open_2(path, flags) })
}

#[no_mangle]
pub unsafe extern "C" fn __open64_2(path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: as for __open_2.
    fresh(|| unsafe { real::__open64_2(path, flags) })
}

#[no_mangle]
pub unsafe extern "C" fn __openat_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: the program's arguments (fortified openat without a mode).
    fresh(|| unsafe { real::__openat_2(dirfd, path, flags) })
}

#[no_mangle]
pub unsafe extern "C" fn __openat64_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: as for __openat_2.
    fresh(|| unsafe { real::__openat64_2(dirfd, path, flags) })
}

// ---- seccomp ---------------------------------------------------------------------

/// `prctl(2)` is C-variadic; like `syscall` below it takes its four
/// argument words as fixed parameters (sound on the ABIs explained there)
/// and passes all of them on. `PR_SET_SECCOMP` is noticed before the call:
/// the library confines itself first (`process::restrict`).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
pub unsafe extern "C" fn prctl(
    option: c_int,
    a2: c_ulong,
    a3: c_ulong,
    a4: c_ulong,
    a5: c_ulong,
) -> c_int {
    if process::installs_seccomp(true, option as libc::c_long, a2 as libc::c_long) {
        process::restrict("prctl(PR_SET_SECCOMP)");
    }
    // SAFETY: the program's arguments, under prctl(2)'s contract.
    unsafe { real::prctl(option, a2, a3, a4, a5) }
}

// ---- waiting: poll, select, epoll ----------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn epoll_create(size: c_int) -> c_int {
    // SAFETY: the program's argument.
    unsafe { poll::epoll_create(size) }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_create1(flags: c_int) -> c_int {
    // SAFETY: the program's argument.
    unsafe { poll::epoll_create1(flags) }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut libc::epoll_event,
) -> c_int {
    // SAFETY: the program's arguments, under epoll_ctl(2)'s contract.
    unsafe { poll::epoll_ctl(epfd, op, fd, ev) }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    evs: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    // SAFETY: the program's arguments, under epoll_wait(2)'s contract.
    unsafe { poll::epoll_wait(epfd, evs, max, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    evs: *mut libc::epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: the program's arguments, under epoll_pwait(2)'s contract.
    unsafe { poll::epoll_pwait(epfd, evs, max, timeout, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    evs: *mut libc::epoll_event,
    max: c_int,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: the program's arguments, under epoll_pwait2(2)'s contract.
    unsafe { poll::epoll_pwait2(epfd, evs, max, ts, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut libc::pollfd, n: libc::nfds_t, timeout: c_int) -> c_int {
    // SAFETY: the program's arguments, under poll(2)'s contract.
    unsafe { poll::poll(fds, n, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: the program's arguments, under ppoll(2)'s contract.
    unsafe { poll::ppoll(fds, n, ts, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    timeout: c_int,
    fdslen: size_t,
) -> c_int {
    if fdslen / std::mem::size_of::<libc::pollfd>() < n as usize {
        // SAFETY: libc's check, which reports the overflow and aborts.
        return unsafe { real::__poll_chk(fds, n, timeout, fdslen) };
    }
    // SAFETY: as for poll.
    unsafe { poll::poll(fds, n, timeout) }
}

#[no_mangle]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut libc::pollfd,
    n: libc::nfds_t,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
    fdslen: size_t,
) -> c_int {
    if fdslen / std::mem::size_of::<libc::pollfd>() < n as usize {
        // SAFETY: libc's check, which reports the overflow and aborts.
        return unsafe { real::__ppoll_chk(fds, n, ts, mask, fdslen) };
    }
    // SAFETY: as for ppoll.
    unsafe { poll::ppoll(fds, n, ts, mask) }
}

#[no_mangle]
pub unsafe extern "C" fn select(
    nfds: c_int,
    rd: *mut libc::fd_set,
    wr: *mut libc::fd_set,
    ex: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    // SAFETY: the program's arguments, under select(2)'s contract.
    unsafe { poll::select(nfds, rd, wr, ex, tv) }
}

#[no_mangle]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    rd: *mut libc::fd_set,
    wr: *mut libc::fd_set,
    ex: *mut libc::fd_set,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: the program's arguments, under pselect(2)'s contract.
    unsafe { poll::pselect(nfds, rd, wr, ex, ts, mask) }
}

// ---- exec and spawn (see `inherit`) ---------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn execve(
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: the program's arguments, under execve(2)'s contract.
    unsafe { inherit::execve(path, argv, envp) }
}

#[no_mangle]
pub unsafe extern "C" fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: the program's arguments, under execv(3)'s contract.
    unsafe { inherit::execv(path, argv) }
}

#[no_mangle]
pub unsafe extern "C" fn execvpe(
    file: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: the program's arguments, under execvpe(3)'s contract.
    unsafe { inherit::execvpe(file, argv, envp) }
}

#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    // SAFETY: the program's arguments, under execvp(3)'s contract.
    unsafe { inherit::execvp(file, argv) }
}

#[no_mangle]
pub unsafe extern "C" fn fexecve(
    fd: c_int,
    argv: *const *const c_char,
    envp: *const *const c_char,
) -> c_int {
    // SAFETY: the program's arguments, under fexecve(3)'s contract.
    unsafe { inherit::fexecve(fd, argv, envp) }
}

#[no_mangle]
pub unsafe extern "C" fn execveat(
    dirfd: c_int,
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
    flags: c_int,
) -> c_int {
    // SAFETY: the program's arguments, under execveat(2)'s contract.
    unsafe { inherit::execveat(dirfd, path, argv, envp, flags) }
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawn(
    pid: *mut libc::pid_t,
    path: *const c_char,
    fa: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    pinned::copies_may_exist();
    // SAFETY: the program's arguments, under posix_spawn(3)'s contract.
    unsafe { inherit::posix_spawn(pid, path, fa, attr, argv, envp) }
}

#[no_mangle]
pub unsafe extern "C" fn posix_spawnp(
    pid: *mut libc::pid_t,
    file: *const c_char,
    fa: *const libc::posix_spawn_file_actions_t,
    attr: *const libc::posix_spawnattr_t,
    argv: *const *mut c_char,
    envp: *const *mut c_char,
) -> c_int {
    pinned::copies_may_exist();
    // SAFETY: the program's arguments, under posix_spawnp(3)'s contract.
    unsafe { inherit::posix_spawnp(pid, file, fa, attr, argv, envp) }
}

/// The `execl` family is C-variadic. Rust cannot define a C-variadic
/// function on stable, so each wrapper takes `inherit::MAX_L` pointer-sized
/// parameters: on the ABIs the variadic entry points are built for (see
/// `syscall` below) a variadic pointer argument arrives exactly where a
/// fixed one would, so slot `i` is the `i`-th argument; slots after the
/// terminator are never used (see `inherit::collect`).
macro_rules! execl_like {
    ($name:ident, $with_env:expr, $target:path) => {
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        #[no_mangle]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "C" fn $name(
            path: *const c_char,
            a0: *const c_char,
            a1: *const c_char,
            a2: *const c_char,
            a3: *const c_char,
            a4: *const c_char,
            a5: *const c_char,
            a6: *const c_char,
            a7: *const c_char,
            a8: *const c_char,
            a9: *const c_char,
            a10: *const c_char,
            a11: *const c_char,
            a12: *const c_char,
            a13: *const c_char,
            a14: *const c_char,
            a15: *const c_char,
            a16: *const c_char,
            a17: *const c_char,
            a18: *const c_char,
            a19: *const c_char,
            a20: *const c_char,
            a21: *const c_char,
            a22: *const c_char,
            a23: *const c_char,
            a24: *const c_char,
            a25: *const c_char,
            a26: *const c_char,
            a27: *const c_char,
            a28: *const c_char,
            a29: *const c_char,
        ) -> c_int {
            let args: [*const c_char; inherit::MAX_L] = [
                a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17,
                a18, a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29,
            ];
            // SAFETY: the program's argument list, as execl(3) takes it.
            unsafe { inherit::execl(stringify!($name), path, &args, $with_env, $target) }
        }
    };
}

execl_like!(execl, false, inherit::execve);
execl_like!(execle, true, inherit::execve);
execl_like!(execlp, false, inherit::execvpe);

// ---- syscall(2) ----------------------------------------------------------------

/// `syscall(2)`: `process::syscall_observed` sees the number, then libc's
/// `syscall` makes the call with the program's arguments.
///
/// ABI. libc declares `long syscall(long number, ...)`. Rust cannot define
/// a C-variadic function on stable, so this one takes the number and six
/// argument words as fixed parameters and passes all six on (the kernel
/// ignores the words a system call does not take). That is sound only where
/// a variadic callee finds integer arguments exactly where a callee with
/// fixed integer parameters looks for them, which holds on the two
/// architectures it is built for:
/// - x86-64 (System V): integer arguments, variadic or not, go in rdi, rsi,
///   rdx, rcx, r8, r9, then on the stack in order (`al`, the count of vector
///   registers a variadic caller sets, is read only by a variadic callee's
///   prologue). The number and five words arrive in registers; the sixth is
///   read from the caller's first stack-argument slot — as glibc's own
///   `syscall` does. A caller that passed fewer words leaves some value of
///   its own frame there, which is passed on and ignored.
/// - AArch64 (AAPCS64 as Linux uses it; not Apple's variant, which puts
///   variadic arguments on the stack): variadic integer arguments go in
///   x0–x7 like fixed ones, so all seven arrive in x0–x6.
///
/// Elsewhere the interposer is not built: programs' `syscall` calls go to
/// libc directly, and an io_uring created through it is not noticed.
///
/// Nothing inside this object calls it: the library's own system calls are
/// raw (`sys`), and the linker sends the `syscall` calls of std and
/// parking_lot to `sys::__wrap_syscall` (build.rs; `tests/syscall.rs`
/// checks that no relocation names `syscall`).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
pub unsafe extern "C" fn syscall(
    n: libc::c_long,
    a1: libc::c_long,
    a2: libc::c_long,
    a3: libc::c_long,
    a4: libc::c_long,
    a5: libc::c_long,
    a6: libc::c_long,
) -> libc::c_long {
    // Calls that change the descriptor table (libuv closes sockets with
    // syscall(SYS_close)) or move a socket's bytes take the same path as
    // their libc wrappers, so the library's tables follow and the bytes use
    // the ring; the wrappers make the same system call.
    // SAFETY: the program's arguments, under each call's contract.
    unsafe {
        match n {
            libc::SYS_close => return socket::close(a1 as c_int) as libc::c_long,
            libc::SYS_close_range => {
                return socket::close_range(a1 as c_uint, a2 as c_uint, a3 as c_int) as libc::c_long
            }
            libc::SYS_dup => return socket::dup(a1 as c_int) as libc::c_long,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_dup2 => return socket::dup3(a1 as c_int, a2 as c_int, None) as libc::c_long,
            libc::SYS_dup3 => {
                return socket::dup3(a1 as c_int, a2 as c_int, Some(a3 as c_int)) as libc::c_long
            }
            libc::SYS_fcntl => {
                return socket::fcntl(a1 as c_int, a2 as c_int, a3 as c_ulong) as libc::c_long
            }
            libc::SYS_connect => {
                return socket::connect(a1 as c_int, a2 as *const sockaddr, a3 as socklen_t)
                    as libc::c_long
            }
            libc::SYS_listen => return socket::listen(a1 as c_int, a2 as c_int) as libc::c_long,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_accept => {
                return socket::accept4(a1 as c_int, a2 as *mut sockaddr, a3 as *mut socklen_t, 0)
                    as libc::c_long
            }
            libc::SYS_accept4 => {
                return socket::accept4(
                    a1 as c_int,
                    a2 as *mut sockaddr,
                    a3 as *mut socklen_t,
                    a4 as c_int,
                ) as libc::c_long
            }
            libc::SYS_shutdown => {
                return socket::shutdown(a1 as c_int, a2 as c_int) as libc::c_long
            }
            // The data path too: on an accelerated socket the kernel's
            // calls would read doorbells as data, or put bytes beside the
            // ring.
            libc::SYS_read => return read(a1 as c_int, a2 as *mut c_void, a3 as size_t) as libc::c_long,
            libc::SYS_write => return write(a1 as c_int, a2 as *const c_void, a3 as size_t) as libc::c_long,
            libc::SYS_readv => return readv(a1 as c_int, a2 as *const iovec, a3 as c_int) as libc::c_long,
            libc::SYS_writev => return writev(a1 as c_int, a2 as *const iovec, a3 as c_int) as libc::c_long,
            libc::SYS_sendto => {
                return sendto(a1 as c_int, a2 as *const c_void, a3 as size_t, a4 as c_int, a5 as *const sockaddr, a6 as socklen_t)
                    as libc::c_long
            }
            libc::SYS_recvfrom => {
                return recvfrom(a1 as c_int, a2 as *mut c_void, a3 as size_t, a4 as c_int, a5 as *mut sockaddr, a6 as *mut socklen_t)
                    as libc::c_long
            }
            libc::SYS_sendmsg => return sendmsg(a1 as c_int, a2 as *const msghdr, a3 as c_int) as libc::c_long,
            libc::SYS_recvmsg => return recvmsg(a1 as c_int, a2 as *mut msghdr, a3 as c_int) as libc::c_long,
            libc::SYS_sendmmsg => {
                return sendmmsg(a1 as c_int, a2 as *mut libc::mmsghdr, a3 as c_uint, a4 as c_int) as libc::c_long
            }
            libc::SYS_recvmmsg => {
                return recvmmsg(a1 as c_int, a2 as *mut libc::mmsghdr, a3 as c_uint, a4 as c_int, a5 as *mut libc::timespec)
                    as libc::c_long
            }
            _ => {}
        }
    }
    process::syscall_observed(n);
    // SAFETY: forwarding the program's system call to libc's `syscall`.
    let r = unsafe { real::syscall(n, [a1, a2, a3, a4, a5, a6]) };
    if r >= 0 && process::creates_descriptor(n) {
        socket::fresh_fd(r as c_int);
    }
    r
}
