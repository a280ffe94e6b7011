//! Behaviour of the registry as the broker sees it.

use fido_proto::{MAX_TXN_OPS, MAX_VALUE};
use fido_registry::{Registry, RegistryError, TxnOp, TxnOutcome, WatchEvent};

fn reg() -> Registry {
    Registry::in_memory().unwrap()
}

fn ev(owner: u64, token: u64, path: &str, value: Option<&[u8]>) -> WatchEvent {
    WatchEvent {
        owner,
        token,
        path: path.to_owned(),
        value: value.map(<[u8]>::to_vec),
    }
}

fn put(path: &str, value: &[u8]) -> TxnOp {
    TxnOp::Put {
        path: path.to_owned(),
        value: value.to_vec(),
    }
}

fn check(path: &str, expected: Option<&[u8]>) -> TxnOp {
    TxnOp::Check {
        path: path.to_owned(),
        expected: expected.map(<[u8]>::to_vec),
    }
}

fn read(path: &str) -> TxnOp {
    TxnOp::Read {
        path: path.to_owned(),
    }
}

fn del(path: &str) -> TxnOp {
    TxnOp::Delete {
        path: path.to_owned(),
    }
}

/// Every key with its value, for "nothing changed" assertions.
fn dump(r: &Registry) -> Vec<(String, Option<Vec<u8>>)> {
    fn walk(r: &Registry, path: &str, out: &mut Vec<(String, Option<Vec<u8>>)>) {
        out.push((path.to_owned(), r.read(path).unwrap()));
        for name in r.list(path).unwrap() {
            let child = if path == "/" {
                format!("/{name}")
            } else {
                format!("{path}/{name}")
            };
            walk(r, &child, out);
        }
    }
    let mut out = Vec::new();
    walk(r, "/", &mut out);
    out
}

#[test]
fn registry_is_send() {
    fn assert_send<T: Send>() {}
    assert_send::<Registry>();
}

#[test]
fn write_read_overwrite_and_empty_value() {
    let mut r = reg();
    assert_eq!(r.read("/a").unwrap(), None);
    r.write("/a", b"1").unwrap();
    assert_eq!(r.read("/a").unwrap().as_deref(), Some(&b"1"[..]));
    r.write("/a", b"22").unwrap();
    assert_eq!(r.read("/a").unwrap().as_deref(), Some(&b"22"[..]));
    // An empty value is a value, not absence.
    r.write("/e", b"").unwrap();
    assert_eq!(r.read("/e").unwrap(), Some(Vec::new()));
    // A value of exactly MAX_VALUE bytes is fine.
    r.write("/big", &vec![7u8; MAX_VALUE]).unwrap();
    assert_eq!(r.read("/big").unwrap().unwrap().len(), MAX_VALUE);
}

#[test]
fn key_can_have_value_and_children() {
    let mut r = reg();
    r.write("/a", b"v").unwrap();
    r.write("/a/b", b"w").unwrap();
    assert_eq!(r.read("/a").unwrap().as_deref(), Some(&b"v"[..]));
    assert_eq!(r.read("/a/b").unwrap().as_deref(), Some(&b"w"[..]));
    // Implicit directory: no value of its own.
    r.write("/x/y/z", b"1").unwrap();
    assert_eq!(r.read("/x").unwrap(), None);
    assert_eq!(r.read("/x/y").unwrap(), None);
}

#[test]
fn delete_removes_whole_subtree_but_not_siblings() {
    let mut r = reg();
    for k in [
        "/a", "/a/b", "/a/b/c", "/a/d", "/ab", "/a+x", "/a-y", "/a.z", "/a0", "/b",
    ] {
        r.write(k, k.as_bytes()).unwrap();
    }
    r.delete("/a").unwrap();
    for k in ["/a", "/a/b", "/a/b/c", "/a/d"] {
        assert_eq!(r.read(k).unwrap(), None, "{k} survived");
    }
    for k in ["/ab", "/a+x", "/a-y", "/a.z", "/a0", "/b"] {
        assert_eq!(
            r.read(k).unwrap().as_deref(),
            Some(k.as_bytes()),
            "{k} was deleted"
        );
    }
    // Deleting a missing key is fine and reports nothing.
    assert_eq!(r.delete("/nope").unwrap(), vec![]);
    assert_eq!(r.delete("/a").unwrap(), vec![]);
}

#[test]
fn delete_of_implicit_directory_removes_descendants() {
    let mut r = reg();
    r.write("/d/x/y", b"1").unwrap();
    r.write("/d/z", b"2").unwrap();
    r.watch(1, 1, "/d").unwrap();
    let events = r.delete("/d").unwrap();
    assert_eq!(
        events,
        vec![ev(1, 1, "/d/x/y", None), ev(1, 1, "/d/z", None)]
    );
    assert_eq!(r.list("/").unwrap(), Vec::<String>::new());
}

#[test]
fn delete_root_clears_everything() {
    let mut r = reg();
    r.write("/", b"root").unwrap();
    r.write("/a/b", b"1").unwrap();
    r.write("/c", b"2").unwrap();
    r.watch(9, 9, "/").unwrap();
    let events = r.delete("/").unwrap();
    assert_eq!(events.len(), 3);
    assert_eq!(r.usage("/").unwrap(), (0, 0));
}

#[test]
fn list_children_including_implicit_dirs() {
    let mut r = reg();
    r.write("/a/b/c", b"1").unwrap();
    assert_eq!(r.list("/a").unwrap(), ["b"]);
    assert_eq!(r.list("/a/b").unwrap(), ["c"]);
    assert_eq!(r.list("/a/b/c").unwrap(), Vec::<String>::new());
    assert_eq!(r.list("/").unwrap(), ["a"]);
    assert_eq!(r.list("/missing").unwrap(), Vec::<String>::new());

    // Children that are keys, directories or both, and names that sort
    // between "c" and "c/" ('+', '-', '.' are below '/').
    for k in [
        "/p/c",
        "/p/c/deep/er",
        "/p/c+x",
        "/p/c-y/z",
        "/p/c.z",
        "/p/c0",
        "/p/b/1",
        "/p/b/2",
        "/p/d",
    ] {
        r.write(k, b"").unwrap();
    }
    r.write("/pp/no", b"").unwrap();
    r.write("/p+/no", b"").unwrap();
    assert_eq!(
        r.list("/p").unwrap(),
        ["b", "c", "c+x", "c-y", "c.z", "c0", "d"]
    );
    assert_eq!(r.list("/").unwrap(), ["a", "p", "p+", "pp"]);

    // A key at the root is not its own child.
    r.write("/", b"root").unwrap();
    assert_eq!(r.list("/").unwrap(), ["a", "p", "p+", "pp"]);
}

#[test]
fn list_many_children() {
    let mut r = reg();
    let mut expected = Vec::new();
    for i in 0..200 {
        let name = format!("n{i:03}");
        r.write(&format!("/big/{name}/x/y"), b"").unwrap();
        r.write(&format!("/big/{name}/z"), b"").unwrap();
        expected.push(name);
    }
    assert_eq!(r.list("/big").unwrap(), expected);
}

/// Pages of a listing, however small, gather into exactly the listing
/// (children that are keys, directories or both, and the names sorting
/// between "c" and "c/"), each page bounded; a cursor from elsewhere is
/// refused.
#[test]
fn list_pages_gather_into_the_listing() {
    let mut r = reg();
    for k in [
        "/p/c", "/p/c/deep/er", "/p/c+x", "/p/c-y/z", "/p/c.z", "/p/c0", "/p/b/1", "/p/b/2", "/p/d",
    ] {
        r.write(k, b"").unwrap();
    }
    for i in 0..300 {
        r.write(&format!("/p/n{i:03}/x"), b"").unwrap();
    }
    let all = r.list("/p").unwrap();
    for max in [1, 2, 7, 100, 1 << 20] {
        let mut got = std::collections::BTreeSet::new();
        let mut cursor = None;
        let mut pages = 0;
        loop {
            let (names, next) = r.list_page("/p", cursor.as_ref(), max).unwrap();
            let bytes: usize = names.iter().map(|n| n.len() + 1).sum();
            assert!(bytes < max + 8, "page of {bytes} bytes over {max}");
            got.extend(names);
            pages += 1;
            match next {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        assert_eq!(got.into_iter().collect::<Vec<_>>(), all, "max {max}");
        assert!(max > 100 || pages > 10, "max {max}: {pages} pages");
    }
    let elsewhere = fido_registry::ListCursor { key: "/q/x".into(), inclusive: false };
    assert!(r.list_page("/p", Some(&elsewhere), 10).is_err());
}

#[test]
fn persistence_across_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("registry.db");
    {
        let mut r = Registry::open(&db).unwrap();
        r.write("/dom/1/name", b"alpha").unwrap();
        r.write("/dom/2/name", b"beta").unwrap();
        r.delete("/dom/2").unwrap();
        let out = r
            .transact(&[put("/svc/x", b"1"), put("/svc/y", b"2")])
            .unwrap();
        assert!(out.committed);
        r.watch(1, 1, "/").unwrap();
    }
    let mut r = Registry::open(&db).unwrap();
    assert_eq!(
        r.read("/dom/1/name").unwrap().as_deref(),
        Some(&b"alpha"[..])
    );
    assert_eq!(r.read("/dom/2/name").unwrap(), None);
    assert_eq!(r.list("/svc").unwrap(), ["x", "y"]);
    // Watches are in memory only: owners re-register after a restart.
    assert_eq!(r.watch_count(1), 0);
    assert_eq!(r.write("/dom/3", b"").unwrap(), vec![]);
}

#[test]
fn next_counter_is_monotonic_per_name_and_across_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("registry.db");
    {
        let mut r = Registry::open(&db).unwrap();
        assert_eq!(r.next_counter("domain").unwrap(), 1);
        assert_eq!(r.next_counter("domain").unwrap(), 2);
        assert_eq!(r.next_counter("conn").unwrap(), 1);
        assert_eq!(r.next_counter("domain").unwrap(), 3);
    }
    let mut r = Registry::open(&db).unwrap();
    assert_eq!(r.next_counter("domain").unwrap(), 4);
    assert_eq!(r.next_counter("conn").unwrap(), 2);
    // Counters are not registry keys.
    assert_eq!(r.usage("/").unwrap(), (0, 0));
}

#[test]
fn newer_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("registry.db");
    {
        let conn = rusqlite::Connection::open(&db).unwrap();
        conn.pragma_update(None, "user_version", 99).unwrap();
    }
    assert!(matches!(
        Registry::open(&db),
        Err(RegistryError::SchemaVersion { found: 99 })
    ));
}

#[test]
fn watch_is_component_wise_prefix() {
    let mut r = reg();
    r.watch(1, 10, "/a").unwrap();
    assert_eq!(
        r.write("/a", b"1").unwrap(),
        vec![ev(1, 10, "/a", Some(b"1"))]
    );
    assert_eq!(
        r.write("/a/b/c", b"2").unwrap(),
        vec![ev(1, 10, "/a/b/c", Some(b"2"))]
    );
    assert_eq!(r.write("/ab", b"3").unwrap(), vec![]);
    assert_eq!(r.write("/a+b", b"3").unwrap(), vec![]);
    assert_eq!(r.write("/b", b"4").unwrap(), vec![]);
    // A watch below the changed key does not fire.
    r.watch(1, 11, "/x/y").unwrap();
    assert_eq!(r.write("/x", b"5").unwrap(), vec![]);
    // The root watch sees everything.
    r.watch(2, 1, "/").unwrap();
    assert_eq!(
        r.write("/q", b"6").unwrap(),
        vec![ev(2, 1, "/q", Some(b"6"))]
    );
}

#[test]
fn delete_fires_once_per_deleted_key_per_watch() {
    let mut r = reg();
    r.write("/a", b"0").unwrap();
    r.write("/a/b", b"1").unwrap();
    r.write("/a/b/c", b"2").unwrap();
    r.write("/ab", b"3").unwrap();
    r.watch(1, 1, "/a").unwrap();
    r.watch(1, 2, "/a/b/c").unwrap();
    let mut events = r.delete("/a").unwrap();
    events.sort_by(|x, y| (&x.path, x.token).cmp(&(&y.path, y.token)));
    assert_eq!(
        events,
        vec![
            ev(1, 1, "/a", None),
            ev(1, 1, "/a/b", None),
            ev(1, 1, "/a/b/c", None),
            ev(1, 2, "/a/b/c", None),
        ]
    );
}

#[test]
fn unwatch_and_replace() {
    let mut r = reg();
    r.watch(1, 1, "/a").unwrap();
    assert_eq!(r.watch_count(1), 1);
    // Re-adding the same (owner, token) replaces the prefix.
    r.watch(1, 1, "/b").unwrap();
    assert_eq!(r.watch_count(1), 1);
    assert_eq!(r.write("/a", b"").unwrap(), vec![]);
    assert_eq!(r.write("/b", b"").unwrap(), vec![ev(1, 1, "/b", Some(b""))]);
    assert!(r.unwatch(1, 1));
    assert!(!r.unwatch(1, 1));
    assert_eq!(r.watch_count(1), 0);
    assert_eq!(r.write("/b", b"").unwrap(), vec![]);
}

#[test]
fn owners_are_isolated() {
    let mut r = reg();
    // Two owners, same prefix, same token number.
    r.watch(1, 7, "/shared").unwrap();
    r.watch(2, 7, "/shared").unwrap();
    let mut events = r.write("/shared/k", b"v").unwrap();
    events.sort_by_key(|e| e.owner);
    assert_eq!(
        events,
        vec![
            ev(1, 7, "/shared/k", Some(b"v")),
            ev(2, 7, "/shared/k", Some(b"v"))
        ]
    );

    // Owner 2 can neither remove nor replace owner 1's watch.
    assert!(r.unwatch(2, 7));
    assert!(!r.unwatch(2, 7));
    r.watch(2, 7, "/elsewhere").unwrap();
    assert_eq!(
        r.write("/shared/k", b"w").unwrap(),
        vec![ev(1, 7, "/shared/k", Some(b"w"))]
    );

    // drop_owner removes every watch of that owner only.
    r.watch(1, 8, "/").unwrap();
    assert_eq!(r.watch_count(1), 2);
    assert_eq!(r.watch_count(2), 1);
    r.drop_owner(1);
    assert_eq!(r.watch_count(1), 0);
    assert_eq!(r.watch_count(2), 1);
    assert_eq!(r.write("/shared/k", b"x").unwrap(), vec![]);
    assert_eq!(
        r.write("/elsewhere", b"x").unwrap(),
        vec![ev(2, 7, "/elsewhere", Some(b"x"))]
    );
    r.drop_owner(1); // idempotent
    r.drop_owner(42); // unknown owner
}

#[test]
fn one_owner_many_matching_watches() {
    let mut r = reg();
    r.watch(1, 1, "/").unwrap();
    r.watch(1, 2, "/a").unwrap();
    r.watch(1, 3, "/a/b").unwrap();
    let mut tokens: Vec<u64> = r
        .write("/a/b", b"")
        .unwrap()
        .iter()
        .map(|e| e.token)
        .collect();
    tokens.sort();
    assert_eq!(tokens, [1, 2, 3]);
}

#[test]
fn thousands_of_watches() {
    let mut r = reg();
    for owner in 0..50u64 {
        for token in 0..100u64 {
            r.watch(owner, token, &format!("/dom/{owner}/t{token}"))
                .unwrap();
        }
    }
    assert_eq!(r.watch_count(3), 100);
    assert_eq!(
        r.write("/dom/3/t42/x", b"v").unwrap(),
        vec![ev(3, 42, "/dom/3/t42/x", Some(b"v"))]
    );
    assert_eq!(
        r.write("/dom/3/t4", b"v").unwrap(),
        vec![ev(3, 4, "/dom/3/t4", Some(b"v"))]
    );
    for owner in 0..50u64 {
        r.drop_owner(owner);
    }
    assert_eq!(r.write("/dom/3/t42/x", b"v").unwrap(), vec![]);
}

#[test]
fn txn_cas_success() {
    let mut r = reg();
    r.write("/cfg/v", b"1").unwrap();
    r.watch(5, 1, "/cfg").unwrap();
    let out = r
        .transact(&[
            check("/cfg/v", Some(b"1")),
            put("/cfg/v", b"2"),
            put("/cfg/w", b"3"),
            read("/cfg/v"),
        ])
        .unwrap();
    assert_eq!(
        out,
        TxnOutcome {
            committed: true,
            reads: vec![Some(b"2".to_vec())],
            events: vec![
                ev(5, 1, "/cfg/v", Some(b"2")),
                ev(5, 1, "/cfg/w", Some(b"3"))
            ],
        }
    );
    assert_eq!(r.read("/cfg/v").unwrap().as_deref(), Some(&b"2"[..]));
    assert_eq!(r.read("/cfg/w").unwrap().as_deref(), Some(&b"3"[..]));
}

#[test]
fn txn_cas_failure_writes_nothing_and_fires_nothing() {
    let mut r = reg();
    r.write("/cfg/v", b"1").unwrap();
    r.write("/cfg/old", b"o").unwrap();
    r.watch(5, 1, "/").unwrap();
    let before = dump(&r);
    let out = r
        .transact(&[
            put("/cfg/v", b"2"),
            del("/cfg/old"),
            read("/cfg/v"),
            check("/cfg/v", Some(b"stale")),
            put("/cfg/new", b"n"),
        ])
        .unwrap();
    assert_eq!(
        out,
        TxnOutcome {
            committed: false,
            reads: vec![],
            events: vec![]
        }
    );
    assert_eq!(dump(&r), before);
}

#[test]
fn txn_checks_see_state_before_the_txn() {
    let mut r = reg();
    r.write("/k", b"old").unwrap();
    // The Put comes first, but the Check is evaluated against the pre-txn
    // state, so it passes...
    let out = r
        .transact(&[put("/k", b"new"), check("/k", Some(b"old"))])
        .unwrap();
    assert!(out.committed);
    assert_eq!(r.read("/k").unwrap().as_deref(), Some(&b"new"[..]));
    // ...and a Check on the value a preceding Put writes fails.
    let out = r
        .transact(&[put("/k", b"newer"), check("/k", Some(b"newer"))])
        .unwrap();
    assert!(!out.committed);
    assert_eq!(r.read("/k").unwrap().as_deref(), Some(&b"new"[..]));
}

#[test]
fn txn_read_your_writes_and_deletes() {
    let mut r = reg();
    r.write("/t/a", b"1").unwrap();
    r.write("/t/a/sub", b"2").unwrap();
    r.watch(1, 1, "/t").unwrap();
    let out = r
        .transact(&[
            read("/t/a"),
            put("/t/b", b"x"),
            read("/t/b"),
            del("/t/a"),
            read("/t/a"),
            read("/t/a/sub"),
            put("/t/b", b"y"),
            read("/t/b"),
        ])
        .unwrap();
    assert!(out.committed);
    assert_eq!(
        out.reads,
        vec![
            Some(b"1".to_vec()),
            Some(b"x".to_vec()),
            None,
            None,
            Some(b"y".to_vec())
        ]
    );
    assert_eq!(
        out.events,
        vec![
            ev(1, 1, "/t/b", Some(b"x")),
            ev(1, 1, "/t/a", None),
            ev(1, 1, "/t/a/sub", None),
            ev(1, 1, "/t/b", Some(b"y")),
        ]
    );
    assert_eq!(r.list("/t").unwrap(), ["b"]);
}

#[test]
fn txn_check_absent() {
    let mut r = reg();
    // Create-if-absent succeeds once...
    let create = [check("/lock", None), put("/lock", b"me")];
    assert!(r.transact(&create).unwrap().committed);
    // ...and fails the second time.
    let again = [check("/lock", None), put("/lock", b"you")];
    assert!(!r.transact(&again).unwrap().committed);
    assert_eq!(r.read("/lock").unwrap().as_deref(), Some(&b"me"[..]));
    // An implicit directory has no value, so it counts as absent.
    r.write("/dir/child", b"").unwrap();
    assert!(r.transact(&[check("/dir", None)]).unwrap().committed);
    // Expecting a value on a missing key fails.
    assert!(
        !r.transact(&[check("/missing", Some(b""))])
            .unwrap()
            .committed
    );
}

#[test]
fn txn_empty_commits() {
    let mut r = reg();
    assert_eq!(
        r.transact(&[]).unwrap(),
        TxnOutcome {
            committed: true,
            reads: vec![],
            events: vec![]
        }
    );
}

#[test]
fn txn_bad_input_is_refused_without_change() {
    let mut r = reg();
    r.write("/a", b"1").unwrap();
    r.watch(1, 1, "/").unwrap();
    let before = dump(&r);
    let bad: Vec<Vec<TxnOp>> = vec![
        vec![put("/a", b"2"), put("/bad//path", b"x")],
        vec![put("/a", b"2"), read("relative")],
        vec![put("/a", b"2"), del("/a/../b")],
        vec![put("/a", b"2"), check("/a/", None)],
        vec![put("/a", b"2"), put("/b", &vec![0; MAX_VALUE + 1])],
        vec![put("/a", b"2"), check("/b", Some(&vec![0; MAX_VALUE + 1]))],
        vec![put("/a", b"2"); MAX_TXN_OPS + 1],
    ];
    for ops in &bad {
        assert!(r.transact(ops).is_err());
        assert_eq!(dump(&r), before);
    }
    assert!(matches!(
        r.transact(&bad[0]),
        Err(RegistryError::BadPath(_))
    ));
    assert!(
        matches!(r.transact(&bad[4]), Err(RegistryError::ValueTooLarge(n)) if n == MAX_VALUE + 1)
    );
    assert!(
        matches!(r.transact(&bad[6]), Err(RegistryError::TooManyOps(n)) if n == MAX_TXN_OPS + 1)
    );
    // The maximum size is accepted.
    assert!(
        r.transact(&vec![put("/a", b"2"); MAX_TXN_OPS])
            .unwrap()
            .committed
    );
}

#[test]
fn bad_paths_and_oversize_values_are_rejected_without_change() {
    let mut r = reg();
    r.write("/ok", b"v").unwrap();
    r.watch(1, 1, "/").unwrap();
    let before = dump(&r);
    let long = format!("/{}", "x".repeat(fido_proto::MAX_PATH));
    let bad_paths = [
        "",
        "a",
        "a/b",
        "/a/",
        "//",
        "/a//b",
        "/./a",
        "/a/..",
        "/a b",
        "/a\0b",
        "/é",
        "/a*",
        "/a\n",
        long.as_str(),
    ];
    for p in bad_paths {
        assert!(
            matches!(r.read(p), Err(RegistryError::BadPath(_))),
            "read {p:?}"
        );
        assert!(
            matches!(r.write(p, b"v"), Err(RegistryError::BadPath(_))),
            "write {p:?}"
        );
        assert!(
            matches!(r.delete(p), Err(RegistryError::BadPath(_))),
            "delete {p:?}"
        );
        assert!(
            matches!(r.list(p), Err(RegistryError::BadPath(_))),
            "list {p:?}"
        );
        assert!(
            matches!(r.usage(p), Err(RegistryError::BadPath(_))),
            "usage {p:?}"
        );
        assert!(
            matches!(r.watch(2, 1, p), Err(RegistryError::BadPath(_))),
            "watch {p:?}"
        );
    }
    assert_eq!(r.watch_count(2), 0);
    let too_big = vec![0u8; MAX_VALUE + 1];
    assert!(
        matches!(r.write("/ok", &too_big), Err(RegistryError::ValueTooLarge(n)) if n == MAX_VALUE + 1)
    );
    assert!(matches!(
        r.write("/new", &too_big),
        Err(RegistryError::ValueTooLarge(_))
    ));
    assert_eq!(dump(&r), before);
    // The error for a huge path is bounded.
    let err = r.read(&"/".repeat(100_000)).unwrap_err();
    assert!(err.to_string().len() < 300, "{err}");
}

#[test]
fn usage_counts_keys_and_bytes() {
    let mut r = reg();
    assert_eq!(r.usage("/").unwrap(), (0, 0));
    r.write("/dom/1", b"abc").unwrap();
    r.write("/dom/1/a", b"12345").unwrap();
    r.write("/dom/1/a/b", b"").unwrap();
    r.write("/dom/10/x", b"zz").unwrap();
    r.write("/dom/1+", b"q").unwrap();
    assert_eq!(r.usage("/dom/1").unwrap(), (3, 8));
    assert_eq!(r.usage("/dom/1/a").unwrap(), (2, 5));
    assert_eq!(r.usage("/dom/10").unwrap(), (1, 2));
    assert_eq!(r.usage("/dom").unwrap(), (5, 11));
    assert_eq!(r.usage("/").unwrap(), (5, 11));
    assert_eq!(r.usage("/nothing").unwrap(), (0, 0));
    r.write("/dom/1/a", b"1").unwrap();
    assert_eq!(r.usage("/dom/1").unwrap(), (3, 4));
    r.delete("/dom/1/a").unwrap();
    assert_eq!(r.usage("/dom/1").unwrap(), (1, 3));
}

/// The broker's private records live apart from the key tree: no path
/// reaches them (read, list, watch, usage), they survive a reopen, and
/// prefix deletes stop at the prefix.
#[test]
fn private_records_are_out_of_every_paths_reach() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("r.sqlite");
    {
        let mut r = Registry::open(&db).unwrap();
        r.watch(1, 1, "/").unwrap();
        r.private_put("resume/domain/1", b"secret-hash").unwrap();
        r.private_put("resume/domain/12", b"other").unwrap();
        r.private_put("resume/map/1/3", b"2").unwrap();
        r.private_put("resume/map/12/3", b"2").unwrap();
        assert!(r.list("/").unwrap().is_empty());
        assert_eq!(r.usage("/").unwrap(), (0, 0));
        assert_eq!(r.read("/resume/domain/1").unwrap(), None);
        let events = r.write("/app/x", b"v").unwrap();
        assert_eq!(events.len(), 1, "only the key write is watched");
    }
    let mut r = Registry::open(&db).unwrap();
    r.private_delete("resume/domain/1").unwrap();
    r.private_delete_prefix("resume/map/1/").unwrap();
    let left: Vec<String> = r.private_list("resume/").unwrap().into_iter().map(|(k, _)| k).collect();
    assert_eq!(left, ["resume/domain/12", "resume/map/12/3"]);
    assert_eq!(r.private_list("resume/domain/").unwrap(), [("resume/domain/12".to_string(), b"other".to_vec())]);
}

// ----- the database's files, damage, locks and a full disk (issue #16) -----

fn file_mode(path: &std::path::Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

#[test]
fn the_files_are_private_even_if_they_were_not() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("registry.sqlite");
    {
        let mut r = Registry::open(&db).unwrap();
        r.write("/a", b"secret").unwrap();
        r.next_counter("domain").unwrap();
        for f in [
            "registry.sqlite",
            "registry.sqlite-wal",
            "registry.sqlite-shm",
            "registry.ids",
            "registry.reserve",
        ] {
            assert_eq!(file_mode(&dir.path().join(f)), 0o600, "{f}");
        }
    }
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o644)).unwrap();
    let _r = Registry::open(&db).unwrap();
    assert_eq!(file_mode(&db), 0o600);
}

#[test]
fn a_lock_held_by_another_connection_is_an_error_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("registry.sqlite");
    let mut r = Registry::open(&db).unwrap();
    r.write("/a", b"1").unwrap();
    let other = rusqlite::Connection::open(&db).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let t = std::time::Instant::now();
    let e = r.write("/a", b"2").expect_err("wrote through another's write lock");
    assert!(e.to_string().contains("locked"), "{e}");
    assert!(t.elapsed() < std::time::Duration::from_secs(1), "waited {:?}", t.elapsed());
    other.execute_batch("ROLLBACK").unwrap();
    r.write("/a", b"3").unwrap();
}

#[test]
fn a_truncated_database_is_refused_and_one_moved_aside_restarts_past_its_ids() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("registry.sqlite");
    {
        let mut r = Registry::open(&db).unwrap();
        for _ in 0..5 {
            r.next_counter("domain").unwrap();
        }
        r.write("/k", b"v").unwrap();
    }
    std::fs::OpenOptions::new().write(true).open(&db).unwrap().set_len(0).unwrap();
    let e = Registry::open(&db).expect_err("a truncated database was opened");
    assert!(matches!(e, RegistryError::Damaged(_)) && e.to_string().contains("truncated"), "{e}");
    std::fs::rename(&db, dir.path().join("registry.sqlite.old")).unwrap();
    let mut r = Registry::open(&db).unwrap();
    assert_eq!(r.read("/k").unwrap(), None);
    assert!(r.next_counter("domain").unwrap() > 5);
    assert_eq!(r.next_counter("conn").unwrap(), 1);
}

#[test]
fn a_corrupt_database_or_id_file_is_refused() {
    use std::io::{Seek, Write};
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("registry.sqlite");
    {
        let mut r = Registry::open(&db).unwrap();
        for i in 0..100 {
            r.write(&format!("/k{i}"), &[b'x'; 1000]).unwrap();
        }
    }
    let mut f = std::fs::OpenOptions::new().write(true).open(&db).unwrap();
    f.seek(std::io::SeekFrom::Start(5 * 4096)).unwrap();
    f.write_all(&[0x5a; 4096]).unwrap();
    drop(f);
    let e = Registry::open(&db).expect_err("a corrupt database was opened");
    assert!(matches!(e, RegistryError::Damaged(_)), "{e}");

    std::fs::write(dir.path().join("registry.sqlite"), b"not a database at all, not at all, no").unwrap();
    let e = Registry::open(&db).expect_err("garbage was opened");
    assert!(matches!(e, RegistryError::Damaged(_)), "{e}");

    std::fs::remove_file(&db).unwrap();
    std::fs::write(dir.path().join("registry.ids"), b"domain twelve\n").unwrap();
    let e = Registry::open(&db).expect_err("a garbled id file was accepted");
    assert!(matches!(e, RegistryError::Damaged(_)), "{e}");
}
