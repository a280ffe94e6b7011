//! Domains: join (fresh or resumed after a broker restart), leave, death
//! (socket EOF or missed heartbeats) with everything a dead domain held torn
//! down and its peers told, the post-restart grace period, and the PGVAS
//! slots domains own and map.

use std::collections::BTreeSet;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

use fido_proto::{
    ConnId, Counters, DomainId, ErrorCode, Event, GoneReason, PeerInfo, RemoteError, Reply, Resume,
};

use crate::policy::Rule;
use crate::sys;

use super::{err, internal, Conn, Domain, Handled, Server, Slot};

/// Who is joining, as the socket and the `Join` request say.
pub(super) struct Joiner {
    key: u64,
    pub(super) pid: i32,
    pub(super) uid: u32,
    pub(super) gid: u32,
    pub(super) name: String,
    pub(super) label: Option<String>,
}

impl Server {
    /// Handles `Join`: checks the arena, lets the policy decide, picks the
    /// domain's id and slot (fresh, or its old ones on resume) and records it.
    pub(super) fn join(
        &mut self,
        key: u64,
        name: String,
        label: Option<String>,
        arena_len: u64,
        resume: Option<Resume>,
        fds: Vec<OwnedFd>,
    ) -> Handled {
        let arena = self.join_arena(fds, arena_len)?;
        let (pid, uid, gid) = {
            let c = self
                .clients
                .get(&key)
                .expect("client exists while handling its message");
            (c.pid, c.uid, c.gid)
        };
        let who = Joiner {
            key,
            pid,
            uid,
            gid,
            name,
            label,
        };
        let rule = self.admit(&who, arena_len)?;
        fido_shm::check_grant(arena.as_fd(), arena_len).map_err(|e| {
            err(
                ErrorCode::BadDescriptor,
                format!("arena refused: {e} (it must be a sealed memfd re-opened read-only)"),
            )
        })?;
        let (id, slot) = match &resume {
            None => self.fresh_identity()?,
            Some(r) => self.resumed_identity(r)?,
        };
        self.install_domain(&who, id, slot, arena, arena_len, rule);

        if let Some(r) = resume {
            self.resume(id, r);
            // Connections are re-registered as they were; the policy (which
            // may have changed across the restart) decides whether they stay.
            self.enforce_connect_policy();
            tracing::info!(
                domain = id,
                slot,
                name = who.name,
                pid,
                uid,
                "domain resumed"
            );
        } else {
            tracing::info!(
                domain = id,
                slot,
                name = who.name,
                pid,
                uid,
                "domain joined"
            );
        }
        if let Some(d) = self.domains.get(&id) {
            tracing::debug!(domain = id, rule = d.rule.name, "policy rule");
        }
        let joined = Reply::Joined {
            domain: id,
            slot,
            geometry: self.cfg.geometry,
            heartbeat_ms: self
                .cfg
                .heartbeat
                .as_millis()
                .try_into()
                .unwrap_or(u64::MAX),
        };
        Ok(Some((joined, Vec::new())))
    }

    /// The one descriptor of a `Join`, its arena, if its length fits a slot.
    fn join_arena(&self, mut fds: Vec<OwnedFd>, arena_len: u64) -> Result<OwnedFd, RemoteError> {
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
        let slot_size = self.cfg.geometry.slot_size;
        if arena_len == 0 || arena_len > slot_size {
            return Err(err(
                ErrorCode::BadDescriptor,
                format!(
                    "arena of {arena_len} bytes does not fit a PGVAS slot of {slot_size} bytes"
                ),
            ));
        }
        Ok(arena)
    }

    /// A new domain id and the lowest free slot.
    fn fresh_identity(&mut self) -> Result<(DomainId, u32), RemoteError> {
        let slot = self.free_slot().ok_or_else(|| {
            err(
                ErrorCode::Quota,
                format!("all {} PGVAS slots are in use", self.cfg.geometry.slots),
            )
        })?;
        let id = self
            .reg
            .next_counter("domain")
            .map_err(|e| internal("registry counter", e))?;
        Ok((id, slot))
    }

    /// The id and slot a domain held before the broker restarted, if they
    /// are still its to take.
    fn resumed_identity(&mut self, r: &Resume) -> Result<(DomainId, u32), RemoteError> {
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
        if r.slot >= self.cfg.geometry.slots {
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
        Ok((r.domain, r.slot))
    }

    /// Records an admitted domain: its client, its slot and arena, its
    /// registry keys under `/domain/<id>`.
    fn install_domain(
        &mut self,
        who: &Joiner,
        id: DomainId,
        slot: u32,
        arena: OwnedFd,
        arena_len: u64,
        rule: Arc<Rule>,
    ) {
        if let Some(c) = self.clients.get_mut(&who.key) {
            c.domain = Some(id);
        }
        match self.slots.get_mut(&slot) {
            Some(s) => {
                s.live = true;
                s.arena = Some(arena);
                s.len = arena_len;
            }
            None => {
                let s = Slot {
                    owner: id,
                    live: true,
                    arena: Some(arena),
                    len: arena_len,
                    mappers: BTreeSet::new(),
                };
                self.slots.insert(slot, s);
            }
        }
        let domain = Domain {
            client: who.key,
            name: who.name.clone(),
            slot,
            arena_len,
            pid: who.pid,
            uid: who.uid,
            gid: who.gid,
            label: who.label.clone(),
            counters: Counters::default(),
            services: BTreeSet::new(),
            maps: BTreeSet::new(),
            rule,
        };
        self.domains.insert(id, domain);
        let base = format!("/domain/{id}");
        self.reg_write(&format!("{base}/name"), who.name.as_bytes());
        self.reg_write(&format!("{base}/pid"), who.pid.to_string().as_bytes());
        self.reg_write(&format!("{base}/uid"), who.uid.to_string().as_bytes());
        self.reg_write(&format!("{base}/slot"), slot.to_string().as_bytes());
        if let Some(l) = &who.label {
            self.reg_write(&format!("{base}/label"), l.as_bytes());
        }
    }

    /// Handles `Leave`: answered first, then the domain goes as if it died.
    pub(super) fn leave(&mut self, key: u64, id: u64) -> Handled {
        self.reply(key, id, Ok(Reply::Ok), Vec::new());
        self.doom(key, GoneReason::Left);
        Ok(None)
    }

    // ----- slots --------------------------------------------------------------

    /// Lowest slot with no live owner, no remaining mappers and no reservation.
    fn free_slot(&self) -> Option<u32> {
        (0..self.cfg.geometry.slots)
            .find(|s| !self.slots.contains_key(s) && !self.reserved.contains_key(s))
    }

    /// Frees a slot whose owner is dead once nobody maps it any more.
    pub(super) fn maybe_free(&mut self, slot: u32) {
        if let Some(s) = self.slots.get(&slot) {
            if !s.live && s.mappers.is_empty() {
                tracing::debug!(slot, owner = s.owner, "slot free again");
                self.slots.remove(&slot);
            }
        }
    }

    pub(super) fn add_mapping(&mut self, mapper: DomainId, slot: u32) {
        if let Some(s) = self.slots.get_mut(&slot) {
            s.mappers.insert(mapper);
            if let Some(d) = self.domains.get_mut(&mapper) {
                d.maps.insert(slot);
            }
        }
    }

    pub(super) fn peer_info(&self, dom: DomainId) -> Option<PeerInfo> {
        self.domains.get(&dom).map(|d| PeerInfo {
            domain: dom,
            name: d.name.clone(),
            slot: d.slot,
            arena_len: d.arena_len,
            uid: d.uid,
            pid: d.pid,
        })
    }

    pub(super) fn arena_dup(&self, dom: DomainId) -> Result<OwnedFd, RemoteError> {
        let slot = self.domains.get(&dom).map(|d| d.slot);
        let arena = slot
            .and_then(|s| self.slots.get(&s))
            .and_then(|s| s.arena.as_ref())
            .ok_or_else(|| internal("arena", format!("domain {dom} has no arena on record")))?;
        sys::dup(arena.as_fd()).map_err(|e| internal("dup", e))
    }

    // ----- resume -------------------------------------------------------------

    /// A resuming domain re-registers what it held before the broker
    /// restarted: services, mappings, connections, watches. Each item is
    /// checked again; what no longer holds is dropped (and said so).
    fn resume(&mut self, id: DomainId, r: Resume) {
        for service in r.services.iter().cloned().collect::<BTreeSet<_>>() {
            if let Err(e) = self.offer(id, service.clone()) {
                tracing::warn!(domain = id, service, error = %e, "resumed service dropped");
            }
        }
        for (slot, owner) in r.mapped {
            self.resume_mapping(id, slot, owner);
        }
        let mut max_conn = None;
        let in_grace = Instant::now() < self.grace_end;
        for (conn, peer, service) in r.connections {
            if self.resume_connection(id, conn, peer, service, in_grace) {
                max_conn = max_conn.max(Some(conn));
            }
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

    /// `id` says it maps `owner`'s arena in `slot`.
    fn resume_mapping(&mut self, id: DomainId, slot: u32, owner: DomainId) {
        if slot >= self.cfg.geometry.slots {
            tracing::warn!(
                domain = id,
                slot,
                "resumed mapping outside the PGVAS window ignored"
            );
            return;
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
                return;
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

    /// `id` says it has connection `conn` with `peer` for `service`; during
    /// the grace period a peer that is not back yet may still come. Returns
    /// true when the connection was registered anew (its id then moves the
    /// connection counter).
    fn resume_connection(
        &mut self,
        id: DomainId,
        conn: ConnId,
        peer: DomainId,
        service: String,
        in_grace: bool,
    ) -> bool {
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
            return false;
        }
        if self.pending.contains_key(&conn) {
            tracing::warn!(
                domain = id,
                conn,
                "resumed connection id clashes with a new one; ignored"
            );
            return false;
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
            return false;
        }
        // Who is the server? The side offering the service (the resuming
        // domain if it offers it, else the peer).
        let i_serve = self.services.get(&service) == Some(&id) && peer != id;
        let (client, server) = if i_serve { (peer, id) } else { (id, peer) };
        self.conns.insert(
            conn,
            Conn {
                service,
                client,
                server,
            },
        );
        if !peer_live {
            self.unconfirmed.insert(conn);
        }
        self.write_conn_keys(conn);
        true
    }

    // ----- death --------------------------------------------------------------

    /// Tears down a domain that died, left or was evicted: its services,
    /// pending and established connections (peers told `PeerGone`), its
    /// mappings and slot, its registry keys, pipes and accounts.
    pub(super) fn domain_death(&mut self, id: DomainId, reason: GoneReason) {
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
        self.net_domain_gone(id);

        for s in &d.services {
            self.services.remove(s);
            self.reg_delete(&format!("/service/{s}"));
        }
        self.end_pending_of(id, reason);
        self.end_connections_of(id, reason);
        self.release_slots_of(id, &d, reason);
        self.reg_delete(&format!("/domain/{id}"));
    }

    /// Connections waiting on the dead domain `id`: a client waiting for it
    /// is answered, a server asked by it is told.
    fn end_pending_of(&mut self, id: DomainId, reason: GoneReason) {
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
    }

    /// Established connections of the dead domain `id`: the other end is told.
    fn end_connections_of(&mut self, id: DomainId, reason: GoneReason) {
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
    }

    /// The dead domain `id` (record `d`) maps nothing any more; its own slot
    /// is freed once nobody maps its arena.
    fn release_slots_of(&mut self, id: DomainId, d: &Domain, reason: GoneReason) {
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
            self.send_event(
                m,
                Event::PeerGone {
                    domain: id,
                    conn: None,
                    reason,
                },
                Vec::new(),
            );
        }
        self.maybe_free(d.slot);
    }

    // ----- heartbeats and the grace period ------------------------------------

    /// Periodic work: declare silent clients dead; end the post-restart grace period.
    pub(super) fn tick(&mut self, now: Instant) {
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
            self.tell_mappers_of_orphans();
        }
        if now >= self.grace_end && (!self.reserved.is_empty() || !self.unconfirmed.is_empty()) {
            self.reserved.clear();
            for conn in std::mem::take(&mut self.unconfirmed) {
                self.settle_unconfirmed(conn);
            }
        }
    }

    /// Arenas of domains that did not come back, still mapped by domains
    /// that did: tell the mappers their owners are gone so they unmap them
    /// and the slots can be freed.
    fn tell_mappers_of_orphans(&mut self) {
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
                    Event::PeerGone {
                        domain: owner,
                        conn: None,
                        reason: GoneReason::MissedHeartbeat,
                    },
                    Vec::new(),
                );
            }
        }
    }

    /// A connection re-reported by one side only, at the end of the grace
    /// period: kept if both ends are back, else ended for the one that is.
    fn settle_unconfirmed(&mut self, conn: ConnId) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        let (client_live, server_live) = (
            self.domains.contains_key(&c.client),
            self.domains.contains_key(&c.server),
        );
        if client_live && server_live {
            return;
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
