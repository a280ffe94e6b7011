//! Adversarial peers (issue #3 item 4): a domain that lies in its indices,
//! floods doorbells, never releases, or joins and leaves in a loop. Honest
//! domains and the broker stay correct and responsive.

use fido_test_support::domains::HangDetection;
use fido::{Error, JoinOptions, Message, ProtocolError, WaitStrategy};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

type TestBroker = fido_test_support::TestBroker<HangDetection>;

fn honest_pair(b: &TestBroker, svc: &str) -> (fido::Domain, fido::Channel, fido::Channel) {
    let a = b.join("honest-a");
    let l = a.offer(svc).unwrap();
    let other = b.join_with(JoinOptions::new("honest-b").arena_len(32 << 20).swizzle(true));
    let c = other.connect(svc).unwrap();
    let s = l.accept_timeout(Duration::from_secs(5)).unwrap();
    std::mem::forget(l);
    (other, c, s)
}

fn round_trip(d: &fido::Domain, c: &fido::Channel, s: &fido::Channel) {
    c.send(d.alloc_copy(b"ping").unwrap()).unwrap();
    assert_eq!(s.recv_timeout(Duration::from_secs(5)).unwrap().as_slice().unwrap(), b"ping");
}

#[test]
fn lying_indices_fail_only_the_liars_connection() {
    let b = TestBroker::start();
    let victim = b.join("victim");
    let l = victim.offer("liar-svc").unwrap();
    let (hd, hc, hs) = honest_pair(&b, "honest-svc");
    // Every lie here is an index no honest peer can publish.
    for (what, data, rel) in [
        ("publish index jumps ahead", Some(1_000_000), None),
        ("publish index runs backwards", Some(u64::MAX), None),
        ("releases of messages never sent", None, Some(5)),
    ] {
        let evil = b.join_with(JoinOptions::new("liar").arena_len(16 << 20).swizzle(true));
        let c = evil.connect("liar-svc").unwrap();
        let s = l.accept_timeout(Duration::from_secs(5)).unwrap();
        if rel.is_some() {
            // The victim must have a message out for a release to matter.
            s.send(victim.alloc_copy(b"x").unwrap()).unwrap();
            let _m = c.recv_timeout(Duration::from_secs(5)).unwrap();
            c.__forge_indices(data, rel);
            let e = s.send_timeout(victim.alloc_copy(b"y").unwrap(), Duration::from_secs(5));
            // Reaping happens when half the window is out or it is full; force it.
            let r = e.map(|_| ()).map_err(|e| e.error).and_then(|_| s.in_flight_checked());
            assert!(matches!(r, Err(Error::Protocol(ProtocolError::Ring(_)))), "{what}: got {r:?}");
        } else {
            c.__forge_indices(data, rel);
            let r = s.recv_timeout(Duration::from_secs(5));
            assert!(matches!(r, Err(Error::Protocol(ProtocolError::Ring(_)))), "{what}: got {r:?}");
        }
        // Honest traffic elsewhere is unaffected.
        round_trip(&hd, &hc, &hs);
    }
}

#[test]
fn a_doorbell_flood_costs_wakeups_not_correctness() {
    let b = TestBroker::start();
    let (d, c, s) = honest_pair(&b, "flood-svc");
    s.set_wait(WaitStrategy::Block);
    // The "peer" rings our doorbell as fast as it can, through the ring end
    // it was given (the client side holds exactly that).
    let bell = c.__peer_data_bell().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    let flooder = std::thread::spawn(move || {
        let mut n = 0u64;
        while !st.load(Ordering::Relaxed) {
            let _ = rustix::net::send(&bell, &[1], rustix::net::SendFlags::DONTWAIT);
            n += 1;
        }
        n
    });
    // Spurious wake-ups never produce a message that was not sent...
    assert!(matches!(s.recv_timeout(Duration::from_millis(200)), Err(Error::Timeout)));
    // ... and real ones still arrive, in order.
    for i in 0..200u64 {
        c.send(Message::new(d.alloc_copy(&i.to_le_bytes()).unwrap()).tag(i)).unwrap();
        assert_eq!(s.recv_timeout(Duration::from_secs(5)).unwrap().tag(), i);
    }
    stop.store(true, Ordering::Relaxed);
    assert!(flooder.join().unwrap() > 0);
}

#[test]
fn join_leave_churn_does_not_disturb_the_broker_or_streams() {
    let b = TestBroker::start();
    let (d, c, s) = honest_pair(&b, "churn-svc");
    let socket = b.socket.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    let churn = std::thread::spawn(move || {
        let mut n = 0;
        while !st.load(Ordering::Relaxed) {
            let e = fido::Domain::join(JoinOptions::new("churner").broker(&socket).arena_len(1 << 20)).unwrap();
            if n % 2 == 0 {
                e.leave().unwrap();
            } // else: dropped without leaving, like a crash of the domain object
            n += 1;
        }
        n
    });
    let started = Instant::now();
    let mut i = 0u64;
    while started.elapsed() < Duration::from_secs(2) {
        c.send(Message::new(d.alloc_copy(&i.to_le_bytes()).unwrap()).tag(i)).unwrap();
        assert_eq!(s.recv_timeout(Duration::from_secs(5)).unwrap().tag(), i);
        i += 1;
    }
    // The broker still answers promptly.
    let t = Instant::now();
    d.write("/app/churn", b"ok").unwrap();
    assert!(t.elapsed() < Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    let joins = churn.join().unwrap();
    assert!(joins > 10, "only {joins} joins");
}
