//! The broker's event loop and the protocol semantics.
//!
//! One thread, one epoll set: the listener, every client socket and the
//! shutdown eventfd. Heartbeat checks run on the epoll timeout. Nothing in here
//! blocks: sockets are non-blocking, a client whose socket stays full has a
//! bounded queue and is dropped when it overflows.
//!
//! Deaths are never processed in the middle of handling another message: a
//! client found dead is *doomed* (marked and queued) and [`Server::reap`] tears
//! it down once the current event is handled, so teardown can itself send
//! messages (and doom further clients) without re-entrancy.
//!
//! One [`Server`] holds the state; its methods live by concern:
//! - [`io`]: the epoll loop, accepting clients, sending and queueing
//!   messages with their descriptors, dooming and reaping clients;
//! - [`dispatch`]: a message decoded and routed to its request family;
//! - [`domains`]: join, resume, leave, death, heartbeats, PGVAS slots;
//! - [`connections`]: services, connections, arena grants;
//! - [`authorization`]: the policy's decisions, its reload, quotas;
//! - [`registry`]: the registry requests and the broker-managed keys;
//! - [`pipes`]: the pipe requests, on top of the `fido-pipe-engine` crate;
//! - [`status`]: what `Status` reports.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

use fido_proto::{ConnId, Counters, DomainId, ErrorCode, Event, GoneReason, RemoteError, Reply};
use fido_registry::Registry;
use rustix::event::epoll;

mod authorization;
mod connections;
mod dispatch;
mod domains;
#[cfg(feature = "fuzz-hooks")]
pub mod harness;
mod io;
mod net;
mod pipes;
mod registry;
mod status;

pub(crate) use domains::load_recorded;

use crate::account::RegAccount;
use crate::policy::Rule;
use crate::resume::Recorded;
use crate::ReloadSlot;
use crate::{BrokerError, Config};

/// Registry subtrees the broker owns: cleared at startup, read-only to applications.
/// `/net/listen`: MMNet listeners, published by the broker from the sockets
/// themselves (`net`).
pub(crate) const MANAGED: [&str; 4] = ["/domain", "/service", "/connection", "/net/listen"];

const KEY_LISTENER: u64 = 0;
const KEY_SHUTDOWN: u64 = 1;
const KEY_RELOAD: u64 = 2;
/// The pipe engine's completion eventfd.
const KEY_PIPE: u64 = 3;
const FIRST_CLIENT_KEY: u64 = 4;

/// Messages handled per client per wake-up, so one chatty client cannot starve others.
const MAX_BATCH: usize = 64;
/// Bound on what is queued for a client that does not read its socket.
const MAX_QUEUED_MSGS: usize = 1024;
const MAX_QUEUED_BYTES: usize = 8 << 20;
/// Replies larger than this are replaced by an error (they might not fit the
/// receiver's socket buffer as one datagram).
const MAX_REPLY: usize = 192 * 1024;
/// Most counter steps taken to move a counter past an id reported by a resuming domain.
const MAX_COUNTER_ADVANCE: u64 = 1024;

type Handled = Result<Option<(Reply, Vec<OwnedFd>)>, RemoteError>;

fn err(code: ErrorCode, message: impl Into<String>) -> RemoteError {
    RemoteError::new(code, message)
}

fn internal(what: &str, e: impl std::fmt::Display) -> RemoteError {
    err(ErrorCode::Internal, format!("{what}: {e}"))
}

struct Outgoing {
    bytes: Vec<u8>,
    fds: Vec<OwnedFd>,
}

struct Client {
    sock: OwnedFd,
    pid: i32,
    uid: u32,
    gid: u32,
    domain: Option<DomainId>,
    /// When it connected and when it was last heard from, on the broker's
    /// awake clock ([`io::AwakeClock`]).
    connected: std::time::Duration,
    last_seen: std::time::Duration,
    /// No rule of the policy could admit its uid: its first request is
    /// answered `Denied` and it is closed; nothing else is done for it.
    refused: bool,
    queue: VecDeque<Outgoing>,
    queued_bytes: usize,
    want_out: bool,
    doomed: bool,
}

impl Client {
    /// A client just accepted on `sock` with its `SO_PEERCRED` identity, at
    /// `now` on the awake clock; `refused`: no rule could admit its uid.
    fn accepted(
        sock: OwnedFd,
        (pid, uid, gid): (i32, u32, u32),
        now: std::time::Duration,
        refused: bool,
    ) -> Client {
        Client {
            sock,
            pid,
            uid,
            gid,
            domain: None,
            connected: now,
            last_seen: now,
            refused,
            queue: VecDeque::new(),
            queued_bytes: 0,
            want_out: false,
            doomed: false,
        }
    }
}

struct Domain {
    client: u64,
    name: String,
    slot: u32,
    arena_len: u64,
    pid: i32,
    uid: u32,
    /// Identity and label it joined with: a reloaded policy decides again on them.
    gid: u32,
    label: Option<String>,
    counters: Counters,
    services: BTreeSet<String>,
    /// Slots (of other domains, or its own) this domain has mapped.
    maps: BTreeSet<u32>,
    /// The policy rule that admitted it; decides its rights and quotas until
    /// the policy is reloaded (then the new policy decides again).
    rule: Arc<Rule>,
}

/// A PGVAS slot in use: by a live owner, or pinned by domains that still map
/// a dead owner's arena.
struct Slot {
    owner: DomainId,
    live: bool,
    /// The owner's arena, read-only; kept while the owner lives and, after it
    /// died, while some domain still maps it (messages forwarded from the dead
    /// domain may still travel downstream and need a grant).
    arena: Option<OwnedFd>,
    /// Length of that arena.
    len: u64,
    mappers: BTreeSet<DomainId>,
}

struct Conn {
    service: String,
    client: DomainId,
    server: DomainId,
}

struct Pending {
    service: String,
    client: DomainId,
    client_req: u64,
    server: DomainId,
    /// End 1 of the liveness pair, for the client once the server accepts.
    liveness: OwnedFd,
}

pub(crate) struct Server {
    cfg: Config,
    listener: OwnedFd,
    shutdown: Arc<OwnedFd>,
    reload: ReloadSlot,
    epoll: OwnedFd,
    reg: Registry,
    clients: HashMap<u64, Client>,
    next_key: u64,
    domains: BTreeMap<DomainId, Domain>,
    slots: BTreeMap<u32, Slot>,
    services: BTreeMap<String, DomainId>,
    conns: BTreeMap<ConnId, Conn>,
    pending: BTreeMap<ConnId, Pending>,
    /// Domains that died under this broker: never accepted again, even by resume.
    retired: HashSet<DomainId>,
    doomed: Vec<(u64, GoneReason)>,
    /// Slots domains held before the restart (read from the registry at startup),
    /// kept for them to resume until the grace period ends.
    reserved: BTreeMap<u32, DomainId>,
    /// What the broker recorded about domains (for their resume), and about
    /// connections and mappings before the restart.
    recorded: Recorded,
    /// Connections re-reported by one side only; checked when the grace period ends.
    unconfirmed: BTreeSet<ConnId>,
    grace_end: Instant,
    /// Set once the end-of-grace work ran.
    grace_over: bool,
    after_reply: Vec<(DomainId, Event)>,
    buf: Vec<u8>,
    /// The policy's rules, shared with the domains they admitted.
    rules: Vec<Arc<Rule>>,
    /// Who is charged for which application registry key.
    acct: RegAccount,
    /// vPipe: pipes, running transfers, the engine.
    pipes: pipes::PipeState,
    /// Who gets in and when silence counts: the awake clock, unjoined
    /// clients per uid, the listener's back-off.
    intake: io::Intake,
    /// MMNet: offered segments and published listeners.
    net: net::NetState,
}

impl Server {
    pub(crate) fn new(
        cfg: Config,
        listener: OwnedFd,
        shutdown: Arc<OwnedFd>,
        reload: ReloadSlot,
        reg: Registry,
        reserved: BTreeMap<u32, DomainId>,
        recorded: Recorded,
    ) -> Result<Server, BrokerError> {
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(|source| BrokerError::Sys {
            what: "epoll_create",
            source,
        })?;
        let add = |fd, key| {
            epoll::add(
                &ep,
                fd,
                epoll::EventData::new_u64(key),
                epoll::EventFlags::IN,
            )
            .map_err(|source| BrokerError::Sys {
                what: "epoll_ctl",
                source,
            })
        };
        add(listener.as_fd(), KEY_LISTENER)?;
        add(shutdown.as_fd(), KEY_SHUTDOWN)?;
        add(reload.event.as_fd(), KEY_RELOAD)?;
        let pipe_state = pipes::PipeState::new(&cfg)?;
        add(pipe_state.engine.done_fd(), KEY_PIPE)?;
        let grace_end = Instant::now() + cfg.heartbeat_timeout();
        let rules = cfg.policy.rules.iter().cloned().map(Arc::new).collect();
        tracing::info!(
            policy = cfg.policy.source,
            rules = cfg.policy.rules.len(),
            "access policy loaded"
        );
        Ok(Server {
            cfg,
            listener,
            shutdown,
            reload,
            epoll: ep,
            reg,
            clients: HashMap::new(),
            next_key: FIRST_CLIENT_KEY,
            domains: BTreeMap::new(),
            slots: BTreeMap::new(),
            services: BTreeMap::new(),
            conns: BTreeMap::new(),
            pending: BTreeMap::new(),
            retired: HashSet::new(),
            doomed: Vec::new(),
            reserved,
            recorded,
            unconfirmed: BTreeSet::new(),
            grace_end,
            grace_over: false,
            after_reply: Vec::new(),
            buf: vec![0u8; fido_proto::MAX_MESSAGE],
            rules,
            acct: RegAccount::default(),
            pipes: pipe_state,
            intake: io::Intake::new(),
            net: net::NetState::default(),
        })
    }
}
