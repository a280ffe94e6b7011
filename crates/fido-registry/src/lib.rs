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
    /// The database is damaged (corrupt, not a database, or truncated); it
    /// is refused rather than read as an empty or partial registry.
    #[error("registry database is damaged: {0}; move it aside to start an empty registry (ids continue past the recorded high-water marks)")]
    Damaged(String),
    /// A file beside the database (id high-water marks, modes) could not be
    /// read or written.
    #[error("registry file: {0}")]
    Io(#[from] std::io::Error),
}

impl RegistryError {
    /// Did the disk (or the filesystem's quota) run out of space?
    pub fn is_disk_full(&self) -> bool {
        match self {
            RegistryError::Sqlite(rusqlite::Error::SqliteFailure(e, _)) => {
                e.code == rusqlite::ErrorCode::DiskFull
            }
            RegistryError::Io(e) => e.raw_os_error() == Some(28), // ENOSPC
            _ => false,
        }
    }

    /// Is the database damaged (found corrupt while in use)?
    pub fn is_damage(&self) -> bool {
        match self {
            RegistryError::Damaged(_) => true,
            RegistryError::Sqlite(rusqlite::Error::SqliteFailure(e, _)) => matches!(
                e.code,
                rusqlite::ErrorCode::DatabaseCorrupt | rusqlite::ErrorCode::NotADatabase
            ),
            _ => false,
        }
    }
}

/// A SQLite error met while opening: damage is told apart from other failures.
fn damage(path: &Path, e: rusqlite::Error) -> RegistryError {
    let e = RegistryError::Sqlite(e);
    if e.is_damage() {
        RegistryError::Damaged(format!("{}: {e}", path.display()))
    } else {
        e
    }
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
    /// The ids' high-water marks (absent for an in-memory registry).
    ids: Option<IdMarks>,
    /// Space set aside so that deletes still work on a full disk.
    reserve: Option<Reserve>,
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
    ///
    /// The files are the broker's alone: the database (and so its `-wal` and
    /// `-shm`, which SQLite creates with the database's mode) and the files
    /// next to it are made `0600`. SQLite waits for no lock (busy timeout
    /// zero): the broker is the only writer, so a lock held by anyone else is
    /// an error on that operation, never a stall of the broker's loop.
    ///
    /// A damaged database is refused ([`RegistryError::Damaged`]): one that
    /// fails SQLite's `quick_check` or is not a database, and one that is
    /// empty although the id high-water file (`<stem>.ids` beside it) says ids
    /// were handed out (it was truncated). A missing database with that file
    /// present (an operator moved a damaged one aside) starts empty, its id
    /// counters past everything ever handed out.
    pub fn open(path: &Path) -> Result<Registry, RegistryError> {
        let ids = IdMarks::load(&path.with_extension("ids"))?;
        match std::fs::metadata(path) {
            Ok(meta) if meta.len() == 0 && ids.any() => {
                return Err(RegistryError::Damaged(format!(
                    "{} is empty, but {} records ids handed out from it: it was truncated",
                    path.display(),
                    ids.path.display()
                )))
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(RegistryError::Io(e)),
        }
        private_file(path, true)?;
        for suffix in ["-wal", "-shm"] {
            let mut side = path.as_os_str().to_owned();
            side.push(suffix);
            private_file(Path::new(&side), false)?;
        }
        let damaged = |e: rusqlite::Error| damage(path, e);
        let conn = Connection::open(path).map_err(damaged)?;
        conn.busy_timeout(std::time::Duration::ZERO)?;
        let mode: String = conn
            .pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))
            .map_err(damaged)?;
        if !mode.eq_ignore_ascii_case("wal") {
            // Some filesystems (network mounts) cannot do WAL; SQLite falls back
            // to a rollback journal, which is slower but just as safe.
            tracing::warn!(db = %path.display(), %mode, "registry database is not in WAL mode");
        }
        let check: Vec<String> = conn
            .prepare("PRAGMA quick_check(5)")
            .and_then(|mut st| st.query_map([], |r| r.get(0))?.collect())
            .map_err(damaged)?;
        if check != ["ok"] {
            return Err(RegistryError::Damaged(format!(
                "{} fails SQLite's quick_check: {}",
                path.display(),
                check.join("; ")
            )));
        }
        let mut reg = Self::setup(conn).map_err(|e| match e {
            RegistryError::Sqlite(e) => damage(path, e),
            e => e,
        })?;
        reg.ids = Some(ids);
        reg.reserve = Some(Reserve::new(path.with_extension("reserve")));
        reg.sync_counters_with_marks()?;
        if let Some(r) = reg.reserve.as_mut() {
            r.refill();
        }
        Ok(reg)
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
            ids: None,
            reserve: None,
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
        self.refill_reserve();
        put(&self.conn, path, value)?;
        let mut events = Vec::new();
        self.watches.fire(path, Some(value), &mut events);
        Ok(events)
    }

    /// Deletes the key and its whole subtree. Returns one event per deleted key
    /// per matching watch. Deleting a missing key is `Ok(vec![])`.
    ///
    /// A delete frees space, so it must work on a full disk too: if SQLite
    /// finds no room for its journal, the space reserved beside the database
    /// is given up and the delete tried once more.
    pub fn delete(&mut self, path: &str) -> Result<Vec<WatchEvent>, RegistryError> {
        checked(path)?;
        // A single DELETE statement is atomic on its own.
        let deleted = match delete_subtree(&self.conn, path) {
            Err(e) if e.is_disk_full() && self.release_reserve() => {
                delete_subtree(&self.conn, path)?
            }
            other => other?,
        };
        self.refill_reserve();
        let mut events = Vec::new();
        for key in &deleted {
            self.watches.fire(key, None, &mut events);
        }
        Ok(events)
    }

    /// Gives up the reserved space; `false` if there was none to give.
    fn release_reserve(&mut self) -> bool {
        self.reserve.as_mut().is_some_and(Reserve::release)
    }

    /// Takes the reserve back once there is room again (tried now and then).
    fn refill_reserve(&mut self) {
        if let Some(r) = self.reserve.as_mut() {
            r.refill_later();
        }
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
        let value = result? as u64;
        restore?;
        // The id is handed out only once the high-water mark covers it, so
        // that even a lost database never hands it out again.
        if let Some(ids) = self.ids.as_mut() {
            ids.cover(name, value)?;
        }
        Ok(value)
    }

    /// Brings the counters and their high-water marks in line at open: a
    /// counter the database does not have (a fresh database) starts at its
    /// mark; a counter past its mark (a state directory from before the
    /// marks existed) raises it.
    fn sync_counters_with_marks(&mut self) -> Result<(), RegistryError> {
        let Some(ids) = self.ids.as_mut() else {
            return Ok(());
        };
        for (name, mark) in ids.marks.clone() {
            let mark = i64::try_from(mark).unwrap_or(i64::MAX);
            self.conn.execute(
                "INSERT INTO counters(name, value) VALUES (?1, ?2) ON CONFLICT(name) DO NOTHING",
                (&name, mark),
            )?;
        }
        let counters: Vec<(String, i64)> = self
            .conn
            .prepare("SELECT name, value FROM counters")?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<_, _>>()?;
        for (name, value) in counters {
            ids.cover(&name, u64::try_from(value).unwrap_or(0))?;
        }
        Ok(())
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

/// The id counters' high-water marks, in a small text file beside the
/// database (`name value` lines): every id a counter ever handed out is at
/// most its mark. Raised a block at a time, so the file is rewritten once
/// every [`IdMarks::BLOCK`] ids, atomically (write, sync, rename).
struct IdMarks {
    path: std::path::PathBuf,
    marks: std::collections::BTreeMap<String, u64>,
}

impl IdMarks {
    const BLOCK: u64 = 1024;

    fn load(path: &Path) -> Result<IdMarks, RegistryError> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(RegistryError::Io(e)),
        };
        let mut marks = std::collections::BTreeMap::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let parsed = line
                .split_once(' ')
                .and_then(|(n, v)| Some((n.to_owned(), v.trim().parse::<u64>().ok()?)));
            let Some((name, mark)) = parsed else {
                return Err(RegistryError::Damaged(format!(
                    "{}: unreadable line {line:?}",
                    path.display()
                )));
            };
            marks.insert(name, mark);
        }
        Ok(IdMarks {
            path: path.to_owned(),
            marks,
        })
    }

    fn any(&self) -> bool {
        self.marks.values().any(|m| *m > 0)
    }

    /// Makes sure `value` of counter `name` is at most its mark.
    fn cover(&mut self, name: &str, value: u64) -> Result<(), RegistryError> {
        if self.marks.get(name).is_some_and(|m| *m >= value) {
            return Ok(());
        }
        let mut marks = self.marks.clone();
        marks.insert(name.to_owned(), value.saturating_add(Self::BLOCK));
        let text: String = marks.iter().map(|(n, v)| format!("{n} {v}\n")).collect();
        let tmp = self.path.with_extension("ids-new");
        let written = (|| {
            let mut f = private_create(&tmp, true)?;
            std::io::Write::write_all(&mut f, text.as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, &self.path)?;
            if let Some(dir) = self.path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::File::open(dir)?.sync_all()?;
            }
            Ok(())
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(RegistryError::Io(e));
        }
        self.marks = marks;
        Ok(())
    }
}

/// A file of [`Reserve::SIZE`] bytes beside the database, given up when the
/// disk is full so that deletes (which SQLite must journal) still succeed.
struct Reserve {
    path: std::path::PathBuf,
    present: bool,
    last_try: Option<std::time::Instant>,
}

impl Reserve {
    const SIZE: usize = 1 << 20;
    /// How often a missing reserve is tried again.
    const RETRY: std::time::Duration = std::time::Duration::from_secs(10);

    fn new(path: std::path::PathBuf) -> Reserve {
        Reserve {
            path,
            present: false,
            last_try: None,
        }
    }

    /// Creates the reserve, written out (not sparse) so its blocks are taken.
    fn refill(&mut self) {
        self.last_try = Some(std::time::Instant::now());
        if std::fs::metadata(&self.path).is_ok_and(|m| m.len() >= Self::SIZE as u64) {
            self.present = true;
            return;
        }
        let made = (|| {
            let mut f = private_create(&self.path, true)?;
            std::io::Write::write_all(&mut f, &vec![0u8; Self::SIZE])?;
            f.sync_all()
        })();
        match made {
            Ok(()) => self.present = true,
            Err(e) => {
                let _ = std::fs::remove_file(&self.path);
                self.present = false;
                tracing::warn!(file = %self.path.display(), error = %e,
                    "could not reserve space for registry deletes on a full disk");
            }
        }
    }

    fn refill_later(&mut self) {
        if !self.present && self.last_try.is_none_or(|t| t.elapsed() >= Self::RETRY) {
            self.refill();
        }
    }

    fn release(&mut self) -> bool {
        if !self.present {
            return false;
        }
        self.present = false;
        self.last_try = Some(std::time::Instant::now());
        tracing::error!(file = %self.path.display(),
            "registry disk is full: releasing the reserved space so deletes can proceed");
        std::fs::remove_file(&self.path).is_ok()
    }
}

/// Opens `path` for writing, created `0600` if missing (and truncated when
/// `truncate`); an existing file is made `0600` too.
fn private_create(path: &Path, truncate: bool) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(truncate)
        .mode(0o600)
        .open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    Ok(f)
}

/// Makes `path` private (`0600`), creating it empty first when `create`.
fn private_file(path: &Path, create: bool) -> Result<(), RegistryError> {
    use std::os::unix::fs::PermissionsExt;
    if create {
        private_create(path, false)?;
        return Ok(());
    }
    match std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(RegistryError::Io(e)),
        _ => Ok(()),
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
