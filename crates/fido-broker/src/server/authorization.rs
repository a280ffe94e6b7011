//! Authorization: the policy's decisions (who joins under which rule, who
//! may write or delete where in the registry, MMNet's handshake), quotas,
//! and a policy reloaded while domains live.

use std::os::fd::AsFd;
use std::sync::Arc;

use fido_proto::{ConnId, DomainId, ErrorCode, Event, GoneReason, RemoteError, TxnOp};

use crate::policy::{JoinDenied, Rule, UidQuotas, ADMIN_RESERVED_SLOTS};

use super::{domains, err, internal, Server, MANAGED};

impl Server {
    /// The rule that admits `who` with an arena of `arena_len` bytes, or why not.
    pub(super) fn admit(
        &self,
        who: &domains::Joiner,
        arena_len: u64,
    ) -> Result<Arc<Rule>, RemoteError> {
        let (pid, uid, gid, name) = (who.pid, who.uid, who.gid, &who.name);
        let rule = match self.cfg.policy.decide(uid, gid, who.label.as_deref()) {
            Ok(i) => self.rules[i].clone(),
            Err(why) => {
                let reason = match why {
                    JoinDenied::NoRule => "no rule matches".to_string(),
                    JoinDenied::Forbidden(r) => format!("rule {r} says join = false"),
                };
                let msg = format!(
                    "uid {uid} (gid {gid}, label {:?}) may not join: {reason} (policy {})",
                    who.label, self.cfg.policy.source
                );
                tracing::warn!(pid, uid, gid, name, "denied: {msg}");
                return Err(err(ErrorCode::Denied, msg));
            }
        };
        if !is_admin(uid) {
            let held = self.uid_domains(uid);
            let limit = rule.per_uid.domains;
            if held >= limit {
                let msg = format!(
                    "too many domains for uid {uid}: it has {held} live (limit {limit} per uid; rule {})",
                    rule.name
                );
                tracing::warn!(pid, uid, name, "quota: {msg}");
                return Err(err(ErrorCode::Quota, msg));
            }
            // Slots reserved for resuming domains are not counted: a resume
            // takes its own back, and a fresh join cannot take them anyway.
            let total = self.cfg.geometry.slots;
            let keep = ADMIN_RESERVED_SLOTS.min(total / 8);
            let free = total.saturating_sub(self.slots.len() as u32);
            if free <= keep {
                let msg = format!(
                    "only {free} of {total} PGVAS slots are free, and the last {keep} are kept for \
                     the administrator (root and the broker's uid)"
                );
                tracing::warn!(pid, uid, name, "quota: {msg}");
                return Err(err(ErrorCode::Quota, msg));
            }
        }
        if arena_len > rule.quotas.arena_bytes {
            let msg = format!(
                "arena of {arena_len} bytes is over this domain's quota (limit {}; rule {})",
                rule.quotas.arena_bytes, rule.name
            );
            tracing::warn!(pid, uid, name, "quota: {msg}");
            return Err(err(ErrorCode::Quota, msg));
        }
        Ok(rule)
    }

    /// `ReloadHandle::reload` woke the loop: apply the queued policy, if any.
    pub(super) fn reload_requested(&mut self) {
        let mut b = [0u8; 8];
        let _ = rustix::io::read(self.reload.event.as_fd(), &mut b);
        let next = self
            .reload
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(policy) = next {
            self.apply_policy(policy);
            self.send_after_reply();
        }
    }

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
            if !self
                .domains
                .get(&dom)
                .is_some_and(|d| d.rule.may_offer(&service))
            {
                tracing::warn!(
                    domain = dom,
                    service,
                    "service withdrawn: the reloaded policy forbids offering it"
                );
                self.withdraw(dom, &service);
            }
        }
        self.enforce_connect_policy();
    }

    /// Revokes every connection (established or waiting for its server) whose
    /// client may not connect to its service under the current rules. Runs
    /// after a policy reload and after a domain resumed its connections.
    pub(super) fn enforce_connect_policy(&mut self) {
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
            let e = self.deny(
                p.client,
                format!(
                    "may not connect to service {:?} (policy reloaded)",
                    p.service
                ),
            );
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

    /// A `Denied` error naming the rule, logged at warn.
    pub(super) fn deny(&self, dom: DomainId, what: String) -> RemoteError {
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
    pub(super) fn quota(&self, dom: DomainId, what: String) -> RemoteError {
        let rule = self.domains.get(&dom).map_or("?", |d| d.rule.name.as_str());
        let msg = format!("{what}; rule {rule}");
        tracing::warn!(domain = dom, "quota: {msg}");
        err(ErrorCode::Quota, msg)
    }

    /// May `dom` write (or, with `delete`, delete the subtree of) `path`?
    pub(super) fn check_reg_access(
        &self,
        dom: DomainId,
        path: &str,
        delete: bool,
    ) -> Result<(), RemoteError> {
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
                    format!(
                        "MMNet acceleration disabled by policy {}: {why}",
                        self.cfg.policy.source
                    ),
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

    /// Live domains of `uid`.
    pub(super) fn uid_domains(&self, uid: u32) -> u64 {
        self.domains.values().filter(|d| d.uid == uid).count() as u64
    }

    /// The uid of a live domain.
    pub(super) fn uid_of(&self, dom: DomainId) -> Option<u32> {
        self.domains.get(&dom).map(|d| d.uid)
    }

    /// Established and pending connections with a domain of `uid` at an
    /// end (a connection between two of its domains counts once).
    pub(super) fn uid_connections(&self, uid: u32) -> u64 {
        let mine =
            |a: DomainId, b: DomainId| self.uid_of(a) == Some(uid) || self.uid_of(b) == Some(uid);
        let est = self.conns.values().filter(|c| mine(c.client, c.server));
        let pend = self.pending.values().filter(|p| mine(p.client, p.server));
        (est.count() + pend.count()) as u64
    }

    /// Refuses `dom` one more of `what` when its uid (not an administrator)
    /// already holds `held` of them against its rule's per-uid `limit`.
    pub(super) fn check_uid_quota(
        &self,
        dom: DomainId,
        what: &str,
        held: impl FnOnce(&Server, u32) -> u64,
        limit: impl FnOnce(&UidQuotas) -> u64,
    ) -> Result<(), RemoteError> {
        let Some(d) = self.domains.get(&dom) else {
            return Err(internal("quota", "caller has no domain"));
        };
        if is_admin(d.uid) {
            return Ok(());
        }
        let (held, limit) = (held(self, d.uid), limit(&d.rule.per_uid));
        if held >= limit {
            return Err(self.quota(
                dom,
                format!(
                    "too many {what} for uid {}: its domains hold {held} (limit {limit} per uid)",
                    d.uid
                ),
            ));
        }
        Ok(())
    }

    /// Neither end of a new connection of `dom` to `server`'s `service`
    /// may be at its connection quota, nor either end's uid at its per-uid one.
    pub(super) fn check_connection_quotas(
        &self,
        dom: DomainId,
        server: DomainId,
        service: &str,
    ) -> Result<(), RemoteError> {
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
        self.check_uid_quota(dom, "connections", Server::uid_connections, |q| {
            q.connections
        })?;
        let (mine, theirs) = (self.uid_of(dom), self.uid_of(server));
        if let (Some(s), Some(theirs)) = (self.domains.get(&server), theirs) {
            if Some(theirs) != mine && !is_admin(theirs) {
                let held = self.uid_connections(theirs);
                let limit = s.rule.per_uid.connections;
                if held >= limit {
                    return Err(self.quota(
                        dom,
                        format!(
                            "the uid of domain {server} offering {service:?} is at its connection \
                             limit ({held} open, limit {limit} per uid)"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks the registry quotas for `ops` run by `dom`; the returned charges
    /// are committed once the registry has applied them.
    pub(super) fn charge(
        &self,
        dom: DomainId,
        ops: &[TxnOp],
    ) -> Result<crate::account::Overlay, RemoteError> {
        let (q, uq, uid) = match self.domains.get(&dom) {
            Some(d) => (d.rule.quotas, d.rule.per_uid, d.uid),
            None => return Err(internal("registry", "caller has no domain")),
        };
        let (keys0, bytes0) = self.acct.usage(dom);
        let (overlay, (keys, bytes)) = self.acct.simulate(dom, ops);
        if !is_admin(uid) {
            // What the uid's other domains hold stays as it is, except for
            // keys of theirs this batch overwrites or deletes.
            let (mut ukeys, mut ubytes) = (keys, bytes);
            for (id, _) in self
                .domains
                .iter()
                .filter(|(id, d)| d.uid == uid && **id != dom)
            {
                let (k, b) = self.acct.simulate_other(*id, &overlay);
                ukeys += k;
                ubytes += b;
            }
            if ukeys > uq.registry_keys && keys > keys0 {
                return Err(self.quota(
                    dom,
                    format!(
                        "too many registry keys for uid {uid}: its domains would hold {ukeys} \
                         (limit {} per uid)",
                        uq.registry_keys
                    ),
                ));
            }
            if ubytes > uq.registry_bytes && bytes > bytes0 {
                return Err(self.quota(
                    dom,
                    format!(
                        "too many registry bytes for uid {uid}: its domains would hold {ubytes} \
                         bytes of values (limit {} per uid)",
                        uq.registry_bytes
                    ),
                ));
            }
        }
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
}

/// Who asks to see something (a `Status`, a registry read, a watch): a
/// joined domain, or a peer that has not joined (`fido status` needs no PGVAS
/// slot). An administrator sees everything; anyone else what its rule and
/// its uid allow (see docs/SECURITY.md §3.4, "Who sees what").
pub(super) struct Viewer {
    pub(super) uid: u32,
    pub(super) admin: bool,
    /// The rule deciding what it may read.
    pub(super) rule: Option<Arc<Rule>>,
}

/// Keys below these are readable only by the uid of the domain that wrote
/// them last (and the administrator): per-process MMNet statistics (pids,
/// peer addresses) and connection requests (memfd numbers, nonces).
const OWNER_PRIVATE: [&str; 2] = ["/net/stats/", "/net/conn/"];

impl Server {
    /// The viewer a joined domain is.
    pub(super) fn domain_viewer(&self, dom: DomainId) -> Result<Viewer, RemoteError> {
        let d = self
            .domains
            .get(&dom)
            .ok_or_else(|| internal("viewer", "caller has no domain"))?;
        Ok(Viewer {
            uid: d.uid,
            admin: is_admin(d.uid),
            rule: Some(d.rule.clone()),
        })
    }

    /// The viewer a client that has not joined is: the rule a join of its
    /// uid and gid would get decides; a uid the policy would never admit
    /// sees nothing.
    pub(super) fn client_viewer(&self, key: u64) -> Result<Viewer, RemoteError> {
        let c = self
            .clients
            .get(&key)
            .ok_or_else(|| internal("viewer", "no such client"))?;
        let (uid, gid) = (c.uid, c.gid);
        // The policy decides even for the administrator: a rule that keeps
        // it out keeps it from looking too.
        let Some(i) = self.cfg.policy.observer_rule(uid, gid) else {
            let reason = match self.cfg.policy.decide(uid, gid, None) {
                Err(JoinDenied::Forbidden(r)) => format!("rule {r} says join = false"),
                _ => "no rule matches".to_string(),
            };
            let msg = format!(
                "uid {uid} (gid {gid}) may not join, so it may not look either: {reason} (policy {})",
                self.cfg.policy.source
            );
            tracing::warn!(uid, gid, "denied: {msg}");
            return Err(err(ErrorCode::Denied, msg));
        };
        Ok(Viewer {
            uid,
            admin: is_admin(uid),
            rule: Some(self.rules[i].clone()),
        })
    }

    /// Does `v` see domain `dom` (in `Status`, under `/domain`)?
    pub(super) fn sees_domain(&self, v: &Viewer, dom: DomainId) -> bool {
        v.admin || self.uid_of(dom) == Some(v.uid)
    }

    /// Does `v` see the service `name`: may its rule offer it or connect to it?
    pub(super) fn sees_service(&self, v: &Viewer, name: &str) -> bool {
        v.admin
            || v.rule
                .as_ref()
                .is_some_and(|r| r.may_offer(name) || r.may_connect(name))
    }

    /// Does `v` see a connection: is a domain of its uid one of its ends?
    pub(super) fn sees_connection(&self, v: &Viewer, client: DomainId, server: DomainId) -> bool {
        self.sees_domain(v, client) || self.sees_domain(v, server)
    }

    /// May `v` read the key `path` — or, with `below`, `path` or some key
    /// under it (may a listing show it, may a watch start there)?
    pub(super) fn may_read_key(&self, v: &Viewer, path: &str, below: bool) -> bool {
        if v.admin {
            return true;
        }
        let Some(rule) = &v.rule else {
            return false;
        };
        if path == "/" {
            return below;
        }
        let mut parts = path[1..].splitn(3, '/');
        match (parts.next(), parts.next()) {
            (Some("domain" | "service" | "connection"), None) => below,
            (Some("domain"), Some(id)) => id.parse().is_ok_and(|id| self.sees_domain(v, id)),
            (Some("service"), Some(name)) => self.sees_service(v, name),
            (Some("connection"), Some(id)) => id
                .parse()
                .ok()
                .and_then(|id| self.conns.get(&id))
                .is_some_and(|c| self.sees_connection(v, c.client, c.server)),
            _ => {
                let globbed = if below {
                    rule.may_read_at_or_below(path)
                } else {
                    rule.may_read(path)
                };
                if !globbed || !OWNER_PRIVATE.iter().any(|p| path.starts_with(p)) {
                    return globbed;
                }
                let mine = |o: DomainId| self.uid_of(o) == Some(v.uid);
                if below {
                    self.acct.owners_under(path).any(mine)
                } else {
                    self.acct.owner(path).is_some_and(mine)
                }
            }
        }
    }

    /// A `Denied` error for a read `v` may not make.
    pub(super) fn deny_read(&self, v: &Viewer, path: &str) -> RemoteError {
        let rule = v.rule.as_ref().map_or("?", |r| r.name.as_str());
        let msg = format!(
            "denied: uid {} may not read {path} (policy {}, rule {rule}: registry_read, \
             and only its own uid's domains, connections and MMNet keys)",
            v.uid, self.cfg.policy.source
        );
        tracing::debug!(uid = v.uid, "{msg}");
        err(ErrorCode::Denied, msg)
    }
}

/// Root and the broker's own uid: they see everything and per-uid limits do
/// not apply to them, so the administrator can always get in and look.
pub(super) fn is_admin(uid: u32) -> bool {
    uid == 0 || uid == rustix::process::geteuid().as_raw()
}

/// Is `path` in a broker-managed subtree (`/domain`, `/service`, `/connection`)?
pub(super) fn is_managed_path(path: &str) -> bool {
    path != "/" && is_managed(path)
}

fn is_managed(path: &str) -> bool {
    path == "/"
        || MANAGED
            .iter()
            .any(|m| path == *m || path.strip_prefix(m).is_some_and(|r| r.starts_with('/')))
}

pub(super) fn check_writable(path: &str) -> Result<(), RemoteError> {
    if is_managed(path) {
        return Err(err(
            ErrorCode::Denied,
            format!(
                "{path} is managed by the broker (/domain, /service, /connection, /net/listen are read-only)"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
