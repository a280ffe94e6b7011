//! Channel semantics within one process (two domains; the second usually runs
//! swizzled because the first holds the PGVAS window): scatter-gather, window
//! back-pressure, forged descriptors, counters and doorbell suppression.

use fido_test_support::domains::{check, fill, HangDetection};
use fido::{Descriptor, Error, InvalidArgument, JoinOptions, Message, ProtocolError, Segment, WaitStrategy};
use std::time::Duration;

type TestBroker = fido_test_support::TestBroker<HangDetection>;

fn pair(b: &TestBroker, service: &str, entries: u32) -> (fido::Domain, fido::Domain, fido::Channel, fido::Channel) {
    let server = b.join_with(JoinOptions::new("server").arena_len(64 << 20).ring_entries(entries));
    let client = b.join_with(JoinOptions::new("client").arena_len(64 << 20).ring_entries(entries).swizzle(true));
    let l = server.offer(service).unwrap();
    let c = client.connect(service).unwrap();
    let s = l.accept_timeout(Duration::from_secs(5)).unwrap();
    (server, client, s, c)
}

#[test]
fn scatter_gather_and_inline_messages_arrive_intact() {
    let b = TestBroker::start();
    let (server, client, s, c) = pair(&b, "sg", 64);
    for parts in [1usize, 2, 3, 17, 300] {
        let bufs: Vec<fido::Buf> = (0..parts)
            .map(|i| {
                let mut buf = client.alloc(10 + i).unwrap();
                buf.iter_mut().for_each(|x| *x = i as u8);
                buf
            })
            .collect();
        c.send(Message::gather(bufs).tag(parts as u64).opcode(3)).unwrap();
        let m = s.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!((m.tag(), m.opcode(), m.segment_count()), (parts as u64, 3, parts));
        for (i, seg) in m.segments().enumerate() {
            assert_eq!(seg.len(), 10 + i);
            assert!(seg.iter().all(|x| x == i as u8));
        }
        assert_eq!(m.len(), (0..parts).map(|i| 10 + i).sum::<usize>());
    }
    // Messages carried in the descriptor itself: any length up to
    // INLINE_BYTES, one segment (none when empty), no global pointers; a
    // forward copies the bytes on; a longer one is refused.
    for len in [0usize, 1, 8, fido::INLINE_BYTES] {
        let bytes: Vec<u8> = (0..len as u8).map(|i| i ^ 0x5a).collect();
        c.send(Message::inline(&bytes).unwrap().tag(len as u64).opcode(9)).unwrap();
        let m = s.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!((m.tag(), m.opcode(), m.len()), (len as u64, 9, len));
        assert_eq!(m.inline_bytes(), Some(&bytes[..]));
        assert_eq!(m.segment_count(), (len > 0) as usize);
        assert_eq!(m.segments().next().unwrap_or(fido::PeerSlice::empty()), &bytes[..]);
        assert_eq!(m.global_segments().count(), 0);
        // Back the other way, forwarded.
        s.forward(m).unwrap();
        let back = c.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!((back.tag(), back.inline_bytes()), (len as u64, Some(&bytes[..])));
    }
    assert!(matches!(
        Message::inline(&[0; fido::INLINE_BYTES + 1]),
        Err(Error::Invalid(InvalidArgument::InlineTooLong { len })) if len == fido::INLINE_BYTES + 1
    ));
    // `send_inline` sends the same message without building a `Message`.
    for len in [0usize, 5, fido::INLINE_BYTES] {
        let bytes: Vec<u8> = (0..len as u8).map(|i| i.wrapping_mul(7)).collect();
        c.send_inline(100 + len as u64, 4, &bytes).unwrap();
        let m = s.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!((m.tag(), m.opcode(), m.inline_bytes()), (100 + len as u64, 4, Some(&bytes[..])));
    }
    let e = c.send_inline(7, 1, &[0; fido::INLINE_BYTES + 1]).unwrap_err();
    assert!(matches!(e.error, Error::Invalid(InvalidArgument::InlineTooLong { len }) if len == fido::INLINE_BYTES + 1));
    assert_eq!(e.message.get_tag(), 7);
    // Every buffer (and SG list) is released back to the client.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while c.in_flight() > 0 {
        // The server collects the releases of what it forwarded (which
        // releases those messages upstream, to us).
        s.reap().unwrap();
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(client.counters().bytes_copied, 0);
    assert_eq!(server.counters().bytes_copied, 0);
}

#[test]
fn full_window_gives_back_pressure_not_memory_growth() {
    let b = TestBroker::start();
    let (_server, client, s, c) = pair(&b, "window", 8);
    let mut held = Vec::new();
    for i in 0..8u64 {
        c.send(Message::new(client.alloc_copy(&i.to_le_bytes()).unwrap()).tag(i)).unwrap();
    }
    // The receiver holds every message: the window is full.
    for _ in 0..8 {
        held.push(s.recv_timeout(Duration::from_secs(5)).unwrap());
    }
    let e = c.try_send(client.alloc(8).unwrap()).unwrap_err();
    assert!(matches!(e.error, Error::WouldBlock));
    assert_eq!(e.message.into_bufs().len(), 1, "the message comes back");
    let e = c.send_timeout(client.alloc(8).unwrap(), Duration::from_millis(50)).unwrap_err();
    assert!(matches!(e.error, Error::Timeout));
    // An inline send comes back whole too, as a message that can be resent.
    let e = c.try_send_inline(77, 5, b"inline").unwrap_err();
    assert!(matches!(e.error, Error::WouldBlock));
    let back = e.message;
    assert_eq!(back.get_tag(), 77);
    // Out-of-order release frees one slot.
    held.remove(5);
    c.send_timeout(back, Duration::from_secs(5)).unwrap();
    assert_eq!(c.in_flight(), 8);
    held.remove(0);
    c.send_timeout(client.alloc(8).unwrap(), Duration::from_secs(5)).unwrap();
    assert_eq!(c.in_flight(), 8);
    // The resent inline message arrives as it was first given.
    let m = s.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!((m.tag(), m.opcode(), m.inline_bytes()), (77, 5, Some(&b"inline"[..])));
}

#[test]
fn forged_descriptors_are_an_error_on_their_connection_only() {
    let b = TestBroker::start();
    let honest_srv = b.join("victim");
    let l = honest_srv.offer("victim-svc").unwrap();
    let evil = b.join_with(JoinOptions::new("evil").arena_len(64 << 20).swizzle(true));
    let friend = b.join_with(JoinOptions::new("friend").arena_len(64 << 20).swizzle(true));
    let good_c = friend.connect("victim-svc").unwrap();
    let good_s = l.accept_timeout(Duration::from_secs(5)).unwrap();

    let base = evil.arena().base().addr();
    let len = evil.arena().len();
    let window = evil.address_space().geometry();
    let unused_slot = window.base + window.slot_size * (window.slots as u64 - 1);
    let one = |addr: u64, l: u64| Descriptor { total_len: l, nseg: 1, segments: [Segment { addr, len: l }, Segment::default()], ..Default::default() };
    let forged = [
        ("pointer past the arena", one(base + len - 8, 64)),
        ("huge length", one(base, u64::MAX / 2)),
        ("length overflow", one(base + 64, u64::MAX)),
        ("slot never granted", one(unused_slot, 64)),
        ("outside the window", one(0x1000, 64)),
        ("lengths disagree", Descriptor { total_len: 1, ..one(base, 64) }),
        ("too many inline segments", Descriptor { nseg: 9, ..one(base, 64) }),
        ("unknown flag", Descriptor { flags: 0x40, ..one(base, 64) }),
        ("SG list outside arena", Descriptor { flags: 1, nseg: 4, segments: [Segment { addr: base + len, len: 64 }, Segment::default()], ..Default::default() }),
    ];
    for (what, desc) in forged {
        let c = evil.connect("victim-svc").unwrap();
        let s = l.accept_timeout(Duration::from_secs(5)).unwrap();
        c.__send_raw_descriptor(desc).unwrap();
        match s.recv_timeout(Duration::from_secs(5)) {
            Err(Error::Protocol(ProtocolError::Descriptor(why))) => eprintln!("{what}: {why}"),
            other => panic!("{what}: expected an invalid descriptor, got {other:?}"),
        }
        // The connection stays failed, for the same reason.
        assert!(matches!(s.try_recv(), Err(Error::Protocol(ProtocolError::Descriptor(_)))), "{what}");
        // The honest connection is unaffected.
        good_c.send(friend.alloc_copy(b"fine").unwrap()).unwrap();
        assert_eq!(good_s.recv_timeout(Duration::from_secs(5)).unwrap().as_slice().unwrap(), b"fine");
    }
}

#[test]
fn a_busy_stream_rings_almost_no_doorbells() {
    let b = TestBroker::start();
    let (server, client, s, c) = pair(&b, "busy", 256);
    s.set_wait(WaitStrategy::BusyPoll);
    const N: u64 = 200_000;
    let receiver = std::thread::spawn(move || {
        for i in 0..N {
            let m = s.recv().unwrap();
            assert_eq!(m.tag(), i);
        }
        drop(server);
    });
    for i in 0..N {
        let mut buf = client.alloc(64).unwrap();
        buf.fill(1);
        c.send(Message::new(buf).tag(i)).unwrap();
    }
    receiver.join().unwrap();
    let k = client.counters();
    assert_eq!(k.messages_sent, N);
    // The consumer never sleeps while it keeps up: far fewer than 1 doorbell per 100 messages.
    assert!(k.doorbells_rung * 100 < N, "{} doorbells for {N} messages", k.doorbells_rung);
}

#[test]
fn a_peer_cannot_write_our_memory() {
    // The peer mapping of our arena is read-only, enforced by the kernel.
    let b = TestBroker::start();
    let (server, _client, _s, _c) = pair(&b, "ro", 8);
    let slot = server.slot();
    let client_view = _client.address_space().mapping(slot).expect("client maps the server's arena");
    assert!(!client_view.is_own());
    let addr = client_view.local_base() as *mut std::ffi::c_void;
    // SAFETY: mprotect on a mapping we hold; expected to fail.
    let r = unsafe { rustix::mm::mprotect(addr, 4096, rustix::mm::MprotectFlags::READ | rustix::mm::MprotectFlags::WRITE) };
    assert!(r.is_err(), "a peer mapping could be made writable");
}

#[test]
fn a_peer_that_closes_keeps_what_it_holds_valid() {
    let b = TestBroker::start();
    let (_server, client, s, c) = pair(&b, "close-hold", 8);
    for i in 0..3u64 {
        let mut buf = client.alloc(64).unwrap();
        fill(&mut buf, i, 0);
        c.send(Message::new(buf).tag(i)).unwrap();
    }
    let held: Vec<fido::Msg> = (0..3).map(|_| s.recv_timeout(Duration::from_secs(5)).unwrap()).collect();
    drop(s); // the receiver closes its channel but keeps the messages
    let e = c.send_timeout(client.alloc(8).unwrap(), Duration::from_secs(5)).unwrap_err();
    assert!(matches!(e.error, Error::Closed), "got {:?}", e.error);
    // Still held by the peer: not undelivered, and their buffers are not reused.
    assert!(c.take_undelivered().is_empty());
    assert_eq!(c.in_flight(), 3);
    for _ in 0..100 {
        let mut junk = client.alloc(64).unwrap();
        junk.fill(0xee);
    }
    for (i, m) in held.iter().enumerate() {
        assert_eq!(check(m.as_slice().unwrap()).0, i as u64, "a held message changed under its reader");
    }
    drop(held);
    // Releases still flow after the close.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while c.in_flight() > 0 {
        assert!(std::time::Instant::now() < deadline, "releases did not come back after close");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn reap_ahead_collects_releases_once_half_the_window_is_out() {
    let b = TestBroker::start();
    let (_server, client, s, c) = pair(&b, "reap-ahead", 16);
    let in_use = || client.arena().stats().allocations;
    let before = in_use();
    // Below half the window: nothing to do yet, even with releases waiting.
    for i in 0..7u64 {
        c.send(client.alloc_copy(&[i as u8; 4096]).unwrap()).unwrap();
        drop(s.recv_timeout(Duration::from_secs(5)).unwrap());
    }
    c.reap_ahead().unwrap();
    assert_eq!(in_use(), before + 7, "collected before half the window was out");
    // Half out: every release the peer published is collected, and the
    // buffers go back to the arena.
    c.send(client.alloc_copy(&[7; 4096]).unwrap()).unwrap();
    drop(s.recv_timeout(Duration::from_secs(5)).unwrap());
    c.reap_ahead().unwrap();
    assert_eq!(in_use(), before);
}

/// A message whose release is deferred is released by the receiver's next
/// send, by its next wait for a message, by a second deferred message, or
/// by the channel's drop — and not before.
#[test]
fn a_deferred_release_waits_for_the_next_send_or_wait() {
    let b = TestBroker::start();
    let (_server, _client, s, c) = pair(&b, "deferred", 8);
    // The receiver `s` defers; the sender `c` counts what is released.
    let out = |c: &fido::Channel| {
        c.reap().unwrap();
        c.in_flight()
    };
    let receive_deferred = |s: &fido::Channel| {
        let mut m = s.recv_timeout(Duration::from_secs(5)).unwrap();
        m.defer_release();
        drop(m);
    };
    c.send_inline(1, 0, b"one").unwrap();
    receive_deferred(&s);
    assert_eq!(out(&c), 1, "published by the drop itself");
    // The receiver's next send publishes it.
    s.send_inline(9, 0, b"answer").unwrap();
    assert_eq!(out(&c), 0);
    drop(c.recv_timeout(Duration::from_secs(5)).unwrap());
    // A receive that has to wait publishes it first.
    c.send_inline(2, 0, b"two").unwrap();
    receive_deferred(&s);
    assert_eq!(out(&c), 1);
    assert!(matches!(s.recv_timeout(Duration::from_millis(20)), Err(Error::Timeout)));
    assert_eq!(out(&c), 0);
    // A second deferred message publishes the first; the channel's drop
    // publishes the last.
    c.send_inline(3, 0, b"three").unwrap();
    c.send_inline(4, 0, b"four").unwrap();
    receive_deferred(&s);
    assert_eq!(out(&c), 2);
    receive_deferred(&s);
    assert_eq!(out(&c), 1);
    drop(s);
    assert_eq!(out(&c), 0);
}

/// `Counters::bytes_copied` counts every copy a receiver keeps of payload —
/// `Msg::to_vec`, and `copy_to` / `to_vec` / `append_to` of the views from
/// `as_slice`, `segments`, `resolve` and `peer_arena` — and no read in place
/// (`read_obj`, `read_chunks`, `fold_u64`, `iter`, comparisons).
#[test]
fn bytes_copied_counts_every_kept_copy_and_no_read_in_place() {
    let b = TestBroker::start();
    let (server, client, s, c) = pair(&b, "copies", 8);
    let copied = || server.counters().bytes_copied;
    let mut buf = client.alloc(1000).unwrap();
    buf.iter_mut().enumerate().for_each(|(i, x)| *x = i as u8);
    let (g, len) = (buf.gptr(), buf.len());
    c.send(buf).unwrap();
    let m = s.recv_timeout(Duration::from_secs(5)).unwrap();
    let v = m.as_slice().unwrap();
    // Reads in place.
    assert_eq!(v.read_obj::<u8>(999), Some(999u32 as u8));
    let mut sum = 0u64;
    v.read_chunks(|ch| sum += ch.iter().map(|&x| x as u64).sum::<u64>());
    assert_eq!(sum, (0..1000u64).map(|i| i % 256).sum::<u64>());
    let _ = (v.fold_u64(0u64, |a, w| a ^ w), v.iter().count(), v == &[0u8; 3][..]);
    assert_eq!(copied(), 0, "reads in place");
    // Kept copies, each path counted by what it copied.
    assert_eq!(m.to_vec().len(), 1000);
    assert_eq!(copied(), 1000, "Msg::to_vec");
    assert_eq!(v.copy_to(&mut [0u8; 100]), 100);
    assert_eq!(copied(), 1100, "as_slice().copy_to");
    assert_eq!(m.segments().next().unwrap().to_vec().len(), 1000);
    assert_eq!(copied(), 2100, "segments().to_vec");
    let r = m.resolve(g.add(10).unwrap(), 50).unwrap();
    assert!(r == &(10..60).map(|i| i as u8).collect::<Vec<u8>>()[..]);
    assert_eq!(copied(), 2100, "a comparison is a read in place");
    assert_eq!(r.to_vec().len(), 50);
    assert_eq!(copied(), 2150, "resolve().to_vec");
    let (base, arena) = m.peer_arena();
    let mut kept = Vec::new();
    arena.subslice((g.addr() - base.addr()) as usize, len).unwrap().append_to(&mut kept);
    assert_eq!(kept, m.to_vec());
    assert_eq!(copied(), 2150 + 1000 + 1000, "peer_arena().append_to (and to_vec)");
    drop(m);
    // An inline message's bytes are our own copy already; copying them again
    // is still a copy the caller keeps.
    c.send_inline(1, 0, b"abc").unwrap();
    let m = s.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(m.to_vec(), b"abc");
    assert_eq!(copied(), 4153, "an inline message's to_vec");
    assert_eq!(client.counters().bytes_copied, 0, "the sender copied nothing");
}

/// Messages dropped on many threads at once each publish one release, and
/// each release is counted (a doorbell rung or suppressed) exactly once: the
/// release counters are written under the release lock, never after it.
#[test]
fn releases_from_concurrent_drops_are_all_counted() {
    const THREADS: usize = 8;
    const ENTRIES: u32 = 1024;
    const ROUNDS: u64 = 64;
    let b = TestBroker::start();
    let (server, _client, s, c) = pair(&b, "drops", ENTRIES);
    for _ in 0..ROUNDS {
        for i in 0..ENTRIES {
            c.send_inline(i as u64, 0, b"x").unwrap();
        }
        let mut msgs: Vec<fido::Msg> = (0..ENTRIES).map(|_| s.recv_timeout(Duration::from_secs(5)).unwrap()).collect();
        let per_thread = msgs.len() / THREADS;
        let start = std::sync::Barrier::new(THREADS);
        std::thread::scope(|scope| {
            for _ in 0..THREADS {
                let mine: Vec<fido::Msg> = msgs.drain(..per_thread).collect();
                let start = &start;
                scope.spawn(move || {
                    start.wait();
                    for m in mine {
                        drop(m);
                    }
                });
            }
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while c.in_flight_checked().unwrap() > 0 {
            assert!(std::time::Instant::now() < deadline, "releases never arrived");
            std::thread::yield_now();
        }
    }
    let counted = server.counters();
    assert_eq!(counted.messages_received, ROUNDS * ENTRIES as u64);
    assert_eq!(counted.doorbells_rung + counted.doorbells_suppressed, ROUNDS * ENTRIES as u64, "{counted:?}");
}

/// A caller's mistake comes back as the `InvalidArgument` that names it, and
/// its message says what was wrong.
#[test]
fn invalid_arguments_name_the_mistake() {
    let b = TestBroker::start();
    match fido::Domain::join(JoinOptions::new("odd-ring").broker(&b.socket).ring_entries(3)) {
        Err(Error::Invalid(InvalidArgument::RingEntries(3))) => {}
        other => panic!("ring_entries 3: {:?}", other.map(|_| ())),
    }
    match fido::Domain::join(JoinOptions::new("").broker(&b.socket)) {
        Err(e @ Error::Invalid(InvalidArgument::Name(_))) => assert!(e.to_string().contains("domain name"), "{e}"),
        other => panic!("empty name: {:?}", other.map(|_| ())),
    }
    let (_server, client, _s, c) = pair(&b, "args", 8);
    let mut empty = client.alloc(8).unwrap();
    empty.truncate(0);
    let e = c.send(Message::gather(vec![client.alloc(8).unwrap(), empty])).unwrap_err();
    assert!(matches!(e.error, Error::Invalid(InvalidArgument::EmptyBuffer)), "{e}");
    let many: Vec<fido::Buf> = (0..fido::MAX_SEGMENTS + 1).map(|_| client.alloc(1).unwrap()).collect();
    let e = c.send(Message::gather(many)).unwrap_err();
    assert!(matches!(e.error, Error::Invalid(InvalidArgument::TooManySegments { count }) if count == fido::MAX_SEGMENTS + 1), "{e}");
    assert_eq!(e.to_string(), format!("invalid argument: {} segments (max {})", fido::MAX_SEGMENTS + 1, fido::MAX_SEGMENTS));
    // Nothing went out.
    assert_eq!(c.in_flight(), 0);
}

/// An acceptor that cannot take a connection (here: no room in its arena for
/// its ring block) refuses it, so the connecting side hears of it at once.
/// Before, only descriptor and peer-arena failures were refused; an
/// allocation or doorbell failure left the client waiting out its request
/// timeout (seen inside VMs, which have a fixed number of doorbell vectors).
#[test]
fn an_acceptor_that_cannot_take_a_connection_refuses_it_at_once() {
    let b = TestBroker::start();
    // A 1 MiB arena cannot hold the block of a ring of 65 536 entries.
    let server = b.join_with(JoinOptions::new("small-server").arena_len(1 << 20));
    let client = b.join_with(JoinOptions::new("big-client").arena_len(64 << 20).ring_entries(1 << 16).swizzle(true));
    let _l = server.offer("tight").unwrap();
    let t = std::time::Instant::now();
    let Err(err) = client.connect("tight") else { panic!("the server cannot hold this connection") };
    assert!(t.elapsed() < Duration::from_secs(5), "refusal took {:?}: {err}", t.elapsed());
    assert!(err.to_string().to_lowercase().contains("refus") || err.to_string().contains("memory"), "{err}");
}
