//! File workers: `copy_file_range` (which io_uring cannot issue), off the engine thread.

use std::os::fd::OwnedFd;
use std::sync::{mpsc, Arc};

use rustix::io::Errno;

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

/// Threads that run `copy_file_range` (which io_uring cannot issue). One more
/// is started whenever every existing one is busy, up to [`MAX_FILE_WORKERS`],
/// so a chunk stuck on a hung filesystem holds one thread, not the others.
pub(crate) struct FileWorkers {
    tx: mpsc::Sender<FileChunk>,
    rx: Arc<std::sync::Mutex<mpsc::Receiver<FileChunk>>>,
    done_tx: mpsc::Sender<(u64, Result<usize, Errno>)>,
    done_rx: mpsc::Receiver<(u64, Result<usize, Errno>)>,
    wake: Arc<OwnedFd>,
    idle: Arc<std::sync::atomic::AtomicUsize>,
    threads: usize,
}

const MAX_FILE_WORKERS: usize = 16;

impl FileWorkers {
    pub(crate) fn new(wake: Arc<OwnedFd>) -> FileWorkers {
        let (tx, rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel();
        FileWorkers {
            tx,
            rx: Arc::new(std::sync::Mutex::new(rx)),
            done_tx,
            done_rx,
            wake,
            idle: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            threads: 0,
        }
    }

    pub(crate) fn submit(&mut self, chunk: FileChunk) {
        use std::sync::atomic::Ordering;
        if self.idle.load(Ordering::Acquire) == 0 && self.threads < MAX_FILE_WORKERS {
            let (rx, done, wake, idle) = (
                self.rx.clone(),
                self.done_tx.clone(),
                self.wake.clone(),
                self.idle.clone(),
            );
            let spawned = std::thread::Builder::new()
                .name("fido-pipe-file".into())
                .spawn(move || loop {
                    idle.fetch_add(1, Ordering::AcqRel);
                    let next = rx.lock().map(|r| r.recv());
                    idle.fetch_sub(1, Ordering::AcqRel);
                    let Ok(Ok(c)) = next else { return };
                    let (mut i, mut o) = (c.in_off, c.out_off);
                    let r = loop {
                        match rustix::fs::copy_file_range(
                            &*c.src,
                            Some(&mut i),
                            &*c.dst,
                            Some(&mut o),
                            c.len,
                        ) {
                            Err(Errno::INTR) => continue,
                            r => break r,
                        }
                    };
                    drop(c.src);
                    drop(c.dst);
                    if done.send((c.job, r)).is_err() {
                        return;
                    }
                    ring_bell(&wake);
                });
            if spawned.is_ok() {
                self.threads += 1;
            }
        }
        let _ = self.tx.send(chunk);
    }

    pub(crate) fn results(&self) -> Vec<(u64, Result<usize, Errno>)> {
        self.done_rx.try_iter().collect()
    }
}
