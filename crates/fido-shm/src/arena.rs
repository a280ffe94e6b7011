//! The owner's side of an arena: creating and sealing it, placing it in its
//! slot, and allocating buffers from it. No `unsafe` here.

use crate::alloc::{Allocator, ArenaStats, UNIT};
use crate::buf::Buf;
use crate::grant;
use crate::map::{Mapping, RwRegion};
use crate::{AddressSpace, GPtr, ShmError};
use rustix::fd::{AsFd, OwnedFd};
use std::sync::Arc;

/// Largest arena we create: 64 TiB (far beyond any slot; keeps unit indices in u32).
const MAX_ARENA: u64 = 1 << 46;

/// The owner's arena before it has a slot: the broker assigns the slot at join
/// and needs the (read-only) fd first.
pub struct UnplacedArena {
    fd: OwnedFd,
    region: RwRegion,
    len: u64,
}

impl std::fmt::Debug for UnplacedArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnplacedArena")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl UnplacedArena {
    /// Create a sealed, sparse arena of `len` bytes (rounded up to a multiple of
    /// 64 KiB, the allocator's unit): memfd, ftruncate, RW shared mapping,
    /// optional pre-fault, then seals SHRINK|GROW|FUTURE_WRITE|SEAL. From then on
    /// nobody — not even via a /proc/PID/fd re-open — can create a writable
    /// mapping; our existing RW mapping keeps working.
    pub fn create(len: u64, prefault: bool) -> Result<UnplacedArena, ShmError> {
        if len == 0 {
            return Err(ShmError::InvalidLength(0));
        }
        if len > MAX_ARENA {
            return Err(ShmError::TooLarge {
                len,
                max: MAX_ARENA,
            });
        }
        let len = len.div_ceil(UNIT) * UNIT;
        let fd = grant::create_memfd(len)?;
        // Map before sealing: FUTURE_WRITE forbids *new* writable mappings only.
        let region = RwRegion::map(fd.as_fd(), len)?;
        if prefault {
            region.prefault();
        }
        grant::seal(fd.as_fd())?;
        Ok(UnplacedArena { fd, region, len })
    }

    /// Arena length in bytes (a multiple of 64 KiB).
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A new read-only file description of the memfd, to grant to peers.
    pub fn ro_fd(&self) -> Result<OwnedFd, ShmError> {
        grant::ro_reopen(self.fd.as_fd())
    }

    /// Move the RW mapping into `slot` (PGVAS: mremap to G(slot); swizzle: it
    /// stays where it is) and register it in `space` as our own mapping, so
    /// `resolve` works on our own pointers too. Fails with `SlotBusy` if the slot
    /// is taken, `TooLarge` if the arena exceeds a slot; on failure the arena is
    /// dropped.
    pub fn place(
        self,
        space: &Arc<AddressSpace>,
        slot: u32,
        owner: u64,
    ) -> Result<Arc<Arena>, ShmError> {
        let UnplacedArena { fd, region, len } = self;
        let mapping = space.adopt_own(slot, owner, region, len)?;
        tracing::debug!(slot, owner, len, local = ?mapping.local_base(), "placed own arena");
        Ok(Arc::new(Arena {
            alloc: Allocator::new(len),
            mapping,
            fd,
            len,
            device: false,
        }))
    }
}

/// The owner's arena, placed in its slot. Send + Sync: allocate from any thread.
///
/// Dropping the last `Arc<Arena>` (every `Buf` holds one) drops the allocator;
/// the pages stay mapped while the space's slot table (or anyone else) holds
/// the `Mapping`: call `AddressSpace::unmap(slot)` to let them go.
pub struct Arena {
    alloc: Allocator,
    mapping: Arc<Mapping>,
    fd: OwnedFd,
    len: u64,
    /// Device memory (a VM guest's BAR), not a memfd.
    device: bool,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("slot", &self.slot())
            .field("len", &self.len)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Arena {
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn slot(&self) -> u32 {
        self.mapping.slot()
    }
    pub fn owner(&self) -> u64 {
        self.mapping.owner()
    }
    /// A new read-only file description of the memfd, to grant to peers.
    /// A device arena (a VM guest's) has none: its supervisor grants it.
    pub fn ro_fd(&self) -> Result<OwnedFd, ShmError> {
        if self.device {
            return Err(ShmError::NotGrantable);
        }
        grant::ro_reopen(self.fd.as_fd())
    }

    /// Places an arena that is device memory in `slot`: inside a VM guest,
    /// the BAR of the VM's own `ivshmem` device (its sysfs `resource2`,
    /// opened read-write), which the host side created, sealed and granted.
    /// Mapped read-write at G(slot) directly (the slot is known: the guest
    /// joins before it maps). `len` is the BAR size; the allocator hands out
    /// all of it.
    pub fn place_device(space: &Arc<AddressSpace>, slot: u32, owner: u64, fd: OwnedFd, len: u64) -> Result<Arc<Arena>, ShmError> {
        if len == 0 || len % UNIT != 0 {
            return Err(ShmError::InvalidLength(len));
        }
        if len > MAX_ARENA {
            return Err(ShmError::TooLarge { len, max: MAX_ARENA });
        }
        let mapping = space.map_own_device(slot, owner, fd.as_fd(), len)?;
        Ok(Arc::new(Arena { alloc: Allocator::new(len), mapping, fd, len, device: true }))
    }
    /// G(slot): the global address of offset 0.
    pub fn base(&self) -> GPtr {
        self.mapping.global_base()
    }
    /// Our own (read-write) mapping.
    pub fn mapping(&self) -> &Arc<Mapping> {
        &self.mapping
    }

    /// Allocate `len > 0` bytes, 64-byte aligned. `OutOfMemory` when no block
    /// fits. Any size up to the arena length (see the allocator docs for the
    /// largest block of a non-power-of-two arena).
    pub fn alloc(self: &Arc<Self>, len: usize) -> Result<Buf, ShmError> {
        let (off, block) = self.alloc.alloc(len as u64)?;
        Ok(Buf::new(self.clone(), off, len, block))
    }

    /// Return an allocation (called by `Buf::drop` only).
    pub(crate) fn free(&self, off: u64, block: crate::alloc::Block) {
        self.alloc.free(off, block)
    }

    pub fn stats(&self) -> ArenaStats {
        self.alloc.stats()
    }

    /// Whether `[g, g+len)` lies inside this arena (overflow-safe).
    pub fn contains(&self, g: GPtr, len: u64) -> bool {
        match g.0.checked_sub(self.base().0) {
            Some(off) => off.checked_add(len).is_some_and(|end| end <= self.len),
            None => false,
        }
    }
}
