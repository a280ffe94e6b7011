//! Co-location through the broker: one lazily joined Fido domain per process
//! (joined at the first TCP `listen` or possibly local `connect`), the
//! registry keys of the handshake, and the published per-process statistics.
//!
//! Handshake (the broker checks every step against the kernel; nothing here
//! trusts a registry key another user could have written):
//! 1. A listener hands its socket to the broker (`NetListen`), which
//!    publishes `/net/listen/<port>/<netns>@<ip>@<domain>@<uid>@<pid>` — a
//!    subtree only the broker writes.
//! 2. A client whose destination is in its own namespace (loopback or a local
//!    address) looks for a listener of that namespace; one whose route leads
//!    straight over a veth into another namespace looks for a listener the
//!    kernel proves lives there (`netns`). It checks the listener's domain is
//!    alive and runs as its uid, binds its socket to learn its port, creates
//!    the segment and offers it with the socket (`NetOffer`) — all before its
//!    SYN leaves.
//! 3. The server's `accept` hands the accepted socket to the broker
//!    (`NetClaim`), which gives it the segment only if the offering socket
//!    is, by sock_diag, the other end of this very connection, of the same
//!    uid; it checks magic and nonce and marks the segment attached. No
//!    offer: plain TCP.
//!
//! This module only speaks to the broker; connections, their state and the
//! statistics live above it (`conn`, `table`, `stats`).
//!
//! Must never: block or fail a program because the broker is missing or
//! slow — every failure here means "plain TCP".

use crate::sys::debug;
use fido::{BrokerLink, Domain, JoinOptions};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A lost broker is joined again at most this often (a failed join costs a
/// `connect` to its socket; a program's calls must not pay it each time).
const REJOIN_EVERY: Duration = Duration::from_secs(1);

struct Net {
    pid: u32,
    dom: Option<Domain>,
    /// When a join was last tried.
    tried: Instant,
    /// The broker session the epoch counts: (domain id, reconnects).
    session: Option<(u64, u64)>,
    /// A request went unanswered (a stopped or overloaded broker): until
    /// then every connection is plain without asking, so at most one call
    /// per `quiet_for` waits for it.
    quiet_until: Option<Instant>,
    /// How long the last quiet period was: doubled (up to [`QUIET_MAX`]) while
    /// the broker keeps not answering, forgotten once it answers.
    quiet_for: Duration,
}

/// The longest a process asks nothing of a broker that stopped answering.
const QUIET_MAX: Duration = Duration::from_secs(30);

static NET: Mutex<Option<Net>> = Mutex::new(None);
static BROKER_PATH: Mutex<Option<std::path::PathBuf>> = Mutex::new(None);
/// Counts broker sessions this process has had (a join, a resumption after a
/// broker restart): a new broker knows none of our listeners.
static EPOCH: AtomicU64 = AtomicU64::new(0);

pub fn set_broker_path(p: std::path::PathBuf) {
    *BROKER_PATH.lock() = Some(p);
}

/// The broker session listeners were last published under (see `republish`).
pub fn epoch() -> u64 {
    EPOCH.load(Ordering::Acquire)
}

/// How long one broker request may take before the connection stays plain:
/// a claim answered after the client stopped waiting (`FIDO_NET_ATTACH_MS`)
/// is useless anyway, and no program call may wait the control session's
/// default 15 s on a broker that stopped answering.
fn request_timeout() -> Duration {
    crate::config::attach_wait().max(Duration::from_secs(1))
}

thread_local! {
    /// This thread holds `NET` (joining): descriptors the join creates pass
    /// through our interposers (`socket::fresh_fd`), which must not call
    /// back into this module.
    static HOLDS_NET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is inside `domain()`'s join (see `HOLDS_NET`).
pub fn busy_here() -> bool {
    HOLDS_NET.with(|b| b.get())
}

/// This process's domain, joining on first use. `None` when there is no
/// broker (then everything stays plain TCP) — decided at once: while the
/// broker is away (killed, restarting) requests would wait for it, so its
/// absence answers `None` without a request, and a join is retried at most
/// once per [`REJOIN_EVERY`].
pub fn domain() -> Option<Domain> {
    let pid = std::process::id();
    let mut g = NET.lock();
    match g.as_mut() {
        Some(n) if n.pid == pid => {
            if n.quiet_until.is_some_and(|t| Instant::now() < t) {
                return None;
            }
            if let Some(d) = &n.dom {
                match d.broker_link() {
                    BrokerLink::Up { reconnects } => {
                        let session = (d.id(), reconnects);
                        if n.session != Some(session) {
                            // Resumed with a restarted broker: it forgot our listeners.
                            n.session = Some(session);
                            EPOCH.fetch_add(1, Ordering::AcqRel);
                        }
                        return Some(d.clone());
                    }
                    // The control thread reconnects in the background.
                    BrokerLink::Reconnecting => return None,
                    BrokerLink::Ended => {
                        debug!("the broker refused to resume our domain: joining again");
                        n.dom = None;
                    }
                }
            }
            if n.tried.elapsed() < REJOIN_EVERY {
                return None;
            }
        }
        // First use in this process (or a forked child: the parent's domain
        // and its control thread are not ours; leave them untouched).
        _ => {
            if let Some(old) = g.take() {
                std::mem::forget(old);
            }
        }
    }
    let name = format!("net-{}", exe_name());
    let mut opts = JoinOptions::new(name)
        .arena_len(64 << 10)
        .ring_entries(2)
        .swizzle(true)
        .request_timeout(request_timeout())
        .link_wait(Duration::ZERO);
    if let Some(p) = BROKER_PATH.lock().clone() {
        opts = opts.broker(p);
    }
    HOLDS_NET.with(|b| b.set(true));
    let joined = Domain::join(opts);
    HOLDS_NET.with(|b| b.set(false));
    let dom = match joined {
        Ok(d) => Some(d),
        Err(e) => {
            debug!("no broker ({e}): plain TCP");
            None
        }
    };
    let session = dom.as_ref().map(|d| (d.id(), 0));
    if session.is_some() {
        EPOCH.fetch_add(1, Ordering::AcqRel);
    }
    *g = Some(Net {
        pid,
        dom: dom.clone(),
        tried: Instant::now(),
        session,
        quiet_until: None,
        quiet_for: Duration::ZERO,
    });
    dom
}

/// Passes a request's result on, noting a broker that did not answer in
/// time (see `Net::quiet_until`) or that answers again.
pub fn noted<T>(r: fido::Result<T>) -> fido::Result<T> {
    let unavailable = matches!(&r, Err(fido::Error::BrokerUnavailable(_)));
    let mut g = NET.lock();
    if let Some(n) = g.as_mut().filter(|n| n.pid == std::process::id()) {
        if unavailable {
            n.quiet_for = (n.quiet_for * 2).clamp(REJOIN_EVERY, QUIET_MAX);
            n.quiet_until = Some(Instant::now() + n.quiet_for);
            debug!("broker unavailable: plain TCP for {:?}", n.quiet_for);
        } else if r.is_ok() {
            n.quiet_for = Duration::ZERO;
        }
    }
    r
}

/// Whether this process had a broker and lost it (it is away, or refused to
/// resume us): what was offered there will never be claimed.
pub fn lost() -> bool {
    let g = NET.lock();
    match g.as_ref() {
        Some(n) if n.pid == std::process::id() => n
            .dom
            .as_ref()
            .is_some_and(|d| !matches!(d.broker_link(), BrokerLink::Up { .. })),
        _ => false,
    }
}

/// Publishes again the listeners the current broker does not know (it was
/// away when they started listening, or restarted since): called where the
/// program enters the library anyway (accept, the statistics thread).
pub fn republish() {
    // Off (or confined): no broker I/O at all.
    if !crate::config::enabled() || !crate::table::has_own_listeners() || domain().is_none() {
        return;
    }
    // `domain()` moved the epoch on if the broker session changed.
    let epoch = epoch();
    for fd in crate::table::stale_listeners(epoch) {
        if let Some(a) = crate::addr::sock_name(fd, false) {
            let key = publish_listener(fd, &a.ip, a.port);
            debug!("listener fd {fd} published again: {key:?}");
            crate::table::add_listener(fd, key, epoch);
        }
    }
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

/// Publishes listening socket `fd` (the broker writes its key from what
/// the kernel says about the socket). Returns the key.
pub fn publish_listener(fd: i32, ip: &str, port: u16) -> Option<String> {
    let d = domain()?;
    // SAFETY: `fd` is the program's listening socket, open for this call.
    let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    match noted(d.net_listen(sock)) {
        Ok(key) => Some(key),
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
        let _ = noted(d.net_unlisten(key));
    }
}

/// Where a connect to `ip:port` leads, as far as acceleration goes.
pub enum Target {
    /// A listener in our own namespace (loopback, or one of our addresses).
    Same,
    /// A listener in another namespace the kernel routes `ip` straight into.
    Other,
}

/// How long a listener found in our own namespace is taken as still there
/// without reading the registry again (see [`found_recently`]).
const FOUND_FOR: Duration = Duration::from_secs(1);

/// Listeners in our namespace found recently: (ip, port, broker epoch, when).
static FOUND: Mutex<Vec<(String, u16, u64, Instant)>> = Mutex::new(Vec::new());

/// Whether a listener under Fido in our namespace was found behind `ip:port`
/// within [`FOUND_FOR`] (in this broker session). A client that connects in
/// a loop then offers without reading the registry first (one broker round
/// trip per connection instead of three). A stale answer costs nothing but
/// the offer: the broker checks every offer against the kernel's listening
/// sockets and refuses it unless each one that could take the connection is
/// a published listener of the client's uid ([`forget_found`] follows).
/// Never waits: a lock another thread holds (or held across `fork`) is a miss.
pub fn found_recently(ip: &str, port: u16) -> bool {
    let Some(g) = FOUND.try_lock() else {
        return false;
    };
    let e = epoch();
    g.iter()
        .any(|(i, p, ep, at)| *p == port && i == ip && *ep == e && at.elapsed() < FOUND_FOR)
}

fn remember_found(ip: &str, port: u16) {
    let Some(mut g) = FOUND.try_lock() else {
        return;
    };
    let e = epoch();
    g.retain(|(i, p, ep, at)| !(*p == port && i == ip) && *ep == e && at.elapsed() < FOUND_FOR);
    if g.len() < 64 {
        g.push((ip.to_string(), port, e, Instant::now()));
    }
}

/// The broker refused an offer to `ip:port`: read the registry next time.
pub fn forget_found(ip: &str, port: u16) {
    if let Some(mut g) = FOUND.try_lock() {
        g.retain(|(i, p, ..)| !(*p == port && i == ip));
    }
}

/// Is a live listener under Fido, of our uid, behind `ip:port`? `local`:
/// the destination is in our namespace (loopback or one of our addresses);
/// otherwise only a listener in the namespace our direct veth route leads
/// into counts (see `netns`).
pub fn find_listener(ip: &str, v4: bool, port: u16, local: bool) -> Option<Target> {
    let d = domain()?;
    let names = noted(d.list(&format!("/net/listen/{port}"))).ok()?;
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
        if !matches!(noted(d.read(&format!("/domain/{dom}/pid"))), Ok(Some(_))) {
            continue;
        }
        if local {
            remember_found(ip, port);
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

/// Offers segment `memfd` for the connection socket `fd` (bound) is about
/// to open to `remote`; returns the offer's id, `Err(reason)` when refused.
pub fn offer(
    fd: i32,
    memfd: i32,
    remote: std::net::SocketAddr,
    nonce: u64,
    ring_len: usize,
) -> Result<u64, String> {
    let Some(d) = domain() else {
        return Err("no broker".into());
    };
    // SAFETY: the program's socket and our memfd, both open for this call.
    let (sock, seg) = unsafe {
        (
            std::os::fd::BorrowedFd::borrow_raw(fd),
            std::os::fd::BorrowedFd::borrow_raw(memfd),
        )
    };
    noted(d.net_offer(sock, seg, remote, ring_len as u64, nonce)).map_err(|e| {
        pin_if_unanswered(fd, &e);
        policy_refusal(&e).unwrap_or_else(|| e.to_string())
    })
}

/// A request that carried socket `fd` got no answer: the broker may still
/// hold the socket in its queue (see `pinned`).
fn pin_if_unanswered(fd: i32, e: &fido::Error) {
    if matches!(e, fido::Error::BrokerUnavailable(_)) {
        crate::pinned::pin(fd);
    }
}

/// Withdraws an offer nobody claimed (the client gave up or closed).
pub fn withdraw_offer(offer: u64) {
    if let Some(d) = domain() {
        let _ = noted(d.net_withdraw(offer));
    }
}

/// The server's claim of its client's segment for accepted socket `fd`.
/// `Err(reason)`: no offer the broker could prove is this connection's.
pub fn claim(fd: i32) -> Result<fido::NetClaim, String> {
    let Some(d) = domain() else {
        return Err("no broker".into());
    };
    // SAFETY: the accepted socket, open for this call.
    let sock = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    noted(d.net_claim(sock)).map_err(|e| {
        pin_if_unanswered(fd, &e);
        e.to_string()
    })
}
