//! The broker's hierarchical key-value registry.
//!
//! A XenStore-like tree of `/`-separated keys that domains use for rendezvous and
//! configuration: any key may hold a value and have children (intermediate
//! "directories" are implicit), owners register *prefix watches* that fire on
//! every write or delete at or below a prefix, and multi-key *transactions*
//! compare-and-set several keys at once. Keys and the id counters live in an
//! embedded SQLite database so that they survive a broker restart; watches are
//! kept in memory only, because their owners are connections that die with the
//! broker and re-register when they reconnect.
//!
//! What this crate must never do:
//! - accept a path that has not passed [`fido_proto::check_path`], or a value
//!   larger than [`fido_proto::MAX_VALUE`] — bad input is an error and changes
//!   nothing;
//! - let one owner's watches or quotas affect another's — watches are keyed by
//!   `(owner, token)`, so owners can neither replace nor remove each other's;
//! - apply part of a failed transaction — every multi-key change runs inside one
//!   SQLite transaction, and watch events are only handed out after it commits.
//!
//! [`Registry`] is a single-threaded object owned by the broker's event loop. It
//! is `Send` (it can be moved to that thread) but not `Sync`.

#![forbid(unsafe_code)]

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

pub use fido_proto::{ListCursor, TxnOp};
use fido_proto::{check_path, MAX_TXN_OPS, MAX_VALUE};

/// Version of the on-disk schema, kept in SQLite's `user_version`. A database
/// written by a newer broker is refused rather than misread.
const SCHEMA_VERSION: i64 = 1;

// `keys` is WITHOUT ROWID so the primary key *is* the table's B-tree: subtree
// deletes, usage sums and child listings are all range scans on `path`. The
// column uses SQLite's default BINARY collation (memcmp order), which the range
// bounds in `subtree_bounds` rely on.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS keys (
    path  TEXT PRIMARY KEY NOT NULL,
    value BLOB NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS counters (
    name  TEXT PRIMARY KEY NOT NULL,
    value INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS private (
    key   TEXT PRIMARY KEY NOT NULL,
    value BLOB NOT NULL
) WITHOUT ROWID;
";

/// Deleting a key deletes the key itself and everything strictly below it.
const SUBTREE_WHERE: &str = "path = ?1 OR (path >= ?2 AND path < ?3)";

/// Everything that can go wrong in the registry.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The path failed [`fido_proto::check_path`]. Carries (a prefix of) the
    /// offending path for the log; it is client input, so it is shown escaped.
    #[error("bad registry path {0:?}")]
    BadPath(String),
    /// A value (or a transaction's expected value) exceeds [`MAX_VALUE`].
    #[error("registry value too large ({0} bytes, limit {MAX_VALUE})")]
    ValueTooLarge(usize),
    /// A transaction with more than [`MAX_TXN_OPS`] operations.
    #[error("registry transaction has {0} operations (limit {MAX_TXN_OPS})")]
    TooManyOps(usize),
    /// The database was written with a schema this build does not know.
    #[error("registry database has schema version {found}, this broker speaks {SCHEMA_VERSION}")]
    SchemaVersion { found: i64 },
    /// SQLite failed (I/O error, corrupt database, disk full, ...).
    #[error("registry database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
}

/// A change to deliver to the owner of a matching watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    pub owner: u64,
    pub token: u64,
    /// The key that changed (not the watched prefix).
    pub path: String,
    /// The new value; `None` means the key was deleted.
    pub value: Option<Vec<u8>>,
}

/// Result of [`Registry::transact`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnOutcome {
    /// `false` if a `Check` failed; then nothing was written, `reads` and
    /// `events` are empty.
    pub committed: bool,
    /// One entry per `Read` op, in op order.
    pub reads: Vec<Option<Vec<u8>>>,
    /// Events for every `Put`/`Delete` of the transaction, in op order.
    pub events: Vec<WatchEvent>,
}

/// The registry: a SQLite-backed key tree plus in-memory prefix watches.
pub struct Registry {
    conn: Connection,
    watches: Watches,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("db", &self.conn.path())
            .field(
                "watches",
                &self
                    .watches
                    .by_prefix
                    .values()
                    .map(BTreeSet::len)
                    .sum::<usize>(),
            )
            .finish()
    }
}

impl Registry {
    /// Opens or creates the SQLite database at `path` (WAL mode,
    /// `synchronous=NORMAL`) and creates the schema.
    ///
    /// WAL + NORMAL means a committed write survives a broker crash but the last
    /// few commits may be lost on power failure; the database stays consistent
    /// either way. [`Registry::next_counter`] syncs fully because ids must never
    /// repeat.
    pub fn open(path: &Path) -> Result<Registry, RegistryError> {
        let conn = Connection::open(path)?;
        let mode: String =
            conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            // Some filesystems (network mounts) cannot do WAL; SQLite falls back
            // to a rollback journal, which is slower but just as safe.
            tracing::warn!(db = %path.display(), %mode, "registry database is not in WAL mode");
        }
        Self::setup(conn)
    }

    /// A purely in-memory registry (SQLite `:memory:`), for tests.
    pub fn in_memory() -> Result<Registry, RegistryError> {
        Self::setup(Connection::open_in_memory()?)
    }

    fn setup(conn: Connection) -> Result<Registry, RegistryError> {
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        let found: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        if found != 0 && found != SCHEMA_VERSION {
            return Err(RegistryError::SchemaVersion { found });
        }
        conn.execute_batch(SCHEMA)?;
        conn.pragma_update(None, "user_version", SCHEMA_VERSION)?;
        tracing::debug!(db = ?conn.path(), "registry opened");
        Ok(Registry {
            conn,
            watches: Watches::default(),
        })
    }

    /// The value of `path`, or `None` if the key has no value (it may still have
    /// children).
    pub fn read(&self, path: &str) -> Result<Option<Vec<u8>>, RegistryError> {
        checked(path)?;
        get(&self.conn, path)
    }

    /// Writes a key, creating it if needed. Intermediate "directories" are
    /// implicit: a key may have both a value and children. Returns the watch
    /// events to deliver (one per matching watch).
    pub fn write(&mut self, path: &str, value: &[u8]) -> Result<Vec<WatchEvent>, RegistryError> {
        checked(path)?;
        check_value(value)?;
        put(&self.conn, path, value)?;
        let mut events = Vec::new();
        self.watches.fire(path, Some(value), &mut events);
        Ok(events)
    }

    /// Deletes the key and its whole subtree. Returns one event per deleted key
    /// per matching watch. Deleting a missing key is `Ok(vec![])`.
    pub fn delete(&mut self, path: &str) -> Result<Vec<WatchEvent>, RegistryError> {
        checked(path)?;
        // A single DELETE statement is atomic on its own.
        let deleted = delete_subtree(&self.conn, path)?;
        let mut events = Vec::new();
        for key in &deleted {
            self.watches.fire(key, None, &mut events);
        }
        Ok(events)
    }

    /// Names (last component only, sorted) of the direct children of `path`,
    /// including children that exist only because a deeper key exists
    /// (keys `/a/b/c` → `list("/a") == ["b"]`). `list("/")` lists top-level
    /// names. A path with no children (or no such key) lists as empty.
    pub fn list(&self, path: &str) -> Result<Vec<String>, RegistryError> {
        let (names, _) = self.list_page(path, None, usize::MAX)?;
        let sorted: BTreeSet<String> = names.into_iter().collect();
        Ok(sorted.into_iter().collect())
    }

    /// One page of [`list`](Self::list): the children of `path` met from
    /// `from` on (`None`: the start), until their names add up to
    /// `max_bytes`, and where the next page starts (`None`: this was the
    /// last). Names come in key order, not sorted, and a child that is both
    /// a key and a directory may come twice, once on each of two pages; a
    /// caller gathering pages puts them in a set. A cursor from outside the
    /// subtree of `path` is refused.
    pub fn list_page(
        &self,
        path: &str,
        from: Option<&ListCursor>,
        max_bytes: usize,
    ) -> Result<(Vec<String>, Option<ListCursor>), RegistryError> {
        checked(path)?;
        let (lo, hi) = subtree_bounds(path);
        // Skip-scan: find the smallest key below `path`, take its next
        // component, then jump past that child's whole subtree. This costs a
        // couple of index seeks per child instead of a scan of every
        // descendant, so listing a domain directory stays cheap however deep
        // the keys under it go.
        let mut after = self.conn.prepare_cached(
            "SELECT path FROM keys WHERE path > ?1 AND path < ?2 ORDER BY path LIMIT 1",
        )?;
        let mut from_stmt = self.conn.prepare_cached(
            "SELECT path FROM keys WHERE path >= ?1 AND path < ?2 ORDER BY path LIMIT 1",
        )?;
        // Names are collected in a set: a child that is both a key and a
        // directory ("c" and "c/x") is met twice, with siblings such as "c+x"
        // (which sort between "c" and "c/") in between.
        let mut names = BTreeSet::new();
        let mut order = Vec::new();
        let mut bytes = 0usize;
        let (mut cursor, mut inclusive) = match from {
            None => (lo.clone(), false),
            Some(c) if c.key.starts_with(&lo) && c.key < hi => (c.key.clone(), c.inclusive),
            Some(c) => return Err(RegistryError::BadPath(format!("list cursor {:?} outside {path}", c.key))),
        };
        loop {
            if bytes >= max_bytes {
                return Ok((order, Some(ListCursor { key: cursor, inclusive })));
            }
            let stmt = if inclusive { &mut from_stmt } else { &mut after };
            let key: Option<String> = stmt.query_row((&cursor, &hi), |r| r.get(0)).optional()?;
            let Some(key) = key else { break };
            let rest = &key[lo.len()..];
            match rest.find('/') {
                // The child is itself a key: continue right after it (its own
                // subtree, if any, is found and skipped on the next round).
                None => {
                    if names.insert(rest.to_owned()) {
                        bytes += rest.len() + 1;
                        order.push(rest.to_owned());
                    }
                    cursor = key;
                    inclusive = false;
                }
                // A descendant of child `name`: jump to the first key after
                // `lo + name + "/..."`, i.e. `lo + name + "0"` ('0' follows '/').
                Some(i) => {
                    let name = &rest[..i];
                    if names.insert(name.to_owned()) {
                        bytes += name.len() + 1;
                        order.push(name.to_owned());
                    }
                    cursor = format!("{lo}{name}0");
                    inclusive = true;
                }
            }
        }
        Ok((order, None))
    }

    /// Prefix watch: fires for any write or delete of `prefix` itself or of any
    /// key under it, component-wise (`/a` matches `/a` and `/a/b`, not `/ab`).
    /// Watches live in memory only. `(owner, token)` is unique: re-adding
    /// replaces the earlier prefix.
    pub fn watch(&mut self, owner: u64, token: u64, prefix: &str) -> Result<(), RegistryError> {
        checked(prefix)?;
        self.watches.add(owner, token, prefix);
        Ok(())
    }

    /// Removes one watch; `false` if `owner` had no watch `token`.
    pub fn unwatch(&mut self, owner: u64, token: u64) -> bool {
        self.watches.remove(owner, token)
    }

    /// Removes every watch of `owner` (its domain died).
    pub fn drop_owner(&mut self, owner: u64) {
        self.watches.drop_owner(owner);
    }

    /// Number of watches `owner` holds (for the broker's per-domain quota).
    pub fn watch_count(&self, owner: u64) -> usize {
        self.watches.by_owner.get(&owner).map_or(0, HashMap::len)
    }

    /// Atomic multi-key transaction, run as one SQLite transaction.
    ///
    /// All `Check` ops are evaluated against the state *before* the
    /// transaction, wherever they appear in `ops`; if any fails nothing is
    /// written and the outcome is `committed: false` with empty `reads` and
    /// `events`. Otherwise `Put`/`Delete`/`Read` are applied in order, a `Read`
    /// seeing the effect of earlier ops. Any error (bad input, SQLite failure)
    /// rolls the whole transaction back.
    pub fn transact(&mut self, ops: &[TxnOp]) -> Result<TxnOutcome, RegistryError> {
        if ops.len() > MAX_TXN_OPS {
            return Err(RegistryError::TooManyOps(ops.len()));
        }
        // Validate everything before touching the database, so bad input is
        // refused even when an earlier Check would have failed anyway.
        for op in ops {
            match op {
                TxnOp::Check { path, expected } => {
                    checked(path)?;
                    if let Some(v) = expected {
                        check_value(v)?;
                    }
                }
                TxnOp::Put { path, value } => {
                    checked(path)?;
                    check_value(value)?;
                }
                TxnOp::Delete { path } | TxnOp::Read { path } => checked(path)?,
            }
        }

        // IMMEDIATE takes the write lock up front so the checks and the writes
        // see one and the same state even if another process opens the file.
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        for op in ops {
            if let TxnOp::Check { path, expected } = op {
                if get(&tx, path)? != *expected {
                    // Dropping `tx` rolls back; nothing has been written anyway.
                    return Ok(TxnOutcome {
                        committed: false,
                        reads: Vec::new(),
                        events: Vec::new(),
                    });
                }
            }
        }
        // Remember what changed, but match watches only once the commit has
        // succeeded: a rolled-back transaction must produce no event.
        let mut changes: Vec<(String, Option<&[u8]>)> = Vec::new();
        let mut reads = Vec::new();
        for op in ops {
            match op {
                TxnOp::Check { .. } => {}
                TxnOp::Put { path, value } => {
                    put(&tx, path, value)?;
                    changes.push((path.clone(), Some(value)));
                }
                TxnOp::Delete { path } => {
                    for key in delete_subtree(&tx, path)? {
                        changes.push((key, None));
                    }
                }
                TxnOp::Read { path } => reads.push(get(&tx, path)?),
            }
        }
        tx.commit()?;

        let mut events = Vec::new();
        for (path, value) in &changes {
            self.watches.fire(path, *value, &mut events);
        }
        Ok(TxnOutcome {
            committed: true,
            reads,
            events,
        })
    }

    /// Number of keys and total value bytes at and under `prefix`, for quotas.
    pub fn usage(&self, prefix: &str) -> Result<(u64, u64), RegistryError> {
        checked(prefix)?;
        let (lo, hi) = subtree_bounds(prefix);
        let sql = format!(
            "SELECT count(*), coalesce(sum(length(value)), 0) FROM keys WHERE {SUBTREE_WHERE}"
        );
        let (keys, bytes): (i64, i64) = self
            .conn
            .prepare_cached(&sql)?
            .query_row((prefix, &lo, &hi), |r| Ok((r.get(0)?, r.get(1)?)))?;
        // count(*) and sums of lengths are never negative.
        Ok((keys as u64, bytes as u64))
    }

    /// A persistent counter: returns 1, 2, 3, ... for each `name`, never
    /// repeating across restarts (used for DomainId / ConnId allocation).
    ///
    /// Counter names come from the broker's code, not from clients, so they are
    /// not path-checked; they are bound as SQL parameters like everything else.
    pub fn next_counter(&mut self, name: &str) -> Result<u64, RegistryError> {
        // Under synchronous=NORMAL a power failure may lose the last commits,
        // which would hand out an id again. Ids are allocated rarely (on join
        // and connect), so pay for a full sync of this one commit.
        self.conn.pragma_update(None, "synchronous", "FULL")?;
        let result = self
            .conn
            .prepare_cached(
                "INSERT INTO counters(name, value) VALUES (?1, 1)
                 ON CONFLICT(name) DO UPDATE SET value = value + 1
                 RETURNING value",
            )
            .and_then(|mut stmt| stmt.query_row([name], |r| r.get::<_, i64>(0)));
        // Restore NORMAL even if the increment failed.
        let restore = self.conn.pragma_update(None, "synchronous", "NORMAL");
        let value = result?;
        restore?;
        Ok(value as u64)
    }

    // ----- the broker's private records ------------------------------------------
    //
    // A table apart from `keys`: no registry path reaches it, so no Read, List,
    // Watch, Transaction or usage sum of any client ever sees it. The broker
    // keeps there what it must remember across restarts and must not show
    // (what proves a domain's identity). Keys are the broker's own, never a
    // client's; they are bound as SQL parameters.

    /// Sets private record `key` to `value`.
    pub fn private_put(&mut self, key: &str, value: &[u8]) -> Result<(), RegistryError> {
        self.conn
            .prepare_cached("INSERT INTO private(key, value) VALUES (?1, ?2) ON CONFLICT(key) DO UPDATE SET value = excluded.value")?
            .execute((key, value))?;
        Ok(())
    }

    /// Removes private record `key`, if there is one.
    pub fn private_delete(&mut self, key: &str) -> Result<(), RegistryError> {
        self.conn.prepare_cached("DELETE FROM private WHERE key = ?1")?.execute([key])?;
        Ok(())
    }

    /// Removes every private record whose key starts with `prefix` (an exact
    /// key is its own prefix).
    pub fn private_delete_prefix(&mut self, prefix: &str) -> Result<(), RegistryError> {
        self.conn
            .prepare_cached("DELETE FROM private WHERE substr(key, 1, length(?1)) = ?1")?
            .execute([prefix])?;
        Ok(())
    }

    /// Every private record whose key starts with `prefix`, in key order.
    pub fn private_list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, RegistryError> {
        let mut stmt = self
            .conn
            .prepare_cached("SELECT key, value FROM private WHERE substr(key, 1, length(?1)) = ?1 ORDER BY key")?;
        let rows = stmt.query_map([prefix], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<Result<Vec<_>, _>>()?)
    }
}

/// In-memory watch table, indexed both ways: by prefix, so that a change costs
/// one hash lookup per ancestor of the changed key (O(depth), independent of how
/// many watches exist), and by owner, so that unwatch / drop_owner / counting
/// never scan other owners' watches.
#[derive(Default)]
struct Watches {
    /// prefix → (owner, token) of every watch on exactly that prefix. Ordered
    /// sets keep event order deterministic.
    by_prefix: HashMap<String, BTreeSet<(u64, u64)>>,
    /// owner → token → prefix.
    by_owner: HashMap<u64, HashMap<u64, String>>,
}

impl Watches {
    fn add(&mut self, owner: u64, token: u64, prefix: &str) {
        let old = self
            .by_owner
            .entry(owner)
            .or_default()
            .insert(token, prefix.to_owned());
        if let Some(old) = old {
            self.unlink(&old, owner, token);
        }
        self.by_prefix
            .entry(prefix.to_owned())
            .or_default()
            .insert((owner, token));
    }

    fn remove(&mut self, owner: u64, token: u64) -> bool {
        let Some(tokens) = self.by_owner.get_mut(&owner) else {
            return false;
        };
        let Some(prefix) = tokens.remove(&token) else {
            return false;
        };
        if tokens.is_empty() {
            self.by_owner.remove(&owner);
        }
        self.unlink(&prefix, owner, token);
        true
    }

    fn drop_owner(&mut self, owner: u64) {
        for (token, prefix) in self.by_owner.remove(&owner).unwrap_or_default() {
            self.unlink(&prefix, owner, token);
        }
    }

    fn unlink(&mut self, prefix: &str, owner: u64, token: u64) {
        if let Some(set) = self.by_prefix.get_mut(prefix) {
            set.remove(&(owner, token));
            // Empty sets are removed so the map does not grow with dead prefixes.
            if set.is_empty() {
                self.by_prefix.remove(prefix);
            }
        }
    }

    /// Appends one event per watch whose prefix is `path` or an ancestor of it.
    fn fire(&self, path: &str, value: Option<&[u8]>, out: &mut Vec<WatchEvent>) {
        if self.by_prefix.is_empty() {
            return;
        }
        for prefix in ancestors(path) {
            for &(owner, token) in self.by_prefix.get(prefix).into_iter().flatten() {
                out.push(WatchEvent {
                    owner,
                    token,
                    path: path.to_owned(),
                    value: value.map(<[u8]>::to_vec),
                });
            }
        }
    }
}

/// `path` and its ancestors, deepest first: `/a/b` → `/a/b`, `/a`, `/`.
/// Component-wise by construction, so `/ab` never yields `/a`.
fn ancestors(path: &str) -> impl Iterator<Item = &str> {
    let mut next = Some(path);
    std::iter::from_fn(move || {
        let cur = next?;
        next = match cur.rfind('/') {
            _ if cur == "/" => None,
            Some(0) => Some("/"),
            Some(i) => Some(&cur[..i]),
            None => None,
        };
        Some(cur)
    })
}

/// `[lo, hi)` holding exactly the keys strictly below `path` (for `/`: every
/// key, `/` included). Keys below `/a` all start with `/a/`; under BINARY
/// collation they are the strings from `/a/` up to but excluding `/a0`, since
/// `'0'` is the byte right after `'/'`. Siblings such as `/ab` or `/a+x` fall
/// outside.
fn subtree_bounds(path: &str) -> (String, String) {
    let lo = if path == "/" {
        "/".to_owned()
    } else {
        format!("{path}/")
    };
    let hi = format!("{}0", &lo[..lo.len() - 1]);
    (lo, hi)
}

fn checked(path: &str) -> Result<(), RegistryError> {
    check_path(path).map_err(|_| {
        // The path is client input of any length; keep the error (and the log
        // line it ends up in) bounded.
        const SHOWN: usize = 128;
        let mut end = path.len().min(SHOWN);
        while !path.is_char_boundary(end) {
            end -= 1;
        }
        RegistryError::BadPath(path[..end].to_owned())
    })
}

fn check_value(value: &[u8]) -> Result<(), RegistryError> {
    if value.len() > MAX_VALUE {
        return Err(RegistryError::ValueTooLarge(value.len()));
    }
    Ok(())
}

// Helpers on a plain connection so that the single-key methods and `transact`
// (which passes its `Transaction`, a `Connection` by deref) share one code path.

fn get(conn: &Connection, path: &str) -> Result<Option<Vec<u8>>, RegistryError> {
    Ok(conn
        .prepare_cached("SELECT value FROM keys WHERE path = ?1")?
        .query_row([path], |r| r.get(0))
        .optional()?)
}

fn put(conn: &Connection, path: &str, value: &[u8]) -> Result<(), RegistryError> {
    conn.prepare_cached(
        "INSERT INTO keys(path, value) VALUES (?1, ?2)
         ON CONFLICT(path) DO UPDATE SET value = excluded.value",
    )?
    .execute((path, value))?;
    Ok(())
}

/// Deletes `path` and its subtree; returns the deleted keys, sorted.
fn delete_subtree(conn: &Connection, path: &str) -> Result<Vec<String>, RegistryError> {
    let (lo, hi) = subtree_bounds(path);
    let sql = format!("DELETE FROM keys WHERE {SUBTREE_WHERE} RETURNING path");
    let mut stmt = conn.prepare_cached(&sql)?;
    let mut deleted = stmt
        .query_map((path, &lo, &hi), |r| r.get::<_, String>(0))?
        .collect::<Result<Vec<_>, _>>()?;
    // RETURNING order is unspecified; sort for deterministic event order.
    deleted.sort_unstable();
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ancestors_are_component_wise() {
        assert_eq!(
            ancestors("/a/b/c").collect::<Vec<_>>(),
            ["/a/b/c", "/a/b", "/a", "/"]
        );
        assert_eq!(ancestors("/ab").collect::<Vec<_>>(), ["/ab", "/"]);
        assert_eq!(ancestors("/").collect::<Vec<_>>(), ["/"]);
    }

    #[test]
    fn subtree_bounds_cover_exactly_descendants() {
        assert_eq!(subtree_bounds("/a"), ("/a/".to_owned(), "/a0".to_owned()));
        assert_eq!(subtree_bounds("/"), ("/".to_owned(), "0".to_owned()));
        let (lo, hi) = subtree_bounds("/a");
        let inside = |k: &str| k >= lo.as_str() && k < hi.as_str();
        assert!(inside("/a/b") && inside("/a/b/c") && inside("/a/-"));
        assert!(
            !inside("/a") && !inside("/ab") && !inside("/a+x") && !inside("/a-") && !inside("/a.")
        );
    }

    #[test]
    fn subtree_queries_use_the_primary_key() {
        let reg = Registry::in_memory().unwrap();
        for sql in [
            format!("SELECT count(*) FROM keys WHERE {SUBTREE_WHERE}"),
            "SELECT path FROM keys WHERE path > ?1 AND path < ?2 ORDER BY path LIMIT 1".to_owned(),
        ] {
            let mut stmt = reg
                .conn
                .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
                .unwrap();
            let params = ["/a", "/a/", "/a0"]
                .into_iter()
                .take(stmt.parameter_count());
            let plan: Vec<String> = stmt
                .query_map(rusqlite::params_from_iter(params), |r| r.get(3))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
            let plan = plan.join("; ");
            assert!(!plan.contains("SCAN keys"), "full scan in {sql}: {plan}");
        }
    }
}
