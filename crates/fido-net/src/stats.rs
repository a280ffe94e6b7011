//! The statistics every process under the preload publishes in the registry
//! (`/net/stats/<domain>`): connections accelerated, left plain, inherited
//! across exec, bytes and doorbells. Tests read them as the proof that a
//! connection was accelerated; `fido status` shows them.
//!
//! Must never: join the broker for a process that has nothing to report
//! (publishing starts with its first counted connection).

use crate::conn::Conn;
use crate::{broker, seg, table};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

static ACCELERATED: AtomicU64 = AtomicU64::new(0);
static PLAIN_LOCAL: AtomicU64 = AtomicU64::new(0);
/// Accelerated connections adopted from an earlier image across exec.
static INHERITED: AtomicU64 = AtomicU64::new(0);
static CLOSED_SENT: AtomicU64 = AtomicU64::new(0);
static CLOSED_RECV: AtomicU64 = AtomicU64::new(0);
/// Doorbell bytes our sides of closed connections sent (wake-ups that cost
/// a TCP send: lazy arming exists to make them rare).
static CLOSED_DOORBELLS: AtomicU64 = AtomicU64::new(0);
static STATS_PID: AtomicU64 = AtomicU64::new(0);
/// What was last published, and under which broker session (a restarted
/// broker gets it again).
static LAST: Mutex<(u64, String)> = Mutex::new((0, String::new()));

pub fn count_plain() {
    PLAIN_LOCAL.fetch_add(1, Ordering::Relaxed);
}

pub fn count_closed(c: &Conn) {
    CLOSED_SENT.fetch_add(c.bytes_sent(), Ordering::Relaxed);
    CLOSED_RECV.fetch_add(c.bytes_received(), Ordering::Relaxed);
    CLOSED_DOORBELLS.fetch_add(c.doorbells_sent(), Ordering::Relaxed);
}

/// A connection was accelerated: count it and make sure this process
/// publishes its statistics.
pub fn count_accelerated() {
    ACCELERATED.fetch_add(1, Ordering::Relaxed);
    publish_from_now_on();
}

/// An accelerated connection was adopted across exec (see `inherit`).
pub fn count_inherited() {
    INHERITED.fetch_add(1, Ordering::Relaxed);
    publish_from_now_on();
}

fn publish_from_now_on() {
    let pid = std::process::id() as u64;
    if STATS_PID.swap(pid, Ordering::SeqCst) != pid {
        let _ = std::thread::Builder::new()
            .name("fido-net-stats".into())
            .spawn(|| loop {
                std::thread::sleep(std::time::Duration::from_millis(200));
                // Also where a broker that came back learns our listeners
                // again (and a lost one is joined again, off the program's
                // own calls).
                broker::republish();
                publish_stats();
                if crate::config::restricted()
                    || STATS_PID.load(Ordering::SeqCst) != std::process::id() as u64
                {
                    return;
                }
            });
        // SAFETY: registering a plain extern "C" function.
        unsafe { libc::atexit(at_exit) };
    }
}

/// Set at exit: the process's sockets close with it, so its last statistics
/// list no open connection (programs such as socat exit without closing).
static EXITING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn at_exit() {
    EXITING.store(true, Ordering::SeqCst);
    publish_stats();
}

/// Open connections listed by name in the statistics. Each entry takes at
/// most ~250 bytes, so the value stays well inside the registry's 64 KiB
/// limit; a process with more (1000 asyncio connections) lists the first
/// ones and `open_total` counts all (before, its whole value was refused
/// and nothing was published at all).
const MAX_LISTED_OPEN: usize = 150;

fn stats_json() -> String {
    let mut sent = CLOSED_SENT.load(Ordering::Relaxed);
    let mut recv = CLOSED_RECV.load(Ordering::Relaxed);
    let mut doorbells = CLOSED_DOORBELLS.load(Ordering::Relaxed);
    let exiting = EXITING.load(Ordering::SeqCst);
    let all = table::all();
    let open_total = if exiting { 0 } else { all.len() };
    let open: Vec<serde_json::Value> = all
        .iter()
        .enumerate()
        .filter_map(|(i, c)| {
            sent += c.bytes_sent();
            recv += c.bytes_received();
            doorbells += c.doorbells_sent();
            (i < MAX_LISTED_OPEN).then(|| serde_json::json!({
                "local": c.local, "peer": c.peer,
                "side": if c.me == seg::CLIENT { "client" } else { "server" },
                "bytes_sent": c.bytes_sent(), "bytes_received": c.bytes_received(),
                "doorbells": c.doorbells_sent(),
                "arming": if c.is_lazy() { "lazy" } else { "eager" },
            }))
        })
        .collect();
    serde_json::json!({
        "pid": std::process::id(),
        "name": broker::exe_name(),
        "accelerated": ACCELERATED.load(Ordering::Relaxed),
        "plain_local": PLAIN_LOCAL.load(Ordering::Relaxed),
        "inherited": INHERITED.load(Ordering::Relaxed),
        "bytes_sent": sent,
        "bytes_received": recv,
        "doorbells": doorbells,
        "open": if exiting { Vec::new() } else { open },
        "open_total": open_total,
    })
    .to_string()
}

pub fn publish_stats() {
    // Under a seccomp filter a broker request could be a forbidden call.
    if crate::config::restricted() {
        return;
    }
    if ACCELERATED.load(Ordering::Relaxed) == 0
        && PLAIN_LOCAL.load(Ordering::Relaxed) == 0
        && INHERITED.load(Ordering::Relaxed) == 0
    {
        return;
    }
    let s = stats_json();
    let Some(d) = broker::domain() else { return };
    let epoch = broker::epoch();
    {
        let mut last = LAST.lock();
        if last.0 == epoch && last.1 == s {
            return;
        }
        *last = (epoch, s.clone());
    }
    let _ = broker::noted(d.write(&format!("/net/stats/{}", d.id()), s.as_bytes()));
}

/// `fork` (atfork child): the child publishes its own statistics once it
/// counts its first connection.
pub fn fork_child() {
    STATS_PID.store(0, Ordering::SeqCst);
}
