//! The broker's MMNet request path on untrusted input (issue #16): the
//! `NetOffer`/`NetWithdraw`/`NetClaim`/`NetListen`/`NetUnlisten` requests as
//! decoded from a domain, and the kernel answers the broker parses to check
//! them (`fido_netlink`, the broker's `netdiag`: sock_diag, route, link and
//! namespace-id replies). The first byte picks what the rest is:
//!
//! - 0: a `ClientMsg`; an accepted MMNet request re-encodes to the same
//!   message and passes its own validation again;
//! - 1: a sock_diag reply for a 4-tuple made of the next 38 bytes (two
//!   16-byte addresses, IPv4 when the first byte is even, two ports); an
//!   answer taken as a socket must describe exactly that 4-tuple;
//! - 2: a route reply, 3: a link reply, 4: a namespace-id reply, 5: a
//!   datagram of the listening-socket dump (IPv4 when the next byte is
//!   even), other: the generic netlink header and attribute walkers.
//!
//! Never a panic; every slice stays inside the input.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use fido_netlink as netlink;
use fido_proto::{ClientMsg, Request};

fn addr(bytes: &[u8], v4: bool, port: u16) -> SocketAddr {
    let ip = if v4 {
        IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3]))
    } else {
        let mut a = [0u8; 16];
        a.copy_from_slice(&bytes[..16]);
        IpAddr::V6(Ipv6Addr::from(a))
    };
    SocketAddr::new(ip, port)
}

/// Checks one input; returns whether it was accepted (a request decoded, a
/// socket or route found) — for corpus statistics.
pub fn check(data: &[u8]) -> bool {
    let Some((&mode, rest)) = data.split_first() else {
        return false;
    };
    match mode {
        0 => {
            let Ok(msg) = fido_proto::decode::<ClientMsg>(rest) else {
                return false;
            };
            let ClientMsg::Request { body, .. } = &msg else {
                return false;
            };
            if !matches!(
                body,
                Request::NetOffer { .. }
                    | Request::NetWithdraw { .. }
                    | Request::NetClaim
                    | Request::NetListen
                    | Request::NetUnlisten { .. }
            ) {
                return false;
            }
            let again = fido_proto::encode(&msg).expect("an accepted message encodes");
            let back = fido_proto::decode::<ClientMsg>(&again).expect("and decodes again");
            assert_eq!(back, msg);
            if let Request::NetOffer { remote, .. } = body {
                assert_ne!(remote.port(), 0, "validation lets port 0 through");
            }
            true
        }
        1 => {
            if rest.len() < 38 {
                return false;
            }
            let v4 = rest[0] % 2 == 0;
            let lport = u16::from_be_bytes([rest[32], rest[33]]);
            let rport = u16::from_be_bytes([rest[34], rest[35]]);
            let local = addr(&rest[..16], v4, lport);
            let remote = addr(&rest[16..32], v4, rport);
            let reply = &rest[38..];
            match netlink::parse_diag_reply(reply, local, remote) {
                Ok(Some(_)) => {
                    // Taken as a socket: the reply names exactly this
                    // 4-tuple (family, ports, addresses), as the request did.
                    let want = netlink::diag_request_body(local, remote).expect("same family");
                    let p = &reply[16..];
                    assert_eq!(p[0], want[0]);
                    assert_eq!(p[4..8], want[8..12]);
                    true
                }
                Ok(None) | Err(_) => false,
            }
        }
        2 => !matches!(
            netlink::parse_route_reply(rest),
            netlink::RouteAnswer::Other
        ),
        3 => netlink::parse_link_reply(rest).is_some(),
        4 => netlink::parse_nsid_reply(rest).is_some(),
        // A datagram of the listening-socket dump (SO_REUSEPORT check).
        5 => {
            let family = if rest.first().is_some_and(|b| b % 2 == 0) { libc::AF_INET } else { libc::AF_INET6 };
            match netlink::parse_listeners_datagram(rest.get(1..).unwrap_or(&[]), family) {
                Ok((sockets, _)) => {
                    // Each listed socket took at least one full message.
                    assert!(sockets.len() * (netlink::NLMSG_HDR + netlink::DIAG_MSG_LEN) <= rest.len());
                    !sockets.is_empty()
                }
                Err(_) => false,
            }
        }
        _ => {
            let want = u16::from_ne_bytes([mode, mode]);
            if let Ok(p) = netlink::reply_payload(rest, want) {
                assert!(p.len() <= rest.len());
                for (_, v) in netlink::attrs(p, (mode % 32) as usize) {
                    assert!(v.len() <= p.len());
                }
                return true;
            }
            false
        }
    }
}
