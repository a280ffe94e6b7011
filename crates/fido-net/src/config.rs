//! The library's settings and process-wide switches.
//!
//! Every `FIDO_NET_*` variable is read once, by the constructor
//! (`read_at_load`): some programs (nginx) replace the environment of the
//! children they fork, and a getenv on the data path would cost a lock.
//! Two switches only ever go one way during a process's life: acceleration
//! off (`set_off`) and lazy arming given up (`give_up_lazy`).
//!
//! Must never: depend on another module of this library — every layer reads
//! its settings from here.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::time::Duration;

/// Reads every setting once (at load).
pub fn read_at_load() {
    if std::env::var_os("FIDO_NET").is_some_and(|v| v == "off" || v == "0") {
        set_off();
    }
    if std::env::var("FIDO_NET_LAZY").is_ok_and(|v| v == "0" || v == "off") {
        LAZY.store(false, Ordering::SeqCst);
    }
    debug_on();
    ring_len();
    spin_budget();
    attach_wait();
    doorbell_delay();
}

// ---- switches ----------------------------------------------------------------

/// Acceleration switched off for this process (`FIDO_NET=off`, or after an
/// io_uring instance was created).
static OFF: AtomicBool = AtomicBool::new(false);

pub fn set_off() {
    OFF.store(true, Ordering::SeqCst);
}

/// Whether new connections of this process may be accelerated.
pub fn enabled() -> bool {
    !OFF.load(Ordering::Relaxed)
}

/// A seccomp filter confines this process (see `process::restrict`): the
/// library makes no system call the program itself does not make on its
/// sockets (read, write, poll; futex for the ring locks) and sets nothing up.
static RESTRICTED: AtomicBool = AtomicBool::new(false);

pub fn set_restricted() {
    RESTRICTED.store(true, Ordering::SeqCst);
    set_off();
}

/// Whether a seccomp filter confines this process.
pub fn restricted() -> bool {
    RESTRICTED.load(Ordering::Relaxed)
}

/// Lazy arming allowed in this process (`FIDO_NET_LAZY`, default on) and not
/// yet given up (see `wait::all_eager`).
static LAZY: AtomicBool = AtomicBool::new(true);

/// Whether a new connection of this process may arm lazily.
pub fn lazy_allowed() -> bool {
    LAZY.load(Ordering::Relaxed)
}

/// Turns lazy arming off for good; true for the call that turned it off.
pub fn give_up_lazy() -> bool {
    LAZY.swap(false, Ordering::SeqCst)
}

// ---- values ------------------------------------------------------------------

/// Default ring size per direction; `FIDO_NET_RING` (bytes, power of two,
/// 64 KiB..=64 MiB) overrides it.
const DEFAULT_RING: usize = 1 << 20;

/// Whether `n` is a ring size this library accepts (ours, or a peer's).
pub fn valid_ring_len(n: usize) -> bool {
    n.is_power_of_two() && (64 << 10..=64 << 20).contains(&n)
}

/// The ring size of the connections this process requests.
pub fn ring_len() -> usize {
    static LEN: AtomicUsize = AtomicUsize::new(0);
    let v = LEN.load(Ordering::Relaxed);
    if v != 0 {
        return v;
    }
    let v = std::env::var("FIDO_NET_RING")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&n| valid_ring_len(n))
        .unwrap_or(DEFAULT_RING);
    LEN.store(v, Ordering::Relaxed);
    v
}

/// `FIDO_NET_DEBUG=1`: one line on stderr per decision (why a connection is,
/// or is not, accelerated).
pub fn debug_on() -> bool {
    static ON: AtomicU8 = AtomicU8::new(2);
    let v = ON.load(Ordering::Relaxed);
    if v != 2 {
        return v == 1;
    }
    let on = std::env::var_os("FIDO_NET_DEBUG").is_some_and(|v| v != "0");
    ON.store(on as u8, Ordering::Relaxed);
    on
}

/// How long a blocking call spins on the ring before sleeping on the socket
/// (`FIDO_NET_SPIN_US`, default 20).
pub fn spin_budget() -> Duration {
    if restricted() {
        // A spin yields the CPU (sched_yield), which a filter may forbid.
        return Duration::ZERO;
    }
    static NS: AtomicU64 = AtomicU64::new(u64::MAX);
    let mut v = NS.load(Ordering::Relaxed);
    if v == u64::MAX {
        v = std::env::var("FIDO_NET_SPIN_US")
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(20)
            * 1000;
        NS.store(v, Ordering::Relaxed);
    }
    Duration::from_nanos(v)
}

/// How long a client's first I/O waits for the server to attach
/// (`FIDO_NET_ATTACH_MS`, default 500).
pub fn attach_wait() -> Duration {
    static MS: AtomicU64 = AtomicU64::new(u64::MAX);
    let mut v = MS.load(Ordering::Relaxed);
    if v == u64::MAX {
        v = std::env::var("FIDO_NET_ATTACH_MS")
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(500);
        MS.store(v, Ordering::Relaxed);
    }
    Duration::from_millis(v)
}

/// Test hook (`FIDO_NET_TEST_DOORBELL_DELAY_US`, default 0): a writer sleeps
/// this long between taking the reader's arm and sending its doorbell, which
/// makes the "doorbell lands after its data was read" race deterministic for
/// tests/c/readiness.c. Unset, it costs one relaxed load on the doorbell path
/// (which makes a system call anyway).
pub fn doorbell_delay() -> Duration {
    static US: AtomicU64 = AtomicU64::new(u64::MAX);
    let mut v = US.load(Ordering::Relaxed);
    if v == u64::MAX {
        v = std::env::var("FIDO_NET_TEST_DOORBELL_DELAY_US")
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0);
        US.store(v, Ordering::Relaxed);
    }
    Duration::from_micros(v)
}
