//! The `broker_session` property: the broker's whole request path, driven
//! in-process through `fido_broker::harness` (decode → dispatch → every
//! handler → replies, events and descriptors on real sockets), by several
//! simulated clients of different uids, one request at a time, checked after
//! every step. Shared by the fuzz target and by
//! crates/fido-broker/tests/fuzz_corpus.rs (which includes this file with
//! `#[path]`: it uses only `std`, `libc`, `rustix`, `fido_proto`,
//! `fido_shm` and `fido_broker`).
//!
//! The input is a program: an options byte (bit 0: run the pipe engine),
//! then a stream of steps, each an opcode byte and its
//! arguments, read with a reader that yields zeros once the input runs out.
//! Steps: a client connects (uid 0, alice 1001, bob 1002, or mallory 1003,
//! whom the policy refuses); joins with a real sealed memfd arena, a wrong
//! descriptor or none; joins with a forged `resume` (made-up domain, slot,
//! services, mappings, connections, watches); offers, withdraws, connects,
//! accepts, refuses, closes, asks for a slot's grant, says it unmapped one;
//! reads, writes, lists, deletes, watches, runs transactions in the registry;
//! creates, runs, cancels, destroys pipes (with pipes, sockets and memfds);
//! sets pipe weights; asks for the status; publishes counters; leaves;
//! disconnects; sends a heartbeat, or raw bytes; time passes; the policy is
//! reloaded (to a narrower one, or back).
//!
//! The oracle, after every step ([`Session::step`] panics on a violation):
//! - the broker's own invariants ([`Harness::check_invariants`]: clients,
//!   domains, slots, mappers, services, connections and pipes agree; no
//!   domain over a quota; nothing charged to a dead domain);
//! - every datagram decodes as a `BrokerMsg`, fits (`MAX_MESSAGE`; a reply
//!   192 KiB), and every request the broker answers at once is answered,
//!   exactly once;
//! - an arena (recognised by its memfd inode) reaches a domain only if it is
//!   its own or the two are linked by a chain of connections the policy
//!   allowed (connections seen established, or offered to the server, for
//!   services the client's uid may connect to and the server's uid offer);
//!   a `Grant`, `Connected` or `Incoming` names the arena's real owner, and
//!   a `PeerInfo` the peer's real uid;
//! - a domain id is handed out once, to one client;
//! - a registry write, delete or committed transaction succeeds only on
//!   paths the caller's uid may write (alice: `/app/alice/**`, `/net/**`;
//!   bob likewise; root: anything but the broker's subtrees).

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use fido_broker::harness::{ClientKey, Harness, Received};
use fido_broker::{Capacity, Config, PipeConfig, Policy};
use fido_proto::{
    BrokerMsg, ClientMsg, ConnId, Counters, DomainId, Event, PgvasGeometry, PipeId, PipeOp, Reply,
    Request, Resume, ResumeSecret, RingBlock, TxnOp,
};

pub const ROOT: u32 = 0;
pub const ALICE: u32 = 1001;
pub const BOB: u32 = 1002;
/// Admitted by no rule.
pub const MALLORY: u32 = 1003;
const UIDS: [u32; 4] = [ROOT, ALICE, BOB, MALLORY];

/// The issue's setup: two users, each offering and connecting only to its
/// own services, writing only its own `/app/<user>` subtree and `/net`;
/// root connects anywhere. Small quotas so that they are reached.
pub const POLICY: &str = r#"
[defaults]
connections = 3
registry_keys = 6
registry_bytes = 600
watches = 2
pipes = 2

[[rule]]
name = "root"
uids = [0]
offer = ["root-*"]
connect = ["*"]
registry_write = ["/**"]

[[rule]]
name = "alice"
uids = [1001]
offer = ["alice-*"]
connect = ["alice-*"]
registry_write = ["/app/alice/**", "/net/**"]

[[rule]]
name = "bob"
uids = [1002]
offer = ["bob-*"]
connect = ["bob-*"]
registry_write = ["/app/bob/**", "/net/**"]
"#;

/// What a reload may switch to: the same rules, narrower (so the static
/// checks below, written for [`POLICY`], stay sound): alice connects only to
/// `alice-db` and no longer writes `/net`, bob's uid is refused (his domains
/// are evicted). Quotas unchanged: usage above a lowered quota is kept.
pub const NARROW_POLICY: &str = r#"
[defaults]
connections = 3
registry_keys = 6
registry_bytes = 600
watches = 2
pipes = 2

[[rule]]
name = "root"
uids = [0]
offer = ["root-*"]
connect = ["*"]
registry_write = ["/**"]

[[rule]]
name = "alice"
uids = [1001]
offer = ["alice-*"]
connect = ["alice-db"]
registry_write = ["/app/alice/**"]

[[rule]]
name = "bob"
uids = [1002]
join = false
"#;

const SLOTS: u32 = 6;
const MAX_CLIENTS: usize = 8;
const MAX_STEPS: usize = 160;
/// The largest reply the broker sends (server/mod.rs `MAX_REPLY`).
const MAX_REPLY: usize = 192 * 1024;
/// Request ids the session gives its own requests start here; raw messages
/// carry whatever ids their bytes say.
const FIRST_ID: u64 = 1 << 40;

const SERVICES: &[&str] = &[
    "alice-db",
    "alice-web",
    "bob-db",
    "bob-web",
    "root-admin",
    "shared",
    "alice-",
    "",
];

const PATHS: &[&str] = &[
    "/app/alice/k",
    "/app/alice/k/x",
    "/app/alice",
    "/app/bob/k",
    "/app/bob",
    "/app",
    "/app/alicex/k",
    "/net/conn/1",
    "/net",
    "/net/conn",
    "/",
    "/domain/1/name",
    "/domain",
    "/service/alice-db/domain",
    "/connection",
    "/app/alice/../bob/k",
    "/app//alice",
    "x",
    "/app/root/k",
];

const NAMES: &[&str] = &["app", "net-curl", "", "a/b", "d\u{e9}j\u{e0}"];

/// Byte reader that yields zeros once the input is exhausted.
struct Input<'a> {
    data: &'a [u8],
}

impl Input<'_> {
    fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from(self.u8()) | u16::from(self.u8()) << 8
    }
    fn u64(&mut self) -> u64 {
        (0..8).fold(0, |v, i| v | u64::from(self.u8()) << (8 * i))
    }
    fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }
    fn pick<'s>(&mut self, from: &[&'s str]) -> &'s str {
        from[usize::from(self.u8()) % from.len()]
    }
    fn take(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }
    fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// Steps a run may skip: `FIDO_FUZZ_SKIP=resume,raw` (names of [`Op`]s in
/// lower case), so that a long run on a broker with a known, unfixed bug
/// explores past it.
fn skipped() -> &'static HashSet<String> {
    static SKIP: OnceLock<HashSet<String>> = OnceLock::new();
    SKIP.get_or_init(|| {
        std::env::var("FIDO_FUZZ_SKIP")
            .unwrap_or_default()
            .split(',')
            .map(|s| s.trim().to_ascii_lowercase())
            .filter(|s| !s.is_empty())
            .collect()
    })
}

/// `FIDO_FUZZ_TRACE=1`: print every step and every message received
/// (to read what an input does).
fn tracing() -> bool {
    static TRACE: OnceLock<bool> = OnceLock::new();
    *TRACE.get_or_init(|| std::env::var_os("FIDO_FUZZ_TRACE").is_some_and(|v| v == "1"))
}

/// What a request was, for checking its answer.
enum Sent {
    Join {
        arena: Option<Inode>,
    },
    Connect {
        service: String,
    },
    /// Registry paths a success writes or deletes.
    Update {
        paths: Vec<String>,
    },
    Txn {
        paths: Vec<String>,
    },
    Other,
}

struct Outstanding {
    sent: Sent,
    /// Answered while the request is handled (not later, as `Connect` and
    /// the pipe operations are).
    immediate: bool,
    what: &'static str,
}

type Inode = (u64, u64);

struct Cl {
    key: ClientKey,
    uid: u32,
    domain: Option<DomainId>,
    /// The owner's side of the arenas this client joined with (kept mapped).
    arenas: Vec<fido_shm::UnplacedArena>,
    incoming: Vec<ConnId>,
    conns: Vec<ConnId>,
    pipes: Vec<PipeId>,
    slots_seen: Vec<(u32, DomainId)>,
    outstanding: HashMap<u64, Outstanding>,
    sent_raw: bool,
    /// Descriptors whose other end must stay open for a while (pipe ends).
    keep: Vec<OwnedFd>,
}

/// One session: a broker, its clients and the model the oracle checks against.
pub struct Session {
    h: Harness,
    clients: Vec<Cl>,
    next_id: u64,
    /// Domain whose arena each memfd inode is.
    arena_owner: HashMap<Inode, DomainId>,
    dom_uid: HashMap<DomainId, u32>,
    /// Every domain id the broker handed out.
    issued: HashSet<DomainId>,
    /// The resume secret each domain was given at its join: a forged resume
    /// may present a real one (a leaked secret, from the wrong client).
    secrets: HashMap<DomainId, ResumeSecret>,
    /// Domains linked by a connection the policy allowed (ever).
    links: HashMap<DomainId, HashSet<DomainId>>,
    steps: usize,
}

fn uid_may_connect(uid: u32, service: &str) -> bool {
    match uid {
        ROOT => true,
        ALICE => service.starts_with("alice-"),
        BOB => service.starts_with("bob-"),
        _ => false,
    }
}

fn uid_may_offer(uid: u32, service: &str) -> bool {
    match uid {
        ROOT => service.starts_with("root-"),
        ALICE => service.starts_with("alice-"),
        BOB => service.starts_with("bob-"),
        _ => false,
    }
}

fn under(path: &str, prefix: &str) -> bool {
    path == prefix
        || path
            .strip_prefix(prefix)
            .is_some_and(|r| r.starts_with('/'))
}

/// May `uid` write or delete `path` (and, for a delete, everything under it)?
fn uid_may_write(uid: u32, path: &str) -> bool {
    let managed = path == "/"
        || ["/domain", "/service", "/connection"]
            .iter()
            .any(|m| under(path, m));
    if managed {
        return false;
    }
    match uid {
        ROOT => true,
        ALICE => under(path, "/app/alice") || under(path, "/net"),
        BOB => under(path, "/app/bob") || under(path, "/net"),
        _ => false,
    }
}

fn inode(fd: &OwnedFd) -> Option<Inode> {
    rustix::fs::fstat(fd).ok().map(|st| (st.st_dev, st.st_ino))
}

fn stream_pair() -> (OwnedFd, OwnedFd) {
    rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .expect("socketpair")
}

fn memfd(data: &[u8]) -> OwnedFd {
    let fd = rustix::fs::memfd_create("fuzz", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd");
    if !data.is_empty() {
        rustix::io::write(&fd, data).expect("memfd write");
    }
    fd
}

fn block(inp: &mut Input) -> RingBlock {
    match inp.u8() % 4 {
        0 => RingBlock {
            offset: 4096,
            len: 8192,
            entries: 128,
        },
        1 => RingBlock {
            offset: 0,
            len: 0,
            entries: 0,
        },
        2 => RingBlock {
            offset: u64::MAX,
            len: u64::MAX,
            entries: u32::MAX,
        },
        _ => RingBlock {
            offset: inp.u64(),
            len: inp.u64(),
            entries: inp.u16().into(),
        },
    }
}

/// Parsed once: every session shares them.
fn policy(narrow: bool) -> Arc<Policy> {
    static PARSED: OnceLock<[Arc<Policy>; 2]> = OnceLock::new();
    let parsed = PARSED.get_or_init(|| {
        let parse =
            |text, name| Arc::new(Policy::parse(text, name).expect("the session's policies parse"));
        [
            parse(POLICY, "broker_session"),
            parse(NARROW_POLICY, "broker_session_narrow"),
        ]
    });
    parsed[usize::from(narrow)].clone()
}

/// What a run of `data` did, for the replay's figures.
#[derive(Debug, Default, Clone, Copy)]
pub struct Outcome {
    pub steps: usize,
    pub joined: usize,
}

/// Runs one program; panics on the first violated property.
pub fn run(data: &[u8]) -> Outcome {
    ignore_sigpipe();
    let mut inp = Input { data };
    // The first byte: session options (bit 0: a running pipe engine).
    let mut s = Session::new(inp.u8() & 1 == 1);
    let mut joined = 0;
    while !inp.is_empty() && s.steps < MAX_STEPS {
        s.step(&mut inp);
        joined = joined.max(s.clients.iter().filter(|c| c.domain.is_some()).count());
    }
    Outcome {
        steps: s.steps,
        joined,
    }
}

fn ignore_sigpipe() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        // SAFETY: setting a signal's disposition to SIG_IGN installs no
        // handler code; the pipe engine's sends to a closed reader must fail
        // with EPIPE (as in `fido broker`, whose Rust runtime ignores
        // SIGPIPE) instead of killing the fuzzer.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
    });
}

/// One step's kind. A program's opcode byte is an index into [`OPS`], which
/// lists them in this order, so `op as u8` is the byte that picks `op` (the
/// seed builders of crates/fido-broker/tests/fuzz_corpus.rs rely on it).
#[derive(Clone, Copy, Debug)]
#[repr(u8)]
pub enum Op {
    Client,
    Join,
    Resume,
    Offer,
    Withdraw,
    Connect,
    Accept,
    Refuse,
    Close,
    Grant,
    Unmapped,
    Write,
    Delete,
    Read,
    List,
    Watch,
    Unwatch,
    Txn,
    Status,
    Counters,
    Leave,
    Disconnect,
    Heartbeat,
    Raw,
    Tick,
    PipeCreate,
    PipeRun,
    PipeOnce,
    PipeEnd,
    PipeWeight,
    Reload,
}

pub const OPS: [Op; 31] = [
    Op::Client,
    Op::Join,
    Op::Resume,
    Op::Offer,
    Op::Withdraw,
    Op::Connect,
    Op::Accept,
    Op::Refuse,
    Op::Close,
    Op::Grant,
    Op::Unmapped,
    Op::Write,
    Op::Delete,
    Op::Read,
    Op::List,
    Op::Watch,
    Op::Unwatch,
    Op::Txn,
    Op::Status,
    Op::Counters,
    Op::Leave,
    Op::Disconnect,
    Op::Heartbeat,
    Op::Raw,
    Op::Tick,
    Op::PipeCreate,
    Op::PipeRun,
    Op::PipeOnce,
    Op::PipeEnd,
    Op::PipeWeight,
    Op::Reload,
];

impl Session {
    /// A fresh broker; without `pipe_engine` its pipe requests are refused
    /// (`Unavailable`), and a session starts faster.
    fn new(pipe_engine: bool) -> Session {
        let mut cfg = Config::new("/nonexistent/fido-fuzz.sock", "/nonexistent/fido-fuzz");
        cfg.policy = policy(false);
        cfg.geometry = PgvasGeometry {
            slots: SLOTS,
            ..PgvasGeometry::DEFAULT
        };
        cfg.pipe = PipeConfig {
            capacity: Capacity::Unlimited,
            lanes: 2,
            chunk: 64 << 10,
            enabled: pipe_engine,
            ..PipeConfig::default()
        };
        Session {
            h: Harness::new(cfg).expect("harness"),
            clients: Vec::new(),
            next_id: FIRST_ID,
            arena_owner: HashMap::new(),
            dom_uid: HashMap::new(),
            issued: HashSet::new(),
            secrets: HashMap::new(),
            links: HashMap::new(),
            steps: 0,
        }
    }

    fn step(&mut self, inp: &mut Input) {
        self.steps += 1;
        let op = OPS[usize::from(inp.u8()) % OPS.len()];
        if skipped().contains(&format!("{op:?}").to_ascii_lowercase()) {
            return;
        }
        if self.clients.is_empty() || matches!(op, Op::Client) {
            let uid = UIDS[usize::from(inp.u8()) % UIDS.len()];
            if tracing() {
                eprintln!("step {}: new client of uid {uid}", self.steps);
            }
            if self.clients.len() < MAX_CLIENTS {
                self.new_client(uid);
            }
            return self.check(None);
        }
        if let Op::Reload = op {
            let narrow = inp.bool();
            if tracing() {
                eprintln!("step {}: policy reloaded (narrow: {narrow})", self.steps);
            }
            self.h.reload((*policy(narrow)).clone());
            return self.check(None);
        }
        let c = usize::from(inp.u8()) % self.clients.len();
        if tracing() {
            eprintln!(
                "step {}: client {} (uid {}): {op:?}",
                self.steps, self.clients[c].key, self.clients[c].uid
            );
        }
        match op {
            Op::Client | Op::Reload => unreachable!("handled above"),
            Op::Join => self.join(c, inp, None),
            Op::Resume => {
                let resume = self.forged_resume(c, inp);
                self.join(c, inp, Some(resume))
            }
            Op::Offer => {
                let service = inp.pick(SERVICES).to_string();
                self.request(c, Request::Offer { service }, vec![], Sent::Other, "Offer")
            }
            Op::Withdraw => {
                let service = inp.pick(SERVICES).to_string();
                self.request(
                    c,
                    Request::Withdraw { service },
                    vec![],
                    Sent::Other,
                    "Withdraw",
                )
            }
            Op::Connect => {
                let service = inp.pick(SERVICES).to_string();
                let block = block(inp);
                let fds = self.bells(inp);
                let sent = Sent::Connect {
                    service: service.clone(),
                };
                self.request(c, Request::Connect { service, block }, fds, sent, "Connect")
            }
            Op::Accept => {
                let conn = self.pick_conn(c, inp, true);
                let block = block(inp);
                let fds = self.bells(inp);
                self.request(
                    c,
                    Request::Accept { conn, block },
                    fds,
                    Sent::Other,
                    "Accept",
                )
            }
            Op::Refuse => {
                let conn = self.pick_conn(c, inp, true);
                let reason = "no".repeat(usize::from(inp.u8() % 4));
                self.request(
                    c,
                    Request::Refuse { conn, reason },
                    vec![],
                    Sent::Other,
                    "Refuse",
                )
            }
            Op::Close => {
                let conn = self.pick_conn(c, inp, false);
                self.request(c, Request::Close { conn }, vec![], Sent::Other, "Close")
            }
            Op::Grant => {
                let slot = self.pick_slot(inp);
                self.request(
                    c,
                    Request::GrantSlot { slot },
                    vec![],
                    Sent::Other,
                    "GrantSlot",
                )
            }
            Op::Unmapped => {
                let slot = self.pick_slot(inp);
                let owner = self.pick_domain(inp);
                let body = Request::Unmapped { slot, owner };
                self.request(c, body, vec![], Sent::Other, "Unmapped")
            }
            Op::Write => {
                let path = inp.pick(PATHS).to_string();
                let value = vec![b'v'; usize::from(inp.u8()) * 4];
                let sent = Sent::Update {
                    paths: vec![path.clone()],
                };
                self.request(c, Request::Write { path, value }, vec![], sent, "Write")
            }
            Op::Delete => {
                let path = inp.pick(PATHS).to_string();
                let sent = Sent::Update {
                    paths: vec![path.clone()],
                };
                self.request(c, Request::Delete { path }, vec![], sent, "Delete")
            }
            Op::Read => {
                let path = inp.pick(PATHS).to_string();
                self.request(c, Request::Read { path }, vec![], Sent::Other, "Read")
            }
            Op::List => {
                let path = inp.pick(PATHS).to_string();
                self.request(c, Request::List { path }, vec![], Sent::Other, "List")
            }
            Op::Watch => {
                let token = u64::from(inp.u8() % 4);
                let prefix = inp.pick(PATHS).to_string();
                self.request(
                    c,
                    Request::Watch { token, prefix },
                    vec![],
                    Sent::Other,
                    "Watch",
                )
            }
            Op::Unwatch => {
                let token = u64::from(inp.u8() % 4);
                self.request(
                    c,
                    Request::Unwatch { token },
                    vec![],
                    Sent::Other,
                    "Unwatch",
                )
            }
            Op::Txn => {
                let (ops, paths) = txn_ops(inp);
                self.request(
                    c,
                    Request::Transaction { ops },
                    vec![],
                    Sent::Txn { paths },
                    "Transaction",
                )
            }
            Op::Status => self.request(c, Request::Status, vec![], Sent::Other, "Status"),
            Op::Counters => {
                let n = inp.u64();
                let counters = Counters {
                    messages_sent: n,
                    bytes_copied: n,
                    ..Counters::default()
                };
                self.request(
                    c,
                    Request::Counters { counters },
                    vec![],
                    Sent::Other,
                    "Counters",
                )
            }
            Op::Leave => self.request(c, Request::Leave, vec![], Sent::Other, "Leave"),
            Op::Disconnect => {
                let key = self.clients[c].key;
                self.h.disconnect(key);
                self.clients.remove(c);
                self.check(None);
            }
            Op::Heartbeat => {
                let bytes = fido_proto::encode(&ClientMsg::Heartbeat).expect("encode");
                let fds = if inp.u8() % 8 == 0 {
                    vec![memfd(b"")]
                } else {
                    vec![]
                };
                self.send_raw(c, &bytes, fds);
            }
            Op::Raw => {
                let n = usize::from(inp.u8());
                let mut bytes = inp.take(n).to_vec();
                if bytes.len() >= 2 && bytes[0] & 1 == 1 {
                    // A valid header ahead of fuzzed bytes reaches the body's decoder.
                    let header = fido_proto::encode(&ClientMsg::Heartbeat).expect("encode");
                    let keep = header.len().min(9);
                    bytes.splice(0..0, header[..keep].iter().copied());
                }
                let fds = if inp.u8() % 8 == 0 {
                    vec![memfd(b"")]
                } else {
                    vec![]
                };
                self.send_raw(c, &bytes, fds);
            }
            Op::Tick => {
                let ms = u64::from(inp.u8()) * 20;
                self.h.advance(Duration::from_millis(ms));
                self.check(None);
            }
            Op::PipeCreate => {
                let fds = self.pipe_fds(c, inp);
                self.request(c, Request::PipeCreate, fds, Sent::Other, "PipeCreate")
            }
            Op::PipeRun => {
                let pipe = self.pick_pipe(c, inp);
                let op = pipe_op(inp);
                self.request_later(c, Request::PipeRun { pipe, op }, vec![], "PipeRun")
            }
            Op::PipeOnce => {
                let fds = self.pipe_fds(c, inp);
                let op = pipe_op(inp);
                self.request_later(c, Request::PipeOnce { op }, fds, "PipeOnce")
            }
            Op::PipeEnd => {
                let pipe = self.pick_pipe(c, inp);
                let body = if inp.bool() {
                    Request::PipeCancel { pipe }
                } else {
                    Request::PipeDestroy { pipe }
                };
                self.request(c, body, vec![], Sent::Other, "PipeCancel/Destroy")
            }
            Op::PipeWeight => {
                let domain = match inp.u8() % 3 {
                    0 => self.pick_domain(inp).to_string(),
                    1 => inp.pick(NAMES).to_string(),
                    _ => "nobody".to_string(),
                };
                let weight = u32::from(inp.u16());
                let body = Request::PipeWeight { domain, weight };
                self.request(c, body, vec![], Sent::Other, "PipeWeight")
            }
        }
    }

    fn new_client(&mut self, uid: u32) {
        let pid = 40_000 + self.clients.len() as i32;
        let key = self.h.connect(pid, uid, uid).expect("harness connect");
        self.clients.push(Cl {
            key,
            uid,
            domain: None,
            arenas: Vec::new(),
            incoming: Vec::new(),
            conns: Vec::new(),
            pipes: Vec::new(),
            slots_seen: Vec::new(),
            outstanding: HashMap::new(),
            sent_raw: false,
            keep: Vec::new(),
        });
    }

    fn join(&mut self, c: usize, inp: &mut Input, resume: Option<Resume>) {
        let name = inp.pick(NAMES).to_string();
        let label = match inp.u8() % 4 {
            0 => Some("gold".to_string()),
            _ => None,
        };
        let mut arena_len = match inp.u8() % 8 {
            0 => 0,
            1 => u64::MAX,
            2 => PgvasGeometry::DEFAULT.slot_size + 1,
            3 => 1 << 17,
            _ => 1 << 16,
        };
        let mut ino = None;
        let fds = match inp.u8() % 8 {
            0 => vec![],
            1 => vec![memfd(&[0; 64])],
            2 => vec![stream_pair().0],
            3 => {
                let (a, b) = stream_pair();
                vec![a, b]
            }
            _ => match fido_shm::UnplacedArena::create(1 << 16, false) {
                Ok(arena) => {
                    let fd = arena.ro_fd().expect("arena ro_fd");
                    ino = inode(&fd);
                    if arena_len == 1 << 17 {
                        arena_len = arena.len() + 1;
                    }
                    self.clients[c].arenas.push(arena);
                    vec![fd]
                }
                Err(e) => panic!("could not create an arena: {e}"),
            },
        };
        let body = Request::Join {
            name,
            label,
            arena_len,
            resume,
        };
        self.request(c, body, fds, Sent::Join { arena: ino }, "Join");
    }

    fn forged_resume(&mut self, c: usize, inp: &mut Input) -> Resume {
        let domain = self.pick_domain(inp);
        let slot = self.pick_slot(inp);
        let services = (0..inp.u8() % 3)
            .map(|_| inp.pick(SERVICES).to_string())
            .collect();
        let mapped = (0..inp.u8() % 4)
            .map(|_| (self.pick_slot(inp), self.pick_domain(inp)))
            .collect();
        let connections = (0..inp.u8() % 5)
            .map(|_| {
                let conn = self.pick_conn(c, inp, false);
                (conn, self.pick_domain(inp), inp.pick(SERVICES).to_string())
            })
            .collect();
        let watches = (0..inp.u8() % 4)
            .map(|_| (u64::from(inp.u8() % 4), inp.pick(PATHS).to_string()))
            .collect();
        // A leaked real secret (an even byte, when one is known), or
        // made-up bytes. Always two bytes, so programs stay readable.
        let (pick, fill) = (inp.u8(), inp.u8());
        let secret = match self.secrets.get(&domain) {
            Some(real) if pick % 2 == 0 => *real,
            _ => ResumeSecret([fill; 32]),
        };
        Resume {
            domain,
            slot,
            services,
            mapped,
            connections,
            watches,
            secret,
        }
    }

    fn pick_domain(&self, inp: &mut Input) -> DomainId {
        let known: Vec<DomainId> = self
            .issued
            .iter()
            .copied()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let b = inp.u8();
        if b < 200 && !known.is_empty() {
            known[usize::from(b) % known.len()]
        } else {
            u64::from(b % 16)
        }
    }

    fn pick_slot(&self, inp: &mut Input) -> u32 {
        match inp.u8() {
            255 => u32::MAX,
            254 => SLOTS,
            b => u32::from(b) % SLOTS,
        }
    }

    fn pick_conn(&self, c: usize, inp: &mut Input, incoming: bool) -> ConnId {
        let cl = &self.clients[c];
        let mine = if incoming { &cl.incoming } else { &cl.conns };
        let b = inp.u8();
        if b < 200 && !mine.is_empty() {
            mine[usize::from(b) % mine.len()]
        } else {
            u64::from(b % 16)
        }
    }

    fn pick_pipe(&self, c: usize, inp: &mut Input) -> PipeId {
        let mine = &self.clients[c].pipes;
        let b = inp.u8();
        if b < 200 && !mine.is_empty() {
            mine[usize::from(b) % mine.len()]
        } else {
            u64::from(b % 8)
        }
    }

    /// Two doorbell ends (or something else the broker must refuse).
    fn bells(&mut self, inp: &mut Input) -> Vec<OwnedFd> {
        match inp.u8() % 8 {
            0 => vec![],
            1 => vec![stream_pair().0],
            2 => vec![memfd(b""), stream_pair().0],
            3 => vec![stream_pair().0, stream_pair().0, stream_pair().0],
            _ => vec![stream_pair().0, stream_pair().0],
        }
    }

    /// A source and a sink for a pipe: pipes (at end of file, or held open
    /// so the operation waits), stream sockets, memfds.
    fn pipe_fds(&mut self, c: usize, inp: &mut Input) -> Vec<OwnedFd> {
        let flags = rustix::pipe::PipeFlags::CLOEXEC;
        let source = match inp.u8() % 5 {
            0 => {
                let (r, _w) = rustix::pipe::pipe_with(flags).expect("pipe");
                r
            }
            1 => {
                let (r, w) = rustix::pipe::pipe_with(flags).expect("pipe");
                rustix::io::write(&w, b"some bytes").expect("pipe write");
                self.clients[c].keep.push(w);
                r
            }
            2 => {
                let (a, b) = stream_pair();
                let _ = rustix::io::write(&b, b"socket bytes");
                drop(b);
                a
            }
            3 => memfd(&[7; 100]),
            _ => memfd(b""),
        };
        let sink = match inp.u8() % 4 {
            0 => {
                let (r, w) = rustix::pipe::pipe_with(flags).expect("pipe");
                self.clients[c].keep.push(r);
                w
            }
            1 => stream_pair().0,
            2 => memfd(b""),
            _ => {
                let (r, _w) = rustix::pipe::pipe_with(flags).expect("pipe");
                r
            }
        };
        let mut fds = vec![source, sink];
        if inp.u8() % 8 == 0 {
            fds.pop();
        }
        fds
    }

    fn request(
        &mut self,
        c: usize,
        body: Request,
        fds: Vec<OwnedFd>,
        sent: Sent,
        what: &'static str,
    ) {
        self.send_request(c, body, fds, sent, true, what)
    }

    fn request_later(&mut self, c: usize, body: Request, fds: Vec<OwnedFd>, what: &'static str) {
        self.send_request(c, body, fds, Sent::Other, false, what)
    }

    fn send_request(
        &mut self,
        c: usize,
        body: Request,
        fds: Vec<OwnedFd>,
        sent: Sent,
        immediate: bool,
        what: &'static str,
    ) {
        let id = self.next_id;
        self.next_id += 1;
        // Connect waits for the server's answer.
        let immediate = immediate && !matches!(sent, Sent::Connect { .. });
        let msg = ClientMsg::Request { id, body };
        let Ok(bytes) = fido_proto::encode(&msg) else {
            return;
        };
        let key = self.clients[c].key;
        if tracing() {
            eprintln!("  -> {msg:?} with {} descriptors", fds.len());
        }
        self.clients[c].outstanding.insert(
            id,
            Outstanding {
                sent,
                immediate,
                what,
            },
        );
        let ok = self.h.send(key, &bytes, &fds).is_ok();
        if !ok {
            self.clients[c].outstanding.remove(&id);
        }
        drop(fds);
        self.check(Some(c));
    }

    fn send_raw(&mut self, c: usize, bytes: &[u8], fds: Vec<OwnedFd>) {
        self.clients[c].sent_raw = true;
        let key = self.clients[c].key;
        let _ = self.h.send(key, bytes, &fds);
        drop(fds);
        self.check(None);
    }

    /// Reads what every client received and checks the oracle.
    fn check(&mut self, stepping: Option<usize>) {
        self.h.pipe_completions();
        for c in 0..self.clients.len() {
            let key = self.clients[c].key;
            for m in self.h.recv(key) {
                self.received(c, m);
            }
        }
        if let Some(c) = stepping {
            let cl = &self.clients[c];
            if self.h.is_client(cl.key) {
                if let Some((id, o)) = cl.outstanding.iter().find(|(_, o)| o.immediate) {
                    panic!(
                        "client {} (uid {}): request {id} ({}) got no answer",
                        cl.key, cl.uid, o.what
                    );
                }
            }
        }
        if let Err(e) = self.h.check_invariants() {
            panic!("broker invariant broken after step {}: {e}", self.steps);
        }
        // Clients the broker dropped are gone from the session too.
        let h = &self.h;
        self.clients.retain(|c| h.is_client(c.key));
    }

    fn received(&mut self, c: usize, m: Received) {
        let (key, uid) = (self.clients[c].key, self.clients[c].uid);
        assert!(
            !m.truncated,
            "client {key}: a datagram of the broker was truncated"
        );
        let msg = match fido_proto::decode::<BrokerMsg>(&m.bytes) {
            Ok(msg) => msg,
            Err(e) => panic!("client {key}: the broker sent a message that does not decode: {e}"),
        };
        let me = self.clients[c].domain;
        if tracing() {
            eprintln!(
                "  <- client {key}: {msg:?} with {} descriptors",
                m.fds.len()
            );
        }
        match msg {
            BrokerMsg::Reply { id, body } => {
                assert!(
                    m.bytes.len() <= MAX_REPLY,
                    "a reply of {} bytes",
                    m.bytes.len()
                );
                let cl = &mut self.clients[c];
                let Some(o) = cl.outstanding.remove(&id) else {
                    assert!(
                        id < FIRST_ID || cl.sent_raw,
                        "client {key}: reply to request {id}, which was answered already or never sent"
                    );
                    return;
                };
                match body {
                    Ok(reply) => self.reply_ok(c, o, reply, &m.fds),
                    Err(_) => assert!(
                        m.fds.is_empty(),
                        "client {key}: an error reply to {} carries descriptors",
                        o.what
                    ),
                }
            }
            BrokerMsg::Event(ev) => match ev {
                Event::Incoming {
                    conn,
                    service,
                    peer,
                    ..
                } => {
                    let me =
                        me.unwrap_or_else(|| panic!("client {key}: Incoming before it joined"));
                    self.check_peer(&peer);
                    assert!(
                        uid_may_connect(peer.uid, &service) && uid_may_offer(uid, &service),
                        "domain {me} (uid {uid}) heard of a connection from uid {} to {service:?}, which the policy forbids",
                        peer.uid
                    );
                    self.link(me, peer.domain);
                    self.check_arena(me, m.fds.first(), Some(peer.domain), "Incoming");
                    self.clients[c].incoming.push(conn);
                }
                Event::PeerGone { .. } | Event::Closed { .. } | Event::Watch { .. } => {}
            },
        }
        if let Some(me) = self.clients[c].domain {
            for fd in &m.fds {
                self.check_arena(me, Some(fd), None, "a message");
            }
        }
    }

    fn reply_ok(&mut self, c: usize, o: Outstanding, reply: Reply, fds: &[OwnedFd]) {
        let (key, uid) = (self.clients[c].key, self.clients[c].uid);
        match (o.sent, reply) {
            (Sent::Join { arena }, Reply::Joined { domain, slot, resume_secret, .. }) => {
                self.secrets.insert(domain, resume_secret);
                assert!(
                    self.issued.insert(domain),
                    "client {key} (uid {uid}) joined as domain {domain}, an id handed out before"
                );
                assert!(
                    slot < SLOTS,
                    "domain {domain} got slot {slot}, outside the window"
                );
                let arena = arena.unwrap_or_else(|| panic!("client {key} joined without an arena"));
                self.arena_owner.insert(arena, domain);
                self.dom_uid.insert(domain, uid);
                assert_eq!(self.h.domain_of(key), Some(domain), "client {key}'s domain");
                self.clients[c].domain = Some(domain);
            }
            (Sent::Join { .. }, r) => panic!("client {key}: Join answered {r:?}"),
            (Sent::Connect { service }, Reply::Connected { conn, peer, .. }) => {
                let me = self.clients[c].domain.expect("connected, so joined");
                self.check_peer(&peer);
                assert!(
                    uid_may_connect(uid, &service) && uid_may_offer(peer.uid, &service),
                    "uid {uid} connected to {service:?} offered by uid {}, which the policy forbids",
                    peer.uid
                );
                self.link(me, peer.domain);
                self.check_arena(me, fds.first(), Some(peer.domain), "Connected");
                self.clients[c].conns.push(conn);
            }
            (
                Sent::Update { paths } | Sent::Txn { paths },
                Reply::Ok
                | Reply::Txn {
                    committed: true, ..
                },
            ) => {
                for p in paths {
                    assert!(
                        uid_may_write(uid, &p),
                        "uid {uid} wrote or deleted {p:?}, which its rule does not allow"
                    );
                }
            }
            (_, Reply::Grant { owner, slot, .. }) => {
                let me = self.clients[c].domain.expect("granted, so joined");
                self.clients[c].slots_seen.push((slot, owner));
                self.check_arena(me, fds.first(), Some(owner), "Grant");
            }
            (_, Reply::PipeCreated { pipe, .. }) => self.clients[c].pipes.push(pipe),
            (_, Reply::Ok) if o.what == "Accept" => {}
            _ => {}
        }
    }

    /// A `PeerInfo` vouches for the peer's uid.
    fn check_peer(&self, peer: &fido_proto::PeerInfo) {
        if let Some(&u) = self.dom_uid.get(&peer.domain) {
            assert_eq!(
                u, peer.uid,
                "PeerInfo of domain {} gives a wrong uid",
                peer.domain
            );
        }
    }

    fn link(&mut self, a: DomainId, b: DomainId) {
        self.links.entry(a).or_default().insert(b);
        self.links.entry(b).or_default().insert(a);
    }

    fn linked(&self, from: DomainId, to: DomainId) -> bool {
        let mut seen = HashSet::from([from]);
        let mut queue = VecDeque::from([from]);
        while let Some(d) = queue.pop_front() {
            if d == to {
                return true;
            }
            for n in self.links.get(&d).into_iter().flatten() {
                if seen.insert(*n) {
                    queue.push_back(*n);
                }
            }
        }
        false
    }

    /// Domain `me` received `fd`: if it is a domain's arena, `me` must be that
    /// domain or linked to it; `owner` is who the message says it belongs to.
    fn check_arena(&self, me: DomainId, fd: Option<&OwnedFd>, owner: Option<DomainId>, what: &str) {
        let Some(fd) = fd else {
            if owner.is_some() {
                panic!("{what} to domain {me} came without the arena");
            }
            return;
        };
        let Some(real) = inode(fd).and_then(|i| self.arena_owner.get(&i)).copied() else {
            if owner.is_some() && what != "Grant" {
                panic!("{what} to domain {me}: the descriptor is no domain's arena");
            }
            return;
        };
        if let Some(o) = owner {
            assert_eq!(
                o, real,
                "{what} to domain {me} says the arena is domain {o}'s; it is domain {real}'s"
            );
        }
        if real != me && !self.linked(me, real) {
            let (a, b) = (self.dom_uid.get(&real), self.dom_uid.get(&me));
            panic!(
                "{what}: domain {me} (uid {b:?}) received the arena of domain {real} (uid {a:?}) \
                 without a chain of allowed connections between them"
            );
        }
    }
}

fn pipe_op(inp: &mut Input) -> PipeOp {
    let len = u64::from(inp.u16() % 2048);
    let off = u64::from(inp.u8());
    match inp.u8() % 5 {
        0 => PipeOp::FileToSocket { off, len },
        1 => PipeOp::SocketToSocket { len },
        2 => PipeOp::SocketToFile { off, len },
        3 => PipeOp::FileToFile {
            in_off: off,
            len,
            out_off: u64::from(inp.u8()),
        },
        _ => PipeOp::SocketToSocket { len: inp.u64() },
    }
}

/// A transaction and the paths it writes or deletes if it commits.
fn txn_ops(inp: &mut Input) -> (Vec<TxnOp>, Vec<String>) {
    let mut ops = Vec::new();
    let mut paths = Vec::new();
    for _ in 0..inp.u8() % 5 {
        let path = inp.pick(PATHS).to_string();
        match inp.u8() % 4 {
            0 => {
                paths.push(path.clone());
                ops.push(TxnOp::Put {
                    path,
                    value: vec![b'x'; usize::from(inp.u8())],
                });
            }
            1 => {
                paths.push(path.clone());
                ops.push(TxnOp::Delete { path });
            }
            2 => ops.push(TxnOp::Check {
                path,
                expected: None,
            }),
            _ => ops.push(TxnOp::Read { path }),
        }
    }
    (ops, paths)
}
