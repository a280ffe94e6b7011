//! Futex wake-ups: the cheap way to wake a peer that sleeps for a short while.
//!
//! A futex sleeper waits on its *producer's* bell word (see `protocol`), which
//! lives in the producer's arena and is mapped read-only here. Futexes on a
//! shared file mapping are keyed on the file and the offset, not on the
//! address or on write permission, so both sides name the same futex through
//! their own mappings, and neither needs to write the other's memory.
//! Only shared (non-`PRIVATE`) futex operations do that: the private ones key
//! on the address space.
//!
//! A wake is `FUTEX_WAKE` of every waiter: a third domain that maps the same
//! arena could queue itself on our word, and must not be able to take the
//! one wake-up meant for our peer.

use crate::sync::AtomicU32;
use std::time::Duration;

use rustix::io::Errno;
#[cfg(not(loom))]
use rustix::thread::futex;

/// Why [`wait`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FutexWait {
    /// Woken, interrupted, or the word no longer held the expected value:
    /// look at the condition again.
    Woken,
    /// The timeout passed.
    TimedOut,
    /// The kernel refused the wait (e.g. the memory is not a shared mapping):
    /// use another way to sleep.
    Failed(Errno),
}

/// Sleeps while `word` reads `expected`, at most `timeout`.
#[cfg(not(loom))]
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) -> FutexWait {
    let ts = futex::Timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    match futex::wait(word, futex::Flags::empty(), expected, Some(&ts)) {
        Ok(()) | Err(Errno::AGAIN) | Err(Errno::INTR) => FutexWait::Woken,
        Err(Errno::TIMEDOUT) => FutexWait::TimedOut,
        Err(e) => FutexWait::Failed(e),
    }
}

/// Wakes every thread sleeping on `word`. Never blocks.
#[cfg(not(loom))]
pub fn wake_all(word: &AtomicU32) {
    let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
}

// Under loom the atomics are loom's and no system call is made: the model in
// `tests/loom.rs` checks the protocol with its own futex model.
#[cfg(loom)]
pub fn wait(_word: &AtomicU32, _expected: u32, _timeout: Duration) -> FutexWait {
    FutexWait::Failed(Errno::NOSYS)
}
#[cfg(loom)]
pub fn wake_all(_word: &AtomicU32) {}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use rustix::fs::{ftruncate, memfd_create, MemfdFlags};
    use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};
    use std::sync::atomic::Ordering;

    /// The property the futex stage rests on: a sleeper waiting on a word
    /// through a *read-only* shared mapping of a memfd is woken by the owner's
    /// `FUTEX_WAKE` through its own read-write mapping (two mappings, one
    /// key), and the wait itself is accepted (not `EFAULT`).
    #[test]
    fn a_read_only_mapping_sleeps_and_is_woken_through_the_owners_mapping() {
        let fd = memfd_create("futex-test", MemfdFlags::CLOEXEC).unwrap();
        ftruncate(&fd, 4096).unwrap();
        // SAFETY: fresh mappings of our own memfd; unmapped at the end, after
        // the other thread was joined.
        let (rw, ro) = unsafe {
            let rw = mmap(std::ptr::null_mut(), 4096, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, &fd, 0).unwrap();
            let ro = mmap(std::ptr::null_mut(), 4096, ProtFlags::READ, MapFlags::SHARED, &fd, 0).unwrap();
            (rw, ro)
        };
        assert_ne!(rw, ro);
        // SAFETY: both mappings are page-aligned and at least 4 bytes long.
        let (owner, sleeper) = unsafe { (&*(rw as *const AtomicU32), &*(ro as *const AtomicU32)) };
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut results = Vec::new();
                while sleeper.load(Ordering::Acquire) == 0 {
                    let r = wait(sleeper, 0, Duration::from_secs(20));
                    results.push(r);
                    if results.len() > 1000 {
                        break;
                    }
                }
                tx.send(results).unwrap();
            });
            // Let the sleeper get into the kernel (if it is not yet, the
            // wait sees the changed word and returns at once: still Woken).
            std::thread::sleep(Duration::from_millis(50));
            owner.store(1, Ordering::Release);
            wake_all(owner);
            let results = rx.recv_timeout(Duration::from_secs(60)).expect("sleeper never woke");
            assert!(!results.is_empty() && results.iter().all(|r| *r == FutexWait::Woken), "{results:?}");
        });
        // A wake through the read-only mapping reaches a sleeper too (how a
        // side wakes its own waiters on its peer's bell, `Channel` state
        // changes): the sleeper waits on the unchanged word and only the wake
        // can end its wait before the 20 s timeout.
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut results = Vec::new();
                while !stop.load(Ordering::Acquire) && results.len() < 1000 {
                    results.push(wait(sleeper, 1, Duration::from_secs(20)));
                }
                tx.send(results).unwrap();
            });
            std::thread::sleep(Duration::from_millis(50));
            stop.store(true, Ordering::Release);
            // Again and again: a wake before the sleeper reached the kernel
            // is lost (nobody changed the word), the next one is not.
            let results = loop {
                wake_all(sleeper);
                match rx.recv_timeout(Duration::from_millis(100)) {
                    Ok(r) => break r,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    Err(e) => panic!("sleeper thread failed: {e}"),
                }
            };
            assert!(results.iter().all(|r| *r == FutexWait::Woken), "{results:?}");
        });
        // SAFETY: nothing refers to the mappings any more.
        unsafe {
            munmap(rw, 4096).unwrap();
            munmap(ro, 4096).unwrap();
        }
    }

    #[test]
    fn a_wait_on_a_changed_word_returns_at_once_and_timeouts_are_reported() {
        let w = AtomicU32::new(5);
        assert_eq!(wait(&w, 4, Duration::from_secs(30)), FutexWait::Woken);
        assert_eq!(wait(&w, 5, Duration::from_millis(1)), FutexWait::TimedOut);
    }
}
