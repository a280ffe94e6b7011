//! Authorization: the policy's decisions (who joins under which rule, who
//! may write or delete where in the registry, MMNet's handshake), quotas,
//! and a policy reloaded while domains live.

use std::os::fd::AsFd;
use std::sync::Arc;

use fido_proto::{ConnId, DomainId, ErrorCode, Event, GoneReason, RemoteError, TxnOp};

use crate::policy::{JoinDenied, Rule};

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

    /// Neither end of a new connection of `dom` to `server`'s `service`
    /// may be at its connection quota.
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
        Ok(())
    }

    /// Checks the registry quotas for `ops` run by `dom`; the returned charges
    /// are committed once the registry has applied them.
    pub(super) fn charge(
        &self,
        dom: DomainId,
        ops: &[TxnOp],
    ) -> Result<crate::account::Overlay, RemoteError> {
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
