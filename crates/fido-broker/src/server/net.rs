//! MMNet (fido-net) co-location, checked by the broker against the kernel.
//!
//! A TCP connection between two processes under `fido run` moves its bytes
//! through a segment (a memfd) the client makes. Who gets that segment must
//! never follow from anything another user can write, so every step names
//! a socket the caller *holds* (passed as a descriptor) and the broker asks
//! the kernel about it:
//!
//! - `NetOffer` (client, before its SYN): its bound socket and the segment.
//!   The broker records the socket's identity — inode, namespace, local
//!   address — the destination, the caller's uid, and keeps the segment.
//!   The socket descriptor is dropped at once (holding it would keep the
//!   connection alive after the client closed it).
//! - `NetClaim` (server, at accept): its accepted socket. The broker finds
//!   where the peer lives — our own namespace when the server's route to the
//!   peer address is local, else the namespace the kernel proves a direct
//!   veth leads into — and asks sock_diag there for the socket with the
//!   connection's 4-tuple seen from the client. Only an offer whose recorded
//!   inode *is* that socket, made by the server's own uid, is handed over
//!   (and removed); anything else answers `NoSuchKey`: plain TCP.
//! - `NetListen`: a listening socket, published under `/net/listen` (a
//!   subtree only the broker writes) from what the kernel says about it,
//!   withdrawn by its domain or when the domain goes.
//!
//! Offers end when claimed, withdrawn, when their domain goes, or after
//! [`OFFER_TTL`]; a domain holds at most its connection quota of them.

use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use fido_proto::{DomainId, ErrorCode, RemoteError, Reply, Request};

use crate::netdiag::{self, canonical, Route, TCP_ESTABLISHED, TCP_SYN_SENT};

use super::{err, Handled, Server};

/// An unclaimed offer is dropped after this long (a client waits for its
/// server at most `FIDO_NET_ATTACH_MS`, 500 ms by default).
pub(super) const OFFER_TTL: Duration = Duration::from_secs(60);
/// fido-net's segment: a 4 KiB header and two rings of a power of two
/// between 64 KiB and 64 MiB (`crates/fido-net/src/seg.rs`, `config.rs`).
const SEG_HEADER: u64 = 4096;
const MIN_RING: u64 = 64 << 10;
const MAX_RING: u64 = 64 << 20;
/// `SIOCGSKNS`: a descriptor of a socket's network namespace.
const SIOCGSKNS: libc::c_ulong = 0x894C;

struct Offer {
    domain: DomainId,
    uid: u32,
    pid: i32,
    /// Inode of the client's socket and of its network namespace.
    inode: u64,
    netns: u64,
    /// The client's address (its IP may still be unspecified: the kernel
    /// picks the source address at connect) and the one it connects to.
    local: SocketAddr,
    remote: SocketAddr,
    ring_len: u64,
    nonce: u64,
    segment: OwnedFd,
    made: Instant,
}

/// The broker's MMNet records.
#[derive(Default)]
pub(super) struct NetState {
    offers: std::collections::BTreeMap<u64, Offer>,
    next_offer: u64,
    /// Published listener keys: their domains and the inodes of the sockets.
    listeners: std::collections::BTreeMap<String, (DomainId, u64)>,
}

/// A TCP socket as the kernel describes it.
struct TcpSocket {
    inode: u64,
    local: SocketAddr,
    peer: Option<SocketAddr>,
    listening: bool,
}

fn bad(msg: impl Into<String>) -> RemoteError {
    err(ErrorCode::BadDescriptor, msg)
}

fn sockopt_int(fd: BorrowedFd<'_>, opt: libc::c_int) -> Option<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt into an int of the size given.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            &mut v as *mut _ as *mut libc::c_void,
            &mut len,
        )
    };
    (r == 0).then_some(v)
}

fn sock_addr(fd: BorrowedFd<'_>, peer: bool) -> Option<SocketAddr> {
    // SAFETY: sockaddr_storage is plain data, large enough for any address.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let p = &mut ss as *mut _ as *mut libc::sockaddr;
    // SAFETY: the kernel writes at most `len` bytes into the storage.
    let r = unsafe {
        if peer {
            libc::getpeername(fd.as_raw_fd(), p, &mut len)
        } else {
            libc::getsockname(fd.as_raw_fd(), p, &mut len)
        }
    };
    if r != 0 {
        return None;
    }
    match ss.ss_family as libc::c_int {
        libc::AF_INET if len as usize >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: family and length checked.
            let a = unsafe { &*(p as *const libc::sockaddr_in) };
            let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
            Some(SocketAddr::new(ip.into(), u16::from_be(a.sin_port)))
        }
        libc::AF_INET6 if len as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: family and length checked.
            let a = unsafe { &*(p as *const libc::sockaddr_in6) };
            let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
            Some(canonical(SocketAddr::new(ip.into(), u16::from_be(a.sin6_port))))
        }
        _ => None,
    }
}

/// What the kernel says about `fd`, which must be a TCP socket with a local port.
fn tcp_socket(fd: BorrowedFd<'_>) -> Result<TcpSocket, RemoteError> {
    let st = rustix::fs::fstat(fd).map_err(|e| bad(format!("fstat: {e}")))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(bad("not a socket"));
    }
    let family = sockopt_int(fd, libc::SO_DOMAIN);
    if !matches!(family, Some(libc::AF_INET | libc::AF_INET6))
        || sockopt_int(fd, libc::SO_TYPE) != Some(libc::SOCK_STREAM)
        || sockopt_int(fd, libc::SO_PROTOCOL) != Some(libc::IPPROTO_TCP)
    {
        return Err(bad("not a TCP socket"));
    }
    let local = sock_addr(fd, false)
        .filter(|a| a.port() != 0)
        .ok_or_else(|| bad("TCP socket without a local port"))?;
    Ok(TcpSocket {
        inode: st.st_ino,
        local,
        peer: sock_addr(fd, true),
        listening: sockopt_int(fd, libc::SO_ACCEPTCONN) == Some(1),
    })
}

fn inode_of(fd: BorrowedFd<'_>) -> Option<u64> {
    rustix::fs::fstat(fd).ok().map(|st| st.st_ino)
}

fn open_netns_of_pid(pid: i32) -> Option<OwnedFd> {
    let path = format!("/proc/{pid}/ns/net\0");
    // SAFETY: opening a NUL-terminated path; the descriptor is owned below.
    let fd = unsafe {
        libc::open(
            path.as_ptr() as *const libc::c_char,
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    // SAFETY: a fresh descriptor nobody else owns.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The network namespace of socket `fd` (held by process `pid`): asked of
/// the socket itself (`SIOCGSKNS`, needs `CAP_NET_ADMIN`), else the
/// process's namespace. Returns a descriptor and its inode.
fn socket_netns(fd: BorrowedFd<'_>, pid: i32) -> Result<(OwnedFd, u64), RemoteError> {
    // SAFETY: an ioctl that only returns a new descriptor (or fails).
    let ns = unsafe { libc::ioctl(fd.as_raw_fd(), SIOCGSKNS as _) };
    let ns = if ns >= 0 {
        // SAFETY: a fresh descriptor nobody else owns.
        Some(unsafe { OwnedFd::from_raw_fd(ns) })
    } else {
        open_netns_of_pid(pid)
    };
    let ns = ns.ok_or_else(|| err(ErrorCode::Unavailable, "network namespace of the socket unknown"))?;
    let ino = inode_of(ns.as_fd()).ok_or_else(|| err(ErrorCode::Unavailable, "fstat of a namespace"))?;
    Ok((ns, ino))
}

/// The broker's own network namespace inode.
fn own_netns() -> u64 {
    static OWN: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *OWN.get_or_init(|| {
        std::fs::metadata("/proc/thread-self/ns/net")
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
            .unwrap_or(0)
    })
}

/// A netlink socket in namespace `ns` (inode `ino`): made here when it is ours.
fn netlink(ns: BorrowedFd<'_>, ino: u64, proto: libc::c_int) -> Result<OwnedFd, String> {
    let foreign = (ino != own_netns()).then_some(ns);
    netdiag::netlink_in(foreign, proto).map_err(|e| format!("netlink in namespace {ino}: {e}"))
}

/// The segment of an offer: a memfd of the right size, open read-write,
/// sealed so its owner cannot shrink it under the server (SIGBUS there).
fn check_segment(fd: BorrowedFd<'_>, ring_len: u64) -> Result<(), RemoteError> {
    if !ring_len.is_power_of_two() || !(MIN_RING..=MAX_RING).contains(&ring_len) {
        return Err(err(
            ErrorCode::BadRequest,
            format!("MMNet ring of {ring_len} bytes (a power of two, 64 KiB to 64 MiB)"),
        ));
    }
    let st = rustix::fs::fstat(fd).map_err(|e| bad(format!("fstat: {e}")))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_size as u64 != SEG_HEADER + 2 * ring_len {
        return Err(bad(format!(
            "MMNet segment must be a file of {} bytes",
            SEG_HEADER + 2 * ring_len
        )));
    }
    // SAFETY: fcntl queries on a descriptor we hold.
    let (seals, flags) = unsafe {
        (
            libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS),
            libc::fcntl(fd.as_raw_fd(), libc::F_GETFL),
        )
    };
    let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    if seals < 0 || seals & need != need {
        return Err(bad("MMNet segment must be a memfd sealed against shrinking and growing"));
    }
    if flags < 0 || flags & libc::O_ACCMODE != libc::O_RDWR {
        return Err(bad("MMNet segment must be open read-write"));
    }
    Ok(())
}

impl Server {
    /// Handles `NetOffer`, `NetWithdraw`, `NetClaim`, `NetListen`, `NetUnlisten`.
    pub(super) fn net_request(&mut self, dom: DomainId, body: Request, fds: Vec<OwnedFd>) -> Handled {
        match body {
            Request::NetOffer { remote, ring_len, nonce } => self.net_offer(dom, remote, ring_len, nonce, fds),
            Request::NetWithdraw { offer } => {
                if self.net.offers.get(&offer).is_some_and(|o| o.domain == dom) {
                    self.net.offers.remove(&offer);
                    Ok(Some((Reply::Ok, Vec::new())))
                } else {
                    Err(err(ErrorCode::NoSuchKey, format!("no MMNet offer {offer} of this domain")))
                }
            }
            Request::NetClaim => self.net_claim(dom, fds),
            Request::NetListen => self.net_listen(dom, fds),
            Request::NetUnlisten { key } => {
                if self.net.listeners.get(&key).map(|l| l.0) != Some(dom) {
                    return Err(err(ErrorCode::NoSuchKey, format!("{key} is not a listener of this domain")));
                }
                self.net.listeners.remove(&key);
                self.reg_delete(&key);
                Ok(Some((Reply::Ok, Vec::new())))
            }
            other => Err(err(ErrorCode::BadRequest, format!("not an MMNet request: {other:?}"))),
        }
    }

    /// Why the `net` policy refuses `dom` acceleration, as the error text
    /// fido-net shows (`None`: allowed).
    fn net_refusal(&self, dom: DomainId) -> Option<String> {
        let d = self.domains.get(&dom)?;
        let why = self.cfg.policy.net_refusal(&d.rule, &d.name)?;
        Some(format!(
            "MMNet acceleration disabled by policy {}: {why}",
            self.cfg.policy.source
        ))
    }

    fn net_offer(
        &mut self,
        dom: DomainId,
        remote: SocketAddr,
        ring_len: u64,
        nonce: u64,
        fds: Vec<OwnedFd>,
    ) -> Handled {
        let Some(d) = self.domains.get(&dom) else {
            return Err(err(ErrorCode::Internal, "caller has no domain"));
        };
        let (uid, pid, limit) = (d.uid, d.pid, d.rule.quotas.connections);
        if let Some(why) = self.net_refusal(dom) {
            tracing::debug!(domain = dom, "MMNet offer refused: {why}");
            return Err(err(ErrorCode::Denied, why));
        }
        let [socket, segment]: [OwnedFd; 2] = fds
            .try_into()
            .map_err(|f: Vec<OwnedFd>| bad(format!("NetOffer carries two descriptors (socket, segment); got {}", f.len())))?;
        let s = tcp_socket(socket.as_fd())?;
        if s.listening {
            return Err(bad("NetOffer: a listening socket"));
        }
        let remote = canonical(remote);
        if remote.is_ipv4() != s.local.is_ipv4() {
            return Err(err(ErrorCode::BadRequest, "NetOffer: remote address of another family"));
        }
        check_segment(segment.as_fd(), ring_len)?;
        let (client_ns, netns) = socket_netns(socket.as_fd(), pid)?;
        drop(socket);
        if netns != own_netns() && !rustix::process::geteuid().is_root() {
            // Proving the connection would mean entering the client's
            // namespace (setns): refuse now, so it does not wait for a claim.
            return Err(err(
                ErrorCode::Unavailable,
                "MMNet across network namespaces needs a root broker",
            ));
        }
        if let Some(why) = self.no_sure_taker(client_ns.as_fd(), netns, remote, uid) {
            tracing::debug!(domain = dom, "MMNet offer refused: {why}");
            return Err(err(ErrorCode::Unavailable, why));
        }

        let now = Instant::now();
        self.net.offers.retain(|_, o| now.duration_since(o.made) < OFFER_TTL && o.inode != s.inode);
        let held = self.net.offers.values().filter(|o| o.domain == dom).count() as u64;
        if held >= limit {
            return Err(self.quota(
                dom,
                format!("too many MMNet offers: this domain holds {held} (limit {limit}, its connection quota)"),
            ));
        }
        self.net.next_offer += 1;
        let id = self.net.next_offer;
        self.net.offers.insert(
            id,
            Offer {
                domain: dom,
                uid,
                pid,
                inode: s.inode,
                netns,
                local: s.local,
                remote,
                ring_len,
                nonce,
                segment,
                made: now,
            },
        );
        Ok(Some((Reply::NetOffered { offer: id }, Vec::new())))
    }

    /// Why a connection to `remote` from namespace `ns` (inode `ino`), by a
    /// client of `uid`, may reach a listener that would never claim the
    /// offer, so that the client would wait for a claim in vain:
    /// - a listening socket that is not a published Fido listener — a port
    ///   shared (`SO_REUSEPORT`) with a program not under `fido run`, or a
    ///   published key whose socket is no longer the one listening (closed
    ///   without the library seeing it, handed to another process);
    /// - a published listener of another uid (its claim would be refused);
    /// - nothing listening at all on a loopback address (the connect fails).
    ///
    /// `None` when every listening socket that could take the connection in
    /// that namespace is published by a live domain of `uid` (or none listens
    /// on a non-loopback address: a listener in another namespace is the
    /// claim's business). The library's own registry read comes a moment
    /// before the offer and may be stale by then; this check is the one
    /// against the kernel.
    fn no_sure_taker(&self, ns: BorrowedFd<'_>, ino: u64, remote: SocketAddr, uid: u32) -> Option<String> {
        let diag = match netlink(ns, ino, libc::NETLINK_SOCK_DIAG) {
            Ok(fd) => fd,
            Err(e) => return Some(format!("cannot list the listeners on port {}: {e}", remote.port())),
        };
        let mut listening = Vec::new();
        for family in [libc::AF_INET, libc::AF_INET6] {
            match netdiag::listening_sockets(&diag, family) {
                Ok(mut l) => listening.append(&mut l),
                Err(e) => return Some(format!("cannot list the listeners on port {}: {e}", remote.port())),
            }
        }
        // Who may take a connection to `remote`: its exact address or a
        // wildcard of the port (an IPv6 wildcard takes IPv4 too, unless
        // IPV6_V6ONLY: counting it anyway only ever means plain TCP).
        let takers: Vec<&(SocketAddr, u64)> = listening
            .iter()
            .filter(|(a, _)| {
                a.port() == remote.port()
                    && (a.ip() == remote.ip() || (a.ip().is_unspecified() && (a.is_ipv6() || remote.is_ipv4())))
            })
            .collect();
        if takers.is_empty() && remote.ip().is_loopback() {
            return Some(format!("nothing listens on {remote}"));
        }
        for (addr, inode) in &takers {
            let owner = self.net.listeners.values().find(|l| l.1 == *inode).map(|l| l.0);
            let Some(dom) = owner else {
                return Some(format!(
                    "listening socket {inode} on {addr} (one of {}) is not a published MMNet listener: plain TCP",
                    takers.len()
                ));
            };
            match self.domains.get(&dom).map(|d| d.uid) {
                Some(u) if u == uid => {}
                other => {
                    return Some(format!(
                        "the listener on {addr} belongs to {}: its claim would be refused, plain TCP",
                        other.map_or("a domain that has gone".to_string(), |u| format!("uid {u}, not {uid}"))
                    ))
                }
            }
        }
        None
    }

    fn net_claim(&mut self, dom: DomainId, fds: Vec<OwnedFd>) -> Handled {
        let Some(d) = self.domains.get(&dom) else {
            return Err(err(ErrorCode::Internal, "caller has no domain"));
        };
        let (uid, pid) = (d.uid, d.pid);
        let [socket]: [OwnedFd; 1] = fds
            .try_into()
            .map_err(|f: Vec<OwnedFd>| bad(format!("NetClaim carries one descriptor (the accepted socket); got {}", f.len())))?;
        let s = tcp_socket(socket.as_fd())?;
        let Some(peer) = s.peer else {
            return Err(bad("NetClaim: the socket is not connected"));
        };
        let now = Instant::now();
        // Offers for this connection as the client saw it: its local port
        // (its address, if it bound one) and our address as its destination.
        let candidates: Vec<u64> = self
            .net
            .offers
            .iter()
            .filter(|(_, o)| {
                now.duration_since(o.made) < OFFER_TTL
                    && o.remote == s.local
                    && o.local.port() == peer.port()
                    && (o.local.ip().is_unspecified() || o.local.ip() == peer.ip())
            })
            .map(|(id, _)| *id)
            .collect();
        if candidates.is_empty() {
            return Err(err(ErrorCode::NoSuchKey, format!("no MMNet offer for {peer} -> {}", s.local)));
        }
        // Another uid's offer is never ours: nothing to ask the kernel about.
        let (candidates, others): (Vec<u64>, Vec<u64>) =
            candidates.into_iter().partition(|id| self.net.offers[id].uid == uid);
        if candidates.is_empty() {
            return Err(err(
                ErrorCode::NoSuchKey,
                format!(
                    "no MMNet offer proven for {peer} -> {}: offer {} is another uid's",
                    s.local, others[0]
                ),
            ));
        }
        let (server_ns, server_ino) = socket_netns(socket.as_fd(), pid)?;
        drop(socket);
        let rt = netlink(server_ns.as_fd(), server_ino, libc::NETLINK_ROUTE)
            .map_err(|e| err(ErrorCode::Unavailable, e))?;
        let route = netdiag::route(&rt, peer.ip());
        let mut proven = Vec::new();
        let mut why = Vec::new();
        for id in candidates {
            let o = &self.net.offers[&id];
            // The namespace our peer lives in, as the kernel routes to it.
            let client_ns: OwnedFd = match route {
                Route::Local if o.netns == server_ino => match server_ns.try_clone() {
                    Ok(fd) => fd,
                    Err(e) => {
                        why.push(format!("dup: {e}"));
                        continue;
                    }
                },
                Route::Veth { nsid } => {
                    let Some(ns) = open_netns_of_pid(o.pid).filter(|ns| inode_of(ns.as_fd()) == Some(o.netns)) else {
                        why.push(format!("offer {id}: its process left namespace {}", o.netns));
                        continue;
                    };
                    if netdiag::nsid_of(&rt, ns.as_fd()) != Some(nsid) {
                        why.push(format!("offer {id} is not in the namespace our route to {} enters", peer.ip()));
                        continue;
                    }
                    ns
                }
                _ => {
                    why.push(format!("offer {id}: namespace {} is not where our route to {} leads ({route:?})", o.netns, peer.ip()));
                    continue;
                }
            };
            // The client end of this very connection, as the kernel reports it there.
            let diag = match netlink(client_ns.as_fd(), o.netns, libc::NETLINK_SOCK_DIAG) {
                Ok(fd) => fd,
                Err(e) => {
                    why.push(e);
                    continue;
                }
            };
            match netdiag::find_socket(&diag, peer, s.local) {
                Ok(Some(c)) if c.inode == o.inode && matches!(c.state, TCP_ESTABLISHED | TCP_SYN_SENT) => {
                    proven.push(id)
                }
                Ok(Some(c)) => why.push(format!(
                    "offer {id}: the client end is socket {} (state {}), not the offer's {}",
                    c.inode, c.state, o.inode
                )),
                Ok(None) => why.push(format!("offer {id}: no client socket {peer} -> {}", s.local)),
                Err(e) => why.push(format!("offer {id}: {e}")),
            }
        }
        let id = match proven[..] {
            [id] => id,
            [] => return Err(err(ErrorCode::NoSuchKey, format!("no MMNet offer proven for {peer} -> {}: {}", s.local, why.join("; ")))),
            _ => return Err(err(ErrorCode::NoSuchKey, format!("several MMNet offers proven for {peer} -> {}: ambiguous", s.local))),
        };
        let o = self.net.offers.remove(&id).expect("proven above");
        let refusal = self.net_refusal(dom);
        if let Some(why) = &refusal {
            tracing::debug!(domain = dom, "MMNet claim refused: {why}");
        }
        Ok(Some((
            Reply::NetClaimed { ring_len: o.ring_len, nonce: o.nonce, refusal },
            vec![o.segment],
        )))
    }

    fn net_listen(&mut self, dom: DomainId, fds: Vec<OwnedFd>) -> Handled {
        let Some(d) = self.domains.get(&dom) else {
            return Err(err(ErrorCode::Internal, "caller has no domain"));
        };
        let (uid, pid, limit) = (d.uid, d.pid, d.rule.quotas.registry_keys);
        let [socket]: [OwnedFd; 1] = fds
            .try_into()
            .map_err(|f: Vec<OwnedFd>| bad(format!("NetListen carries one descriptor (the listening socket); got {}", f.len())))?;
        let s = tcp_socket(socket.as_fd())?;
        if !s.listening {
            return Err(bad("NetListen: the socket is not listening"));
        }
        let (_, netns) = socket_netns(socket.as_fd(), pid)?;
        drop(socket);
        let held = self.net.listeners.values().filter(|l| l.0 == dom).count() as u64;
        if held >= limit {
            return Err(self.quota(
                dom,
                format!("too many MMNet listeners: this domain holds {held} (limit {limit}, its registry key quota)"),
            ));
        }
        let key = format!(
            "/net/listen/{}/{netns}@{}@{dom}@{uid}@{pid}",
            s.local.port(),
            s.local.ip()
        );
        let events = self
            .reg
            .write(&key, pid.to_string().as_bytes())
            .map_err(|e| super::internal("registry write", e))?;
        self.deliver(events);
        self.net.listeners.insert(key.clone(), (dom, s.inode));
        Ok(Some((Reply::NetListening { key }, Vec::new())))
    }

    /// A domain went: its offers end and its listeners are withdrawn.
    pub(super) fn net_domain_gone(&mut self, dom: DomainId) {
        self.net.offers.retain(|_, o| o.domain != dom);
        let keys: Vec<String> = self
            .net
            .listeners
            .iter()
            .filter(|(_, l)| l.0 == dom)
            .map(|(k, _)| k.clone())
            .collect();
        for k in keys {
            self.net.listeners.remove(&k);
            self.reg_delete(&k);
        }
    }
}
