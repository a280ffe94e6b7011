//! What the kernel says about TCP sockets, routes and network namespaces —
//! the facts the broker checks MMNet's handshake against (`server::net`),
//! never what a client writes or claims.
//!
//! The requests and the parsers of the kernel's answers are `fido-netlink`'s
//! (shared with `fido-net`, fuzzed by `fuzz/fuzz_targets/net_request.rs`),
//! re-exported here; which answer proves what is `server::net`'s policy.
//! What this module adds is the broker's own reach: netlink sockets are of
//! the namespace of the thread that creates them, and [`netlink_in`] makes
//! one inside another namespace from a short-lived thread that enters it
//! (`setns`), so the broker's own thread never moves.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::time::Duration;

pub use fido_netlink::{
    attrs, canonical, diag_request_body, find_socket, nsid_of, parse_diag_reply, parse_link_reply,
    parse_nsid_reply, parse_route_reply, reply_payload, route, DiagSocket, Route, RouteAnswer,
    TCP_ESTABLISHED, TCP_SYN_SENT,
};

/// How long the broker waits for one kernel answer: the kernel answers at
/// once, and a surprise must not stall the broker's loop.
const ANSWER_TIMEOUT: Duration = Duration::from_millis(500);

/// A netlink socket of protocol `proto` (`NETLINK_ROUTE`,
/// `NETLINK_SOCK_DIAG`) in network namespace `ns`, or in ours for `None`.
/// Entering another namespace needs `CAP_SYS_ADMIN` (a root broker).
pub fn netlink_in(ns: Option<BorrowedFd<'_>>, proto: libc::c_int) -> io::Result<OwnedFd> {
    let Some(ns) = ns else {
        return fido_netlink::open(proto, ANSWER_TIMEOUT);
    };
    let raw = ns.as_raw_fd();
    std::thread::scope(|s| {
        s.spawn(move || {
            // SAFETY: setns on this thread alone (a network namespace is per
            // thread); the thread ends right after making the socket.
            if unsafe { libc::setns(raw, libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            fido_netlink::open(proto, ANSWER_TIMEOUT)
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("namespace thread panicked")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_live_loopback_connection_and_its_inode() {
        let lst = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(lst.local_addr().unwrap()).unwrap();
        let (_s, _) = lst.accept().unwrap();
        let diag = netlink_in(None, libc::NETLINK_SOCK_DIAG).unwrap();
        let got = find_socket(&diag, c.local_addr().unwrap(), c.peer_addr().unwrap())
            .unwrap()
            .expect("the client socket");
        let st = rustix::fs::fstat(&c).unwrap();
        assert_eq!(got.inode, st.st_ino);
        assert_eq!(got.state, TCP_ESTABLISHED);
        let rt = netlink_in(None, libc::NETLINK_ROUTE).unwrap();
        assert_eq!(route(&rt, "127.0.0.1".parse().unwrap()), Route::Local);
    }
}
