//! The session against a scripted broker: over an in-memory transport (which
//! can be told not to pass descriptors) and over a real `socketpair`. No broker
//! process is involved; the test plays the broker's side frame by frame.

use fido_control::{
    Backoff, Connect, ControlError, Handler, Options, Received, Session, Transport, UnixSeqpacket,
};
use fido_proto::{
    BrokerMsg, ClientMsg, ErrorCode, Event, GoneReason, PgvasGeometry, RemoteError, Reply, Request,
    ResumeSecret,
};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

// ---- an in-memory transport -------------------------------------------------

/// Frames on their way, and whether the queue is closed.
type Frames = (VecDeque<(Vec<u8>, Vec<OwnedFd>)>, bool);

#[derive(Default)]
struct Queue {
    state: Mutex<Frames>,
    cv: Condvar,
}

impl Queue {
    fn close(&self) {
        self.state.lock().1 = true;
        self.cv.notify_all();
    }
}

/// One end of an in-memory link: frames pushed on `tx` come out of the other
/// end's `rx`.
struct MemEnd {
    rx: Arc<Queue>,
    tx: Arc<Queue>,
    passes_fds: bool,
    sent: AtomicUsize,
}

fn mem_pair(passes_fds: bool) -> (MemEnd, MemEnd) {
    let (a, b) = (Arc::new(Queue::default()), Arc::new(Queue::default()));
    let end = |rx: &Arc<Queue>, tx: &Arc<Queue>| MemEnd { rx: rx.clone(), tx: tx.clone(), passes_fds, sent: AtomicUsize::new(0) };
    (end(&a, &b), end(&b, &a))
}

impl Transport for MemEnd {
    fn send(&self, frame: &[u8], fds: &[OwnedFd]) -> io::Result<()> {
        if !fds.is_empty() && !self.passes_fds {
            return Err(io::ErrorKind::Unsupported.into());
        }
        let mut st = self.tx.state.lock();
        if st.1 {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        let fds = fds.iter().map(|f| f.try_clone()).collect::<io::Result<Vec<_>>>()?;
        st.0.push_back((frame.to_vec(), fds));
        self.sent.fetch_add(1, Ordering::Relaxed);
        self.tx.cv.notify_all();
        Ok(())
    }

    fn recv(&self, buf: &mut [u8], timeout: Option<Duration>) -> io::Result<Received> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = self.rx.state.lock();
        loop {
            if let Some((frame, fds)) = st.0.pop_front() {
                let len = frame.len().min(buf.len());
                buf[..len].copy_from_slice(&frame[..len]);
                return Ok(Received::Frame { len, fds, truncated: len < frame.len() });
            }
            if st.1 {
                return Ok(Received::Closed);
            }
            match deadline {
                Some(d) => {
                    if self.rx.cv.wait_until(&mut st, d).timed_out() {
                        return Ok(Received::Idle);
                    }
                }
                None => self.rx.cv.wait(&mut st),
            }
        }
    }

    fn passes_fds(&self) -> bool {
        self.passes_fds
    }

    fn shutdown(&self) {
        self.rx.close();
        self.tx.close();
    }
}

/// Hands out the client ends the test queued, one per connection attempt.
#[derive(Default)]
struct MemConnector {
    ends: Mutex<VecDeque<MemEnd>>,
    attempts: AtomicUsize,
}

impl Connect for MemConnector {
    fn connect(&self) -> fido_control::Result<Arc<dyn Transport>> {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        match self.ends.lock().pop_front() {
            Some(end) => Ok(Arc::new(end)),
            None => Err(ControlError::Unavailable("nobody listening".into())),
        }
    }
    fn address(&self) -> String {
        "memory".into()
    }
}

// ---- the broker's side, scripted --------------------------------------------

struct FakeBroker {
    end: Arc<dyn Transport>,
    heartbeats: AtomicUsize,
}

impl FakeBroker {
    fn new(end: impl Transport) -> FakeBroker {
        FakeBroker { end: Arc::new(end), heartbeats: AtomicUsize::new(0) }
    }

    /// The next request (heartbeats are counted and skipped); `None` when the
    /// link closed or nothing came within `within`.
    fn next_request(&self, within: Duration) -> Option<(u64, Request, Vec<OwnedFd>)> {
        let deadline = Instant::now() + within;
        let mut buf = vec![0u8; fido_proto::MAX_MESSAGE];
        while Instant::now() < deadline {
            match self.end.recv(&mut buf, Some(Duration::from_millis(20))).unwrap() {
                Received::Frame { len, fds, .. } => match fido_proto::decode::<ClientMsg>(&buf[..len]).unwrap() {
                    ClientMsg::Heartbeat => {
                        self.heartbeats.fetch_add(1, Ordering::Relaxed);
                    }
                    ClientMsg::Request { id, body } => return Some((id, body, fds)),
                },
                Received::Idle => {}
                Received::Closed => return None,
            }
        }
        None
    }

    /// Whether the client closed the link within `within` (frames before the
    /// close are read and dropped).
    fn closed_within(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        let mut buf = vec![0u8; fido_proto::MAX_MESSAGE];
        while Instant::now() < deadline {
            if let Received::Closed = self.end.recv(&mut buf, Some(Duration::from_millis(20))).unwrap() {
                return true;
            }
        }
        false
    }

    fn expect_request(&self) -> (u64, Request, Vec<OwnedFd>) {
        self.next_request(Duration::from_secs(5)).expect("a request")
    }

    fn send(&self, msg: BrokerMsg, fds: &[OwnedFd]) {
        self.end.send(&fido_proto::encode(&msg).unwrap(), fds).unwrap();
    }

    fn reply(&self, id: u64, body: Result<Reply, RemoteError>) {
        self.send(BrokerMsg::Reply { id, body }, &[]);
    }

    /// Answers the Join that opens every link; returns it.
    fn accept_join(&self, heartbeat_ms: u64) -> Request {
        let (id, join, _) = self.expect_request();
        assert!(matches!(join, Request::Join { .. }), "first message must be a Join, got {join:?}");
        self.reply(id, Ok(Reply::Joined { domain: 7, slot: 3, geometry: PgvasGeometry::DEFAULT, heartbeat_ms, resume_secret: ResumeSecret([1; 32]) }));
        join
    }

    fn close(&self) {
        self.end.shutdown();
    }
}

fn join_request(name: &str) -> Request {
    Request::Join { name: name.into(), label: None, arena_len: 1 << 16, resume: None }
}

/// Records events and rejoins with a Join named "again".
#[derive(Default)]
struct Recorder {
    events: Mutex<Vec<Event>>,
    rejoins: AtomicUsize,
    ticks: AtomicUsize,
}

impl Handler for Recorder {
    fn event(&self, event: Event, _fds: Vec<OwnedFd>) {
        self.events.lock().push(event);
    }
    fn tick(&self) {
        self.ticks.fetch_add(1, Ordering::Relaxed);
    }
    fn rejoin(&self) -> fido_control::Result<(Request, Vec<OwnedFd>)> {
        self.rejoins.fetch_add(1, Ordering::Relaxed);
        Ok((join_request("again"), vec![]))
    }
}

/// A started session on an in-memory link whose broker side the test holds.
fn session(options: Options, heartbeat_ms: u64, passes_fds: bool) -> (Session, FakeBroker, Arc<MemConnector>, Arc<Recorder>) {
    let connector = Arc::new(MemConnector::default());
    let (client, broker) = mem_pair(passes_fds);
    connector.ends.lock().push_back(client);
    let broker = FakeBroker::new(broker);
    let (session, joined) = std::thread::scope(|s| {
        let b = s.spawn(|| broker.accept_join(heartbeat_ms));
        let r = Session::join(connector.clone(), join_request("first"), vec![], options).unwrap();
        b.join().unwrap();
        r
    });
    assert_eq!((joined.domain, joined.slot, joined.heartbeat), (7, 3, Duration::from_millis(heartbeat_ms)));
    let recorder = Arc::new(Recorder::default());
    let weak: Weak<dyn Handler> = Arc::downgrade(&recorder) as Weak<dyn Handler>;
    session.start(weak, "test-control").unwrap();
    (session, broker, connector, recorder)
}

fn value(v: &str) -> Reply {
    Reply::Value(Some(v.as_bytes().to_vec()))
}

fn read(path: &str) -> Request {
    Request::Read { path: path.into() }
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

// ---- the tests ---------------------------------------------------------------

#[test]
fn replies_out_of_order_reach_their_own_requests() {
    let (session, broker, _, _handler) = session(Options::default(), 1000, true);
    let mut a = session.start_request(read("/a"), &[]).unwrap();
    let b = session.start_request(read("/b"), &[]).unwrap();
    let c = session.start_request(read("/c"), &[]).unwrap();
    let ids: Vec<(u64, Request)> = (0..3).map(|_| broker.expect_request()).map(|(id, r, _)| (id, r)).collect();
    assert_eq!(ids.iter().map(|(_, r)| r.clone()).collect::<Vec<_>>(), vec![read("/a"), read("/b"), read("/c")]);
    assert_eq!([a.id(), b.id(), c.id()], [ids[0].0, ids[1].0, ids[2].0]);
    // Answer c, then a refusal for b, then a.
    broker.reply(ids[2].0, Ok(value("c")));
    broker.reply(ids[1].0, Err(RemoteError::new(ErrorCode::NoSuchDomain, "b")));
    assert!(a.wait_timeout(Duration::from_millis(50)).is_none(), "a was answered before its reply came");
    broker.reply(ids[0].0, Ok(value("a")));
    assert_eq!(c.wait().unwrap().0, value("c"));
    assert!(matches!(b.wait(), Err(ControlError::Refused(e)) if e.code == ErrorCode::NoSuchDomain && e.message == "b"));
    assert_eq!(a.wait_timeout(Duration::from_secs(5)).unwrap().unwrap().0, value("a"));
    assert!(matches!(a.try_take(), Some(Err(ControlError::AlreadyTaken))));
    assert_eq!(session.stats().replies, 3);
    assert_eq!(session.stats().unmatched_replies, 0);
}

#[test]
fn a_reply_for_an_unknown_id_is_counted_and_ignored() {
    let (session, broker, _, _handler) = session(Options::default(), 1000, true);
    broker.reply(424_242, Ok(value("stray")));
    wait_until("the stray reply", || session.stats().unmatched_replies == 1);
    // A real request afterwards still gets its own answer, not the stray one.
    std::thread::scope(|s| {
        s.spawn(|| {
            let (id, body, _) = broker.expect_request();
            assert_eq!(body, read("/x"));
            broker.reply(id, Ok(value("x")));
        });
        assert_eq!(session.request(read("/x"), &[]).unwrap().0, value("x"));
    });
    assert_eq!(session.stats(), fido_control::Stats { replies: 1, unmatched_replies: 1, ..session.stats() });
}

#[test]
fn losing_the_broker_fails_pending_requests_and_ends_a_session_without_reconnect() {
    let (session, broker, connector, recorder) = session(Options::default(), 1000, true);
    let first = session.start_request(read("/a"), &[]).unwrap();
    let second = session.start_request(read("/b"), &[]).unwrap();
    broker.expect_request();
    broker.close();
    assert!(matches!(first.wait(), Err(ControlError::Lost(_))));
    assert!(matches!(second.wait(), Err(ControlError::Lost(_))));
    // Ended: the next request fails at once, without a reconnection attempt.
    let t = Instant::now();
    assert!(matches!(session.request(read("/c"), &[]), Err(ControlError::Unavailable(_))));
    assert!(t.elapsed() < Duration::from_secs(1));
    assert_eq!(connector.attempts.load(Ordering::Relaxed), 1, "only the first connection");
    assert_eq!(recorder.rejoins.load(Ordering::Relaxed), 0);
}

#[test]
fn reconnecting_replays_the_registration_the_handler_supplies() {
    let options = Options { reconnect: Some(Backoff { first: Duration::from_millis(5), max: Duration::from_millis(20) }), ..Options::default() };
    let (session, broker, connector, recorder) = session(options, 1000, true);
    let pending = session.start_request(read("/a"), &[]).unwrap();
    broker.expect_request();
    broker.close();
    assert!(matches!(pending.wait(), Err(ControlError::Lost(_))), "the request in flight fails");
    // Nobody listens for a while: the session keeps trying with back-off.
    wait_until("retries", || connector.attempts.load(Ordering::Relaxed) >= 3);
    let (client, broker_end) = mem_pair(true);
    let broker = FakeBroker::new(broker_end);
    connector.ends.lock().push_back(client);
    let join = broker.accept_join(1000);
    assert_eq!(join, join_request("again"), "the re-registration is the handler's");
    assert_eq!(recorder.rejoins.load(Ordering::Relaxed), 1);
    wait_until("the reconnection", || session.stats().reconnects == 1);
    // Requests flow on the new link.
    std::thread::scope(|s| {
        s.spawn(|| {
            let (id, body, _) = broker.expect_request();
            assert_eq!(body, read("/after"));
            broker.reply(id, Ok(value("after")));
        });
        assert_eq!(session.request(read("/after"), &[]).unwrap().0, value("after"));
    });
}

#[test]
fn a_request_waits_for_the_reconnection_and_a_refused_rejoin_ends_the_session() {
    let options = Options { reconnect: Some(Backoff { first: Duration::from_millis(5), max: Duration::from_millis(20) }), ..Options::default() };
    let (session, broker, connector, _handler) = session(options, 1000, true);
    broker.close();
    wait_until("retries", || connector.attempts.load(Ordering::Relaxed) >= 2);
    let (client, broker_end) = mem_pair(true);
    let broker = FakeBroker::new(broker_end);
    std::thread::scope(|s| {
        let asker = s.spawn(|| session.request(read("/while-down"), &[]));
        std::thread::sleep(Duration::from_millis(50));
        connector.ends.lock().push_back(client);
        broker.accept_join(1000);
        let (id, body, _) = broker.expect_request();
        assert_eq!(body, read("/while-down"));
        broker.reply(id, Ok(value("late")));
        assert_eq!(asker.join().unwrap().unwrap().0, value("late"));
    });
    // This broker knows the domain as dead: no more retries, requests fail.
    let (client, broker_end) = mem_pair(true);
    let third = FakeBroker::new(broker_end);
    connector.ends.lock().push_back(client);
    broker.close();
    let (id, _, _) = third.expect_request();
    third.reply(id, Err(RemoteError::new(ErrorCode::Denied, "domain is dead")));
    wait_until("the end", || matches!(session.request(read("/x"), &[]), Err(ControlError::Unavailable(why)) if why.contains("refused")));
    let attempts = connector.attempts.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(connector.attempts.load(Ordering::Relaxed), attempts, "no retry after a refusal");
}

#[test]
fn a_transport_without_fd_passing_refuses_requests_with_descriptors() {
    let (session, broker, _, _handler) = session(Options::default(), 1000, false);
    let (fd, _keep) = std::os::unix::net::UnixStream::pair().unwrap();
    let fd: OwnedFd = fd.into();
    assert!(matches!(session.start_request(read("/a"), std::slice::from_ref(&fd)), Err(ControlError::FdsNotSupported { count: 1 })));
    assert!(matches!(session.notify_with(read("/a"), std::slice::from_ref(&fd)), Err(ControlError::FdsNotSupported { count: 1 })));
    assert!(broker.next_request(Duration::from_millis(100)).is_none(), "nothing was sent");
    // Without descriptors the same transport works.
    std::thread::scope(|s| {
        s.spawn(|| {
            let (id, _, _) = broker.expect_request();
            broker.reply(id, Ok(Reply::Ok));
        });
        assert_eq!(session.request(read("/a"), &[]).unwrap().0, Reply::Ok);
    });
}

#[test]
fn a_request_without_a_reply_times_out_and_its_late_reply_is_ignored() {
    let options = Options { request_timeout: Duration::from_millis(100), ..Options::default() };
    let (session, broker, _, _handler) = session(options, 1000, true);
    let t = Instant::now();
    assert!(matches!(session.request(read("/slow"), &[]), Err(ControlError::NoReply(d)) if d == Duration::from_millis(100)));
    assert!(t.elapsed() >= Duration::from_millis(100));
    let (id, _, _) = broker.expect_request();
    broker.reply(id, Ok(Reply::Ok));
    wait_until("the late reply", || session.stats().unmatched_replies == 1);
}

#[test]
fn heartbeats_ticks_and_events_flow_and_dropping_the_handler_ends_the_thread() {
    let (session, broker, _, recorder) = session(Options::default(), 10, true);
    wait_until("heartbeats", || {
        broker.next_request(Duration::from_millis(30));
        broker.heartbeats.load(Ordering::Relaxed) >= 3
    });
    assert!(recorder.ticks.load(Ordering::Relaxed) >= 2);
    broker.send(BrokerMsg::Event(Event::PeerGone { domain: 9, conn: None, reason: GoneReason::Exited }), &[]);
    wait_until("the event", || recorder.events.lock().len() == 1);
    assert_eq!(session.stats().events, 1);
    // The reader holds the handler weakly: without it, the thread ends and the
    // link closes (the broker sees EOF).
    assert!(!broker.closed_within(Duration::from_millis(50)));
    drop(recorder);
    assert!(broker.closed_within(Duration::from_secs(5)), "the link stayed open");
    assert!(matches!(session.request(read("/x"), &[]), Err(ControlError::Unavailable(_))));
}

#[test]
fn over_a_socketpair_descriptors_travel_and_leave_is_answered() {
    let (client, broker) = rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    struct Once(Mutex<Option<UnixSeqpacket>>);
    impl Connect for Once {
        fn connect(&self) -> fido_control::Result<Arc<dyn Transport>> {
            let t = self.0.lock().take().ok_or_else(|| ControlError::Unavailable("used".into()))?;
            Ok(Arc::new(t))
        }
        fn address(&self) -> String {
            "socketpair".into()
        }
    }
    let broker = FakeBroker::new(UnixSeqpacket::from_connected(broker));
    let connector = Arc::new(Once(Mutex::new(Some(UnixSeqpacket::from_connected(client)))));
    let (file, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
    let arena: OwnedFd = file.into();
    let (session, _) = std::thread::scope(|s| {
        s.spawn(|| {
            let (id, _, fds) = broker.expect_request();
            assert_eq!(fds.len(), 1, "the Join's descriptor came along");
            broker.reply(id, Ok(Reply::Joined { domain: 1, slot: 1, geometry: PgvasGeometry::DEFAULT, heartbeat_ms: 1000, resume_secret: ResumeSecret([1; 32]) }));
        });
        Session::join(connector, join_request("pair"), vec![arena], Options::default()).unwrap()
    });
    let recorder = Arc::new(Recorder::default());
    session.start(Arc::downgrade(&recorder) as Weak<dyn Handler>, "pair-control").unwrap();
    // A reply with a descriptor hands it to the caller.
    std::thread::scope(|s| {
        s.spawn(|| {
            let (id, body, _) = broker.expect_request();
            assert_eq!(body, Request::GrantSlot { slot: 4 });
            let (mine, _theirs) = std::os::unix::net::UnixStream::pair().unwrap();
            let mine: OwnedFd = mine.into();
            broker.send(BrokerMsg::Reply { id, body: Ok(Reply::Ok) }, &[mine]);
        });
        let (reply, fds) = session.request(Request::GrantSlot { slot: 4 }, &[]).unwrap();
        assert_eq!((reply, fds.len()), (Reply::Ok, 1));
        assert!(fido_proto::wire::fd_kind(fds[0].as_fd()).unwrap().starts_with("socket:"));
    });
    std::thread::scope(|s| {
        s.spawn(|| {
            let (id, body, _) = broker.expect_request();
            assert_eq!(body, Request::Leave);
            broker.reply(id, Ok(Reply::Ok));
            broker.close();
        });
        session.leave(Duration::from_secs(5)).unwrap();
    });
    assert!(matches!(session.request(read("/x"), &[]), Err(ControlError::Unavailable(_))));
}
