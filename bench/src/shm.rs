//! `spin-floor` and `eventfd-floor`: the cost floor of a shared-memory hop.
//!
//! Two processes share one `MAP_SHARED` memfd mapping (pre-faulted with
//! `MAP_POPULATE`). Page 0 holds one `AtomicU64` — the single shared cache line both
//! sides ping-pong on: the parent stores `2k+1` after writing the A→B payload, the peer
//! stores `2k+2` after folding it and writing the B→A payload. Payloads live in the
//! following pages and are written by the sender and read (every byte folded) by the
//! receiver on every iteration.
//!
//! * `spin-floor`: both sides spin on the cache line (bounded spin, then `sched_yield`).
//! * `eventfd-floor`: each side blocks in `read` on its own eventfd; the other writes it.
//! * `futex-floor` (no payload; `fido-bench rpc`'s `null-notified`): each side blocks in
//!   `FUTEX_WAIT` on its own 32-bit word of the control page; the other stores the call
//!   number there and `FUTEX_WAKE`s it. Nobody spins, so every round trip pays two
//!   wake-ups: the floor of any call whose both ends block between request and reply.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{bail, Context as _};
use rustix::event::EventfdFlags;
use rustix::mm::{MapFlags, ProtFlags};
use rustix::thread::futex;

use crate::harness::*;

const STOP: u64 = u64::MAX;
const PAGE: usize = 4096;
const STALL: Duration = Duration::from_secs(10);

/// A read-write, pre-faulted `MAP_SHARED` mapping of a memfd, unmapped on drop:
/// what both processes of a floor map (here and in `rpc::shm_floor`).
pub(crate) struct MemfdMapping {
    base: *mut u8,
    len: usize,
}

impl MemfdMapping {
    /// Maps the first `len` bytes of `fd` (which must be at least that long).
    pub(crate) fn new(fd: impl AsFd, len: usize) -> anyhow::Result<MemfdMapping> {
        // SAFETY: a fresh shared mapping of a memfd at least `len` bytes long, placed
        // by the kernel; unmapped only in Drop.
        let base = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::POPULATE,
                fd,
                0,
            )?
        } as *mut u8;
        Ok(MemfdMapping { base, len })
    }

    /// The first byte (valid for `len()` bytes while `self` lives).
    pub(crate) fn base(&self) -> *mut u8 {
        self.base
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for MemfdMapping {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping created in `new`.
        unsafe {
            let _ = rustix::mm::munmap(self.base as *mut _, self.len);
        }
    }
}

/// A shared mapping of a memfd: control page + A→B buffer + B→A buffer.
struct Region {
    base: *mut u8,
    size: usize,
    _map: MemfdMapping,
}

impl Region {
    fn layout(size: usize) -> (usize, usize) {
        let slot = size.div_ceil(PAGE) * PAGE;
        (slot, PAGE + 2 * slot)
    }

    fn create(size: usize) -> anyhow::Result<(OwnedFd, Region)> {
        let fd = rustix::fs::memfd_create("fido-bench-floor", rustix::fs::MemfdFlags::CLOEXEC)?;
        let (_, len) = Self::layout(size);
        rustix::fs::ftruncate(&fd, len as u64)?;
        let r = Self::map(&fd, size)?;
        Ok((fd, r))
    }

    fn map(fd: impl AsFd, size: usize) -> anyhow::Result<Region> {
        let (_, len) = Self::layout(size);
        let map = MemfdMapping::new(fd, len)?;
        Ok(Region { base: map.base(), size, _map: map })
    }

    fn flag(&self) -> &AtomicU64 {
        // SAFETY: offset 0 is page-aligned, inside the mapping, and only ever accessed
        // atomically by both processes.
        unsafe { &*(self.base as *const AtomicU64) }
    }

    /// Futex word `i` (0 or 1) of `futex-floor`, each on its own cache line of the
    /// control page (after the `flag` line).
    fn word(&self, i: usize) -> &AtomicU32 {
        assert!(i < 2);
        // SAFETY: offsets 64 and 128 are 4-aligned, inside the control page, and only
        // ever accessed atomically by both processes.
        unsafe { &*(self.base.add(64 * (i + 1)) as *const AtomicU32) }
    }

    fn ab(&self) -> *mut u8 {
        // SAFETY: in bounds (layout).
        unsafe { self.base.add(PAGE) }
    }

    fn ba(&self) -> *mut u8 {
        let (slot, _) = Self::layout(self.size);
        // SAFETY: in bounds (layout).
        unsafe { self.base.add(PAGE + slot) }
    }

    /// The protocol gives the owner of the current turn exclusive use of a buffer.
    fn read(&self, p: *mut u8) -> u64 {
        // SAFETY: in bounds; the sender published it with Release before we observed its
        // sequence number with Acquire, and will not touch it until we reply.
        fold(unsafe { std::slice::from_raw_parts(p, self.size) })
    }

    fn write(&self, p: *mut u8, seq: u64) {
        // SAFETY: in bounds; it is our turn (see `read`), the peer does not access it.
        unsafe { fill_raw(p, self.size, seq) }
    }
}


fn check(got: u64, want: u64) -> anyhow::Result<()> {
    if got != want {
        bail!("payload carried sequence {got}, expected {want}");
    }
    Ok(())
}

/// Parent side of `spin-floor` for one size. Returns round-trip samples and
/// both sides' CPU time over the measured window.
pub fn spin_floor(size: usize, opts: &Opts) -> anyhow::Result<(Vec<u64>, CpuUse)> {
    let place = Placement::detect();
    let (fd, region) = Region::create(size)?;
    let _pin = PinGuard::pin(place.parent)?;
    let peer = Peer::spawn(
        &[
            "spin-floor",
            &format!("size={size}"),
            &format!("cpu={}", place.peer),
        ],
        &[fd.as_fd()],
    )?;
    let dog = Watchdog::new(peer.pid(), || {})?;
    let flag = region.flag();
    let abort = dog.flag();
    let rtts = time_round_trips_cpu(opts.warmup(), opts.duration(), Some(peer.pid()), |k| {
        region.write(region.ab(), k);
        flag.store(2 * k - 1, Ordering::Release);
        spin_until(|| flag.load(Ordering::Acquire) == 2 * k, &abort, STALL)?;
        check(region.read(region.ba()), k)
    })?;
    flag.store(STOP, Ordering::Release);
    drop(dog);
    peer.finish(Duration::from_secs(5))?;
    Ok(rtts)
}

fn spin_floor_peer(a: &PeerArgs) -> anyhow::Result<()> {
    let size: usize = a.num("size")?;
    let fd = peer_fd(0);
    let region = Region::map(&fd, size)?;
    let flag = region.flag();
    let never = AtomicBool::new(false);
    let mut last = 0u64;
    loop {
        // The parent may legitimately think for a long time between points; no stall limit.
        spin_until(
            || flag.load(Ordering::Acquire) != last,
            &never,
            Duration::MAX,
        )?;
        let v = flag.load(Ordering::Acquire);
        if v == STOP {
            return Ok(());
        }
        let k = v.div_ceil(2);
        check(region.read(region.ab()), k)?;
        region.write(region.ba(), k);
        last = v + 1;
        flag.store(last, Ordering::Release);
    }
}

fn efd_wait(fd: &OwnedFd) -> anyhow::Result<()> {
    let mut b = [0u8; 8];
    loop {
        match rustix::io::read(fd, &mut b) {
            Ok(_) => return Ok(()),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e).context("eventfd read"),
        }
    }
}

fn efd_ring(fd: &OwnedFd) -> anyhow::Result<()> {
    rustix::io::write(fd, &1u64.to_ne_bytes()).context("eventfd write")?;
    Ok(())
}

/// Parent side of `eventfd-floor` for one size. Returns round-trip samples and
/// both sides' CPU time over the measured window.
pub fn eventfd_floor(size: usize, opts: &Opts) -> anyhow::Result<(Vec<u64>, CpuUse)> {
    let place = Placement::detect();
    let (fd, region) = Region::create(size)?;
    let to_peer = rustix::event::eventfd(0, EventfdFlags::CLOEXEC)?;
    let to_parent = std::sync::Arc::new(rustix::event::eventfd(0, EventfdFlags::CLOEXEC)?);
    let _pin = PinGuard::pin(place.parent)?;
    let peer = Peer::spawn(
        &[
            "eventfd-floor",
            &format!("size={size}"),
            &format!("cpu={}", place.peer),
        ],
        &[fd.as_fd(), to_peer.as_fd(), to_parent.as_fd()],
    )?;
    let wake = to_parent.clone();
    let dog = Watchdog::new(peer.pid(), move || {
        let _ = efd_ring(&wake);
    })?;
    let flag = region.flag();
    let rtts = time_round_trips_cpu(opts.warmup(), opts.duration(), Some(peer.pid()), |k| {
        region.write(region.ab(), k);
        flag.store(2 * k - 1, Ordering::Release);
        efd_ring(&to_peer)?;
        efd_wait(&to_parent)?;
        if dog.aborted() {
            bail!("bench peer died");
        }
        if flag.load(Ordering::Acquire) != 2 * k {
            bail!("eventfd-floor: peer out of step");
        }
        check(region.read(region.ba()), k)
    })?;
    flag.store(STOP, Ordering::Release);
    efd_ring(&to_peer)?;
    drop(dog);
    peer.finish(Duration::from_secs(5))?;
    Ok(rtts)
}

fn eventfd_floor_peer(a: &PeerArgs) -> anyhow::Result<()> {
    let size: usize = a.num("size")?;
    let (fd, wait, ring) = (peer_fd(0), peer_fd(1), peer_fd(2));
    let region = Region::map(&fd, size)?;
    let flag = region.flag();
    loop {
        efd_wait(&wait)?;
        let v = flag.load(Ordering::Acquire);
        if v == STOP {
            return Ok(());
        }
        let k = v.div_ceil(2);
        check(region.read(region.ab()), k)?;
        region.write(region.ba(), k);
        flag.store(v + 1, Ordering::Release);
        efd_ring(&ring)?;
    }
}

/// `futex-floor`'s "stop" call number.
const FSTOP: u32 = u32::MAX;

/// Blocks until `word` holds `want`. The value is checked before every
/// `FUTEX_WAIT` (which itself only sleeps while the word still holds the value we
/// saw), so a store + wake that lands between the check and the wait is never
/// lost. Waits are shared (not `FUTEX_PRIVATE`): the word is in a mapping two
/// processes share. With `abort`, a wait times out every 100 ms to look at it (a
/// dead peer never hangs the parent) and fails after `STALL` without progress.
fn futex_wait_for(word: &AtomicU32, want: u32, abort: Option<&AtomicBool>) -> anyhow::Result<()> {
    let tick = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 100_000_000,
    };
    let since = std::time::Instant::now();
    loop {
        let v = word.load(Ordering::Acquire);
        if v == want {
            return Ok(());
        }
        let timeout = abort.map(|_| &tick);
        match futex::wait(word, futex::Flags::empty(), v, timeout) {
            Ok(()) | Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::TIMEDOUT) => {}
            Err(e) => return Err(e).context("futex wait"),
        }
        if let Some(abort) = abort {
            if abort.load(Ordering::Relaxed) {
                bail!("bench peer died");
            }
            if word.load(Ordering::Acquire) != want && since.elapsed() > STALL {
                bail!("futex-floor: peer stalled for {STALL:?}");
            }
        }
    }
}

fn futex_wake(word: &AtomicU32) -> anyhow::Result<()> {
    futex::wake(word, futex::Flags::empty(), 1).context("futex wake")?;
    Ok(())
}

/// Parent side of `futex-floor`: a null round trip through two blocking futex
/// waits. Returns round-trip samples (ns).
pub fn futex_floor(opts: &Opts) -> anyhow::Result<Vec<u64>> {
    let place = Placement::detect();
    let (fd, region) = Region::create(8)?;
    let _pin = PinGuard::pin(place.parent)?;
    let peer = Peer::spawn(
        &["futex-floor", &format!("cpu={}", place.peer)],
        &[fd.as_fd()],
    )?;
    let dog = Watchdog::new(peer.pid(), || {})?;
    let abort = dog.flag();
    let (to_peer, to_parent) = (region.word(0), region.word(1));
    let rtts = time_round_trips(opts.warmup(), opts.duration(), |k| {
        // Call numbers start at 1 (0 = nothing yet) and never reach FSTOP in a point.
        let k = (k % u64::from(FSTOP)) as u32;
        to_peer.store(k, Ordering::Release);
        futex_wake(to_peer)?;
        futex_wait_for(to_parent, k, Some(&abort))
    })?;
    to_peer.store(FSTOP, Ordering::Release);
    futex_wake(to_peer)?;
    drop(dog);
    peer.finish(Duration::from_secs(5))?;
    Ok(rtts)
}

fn futex_floor_peer() -> anyhow::Result<()> {
    let fd = peer_fd(0);
    let region = Region::map(&fd, 8)?;
    let (wait, ring) = (region.word(0), region.word(1));
    let mut last = 0u32;
    loop {
        // Sleep while the word still holds the last call we answered (no timeout:
        // the parent may think for a long time; we die with it).
        let v = wait.load(Ordering::Acquire);
        if v == last {
            match futex::wait(wait, futex::Flags::empty(), last, None) {
                Ok(()) | Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e).context("futex wait"),
            }
        }
        if v == FSTOP {
            return Ok(());
        }
        ring.store(v, Ordering::Release);
        futex_wake(ring)?;
        last = v;
    }
}

pub(crate) fn peer(kind: &str, a: &PeerArgs) -> Option<anyhow::Result<()>> {
    match kind {
        "spin-floor" => Some(spin_floor_peer(a)),
        "futex-floor" => Some(futex_floor_peer()),
        "eventfd-floor" => Some(eventfd_floor_peer(a)),
        _ => None,
    }
}
