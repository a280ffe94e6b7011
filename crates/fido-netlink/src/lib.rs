//! `fido-netlink`: the netlink requests Fido makes to learn, from the kernel
//! itself, facts about TCP sockets, routes and network namespaces, and the
//! parsers of the kernel's answers. Two users, one implementation:
//!
//! - the broker (`fido_broker::netdiag`, `server::net`) checks MMNet's
//!   handshake against these facts: which socket has a 4-tuple in a
//!   namespace, its state, owner and inode (sock_diag exact lookup), which
//!   sockets listen in a namespace (sock_diag dump), where a
//!   namespace's route to an address leads, and namespace ids;
//! - `fido-net`, the preload library, proves that a route leads straight
//!   into the peer's namespace before accelerating a connection between
//!   namespaces (`fido-net/src/netns.rs`).
//!
//! What it is for: plain data in (addresses, descriptors), parsed answers out
//! (`Route`, `DiagSocket`, namespace ids). Which answer proves what is each
//! user's policy, not this crate's.
//!
//! What it must never do: trust an answer's shape (every parser takes any
//! byte string, checks every length and answers `Err`/`None`/`Other` for
//! anything it does not expect — fuzzed by `fuzz/fuzz_targets/net_request.rs`),
//! block its caller without bound (every socket has a receive timeout), or
//! change the calling thread's state (no `setns` here: entering a namespace
//! is the broker's business, on a thread of its own). Its system calls are
//! `socket`, `setsockopt`, `sendto` and `recv` on its own netlink sockets,
//! exactly those `fido-net` made itself before this crate existed.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// `TCP_ESTABLISHED` and `TCP_SYN_SENT` (include/net/tcp_states.h).
pub const TCP_ESTABLISHED: u8 = 1;
pub const TCP_SYN_SENT: u8 = 2;

/// `sizeof(struct nlmsghdr)`.
pub const NLMSG_HDR: usize = 16;
pub const NLMSG_ERROR: u16 = 2;
pub const SOCK_DIAG_BY_FAMILY: u16 = 20;
pub const RTM_NEWLINK: u16 = 16;
pub const RTM_GETLINK: u16 = 18;
pub const RTM_NEWROUTE: u16 = 24;
pub const RTM_GETROUTE: u16 = 26;
pub const RTM_NEWNSID: u16 = 88;
pub const RTM_GETNSID: u16 = 90;
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
/// `sizeof(struct inet_diag_msg)`.
pub const DIAG_MSG_LEN: usize = 72;

/// A socket as sock_diag reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiagSocket {
    pub state: u8,
    pub uid: u32,
    pub inode: u64,
}

/// Where a namespace's route to an address leads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// One of the namespace's own addresses (loopback included).
    Local,
    /// Directly connected (no gateway) over a veth whose other end is in
    /// the namespace this one knows as `nsid`.
    Veth { nsid: i32 },
    /// Anything else: a gateway, a bridge or physical device, no route.
    Other,
}

/// The route answer's verdict: local, a direct link through interface
/// `oif` (to be asked about with [`link_request`], answered by
/// [`parse_link_reply`]), or anything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteAnswer {
    Local,
    Direct { oif: i32 },
    Other,
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is (a dual-stack
/// socket and an IPv4 one see the same connection with different families).
pub fn canonical(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => a,
        },
        SocketAddr::V4(_) => a,
    }
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

// ----- building requests -----------------------------------------------------------

/// A netlink request of type `ty`: header, the fixed `body`, then `attrs`
/// (type, value), each padded to 4 bytes.
pub fn message(ty: u16, body: &[u8], attrs: &[(u16, &[u8])]) -> Vec<u8> {
    let mut msg = vec![0u8; NLMSG_HDR];
    msg.extend_from_slice(body);
    msg.resize(align4(msg.len()), 0);
    for (t, v) in attrs {
        msg.extend_from_slice(&((4 + v.len()) as u16).to_ne_bytes());
        msg.extend_from_slice(&t.to_ne_bytes());
        msg.extend_from_slice(v);
        msg.resize(align4(msg.len()), 0);
    }
    let total = msg.len() as u32;
    msg[0..4].copy_from_slice(&total.to_ne_bytes());
    msg[4..6].copy_from_slice(&ty.to_ne_bytes());
    msg[6..8].copy_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    msg[8..12].copy_from_slice(&1u32.to_ne_bytes());
    msg
}

fn addr_words(ip: IpAddr) -> [u8; 16] {
    let mut w = [0u8; 16];
    match ip {
        IpAddr::V4(a) => w[..4].copy_from_slice(&a.octets()),
        IpAddr::V6(a) => w.copy_from_slice(&a.octets()),
    }
    w
}

/// The `inet_diag_req_v2` body asking for the TCP socket whose own address
/// is `local` and whose peer is `remote` (same family after [`canonical`];
/// `None` otherwise).
pub fn diag_request_body(local: SocketAddr, remote: SocketAddr) -> Option<Vec<u8>> {
    let (local, remote) = (canonical(local), canonical(remote));
    let family = match (local.ip(), remote.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => libc::AF_INET,
        (IpAddr::V6(_), IpAddr::V6(_)) => libc::AF_INET6,
        _ => return None,
    };
    let mut b = Vec::with_capacity(56);
    b.push(family as u8);
    b.push(libc::IPPROTO_TCP as u8);
    b.push(0); // no extensions
    b.push(0);
    b.extend_from_slice(&u32::MAX.to_ne_bytes()); // every state
    b.extend_from_slice(&local.port().to_be_bytes());
    b.extend_from_slice(&remote.port().to_be_bytes());
    b.extend_from_slice(&addr_words(local.ip()));
    b.extend_from_slice(&addr_words(remote.ip()));
    b.extend_from_slice(&0u32.to_ne_bytes()); // any interface
    b.extend_from_slice(&u32::MAX.to_ne_bytes()); // INET_DIAG_NOCOOKIE
    b.extend_from_slice(&u32::MAX.to_ne_bytes());
    Some(b)
}

/// `RTM_GETROUTE` for the route to `dst`.
pub fn route_request(dst: IpAddr) -> Vec<u8> {
    let (family, bytes) = match dst {
        IpAddr::V4(a) => (libc::AF_INET as u8, a.octets().to_vec()),
        IpAddr::V6(a) => (libc::AF_INET6 as u8, a.octets().to_vec()),
    };
    // struct rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags (u32).
    let mut rtm = [0u8; 12];
    rtm[0] = family;
    rtm[1] = (bytes.len() * 8) as u8;
    message(RTM_GETROUTE, &rtm, &[(RTA_DST, &bytes)])
}

/// `RTM_GETLINK` for the interface of index `oif`.
pub fn link_request(oif: i32) -> Vec<u8> {
    // struct ifinfomsg: family, pad, type (u16), index (i32), flags (u32), change (u32).
    let mut ifi = [0u8; 16];
    ifi[4..8].copy_from_slice(&oif.to_ne_bytes());
    message(RTM_GETLINK, &ifi, &[])
}

/// `RTM_GETNSID` for the network namespace open as descriptor `ns`.
pub fn nsid_request(ns: BorrowedFd<'_>) -> Vec<u8> {
    let raw = ns.as_raw_fd() as u32;
    // struct rtgenmsg (one byte, padded to 4).
    message(
        RTM_GETNSID,
        &[libc::AF_UNSPEC as u8],
        &[(NETNSA_FD, &raw.to_ne_bytes())],
    )
}

// ----- parsing answers -------------------------------------------------------------

/// The payload of the first message of a netlink answer, if it has type
/// `want`; `Err(errno)` for an `NLMSG_ERROR` (errno 0 would be an ack),
/// `Err(EBADMSG)` for anything malformed or unexpected.
pub fn reply_payload(buf: &[u8], want: u16) -> Result<&[u8], i32> {
    if buf.len() < NLMSG_HDR {
        return Err(libc::EBADMSG);
    }
    let len = u32::from_ne_bytes(buf[0..4].try_into().expect("4 bytes")) as usize;
    let ty = u16::from_ne_bytes([buf[4], buf[5]]);
    if len < NLMSG_HDR || len > buf.len() {
        return Err(libc::EBADMSG);
    }
    let payload = &buf[NLMSG_HDR..len];
    if ty == NLMSG_ERROR {
        let code = payload
            .get(..4)
            .map(|b| i32::from_ne_bytes(b.try_into().expect("4 bytes")))
            .ok_or(libc::EBADMSG)?;
        // An errno is a small negative number; anything else (0, an ack
        // where an answer was due; i32::MIN, which has no negation) is garbage.
        return Err(match code.checked_neg() {
            Some(e) if e > 0 => e,
            _ => libc::EBADMSG,
        });
    }
    if ty != want {
        return Err(libc::EBADMSG);
    }
    Ok(payload)
}

/// The attributes after a fixed header of `hdr` bytes (a malformed tail ends the list).
pub fn attrs(payload: &[u8], hdr: usize) -> Vec<(u16, &[u8])> {
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

/// The socket in a sock_diag answer to [`diag_request_body`]`(local, remote)`:
/// `Ok(None)` when the kernel has no such socket; `Err` for an answer that
/// is malformed or describes another 4-tuple.
pub fn parse_diag_reply(
    buf: &[u8],
    local: SocketAddr,
    remote: SocketAddr,
) -> Result<Option<DiagSocket>, &'static str> {
    let p = match reply_payload(buf, SOCK_DIAG_BY_FAMILY) {
        Ok(p) => p,
        Err(libc::ENOENT) => return Ok(None),
        Err(_) => return Err("sock_diag: malformed or failed answer"),
    };
    if p.len() < DIAG_MSG_LEN {
        return Err("sock_diag: short answer");
    }
    let (local, remote) = (canonical(local), canonical(remote));
    let want = diag_request_body(local, remote).ok_or("sock_diag: mixed families")?;
    // The answer's family and inet_diag_sockid (ports, addresses) must be
    // the ones asked for; the interface and cookie are the kernel's.
    let addr_len = if local.is_ipv4() { 4 } else { 16 };
    if p[0] != want[0]
        || p[4..8] != want[8..12]
        || p[8..8 + addr_len] != want[12..12 + addr_len]
        || p[24..24 + addr_len] != want[28..28 + addr_len]
    {
        return Err("sock_diag: answer for another socket");
    }
    let u32_at = |at: usize| u32::from_ne_bytes(p[at..at + 4].try_into().expect("4 bytes"));
    Ok(Some(DiagSocket {
        state: p[1],
        uid: u32_at(64),
        inode: u64::from(u32_at(68)),
    }))
}

/// The verdict of a route answer (to [`route_request`]).
pub fn parse_route_reply(buf: &[u8]) -> RouteAnswer {
    let Ok(p) = reply_payload(buf, RTM_NEWROUTE) else {
        return RouteAnswer::Other;
    };
    if p.len() < 12 {
        return RouteAnswer::Other;
    }
    match p[7] {
        RTN_LOCAL => return RouteAnswer::Local,
        RTN_UNICAST => {}
        _ => return RouteAnswer::Other,
    }
    let mut oif = None;
    for (t, v) in attrs(p, 12) {
        match t {
            RTA_GATEWAY | RTA_VIA => return RouteAnswer::Other,
            RTA_OIF => oif = i32_of(v),
            _ => {}
        }
    }
    match oif {
        Some(oif) if oif > 0 => RouteAnswer::Direct { oif },
        _ => RouteAnswer::Other,
    }
}

/// The namespace id at the other end of a veth link answer (to
/// [`link_request`]); `None`: not a veth, or no peer namespace id.
pub fn parse_link_reply(buf: &[u8]) -> Option<i32> {
    let p = reply_payload(buf, RTM_NEWLINK).ok()?;
    if p.len() < 16 {
        return None;
    }
    let mut veth = false;
    let mut nsid = None;
    for (t, v) in attrs(p, 16) {
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
    nsid.filter(|&n| veth && n >= 0)
}

/// The id in a `RTM_GETNSID` answer (to [`nsid_request`]).
pub fn parse_nsid_reply(buf: &[u8]) -> Option<i32> {
    let p = reply_payload(buf, RTM_NEWNSID).ok()?;
    attrs(p, 1)
        .into_iter()
        .find(|(t, _)| *t == NETNSA_NSID)
        .and_then(|(_, v)| i32_of(v))
        .filter(|&n| n >= 0)
}

// ----- talking to the kernel -------------------------------------------------------

/// A netlink socket of protocol `proto` (`NETLINK_ROUTE`,
/// `NETLINK_SOCK_DIAG`) in the calling thread's network namespace, whose
/// receives give up after `timeout`: the kernel answers at once, and a
/// surprise must not stall the caller.
pub fn open(proto: libc::c_int, timeout: Duration) -> io::Result<OwnedFd> {
    // SAFETY: creating a socket; the descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval {
        tv_sec: timeout.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
        tv_usec: timeout.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: setsockopt with a timeval of the size given, on our socket.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Sends `msg` on `nl` and returns the first answer datagram.
pub fn exchange(nl: &OwnedFd, msg: &[u8]) -> io::Result<Vec<u8>> {
    // SAFETY: sending our buffer on our socket to the kernel (zeroed sockaddr_nl).
    let r = unsafe {
        let mut sa: libc::sockaddr_nl = std::mem::zeroed();
        sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        libc::sendto(
            nl.as_raw_fd(),
            msg.as_ptr() as *const libc::c_void,
            msg.len(),
            0,
            &sa as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if r != msg.len() as isize {
        return Err(io::Error::last_os_error());
    }
    let mut buf = vec![0u8; 16384];
    // SAFETY: receiving into our buffer of the length given.
    let n = unsafe {
        libc::recv(
            nl.as_raw_fd(),
            buf.as_mut_ptr() as *mut libc::c_void,
            buf.len(),
            0,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

/// The TCP socket (in the namespace of the sock_diag socket `diag`) whose
/// own address is `local` and whose peer is `remote`.
pub fn find_socket(
    diag: &OwnedFd,
    local: SocketAddr,
    remote: SocketAddr,
) -> Result<Option<DiagSocket>, String> {
    let body = diag_request_body(local, remote).ok_or("mixed address families")?;
    let msg = message(SOCK_DIAG_BY_FAMILY, &body, &[]);
    let buf = exchange(diag, &msg).map_err(|e| format!("sock_diag: {e}"))?;
    parse_diag_reply(&buf, local, remote).map_err(str::to_string)
}

/// `TCP_LISTEN` (include/net/tcp_states.h).
pub const TCP_LISTEN: u8 = 10;
const NLMSG_DONE: u16 = 3;
const NLM_F_DUMP: u16 = 0x300;
/// A dump ends within this many answer datagrams (a bound against a kernel
/// or a peer that never says `NLMSG_DONE`).
const MAX_DUMP_DATAGRAMS: usize = 4096;

/// The `inet_diag_req_v2` dump request for every listening TCP socket of
/// `family` (`AF_INET` or `AF_INET6`).
pub fn listeners_request(family: libc::c_int) -> Vec<u8> {
    let mut b = vec![family as u8, libc::IPPROTO_TCP as u8, 0, 0];
    b.extend_from_slice(&(1u32 << TCP_LISTEN).to_ne_bytes());
    b.resize(56, 0); // inet_diag_sockid: all zero, the dump filters nothing else
    let mut m = message(SOCK_DIAG_BY_FAMILY, &b, &[]);
    m[6..8].copy_from_slice(&((libc::NLM_F_REQUEST as u16) | NLM_F_DUMP).to_ne_bytes());
    m
}

/// A listening socket as a sock_diag dump lists it: its local address and inode.
pub type ListeningSocket = (SocketAddr, u64);

/// One datagram of a dump: the sockets it lists, and whether the dump ended.
pub type DumpPart = (Vec<ListeningSocket>, bool);

/// The sockets in one datagram of an answer to [`listeners_request`]:
/// (local address, inode) of each, and whether the dump ended (`NLMSG_DONE`).
/// `Err` for an error message or anything malformed.
pub fn parse_listeners_datagram(buf: &[u8], family: libc::c_int) -> Result<DumpPart, &'static str> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + NLMSG_HDR <= buf.len() {
        let len = u32::from_ne_bytes(buf[at..at + 4].try_into().expect("4 bytes")) as usize;
        let ty = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
        if len < NLMSG_HDR || at + len > buf.len() {
            return Err("sock_diag dump: malformed message");
        }
        match ty {
            NLMSG_DONE => return Ok((out, true)),
            NLMSG_ERROR => return Err("sock_diag dump: error answer"),
            SOCK_DIAG_BY_FAMILY => {
                let p = &buf[at + NLMSG_HDR..at + len];
                if p.len() < DIAG_MSG_LEN || i32::from(p[0]) != family {
                    return Err("sock_diag dump: short answer or another family");
                }
                let port = u16::from_be_bytes([p[4], p[5]]);
                let ip = if family == libc::AF_INET {
                    IpAddr::from(<[u8; 4]>::try_from(&p[8..12]).expect("4 bytes"))
                } else {
                    IpAddr::from(<[u8; 16]>::try_from(&p[8..24]).expect("16 bytes"))
                };
                let inode = u64::from(u32::from_ne_bytes(p[68..72].try_into().expect("4 bytes")));
                out.push((canonical(SocketAddr::new(ip, port)), inode));
            }
            _ => return Err("sock_diag dump: unexpected message"),
        }
        at += align4(len);
    }
    Ok((out, false))
}

/// Every listening TCP socket of `family` in the namespace of the sock_diag
/// socket `diag`: (local address, inode).
pub fn listening_sockets(diag: &OwnedFd, family: libc::c_int) -> Result<Vec<ListeningSocket>, String> {
    let msg = listeners_request(family);
    // SAFETY: sending our buffer on our socket to the kernel (zeroed sockaddr_nl).
    let r = unsafe {
        let mut sa: libc::sockaddr_nl = std::mem::zeroed();
        sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        libc::sendto(
            diag.as_raw_fd(),
            msg.as_ptr() as *const libc::c_void,
            msg.len(),
            0,
            &sa as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if r != msg.len() as isize {
        return Err(format!("sock_diag dump: {}", io::Error::last_os_error()));
    }
    let mut all = Vec::new();
    let mut buf = vec![0u8; 32768];
    for _ in 0..MAX_DUMP_DATAGRAMS {
        // SAFETY: receiving into our buffer of the length given.
        let n = unsafe { libc::recv(diag.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
        if n < 0 {
            return Err(format!("sock_diag dump: {}", io::Error::last_os_error()));
        }
        let (mut got, done) = parse_listeners_datagram(&buf[..n as usize], family)?;
        all.append(&mut got);
        if done {
            return Ok(all);
        }
    }
    Err("sock_diag dump: no end".into())
}

/// Where the route of `rt`'s namespace to `dst` leads (any failure to ask
/// or to understand the answer: [`Route::Other`]).
pub fn route(rt: &OwnedFd, dst: IpAddr) -> Route {
    let Ok(buf) = exchange(rt, &route_request(dst)) else {
        return Route::Other;
    };
    let oif = match parse_route_reply(&buf) {
        RouteAnswer::Local => return Route::Local,
        RouteAnswer::Other => return Route::Other,
        RouteAnswer::Direct { oif } => oif,
    };
    match exchange(rt, &link_request(oif)) {
        Ok(buf) => parse_link_reply(&buf).map_or(Route::Other, |nsid| Route::Veth { nsid }),
        Err(_) => Route::Other,
    }
}

/// The id `rt`'s namespace gives the network namespace `ns`.
pub fn nsid_of(rt: &OwnedFd, ns: BorrowedFd<'_>) -> Option<i32> {
    parse_nsid_reply(&exchange(rt, &nsid_request(ns)).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_millis(500);

    #[test]
    fn parsers_refuse_garbage_and_other_sockets() {
        let l: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let r: SocketAddr = "127.0.0.1:80".parse().unwrap();
        for junk in [&b""[..], b"\x10\0\0\0\x14\0", &[0xffu8; 40]] {
            assert!(parse_diag_reply(junk, l, r).is_err());
            assert!(parse_nsid_reply(junk).is_none());
            assert!(parse_link_reply(junk).is_none());
            assert!(matches!(parse_route_reply(junk), RouteAnswer::Other));
        }
        // A well-formed answer for exactly this socket.
        let body = diag_request_body(l, r).unwrap();
        let mut msg = vec![0u8; DIAG_MSG_LEN];
        msg[0] = libc::AF_INET as u8;
        msg[1] = TCP_ESTABLISHED;
        msg[4..52].copy_from_slice(&body[8..56]);
        msg[64..68].copy_from_slice(&1000u32.to_ne_bytes());
        msg[68..72].copy_from_slice(&777u32.to_ne_bytes());
        let reply = message(SOCK_DIAG_BY_FAMILY, &msg, &[]);
        assert_eq!(
            parse_diag_reply(&reply, l, r),
            Ok(Some(DiagSocket {
                state: TCP_ESTABLISHED,
                uid: 1000,
                inode: 777
            }))
        );
        // The same answer checked against another 4-tuple is refused.
        let other: SocketAddr = "127.0.0.1:4001".parse().unwrap();
        assert!(parse_diag_reply(&reply, other, r).is_err());
        // ENOENT: no such socket.
        let mut err = vec![0u8; 4];
        err.copy_from_slice(&(-libc::ENOENT).to_ne_bytes());
        let reply = message(NLMSG_ERROR, &err, &[]);
        assert_eq!(parse_diag_reply(&reply, l, r), Ok(None));
        // An error code without a negation (found by fuzzing) is garbage, not a panic.
        let reply = message(NLMSG_ERROR, &i32::MIN.to_ne_bytes(), &[]);
        assert!(parse_diag_reply(&reply, l, r).is_err());
        // Mapped addresses are their IPv4 selves.
        let m: SocketAddr = "[::ffff:127.0.0.1]:4000".parse().unwrap();
        assert_eq!(canonical(m), l);
    }

    /// A reply of type `ty` carrying the fixed header `hdr` and `attrs`.
    fn reply(ty: u16, hdr: &[u8], attrs: &[(u16, &[u8])]) -> Vec<u8> {
        message(ty, hdr, attrs)
    }

    #[test]
    fn route_answers_prove_only_direct_links() {
        let mut rtm = [0u8; 12];
        rtm[7] = RTN_LOCAL;
        assert_eq!(
            parse_route_reply(&reply(RTM_NEWROUTE, &rtm, &[])),
            RouteAnswer::Local
        );
        rtm[7] = RTN_UNICAST;
        let oif = 7i32.to_ne_bytes();
        assert_eq!(
            parse_route_reply(&reply(RTM_NEWROUTE, &rtm, &[(RTA_OIF, &oif)])),
            RouteAnswer::Direct { oif: 7 }
        );
        // A gateway (or a route without an interface) proves nothing.
        let gw = [10, 0, 0, 1];
        assert_eq!(
            parse_route_reply(&reply(
                RTM_NEWROUTE,
                &rtm,
                &[(RTA_OIF, &oif), (RTA_GATEWAY, &gw)]
            )),
            RouteAnswer::Other
        );
        assert_eq!(
            parse_route_reply(&reply(RTM_NEWROUTE, &rtm, &[])),
            RouteAnswer::Other
        );
        // The answer to another question (a link answer) is not a route.
        assert_eq!(
            parse_route_reply(&reply(RTM_NEWLINK, &rtm, &[(RTA_OIF, &oif)])),
            RouteAnswer::Other
        );
    }

    #[test]
    fn link_and_nsid_answers() {
        let ifi = [0u8; 16];
        let nsid = 3i32.to_ne_bytes();
        // IFLA_LINKINFO { IFLA_INFO_KIND "veth\0" }, padded.
        let kind = |k: &[u8]| {
            let mut v = ((4 + k.len()) as u16).to_ne_bytes().to_vec();
            v.extend_from_slice(&IFLA_INFO_KIND.to_ne_bytes());
            v.extend_from_slice(k);
            v.resize(align4(v.len()), 0);
            v
        };
        let veth = kind(b"veth\0");
        let bridge = kind(b"bridge\0");
        let link = |info: &[u8]| {
            reply(
                RTM_NEWLINK,
                &ifi,
                &[(IFLA_LINKINFO, info), (IFLA_LINK_NETNSID, &nsid)],
            )
        };
        assert_eq!(parse_link_reply(&link(&veth)), Some(3));
        assert_eq!(parse_link_reply(&link(&bridge)), None);
        let no_id = reply(RTM_NEWLINK, &ifi, &[(IFLA_LINKINFO, &veth)]);
        assert_eq!(parse_link_reply(&no_id), None);

        let ok = reply(RTM_NEWNSID, &[0], &[(NETNSA_NSID, &nsid)]);
        assert_eq!(parse_nsid_reply(&ok), Some(3));
        let unassigned = reply(RTM_NEWNSID, &[0], &[(NETNSA_NSID, &(-1i32).to_ne_bytes())]);
        assert_eq!(parse_nsid_reply(&unassigned), None);
    }

    #[test]
    fn requests_have_their_kernel_layout() {
        let m = route_request("10.1.2.3".parse().unwrap());
        assert_eq!(
            u32::from_ne_bytes(m[0..4].try_into().unwrap()) as usize,
            m.len()
        );
        assert_eq!(u16::from_ne_bytes([m[4], m[5]]), RTM_GETROUTE);
        assert_eq!(m[NLMSG_HDR], libc::AF_INET as u8);
        assert_eq!(m[NLMSG_HDR + 1], 32);
        assert_eq!(
            attrs(&m[NLMSG_HDR..], 12),
            vec![(RTA_DST, &[10u8, 1, 2, 3][..])]
        );
        let m = link_request(9);
        assert_eq!(m.len(), NLMSG_HDR + 16);
        assert_eq!(i32_of(&m[NLMSG_HDR + 4..]), Some(9));
    }

    #[test]
    fn finds_a_live_loopback_connection_and_its_inode() {
        let lst = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(lst.local_addr().unwrap()).unwrap();
        let (_s, _) = lst.accept().unwrap();
        let diag = open(libc::NETLINK_SOCK_DIAG, TIMEOUT).unwrap();
        let got = find_socket(&diag, c.local_addr().unwrap(), c.peer_addr().unwrap())
            .unwrap()
            .expect("the client socket");
        let st = rustix::fs::fstat(&c).unwrap();
        assert_eq!(got.inode, st.st_ino);
        assert_eq!(got.state, TCP_ESTABLISHED);
        let rt = open(libc::NETLINK_ROUTE, TIMEOUT).unwrap();
        assert_eq!(route(&rt, "127.0.0.1".parse().unwrap()), Route::Local);
    }
}
