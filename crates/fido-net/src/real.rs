//! The next definitions (libc's) of the calls this library interposes,
//! resolved once with `dlsym(RTLD_NEXT, …)`.
//!
//! Everything the library does to a socket goes through these, never through
//! the interposed names, so an interposer never re-enters itself on an
//! application descriptor.

use libc::{
    c_char, c_int, c_uint, c_void, iovec, msghdr, nfds_t, pollfd, size_t, sockaddr, socklen_t,
    ssize_t,
};
use std::sync::atomic::{AtomicUsize, Ordering};

fn resolve(name: &'static str) -> usize {
    debug_assert!(name.ends_with('\0'));
    // SAFETY: `name` is NUL-terminated; RTLD_NEXT asks for the definition after
    // this object's in the lookup order, i.e. libc's.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr() as *const c_char) };
    if p.is_null() {
        crate::sys::write_stderr(b"fido-net: libc lacks an interposed symbol; aborting\n");
        // SAFETY: abort has no preconditions.
        unsafe { libc::abort() };
    }
    p as usize
}

macro_rules! real_fns {
    ($( $name:ident ( $($arg:ident : $ty:ty),* ) -> $ret:ty; )*) => {
        $(
            /// libc's definition of this call.
            ///
            /// # Safety
            /// Same contract as the libc function.
            pub unsafe fn $name($($arg: $ty),*) -> $ret {
                static SLOT: AtomicUsize = AtomicUsize::new(0);
                let mut f = SLOT.load(Ordering::Relaxed);
                if f == 0 {
                    f = resolve(concat!(stringify!($name), "\0"));
                    SLOT.store(f, Ordering::Relaxed);
                }
                // SAFETY: `f` is libc's definition of this symbol, whose C
                // prototype is the one spelled here.
                let f: unsafe extern "C" fn($($ty),*) -> $ret = unsafe { std::mem::transmute::<usize, _>(f) };
                // SAFETY: the caller upholds the libc contract.
                unsafe { f($($arg),*) }
            }
        )*
    };
}

real_fns! {
    connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int;
    listen(fd: c_int, backlog: c_int) -> c_int;
    accept4(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t, flags: c_int) -> c_int;
    read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t;
    write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t;
    readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t;
    writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t;
    send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t;
    recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t;
    sendto(fd: c_int, buf: *const c_void, n: size_t, flags: c_int, addr: *const sockaddr, len: socklen_t) -> ssize_t;
    recvfrom(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> ssize_t;
    sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t;
    recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t;
    sendmmsg(fd: c_int, msgs: *mut libc::mmsghdr, n: c_uint, flags: c_int) -> c_int;
    recvmmsg(fd: c_int, msgs: *mut libc::mmsghdr, n: c_uint, flags: c_int, timeout: *mut libc::timespec) -> c_int;
    close(fd: c_int) -> c_int;
    shutdown(fd: c_int, how: c_int) -> c_int;
    dup(fd: c_int) -> c_int;
    dup2(fd: c_int, new: c_int) -> c_int;
    dup3(fd: c_int, new: c_int, flags: c_int) -> c_int;
    poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int;
    close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int;
    fork() -> libc::pid_t;
    splice(fd_in: c_int, off_in: *mut libc::loff_t, fd_out: c_int, off_out: *mut libc::loff_t, len: size_t, flags: c_uint) -> ssize_t;
    sendfile(out: c_int, inp: c_int, off: *mut libc::off_t, n: size_t) -> ssize_t;
    ppoll(fds: *mut pollfd, n: nfds_t, ts: *const libc::timespec, mask: *const libc::sigset_t) -> c_int;
    select(n: c_int, rd: *mut libc::fd_set, wr: *mut libc::fd_set, ex: *mut libc::fd_set, tv: *mut libc::timeval) -> c_int;
    pselect(n: c_int, rd: *mut libc::fd_set, wr: *mut libc::fd_set, ex: *mut libc::fd_set, ts: *const libc::timespec, mask: *const libc::sigset_t) -> c_int;
    epoll_create(size: c_int) -> c_int;
    epoll_create1(flags: c_int) -> c_int;
    epoll_ctl(epfd: c_int, op: c_int, fd: c_int, ev: *mut libc::epoll_event) -> c_int;
    epoll_wait(epfd: c_int, evs: *mut libc::epoll_event, max: c_int, timeout: c_int) -> c_int;
    epoll_pwait(epfd: c_int, evs: *mut libc::epoll_event, max: c_int, timeout: c_int, mask: *const libc::sigset_t) -> c_int;
    epoll_pwait2(epfd: c_int, evs: *mut libc::epoll_event, max: c_int, ts: *const libc::timespec, mask: *const libc::sigset_t) -> c_int;
    __poll_chk(fds: *mut pollfd, n: nfds_t, timeout: c_int, fdslen: size_t) -> c_int;
    __ppoll_chk(fds: *mut pollfd, n: nfds_t, ts: *const libc::timespec, mask: *const libc::sigset_t, fdslen: size_t) -> c_int;
    getsockopt(fd: c_int, level: c_int, name: c_int, val: *mut c_void, len: *mut socklen_t) -> c_int;
    setsockopt(fd: c_int, level: c_int, name: c_int, val: *const c_void, len: socklen_t) -> c_int;
}

// Calls that create descriptors (see `socket::fresh_fd`).
real_fns! {
    socket(domain: c_int, ty: c_int, proto: c_int) -> c_int;
    socketpair(domain: c_int, ty: c_int, proto: c_int, sv: *mut c_int) -> c_int;
    pipe(fds: *mut c_int) -> c_int;
    pipe2(fds: *mut c_int, flags: c_int) -> c_int;
    eventfd(init: c_uint, flags: c_int) -> c_int;
    memfd_create(name: *const c_char, flags: c_uint) -> c_int;
    __open_2(path: *const c_char, flags: c_int) -> c_int;
    __open64_2(path: *const c_char, flags: c_int) -> c_int;
    __openat_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int;
    __openat64_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int;
    timerfd_create(clock: c_int, flags: c_int) -> c_int;
    signalfd(fd: c_int, mask: *const libc::sigset_t, flags: c_int) -> c_int;
    inotify_init() -> c_int;
    inotify_init1(flags: c_int) -> c_int;
    fanotify_init(flags: c_uint, event_flags: c_uint) -> c_int;
    creat(path: *const c_char, mode: libc::mode_t) -> c_int;
    creat64(path: *const c_char, mode: libc::mode_t) -> c_int;
    mkstemp(template: *mut c_char) -> c_int;
    mkstemp64(template: *mut c_char) -> c_int;
    mkostemp(template: *mut c_char, flags: c_int) -> c_int;
    mkostemp64(template: *mut c_char, flags: c_int) -> c_int;
    mkstemps(template: *mut c_char, suffix: c_int) -> c_int;
    mkstemps64(template: *mut c_char, suffix: c_int) -> c_int;
    mkostemps(template: *mut c_char, suffix: c_int, flags: c_int) -> c_int;
    mkostemps64(template: *mut c_char, suffix: c_int, flags: c_int) -> c_int;
    fopen(path: *const c_char, mode: *const c_char) -> *mut libc::FILE;
    fopen64(path: *const c_char, mode: *const c_char) -> *mut libc::FILE;
    freopen(path: *const c_char, mode: *const c_char, f: *mut libc::FILE) -> *mut libc::FILE;
    freopen64(path: *const c_char, mode: *const c_char, f: *mut libc::FILE) -> *mut libc::FILE;
    tmpfile() -> *mut libc::FILE;
    tmpfile64() -> *mut libc::FILE;
    opendir(path: *const c_char) -> *mut libc::DIR;
    fdopen(fd: c_int, mode: *const c_char) -> *mut libc::FILE;
    fclose(f: *mut libc::FILE) -> c_int;
}

/// libc's `open`/`open64` (`name`, NUL-terminated; variadic: the mode is
/// passed as the one variadic argument, read only with `O_CREAT`/`O_TMPFILE`).
///
/// # Safety
/// Same contract as `open(2)`.
pub unsafe fn open_named(
    slot: &AtomicUsize,
    name: &'static str,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    let mut f = slot.load(Ordering::Relaxed);
    if f == 0 {
        f = resolve(name);
        slot.store(f, Ordering::Relaxed);
    }
    // SAFETY: libc's open has this variadic prototype.
    let f: unsafe extern "C" fn(*const c_char, c_int, ...) -> c_int =
        unsafe { std::mem::transmute::<usize, _>(f) };
    // SAFETY: the caller upholds open's contract.
    unsafe { f(path, flags, mode) }
}

/// libc's `openat`/`openat64` (variadic, as `open_named`).
///
/// # Safety
/// Same contract as `openat(2)`.
pub unsafe fn openat_named(
    slot: &AtomicUsize,
    name: &'static str,
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    let mut f = slot.load(Ordering::Relaxed);
    if f == 0 {
        f = resolve(name);
        slot.store(f, Ordering::Relaxed);
    }
    // SAFETY: libc's openat has this variadic prototype.
    let f: unsafe extern "C" fn(c_int, *const c_char, c_int, ...) -> c_int =
        unsafe { std::mem::transmute::<usize, _>(f) };
    // SAFETY: the caller upholds openat's contract.
    unsafe { f(dirfd, path, flags, mode) }
}

// The exec family and posix_spawn (see `inherit`).
real_fns! {
    execve(path: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    execvpe(file: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    fexecve(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    execveat(dirfd: c_int, path: *const c_char, argv: *const *const c_char, envp: *const *const c_char, flags: c_int) -> c_int;
    posix_spawn(pid: *mut libc::pid_t, path: *const c_char, fa: *const libc::posix_spawn_file_actions_t, attr: *const libc::posix_spawnattr_t, argv: *const *mut c_char, envp: *const *mut c_char) -> c_int;
    posix_spawnp(pid: *mut libc::pid_t, file: *const c_char, fa: *const libc::posix_spawn_file_actions_t, attr: *const libc::posix_spawnattr_t, argv: *const *mut c_char, envp: *const *mut c_char) -> c_int;
}

/// libc's `fcntl` (variadic: called through a variadic pointer).
///
/// # Safety
/// Same contract as `fcntl(2)`.
pub unsafe fn fcntl(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    let mut f = SLOT.load(Ordering::Relaxed);
    if f == 0 {
        f = resolve("fcntl\0");
        SLOT.store(f, Ordering::Relaxed);
    }
    // SAFETY: libc's fcntl has this variadic prototype.
    let f: unsafe extern "C" fn(c_int, c_int, ...) -> c_int =
        unsafe { std::mem::transmute::<usize, _>(f) };
    // SAFETY: the caller upholds fcntl's contract for `cmd`.
    unsafe { f(fd, cmd, arg) }
}

/// libc's `prctl` (variadic: four argument words).
///
/// # Safety
/// Same contract as `prctl(2)` for `option`.
pub unsafe fn prctl(
    option: c_int,
    a2: libc::c_ulong,
    a3: libc::c_ulong,
    a4: libc::c_ulong,
    a5: libc::c_ulong,
) -> c_int {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    let mut f = SLOT.load(Ordering::Relaxed);
    if f == 0 {
        f = resolve("prctl\0");
        SLOT.store(f, Ordering::Relaxed);
    }
    // SAFETY: libc's prctl has this variadic prototype.
    let f: unsafe extern "C" fn(c_int, ...) -> c_int =
        unsafe { std::mem::transmute::<usize, _>(f) };
    // SAFETY: the caller upholds prctl's contract.
    unsafe { f(option, a2, a3, a4, a5) }
}

/// libc's `ioctl` (variadic).
///
/// # Safety
/// Same contract as `ioctl(2)`.
pub unsafe fn ioctl(fd: c_int, req: libc::c_ulong, arg: *mut c_void) -> c_int {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    let mut f = SLOT.load(Ordering::Relaxed);
    if f == 0 {
        f = resolve("ioctl\0");
        SLOT.store(f, Ordering::Relaxed);
    }
    // SAFETY: libc's ioctl has this variadic prototype.
    let f: unsafe extern "C" fn(c_int, libc::c_ulong, ...) -> c_int =
        unsafe { std::mem::transmute::<usize, _>(f) };
    // SAFETY: the caller upholds ioctl's contract for `req`.
    unsafe { f(fd, req, arg) }
}

/// libc's `syscall`, called as what it is: a C-variadic function, given the
/// six argument words the interposer received (see the `syscall` shim in lib.rs; the
/// kernel ignores the words a system call does not take).
///
/// # Safety
/// Same contract as `syscall(2)` for system call `n`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub unsafe fn syscall(n: libc::c_long, a: [libc::c_long; 6]) -> libc::c_long {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    let mut f = SLOT.load(Ordering::Relaxed);
    if f == 0 {
        f = resolve("syscall\0");
        SLOT.store(f, Ordering::Relaxed);
    }
    // SAFETY: libc's syscall has this variadic prototype.
    let f: unsafe extern "C" fn(libc::c_long, ...) -> libc::c_long =
        unsafe { std::mem::transmute::<usize, _>(f) };
    // SAFETY: the caller upholds the contract of system call `n`.
    unsafe { f(n, a[0], a[1], a[2], a[3], a[4], a[5]) }
}
