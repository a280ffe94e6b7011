//! File workers: `copy_file_range` (which io_uring cannot issue), off the
//! engine thread, each as the caller whose chunks it copies.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use rustix::io::Errno;

use crate::caller::Caller;
use crate::engine::ring_bell;

/// One `copy_file_range` chunk for a file worker.
pub(crate) struct FileChunk {
    pub(crate) job: u64,
    pub(crate) src: Arc<OwnedFd>,
    pub(crate) dst: Arc<OwnedFd>,
    pub(crate) in_off: u64,
    pub(crate) out_off: u64,
    pub(crate) len: usize,
}

/// Threads per caller that run `copy_file_range`. A caller's chunks go to
/// threads that became that caller (so the kernel applies its quotas, its
/// share of the filesystem and its lack of `CAP_FSETID`), never to a thread
/// with the broker's credentials. One more thread is started whenever all of
/// the caller's are busy, up to [`MAX_FILE_WORKERS_PER_CALLER`], so a chunk
/// stuck on a hung filesystem holds one thread of its own caller; a thread
/// idle for [`IDLE`] ends.
pub(crate) struct FileWorkers {
    pools: HashMap<Option<Caller>, Pool>,
    done_tx: mpsc::Sender<(u64, Copied)>,
    done_rx: mpsc::Receiver<(u64, Copied)>,
    wake: Arc<OwnedFd>,
}

/// What became of a chunk: `copy_file_range`'s result, or `None` when no
/// worker ran it (the last one ended as it arrived): the engine sends it again.
pub(crate) type Copied = Option<Result<usize, Errno>>;

struct Pool {
    tx: mpsc::Sender<FileChunk>,
    rx: Arc<Mutex<mpsc::Receiver<FileChunk>>>,
    idle: Arc<AtomicUsize>,
    threads: Arc<AtomicUsize>,
}

const MAX_FILE_WORKERS_PER_CALLER: usize = 4;
const IDLE: Duration = Duration::from_secs(10);

impl FileWorkers {
    pub(crate) fn new(wake: Arc<OwnedFd>) -> FileWorkers {
        let (done_tx, done_rx) = mpsc::channel();
        FileWorkers {
            pools: HashMap::new(),
            done_tx,
            done_rx,
            wake,
        }
    }

    /// Hands `chunk` to a worker of `caller` (`None`: the broker's own
    /// credentials, for a caller it need not act as).
    pub(crate) fn submit(&mut self, caller: Option<&Caller>, chunk: FileChunk) {
        // Pools whose threads all ended are dropped (their callers left).
        self.pools
            .retain(|_, p| p.threads.load(Ordering::Acquire) > 0);
        let pool = self.pools.entry(caller.cloned()).or_insert_with(|| {
            let (tx, rx) = mpsc::channel();
            Pool {
                tx,
                rx: Arc::new(Mutex::new(rx)),
                idle: Arc::new(AtomicUsize::new(0)),
                threads: Arc::new(AtomicUsize::new(0)),
            }
        });
        let threads = pool.threads.load(Ordering::Acquire);
        let mut spawn_failed = false;
        if pool.idle.load(Ordering::Acquire) == 0 && threads < MAX_FILE_WORKERS_PER_CALLER {
            pool.threads.fetch_add(1, Ordering::AcqRel);
            let worker = Worker {
                caller: caller.cloned(),
                rx: pool.rx.clone(),
                idle: pool.idle.clone(),
                threads: pool.threads.clone(),
                done: self.done_tx.clone(),
                wake: self.wake.clone(),
            };
            let spawned = std::thread::Builder::new()
                .name("fido-pipe-file".into())
                .spawn(move || worker.run());
            if spawned.is_err() {
                pool.threads.fetch_sub(1, Ordering::AcqRel);
                spawn_failed = true;
            }
        }
        let job = chunk.job;
        let answer = |done: &mpsc::Sender<(u64, Copied)>, job, copied| {
            let _ = done.send((job, copied));
            ring_bell(&self.wake);
        };
        if pool.threads.load(Ordering::Acquire) == 0 {
            // No thread of this caller: a failed start is an error, a last
            // thread that ended meanwhile means "send it again".
            let copied = spawn_failed.then_some(Err(Errno::AGAIN));
            return answer(&self.done_tx, job, copied);
        }
        if pool.tx.send(chunk).is_err() {
            return answer(&self.done_tx, job, None);
        }
        // A last thread that ended after the check above may have missed the
        // chunk (it looks for late ones after it stopped counting itself).
        if pool.threads.load(Ordering::Acquire) == 0 {
            if let Ok(rx) = pool.rx.lock() {
                for c in rx.try_iter() {
                    answer(&self.done_tx, c.job, None);
                }
            }
        }
    }

    pub(crate) fn results(&self) -> Vec<(u64, Copied)> {
        self.done_rx.try_iter().collect()
    }
}

struct Worker {
    caller: Option<Caller>,
    rx: Arc<Mutex<mpsc::Receiver<FileChunk>>>,
    idle: Arc<AtomicUsize>,
    threads: Arc<AtomicUsize>,
    done: mpsc::Sender<(u64, Copied)>,
    wake: Arc<OwnedFd>,
}

impl Worker {
    fn run(self) {
        let became = match &self.caller {
            Some(c) => c.become_on_this_thread(),
            None => Ok(()),
        };
        if let Err(e) = &became {
            tracing::error!(caller = ?self.caller, error = %e, "a file worker could not take its caller's credentials; its chunks fail");
        }
        loop {
            self.idle.fetch_add(1, Ordering::AcqRel);
            let next = self.rx.lock().map(|r| r.recv_timeout(IDLE));
            self.idle.fetch_sub(1, Ordering::AcqRel);
            let c = match next {
                Ok(Ok(c)) => c,
                // Idle too long, or the engine is gone. A chunk queued
                // between the timeout and this exit is taken by the next
                // worker the engine starts for this caller.
                _ => break,
            };
            let r = match became {
                Err(e) => Err(e),
                Ok(()) => copy(&c),
            };
            drop(c.src);
            drop(c.dst);
            if self.done.send((c.job, Some(r))).is_err() {
                break;
            }
            ring_bell(&self.wake);
        }
        self.threads.fetch_sub(1, Ordering::AcqRel);
        // A chunk may have arrived after the timeout: if this was the last
        // thread, hand it back to be sent again rather than leave it unanswered.
        if self.threads.load(Ordering::Acquire) == 0 {
            if let Ok(rx) = self.rx.lock() {
                for c in rx.try_iter() {
                    let _ = self.done.send((c.job, None));
                    ring_bell(&self.wake);
                }
            }
        }
    }
}

fn copy(c: &FileChunk) -> Result<usize, Errno> {
    let (mut i, mut o) = (c.in_off, c.out_off);
    loop {
        match rustix::fs::copy_file_range(&*c.src, Some(&mut i), &*c.dst, Some(&mut o), c.len) {
            Err(Errno::INTR) => continue,
            r => return r,
        }
    }
}
