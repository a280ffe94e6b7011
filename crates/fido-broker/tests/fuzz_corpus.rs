//! Replays the committed `broker_session` fuzz corpus
//! (fuzz/corpus/broker_session/) through the same stateful check the fuzz
//! target runs (fuzz/src/broker_session.rs: simulated clients of uids 0,
//! 1001, 1002 and 1003 drive the broker's real request path in-process;
//! the broker's invariants, the arena-flow, identity, registry-ACL and
//! answer checks hold after every step), on the stable toolchain and
//! without libFuzzer.
//!
//! `cargo test --release -p fido-broker --test fuzz_corpus -- --ignored regenerate_seeds`
//! rewrites the hand-written seed programs (`seed-*`); files the fuzzer
//! added are left alone.

use std::path::{Path, PathBuf};

#[path = "../../../fuzz/src/broker_session.rs"]
#[allow(dead_code)]
mod broker_session;
use broker_session::{Op, OPS};

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/broker_session")
}

#[test]
fn broker_session_corpus() {
    let dir = corpus_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "empty corpus {}", dir.display());
    let mut steps = 0;
    for f in &files {
        let data = std::fs::read(f).unwrap();
        match std::panic::catch_unwind(|| broker_session::run(&data)) {
            Ok(o) => steps += o.steps,
            Err(_) => panic!("corpus input {} violates the property", f.display()),
        }
    }
    eprintln!("broker_session: {} inputs, {steps} steps", files.len());
}

#[test]
fn seeds_pass() {
    for (name, s) in seeds() {
        let o = broker_session::run(&s);
        assert!(o.steps > 0, "seed {name} ran no step");
    }
}

/// Inputs that showed a broker bug (fuzz/findings/broker_session/, see
/// fuzz/README.md): forged resumes of issue #16 that got bob alice's arena,
/// confirmed a made-up connection, or pinned a slot. Fixed; they must stay so.
/// The seed builders write `op as u8` as the opcode: that must be `op`'s
/// index in the session's table.
#[test]
fn opcodes_are_indices_into_the_step_table() {
    for (i, op) in OPS.iter().enumerate() {
        assert_eq!(*op as usize, i, "{op:?}");
    }
}

#[test]
fn findings_pass() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/findings/broker_session");
    let mut failed = Vec::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let f = e.unwrap().path();
        let data = std::fs::read(&f).unwrap();
        if std::panic::catch_unwind(|| broker_session::run(&data)).is_err() {
            failed.push(f.display().to_string());
        }
    }
    assert!(failed.is_empty(), "findings still failing: {failed:#?}");
}

/// `FIDO_FUZZ_INPUT=FILE FIDO_FUZZ_TRACE=1 cargo test --release -p fido-broker
/// --test fuzz_corpus -- --ignored replay_one --nocapture`: what one input
/// (a crash the fuzzer found, say) does, step by step.
#[test]
#[ignore]
fn replay_one() {
    let path = std::env::var("FIDO_FUZZ_INPUT").expect("FIDO_FUZZ_INPUT=FILE");
    let o = broker_session::run(&std::fs::read(&path).unwrap());
    eprintln!("{path}: {o:?}");
}

#[test]
#[ignore]
fn regenerate_seeds() {
    let dir = corpus_dir();
    std::fs::create_dir_all(&dir).unwrap();
    for (name, s) in seeds() {
        std::fs::write(dir.join(format!("seed-{name}")), s).unwrap();
    }
    let findings = corpus_dir().join("../../findings/broker_session");
    std::fs::create_dir_all(&findings).unwrap();
    for (name, s) in known_findings() {
        std::fs::write(findings.join(name), s).unwrap();
    }
}

/// Builds a program step by step (opcodes are indices into the session's
/// `OPS`), after its options byte (pipe engine on).
struct Program(Vec<u8>);

impl Default for Program {
    fn default() -> Self {
        Program(vec![1])
    }
}


/// Client indices in the session, in the order they connected.
const ROOT: u8 = 0;
const ALICE: u8 = 1;
const BOB: u8 = 2;
const MALLORY: u8 = 3;

impl Program {
    fn op(mut self, op: Op, args: &[u8]) -> Self {
        self.0.push(op as u8);
        self.0.extend_from_slice(args);
        self
    }
    /// Clients: root, alice, bob, mallory (uid index = client index).
    fn four_clients(self) -> Self {
        self.op(Op::Client, &[0])
            .op(Op::Client, &[1])
            .op(Op::Client, &[2])
            .op(Op::Client, &[3])
    }
    /// Client `c` joins with a real arena: name "app", no label, 64 KiB.
    fn join(self, c: u8) -> Self {
        self.op(Op::Join, &[c, 0, 1, 7, 7])
    }
    /// Client `c` offers / connects to SERVICES[s] (with two doorbells).
    fn offer(self, c: u8, s: u8) -> Self {
        self.op(Op::Offer, &[c, s])
    }
    fn connect(self, c: u8, s: u8) -> Self {
        self.op(Op::Connect, &[c, s, 0, 7])
    }
    /// Client `c` accepts its first incoming connection.
    fn accept(self, c: u8) -> Self {
        self.op(Op::Accept, &[c, 0, 0, 7])
    }
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let joined = || {
        Program::default()
            .four_clients()
            .join(ROOT)
            .join(ALICE)
            .join(BOB)
            .join(MALLORY)
    };
    vec![
        ("join-all", joined().op(Op::Status, &[ROOT]).0),
        (
            // alice serves alice-db to herself from a second domain; bob asks
            // for her slot; the grant follows the connection only.
            "connect-grant",
            joined()
                .offer(ALICE, 0)
                .op(Op::Client, &[1])
                .join(4)
                .connect(4, 0)
                .accept(ALICE)
                .op(Op::Grant, &[4, 1])
                .op(Op::Grant, &[BOB, 1])
                .op(Op::Grant, &[BOB, 2])
                .op(Op::Close, &[4, 0])
                .0,
        ),
        (
            "cross-user-connect",
            joined()
                .offer(ALICE, 0)
                .offer(BOB, 2)
                .offer(BOB, 0)
                .connect(BOB, 0)
                .connect(ALICE, 2)
                .connect(ROOT, 0)
                .accept(ALICE)
                .op(Op::Grant, &[ROOT, 1])
                .op(Op::Refuse, &[ALICE, 0])
                .0,
        ),
        (
            // Registry: own subtree, the other user's, /net, managed keys.
            "registry-acl",
            joined()
                .op(Op::Write, &[ALICE, 0, 4])
                .op(Op::Write, &[BOB, 0, 4])
                .op(Op::Write, &[BOB, 3, 4])
                .op(Op::Write, &[ALICE, 7, 1])
                .op(Op::Delete, &[BOB, 5])
                .op(Op::Delete, &[ALICE, 2])
                .op(Op::Write, &[ALICE, 11, 1])
                .op(Op::Txn, &[BOB, 2, 3, 0, 9, 0, 1, 1])
                .op(Op::Watch, &[ALICE, 0, 5])
                .op(Op::Write, &[ROOT, 0, 9])
                .op(Op::Read, &[BOB, 0])
                .op(Op::List, &[BOB, 5])
                .0,
        ),
        (
            // Quotas: alice writes keys until refused, connects until refused.
            "quotas",
            (0..8u8)
                .fold(joined().offer(ALICE, 0).offer(ALICE, 1), |p, i| {
                    p.op(Op::Write, &[ALICE, if i % 2 == 0 { 0 } else { 1 }, 40 + i])
                        .op(Op::Watch, &[ALICE, i % 4, 7])
                        .op(Op::Client, &[1])
                        .join(4 + i)
                        .connect(4 + i, i % 2)
                })
                .0,
        ),
        (
            "death-and-ticks",
            joined()
                .offer(ALICE, 0)
                .op(Op::Client, &[1])
                .join(4)
                .connect(4, 0)
                .accept(ALICE)
                .op(Op::Heartbeat, &[ALICE, 1])
                .op(Op::Tick, &[0, 100])
                .op(Op::Tick, &[0, 100])
                .op(Op::Leave, &[4])
                .op(Op::Disconnect, &[BOB])
                .op(Op::Tick, &[0, 200])
                .op(Op::Status, &[ROOT])
                .0,
        ),
        (
            "pipes",
            joined()
                .op(Op::PipeCreate, &[ALICE, 3, 0, 1])
                .op(Op::PipeCreate, &[ALICE, 0, 2, 1])
                .op(Op::PipeCreate, &[ALICE, 3, 0, 1])
                .op(Op::PipeRun, &[ALICE, 0, 100, 0, 0, 0])
                .op(Op::PipeOnce, &[BOB, 2, 1, 1, 50, 0, 0, 1])
                .op(Op::PipeEnd, &[ALICE, 0, 1])
                .op(Op::PipeEnd, &[ALICE, 1, 0])
                .op(Op::PipeWeight, &[ROOT, 0, 1, 5, 0])
                .op(Op::PipeWeight, &[ALICE, 0, 1, 5, 0])
                .op(Op::Tick, &[0, 5])
                .0,
        ),
        (
            // A narrower policy: bob is evicted, alice's connection to
            // alice-web revoked, her /net writes refused; then back.
            "reload",
            joined()
                .offer(ALICE, 0)
                .offer(ALICE, 1)
                .offer(BOB, 2)
                .op(Op::Client, &[1])
                .join(4)
                .connect(4, 1)
                .accept(ALICE)
                .op(Op::Write, &[ALICE, 7, 2])
                .op(Op::Reload, &[1])
                .op(Op::Write, &[ALICE, 7, 2])
                .connect(4, 1)
                .op(Op::Status, &[ROOT])
                .op(Op::Reload, &[0])
                .op(Op::Client, &[2])
                .join(5)
                .0,
        ),
        (
            "garbage",
            joined()
                .op(Op::Raw, &[MALLORY, 6, 1, 2, 3, 4, 5, 6, 0])
                .op(
                    Op::Raw,
                    &[ALICE, 12, 0x46, 0x44, 1, 0, 0, 0, 0, 0, 0, 1, 2, 3, 1],
                )
                .op(Op::Join, &[ALICE, 0, 1, 0, 1])
                .op(Op::Offer, &[MALLORY, 0])
                .op(Op::Counters, &[BOB, 1, 2, 3, 4, 5, 6, 7, 8])
                .0,
        ),
    ]
}

/// Programs that break the oracle on the broker this branch started from
/// (fuzz/findings/broker_session/; not replayed by CI until fixed).
fn known_findings() -> Vec<(&'static str, Vec<u8>)> {
    let joined = || {
        Program::default()
            .four_clients()
            .join(ROOT)
            .join(ALICE)
            .join(BOB)
            .join(MALLORY)
    };
    vec![
        (
            // Issue #16 finding 1: bob joins with a forged resume claiming he
            // maps alice's slot, then GrantSlot hands him alice's arena.
            "resume-forged-mapping-grant",
            joined()
                .offer(ALICE, 0)
                .op(Op::Client, &[2])
                .op(
                    Op::Resume,
                    &[4, 250, 5, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 7, 7, 1, 0x42],
                )
                .op(Op::Grant, &[4, 1])
                .0,
        ),
        (
            // A sibling: a forged resume naming one connection twice, to a
            // domain that is not live; the second mention "confirms" it, so
            // it outlives the grace period with a dead end.
            "resume-self-confirmed-connection",
            joined()
                .op(Op::Client, &[2])
                .op(
                    Op::Resume,
                    &[4, 250, 5, 0, 0, 2, 5, 201, 2, 5, 201, 2, 0, 0, 1, 7, 7, 1, 0x42],
                )
                .op(Op::Status, &[ROOT])
                .0,
        ),
    ]
}
