//! The tokio flavour: an async echo between two domains, back-pressure that
//! awaits instead of blocking, and a peer's death as an error.

use fido_test_support::domains::HangDetection;
use fido::{AsyncChannel, Error, JoinOptions, Message};
use std::time::Duration;

type TestBroker = fido_test_support::TestBroker<HangDetection>;

#[tokio::test(flavor = "current_thread")]
async fn async_echo_and_backpressure() {
    let b = TestBroker::start();
    let server = b.join_with(JoinOptions::new("async-server").arena_len(32 << 20).ring_entries(4));
    let client = b.join_with(JoinOptions::new("async-client").arena_len(32 << 20).ring_entries(4).swizzle(true));
    let l = server.offer("async-echo").unwrap();
    let c = AsyncChannel::new(client.connect("async-echo").unwrap()).unwrap();
    let s = AsyncChannel::new(l.accept_timeout(Duration::from_secs(5)).unwrap()).unwrap();
    let srv = server.clone();
    let echo = tokio::spawn(async move {
        for _ in 0..100 {
            let m = s.recv().await.unwrap();
            let reply = srv.alloc_copy(&m.to_vec()).unwrap();
            let tag = m.tag();
            drop(m);
            s.send(Message::new(reply).tag(tag)).await.unwrap();
        }
        s
    });
    // More sends than the window: the client awaits releases, it never fails.
    let sender = async {
        for i in 0..100u64 {
            c.send(Message::new(client.alloc_copy(&i.to_le_bytes()).unwrap()).tag(i)).await.unwrap();
        }
    };
    let receiver = async {
        for i in 0..100u64 {
            let m = c.recv().await.unwrap();
            assert_eq!(m.tag(), i);
            assert_eq!(m.as_slice().unwrap(), &i.to_le_bytes()[..]);
        }
    };
    tokio::time::timeout(Duration::from_secs(20), async { tokio::join!(sender, receiver) }).await.expect("async echo stalled");
    let s = echo.await.unwrap();
    // The peer leaves: the waiting receiver wakes with an error.
    let waiter = tokio::spawn(async move { c.recv().await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(s);
    drop(l);
    server.leave().unwrap();
    let r = tokio::time::timeout(Duration::from_secs(5), waiter).await.expect("receiver not woken").unwrap();
    assert!(matches!(r, Err(Error::Closed) | Err(Error::PeerGone { .. })), "got {r:?}");
}
