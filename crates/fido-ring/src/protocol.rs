//! The index / sleep-word protocol, the only tricky concurrency in Fido.
//!
//! Each side of a ring owns the words it writes and only reads the peer's:
//!
//! * the **producer** owns the ring's publish index (`prod`) and, next to it,
//!   its **bell** word: a counter it bumps each time it wakes a futex sleeper;
//! * the **consumer** owns its **sleep word**: `epoch << 2 | how`, where `how`
//!   is [`AWAKE`], [`ON_SOCKET`] (asleep on its socket doorbell) or
//!   [`ON_FUTEX`] (asleep in `FUTEX_WAIT` on the producer's bell word, which it
//!   maps read-only).
//!
//! Publishing (producer):  `prod.store(new, Release); fence(SeqCst); w = sleep.load()`
//! and wake the consumer only if `w` says asleep *and* `w` differs from the last
//! sleep word it already woke. How depends on `w`: ring the socket doorbell, or
//! bump the bell word (Release) and `FUTEX_WAKE` it. Sleeping (consumer):
//! `b = bell.load(Acquire)` (futex sleeps only); `sleep.store(epoch<<2|how);
//! fence(SeqCst); p = prod.load(Acquire)`; sleep only if `p` shows nothing new —
//! on the socket, or in `FUTEX_WAIT(bell, b)`, which the kernel refuses to start
//! if the bell no longer reads `b`.
//!
//! Why no wake-up is lost: the two sequences are the store–fence–load halves of
//! Dekker's algorithm. With both fences `SeqCst`, the fences are totally ordered;
//! whichever comes second sees the other side's store. Either the consumer sees
//! the new index (and does not sleep) or the producer sees the sleep word (and
//! wakes it). For the futex, the consumer reads the bell *before* storing its
//! sleep word, and the producer bumps the bell only *after* seeing that word,
//! so the bump meant for this sleep comes after the value the consumer passes
//! to `FUTEX_WAIT`: the call returns at once, or the wake that follows the bump
//! ends it. (Read the other way round, the bump could land before the read —
//! a publish that is slow to look at the sleep word wakes a sleep whose
//! consumer already took that very descriptor — and the next publish, seeing
//! the same sleep word, would not wake it again: `tests/loom.rs` finds this.)
//! Why a consumer never reads an unpublished descriptor: the producer writes the
//! descriptor before its `Release` store of `prod`, and the consumer reads it
//! only after an `Acquire` load of `prod` that returned a larger value.
//!
//! Why a busy stream costs no system call: while the consumer is awake its sleep
//! word is even, so the producer's check is one load of a cache line that does
//! not change. And a consumer that went to sleep once is woken at most once for
//! that sleep (`last_rung`), so a burst of messages costs one wake-up.
//!
//! Why the futex keeps the trust model: the word a consumer sleeps on is in the
//! *producer's* memory, written only by the producer; the consumer needs only
//! read access (`FUTEX_WAIT` and `FUTEX_WAKE` on a shared mapping key on the
//! file and offset, and need no write permission). The producer's wake is
//! `FUTEX_WAKE` on its own word: it never blocks and never writes peer memory.
//!
//! `tests/loom.rs` model-checks exactly these functions.

use crate::sync::{fence, AtomicU32, AtomicU64, Ordering};

/// Sleep-word state: awake (the producer need not wake anybody).
pub const AWAKE: u64 = 0;
/// Sleep-word state: asleep on the socket doorbell.
pub const ON_SOCKET: u64 = 1;
/// Sleep-word state: asleep in `FUTEX_WAIT` on the producer's bell word.
pub const ON_FUTEX: u64 = 3;

/// How a consumer is about to sleep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sleep {
    /// On its socket doorbell (poll/epoll/async runtimes; long sleeps).
    Socket,
    /// In `FUTEX_WAIT` on the producer's bell word (short sleeps: the cheaper
    /// wake-up).
    Futex,
}

/// What the producer must do after publishing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// The consumer is awake (or was already woken for this sleep).
    None,
    /// Ring the consumer's socket doorbell.
    Socket,
    /// Bump our bell word ([`bump`]) and `FUTEX_WAKE` it.
    Futex,
}

/// Producer: make `new` the published index, then say whether and how the
/// consumer must be woken. `last_rung` is the producer's private memory of the
/// last sleep word it woke.
#[inline]
pub fn publish(index: &AtomicU64, new: u64, peer_sleep: &AtomicU64, last_rung: &mut u64) -> Wake {
    index.store(new, Ordering::Release);
    fence(Ordering::SeqCst);
    let word = peer_sleep.load(Ordering::Relaxed);
    if word & 1 == 1 && word != *last_rung {
        *last_rung = word;
        if word & 3 == ON_FUTEX {
            Wake::Futex
        } else {
            Wake::Socket
        }
    } else {
        Wake::None
    }
}

/// Producer: change the bell word a futex sleeper waits on (before waking it).
#[inline]
pub fn bump(bell: &AtomicU32) {
    bell.fetch_add(1, Ordering::Release);
}

/// Consumer: announce that it is about to sleep, and how. The caller must
/// re-check the producer's index *after* this returns and before sleeping.
#[inline]
pub fn arm(sleep: &AtomicU64, epoch: &mut u64, how: Sleep) {
    *epoch += 1;
    let state = match how {
        Sleep::Socket => ON_SOCKET,
        Sleep::Futex => ON_FUTEX,
    };
    sleep.store((*epoch << 2) | state, Ordering::Relaxed);
    fence(Ordering::SeqCst);
}

/// Consumer, futex sleeps: the bell value to pass to `FUTEX_WAIT`. Read
/// *before* [`arm`].
#[inline]
pub fn bell_value(bell: &AtomicU32) -> u32 {
    bell.load(Ordering::Acquire)
}

/// Consumer: awake again (found work or was woken).
#[inline]
pub fn disarm(sleep: &AtomicU64, epoch: u64) {
    sleep.store((epoch << 2) | AWAKE, Ordering::Relaxed);
}

/// Consumer: read the producer's published index.
#[inline]
pub fn observe(index: &AtomicU64) -> u64 {
    index.load(Ordering::Acquire)
}
