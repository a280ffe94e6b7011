//! Replays the committed `guest_link` fuzz corpus (fuzz/corpus/guest_link/)
//! through the same stateful check the fuzz target runs
//! (fuzz/src/guest_link.rs: a hostile guest's link bytes and the broker's
//! frames drive a supervisor's `Relay` with fake devices and a real broker
//! socket; what reaches the broker, the guest and the devices is checked
//! after every step), on the stable toolchain and without libFuzzer; and
//! pins the relay bugs the harness found (`regressions` below; the seeds
//! `seed-incoming-limit` and `seed-vectors-reused` break the property
//! without their fixes).
//!
//! `cargo test --release -p fido-vm --test guest_link_corpus -- --ignored regenerate_seeds`
//! rewrites the hand-written seed programs (`seed-*`); files the fuzzer
//! added are left alone.

use std::path::{Path, PathBuf};

#[path = "../../../fuzz/src/guest_link.rs"]
#[allow(dead_code)]
mod guest_link;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

fn replay_dir(dir: &Path) -> (usize, usize) {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    let mut steps = 0;
    for f in &files {
        let data = std::fs::read(f).unwrap();
        match std::panic::catch_unwind(|| guest_link::run(&data)) {
            Ok(o) => steps += o.steps,
            Err(_) => panic!("input {} violates the property (replay it with FIDO_FUZZ_TRACE=1 FIDO_FUZZ_INPUT=…, see fuzz/README.md)", f.display()),
        }
    }
    (files.len(), steps)
}

#[test]
fn guest_link_corpus() {
    let (n, steps) = replay_dir(&fuzz_dir().join("corpus/guest_link"));
    assert!(n >= seeds().len(), "corpus missing");
    eprintln!("guest_link: {n} inputs, {steps} steps");
}

/// `FIDO_FUZZ_INPUT=FILE [FIDO_FUZZ_TRACE=1]`: runs one input.
#[test]
#[ignore = "runs $FIDO_FUZZ_INPUT; by hand"]
fn replay_one() {
    let path = std::env::var("FIDO_FUZZ_INPUT").expect("FIDO_FUZZ_INPUT");
    let o = guest_link::run(&std::fs::read(path).unwrap());
    eprintln!("{o:?}");
}

// ---- regressions: relay bugs the harness found -----------------------------

use fido_proto::guest::{GuestMsg, HostMsg, LINK_VERSION};
use fido_proto::{BrokerMsg, ClientMsg, ErrorCode, Request, RingBlock};
use guest_link::{World, LIMIT};

const BLOCK: RingBlock = RingBlock { offset: 4096, len: 8192, entries: 64 };

fn joined() -> World {
    let mut w = World::new();
    w.guest_msg(&GuestMsg::Hello { version: LINK_VERSION }, 0);
    let join = Request::Join { name: "app".into(), label: None, arena_len: guest_link::ARENA_LEN, resume: None };
    w.guest_request(1, join, vec![]);
    assert_eq!(w.last_forwarded.len(), 1, "the Join reaches the broker");
    w
}

/// The error code of the refusal the relay answered the last request with.
fn refusal(w: &World) -> Option<ErrorCode> {
    w.last_host.iter().find_map(|m| match m {
        HostMsg::Frame { frame, .. } => match fido_proto::decode::<BrokerMsg>(frame) {
            Ok(BrokerMsg::Reply { body: Err(e), .. }) => Some(e.code),
            _ => None,
        },
        _ => None,
    })
}

/// Bug: a connection announced by `Incoming` was counted against the limit
/// again when the guest accepted it, so a VM with `LIMIT - 1` connections
/// could not accept one more (the Accept was refused with `Quota`; the
/// guest's fire-and-forget accept never reached the broker).
#[test]
fn the_last_connection_can_be_accepted() {
    let mut w = joined();
    for i in 0..LIMIT as u16 - 1 {
        let id = 10 + u64::from(i);
        w.guest_request(id, Request::Connect { service: "s".into(), block: BLOCK }, vec![1 + 2 * i, 2 + 2 * i]);
        assert_eq!(w.last_forwarded.len(), 1, "connect {i} reaches the broker");
        w.inject_connected(id, 0);
    }
    assert_eq!(w.relay().connections(), LIMIT - 1);
    let conn = w.inject_incoming(1);
    assert_eq!(w.last_host.len(), 1, "the guest sees the incoming connection");
    let v = 2 * LIMIT as u16 - 1;
    w.guest_request(50, Request::Accept { conn, block: BLOCK }, vec![v, v + 1]);
    assert_eq!(refusal(&w), None, "the accept was refused: {:?}", w.last_host);
    assert!(matches!(w.last_forwarded.as_slice(), [ClientMsg::Request { body: Request::Accept { .. }, .. }]), "{:?}", w.last_forwarded);
    assert_eq!(w.relay().connections(), LIMIT);
}

/// Bug: every `Incoming` added a connection (two peer doorbells in QEMU, a
/// hot-plugged arena, a liveness socket) with no limit, and once more were
/// announced than the VM could hold, every Accept was refused — even with
/// no connection established. Now an Incoming beyond the limit is refused
/// by the relay before any device is touched, and the guest never sees it.
#[test]
fn incoming_beyond_the_limit_is_refused_by_the_relay() {
    let mut w = joined();
    let conns: Vec<u64> = (0..LIMIT).map(|i| w.inject_incoming(i % 2)).collect();
    assert_eq!(w.relay().connections(), LIMIT);
    let held = w.devices_held();
    w.inject_incoming(4);
    assert!(w.last_host.is_empty(), "the guest was shown a connection it cannot take: {:?}", w.last_host);
    assert!(
        matches!(w.last_forwarded.as_slice(), [ClientMsg::Request { id, body: Request::Refuse { .. } }] if id >> 63 == 1),
        "the relay refuses it itself: {:?}",
        w.last_forwarded
    );
    assert_eq!(w.devices_held(), held, "no device was touched");
    assert_eq!(w.relay().connections(), LIMIT);
    // Each of the LIMIT announced connections can still be accepted.
    for (i, conn) in conns.into_iter().enumerate() {
        let v = 1 + 2 * i as u16;
        w.guest_request(60 + i as u64, Request::Accept { conn, block: BLOCK }, vec![v, v + 1]);
        assert_eq!(refusal(&w), None, "accept {i} was refused");
    }
}

/// Bug: a second `Connect` with the id of one in flight replaced the
/// first's vectors in the relay's books while the broker could still
/// connect the first: two connections could then be given one vector.
#[test]
fn a_connect_id_in_flight_cannot_be_reused() {
    let mut w = joined();
    w.guest_request(7, Request::Connect { service: "s".into(), block: BLOCK }, vec![1, 2]);
    assert_eq!(w.last_forwarded.len(), 1);
    w.guest_request(7, Request::Connect { service: "s".into(), block: BLOCK }, vec![3, 4]);
    assert_eq!(refusal(&w), Some(ErrorCode::BadRequest));
    assert!(w.last_forwarded.is_empty());
    // Once answered, the id is free again.
    w.inject_connected(7, 0);
    w.guest_request(7, Request::Connect { service: "s".into(), block: BLOCK }, vec![3, 4]);
    assert_eq!(refusal(&w), None);
    assert_eq!(w.last_forwarded.len(), 1);
}

/// Bug: when a connection failed at once because a peer doorbell could not
/// be given to QEMU, the peer's arena — already hot-plugged for it — stayed
/// plugged: the guest never maps it, so never says `Unmapped`, and the port
/// was lost until the guest's session ended (and the broker kept the grant).
#[test]
fn the_arena_of_a_connection_that_failed_at_once_is_unplugged() {
    let mut w = joined();
    w.fail_peer_bells(true);
    w.guest_request(7, Request::Connect { service: "s".into(), block: BLOCK }, vec![1, 2]);
    w.inject_connected(7, 0);
    assert_eq!(w.devices_held(), (0, 0), "the connect failed: nothing stays plugged");
    let sent = |w: &World| -> Vec<&'static str> {
        w.last_forwarded
            .iter()
            .map(|m| match m {
                ClientMsg::Request { body: Request::Close { .. }, .. } => "Close",
                ClientMsg::Request { body: Request::Refuse { .. }, .. } => "Refuse",
                ClientMsg::Request { body: Request::Unmapped { slot: 1, owner: 1 }, .. } => "Unmapped",
                _ => "other",
            })
            .collect()
    };
    assert_eq!(sent(&w), ["Close", "Unmapped"], "the relay closes and reports the arena unmapped");
    w.inject_incoming(0);
    assert!(w.last_host.is_empty(), "the guest never sees it");
    assert_eq!(w.devices_held(), (0, 0));
    assert_eq!(sent(&w), ["Refuse", "Unmapped"]);
    // With doorbells back, the same peer connects and its arena stays.
    w.fail_peer_bells(false);
    w.inject_incoming(1);
    assert_eq!(w.devices_held(), (1, 2));
    assert_eq!(w.relay().connections(), 1);
}

/// A connection that fails at once while the broker dies: the relay's own
/// Close (and Unmapped) cannot be sent, and must not open a fresh broker
/// connection to send them on (a domain-less session the guest never asked
/// for; the fake line panics if the relay connects outside a guest step).
#[test]
fn the_relay_opens_no_broker_connection_of_its_own() {
    let mut w = joined();
    w.fail_peer_bells(true);
    w.guest_request(7, Request::Connect { service: "s".into(), block: BLOCK }, vec![1, 2]);
    w.die_after_send = true;
    w.inject_connected(7, 0);
    assert!(w.last_host.contains(&HostMsg::BrokerClosed), "{:?}", w.last_host);
    assert!(w.relay().broker_fd().is_none());
    assert_eq!(w.devices_held(), (0, 0));
}

// ---- seeds ----------------------------------------------------------------
// Opcodes (the first byte of a step, mod 16): 0..=4 guest message, 5..=9
// broker frame, 10 raw guest bytes, 11 broker hangs up, 12 liveness
// hang-up, 13 tick, 14 failures, 15 a broker frame, then the broker dies.

/// A guest message step: split point, kind (0 Hello, 2 Reconnect, 3
/// heartbeat, 5.. a request: id byte, request kind, then its arguments).
fn hello() -> Vec<u8> {
    vec![0, 0, 0]
}
fn request(id: u8, kind: u8, args: &[u8]) -> Vec<u8> {
    let mut v = vec![0, 0, 5, id, kind];
    v.extend_from_slice(args);
    v
}
/// Connect (request kind 1) with vectors `a`, `b` (bell byte < 200: the two named).
fn connect(id: u8, a: u8, b: u8) -> Vec<u8> {
    request(id, 1, &[0, 0, a, b])
}
/// Accept (request kind 3) of the `conn_pick`th known connection with vectors `a`, `b`.
fn accept(id: u8, conn_pick: u8, a: u8, b: u8) -> Vec<u8> {
    request(id, 3, &[conn_pick, 0, a, b])
}
/// Broker step: kind (0 Connected, 3 Incoming, 5 Grant, 6 PeerGone, 7
/// Closed, 8 error, 9 own answer, 11 garbage).
fn broker(kind: u8, args: &[u8]) -> Vec<u8> {
    let mut v = vec![5, kind];
    v.extend_from_slice(args);
    v
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let join = request(1, 0, &[0, 0, 0, 0]);
    // Connected for the first pending Connect, peer 1 (4 KiB), four fds.
    let connected = broker(0, &[0, 0, 3]);
    // Incoming from peer 2 (64 KiB), four fds.
    let incoming = |peer: u8| broker(3, &[peer, 3]);
    vec![
        ("join", [hello(), join.clone()].concat()),
        (
            "connect-connected-close",
            [hello(), join.clone(), connect(2, 1, 2), connected.clone(), request(3, 5, &[0, 0]), request(4, 7, &[0, 0])].concat(),
        ),
        // Peer 3's arena (3000 bytes) fits no port: the connect fails, the relay closes it.
        ("connected-unsupported", [hello(), connect(2, 1, 2), broker(0, &[0, 2, 3])].concat()),
        ("incoming-accept", [hello(), join.clone(), incoming(1), accept(3, 0, 3, 4)].concat()),
        // LIMIT Incomings, then all accepted: each accept must pass.
        (
            "incoming-limit",
            [hello(), join.clone(), incoming(0), incoming(1), incoming(4), incoming(5), incoming(0), accept(2, 0, 1, 2), accept(3, 1, 3, 4), accept(4, 2, 5, 6), accept(5, 3, 7, 8)].concat(),
        ),
        ("vectors-reused", [hello(), connect(2, 1, 2), connect(3, 2, 3), connect(4, 0, 9), connect(2, 5, 6), connect(5, 1, 1)].concat()),
        ("grant-unmapped", [hello(), request(2, 8, &[1, 0]), broker(5, &[2, 0, 3]), request(3, 7, &[0, 0])].concat()),
        ("host-fds-refused", [hello(), request(2, 9, &[0, 0]), request(3, 9, &[1, 0]), request(4, 9, &[3, 0])].concat()),
        (
            "peer-gone-hangup-tick",
            [hello(), connect(2, 1, 2), connected.clone(), broker(6, &[40, 0]), vec![12, 0], vec![13, 0xfe], vec![13, 1]].concat(),
        ),
        ("broker-hangs-up-reconnect", [hello(), connect(2, 1, 2), vec![11], vec![0, 0, 2], connect(2, 1, 2)].concat()),
        ("failures", [hello(), vec![14, 0x1f], connect(2, 1, 2), vec![14, 0x0f], join.clone(), incoming(1), vec![14, 0], incoming(1)].concat()),
        ("raw-garbage", [hello(), vec![10, 20, 3], vec![0xff; 20]].concat()),
        ("bad-version", vec![0, 0, 1, 7]),
        ("own-answer", [hello(), connect(2, 1, 2), broker(0, &[0, 2, 3]), broker(9, &[0, 0])].concat()),
    ]
}

#[test]
fn seeds_pass() {
    let mut failed = Vec::new();
    for (name, s) in seeds() {
        match std::panic::catch_unwind(|| guest_link::run(&s)) {
            Ok(o) => {
                assert!(o.steps >= 1, "seed {name} ran no step");
                eprintln!("{name}: {o:?}");
            }
            Err(_) => failed.push(name),
        }
    }
    assert!(failed.is_empty(), "seeds that violate the property: {failed:?}");
}

#[test]
#[ignore = "writes fuzz/corpus/guest_link/seed-*; run by hand"]
fn regenerate_seeds() {
    let dir = fuzz_dir().join("corpus/guest_link");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, s) in seeds() {
        std::fs::write(dir.join(format!("seed-{name}")), s).unwrap();
    }
}

/// Random programs (a quick stand-in for the fuzzer where cargo-fuzz is
/// missing): `FIDO_FUZZ_RANDOM=N` programs, the first failing one written to
/// `$TMPDIR/guest_link-failure`.
#[test]
#[ignore = "random programs; by hand"]
fn random_programs() {
    let n: u64 = std::env::var("FIDO_FUZZ_RANDOM").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for i in 0..n {
        let len = (next() % 600) as usize;
        let data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        if std::panic::catch_unwind(|| guest_link::run(&data)).is_err() {
            let path = std::env::temp_dir().join("guest_link-failure");
            std::fs::write(&path, &data).unwrap();
            panic!("program {i} violates the property: {}", path.display());
        }
    }
}
