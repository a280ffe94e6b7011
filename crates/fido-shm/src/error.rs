//! The crate's one error type.

use crate::GPtr;
use rustix::io::Errno;

/// Everything `fido-shm` can refuse or fail at. Grant-validation failures are
/// distinct variants (not `Io`) because the broker and the client library react
/// to them differently: a refused grant is a misbehaving peer, an `Io` error is
/// this process's problem.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ShmError {
    /// A system call failed; `op` names it and what it was for.
    #[error("{op}: {errno}")]
    Io { op: &'static str, errno: Errno },
    /// The grant lacks one of F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_FUTURE_WRITE
    /// (the raw seal bits found are included).
    #[error("grant is not sealed (seals {seals:#x}; need SHRINK|GROW|FUTURE_WRITE)")]
    NotSealed { seals: u32 },
    /// The grant's file description is not O_RDONLY (or is an O_PATH handle).
    #[error("grant file description is not read-only")]
    Writable,
    /// The grant's file is shorter than the length it was announced with.
    #[error("grant is {size} bytes, smaller than the announced {len}")]
    TooSmall { size: u64, len: u64 },
    /// A length exceeds the slot size (or another hard limit).
    #[error("length {len} exceeds the limit {max}")]
    TooLarge { len: u64, max: u64 },
    /// A length of zero (or otherwise unusable) was passed.
    #[error("invalid length {0}")]
    InvalidLength(u64),
    /// The PGVAS geometry is not usable (see `PgvasGeometry::validate`).
    #[error("invalid PGVAS geometry")]
    InvalidGeometry,
    #[error("slot {slot} out of range (window has {slots} slots)")]
    SlotOutOfRange { slot: u32, slots: u32 },
    /// The slot holds a mapping of another owner.
    #[error("slot {slot} is held by owner {owner}")]
    SlotBusy { slot: u32, owner: u64 },
    /// The slot was unmapped from the table but its previous mapping is still
    /// referenced (an `Arc<Mapping>` is alive somewhere), so its pages still
    /// occupy the slot. Retry once those references are gone.
    #[error("slot {slot} is still occupied by a previous mapping that is alive")]
    SlotDraining { slot: u32 },
    /// Nothing is mapped in the slot a global pointer points into.
    #[error("slot {slot} is not mapped")]
    NotMapped { slot: u32 },
    /// A global pointer outside the PGVAS window.
    #[error("global pointer {0:#x?} is outside the PGVAS window")]
    OutsideWindow(GPtr),
    /// A global pointer + length runs past the end of the mapping (or overflows).
    #[error("range {gptr:#x?}+{len} exceeds the mapping")]
    OutOfBounds { gptr: GPtr, len: u64 },
    /// A device memory region (a VM guest's PCI BAR) that is not what the
    /// mapping needs: not a regular file, or opened with the wrong access.
    #[error("device memory: {0}")]
    Device(&'static str),
    /// The arena is device memory (a VM guest's BAR): it has no memfd to grant;
    /// the VM's supervisor grants it on the host.
    #[error("a device arena cannot be granted from inside the guest")]
    NotGrantable,
    /// The arena has no free block large enough.
    #[error("arena out of memory allocating {len} bytes")]
    OutOfMemory { len: u64 },
}

impl ShmError {
    /// Adapter for `map_err`: tag an errno with the operation that produced it.
    pub(crate) fn io(op: &'static str) -> impl FnOnce(Errno) -> ShmError {
        move |errno| ShmError::Io { op, errno }
    }

    /// The errno, if this is an `Io` error.
    pub fn errno(&self) -> Option<Errno> {
        match self {
            ShmError::Io { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}
