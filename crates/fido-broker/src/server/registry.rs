//! The registry requests (read, list, write, delete, watch, transaction:
//! checked against the managed subtrees, the policy and the quotas) and the
//! broker's own writes under `/domain`, `/service`, `/connection`.

use super::authorization::{check_writable, is_managed_path, Viewer};
use fido_proto::{DomainId, ErrorCode, RemoteError, Reply, Request, TxnOp};
use fido_registry::{RegistryError, WatchEvent};

/// Bytes of names one `ListPage` answer carries at most (about: the scan
/// stops once it has reached them), well within a reply datagram.
const LIST_PAGE_BYTES: usize = 64 * 1024;

use super::{err, internal, Handled, Server, MAX_COUNTER_ADVANCE};

/// A registry operation failed: the request gets an error saying why, and
/// the operator a log line (at error: the registry is the broker's own state,
/// and a full disk or a damaged database needs someone to act).
pub(super) fn registry_failure(what: &str, e: fido_registry::RegistryError) -> RemoteError {
    match &e {
        fido_registry::RegistryError::BadPath(_)
        | fido_registry::RegistryError::ValueTooLarge(_)
        | fido_registry::RegistryError::TooManyOps(_) => {
            return err(ErrorCode::BadRequest, format!("{what}: {e}"))
        }
        _ if e.is_disk_full() => {
            tracing::error!(error = %e, "{what} failed: the state directory's disk is full");
            return internal(what, format!("{e} (the broker's state disk is full)"));
        }
        _ if e.is_damage() => tracing::error!(
            error = %e,
            "{what} failed: the registry database is damaged; stop the broker and move it aside"
        ),
        _ => tracing::error!(error = %e, "{what} failed"),
    }
    internal(what, e)
}

impl Server {
    /// Handles `Read`, `List`, `Write`, `Delete`, `Watch`, `Unwatch`, `Transaction`.
    pub(super) fn registry_request(&mut self, dom: DomainId, body: Request) -> Handled {
        match body {
            body @ (Request::Read { .. } | Request::List { .. } | Request::ListPage { .. }) => {
                self.registry_look(&self.domain_viewer(dom)?, body)
            }
            Request::Write { path, value } => self.registry_update(dom, path, Some(value)),
            Request::Delete { path } => self.registry_update(dom, path, None),
            Request::Watch { token, prefix } => self.watch(dom, token, prefix),
            Request::Unwatch { token } => {
                self.reg.unwatch(dom, token);
                Ok(Some((Reply::Ok, Vec::new())))
            }
            Request::Transaction { ops } => self.transaction(dom, ops),
            other => Err(err(
                ErrorCode::BadRequest,
                format!("not a registry request: {other:?}"),
            )),
        }
    }

    /// `Read` and `List`, as far as `viewer` may see: a key it may not read
    /// is refused, a listing shows only the children it may read (or read
    /// below).
    pub(super) fn registry_look(&self, viewer: &Viewer, body: Request) -> Handled {
        match body {
            Request::Read { path } => {
                if !self.may_read_key(viewer, &path, false) {
                    return Err(self.deny_read(viewer, &path));
                }
                let v = self
                    .reg
                    .read(&path)
                    .map_err(|e| registry_failure("registry read", e))?;
                Ok(Some((Reply::Value(v), Vec::new())))
            }
            Request::List { path } => {
                if !self.may_read_key(viewer, &path, true) {
                    return Err(self.deny_read(viewer, &path));
                }
                let mut keys = self
                    .reg
                    .list(&path)
                    .map_err(|e| registry_failure("registry list", e))?;
                let base = path.trim_end_matches('/');
                keys.retain(|k| self.may_read_key(viewer, &format!("{base}/{k}"), true));
                Ok(Some((Reply::Keys(keys), Vec::new())))
            }
            Request::ListPage { path, cursor } => {
                if !self.may_read_key(viewer, &path, true) {
                    return Err(self.deny_read(viewer, &path));
                }
                let (mut keys, next) = self
                    .reg
                    .list_page(&path, cursor.as_ref(), LIST_PAGE_BYTES)
                    .map_err(|e| match e {
                        RegistryError::BadPath(p) => err(ErrorCode::BadRequest, p),
                        e => registry_failure("registry list", e),
                    })?;
                let base = path.trim_end_matches('/');
                keys.retain(|k| self.may_read_key(viewer, &format!("{base}/{k}"), true));
                Ok(Some((Reply::KeysPage { keys, next }, Vec::new())))
            }
            other => Err(err(
                ErrorCode::BadRequest,
                format!("not a registry read: {other:?}"),
            )),
        }
    }

    /// Watch events `watcher`s may see: a put only when the watcher may read
    /// the key now (after the write: it shows the new writer's value); a
    /// delete when it could read the key before (`visible_before`), or when
    /// it was a broker-managed key of a domain, service or connection that is
    /// gone (it carries no value, only the path).
    fn visible_events(&self, events: Vec<WatchEvent>, visible_before: &[bool]) -> Vec<WatchEvent> {
        events
            .into_iter()
            .zip(visible_before)
            .filter(|(e, before)| {
                if e.value.is_none() && (**before || is_managed_path(&e.path)) {
                    return true;
                }
                self.domain_viewer(e.owner)
                    .is_ok_and(|v| self.may_read_key(&v, &e.path, false))
            })
            .map(|(e, _)| e)
            .collect()
    }

    /// For each event, may its watcher read its key now (before a batch
    /// that deletes it is committed to the accounts)?
    fn visible_now(&self, events: &[WatchEvent]) -> Vec<bool> {
        events
            .iter()
            .map(|e| {
                self.domain_viewer(e.owner)
                    .is_ok_and(|v| self.may_read_key(&v, &e.path, false))
            })
            .collect()
    }

    /// `Write` (with a value) or `Delete` (without) of one key: allowed,
    /// within quota, applied.
    fn registry_update(&mut self, dom: DomainId, path: String, value: Option<Vec<u8>>) -> Handled {
        check_writable(&path)?;
        self.check_reg_access(dom, &path, value.is_none())?;
        let op = match value {
            Some(value) => TxnOp::Put { path, value },
            None => TxnOp::Delete { path },
        };
        let overlay = self.charge(dom, std::slice::from_ref(&op))?;
        let events = match &op {
            TxnOp::Put { path, value } => self
                .reg
                .write(path, value)
                .map_err(|e| registry_failure("registry write", e))?,
            TxnOp::Delete { path } => self
                .reg
                .delete(path)
                .map_err(|e| registry_failure("registry delete", e))?,
            TxnOp::Check { .. } | TxnOp::Read { .. } => unreachable!("built above"),
        };
        let before = self.visible_now(&events);
        self.acct.commit(overlay);
        let events = self.visible_events(events, &before);
        self.deliver(events);
        Ok(Some((Reply::Ok, Vec::new())))
    }

    pub(super) fn watch(&mut self, dom: DomainId, token: u64, prefix: String) -> Handled {
        let viewer = self.domain_viewer(dom)?;
        if !self.may_read_key(&viewer, &prefix, true) {
            return Err(self.deny_read(&viewer, &prefix));
        }
        let limit = self.domains.get(&dom).map_or(0, |d| d.rule.quotas.watches);
        let held = self.reg.watch_count(dom) as u64;
        // Re-using a token replaces that watch: it does not add one.
        let replaces = self.reg.watch_count(dom) > 0 && self.reg.unwatch(dom, token);
        if held >= limit && !replaces {
            return Err(self.quota(
                dom,
                format!("too many registry watches: this domain holds {held} (limit {limit})"),
            ));
        }
        if !replaces {
            self.check_uid_quota(
                dom,
                "registry watches",
                |s, uid| {
                    let doms = s.domains.iter().filter(|(_, d)| d.uid == uid);
                    doms.map(|(id, _)| s.reg.watch_count(*id) as u64).sum()
                },
                |q| q.watches,
            )?;
        }
        self.reg
            .watch(dom, token, &prefix)
            .map_err(|e| registry_failure("registry watch", e))?;
        Ok(Some((Reply::Ok, Vec::new())))
    }

    fn transaction(&mut self, dom: DomainId, ops: Vec<TxnOp>) -> Handled {
        let viewer = self.domain_viewer(dom)?;
        for op in &ops {
            match op {
                // A check compares a value: it reads as much as a read does.
                TxnOp::Check { path, .. } | TxnOp::Read { path } => {
                    if !self.may_read_key(&viewer, path, false) {
                        return Err(self.deny_read(&viewer, path));
                    }
                }
                TxnOp::Put { path, .. } => {
                    check_writable(path)?;
                    self.check_reg_access(dom, path, false)?;
                }
                TxnOp::Delete { path } => {
                    check_writable(path)?;
                    self.check_reg_access(dom, path, true)?;
                }
            }
        }
        let overlay = self.charge(dom, &ops)?;
        let out = self
            .reg
            .transact(&ops)
            .map_err(|e| registry_failure("registry transaction", e))?;
        let before = self.visible_now(&out.events);
        if out.committed {
            self.acct.commit(overlay);
        }
        let events = self.visible_events(out.events, &before);
        self.deliver(events);
        Ok(Some((
            Reply::Txn {
                committed: out.committed,
                reads: out.reads,
            },
            Vec::new(),
        )))
    }

    // ----- broker-managed keys ------------------------------------------------

    pub(super) fn reg_write(&mut self, path: &str, value: &[u8]) {
        match self.reg.write(path, value) {
            Ok(events) => {
                let visible = self.visible_now(&events);
                let events = self.visible_events(events, &visible);
                self.deliver(events)
            }
            Err(e) => tracing::error!(path, error = %e, "registry write failed"),
        }
    }

    /// Writes broker-managed keys all together or not at all: what a request
    /// records about itself (a join's `/domain/<id>`, an offer's `/service`)
    /// must be there if the request succeeds, so a failed write (a full
    /// disk, a damaged database) fails the request.
    pub(super) fn reg_write_all(&mut self, keys: Vec<(String, Vec<u8>)>) -> Result<(), RemoteError> {
        let ops: Vec<TxnOp> = keys
            .into_iter()
            .map(|(path, value)| TxnOp::Put { path, value })
            .collect();
        match self.reg.transact(&ops) {
            Ok(out) => {
                let visible = self.visible_now(&out.events);
                let events = self.visible_events(out.events, &visible);
                self.deliver(events);
                Ok(())
            }
            Err(e) => {
                tracing::error!(error = %e, "registry write failed; request refused");
                Err(registry_failure("registry write", e))
            }
        }
    }

    pub(super) fn reg_delete(&mut self, path: &str) {
        match self.reg.delete(path) {
            Ok(events) => {
                let visible = self.visible_now(&events);
                let events = self.visible_events(events, &visible);
                self.deliver(events)
            }
            Err(e) => tracing::error!(path, error = %e, "registry delete failed"),
        }
    }

    /// Moves a persistent counter past `id`; returns false if `id` is absurdly far ahead.
    pub(super) fn advance_counter(&mut self, name: &str, id: u64) -> Result<(), RemoteError> {
        for _ in 0..MAX_COUNTER_ADVANCE {
            let v = self
                .reg
                .next_counter(name)
                .map_err(|e| registry_failure("registry counter", e))?;
            if v > id {
                return Ok(());
            }
        }
        Err(err(
            ErrorCode::BadRequest,
            format!("resumed {name} id {id} is far beyond this broker's counter; join afresh"),
        ))
    }
}
