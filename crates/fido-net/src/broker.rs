//! Co-location through the broker: one lazily joined Fido domain per process
//! (joined at the first TCP `listen` or loopback `connect`), the registry keys
//! of the handshake, and the published per-process statistics.
//!
//! Handshake (both ends confirm through the registry before any data byte):
//! 1. A listener publishes `/net/listen/<netns>/<port>/<ip>@<domain>@<uid>`.
//! 2. A client connecting to a loopback address finds such a key, checks the
//!    listener's domain is alive (`/domain/<id>/pid`) and runs as its uid,
//!    binds its socket to learn its port, creates the segment and writes the
//!    request `/net/conn/<netns>/<server port>/<client port>` =
//!    `<pid> <memfd> <nonce> <ring_len>` — all before its SYN leaves.
//! 3. The server's `accept` reads the request for the accepted 4-tuple's ports,
//!    maps the segment from `/proc/<pid>/fd/<memfd>`, checks magic and nonce,
//!    marks it attached and deletes the key. No request: plain TCP.

use crate::conn::Conn;
use crate::table;
use fido::{Domain, JoinOptions};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

struct Net {
    pid: u32,
    dom: Option<Domain>,
}

static NET: Mutex<Option<Net>> = Mutex::new(None);
static BROKER_PATH: Mutex<Option<std::path::PathBuf>> = Mutex::new(None);

pub fn set_broker_path(p: std::path::PathBuf) {
    *BROKER_PATH.lock() = Some(p);
}

/// Acceleration switched off for this process (`FIDO_NET=off`, or after an
/// io_uring instance was created).
static OFF: AtomicBool = AtomicBool::new(false);

pub fn set_off() {
    OFF.store(true, Ordering::SeqCst);
}

pub fn enabled() -> bool {
    !OFF.load(Ordering::Relaxed)
}

/// This process's domain, joining on first use. `None` when there is no
/// broker (then everything stays plain TCP).
pub fn domain() -> Option<Domain> {
    let pid = std::process::id();
    let mut g = NET.lock();
    if let Some(n) = g.as_ref() {
        if n.pid == pid {
            return n.dom.clone();
        }
    }
    // First use in this process (or a forked child: the parent's domain and
    // its control thread are not ours; leave it untouched).
    if let Some(old) = g.take() {
        std::mem::forget(old);
    }
    let name = format!("net-{}", exe_name());
    let mut opts = JoinOptions::new(name)
        .arena_len(64 << 10)
        .ring_entries(2)
        .swizzle(true);
    if let Some(p) = BROKER_PATH.lock().clone() {
        opts = opts.broker(p);
    }
    let dom = match Domain::join(opts) {
        Ok(d) => Some(d),
        Err(e) => {
            crate::debug!("no broker ({e}): plain TCP");
            None
        }
    };
    *g = Some(Net {
        pid,
        dom: dom.clone(),
    });
    dom
}

pub fn fork_prepare() {
    std::mem::forget(NET.lock());
}
pub fn fork_parent() {
    // SAFETY: locked by fork_prepare on this thread, guard forgotten.
    unsafe { NET.force_unlock() };
}
pub fn fork_child() {
    // SAFETY: as above; the child has one thread.
    unsafe { NET.force_unlock() };
    STATS_PID.store(0, Ordering::SeqCst);
}

fn exe_name() -> String {
    static NAME: Mutex<Option<(u32, String)>> = Mutex::new(None);
    let pid = std::process::id();
    let mut g = NAME.lock();
    if let Some((p, n)) = g.as_ref() {
        if *p == pid {
            return n.clone();
        }
    }
    let n = read_exe_name();
    *g = Some((pid, n.clone()));
    n
}

fn read_exe_name() -> String {
    let raw = std::fs::read_to_string("/proc/self/comm").unwrap_or_else(|_| "proc".into());
    let s: String = raw
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_.:@+=-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    if s.is_empty() {
        "proc".into()
    } else {
        s
    }
}

/// Identity of our network namespace (its inode).
pub fn netns() -> u64 {
    static NS: AtomicU64 = AtomicU64::new(0);
    let v = NS.load(Ordering::Relaxed);
    if v != 0 {
        return v;
    }
    let ino = std::fs::metadata("/proc/self/ns/net")
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap_or(1);
    NS.store(ino, Ordering::Relaxed);
    ino
}

pub fn euid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// Publishes a listening socket. Returns the key.
pub fn publish_listener(ip: &str, port: u16) -> Option<String> {
    let d = domain()?;
    let key = format!(
        "/net/listen/{}/{}/{}@{}@{}",
        netns(),
        port,
        ip,
        d.id(),
        euid()
    );
    d.write(&key, std::process::id().to_string().as_bytes())
        .ok()?;
    Some(key)
}

pub fn withdraw(key: &str) {
    if let Some(d) = domain() {
        let _ = d.delete(key);
    }
}

/// Is a live listener under Fido, of our uid, behind `ip:port` (a loopback
/// destination)?
pub fn find_listener(ip: &str, v4: bool, port: u16) -> bool {
    let Some(d) = domain() else { return false };
    let Ok(names) = d.list(&format!("/net/listen/{}/{}", netns(), port)) else {
        return false;
    };
    for n in names {
        let mut it = n.split('@');
        let (Some(lip), Some(dom), Some(uid)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        let ip_ok = lip == ip
            || lip == "::"
            || (v4 && lip == "0.0.0.0")
            || (!v4 && ip == "::1" && lip == "::1");
        if !ip_ok || uid.parse::<u32>().ok() != Some(euid()) {
            continue;
        }
        if matches!(d.read(&format!("/domain/{dom}/pid")), Ok(Some(_))) {
            return true;
        }
    }
    false
}

pub fn request_key(sport: u16, cport: u16) -> String {
    format!("/net/conn/{}/{}/{}", netns(), sport, cport)
}

pub fn write_request(key: &str, memfd: i32, nonce: u64, ring_len: usize) -> bool {
    let Some(d) = domain() else { return false };
    d.write(
        key,
        format!("{} {} {} {}", std::process::id(), memfd, nonce, ring_len).as_bytes(),
    )
    .is_ok()
}

pub fn delete_key(key: &str) {
    if let Some(d) = domain() {
        let _ = d.delete(key);
    }
}

pub struct Request {
    pub pid: u32,
    pub memfd: i32,
    pub nonce: u64,
    pub ring_len: usize,
}

/// The client's request for this 4-tuple, if any (validated syntactically).
pub fn read_request(key: &str) -> Option<Request> {
    let d = domain()?;
    let v = d.read(key).ok()??;
    let s = std::str::from_utf8(&v).ok()?;
    let mut it = s.split(' ');
    let r = Request {
        pid: it.next()?.parse().ok()?,
        memfd: it.next()?.parse().ok()?,
        nonce: it.next()?.parse().ok()?,
        ring_len: it.next()?.parse().ok()?,
    };
    (r.pid > 0 && r.memfd >= 0 && crate::valid_ring_len(r.ring_len)).then_some(r)
}

// ---- statistics -------------------------------------------------------

static ACCELERATED: AtomicU64 = AtomicU64::new(0);
static PLAIN_LOCAL: AtomicU64 = AtomicU64::new(0);
static CLOSED_SENT: AtomicU64 = AtomicU64::new(0);
static CLOSED_RECV: AtomicU64 = AtomicU64::new(0);
/// Doorbell bytes our sides of closed connections sent (wake-ups that cost
/// a TCP send: lazy arming exists to make them rare).
static CLOSED_DOORBELLS: AtomicU64 = AtomicU64::new(0);
static STATS_PID: AtomicU64 = AtomicU64::new(0);
static LAST: Mutex<String> = Mutex::new(String::new());

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
    let pid = std::process::id() as u64;
    if STATS_PID.swap(pid, Ordering::SeqCst) != pid {
        let _ = std::thread::Builder::new()
            .name("fido-net-stats".into())
            .spawn(|| loop {
                std::thread::sleep(std::time::Duration::from_millis(200));
                publish_stats();
                if STATS_PID.load(Ordering::SeqCst) != std::process::id() as u64 {
                    return;
                }
            });
        // SAFETY: registering a plain extern "C" function.
        unsafe { libc::atexit(at_exit) };
    }
}

extern "C" fn at_exit() {
    publish_stats();
}

fn stats_json() -> String {
    let mut sent = CLOSED_SENT.load(Ordering::Relaxed);
    let mut recv = CLOSED_RECV.load(Ordering::Relaxed);
    let mut doorbells = CLOSED_DOORBELLS.load(Ordering::Relaxed);
    let open: Vec<serde_json::Value> = table::all()
        .iter()
        .map(|c| {
            sent += c.bytes_sent();
            recv += c.bytes_received();
            doorbells += c.doorbells_sent();
            serde_json::json!({
                "local": c.local, "peer": c.peer,
                "side": if c.me == crate::seg::CLIENT { "client" } else { "server" },
                "bytes_sent": c.bytes_sent(), "bytes_received": c.bytes_received(),
                "doorbells": c.doorbells_sent(),
                "arming": if c.is_lazy() { "lazy" } else { "eager" },
            })
        })
        .collect();
    serde_json::json!({
        "pid": std::process::id(),
        "name": exe_name(),
        "accelerated": ACCELERATED.load(Ordering::Relaxed),
        "plain_local": PLAIN_LOCAL.load(Ordering::Relaxed),
        "bytes_sent": sent,
        "bytes_received": recv,
        "doorbells": doorbells,
        "open": open,
    })
    .to_string()
}

pub fn publish_stats() {
    if ACCELERATED.load(Ordering::Relaxed) == 0 && PLAIN_LOCAL.load(Ordering::Relaxed) == 0 {
        return;
    }
    let s = stats_json();
    {
        let mut last = LAST.lock();
        if *last == s {
            return;
        }
        *last = s.clone();
    }
    if let Some(d) = domain() {
        let _ = d.write(&format!("/net/stats/{}", d.id()), s.as_bytes());
    }
}

/// Makes a connection record (used by both sides).
#[allow(clippy::too_many_arguments)]
pub fn new_conn(
    seg: crate::seg::Segment,
    me: usize,
    nonblock: bool,
    memfd: i32,
    request_key: Option<String>,
    connected: bool,
    local: String,
    peer: String,
) -> Arc<Conn> {
    if !crate::wait::lazy_allowed() {
        seg.side(me).eager.store(1, Ordering::SeqCst);
    }
    Arc::new(Conn {
        seg,
        me,
        nonblock: AtomicBool::new(nonblock),
        local_refs: std::sync::atomic::AtomicU32::new(0),
        memfd: std::sync::atomic::AtomicI32::new(memfd),
        request_key,
        broken: AtomicBool::new(false),
        stuck_at: AtomicU64::new(u64::MAX),
        connected: AtomicBool::new(connected),
        local,
        peer,
        app_nodelay: std::sync::atomic::AtomicI32::new(0),
        app_cork: std::sync::atomic::AtomicI32::new(0),
        tcp_opts_taken: AtomicBool::new(false),
    })
}
