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

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fido_proto::{
    BrokerMsg, ClientMsg, ConnId, ConnStatus, Counters, DomainId, DomainStatus, ErrorCode, Event,
    GoneReason, PeerInfo, ProtoError, RemoteError, Reply, Request, Resume, RingBlock, Status,
    TxnOp,
};
use fido_registry::{Registry, WatchEvent};
use rustix::event::epoll;
use rustix::io::Errno;
use rustix::net::SocketFlags;

use crate::account::RegAccount;
use crate::policy::{JoinDenied, Rule};
use crate::ReloadSlot;
use crate::sys::{self, Recv};
use crate::{BrokerError, Config};

/// Registry subtrees the broker owns: cleared at startup, read-only to applications.
pub(crate) const MANAGED: [&str; 3] = ["/domain", "/service", "/connection"];

const KEY_LISTENER: u64 = 0;
const KEY_SHUTDOWN: u64 = 1;
const KEY_RELOAD: u64 = 2;
/// The pipe engine's completion eventfd.
const KEY_PIPE: u64 = 3;
const FIRST_CLIENT_KEY: u64 = 4;

#[path = "pipe_server.rs"]
mod pipes;

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
    last_seen: Instant,
    queue: VecDeque<Outgoing>,
    queued_bytes: usize,
    want_out: bool,
    doomed: bool,
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
}

impl Server {
    pub(crate) fn new(
        cfg: Config,
        listener: OwnedFd,
        shutdown: Arc<OwnedFd>,
        reload: ReloadSlot,
        reg: Registry,
        reserved: BTreeMap<u32, DomainId>,
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
            unconfirmed: BTreeSet::new(),
            grace_end,
            grace_over: false,
            after_reply: Vec::new(),
            buf: vec![0u8; fido_proto::MAX_MESSAGE],
            rules,
            acct: RegAccount::default(),
            pipes: pipe_state,
        })
    }

    pub(crate) fn run(mut self) -> Result<(), BrokerError> {
        let tick = self.cfg.heartbeat.min(Duration::from_secs(1));
        let mut next_tick = Instant::now() + tick;
        let mut events: Vec<epoll::Event> = Vec::with_capacity(64);
        loop {
            let now = Instant::now();
            if now >= next_tick {
                self.tick(now);
                self.reap();
                next_tick = now + tick;
            }
            let wait = next_tick.saturating_duration_since(now);
            let timeout = rustix::event::Timespec {
                tv_sec: wait.as_secs() as _,
                tv_nsec: wait.subsec_nanos() as _,
            };
            events.clear();
            match epoll::wait(
                &self.epoll,
                rustix::buffer::spare_capacity(&mut events),
                Some(&timeout),
            ) {
                Ok(_) => {}
                Err(Errno::INTR) => continue,
                Err(source) => {
                    return Err(BrokerError::Sys {
                        what: "epoll_wait",
                        source,
                    })
                }
            }
            for ev in events.iter().copied() {
                let data = ev.data;
                let flags = ev.flags;
                match data.u64() {
                    KEY_LISTENER => self.accept_all(),
                    KEY_SHUTDOWN => {
                        let mut b = [0u8; 8];
                        let _ = rustix::io::read(self.shutdown.as_fd(), &mut b);
                        tracing::info!(domains = self.domains.len(), "broker shutting down");
                        return Ok(());
                    }
                    KEY_RELOAD => {
                        let mut b = [0u8; 8];
                        let _ = rustix::io::read(self.reload.event.as_fd(), &mut b);
                        let next = self.reload.pending.lock().unwrap_or_else(|e| e.into_inner()).take();
                        if let Some(policy) = next {
                            self.apply_policy(policy);
                            for (dom, event) in std::mem::take(&mut self.after_reply) {
                                self.send_event(dom, event, Vec::new());
                            }
                        }
                    }
                    KEY_PIPE => self.pipe_completions(),
                    key => self.client_ready(key, flags),
                }
                self.reap();
            }
        }
    }

    // ----- sockets ------------------------------------------------------------

    fn accept_all(&mut self) {
        loop {
            let sock = match rustix::net::accept_with(
                &self.listener,
                SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            ) {
                Ok(s) => s,
                Err(Errno::AGAIN) => return,
                Err(Errno::INTR) | Err(Errno::CONNABORTED) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    return;
                }
            };
            let cred = match rustix::net::sockopt::socket_peercred(&sock) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "SO_PEERCRED failed; dropping connection");
                    continue;
                }
            };
            // Big enough for any control message as one datagram (the kernel caps it).
            let _ = rustix::net::sockopt::set_socket_send_buffer_size(&sock, 1 << 20);
            let key = self.next_key;
            self.next_key += 1;
            if let Err(e) = epoll::add(
                &self.epoll,
                &sock,
                epoll::EventData::new_u64(key),
                epoll::EventFlags::IN,
            ) {
                tracing::warn!(error = %e, "epoll_ctl failed; dropping connection");
                continue;
            }
            let client = Client {
                sock,
                pid: cred.pid.as_raw_nonzero().get(),
                uid: cred.uid.as_raw(),
                gid: cred.gid.as_raw(),
                domain: None,
                last_seen: Instant::now(),
                queue: VecDeque::new(),
                queued_bytes: 0,
                want_out: false,
                doomed: false,
            };
            tracing::debug!(
                pid = client.pid,
                uid = client.uid,
                gid = client.gid,
                "client connected"
            );
            self.clients.insert(key, client);
        }
    }

    fn client_ready(&mut self, key: u64, flags: epoll::EventFlags) {
        if flags.contains(epoll::EventFlags::OUT) {
            self.flush(key);
        }
        if !flags
            .intersects(epoll::EventFlags::IN | epoll::EventFlags::HUP | epoll::EventFlags::ERR)
        {
            return;
        }
        for _ in 0..MAX_BATCH {
            let Some(c) = self.clients.get_mut(&key) else {
                return;
            };
            if c.doomed {
                return;
            }
            match sys::recv(c.sock.as_fd(), &mut self.buf) {
                Ok(Recv::WouldBlock) => return,
                Ok(Recv::Eof) => {
                    self.doom(key, GoneReason::Exited);
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "client socket error");
                    self.doom(key, GoneReason::Exited);
                    return;
                }
                Ok(Recv::Msg {
                    len,
                    fds,
                    truncated,
                }) => {
                    c.last_seen = Instant::now();
                    let bytes = self.buf[..len].to_vec();
                    self.message(key, &bytes, fds, truncated);
                }
            }
        }
    }

    fn doom(&mut self, key: u64, reason: GoneReason) {
        if let Some(c) = self.clients.get_mut(&key) {
            if !c.doomed {
                c.doomed = true;
                self.doomed.push((key, reason));
            }
        }
    }

    /// Tears down every doomed client (which may doom others: loop until none).
    fn reap(&mut self) {
        while let Some((key, reason)) = self.doomed.pop() {
            let Some(c) = self.clients.remove(&key) else {
                continue;
            };
            let _ = epoll::delete(&self.epoll, &c.sock);
            match c.domain {
                Some(id) => self.domain_death(id, reason),
                None => tracing::debug!(pid = c.pid, "unjoined client disconnected"),
            }
            // Dropping `c` closes the socket.
        }
    }

    fn send(&mut self, key: u64, msg: &BrokerMsg, fds: Vec<OwnedFd>) {
        let bytes = match fido_proto::encode(msg) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "could not encode a broker message");
                return;
            }
        };
        let Some(c) = self.clients.get_mut(&key) else {
            return;
        };
        if c.doomed {
            return;
        }
        if c.queue.is_empty() {
            match sys::send(c.sock.as_fd(), &bytes, &fds) {
                Ok(()) => return,
                Err(Errno::AGAIN) => {}
                Err(e) => {
                    tracing::debug!(error = %e, pid = c.pid, "send to client failed");
                    c.doomed = true;
                    self.doomed.push((key, GoneReason::Exited));
                    return;
                }
            }
        }
        if c.queue.len() >= MAX_QUEUED_MSGS || c.queued_bytes + bytes.len() > MAX_QUEUED_BYTES {
            tracing::warn!(pid = c.pid, domain = ?c.domain, "client does not read its socket; dropping it");
            c.doomed = true;
            self.doomed.push((key, GoneReason::Exited));
            return;
        }
        c.queued_bytes += bytes.len();
        c.queue.push_back(Outgoing { bytes, fds });
        if !c.want_out {
            c.want_out = true;
            let _ = epoll::modify(
                &self.epoll,
                &c.sock,
                epoll::EventData::new_u64(key),
                epoll::EventFlags::IN | epoll::EventFlags::OUT,
            );
        }
    }

    fn flush(&mut self, key: u64) {
        let Some(c) = self.clients.get_mut(&key) else {
            return;
        };
        while let Some(front) = c.queue.front() {
            if c.doomed {
                return;
            }
            match sys::send(c.sock.as_fd(), &front.bytes, &front.fds) {
                Ok(()) => {
                    c.queued_bytes -= front.bytes.len();
                    c.queue.pop_front();
                }
                Err(Errno::AGAIN) => return,
                Err(_) => {
                    c.doomed = true;
                    self.doomed.push((key, GoneReason::Exited));
                    return;
                }
            }
        }
        if c.want_out {
            c.want_out = false;
            let _ = epoll::modify(
                &self.epoll,
                &c.sock,
                epoll::EventData::new_u64(key),
                epoll::EventFlags::IN,
            );
        }
    }

    fn reply(&mut self, key: u64, id: u64, body: Result<Reply, RemoteError>, fds: Vec<OwnedFd>) {
        let msg = BrokerMsg::Reply { id, body };
        let size = fido_proto::encode(&msg).map(|b| b.len());
        match size {
            Ok(n) if n <= MAX_REPLY => self.send(key, &msg, fds),
            Ok(n) => {
                let e = internal("reply too large", format!("{n} bytes; narrow the request"));
                self.send(key, &BrokerMsg::Reply { id, body: Err(e) }, Vec::new())
            }
            Err(e) => {
                let e = internal("could not encode reply", e);
                self.send(key, &BrokerMsg::Reply { id, body: Err(e) }, Vec::new())
            }
        }
    }

    fn send_event(&mut self, domain: DomainId, event: Event, fds: Vec<OwnedFd>) {
        if let Some(key) = self.domains.get(&domain).map(|d| d.client) {
            self.send(key, &BrokerMsg::Event(event), fds);
        }
    }

    fn deliver(&mut self, events: Vec<WatchEvent>) {
        for e in events {
            self.send_event(
                e.owner,
                Event::Watch {
                    token: e.token,
                    path: e.path,
                    value: e.value,
                },
                Vec::new(),
            );
        }
    }

    // ----- registry helpers for broker-managed keys ---------------------------

    fn reg_write(&mut self, path: &str, value: &[u8]) {
        match self.reg.write(path, value) {
            Ok(events) => self.deliver(events),
            Err(e) => tracing::warn!(path, error = %e, "registry write failed"),
        }
    }

    fn reg_delete(&mut self, path: &str) {
        match self.reg.delete(path) {
            Ok(events) => self.deliver(events),
            Err(e) => tracing::warn!(path, error = %e, "registry delete failed"),
        }
    }

    /// Moves a persistent counter past `id`; returns false if `id` is absurdly far ahead.
    fn advance_counter(&mut self, name: &str, id: u64) -> Result<(), RemoteError> {
        for _ in 0..MAX_COUNTER_ADVANCE {
            let v = self
                .reg
                .next_counter(name)
                .map_err(|e| internal("registry counter", e))?;
            if v > id {
                return Ok(());
            }
        }
        Err(err(
            ErrorCode::BadRequest,
            format!("resumed {name} id {id} is far beyond this broker's counter; join afresh"),
        ))
    }

    // ----- messages -----------------------------------------------------------

    fn message(&mut self, key: u64, bytes: &[u8], fds: Vec<OwnedFd>, truncated: bool) {
        let decoded = if truncated {
            Err(ProtoError::Invalid(
                "message (data or descriptors truncated)",
            ))
        } else {
            fido_proto::decode::<ClientMsg>(bytes)
        };
        let msg = match decoded {
            Ok(m) => m,
            Err(e) => {
                drop(fds);
                let pid = self.clients.get(&key).map(|c| c.pid);
                tracing::warn!(pid, error = %e, "malformed control message");
                match (peek_id(bytes), e) {
                    (id, ProtoError::Version(v)) => {
                        let msg = format!(
                            "protocol version {v} not supported; this broker speaks {}",
                            fido_proto::PROTOCOL_VERSION
                        );
                        self.reply(
                            key,
                            id.unwrap_or(0),
                            Err(err(ErrorCode::Version, msg)),
                            Vec::new(),
                        );
                        self.doom(key, GoneReason::Exited);
                    }
                    (Some(id), e) => {
                        let msg = format!("malformed request: {e}");
                        self.reply(key, id, Err(err(ErrorCode::BadRequest, msg)), Vec::new());
                    }
                    (None, _) => self.doom(key, GoneReason::Exited),
                }
                return;
            }
        };
        let (id, body) = match msg {
            ClientMsg::Heartbeat => {
                if !fds.is_empty() {
                    tracing::warn!("heartbeat carried descriptors; closed them");
                }
                return;
            }
            ClientMsg::Request { id, body } => (id, body),
        };
        let joined = self.clients.get(&key).and_then(|c| c.domain);
        let result = match (joined, body) {
            (
                None,
                Request::Join {
                    name,
                    label,
                    arena_len,
                    resume,
                },
            ) => self.join(key, name, label, arena_len, resume, fds),
            (Some(d), Request::Join { .. }) => Err(err(
                ErrorCode::AlreadyJoined,
                format!("this socket already joined as domain {d}"),
            )),
            (None, _) => Err(err(
                ErrorCode::NotJoined,
                "the first request on a connection must be Join",
            )),
            (Some(d), body) => self.request(key, d, id, body, fds),
        };
        match result {
            Ok(Some((reply, fds))) => self.reply(key, id, Ok(reply), fds),
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(domain = ?joined, error = %e, "request failed");
                self.reply(key, id, Err(e), Vec::new())
            }
        }
        // Events that must follow the reply (e.g. PeerGone for a resumed
        // connection whose peer did not come back).
        for (dom, event) in std::mem::take(&mut self.after_reply) {
            self.send_event(dom, event, Vec::new());
        }
    }

    fn request(
        &mut self,
        key: u64,
        dom: DomainId,
        id: u64,
        body: Request,
        fds: Vec<OwnedFd>,
    ) -> Handled {
        // Only Connect and Accept carry descriptors; everywhere else they are a mistake.
        let takes_fds = matches!(
            body,
            Request::Connect { .. } | Request::Accept { .. } | Request::PipeCreate | Request::PipeOnce { .. }
        );
        if !takes_fds && !fds.is_empty() {
            return Err(err(
                ErrorCode::BadDescriptor,
                format!("this request carries no descriptors, got {}", fds.len()),
            ));
        }
        match body {
            Request::Join { .. } => unreachable!("handled by the caller"),
            Request::Leave => {
                self.reply(key, id, Ok(Reply::Ok), Vec::new());
                self.doom(key, GoneReason::Left);
                Ok(None)
            }
            Request::Offer { service } => self.offer(dom, service),
            Request::Withdraw { service } => {
                if self.services.get(&service) != Some(&dom) {
                    return Err(err(
                        ErrorCode::NoSuchService,
                        format!("you do not offer service {service:?}"),
                    ));
                }
                self.withdraw(dom, &service);
                Ok(Some((Reply::Ok, Vec::new())))
            }
            Request::Connect { service, block } => self.connect(dom, id, service, block, fds),
            Request::Accept { conn, block } => self.accept(key, dom, id, conn, block, fds),
            Request::Refuse { conn, reason } => {
                match self.pending.get(&conn) {
                    Some(p) if p.server == dom => {}
                    _ => return Err(no_pending(conn)),
                }
                let p = self.pending.remove(&conn).expect("checked above");
                tracing::info!(conn, service = p.service, reason, "connection refused");
                self.reply_to_domain(
                    p.client,
                    p.client_req,
                    Err(err(ErrorCode::Refused, reason)),
                    Vec::new(),
                );
                Ok(Some((Reply::Ok, Vec::new())))
            }
            Request::Close { conn } => self.close(dom, conn),
            Request::GrantSlot { slot } => {
                // A live owner's arena, or a dead owner's that someone still
                // maps (a message it sent may still be on its way downstream).
                let Some(s) = self
                    .slots
                    .get_mut(&slot)
                    .filter(|s| s.live || (s.arena.is_some() && !s.mappers.is_empty()))
                else {
                    return Err(err(
                        ErrorCode::NoSuchDomain,
                        format!("no domain owns slot {slot}"),
                    ));
                };
                let owner = s.owner;
                let live = s.live;
                let already = s.mappers.contains(&dom);
                let holders: Vec<DomainId> = s.mappers.iter().copied().collect();
                let reachable = if live {
                    self.connected_path(dom, owner)
                } else {
                    holders.iter().any(|h| *h == dom || self.connected_path(dom, *h))
                };
                if owner != dom && !already && !reachable {
                    return Err(self.deny(
                        dom,
                        format!(
                            "no grant of slot {slot}: this domain has no connection path to its owner, domain {owner} \
                             (a grant needs a chain of established connections, as a forwarded pointer travels)"
                        ),
                    ));
                }
                let Some(s) = self.slots.get_mut(&slot) else {
                    return Err(internal("slot vanished", slot));
                };
                let arena = s
                    .arena
                    .as_ref()
                    .ok_or_else(|| internal("slot has no arena", slot))?;
                let fd = sys::dup(arena.as_fd()).map_err(|e| internal("dup", e))?;
                s.mappers.insert(dom);
                let arena_len = s.len;
                if let Some(d) = self.domains.get_mut(&dom) {
                    d.maps.insert(slot);
                }
                if !live {
                    // Say first that the owner is dead, so the requester unmaps
                    // the arena once it is done with it.
                    self.send_event(
                        dom,
                        Event::PeerGone { domain: owner, conn: None, reason: GoneReason::Exited },
                        Vec::new(),
                    );
                }
                Ok(Some((
                    Reply::Grant {
                        owner,
                        slot,
                        arena_len,
                    },
                    vec![fd],
                )))
            }
            Request::Unmapped { slot, owner } => {
                if let Some(s) = self.slots.get_mut(&slot).filter(|s| s.owner == owner) {
                    s.mappers.remove(&dom);
                    if let Some(d) = self.domains.get_mut(&dom) {
                        d.maps.remove(&slot);
                    }
                    self.maybe_free(slot);
                }
                Ok(Some((Reply::Ok, Vec::new())))
            }
            Request::Read { path } => {
                let v = self
                    .reg
                    .read(&path)
                    .map_err(|e| internal("registry read", e))?;
                Ok(Some((Reply::Value(v), Vec::new())))
            }
            Request::List { path } => {
                let v = self
                    .reg
                    .list(&path)
                    .map_err(|e| internal("registry list", e))?;
                Ok(Some((Reply::Keys(v), Vec::new())))
            }
            Request::Write { path, value } => {
                check_writable(&path)?;
                self.check_reg_access(dom, &path, false)?;
                let op = [TxnOp::Put { path, value }];
                let overlay = self.charge(dom, &op)?;
                let [TxnOp::Put { path, value }] = &op else {
                    unreachable!()
                };
                let events = self
                    .reg
                    .write(path, value)
                    .map_err(|e| internal("registry write", e))?;
                self.acct.commit(overlay);
                self.deliver(events);
                Ok(Some((Reply::Ok, Vec::new())))
            }
            Request::Delete { path } => {
                check_writable(&path)?;
                self.check_reg_access(dom, &path, true)?;
                let op = [TxnOp::Delete { path }];
                let overlay = self.charge(dom, &op)?;
                let [TxnOp::Delete { path }] = &op else {
                    unreachable!()
                };
                let events = self
                    .reg
                    .delete(path)
                    .map_err(|e| internal("registry delete", e))?;
                self.acct.commit(overlay);
                self.deliver(events);
                Ok(Some((Reply::Ok, Vec::new())))
            }
            Request::Watch { token, prefix } => {
                let limit = self.domains.get(&dom).map_or(0, |d| d.rule.quotas.watches);
                let held = self.reg.watch_count(dom) as u64;
                // Re-using a token replaces that watch: it does not add one.
                if held >= limit && !self.reg.unwatch(dom, token) {
                    return Err(self.quota(
                        dom,
                        format!(
                            "too many registry watches: this domain holds {held} (limit {limit})"
                        ),
                    ));
                }
                self.reg
                    .watch(dom, token, &prefix)
                    .map_err(|e| internal("registry watch", e))?;
                Ok(Some((Reply::Ok, Vec::new())))
            }
            Request::Unwatch { token } => {
                self.reg.unwatch(dom, token);
                Ok(Some((Reply::Ok, Vec::new())))
            }
            Request::Transaction { ops } => {
                for op in &ops {
                    match op {
                        TxnOp::Put { path, .. } => {
                            check_writable(path)?;
                            self.check_reg_access(dom, path, false)?;
                        }
                        TxnOp::Delete { path } => {
                            check_writable(path)?;
                            self.check_reg_access(dom, path, true)?;
                        }
                        TxnOp::Check { .. } | TxnOp::Read { .. } => {}
                    }
                }
                let overlay = self.charge(dom, &ops)?;
                let out = self
                    .reg
                    .transact(&ops)
                    .map_err(|e| internal("registry transaction", e))?;
                if out.committed {
                    self.acct.commit(overlay);
                }
                self.deliver(out.events);
                Ok(Some((
                    Reply::Txn {
                        committed: out.committed,
                        reads: out.reads,
                    },
                    Vec::new(),
                )))
            }
            Request::Status => Ok(Some((Reply::Status(self.status()), Vec::new()))),
            body @ (Request::PipeCreate
            | Request::PipeRun { .. }
            | Request::PipeOnce { .. }
            | Request::PipeCancel { .. }
            | Request::PipeDestroy { .. }
            | Request::PipeWeight { .. }) => self.pipe_request(key, dom, id, body, fds),
            Request::Counters { counters } => {
                if let Some(d) = self.domains.get_mut(&dom) {
                    d.counters = counters;
                }
                Ok(Some((Reply::Ok, Vec::new())))
            }
        }
    }

    fn reply_to_domain(
        &mut self,
        dom: DomainId,
        id: u64,
        body: Result<Reply, RemoteError>,
        fds: Vec<OwnedFd>,
    ) {
        if let Some(key) = self.domains.get(&dom).map(|d| d.client) {
            self.reply(key, id, body, fds);
        }
    }

    // ----- join ---------------------------------------------------------------

    fn join(
        &mut self,
        key: u64,
        name: String,
        label: Option<String>,
        arena_len: u64,
        resume: Option<Resume>,
        mut fds: Vec<OwnedFd>,
    ) -> Handled {
        if fds.len() != 1 {
            return Err(err(
                ErrorCode::BadDescriptor,
                format!(
                    "Join carries exactly one descriptor (the arena, read-only); got {}",
                    fds.len()
                ),
            ));
        }
        let arena = fds.pop().expect("one descriptor");
        let geo = self.cfg.geometry;
        if arena_len == 0 || arena_len > geo.slot_size {
            return Err(err(
                ErrorCode::BadDescriptor,
                format!(
                    "arena of {arena_len} bytes does not fit a PGVAS slot of {} bytes",
                    geo.slot_size
                ),
            ));
        }
        let (pid, uid, gid) = {
            let c = self
                .clients
                .get(&key)
                .expect("client exists while handling its message");
            (c.pid, c.uid, c.gid)
        };
        let rule = match self.cfg.policy.decide(uid, gid, label.as_deref()) {
            Ok(i) => self.rules[i].clone(),
            Err(why) => {
                let reason = match why {
                    JoinDenied::NoRule => "no rule matches".to_string(),
                    JoinDenied::Forbidden(r) => format!("rule {r} says join = false"),
                };
                let msg = format!(
                    "uid {uid} (gid {gid}, label {label:?}) may not join: {reason} (policy {})",
                    self.cfg.policy.source
                );
                tracing::warn!(pid, uid, gid, name, "denied: {msg}");
                return Err(err(ErrorCode::Denied, msg));
            }
        };
        if arena_len > rule.quotas.arena_bytes {
            let msg = format!(
                "arena of {arena_len} bytes is over this domain's quota (limit {}; rule {})",
                rule.quotas.arena_bytes, rule.name
            );
            tracing::warn!(pid, uid, name, "quota: {msg}");
            return Err(err(ErrorCode::Quota, msg));
        }
        fido_shm::check_grant(arena.as_fd(), arena_len).map_err(|e| {
            err(
                ErrorCode::BadDescriptor,
                format!("arena refused: {e} (it must be a sealed memfd re-opened read-only)"),
            )
        })?;

        let (id, slot) = match &resume {
            None => {
                let slot = self.free_slot().ok_or_else(|| {
                    err(
                        ErrorCode::Quota,
                        format!("all {} PGVAS slots are in use", geo.slots),
                    )
                })?;
                let id = self
                    .reg
                    .next_counter("domain")
                    .map_err(|e| internal("registry counter", e))?;
                (id, slot)
            }
            Some(r) => {
                if self.domains.contains_key(&r.domain) {
                    return Err(err(
                        ErrorCode::AlreadyJoined,
                        format!("domain {} is already live", r.domain),
                    ));
                }
                if self.retired.contains(&r.domain) {
                    return Err(err(
                        ErrorCode::Denied,
                        format!(
                            "domain {} was declared dead by this broker; join without resume",
                            r.domain
                        ),
                    ));
                }
                if r.slot >= geo.slots {
                    return Err(err(
                        ErrorCode::BadRequest,
                        format!("slot {} is outside the PGVAS window", r.slot),
                    ));
                }
                match self.slots.get(&r.slot) {
                    None => {}
                    Some(s) if s.owner == r.domain && !s.live => {}
                    Some(s) => {
                        return Err(err(
                            ErrorCode::Unavailable,
                            format!(
                                "slot {} is held by domain {}; join without resume",
                                r.slot, s.owner
                            ),
                        ))
                    }
                }
                if matches!(self.reserved.get(&r.slot), Some(&o) if o != r.domain) {
                    return Err(err(
                        ErrorCode::Unavailable,
                        format!(
                            "slot {} belonged to another domain before the restart",
                            r.slot
                        ),
                    ));
                }
                self.advance_counter("domain", r.domain)?;
                self.reserved.remove(&r.slot);
                (r.domain, r.slot)
            }
        };

        if let Some(c) = self.clients.get_mut(&key) {
            c.domain = Some(id);
        }
        match self.slots.get_mut(&slot) {
            Some(s) => {
                s.live = true;
                s.arena = Some(arena);
                s.len = arena_len;
            }
            None => {
                self.slots.insert(
                    slot,
                    Slot {
                        owner: id,
                        live: true,
                        arena: Some(arena),
                        len: arena_len,
                        mappers: BTreeSet::new(),
                    },
                );
            }
        }
        self.domains.insert(
            id,
            Domain {
                client: key,
                name: name.clone(),
                slot,
                arena_len,
                pid,
                uid,
                gid,
                label: label.clone(),
                counters: Counters::default(),
                services: BTreeSet::new(),
                maps: BTreeSet::new(),
                rule,
            },
        );
        let base = format!("/domain/{id}");
        self.reg_write(&format!("{base}/name"), name.as_bytes());
        self.reg_write(&format!("{base}/pid"), pid.to_string().as_bytes());
        self.reg_write(&format!("{base}/uid"), uid.to_string().as_bytes());
        self.reg_write(&format!("{base}/slot"), slot.to_string().as_bytes());
        if let Some(l) = &label {
            self.reg_write(&format!("{base}/label"), l.as_bytes());
        }

        if let Some(r) = resume {
            self.resume(id, r);
            // Connections are re-registered as they were; the policy (which
            // may have changed across the restart) decides whether they stay.
            self.enforce_connect_policy();
            tracing::info!(domain = id, slot, name, pid, uid, "domain resumed");
        } else {
            tracing::info!(domain = id, slot, name, pid, uid, "domain joined");
        }
        if let Some(d) = self.domains.get(&id) {
            tracing::debug!(domain = id, rule = d.rule.name, "policy rule");
        }
        let joined = Reply::Joined {
            domain: id,
            slot,
            geometry: geo,
            heartbeat_ms: self
                .cfg
                .heartbeat
                .as_millis()
                .try_into()
                .unwrap_or(u64::MAX),
        };
        Ok(Some((joined, Vec::new())))
    }
}

impl Server {
    // ----- slots --------------------------------------------------------------

    /// Lowest slot with no live owner, no remaining mappers and no reservation.
    fn free_slot(&self) -> Option<u32> {
        (0..self.cfg.geometry.slots)
            .find(|s| !self.slots.contains_key(s) && !self.reserved.contains_key(s))
    }

    /// Frees a slot whose owner is dead once nobody maps it any more.
    fn maybe_free(&mut self, slot: u32) {
        if let Some(s) = self.slots.get(&slot) {
            if !s.live && s.mappers.is_empty() {
                tracing::debug!(slot, owner = s.owner, "slot free again");
                self.slots.remove(&slot);
            }
        }
    }

    fn add_mapping(&mut self, mapper: DomainId, slot: u32) {
        if let Some(s) = self.slots.get_mut(&slot) {
            s.mappers.insert(mapper);
            if let Some(d) = self.domains.get_mut(&mapper) {
                d.maps.insert(slot);
            }
        }
    }

    fn peer_info(&self, dom: DomainId) -> Option<PeerInfo> {
        self.domains.get(&dom).map(|d| PeerInfo {
            domain: dom,
            name: d.name.clone(),
            slot: d.slot,
            arena_len: d.arena_len,
            uid: d.uid,
            pid: d.pid,
        })
    }

    fn arena_dup(&self, dom: DomainId) -> Result<OwnedFd, RemoteError> {
        let slot = self.domains.get(&dom).map(|d| d.slot);
        let arena = slot
            .and_then(|s| self.slots.get(&s))
            .and_then(|s| s.arena.as_ref())
            .ok_or_else(|| internal("arena", format!("domain {dom} has no arena on record")))?;
        sys::dup(arena.as_fd()).map_err(|e| internal("dup", e))
    }

    // ----- resume -------------------------------------------------------------

    fn resume(&mut self, id: DomainId, r: Resume) {
        for service in r.services.iter().cloned().collect::<BTreeSet<_>>() {
            if let Err(e) = self.offer(id, service.clone()) {
                tracing::warn!(domain = id, service, error = %e, "resumed service dropped");
            }
        }

        for (slot, owner) in r.mapped {
            if slot >= self.cfg.geometry.slots {
                tracing::warn!(
                    domain = id,
                    slot,
                    "resumed mapping outside the PGVAS window ignored"
                );
                continue;
            }
            match self.slots.get_mut(&slot) {
                Some(s) if s.owner == owner => {
                    s.mappers.insert(id);
                }
                Some(s) => {
                    tracing::warn!(
                        domain = id,
                        slot,
                        owner,
                        holder = s.owner,
                        "resumed mapping conflicts; ignored"
                    );
                    continue;
                }
                None => {
                    // Pin the slot for its owner, who may resume later.
                    self.slots.insert(
                        slot,
                        Slot {
                            owner,
                            live: false,
                            arena: None,
                            len: 0,
                            mappers: BTreeSet::from([id]),
                        },
                    );
                }
            }
            if let Some(d) = self.domains.get_mut(&id) {
                d.maps.insert(slot);
            }
        }

        let mut max_conn = None;
        let in_grace = Instant::now() < self.grace_end;
        for (conn, peer, service) in r.connections {
            if let Some(c) = self.conns.get(&conn) {
                if c.client == id || c.server == id {
                    self.unconfirmed.remove(&conn);
                } else {
                    tracing::warn!(
                        domain = id,
                        conn,
                        "resumed connection belongs to other domains; ignored"
                    );
                }
                continue;
            }
            if self.pending.contains_key(&conn) {
                tracing::warn!(
                    domain = id,
                    conn,
                    "resumed connection id clashes with a new one; ignored"
                );
                continue;
            }
            let peer_live = self.domains.contains_key(&peer);
            if !peer_live && (!in_grace || self.retired.contains(&peer)) {
                self.after_reply.push((
                    id,
                    Event::PeerGone {
                        domain: peer,
                        conn: Some(conn),
                        reason: GoneReason::MissedHeartbeat,
                    },
                ));
                continue;
            }
            // Who is the server? The side offering the service (the resuming
            // domain if it offers it, else the peer).
            let i_serve = self.services.get(&service) == Some(&id) && peer != id;
            let (client, server) = if i_serve { (peer, id) } else { (id, peer) };
            self.conns.insert(
                conn,
                Conn {
                    service: service.clone(),
                    client,
                    server,
                },
            );
            if !peer_live {
                self.unconfirmed.insert(conn);
            }
            self.write_conn_keys(conn);
            max_conn = max_conn.max(Some(conn));
        }
        if let Some(max) = max_conn {
            if let Err(e) = self.advance_counter("connection", max) {
                tracing::warn!(domain = id, error = %e, "could not advance the connection counter");
            }
        }

        let limit = self.domains.get(&id).map_or(0, |d| d.rule.quotas.watches);
        for (token, prefix) in r.watches {
            if self.reg.watch_count(id) as u64 >= limit {
                tracing::warn!(
                    domain = id,
                    token,
                    prefix,
                    limit,
                    "resumed watch over quota dropped"
                );
                continue;
            }
            if let Err(e) = self.reg.watch(id, token, &prefix) {
                tracing::warn!(domain = id, token, prefix, error = %e, "resumed watch dropped");
            }
        }
    }

    // ----- policy and quotas --------------------------------------------------

    /// Installs a new policy and applies it to everything live: domains are
    /// admitted again (or evicted), services and connections the new rules do
    /// not allow are withdrawn and revoked. Quotas apply to what is charged
    /// from now on; usage already above a lowered quota is not taken away.
    fn apply_policy(&mut self, policy: crate::Policy) {
        tracing::info!(
            policy = policy.source,
            rules = policy.rules.len(),
            "access policy reloaded"
        );
        self.rules = policy.rules.iter().cloned().map(Arc::new).collect();
        self.cfg.policy = Arc::new(policy);
        let ids: Vec<DomainId> = self.domains.keys().copied().collect();
        for id in ids {
            let d = &self.domains[&id];
            match self.cfg.policy.decide(d.uid, d.gid, d.label.as_deref()) {
                Ok(i) => {
                    let rule = self.rules[i].clone();
                    if let Some(d) = self.domains.get_mut(&id) {
                        d.rule = rule;
                    }
                }
                Err(_) => {
                    tracing::warn!(
                        domain = id,
                        uid = d.uid,
                        gid = d.gid,
                        label = d.label,
                        "evicted: the reloaded policy no longer admits this domain"
                    );
                    let key = d.client;
                    self.doom(key, GoneReason::Evicted);
                }
            }
        }
        self.reap();
        self.pipe_policy_reloaded();
        let offered: Vec<(String, DomainId)> =
            self.services.iter().map(|(s, d)| (s.clone(), *d)).collect();
        for (service, dom) in offered {
            if !self.domains.get(&dom).is_some_and(|d| d.rule.may_offer(&service)) {
                tracing::warn!(domain = dom, service, "service withdrawn: the reloaded policy forbids offering it");
                self.withdraw(dom, &service);
            }
        }
        self.enforce_connect_policy();
    }

    /// Revokes every connection (established or waiting for its server) whose
    /// client may not connect to its service under the current rules. Runs
    /// after a policy reload and after a domain resumed its connections.
    fn enforce_connect_policy(&mut self) {
        let denied = |server: &Server, client: DomainId, service: &str| {
            server
                .domains
                .get(&client)
                .is_some_and(|d| !d.rule.may_connect(service))
        };
        let revoked: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| denied(self, c.client, &c.service))
            .map(|(c, _)| *c)
            .collect();
        for conn in revoked {
            self.revoke(conn);
        }
        let waiting: Vec<ConnId> = self
            .pending
            .iter()
            .filter(|(_, p)| denied(self, p.client, &p.service))
            .map(|(c, _)| *c)
            .collect();
        for conn in waiting {
            let p = self.pending.remove(&conn).expect("listed above");
            let e = self.deny(p.client, format!("may not connect to service {:?} (policy reloaded)", p.service));
            self.reply_to_domain(p.client, p.client_req, Err(e), Vec::new());
            self.send_event(
                p.server,
                Event::PeerGone {
                    domain: p.client,
                    conn: Some(conn),
                    reason: GoneReason::Revoked,
                },
                Vec::new(),
            );
        }
    }

    /// Ends one connection by policy: both sides hear `PeerGone { reason:
    /// Revoked }` for it (their domains live on) and no grant travels along it
    /// any more. Memory already mapped stays mapped (the kernel cannot take a
    /// mapping back); honest libraries close the channel.
    fn revoke(&mut self, conn: ConnId) {
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        self.unconfirmed.remove(&conn);
        tracing::warn!(conn, client = c.client, server = c.server, service = c.service, "connection revoked by policy");
        // After the reply under way (a resuming domain hears its Joined first).
        for (me, other) in [(c.client, c.server), (c.server, c.client)] {
            if self.domains.contains_key(&me) {
                self.after_reply.push((
                    me,
                    Event::PeerGone {
                        domain: other,
                        conn: Some(conn),
                        reason: GoneReason::Revoked,
                    },
                ));
            }
        }
        self.reg_delete(&format!("/connection/{conn}"));
    }

    fn withdraw(&mut self, dom: DomainId, service: &str) {
        self.services.remove(service);
        if let Some(d) = self.domains.get_mut(&dom) {
            d.services.remove(service);
        }
        self.reg_delete(&format!("/service/{service}"));
        tracing::info!(domain = dom, service, "service withdrawn");
    }

    /// A `Denied` error naming the rule, logged at warn.
    fn deny(&self, dom: DomainId, what: String) -> RemoteError {
        let (rule, uid, pid) = self.domains.get(&dom).map_or(("?".to_string(), 0, 0), |d| {
            (d.rule.name.clone(), d.uid, d.pid)
        });
        let msg = format!(
            "denied: {what} (policy {}, rule {rule})",
            self.cfg.policy.source
        );
        tracing::warn!(domain = dom, uid, pid, "{msg}");
        err(ErrorCode::Denied, msg)
    }

    /// A `Quota` error (the message carries the limit), logged at warn.
    fn quota(&self, dom: DomainId, what: String) -> RemoteError {
        let rule = self.domains.get(&dom).map_or("?", |d| d.rule.name.as_str());
        let msg = format!("{what}; rule {rule}");
        tracing::warn!(domain = dom, "quota: {msg}");
        err(ErrorCode::Quota, msg)
    }

    /// May `dom` write (or, with `delete`, delete the subtree of) `path`?
    fn check_reg_access(&self, dom: DomainId, path: &str, delete: bool) -> Result<(), RemoteError> {
        let Some(d) = self.domains.get(&dom) else {
            return Err(internal("registry", "caller has no domain"));
        };
        // MMNet: the `net` policy refuses the handshake steps (not a warning:
        // a process under `fido run` meets it on every connection).
        if crate::policy::is_net_handshake(path, delete) {
            if let Some(why) = self.cfg.policy.net_refusal(&d.rule, &d.name) {
                tracing::debug!(domain = dom, path, "MMNet refused: {why}");
                return Err(err(
                    ErrorCode::Denied,
                    format!("MMNet acceleration disabled by policy {}: {why}", self.cfg.policy.source),
                ));
            }
        }
        let ok = if delete {
            d.rule
                .may_delete(path, || self.reg.list(path).map_or(true, |c| !c.is_empty()))
        } else {
            d.rule.may_write(path)
        };
        if ok {
            return Ok(());
        }
        let what = if delete {
            format!("may not delete {path} (and its subtree)")
        } else {
            format!("may not write {path}")
        };
        Err(self.deny(dom, what))
    }

    /// Checks the registry quotas for `ops` run by `dom`; the returned charges
    /// are committed once the registry has applied them.
    fn charge(&self, dom: DomainId, ops: &[TxnOp]) -> Result<crate::account::Overlay, RemoteError> {
        let q = match self.domains.get(&dom) {
            Some(d) => d.rule.quotas,
            None => return Err(internal("registry", "caller has no domain")),
        };
        let (keys0, bytes0) = self.acct.usage(dom);
        let (overlay, (keys, bytes)) = self.acct.simulate(dom, ops);
        // Growing past a limit is refused; shrinking is always allowed.
        if keys > q.registry_keys && keys > keys0 {
            return Err(self.quota(
                dom,
                format!(
                    "too many registry keys: this would hold {keys} (limit {})",
                    q.registry_keys
                ),
            ));
        }
        if bytes > q.registry_bytes && bytes > bytes0 {
            return Err(self.quota(
                dom,
                format!(
                    "too many registry bytes: this would hold {bytes} bytes of values (limit {})",
                    q.registry_bytes
                ),
            ));
        }
        Ok(overlay)
    }

    /// Established and pending connections `dom` is an end of.
    fn open_connections(&self, dom: DomainId) -> u64 {
        let est = self
            .conns
            .values()
            .filter(|c| c.client == dom || c.server == dom)
            .count();
        let pend = self
            .pending
            .values()
            .filter(|p| p.client == dom || p.server == dom)
            .count();
        (est + pend) as u64
    }

    /// Is `to` reachable from `from` over established connections (either
    /// direction, any number of hops)? This is how a pointer into `to`'s arena
    /// can legitimately reach `from`: forwarded along a chain of connections.
    fn connected_path(&self, from: DomainId, to: DomainId) -> bool {
        let mut adj: HashMap<DomainId, Vec<DomainId>> = HashMap::new();
        for c in self.conns.values() {
            adj.entry(c.client).or_default().push(c.server);
            adj.entry(c.server).or_default().push(c.client);
        }
        let mut seen = HashSet::from([from]);
        let mut queue = VecDeque::from([from]);
        while let Some(d) = queue.pop_front() {
            if d == to {
                return true;
            }
            for &n in adj.get(&d).map(Vec::as_slice).unwrap_or(&[]) {
                if seen.insert(n) {
                    queue.push_back(n);
                }
            }
        }
        false
    }

    fn write_conn_keys(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        let (service, client, server) = (c.service.clone(), c.client, c.server);
        let base = format!("/connection/{conn}");
        self.reg_write(&format!("{base}/service"), service.as_bytes());
        self.reg_write(&format!("{base}/client"), client.to_string().as_bytes());
        self.reg_write(&format!("{base}/server"), server.to_string().as_bytes());
    }

    // ----- services and connections -------------------------------------------

    fn offer(&mut self, dom: DomainId, service: String) -> Handled {
        if !self
            .domains
            .get(&dom)
            .is_some_and(|d| d.rule.may_offer(&service))
        {
            return Err(self.deny(dom, format!("may not offer service {service:?}")));
        }
        if let Some(owner) = self.services.get(&service) {
            return Err(err(
                ErrorCode::ServiceTaken,
                format!("service {service:?} is already offered by domain {owner}"),
            ));
        }
        self.services.insert(service.clone(), dom);
        if let Some(d) = self.domains.get_mut(&dom) {
            d.services.insert(service.clone());
        }
        self.reg_write(
            &format!("/service/{service}/domain"),
            dom.to_string().as_bytes(),
        );
        tracing::info!(domain = dom, service, "service offered");
        Ok(Some((Reply::Ok, Vec::new())))
    }

    fn connect(
        &mut self,
        dom: DomainId,
        req: u64,
        service: String,
        block: RingBlock,
        fds: Vec<OwnedFd>,
    ) -> Handled {
        // The policy first: a denied domain learns nothing and gets nothing,
        // and the server never hears of it.
        if !self
            .domains
            .get(&dom)
            .is_some_and(|d| d.rule.may_connect(&service))
        {
            return Err(self.deny(dom, format!("may not connect to service {service:?}")));
        }
        check_bells("Connect", &fds)?;
        let Some(&server) = self.services.get(&service) else {
            return Err(err(
                ErrorCode::NoSuchService,
                format!("no domain offers service {service:?}"),
            ));
        };
        let limit = self
            .domains
            .get(&dom)
            .map_or(0, |d| d.rule.quotas.connections);
        let open = self.open_connections(dom);
        if open >= limit {
            return Err(self.quota(
                dom,
                format!("too many connections: this domain has {open} open (limit {limit})"),
            ));
        }
        if server != dom {
            let limit = self
                .domains
                .get(&server)
                .map_or(0, |d| d.rule.quotas.connections);
            let open = self.open_connections(server);
            if open >= limit {
                return Err(self.quota(
                    dom,
                    format!(
                        "domain {server} offering {service:?} is at its connection limit ({open} open, limit {limit})"
                    ),
                ));
            }
        }
        let peer = self
            .peer_info(dom)
            .ok_or_else(|| internal("connect", "caller has no domain"))?;
        let arena = self.arena_dup(dom)?;
        let (end0, end1) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| internal("socketpair", e))?;
        let conn = self
            .reg
            .next_counter("connection")
            .map_err(|e| internal("registry counter", e))?;
        let mut out = vec![arena];
        out.extend(fds);
        out.push(end0);
        self.pending.insert(
            conn,
            Pending {
                service: service.clone(),
                client: dom,
                client_req: req,
                server,
                liveness: end1,
            },
        );
        tracing::debug!(conn, service, client = dom, server, "connection requested");
        self.send_event(
            server,
            Event::Incoming {
                conn,
                service,
                peer,
                block,
            },
            out,
        );
        Ok(None)
    }

    fn accept(
        &mut self,
        key: u64,
        dom: DomainId,
        id: u64,
        conn: ConnId,
        block: RingBlock,
        fds: Vec<OwnedFd>,
    ) -> Handled {
        match self.pending.get(&conn) {
            Some(p) if p.server == dom => {}
            _ => return Err(no_pending(conn)),
        }
        check_bells("Accept", &fds)?;
        let peer = self
            .peer_info(dom)
            .ok_or_else(|| internal("accept", "caller has no domain"))?;
        let arena = self.arena_dup(dom)?;
        let p = self.pending.remove(&conn).expect("checked above");
        let client = p.client;
        self.conns.insert(
            conn,
            Conn {
                service: p.service.clone(),
                client,
                server: dom,
            },
        );
        self.write_conn_keys(conn);
        let client_slot = self.domains.get(&client).map(|d| d.slot);
        let server_slot = self.domains.get(&dom).map(|d| d.slot);
        if let Some(s) = server_slot {
            self.add_mapping(client, s);
        }
        if let Some(s) = client_slot {
            self.add_mapping(dom, s);
        }
        tracing::info!(
            conn,
            service = p.service,
            client,
            server = dom,
            "connection established"
        );
        self.reply(key, id, Ok(Reply::Ok), Vec::new());
        let mut out = vec![arena];
        out.extend(fds);
        out.push(p.liveness);
        self.reply_to_domain(
            client,
            p.client_req,
            Ok(Reply::Connected { conn, peer, block }),
            out,
        );
        Ok(None)
    }

    fn close(&mut self, dom: DomainId, conn: ConnId) -> Handled {
        if let Some(c) = self.conns.get(&conn) {
            if c.client != dom && c.server != dom {
                return Err(err(
                    ErrorCode::NoSuchConnection,
                    format!("connection {conn} is not yours"),
                ));
            }
            let other = if c.client == dom { c.server } else { c.client };
            self.conns.remove(&conn);
            self.unconfirmed.remove(&conn);
            self.send_event(other, Event::Closed { conn }, Vec::new());
            self.reg_delete(&format!("/connection/{conn}"));
            tracing::debug!(conn, by = dom, "connection closed");
            return Ok(Some((Reply::Ok, Vec::new())));
        }
        match self.pending.get(&conn) {
            Some(p) if p.client == dom => {
                let p = self.pending.remove(&conn).expect("checked above");
                self.send_event(p.server, Event::Closed { conn }, Vec::new());
                let e = err(
                    ErrorCode::Unavailable,
                    "the connection was closed before it was accepted",
                );
                self.reply_to_domain(p.client, p.client_req, Err(e), Vec::new());
                Ok(Some((Reply::Ok, Vec::new())))
            }
            Some(p) if p.server == dom => {
                let p = self.pending.remove(&conn).expect("checked above");
                let e = err(
                    ErrorCode::Refused,
                    "the server closed the connection without accepting it",
                );
                self.reply_to_domain(p.client, p.client_req, Err(e), Vec::new());
                Ok(Some((Reply::Ok, Vec::new())))
            }
            _ => Err(err(
                ErrorCode::NoSuchConnection,
                format!("no connection {conn}"),
            )),
        }
    }

    // ----- death --------------------------------------------------------------

    fn domain_death(&mut self, id: DomainId, reason: GoneReason) {
        let Some(d) = self.domains.remove(&id) else {
            return;
        };
        self.retired.insert(id);
        match reason {
            GoneReason::MissedHeartbeat => {
                tracing::warn!(
                    domain = id,
                    name = d.name,
                    pid = d.pid,
                    "domain missed its heartbeats; declared dead"
                )
            }
            _ => tracing::info!(
                domain = id,
                name = d.name,
                pid = d.pid,
                ?reason,
                "domain gone"
            ),
        }
        self.reg.drop_owner(id);
        self.acct.forget(id);
        self.pipe_domain_gone(id);

        for s in &d.services {
            self.services.remove(s);
            self.reg_delete(&format!("/service/{s}"));
        }

        let pend: Vec<ConnId> = self
            .pending
            .iter()
            .filter(|(_, p)| p.client == id || p.server == id)
            .map(|(c, _)| *c)
            .collect();
        for conn in pend {
            let p = self.pending.remove(&conn).expect("listed above");
            if p.server == id {
                let e = err(
                    ErrorCode::Unavailable,
                    format!(
                        "domain {id} offering {:?} went away before answering",
                        p.service
                    ),
                );
                self.reply_to_domain(p.client, p.client_req, Err(e), Vec::new());
            } else {
                self.send_event(
                    p.server,
                    Event::PeerGone {
                        domain: id,
                        conn: Some(conn),
                        reason,
                    },
                    Vec::new(),
                );
            }
        }

        let mine: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.client == id || c.server == id)
            .map(|(c, _)| *c)
            .collect();
        for conn in mine {
            let c = self.conns.remove(&conn).expect("listed above");
            self.unconfirmed.remove(&conn);
            let other = if c.client == id { c.server } else { c.client };
            if other != id {
                self.send_event(
                    other,
                    Event::PeerGone {
                        domain: id,
                        conn: Some(conn),
                        reason,
                    },
                    Vec::new(),
                );
            }
            self.reg_delete(&format!("/connection/{conn}"));
        }

        for slot in &d.maps {
            if let Some(s) = self.slots.get_mut(slot) {
                s.mappers.remove(&id);
            }
            self.maybe_free(*slot);
        }
        // Every domain that still maps the dead domain's arena — through a
        // connection or through forwarded pointers — must learn it is dead, or
        // it never unmaps it and the slot is never freed. Connection peers
        // heard above; tell the rest (conn: None = "this domain, everywhere").
        let mut mappers: Vec<DomainId> = Vec::new();
        if let Some(s) = self.slots.get_mut(&d.slot) {
            if s.owner == id {
                s.live = false;
                mappers = s.mappers.iter().copied().filter(|m| *m != id).collect();
            }
        }
        for m in mappers {
            self.send_event(m, Event::PeerGone { domain: id, conn: None, reason }, Vec::new());
        }
        self.maybe_free(d.slot);

        self.reg_delete(&format!("/domain/{id}"));
    }

    /// Periodic work: declare silent clients dead; end the post-restart grace period.
    fn tick(&mut self, now: Instant) {
        let timeout = self.cfg.heartbeat_timeout();
        let silent: Vec<u64> = self
            .clients
            .iter()
            .filter(|(_, c)| !c.doomed && now.duration_since(c.last_seen) > timeout)
            .map(|(k, _)| *k)
            .collect();
        for key in silent {
            self.doom(key, GoneReason::MissedHeartbeat);
        }

        if now >= self.grace_end && !self.grace_over {
            self.grace_over = true;
            // Arenas of domains that did not come back, still mapped by
            // domains that did: tell the mappers their owners are gone so they
            // unmap them and the slots can be freed.
            let orphaned: Vec<(DomainId, Vec<DomainId>)> = self
                .slots
                .values()
                .filter(|s| !s.live && !self.domains.contains_key(&s.owner))
                .map(|s| (s.owner, s.mappers.iter().copied().collect()))
                .collect();
            for (owner, mappers) in orphaned {
                for m in mappers {
                    self.send_event(
                        m,
                        Event::PeerGone { domain: owner, conn: None, reason: GoneReason::MissedHeartbeat },
                        Vec::new(),
                    );
                }
            }
        }
        if now >= self.grace_end && (!self.reserved.is_empty() || !self.unconfirmed.is_empty()) {
            self.reserved.clear();
            for conn in std::mem::take(&mut self.unconfirmed) {
                let Some(c) = self.conns.get(&conn) else {
                    continue;
                };
                let (client_live, server_live) = (
                    self.domains.contains_key(&c.client),
                    self.domains.contains_key(&c.server),
                );
                if client_live && server_live {
                    continue;
                }
                let c = self.conns.remove(&conn).expect("present");
                let (live, gone) = if client_live {
                    (c.client, c.server)
                } else {
                    (c.server, c.client)
                };
                tracing::info!(
                    conn,
                    domain = gone,
                    "peer did not come back after the broker restart"
                );
                self.send_event(
                    live,
                    Event::PeerGone {
                        domain: gone,
                        conn: Some(conn),
                        reason: GoneReason::MissedHeartbeat,
                    },
                    Vec::new(),
                );
                self.reg_delete(&format!("/connection/{conn}"));
            }
        }
    }

    fn status(&self) -> Status {
        let (pipe_engine, pipes) = self.pipe_status();
        Status {
            pipe_engine,
            pipes,
            broker_pid: rustix::process::getpid().as_raw_nonzero().get(),
            domains: self
                .domains
                .iter()
                .map(|(id, d)| DomainStatus {
                    domain: *id,
                    name: d.name.clone(),
                    slot: d.slot,
                    pid: d.pid,
                    uid: d.uid,
                    arena_len: d.arena_len,
                    counters: d.counters,
                })
                .collect(),
            services: self.services.iter().map(|(s, d)| (s.clone(), *d)).collect(),
            connections: self
                .conns
                .iter()
                .map(|(c, x)| ConnStatus {
                    conn: *c,
                    service: x.service.clone(),
                    client: x.client,
                    server: x.server,
                })
                .collect(),
        }
    }
}

fn check_bells(what: &str, fds: &[OwnedFd]) -> Result<(), RemoteError> {
    if fds.len() != 2 {
        return Err(err(
            ErrorCode::BadDescriptor,
            format!(
                "{what} carries exactly two descriptors (data and space doorbells); got {}",
                fds.len()
            ),
        ));
    }
    for (i, fd) in fds.iter().enumerate() {
        if !sys::is_doorbell(fd.as_fd()) {
            let kind = sys::fd_kind(fd.as_fd()).unwrap_or_else(|| "unknown".into());
            let which = if i == 0 { "data" } else { "space" };
            return Err(err(
                ErrorCode::BadDescriptor,
                format!("{what}: the {which} doorbell is not a Unix stream socket ({kind})"),
            ));
        }
    }
    Ok(())
}

/// The request id of a malformed message, when its header and first bytes are intact.
fn peek_id(bytes: &[u8]) -> Option<u64> {
    if bytes.len() < 10 || bytes[0..2] != *b"FD" || bytes[8] != 0 {
        return None;
    }
    let mut id = 0u64;
    for (i, b) in bytes[9..].iter().take(10).enumerate() {
        id |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some(id);
        }
    }
    None
}

fn is_managed(path: &str) -> bool {
    path == "/"
        || MANAGED
            .iter()
            .any(|m| path == *m || path.strip_prefix(m).is_some_and(|r| r.starts_with('/')))
}

fn check_writable(path: &str) -> Result<(), RemoteError> {
    if is_managed(path) {
        return Err(err(
            ErrorCode::Denied,
            format!(
                "{path} is managed by the broker (/domain, /service, /connection are read-only)"
            ),
        ));
    }
    Ok(())
}

fn no_pending(conn: ConnId) -> RemoteError {
    err(
        ErrorCode::NoSuchConnection,
        format!("no pending connection {conn} addressed to you"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peek_id_recovers_request_ids() {
        let bytes = fido_proto::encode(&ClientMsg::Request {
            id: 300,
            body: Request::Status,
        })
        .unwrap();
        assert_eq!(peek_id(&bytes), Some(300));
        assert_eq!(
            peek_id(&fido_proto::encode(&ClientMsg::Heartbeat).unwrap()),
            None
        );
        assert_eq!(peek_id(b"garbage"), None);
        assert_eq!(peek_id(b"FD\x01\x00\x05\x00\x00\x00\x00\xff\xff"), None);
    }

    #[test]
    fn managed_subtrees() {
        for p in [
            "/",
            "/domain",
            "/domain/1/name",
            "/service/x",
            "/connection",
        ] {
            assert!(is_managed(p), "{p}");
        }
        for p in ["/domainx", "/app", "/services", "/app/domain"] {
            assert!(!is_managed(p), "{p}");
        }
    }
}
