//! Sealing and isolation: what a peer holding a grant can and cannot do. These
//! hold for root too: seals and file-description access modes are not
//! permission checks that CAP_SYS_ADMIN / CAP_DAC_OVERRIDE bypass.

use fido_shm::{check_grant, ShmError, UnplacedArena};
use rustix::fd::{AsFd, AsRawFd, OwnedFd};
use rustix::fs::{self, MemfdFlags, Mode, OFlags, SealFlags};
use rustix::io::Errno;
use rustix::mm::{self, MapFlags, MprotectFlags, ProtFlags};
use std::ffi::c_void;

const LEN: usize = 1 << 20;

fn try_map(fd: impl AsFd, prot: ProtFlags, flags: MapFlags) -> Result<*mut c_void, Errno> {
    // SAFETY: no MAP_FIXED; the kernel picks free address space.
    unsafe { mm::mmap(std::ptr::null_mut(), LEN, prot, flags, fd, 0) }
}

fn unmap(p: *mut c_void) {
    // SAFETY: `p` is a LEN-byte mapping this test created.
    unsafe { mm::munmap(p, LEN) }.unwrap();
}

fn reopen_rdwr(fd: &OwnedFd) -> Result<OwnedFd, Errno> {
    fs::open(
        format!("/proc/self/fd/{}", fd.as_raw_fd()).as_str(),
        OFlags::RDWR | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

#[test]
fn ro_fd_cannot_be_mapped_writable() {
    let arena = UnplacedArena::create(LEN as u64, false).unwrap();
    let ro = arena.ro_fd().unwrap();
    assert_eq!(
        fs::fcntl_getfl(&ro).unwrap() & OFlags::ACCMODE,
        OFlags::RDONLY
    );
    assert_eq!(
        try_map(&ro, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED),
        Err(Errno::ACCESS)
    );
    check_grant(ro.as_fd(), LEN as u64).unwrap();
}

#[test]
fn ro_mapping_cannot_be_mprotected_writable() {
    let arena = UnplacedArena::create(LEN as u64, true).unwrap();
    let ro = arena.ro_fd().unwrap();
    let p = try_map(&ro, ProtFlags::READ, MapFlags::SHARED).unwrap();
    // SAFETY: `p` is our LEN-byte read-only mapping; nothing references it.
    let r = unsafe { mm::mprotect(p, LEN, MprotectFlags::READ | MprotectFlags::WRITE) };
    assert_eq!(r, Err(Errno::ACCESS));
    unmap(p);
}

#[test]
fn proc_reopen_rdwr_cannot_write() {
    let arena = UnplacedArena::create(LEN as u64, false).unwrap();
    let ro = arena.ro_fd().unwrap();
    // The memfd inode is mode 0777, so the re-open itself may succeed (it does
    // for root and the owner); F_SEAL_FUTURE_WRITE must then refuse every way of
    // writing through it.
    let rw = match reopen_rdwr(&ro) {
        Ok(fd) => fd,
        Err(e) => {
            assert_eq!(e, Errno::ACCESS);
            return;
        }
    };
    assert_eq!(
        try_map(&rw, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED),
        Err(Errno::PERM)
    );
    // A read-only shared mapping of the RDWR description must not be upgradable.
    let p = try_map(&rw, ProtFlags::READ, MapFlags::SHARED).unwrap();
    // SAFETY: `p` is our LEN-byte read-only mapping; nothing references it.
    let r = unsafe { mm::mprotect(p, LEN, MprotectFlags::READ | MprotectFlags::WRITE) };
    assert!(
        r.is_err(),
        "mprotect(PROT_WRITE) succeeded on a FUTURE_WRITE-sealed memfd"
    );
    unmap(p);
    assert_eq!(rustix::io::write(&rw, b"x"), Err(Errno::PERM));
    assert_eq!(fs::ftruncate(&rw, 0), Err(Errno::PERM));
    assert_eq!(fs::ftruncate(&rw, 2 * LEN as u64), Err(Errno::PERM));
    assert_eq!(fs::ftruncate(&ro, 0), Err(Errno::INVAL)); // not even opened for writing
                                                          // Seals cannot be removed or added (F_SEAL_SEAL).
    assert_eq!(fs::fcntl_add_seals(&rw, SealFlags::WRITE), Err(Errno::PERM));
    // The grant still passes, the writable description does not.
    check_grant(ro.as_fd(), LEN as u64).unwrap();
    assert_eq!(check_grant(rw.as_fd(), LEN as u64), Err(ShmError::Writable));
}

#[test]
fn owner_keeps_writing_after_sealing() {
    use fido_shm::{AddressSpace, ModeRequest, PgvasGeometry};
    use std::sync::Arc;
    let geo = PgvasGeometry {
        base: 0x6100_0000_0000,
        slot_size: 1 << 30,
        slots: 4,
    };
    let owner_space = Arc::new(AddressSpace::new(geo, ModeRequest::ForceSwizzle).unwrap());
    let arena = UnplacedArena::create(LEN as u64, false)
        .unwrap()
        .place(&owner_space, 2, 7)
        .unwrap();
    let ro = arena.ro_fd().unwrap();
    let mut b = arena.alloc(100).unwrap();
    b.copy_from_slice(&[0x5A; 100]);
    let p = try_map(&ro, ProtFlags::READ, MapFlags::SHARED).unwrap();
    // SAFETY: `p` maps LEN readable bytes and the buffer lies inside the arena.
    let seen = unsafe { std::slice::from_raw_parts(p.cast::<u8>().add(b.offset() as usize), 100) };
    assert_eq!(seen, &[0x5A; 100][..]);
    b[0] = 1;
    assert_eq!(
        seen[0], 1,
        "peer sees the owner's later writes (shared, not a copy)"
    );
    unmap(p);
}

#[test]
fn check_grant_refusals() {
    // Unsealed memfd, re-opened read-only: refused for missing seals.
    let fd = fs::memfd_create("t", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    fs::ftruncate(&fd, LEN as u64).unwrap();
    let ro = fs::open(
        format!("/proc/self/fd/{}", fd.as_raw_fd()).as_str(),
        OFlags::RDONLY,
        Mode::empty(),
    )
    .unwrap();
    assert!(matches!(
        check_grant(ro.as_fd(), 1),
        Err(ShmError::NotSealed { .. })
    ));
    // Partly sealed (no FUTURE_WRITE): still refused.
    fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
    assert!(matches!(
        check_grant(ro.as_fd(), 1),
        Err(ShmError::NotSealed { .. })
    ));
    // Fully sealed but the O_RDWR description: refused as writable.
    fs::fcntl_add_seals(&fd, SealFlags::FUTURE_WRITE).unwrap();
    assert_eq!(check_grant(fd.as_fd(), 1), Err(ShmError::Writable));
    check_grant(ro.as_fd(), LEN as u64).unwrap();
    // Size and length checks.
    assert_eq!(
        check_grant(ro.as_fd(), LEN as u64 + 1),
        Err(ShmError::TooSmall {
            size: LEN as u64,
            len: LEN as u64 + 1
        })
    );
    assert_eq!(check_grant(ro.as_fd(), 0), Err(ShmError::InvalidLength(0)));
    // Not a memfd at all.
    let file = tempfile::tempfile().unwrap();
    assert!(matches!(
        check_grant(file.as_fd(), 1),
        Err(ShmError::NotSealed { .. })
    ));
    // An O_PATH handle is no grant either.
    let path = fs::open(
        format!("/proc/self/fd/{}", ro.as_raw_fd()).as_str(),
        OFlags::PATH | OFlags::CLOEXEC,
        Mode::empty(),
    );
    if let Ok(path) = path {
        assert!(check_grant(path.as_fd(), 1).is_err());
    }
}
