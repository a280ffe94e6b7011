//! Co-location through the broker: one lazily joined Fido domain per process
//! (joined at the first TCP `listen` or possibly local `connect`), the
//! registry keys of the handshake, and the published per-process statistics.
//!
//! Handshake (both ends confirm through the registry before any data byte):
//! 1. A listener publishes `/net/listen/<port>/<netns>@<ip>@<domain>@<uid>@<pid>`.
//! 2. A client whose destination is in its own namespace (loopback or a local
//!    address) looks for a listener of that namespace; one whose route leads
//!    straight over a veth into another namespace looks for a listener the
//!    kernel proves lives there (`netns`). It checks the listener's domain is
//!    alive and runs as its uid, binds its socket to learn its port, creates
//!    the segment and writes the request
//!    `/net/conn/<server ip>/<server port>/<client port>/<client netns>` =
//!    `<pid> <memfd> <nonce> <ring_len>` — all before its SYN leaves.
//! 3. The server's `accept` finds the request for the accepted 4-tuple (its
//!    own namespace's directly; another namespace's only when the kernel
//!    proves its route to the peer leads there), maps the segment from
//!    `/proc/<pid>/fd/<memfd>`, checks magic and nonce, claims the request by
//!    deleting it (the step the broker's `net` policy may refuse) and marks
//!    the segment attached. No request: plain TCP.

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

/// Why the broker refused a handshake step, when it was the `net` policy
/// (the broker answers `Denied` with "MMNet acceleration disabled by policy").
fn policy_refusal(e: &fido::Error) -> Option<String> {
    match e {
        fido::Error::Broker(r)
            if r.code == fido::ErrorCode::Denied && r.message.contains("MMNet") =>
        {
            Some(r.message.clone())
        }
        _ => None,
    }
}

/// Publishes a listening socket. Returns the key.
///
/// Key: `/net/listen/<port>/<netns>@<ip>@<domain>@<uid>@<pid>` — the netns
/// (inode) scopes loopback and same-namespace matches; the pid lets a client
/// in another namespace ask the kernel whether its route leads there.
pub fn publish_listener(ip: &str, port: u16) -> Option<String> {
    let d = domain()?;
    let key = format!(
        "/net/listen/{}/{}@{}@{}@{}@{}",
        port,
        netns(),
        ip,
        d.id(),
        euid(),
        std::process::id()
    );
    match d.write(&key, std::process::id().to_string().as_bytes()) {
        Ok(()) => Some(key),
        Err(e) => {
            match policy_refusal(&e) {
                Some(why) => crate::debug!("listen on {ip}:{port}: not published: {why}"),
                None => crate::debug!("listen on {ip}:{port}: not published: {e}"),
            }
            None
        }
    }
}

pub fn withdraw(key: &str) {
    if let Some(d) = domain() {
        let _ = d.delete(key);
    }
}

/// Where a connect to `ip:port` leads, as far as acceleration goes.
pub enum Target {
    /// A listener in our own namespace (loopback, or one of our addresses).
    Same,
    /// A listener in another namespace the kernel routes `ip` straight into.
    Other,
}

/// Is a live listener under Fido, of our uid, behind `ip:port`? `local`:
/// the destination is in our namespace (loopback or one of our addresses);
/// otherwise only a listener in the namespace our direct veth route leads
/// into counts (see `netns`).
pub fn find_listener(ip: &str, v4: bool, port: u16, local: bool) -> Option<Target> {
    let d = domain()?;
    let names = d.list(&format!("/net/listen/{port}")).ok()?;
    let me = netns();
    let dst: Option<std::net::IpAddr> = ip.parse().ok();
    for n in names {
        let mut it = n.split('@');
        let (Some(ns), Some(lip), Some(dom), Some(uid), Some(pid)) =
            (it.next(), it.next(), it.next(), it.next(), it.next())
        else {
            continue;
        };
        let (Ok(ns), Ok(uid), Ok(pid)) =
            (ns.parse::<u64>(), uid.parse::<u32>(), pid.parse::<u32>())
        else {
            continue;
        };
        let wild = lip == "::" || (v4 && lip == "0.0.0.0");
        let ip_ok = lip == ip || wild || (!v4 && ip == "::1" && lip == "::1");
        if !ip_ok || uid != euid() {
            continue;
        }
        if local != (ns == me) {
            continue;
        }
        if !matches!(d.read(&format!("/domain/{dom}/pid")), Ok(Some(_))) {
            continue;
        }
        if local {
            return Some(Target::Same);
        }
        let Some(dst) = dst else { continue };
        match crate::netns::leads_to(dst, pid, ns) {
            Ok(()) => return Some(Target::Other),
            Err(why) => crate::debug!("listener {n} not reachable for sure: {why}"),
        }
    }
    None
}

/// The request key: `/net/conn/<server ip>/<server port>/<client port>/<client netns>`.
/// Both ends see the same addresses and ports (no NAT between namespaces of
/// one host); the client's namespace tells same-namespace requests (read
/// directly) from cross-namespace ones (verified through the kernel).
pub fn request_key(sip: &str, sport: u16, cport: u16, cns: u64) -> String {
    format!("/net/conn/{sip}/{sport}/{cport}/{cns}")
}

/// Writes the request; `Err(reason)` when refused.
pub fn write_request(key: &str, memfd: i32, nonce: u64, ring_len: usize) -> Result<(), String> {
    let Some(d) = domain() else {
        return Err("no broker".into());
    };
    d.write(
        key,
        format!("{} {} {} {}", std::process::id(), memfd, nonce, ring_len).as_bytes(),
    )
    .map_err(|e| policy_refusal(&e).unwrap_or_else(|| e.to_string()))
}

pub fn delete_key(key: &str) {
    if let Some(d) = domain() {
        let _ = d.delete(key);
    }
}

/// The server claims a request before it attaches: deleting it through the
/// broker is the step the `net` policy can refuse. `Err(reason)` if refused.
pub fn claim(key: &str) -> Result<(), String> {
    let Some(d) = domain() else {
        return Err("no broker".into());
    };
    d.delete(key)
        .map_err(|e| policy_refusal(&e).unwrap_or_else(|| e.to_string()))
}

pub struct Request {
    pub pid: u32,
    pub memfd: i32,
    pub nonce: u64,
    pub ring_len: usize,
}

fn parse_request(v: &[u8]) -> Option<Request> {
    let s = std::str::from_utf8(v).ok()?;
    let mut it = s.split(' ');
    let r = Request {
        pid: it.next()?.parse().ok()?,
        memfd: it.next()?.parse().ok()?,
        nonce: it.next()?.parse().ok()?,
        ring_len: it.next()?.parse().ok()?,
    };
    (r.pid > 0 && r.memfd >= 0 && crate::valid_ring_len(r.ring_len)).then_some(r)
}

/// The client's request for the connection accepted with local `sip:sport`
/// from `peer:cport`, if any, with its key. `same`: the peer address is in
/// our namespace (loopback or local), so the request must come from our
/// namespace and is read directly (the 4-tuple is unique in a namespace).
/// Otherwise a request counts only when the kernel proves our route to
/// `peer` leads straight into that client's namespace — so a pair of
/// namespaces reusing the same addresses can never hand us its segment.
/// Several proven candidates (cannot happen with a direct veth) or none:
/// `None`, plain TCP.
pub fn read_request(
    sip: &str,
    sport: u16,
    peer: &str,
    cport: u16,
    same: bool,
) -> Option<(String, Request)> {
    let d = domain()?;
    let me = netns();
    if same {
        let key = request_key(sip, sport, cport, me);
        let r = parse_request(&d.read(&key).ok()??)?;
        if crate::netns::ns_of(r.pid) != Some(me) {
            crate::debug!("request {key}: pid {} is not in our namespace", r.pid);
            return None;
        }
        return Some((key, r));
    }
    let dir = format!("/net/conn/{sip}/{sport}/{cport}");
    let names = d.list(&dir).ok()?;
    if names.is_empty() {
        return None;
    }
    let peer_ip: std::net::IpAddr = peer.parse().ok()?;
    let mut found: Option<(String, Request)> = None;
    for n in names {
        let Ok(ns) = n.parse::<u64>() else { continue };
        if ns == me {
            continue;
        }
        let k = format!("{dir}/{n}");
        let Some(r) = d.read(&k).ok().flatten().and_then(|v| parse_request(&v)) else {
            continue;
        };
        match crate::netns::leads_to(peer_ip, r.pid, ns) {
            Ok(()) => {
                if found.is_some() {
                    crate::debug!("{dir}: several proven requests: ambiguous, plain TCP");
                    return None;
                }
                found = Some((k, r));
            }
            Err(why) => crate::debug!("request {k} is not our peer's: {why}"),
        }
    }
    found
}

// ---- statistics -------------------------------------------------------

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
        "inherited": INHERITED.load(Ordering::Relaxed),
        "bytes_sent": sent,
        "bytes_received": recv,
        "doorbells": doorbells,
        "open": open,
    })
    .to_string()
}

pub fn publish_stats() {
    if ACCELERATED.load(Ordering::Relaxed) == 0
        && PLAIN_LOCAL.load(Ordering::Relaxed) == 0
        && INHERITED.load(Ordering::Relaxed) == 0
    {
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
        kernel_err: std::sync::atomic::AtomicI32::new(0),
    })
}
