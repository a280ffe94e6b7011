//! Model check of the index / sleep-word protocol (`fido_ring::protocol`) with
//! `loom`: every interleaving of a producer publishing and a consumer deciding to
//! sleep. Run with
//! `RUSTFLAGS="--cfg loom" cargo test -p fido-ring --release --test loom`.
//!
//! The doorbell (a socket pair: rings queue bytes) is modelled as a counting
//! semaphore; the kernel's futex as what it is — a wait that checks the word
//! and queues under one lock, and a wake that takes that lock. loom reports a
//! deadlock if the consumer sleeps while the producer has finished (a lost
//! wake-up) and a data race if the consumer reads a slot that was not published.
#![cfg(loom)]

use fido_ring::protocol::{arm, bell_value, bump, disarm, observe, publish, Sleep, Wake};
use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use loom::sync::{Arc, Condvar, Mutex};

struct Eventfd {
    count: Mutex<u64>,
    cv: Condvar,
}

impl Eventfd {
    fn ring(&self) {
        *self.count.lock().unwrap() += 1;
        self.cv.notify_one();
    }
    fn wait(&self) {
        let mut c = self.count.lock().unwrap();
        while *c == 0 {
            c = self.cv.wait(c).unwrap();
        }
        *c = 0;
    }
}

/// `FUTEX_WAIT` / `FUTEX_WAKE` on one word: the kernel reads the word and
/// queues the waiter under the hash bucket's lock, and a wake takes the same
/// lock, so a wake after the word changed cannot slip between the two.
struct Futex {
    bucket: Mutex<()>,
    cv: Condvar,
}

impl Futex {
    fn wait(&self, word: &AtomicU32, expected: u32) {
        let g = self.bucket.lock().unwrap();
        if word.load(Ordering::SeqCst) != expected {
            return;
        }
        drop(self.cv.wait(g).unwrap());
    }
    fn wake_all(&self) {
        let _g = self.bucket.lock().unwrap();
        self.cv.notify_all();
    }
}

struct Shared {
    slots: [UnsafeCell<u64>; 2],
    prod: AtomicU64,
    sleep: AtomicU64,
    bell: Eventfd,
    /// The producer's bell word (in its memory; the consumer only reads it).
    futex_word: AtomicU32,
    futex: Futex,
}

fn shared() -> Arc<Shared> {
    Arc::new(Shared {
        slots: [UnsafeCell::new(0), UnsafeCell::new(0)],
        prod: AtomicU64::new(0),
        sleep: AtomicU64::new(0),
        bell: Eventfd { count: Mutex::new(0), cv: Condvar::new() },
        futex_word: AtomicU32::new(0),
        futex: Futex { bucket: Mutex::new(()), cv: Condvar::new() },
    })
}

/// The producer: two descriptors, each published and woken for as the
/// consumer's sleep word asks (`TxRing::publish`).
fn produce(p: Arc<Shared>) -> loom::thread::JoinHandle<()> {
    loom::thread::spawn(move || {
        let mut last_rung = 0;
        for i in 0..2u64 {
            p.slots[i as usize].with_mut(|v| unsafe { *v = 100 + i });
            match publish(&p.prod, i + 1, &p.sleep, &mut last_rung) {
                Wake::None => {}
                Wake::Socket => p.bell.ring(),
                Wake::Futex => {
                    bump(&p.futex_word);
                    p.futex.wake_all();
                }
            }
        }
    })
}

/// How the consumer sleeps when it finds nothing (`wait::wait_until`).
#[derive(Clone, Copy)]
enum Plan {
    /// The futex stage only.
    Futex,
    /// A futex stage that ends (its time is up) before any wake-up, then the
    /// doorbell: the hand-over where a wake-up could fall between the two.
    FutexThenSocket,
}

fn consume(s: &Shared, plan: Plan) {
    let mut cons = 0u64;
    let mut epoch = 0u64;
    while cons < 2 {
        if observe(&s.prod) > cons {
            let v = s.slots[cons as usize].with(|v| unsafe { *v });
            assert_eq!(v, 100 + cons);
            cons += 1;
            continue;
        }
        let seen = bell_value(&s.futex_word);
        arm(&s.sleep, &mut epoch, Sleep::Futex);
        if observe(&s.prod) > cons {
            disarm(&s.sleep, epoch);
            continue;
        }
        match plan {
            Plan::Futex => {
                s.futex.wait(&s.futex_word, seen);
                disarm(&s.sleep, epoch);
            }
            Plan::FutexThenSocket => {
                disarm(&s.sleep, epoch);
                arm(&s.sleep, &mut epoch, Sleep::Socket);
                if observe(&s.prod) > cons {
                    disarm(&s.sleep, epoch);
                    continue;
                }
                s.bell.wait();
                disarm(&s.sleep, epoch);
            }
        }
    }
}

/// Interleavings with up to this many preemptions. The lost wake-up found
/// while building the futex stage (bell read after arming) needs 3; the full
/// search takes minutes on the CI machine, this bound seconds.
fn bounded() -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(4);
    b
}

#[test]
fn futex_sleeps_lose_no_wakeup() {
    bounded().check(|| {
        let s = shared();
        let producer = produce(s.clone());
        consume(&s, Plan::Futex);
        producer.join().unwrap();
    });
}

#[test]
fn moving_from_the_futex_to_the_doorbell_loses_no_wakeup() {
    bounded().check(|| {
        let s = shared();
        let producer = produce(s.clone());
        consume(&s, Plan::FutexThenSocket);
        producer.join().unwrap();
    });
}

#[test]
fn no_lost_wakeup_no_unpublished_read() {
    loom::model(|| {
        let s = shared();
        let producer = produce(s.clone());
        let mut cons = 0u64;
        let mut epoch = 0u64;
        while cons < 2 {
            if observe(&s.prod) > cons {
                let v = s.slots[cons as usize].with(|v| unsafe { *v });
                assert_eq!(v, 100 + cons);
                cons += 1;
                continue;
            }
            arm(&s.sleep, &mut epoch, Sleep::Socket);
            if observe(&s.prod) > cons {
                disarm(&s.sleep, epoch);
                continue;
            }
            s.bell.wait();
            disarm(&s.sleep, epoch);
        }
        producer.join().unwrap();
    });
}
