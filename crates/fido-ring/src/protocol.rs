//! The index / sleep-flag protocol, the only tricky concurrency in Fido.
//!
//! Each side of a ring owns the words it writes and only reads the peer's:
//!
//! * the **producer** owns the ring's publish index (`prod`);
//! * the **consumer** owns its **sleep word**: `epoch << 1 | asleep`.
//!
//! Publishing (producer):  `prod.store(new, Release); fence(SeqCst); w = sleep.load()`
//! and ring the doorbell only if `w` says asleep *and* `w` differs from the last
//! sleep word it already rang for. Sleeping (consumer): `sleep.store(epoch<<1|1);
//! fence(SeqCst); p = prod.load(Acquire)`; block on the doorbell only if `p` shows
//! nothing new.
//!
//! Why no wake-up is lost: the two sequences are the store–fence–load halves of
//! Dekker's algorithm. With both fences `SeqCst`, the fences are totally ordered;
//! whichever comes second sees the other side's store. Either the consumer sees
//! the new index (and does not sleep) or the producer sees the sleep word (and
//! rings). Why a consumer never reads an unpublished descriptor: the producer
//! writes the descriptor before its `Release` store of `prod`, and the consumer
//! reads it only after an `Acquire` load of `prod` that returned a larger value.
//!
//! Why a busy stream costs no system call: while the consumer is awake its sleep
//! word is even, so the producer's check is one load of a cache line that does
//! not change. And a consumer that went to sleep once is rung at most once for
//! that sleep (`last_rung`), so a burst of messages costs one doorbell.
//!
//! `tests/loom.rs` model-checks exactly these functions.

use crate::sync::{fence, AtomicU64, Ordering};

/// Producer: make `new` the published index, then say whether the consumer must
/// be woken. `last_rung` is the producer's private memory of the last sleep word
/// it rang for.
#[inline]
pub fn publish(index: &AtomicU64, new: u64, peer_sleep: &AtomicU64, last_rung: &mut u64) -> bool {
    index.store(new, Ordering::Release);
    fence(Ordering::SeqCst);
    let word = peer_sleep.load(Ordering::Relaxed);
    if word & 1 == 1 && word != *last_rung {
        *last_rung = word;
        true
    } else {
        false
    }
}

/// Consumer: announce that it is about to sleep. The caller must re-check the
/// producer's index *after* this returns and before blocking.
#[inline]
pub fn arm(sleep: &AtomicU64, epoch: &mut u64) {
    *epoch += 1;
    sleep.store((*epoch << 1) | 1, Ordering::Relaxed);
    fence(Ordering::SeqCst);
}

/// Consumer: awake again (found work or was woken).
#[inline]
pub fn disarm(sleep: &AtomicU64, epoch: u64) {
    sleep.store(epoch << 1, Ordering::Relaxed);
}

/// Consumer: read the producer's published index.
#[inline]
pub fn observe(index: &AtomicU64) -> u64 {
    index.load(Ordering::Acquire)
}
