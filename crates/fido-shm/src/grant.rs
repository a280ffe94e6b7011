//! Grants: the sealed memfd behind an arena, its read-only re-opens, and the
//! checks a receiver makes before trusting one. No `unsafe` here.

use crate::ShmError;
use rustix::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use rustix::fs::{self, MemfdFlags, Mode, OFlags, SealFlags};

/// Seals a grant must carry before anyone maps it. SHRINK: a peer cannot make
/// our reads SIGBUS by truncating; GROW: the size we checked stays the size;
/// FUTURE_WRITE: no new writable mapping or write(2), even through a re-open of
/// /proc/PID/fd/N, so the owner's existing mapping is the only writer.
pub(crate) const REQUIRED_SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::FUTURE_WRITE);

/// Check a grant without mapping it: the same checks as
/// [`crate::AddressSpace::map_peer`] minus the slot-size bound. The fd must be
/// sealed (SHRINK|GROW|FUTURE_WRITE), its file description O_RDONLY (not
/// O_PATH), `len > 0`, and the file at least `len` bytes.
pub fn check_grant(fd: BorrowedFd<'_>, len: u64) -> Result<(), ShmError> {
    if len == 0 {
        return Err(ShmError::InvalidLength(0));
    }
    let seals = fs::fcntl_get_seals(fd).map_err(|e| match e {
        // Not a memfd/shmem file at all: it cannot be sealed.
        rustix::io::Errno::INVAL => ShmError::NotSealed { seals: 0 },
        e => ShmError::Io {
            op: "fcntl(F_GET_SEALS) on grant",
            errno: e,
        },
    })?;
    if !seals.contains(REQUIRED_SEALS) {
        return Err(ShmError::NotSealed {
            seals: seals.bits(),
        });
    }
    let fl = fs::fcntl_getfl(fd).map_err(ShmError::io("fcntl(F_GETFL) on grant"))?;
    // O_RDONLY is 0: the access mode must be empty, and O_PATH (also access mode
    // 0) is no real file description.
    if fl.contains(OFlags::PATH) || !(fl & OFlags::ACCMODE).is_empty() {
        return Err(ShmError::Writable);
    }
    let size = fs::fstat(fd)
        .map_err(ShmError::io("fstat on grant"))?
        .st_size;
    let size = u64::try_from(size).unwrap_or(0);
    if size < len {
        return Err(ShmError::TooSmall { size, len });
    }
    Ok(())
}

/// Checks device memory (a VM guest's PCI BAR, its sysfs `resourceN` file)
/// before it is mapped: a regular file of at least `len` bytes, opened
/// read-only (a peer's arena) or read-write (our own). A guest cannot check
/// seals: the read-only-ness of a peer's BAR is enforced on the host (QEMU
/// maps it `readonly=on` from a sealed, read-only memfd), and this mapping is
/// `PROT_READ` besides.
pub fn check_device(fd: BorrowedFd<'_>, len: u64, writable: bool) -> Result<(), ShmError> {
    if len == 0 {
        return Err(ShmError::InvalidLength(0));
    }
    let st = fs::fstat(fd).map_err(ShmError::io("fstat on device memory"))?;
    if fs::FileType::from_raw_mode(st.st_mode) != fs::FileType::RegularFile {
        return Err(ShmError::Device("not a regular file (a sysfs resourceN)"));
    }
    let fl = fs::fcntl_getfl(fd).map_err(ShmError::io("fcntl(F_GETFL) on device memory"))?;
    let mode = fl & OFlags::ACCMODE;
    if fl.contains(OFlags::PATH) || (writable && mode != OFlags::RDWR) || (!writable && !mode.is_empty()) {
        return Err(ShmError::Device(if writable { "own arena not opened read-write" } else { "peer arena not opened read-only" }));
    }
    let size = u64::try_from(st.st_size).unwrap_or(0);
    if size < len {
        return Err(ShmError::TooSmall { size, len });
    }
    Ok(())
}

/// `memfd_create("fido-arena", MFD_CLOEXEC|MFD_ALLOW_SEALING)` + `ftruncate(len)`.
/// The file stays sparse: pages exist only once touched.
pub(crate) fn create_memfd(len: u64) -> Result<OwnedFd, ShmError> {
    let fd = fs::memfd_create(
        "fido-arena",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .map_err(ShmError::io("memfd_create"))?;
    fs::ftruncate(&fd, len).map_err(ShmError::io("ftruncate arena"))?;
    Ok(fd)
}

/// Seal for good: SHRINK|GROW|FUTURE_WRITE, then SEAL so no seal can be added or
/// (ever) removed. Must come after the owner's RW mapping exists: after this no
/// new writable mapping can be created by anyone.
pub(crate) fn seal(fd: BorrowedFd<'_>) -> Result<(), ShmError> {
    fs::fcntl_add_seals(fd, REQUIRED_SEALS | SealFlags::SEAL)
        .map_err(ShmError::io("fcntl(F_ADD_SEALS)"))
}

/// A new read-only file description of the memfd, to grant to peers. A dup()
/// would share our description's access mode; re-opening via /proc creates a
/// fresh O_RDONLY one, which the kernel will never let anyone map writable.
pub(crate) fn ro_reopen(fd: BorrowedFd<'_>) -> Result<OwnedFd, ShmError> {
    let path = format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd());
    fs::open(
        path.as_str(),
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(ShmError::io("open /proc/self/fd/N read-only"))
}
