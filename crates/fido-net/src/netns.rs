//! Which network namespace a TCP connection leads to, asked of the kernel
//! (rtnetlink), so that two processes in *different* namespaces of this host
//! can accelerate their connection without ever attaching the wrong segment.
//!
//! A connection between namespaces is accelerated only when the kernel
//! proves where it goes: the route from this namespace to the peer address is
//! *directly connected* (no gateway) through a `veth` device whose other end
//! lives in the peer process's namespace. Then every packet towards that
//! address enters exactly that namespace, so the TCP peer of our socket is
//! the socket with the same 4-tuple *there* — not one in another pair of
//! namespaces that reuses the same private addresses. Bridged or routed
//! topologies (a bridge, a router namespace, a gateway) cannot be proven
//! this way and stay plain TCP.
//!
//! The requests and the parsers of the kernel's answers are `fido-netlink`'s
//! (shared with the broker): everything read from the kernel is
//! length-checked; any surprise answers "not proven" (plain TCP), never a
//! guess.

use std::collections::HashMap;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

pub use fido_netlink::Route;

/// How long one kernel answer may take: it comes at once; never block a
/// program on it forever.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(1);

/// A fresh rtnetlink socket in this thread's namespace.
fn rtnetlink() -> Option<OwnedFd> {
    fido_netlink::open(libc::NETLINK_ROUTE, ANSWER_TIMEOUT).ok()
}

/// Route answers, kept one second: a program connecting to (or accepted
/// from) remote addresses pays the netlink round trips once per address and
/// second, not per connection; a route that changes is seen within a second.
type RouteCache = (u32, HashMap<IpAddr, (Route, Instant)>);
/// (pid that filled it, answers).
static CACHE: parking_lot::Mutex<Option<RouteCache>> = parking_lot::Mutex::new(None);
const CACHE_TTL: Duration = Duration::from_secs(1);
const CACHE_MAX: usize = 1024;

/// Where this namespace's route to `dst` leads.
pub fn route(dst: IpAddr) -> Route {
    let pid = std::process::id();
    if let Some((p, m)) = CACHE.lock().as_ref() {
        if *p == pid {
            if let Some((r, t)) = m.get(&dst) {
                if t.elapsed() < CACHE_TTL {
                    return *r;
                }
            }
        }
    }
    let r = route_uncached(dst);
    let mut g = CACHE.lock();
    // A forked child may have moved to another namespace (unshare, setns):
    // the cache belongs to the process that filled it.
    if g.as_ref()
        .is_none_or(|(p, m)| *p != pid || m.len() >= CACHE_MAX)
    {
        *g = Some((pid, HashMap::new()));
    }
    if let Some((_, m)) = g.as_mut() {
        m.insert(dst, (r, Instant::now()));
    }
    r
}

fn route_uncached(dst: IpAddr) -> Route {
    rtnetlink().map_or(Route::Other, |rt| fido_netlink::route(&rt, dst))
}

/// The id this namespace gives the network namespace of `pid`, which must
/// be the namespace whose inode is `ino` (guards against a reused pid).
pub fn nsid_of(pid: u32, ino: u64) -> Option<i32> {
    let path = format!("/proc/{pid}/ns/net\0");
    // SAFETY: opening a NUL-terminated path.
    let fd = unsafe {
        libc::open(
            path.as_ptr() as *const libc::c_char,
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: we own fd.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: fstat into a zeroed stat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer, our descriptor.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 || st.st_ino != ino {
        return None;
    }
    fido_netlink::nsid_of(&rtnetlink()?, fd.as_fd())
}

/// Does the route to `dst` lead straight into the namespace `ino` of `pid`?
pub fn leads_to(dst: IpAddr, pid: u32, ino: u64) -> Result<(), String> {
    match route(dst) {
        Route::Veth { nsid } => match nsid_of(pid, ino) {
            Some(n) if n == nsid => Ok(()),
            Some(n) => Err(format!(
                "route to {dst} enters namespace id {nsid}, pid {pid} is in id {n}"
            )),
            None => Err(format!(
                "no namespace id for pid {pid} (gone, or namespace {ino} not its)"
            )),
        },
        Route::Local => Err(format!("{dst} is local to this namespace")),
        Route::Other => Err(format!(
            "route to {dst} is not a direct veth link (gateway, bridge or device): not provable"
        )),
    }
}
