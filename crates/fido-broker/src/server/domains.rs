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
    ResumeSecret,
};
use fido_registry::Registry;

use crate::policy::Rule;
use crate::resume::{self, Admitted, DomainRecord, Limits, Recorded, RecordedConn};
use crate::sys;

/// Most services one resume may re-offer (the protocol's own bound).
const MAX_RESUMED_SERVICES: u64 = 4096;

/// Private-record keys: a domain's proof of identity, and each arena mapping
/// the broker granted (`map/<mapper>/<slot>` = owner).
fn domain_record_key(id: DomainId) -> String {
    format!("resume/domain/{id}")
}
fn mappings_key_prefix(mapper: DomainId) -> String {
    format!("resume/map/{mapper}/")
}
fn mapping_key(mapper: DomainId, slot: u32) -> String {
    format!("resume/map/{mapper}/{slot}")
}

/// What the previous broker run recorded: domain records and mappings from
/// the private table, connections from the `/connection` keys (which only
/// the broker writes). Read at startup, before the live-state subtrees are
/// cleared. Entries that do not parse are skipped (and said so).
pub(crate) fn load_recorded(reg: &Registry) -> Recorded {
    let mut out = Recorded::default();
    match reg.private_list("resume/domain/") {
        Ok(rows) => {
            for (key, value) in rows {
                let id = key
                    .rsplit('/')
                    .next()
                    .and_then(|s| s.parse::<DomainId>().ok());
                match (id, DomainRecord::decode(&value)) {
                    (Some(id), Some(rec)) => {
                        out.domains.insert(id, rec);
                    }
                    _ => tracing::warn!(key, "unreadable domain record skipped"),
                }
            }
        }
        Err(e) => tracing::warn!(error = %e, "could not read the domain records"),
    }
    match reg.private_list("resume/map/") {
        Ok(rows) => {
            for (key, value) in rows {
                let mut parts = key.trim_start_matches("resume/map/").split('/');
                let mapper = parts.next().and_then(|s| s.parse::<DomainId>().ok());
                let slot = parts.next().and_then(|s| s.parse::<u32>().ok());
                let owner = std::str::from_utf8(&value)
                    .ok()
                    .and_then(|s| s.parse::<DomainId>().ok());
                match (mapper, slot, owner) {
                    (Some(m), Some(s), Some(o)) => {
                        out.mappings.insert((m, s, o));
                    }
                    _ => tracing::warn!(key, "unreadable mapping record skipped"),
                }
            }
        }
        Err(e) => tracing::warn!(error = %e, "could not read the mapping records"),
    }
    let read = |path: String| {
        reg.read(&path)
            .ok()
            .flatten()
            .and_then(|v| String::from_utf8(v).ok())
    };
    for child in reg.list("/connection").unwrap_or_default() {
        let name = child.rsplit('/').next().unwrap_or(&child);
        let Ok(conn) = name.parse::<ConnId>() else {
            continue;
        };
        let base = format!("/connection/{conn}");
        let service = read(format!("{base}/service"));
        let client = read(format!("{base}/client")).and_then(|s| s.parse().ok());
        let server = read(format!("{base}/server")).and_then(|s| s.parse().ok());
        if let (Some(service), Some(client), Some(server)) = (service, client, server) {
            out.conns.insert(
                conn,
                RecordedConn {
                    service,
                    client,
                    server,
                },
            );
        }
    }
    out
}

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
    /// domain's id and slot and records it. Fresh: a new id, the lowest free
    /// slot, and a resume secret issued and recorded. Resume: the old id and
    /// slot, once the resume proved itself against the record.
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
        let (id, slot, secret, admitted) = match &resume {
            None => {
                let (id, slot) = self.fresh_identity()?;
                let secret = self.record_domain(&who, id, slot)?;
                (id, slot, secret, None)
            }
            Some(r) => {
                let admitted = self.prove_resume(&who, &rule, r)?;
                let (id, slot) = self.resumed_identity(r)?;
                (id, slot, r.secret, Some(admitted))
            }
        };
        self.install_domain(&who, id, slot, arena, arena_len, rule)?;

        if let Some(admitted) = admitted {
            self.resume(id, admitted);
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
            resume_secret: secret,
        };
        Ok(Some((joined, Vec::new())))
    }

    /// Issues a fresh domain its resume secret and records what will prove
    /// it after a restart: who joined, its slot, the secret's hash. A domain
    /// whose record cannot be kept is not admitted.
    fn record_domain(
        &mut self,
        who: &Joiner,
        id: DomainId,
        slot: u32,
    ) -> Result<ResumeSecret, RemoteError> {
        let secret = resume::new_secret().map_err(|e| internal("resume secret", e))?;
        let record = DomainRecord {
            uid: who.uid,
            gid: who.gid,
            slot,
            secret_hash: resume::hash_secret(&secret),
        };
        self.reg
            .private_put(&domain_record_key(id), &record.encode())
            .map_err(|e| internal("recording the domain", e))?;
        self.recorded.domains.insert(id, record);
        Ok(secret)
    }

    /// A resume must prove itself against what the broker recorded (see
    /// [`resume::check_resume`]); a refusal is logged with who tried.
    fn prove_resume(&self, who: &Joiner, rule: &Rule, r: &Resume) -> Result<Admitted, RemoteError> {
        let limits = Limits {
            services: MAX_RESUMED_SERVICES,
            connections: rule.quotas.connections,
            watches: rule.quotas.watches,
            mappings: u64::from(self.cfg.geometry.slots),
        };
        resume::check_resume(&self.recorded, who.uid, r, &limits).inspect_err(|e| {
            tracing::warn!(
                domain = r.domain,
                pid = who.pid,
                uid = who.uid,
                name = who.name,
                code = ?e.code,
                "resume refused: {}",
                e.message
            );
        })
    }

    /// Forgets what proved a domain and the mappings it was granted: it
    /// died, left, or did not come back after a restart.
    fn forget_record(&mut self, id: DomainId) {
        self.recorded.domains.remove(&id);
        if let Err(e) = self
            .reg
            .private_delete(&domain_record_key(id))
            .and_then(|()| self.reg.private_delete_prefix(&mappings_key_prefix(id)))
        {
            tracing::warn!(domain = id, error = %e, "could not delete the domain's record");
        }
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
            .map_err(|e| super::registry::registry_failure("registry counter", e))?;
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
    ) -> Result<(), RemoteError> {
        // Its keys first: a domain whose record cannot be written is not admitted.
        let base = format!("/domain/{id}");
        let mut keys = vec![
            (format!("{base}/name"), who.name.clone().into_bytes()),
            (format!("{base}/pid"), who.pid.to_string().into_bytes()),
            (format!("{base}/uid"), who.uid.to_string().into_bytes()),
            (format!("{base}/slot"), slot.to_string().into_bytes()),
        ];
        if let Some(l) = &who.label {
            keys.push((format!("{base}/label"), l.clone().into_bytes()));
        }
        self.reg_write_all(keys)?;
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
        Ok(())
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

    /// `mapper` now maps the arena in `slot` because the broker granted it
    /// (an accepted connection, a `GrantSlot`): kept in memory and in the
    /// private records, the only account a later resume is checked against.
    pub(super) fn add_mapping(&mut self, mapper: DomainId, slot: u32) {
        if let Some(s) = self.slots.get_mut(&slot) {
            s.mappers.insert(mapper);
            let owner = s.owner;
            if let Some(d) = self.domains.get_mut(&mapper) {
                d.maps.insert(slot);
            }
            if let Err(e) = self
                .reg
                .private_put(&mapping_key(mapper, slot), owner.to_string().as_bytes())
            {
                tracing::warn!(mapper, slot, error = %e, "could not record the mapping");
            }
        }
    }

    /// `mapper` no longer maps the arena in `slot`.
    pub(super) fn remove_mapping(&mut self, mapper: DomainId, slot: u32) {
        if let Some(s) = self.slots.get_mut(&slot) {
            s.mappers.remove(&mapper);
        }
        if let Some(d) = self.domains.get_mut(&mapper) {
            d.maps.remove(&slot);
        }
        if let Err(e) = self.reg.private_delete(&mapping_key(mapper, slot)) {
            tracing::warn!(mapper, slot, error = %e, "could not delete the mapping record");
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

    /// A resuming domain, its proof checked, takes up what it held before the
    /// broker restarted: services and watches through the same checks as
    /// fresh requests, and the mappings and connections the broker recorded
    /// for it (claims not on record were filtered out by the proof; they are
    /// logged, and a connection the broker does not know is ended for the
    /// caller).
    fn resume(&mut self, id: DomainId, a: Admitted) {
        for service in a.services {
            if let Err(e) = self.offer(id, service.clone()) {
                tracing::warn!(domain = id, service, error = %e, "resumed service dropped");
            }
        }
        for (slot, owner) in a.unrecorded_mappings {
            tracing::warn!(
                domain = id,
                slot,
                owner,
                "resumed mapping not on record; ignored"
            );
        }
        // Grants recorded for this domain that it no longer reports: it
        // unmapped them while the broker was down. Their records go.
        let stale: Vec<u32> = self
            .recorded
            .mappings
            .range((id, 0, 0)..=(id, u32::MAX, DomainId::MAX))
            .filter(|(_, slot, owner)| !a.mapped.contains(&(*slot, *owner)))
            .map(|(_, slot, _)| *slot)
            .collect();
        for slot in stale {
            if let Err(e) = self.reg.private_delete(&mapping_key(id, slot)) {
                tracing::warn!(domain = id, slot, error = %e, "could not delete the mapping record");
            }
        }
        for (slot, owner) in a.mapped {
            self.resume_mapping(id, slot, owner);
        }
        for (conn, peer) in a.unrecorded_connections {
            tracing::warn!(
                domain = id,
                conn,
                peer,
                "resumed connection not on record; ended"
            );
            self.after_reply.push((
                id,
                Event::PeerGone {
                    domain: peer,
                    conn: Some(conn),
                    reason: GoneReason::Revoked,
                },
            ));
        }
        let mut max_conn = None;
        let in_grace = Instant::now() < self.grace_end;
        for (conn, recorded) in a.connections {
            if self.resume_connection(id, conn, recorded, in_grace) {
                max_conn = max_conn.max(Some(conn));
            }
        }
        if let Some(max) = max_conn {
            if let Err(e) = self.advance_counter("connection", max) {
                tracing::warn!(domain = id, error = %e, "could not advance the connection counter");
            }
        }
        for (token, prefix) in a.watches {
            if let Err(e) = self.watch(id, token, prefix.clone()) {
                tracing::warn!(domain = id, token, prefix, error = %e, "resumed watch dropped");
            }
        }
    }

    /// `id` was granted `owner`'s arena in `slot` before the restart (the
    /// broker's record says so): it still maps it, so the slot stays pinned.
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
                if let Err(e) = self.reg.private_delete(&mapping_key(id, slot)) {
                    tracing::warn!(domain = id, slot, error = %e, "could not delete the mapping record");
                }
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

    /// Connection `conn`, recorded before the restart with `id` as one end,
    /// comes back; during the grace period a peer that is not back yet may
    /// still come. It counts against both ends' connection quotas, as a new
    /// one would. Returns true when the connection was registered anew (its
    /// id then moves the connection counter).
    fn resume_connection(
        &mut self,
        id: DomainId,
        conn: ConnId,
        recorded: RecordedConn,
        in_grace: bool,
    ) -> bool {
        let peer = if recorded.client == id {
            recorded.server
        } else {
            recorded.client
        };
        let gone = |reason| Event::PeerGone {
            domain: peer,
            conn: Some(conn),
            reason,
        };
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
            self.after_reply
                .push((id, gone(GoneReason::MissedHeartbeat)));
            return false;
        }
        if let Some(why) = self.over_connection_quota(id, peer) {
            tracing::warn!(domain = id, conn, peer, "resumed connection dropped: {why}");
            self.after_reply.push((id, gone(GoneReason::Revoked)));
            return false;
        }
        let RecordedConn {
            service,
            client,
            server,
        } = recorded;
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

    /// Why one more connection between `id` and `peer` would be over either
    /// live end's connection quota, if it would.
    fn over_connection_quota(&self, id: DomainId, peer: DomainId) -> Option<String> {
        for dom in [id, peer] {
            let Some(d) = self.domains.get(&dom) else {
                continue;
            };
            let (open, limit) = (self.open_connections(dom), d.rule.quotas.connections);
            if open >= limit {
                return Some(format!(
                    "domain {dom} has {open} open connections (limit {limit})"
                ));
            }
            // Per uid too: a resume must not hold more than a fresh connect could.
            if let Err(e) = self.check_uid_quota(dom, "connections", Server::uid_connections, |q| {
                q.connections
            }) {
                return Some(e.message);
            }
        }
        None
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
        self.forget_record(id);
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
    ///
    /// Silence is measured on the broker's awake clock, and a client that
    /// looks silent has its socket read first: heartbeats queued there while
    /// the broker was not reading (stopped, stalled, busy) prove it alive.
    /// A connection that has not joined within `join_timeout` is closed,
    /// heartbeats or not.
    pub(super) fn tick(&mut self, now: Instant) {
        let timeout = self.cfg.heartbeat_timeout();
        let awake = self.intake.clock.now();
        let silent_keys = |s: &Self| -> Vec<u64> {
            s.clients
                .iter()
                .filter(|(_, c)| !c.doomed && awake.saturating_sub(c.last_seen) > timeout)
                .map(|(k, _)| *k)
                .collect()
        };
        for key in silent_keys(self) {
            self.client_ready(key, rustix::event::epoll::EventFlags::IN);
        }
        for key in silent_keys(self) {
            self.doom(key, GoneReason::MissedHeartbeat);
        }
        let join_timeout = self.cfg.join_timeout;
        let late: Vec<u64> = self
            .clients
            .iter()
            .filter(|(_, c)| {
                let deadline = if c.refused {
                    join_timeout.min(super::io::REFUSED_DEADLINE)
                } else {
                    join_timeout
                };
                !c.doomed && c.domain.is_none() && awake.saturating_sub(c.connected) > deadline
            })
            .map(|(k, _)| *k)
            .collect();
        for key in late {
            if let Some(c) = self.clients.get(&key) {
                tracing::debug!(pid = c.pid, uid = c.uid, "connection did not join in time; closed");
            }
            self.doom(key, GoneReason::Exited);
        }
        if now >= self.grace_end && !self.grace_over {
            self.grace_over = true;
            self.tell_mappers_of_orphans();
            self.forget_absent_records();
        }
        if now >= self.grace_end && (!self.reserved.is_empty() || !self.unconfirmed.is_empty()) {
            self.reserved.clear();
            for conn in std::mem::take(&mut self.unconfirmed) {
                self.settle_unconfirmed(conn);
            }
        }
    }

    /// Domains recorded before the restart that did not come back by the end
    /// of the grace period count as dead: their records go, and so does what
    /// was recorded before the restart (no one resumes after this).
    fn forget_absent_records(&mut self) {
        let absent: Vec<DomainId> = self
            .recorded
            .domains
            .keys()
            .copied()
            .filter(|id| !self.domains.contains_key(id))
            .collect();
        for id in absent {
            tracing::info!(
                domain = id,
                "domain did not come back after the broker restart"
            );
            self.forget_record(id);
        }
        self.recorded.conns.clear();
        self.recorded.mappings.clear();
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
