//! Which descriptors of this process are accelerated connections, and which
//! are listening sockets we published.
//!
//! Must never: cost a process without accelerated connections more than one
//! relaxed load per interposed call (`COUNT`).

use crate::conn::Conn;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

static CONNS: RwLock<Option<HashMap<i32, Arc<Conn>>>> = RwLock::new(None);
/// Number of entries in CONNS: the fast path of every interposed call on a
/// process without accelerated connections is one relaxed load.
static COUNT: AtomicUsize = AtomicUsize::new(0);

/// Listening sockets of this process (published or not: a broker that
/// comes back gets them again). See [`Listener`].
static LISTENERS: Mutex<Option<HashMap<i32, Listener>>> = Mutex::new(None);

/// A listening TCP socket of the program.
#[derive(Clone)]
struct Listener {
    /// Its `/net/listen` key; `None` while unpublished (no broker, or refused).
    key: Option<String>,
    /// The process that publishes (and withdraws) it; 0 for a duplicate.
    pid: u32,
    /// The broker epoch (`broker::epoch`) it was last published under.
    epoch: u64,
}
/// Entries in LISTENERS (0: closing a descriptor need not take the lock).
static LISTENER_COUNT: AtomicUsize = AtomicUsize::new(0);

/// Descriptors naming accelerated connections (0: nothing to interpose).
pub fn count() -> usize {
    COUNT.load(Ordering::Relaxed)
}

pub fn lookup(fd: i32) -> Option<Arc<Conn>> {
    if COUNT.load(Ordering::Relaxed) == 0 || fd < 0 {
        return None;
    }
    CONNS.read().as_ref()?.get(&fd).cloned()
}

/// Names `conn` by `fd` too. Returns a connection `fd` named before (the
/// caller releases it: dup2 onto an accelerated descriptor closes it).
/// The first descriptor of a connection records the socket's inode, which
/// later tells a stale entry (the program closed the number in a way we did
/// not see, and it names something else now) from a live one.
pub fn insert(fd: i32, conn: Arc<Conn>) -> Option<Arc<Conn>> {
    if conn.sock_ino.load(Ordering::Relaxed) == 0 {
        if let Some(ino) = crate::addr::fd_inode(fd) {
            conn.sock_ino.store(ino, Ordering::Relaxed);
        }
    }
    conn.local_refs.fetch_add(1, Ordering::SeqCst);
    let mut g = CONNS.write();
    let old = g.get_or_insert_with(HashMap::new).insert(fd, conn);
    if old.is_none() {
        COUNT.fetch_add(1, Ordering::Relaxed);
    }
    old
}

/// Forgets `fd`; returns its connection and whether it was this process's
/// last descriptor for it.
pub fn remove(fd: i32) -> Option<(Arc<Conn>, bool)> {
    if COUNT.load(Ordering::Relaxed) == 0 || fd < 0 {
        return None;
    }
    let c = CONNS.write().as_mut()?.remove(&fd)?;
    COUNT.fetch_sub(1, Ordering::Relaxed);
    let last = c.local_refs.fetch_sub(1, Ordering::SeqCst) == 1;
    Some((c, last))
}

/// Whether `fd` still names the socket its entry was made for (one `fstat`;
/// true when there is no entry).
pub fn entry_is_current(fd: i32) -> bool {
    match lookup(fd) {
        None => true,
        Some(c) => crate::addr::fd_inode(fd) == Some(c.sock_ino.load(Ordering::Relaxed)),
    }
}

/// Whether any descriptor number is remembered (connections or listeners):
/// what a call that creates a descriptor must check, at the cost of two
/// relaxed loads.
pub fn remembers_any() -> bool {
    COUNT.load(Ordering::Relaxed) != 0 || LISTENER_COUNT.load(Ordering::Relaxed) != 0
}

/// Distinct connections of this process.
pub fn all() -> Vec<Arc<Conn>> {
    let g = CONNS.read();
    let mut v: Vec<Arc<Conn>> = Vec::new();
    if let Some(m) = g.as_ref() {
        for c in m.values() {
            if !v.iter().any(|x| Arc::ptr_eq(x, c)) {
                v.push(c.clone());
            }
        }
    }
    v
}

/// Every descriptor naming a connection, with it.
pub fn entries() -> Vec<(i32, Arc<Conn>)> {
    if COUNT.load(Ordering::Relaxed) == 0 {
        return Vec::new();
    }
    CONNS
        .read()
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (*k, v.clone())).collect())
        .unwrap_or_default()
}

/// Descriptors of the listeners we published (or duplicated).
pub fn listener_fds() -> Vec<i32> {
    LISTENERS
        .lock()
        .as_ref()
        .map(|m| m.keys().copied().collect())
        .unwrap_or_default()
}

/// Descriptors of accelerated connections and published listeners.
pub fn fds() -> Vec<i32> {
    let mut v: Vec<i32> = CONNS
        .read()
        .as_ref()
        .map(|m| m.keys().copied().collect())
        .unwrap_or_default();
    if let Some(m) = LISTENERS.lock().as_ref() {
        v.extend(m.keys().copied());
    }
    v
}

pub fn add_listener(fd: i32, key: Option<String>, epoch: u64) {
    let old = LISTENERS.lock().get_or_insert_with(HashMap::new).insert(
        fd,
        Listener {
            key,
            pid: std::process::id(),
            epoch,
        },
    );
    if old.is_none() {
        LISTENER_COUNT.fetch_add(1, Ordering::Relaxed);
    }
}

/// The key to withdraw when `fd` closes (only in the process that published it).
pub fn remove_listener(fd: i32) -> Option<String> {
    if LISTENER_COUNT.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let mut g = LISTENERS.lock();
    let l = g.as_mut()?.remove(&fd)?;
    LISTENER_COUNT.fetch_sub(1, Ordering::Relaxed);
    if l.pid == std::process::id() {
        l.key
    } else {
        None
    }
}

/// Whether this process publishes any listener (cheap when it has none).
pub fn has_own_listeners() -> bool {
    let pid = std::process::id();
    LISTENERS
        .lock()
        .as_ref()
        .is_some_and(|m| m.values().any(|l| l.pid == pid))
}

/// Listeners this process publishes that were not published under broker
/// epoch `epoch` (the broker restarted, or was away when they listened).
pub fn stale_listeners(epoch: u64) -> Vec<i32> {
    let pid = std::process::id();
    LISTENERS
        .lock()
        .as_ref()
        .map(|m| {
            m.iter()
                .filter(|(_, l)| l.pid == pid && l.epoch != epoch)
                .map(|(fd, _)| *fd)
                .collect()
        })
        .unwrap_or_default()
}

pub fn is_listener(fd: i32) -> bool {
    LISTENERS
        .lock()
        .as_ref()
        .is_some_and(|m| m.contains_key(&fd))
}

pub fn dup_listener(old: i32, new: i32) {
    let mut g = LISTENERS.lock();
    if let Some(m) = g.as_mut() {
        if let Some(mut v) = m.get(&old).cloned() {
            // The duplicate never withdraws (or republishes) the key.
            v.pid = 0;
            if m.insert(new, v).is_none() {
                LISTENER_COUNT.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// fork(): hold every lock so the child gets them in a consistent state.
pub fn fork_prepare() {
    std::mem::forget(CONNS.write());
    std::mem::forget(LISTENERS.lock());
}

pub fn fork_parent() {
    // SAFETY: fork_prepare locked both and forgot the guards, on this thread.
    unsafe {
        CONNS.force_unlock_write();
        LISTENERS.force_unlock();
    }
}

pub fn fork_child() {
    // SAFETY: as in fork_parent; the child has only this thread.
    unsafe {
        CONNS.force_unlock_write();
        LISTENERS.force_unlock();
    }
}
