//! Sockets the broker may still hold a reference to.
//!
//! An offer or a claim carries the program's socket to the broker
//! (`SCM_RIGHTS`). When the broker does not answer in time — stopped,
//! hopelessly overloaded — the connection stays plain TCP, but the
//! descriptor waits in the broker's socket queue, a second reference to the
//! program's socket: the program's `close` then drops its own reference
//! only, no FIN leaves, and a peer that waits for end-of-file waits until
//! the broker reads its queue or dies. So such a socket is remembered here,
//! and its `close` shuts it down first when the program surely held the
//! only descriptor of it: no other number in this process names it, and no
//! copy can have left the process since (no `fork`, `posix_spawn` or exec
//! the library saw, unless it is close-on-exec; not passed over a Unix
//! socket). Then the shutdown sends exactly the FIN that close would have
//! (with unread data, close would have sent a reset: a FIN is the one
//! difference).
//!
//! Must never: shut down a socket another holder may still use.

use libc::c_int;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// (descriptor, socket inode, `COPIES` when pinned).
static PINNED: Mutex<Vec<(c_int, u64, u64)>> = Mutex::new(Vec::new());
static COUNT: AtomicUsize = AtomicUsize::new(0);
/// Moves on at every fork, `posix_spawn` and exec the library sees: after
/// one, another process may hold a copy of any inheritable descriptor.
static COPIES: AtomicU64 = AtomicU64::new(0);

fn inode(fd: c_int) -> Option<u64> {
    // SAFETY: fstat into a zeroed stat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; any descriptor number is allowed.
    let ok = unsafe { libc::fstat(fd, &mut st) } == 0 && st.st_mode & libc::S_IFMT == libc::S_IFSOCK;
    ok.then_some(st.st_ino)
}

/// Whether any socket is pinned (one load).
pub fn any() -> bool {
    COUNT.load(Ordering::Acquire) != 0
}

/// The pinned descriptors (for `close_range`).
pub fn fds() -> Vec<c_int> {
    if !any() {
        return Vec::new();
    }
    PINNED.lock().iter().map(|p| p.0).collect()
}

/// A request carrying socket `fd` got no answer: the broker may hold it.
pub fn pin(fd: c_int) {
    let Some(ino) = inode(fd) else { return };
    let mut g = PINNED.lock();
    g.retain(|p| p.0 != fd);
    g.push((fd, ino, COPIES.load(Ordering::SeqCst)));
    COUNT.store(g.len(), Ordering::Release);
}

/// A copy of every inheritable descriptor may now live in another process.
pub fn copies_may_exist() {
    COPIES.fetch_add(1, Ordering::SeqCst);
}

/// Forgets `fd` (closed behind our back, or passed to another process).
pub fn forget(fd: c_int) -> Option<(u64, u64)> {
    if COUNT.load(Ordering::Acquire) == 0 {
        return None;
    }
    let mut g = PINNED.lock();
    let i = g.iter().position(|p| p.0 == fd)?;
    let (_, ino, copies) = g.swap_remove(i);
    COUNT.store(g.len(), Ordering::Release);
    Some((ino, copies))
}

/// The program is closing `fd`: shut it down first if it was pinned and
/// this close drops the last descriptor of it (see the module docs).
pub fn closing(fd: c_int) {
    let Some((ino, copies)) = forget(fd) else { return };
    // Under a seccomp filter (sshd's pre-auth child) `fstat` and reading
    // /proc may kill the process: only calls the program makes itself.
    if crate::config::restricted() {
        return;
    }
    if inode(fd) != Some(ino) {
        return;
    }
    if COPIES.load(Ordering::SeqCst) != copies && !crate::addr::fd_cloexec(fd) {
        return;
    }
    if !only_descriptor(fd, ino) {
        return;
    }
    crate::sys::debug!("fd {fd}: the broker may hold this socket (a request it did not answer): shut down at close");
    // SAFETY: shutting down the program's socket, which it is closing.
    unsafe { crate::real::shutdown(fd, libc::SHUT_RDWR) };
}

/// Whether no descriptor of this process but `fd` names socket `ino`.
fn only_descriptor(fd: c_int, ino: u64) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return false;
    };
    for e in dir.flatten() {
        let Some(n) = e.file_name().to_str().and_then(|s| s.parse::<c_int>().ok()) else {
            continue;
        };
        if n != fd && inode(n) == Some(ino) {
            return false;
        }
    }
    true
}

/// `fork`: the child must not take the parent's pins (nor the parent its
/// child's), which `copies_may_exist` ensures; the lock is held across the
/// fork so the child's copy is consistent.
pub fn fork_prepare() {
    std::mem::forget(PINNED.lock());
    COPIES.fetch_add(1, Ordering::SeqCst);
}
pub fn fork_after() {
    // SAFETY: locked by fork_prepare on this thread, guard forgotten.
    unsafe { PINNED.force_unlock() };
}
