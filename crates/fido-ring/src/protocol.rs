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
//! Each descriptor slot also carries a **publication mark** (`seq`, the lap
//! the slot was last written for, `block::lap_mark`): the producer writes the
//! descriptor, then stores the mark ([`mark_slot`], `Release`); a polling
//! consumer looks at the next slot's mark ([`slot_marked`], `Acquire`) and
//! never needs `prod` to take a message — the slot is the one cache line the
//! message arrives in. `prod` is still what the sleep protocol publishes, and
//! what a waiting consumer checks now and then ([`index_plausible`]).
//!
//! Pushing (producer, per descriptor): write the slot; `mark.store(lap, Release)`.
//! Publishing (producer, once per batch): `prod.store(new, Release); fence(SeqCst);
//! w = sleep.load()` and wake the consumer only if `w` says asleep *and* `w`
//! differs from the last sleep word it already woke. How depends on `w`: ring
//! the socket doorbell, or bump the bell word (Release) and `FUTEX_WAKE` it.
//! Sleeping (consumer): `b = bell.load(Acquire)` (futex sleeps only);
//! `sleep.store(epoch<<2|how); fence(SeqCst);` look at the next slot's mark
//! (`Acquire`); sleep only if it is not that slot's lap — on the socket, or in
//! `FUTEX_WAIT(bell, b)`, which the kernel refuses to start if the bell no
//! longer reads `b`.
//!
//! Why no wake-up is lost: the two sequences are the store–fence–load halves of
//! Dekker's algorithm. With both fences `SeqCst`, the fences are totally ordered;
//! whichever comes second sees the other side's store. The producer stores
//! every mark of a batch before its fence, so either the consumer sees the new
//! mark (and does not sleep) or the producer sees the sleep word (and wakes
//! it). A descriptor pushed but not yet published may be taken by a polling
//! consumer, but wakes no sleeper until the batch is published. For the futex,
//! the consumer reads the bell *before* storing its sleep word, and the
//! producer bumps the bell only *after* seeing that word, so the bump meant
//! for this sleep comes after the value the consumer passes to `FUTEX_WAIT`:
//! the call returns at once, or the wake that follows the bump ends it. (Read
//! the other way round, the bump could land before the read — a publish that
//! is slow to look at the sleep word wakes a sleep whose consumer already took
//! that very descriptor — and the next publish, seeing the same sleep word,
//! would not wake it again: `tests/loom.rs` finds this.)
//!
//! Why a consumer never reads an unpublished descriptor: the producer writes
//! the descriptor before its `Release` store of the slot's mark, and never
//! writes the mark any other way; the consumer copies the slot only after an
//! `Acquire` load of the mark returned the lap it expects. Marks of successive
//! laps differ, and a producer is never a lap ahead of the releases, so an old
//! mark is never taken for a new one; the consumer's copy is what it validates.
//! Why the index check: the publish index may trail what was consumed (slots
//! are marked as they are pushed, the batch is published once), but by at most
//! a ring, and never lead by more; a peer whose index says otherwise is lying.
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
//! `tests/loom.rs` model-checks exactly these functions, with `block::lap_mark`.

use crate::sync::{fence, AtomicU16, AtomicU32, AtomicU64, Ordering};

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

/// Producer: marks a descriptor slot published for lap `lap`, once the rest
/// of the slot is written (`Release`: a consumer that sees the mark sees the
/// descriptor). The mark word is written this way only.
#[inline]
pub fn mark_slot(mark: &AtomicU16, lap: u16) {
    mark.store(lap, Ordering::Release);
}

/// Consumer: whether a slot carries lap `lap`'s mark (`Acquire`: a copy of
/// the slot made afterwards sees everything written before the mark).
#[inline]
pub fn slot_marked(mark: &AtomicU16, lap: u16) -> bool {
    mark.load(Ordering::Acquire) == lap
}

/// Consumer: whether a publish index read from the peer fits what this side
/// consumed. It may trail (slots are marked as they are pushed, their batch
/// published once) or lead, but never by more than a ring of `entries`.
#[inline]
pub fn index_plausible(published: u64, consumed: u64, entries: u32) -> bool {
    published.abs_diff(consumed) <= entries as u64
}
