//! The address space of a domain: the PGVAS window, the slot table, and the
//! one pointer resolver.

use crate::grant::{check_device, check_grant};
use crate::map::{Mapping, RwRegion, Window};
use crate::{AddressMode, GPtr, ModeRequest, PgvasGeometry, ShmError};
use parking_lot::RwLock;
use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

/// One per process (a domain): the PGVAS window (or, when it could not be
/// reserved, a swizzle table) and the mappings of every arena this domain can
/// read, its own included. Send + Sync.
///
/// Locking: `resolve` takes one slot's read lock (uncontended in practice:
/// writers are map/unmap, which are rare). `map_peer`/`place` serialise on the
/// window's occupancy mutex, then take the slot's write lock.
pub struct AddressSpace {
    window: Arc<Window>,
    table: Box<[RwLock<Option<Arc<Mapping>>>]>,
    /// `log2(slot_size)` when it is a power of two, so `slot_of` is a shift.
    slot_shift: Option<u32>,
}

impl std::fmt::Debug for AddressSpace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AddressSpace")
            .field("mode", &self.mode())
            .field("geometry", &self.geometry())
            .finish_non_exhaustive()
    }
}

impl AddressSpace {
    /// `Auto`: reserve `[base, base + slot_size*slots)` PROT_NONE with
    /// `MAP_FIXED_NOREPLACE`; on failure (conflict, no memory, placed elsewhere)
    /// fall back to swizzling with a warning. `ForceSwizzle`: never reserve.
    pub fn new(geometry: PgvasGeometry, mode: ModeRequest) -> Result<AddressSpace, ShmError> {
        geometry.validate().map_err(|_| ShmError::InvalidGeometry)?;
        let window = Arc::new(Window::new(geometry, mode == ModeRequest::Auto));
        let slot_shift = geometry
            .slot_size
            .is_power_of_two()
            .then(|| geometry.slot_size.trailing_zeros());
        let table = (0..geometry.slots).map(|_| RwLock::new(None)).collect();
        Ok(AddressSpace {
            window,
            table,
            slot_shift,
        })
    }

    pub fn mode(&self) -> AddressMode {
        if self.window.is_reserved() {
            AddressMode::Pgvas
        } else {
            AddressMode::Swizzle
        }
    }

    pub fn geometry(&self) -> PgvasGeometry {
        self.window.geometry()
    }

    /// G(slot) = base + slot * slot_size (the same in every domain and mode).
    pub fn slot_base(&self, slot: u32) -> GPtr {
        debug_assert!(slot < self.geometry().slots, "slot {slot} out of range");
        GPtr(self.window.slot_addr(slot))
    }

    /// `(slot, offset)` of a global pointer, or `None` outside the window.
    #[inline]
    pub fn slot_of(&self, g: GPtr) -> Option<(u32, u64)> {
        let geo = self.window.geometry();
        let d = g.0.checked_sub(geo.base)?;
        let (slot, off) = match self.slot_shift {
            Some(s) => (d >> s, d & (geo.slot_size - 1)),
            None => (d / geo.slot_size, d % geo.slot_size),
        };
        (slot < geo.slots as u64).then_some((slot as u32, off))
    }

    fn check_slot(&self, slot: u32) -> Result<(), ShmError> {
        let slots = self.geometry().slots;
        if slot >= slots {
            return Err(ShmError::SlotOutOfRange { slot, slots });
        }
        Ok(())
    }

    /// The existing mapping of `slot` if it belongs to `owner`; `SlotBusy` if it
    /// belongs to someone else; `None` if the slot table is empty there.
    fn existing(&self, slot: u32, owner: u64) -> Result<Option<Arc<Mapping>>, ShmError> {
        match &*self.table[slot as usize].read() {
            Some(m) if m.owner() == owner => Ok(Some(m.clone())),
            Some(m) => Err(ShmError::SlotBusy {
                slot,
                owner: m.owner(),
            }),
            None => Ok(None),
        }
    }

    /// Map a peer's arena read-only into `slot`, after checking the grant (seals,
    /// O_RDONLY, size ≥ len, 0 < len ≤ slot_size). PGVAS: at exactly G(slot);
    /// swizzle: wherever the kernel puts it. Idempotent per owner: if `slot`
    /// already holds `owner`'s arena, that mapping is returned and `fd` dropped.
    pub fn map_peer(
        &self,
        slot: u32,
        owner: u64,
        fd: OwnedFd,
        len: u64,
    ) -> Result<Arc<Mapping>, ShmError> {
        self.map_checked((slot, owner), fd.as_fd(), len, false, |fd| check_grant(fd, len))
    }

    /// Maps a peer's arena that is device memory (inside a VM guest: the BAR
    /// of a hot-plugged read-only `ivshmem` device) read-only in `slot`, after
    /// [`crate::grant::check_device`]. Otherwise like [`map_peer`](Self::map_peer).
    pub fn map_peer_device(&self, slot: u32, owner: u64, fd: OwnedFd, len: u64) -> Result<Arc<Mapping>, ShmError> {
        self.map_checked((slot, owner), fd.as_fd(), len, false, |fd| check_device(fd, len, false))
    }

    /// Maps our own arena that is device memory (a VM guest's own BAR)
    /// read-write in `slot` (used by `Arena::place_device`).
    pub(crate) fn map_own_device(&self, slot: u32, owner: u64, fd: BorrowedFd<'_>, len: u64) -> Result<Arc<Mapping>, ShmError> {
        self.map_checked((slot, owner), fd, len, true, |fd| check_device(fd, len, true))
    }

    /// The one way a slot gets an arena mapped from a descriptor: slot and
    /// length checks, `check` on the descriptor, then the mapping under the
    /// window's lock. A peer's arena (`own == false`) already mapped for the
    /// same owner is returned as it is (before and, in case another thread
    /// mapped it meanwhile, under the lock); any other occupant is `SlotBusy`.
    fn map_checked(
        &self,
        (slot, owner): (u32, u64),
        fd: BorrowedFd<'_>,
        len: u64,
        own: bool,
        check: impl FnOnce(BorrowedFd<'_>) -> Result<(), ShmError>,
    ) -> Result<Arc<Mapping>, ShmError> {
        self.check_slot(slot)?;
        if !own {
            if let Some(m) = self.existing(slot, owner)? {
                return Ok(m);
            }
        }
        let max = self.geometry().slot_size;
        if len > max {
            return Err(ShmError::TooLarge { len, max });
        }
        check(fd)?;
        let mut occ = self.window.lock_occupied();
        match self.table[slot as usize].read().as_ref() {
            Some(m) if !own && m.owner() == owner => return Ok(m.clone()),
            Some(m) => return Err(ShmError::SlotBusy { slot, owner: m.owner() }),
            None => {}
        }
        let m = Arc::new(Mapping::map_in_slot(&self.window, &mut occ, (slot, owner), fd, len, own)?);
        *self.table[slot as usize].write() = Some(m.clone());
        drop(occ);
        tracing::debug!(slot, owner, len, own, local = ?m.local_base(), "mapped arena");
        Ok(m)
    }

    /// Register our own RW region as the mapping of `slot` (used by
    /// `UnplacedArena::place`).
    pub(crate) fn adopt_own(
        &self,
        slot: u32,
        owner: u64,
        region: RwRegion,
        len: u64,
    ) -> Result<Arc<Mapping>, ShmError> {
        self.check_slot(slot)?;
        let max = self.geometry().slot_size;
        if len > max {
            return Err(ShmError::TooLarge { len, max });
        }
        let mut occ = self.window.lock_occupied();
        if let Some(m) = self.table[slot as usize].read().as_ref() {
            return Err(ShmError::SlotBusy {
                slot,
                owner: m.owner(),
            });
        }
        let m = Arc::new(Mapping::adopt_own(
            &self.window,
            &mut occ,
            slot,
            owner,
            region,
            len,
        )?);
        *self.table[slot as usize].write() = Some(m.clone());
        drop(occ);
        Ok(m)
    }

    /// The mapping in `slot`, if any.
    pub fn mapping(&self, slot: u32) -> Option<Arc<Mapping>> {
        self.table.get(slot as usize)?.read().clone()
    }

    /// Remove `slot` from the table (resolve fails for it from now on). The pages
    /// go when the last `Arc<Mapping>` drops: PGVAS re-reserves the range
    /// PROT_NONE (the window stays ours), swizzle unmaps. Until then the slot
    /// cannot be refilled (`ShmError::SlotDraining`).
    pub fn unmap(&self, slot: u32) -> Option<Arc<Mapping>> {
        self.table.get(slot as usize)?.write().take()
    }

    /// THE resolver: the only way a global pointer becomes a local one.
    /// Checks that `g` is inside the window, its slot is mapped, and
    /// `offset + len <= mapping.len()` (overflow-safe). Returns the local address
    /// and the mapping, which keeps the pages alive while held.
    /// O(1), no allocation: one shift, one read lock, one `Arc` clone.
    #[inline]
    pub fn resolve(&self, g: GPtr, len: u64) -> Result<(NonNull<u8>, Arc<Mapping>), ShmError> {
        let (slot, off) = self.slot_of(g).ok_or(ShmError::OutsideWindow(g))?;
        let m = self.table[slot as usize]
            .read()
            .clone()
            .ok_or(ShmError::NotMapped { slot })?;
        match off.checked_add(len) {
            Some(end) if end <= m.len() => {}
            _ => return Err(ShmError::OutOfBounds { gptr: g, len }),
        }
        // `off <= m.len()`, which is within the mapping (or one past its end), so
        // wrapping_add stays in bounds and never wraps; no unsafe needed.
        let p = m.local_nonnull().as_ptr().wrapping_add(off as usize);
        Ok((NonNull::new(p).expect("in-bounds pointer is non-null"), m))
    }
}
