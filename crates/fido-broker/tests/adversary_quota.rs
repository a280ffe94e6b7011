//! Issue #16, findings 8, 9 and 14: what one local user can do to the others
//! through the broker's shared resources and what it can see of them.
//!
//! A root broker with the issue's policy: two real, unprivileged users
//! (`fido-qa-alice`, `fido-qa-bob`), each allowed to offer and connect only
//! to its own services and to write `/app/<user>/**` and `/net/**` (what
//! `fido run` needs); root is the administrator. Clients of the two users
//! are raw protocol clients whose sockets were connected from a thread
//! running under that user's uid and gid, so the broker's `SO_PEERCRED` sees
//! the real uid. Without root the tests print why and pass vacuously.

use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use fido_broker::Policy;
use fido_proto::{
    ErrorCode, Event, PgvasGeometry, RemoteError, Reply, Request, Status, StatusCursor, TxnOp,
};
use fido_test_support::raw::*;
use fido_test_support::users::{test_user, User};
use fido_test_support::Defaults;
use rustix::process::{Gid, Uid};

type TestBroker = fido_test_support::TestBroker<Defaults>;

const ALICE: &str = "fido-qa-alice";
const BOB: &str = "fido-qa-bob";

/// The issue's policy, with `extra` appended to both users' rules.
fn issue_policy(extra: &str) -> String {
    let rule = |user: &str, svc: &str| {
        format!(
            "[[rule]]\nname = \"{user}\"\nusers = [\"{user}\"]\noffer = [\"{svc}-*\"]\n\
             connect = [\"{svc}-*\"]\nregistry_write = [\"/app/{user}/**\", \"/net/**\"]\n{extra}\n"
        )
    };
    format!(
        "{}{}[[rule]]\nname = \"admin\"\nuids = [0]\noffer = [\"*\"]\nconnect = [\"*\"]\n\
         registry_write = [\"/**\"]\n",
        rule(ALICE, "alice"),
        rule(BOB, "bob")
    )
}

fn broker(policy_text: &str, slots: u32) -> TestBroker {
    let p = Arc::new(Policy::parse(policy_text, "issue-16-policy").unwrap());
    TestBroker::start_with(|c| {
        c.policy = p;
        c.geometry = PgvasGeometry {
            slots,
            ..PgvasGeometry::DEFAULT
        };
        // Raw clients do not beat: a slow heartbeat keeps them alive.
        c.heartbeat = Duration::from_millis(1000);
        c.heartbeat_misses = 60;
        let top = c.socket.parent().unwrap().parent().unwrap();
        std::fs::set_permissions(top, std::fs::Permissions::from_mode(0o755)).unwrap();
    })
}

/// The two users, or `None` (and the test passes vacuously) without root.
fn users() -> Option<(User, User)> {
    Some((test_user(ALICE)?, test_user(BOB)?))
}

/// A raw client whose socket `user` connected: a thread takes the user's
/// gid and uid (thread credentials only, as the raw syscalls set them) for
/// the `connect`, which is when the kernel records the peer credentials.
fn client_as(socket: &Path, user: User) -> Raw {
    let socket = socket.to_path_buf();
    std::thread::spawn(move || {
        rustix::thread::set_thread_groups(&[]).unwrap();
        let gid = Gid::from_raw(user.gid);
        rustix::thread::set_thread_res_gid(gid, gid, gid).unwrap();
        let uid = Uid::from_raw(user.uid);
        rustix::thread::set_thread_res_uid(uid, uid, uid).unwrap();
        Raw::connect(&socket)
    })
    .join()
    .unwrap()
}

fn join(raw: &mut Raw, name: &str) -> Result<Reply, RemoteError> {
    raw.join_labelled(name, None, ARENA_LEN)
}

fn joined_as(socket: &Path, user: User, name: &str) -> Raw {
    let mut raw = client_as(socket, user);
    let r = join(&mut raw, name);
    assert!(matches!(r, Ok(Reply::Joined { .. })), "{name}: {r:?}");
    raw
}

fn root_joined(b: &TestBroker, name: &str) -> Raw {
    let mut raw = b.client();
    let r = join(&mut raw, name);
    assert!(matches!(r, Ok(Reply::Joined { .. })), "{name}: {r:?}");
    raw
}

fn expect_err(r: Result<Reply, RemoteError>, code: ErrorCode, needle: &str) {
    match r {
        Err(e) if e.code == code && e.message.contains(needle) => {}
        other => panic!("expected {code:?} with {needle:?}, got {other:?}"),
    }
}

/// Every page of the status, asked on `raw` (joined or not).
fn status(raw: &mut Raw) -> Result<Status, RemoteError> {
    Status::collect(|req| match raw.request(req)? {
        Reply::Status(s) => Ok(s),
        other => panic!("status answered {other:?}"),
    })
}

fn keys(raw: &mut Raw, path: &str) -> Vec<String> {
    match raw.request(Request::List { path: path.into() }) {
        Ok(Reply::Keys(k)) => k,
        other => panic!("list {path}: {other:?}"),
    }
}

/// Finding 8: alice joins as fast as she can. On d54ab9b every join up to
/// the 1024th succeeded and then everyone, root's `fido status` included,
/// got `Quota: all 1024 PGVAS slots are in use`. Now her uid stops at the
/// per-uid default (64 domains), bob still joins, and root looks without
/// joining and joins too.
#[test]
fn one_uid_cannot_take_every_slot() {
    let Some((alice, bob)) = users() else { return };
    let b = broker(&issue_policy(""), 1024);
    let mut held = Vec::new();
    let refused = loop {
        let mut raw = client_as(&b.socket, alice);
        match join(&mut raw, "flood") {
            Ok(Reply::Joined { .. }) => held.push(raw),
            Ok(other) => panic!("join answered {other:?}"),
            Err(e) => break e,
        }
        assert!(
            held.len() <= 64,
            "alice holds {} domains: no per-uid limit",
            held.len()
        );
    };
    assert_eq!(held.len(), 64, "the per-uid default: {refused:?}");
    assert_eq!(refused.code, ErrorCode::Quota, "{refused:?}");
    assert!(
        refused.message.contains("too many domains for uid")
            && refused.message.contains("limit 64 per uid"),
        "{refused:?}"
    );
    let _bob = joined_as(&b.socket, bob, "bob-app");

    // Root looks without joining (no slot), and sees alice's flood.
    let mut look = b.client();
    let st = status(&mut look).expect("status without joining");
    assert_eq!(st.domains.iter().filter(|d| d.uid == alice.uid).count(), 64);
    assert_eq!(st.domains.iter().filter(|d| d.uid == bob.uid).count(), 1);
    let _root = root_joined(&b, "admin");
}

/// The last slots are the administrator's: two uids with a per-uid limit
/// above the window fill it up to the reserve and no further; root still
/// joins.
#[test]
fn the_last_slots_are_kept_for_the_administrator() {
    let Some((alice, bob)) = users() else { return };
    let b = broker(&issue_policy("per_uid_domains = 1000"), 32);
    let mut held = Vec::new();
    for (user, n) in [(alice, 20), (bob, 8)] {
        for _ in 0..n {
            held.push(joined_as(&b.socket, user, "fill"));
        }
    }
    // 28 of 32 taken; the last 4 (32 / 8) are root's.
    let mut raw = client_as(&b.socket, bob);
    expect_err(
        join(&mut raw, "one-more"),
        ErrorCode::Quota,
        "kept for the administrator",
    );
    let mut raw = client_as(&b.socket, alice);
    expect_err(
        join(&mut raw, "one-more"),
        ErrorCode::Quota,
        "kept for the administrator",
    );
    let _root: Vec<Raw> = (0..4).map(|_| root_joined(&b, "admin")).collect();
    let mut raw = b.client();
    expect_err(
        join(&mut raw, "admin"),
        ErrorCode::Quota,
        "all 32 PGVAS slots are in use",
    );
}

/// The per-uid limits hold summed over all of a uid's domains: services,
/// watches, registry keys and bytes, connections (pending ones too). On
/// d54ab9b only per-domain quotas existed: a second domain started afresh.
/// The per-domain quotas still hold, and root is not limited per uid.
#[test]
fn per_uid_limits_sum_over_all_domains_of_a_uid() {
    let Some((alice, bob)) = users() else { return };
    let b = broker(
        &issue_policy(
            "per_uid_services = 3\nper_uid_watches = 3\nper_uid_registry_keys = 3\n\
             per_uid_registry_bytes = 100\nper_uid_connections = 1\nwatches = 2\n",
        ),
        64,
    );
    let mut a1 = joined_as(&b.socket, alice, "a1");
    let mut a2 = joined_as(&b.socket, alice, "a2");
    let mut bb = joined_as(&b.socket, bob, "b1");

    // Services: 2 + 1, then no more from either domain.
    a1.ok(Request::Offer {
        service: "alice-1".into(),
    });
    a1.ok(Request::Offer {
        service: "alice-2".into(),
    });
    a2.ok(Request::Offer {
        service: "alice-3".into(),
    });
    let r = a2.request(Request::Offer {
        service: "alice-4".into(),
    });
    expect_err(r, ErrorCode::Quota, "too many services offered for uid");
    bb.ok(Request::Offer {
        service: "bob-1".into(),
    });

    // Watches: the per-domain quota (2) still holds; the uid's (3) too.
    a1.ok(Request::Watch {
        token: 1,
        prefix: "/app/fido-qa-alice".into(),
    });
    a1.ok(Request::Watch {
        token: 2,
        prefix: "/app/fido-qa-alice".into(),
    });
    let r = a1.request(Request::Watch {
        token: 3,
        prefix: "/app/fido-qa-alice".into(),
    });
    expect_err(r, ErrorCode::Quota, "this domain holds 2 (limit 2)");
    a2.ok(Request::Watch {
        token: 1,
        prefix: "/app/fido-qa-alice".into(),
    });
    let r = a2.request(Request::Watch {
        token: 2,
        prefix: "/app/fido-qa-alice".into(),
    });
    expect_err(r, ErrorCode::Quota, "too many registry watches for uid");
    // Re-using a token replaces a watch: no new one.
    a2.ok(Request::Watch {
        token: 1,
        prefix: "/app/fido-qa-alice/x".into(),
    });

    // Registry keys and bytes.
    let put = |raw: &mut Raw, k: &str, n: usize| {
        raw.request(Request::Write {
            path: format!("/app/fido-qa-alice/{k}"),
            value: vec![7; n],
        })
    };
    assert_eq!(put(&mut a1, "k1", 10), Ok(Reply::Ok));
    assert_eq!(put(&mut a2, "k2", 10), Ok(Reply::Ok));
    assert_eq!(put(&mut a2, "k3", 10), Ok(Reply::Ok));
    expect_err(
        put(&mut a1, "k4", 1),
        ErrorCode::Quota,
        "too many registry keys for uid",
    );
    // Overwriting its own key grows bytes, not keys.
    expect_err(
        put(&mut a1, "k1", 90),
        ErrorCode::Quota,
        "too many registry bytes for uid",
    );
    assert_eq!(put(&mut a1, "k1", 70), Ok(Reply::Ok));
    // Taking over a key of the uid's other domain moves the charge: fine.
    assert_eq!(put(&mut a1, "k2", 10), Ok(Reply::Ok));

    // Connections: a pending one counts; then the uid is at its limit.
    let bells = [bell(), bell()];
    let pending = a2.send_request(
        Request::Connect {
            service: "alice-1".into(),
            block: BLOCK,
        },
        &[bells[0].as_fd(), bells[1].as_fd()],
    );
    let (ev, _) = a1.event_where(|e| matches!(e, Event::Incoming { .. }));
    let Event::Incoming { conn, .. } = ev else {
        unreachable!()
    };
    let bells2 = [bell(), bell()];
    let (r, _) = a2.request_fds(
        Request::Connect {
            service: "alice-3".into(),
            block: BLOCK,
        },
        &[bells2[0].as_fd(), bells2[1].as_fd()],
    );
    expect_err(r, ErrorCode::Quota, "too many connections for uid");
    a1.ok(Request::Refuse {
        conn,
        reason: "no".into(),
    });
    let (r, _) = a2.wait_reply(pending);
    expect_err(r, ErrorCode::Refused, "no");

    // Root: per-domain quotas only.
    let mut root = root_joined(&b, "admin");
    for i in 0..10 {
        root.ok(Request::Offer {
            service: format!("root-{i}"),
        });
    }
}

/// Finding 9: 2000 services with long names. On d54ab9b every caller's
/// `Status` failed with `Internal: reply too large: 260115 bytes`; now the
/// status comes in pages that all fit, and the walk over them finds every
/// service, for a joined root domain and for an observer that never joined.
#[test]
fn many_services_never_break_status() {
    let Some((alice, _bob)) = users() else { return };
    let b = broker(&issue_policy("per_uid_services = 4000"), 64);
    let mut a = joined_as(&b.socket, alice, "many");
    let name = |i: usize| format!("alice-{}-{i:05}", "x".repeat(110));
    for i in 0..2000 {
        a.ok(Request::Offer { service: name(i) });
    }
    let mut root = root_joined(&b, "admin");
    match root.request(Request::Status) {
        Ok(Reply::Status(first)) => assert!(first.next.is_some(), "one page cannot hold 2000"),
        other => panic!("first page: {other:?}"),
    }
    for raw in [&mut root, &mut b.client(), &mut a] {
        let st = status(raw).expect("status in pages");
        assert_eq!(st.services.len(), 2000);
        assert!(st
            .services
            .iter()
            .enumerate()
            .all(|(i, (s, _))| *s == name(i)));
        assert!(st.domains.iter().any(|d| d.name == "many"));
    }
    // A cursor naming an entry that went away still moves on.
    let r = root.request(Request::StatusPage {
        cursor: StatusCursor::Services {
            after: Some("alice-gone".into()),
        },
    });
    assert!(matches!(r, Ok(Reply::Status(_))), "{r:?}");
}

/// Finding 14 (c): what a non-owner may see. On d54ab9b bob's `Status`
/// listed alice's domains, pids, uids and services, and bob read her
/// `/net/stats/<domain>` (pids, peer addresses) and her keys. Now bob sees
/// his own uid's domains, the services his rule names, the connections of
/// his domains, and in the registry what `registry_read` allows, with the
/// managed subtrees and MMNet's per-process keys filtered by owner. Root
/// sees everything.
#[test]
fn non_owners_see_only_what_is_theirs() {
    let Some((alice, bob)) = users() else { return };
    let b = broker(&issue_policy(""), 64);
    let mut a = joined_as(&b.socket, alice, "alice-app");
    let aid = a.domain.unwrap();
    a.ok(Request::Offer {
        service: "alice-db".into(),
    });
    a.ok(Request::Write {
        path: "/app/fido-qa-alice/db-password".into(),
        value: b"hunter2".to_vec(),
    });
    a.ok(Request::Write {
        path: format!("/net/stats/{aid}"),
        value: b"{\"pid\":1}".to_vec(),
    });
    a.ok(Request::Write {
        path: "/net/conn/127.0.0.1/80/5000/1".into(),
        value: b"1 2 3 4".to_vec(),
    });
    a.ok(Request::Write {
        path: "/net/pub/80/1@127.0.0.1@9@9@9".into(),
        value: b"9".to_vec(),
    });

    let mut bw = joined_as(&b.socket, bob, "bob-app");
    let bid = bw.domain.unwrap();
    bw.ok(Request::Offer {
        service: "bob-web".into(),
    });
    bw.ok(Request::Watch {
        token: 7,
        prefix: "/net".into(),
    });

    for (what, raw) in [
        ("joined", &mut bw),
        ("observer", &mut client_as(&b.socket, bob)),
    ] {
        let st = status(raw).unwrap();
        let doms: Vec<_> = st.domains.iter().map(|d| d.domain).collect();
        assert_eq!(doms, vec![bid], "{what}: only bob's own domains: {st:?}");
        let svcs: Vec<_> = st.services.iter().map(|(s, _)| s.as_str()).collect();
        assert_eq!(svcs, vec!["bob-web"], "{what}");
        for path in [
            "/app/fido-qa-alice/db-password".to_string(),
            format!("/net/stats/{aid}"),
            "/net/conn/127.0.0.1/80/5000/1".to_string(),
            format!("/domain/{aid}/pid"),
            "/service/alice-db/domain".to_string(),
        ] {
            expect_err(
                raw.request(Request::Read { path: path.clone() }),
                ErrorCode::Denied,
                "may not read",
            );
        }
        assert_eq!(keys(raw, "/domain"), vec![bid.to_string()], "{what}");
        assert_eq!(keys(raw, "/service"), vec!["bob-web".to_string()], "{what}");
        assert!(keys(raw, "/net/stats").is_empty(), "{what}");
        assert!(keys(raw, "/net/conn").is_empty(), "{what}");
        assert_eq!(
            keys(raw, "/net/pub/80"),
            vec!["1@127.0.0.1@9@9@9".to_string()]
        );
        assert!(
            keys(raw, "/app").is_empty(),
            "{what}: alice's /app/... is hidden"
        );
        assert!(matches!(
            raw.request(Request::Read {
                path: format!("/domain/{bid}/name")
            }),
            Ok(Reply::Value(Some(_)))
        ));
    }
    // A check compares a value: it reads, so it is refused too.
    let r = bw.request(Request::Transaction {
        ops: vec![TxnOp::Check {
            path: "/app/fido-qa-alice/db-password".into(),
            expected: Some(b"hunter2".to_vec()),
        }],
    });
    expect_err(r, ErrorCode::Denied, "may not read");
    expect_err(
        bw.request(Request::Watch {
            token: 8,
            prefix: "/app/fido-qa-alice".into(),
        }),
        ErrorCode::Denied,
        "may not read",
    );
    // Bob's watch on /net sees keys he may read (under /net/**, which the
    // policy lets every user write and so read), not alice's stats.
    a.ok(Request::Write {
        path: format!("/net/stats/{aid}"),
        value: b"{\"pid\":2}".to_vec(),
    });
    a.ok(Request::Write {
        path: "/net/pub/81/1@127.0.0.1@9@9@9".into(),
        value: b"9".to_vec(),
    });
    let (ev, _) = bw.event_where(|e| matches!(e, Event::Watch { .. }));
    assert!(
        matches!(&ev, Event::Watch { path, .. } if path == "/net/pub/81/1@127.0.0.1@9@9@9"),
        "the stats write was not shown to bob: {ev:?}"
    );

    // Alice reads her own; root reads everything and sees both users.
    assert!(matches!(
        a.request(Request::Read {
            path: format!("/net/stats/{aid}")
        }),
        Ok(Reply::Value(Some(_)))
    ));
    let mut root = b.client();
    let st = status(&mut root).unwrap();
    assert!(
        st.domains.iter().any(|d| d.domain == aid) && st.domains.iter().any(|d| d.domain == bid)
    );
    assert_eq!(st.services.len(), 2);
    assert!(matches!(
        root.request(Request::Read { path: "/app/fido-qa-alice/db-password".into() }),
        Ok(Reply::Value(Some(v))) if v == b"hunter2"
    ));
}

/// A uid no rule admits may not look either (finding 7's refused user):
/// its observer requests are denied, with the reason.
#[test]
fn a_refused_uid_sees_nothing() {
    let Some(_) = users() else { return };
    let Some(stranger) = test_user("fido-qa-stranger") else {
        return;
    };
    let b = broker(&issue_policy(""), 64);
    let mut raw = client_as(&b.socket, stranger);
    expect_err(
        raw.request(Request::Status),
        ErrorCode::Denied,
        "no rule matches",
    );
    // A uid no rule admits is answered once and closed (adversary_state.rs):
    // it asks again on a new connection.
    let mut raw = client_as(&b.socket, stranger);
    expect_err(
        raw.request(Request::List { path: "/".into() }),
        ErrorCode::Denied,
        "may not join",
    );
}

/// Finding 9's sibling in the registry: a listing grows with what others
/// create. Alice fills a directory bob may read (`/net/pub/80`: under
/// `/net/**`, which the issue's policy lets every user write) with 3000 long
/// names. (`/net/listen`, which every `fido run` client lists, is written by
/// the broker alone now, one key per listening socket a domain holds.) On d54ab9b bob's `List` failed with
/// `Internal: reply too large` — MMNet lookups for that port failed for
/// everyone. `ListPage` answers in bounded pages that gather into the whole
/// listing; a bad cursor is a clear error.
#[test]
fn a_listing_others_filled_still_lists() {
    let Some((alice, bob)) = users() else { return };
    let b = broker(&issue_policy(""), 64);
    let mut a = joined_as(&b.socket, alice, "filler");
    let name = |i: usize| format!("{i:05}@{}", "x".repeat(120));
    for i in 0..3000 {
        a.ok(Request::Write {
            path: format!("/net/pub/80/{}", name(i)),
            value: b"1".to_vec(),
        });
    }
    let mut bw = joined_as(&b.socket, bob, "lister");
    let mut pages = 0;
    let all = fido_proto::ListCursor::walk("/net/pub/80", |req| {
        pages += 1;
        match bw.request(req) {
            Ok(Reply::KeysPage { keys, next }) => Ok((keys, next)),
            other => Err(format!("{other:?}")),
        }
    })
    .expect("every page");
    assert_eq!(all.len(), 3000);
    assert!(all.iter().enumerate().all(|(i, n)| *n == name(i)));
    assert!(pages > 1, "{pages} pages");
    let r = bw.request(Request::ListPage {
        path: "/net/pub/80".into(),
        cursor: Some(fido_proto::ListCursor {
            key: "/app/elsewhere".into(),
            inclusive: false,
        }),
    });
    expect_err(r, ErrorCode::BadRequest, "outside");
    // The broker serves everyone as before.
    assert!(status(&mut bw).is_ok());
}
