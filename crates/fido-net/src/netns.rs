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
//! Everything read from the kernel is length-checked; any surprise answers
//! "not proven" (plain TCP), never a guess.

use std::collections::HashMap;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const RTM_NEWROUTE: u16 = 24;
const RTM_GETROUTE: u16 = 26;
const RTM_NEWNSID: u16 = 88;
const RTM_GETNSID: u16 = 90;
const NLMSG_ERROR: u16 = 2;
const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RTA_VIA: u16 = 18;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_LINK_NETNSID: u16 = 37;
const NETNSA_NSID: u16 = 1;
const NETNSA_FD: u16 = 3;
const RTN_UNICAST: u8 = 1;
const RTN_LOCAL: u8 = 2;

/// Where the route to an address leads.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub enum Route {
    /// The address is one of this namespace's own.
    Local,
    /// Directly connected over a veth whose other end is in the namespace
    /// this namespace knows as `nsid`.
    Veth { nsid: i32 },
    /// Anything else (a gateway, a physical or bridge device, no route).
    Other,
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// One rtnetlink request and its single answer (`NLMSG_ERROR` → `None`).
fn ask(ty: u16, body: &[u8], attrs: &[(u16, &[u8])]) -> Option<(u16, Vec<u8>)> {
    // SAFETY: a fresh netlink socket, owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: we own fd.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut msg = vec![0u8; 16];
    msg.extend_from_slice(body);
    msg.resize(align4(msg.len()), 0);
    for (t, v) in attrs {
        let len = 4 + v.len();
        msg.extend_from_slice(&(len as u16).to_ne_bytes());
        msg.extend_from_slice(&t.to_ne_bytes());
        msg.extend_from_slice(v);
        msg.resize(align4(msg.len()), 0);
    }
    let total = msg.len() as u32;
    msg[0..4].copy_from_slice(&total.to_ne_bytes());
    msg[4..6].copy_from_slice(&ty.to_ne_bytes());
    msg[6..8].copy_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    msg[8..12].copy_from_slice(&1u32.to_ne_bytes());
    // SAFETY: sending our buffer on our socket (to the kernel: zeroed sockaddr_nl).
    let r = unsafe {
        let mut sa: libc::sockaddr_nl = std::mem::zeroed();
        sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        libc::sendto(
            fd.as_raw_fd(),
            msg.as_ptr() as *const libc::c_void,
            msg.len(),
            0,
            &sa as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if r != msg.len() as isize {
        return None;
    }
    let mut buf = vec![0u8; 16384];
    // Bounded: the kernel answers a request at once; never block a program
    // on it forever.
    let tv = libc::timeval {
        tv_sec: 1,
        tv_usec: 0,
    };
    // SAFETY: setsockopt with a timeval on our socket.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    // SAFETY: receiving into our buffer.
    let n = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            buf.as_mut_ptr() as *mut libc::c_void,
            buf.len(),
            0,
        )
    };
    if n < 16 {
        return None;
    }
    let n = n as usize;
    let len = u32::from_ne_bytes(buf[0..4].try_into().ok()?) as usize;
    let rty = u16::from_ne_bytes(buf[4..6].try_into().ok()?);
    if len < 16 || len > n || rty == NLMSG_ERROR {
        return None;
    }
    buf.truncate(len);
    Some((rty, buf.split_off(16)))
}

/// The attributes after a fixed header of `hdr` bytes.
fn attrs(payload: &[u8], hdr: usize) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    let mut at = align4(hdr);
    while at + 4 <= payload.len() {
        let len = u16::from_ne_bytes([payload[at], payload[at + 1]]) as usize;
        let ty = u16::from_ne_bytes([payload[at + 2], payload[at + 3]]) & 0x3fff;
        if len < 4 || at + len > payload.len() {
            break;
        }
        out.push((ty, &payload[at + 4..at + len]));
        at += align4(len);
    }
    out
}

fn i32_of(v: &[u8]) -> Option<i32> {
    Some(i32::from_ne_bytes(v.get(..4)?.try_into().ok()?))
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
    let (fam, bytes): (u8, Vec<u8>) = match dst {
        IpAddr::V4(a) => (libc::AF_INET as u8, a.octets().to_vec()),
        IpAddr::V6(a) => (libc::AF_INET6 as u8, a.octets().to_vec()),
    };
    // struct rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags(u32)
    let mut rtm = [0u8; 12];
    rtm[0] = fam;
    rtm[1] = (bytes.len() * 8) as u8;
    let Some((ty, p)) = ask(RTM_GETROUTE, &rtm, &[(RTA_DST, &bytes)]) else {
        return Route::Other;
    };
    if ty != RTM_NEWROUTE || p.len() < 12 {
        return Route::Other;
    }
    match p[7] {
        RTN_LOCAL => return Route::Local,
        RTN_UNICAST => {}
        _ => return Route::Other,
    }
    let mut oif = None;
    for (t, v) in attrs(&p, 12) {
        match t {
            RTA_GATEWAY | RTA_VIA => return Route::Other,
            RTA_OIF => oif = i32_of(v),
            _ => {}
        }
    }
    let Some(oif) = oif.filter(|&i| i > 0) else {
        return Route::Other;
    };
    // struct ifinfomsg: family, pad, type(u16), index(i32), flags(u32), change(u32)
    let mut ifi = [0u8; 16];
    ifi[4..8].copy_from_slice(&oif.to_ne_bytes());
    let Some((ty, p)) = ask(RTM_GETLINK, &ifi, &[]) else {
        return Route::Other;
    };
    if ty != RTM_NEWLINK || p.len() < 16 {
        return Route::Other;
    }
    let mut veth = false;
    let mut nsid = None;
    for (t, v) in attrs(&p, 16) {
        match t {
            IFLA_LINKINFO => {
                for (it, iv) in attrs(v, 0) {
                    if it == IFLA_INFO_KIND && iv.strip_suffix(b"\0").unwrap_or(iv) == b"veth" {
                        veth = true;
                    }
                }
            }
            IFLA_LINK_NETNSID => nsid = i32_of(v),
            _ => {}
        }
    }
    match (veth, nsid) {
        (true, Some(n)) if n >= 0 => Route::Veth { nsid: n },
        _ => Route::Other,
    }
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
    let raw = fd.as_raw_fd() as u32;
    // struct rtgenmsg (one byte, padded to 4).
    let (ty, p) = ask(
        RTM_GETNSID,
        &[libc::AF_UNSPEC as u8],
        &[(NETNSA_FD, &raw.to_ne_bytes())],
    )?;
    if ty != RTM_NEWNSID {
        return None;
    }
    attrs(&p, 1)
        .into_iter()
        .find(|(t, _)| *t == NETNSA_NSID)
        .and_then(|(_, v)| i32_of(v))
        .filter(|&n| n >= 0)
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
