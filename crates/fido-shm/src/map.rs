//! Mappings and the PGVAS reservation: every `mmap`/`mremap`/`munmap`/`madvise`
//! of this crate, and so nearly all of its `unsafe`, lives here.
//!
//! The invariants that make the `unsafe` sound are kept by this module alone:
//!
//! * A [`Window`] in PGVAS mode owns `[base, base + slot_size * slots)`: it
//!   reserved it with `MAP_FIXED_NOREPLACE` (so it clobbered nothing) and unmaps
//!   it only when dropped, which happens after every [`Mapping`] is gone (each
//!   holds an `Arc<Window>`). Hence `MAP_FIXED` inside that range can never
//!   clobber memory that isn't ours.
//! * Inside the window, a slot's range holds either the PROT_NONE reservation or
//!   exactly one live [`Mapping`]; the per-slot `occupied` flag (under the
//!   window's mutex) says which. A new mapping is only placed in a slot that is
//!   not occupied, and a dropping mapping puts the reservation back *before*
//!   clearing the flag, under the same mutex, so two mappings never race for one
//!   slot's addresses.
//! * A [`Mapping`] is never longer than its slot, so it stays inside its slot.
//! * Peers' arenas are only ever mapped `PROT_READ` from an `O_RDONLY` file
//!   description, so the kernel, not this code, guarantees we cannot write them.

use crate::{GPtr, PgvasGeometry, ShmError};
use parking_lot::{Mutex, MutexGuard};
use rustix::fd::BorrowedFd;
use rustix::mm::{self, Advice, MapFlags, MremapFlags, ProtFlags};
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

/// The system page size.
pub(crate) fn page_size() -> u64 {
    rustix::param::page_size() as u64
}

/// `len` rounded up to whole pages, as a `usize` for the syscalls.
fn page_round(len: u64) -> usize {
    let p = page_size();
    (len.div_ceil(p) * p) as usize
}

/// The PGVAS window of one address space, and which slots have pages in them.
pub(crate) struct Window {
    geometry: PgvasGeometry,
    /// True in PGVAS mode: we own the whole window range.
    reserved: bool,
    /// Per slot: a live `Mapping` has pages in the slot.
    occupied: Mutex<Vec<bool>>,
}

impl Window {
    /// Try to reserve the window (if `try_reserve`); `is_reserved()` tells whether
    /// that worked. A failure to reserve is not an error: the caller falls back
    /// to swizzling.
    pub(crate) fn new(geometry: PgvasGeometry, try_reserve: bool) -> Window {
        let reserved = try_reserve && Self::reserve(&geometry);
        Window {
            geometry,
            reserved,
            occupied: Mutex::new(vec![false; geometry.slots as usize]),
        }
    }

    fn total(geometry: &PgvasGeometry) -> usize {
        (geometry.slot_size * geometry.slots as u64) as usize
    }

    fn reserve(geometry: &PgvasGeometry) -> bool {
        let want = geometry.base as *mut c_void;
        let total = Self::total(geometry);
        // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping: it either
        // creates a new PROT_NONE mapping in free address space or fails with EEXIST.
        // Nothing is dereferenced.
        let r = unsafe {
            mm::mmap_anonymous(
                want,
                total,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::NORESERVE | MapFlags::FIXED_NOREPLACE,
            )
        };
        match r {
            Ok(p) if p == want => true,
            Ok(p) => {
                // Kernels before 4.17 treat the unknown flag as a hint and may place
                // the mapping elsewhere; that is not our window, so give it back.
                tracing::warn!(
                    base = format_args!("{:#x}", geometry.base),
                    got = format_args!("{p:p}"),
                    "PGVAS window placed elsewhere; falling back to swizzling"
                );
                // SAFETY: `p..p+total` is the mapping we just created and nobody else
                // knows about it.
                let _ = unsafe { mm::munmap(p, total) };
                false
            }
            Err(e) => {
                tracing::warn!(
                    base = format_args!("{:#x}", geometry.base),
                    len = total,
                    error = %e,
                    "cannot reserve the PGVAS window; falling back to swizzling"
                );
                false
            }
        }
    }

    pub(crate) fn is_reserved(&self) -> bool {
        self.reserved
    }

    pub(crate) fn geometry(&self) -> PgvasGeometry {
        self.geometry
    }

    pub(crate) fn slot_addr(&self, slot: u32) -> u64 {
        self.geometry.base + slot as u64 * self.geometry.slot_size
    }

    /// The per-slot occupancy, locked. Held across "check slot free → map → mark".
    pub(crate) fn lock_occupied(&self) -> MutexGuard<'_, Vec<bool>> {
        self.occupied.lock()
    }

    /// Guard for every fixed-address operation: the slot and length must lie
    /// inside the window, the window must be ours, and the slot must be free.
    fn check_fixed(&self, occ: &[bool], slot: u32, map_len: usize) -> Result<u64, ShmError> {
        if slot >= self.geometry.slots {
            return Err(ShmError::SlotOutOfRange {
                slot,
                slots: self.geometry.slots,
            });
        }
        if map_len as u64 > self.geometry.slot_size {
            return Err(ShmError::TooLarge {
                len: map_len as u64,
                max: self.geometry.slot_size,
            });
        }
        if occ[slot as usize] {
            return Err(ShmError::SlotDraining { slot });
        }
        Ok(self.slot_addr(slot))
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        if self.reserved {
            // SAFETY: we reserved exactly this range in `new`; every Mapping holds an
            // Arc<Window>, so none is alive and the whole range is our reservation.
            if let Err(e) = unsafe {
                mm::munmap(
                    self.geometry.base as *mut c_void,
                    Self::total(&self.geometry),
                )
            } {
                tracing::error!(error = %e, "munmap of the PGVAS window failed");
            }
        }
    }
}

/// The owner's read-write mapping of its arena before it is placed in a slot.
pub(crate) struct RwRegion {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the region is plain shared memory owned by this value; moving it to or
// using it from another thread is no different from a heap allocation.
unsafe impl Send for RwRegion {}
// SAFETY: `RwRegion` exposes no interior mutability through `&self`.
unsafe impl Sync for RwRegion {}

impl RwRegion {
    /// `mmap(NULL, len, PROT_READ|PROT_WRITE, MAP_SHARED, fd, 0)`.
    pub(crate) fn map(fd: BorrowedFd<'_>, len: u64) -> Result<RwRegion, ShmError> {
        let len = page_round(len);
        // SAFETY: a null hint without MAP_FIXED lets the kernel choose free address
        // space; nothing existing is replaced.
        let p = unsafe {
            mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }
        .map_err(ShmError::io("mmap arena read-write"))?;
        let ptr = NonNull::new(p.cast::<u8>()).ok_or(ShmError::Io {
            op: "mmap arena",
            errno: rustix::io::Errno::FAULT,
        })?;
        Ok(RwRegion { ptr, len })
    }

    /// Fault every page in now so the data path never takes a page fault.
    /// `MADV_POPULATE_WRITE` (Linux 5.14); older kernels: touch one byte per page.
    pub(crate) fn prefault(&self) {
        // SAFETY: the range is our own live mapping; MADV_POPULATE_WRITE only
        // faults pages in (it does not change contents).
        let r = unsafe {
            mm::madvise(
                self.ptr.as_ptr().cast(),
                self.len,
                Advice::LinuxPopulateWrite,
            )
        };
        if r.is_err() {
            let page = page_size() as usize;
            for off in (0..self.len).step_by(page) {
                // SAFETY: `off < len`, inside our RW mapping. A fresh memfd is all zeros
                // and nothing has been allocated yet, so writing 0 preserves contents.
                unsafe { self.ptr.as_ptr().add(off).write_volatile(0) };
            }
        }
    }
}

impl Drop for RwRegion {
    fn drop(&mut self) {
        // SAFETY: the region is ours and, being unplaced, nothing else refers to it.
        let _ = unsafe { mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A mapping of one arena in one slot: a peer's (read-only) or our own
/// (read-write, owned by an [`crate::Arena`]). Send + Sync; the pages stay mapped
/// as long as any `Arc<Mapping>` is alive.
pub struct Mapping {
    window: Arc<Window>,
    slot: u32,
    owner: u64,
    /// Arena length: the bound every resolve checks against.
    len: u64,
    /// Mapped length (`len` rounded up to pages).
    map_len: usize,
    local: NonNull<u8>,
    own: bool,
}

// SAFETY: a Mapping only hands out addresses; the memory behind them is shared
// memory that lives until drop, which `Arc` delays until the last user is gone.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` gives no mutable access.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps a validated arena in `slot`: a peer's read-only (a sealed memfd,
    /// or a VM guest's read-only BAR), or, with `own`, our own device arena
    /// read-write (a VM guest's own BAR: no memfd to seal, the host side gave
    /// it). `occ` is the window's locked occupancy table; on success the slot
    /// is marked occupied.
    pub(crate) fn map_in_slot(
        window: &Arc<Window>,
        occ: &mut [bool],
        (slot, owner): (u32, u64),
        fd: BorrowedFd<'_>,
        len: u64,
        own: bool,
    ) -> Result<Mapping, ShmError> {
        let prot = if own { ProtFlags::READ | ProtFlags::WRITE } else { ProtFlags::READ };
        let map_len = page_round(len);
        let at = window.check_fixed(occ, slot, map_len)?;
        let p = if window.reserved {
            // SAFETY: `at..at+map_len` lies inside slot `slot` (check_fixed), inside
            // our own reservation, and the slot holds no live mapping, so MAP_FIXED
            // replaces only our PROT_NONE placeholder.
            unsafe {
                mm::mmap(
                    at as *mut c_void,
                    map_len,
                    prot,
                    MapFlags::SHARED | MapFlags::FIXED,
                    fd,
                    0,
                )
            }
        } else {
            // SAFETY: no MAP_FIXED: the kernel picks free address space.
            unsafe {
                mm::mmap(
                    std::ptr::null_mut(),
                    map_len,
                    prot,
                    MapFlags::SHARED,
                    fd,
                    0,
                )
            }
        }
        .map_err(ShmError::io(if own { "mmap own device arena" } else { "mmap peer arena read-only" }))?;
        let local = NonNull::new(p.cast::<u8>()).ok_or(ShmError::Io {
            op: "mmap peer arena",
            errno: rustix::io::Errno::FAULT,
        })?;
        debug_assert!(!window.reserved || local.as_ptr() as u64 == at);
        occ[slot as usize] = true;
        Ok(Mapping {
            window: window.clone(),
            slot,
            owner,
            len,
            map_len,
            local,
            own,
        })
    }

    /// Take over the owner's RW region as the mapping of `slot`. In PGVAS mode
    /// the VMA is moved to G(slot) with `mremap(MREMAP_FIXED|MREMAP_MAYMOVE)`:
    /// moving an existing mapping is not a new writable mapping, so the
    /// F_SEAL_FUTURE_WRITE seal allows it. In swizzle mode it stays put.
    pub(crate) fn adopt_own(
        window: &Arc<Window>,
        occ: &mut [bool],
        slot: u32,
        owner: u64,
        region: RwRegion,
        len: u64,
    ) -> Result<Mapping, ShmError> {
        let map_len = region.len;
        let at = window.check_fixed(occ, slot, map_len)?;
        let local = if window.reserved {
            // SAFETY: the source is our own unplaced RW region (no references into it
            // exist yet: allocation starts after placement); the destination lies in
            // slot `slot` of our reservation, which holds no live mapping.
            let p = unsafe {
                mm::mremap_fixed(
                    region.ptr.as_ptr().cast(),
                    map_len,
                    map_len,
                    MremapFlags::MAYMOVE,
                    at as *mut c_void,
                )
            }
            .map_err(ShmError::io("mremap arena into its slot"))?;
            // The region has moved; its old address must not be unmapped again.
            std::mem::forget(region);
            NonNull::new(p.cast::<u8>()).expect("mremap returned the slot address")
        } else {
            let p = region.ptr;
            std::mem::forget(region);
            p
        };
        occ[slot as usize] = true;
        Ok(Mapping {
            window: window.clone(),
            slot,
            owner,
            len,
            map_len,
            local,
            own: true,
        })
    }

    pub fn slot(&self) -> u32 {
        self.slot
    }
    /// The owning domain (the broker's DomainId as passed to `map_peer`/`place`).
    pub fn owner(&self) -> u64 {
        self.owner
    }
    /// Arena length in bytes (the bound of every resolve in this slot).
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Where the arena is mapped in this process (== `global_base()` in PGVAS mode).
    pub fn local_base(&self) -> *const u8 {
        self.local.as_ptr()
    }
    /// [`Mapping::local_base`], never null.
    pub fn local_nonnull(&self) -> NonNull<u8> {
        self.local
    }
    /// G(slot).
    pub fn global_base(&self) -> GPtr {
        GPtr(self.window.slot_addr(self.slot))
    }
    /// True for our own (read-write) arena, false for a peer's read-only one.
    pub fn is_own(&self) -> bool {
        self.own
    }
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("slot", &self.slot)
            .field("owner", &self.owner)
            .field("len", &self.len)
            .field("local", &self.local)
            .field("own", &self.own)
            .finish()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let mut occ = self.window.occupied.lock();
        let p = self.local.as_ptr().cast::<c_void>();
        let r = if self.window.reserved {
            // SAFETY: `p..p+map_len` is this mapping, inside our reservation and slot
            // (adopt_own/map_peer checked); nothing refers to it any more (last Arc).
            // MAP_FIXED atomically swaps it for a PROT_NONE placeholder, so the
            // window never has a hole another mmap could land in.
            unsafe {
                mm::mmap_anonymous(
                    p,
                    self.map_len,
                    ProtFlags::empty(),
                    MapFlags::PRIVATE | MapFlags::NORESERVE | MapFlags::FIXED,
                )
            }
            .map(drop)
        } else {
            // SAFETY: this mapping is ours and nothing refers to it any more.
            unsafe { mm::munmap(p, self.map_len) }
        };
        match r {
            Ok(()) => occ[self.slot as usize] = false,
            // Leave the slot marked occupied: we don't know what is there now.
            Err(e) => {
                tracing::error!(slot = self.slot, error = %e, "releasing an arena mapping failed")
            }
        }
    }
}
