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
    attrs, canonical, diag_request_body, find_socket, listening_sockets, nsid_of, parse_diag_reply, parse_link_reply,
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
    use std::os::fd::AsFd;

    /// A socket made by a thread that entered a namespace (here our own, as
    /// root) answers for that namespace; without `CAP_SYS_ADMIN` the entry
    /// is refused, never done halfway.
    #[test]
    fn a_socket_made_inside_a_namespace_answers_for_it() {
        let ns = std::fs::File::open("/proc/self/ns/net").unwrap();
        let rt = match netlink_in(Some(ns.as_fd()), libc::NETLINK_ROUTE) {
            Ok(rt) => rt,
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => return,
            Err(e) => panic!("entering our own namespace: {e}"),
        };
        assert_eq!(route(&rt, "127.0.0.1".parse().unwrap()), Route::Local);
        let ours = netlink_in(None, libc::NETLINK_ROUTE).unwrap();
        assert_eq!(nsid_of(&rt, ns.as_fd()), nsid_of(&ours, ns.as_fd()));
    }
}
