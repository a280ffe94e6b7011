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
//!
//! This module only speaks to the broker; connections, their state and the
//! statistics live above it (`conn`, `table`, `stats`).
//!
//! Must never: block or fail a program because the broker is missing or
//! slow — every failure here means "plain TCP".

use crate::sys::debug;
use fido::{Domain, JoinOptions};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

struct Net {
    pid: u32,
    dom: Option<Domain>,
}

static NET: Mutex<Option<Net>> = Mutex::new(None);
static BROKER_PATH: Mutex<Option<std::path::PathBuf>> = Mutex::new(None);

pub fn set_broker_path(p: std::path::PathBuf) {
    *BROKER_PATH.lock() = Some(p);
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
            debug!("no broker ({e}): plain TCP");
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
}

/// This program's name as the registry shows it (from `/proc/self/comm`).
pub fn exe_name() -> String {
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
                Some(why) => debug!("listen on {ip}:{port}: not published: {why}"),
                None => debug!("listen on {ip}:{port}: not published: {e}"),
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
            Err(why) => debug!("listener {n} not reachable for sure: {why}"),
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
    (r.pid > 0 && r.memfd >= 0 && crate::config::valid_ring_len(r.ring_len)).then_some(r)
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
            debug!("request {key}: pid {} is not in our namespace", r.pid);
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
                    debug!("{dir}: several proven requests: ambiguous, plain TCP");
                    return None;
                }
                found = Some((k, r));
            }
            Err(why) => debug!("request {k} is not our peer's: {why}"),
        }
    }
    found
}
