//! Events of the whole process rather than of one descriptor: the library's
//! load (settings, connections inherited across exec, fork handlers), `fork`
//! itself, and the system calls a program makes through `syscall(2)` that
//! change what this library may do.
//!
//! Must never: fail a program's fork or its system call; everything here is
//! bookkeeping around the kernel's answer.

use crate::sys::guard;
use crate::{broker, config, inherit, real, stats, table, wait};
use std::sync::atomic::Ordering;

/// The library's constructor.
pub fn load() {
    // Read the configuration now: some programs (nginx) replace the
    // environment of the children they fork.
    config::read_at_load();
    broker::set_broker_path(fido::default_broker_path());
    inherit::set_owner();
    // A seccomp filter inherited from the process that exec'd us.
    if guard(false, seccomp_filtered_at_load) {
        restrict("a seccomp filter was in place at load");
    }
    // Connections an earlier image passed across exec (FIDO_NET_INHERIT).
    guard((), inherit::adopt);
    // SAFETY: registering plain extern "C" handlers.
    unsafe { libc::pthread_atfork(Some(fork_prepare), Some(fork_parent), Some(fork_child)) };
}

extern "C" fn fork_prepare() {
    crate::pinned::fork_prepare();
    broker::fork_prepare();
    table::fork_prepare();
    wait::fork_prepare();
}

extern "C" fn fork_parent() {
    crate::pinned::fork_after();
    table::fork_parent();
    broker::fork_parent();
    guard((), wait::fork_after);
}

extern "C" fn fork_child() {
    crate::pinned::fork_after();
    table::fork_child();
    broker::fork_child();
    stats::fork_child();
    inherit::set_owner();
    guard((), wait::fork_after);
}

/// `fork`: the child holds every connection the parent holds. The holder
/// counts are raised *before* the fork so a parent closing its copy right
/// after cannot believe it was the last holder.
pub fn fork() -> libc::pid_t {
    let conns = table::all();
    for c in &conns {
        c.seg.side(c.me).holders.fetch_add(1, Ordering::SeqCst);
    }
    // SAFETY: fork has no arguments; the atfork handlers keep our locks sane.
    let pid = unsafe { real::fork() };
    if pid < 0 {
        for c in &conns {
            c.seg.side(c.me).holders.fetch_sub(1, Ordering::SeqCst);
        }
    }
    pid
}

/// The program is about to make system call `n` through `syscall(2)`.
/// Programs that create an io_uring may move socket I/O out of our sight:
/// new connections of this process stay plain TCP from then on (liburing
/// enters the kernel through libc's `syscall`). A wait made this way is one
/// `wait` cannot see.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub fn syscall_observed(n: libc::c_long) {
    if n == libc::SYS_io_uring_setup {
        config::set_off();
    }
    guard((), || wait::raw_syscall(n));
}

/// Whether system call `n`, made through `syscall(2)`, returns a new
/// descriptor (whose number may carry stale state: `socket::fresh_fd`).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub fn creates_descriptor(n: libc::c_long) -> bool {
    #[cfg(target_arch = "x86_64")]
    if [
        libc::SYS_open,
        libc::SYS_creat,
        libc::SYS_epoll_create,
        libc::SYS_eventfd,
    ]
    .contains(&n)
    {
        return true;
    }
    [
        libc::SYS_openat,
        libc::SYS_openat2,
        libc::SYS_socket,
        libc::SYS_eventfd2,
        libc::SYS_memfd_create,
        libc::SYS_epoll_create1,
        libc::SYS_timerfd_create,
        libc::SYS_signalfd4,
        libc::SYS_inotify_init1,
        libc::SYS_pidfd_open,
        libc::SYS_io_uring_setup,
    ]
    .contains(&n)
}

/// Whether `/proc/self/status` says a seccomp filter confines us
/// (`Seccomp: 2`; 1 is strict mode, where nothing but read/write/exit runs).
fn seccomp_filtered_at_load() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Seccomp:"))
            .is_some_and(|v| v.trim() != "0")
    })
}

/// The program confines itself with seccomp (`prctl(PR_SET_SECCOMP)`,
/// `seccomp(2)`), or was confined when it started. From now on the library
/// must never make a system call on the program's behalf that the filter
/// could forbid — sshd's pre-auth child kills itself on `sendto`, and the
/// library cannot know what a filter allows. So: new connections stay
/// plain TCP (no broker, no memfd, no thread); established ones keep
/// working with the calls the program itself makes on a socket — `read`,
/// `write`, `poll`/`ppoll` — plus futex for the ring locks and
/// rt_sigprocmask around a wait (see `config::restricted`), and statistics
/// are no longer published. Called *before* the filter is installed, so
/// what is decided here may still use any call.
pub fn restrict(why: &str) {
    if config::restricted() {
        return;
    }
    crate::sys::debug!(
        "{why}: new connections stay plain TCP; established ones use read/write/poll only"
    );
    config::set_restricted();
}

/// `prctl(2)` or `syscall(SYS_prctl/SYS_seccomp)` with these arguments is
/// about to install a seccomp filter (or strict mode).
pub fn installs_seccomp(prctl: bool, a1: libc::c_long, a2: libc::c_long) -> bool {
    if prctl {
        a1 == libc::PR_SET_SECCOMP as libc::c_long
    } else {
        // seccomp(SECCOMP_SET_MODE_STRICT | SECCOMP_SET_MODE_FILTER, …)
        let _ = a2;
        a1 == 0 || a1 == 1
    }
}
