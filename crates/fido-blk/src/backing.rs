//! The file backend: a regular file, a block device or a RAM disk (a memfd
//! the storage domain owns), driven through io_uring.
//!
//! Each connection gets its own ring and one completion thread, so many
//! requests are in flight at once and complete in any order. WRITE hands the
//! client's payload segments to the kernel as an iovec (`pwritev2`), no copy
//! through our code; READ lands in a buffer of the storage domain's arena,
//! which becomes the reply. FLUSH is `fdatasync`, FUA is `RWF_DSYNC`,
//! DISCARD punches a hole, WRITE_ZEROES is `FALLOC_FL_ZERO_RANGE` with
//! fallbacks (punch a hole, then allocate again for NO_UNMAP; or write zeros).
//!
//! With `direct` (O_DIRECT) the kernel needs buffers aligned to the logical
//! block: READ buffers are (the arena allocator aligns block-multiple sizes to
//! the block), and a WRITE whose payload segments are not block aligned in
//! address and length is refused with EINVAL — clients that allocate their
//! payload in block multiples (as `BlkClient` does) always are. Nothing is
//! copied to align it.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;

use fido::{Buf, Domain};
use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;

use crate::proto::{self, Info, Op};
use crate::server::{BackendQueue, BlockBackend, Request};

/// The largest READ or WRITE by default.
pub const DEFAULT_MAX_TRANSFER: u32 = 4 << 20;
/// Reads and writes of shmem backings up to this size are done on the
/// connection's thread with plain system calls (see `UringQueue::submit`).
const INLINE_MAX: u32 = 64 << 10;
/// Ring entries per connection by default (also INFO's queue_depth).
pub const DEFAULT_QUEUE_DEPTH: u32 = 128;

/// How a file backend is opened.
#[derive(Clone, Debug)]
pub struct BackingOptions {
    /// O_DIRECT (see the module comment for what it requires of clients).
    pub direct: bool,
    /// Refuse every modifying request with EROFS (and open read-only).
    pub read_only: bool,
    /// 512 or 4096.
    pub logical_block: u32,
    pub max_transfer: u32,
    pub queue_depth: u32,
}

impl Default for BackingOptions {
    fn default() -> Self {
        BackingOptions { direct: false, read_only: false, logical_block: 512, max_transfer: DEFAULT_MAX_TRANSFER, queue_depth: DEFAULT_QUEUE_DEPTH }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    File,
    BlockDevice,
    Ram,
}

/// A file, block device or RAM disk served through io_uring.
pub struct FileBackend {
    file: Arc<File>,
    info: Info,
    direct: bool,
    kind: Kind,
    /// Small reads and writes are done with plain system calls (shmem:
    /// a RAM disk, or a file on tmpfs; see `UringQueue::submit`).
    inline_small: bool,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

impl FileBackend {
    /// Opens `path`, a regular file (its current size, rounded down to the
    /// block) or a block device (its size).
    pub fn open(path: &Path, opts: &BackingOptions) -> io::Result<FileBackend> {
        check_opts(opts)?;
        let mut o = std::fs::OpenOptions::new();
        o.read(true).write(!opts.read_only);
        if opts.direct {
            o.custom_flags(libc::O_DIRECT);
        }
        let file = o.open(path).map_err(|e| io::Error::new(e.kind(), format!("opening {}: {e}", path.display())))?;
        let meta = file.metadata()?;
        let (kind, size) = if meta.file_type().is_block_device() {
            (Kind::BlockDevice, block_device_size(&file)?)
        } else if meta.is_file() {
            (Kind::File, meta.len())
        } else {
            return Err(invalid(format!("{} is neither a regular file nor a block device", path.display())));
        };
        Self::with_file(file, size, kind, opts)
    }

    /// A RAM disk of `size` bytes: a memfd owned by this process, gone with it.
    pub fn ram(size: u64, opts: &BackingOptions) -> io::Result<FileBackend> {
        check_opts(opts)?;
        if opts.direct {
            return Err(invalid("--direct does not apply to a RAM disk".into()));
        }
        // SAFETY: a NUL-terminated name and valid flags; the result is checked.
        let fd = unsafe { libc::memfd_create(c"fido-blk-ram".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and is owned by nothing else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size)?;
        Self::with_file(file, size, Kind::Ram, opts)
    }

    fn with_file(file: File, size: u64, kind: Kind, opts: &BackingOptions) -> io::Result<FileBackend> {
        let block = u64::from(opts.logical_block);
        let size = size / block * block;
        if size == 0 {
            return Err(invalid(format!("the backing holds less than one {block}-byte block")));
        }
        let mut flags = proto::INFO_FLUSH | proto::INFO_FUA | proto::INFO_DISCARD | proto::INFO_WRITE_ZEROES | proto::INFO_CAN_MULTI_CONN;
        if opts.read_only {
            flags |= proto::INFO_READ_ONLY;
        }
        let info = Info { size, logical_block: opts.logical_block, max_transfer: opts.max_transfer, flags, queue_depth: opts.queue_depth };
        let inline_small = kind == Kind::Ram || on_tmpfs(&file);
        Ok(FileBackend { file: Arc::new(file), info, direct: opts.direct, kind, inline_small })
    }
}

/// Whether `file` lives on tmpfs (shmem, like a RAM disk's memfd).
#[allow(clippy::unnecessary_cast)] // `f_type`'s type depends on the target
fn on_tmpfs(file: &File) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: fstatfs fills the struct through a valid pointer to ours.
    let r = unsafe { libc::fstatfs(file.as_raw_fd(), st.as_mut_ptr()) };
    // SAFETY: initialised by the successful call (zeroed before anyway).
    r == 0 && unsafe { st.assume_init() }.f_type as i64 == TMPFS_MAGIC
}

fn check_opts(opts: &BackingOptions) -> io::Result<()> {
    if opts.logical_block != 512 && opts.logical_block != 4096 {
        return Err(invalid(format!("block size {} is neither 512 nor 4096", opts.logical_block)));
    }
    if opts.max_transfer == 0 || opts.max_transfer % opts.logical_block != 0 || opts.max_transfer > 64 << 20 {
        return Err(invalid(format!("max transfer {} is not a multiple of the block up to 64 MiB", opts.max_transfer)));
    }
    if !(1..=4096).contains(&opts.queue_depth) {
        return Err(invalid(format!("queue depth {} is not in 1..=4096", opts.queue_depth)));
    }
    Ok(())
}

fn block_device_size(file: &File) -> io::Result<u64> {
    // BLKGETSIZE64 = _IOR(0x12, 114, size_t)
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    let mut size: u64 = 0;
    // SAFETY: the ioctl writes one u64 through a valid pointer to ours.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

impl BlockBackend for FileBackend {
    fn info(&self) -> Info {
        self.info
    }

    fn open_queue(&self, domain: &Domain) -> io::Result<Box<dyn BackendQueue>> {
        let ring = IoUring::new(self.info.queue_depth.next_power_of_two())?;
        let shared = Arc::new(Ring {
            ring,
            sq: Mutex::new(()),
            cq: Mutex::new(()),
            ops: Mutex::new(Ops { next: 1, live: HashMap::new() }),
            file: self.file.clone(),
            direct: self.direct,
            block: self.info.logical_block,
            kind: self.kind,
            inline_small: self.inline_small,
        });
        let s = shared.clone();
        let reaper = std::thread::Builder::new().name("blk-uring".into()).spawn(move || reap(s))?;
        Ok(Box::new(UringQueue { ring: shared, reaper: Some(reaper), _domain: domain.clone() }))
    }
}

/// user_data of the Nop that tells the completion thread to finish.
const STOP: u64 = u64::MAX;

/// One request in the kernel's hands.
struct InFlight {
    req: Request,
    /// READ: the reply buffer the kernel fills.
    buf: Option<Buf>,
    /// WRITE: what is left to write (advanced on short writes); READ: unused.
    iov: Vec<libc::iovec>,
    /// Bytes done so far (short reads and writes are continued).
    done: u64,
    /// FLUSH: the fdatasync; also marks a DISCARD/WRITE_ZEROES whose range
    /// is done and whose FUA sync is pending.
    syncing: bool,
}

// SAFETY: the iovecs point into the request's `Msg` (read-only peer memory
// that stays mapped while the Msg lives, and the Msg lives in this struct) or
// nowhere; nothing here is tied to the thread that built it.
unsafe impl Send for InFlight {}

struct Ops {
    next: u64,
    live: HashMap<u64, InFlight>,
}

struct Ring {
    ring: IoUring,
    /// Held while pushing to the submission queue (both threads push).
    sq: Mutex<()>,
    /// Held while reading the completion queue (both threads complete).
    cq: Mutex<()>,
    ops: Mutex<Ops>,
    file: Arc<File>,
    direct: bool,
    block: u32,
    kind: Kind,
    inline_small: bool,
}

impl Ring {
    fn fd(&self) -> types::Fd {
        types::Fd(self.file.as_raw_fd())
    }

    /// Pushes one entry and submits it (a full queue is submitted first).
    fn push(&self, entry: io_uring::squeue::Entry) {
        self.queue(entry);
        self.submit();
    }

    /// Pushes one entry without submitting it (unless the queue is full).
    fn queue(&self, entry: io_uring::squeue::Entry) {
        let _g = self.sq.lock();
        loop {
            // SAFETY: only one thread touches the submission queue at a time
            // (the `sq` lock); the entry's buffers live in `ops` until its
            // completion is reaped.
            let pushed = unsafe { self.ring.submission_shared().push(&entry).is_ok() };
            if pushed {
                break;
            }
            if let Err(e) = self.ring.submitter().submit() {
                tracing::warn!(error = %e, "io_uring submit");
                std::thread::yield_now();
            }
        }
    }

    /// Submits what was queued.
    fn submit(&self) {
        let _g = self.sq.lock();
        while let Err(e) = self.ring.submitter().submit() {
            if e.raw_os_error() != Some(libc::EINTR) && e.raw_os_error() != Some(libc::EAGAIN) && e.raw_os_error() != Some(libc::EBUSY) {
                tracing::warn!(error = %e, "io_uring submit");
                break;
            }
            std::thread::yield_now();
        }
    }

    /// The entry that does (the rest of) `op`'s work.
    fn entry(&self, key: u64, op: &mut InFlight) -> io_uring::squeue::Entry {
        let c = op.req.checked;
        let fd = self.fd();
        let e = if op.syncing {
            opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build()
        } else {
            match c.op {
                Op::Read => {
                    let buf = op.buf.as_mut().expect("a READ has its buffer");
                    let ptr = buf[op.done as usize..].as_mut_ptr();
                    opcode::Read::new(fd, ptr, c.len - op.done as u32).offset(c.offset + op.done).build()
                }
                Op::Write => {
                    let flags = if c.fua { libc::RWF_DSYNC } else { 0 };
                    opcode::Writev::new(fd, op.iov.as_ptr(), op.iov.len() as u32).offset(c.offset + op.done).rw_flags(flags).build()
                }
                Op::Flush => unreachable!("a FLUSH is always syncing"),
                Op::Discard => opcode::Fallocate::new(fd, u64::from(c.len))
                    .offset(c.offset)
                    .mode(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE)
                    .build(),
                Op::WriteZeroes => {
                    let mode = if c.no_unmap || self.kind == Kind::BlockDevice {
                        libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
                    } else {
                        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
                    };
                    opcode::Fallocate::new(fd, u64::from(c.len)).offset(c.offset).mode(mode).build()
                }
            }
        };
        e.user_data(key)
    }

    /// Queues `op` (submitted at the next `submit`).
    fn start(&self, mut op: InFlight) {
        let e = {
            let mut ops = self.ops.lock();
            let key = ops.next;
            ops.next += 1;
            let e = self.entry(key, &mut op);
            ops.live.insert(key, op);
            e
        };
        self.queue(e);
    }

    /// Completes every request whose completion is in the queue; returns
    /// whether STOP was among them. `wait`: the completion thread, which
    /// takes its turn; the connection's thread only looks in passing.
    fn reap_ready(&self, wait: bool) -> bool {
        let guard = if wait { Some(self.cq.lock()) } else { self.cq.try_lock() };
        let Some(_g) = guard else { return false };
        // SAFETY: only the holder of the `cq` lock reads the completion queue.
        let done: Vec<(u64, i32)> = unsafe { self.ring.completion_shared() }.map(|c| (c.user_data(), c.result())).collect();
        let mut stop = false;
        for (key, res) in done {
            if key == STOP {
                stop = true;
                continue;
            }
            let Some(op) = self.ops.lock().live.remove(&key) else { continue };
            complete(self, key, op, res);
        }
        stop
    }

    /// Resubmits `op` (a continuation) under its key.
    fn again(&self, key: u64, mut op: InFlight) {
        let e = {
            let mut ops = self.ops.lock();
            let e = self.entry(key, &mut op);
            ops.live.insert(key, op);
            e
        };
        self.push(e);
    }
}

struct UringQueue {
    ring: Arc<Ring>,
    reaper: Option<JoinHandle<()>>,
    _domain: Domain,
}

fn aligned(addr: usize, len: usize, block: u32) -> bool {
    addr % block as usize == 0 && len % block as usize == 0
}

impl BackendQueue for UringQueue {
    fn submit(&mut self, req: Request) {
        let c = req.checked;
        let mut op = InFlight { req, buf: None, iov: Vec::new(), done: 0, syncing: false };
        match c.op {
            Op::Read => match op.req.reply.alloc(c.len as usize) {
                Ok(buf) => {
                    if self.ring.direct && !aligned(buf.as_ptr() as usize, c.len as usize, self.ring.block) {
                        // The allocator aligns block multiples; refuse rather than corrupt.
                        return op.req.reply.error(proto::EIO);
                    }
                    op.buf = Some(buf);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "fido-blk: no arena memory for a READ");
                    return op.req.reply.error(proto::ENOMEM);
                }
            },
            Op::Write => {
                let iov: Vec<libc::iovec> = op.req.payload().map(|s| libc::iovec { iov_base: s.as_ptr() as *mut libc::c_void, iov_len: s.len() }).collect();
                if self.ring.direct && !iov.iter().all(|v| aligned(v.iov_base as usize, v.iov_len, self.ring.block)) {
                    return op.req.reply.error(proto::EINVAL);
                }
                op.iov = iov;
            }
            Op::Flush => op.syncing = true,
            Op::Discard | Op::WriteZeroes => {}
        }
        if self.ring.inline_small && matches!(c.op, Op::Read | Op::Write) && c.len <= INLINE_MAX {
            // A small read or write of shmem (a RAM disk, a file on tmpfs)
            // is a short copy by the kernel that never blocks: done here it
            // costs one system call, where io_uring hands it to a kernel
            // worker (shmem punts) and wakes threads for the completion.
            // Measured here (blk_load, 4k random reads QD32, interleaved
            // runs): similar or more IOPS with about half the storage
            // domain's CPU. Large ones stay on io_uring, whose workers copy
            // several at once.
            return match rw_now(&self.ring.file, &mut op) {
                Ok(()) => finish(op),
                Err(errno) => op.req.reply.error(errno_status(errno)),
            };
        }
        self.ring.start(op);
    }

    fn flush(&mut self) {
        self.ring.submit();
        // Reads of cached data often complete during the submission itself:
        // reply from here, without waking the completion thread's turn.
        self.ring.reap_ready(false);
    }
}

impl Drop for UringQueue {
    fn drop(&mut self) {
        self.ring.push(opcode::Nop::new().build().user_data(STOP));
        if let Some(t) = self.reaper.take() {
            let _ = t.join();
        }
    }
}

/// The completion thread: finishes (or continues) each request as the kernel
/// completes it; ends after STOP once nothing is in flight.
fn reap(ring: Arc<Ring>) {
    let mut stopping = false;
    loop {
        if stopping && ring.ops.lock().live.is_empty() {
            return;
        }
        // SAFETY: a plain io_uring_enter waiting for one completion; no
        // submission count, no argument.
        let r = unsafe { ring.ring.submitter().enter::<libc::sigset_t>(0, 1, 1 /* IORING_ENTER_GETEVENTS */, None) };
        if let Err(e) = r {
            if e.raw_os_error() != Some(libc::EINTR) {
                tracing::warn!(error = %e, "io_uring wait");
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
        stopping |= ring.reap_ready(true);
    }
}

fn complete(ring: &Ring, key: u64, mut op: InFlight, res: i32) {
    let c = op.req.checked;
    if res < 0 {
        let errno = -res;
        if !op.syncing && matches!(c.op, Op::Discard | Op::WriteZeroes) && (errno == libc::EOPNOTSUPP || errno == libc::EINVAL) {
            // The backing cannot do it with one fallocate: do it by hand.
            return match zero_fallback(ring, &c) {
                Ok(()) => finish_range(ring, key, op),
                Err(e) => op.req.reply.error(errno_status(e.raw_os_error().unwrap_or(libc::EIO))),
            };
        }
        return op.req.reply.error(errno_status(errno));
    }
    if op.syncing {
        return finish(op);
    }
    match c.op {
        Op::Read | Op::Write => {
            let n = res as u64;
            if n == 0 {
                // End of file before the end of the device (the file shrank).
                return op.req.reply.error(proto::EIO);
            }
            op.done += n;
            if op.done < u64::from(c.len) {
                if c.op == Op::Write {
                    advance(&mut op.iov, n as usize);
                }
                return ring.again(key, op);
            }
            finish(op)
        }
        Op::Discard | Op::WriteZeroes => finish_range(ring, key, op),
        Op::Flush => finish(op),
    }
}

/// Does a READ or WRITE with plain system calls (continuing short ones).
fn rw_now(file: &File, op: &mut InFlight) -> Result<(), i32> {
    let c = op.req.checked;
    let fd = file.as_raw_fd();
    while op.done < u64::from(c.len) {
        let at = (c.offset + op.done) as libc::off_t;
        let n = if c.op == Op::Read {
            let buf = op.buf.as_mut().expect("a READ has its buffer");
            let dst = &mut buf[op.done as usize..];
            // SAFETY: `dst` is our own buffer, writable for its length.
            unsafe { libc::pread(fd, dst.as_mut_ptr() as *mut libc::c_void, dst.len(), at) }
        } else {
            // SAFETY: the iovecs point into the request's payload segments,
            // mapped read-only for as long as `op.req.msg` lives (all of this
            // call); the kernel only reads them.
            unsafe { libc::pwritev(fd, op.iov.as_ptr(), op.iov.len() as libc::c_int, at) }
        };
        match n {
            n if n > 0 => {
                op.done += n as u64;
                if c.op == Op::Write {
                    advance(&mut op.iov, n as usize);
                }
            }
            0 => return Err(libc::EIO),
            _ => {
                let e = io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
                if e != libc::EINTR {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// A DISCARD or WRITE_ZEROES whose range is done: FUA syncs first.
fn finish_range(ring: &Ring, key: u64, mut op: InFlight) {
    if op.req.checked.fua && ring.kind != Kind::Ram {
        op.syncing = true;
        return ring.again(key, op);
    }
    finish(op)
}

fn finish(op: InFlight) {
    let InFlight { req, buf, .. } = op;
    let Request { checked, msg, reply } = req;
    // The write is on its way to (or in) the backing: release the client's buffers.
    drop(msg);
    match (checked.op, buf) {
        (Op::Read, Some(buf)) => reply.data(buf),
        _ => reply.ok(),
    }
}

fn errno_status(errno: i32) -> u16 {
    u16::try_from(errno).ok().filter(|&e| e != 0).unwrap_or(proto::EIO)
}

/// Drops the first `n` bytes of an iovec list (after a short write).
fn advance(iov: &mut Vec<libc::iovec>, mut n: usize) {
    let mut skip = 0;
    for v in iov.iter_mut() {
        if n >= v.iov_len {
            n -= v.iov_len;
            skip += 1;
        } else {
            // SAFETY: `n < iov_len`, so the new base is inside the same segment.
            v.iov_base = unsafe { (v.iov_base as *mut u8).add(n) } as *mut libc::c_void;
            v.iov_len -= n;
            break;
        }
    }
    iov.drain(..skip);
}

fn fallocate(fd: RawFd, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: a plain system call on our descriptor.
    let r = unsafe { libc::fallocate(fd, mode, offset as libc::off_t, len as libc::off_t) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// DISCARD / WRITE_ZEROES on a backing whose fallocate refused the first
/// mode (tmpfs has no ZERO_RANGE; some file systems no hole punching):
/// punch a hole (and allocate the range again for NO_UNMAP), else write zeros
/// from a zeroed buffer of our own. A DISCARD that cannot free space is done
/// by writing zeros too, so a discarded range always reads back as zeros.
fn zero_fallback(ring: &Ring, c: &proto::Checked) -> io::Result<()> {
    let fd = ring.file.as_raw_fd();
    let (off, len) = (c.offset, u64::from(c.len));
    let punched = ring.kind != Kind::BlockDevice && fallocate(fd, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, off, len).is_ok();
    if punched {
        if c.op == Op::WriteZeroes && c.no_unmap {
            fallocate(fd, libc::FALLOC_FL_KEEP_SIZE, off, len)?;
        }
        return Ok(());
    }
    write_zeros(ring, off, len)
}

fn write_zeros(ring: &Ring, mut off: u64, len: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    const CHUNK: usize = 1 << 20;
    // Aligned for O_DIRECT: a Vec of 4096-byte blocks.
    #[repr(C, align(4096))]
    #[derive(Clone, Copy)]
    struct Block([u8; 4096]);
    let zeros = vec![Block([0; 4096]); CHUNK / 4096];
    // SAFETY: `Block` is plain bytes; the Vec holds CHUNK of them contiguously.
    let zeros: &[u8] = unsafe { std::slice::from_raw_parts(zeros.as_ptr() as *const u8, CHUNK) };
    let end = off + len;
    while off < end {
        let n = ((end - off) as usize).min(CHUNK);
        ring.file.write_all_at(&zeros[..n], off)?;
        off += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iov(base: usize, len: usize) -> libc::iovec {
        libc::iovec { iov_base: base as *mut libc::c_void, iov_len: len }
    }

    #[test]
    fn advance_after_a_short_write() {
        let mut v = vec![iov(1000, 100), iov(5000, 50), iov(9000, 10)];
        advance(&mut v, 30);
        assert_eq!(v.iter().map(|x| (x.iov_base as usize, x.iov_len)).collect::<Vec<_>>(), [(1030, 70), (5000, 50), (9000, 10)]);
        advance(&mut v, 70);
        assert_eq!(v.iter().map(|x| (x.iov_base as usize, x.iov_len)).collect::<Vec<_>>(), [(5000, 50), (9000, 10)]);
        advance(&mut v, 55);
        assert_eq!(v.iter().map(|x| (x.iov_base as usize, x.iov_len)).collect::<Vec<_>>(), [(9005, 5)]);
        advance(&mut v, 5);
        assert!(v.is_empty());
    }

    #[test]
    fn options_are_checked() {
        let bad = |f: &dyn Fn(&mut BackingOptions)| {
            let mut o = BackingOptions::default();
            f(&mut o);
            FileBackend::ram(1 << 20, &o).is_err()
        };
        assert!(bad(&|o| o.logical_block = 1024));
        assert!(bad(&|o| o.max_transfer = 1000));
        assert!(bad(&|o| o.max_transfer = 128 << 20));
        assert!(bad(&|o| o.queue_depth = 0));
        assert!(bad(&|o| o.direct = true));
        assert!(FileBackend::ram(100, &BackingOptions::default()).is_err(), "less than one block");
        let r = FileBackend::ram((1 << 20) + 100, &BackingOptions::default()).unwrap();
        assert_eq!(r.info().size, 1 << 20, "rounded down to the block");
        assert!(r.inline_small);
    }
}
