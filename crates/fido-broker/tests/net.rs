//! MMNet's handshake at the broker, through raw clients and real sockets:
//! an offered segment goes only to the server whose accepted socket the
//! kernel shows is connected to the very socket that offered it; offers
//! are checked, bounded by the connection quota, withdrawn only by their
//! domain and dropped with it; listeners are published by the broker from
//! the listening socket and withdrawn with their domain.

use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use fido_broker::Policy;
use fido_proto::{ErrorCode, RemoteError, Reply, Request};
use fido_test_support::raw::*;
use fido_test_support::Defaults;
use rustix::fs::{OFlags, SealFlags};
use rustix::net::{AddressFamily, SocketType};

type TestBroker = fido_test_support::TestBroker<Defaults>;

const RING: u64 = 65536;

fn seg() -> OwnedFd {
    arena_with(4096 + 2 * RING, SealFlags::SHRINK | SealFlags::GROW, OFlags::RDWR).0
}

/// A TCP socket bound to `127.0.0.1:port` (0: any port), not connected.
fn bound(port: u16) -> OwnedFd {
    let s = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    rustix::net::sockopt::set_socket_reuseaddr(&s, true).unwrap();
    let a: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    rustix::net::bind(&s, &a).unwrap();
    s
}

fn local_port(s: &OwnedFd) -> u16 {
    let a = rustix::net::getsockname(s).unwrap();
    SocketAddr::try_from(a).unwrap().port()
}

fn offer(raw: &mut Raw, sock: &OwnedFd, dst: SocketAddr) -> Result<Reply, RemoteError> {
    let seg = seg();
    raw.request_fds(
        Request::NetOffer { remote: dst, ring_len: RING, nonce: 7 },
        &[sock.as_fd(), seg.as_fd()],
    )
    .0
}

fn claim(raw: &mut Raw, accepted: &std::net::TcpStream) -> (Result<Reply, RemoteError>, Vec<OwnedFd>) {
    raw.request_fds(Request::NetClaim, &[accepted.as_fd()])
}

/// A listener on `127.0.0.1`, published by `server` (`NetListen`): offers
/// are made only to ports whose every listener is published.
fn published_listener(server: &mut Raw) -> std::net::TcpListener {
    let lst = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    assert!(matches!(
        server.request_fds(Request::NetListen, &[lst.as_fd()]).0,
        Ok(Reply::NetListening { .. })
    ));
    lst
}

/// A listening socket on `127.0.0.1:port` with `SO_REUSEPORT` (0: any port).
fn shared_listener(port: u16) -> OwnedFd {
    let s = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    rustix::net::sockopt::set_socket_reuseport(&s, true).unwrap();
    let a: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    rustix::net::bind(&s, &a).unwrap();
    rustix::net::listen(&s, 8).unwrap();
    s
}

fn joined(b: &TestBroker, name: &str) -> Raw {
    let mut r = b.client();
    r.join(name);
    r
}

#[test]
fn an_offer_goes_only_to_the_server_of_that_very_connection() {
    let b = TestBroker::start();
    let mut client = joined(&b, "net-client");
    let mut server = joined(&b, "net-server");
    let lst = published_listener(&mut server);
    let dst = lst.local_addr().unwrap();

    let sock = bound(0);
    assert!(matches!(offer(&mut client, &sock, dst), Ok(Reply::NetOffered { .. })));
    // Another connection to the same listener: nothing to claim.
    let _other = std::net::TcpStream::connect(dst).unwrap();
    let (acc, _) = lst.accept().unwrap();
    let (r, fds) = claim(&mut server, &acc);
    assert!(matches!(r, Err(ref e) if e.code == ErrorCode::NoSuchKey), "{r:?}");
    assert!(fds.is_empty());

    // The offering socket's own connection: the segment, once.
    rustix::net::connect(&sock, &dst).unwrap();
    let (acc, _) = lst.accept().unwrap();
    let (r, fds) = claim(&mut server, &acc);
    match r {
        Ok(Reply::NetClaimed { ring_len, nonce, refusal }) => {
            assert_eq!((ring_len, nonce, refusal), (RING, 7, None));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(fds.len(), 1);
    let st = rustix::fs::fstat(&fds[0]).unwrap();
    assert_eq!(st.st_size as u64, 4096 + 2 * RING);
    let (r, _) = claim(&mut server, &acc);
    assert!(matches!(r, Err(ref e) if e.code == ErrorCode::NoSuchKey), "claimed twice: {r:?}");
}

#[test]
fn a_claim_needs_the_offering_socket_not_just_its_address() {
    let b = TestBroker::start();
    let mut client = joined(&b, "net-client");
    let mut server = joined(&b, "net-server");
    let lst = published_listener(&mut server);
    let dst = lst.local_addr().unwrap();
    // Offered from a socket that then goes; another socket takes its port
    // and connects: same 4-tuple, another socket.
    let first = bound(0);
    let port = local_port(&first);
    assert!(matches!(offer(&mut client, &first, dst), Ok(Reply::NetOffered { .. })));
    drop(first);
    let second = bound(port);
    rustix::net::connect(&second, &dst).unwrap();
    let (acc, _) = lst.accept().unwrap();
    let (r, fds) = claim(&mut server, &acc);
    match r {
        Err(e) => {
            assert_eq!(e.code, ErrorCode::NoSuchKey);
            assert!(e.message.contains("not the offer's"), "{}", e.message);
        }
        other => panic!("the segment went to another socket's connection: {other:?}"),
    }
    assert!(fds.is_empty());
}

#[test]
fn offers_are_checked_counted_withdrawn_by_their_domain_and_dropped_with_it() {
    let me = rustix::process::geteuid().as_raw();
    let p = Policy::parse(
        &format!("[[rule]]\nname = \"me\"\nuids = [{me}]\nregistry_write = [\"/**\"]\nconnections = 2\n"),
        "test",
    )
    .unwrap();
    let b = TestBroker::start_with(|c| c.policy = Arc::new(p));
    let mut client = joined(&b, "net-client");
    let mut server = joined(&b, "net-server");
    let lst = published_listener(&mut server);
    let dst = lst.local_addr().unwrap();
    let sock = bound(0);
    let bad = |r: Result<Reply, RemoteError>, code: ErrorCode| {
        assert!(matches!(&r, Err(e) if e.code == code), "{r:?}");
    };

    // Wrong descriptors and segments.
    let s = seg();
    let req = || Request::NetOffer { remote: dst, ring_len: RING, nonce: 7 };
    bad(client.request_fds(req(), &[sock.as_fd()]).0, ErrorCode::BadDescriptor);
    bad(client.request_fds(req(), &[s.as_fd(), s.as_fd()]).0, ErrorCode::BadDescriptor);
    let unsealed = arena_with(4096 + 2 * RING, SealFlags::empty(), OFlags::RDWR).0;
    bad(client.request_fds(req(), &[sock.as_fd(), unsealed.as_fd()]).0, ErrorCode::BadDescriptor);
    let small = arena_with(4096, SealFlags::SHRINK | SealFlags::GROW, OFlags::RDWR).0;
    bad(client.request_fds(req(), &[sock.as_fd(), small.as_fd()]).0, ErrorCode::BadDescriptor);
    let odd = Request::NetOffer { remote: dst, ring_len: RING + 1, nonce: 7 };
    bad(client.request_fds(odd, &[sock.as_fd(), s.as_fd()]).0, ErrorCode::BadRequest);
    bad(server.request_fds(Request::NetClaim, &[sock.as_fd()]).0, ErrorCode::BadDescriptor);

    // The connection quota bounds offers.
    let id = match offer(&mut client, &sock, dst) {
        Ok(Reply::NetOffered { offer }) => offer,
        other => panic!("{other:?}"),
    };
    let (s2, s3) = (bound(0), bound(0));
    assert!(matches!(offer(&mut client, &s2, dst), Ok(Reply::NetOffered { .. })));
    bad(offer(&mut client, &s3, dst), ErrorCode::Quota);
    // Only its domain withdraws an offer.
    bad(server.request(Request::NetWithdraw { offer: id }), ErrorCode::NoSuchKey);
    assert!(matches!(client.request(Request::NetWithdraw { offer: id }), Ok(Reply::Ok)));
    assert!(matches!(offer(&mut client, &s3, dst), Ok(Reply::NetOffered { .. })));

    // Listeners: published by the broker, read-only to applications,
    // withdrawn with their domain; offers go with it too.
    let l2 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let key = match client.request_fds(Request::NetListen, &[l2.as_fd()]).0 {
        Ok(Reply::NetListening { key }) => key,
        other => panic!("{other:?}"),
    };
    let port = l2.local_addr().unwrap().port();
    assert!(key.starts_with(&format!("/net/listen/{port}/")), "{key}");
    assert!(key.ends_with(&format!("@{me}@{}", std::process::id())), "{key}");
    bad(server.request(Request::Delete { path: key.clone() }), ErrorCode::Denied);
    bad(server.request(Request::NetUnlisten { key: key.clone() }), ErrorCode::NoSuchKey);
    bad(
        server.request(Request::Write { path: format!("{key}x"), value: b"1".to_vec() }),
        ErrorCode::Denied,
    );
    bad(client.request_fds(Request::NetListen, &[sock.as_fd()]).0, ErrorCode::BadDescriptor);
    rustix::net::connect(&s3, &dst).unwrap();
    let (acc, _) = lst.accept().unwrap();
    assert!(matches!(client.request(Request::Leave), Ok(Reply::Ok)));
    drop(client);
    let (r, _) = claim(&mut server, &acc);
    bad(r, ErrorCode::NoSuchKey);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match server.request(Request::List { path: format!("/net/listen/{port}") }) {
            Ok(Reply::Keys(k)) if k.is_empty() => break,
            Ok(Reply::Keys(_)) => assert!(std::time::Instant::now() < deadline, "listener key outlived its domain"),
            other => panic!("{other:?}"),
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Issue #19 item 6: a port where some listening socket that could take the
/// connection is not a published listener (`SO_REUSEPORT` with a program not
/// under `fido run`; a key whose socket was closed and replaced) gets no
/// offer — `Unavailable` at once, plain TCP — since no server would claim it
/// and the client would wait for the attach.
#[test]
fn an_offer_to_a_port_with_an_unpublished_listener_is_refused() {
    let b = TestBroker::start();
    let mut client = joined(&b, "net-client");
    let mut server = joined(&b, "net-server");
    let fido_side = shared_listener(0);
    let port = local_port(&fido_side);
    assert!(matches!(
        server.request_fds(Request::NetListen, &[fido_side.as_fd()]).0,
        Ok(Reply::NetListening { .. })
    ));
    let dst: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    // Only published listeners: offered.
    assert!(matches!(offer(&mut client, &bound(0), dst), Ok(Reply::NetOffered { .. })));
    // A plain program shares the port: refused.
    let plain = shared_listener(port);
    let r = offer(&mut client, &bound(0), dst);
    assert!(matches!(&r, Err(e) if e.code == ErrorCode::Unavailable), "{r:?}");
    drop(plain);
    assert!(matches!(offer(&mut client, &bound(0), dst), Ok(Reply::NetOffered { .. })));
    // The published socket closed, another (unpublished) listens there now:
    // the key outlived its socket, refused.
    drop(fido_side);
    let _successor = shared_listener(port);
    let r = offer(&mut client, &bound(0), dst);
    assert!(matches!(&r, Err(e) if e.code == ErrorCode::Unavailable), "{r:?}");
}

/// Nothing listens on a loopback port: no server could ever claim the offer
/// (the connect will be refused), so the broker refuses it at once rather
/// than keep an offer nobody will claim.
#[test]
fn an_offer_to_a_loopback_port_nobody_listens_on_is_refused() {
    let b = TestBroker::start();
    let mut client = joined(&b, "net-client");
    let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dst = gone.local_addr().unwrap();
    drop(gone);
    let r = offer(&mut client, &bound(0), dst);
    assert!(matches!(&r, Err(e) if e.code == ErrorCode::Unavailable && e.message.contains("nothing listens")), "{r:?}");
}
