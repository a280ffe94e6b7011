//! Replays the committed fuzz corpora (fuzz/corpus/proto_client_msg/ and
//! fuzz/corpus/proto_broker_msg/) through the same property the fuzz targets
//! check (fuzz/src/proto_check.rs), on the stable toolchain and without
//! libFuzzer, so every CI run re-checks every input the fuzzers ever kept.
//!
//! `cargo test -p fido-proto --test corpus -- --ignored regenerate_seeds`
//! rewrites the hand-written seed files (`seed-*`); files the fuzzer added are
//! left alone.

use std::path::{Path, PathBuf};

use fido_proto::*;

#[path = "../../../fuzz/src/proto_check.rs"]
mod proto_check;

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target)
}

fn replay<T>(target: &str) -> (usize, usize)
where
    T: serde::de::DeserializeOwned + serde::Serialize + Validate + PartialEq + std::fmt::Debug,
{
    let dir = corpus_dir(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "empty corpus {}", dir.display());
    let mut accepted = 0;
    for f in &files {
        let data = std::fs::read(f).unwrap();
        let ok = std::panic::catch_unwind(|| proto_check::round_trip::<T>(&data))
            .unwrap_or_else(|_| panic!("corpus input {} violates the property", f.display()));
        accepted += ok as usize;
    }
    (files.len(), accepted)
}

#[test]
fn client_msg_corpus() {
    let (n, ok) = replay::<ClientMsg>("proto_client_msg");
    eprintln!("proto_client_msg: {n} inputs, {ok} decode");
    assert!(ok > 0, "no corpus input decodes: the seeds are stale");
}

#[test]
fn broker_msg_corpus() {
    let (n, ok) = replay::<BrokerMsg>("proto_broker_msg");
    eprintln!("proto_broker_msg: {n} inputs, {ok} decode");
    assert!(ok > 0, "no corpus input decodes: the seeds are stale");
}

fn block() -> RingBlock {
    RingBlock { offset: 4096, len: 8192, entries: 256 }
}

fn peer() -> PeerInfo {
    PeerInfo { domain: 2, name: "server".into(), slot: 3, arena_len: 1 << 20, uid: 1000, pid: 4242 }
}

fn client_seeds() -> Vec<ClientMsg> {
    let req = |id, body| ClientMsg::Request { id, body };
    vec![
        ClientMsg::Heartbeat,
        req(1, Request::Join { name: "app".into(), label: None, arena_len: 1 << 24, resume: None }),
        req(
            2,
            Request::Join {
                name: "app-2".into(),
                label: Some("gold".into()),
                arena_len: 1 << 30,
                resume: Some(Resume {
                    domain: 9,
                    slot: 4,
                    services: vec!["echo".into(), "kv:1".into()],
                    mapped: vec![(5, 10), (6, 11)],
                    connections: vec![(77, 10, "echo".into())],
                    watches: vec![(1, "/service".into()), (2, "/".into())],
                    secret: ResumeSecret([0x5a; 32]),
                }),
            },
        ),
        req(3, Request::Leave),
        req(4, Request::Offer { service: "echo".into() }),
        req(5, Request::Withdraw { service: "echo".into() }),
        req(6, Request::Connect { service: "echo".into(), block: block() }),
        req(7, Request::Accept { conn: 77, block: block() }),
        req(8, Request::Refuse { conn: 77, reason: "busy".into() }),
        req(9, Request::Close { conn: 77 }),
        req(10, Request::GrantSlot { slot: 5 }),
        req(11, Request::Unmapped { slot: 5, owner: 10 }),
        req(12, Request::Read { path: "/domain/3/name".into() }),
        req(13, Request::Write { path: "/app/x".into(), value: b"hello".to_vec() }),
        req(14, Request::List { path: "/".into() }),
        req(15, Request::Delete { path: "/app".into() }),
        req(16, Request::Watch { token: 1, prefix: "/service".into() }),
        req(17, Request::Unwatch { token: 1 }),
        req(
            18,
            Request::Transaction {
                ops: vec![
                    TxnOp::Check { path: "/lock".into(), expected: None },
                    TxnOp::Check { path: "/v".into(), expected: Some(b"1".to_vec()) },
                    TxnOp::Put { path: "/lock".into(), value: b"me".to_vec() },
                    TxnOp::Delete { path: "/old".into() },
                    TxnOp::Read { path: "/lock".into() },
                ],
            },
        ),
        req(19, Request::Status),
        req(
            u64::MAX,
            Request::Counters {
                counters: Counters {
                    messages_sent: 1,
                    messages_received: 2,
                    bytes_sent: 300,
                    bytes_received: 400,
                    bytes_copied: 0,
                    doorbells_rung: 5,
                    doorbells_suppressed: 6,
                },
            },
        ),
        req(40, Request::PipeCreate),
        req(41, Request::PipeRun { pipe: 1, op: PipeOp::FileToSocket { off: 4096, len: 1 << 20 } }),
        req(42, Request::PipeRun { pipe: 1, op: PipeOp::SocketToSocket { len: 1 } }),
        req(43, Request::PipeOnce { op: PipeOp::SocketToFile { off: 0, len: 0 } }),
        req(44, Request::PipeOnce { op: PipeOp::FileToFile { in_off: 1, len: 2, out_off: 3 } }),
        req(45, Request::PipeCancel { pipe: 1 }),
        req(46, Request::PipeDestroy { pipe: 1 }),
        req(47, Request::PipeWeight { domain: "web".into(), weight: 2 }),
        req(48, Request::StatusPage { cursor: StatusCursor::START }),
        req(49, Request::StatusPage { cursor: StatusCursor::Services { after: Some("echo".into()) } }),
        req(50, Request::ListPage { path: "/net/listen/80".into(), cursor: None }),
        req(51, Request::ListPage { path: "/a".into(), cursor: Some(ListCursor { key: "/a/b0".into(), inclusive: true }) }),
    ]
}

fn broker_seeds() -> Vec<BrokerMsg> {
    let ok = |id, r| BrokerMsg::Reply { id, body: Ok(r) };
    vec![
        ok(1, Reply::Ok),
        ok(2, Reply::Joined { domain: 3, slot: 1, geometry: PgvasGeometry::DEFAULT, heartbeat_ms: 500, resume_secret: ResumeSecret([7; 32]) }),
        ok(3, Reply::Connected { conn: 77, peer: peer(), block: block() }),
        ok(4, Reply::Grant { owner: 2, slot: 3, arena_len: 1 << 20 }),
        ok(5, Reply::Value(None)),
        ok(6, Reply::Value(Some(b"hello".to_vec()))),
        ok(7, Reply::Keys(vec!["a".into(), "b".into()])),
        ok(8, Reply::Txn { committed: true, reads: vec![None, Some(b"x".to_vec())] }),
        ok(
            9,
            Reply::Status(Status {
                broker_pid: 1,
                domains: vec![DomainStatus {
                    domain: 2,
                    name: "server".into(),
                    slot: 3,
                    pid: 4242,
                    uid: 1000,
                    arena_len: 1 << 20,
                    counters: Counters::default(),
                    label: Some("vm-a".into()),
                }],
                services: vec![("echo".into(), 2)],
                connections: vec![ConnStatus { conn: 77, service: "echo".into(), client: 3, server: 2 }],
                pipe_engine: Some(PipeEngineStatus { capacity: Some(1 << 30), calibrated: true, work_conserving: true, lanes: 4 }),
                pipes: vec![PipeDomainStatus { domain: 2, weight: 2, credits: -4096, bytes_per_s: 1 << 20, bytes_total: 1 << 30, pipes: 1, running: 1 }],
                next: Some(StatusCursor::Connections { after: Some(77) }),
            }),
        ),
        BrokerMsg::Reply { id: 10, body: Err(RemoteError::new(ErrorCode::NoSuchService, "no echo")) },
        BrokerMsg::Reply { id: 11, body: Err(RemoteError::new(ErrorCode::Internal, "")) },
        BrokerMsg::Event(Event::Incoming { conn: 78, service: "echo".into(), peer: peer(), block: block() }),
        BrokerMsg::Event(Event::PeerGone { domain: 2, conn: Some(77), reason: GoneReason::MissedHeartbeat }),
        BrokerMsg::Event(Event::PeerGone { domain: 2, conn: None, reason: GoneReason::Exited }),
        BrokerMsg::Event(Event::Closed { conn: 77 }),
        BrokerMsg::Event(Event::Watch { token: 1, path: "/service/echo".into(), value: Some(b"2".to_vec()) }),
        BrokerMsg::Event(Event::Watch { token: 1, path: "/service/echo".into(), value: None }),
        ok(12, Reply::PipeCreated { pipe: 5, source: PipeFdKind::File, sink: PipeFdKind::Stream }),
        ok(13, Reply::PipeDone(PipeResult { moved: 4096, consumed: 4096, end: PipeEnd::Eof })),
        ok(15, Reply::KeysPage { keys: vec!["b".into()], next: Some(ListCursor { key: "/a/b".into(), inclusive: false }) }),
        ok(14, Reply::PipeDone(PipeResult { moved: 1, consumed: 2, end: PipeEnd::Failed { errno: 32, message: "sink: EPIPE".into() } })),
    ]
}

fn write_seeds<T: serde::Serialize>(target: &str, msgs: &[T]) {
    let dir = corpus_dir(target);
    std::fs::create_dir_all(&dir).unwrap();
    for (i, m) in msgs.iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i:02}")), encode(m).unwrap()).unwrap();
    }
}

#[test]
fn seeds_are_valid() {
    for m in client_seeds() {
        assert_eq!(decode::<ClientMsg>(&encode(&m).unwrap()).unwrap(), m);
    }
    for m in broker_seeds() {
        assert_eq!(decode::<BrokerMsg>(&encode(&m).unwrap()).unwrap(), m);
    }
}

#[test]
#[ignore = "writes fuzz/corpus/proto_*/seed-*; run by hand"]
fn regenerate_seeds() {
    write_seeds("proto_client_msg", &client_seeds());
    write_seeds("proto_broker_msg", &broker_seeds());
}
