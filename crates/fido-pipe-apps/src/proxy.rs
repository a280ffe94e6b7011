//! `fido pipe proxy LISTEN UPSTREAM`: a TCP forwarder (vPipe's load-balancer
//! case). Every accepted connection gets its own connection to UPSTREAM and two
//! socket→socket moves through a [`Mover`], one per direction.
//!
//! Half-close is carried through: when one side finishes sending (EOF), the
//! proxy shuts down writing on the other side and keeps forwarding the opposite
//! direction until it ends too — a client may send its request, shut down
//! writing, and still read the whole answer. An error in either direction (a
//! reset, a failed write) shuts both connections down in both directions, so
//! the other mover wakes up and the pair is released; it never affects other
//! pairs. An upstream that cannot be reached closes the client connection.
//!
//! The proxy reads nothing of what it forwards: each client connection gets
//! its own upstream connection, never shared with another client, so no
//! client can frame bytes into another's requests (HTTP request smuggling
//! needs a connection two clients share). What it does bound is how many
//! connections (each two threads and an upstream connection) are open: in
//! all, and per peer (a local uid, or a remote address: [`crate::peers`]).
//! A connection over either limit is closed at once, before any upstream
//! connection is made.

use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use crate::accept;
use crate::mover::Mover;
use crate::peers::{self, ConnLimits};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A bound proxy.
pub struct Proxy {
    listener: TcpListener,
    upstream: Vec<SocketAddr>,
    mover: Arc<dyn Mover>,
    limits: Arc<ConnLimits>,
}

impl Proxy {
    pub const DEFAULT_MAX_CONNS: usize = 1024;
    pub const DEFAULT_MAX_CONNS_PER_PEER: usize = 64;

    pub fn bind(listen: &str, upstream: &str, mover: Arc<dyn Mover>) -> io::Result<Proxy> {
        let upstream: Vec<SocketAddr> = upstream
            .to_socket_addrs()
            .map_err(|e| in_context(e, format!("upstream address {upstream}")))?
            .collect();
        if upstream.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                "upstream resolves to no address",
            ));
        }
        let listener =
            TcpListener::bind(listen).map_err(|e| in_context(e, format!("binding {listen}")))?;
        Ok(Proxy {
            listener,
            upstream,
            mover,
            limits: ConnLimits::new(Self::DEFAULT_MAX_CONNS, Self::DEFAULT_MAX_CONNS_PER_PEER),
        })
    }

    /// At most `max_conns` client connections at once, `max_per_peer` of them
    /// from one peer (defaults: [`Proxy::DEFAULT_MAX_CONNS`],
    /// [`Proxy::DEFAULT_MAX_CONNS_PER_PEER`]).
    pub fn with_limits(mut self, max_conns: usize, max_per_peer: usize) -> Proxy {
        self.limits = ConnLimits::new(max_conns, max_per_peer);
        self
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Accepts forever.
    pub fn run(self) -> io::Result<()> {
        let upstream = Arc::new(self.upstream);
        let mut backoff = accept::Backoff::default();
        loop {
            let (client, peer) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if accept::passing(&e) => continue,
                Err(e) => {
                    backoff.failed(&e);
                    continue;
                }
            };
            backoff.succeeded();
            let who = match client.local_addr() {
                Ok(local) => peers::identify(local, peer),
                Err(_) => continue, // reset before we got here
            };
            let slot = match self.limits.admit(who) {
                Ok(slot) => slot,
                Err(why) => {
                    tracing::debug!(
                        "proxy {peer} ({who}): {why:?} connection limit reached: closed"
                    );
                    continue;
                }
            };
            let mover = self.mover.clone();
            let upstream = upstream.clone();
            let r = std::thread::Builder::new()
                .name("fido-proxy-conn".into())
                .stack_size(256 << 10)
                .spawn(move || {
                    if let Err(e) = pair(mover, client, &upstream) {
                        tracing::debug!("proxy {peer}: {e}");
                    }
                    drop(slot);
                });
            if let Err(e) = r {
                tracing::warn!("spawning a proxy thread: {e}");
            }
        }
    }
}

/// `e` with `what` in front of its message (its kind kept).
pub(crate) fn in_context(e: io::Error, what: String) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn connect_any(addrs: &[SocketAddr]) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no upstream address");
    for a in addrs {
        match TcpStream::connect_timeout(a, CONNECT_TIMEOUT) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Forwards one client connection until both directions ended.
fn pair(mover: Arc<dyn Mover>, client: TcpStream, upstream: &[SocketAddr]) -> io::Result<()> {
    let up = match connect_any(upstream) {
        Ok(u) => u,
        Err(e) => {
            let _ = client.shutdown(Shutdown::Both);
            return Err(e);
        }
    };
    client.set_nodelay(true)?;
    up.set_nodelay(true)?;
    let (c2, u2) = (client.try_clone()?, up.try_clone()?);
    let m2 = mover.clone();
    let back = std::thread::Builder::new()
        .name("fido-proxy-back".into())
        .stack_size(256 << 10)
        .spawn(move || one_way(&*m2, &u2, &c2));
    let back = match back {
        Ok(b) => b,
        Err(e) => {
            let _ = client.shutdown(Shutdown::Both);
            let _ = up.shutdown(Shutdown::Both);
            return Err(e);
        }
    };
    let fwd = one_way(&*mover, &client, &up);
    let back = back
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("proxy thread panicked")));
    fwd.and(back).map(|_| ())
}

/// Moves `from` → `to` until EOF, then half-closes `to`. On error both sockets
/// are shut down completely (waking the opposite direction).
fn one_way(mover: &dyn Mover, from: &TcpStream, to: &TcpStream) -> io::Result<u64> {
    match mover.socket_to_socket(from.as_fd(), to.as_fd(), None) {
        Ok(n) => {
            // EOF from `from`: pass the half-close on. ENOTCONN means the peer is
            // already gone entirely, which the other direction will see.
            let _ = to.shutdown(Shutdown::Write);
            Ok(n)
        }
        Err(e) => {
            let _ = from.shutdown(Shutdown::Both);
            let _ = to.shutdown(Shutdown::Both);
            Err(e)
        }
    }
}
