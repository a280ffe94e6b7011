//! The registry through the library: read/write/list/delete, transactions with
//! compare-and-set, prefix watches, and the broker-managed paths.

use fido_test_support::domains::HangDetection;
use fido::TxnOp;
use std::time::Duration;

type TestBroker = fido_test_support::TestBroker<HangDetection>;

#[test]
fn registry_round_trip_watch_and_transactions() {
    let b = TestBroker::start();
    let d = b.join("app");
    let w = d.watch("/app/cfg").unwrap();
    d.write("/app/cfg/a", b"1").unwrap();
    d.write("/app/cfgx", b"not watched").unwrap();
    let ev = w.recv_timeout(Duration::from_secs(5)).expect("watch fired");
    assert_eq!((ev.path.as_str(), ev.value.as_deref()), ("/app/cfg/a", Some(&b"1"[..])));
    assert_eq!(d.read("/app/cfg/a").unwrap().as_deref(), Some(&b"1"[..]));
    assert_eq!(d.list("/app").unwrap(), vec!["cfg".to_string(), "cfgx".to_string()]);
    // Compare-and-set: succeeds once, then fails without writing.
    let cas = |expected: &[u8], new: &[u8]| {
        d.transact(vec![
            TxnOp::Check { path: "/app/cfg/a".into(), expected: Some(expected.to_vec()) },
            TxnOp::Put { path: "/app/cfg/a".into(), value: new.to_vec() },
            TxnOp::Put { path: "/app/cfg/b".into(), value: new.to_vec() },
        ])
        .unwrap()
        .0
    };
    assert!(cas(b"1", b"2"));
    assert!(!cas(b"1", b"3"));
    assert_eq!(d.read("/app/cfg/b").unwrap().as_deref(), Some(&b"2"[..]));
    d.delete("/app/cfg").unwrap();
    assert_eq!(d.read("/app/cfg/a").unwrap(), None);
    let mut deleted = 0;
    while let Some(ev) = w.recv_timeout(Duration::from_millis(500)) {
        if ev.value.is_none() {
            deleted += 1;
        }
    }
    assert_eq!(deleted, 2, "one delete event per key");
    // The broker's own view: this domain and its service are visible.
    let _l = d.offer("visible-svc").unwrap();
    assert_eq!(d.read(&format!("/domain/{}/name", d.id())).unwrap().as_deref(), Some(&b"app"[..]));
    assert!(d.read("/service/visible-svc/domain").unwrap().is_some());
    // ... and not writable by applications.
    assert!(d.write(&format!("/domain/{}/name", d.id()), b"forged").is_err());
    // Bad paths are refused locally or by the broker, never crash anything.
    assert!(d.write("relative/path", b"x").is_err());
    assert!(d.write("/a/../b", b"x").is_err());
}

#[test]
fn watch_fires_when_a_domain_dies() {
    let b = TestBroker::start();
    let d = b.join("observer");
    let other = b.join("victim");
    let w = d.watch(&format!("/domain/{}", other.id())).unwrap();
    other.leave().unwrap();
    let ev = w.recv_timeout(Duration::from_secs(5)).expect("watch fired on leave");
    assert!(ev.value.is_none());
}
