//! The shared segment of one accelerated connection: a header and two byte
//! rings (client→server, server→client) in a memfd both ends map read-write.
//!
//! Both ends write the header (the peer's *memory* is trusted as far as Fido's
//! relaxed model goes), but nothing read from it is believed: every index is
//! checked against the ring size before a byte is copied, and a lying index
//! fails only this connection (`Corrupt`).
//!
//! All positions are monotonically increasing byte counts (`head` written by
//! the writer, `tail` by the reader); `head - tail` is what is buffered.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

pub const MAGIC: u64 = 0x6669_646f_6e65_7431; // "fidonet1"
pub const VERSION: u32 = 2;
/// Where the first ring starts (the header fits in one page).
pub const HDR_LEN: usize = 4096;

/// Client is side 0, server side 1. Ring `d` carries bytes written by side `d`.
pub const PENDING: u32 = 0;
pub const ATTACHED: u32 = 1;
pub const ABANDONED: u32 = 2;

pub const CLIENT: usize = 0;
pub const SERVER: usize = 1;

#[repr(C, align(64))]
pub struct Pad64<T>(pub T);

/// Per-side state, written by that side (and read by the peer).
#[repr(C)]
pub struct Side {
    /// Processes of this side that hold the connection (fork adds one).
    pub holders: AtomicU32,
    /// Set when the last holder of this side closed.
    pub closed: AtomicU32,
    /// This side shut down writing (`shutdown(SHUT_WR)`), seen by every holder.
    pub shut_wr: AtomicU32,
    pub shut_rd: AtomicU32,
    /// Doorbell bytes this side sent into its TCP stream.
    pub doorbells_sent: AtomicU64,
    /// Doorbell bytes this side drained from its TCP stream.
    pub doorbells_drained: AtomicU64,
    /// Generation of this side's latest data arm (1..=127).
    pub data_gen: AtomicU32,
    /// Generation of this side's latest space arm (128..=255).
    pub space_gen: AtomicU32,
    /// Threads of this side blocked waiting for ring space.
    pub space_waiters: AtomicU32,
    pub pid: AtomicU32,
    /// Threads of this side sleeping in the kernel until data arrives (a
    /// blocking receive, or poll/select/epoll through this library).
    pub data_sleepers: AtomicU32,
    /// 1: this side arms whenever it leaves with an empty ring (the original,
    /// eager protocol), because the program may wait in a way this library
    /// does not see; 0: it arms only around its own sleeps (lazy arming,
    /// see `conn`).
    pub eager: AtomicU32,
    /// This side reset the connection on purpose (a corrupt segment, an
    /// image that cannot adopt it): the peer reports `ECONNRESET`. Without
    /// it a reset from a process that died with doorbells unread — which
    /// TCP would have closed with a FIN — reads as the EOF TCP would give.
    pub reset: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<Side>() <= 64);

/// Per-direction ring control.
#[repr(C)]
pub struct RingCtl {
    pub head: Pad64<AtomicU64>,
    pub tail: Pad64<AtomicU64>,
    /// The reader's "wake me when data arrives" generation; the writer swaps
    /// it to 0 and sends that byte.
    pub data_arm: Pad64<AtomicU32>,
    /// The writer's "wake me when space frees" generation; the reader swaps it.
    pub space_arm: Pad64<AtomicU32>,
    /// Serialise readers (threads, forked processes) and writers.
    pub rlock: Pad64<AtomicU32>,
    pub wlock: Pad64<AtomicU32>,
}

#[repr(C)]
pub struct Header {
    pub magic: u64,
    pub version: u32,
    pub ring_len: u32,
    pub nonce: u64,
    /// Who decided the connection's fate: `PENDING`, then `ATTACHED` (the
    /// server mapped the segment at `accept`) or `ABANDONED` (the client gave
    /// up waiting and both ends use plain TCP). One compare-and-swap decides,
    /// so the two ends can never disagree.
    pub state: AtomicU32,
    pub sides: [Pad64<Side>; 2],
    pub rings: [RingCtl; 2],
}

const _: () = assert!(std::mem::size_of::<Header>() <= HDR_LEN);

#[derive(Debug)]
pub struct Corrupt;

/// A mapped segment. Unmapped on drop.
pub struct Segment {
    base: NonNull<u8>,
    len: usize,
    ring_len: usize,
    /// A close-on-exec descriptor of the memfd, kept so the connection can
    /// be handed to a new image across `exec` (see `inherit`); -1 when not
    /// kept (over budget) or when the program closed that descriptor number.
    kept: Arc<AtomicI32>,
    /// The memfd's inode: the kept descriptor is closed only while its
    /// number still names this memfd (a close we did not see may have freed
    /// the number for one of the program's descriptors).
    ino: u64,
}

/// Kept segment descriptors by number, so a program closing (or `dup2`-ing
/// over) one of them — daemons close every descriptor — is noticed.
/// A kept descriptor's slot in its segment, and the memfd's inode.
type KeptEntry = (Arc<AtomicI32>, u64);
static KEPT: Mutex<Option<HashMap<i32, KeptEntry>>> = Mutex::new(None);
static KEPT_COUNT: AtomicUsize = AtomicUsize::new(0);

/// At most this many descriptors are kept (a quarter of the soft
/// `RLIMIT_NOFILE`), so a program with many connections does not run out of
/// descriptors because of us; connections beyond it cannot cross an exec.
fn kept_budget() -> usize {
    static B: AtomicUsize = AtomicUsize::new(0);
    let v = B.load(Ordering::Relaxed);
    if v != 0 {
        return v;
    }
    let mut rl = libc::rlimit {
        rlim_cur: 1024,
        rlim_max: 1024,
    };
    // SAFETY: getrlimit into a local.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) };
    let v = ((rl.rlim_cur.min(1 << 20)) / 4).max(1) as usize;
    B.store(v, Ordering::Relaxed);
    v
}

/// The program is closing (or replacing) descriptor `fd`: if it was a kept
/// segment descriptor, it is no longer ours. Returns whether it was.
pub fn forget_kept(fd: i32) -> bool {
    if KEPT_COUNT.load(Ordering::Relaxed) == 0 {
        return false;
    }
    if let Some((k, _)) = KEPT.lock().as_mut().and_then(|m| m.remove(&fd)) {
        KEPT_COUNT.fetch_sub(1, Ordering::Relaxed);
        k.store(-1, Ordering::SeqCst);
        return true;
    }
    false
}

/// The program ran out of descriptor numbers (`EMFILE`): every kept segment
/// descriptor is closed so that its number is the program's — a program
/// must never fail for lack of descriptors where TCP alone would not. The
/// connections stay accelerated; an exec can hand them on only if their
/// descriptor can be had again (`Segment::keep_from_mapping`), else they
/// are reset then, as before for connections over the budget. Returns
/// whether any was closed (then the program's call is worth retrying).
pub fn give_back_kept() -> bool {
    if KEPT_COUNT.load(Ordering::Relaxed) == 0 {
        return false;
    }
    let taken = KEPT.lock().take();
    let Some(m) = taken else { return false };
    let mut n = 0;
    for (fd, (k, ino)) in m {
        KEPT_COUNT.fetch_sub(1, Ordering::Relaxed);
        if k.swap(-1, Ordering::SeqCst) == fd && crate::addr::fd_inode(fd) == Some(ino) {
            // SAFETY: our own kept descriptor (its number still names the memfd).
            unsafe { crate::real::close(fd) };
            n += 1;
        }
    }
    GAVE_BACK.store(true, Ordering::Relaxed);
    crate::sys::debug!("descriptor pressure: gave back {n} kept segment descriptors");
    n > 0
}

/// Set once the program ran short of descriptors: no more are kept.
static GAVE_BACK: AtomicBool = AtomicBool::new(false);

/// Whether any segment descriptor is kept (one relaxed load).
pub fn remembers_any() -> bool {
    KEPT_COUNT.load(Ordering::Relaxed) != 0
}

/// Descriptors kept for segments.
pub fn kept_fds() -> Vec<i32> {
    if KEPT_COUNT.load(Ordering::Relaxed) == 0 {
        return Vec::new();
    }
    KEPT.lock()
        .as_ref()
        .map(|m| m.keys().copied().collect())
        .unwrap_or_default()
}

// SAFETY: the mapping is shared memory accessed through atomics (header) and
// lock-serialised byte copies (rings); the pointer is valid until drop.
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

pub fn seg_len(ring_len: usize) -> usize {
    HDR_LEN + 2 * ring_len
}

impl Segment {
    /// Maps `fd` (a memfd of `seg_len(ring_len)` bytes) read-write.
    pub fn map(fd: i32, ring_len: usize) -> std::io::Result<Segment> {
        let len = seg_len(ring_len);
        // SAFETY: a fresh shared mapping of a file we hold; the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Segment {
            base: NonNull::new(p as *mut u8).expect("mmap never returns NULL on success"),
            len,
            ring_len,
            kept: Arc::new(AtomicI32::new(-1)),
            ino: crate::addr::fd_inode(fd).unwrap_or(0),
        })
    }

    /// Keeps a close-on-exec duplicate of `fd` (the memfd this segment was
    /// mapped from), high in the descriptor table, within the budget.
    pub fn retain(&self, fd: i32) {
        if KEPT_COUNT.load(Ordering::Relaxed) >= kept_budget()
            || GAVE_BACK.load(Ordering::Relaxed)
            || self.kept.load(Ordering::Relaxed) >= 0
        {
            return;
        }
        // The upper half of the soft limit.
        let floor = (kept_budget() * 2) as libc::c_ulong;
        // SAFETY: duplicating our own descriptor (libc's fcntl, not ours: this
        // is no descriptor of the program's).
        let mut d = unsafe { crate::real::fcntl(fd, libc::F_DUPFD_CLOEXEC, floor) };
        if d < 0 {
            // SAFETY: as above, lowest free number.
            d = unsafe { crate::real::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        }
        if d >= 0 {
            self.adopt(d);
        }
    }

    /// Takes `fd` (ours, close-on-exec) as the kept descriptor.
    pub fn adopt(&self, fd: i32) {
        self.kept.store(fd, Ordering::SeqCst);
        KEPT.lock()
            .get_or_insert_with(HashMap::new)
            .insert(fd, (self.kept.clone(), self.ino));
        KEPT_COUNT.fetch_add(1, Ordering::Relaxed);
    }

    /// Keeps a descriptor of the segment again, opened from our own mapping
    /// (`/proc/self/map_files`, which the kernel opens only for a process
    /// with `CAP_SYS_ADMIN` or `CAP_CHECKPOINT_RESTORE`): for a connection
    /// that had none (its socket was close-on-exec, or descriptors ran
    /// short) when an exec may now hand it on. Returns whether one is kept.
    pub fn keep_from_mapping(&self) -> bool {
        if self.kept.load(Ordering::Relaxed) >= 0 {
            return true;
        }
        let start = self.base.as_ptr() as usize;
        let path = format!("/proc/self/map_files/{:x}-{:x}\0", start, start + self.len);
        // SAFETY: a NUL-terminated path; the result is our own descriptor.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat,
                libc::AT_FDCWD,
                path.as_ptr(),
                libc::O_RDWR | libc::O_CLOEXEC,
                0,
            )
        } as i32;
        if fd < 0 {
            return false;
        }
        if crate::addr::fd_inode(fd) != Some(self.ino) {
            // SAFETY: the descriptor we opened just above.
            unsafe { crate::real::close(fd) };
            return false;
        }
        self.adopt(fd);
        true
    }

    /// Closes the kept descriptor (the connection will never carry data on
    /// the ring: it was abandoned).
    pub fn drop_kept(&self) {
        if self.kept.load(Ordering::Relaxed) < 0 {
            return;
        }
        let fd = self.kept.swap(-1, Ordering::SeqCst);
        if fd >= 0 {
            forget_kept(fd);
            if crate::addr::fd_inode(fd) == Some(self.ino) {
                // SAFETY: our own kept descriptor (its number still names
                // our memfd).
                unsafe { crate::real::close(fd) };
            }
        }
    }

    /// The kept descriptor, or -1.
    pub fn kept_fd(&self) -> i32 {
        self.kept.load(Ordering::SeqCst)
    }

    pub fn hdr(&self) -> &Header {
        // SAFETY: the mapping is at least HDR_LEN bytes, page aligned, and
        // Header is made of plain integers and atomics (any bit pattern valid).
        unsafe { &*(self.base.as_ptr() as *const Header) }
    }

    /// Initialises a fresh (zeroed) segment: done by the client before anyone else maps it.
    pub fn init(&self, nonce: u64) {
        // SAFETY: only the creator calls this, before the fd is published.
        unsafe {
            let h = self.base.as_ptr() as *mut Header;
            (*h).magic = MAGIC;
            (*h).version = VERSION;
            (*h).ring_len = self.ring_len as u32;
            (*h).nonce = nonce;
        }
        // Both readers start armed: the first byte written on either ring
        // rings the reader's socket (its "ring empty" was never announced).
        for d in [CLIENT, SERVER] {
            self.side(d).data_gen.store(1, Ordering::Relaxed);
            self.ring(d).data_arm.0.store(1, Ordering::Relaxed);
        }
        self.side(CLIENT).holders.store(1, Ordering::Release);
    }

    /// Checks a segment mapped from a peer's descriptor.
    pub fn validate(&self, nonce: u64) -> bool {
        let h = self.hdr();
        h.magic == MAGIC
            && h.version == VERSION
            && h.ring_len as usize == self.ring_len
            && h.nonce == nonce
    }

    pub fn side(&self, s: usize) -> &Side {
        &self.hdr().sides[s].0
    }

    pub fn ring(&self, d: usize) -> &RingCtl {
        &self.hdr().rings[d]
    }

    pub fn ring_len(&self) -> usize {
        self.ring_len
    }

    fn data(&self, d: usize) -> *mut u8 {
        // SAFETY: ring d lies inside the mapping.
        unsafe { self.base.as_ptr().add(HDR_LEN + d * self.ring_len) }
    }

    /// Bytes buffered in ring `d`, validated.
    pub fn used(&self, d: usize) -> Result<usize, Corrupt> {
        self.span(d).map(|(_, _, used)| used)
    }

    /// Ring `d`'s positions `(head, tail)` and the bytes between them,
    /// validated: the peer writes these words, so a `used` beyond the ring
    /// means a corrupt segment. (Acquire on both: on the side we own it
    /// costs nothing and keeps one rule for every caller.)
    fn span(&self, d: usize) -> Result<(u64, u64, usize), Corrupt> {
        let r = self.ring(d);
        let head = r.head.0.load(Ordering::Acquire);
        let tail = r.tail.0.load(Ordering::Acquire);
        let used = head.wrapping_sub(tail);
        if used > self.ring_len as u64 {
            return Err(Corrupt);
        }
        Ok((head, tail, used as usize))
    }

    /// Copies up to the total length of `bufs` from ring `d` into them;
    /// consumes unless `peek`. Caller holds the ring's read lock.
    pub fn read_into(
        &self,
        d: usize,
        bufs: &mut [&mut [u8]],
        peek: bool,
    ) -> Result<usize, Corrupt> {
        let r = self.ring(d);
        let (_, tail, mut avail) = self.span(d)?;
        let mut pos = tail;
        let mut done = 0;
        let base = self.data(d);
        for b in bufs.iter_mut() {
            let mut off = 0;
            while off < b.len() && avail > 0 {
                let at = (pos % self.ring_len as u64) as usize;
                let n = (b.len() - off).min(avail).min(self.ring_len - at);
                // SAFETY: at + n <= ring_len, so the source lies in ring d; the
                // destination is the caller's slice. The writer does not touch
                // [tail, head) until we publish a new tail.
                unsafe { std::ptr::copy_nonoverlapping(base.add(at), b.as_mut_ptr().add(off), n) };
                off += n;
                avail -= n;
                pos += n as u64;
                done += n;
            }
            if avail == 0 {
                break;
            }
        }
        if !peek && done > 0 {
            r.tail.0.store(pos, Ordering::Release);
        }
        Ok(done)
    }

    /// Discards up to `n` bytes (MSG_TRUNC). Caller holds the read lock.
    pub fn discard(&self, d: usize, n: usize) -> Result<usize, Corrupt> {
        let r = self.ring(d);
        let used = self.used(d)?;
        let k = n.min(used);
        let tail = r.tail.0.load(Ordering::Relaxed);
        r.tail.0.store(tail + k as u64, Ordering::Release);
        Ok(k)
    }

    /// Copies as much of `bufs` as fits into ring `d`. Caller holds the write lock.
    pub fn write_from(&self, d: usize, bufs: &[&[u8]]) -> Result<usize, Corrupt> {
        let r = self.ring(d);
        let (head, _, used) = self.span(d)?;
        let mut free = self.ring_len - used;
        let mut pos = head;
        let mut done = 0;
        let base = self.data(d);
        for b in bufs {
            let mut off = 0;
            while off < b.len() && free > 0 {
                let at = (pos % self.ring_len as u64) as usize;
                let n = (b.len() - off).min(free).min(self.ring_len - at);
                // SAFETY: at + n <= ring_len: the destination lies in ring d,
                // in the free part the reader does not read.
                unsafe { std::ptr::copy_nonoverlapping(b.as_ptr().add(off), base.add(at), n) };
                off += n;
                free -= n;
                pos += n as u64;
                done += n;
            }
            if free == 0 {
                break;
            }
        }
        if done > 0 {
            r.head.0.store(pos, Ordering::Release);
        }
        Ok(done)
    }
}

/// Result of [`Segment::write_from_file`].
pub struct FileFill {
    /// Bytes read from the file into the ring (and published).
    pub moved: usize,
    /// The file had no more bytes at that offset.
    pub eof: bool,
    /// `pread` failed with this errno before anything moved.
    pub err: Option<i32>,
}

impl Segment {
    /// Reads up to `max` bytes of `file` at offset `pos` straight into the
    /// free part of ring `d` and publishes them: `sendfile` without a bounce
    /// buffer. Caller holds the ring's write lock.
    pub fn write_from_file(
        &self,
        d: usize,
        file: i32,
        pos: i64,
        max: usize,
    ) -> Result<FileFill, Corrupt> {
        let r = self.ring(d);
        let (head, _, used) = self.span(d)?;
        let mut want = (self.ring_len - used).min(max);
        let mut fill = FileFill {
            moved: 0,
            eof: false,
            err: None,
        };
        let base = self.data(d);
        while want > 0 {
            let at = ((head + fill.moved as u64) % self.ring_len as u64) as usize;
            let n = want.min(self.ring_len - at);
            // SAFETY: at + n <= ring_len: the destination lies in ring d, in
            // the free part the reader does not read.
            let got = unsafe {
                libc::pread(
                    file,
                    base.add(at) as *mut libc::c_void,
                    n,
                    pos + fill.moved as i64,
                )
            };
            if got < 0 {
                if fill.moved == 0 {
                    fill.err = Some(
                        std::io::Error::last_os_error()
                            .raw_os_error()
                            .unwrap_or(libc::EIO),
                    );
                }
                break;
            }
            if got == 0 {
                fill.eof = true;
                break;
            }
            fill.moved += got as usize;
            want -= got as usize;
            if (got as usize) < n {
                break; // short read: the caller asks again
            }
        }
        if fill.moved > 0 {
            r.head.0.store(head + fill.moved as u64, Ordering::Release);
        }
        Ok(fill)
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.drop_kept();
        // SAFETY: unmapping exactly what `map` mapped; nothing borrows it past drop.
        unsafe { libc::munmap(self.base.as_ptr() as *mut libc::c_void, self.len) };
    }
}

/// A mutex in shared memory (threads and forked processes): 0 free, 1 held,
/// 2 held with waiters. Held only for a copy, never across a wait.
pub struct ShmLock<'a>(&'a AtomicU32);

impl<'a> ShmLock<'a> {
    pub fn lock(word: &'a AtomicU32) -> ShmLock<'a> {
        for _ in 0..200 {
            if word
                .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return ShmLock(word);
            }
            std::hint::spin_loop();
        }
        loop {
            if word.swap(2, Ordering::Acquire) == 0 {
                return ShmLock(word);
            }
            // A holder that died inside a copy would leave the word set: wait
            // in bounded slices so a stuck lock costs latency, not a hang of
            // the futex call itself.
            crate::sys::futex_wait(word, 2, std::time::Duration::from_millis(10));
        }
    }
}

impl Drop for ShmLock<'_> {
    fn drop(&mut self) {
        if self.0.swap(0, Ordering::Release) == 2 {
            crate::sys::futex_wake(self.0, 1);
        }
    }
}
