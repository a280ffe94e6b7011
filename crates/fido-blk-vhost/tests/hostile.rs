//! The back end driven by a front end of our own (rust-vmm's vhost-user
//! `Frontend`, no QEMU): a fake guest's memory is a memfd, and the test
//! writes descriptor chains into its virtqueue by hand — good ones, many at
//! once, and hostile ones. Every chain is answered with the right status,
//! nothing is written outside the device-writable buffers the chains name
//! (the rest of guest memory keeps its canary), the back end keeps serving,
//! a second front end on the same socket is served after the first
//! disconnects, and a storage domain that goes away fails the guest's
//! requests until one serves the device again.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fido::{Domain, JoinOptions};
use fido_blk::{BackingOptions, BlkClient, FileBackend, ServeOptions};
use fido_blk_vhost::{VhostBlk, VhostBlkOptions};
use fido_test_support::{Defaults, TestBroker};
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};
use vmm_sys_util::eventfd::EventFd;

const MEM: u64 = 4 << 20;
/// The front end's (pretend) address of guest physical 0.
const VA: u64 = 0x7f00_0000_0000;
const QSIZE: u16 = 16;
const DESC: u64 = 0x0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
/// Everything from here on is data buffers, filled with the canary.
const DATA: u64 = 0x10000;
const CANARY: u8 = 0xa5;
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_GET_ID: u32 = 8;
const S_OK: u8 = 0;
const S_IOERR: u8 = 1;
const S_UNSUPP: u8 = 2;
const DISK: u64 = 1 << 20;

struct Guest {
    mem: GuestMemoryMmap,
    // Held: dropping it disconnects.
    _fe: Frontend,
    kick: EventFd,
    _call: EventFd,
    next_avail: u16,
    next_used: u16,
}

/// One descriptor: guest address, length, writable.
type D = (u64, u32, bool);

impl Guest {
    fn connect(sock: &std::path::Path, file: &File, mem: GuestMemoryMmap) -> Guest {
        let mut fe = Frontend::connect(sock, 1).unwrap();
        fe.set_owner().unwrap();
        let features = fe.get_features().unwrap();
        // Everything offered but EVENT_IDX (bit 29): interrupts after every batch.
        fe.set_features(features & !(1 << 29)).unwrap();
        let pf = fe.get_protocol_features().unwrap();
        assert!(pf.contains(
            VhostUserProtocolFeatures::CONFIG
                | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
                | VhostUserProtocolFeatures::MQ
        ));
        fe.set_protocol_features(VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ)
            .unwrap();
        let (_, config) = fe
            .get_config(0, 60, VhostUserConfigFlags::empty(), &[0u8; 60])
            .unwrap();
        assert_eq!(
            u64::from_le_bytes(config[0..8].try_into().unwrap()),
            DISK / 512,
            "capacity"
        );
        fe.set_mem_table(&[VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: MEM,
            userspace_addr: VA,
            mmap_offset: 0,
            mmap_handle: file.as_raw_fd(),
        }])
        .unwrap();
        // A fresh ring: zero it, canary the data area.
        mem.write_slice(&vec![0u8; DATA as usize], GuestAddress(0))
            .unwrap();
        mem.write_slice(&vec![CANARY; (MEM - DATA) as usize], GuestAddress(DATA))
            .unwrap();
        fe.set_vring_num(0, QSIZE).unwrap();
        fe.set_vring_addr(
            0,
            &VringConfigData {
                queue_max_size: QSIZE,
                queue_size: QSIZE,
                flags: 0,
                desc_table_addr: VA + DESC,
                used_ring_addr: VA + USED,
                avail_ring_addr: VA + AVAIL,
                log_addr: None,
            },
        )
        .unwrap();
        fe.set_vring_base(0, 0).unwrap();
        let call = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let kick = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        fe.set_vring_call(0, &call).unwrap();
        fe.set_vring_kick(0, &kick).unwrap();
        fe.set_vring_enable(0, true).unwrap();
        Guest {
            mem,
            _fe: fe,
            kick,
            _call: call,
            next_avail: 0,
            next_used: 0,
        }
    }

    /// Writes `chains` into the descriptor table (one after another) and the
    /// available ring, then kicks once. Returns the head of each.
    fn submit(&mut self, chains: &[Vec<D>]) -> Vec<u16> {
        let mut idx = 0u16;
        let mut heads = Vec::new();
        for chain in chains {
            heads.push(idx);
            for (i, &(addr, len, writable)) in chain.iter().enumerate() {
                let last = i + 1 == chain.len();
                let flags = if last { 0 } else { F_NEXT } | if writable { F_WRITE } else { 0 };
                self.desc(idx, addr, len, flags, idx + 1);
                idx += 1;
            }
        }
        assert!(idx <= QSIZE);
        for &h in &heads {
            let slot = AVAIL + 4 + 2 * u64::from(self.next_avail % QSIZE);
            self.mem.write_obj(h, GuestAddress(slot)).unwrap();
            self.next_avail = self.next_avail.wrapping_add(1);
        }
        self.mem
            .write_obj(self.next_avail, GuestAddress(AVAIL + 2))
            .unwrap();
        self.kick.write(1).unwrap();
        heads
    }

    fn desc(&self, idx: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = DESC + 16 * u64::from(idx);
        self.mem.write_obj(addr, GuestAddress(at)).unwrap();
        self.mem.write_obj(len, GuestAddress(at + 8)).unwrap();
        self.mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
        self.mem
            .write_obj(next % QSIZE, GuestAddress(at + 14))
            .unwrap();
    }

    /// Waits for `n` more used entries; returns (head, len) of each.
    fn used(&mut self, n: u16) -> Vec<(u16, u32)> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let want = self.next_used.wrapping_add(n);
        while self.mem.read_obj::<u16>(GuestAddress(USED + 2)).unwrap() != want {
            assert!(
                Instant::now() < deadline,
                "only {} of {n} chains came back",
                self.mem
                    .read_obj::<u16>(GuestAddress(USED + 2))
                    .unwrap()
                    .wrapping_sub(self.next_used)
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut out = Vec::new();
        while self.next_used != want {
            let at = USED + 4 + 8 * u64::from(self.next_used % QSIZE);
            let id: u32 = self.mem.read_obj(GuestAddress(at)).unwrap();
            let len: u32 = self.mem.read_obj(GuestAddress(at + 4)).unwrap();
            out.push((id as u16, len));
            self.next_used = self.next_used.wrapping_add(1);
        }
        out
    }

    fn header(&self, at: u64, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(at)).unwrap();
    }

    fn byte(&self, at: u64) -> u8 {
        self.mem.read_obj(GuestAddress(at)).unwrap()
    }

    fn bytes(&self, at: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.read_slice(&mut v, GuestAddress(at)).unwrap();
        v
    }

    /// Checks that every data byte outside `allowed` (address, length) still holds the canary.
    fn assert_canary_except(&self, allowed: &[(u64, u64)]) {
        let all = self.bytes(DATA, (MEM - DATA) as usize);
        for (i, &b) in all.iter().enumerate() {
            let a = DATA + i as u64;
            if b != CANARY && !allowed.iter().any(|&(s, l)| a >= s && a < s + l) {
                panic!("the back end wrote guest memory it was not given: {a:#x} = {b:#x}");
            }
        }
    }
}

fn guest_memory() -> (File, GuestMemoryMmap) {
    let fd = rustix::fs::memfd_create("fake-guest", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let file = File::from(fd);
    file.set_len(MEM).unwrap();
    let region =
        MmapRegion::from_file(FileOffset::new(file.try_clone().unwrap(), 0), MEM as usize).unwrap();
    let mem =
        GuestMemoryMmap::from_regions(vec![GuestRegionMmap::new(region, GuestAddress(0)).unwrap()])
            .unwrap();
    (file, mem)
}

#[test]
fn hostile_chains_are_answered_and_nothing_else_is_written() {
    let b = TestBroker::<Defaults>::start();
    let storage = Domain::join(
        JoinOptions::new("storage")
            .broker(&b.socket)
            .arena_len(64 << 20),
    )
    .unwrap();
    let opts = BackingOptions {
        max_transfer: 64 << 10,
        ..Default::default()
    };
    let server = fido_blk::serve(
        &storage,
        "h",
        Arc::new(FileBackend::ram(DISK, &opts).unwrap()),
        ServeOptions::default(),
    )
    .unwrap();
    let front = Domain::join(
        JoinOptions::new("vhost")
            .broker(&b.socket)
            .arena_len(64 << 20),
    )
    .unwrap();
    let dev = VhostBlk::new(
        BlkClient::connect(&front, "h").unwrap(),
        &VhostBlkOptions {
            queue_size: QSIZE,
            ..Default::default()
        },
    )
    .unwrap();
    let dev = Arc::new(dev);
    let sock = b.dir.path().join("vhost.sock");
    let stop = Arc::new(AtomicBool::new(false));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let serving = {
        let (dev, sock, stop) = (dev.clone(), sock.clone(), stop.clone());
        std::thread::spawn(move || dev.serve(&sock, &stop, move || ready_tx.send(()).unwrap()))
    };
    ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();

    let (file, mem) = guest_memory();
    let mut g = Guest::connect(&sock, &file, mem.clone());
    let hdr = |i: u64| 0x4000 + 0x100 * i; // headers (written by the test: outside the canary area)
    let st = |i: u64| DATA + 0x8000 + 0x10 * i; // status bytes
    let buf = |i: u64| DATA + 0x10000 + 0x10000 * i; // 64 KiB data buffers

    // 1. Writes and reads, several in flight, a 96 KiB write split over two
    //    descriptors and two fido-blk requests (max_transfer 64 KiB).
    let pattern: Vec<u8> = (0..96 * 1024u32)
        .map(|i| (i * 7 + i / 4096) as u8)
        .collect();
    g.mem
        .write_slice(&pattern[..65536], GuestAddress(buf(0)))
        .unwrap();
    g.mem
        .write_slice(&pattern[65536..], GuestAddress(buf(1)))
        .unwrap();
    g.header(hdr(0), T_OUT, 16);
    let heads = g.submit(&[vec![
        (hdr(0), 16, false),
        (buf(0), 65536, false),
        (buf(1), 32768, false),
        (st(0), 1, true),
    ]]);
    assert_eq!(g.used(1), vec![(heads[0], 1)]);
    assert_eq!(g.byte(st(0)), S_OK);
    for i in 0..4 {
        g.header(hdr(1 + i), T_IN, 16 + 48 * i);
    }
    let chains: Vec<Vec<D>> = (0..4)
        .map(|i| {
            vec![
                (hdr(1 + i), 16, false),
                (buf(2 + i), 24576, true),
                (st(1 + i), 1, true),
            ]
        })
        .collect();
    g.submit(&chains);
    let used = g.used(4);
    assert!(used.iter().all(|&(_, len)| len == 24577), "{used:?}");
    for i in 0..4u64 {
        assert_eq!(g.byte(st(1 + i)), S_OK);
        assert_eq!(
            g.bytes(buf(2 + i), 24576),
            pattern[(i as usize) * 24576..(i as usize + 1) * 24576],
            "read {i}"
        );
    }
    g.header(hdr(5), T_GET_ID, 0);
    g.submit(&[vec![
        (hdr(5), 16, false),
        (buf(6), 20, true),
        (st(5), 1, true),
    ]]);
    assert_eq!(g.used(1)[0].1, 1 + "fido:h".len() as u32);
    assert_eq!(&g.bytes(buf(6), 6), b"fido:h");
    let mut allowed = vec![(st(0), 6 * 0x10), (buf(0), 0x10000 * 7)];

    // 2. Hostile chains, each answered; none may write outside its writable buffers.
    let hostile_status = |g: &mut Guest, chain: Vec<D>, status_at: u64| -> u8 {
        g.submit(&[chain]);
        g.used(1);
        g.byte(status_at)
    };
    // A read whose data buffer is device-readable: nothing goes into it.
    g.header(hdr(6), T_IN, 0);
    hostile_status(
        &mut g,
        vec![(hdr(6), 16, false), (buf(7), 4096, false), (st(6), 1, true)],
        st(6),
    );
    allowed.push((st(6), 1));
    // Past the end of the disk; sector × 512 overflowing; misaligned length.
    g.header(hdr(7), T_IN, DISK / 512 - 1);
    assert_eq!(
        hostile_status(
            &mut g,
            vec![(hdr(7), 16, false), (buf(8), 1024, true), (st(7), 1, true)],
            st(7)
        ),
        S_IOERR
    );
    g.header(hdr(8), T_IN, u64::MAX / 256);
    assert_eq!(
        hostile_status(
            &mut g,
            vec![(hdr(8), 16, false), (buf(8), 512, true), (st(8), 1, true)],
            st(8)
        ),
        S_IOERR
    );
    g.header(hdr(9), T_OUT, 0);
    assert_eq!(
        hostile_status(
            &mut g,
            vec![(hdr(9), 16, false), (buf(0), 100, false), (st(9), 1, true)],
            st(9)
        ),
        S_IOERR
    );
    // Unknown type.
    g.header(hdr(10), 99, 0);
    assert_eq!(
        hostile_status(
            &mut g,
            vec![(hdr(10), 16, false), (st(10), 1, true)],
            st(10)
        ),
        S_UNSUPP
    );
    // A data buffer outside guest memory; one whose address wraps.
    g.header(hdr(11), T_IN, 0);
    assert_eq!(
        hostile_status(
            &mut g,
            vec![
                (hdr(11), 16, false),
                (MEM + 0x1000, 4096, true),
                (st(11), 1, true)
            ],
            st(11)
        ),
        S_IOERR
    );
    assert_eq!(
        hostile_status(
            &mut g,
            vec![
                (hdr(11), 16, false),
                (u64::MAX - 100, 4096, true),
                (st(12), 1, true)
            ],
            st(12)
        ),
        S_IOERR
    );
    // A data buffer that runs off the end of guest memory: the part inside
    // may be written (it is writable and the guest's), the status says IOERR.
    assert_eq!(
        hostile_status(
            &mut g,
            vec![
                (hdr(11), 16, false),
                (MEM - 512, 4096, true),
                (st(13), 1, true)
            ],
            st(13)
        ),
        S_IOERR
    );
    allowed.push((MEM - 512, 512));
    // No writable status byte: returned with length 0, nothing written.
    g.header(hdr(12), T_IN, 0);
    g.submit(&[vec![(hdr(12), 16, false), (buf(9), 4096, false)]]);
    assert_eq!(g.used(1)[0].1, 0);
    // A descriptor loop (next points back at itself, NEXT set).
    g.header(hdr(13), T_IN, 0);
    g.desc(0, hdr(13), 16, F_NEXT, 0);
    let slot = AVAIL + 4 + 2 * u64::from(g.next_avail % QSIZE);
    g.mem.write_obj(0u16, GuestAddress(slot)).unwrap();
    g.next_avail = g.next_avail.wrapping_add(1);
    g.mem
        .write_obj(g.next_avail, GuestAddress(AVAIL + 2))
        .unwrap();
    g.kick.write(1).unwrap();
    assert_eq!(g.used(1)[0].1, 0, "a looping chain has no status byte");
    for i in 7..=13 {
        allowed.push((st(i), 1));
    }
    g.assert_canary_except(&allowed);

    // 3. Still serving: the first write reads back.
    g.header(hdr(14), T_IN, 16);
    g.submit(&[vec![
        (hdr(14), 16, false),
        (buf(10), 65536, true),
        (buf(11), 32768, true),
        (st(14), 1, true),
    ]]);
    g.used(1);
    assert_eq!(g.byte(st(14)), S_OK);
    assert_eq!(
        [g.bytes(buf(10), 65536), g.bytes(buf(11), 32768)].concat(),
        pattern
    );

    // 4. The front end goes away; a second one on the same socket is served.
    drop(g);
    let mut g = Guest::connect(&sock, &file, mem);
    g.header(hdr(0), T_IN, 16);
    g.submit(&[vec![
        (hdr(0), 16, false),
        (buf(0), 4096, true),
        (st(0), 1, true),
    ]]);
    g.used(1);
    assert_eq!(g.byte(st(0)), S_OK);
    assert_eq!(g.bytes(buf(0), 4096), pattern[..4096]);

    // 5. The storage domain goes away: the guest's requests fail (IOERR, no
    //    hang); once a storage domain serves `h` again they succeed.
    server.stop();
    storage.leave().unwrap();
    g.header(hdr(1), T_IN, 16);
    g.submit(&[vec![
        (hdr(1), 16, false),
        (buf(1), 4096, true),
        (st(1), 1, true),
    ]]);
    g.used(1);
    assert_eq!(g.byte(st(1)), S_IOERR, "no storage domain");
    let storage = Domain::join(
        JoinOptions::new("storage2")
            .broker(&b.socket)
            .arena_len(64 << 20),
    )
    .unwrap();
    let server = fido_blk::serve(
        &storage,
        "h",
        Arc::new(FileBackend::ram(DISK, &opts).unwrap()),
        ServeOptions::default(),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        g.submit(&[vec![
            (hdr(1), 16, false),
            (buf(1), 4096, true),
            (st(1), 1, true),
        ]]);
        g.used(1);
        if g.byte(st(1)) == S_OK {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the back end never reached the restarted storage domain"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        g.bytes(buf(1), 4096),
        vec![0u8; 4096],
        "a new RAM disk reads zeros"
    );
    drop(g);

    let s = dev.stats();
    assert!(s.connections >= 2 && s.unanswerable == 2, "{s:?}");
    assert!(
        s.bytes_copied_from_guest == 96 * 1024 && s.bytes_copied_to_guest >= 96 * 1024 * 2 + 4096,
        "{s:?}"
    );
    assert!(s.errors >= 8, "{s:?}");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    serving.join().unwrap().unwrap();
    assert!(!sock.exists());
    server.stop();
}
