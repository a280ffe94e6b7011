//! The access policy and the per-domain quotas, end to end through raw clients.
//!
//! The cross-uid tests need root: they create two system users
//! (`fido-test-a`, `fido-test-b`) if missing and run this test binary again
//! under those uids with `setpriv` (the child's role is in `FIDO_POLICY_ROLE`,
//! see [`child_main`]). Without root they print why and pass vacuously.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fido_test_support::raw::*;
use fido_test_support::users::{test_user, User};
use fido_test_support::child::{role_command, RoleChild};
use fido_test_support::Defaults;
use fido_broker::Policy;
use fido_proto::{BrokerMsg, ErrorCode, Event, RemoteError, Reply, Request, TxnOp};

type TestBroker = fido_test_support::TestBroker<Defaults>;

fn policy(text: &str) -> Arc<Policy> {
    Arc::new(Policy::parse(text, "test-policy").unwrap())
}

/// A broker whose socket other uids can reach (the tempdir is made 0755),
/// with a slow heartbeat so raw clients need not beat.
fn broker_with(p: Option<Arc<Policy>>) -> TestBroker {
    TestBroker::start_with(|c| {
        if let Some(p) = p {
            c.policy = p;
        }
        c.heartbeat = Duration::from_millis(1000);
        c.heartbeat_misses = 60;
        let top = c.socket.parent().unwrap().parent().unwrap();
        std::fs::set_permissions(top, std::fs::Permissions::from_mode(0o755)).unwrap();
    })
}

fn join_as(raw: &mut Raw, name: &str, label: Option<&str>, len: u64) -> Result<Reply, RemoteError> {
    raw.join_labelled(name, label, len)
}

fn expect_err(r: Result<Reply, RemoteError>, code: ErrorCode, needle: &str) -> String {
    match r {
        Err(e) if e.code == code => {
            assert!(
                e.message.contains(needle),
                "{code:?} message {:?} lacks {needle:?}",
                e.message
            );
            e.message
        }
        other => panic!("expected {code:?} ({needle}), got {other:?}"),
    }
}

/// Connect with fresh doorbells; returns the request id.
fn send_connect(raw: &mut Raw, svc: &str) -> u64 {
    let bells = [bell(), bell()];
    raw.send_request(
        Request::Connect {
            service: svc.into(),
            block: BLOCK,
        },
        &[bells[0].as_fd(), bells[1].as_fd()],
    )
}

/// Client connects to `svc` offered by `server`, which accepts.
fn connect_accepted(server: &mut Raw, client: &mut Raw, svc: &str) -> u64 {
    let id = send_connect(client, svc);
    let (ev, _fds) = server.event_where(|e| matches!(e, Event::Incoming { .. }));
    let Event::Incoming { conn, .. } = ev else {
        unreachable!()
    };
    let bells = [bell(), bell()];
    let (r, _) = server.request_fds(
        Request::Accept { conn, block: BLOCK },
        &[bells[0].as_fd(), bells[1].as_fd()],
    );
    assert_eq!(r, Ok(Reply::Ok));
    let (r, fds) = client.wait_reply(id);
    assert!(matches!(r, Ok(Reply::Connected { .. })), "{r:?}");
    assert_eq!(fds.len(), 4);
    conn
}

/// Whether our descriptor number `n` is a stream socket (a doorbell end or a
/// liveness socket).
fn is_stream(n: &str) -> bool {
    let fd: std::os::fd::RawFd = n.parse().unwrap();
    // SAFETY: borrowed only for this call, while the descriptor is open.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    matches!(rustix::net::sockopt::socket_type(fd), Ok(rustix::net::SocketType::STREAM))
}

/// Memfds, eventfds, doorbells and other sockets this process holds.
fn fd_census() -> BTreeMap<&'static str, usize> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        let t = target.to_string_lossy();
        let kind = if t.starts_with("/memfd:") {
            "memfd"
        } else if t == "anon_inode:[eventfd]" {
            "eventfd"
        } else if t.starts_with("socket:") && is_stream(e.file_name().to_str().unwrap()) {
            "stream"
        } else if t.starts_with("socket:") {
            "socket"
        } else {
            continue;
        };
        *out.entry(kind).or_default() += 1;
    }
    out
}

// ----- quotas and denials, same uid ---------------------------------------------

fn me() -> u32 {
    rustix::process::geteuid().as_raw()
}

fn tight_policy() -> Arc<Policy> {
    policy(&format!(
        r#"
        [defaults]
        connections = 100

        [[rule]]
        name = "tight"
        uids = [{me}]
        labels = ["tight*"]
        offer = ["t-*"]
        connect = ["svc*"]
        registry_write = ["/app/tight/**"]
        arena_bytes = "256KiB"
        connections = 1
        registry_keys = 2
        registry_bytes = 100
        watches = 2

        [[rule]]
        name = "roomy"
        uids = [{me}]
        offer = ["*"]
        connect = ["*"]
        registry_write = ["/app/**"]
        "#,
        me = me()
    ))
}

#[test]
fn quota_arena_bytes() {
    let b = broker_with(Some(tight_policy()));
    let mut t = b.client();
    let m = expect_err(
        join_as(&mut t, "t", Some("tight"), 1 << 20),
        ErrorCode::Quota,
        "(limit 262144",
    );
    assert!(m.contains("tight"), "{m}");
    // At the limit is fine; a domain under another rule is unaffected.
    let mut t = b.client();
    assert!(join_as(&mut t, "t", Some("tight"), 256 << 10).is_ok());
    let mut r = b.client();
    assert!(join_as(&mut r, "r", None, 1 << 20).is_ok());
}

#[test]
fn quota_connections() {
    let b = broker_with(Some(tight_policy()));
    let mut server = b.client();
    join_as(&mut server, "server", None, ARENA_LEN).unwrap();
    server.ok(Request::Offer {
        service: "svc".into(),
    });
    let mut t = b.client();
    join_as(&mut t, "t", Some("tight"), 64 << 10).unwrap();
    connect_accepted(&mut server, &mut t, "svc");
    let id = send_connect(&mut t, "svc");
    let (r, fds) = t.wait_reply(id);
    expect_err(r, ErrorCode::Quota, "(limit 1)");
    assert!(fds.is_empty());
    assert!(
        server.quiet_for(Duration::from_millis(200)),
        "no Incoming for a refused connect"
    );
    // Another domain is unaffected.
    let mut r = b.client();
    join_as(&mut r, "r", None, ARENA_LEN).unwrap();
    connect_accepted(&mut server, &mut r, "svc");
    connect_accepted(&mut server, &mut r, "svc");
    // Closing frees the tight domain's connection.
    let conn = match t.request(Request::Status) {
        Ok(Reply::Status(s)) => {
            s.connections
                .iter()
                .find(|c| c.client == t.domain.unwrap())
                .unwrap()
                .conn
        }
        other => panic!("{other:?}"),
    };
    t.ok(Request::Close { conn });
    connect_accepted(&mut server, &mut t, "svc");
}

#[test]
fn quota_registry_keys_and_bytes() {
    let b = broker_with(Some(tight_policy()));
    let mut t = b.client();
    join_as(&mut t, "t", Some("tight"), 64 << 10).unwrap();
    let w = |p: &str, n: usize| Request::Write {
        path: p.into(),
        value: vec![b'x'; n],
    };
    t.ok(w("/app/tight/1", 10));
    t.ok(w("/app/tight/2", 10));
    expect_err(
        t.request(w("/app/tight/3", 10)),
        ErrorCode::Quota,
        "(limit 2)",
    );
    assert_eq!(
        t.request(Request::Read {
            path: "/app/tight/3".into()
        }),
        Ok(Reply::Value(None))
    );
    // Overwriting a held key adds none; deleting one makes room.
    t.ok(w("/app/tight/1", 20));
    t.ok(Request::Delete {
        path: "/app/tight/2".into(),
    });
    t.ok(w("/app/tight/3", 10));
    // Bytes: 20 + 10 held; 101 more bytes would pass 100.
    expect_err(
        t.request(w("/app/tight/1", 91)),
        ErrorCode::Quota,
        "(limit 100)",
    );
    t.ok(w("/app/tight/1", 90));
    // A transaction is charged as a whole and refused as a whole.
    let txn = Request::Transaction {
        ops: vec![
            TxnOp::Delete {
                path: "/app/tight/3".into(),
            },
            TxnOp::Put {
                path: "/app/tight/4".into(),
                value: vec![0; 5],
            },
            TxnOp::Put {
                path: "/app/tight/5".into(),
                value: vec![0; 5],
            },
        ],
    };
    expect_err(t.request(txn), ErrorCode::Quota, "(limit 2)");
    assert_eq!(
        t.request(Request::Read {
            path: "/app/tight/3".into()
        }),
        Ok(Reply::Value(Some(vec![b'x'; 10]))),
        "nothing of a refused transaction was applied"
    );
    // Outside its registry_write globs: denied.
    expect_err(
        t.request(w("/app/other", 1)),
        ErrorCode::Denied,
        "may not write /app/other",
    );
    expect_err(
        t.request(Request::Delete {
            path: "/app".into(),
        }),
        ErrorCode::Denied,
        "may not delete /app",
    );
    // Another domain is unaffected, and overwriting a key takes its charge.
    let mut r = b.client();
    join_as(&mut r, "r", None, ARENA_LEN).unwrap();
    for i in 0..20 {
        r.ok(w(&format!("/app/r/{i}"), 100));
    }
    r.ok(w("/app/tight/3", 1));
    t.ok(w("/app/tight/6", 10));
    // A dead domain's keys stay, charged to nobody.
    drop(t);
    let mut t2 = b.client();
    join_as(&mut t2, "t2", Some("tight"), 64 << 10).unwrap();
    t2.ok(w("/app/tight/7", 1));
    t2.ok(w("/app/tight/8", 1));
    assert_eq!(
        r.request(Request::Read {
            path: "/app/tight/6".into()
        }),
        Ok(Reply::Value(Some(vec![b'x'; 10])))
    );
}

#[test]
fn quota_watches() {
    let b = broker_with(Some(tight_policy()));
    let mut t = b.client();
    join_as(&mut t, "t", Some("tight"), 64 << 10).unwrap();
    let watch = |token: u64, p: &str| Request::Watch {
        token,
        prefix: p.into(),
    };
    t.ok(watch(1, "/app"));
    t.ok(watch(2, "/app"));
    expect_err(t.request(watch(3, "/app")), ErrorCode::Quota, "(limit 2)");
    t.ok(watch(1, "/other"));
    t.ok(Request::Unwatch { token: 2 });
    t.ok(watch(3, "/app"));
    let mut r = b.client();
    join_as(&mut r, "r", None, ARENA_LEN).unwrap();
    for i in 0..10 {
        r.ok(watch(i, "/app"));
    }
    // The refused watch really is not there: only tokens 1 (on /other) and 3 fire.
    r.ok(Request::Write {
        path: "/app/x".into(),
        value: b"v".to_vec(),
    });
    let (ev, _) = t.event();
    assert!(matches!(ev, Event::Watch { token: 3, .. }), "{ev:?}");
    assert!(t.quiet_for(Duration::from_millis(200)));
}

#[test]
fn offer_connect_and_grant_follow_the_policy() {
    let b = broker_with(Some(tight_policy()));
    let mut server = b.client();
    join_as(&mut server, "server", None, ARENA_LEN).unwrap();
    server.ok(Request::Offer {
        service: "nope".into(),
    });
    server.ok(Request::Offer {
        service: "svc-1".into(),
    });
    let mut t = b.client();
    join_as(&mut t, "t", Some("tight"), 64 << 10).unwrap();
    let m = expect_err(
        t.request(Request::Offer {
            service: "x".into(),
        }),
        ErrorCode::Denied,
        "may not offer service \"x\"",
    );
    assert!(m.contains("rule tight"), "{m}");
    t.ok(Request::Offer {
        service: "t-mine".into(),
    });
    // (Descriptors are counted per process in the cross-uid test; here other
    // tests run in parallel in this process.)
    let id = send_connect(&mut t, "nope");
    let (r, fds) = t.wait_reply(id);
    expect_err(r, ErrorCode::Denied, "may not connect to service \"nope\"");
    assert!(fds.is_empty(), "no descriptor came back");
    assert!(
        server.quiet_for(Duration::from_millis(200)),
        "the server never heard of it"
    );

    // Grants follow connection paths: a - b - c, and d alone.
    let mut a = b.client();
    let mut bb = b.client();
    let mut c = b.client();
    let mut d = b.client();
    join_as(&mut a, "a", None, ARENA_LEN).unwrap();
    join_as(&mut bb, "b", None, ARENA_LEN).unwrap();
    join_as(&mut c, "c", None, ARENA_LEN).unwrap();
    join_as(&mut d, "d", None, ARENA_LEN).unwrap();
    let slot_a = a.slot.unwrap();
    a.ok(Request::Offer {
        service: "a-svc".into(),
    });
    bb.ok(Request::Offer {
        service: "b-svc".into(),
    });
    expect_err(
        c.request(Request::GrantSlot { slot: slot_a }),
        ErrorCode::Denied,
        "no connection path",
    );
    connect_accepted(&mut a, &mut bb, "a-svc");
    connect_accepted(&mut bb, &mut c, "b-svc");
    let (r, fds) = c.request_fds(Request::GrantSlot { slot: slot_a }, &[]);
    assert!(matches!(r, Ok(Reply::Grant { .. })), "two hops away: {r:?}");
    assert_eq!(fds.len(), 1);
    let (r, fds) = d.request_fds(Request::GrantSlot { slot: slot_a }, &[]);
    expect_err(r, ErrorCode::Denied, "no connection path");
    assert!(fds.is_empty());
}

/// The policy `fido broker` reloads on SIGHUP applies to what is live:
/// a domain no rule admits any more is evicted, a service no longer allowed
/// is withdrawn, a connection whose client may no longer connect is revoked
/// (both sides told, both domains live on), and what stays allowed is untouched.
#[test]
fn a_reloaded_policy_applies_to_live_domains_services_and_connections() {
    let before = |extra: &str| {
        format!(
            r#"
            [[rule]]
            name = "srv"
            uids = [{me}]
            labels = ["srv"]
            offer = ["svc-*"]

            [[rule]]
            name = "cli"
            uids = [{me}]
            labels = ["cli"]
            connect = {extra}
            "#,
            me = me()
        )
    };
    let b = broker_with(Some(policy(&format!(
        "{}\n[[rule]]\nname = \"tmp\"\nuids = [{}]\nlabels = [\"tmp\"]\n",
        before(r#"["svc-*"]"#),
        me()
    ))));
    let mut server = b.client();
    let mut client = b.client();
    let mut tmp = b.client();
    join_as(&mut server, "server", Some("srv"), ARENA_LEN).unwrap();
    join_as(&mut client, "client", Some("cli"), ARENA_LEN).unwrap();
    join_as(&mut tmp, "tmp", Some("tmp"), ARENA_LEN).unwrap();
    for svc in ["svc-a", "svc-b"] {
        server.ok(Request::Offer { service: svc.into() });
    }
    let kept = connect_accepted(&mut server, &mut client, "svc-a");
    let cut = connect_accepted(&mut server, &mut client, "svc-b");

    // New policy: no rule for "tmp"; the server may offer only svc-a and the
    // client connect only to svc-a.
    let next = before(r#"["svc-a"]"#).replace(r#"offer = ["svc-*"]"#, r#"offer = ["svc-a"]"#);
    b.reload.reload(Policy::parse(&next, "reloaded").unwrap());

    assert!(tmp.wait_eof(WAIT), "the domain no rule admits is evicted");
    let revoked = |raw: &mut Raw, who: &str| {
        let (ev, _) = raw.event_where(|e| matches!(e, Event::PeerGone { .. }));
        match ev {
            Event::PeerGone { conn, reason, .. } => {
                assert_eq!(conn, Some(cut), "{who}: only the connection to svc-b ends");
                assert_eq!(reason, fido_proto::GoneReason::Revoked, "{who}");
            }
            _ => unreachable!(),
        }
    };
    revoked(&mut client, "client");
    revoked(&mut server, "server");
    // Both domains live on, the allowed connection is untouched, and the
    // registry shows it and not the revoked one.
    assert!(matches!(client.request(Request::Status), Ok(Reply::Status(_))));
    let listed = |raw: &mut Raw, conn: u64| match raw.request(Request::Read {
        path: format!("/connection/{conn}/service"),
    }) {
        Ok(Reply::Value(v)) => v.is_some(),
        other => panic!("{other:?}"),
    };
    assert!(listed(&mut client, kept));
    assert!(!listed(&mut client, cut));
    // svc-b was withdrawn and may not be offered again; svc-a still works.
    let id = send_connect(&mut client, "svc-b");
    let (r, _) = client.wait_reply(id);
    expect_err(r, ErrorCode::Denied, "may not connect to service \"svc-b\"");
    expect_err(
        server.request(Request::Offer { service: "svc-b".into() }),
        ErrorCode::Denied,
        "may not offer",
    );
    connect_accepted(&mut server, &mut client, "svc-a");
    // A fresh "tmp" is refused at the door.
    let mut tmp2 = b.client();
    expect_err(join_as(&mut tmp2, "tmp2", Some("tmp"), ARENA_LEN), ErrorCode::Denied, "may not join");
}

/// A broker restarted with a stricter policy does not let resumed domains
/// keep connections the new policy forbids: they are revoked as the client
/// resumes; the allowed one is re-established untouched.
#[test]
fn resumed_connections_are_checked_against_the_policy() {
    let rule = |connect: &str| {
        policy(&format!(
            "[[rule]]\nname = \"all\"\nuids = [{}]\noffer = [\"*\"]\nconnect = {connect}\n",
            me()
        ))
    };
    let mut b = broker_with(Some(rule(r#"["svc-*"]"#)));
    let mut server = b.client();
    let mut client = b.client();
    join_as(&mut server, "server", None, ARENA_LEN).unwrap();
    join_as(&mut client, "client", None, ARENA_LEN).unwrap();
    let (sid, sslot) = (server.domain.unwrap(), server.slot.unwrap());
    let (cid, cslot) = (client.domain.unwrap(), client.slot.unwrap());
    for svc in ["svc-a", "svc-b"] {
        server.ok(Request::Offer { service: svc.into() });
    }
    let kept = connect_accepted(&mut server, &mut client, "svc-a");
    let cut = connect_accepted(&mut server, &mut client, "svc-b");

    b.config.policy = rule(r#"["svc-a"]"#);
    b.restart();
    assert!(server.wait_eof(WAIT) && client.wait_eof(WAIT));
    let conns = vec![(kept, cid, "svc-a".to_string()), (cut, cid, "svc-b".to_string())];
    let mut server2 = b.client();
    let r = server2.join_with(
        "server",
        Some(fido_proto::Resume {
            domain: sid,
            slot: sslot,
            services: vec!["svc-a".into(), "svc-b".into()],
            mapped: vec![(cslot, cid)],
            connections: conns.clone(),
            watches: vec![],
            secret: server.secret(),
        }),
    );
    assert!(matches!(r, Ok(Reply::Joined { .. })), "{r:?}");
    let mut client2 = b.client();
    let r = client2.join_with(
        "client",
        Some(fido_proto::Resume {
            domain: cid,
            slot: cslot,
            services: vec![],
            mapped: vec![(sslot, sid)],
            connections: conns.iter().map(|(c, _, s)| (*c, sid, s.clone())).collect(),
            watches: vec![],
            secret: client.secret(),
        }),
    );
    assert!(matches!(r, Ok(Reply::Joined { .. })), "{r:?}");
    for (raw, who) in [(&mut client2, "client"), (&mut server2, "server")] {
        let (ev, _) = raw.event_where(|e| matches!(e, Event::PeerGone { .. }));
        match ev {
            Event::PeerGone { conn, reason, .. } => {
                assert_eq!(conn, Some(cut), "{who}");
                assert_eq!(reason, fido_proto::GoneReason::Revoked, "{who}");
            }
            _ => unreachable!(),
        }
        assert!(raw.quiet_for(Duration::from_millis(200)), "{who}: nothing else ends");
    }
    let listed = |raw: &mut Raw, conn: u64| match raw.request(Request::Read {
        path: format!("/connection/{conn}/service"),
    }) {
        Ok(Reply::Value(v)) => v.is_some(),
        other => panic!("{other:?}"),
    };
    assert!(listed(&mut client2, kept));
    assert!(!listed(&mut client2, cut));
}

#[test]
fn no_matching_rule_or_join_false_is_denied() {
    let p = policy(&format!(
        r#"
        [[rule]]
        name = "banned"
        uids = [{me}]
        labels = ["bad-*"]
        join = false

        [[rule]]
        name = "labelled"
        uids = [{me}]
        labels = ["good"]
        "#,
        me = me()
    ));
    let b = broker_with(Some(p));
    let mut x = b.client();
    expect_err(
        join_as(&mut x, "x", Some("bad-1"), ARENA_LEN),
        ErrorCode::Denied,
        "rule banned says join = false",
    );
    let mut y = b.client();
    expect_err(
        join_as(&mut y, "y", None, ARENA_LEN),
        ErrorCode::Denied,
        "no rule matches",
    );
    let mut z = b.client();
    join_as(&mut z, "z", Some("good"), ARENA_LEN).unwrap();
    // Everything omitted is denied.
    expect_err(
        z.request(Request::Offer {
            service: "s".into(),
        }),
        ErrorCode::Denied,
        "may not offer",
    );
    expect_err(
        z.request(Request::Write {
            path: "/app/k".into(),
            value: vec![],
        }),
        ErrorCode::Denied,
        "may not write",
    );
}

// ----- across uids (root only) ----------------------------------------------------

/// How long a child gets to finish its role.
const KID_TIMEOUT: Duration = Duration::from_secs(30);

/// This test binary again, in `role`, as `user`, through setpriv.
fn kid(user: User, role: &str, socket: &Path, env: &[(&str, String)]) -> RoleChild {
    let mut cmd = role_command(Some(user));
    cmd.env("FIDO_POLICY_ROLE", role).env("FIDO_POLICY_SOCKET", socket);
    for (k, v) in env {
        cmd.env(k, v);
    }
    RoleChild::spawn(cmd)
}

#[test]
fn denied_domain_gets_no_grant_and_no_doorbell_across_uids() {
    let (Some(ua), Some(ub)) = (test_user("fido-test-a"), test_user("fido-test-b")) else {
        return;
    };
    let p = policy(&format!(
        r#"
        [[rule]]
        name = "uid-a"
        uids = [{a}]
        offer = ["svc-*"]

        [[rule]]
        name = "uid-b"
        uids = [{b}]
        connect = ["other-*"]

        [[rule]]
        name = "root"
        uids = [0]
        offer = ["*"]
        connect = ["*"]
        "#,
        a = ua.uid,
        b = ub.uid
    ));
    let b = broker_with(Some(p));
    let meta = std::fs::metadata(b.socket()).unwrap();
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o666,
        "socket reachable by the policy's uids"
    );

    let mut root = b.client();
    join_as(&mut root, "root", None, ARENA_LEN).unwrap();
    root.ok(Request::Offer {
        service: "other-ok".into(),
    });

    let mut server = kid(ua, "server", &b.socket(), &[]);
    let slot_a = server.line("@@ ready slot=");
    let mut client = kid(ub, "client", &b.socket(), &[("FIDO_POLICY_SLOT", slot_a)]);
    client.line("@@ denied-ok");

    // The one connection B may make reaches us; accept it.
    let (ev, fds) = root.event();
    let Event::Incoming {
        conn,
        service,
        peer,
        ..
    } = ev
    else {
        panic!("expected Incoming, got {ev:?}")
    };
    assert_eq!(service, "other-ok");
    assert_eq!(peer.uid, ub.uid);
    assert_eq!(fds.len(), 4);
    let bells = [bell(), bell()];
    let (r, _) = root.request_fds(
        Request::Accept { conn, block: BLOCK },
        &[bells[0].as_fd(), bells[1].as_fd()],
    );
    assert_eq!(r, Ok(Reply::Ok));
    client.line("@@ allowed-ok");
    client.wait_success(KID_TIMEOUT);

    // A never saw an Incoming: B's connect to svc-echo was stopped at the broker.
    drop(server.stdin.take());
    assert_eq!(server.line("@@ incoming="), "0");
    server.wait_success(KID_TIMEOUT);
    // A's denied connect never reached us either (B's exit shows up as PeerGone).
    while let Some((m, _)) = root.recv_timeout(Duration::from_millis(100)) {
        assert!(
            !matches!(m, BrokerMsg::Event(Event::Incoming { .. })),
            "{m:?}"
        );
    }
    match root.request(Request::Status) {
        Ok(Reply::Status(s)) => {
            assert!(
                s.connections.iter().all(|c| c.service == "other-ok"),
                "{:?}",
                s.connections
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn default_policy_admits_only_the_brokers_uid() {
    let Some(ua) = test_user("fido-test-a") else {
        return;
    };
    let b = broker_with(None);
    let mut outsider = kid(ua, "outsider", &b.socket(), &[]);
    outsider.line("@@ join-denied");
    outsider.wait_success(KID_TIMEOUT);
    let mut root = b.client();
    join_as(&mut root, "root", None, ARENA_LEN).unwrap();
    root.ok(Request::Offer {
        service: "anything".into(),
    });
}

/// Entry point of the re-executed children; a no-op in a normal run.
#[test]
fn child_main() {
    let Ok(role) = std::env::var("FIDO_POLICY_ROLE") else {
        return;
    };
    let socket = std::env::var("FIDO_POLICY_SOCKET").unwrap();
    let mut raw = Raw::connect(Path::new(&socket));
    match role.as_str() {
        "outsider" => {
            let m = expect_err(
                join_as(&mut raw, "outsider", None, ARENA_LEN),
                ErrorCode::Denied,
                "may not join: no rule matches",
            );
            assert!(m.contains("built-in default policy"), "{m}");
            println!("@@ join-denied");
        }
        "server" => {
            join_as(&mut raw, "srv-a", None, ARENA_LEN).unwrap();
            raw.ok(Request::Offer {
                service: "svc-echo".into(),
            });
            expect_err(
                raw.request(Request::Offer {
                    service: "other-x".into(),
                }),
                ErrorCode::Denied,
                "rule uid-a",
            );
            let id = send_connect(&mut raw, "other-ok");
            let (r, fds) = raw.wait_reply(id);
            expect_err(r, ErrorCode::Denied, "may not connect");
            assert!(fds.is_empty());
            println!("@@ ready slot={}", raw.slot.unwrap());
            // Count Incoming events until the parent closes our stdin.
            let mut incoming = 0;
            loop {
                raw.heartbeat();
                if readable(std::io::stdin().as_fd(), Duration::from_millis(0)) {
                    break;
                }
                if let Some(m) = raw.recv_timeout(Duration::from_millis(100)) {
                    if matches!(m.0, BrokerMsg::Event(Event::Incoming { .. })) {
                        incoming += 1;
                    }
                }
            }
            println!("@@ incoming={incoming}");
        }
        "client" => {
            let slot_a: u32 = std::env::var("FIDO_POLICY_SLOT").unwrap().parse().unwrap();
            join_as(&mut raw, "cli-b", None, ARENA_LEN).unwrap();
            let bells = [bell(), bell()];
            let before = fd_census();
            let id = raw.send_request(
                Request::Connect {
                    service: "svc-echo".into(),
                    block: BLOCK,
                },
                &[bells[0].as_fd(), bells[1].as_fd()],
            );
            let (r, fds) = raw.wait_reply(id);
            let m = expect_err(
                r,
                ErrorCode::Denied,
                "may not connect to service \"svc-echo\"",
            );
            assert!(m.contains("rule uid-b"), "{m}");
            assert!(fds.is_empty(), "a denied connect carries no descriptor");
            let (r, fds) = raw.request_fds(Request::GrantSlot { slot: slot_a }, &[]);
            expect_err(r, ErrorCode::Denied, "no connection path");
            assert!(fds.is_empty());
            expect_err(
                raw.request(Request::Offer {
                    service: "svc-b".into(),
                }),
                ErrorCode::Denied,
                "may not offer",
            );
            expect_err(
                raw.request(Request::Write {
                    path: "/app/b".into(),
                    value: vec![1],
                }),
                ErrorCode::Denied,
                "may not write",
            );
            let after = fd_census();
            assert_eq!(before, after, "no new memfd, doorbell, liveness or other socket");
            println!("@@ denied-ok {after:?}");
            // The census does see a real grant: the allowed connection brings 4.
            let id = raw.send_request(
                Request::Connect {
                    service: "other-ok".into(),
                    block: BLOCK,
                },
                &[bells[0].as_fd(), bells[1].as_fd()],
            );
            let (r, fds) = raw.wait_reply(id);
            assert!(matches!(r, Ok(Reply::Connected { .. })), "{r:?}");
            let got = fd_census();
            assert_eq!(
                got.get("memfd"),
                Some(&(before.get("memfd").unwrap_or(&0) + 1))
            );
            // Two doorbells and a liveness socket.
            assert_eq!(got.get("stream"), Some(&(before["stream"] + 3)));
            drop(fds);
            // Still no path to A (A is connected to nobody).
            expect_err(
                raw.request(Request::GrantSlot { slot: slot_a }),
                ErrorCode::Denied,
                "no connection path",
            );
            println!("@@ allowed-ok");
        }
        other => panic!("unknown role {other}"),
    }
    let _ = std::io::stdout().flush();
}

/// MMNet (fido-net) acceleration follows the policy: `[net] deny` (domain
/// names `net-<comm>`), `[net] accelerate = false` and a rule's `net = false`
/// make the broker refuse the handshake steps — offering a segment
/// (`NetOffer`), writing or claiming a legacy connection request — with
/// `Denied` and a message naming MMNet, while listeners (`NetListen`: keys
/// only the broker writes) and statistics are always published. A reload
/// applies to the next step at once.
#[test]
fn net_policy_refuses_the_mmnet_handshake_and_follows_reloads() {
    let text = |net: &str, rule_net: bool| {
        format!(
            "{net}\n[[rule]]\nname = \"all\"\nuids = [{}]\nregistry_write = [\"/**\"]\nnet = {rule_net}\n",
            me()
        )
    };
    let b = broker_with(Some(policy(&text("[net]\ndeny = [\"net-denied*\"]", true))));
    let mut denied = b.client();
    let mut other = b.client();
    join_as(&mut denied, "net-denied-app", None, ARENA_LEN).unwrap();
    join_as(&mut other, "net-echo", None, ARENA_LEN).unwrap();
    let put = |raw: &mut Raw, path: &str| {
        raw.request(Request::Write {
            path: path.into(),
            value: b"1".to_vec(),
        })
    };
    let del = |raw: &mut Raw, path: &str| raw.request(Request::Delete { path: path.into() });
    let listen = "/net/listen/80/1@0.0.0.0@1@0@1";
    let conn = "/net/conn/127.0.0.1/80/5000/1";
    let msg = expect_err(put(&mut denied, conn), ErrorCode::Denied, "MMNet");
    assert!(msg.contains("net-denied*"), "{msg}");
    // The allowed domain publishes; the denied one may not claim its request.
    assert!(matches!(put(&mut other, conn), Ok(Reply::Ok)));
    expect_err(del(&mut denied, conn), ErrorCode::Denied, "MMNet");
    // Offering a segment: refused to the denied domain, recorded for the other.
    let offer = |raw: &mut Raw| {
        let sock = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dst = sock.local_addr().unwrap();
        // Published (always allowed): the broker offers only to ports whose
        // every listener is published.
        assert!(matches!(
            raw.request_fds(Request::NetListen, &[sock.as_fd()]).0,
            Ok(Reply::NetListening { .. })
        ));
        let client = rustix::net::socket(
            rustix::net::AddressFamily::INET,
            rustix::net::SocketType::STREAM,
            None,
        )
        .unwrap();
        rustix::net::bind(&client, &"127.0.0.1:0".parse::<std::net::SocketAddr>().unwrap()).unwrap();
        let (seg, _) = arena_with(
            4096 + 2 * 65536,
            rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW,
            rustix::fs::OFlags::RDWR,
        );
        raw.request_fds(
            Request::NetOffer { remote: dst, ring_len: 65536, nonce: 1 },
            &[client.as_fd(), seg.as_fd()],
        )
        .0
    };
    let msg = expect_err(offer(&mut denied), ErrorCode::Denied, "MMNet");
    assert!(msg.contains("net-denied*"), "{msg}");
    assert!(matches!(offer(&mut other), Ok(Reply::NetOffered { .. })));
    // Listeners and statistics are never refused; listener keys are the
    // broker's, written from the listening socket, not by applications.
    expect_err(put(&mut other, listen), ErrorCode::Denied, "managed by the broker");
    let sock = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let key = match denied.request_fds(Request::NetListen, &[sock.as_fd()]).0 {
        Ok(Reply::NetListening { key }) => key,
        other => panic!("{other:?}"),
    };
    expect_err(del(&mut denied, &key), ErrorCode::Denied, "managed by the broker");
    assert!(matches!(
        denied.request(Request::NetUnlisten { key }),
        Ok(Reply::Ok)
    ));
    assert!(matches!(put(&mut denied, "/net/stats/7"), Ok(Reply::Ok)));

    // Reload: a rule's `net = false` now refuses everyone it admits.
    b.reload.reload(Policy::parse(&text("", false), "reloaded").unwrap());
    let deadline = Instant::now() + WAIT;
    loop {
        match put(&mut other, conn) {
            Err(e) if e.code == ErrorCode::Denied => {
                assert!(e.message.contains("rule all says net = false"), "{}", e.message);
                break;
            }
            Ok(_) => assert!(Instant::now() < deadline, "reload never applied"),
            Err(e) => panic!("{e:?}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Reload again: everything allowed, the denied domain may request now.
    b.reload.reload(Policy::parse(&text("", true), "reloaded-2").unwrap());
    let deadline = Instant::now() + WAIT;
    while put(&mut denied, conn).is_err() {
        assert!(Instant::now() < deadline, "second reload never applied");
        std::thread::sleep(Duration::from_millis(20));
    }
    // `[net] accelerate = false` refuses everyone.
    b.reload.reload(Policy::parse(&text("[net]\naccelerate = false", true), "off").unwrap());
    let deadline = Instant::now() + WAIT;
    loop {
        match del(&mut other, conn) {
            Err(e) => {
                assert!(e.message.contains("accelerate = false"), "{}", e.message);
                break;
            }
            Ok(_) => {
                assert!(Instant::now() < deadline, "third reload never applied");
                put(&mut other, conn).ok();
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
