//! Registry quota accounting: who holds which application key.
//!
//! The scheme (documented in docs/SECURITY.md): every key an application
//! writes is charged to the domain that wrote it *last*; overwriting another
//! domain's key moves the charge. A domain's usage is the number of keys it
//! holds and the sum of their value lengths. Deleting a key (or a subtree)
//! uncharges whoever held it. When a domain dies its keys stay in the
//! registry — application data outlives its writer — but are charged to
//! nobody; keys written before a broker restart are likewise uncharged.
//! Broker-managed keys are never charged.

use std::collections::{BTreeMap, HashMap};

use fido_proto::{DomainId, TxnOp};

/// Holder and value length of each charged key.
#[derive(Default)]
pub(crate) struct RegAccount {
    owner: BTreeMap<String, (DomainId, u64)>,
    usage: HashMap<DomainId, (u64, u64)>,
}

/// The charges a batch of operations would leave, key by key (`None`: uncharged).
pub(crate) type Overlay = BTreeMap<String, Option<(DomainId, u64)>>;

fn under(key: &str, path: &str) -> bool {
    key == path
        || (key.starts_with(path) && (path == "/" || key.as_bytes().get(path.len()) == Some(&b'/')))
}

impl RegAccount {
    /// (keys, bytes) charged to `dom`.
    pub(crate) fn usage(&self, dom: DomainId) -> (u64, u64) {
        self.usage.get(&dom).copied().unwrap_or((0, 0))
    }

    /// What `ops`, run by `dom` in order, would change; and `dom`'s usage afterwards.
    pub(crate) fn simulate(&self, dom: DomainId, ops: &[TxnOp]) -> (Overlay, (u64, u64)) {
        let mut overlay = Overlay::new();
        for op in ops {
            match op {
                TxnOp::Put { path, value } => {
                    overlay.insert(path.clone(), Some((dom, value.len() as u64)));
                }
                TxnOp::Delete { path } => {
                    let mut keys: Vec<String> = self
                        .owner
                        .range(path.clone()..)
                        .take_while(|(k, _)| k.starts_with(path.as_str()))
                        .filter(|(k, _)| under(k, path))
                        .map(|(k, _)| k.clone())
                        .collect();
                    keys.extend(
                        overlay
                            .range(path.clone()..)
                            .take_while(|(k, _)| k.starts_with(path.as_str()))
                            .filter(|(k, _)| under(k, path))
                            .map(|(k, _)| k.clone()),
                    );
                    for k in keys {
                        overlay.insert(k, None);
                    }
                }
                TxnOp::Check { .. } | TxnOp::Read { .. } => {}
            }
        }
        let (mut keys, mut bytes) = self.usage(dom);
        for (k, new) in &overlay {
            if let Some((o, len)) = self.owner.get(k) {
                if *o == dom {
                    keys -= 1;
                    bytes -= len;
                }
            }
            if let Some((o, len)) = new {
                if *o == dom {
                    keys += 1;
                    bytes += len;
                }
            }
        }
        (overlay, (keys, bytes))
    }

    /// `other`'s usage (keys, bytes) once `overlay` (another domain's batch) applied.
    pub(crate) fn simulate_other(&self, other: DomainId, overlay: &Overlay) -> (u64, u64) {
        let (mut keys, mut bytes) = self.usage(other);
        if keys == 0 {
            return (0, 0);
        }
        for k in overlay.keys() {
            if let Some((o, len)) = self.owner.get(k) {
                if *o == other {
                    keys -= 1;
                    bytes -= len;
                }
            }
        }
        (keys, bytes)
    }

    /// Whose charge is `key` (the domain that wrote it last), if anyone's.
    pub(crate) fn owner(&self, key: &str) -> Option<DomainId> {
        self.owner.get(key).map(|(o, _)| *o)
    }

    /// The domains charged for keys at or below `path`.
    pub(crate) fn owners_under<'a>(&'a self, path: &'a str) -> impl Iterator<Item = DomainId> + 'a {
        self.owner
            .range(path.to_string()..)
            .take_while(move |(k, _)| k.starts_with(path))
            .filter(move |(k, _)| under(k, path))
            .map(|(_, (o, _))| *o)
    }

    /// Applies what [`simulate`](Self::simulate) computed, once the registry committed it.
    pub(crate) fn commit(&mut self, overlay: Overlay) {
        for (k, new) in overlay {
            if let Some((o, len)) = self.owner.remove(&k) {
                let u = self.usage.entry(o).or_default();
                u.0 -= 1;
                u.1 -= len;
            }
            if let Some((o, len)) = new {
                let u = self.usage.entry(o).or_default();
                u.0 += 1;
                u.1 += len;
                self.owner.insert(k, (o, len));
            }
        }
        self.usage.retain(|_, u| *u != (0, 0));
    }

    /// A domain died: its keys stay in the registry but are charged to nobody.
    pub(crate) fn forget(&mut self, dom: DomainId) {
        if self.usage.remove(&dom).is_some() {
            self.owner.retain(|_, (o, _)| *o != dom);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(p: &str, n: usize) -> TxnOp {
        TxnOp::Put {
            path: p.into(),
            value: vec![0; n],
        }
    }
    fn del(p: &str) -> TxnOp {
        TxnOp::Delete { path: p.into() }
    }

    #[test]
    fn charges_move_and_vanish() {
        let mut a = RegAccount::default();
        let (o, u) = a.simulate(
            1,
            &[put("/app/a", 10), put("/app/a/b", 5), put("/app/ab", 1)],
        );
        assert_eq!(u, (3, 16));
        a.commit(o);
        // Overwrite by another domain moves the charge.
        let (o, u) = a.simulate(2, &[put("/app/a", 3)]);
        assert_eq!(u, (1, 3));
        a.commit(o);
        assert_eq!(a.usage(1), (2, 6));
        // Subtree delete is component-wise (/app/ab survives).
        let (o, u) = a.simulate(2, &[del("/app/a")]);
        assert_eq!(u, (0, 0));
        a.commit(o);
        assert_eq!(a.usage(1), (1, 1));
        // Put then delete in one transaction leaves nothing charged.
        let (o, u) = a.simulate(1, &[put("/x/y", 100), del("/x")]);
        assert_eq!(u, (1, 1));
        a.commit(o);
        a.forget(1);
        assert_eq!(a.usage(1), (0, 0));
        assert!(a.owner.is_empty());
    }
}
