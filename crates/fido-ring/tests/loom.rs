//! Model check of the index / sleep-word protocol (`fido_ring::protocol`) with
//! `loom`: every interleaving of a producer publishing and a consumer deciding to
//! sleep. Run with
//! `RUSTFLAGS="--cfg loom" cargo test -p fido-ring --release --test loom`.
//!
//! The doorbell (a socket pair: rings queue bytes) is modelled as a counting semaphore. loom reports a
//! deadlock if the consumer blocks while the producer has finished (a lost
//! wake-up) and a data race if the consumer reads a slot that was not published.
#![cfg(loom)]

use fido_ring::protocol::{arm, disarm, observe, publish};
use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU64;
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

struct Shared {
    slots: [UnsafeCell<u64>; 2],
    prod: AtomicU64,
    sleep: AtomicU64,
    bell: Eventfd,
}

#[test]
fn no_lost_wakeup_no_unpublished_read() {
    loom::model(|| {
        let s = Arc::new(Shared {
            slots: [UnsafeCell::new(0), UnsafeCell::new(0)],
            prod: AtomicU64::new(0),
            sleep: AtomicU64::new(0),
            bell: Eventfd { count: Mutex::new(0), cv: Condvar::new() },
        });
        let p = s.clone();
        let producer = loom::thread::spawn(move || {
            let mut last_rung = 0;
            for i in 0..2u64 {
                p.slots[i as usize].with_mut(|v| unsafe { *v = 100 + i });
                if publish(&p.prod, i + 1, &p.sleep, &mut last_rung) {
                    p.bell.ring();
                }
            }
        });
        let mut cons = 0u64;
        let mut epoch = 0u64;
        while cons < 2 {
            if observe(&s.prod) > cons {
                let v = s.slots[cons as usize].with(|v| unsafe { *v });
                assert_eq!(v, 100 + cons);
                cons += 1;
                continue;
            }
            arm(&s.sleep, &mut epoch);
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
