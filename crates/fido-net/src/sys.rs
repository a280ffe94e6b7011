//! What every layer needs from the system for itself: errno of the calling
//! thread, the library's own system calls, the debug log and the panic fence
//! at the C boundary.
//!
//! The library's own system calls (futex waits and wakes, the debug log) are
//! made raw, through rustix's direct system-call backend: never through
//! libc's `syscall`, which this library interposes (see `process`), nor
//! through any other interposed name. std and parking_lot, compiled into the
//! same object, do call `syscall` (futex waits, among others); the linker
//! sends those calls to `__wrap_syscall` here (build.rs), which makes them
//! raw too.
//!
//! Must never: call an interposed libc function, or let a panic unwind into C.

use libc::c_int;
use rustix::thread::futex;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

pub fn set_errno(e: c_int) {
    // SAFETY: errno location of this thread.
    unsafe { *libc::__errno_location() = e };
}

pub fn errno() -> c_int {
    // SAFETY: errno location of this thread.
    unsafe { *libc::__errno_location() }
}

/// Runs `f`, turning a panic into `fallback`: a bug in this library must not
/// unwind into C.
pub fn guard<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(fallback)
}

/// Writes `msg` to stderr with one raw `write(2)` (no buffering, no lock, no
/// interposed `write`).
pub fn write_stderr(msg: &[u8]) {
    // A daemon may have put a socket on descriptor 2 (sshd's re-executed
    // child does): the lines would land in its peer's byte stream. And
    // under a seccomp filter even the check may be refused: say nothing.
    if crate::config::restricted() {
        return;
    }
    let stderr = std::io::stderr();
    if rustix::fs::fstat(&stderr).is_ok_and(|st| rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Socket) {
        return;
    }
    let _ = rustix::io::write(stderr, msg);
}

/// One line on stderr when `FIDO_NET_DEBUG` is set (see `config::debug_on`).
macro_rules! debug {
    ($($t:tt)*) => {
        if $crate::config::debug_on() {
            let s = format!("fido-net[{}]: {}\n", std::process::id(), format_args!($($t)*));
            $crate::sys::write_stderr(s.as_bytes());
        }
    };
}
pub(crate) use debug;

/// Sleeps while the shared (not process-private) futex `word` holds
/// `expected`, at most `timeout`. Wakes, interruptions and value changes all
/// just return: the caller looks at its condition again.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = futex::Timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    let _ = futex::wait(word, futex::Flags::empty(), expected, Some(&ts));
}

/// Wakes up to `n` waiters of the shared futex `word`.
pub fn futex_wake(word: &AtomicU32, n: u32) {
    let _ = futex::wake(word, futex::Flags::empty(), n);
}

/// Where the linker sends every call of `syscall` made inside this object
/// (`--wrap=syscall`, see build.rs): std's and parking_lot's futex waits and
/// the like. The system call is made here, raw, with libc's convention for
/// the result (-1 and errno for an error), so that it never reaches this
/// library's own `syscall` interposer. Its fixed parameters read a variadic
/// call's arguments as that interposer's do (sound on the two architectures
/// both are built for: see the `syscall` shim in lib.rs).
///
/// # Safety
/// Same contract as `syscall(2)` for system call `n`.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
pub unsafe extern "C" fn __wrap_syscall(
    n: libc::c_long,
    a1: libc::c_long,
    a2: libc::c_long,
    a3: libc::c_long,
    a4: libc::c_long,
    a5: libc::c_long,
    a6: libc::c_long,
) -> libc::c_long {
    let r: libc::c_long;
    // SAFETY: the kernel's system-call convention for this architecture; the
    // caller upholds the contract of system call `n` (as for libc's
    // `syscall`). The kernel clobbers rcx and r11 on x86-64, nothing else.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") n => r,
            in("rdi") a1,
            in("rsi") a2,
            in("rdx") a3,
            in("r10") a4,
            in("r8") a5,
            in("r9") a6,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    // SAFETY: as above (AArch64: number in x8, arguments and result in x0–x5).
    #[cfg(target_arch = "aarch64")]
    unsafe {
        std::arch::asm!(
            "svc 0",
            in("x8") n,
            inlateout("x0") a1 => r,
            in("x1") a2,
            in("x2") a3,
            in("x3") a4,
            in("x4") a5,
            in("x5") a6,
            options(nostack),
        );
    }
    // The kernel returns -errno (-4095..=-1) for an error.
    if (-4095..0).contains(&r) {
        set_errno(-r as c_int);
        -1
    } else {
        r
    }
}
