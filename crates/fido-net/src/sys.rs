//! What every layer needs from the system for itself: errno of the calling
//! thread, the library's own system calls, the debug log and the panic fence
//! at the C boundary.
//!
//! The library's own system calls (futex waits and wakes, the debug log) are
//! made raw, through rustix's direct system-call backend: never through
//! libc's `syscall`, which this library interposes (see `process`), nor
//! through any other interposed name. (std and parking_lot, compiled into the
//! same object, still enter futex waits through libc's `syscall`; the
//! interposer forwards those untouched.)
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
    let _ = rustix::io::write(std::io::stderr(), msg);
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
