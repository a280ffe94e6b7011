//! PGVAS window, swizzle fallback, and the resolver.
//!
//! Tests run as threads of one process, so each test that reserves a window
//! uses its own base (80 TiB and up, clear of the default 16..80 TiB window,
//! which only `default_geometry_reserves` uses).

use fido_shm::{
    AddressMode, AddressSpace, Arena, GPtr, ModeRequest, PgvasGeometry, ShmError, UnplacedArena,
};
use std::sync::Arc;

const GIB: u64 = 1 << 30;

/// A small geometry, 8 slots of 1 GiB, at a per-test base.
fn geo(test_no: u64) -> PgvasGeometry {
    PgvasGeometry {
        base: 0x5000_0000_0000 + test_no * 0x10_0000_0000,
        slot_size: GIB,
        slots: 8,
    }
}

fn space(g: PgvasGeometry, mode: ModeRequest) -> Arc<AddressSpace> {
    Arc::new(AddressSpace::new(g, mode).unwrap())
}

/// An owner arena in `slot` of its own swizzle space (the "other domain").
fn owner_arena(g: PgvasGeometry, slot: u32, owner: u64, len: u64) -> Arc<Arena> {
    UnplacedArena::create(len, false)
        .unwrap()
        .place(&space(g, ModeRequest::ForceSwizzle), slot, owner)
        .unwrap()
}

fn read_u64(p: std::ptr::NonNull<u8>) -> u64 {
    // SAFETY: callers pass pointers returned by `resolve(_, 8)`, i.e. 8 readable bytes.
    unsafe { p.as_ptr().cast::<u64>().read_unaligned() }
}

#[test]
fn default_geometry_reserves() {
    let s = AddressSpace::new(PgvasGeometry::DEFAULT, ModeRequest::Auto).unwrap();
    assert_eq!(
        s.mode(),
        AddressMode::Pgvas,
        "a stock x86-64 process can reserve the default window"
    );
    assert_eq!(s.slot_base(3), GPtr((16 << 40) + 3 * (64 << 30)));
    assert_eq!(
        s.slot_of(GPtr((16 << 40) + 5 * (64 << 30) + 17)),
        Some((5, 17))
    );
    assert_eq!(s.slot_of(GPtr((16 << 40) - 1)), None);
    assert_eq!(s.slot_of(GPtr(80 << 40)), None);
}

#[test]
fn second_space_falls_back_to_swizzle() {
    let g = geo(1);
    let a = AddressSpace::new(g, ModeRequest::Auto).unwrap();
    let b = AddressSpace::new(g, ModeRequest::Auto).unwrap();
    assert_eq!(a.mode(), AddressMode::Pgvas);
    assert_eq!(b.mode(), AddressMode::Swizzle);
    drop(a);
    // The window is released with its space.
    let c = AddressSpace::new(g, ModeRequest::Auto).unwrap();
    assert_eq!(c.mode(), AddressMode::Pgvas);
    assert_eq!(
        AddressSpace::new(g, ModeRequest::ForceSwizzle)
            .unwrap()
            .mode(),
        AddressMode::Swizzle
    );
}

#[test]
fn invalid_geometry_is_refused() {
    let bad = PgvasGeometry {
        base: 0x5000_0000_0001,
        slot_size: GIB,
        slots: 8,
    };
    assert_eq!(
        AddressSpace::new(bad, ModeRequest::Auto).unwrap_err(),
        ShmError::InvalidGeometry
    );
    let bad = PgvasGeometry {
        base: 0x7fff_0000_0000,
        slot_size: GIB,
        slots: 1 << 20,
    };
    assert_eq!(
        AddressSpace::new(bad, ModeRequest::Auto).unwrap_err(),
        ShmError::InvalidGeometry
    );
}

/// The owner writes a pointer chain into its arena; the peer follows it through
/// `resolve` in both modes and reads identical data.
fn pointer_chain(g: PgvasGeometry, mode: ModeRequest, expect: AddressMode) {
    let owner = owner_arena(g, 3, 33, 4 << 20);
    let mut target = owner.alloc(64).unwrap();
    target[..5].copy_from_slice(b"hello");
    let mut head = owner.alloc(8).unwrap();
    head.copy_from_slice(&target.gptr().addr().to_le_bytes());
    assert_eq!(target.gptr(), GPtr(g.base + 3 * GIB + target.offset()));

    let peer = space(g, mode);
    assert_eq!(peer.mode(), expect);
    let m = peer
        .map_peer(3, 33, owner.ro_fd().unwrap(), owner.len())
        .unwrap();
    assert!(!m.is_own());
    assert_eq!(
        (m.slot(), m.owner(), m.len(), m.global_base()),
        (3, 33, owner.len(), GPtr(g.base + 3 * GIB))
    );
    if expect == AddressMode::Pgvas {
        assert_eq!(
            m.local_base() as u64,
            g.base + 3 * GIB,
            "peer mapping sits at exactly G(slot)"
        );
    } else {
        assert_ne!(m.local_base() as u64, g.base + 3 * GIB);
    }
    let (p, _keep) = peer.resolve(head.gptr(), 8).unwrap();
    let g2 = GPtr(read_u64(p));
    assert_eq!(g2, target.gptr());
    let (q, _keep) = peer.resolve(g2, 5).unwrap();
    if expect == AddressMode::Pgvas {
        assert_eq!(
            q.as_ptr() as u64,
            g2.addr(),
            "in PGVAS a global pointer is the local address"
        );
    }
    assert_eq!(
        // SAFETY: resolve checked 5 readable bytes at q.
        unsafe { std::slice::from_raw_parts(q.as_ptr(), 5) },
        b"hello"
    );
    // Later writes by the owner are visible (shared mapping).
    target[0] = b'J';
    // SAFETY: as above.
    assert_eq!(unsafe { *q.as_ptr() }, b'J');
}

#[test]
fn pointer_chain_pgvas() {
    pointer_chain(geo(2), ModeRequest::Auto, AddressMode::Pgvas);
}

#[test]
fn pointer_chain_swizzle() {
    pointer_chain(geo(3), ModeRequest::ForceSwizzle, AddressMode::Swizzle);
}

#[test]
fn own_arena_is_placed_and_resolvable() {
    for (i, mode) in [(4, ModeRequest::Auto), (5, ModeRequest::ForceSwizzle)] {
        let g = geo(i);
        let s = space(g, mode);
        let unplaced = UnplacedArena::create(2 << 20, true).unwrap();
        assert_eq!(unplaced.len(), 2 << 20);
        let grant = unplaced.ro_fd().unwrap(); // granted before placement, as at join
        let a = unplaced.place(&s, 6, 1).unwrap();
        assert_eq!((a.slot(), a.base()), (6, GPtr(g.base + 6 * GIB)));
        let m = s.mapping(6).unwrap();
        assert!(m.is_own());
        if s.mode() == AddressMode::Pgvas {
            assert_eq!(m.local_base() as u64, a.base().addr());
        }
        let mut b = a.alloc(1000).unwrap();
        b[999] = 9;
        let (p, _) = s.resolve(b.gptr(), 1000).unwrap();
        assert_eq!(p.as_ptr() as *const u8, b.as_ptr());
        assert!(a.contains(b.gptr(), 1000));
        assert!(!a.contains(a.base().add(a.len()).unwrap(), 1));
        assert!(!a.contains(GPtr(a.base().addr() - 1), 1));
        assert!(!a.contains(b.gptr(), u64::MAX));
        // The grant made before the move still reads the same memory.
        let other = space(g, ModeRequest::ForceSwizzle);
        let pm = other.map_peer(6, 1, grant, a.len()).unwrap();
        let (q, _) = other.resolve(b.gptr(), 1000).unwrap();
        // SAFETY: resolve checked 1000 readable bytes at q.
        assert_eq!(unsafe { *q.as_ptr().add(999) }, 9);
        drop(pm);
        // The slot is taken.
        let again = UnplacedArena::create(1 << 20, false).unwrap();
        assert!(matches!(
            again.place(&s, 6, 2),
            Err(ShmError::SlotBusy { slot: 6, owner: 1 })
        ));
        let too_big = UnplacedArena::create(2 * GIB, false).unwrap();
        assert!(matches!(
            too_big.place(&s, 7, 2),
            Err(ShmError::TooLarge { .. })
        ));
    }
}

#[test]
fn resolve_rejects_bad_pointers() {
    for (i, mode) in [(6, ModeRequest::Auto), (7, ModeRequest::ForceSwizzle)] {
        let g = geo(i);
        let owner = owner_arena(g, 1, 11, 1 << 20);
        let s = space(g, mode);
        s.map_peer(1, 11, owner.ro_fd().unwrap(), owner.len())
            .unwrap();
        let base = g.base + GIB;
        let end = base + (1 << 20);
        assert!(s.resolve(GPtr(base), 1 << 20).is_ok());
        assert!(s.resolve(GPtr(end), 0).is_ok());
        assert!(s.resolve(GPtr(end - 8), 8).is_ok());
        assert_eq!(
            s.resolve(GPtr(end - 8), 9).unwrap_err(),
            ShmError::OutOfBounds {
                gptr: GPtr(end - 8),
                len: 9
            }
        );
        assert!(matches!(
            s.resolve(GPtr(end), 1),
            Err(ShmError::OutOfBounds { .. })
        ));
        // Past the arena but still inside its slot.
        assert!(matches!(
            s.resolve(GPtr(base + GIB - 1), 1),
            Err(ShmError::OutOfBounds { .. })
        ));
        // u64 overflow of offset + len.
        assert!(matches!(
            s.resolve(GPtr(base + 8), u64::MAX),
            Err(ShmError::OutOfBounds { .. })
        ));
        assert!(matches!(
            s.resolve(GPtr(base), u64::MAX - base + 1),
            Err(ShmError::OutOfBounds { .. })
        ));
        // Outside the window, both sides, and far away.
        assert_eq!(
            s.resolve(GPtr(g.base - 1), 1).unwrap_err(),
            ShmError::OutsideWindow(GPtr(g.base - 1))
        );
        assert!(matches!(
            s.resolve(GPtr(g.base + 8 * GIB), 1),
            Err(ShmError::OutsideWindow(_))
        ));
        assert!(matches!(
            s.resolve(GPtr::NULL, 1),
            Err(ShmError::OutsideWindow(_))
        ));
        assert!(matches!(
            s.resolve(GPtr(u64::MAX), 1),
            Err(ShmError::OutsideWindow(_))
        ));
        // Unmapped slot.
        assert_eq!(
            s.resolve(GPtr(g.base + 2 * GIB), 1).unwrap_err(),
            ShmError::NotMapped { slot: 2 }
        );
        assert_eq!(
            s.resolve(GPtr(g.base), 1).unwrap_err(),
            ShmError::NotMapped { slot: 0 }
        );
        // GPtr arithmetic is overflow-checked too.
        assert_eq!(GPtr(u64::MAX).add(1), None);
        assert_eq!(GPtr(5).add(3), Some(GPtr(8)));
    }
}

#[test]
fn map_peer_checks_and_slot_rules() {
    let g = geo(8);
    let owner = owner_arena(g, 2, 22, 1 << 20);
    let s = space(g, ModeRequest::Auto);
    assert_eq!(s.mode(), AddressMode::Pgvas);
    let ro = || owner.ro_fd().unwrap();
    assert!(matches!(
        s.map_peer(8, 22, ro(), 1 << 20),
        Err(ShmError::SlotOutOfRange { slot: 8, slots: 8 })
    ));
    assert!(matches!(
        s.map_peer(2, 22, ro(), 0),
        Err(ShmError::InvalidLength(0))
    ));
    assert!(matches!(
        s.map_peer(2, 22, ro(), (1 << 20) + 1),
        Err(ShmError::TooSmall { .. })
    ));
    assert!(matches!(
        s.map_peer(2, 22, ro(), GIB + 1),
        Err(ShmError::TooLarge { .. })
    ));
    // A shorter announced length is fine: the bound is what was announced.
    let m = s.map_peer(2, 22, ro(), 4096).unwrap();
    assert!(matches!(
        s.resolve(GPtr(g.base + 2 * GIB + 4096), 1),
        Err(ShmError::OutOfBounds { .. })
    ));
    // Same owner again: the same mapping. Another owner: busy.
    let m2 = s.map_peer(2, 22, ro(), 4096).unwrap();
    assert!(Arc::ptr_eq(&m, &m2));
    assert_eq!(
        s.map_peer(2, 99, ro(), 4096).unwrap_err(),
        ShmError::SlotBusy { slot: 2, owner: 22 }
    );
    // Unmap: gone from the table, but the pages live while an Arc does.
    let taken = s.unmap(2).unwrap();
    assert!(s.mapping(2).is_none());
    assert!(matches!(
        s.resolve(GPtr(g.base + 2 * GIB), 1),
        Err(ShmError::NotMapped { slot: 2 })
    ));
    // SAFETY: `taken` keeps the 4096-byte read-only mapping alive.
    let _ = unsafe { *taken.local_base() };
    drop(m2);
    assert_eq!(
        s.map_peer(2, 22, ro(), 1 << 20).unwrap_err(),
        ShmError::SlotDraining { slot: 2 }
    );
    drop((m, taken));
    // Now the slot is a PROT_NONE reservation again and can be refilled.
    let m3 = s.map_peer(2, 22, ro(), 1 << 20).unwrap();
    assert_eq!(m3.local_base() as u64, g.base + 2 * GIB);
    assert_eq!(m3.len(), 1 << 20);
    assert!(s.unmap(5).is_none());
    assert!(s.unmap(1000).is_none());
    assert!(s.mapping(1000).is_none());
}

#[test]
fn mapping_outlives_its_space() {
    let g = geo(9);
    let owner = owner_arena(g, 0, 5, 1 << 20);
    let mut b = owner.alloc(8).unwrap();
    b.copy_from_slice(&42u64.to_le_bytes());
    let s = AddressSpace::new(g, ModeRequest::Auto).unwrap();
    assert_eq!(s.mode(), AddressMode::Pgvas);
    s.map_peer(0, 5, owner.ro_fd().unwrap(), owner.len())
        .unwrap();
    let (p, keep) = s.resolve(b.gptr(), 8).unwrap();
    drop(s);
    // The window stays reserved (and the arena mapped) while the mapping lives.
    assert_eq!(read_u64(p), 42);
    assert_eq!(
        AddressSpace::new(g, ModeRequest::Auto).unwrap().mode(),
        AddressMode::Swizzle
    );
    drop(keep);
    assert_eq!(
        AddressSpace::new(g, ModeRequest::Auto).unwrap().mode(),
        AddressMode::Pgvas
    );
}

#[test]
fn concurrent_resolve_and_remap() {
    let g = geo(10);
    let owner = owner_arena(g, 4, 44, 1 << 20);
    let mut b = owner.alloc(8).unwrap();
    b.copy_from_slice(&7u64.to_le_bytes());
    let gp = b.gptr();
    let s = space(g, ModeRequest::Auto);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (s, stop) = (s.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut hits = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    match s.resolve(gp, 8) {
                        Ok((p, _keep)) => {
                            assert_eq!(read_u64(p), 7);
                            hits += 1;
                        }
                        Err(ShmError::NotMapped { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
                hits
            })
        })
        .collect();
    for _ in 0..300 {
        loop {
            match s.map_peer(4, 44, owner.ro_fd().unwrap(), owner.len()) {
                Ok(_) => break,
                Err(ShmError::SlotDraining { .. }) => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        s.unmap(4);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
}

/// Cross-process: a child process (this test binary, re-executed) maps the
/// grant it inherited, at the same address, follows a pointer, and fails to
/// write. The fd is passed by inheritance, standing in for SCM_RIGHTS.
#[test]
fn cross_process_grant() {
    use rustix::fd::AsRawFd;
    let g = geo(11);
    let owner = owner_arena(g, 5, 55, 1 << 20);
    let mut target = owner.alloc(16).unwrap();
    target.copy_from_slice(b"across processes");
    let mut head = owner.alloc(8).unwrap();
    head.copy_from_slice(&target.gptr().addr().to_le_bytes());
    // dup() gives a descriptor without FD_CLOEXEC, so the child inherits it.
    let ro = owner.ro_fd().unwrap();
    let inherited = rustix::io::dup(&ro).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "cross_process_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            "FIDO_SHM_CHILD",
            format!(
                "{} {} {}",
                inherited.as_raw_fd(),
                head.gptr().addr(),
                owner.len()
            ),
        )
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("CHILD OK across processes"), "{stdout}");
}

#[test]
fn cross_process_child() {
    use rustix::fd::{FromRawFd, OwnedFd};
    use rustix::mm::{self, MprotectFlags};
    let Ok(args) = std::env::var("FIDO_SHM_CHILD") else {
        return;
    };
    let v: Vec<u64> = args.split(' ').map(|x| x.parse().unwrap()).collect();
    // SAFETY: the parent passed us this inherited descriptor, which nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(v[0] as i32) };
    let g = geo(11);
    let s = AddressSpace::new(g, ModeRequest::Auto).unwrap();
    assert_eq!(s.mode(), AddressMode::Pgvas);
    let m = s.map_peer(5, 55, fd, v[2]).unwrap();
    assert_eq!(m.local_base() as u64, g.base + 5 * GIB);
    let (p, _) = s.resolve(GPtr(v[1]), 8).unwrap();
    let (q, _) = s.resolve(GPtr(read_u64(p)), 16).unwrap();
    assert_eq!(q.as_ptr() as u64, read_u64(p));
    // SAFETY: resolve checked 16 readable bytes.
    let text = unsafe { std::slice::from_raw_parts(q.as_ptr(), 16) };
    // SAFETY: the mapping is alive (`m`); mprotect only changes protections and must fail.
    let r = unsafe {
        mm::mprotect(
            m.local_base() as *mut _,
            4096,
            MprotectFlags::READ | MprotectFlags::WRITE,
        )
    };
    assert!(r.is_err(), "peer mapping became writable");
    println!("CHILD OK {}", std::str::from_utf8(text).unwrap());
}
