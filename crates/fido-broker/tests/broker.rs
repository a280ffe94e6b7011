//! End-to-end tests of the broker through a raw SEQPACKET client.

use std::os::fd::AsFd;
use std::time::Duration;

use fido_test_support::broker::config_in;
use fido_test_support::raw::*;
use fido_test_support::Defaults;
use fido_broker::{Broker, BrokerError, Config};
use fido_proto::{
    BrokerMsg, ClientMsg, ErrorCode, Event, GoneReason, Reply, Request, Resume, TxnOp,
};
use rustix::fs::{OFlags, SealFlags};

type TestBroker = fido_test_support::TestBroker<Defaults>;

/// Offers `svc` on `server`, connects `client` to it and accepts. Returns the
/// connection id, the client's received fds and the server's received fds, and
/// the doorbells each side keeps for itself (data, space).
struct Link {
    conn: u64,
    client_got: Vec<std::os::fd::OwnedFd>,
    server_got: Vec<std::os::fd::OwnedFd>,
    client_bells: [Bell; 2],
    server_bells: [Bell; 2],
}

fn link(server: &mut Raw, client: &mut Raw, svc: &str) -> Link {
    server.ok(Request::Offer {
        service: svc.into(),
    });
    let client_bells = [bell(), bell()];
    let id = client.send_request(
        Request::Connect {
            service: svc.into(),
            block: BLOCK,
        },
        &[client_bells[0].as_fd(), client_bells[1].as_fd()],
    );
    let (ev, server_got) = server.event();
    let Event::Incoming {
        conn,
        service,
        peer,
        block,
    } = ev
    else {
        panic!("expected Incoming, got {ev:?}")
    };
    assert_eq!(service, svc);
    assert_eq!(peer.domain, client.domain.unwrap());
    assert_eq!(peer.slot, client.slot.unwrap());
    assert_eq!(peer.arena_len, ARENA_LEN);
    assert_eq!(peer.pid, std::process::id() as i32);
    assert_eq!(block, BLOCK);
    let server_bells = [bell(), bell()];
    let (r, fds) = server.request_fds(
        Request::Accept { conn, block: BLOCK },
        &[server_bells[0].as_fd(), server_bells[1].as_fd()],
    );
    assert_eq!(r, Ok(Reply::Ok));
    assert!(fds.is_empty());
    let (r, client_got) = client.wait_reply(id);
    let Ok(Reply::Connected { conn: c2, peer, .. }) = r else {
        panic!("expected Connected, got {r:?}")
    };
    assert_eq!(c2, conn);
    assert_eq!(peer.domain, server.domain.unwrap());
    assert_eq!(peer.slot, server.slot.unwrap());
    Link {
        conn,
        client_got,
        server_got,
        client_bells,
        server_bells,
    }
}

#[test]
fn join_assigns_increasing_ids_and_distinct_slots() {
    let b = TestBroker::start();
    let mut a = b.client();
    let mut c = b.client();
    let (ida, slota) = a.join("alpha");
    let (idc, slotc) = c.join("gamma");
    assert!(idc > ida, "{idc} > {ida}");
    assert_ne!(slota, slotc);
    assert_eq!(slota, 0);
    assert_eq!(
        a.request(Request::Read {
            path: format!("/domain/{ida}/name")
        }),
        Ok(Reply::Value(Some(b"alpha".to_vec())))
    );
    assert_eq!(
        a.request(Request::Read {
            path: format!("/domain/{idc}/slot")
        }),
        Ok(Reply::Value(Some(slotc.to_string().into_bytes())))
    );
    assert_eq!(
        a.request(Request::Read {
            path: format!("/domain/{ida}/pid")
        }),
        Ok(Reply::Value(Some(
            std::process::id().to_string().into_bytes()
        )))
    );
    assert_eq!(
        a.request(Request::Read {
            path: format!("/domain/{ida}/label")
        }),
        Ok(Reply::Value(Some(b"test".to_vec())))
    );
    // A second join on the same socket is refused.
    assert_eq!(
        a.join_with("again", None).unwrap_err().code,
        ErrorCode::AlreadyJoined
    );
    // Joined reply carries the geometry and heartbeat.
    let mut d = b.client();
    match d.join_with("delta", None) {
        Ok(Reply::Joined {
            geometry,
            heartbeat_ms,
            slot,
            ..
        }) => {
            assert_eq!(geometry, b.config.geometry);
            assert_eq!(heartbeat_ms, 500);
            assert_eq!(slot, 2);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_arenas_and_requests_before_join_are_refused() {
    let b = TestBroker::start();
    let mut a = b.client();
    // Only looking (Status, Read, List) is allowed before Join (issue #16:
    // `fido status` needs no slot); anything that acts is not.
    assert_eq!(a.err_code(Request::Offer { service: "x".into() }), ErrorCode::NotJoined);
    assert_eq!(a.err_code(Request::Write { path: "/x".into(), value: vec![] }), ErrorCode::NotJoined);
    assert!(matches!(a.request(Request::Status), Ok(Reply::Status(_))));

    let join = |len| Request::Join {
        name: "x".into(),
        label: None,
        arena_len: len,
        resume: None,
    };
    // Unsealed.
    let (_rw, ro) = arena_with(ARENA_LEN, SealFlags::empty(), OFlags::RDONLY);
    let (r, _) = a.request_fds(join(ARENA_LEN), &[ro.as_fd()]);
    assert_eq!(r.unwrap_err().code, ErrorCode::BadDescriptor);
    // Sealed but read-write.
    let (_rw, rw2) = arena_with(
        ARENA_LEN,
        SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE,
        OFlags::RDWR,
    );
    let (r, _) = a.request_fds(join(ARENA_LEN), &[rw2.as_fd()]);
    let e = r.unwrap_err();
    assert_eq!(e.code, ErrorCode::BadDescriptor, "{e}");
    // Not a memfd at all.
    let ev = eventfd();
    let (r, _) = a.request_fds(join(ARENA_LEN), &[ev.as_fd()]);
    assert_eq!(r.unwrap_err().code, ErrorCode::BadDescriptor);
    // Claims more than the file holds.
    let (_rw, ro) = arena(ARENA_LEN);
    let (r, _) = a.request_fds(join(ARENA_LEN * 2), &[ro.as_fd()]);
    assert_eq!(r.unwrap_err().code, ErrorCode::BadDescriptor);
    // Larger than a slot.
    let (r, _) = a.request_fds(join(b.config.geometry.slot_size + 4096), &[ro.as_fd()]);
    assert_eq!(r.unwrap_err().code, ErrorCode::BadDescriptor);
    // No descriptor / two descriptors.
    let (r, _) = a.request_fds(join(ARENA_LEN), &[]);
    assert_eq!(r.unwrap_err().code, ErrorCode::BadDescriptor);
    let (r, _) = a.request_fds(join(ARENA_LEN), &[ro.as_fd(), ro.as_fd()]);
    assert_eq!(r.unwrap_err().code, ErrorCode::BadDescriptor);
    // Still usable: a proper join works.
    a.join("x");
}

#[test]
fn connect_exchanges_exactly_the_right_descriptors() {
    let b = TestBroker::start();
    let mut server = b.client();
    let mut client = b.client();
    server.join("server");
    client.join("client");
    let l = link(&mut server, &mut client, "echo");

    // Server got: client arena (memfd, read-only), client data bell, client space bell, liveness end.
    assert_eq!(l.server_got.len(), 4);
    assert!(
        is_memfd(&l.server_got[0]),
        "{}",
        fd_kind(l.server_got[0].as_fd())
    );
    assert!(is_doorbell(&l.server_got[1]) && is_doorbell(&l.server_got[2]));
    assert!(is_socket(&l.server_got[3]));
    fido_shm::check_grant(l.server_got[0].as_fd(), ARENA_LEN).unwrap();
    // Client got the same from the server.
    assert_eq!(l.client_got.len(), 4);
    assert!(is_memfd(&l.client_got[0]));
    assert!(is_doorbell(&l.client_got[1]) && is_doorbell(&l.client_got[2]));
    assert!(is_socket(&l.client_got[3]));
    fido_shm::check_grant(l.client_got[0].as_fd(), ARENA_LEN).unwrap();

    // The bells are the real thing: ringing what the client received wakes the server's own wait end.
    ring_bell(&l.client_got[1], 7);
    assert_eq!(rings(&l.server_bells[0].wait), 7);
    ring_bell(&l.client_got[2], 3);
    assert_eq!(rings(&l.server_bells[1].wait), 3);
    ring_bell(&l.server_got[1], 5);
    assert_eq!(rings(&l.client_bells[0].wait), 5);
    assert_eq!(rings(&l.client_bells[1].wait), 0);

    // Registry records the connection.
    assert_eq!(
        client.request(Request::Read {
            path: format!("/connection/{}/service", l.conn)
        }),
        Ok(Reply::Value(Some(b"echo".to_vec())))
    );
    assert_eq!(
        client.request(Request::Read {
            path: format!("/connection/{}/server", l.conn)
        }),
        Ok(Reply::Value(Some(
            server.domain.unwrap().to_string().into_bytes()
        )))
    );

    // The liveness pair: closing the server's end gives the client EOF.
    let Link {
        mut server_got,
        client_got,
        ..
    } = l;
    let live_client = &client_got[3];
    assert!(!readable(live_client.as_fd(), Duration::from_millis(50)));
    drop(server_got.pop());
    assert!(readable(live_client.as_fd(), WAIT));
    let mut buf = [0u8; 8];
    assert_eq!(rustix::io::read(live_client, &mut buf).unwrap(), 0);

    // Status shows the connection.
    match client.request(Request::Status) {
        Ok(Reply::Status(s)) => {
            assert_eq!(s.domains.len(), 2);
            assert_eq!(
                s.services,
                vec![("echo".to_string(), server.domain.unwrap())]
            );
            assert_eq!(s.connections.len(), 1);
            assert_eq!(s.connections[0].client, client.domain.unwrap());
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn connect_errors_refuse_and_unavailable() {
    let b = TestBroker::start();
    let mut server = b.client();
    let mut client = b.client();
    server.join("server");
    client.join("client");
    let bells = [bell(), bell()];
    let connect = |svc: &str| Request::Connect {
        service: svc.into(),
        block: BLOCK,
    };

    let (r, _) = client.request_fds(connect("nope"), &[bells[0].as_fd(), bells[1].as_fd()]);
    assert_eq!(r.unwrap_err().code, ErrorCode::NoSuchService);

    server.ok(Request::Offer {
        service: "svc".into(),
    });
    assert_eq!(
        client.err_code(Request::Offer {
            service: "svc".into()
        }),
        ErrorCode::ServiceTaken
    );

    // Doorbells must be Unix stream sockets, exactly two.
    let (_rw, ro) = arena(ARENA_LEN);
    let (r, _) = client.request_fds(connect("svc"), &[bells[0].as_fd(), ro.as_fd()]);
    assert_eq!(r.unwrap_err().code, ErrorCode::BadDescriptor);
    let (r, _) = client.request_fds(connect("svc"), &[bells[0].as_fd()]);
    assert_eq!(r.unwrap_err().code, ErrorCode::BadDescriptor);

    // Refused.
    let id = client.send_request(connect("svc"), &[bells[0].as_fd(), bells[1].as_fd()]);
    let (Event::Incoming { conn, .. }, _) = server.event() else {
        panic!()
    };
    // Only the server may answer.
    let sb = [bell(), bell()];
    let (r, _) = client.request_fds(
        Request::Accept { conn, block: BLOCK },
        &[sb[0].as_fd(), sb[1].as_fd()],
    );
    assert_eq!(r.unwrap_err().code, ErrorCode::NoSuchConnection);
    server.ok(Request::Refuse {
        conn,
        reason: "go away".into(),
    });
    let (r, fds) = client.wait_reply(id);
    let e = r.unwrap_err();
    assert_eq!(
        (e.code, e.message.as_str()),
        (ErrorCode::Refused, "go away")
    );
    assert!(fds.is_empty());

    // Server leaves before answering: Unavailable.
    let id = client.send_request(connect("svc"), &[bells[0].as_fd(), bells[1].as_fd()]);
    let _ = server.event();
    server.ok(Request::Leave);
    assert!(server.wait_eof(WAIT));
    let (r, _) = client.wait_reply(id);
    assert_eq!(r.unwrap_err().code, ErrorCode::Unavailable);
    // And the service is gone with it.
    let (r, _) = client.request_fds(connect("svc"), &[bells[0].as_fd(), bells[1].as_fd()]);
    assert_eq!(r.unwrap_err().code, ErrorCode::NoSuchService);
}

#[test]
fn loopback_connection_and_close() {
    let b = TestBroker::start();
    let mut a = b.client();
    let mut peer = b.client();
    a.join("self");
    peer.join("peer");
    // A domain may connect to its own service.
    a.ok(Request::Offer {
        service: "loop".into(),
    });
    let bells = [bell(), bell()];
    let id = a.send_request(
        Request::Connect {
            service: "loop".into(),
            block: BLOCK,
        },
        &[bells[0].as_fd(), bells[1].as_fd()],
    );
    let (Event::Incoming { conn, peer: p, .. }, fds) = a.event() else {
        panic!()
    };
    assert_eq!(p.domain, a.domain.unwrap());
    assert_eq!(fds.len(), 4);
    let sb = [bell(), bell()];
    let (r, _) = a.request_fds(
        Request::Accept { conn, block: BLOCK },
        &[sb[0].as_fd(), sb[1].as_fd()],
    );
    assert_eq!(r, Ok(Reply::Ok));
    let (r, fds) = a.wait_reply(id);
    assert!(matches!(r, Ok(Reply::Connected { .. })), "{r:?}");
    assert_eq!(fds.len(), 4);

    // Close between two domains: the other side hears Closed.
    let l = link(&mut peer, &mut a, "svc2");
    a.ok(Request::Close { conn: l.conn });
    let (ev, _) = peer.event();
    assert_eq!(ev, Event::Closed { conn: l.conn });
    assert_eq!(
        a.request(Request::Read {
            path: format!("/connection/{}/service", l.conn)
        }),
        Ok(Reply::Value(None))
    );
    assert_eq!(
        a.err_code(Request::Close { conn: l.conn }),
        ErrorCode::NoSuchConnection
    );
}

#[test]
fn killed_client_tells_peer_and_fires_domain_watch() {
    let b = TestBroker::start();
    let mut server = b.client();
    let mut client = b.client();
    let mut watcher = b.client();
    server.join("server");
    let (cid, _) = client.join("client");
    watcher.join("watcher");
    watcher.ok(Request::Watch {
        token: 42,
        prefix: "/domain".into(),
    });
    let l = link(&mut server, &mut client, "svc");

    drop(client); // socket closed: death by EOF
    let (ev, _) = server.event_where(|e| matches!(e, Event::PeerGone { .. }));
    assert_eq!(
        ev,
        Event::PeerGone {
            domain: cid,
            conn: Some(l.conn),
            reason: GoneReason::Exited
        }
    );
    let name_key = format!("/domain/{cid}/name");
    let (ev, _) =
        watcher.event_where(|e| matches!(e, Event::Watch { path, .. } if *path == name_key));
    assert_eq!(
        ev,
        Event::Watch {
            token: 42,
            path: name_key,
            value: None
        }
    );
    assert_eq!(
        server.request(Request::Read {
            path: format!("/connection/{}/client", l.conn)
        }),
        Ok(Reply::Value(None))
    );
    // The dead domain's slot stays pinned while the server maps it.
    match server.request(Request::Status) {
        Ok(Reply::Status(s)) => assert!(s.domains.iter().all(|d| d.domain != cid)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn slot_is_reused_only_after_every_mapper_unmaps() {
    let b = TestBroker::start();
    let mut server = b.client();
    let mut client = b.client();
    server.join("server");
    let (cid, cslot) = client.join("client");
    let _l = link(&mut server, &mut client, "svc");
    drop(client);
    let _ = server.event_where(|e| matches!(e, Event::PeerGone { .. }));

    // The slot is pinned: a new domain gets another one. The dead arena stays
    // grantable only along connections to a domain that still maps it (a
    // message forwarded from it may still travel); n1 has none.
    let mut n1 = b.client();
    let (_, s1) = n1.join("n1");
    assert_ne!(s1, cslot);
    assert_eq!(
        n1.err_code(Request::GrantSlot { slot: cslot }),
        ErrorCode::Denied
    );

    server.ok(Request::Unmapped {
        slot: cslot,
        owner: cid,
    });
    // Freed: nothing to grant any more.
    assert_eq!(
        n1.err_code(Request::GrantSlot { slot: cslot }),
        ErrorCode::NoSuchDomain
    );
    let mut n2 = b.client();
    let (_, s2) = n2.join("n2");
    assert_eq!(s2, cslot, "freed slot is reused");
}

#[test]
fn grant_slot() {
    let b = TestBroker::start();
    let mut a = b.client();
    let mut c = b.client();
    let (ida, slota) = a.join("a");
    c.join("c");
    // Only along a chain of connections (see also tests/policy.rs).
    assert_eq!(
        c.err_code(Request::GrantSlot { slot: slota }),
        ErrorCode::Denied
    );
    let _l = link(&mut a, &mut c, "svc");
    let (r, fds) = c.request_fds(Request::GrantSlot { slot: slota }, &[]);
    assert_eq!(
        r,
        Ok(Reply::Grant {
            owner: ida,
            slot: slota,
            arena_len: ARENA_LEN
        })
    );
    assert_eq!(fds.len(), 1);
    assert!(is_memfd(&fds[0]));
    fido_shm::check_grant(fds[0].as_fd(), ARENA_LEN).unwrap();
    assert_eq!(
        c.err_code(Request::GrantSlot { slot: 999 }),
        ErrorCode::NoSuchDomain
    );
    // Descriptors on a request that takes none are refused (and closed).
    let ev = eventfd();
    let (r, _) = c.request_fds(Request::Status, &[ev.as_fd()]);
    assert_eq!(r.unwrap_err().code, ErrorCode::BadDescriptor);
}

#[test]
fn heartbeat_timeout_declares_a_silent_domain_dead() {
    let b = TestBroker::start_with(|c| {
        c.heartbeat = Duration::from_millis(60);
        c.heartbeat_misses = 3;
    });
    let mut server = b.client();
    let mut silent = b.client();
    server.join("server");
    let (sid, _) = silent.join("silent");
    let l = link(&mut server, &mut silent, "svc");
    // The server keeps beating while waiting; the silent one does not.
    let start = std::time::Instant::now();
    let ev = loop {
        server.heartbeat();
        if let Some((BrokerMsg::Event(e), _)) = server.recv_timeout(Duration::from_millis(20)) {
            break e;
        }
        assert!(start.elapsed() < WAIT, "no PeerGone");
    };
    assert_eq!(
        ev,
        Event::PeerGone {
            domain: sid,
            conn: Some(l.conn),
            reason: GoneReason::MissedHeartbeat
        }
    );
    assert!(start.elapsed() >= Duration::from_millis(50));
    assert!(
        silent.wait_eof(WAIT),
        "broker closes the hung domain's socket"
    );
    // The beating server is still alive.
    assert!(matches!(
        server.request(Request::Status),
        Ok(Reply::Status(_))
    ));
}

#[test]
fn registry_ops_and_watches() {
    let b = TestBroker::start();
    let mut a = b.client();
    let mut w = b.client();
    a.join("a");
    w.join("w");
    w.ok(Request::Watch {
        token: 9,
        prefix: "/app".into(),
    });
    a.ok(Request::Write {
        path: "/app/x".into(),
        value: b"1".to_vec(),
    });
    a.ok(Request::Write {
        path: "/app/y/z".into(),
        value: b"2".to_vec(),
    });
    assert_eq!(
        a.request(Request::Read {
            path: "/app/x".into()
        }),
        Ok(Reply::Value(Some(b"1".to_vec())))
    );
    assert_eq!(
        a.request(Request::Read {
            path: "/app/nope".into()
        }),
        Ok(Reply::Value(None))
    );
    assert_eq!(
        a.request(Request::List {
            path: "/app".into()
        }),
        Ok(Reply::Keys(vec!["x".into(), "y".into()]))
    );
    assert_eq!(
        w.event().0,
        Event::Watch {
            token: 9,
            path: "/app/x".into(),
            value: Some(b"1".to_vec())
        }
    );
    assert_eq!(
        w.event().0,
        Event::Watch {
            token: 9,
            path: "/app/y/z".into(),
            value: Some(b"2".to_vec())
        }
    );
    a.ok(Request::Delete {
        path: "/app/y".into(),
    });
    assert_eq!(
        w.event().0,
        Event::Watch {
            token: 9,
            path: "/app/y/z".into(),
            value: None
        }
    );
    // A watch by the writer itself is delivered to the writer.
    a.ok(Request::Watch {
        token: 1,
        prefix: "/app/x".into(),
    });
    a.ok(Request::Write {
        path: "/app/x".into(),
        value: b"3".to_vec(),
    });
    assert_eq!(
        a.event().0,
        Event::Watch {
            token: 1,
            path: "/app/x".into(),
            value: Some(b"3".to_vec())
        }
    );
    let _ = w.event();
    w.ok(Request::Unwatch { token: 9 });
    a.ok(Request::Write {
        path: "/app/x".into(),
        value: b"4".to_vec(),
    });
    let _ = a.event();
    assert!(w.quiet_for(Duration::from_millis(100)));

    // Transactions: compare-and-swap.
    let cas = |expected: &[u8], new: &[u8]| Request::Transaction {
        ops: vec![
            TxnOp::Check {
                path: "/app/x".into(),
                expected: Some(expected.to_vec()),
            },
            TxnOp::Put {
                path: "/app/x".into(),
                value: new.to_vec(),
            },
            TxnOp::Read {
                path: "/app/x".into(),
            },
        ],
    };
    assert_eq!(
        a.request(cas(b"4", b"5")),
        Ok(Reply::Txn {
            committed: true,
            reads: vec![Some(b"5".to_vec())]
        })
    );
    let _ = a.event();
    assert_eq!(
        a.request(cas(b"4", b"6")),
        Ok(Reply::Txn {
            committed: false,
            reads: vec![]
        })
    );
    assert_eq!(
        a.request(Request::Read {
            path: "/app/x".into()
        }),
        Ok(Reply::Value(Some(b"5".to_vec())))
    );
    let create = Request::Transaction {
        ops: vec![
            TxnOp::Check {
                path: "/app/new".into(),
                expected: None,
            },
            TxnOp::Put {
                path: "/app/new".into(),
                value: b"n".to_vec(),
            },
        ],
    };
    assert_eq!(
        a.request(create.clone()),
        Ok(Reply::Txn {
            committed: true,
            reads: vec![]
        })
    );
    assert_eq!(
        a.request(create),
        Ok(Reply::Txn {
            committed: false,
            reads: vec![]
        })
    );

    // Broker-managed subtrees are read-only to applications, but readable and watchable.
    let id = a.domain.unwrap();
    for p in [
        "/domain/1/name",
        "/domain",
        "/service/x/domain",
        "/connection/1/client",
        "/",
    ] {
        assert_eq!(
            a.err_code(Request::Write {
                path: p.into(),
                value: b"x".to_vec()
            }),
            ErrorCode::Denied,
            "{p}"
        );
        assert_eq!(
            a.err_code(Request::Delete { path: p.into() }),
            ErrorCode::Denied,
            "{p}"
        );
    }
    let txn = Request::Transaction {
        ops: vec![TxnOp::Put {
            path: format!("/domain/{id}/name"),
            value: b"evil".to_vec(),
        }],
    };
    assert_eq!(a.err_code(txn), ErrorCode::Denied);
    assert_eq!(
        a.request(Request::Read {
            path: format!("/domain/{id}/name")
        }),
        Ok(Reply::Value(Some(b"a".to_vec())))
    );
    // "/domainx" is not managed.
    a.ok(Request::Write {
        path: "/domainx".into(),
        value: b"ok".to_vec(),
    });
    a.ok(Request::Watch {
        token: 2,
        prefix: "/service".into(),
    });
    a.ok(Request::Counters {
        counters: fido_proto::Counters {
            bytes_copied: 3,
            ..Default::default()
        },
    });
    match a.request(Request::Status) {
        Ok(Reply::Status(s)) => {
            let me = s.domains.iter().find(|d| d.domain == id).unwrap();
            assert_eq!(me.counters.bytes_copied, 3);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn malformed_input_does_not_hurt_other_clients() {
    let b = TestBroker::start();
    let mut good = b.client();
    good.join("good");

    // Garbage with no recoverable id: that client is disconnected.
    let mut bad = b.client();
    bad.send_bytes(b"this is not a fido message", &[]);
    assert!(bad.wait_eof(WAIT));

    // A well-framed request with a broken body: BadRequest for that id, client stays.
    let mut bad2 = b.client();
    bad2.join("bad2");
    let mut bytes = fido_proto::encode(&ClientMsg::Request {
        id: 77,
        body: Request::Status,
    })
    .unwrap();
    bytes.extend_from_slice(&[0xff, 0xff, 0xff]);
    let n = (bytes.len() - 8) as u32;
    bytes[4..8].copy_from_slice(&n.to_le_bytes());
    // Garbage descriptors along with it are closed, not kept.
    let ev = eventfd();
    bad2.send_bytes(&bytes, &[ev.as_fd()]);
    let (r, fds) = bad2.wait_reply(77);
    assert_eq!(r.unwrap_err().code, ErrorCode::BadRequest);
    assert!(fds.is_empty());
    // An invalid path is rejected by validation.
    assert_eq!(
        bad2.err_code(Request::Read {
            path: "/a/../b".into()
        }),
        ErrorCode::BadRequest
    );
    assert!(matches!(
        bad2.request(Request::Status),
        Ok(Reply::Status(_))
    ));

    // Wrong protocol version: Version error, then disconnected.
    let mut old = b.client();
    let mut v = fido_proto::encode(&ClientMsg::Request {
        id: 5,
        body: Request::Status,
    })
    .unwrap();
    v[2] = 9;
    old.send_bytes(&v, &[]);
    let (r, _) = old.wait_reply(5);
    assert_eq!(r.unwrap_err().code, ErrorCode::Version);
    assert!(old.wait_eof(WAIT));

    // Too many descriptors (more than MAX_FDS): truncated control data is an error.
    let mut many = b.client();
    let evs: Vec<_> = (0..12).map(|_| eventfd()).collect();
    let borrowed: Vec<_> = evs.iter().map(|e| e.as_fd()).collect();
    many.send(
        &ClientMsg::Request {
            id: 3,
            body: Request::Status,
        },
        &borrowed,
    );
    let (r, fds) = many.wait_reply(3);
    assert_eq!(r.unwrap_err().code, ErrorCode::BadRequest);
    assert!(fds.is_empty());

    // Empty and tiny datagrams.
    let mut tiny = b.client();
    tiny.send_bytes(b"FD", &[]);
    assert!(tiny.wait_eof(WAIT));

    // The good client never noticed.
    assert!(matches!(
        good.request(Request::Status),
        Ok(Reply::Status(_))
    ));
    good.ok(Request::Write {
        path: "/still/fine".into(),
        value: vec![],
    });
}

#[test]
fn leave_tells_peers_left() {
    let b = TestBroker::start();
    let mut server = b.client();
    let mut client = b.client();
    server.join("server");
    let (cid, _) = client.join("client");
    let l = link(&mut server, &mut client, "svc");
    client.ok(Request::Leave);
    assert!(client.wait_eof(WAIT));
    let (ev, _) = server.event();
    assert_eq!(
        ev,
        Event::PeerGone {
            domain: cid,
            conn: Some(l.conn),
            reason: GoneReason::Left
        }
    );
}

#[test]
fn restart_with_resume_keeps_id_and_slot() {
    let mut b = TestBroker::start();
    let mut server = b.client();
    let mut client = b.client();
    let mut other = b.client();
    let (sid, sslot) = server.join("server");
    let (cid, cslot) = client.join("client");
    let (oid, _) = other.join("other");
    let l = link(&mut server, &mut client, "svc");
    server.ok(Request::Write {
        path: "/app/keep".into(),
        value: b"me".to_vec(),
    });

    b.restart();
    assert!(server.wait_eof(WAIT) && client.wait_eof(WAIT) && other.wait_eof(WAIT));

    // Application keys persist; live state is gone until re-reported.
    let mut fresh = b.client();
    // The fresh join avoids the slots the resuming domains held.
    let (fid, fslot) = fresh.join("fresh");
    assert!(fid > oid, "new id {fid} after restart must exceed {oid}");
    assert_ne!(fslot, sslot);
    assert_ne!(fslot, cslot);
    assert_eq!(
        fresh.request(Request::Read {
            path: "/app/keep".into()
        }),
        Ok(Reply::Value(Some(b"me".to_vec())))
    );
    assert_eq!(
        fresh.request(Request::Read {
            path: format!("/domain/{oid}/name")
        }),
        Ok(Reply::Value(None))
    );

    let mut server2 = b.client();
    let r = server2.join_with(
        "server",
        Some(Resume {
            domain: sid,
            slot: sslot,
            services: vec!["svc".into()],
            mapped: vec![(cslot, cid)],
            connections: vec![(l.conn, cid, "svc".into())],
            watches: vec![(5, "/app".into())],
            secret: server.secret(),
        }),
    );
    match r {
        Ok(Reply::Joined { domain, slot, .. }) => assert_eq!((domain, slot), (sid, sslot)),
        other => panic!("{other:?}"),
    }
    let mut client2 = b.client();
    let r = client2.join_with(
        "client",
        Some(Resume {
            domain: cid,
            slot: cslot,
            services: vec![],
            mapped: vec![(sslot, sid)],
            connections: vec![(l.conn, sid, "svc".into())],
            watches: vec![],
            secret: client.secret(),
        }),
    );
    assert!(
        matches!(r, Ok(Reply::Joined { domain, slot, .. }) if domain == cid && slot == cslot),
        "{r:?}"
    );

    // Resuming a live id again is refused: with its proof (a second process
    // of the same domain) as already joined, without it as denied.
    let dup_resume = |secret| Resume {
        domain: sid,
        slot: sslot,
        services: vec![],
        mapped: vec![],
        connections: vec![],
        watches: vec![],
        secret,
    };
    let mut dup = b.client();
    let r = dup.join_with("dup", Some(dup_resume(server.secret())));
    assert_eq!(r.unwrap_err().code, ErrorCode::AlreadyJoined);
    let mut dup = b.client();
    let r = dup.join_with("dup", Some(dup_resume(client.secret())));
    assert_eq!(r.unwrap_err().code, ErrorCode::Denied);

    match fresh.request(Request::Status) {
        Ok(Reply::Status(s)) => {
            assert_eq!(s.services, vec![("svc".to_string(), sid)]);
            assert_eq!(s.connections.len(), 1);
            assert_eq!(
                (s.connections[0].client, s.connections[0].server),
                (cid, sid)
            );
        }
        other => panic!("{other:?}"),
    }
    // The resumed watch works.
    fresh.ok(Request::Write {
        path: "/app/keep".into(),
        value: b"again".to_vec(),
    });
    assert_eq!(
        server2.event().0,
        Event::Watch {
            token: 5,
            path: "/app/keep".into(),
            value: Some(b"again".to_vec())
        }
    );
    // The resumed connection is live: the client dying tells the server.
    drop(client2);
    let (ev, _) = server2.event_where(|e| matches!(e, Event::PeerGone { .. }));
    assert_eq!(
        ev,
        Event::PeerGone {
            domain: cid,
            conn: Some(l.conn),
            reason: GoneReason::Exited
        }
    );
    // A new connection id is larger than the resumed one.
    let mut c3 = b.client();
    c3.join("c3");
    let bells = [bell(), bell()];
    c3.send_request(
        Request::Connect {
            service: "svc".into(),
            block: BLOCK,
        },
        &[bells[0].as_fd(), bells[1].as_fd()],
    );
    // (The server may first hear that the dead client's arena, which it
    // maps, is gone: conn None.)
    let (Event::Incoming { conn, .. }, _) =
        server2.event_where(|e| matches!(e, Event::Incoming { .. }))
    else {
        panic!()
    };
    assert!(conn > l.conn);
}

#[test]
fn resumed_connection_whose_peer_never_returns_is_reported() {
    let mut b = TestBroker::start_with(|c| {
        c.heartbeat = Duration::from_millis(40);
        c.heartbeat_misses = 3;
    });
    let mut server = b.client();
    let mut client = b.client();
    let (sid, sslot) = server.join("server");
    let (cid, _) = client.join("client");
    let l = link(&mut server, &mut client, "svc");
    b.restart();
    let mut server2 = b.client();
    let r = server2.join_with(
        "server",
        Some(Resume {
            domain: sid,
            slot: sslot,
            services: vec!["svc".into()],
            mapped: vec![],
            connections: vec![(l.conn, cid, "svc".into())],
            watches: vec![],
            secret: server.secret(),
        }),
    );
    assert!(matches!(r, Ok(Reply::Joined { .. })), "{r:?}");
    let start = std::time::Instant::now();
    let ev = loop {
        server2.heartbeat();
        if let Some((BrokerMsg::Event(e), _)) = server2.recv_timeout(Duration::from_millis(20)) {
            break e;
        }
        assert!(start.elapsed() < WAIT, "no PeerGone");
    };
    assert_eq!(
        ev,
        Event::PeerGone {
            domain: cid,
            conn: Some(l.conn),
            reason: GoneReason::MissedHeartbeat
        }
    );
}

#[test]
fn second_broker_on_same_state_dir_is_refused_and_sockets_are_checked() {
    let b = TestBroker::start();
    // Same state dir, different socket: lock held.
    let mut cfg = b.config.clone();
    cfg.socket = b.dir.path().join("other.sock");
    match Broker::bind(cfg) {
        Err(e @ BrokerError::Locked(_)) => {
            assert!(e.to_string().contains("already running"), "{e}")
        }
        other => panic!("expected Locked, got {other:?}"),
    }
    // Same socket, different state dir: a live listener.
    let other_dir = tempfile::tempdir().unwrap();
    let cfg = Config::new(b.socket(), other_dir.path().join("state"));
    assert!(matches!(Broker::bind(cfg), Err(BrokerError::AddrInUse(_))));

    // A stale socket file with no listener is replaced.
    let dir = tempfile::tempdir().unwrap();
    let cfg = config_in(dir.path());
    std::fs::create_dir_all(cfg.socket.parent().unwrap()).unwrap();
    {
        let l = std::os::unix::net::UnixListener::bind(&cfg.socket).unwrap();
        drop(l);
    }
    assert!(cfg.socket.exists());
    let (t, h) = Broker::spawn(cfg.clone()).unwrap();
    let mut c = Raw::connect(&cfg.socket);
    c.join("c");
    h.shutdown();
    t.join().unwrap().unwrap();
    assert!(!cfg.socket.exists(), "socket removed on shutdown");
}

#[test]
fn default_socket_path() {
    // Only checks the fallback chain shape; the environment is left untouched.
    let p = Config::default_socket();
    assert!(p.ends_with("broker.sock") || std::env::var_os("FIDO_BROKER").is_some());
}

#[test]
fn a_client_that_never_reads_is_dropped_without_blocking_others() {
    let b = TestBroker::start();
    let mut writer = b.client();
    let mut sink = b.client();
    let mut watcher = b.client();
    writer.join("writer");
    let (sink_id, _) = sink.join("sink");
    watcher.join("watcher");
    sink.ok(Request::Watch {
        token: 1,
        prefix: "/flood".into(),
    });
    watcher.ok(Request::Watch {
        token: 2,
        prefix: format!("/domain/{sink_id}"),
    });
    // The sink never reads; each write queues a ~60 KB watch event for it.
    let value = vec![0xabu8; 60 * 1024];
    let start = std::time::Instant::now();
    let mut dropped = false;
    let mut sent = 0;
    for i in 0..400 {
        sent = i;
        writer.ok(Request::Write {
            path: format!("/flood/k{}", i % 4),
            value: value.clone(),
        });
        if i % 16 == 0 && !watcher.quiet_for(Duration::from_millis(1)) {
            dropped = true;
            break;
        }
    }
    eprintln!(
        "dropped={dropped} after {sent} writes, {:?}",
        start.elapsed()
    );
    assert!(start.elapsed() < Duration::from_secs(60));
    if !dropped {
        let _ = watcher.event();
    }
    // The writer was never blocked and still works.
    assert!(
        matches!(writer.request(Request::Status), Ok(Reply::Status(s)) if s.domains.iter().all(|d| d.domain != sink_id))
    );
}
