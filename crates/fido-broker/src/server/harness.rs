//! An in-process driver of the broker's real request path, for the stateful
//! fuzz target (`fuzz/fuzz_targets/broker_session.rs`) and its stable corpus
//! replay (`crates/fido-broker/tests/fuzz_corpus.rs`). Built only with the
//! `fuzz-hooks` feature.
//!
//! What is real: the [`Server`] with its handlers, the registry (SQLite, in
//! memory), the pipe engine, every client socket (a `SOCK_SEQPACKET` pair per
//! client: the broker reads and writes its end with the same calls as in
//! production, descriptors included). What the harness replaces: `accept`
//! (a client is registered with chosen credentials instead of
//! `SO_PEERCRED`), the epoll loop (the harness says when a client's socket is
//! readable or writable) and the clock (time passes by moving every recorded
//! instant back, so `tick` and the grace period see it pass).
//!
//! [`Harness::check_invariants`] is the broker-side oracle: the maps stay
//! consistent (clients ↔ domains ↔ slots ↔ mappers ↔ services ↔ connections
//! ↔ pipes) and no domain is over a quota.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fido_proto::DomainId;
use rustix::event::epoll;
use rustix::net::{AddressFamily, SocketFlags, SocketType};

use crate::sys::{self, Recv};
use crate::{BrokerError, Config, Policy, ReloadSlot};

use super::{Client, Server};

/// The harness's handle on one simulated client (the broker's client key).
pub type ClientKey = u64;

/// One datagram the broker sent to a client, with its descriptors.
pub struct Received {
    pub bytes: Vec<u8>,
    pub fds: Vec<OwnedFd>,
    /// The datagram (or its descriptors) did not fit the receive buffer of
    /// `fido_proto::MAX_MESSAGE` bytes and `fido_proto::MAX_FDS` descriptors.
    pub truncated: bool,
}

/// A broker [`Server`] driven step by step, with simulated clients.
pub struct Harness {
    server: Server,
    /// The client's end of each client socket, kept by the harness.
    ends: HashMap<ClientKey, OwnedFd>,
    buf: Vec<u8>,
}

fn eventfd() -> Result<OwnedFd, BrokerError> {
    rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    )
    .map_err(|source| BrokerError::Sys {
        what: "eventfd",
        source,
    })
}

fn seqpacket_pair() -> Result<(OwnedFd, OwnedFd), BrokerError> {
    rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(|source| BrokerError::Sys {
        what: "socketpair",
        source,
    })
}

impl Harness {
    /// A broker with `config` (its `socket` and `state_dir` are not used:
    /// nothing is bound and the registry lives in memory).
    pub fn new(config: Config) -> Result<Harness, BrokerError> {
        // Never accepted on: clients come through `connect`.
        let (listener, _other_end) = seqpacket_pair()?;
        let reload = ReloadSlot {
            event: Arc::new(eventfd()?),
            pending: Arc::default(),
        };
        let reg = fido_registry::Registry::in_memory()
            .map_err(|e| BrokerError::Registry(e.to_string()))?;
        let recorded = super::load_recorded(&reg);
        let server = Server::new(
            config,
            listener,
            Arc::new(eventfd()?),
            reload,
            reg,
            BTreeMap::new(),
            recorded,
        )?;
        Ok(Harness {
            server,
            ends: HashMap::new(),
            buf: vec![0u8; fido_proto::MAX_MESSAGE],
        })
    }

    /// A new client, registered as `accept` would, with these credentials.
    pub fn connect(&mut self, pid: i32, uid: u32, gid: u32) -> Result<ClientKey, BrokerError> {
        let (broker_end, client_end) = seqpacket_pair()?;
        let s = &mut self.server;
        let key = s.next_key;
        s.next_key += 1;
        epoll::add(
            &s.epoll,
            &broker_end,
            epoll::EventData::new_u64(key),
            epoll::EventFlags::IN,
        )
        .map_err(|source| BrokerError::Sys {
            what: "epoll_ctl",
            source,
        })?;
        let now = s.intake.clock.now();
        let refused = !s.may_ever_join(uid, gid);
        s.clients.insert(
            key,
            Client::accepted(broker_end, (pid, uid, gid), now, refused),
        );
        self.ends.insert(key, client_end);
        Ok(key)
    }

    /// Sends one datagram from client `key` and lets the broker handle it
    /// (and whatever else waits on that socket). A client the broker
    /// dropped gets the socket's error (`EPIPE`, `ECONNRESET`).
    pub fn send(
        &mut self,
        key: ClientKey,
        bytes: &[u8],
        fds: &[OwnedFd],
    ) -> Result<(), rustix::io::Errno> {
        let end = self.ends.get(&key).ok_or(rustix::io::Errno::BADF)?;
        sys::send(end.as_fd(), bytes, fds)?;
        self.server.client_ready(key, epoll::EventFlags::IN);
        self.server.reap();
        Ok(())
    }

    /// Every datagram the broker sent to client `key` since the last call;
    /// what the broker had queued for it (its socket was full) is flushed
    /// as the client reads, as `EPOLLOUT` would.
    pub fn recv(&mut self, key: ClientKey) -> Vec<Received> {
        let mut out = Vec::new();
        loop {
            let Some(end) = self.ends.get(&key) else {
                return out;
            };
            match sys::recv(end.as_fd(), &mut self.buf) {
                Ok(Recv::Msg {
                    len,
                    fds,
                    truncated,
                }) => out.push(Received {
                    bytes: self.buf[..len].to_vec(),
                    fds,
                    truncated,
                }),
                Ok(Recv::WouldBlock) => {
                    let queued = |s: &Server| {
                        s.clients
                            .get(&key)
                            .filter(|c| c.want_out && !c.doomed)
                            .map(|c| c.queue.len())
                    };
                    let Some(before) = queued(&self.server) else {
                        return out;
                    };
                    self.server.client_ready(key, epoll::EventFlags::OUT);
                    self.server.reap();
                    if queued(&self.server) == Some(before) {
                        return out;
                    }
                }
                Ok(Recv::Eof) | Err(_) => return out,
            }
        }
    }

    /// Client `key` closes its socket (its process exited).
    pub fn disconnect(&mut self, key: ClientKey) {
        if self.ends.remove(&key).is_some() {
            self.server
                .client_ready(key, epoll::EventFlags::IN | epoll::EventFlags::HUP);
            self.server.reap();
        }
    }

    /// Is client `key` still a client of the broker (not dropped)?
    pub fn is_client(&self, key: ClientKey) -> bool {
        self.server.clients.contains_key(&key)
    }

    /// The domain client `key` joined as, if any.
    pub fn domain_of(&self, key: ClientKey) -> Option<DomainId> {
        self.server.clients.get(&key).and_then(|c| c.domain)
    }

    /// `elapsed` passes: the broker's awake clock (what heartbeats and join
    /// deadlines are judged on) moves on that far, the grace period's end
    /// moves that far into the past, then the periodic work runs (`tick`, as
    /// on the event loop's timeout) and finished pipe operations are answered.
    pub fn advance(&mut self, elapsed: Duration) {
        let back = |t: Instant| t.checked_sub(elapsed).unwrap_or(t);
        let s = &mut self.server;
        s.intake.clock.skip(elapsed);
        s.grace_end = back(s.grace_end);
        s.tick(Instant::now());
        s.reap();
        self.pipe_completions();
    }

    /// Answers the pipe operations the engine finished so far.
    pub fn pipe_completions(&mut self) {
        self.server.pipe_completions();
        self.server.reap();
    }

    /// A new policy, applied as `ReloadHandle::reload` does.
    pub fn reload(&mut self, policy: Policy) {
        *self
            .server
            .reload
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(policy);
        self.server.reload_requested();
        self.server.reap();
    }

    /// The broker's own consistency and quota checks: the first that fails.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.server.check_invariants()
    }
}

impl Server {
    /// The bookkeeping agrees with itself and every domain is within its quotas.
    fn check_invariants(&self) -> Result<(), String> {
        self.check_identities()?;
        self.check_slots()?;
        self.check_services_and_connections()?;
        self.check_quotas()
    }

    /// One client per domain, one domain per client, never a retired id.
    fn check_identities(&self) -> Result<(), String> {
        let mut claimed: HashMap<DomainId, u64> = HashMap::new();
        for (key, c) in &self.clients {
            let Some(id) = c.domain else { continue };
            if let Some(other) = claimed.insert(id, *key) {
                return Err(format!("domain {id} is held by clients {other} and {key}"));
            }
            match self.domains.get(&id) {
                Some(d) if d.client == *key => {}
                Some(d) => {
                    return Err(format!(
                        "client {key} says it is domain {id}, whose client is {}",
                        d.client
                    ))
                }
                None => return Err(format!("client {key} holds domain {id}, which is gone")),
            }
        }
        for (id, d) in &self.domains {
            match self.clients.get(&d.client) {
                Some(c) if c.domain == Some(*id) && c.uid == d.uid => {}
                _ => {
                    return Err(format!(
                        "domain {id} has no client of its uid that joined as it"
                    ))
                }
            }
            if self.retired.contains(id) {
                return Err(format!("domain {id} is live and retired"));
            }
        }
        Ok(())
    }

    /// A live domain owns exactly its slot; mappers and maps mirror each
    /// other; a dead owner's slot is kept only while mapped.
    fn check_slots(&self) -> Result<(), String> {
        let window = self.cfg.geometry.slots;
        for (id, d) in &self.domains {
            if d.slot >= window {
                return Err(format!(
                    "domain {id} has slot {} outside the window",
                    d.slot
                ));
            }
            match self.slots.get(&d.slot) {
                Some(s) if s.owner == *id && s.live && s.arena.is_some() => {}
                _ => {
                    return Err(format!(
                        "domain {id}'s slot {} is not live and its own",
                        d.slot
                    ))
                }
            }
            for m in &d.maps {
                match self.slots.get(m) {
                    Some(s) if s.mappers.contains(id) => {}
                    _ => {
                        return Err(format!(
                            "domain {id} maps slot {m}, which lacks it as a mapper"
                        ))
                    }
                }
            }
        }
        for (n, s) in &self.slots {
            if *n >= window {
                return Err(format!("slot {n} outside the window is in use"));
            }
            if s.live {
                if self.domains.get(&s.owner).map(|d| d.slot) != Some(*n) {
                    return Err(format!(
                        "slot {n} is live but its owner {} is not in it",
                        s.owner
                    ));
                }
            } else {
                if self.domains.contains_key(&s.owner) {
                    return Err(format!(
                        "slot {n} is kept for its dead owner {}, who is live",
                        s.owner
                    ));
                }
                if s.mappers.is_empty() {
                    return Err(format!("slot {n} is dead and unmapped, yet not freed"));
                }
            }
            for m in &s.mappers {
                match self.domains.get(m) {
                    Some(d) if d.maps.contains(n) => {}
                    Some(_) => {
                        return Err(format!("slot {n} lists mapper {m}, whose maps omit it"))
                    }
                    None => return Err(format!("slot {n} lists mapper {m}, which is not live")),
                }
            }
        }
        Ok(())
    }

    fn check_services_and_connections(&self) -> Result<(), String> {
        for (service, dom) in &self.services {
            if !self
                .domains
                .get(dom)
                .is_some_and(|d| d.services.contains(service))
            {
                return Err(format!(
                    "service {service:?} is registered to domain {dom}, which does not offer it"
                ));
            }
        }
        for (id, d) in &self.domains {
            for s in &d.services {
                if self.services.get(s) != Some(id) {
                    return Err(format!(
                        "domain {id} lists service {s:?}, registered to another"
                    ));
                }
            }
        }
        // Ends are live, or (after a restart) not confirmed yet.
        for (conn, c) in &self.conns {
            for end in [c.client, c.server] {
                if !self.domains.contains_key(&end) && !self.unconfirmed.contains(conn) {
                    return Err(format!(
                        "connection {conn} has an end {end} that is not live"
                    ));
                }
            }
            if self.pending.contains_key(conn) {
                return Err(format!("connection {conn} is both pending and established"));
            }
        }
        for conn in &self.unconfirmed {
            if !self.conns.contains_key(conn) {
                return Err(format!("unconfirmed connection {conn} does not exist"));
            }
        }
        for (conn, p) in &self.pending {
            for end in [p.client, p.server] {
                if !self.domains.contains_key(&end) {
                    return Err(format!(
                        "pending connection {conn} has an end {end} that is not live"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Every live domain within its quotas; nothing charged to the dead.
    fn check_quotas(&self) -> Result<(), String> {
        for (id, d) in &self.domains {
            let q = d.rule.quotas;
            let open = self.open_connections(*id);
            if open > q.connections {
                return Err(format!(
                    "domain {id} holds {open} connections, over its quota {}",
                    q.connections
                ));
            }
            let (keys, bytes) = self.acct.usage(*id);
            if keys > q.registry_keys || bytes > q.registry_bytes {
                return Err(format!(
                    "domain {id} is charged {keys} keys / {bytes} bytes, over its quota {} / {}",
                    q.registry_keys, q.registry_bytes
                ));
            }
            let watches = self.reg.watch_count(*id) as u64;
            if watches > q.watches {
                return Err(format!(
                    "domain {id} holds {watches} watches, over its quota {}",
                    q.watches
                ));
            }
        }
        for id in &self.retired {
            if self.acct.usage(*id) != (0, 0) {
                return Err(format!("registry keys are charged to dead domain {id}"));
            }
            if self.reg.watch_count(*id) != 0 {
                return Err(format!("dead domain {id} still holds registry watches"));
            }
        }
        // The broker's own pipe records (the engine's figures may lag).
        let (_, pipe_domains) = self.pipe_status();
        for p in pipe_domains.iter().filter(|p| p.pipes > 0) {
            let Some(d) = self.domains.get(&p.domain) else {
                return Err(format!(
                    "domain {} holds {} pipes but is not live",
                    p.domain, p.pipes
                ));
            };
            if u64::from(p.pipes) > d.rule.quotas.pipes {
                return Err(format!(
                    "domain {} holds {} pipes, over its quota {}",
                    p.domain, p.pipes, d.rule.quotas.pipes
                ));
            }
        }
        Ok(())
    }
}
