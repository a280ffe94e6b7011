//! Multi-process tests of the core: transitive zero-copy through real
//! processes, and the failure semantics of docs/ARCHITECTURE.md §3 (a peer killed with -9,
//! a hung peer, a micro-reboot, a broker restart under a live stream).

use fido_test_support::domains::{check, config, connect_retry, fill, HangDetection};
use fido_test_support::ChildProc;
use fido::{Domain, Error, JoinOptions, WaitStrategy};
use std::time::{Duration, Instant};

type TestBroker = fido_test_support::TestBroker<HangDetection>;

const SIZE: usize = 4096;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_default()
}

fn join_child(name: &str) -> Domain {
    let opts = JoinOptions::new(name).arena_len(64 << 20).swizzle(env("FIDO_TEST_SWIZZLE") == "1");
    Domain::join(opts).unwrap()
}

/// Entry point of child processes; a no-op when run as an ordinary test.
#[test]
fn child_main() {
    let Ok(role) = std::env::var("FIDO_TEST_ROLE") else { return };
    let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_writer(std::io::stderr).try_init();
    // Die with the test that started us.
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    match role.as_str() {
        // Offers a service, accepts one connection and streams numbered messages until killed.
        "streamer" => {
            let d = join_child("streamer");
            let l = d.offer(&env("FIDO_TEST_SERVICE")).unwrap();
            println!("id {}", d.id());
            let ch = l.accept().unwrap();
            for seq in 0.. {
                let mut buf = d.alloc(SIZE).unwrap();
                let g = buf.gptr().addr();
                fill(&mut buf, seq, g);
                if ch.send(fido::Message::new(buf).tag(seq)).is_err() {
                    break;
                }
            }
        }
        // Connects and receives, never releasing anything.
        "holder" => {
            let d = join_child("holder");
            let ch = connect_retry(&d, &env("FIDO_TEST_SERVICE"), Duration::from_secs(10));
            let mut held = Vec::new();
            loop {
                let m = ch.recv().unwrap();
                held.push(m);
                println!("got {}", held.len());
            }
        }
        // Offers IN, connects to OUT, forwards every message unchanged.
        "forwarder" => {
            let d = join_child("forwarder");
            let l = d.offer(&env("FIDO_TEST_IN")).unwrap();
            let out = connect_retry(&d, &env("FIDO_TEST_OUT"), Duration::from_secs(10));
            println!("ready");
            let inp = l.accept().unwrap();
            while let Ok(m) = inp.recv() {
                if out.forward(m).is_err() {
                    break;
                }
            }
            println!("copied {}", d.counters().bytes_copied);
        }
        // Offers a service, receives N messages, checks them, reports.
        "sink" => {
            let d = join_child("sink");
            let l = d.offer(&env("FIDO_TEST_SERVICE")).unwrap();
            println!("ready");
            let ch = l.accept().unwrap();
            let n: u64 = env("FIDO_TEST_N").parse().unwrap();
            let mut same_pointer = 0;
            for expect in 0..n {
                let m = ch.recv().unwrap();
                let (seq, header_gptr) = check(m.as_slice().unwrap());
                assert_eq!(seq, expect, "out of order");
                assert_eq!(m.tag(), seq);
                let (g, _) = m.global_segments().next().unwrap();
                if g.addr() == header_gptr {
                    same_pointer += 1;
                }
            }
            println!("result {} {} {}", n, same_pointer, d.counters().bytes_copied);
        }
        // Echo server: offers a service and echoes every message back (copying: it's a reply).
        "echo" => {
            let d = join_child("echo");
            let l = d.offer(&env("FIDO_TEST_SERVICE")).unwrap();
            println!("ready {}", d.id());
            loop {
                let ch = l.accept().unwrap();
                while let Ok(m) = ch.recv() {
                    let buf = d.alloc_copy(&m.to_vec()).unwrap();
                    drop(m);
                    if ch.send(fido::Message::new(buf).tag(7)).is_err() {
                        break;
                    }
                }
            }
        }
        // Receives one message and tries to write into the sender's memory.
        "vandal" => {
            let d = join_child("vandal");
            let ch = connect_retry(&d, &env("FIDO_TEST_SERVICE"), Duration::from_secs(10));
            let m = ch.recv().unwrap();
            println!("writing");
            let p = m.as_slice().unwrap().as_ptr() as *mut u8;
            // SAFETY: deliberately invalid: the page is mapped read-only, so
            // the kernel must kill this process here.
            unsafe { std::ptr::write_volatile(p, 0xff) };
            println!("wrote");
        }
        // A broker process (so a test can kill it).
        "broker" => {
            let socket = env("FIDO_BROKER");
            let cfg = config(std::path::Path::new(&socket), std::path::Path::new(&env("FIDO_TEST_STATE")));
            let broker = fido_broker::Broker::bind(cfg).unwrap();
            println!("ready");
            broker.run().unwrap();
        }
        other => panic!("unknown role {other}"),
    }
    std::process::exit(0);
}

fn pipeline(swizzle: bool) {
    let b = TestBroker::start();
    let tag = if swizzle { "sw" } else { "pg" };
    let sw = if swizzle { "1" } else { "0" };
    let n = 300u64;
    let ns = n.to_string();
    let sink_svc = format!("sink-{tag}");
    let f2_svc = format!("f2-{tag}");
    let f1_svc = format!("f1-{tag}");
    let mut sink = ChildProc::spawn("sink", &b.socket, &[("FIDO_TEST_SERVICE", &sink_svc), ("FIDO_TEST_N", &ns), ("FIDO_TEST_SWIZZLE", sw)]);
    sink.expect_line("ready", Duration::from_secs(10));
    let mut f2 = ChildProc::spawn("forwarder", &b.socket, &[("FIDO_TEST_IN", &f2_svc), ("FIDO_TEST_OUT", &sink_svc), ("FIDO_TEST_SWIZZLE", sw)]);
    f2.expect_line("ready", Duration::from_secs(10));
    let mut f1 = ChildProc::spawn("forwarder", &b.socket, &[("FIDO_TEST_IN", &f1_svc), ("FIDO_TEST_OUT", &f2_svc), ("FIDO_TEST_SWIZZLE", sw)]);
    f1.expect_line("ready", Duration::from_secs(10));
    let src = b.join_with(JoinOptions::new("source").arena_len(64 << 20).ring_entries(32));
    let ch = connect_retry(&src, &f1_svc, Duration::from_secs(10));
    for seq in 0..n {
        let mut buf = src.alloc(SIZE).unwrap();
        let g = buf.gptr().addr();
        fill(&mut buf, seq, g);
        ch.send(fido::Message::new(buf).tag(seq)).unwrap();
    }
    let result = sink.expect_line("result", Duration::from_secs(30));
    let fields: Vec<u64> = result.split_whitespace().map(|x| x.parse().unwrap()).collect();
    assert_eq!(fields[0], n, "sink got all messages");
    assert_eq!(fields[1], n, "every pointer arrived unchanged after 3 hops");
    assert_eq!(fields[2], 0, "sink copied no payload");
    sink.wait_success(Duration::from_secs(10));
    // Every buffer comes back: releases travelled back through both forwarders.
    let deadline = Instant::now() + Duration::from_secs(10);
    // (`in_flight` collects the releases the first forwarder published.)
    while ch.in_flight() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(ch.in_flight(), 0, "every buffer came back through both forwarders");
    drop(ch);
    assert_eq!(f1.expect_line("copied", Duration::from_secs(10)), "0");
    assert_eq!(f2.expect_line("copied", Duration::from_secs(10)), "0");
    assert_eq!(src.counters().bytes_copied, 0);
}

#[test]
fn transitive_zero_copy_through_four_processes_pgvas() {
    pipeline(false);
}

#[test]
fn transitive_zero_copy_through_four_processes_swizzled() {
    pipeline(true);
}

#[test]
fn killed_peer_is_an_error_on_its_connection_only() {
    let b = TestBroker::start();
    let mut streamer = ChildProc::spawn("streamer", &b.socket, &[("FIDO_TEST_SERVICE", "kill-me")]);
    let child_id: u64 = streamer.expect_line("id", Duration::from_secs(10)).parse().unwrap();
    let d = b.join("survivor");
    let watch = d.watch(&format!("/domain/{child_id}")).unwrap();
    // A second, unrelated connection that must keep working.
    let other = b.join("bystander");
    let l = other.offer("bystander-svc").unwrap();
    let side = d.connect("bystander-svc").unwrap();
    let side_peer = l.accept().unwrap();

    let ch = connect_retry(&d, "kill-me", Duration::from_secs(10));
    let mut held = Vec::new();
    for expect in 0..50u64 {
        let m = ch.recv().unwrap();
        assert_eq!(check(m.as_slice().unwrap()).0, expect);
        if expect % 10 == 0 {
            held.push(m);
        }
    }
    streamer.kill9();
    // Drain what was published before the death, then a clear error.
    let deadline = Instant::now() + Duration::from_secs(5);
    let err = loop {
        match ch.recv_timeout(Duration::from_secs(5)) {
            Ok(m) => {
                check(m.as_slice().unwrap());
            }
            Err(e) => break e,
        }
        assert!(Instant::now() < deadline, "no error after the peer died");
    };
    assert!(matches!(err, Error::PeerGone { .. }), "got {err:?}");
    // Messages already received stay readable (the dead peer's memory stays mapped).
    for (i, m) in held.iter().enumerate() {
        assert_eq!(check(m.as_slice().unwrap()).0, i as u64 * 10);
    }
    // The registry watch fired: the dead domain's keys were deleted.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let ev = watch.recv_timeout(Duration::from_secs(5)).expect("watch event for the dead domain");
        if ev.value.is_none() {
            break;
        }
        assert!(Instant::now() < deadline);
    }
    // The bystander connection is unaffected.
    let mut buf = d.alloc(8).unwrap();
    buf.copy_from_slice(b"still ok");
    side.send(buf).unwrap();
    assert_eq!(side_peer.recv_timeout(Duration::from_secs(5)).unwrap().as_slice().unwrap(), b"still ok");
}

#[test]
fn unreleased_messages_come_back_as_undelivered() {
    let b = TestBroker::start();
    let d = b.join("sender");
    let l = d.offer("holder-svc").unwrap();
    let mut holder = ChildProc::spawn("holder", &b.socket, &[("FIDO_TEST_SERVICE", "holder-svc")]);
    let ch = l.accept_timeout(Duration::from_secs(10)).unwrap();
    for tag in 0..20u64 {
        let mut buf = d.alloc(64).unwrap();
        fill(&mut buf, tag, 0);
        ch.send(fido::Message::new(buf).tag(tag)).unwrap();
    }
    loop {
        if holder.expect_line("got", Duration::from_secs(10)) == "20" {
            break;
        }
    }
    assert_eq!(ch.in_flight(), 20);
    holder.kill9();
    let deadline = Instant::now() + Duration::from_secs(5);
    let err = loop {
        let mut buf = d.alloc(64).unwrap();
        fill(&mut buf, 99, 0);
        match ch.send_timeout(fido::Message::new(buf).tag(99), Duration::from_millis(100)) {
            Err(e) if !matches!(e.error, Error::Timeout) => {
                assert_eq!(e.message.get_tag(), 99, "the failed message comes back");
                break e.error;
            }
            _ => {}
        }
        assert!(Instant::now() < deadline, "send kept succeeding after the peer died");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(matches!(err, Error::PeerGone { .. }), "got {err:?}");
    let mut tags: Vec<u64> = ch.take_undelivered().iter().map(|u| u.tag).collect();
    tags.sort();
    // The 20 the holder kept, plus any probe (tag 99) that was sent before the
    // death was noticed: all of them were never released, all come back.
    let probes = tags.iter().filter(|t| **t == 99).count();
    assert_eq!(tags[..tags.len() - probes], (0..20).collect::<Vec<_>>(), "every unreleased message reported");
    assert!(ch.take_undelivered().is_empty(), "reported once");
}

#[test]
fn hung_peer_is_detected_by_heartbeat() {
    let b = TestBroker::start();
    let mut streamer = ChildProc::spawn("streamer", &b.socket, &[("FIDO_TEST_SERVICE", "hang-me")]);
    streamer.expect_line("id", Duration::from_secs(10));
    let d = b.join("observer");
    let ch = connect_retry(&d, "hang-me", Duration::from_secs(10));
    ch.set_wait(WaitStrategy::Block);
    ch.recv().unwrap();
    streamer.signal(rustix::process::Signal::STOP);
    let started = Instant::now();
    let err = loop {
        match ch.recv_timeout(Duration::from_secs(10)) {
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    assert!(matches!(err, Error::PeerGone { reason: "missed heartbeats", .. }), "got {err:?}");
    // 5 × 100 ms heartbeats, plus scheduling slack.
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    streamer.signal(rustix::process::Signal::CONT);
    streamer.kill9();
}

#[test]
fn micro_reboot_under_the_same_service_name() {
    let b = TestBroker::start();
    let d = b.join("client");
    let round_trip = |ch: &fido::Channel| {
        let mut buf = d.alloc(16).unwrap();
        fill(&mut buf, 5, 0);
        ch.send(buf).unwrap();
        let m = ch.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(check(m.as_slice().unwrap()).0, 5);
    };
    let mut first = ChildProc::spawn("echo", &b.socket, &[("FIDO_TEST_SERVICE", "reboot-svc")]);
    let id1: u64 = first.expect_line("ready", Duration::from_secs(10)).parse().unwrap();
    let ch = connect_retry(&d, "reboot-svc", Duration::from_secs(10));
    round_trip(&ch);
    first.kill9();
    assert!(matches!(ch.recv_timeout(Duration::from_secs(5)), Err(Error::PeerGone { .. })));
    let mut second = ChildProc::spawn("echo", &b.socket, &[("FIDO_TEST_SERVICE", "reboot-svc")]);
    let id2: u64 = second.expect_line("ready", Duration::from_secs(10)).parse().unwrap();
    assert!(id2 > id1, "domain ids are never reused");
    let ch2 = connect_retry(&d, "reboot-svc", Duration::from_secs(10));
    round_trip(&ch2);
    second.kill9();
}

#[test]
fn broker_restart_does_not_interrupt_a_stream() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("broker.sock");
    let state = dir.path().join("state");
    let state_s = state.to_str().unwrap().to_string();
    let mut broker = ChildProc::spawn("broker", &socket, &[("FIDO_TEST_STATE", &state_s)]);
    broker.expect_line("ready", Duration::from_secs(10));
    let mut streamer = ChildProc::spawn("streamer", &socket, &[("FIDO_TEST_SERVICE", "long-stream")]);
    let streamer_id: u64 = streamer.expect_line("id", Duration::from_secs(10)).parse().unwrap();
    let d = Domain::join(JoinOptions::new("listener").broker(&socket).arena_len(64 << 20)).unwrap();
    let ch = connect_retry(&d, "long-stream", Duration::from_secs(10));
    let mut next = 0u64;
    let recv_for = |dur: Duration, next: &mut u64| {
        let end = Instant::now() + dur;
        while Instant::now() < end {
            let m = ch.recv_timeout(Duration::from_secs(2)).expect("stream interrupted");
            assert_eq!(check(m.as_slice().unwrap()).0, *next);
            *next += 1;
        }
    };
    recv_for(Duration::from_millis(200), &mut next);
    broker.kill9();
    let before = next;
    // The broker is dead: the data path goes on.
    recv_for(Duration::from_millis(500), &mut next);
    assert!(next > before, "no message while the broker was down");
    let mut broker2 = ChildProc::spawn("broker", &socket, &[("FIDO_TEST_STATE", &state_s)]);
    broker2.expect_line("ready", Duration::from_secs(10));
    recv_for(Duration::from_millis(300), &mut next);
    // Both domains re-registered with their old ids.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(status) = d.status() {
            let ids: Vec<u64> = status.domains.iter().map(|x| x.domain).collect();
            if ids.contains(&d.id()) && ids.contains(&streamer_id) {
                assert!(status.connections.iter().any(|c| c.conn == ch.id()), "connection re-registered");
                break;
            }
        }
        assert!(Instant::now() < deadline, "domains did not re-register");
        std::thread::sleep(Duration::from_millis(50));
    }
    d.write("/app/after-restart", b"yes").unwrap();
    assert_eq!(d.read("/app/after-restart").unwrap().as_deref(), Some(&b"yes"[..]));
    recv_for(Duration::from_millis(200), &mut next);
    streamer.kill9();
    broker2.kill9();
}

#[test]
fn a_peer_writing_our_memory_dies_alone() {
    let b = TestBroker::start();
    let d = b.join("owner");
    let l = d.offer("vandal-svc").unwrap();
    let mut vandal = ChildProc::spawn("vandal", &b.socket, &[("FIDO_TEST_SERVICE", "vandal-svc")]);
    let ch = l.accept_timeout(Duration::from_secs(10)).unwrap();
    let mut buf = d.alloc(64).unwrap();
    fill(&mut buf, 1, 0);
    ch.send(buf).unwrap();
    vandal.expect_line("writing", Duration::from_secs(10));
    let status = vandal.child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(rustix::process::Signal::SEGV.as_raw()), "the write must fault: {status:?}");
    // Our memory is intact and we carry on: the message comes back undelivered.
    let err = ch.recv_timeout(Duration::from_secs(5)).unwrap_err();
    assert!(matches!(err, Error::PeerGone { .. }), "got {err:?}");
    let undelivered = ch.take_undelivered();
    assert_eq!(undelivered.len(), 1);
    let bufs = undelivered.into_iter().next().unwrap().message.into_bufs();
    assert_eq!(check(fido::PeerSlice::from_own(&bufs[0])).0, 1, "payload untouched");
}

/// Waits until `ch` has nothing in flight (collecting releases), or panics.
fn wait_released(ch: &fido::Channel, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while ch.in_flight_checked().unwrap() > 0 {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Three domains downstream of one: a message a forwarder shares with two
/// peers (`forward_shared`, `Message::shared_part`) reaches both by pointer,
/// and its sender gets the release only after both released it and the
/// forwarder dropped its own reference; nothing is copied on the way.
#[test]
fn shared_forward_releases_upstream_after_the_last_downstream() {
    let b = TestBroker::start();
    let src = b.join_with(JoinOptions::new("source").arena_len(16 << 20));
    let fwd = b.join_with(JoinOptions::new("forwarder").arena_len(16 << 20).swizzle(true));
    let d1 = b.join_with(JoinOptions::new("mirror-1").arena_len(16 << 20).swizzle(true));
    let d2 = b.join_with(JoinOptions::new("mirror-2").arena_len(16 << 20).swizzle(true));
    let accept_from = |server: &Domain, client: &Domain, service: &str| {
        let l = server.offer(service).unwrap();
        let c = client.connect(service).unwrap();
        (c, l.accept_timeout(Duration::from_secs(5)).unwrap())
    };
    let (src_out, fwd_in) = accept_from(&fwd, &src, "shared-in");
    let (fwd_out1, d1_in) = accept_from(&d1, &fwd, "shared-d1");
    let (fwd_out2, d2_in) = accept_from(&d2, &fwd, "shared-d2");

    // A header and a payload, gathered, as a block client's write.
    let mut header = src.alloc(16).unwrap();
    header.fill(0xaa);
    let mut payload = src.alloc(SIZE).unwrap();
    let payload_g = payload.gptr().addr();
    fill(&mut payload, 5, payload_g);
    src_out.send(fido::Message::gather(vec![header, payload]).tag(42).opcode(2)).unwrap();
    let m = std::sync::Arc::new(fwd_in.recv_timeout(Duration::from_secs(5)).unwrap());
    let sent: Vec<(u64, usize)> = m.global_segments().map(|(g, l)| (g.addr(), l)).collect();
    // Mirror 1 gets the message as received; mirror 2 a header of the
    // forwarder's own and only the payload, by pointer.
    fwd_out1.forward_shared(&m).unwrap();
    let mut own_header = fwd.alloc(16).unwrap();
    own_header.fill(0x55);
    fwd_out2.send(fido::Message::shared_part(vec![own_header], &m, 16, SIZE).unwrap().tag(7)).unwrap();
    drop(m);

    let got1 = d1_in.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!((got1.tag(), got1.opcode(), got1.len()), (42, 2, 16 + SIZE));
    assert_eq!(got1.global_segments().map(|(g, l)| (g.addr(), l)).collect::<Vec<_>>(), sent, "the same pointers");
    let got2 = d2_in.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!((got2.tag(), got2.len(), got2.segment_count()), (7, 16 + SIZE, 2));
    let segs2: Vec<(u64, usize)> = got2.global_segments().map(|(g, l)| (g.addr(), l)).collect();
    assert_eq!(segs2[1], (payload_g, SIZE), "the payload by pointer");
    assert!(got2.segments().next().unwrap().iter().all(|x| x == 0x55), "the forwarder's header");
    let (seq, _) = check(got2.segments().nth(1).unwrap());
    assert_eq!(seq, 5);

    // Mirror 1 releases: the source still waits for mirror 2.
    drop(got1);
    wait_released(&fwd_out1, "mirror 1's release reached the forwarder");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(src_out.in_flight_checked().unwrap(), 1, "released before mirror 2 did");
    drop(got2);
    wait_released(&fwd_out2, "mirror 2's release reached the forwarder");
    wait_released(&src_out, "the source got its release after both mirrors");

    // Pieces of two messages gathered into one, by pointer.
    let mut pieces = Vec::new();
    for seq in [1u64, 2] {
        let mut buf = src.alloc(SIZE).unwrap();
        let g = buf.gptr().addr();
        fill(&mut buf, seq, g);
        src_out.send(fido::Message::new(buf)).unwrap();
        pieces.push((std::sync::Arc::new(fwd_in.recv_timeout(Duration::from_secs(5)).unwrap()), g));
    }
    let parts = vec![(pieces[0].0.clone(), 0..SIZE), (pieces[1].0.clone(), 100..300)];
    fwd_out1.send(fido::Message::shared_gather(vec![], parts).unwrap()).unwrap();
    let ranges: Vec<u64> = pieces.iter().map(|p| p.1).collect();
    drop(pieces);
    let got = d1_in.recv_timeout(Duration::from_secs(5)).unwrap();
    let segs: Vec<(u64, usize)> = got.global_segments().map(|(g, l)| (g.addr(), l)).collect();
    assert_eq!(segs, vec![(ranges[0], SIZE), (ranges[1] + 100, 200)]);
    assert_eq!(check(got.segments().next().unwrap()).0, 1);
    drop(got);
    wait_released(&fwd_out1, "the gathered message released");
    wait_released(&src_out, "both pieces released upstream");

    // Parts that cannot be shared are refused; nothing was copied anywhere
    // the payload went through.
    src_out.send_inline(1, 0, b"inline").unwrap();
    let inline = std::sync::Arc::new(fwd_in.recv_timeout(Duration::from_secs(5)).unwrap());
    assert!(matches!(fido::Message::shared_part(vec![], &inline, 0, 3), Err(Error::Invalid(fido::InvalidArgument::SharedPart(_)))));
    assert!(matches!(fido::Message::shared_part(vec![], &inline, 7, 0), Err(Error::Invalid(fido::InvalidArgument::SharedPart(_)))));
    fwd_out1.forward_shared(&inline).unwrap();
    drop(inline);
    assert_eq!(d1_in.recv_timeout(Duration::from_secs(5)).unwrap().inline_bytes(), Some(&b"inline"[..]));
    wait_released(&fwd_out1, "the inline forward released");
    wait_released(&src_out, "the inline message released upstream");
    assert_eq!(fwd.counters().bytes_copied, 0, "the forwarder copied nothing");
    assert_eq!(src.counters().bytes_copied, 0);
}

/// A downstream that dies holding a shared message gives its reference back
/// as undelivered: the upstream sender gets its release once the other
/// downstream released and that undelivered message is dropped — once (a
/// second release would be a lie that breaks the source's channel).
#[test]
fn shared_forward_to_a_dying_downstream_releases_once() {
    let b = TestBroker::start();
    let src = b.join_with(JoinOptions::new("source").arena_len(16 << 20));
    let fwd = b.join_with(JoinOptions::new("forwarder").arena_len(16 << 20).swizzle(true));
    let d1 = b.join_with(JoinOptions::new("mirror-1").arena_len(16 << 20).swizzle(true));
    let l_in = fwd.offer("dying-in").unwrap();
    let src_out = src.connect("dying-in").unwrap();
    let fwd_in = l_in.accept_timeout(Duration::from_secs(5)).unwrap();
    let l1 = d1.offer("dying-d1").unwrap();
    let fwd_out1 = fwd.connect("dying-d1").unwrap();
    let d1_in = l1.accept_timeout(Duration::from_secs(5)).unwrap();
    let l2 = fwd.offer("dying-d2").unwrap();
    let mut holder = ChildProc::spawn("holder", &b.socket, &[("FIDO_TEST_SERVICE", "dying-d2")]);
    let fwd_out2 = l2.accept_timeout(Duration::from_secs(10)).unwrap();

    for seq in 0..3u64 {
        let mut buf = src.alloc(SIZE).unwrap();
        let g = buf.gptr().addr();
        fill(&mut buf, seq, g);
        src_out.send(fido::Message::new(buf).tag(seq)).unwrap();
        let m = std::sync::Arc::new(fwd_in.recv_timeout(Duration::from_secs(5)).unwrap());
        fwd_out1.forward_shared(&m).unwrap();
        fwd_out2.forward_shared(&m).unwrap();
    }
    while holder.expect_line("got", Duration::from_secs(10)) != "3" {}
    for seq in 0..3u64 {
        let m = d1_in.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(check(m.as_slice().unwrap()).0, seq);
    }
    wait_released(&fwd_out1, "mirror 1 released");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(src_out.in_flight_checked().unwrap(), 3, "released while the holder still holds them");

    holder.kill9();
    let deadline = Instant::now() + Duration::from_secs(10);
    let undelivered = loop {
        let u = fwd_out2.take_undelivered();
        if !u.is_empty() {
            break u;
        }
        assert!(Instant::now() < deadline, "the dead holder's messages never came back");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(undelivered.iter().map(|u| u.tag).collect::<Vec<_>>(), vec![0, 1, 2]);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(src_out.in_flight_checked().unwrap(), 3, "the undelivered messages still hold their references");
    drop(undelivered);
    wait_released(&src_out, "dropping the undelivered messages released them upstream");
    // Exactly once: the source's channel is healthy and carries on.
    let mut buf = src.alloc(SIZE).unwrap();
    fill(&mut buf, 9, 0);
    src_out.send(fido::Message::new(buf).tag(9)).unwrap();
    let m = fwd_in.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(m.tag(), 9);
    drop(m);
    wait_released(&src_out, "a later message released");
    assert!(src_out.is_open());
    assert_eq!(fwd.counters().bytes_copied, 0);
}
