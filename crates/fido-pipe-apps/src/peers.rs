//! Who is on the other end of an accepted TCP connection, and how many
//! connections each of them holds: what keeps one client of `fido pipe serve`
//! or `fido pipe proxy` from taking every slot (nginx's `limit_conn` keyed by
//! the client address).
//!
//! Every local user connects from the same loopback address, so an address
//! alone would put a hostile local user in one bucket with everyone else on
//! the machine. A peer on this host is therefore told apart by the uid that
//! owns its socket, as the kernel reports it (`sock_diag`, an exact lookup of
//! the peer's 4-tuple — what `ss -e` shows); a peer elsewhere by its address.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustix::net::netlink::{self, SocketAddrNetlink};
use rustix::net::{AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};

/// Whom a connection is counted against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Peer {
    /// A socket on this host, owned by this uid.
    Uid(u32),
    /// A socket elsewhere (or one the kernel no longer knows): its address.
    Addr(IpAddr),
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Uid(u) => write!(f, "local uid {u}"),
            Peer::Addr(a) => write!(f, "{a}"),
        }
    }
}

/// The peer of the connection from `peer` to our `local` address.
pub fn identify(local: SocketAddr, peer: SocketAddr) -> Peer {
    match owner_uid(local, peer) {
        Ok(Some(uid)) => Peer::Uid(uid),
        Ok(None) => Peer::Addr(peer.ip().to_canonical()),
        Err(e) => {
            tracing::debug!("sock_diag lookup of {peer}: {e}");
            Peer::Addr(peer.ip().to_canonical())
        }
    }
}

/// Connection limits: in all, and per [`Peer`].
pub struct ConnLimits {
    max_total: usize,
    max_per_peer: usize,
    held: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    total: usize,
    per_peer: HashMap<Peer, usize>,
}

/// Which limit refused a connection.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    Total,
    Peer,
}

/// One admitted connection; its share is given back when dropped.
pub struct Slot {
    limits: Arc<ConnLimits>,
    peer: Peer,
}

impl ConnLimits {
    /// `max_total` connections at once, at most `max_per_peer` of them from
    /// one peer (both at least 1).
    pub fn new(max_total: usize, max_per_peer: usize) -> Arc<ConnLimits> {
        Arc::new(ConnLimits {
            max_total: max_total.max(1),
            max_per_peer: max_per_peer.max(1),
            held: Mutex::new(Held::default()),
        })
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A connection from `peer`, if neither limit is reached. Called on the
    /// accept thread, so a refused connection costs no thread and no slot.
    pub fn admit(self: &Arc<Self>, peer: Peer) -> Result<Slot, Refused> {
        let mut h = self.held();
        if h.total >= self.max_total {
            return Err(Refused::Total);
        }
        let n = h.per_peer.entry(peer).or_insert(0);
        if *n >= self.max_per_peer {
            return Err(Refused::Peer);
        }
        *n += 1;
        h.total += 1;
        Ok(Slot {
            limits: self.clone(),
            peer,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut h = self.limits.held();
        h.total -= 1;
        if let Some(n) = h.per_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                h.per_peer.remove(&self.peer);
            }
        }
    }
}

// `linux/sock_diag.h`, `linux/inet_diag.h`, `linux/netlink.h`.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const NLMSG_HDR: usize = 16;
/// `struct inet_diag_req_v2`.
const REQ_LEN: usize = 56;
/// Offset of `idiag_uid` in `struct inet_diag_msg`.
const MSG_UID: usize = 64;
const IPPROTO_TCP: u8 = 6;

/// The uid owning the TCP socket at `peer` connected to `local`, if that
/// socket is on this host (network namespace). `Ok(None)`: no such socket
/// here (a remote peer, or one that closed already).
fn owner_uid(local: SocketAddr, peer: SocketAddr) -> io::Result<Option<u32>> {
    // An IPv4 client of a dual-stack listener shows up v4-mapped; its own
    // socket is an IPv4 one.
    let (lip, pip) = (local.ip().to_canonical(), peer.ip().to_canonical());
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    let family = match (pip, lip) {
        (IpAddr::V4(p), IpAddr::V4(l)) => {
            src[..4].copy_from_slice(&p.octets());
            dst[..4].copy_from_slice(&l.octets());
            AddressFamily::INET
        }
        (IpAddr::V6(p), IpAddr::V6(l)) => {
            src = p.octets();
            dst = l.octets();
            AddressFamily::INET6
        }
        _ => return Ok(None),
    };
    let mut req = Vec::with_capacity(NLMSG_HDR + REQ_LEN);
    req.extend_from_slice(&((NLMSG_HDR + REQ_LEN) as u32).to_ne_bytes());
    req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    req.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel fills it in
    req.push(family.as_raw() as u8);
    req.push(IPPROTO_TCP);
    req.push(0); // no extensions
    req.push(0);
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // any state
                                                    // The peer's socket: its local end is `peer`, its remote end is us.
    req.extend_from_slice(&peer.port().to_be_bytes());
    req.extend_from_slice(&local.port().to_be_bytes());
    req.extend_from_slice(&src);
    req.extend_from_slice(&dst);
    req.extend_from_slice(&0u32.to_ne_bytes()); // any interface
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // INET_DIAG_NOCOOKIE
    req.extend_from_slice(&u32::MAX.to_ne_bytes());

    let fd = rustix::net::socket_with(
        AddressFamily::NETLINK,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        Some(netlink::SOCK_DIAG),
    )?;
    // The kernel answers during sendto; the timeout only guards against surprises.
    rustix::net::sockopt::set_socket_timeout(
        &fd,
        rustix::net::sockopt::Timeout::Recv,
        Some(Duration::from_secs(1)),
    )?;
    rustix::net::sendto(&fd, &req, SendFlags::empty(), &SocketAddrNetlink::new(0, 0))?;
    let mut buf = [0u8; 1024];
    let (n, _) = rustix::net::recv(&fd, &mut buf, RecvFlags::empty())?;
    let reply = &buf[..n.min(buf.len())];
    if reply.len() < NLMSG_HDR {
        return Err(io::Error::other("short sock_diag reply"));
    }
    let kind = u16::from_ne_bytes([reply[4], reply[5]]);
    let body = &reply[NLMSG_HDR..];
    if kind == NLMSG_ERROR {
        // `struct nlmsgerr`: a negative errno first. ENOENT: no such socket here.
        let errno = body
            .get(..4)
            .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .unwrap_or(0);
        return match -errno {
            0 => Err(io::Error::other("empty sock_diag reply")),
            e if e == rustix::io::Errno::NOENT.raw_os_error() => Ok(None),
            e => Err(io::Error::from_raw_os_error(e)),
        };
    }
    if kind != SOCK_DIAG_BY_FAMILY || body.len() < MSG_UID + 4 {
        return Err(io::Error::other("unexpected sock_diag reply"));
    }
    // The socket found must be the one asked about (source port, then destination).
    if body[4..6] != peer.port().to_be_bytes() || body[6..8] != local.port().to_be_bytes() {
        return Err(io::Error::other("sock_diag answered for another socket"));
    }
    let u = &body[MSG_UID..MSG_UID + 4];
    Ok(Some(u32::from_ne_bytes([u[0], u[1], u[2], u[3]])))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn a_loopback_peer_is_known_by_its_uid() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, peer) = l.accept().unwrap();
        let me = rustix::process::geteuid().as_raw();
        assert_eq!(identify(s.local_addr().unwrap(), peer), Peer::Uid(me));
        drop(c);
    }

    #[test]
    fn a_peer_on_ipv6_or_a_dual_stack_listener_is_known_by_its_uid() {
        let me = rustix::process::geteuid().as_raw();
        // [::1] (skipped where IPv6 is off), then an IPv4 client of a [::] listener.
        if let Ok(l) = TcpListener::bind("[::1]:0") {
            let _c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let (s, peer) = l.accept().unwrap();
            assert_eq!(identify(s.local_addr().unwrap(), peer), Peer::Uid(me));
        }
        if let Ok(l) = TcpListener::bind("[::]:0") {
            let port = l.local_addr().unwrap().port();
            let Ok(_c) = TcpStream::connect(("127.0.0.1", port)) else {
                return; // a v6-only listener
            };
            let (s, peer) = l.accept().unwrap();
            assert_eq!(identify(s.local_addr().unwrap(), peer), Peer::Uid(me));
        }
    }

    #[test]
    fn an_unknown_peer_is_known_by_its_address() {
        let local: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(identify(local, peer), Peer::Addr(peer.ip()));
    }

    #[test]
    fn limits_per_peer_and_in_all() {
        let l = ConnLimits::new(3, 2);
        let (a, b, c) = (Peer::Uid(1), Peer::Uid(2), Peer::Addr([10, 0, 0, 1].into()));
        let s1 = l.admit(a).unwrap();
        let s2 = l.admit(a).unwrap();
        assert_eq!(l.admit(a).err(), Some(Refused::Peer));
        let s3 = l.admit(b).unwrap();
        assert_eq!(l.admit(c).err(), Some(Refused::Total));
        drop(s1);
        let s4 = l.admit(c).unwrap();
        drop((s2, s3, s4));
        let h = l.held();
        assert_eq!(h.total, 0);
        assert!(h.per_peer.is_empty());
    }
}
