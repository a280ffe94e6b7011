//! An export held in this process's memory: for tests of the NBD server
//! without a storage domain, and a reference for what a backend must do.
//! It knows its holes (pages never written, or trimmed), so READ replies carry
//! OFFSET_HOLE chunks and BLOCK_STATUS reports them; it can complete requests
//! out of order and inject errors, so the server's bookkeeping is exercised.

use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use crate::export::{Completer, Completion, Export, ExportInfo, Op, ReadData, Request, Run, Submitter};
use crate::proto::{STATE_HOLE, STATE_ZERO};

/// Allocation granule: a page is a hole until something non-trimmed lands in it.
const PAGE: usize = 64 << 10;

struct Store {
    pages: Vec<Option<Box<[u8]>>>,
    size: u64,
}

impl Store {
    fn read(&self, offset: u64, len: usize) -> MemData {
        let mut runs: Vec<MemRun> = Vec::new();
        let mut pos = offset as usize;
        let end = pos + len;
        while pos < end {
            let page = pos / PAGE;
            let within = pos % PAGE;
            let n = (PAGE - within).min(end - pos);
            match &self.pages[page] {
                Some(p) => match runs.last_mut() {
                    Some(MemRun::Data(v)) => v.extend_from_slice(&p[within..within + n]),
                    _ => runs.push(MemRun::Data(p[within..within + n].to_vec())),
                },
                None => match runs.last_mut() {
                    Some(MemRun::Zeroes(z)) => *z += n,
                    _ => runs.push(MemRun::Zeroes(n)),
                },
            }
            pos += n;
        }
        MemData(runs)
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let mut pos = offset as usize;
        let mut src = data;
        while !src.is_empty() {
            let page = pos / PAGE;
            let within = pos % PAGE;
            let n = (PAGE - within).min(src.len());
            let p = self.pages[page].get_or_insert_with(|| vec![0u8; PAGE].into_boxed_slice());
            p[within..within + n].copy_from_slice(&src[..n]);
            pos += n;
            src = &src[n..];
        }
    }

    /// Zeroes the range; whole pages become holes when `unmap`.
    fn zero(&mut self, offset: u64, len: usize, unmap: bool) {
        let mut pos = offset as usize;
        let end = pos + len;
        while pos < end {
            let page = pos / PAGE;
            let within = pos % PAGE;
            let n = (PAGE - within).min(end - pos);
            if unmap && n == PAGE {
                self.pages[page] = None;
            } else if let Some(p) = &mut self.pages[page] {
                p[within..within + n].fill(0);
            } else if !unmap {
                self.pages[page] = Some(vec![0u8; PAGE].into_boxed_slice());
            }
            pos += n;
        }
    }

    fn extents(&self, offset: u64, len: u32) -> Vec<(u32, u32)> {
        let mut out: Vec<(u32, u32)> = Vec::new();
        let mut pos = offset;
        let end = (offset + len as u64).min(self.size);
        while pos < end {
            let page = (pos / PAGE as u64) as usize;
            let n = (PAGE as u64 - pos % PAGE as u64).min(end - pos) as u32;
            let flags = if self.pages[page].is_some() { 0 } else { STATE_HOLE | STATE_ZERO };
            match out.last_mut() {
                Some((l, f)) if *f == flags => *l += n,
                _ => out.push((n, flags)),
            }
            pos += n as u64;
        }
        out
    }
}

/// Options of a [`MemoryExport`].
#[derive(Clone, Debug)]
pub struct MemoryOptions {
    pub size: u64,
    pub block_size: u32,
    pub max_transfer: u32,
    pub queue_depth: u32,
    pub read_only: bool,
    /// Complete the newest waiting request first (exercises out-of-order replies).
    pub reorder: bool,
}

impl MemoryOptions {
    pub fn new(size: u64) -> Self {
        MemoryOptions { size, block_size: 512, max_transfer: 1 << 20, queue_depth: 64, read_only: false, reorder: true }
    }
}

struct Shared {
    store: Mutex<Store>,
    info: ExportInfo,
    reorder: bool,
    /// Requests touching these ranges fail with the errno.
    faults: Mutex<Vec<(Range<u64>, i32)>>,
    /// The backend "died": submits and completions fail.
    dead: AtomicBool,
}

/// An in-memory export (see the module docs).
#[derive(Clone)]
pub struct MemoryExport {
    shared: Arc<Shared>,
}

impl MemoryExport {
    pub fn new(opts: MemoryOptions) -> io::Result<Self> {
        let info = ExportInfo {
            size: opts.size,
            block_size: opts.block_size,
            max_transfer: opts.max_transfer,
            max_discard: opts.max_transfer,
            queue_depth: opts.queue_depth,
            read_only: opts.read_only,
            flush: true,
            fua: true,
            trim: true,
            write_zeroes: true,
            multi_conn: true,
        };
        info.validate().map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let pages = opts.size.div_ceil(PAGE as u64) as usize;
        Ok(MemoryExport {
            shared: Arc::new(Shared {
                store: Mutex::new(Store { pages: (0..pages).map(|_| None).collect(), size: opts.size }),
                info,
                reorder: opts.reorder,
                faults: Mutex::new(Vec::new()),
                dead: AtomicBool::new(false),
            }),
        })
    }

    /// Requests overlapping `[offset, offset+len)` fail with `errno` from now on.
    pub fn inject_error(&self, offset: u64, len: u64, errno: i32) {
        self.shared.faults.lock().unwrap().push((offset..offset + len, errno));
    }

    /// The backend goes away: every submit fails with EIO and new
    /// connections cannot open, until [`revive`](Self::revive).
    pub fn kill(&self) {
        self.shared.dead.store(true, Ordering::SeqCst);
    }

    /// The backend is back.
    pub fn revive(&self) {
        self.shared.dead.store(false, Ordering::SeqCst);
    }

    /// A copy of the bytes (for checks).
    pub fn read_back(&self, offset: u64, len: usize) -> Vec<u8> {
        let data = self.shared.store.lock().unwrap().read(offset, len);
        let mut v = Vec::with_capacity(len);
        for r in data.0 {
            match r {
                MemRun::Data(d) => v.extend_from_slice(&d),
                MemRun::Zeroes(n) => v.resize(v.len() + n, 0),
            }
        }
        v
    }
}

impl Export for MemoryExport {
    type Submitter = MemSubmitter;
    type Completer = MemCompleter;

    fn open(&self) -> io::Result<(ExportInfo, MemSubmitter, MemCompleter)> {
        if self.shared.dead.load(Ordering::SeqCst) {
            return Err(io::Error::new(io::ErrorKind::NotConnected, "memory export killed"));
        }
        let (tx, rx) = mpsc::channel();
        Ok((
            self.shared.info,
            MemSubmitter { shared: self.shared.clone(), done: tx },
            MemCompleter { shared: self.shared.clone(), done: rx, ready: Vec::new() },
        ))
    }
}

pub struct MemSubmitter {
    shared: Arc<Shared>,
    done: mpsc::Sender<Completion<MemData>>,
}

fn dead() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "memory export killed")
}

impl Submitter for MemSubmitter {
    type WriteBuf = Vec<u8>;

    fn write_buf(&mut self, len: usize) -> io::Result<Vec<u8>> {
        Ok(vec![0u8; len])
    }

    fn submit(&mut self, req: Request<Vec<u8>>) -> Result<(), i32> {
        if self.shared.dead.load(Ordering::SeqCst) {
            return Err(libc::EIO);
        }
        let range = req.offset..req.offset + req.len as u64;
        let fault = self
            .shared
            .faults
            .lock()
            .unwrap()
            .iter()
            .find(|(r, _)| r.start < range.end && range.start < r.end && !matches!(req.op, Op::Flush))
            .map(|(_, e)| *e);
        let result = match fault {
            Some(errno) => Err(errno),
            None => {
                let mut store = self.shared.store.lock().unwrap();
                match req.op {
                    Op::Read => Ok(Some(store.read(req.offset, req.len as usize))),
                    Op::Write(buf) => {
                        assert_eq!(buf.len(), req.len as usize, "server sent a payload of the wrong length");
                        store.write(req.offset, &buf);
                        Ok(None)
                    }
                    Op::Flush => Ok(None),
                    Op::Trim => {
                        store.zero(req.offset, req.len as usize, true);
                        Ok(None)
                    }
                    Op::WriteZeroes { may_unmap } => {
                        store.zero(req.offset, req.len as usize, may_unmap);
                        Ok(None)
                    }
                }
            }
        };
        self.done.send(Completion { tag: req.tag, result }).map_err(|_| libc::EIO)
    }

    fn extents(&mut self, offset: u64, len: u32) -> io::Result<Vec<(u32, u32)>> {
        Ok(self.shared.store.lock().unwrap().extents(offset, len))
    }
}

pub struct MemCompleter {
    shared: Arc<Shared>,
    done: mpsc::Receiver<Completion<MemData>>,
    ready: Vec<Completion<MemData>>,
}

impl Completer for MemCompleter {
    type Data = MemData;

    fn complete(&mut self) -> io::Result<Completion<MemData>> {
        if self.ready.is_empty() {
            self.ready.push(self.done.recv().map_err(|_| dead())?);
        }
        if self.shared.reorder {
            // Everything already finished joins the queue; the newest goes first.
            while let Ok(c) = self.done.try_recv() {
                self.ready.push(c);
            }
            Ok(self.ready.pop().expect("one is ready"))
        } else {
            Ok(self.ready.remove(0))
        }
    }

    fn try_complete(&mut self) -> io::Result<Option<Completion<MemData>>> {
        if self.ready.is_empty() {
            match self.done.try_recv() {
                Ok(c) => self.ready.push(c),
                Err(_) => return Ok(None),
            }
        }
        self.complete().map(Some)
    }
}

enum MemRun {
    Data(Vec<u8>),
    Zeroes(usize),
}

/// A READ's result: data runs copied out of the store, and holes.
pub struct MemData(Vec<MemRun>);

// SAFETY: the pointers are those of the Vecs `self` owns; they stay valid and
// unmoved until `self` is dropped.
unsafe impl ReadData for MemData {
    fn runs(&self, out: &mut Vec<Run>) {
        for r in &self.0 {
            out.push(match r {
                MemRun::Data(v) => Run::Data { ptr: v.as_ptr(), len: v.len() },
                MemRun::Zeroes(n) => Run::Zeroes { len: *n },
            });
        }
    }
}
