//! Services and connections: offer and withdraw, connect / accept / refuse
//! / close (arena grants, doorbells and the liveness pair exchanged), the
//! connection quotas, revocation, and arena grants by slot along the
//! connection graph.

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, OwnedFd};

use fido_proto::{
    ConnId, DomainId, ErrorCode, Event, GoneReason, RemoteError, Reply, Request, RingBlock,
};
use rustix::net::SocketFlags;

use crate::sys;

use super::{err, internal, Conn, Handled, Pending, Server};

impl Server {
    /// Handles `Offer`, `Withdraw`, `Connect`, `Accept`, `Refuse`, `Close`,
    /// `GrantSlot`, `Unmapped`.
    pub(super) fn connection_request(
        &mut self,
        key: u64,
        dom: DomainId,
        id: u64,
        body: Request,
        fds: Vec<OwnedFd>,
    ) -> Handled {
        match body {
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
            Request::Refuse { conn, reason } => self.refuse(dom, conn, reason),
            Request::Close { conn } => self.close(dom, conn),
            Request::GrantSlot { slot } => self.grant_slot(dom, slot),
            Request::Unmapped { slot, owner } => {
                if self.slots.get(&slot).is_some_and(|s| s.owner == owner) {
                    self.remove_mapping(dom, slot);
                    self.maybe_free(slot);
                }
                Ok(Some((Reply::Ok, Vec::new())))
            }
            other => Err(err(
                ErrorCode::BadRequest,
                format!("not a connection request: {other:?}"),
            )),
        }
    }

    fn refuse(&mut self, dom: DomainId, conn: ConnId, reason: String) -> Handled {
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

    /// Handles `GrantSlot`: a live owner's arena, or a dead owner's that
    /// someone still maps (a message it sent may still be on its way
    /// downstream), to a domain with a connection path to it.
    fn grant_slot(&mut self, dom: DomainId, slot: u32) -> Handled {
        let Some(s) = self
            .slots
            .get(&slot)
            .filter(|s| s.live || (s.arena.is_some() && !s.mappers.is_empty()))
        else {
            return Err(err(
                ErrorCode::NoSuchDomain,
                format!("no domain owns slot {slot}"),
            ));
        };
        let owner = s.owner;
        let live = s.live;
        // Only mappings the broker itself granted are in `mappers` (accept,
        // GrantSlot, a resume checked against the record), never a caller's
        // own claim.
        let already = s.mappers.contains(&dom);
        let holders: Vec<DomainId> = s.mappers.iter().copied().collect();
        let reachable = if live {
            self.connected_path(dom, owner)
        } else {
            holders
                .iter()
                .any(|h| *h == dom || self.connected_path(dom, *h))
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
        let arena_len = s.len;
        self.add_mapping(dom, slot);
        if !live {
            // Say first that the owner is dead, so the requester unmaps
            // the arena once it is done with it.
            self.send_event(
                dom,
                Event::PeerGone {
                    domain: owner,
                    conn: None,
                    reason: GoneReason::Exited,
                },
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

    /// Established and pending connections `dom` is an end of.
    pub(super) fn open_connections(&self, dom: DomainId) -> u64 {
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
    pub(super) fn connected_path(&self, from: DomainId, to: DomainId) -> bool {
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

    pub(super) fn write_conn_keys(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        for (path, value) in conn_keys(conn, &c.service, c.client, c.server) {
            self.reg_write(&path, &value);
        }
    }

    pub(super) fn offer(&mut self, dom: DomainId, service: String) -> Handled {
        if !self
            .domains
            .get(&dom)
            .is_some_and(|d| d.rule.may_offer(&service))
        {
            return Err(self.deny(dom, format!("may not offer service {service:?}")));
        }
        self.check_uid_quota(
            dom,
            "services offered",
            |s, uid| {
                let offered = s.services.values().filter(|d| s.uid_of(**d) == Some(uid));
                offered.count() as u64
            },
            |q| q.services,
        )?;
        if let Some(owner) = self.services.get(&service) {
            return Err(err(
                ErrorCode::ServiceTaken,
                format!("service {service:?} is already offered by domain {owner}"),
            ));
        }
        self.reg_write_all(vec![(
            format!("/service/{service}/domain"),
            dom.to_string().into_bytes(),
        )])?;
        self.services.insert(service.clone(), dom);
        if let Some(d) = self.domains.get_mut(&dom) {
            d.services.insert(service.clone());
        }
        tracing::info!(domain = dom, service, "service offered");
        Ok(Some((Reply::Ok, Vec::new())))
    }

    pub(super) fn withdraw(&mut self, dom: DomainId, service: &str) {
        self.services.remove(service);
        if let Some(d) = self.domains.get_mut(&dom) {
            d.services.remove(service);
        }
        self.reg_delete(&format!("/service/{service}"));
        tracing::info!(domain = dom, service, "service withdrawn");
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
        self.check_connection_quotas(dom, server, &service)?;
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
            .map_err(|e| super::registry::registry_failure("registry counter", e))?;
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
        // Its keys first: a connection whose record cannot be written (a
        // full disk) is not established; it stays pending, as it was.
        let keys = {
            let p = &self.pending[&conn];
            conn_keys(conn, &p.service, p.client, dom)
        };
        self.reg_write_all(keys)?;
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

    /// Ends one connection by policy: both sides hear `PeerGone { reason:
    /// Revoked }` for it (their domains live on) and no grant travels along it
    /// any more. Memory already mapped stays mapped (the kernel cannot take a
    /// mapping back); honest libraries close the channel.
    pub(super) fn revoke(&mut self, conn: ConnId) {
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        self.unconfirmed.remove(&conn);
        tracing::warn!(
            conn,
            client = c.client,
            server = c.server,
            service = c.service,
            "connection revoked by policy"
        );
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

fn no_pending(conn: ConnId) -> RemoteError {
    err(
        ErrorCode::NoSuchConnection,
        format!("no pending connection {conn} addressed to you"),
    )
}

/// The registry keys recording connection `conn`, under `/connection/<conn>`.
fn conn_keys(
    conn: ConnId,
    service: &str,
    client: DomainId,
    server: DomainId,
) -> Vec<(String, Vec<u8>)> {
    let base = format!("/connection/{conn}");
    vec![
        (format!("{base}/service"), service.as_bytes().to_vec()),
        (format!("{base}/client"), client.to_string().into_bytes()),
        (format!("{base}/server"), server.to_string().into_bytes()),
    ]
}
