//! Composition domains through a real broker: RAID-1 puts every write on
//! both mirrors with no byte copied by the RAID or storage domains, keeps
//! serving when a mirror is killed with -9 in the middle of a write stream
//! and resyncs it when it comes back; RAID-0 and concatenation put each byte
//! where the layout says across chunk and member boundaries; a member that
//! lies costs errors (or, with a mirror, nothing), never a crash or a hang.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fido::{Domain, Message};
use fido_blk::proto::{self, Info};
use fido_blk::raid::{Layout, MemberState, Raid, RaidOptions};
use fido_blk::{serve, BackingOptions, BlkClient, BlkError, FileBackend, ServeOptions, Server};
use fido_test_support::domains::Patient;
use fido_test_support::ChildProc;

mod common;
use common::pattern;

type TestBroker = fido_test_support::TestBroker<Patient>;

const T: Duration = Duration::from_secs(30);


/// Entry point of child processes (storage domains a test can kill); a
/// no-op when run as an ordinary test.
#[test]
fn child_main() {
    let Ok(role) = std::env::var("FIDO_TEST_ROLE") else { return };
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    let env = |k: &str| std::env::var(k).unwrap();
    match role.as_str() {
        // A storage domain serving FIDO_TEST_NAME from FIDO_TEST_FILE.
        "storage" => {
            let name = env("FIDO_TEST_NAME");
            let d = Domain::join(fido::JoinOptions::new(format!("store-{name}")).broker(env("FIDO_BROKER")).arena_len(32 << 20)).unwrap();
            let backend = FileBackend::open(Path::new(&env("FIDO_TEST_FILE")), &BackingOptions::default()).unwrap();
            let _server = serve(&d, &name, Arc::new(backend), ServeOptions::default()).unwrap();
            println!("ready");
            loop {
                std::thread::sleep(Duration::from_secs(60));
            }
        }
        other => panic!("unknown role {other}"),
    }
}

fn ram(d: &Domain, name: &str, size: u64) -> Server {
    serve(d, name, Arc::new(FileBackend::ram(size, &BackingOptions::default()).unwrap()), ServeOptions::default()).unwrap()
}

fn start(d: &Domain, layout: Layout, members: &[&str], assume_clean: bool) -> Arc<Raid> {
    let mut o = RaidOptions::new(layout, members.iter().map(|s| s.to_string()).collect());
    o.assume_clean = assume_clean;
    Raid::start(d, o).unwrap()
}

fn read_all(c: &BlkClient, offset: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let step = c.info().max_transfer as usize;
    let mut at = 0;
    while at < len {
        let n = (len - at).min(step);
        out.extend(c.read_at(offset + at as u64, n as u32).unwrap().to_vec());
        at += n;
    }
    out
}

fn wait_for(what: &str, timeout: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn raid1_puts_every_write_on_both_mirrors_without_a_copy() {
    let b = TestBroker::start();
    let (s1, s2) = (b.join("store-1"), b.join("store-2"));
    let _m1 = ram(&s1, "m1", 8 << 20);
    let _m2 = ram(&s2, "m2", 8 << 20);
    let rd = b.join("raid");
    let raid = start(&rd, Layout::Mirror, &["m1", "m2"], true);
    assert_eq!(raid.info().size, 8 << 20);
    let server = serve(&rd, "r1", raid.clone(), ServeOptions::default()).unwrap();
    let cd = b.join("client");
    let c = BlkClient::connect(&cd, "r1").unwrap();

    // 48 writes of 64 KiB, 16 in flight at a time, some FUA, scatter-gather.
    let mut model = vec![0u8; 8 << 20];
    let mut in_flight = 0;
    for i in 0..48u64 {
        let offset = (i * 7 % 120) * (64 << 10);
        let data = pattern(64 << 10, i);
        model[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
        let bufs: Vec<fido::Buf> = data
            .chunks(16 << 10)
            .map(|part| {
                let mut buf = c.alloc(part.len()).unwrap();
                buf.copy_from_slice(part);
                buf
            })
            .collect();
        if in_flight == 16 {
            assert!(c.complete(T).unwrap().result.unwrap().is_none());
            in_flight -= 1;
        }
        c.submit_write(i, offset, bufs, i % 5 == 0).unwrap();
        in_flight += 1;
    }
    for _ in 0..in_flight {
        assert!(c.complete(T).unwrap().result.unwrap().is_none());
    }
    c.flush().unwrap();
    // DISCARD and WRITE_ZEROES reach both mirrors too.
    c.write_zeroes(1 << 20, 128 << 10, false, false).unwrap();
    model[1 << 20..(1 << 20) + (128 << 10)].fill(0);

    assert!(read_all(&c, 0, 8 << 20) == model, "read back through the mirror");
    for m in ["m1", "m2"] {
        let direct = BlkClient::connect(&cd, m).unwrap();
        assert!(read_all(&direct, 0, 8 << 20) == model, "mirror {m} holds every write");
    }
    // Neither the RAID nor a storage domain copied a byte: the payloads went
    // from the client's arena to the kernel by pointer through the RAID, and
    // read data from a storage domain's arena to the client.
    assert_eq!(rd.counters().bytes_copied, 0, "the RAID domain copied");
    assert_eq!(s1.counters().bytes_copied, 0);
    assert_eq!(s2.counters().bytes_copied, 0);
    let st = raid.status();
    assert_eq!(st.state, "clean");
    assert!(st.members.iter().all(|m| m.state == MemberState::Up && m.failures == 0));
    assert!(server.stats().writes >= 48);
    // Every payload buffer came back to the client (released by both mirrors).
    drop(c);
}

#[test]
fn raid1_keeps_serving_through_a_kill_9_and_resyncs_the_dirty_regions() {
    const SIZE: u64 = 8 << 20;
    const LEN: usize = 32 << 10;
    let b = TestBroker::start();
    let files: Vec<std::path::PathBuf> = (1..=2).map(|k| b.dir.path().join(format!("mirror{k}.img"))).collect();
    for f in &files {
        std::fs::File::create(f).unwrap().set_len(SIZE).unwrap();
    }
    let spawn = |k: usize| {
        let mut c = ChildProc::spawn("storage", &b.socket, &[("FIDO_TEST_NAME", &format!("k{}", k + 1)), ("FIDO_TEST_FILE", files[k].to_str().unwrap())]);
        c.expect_line("ready", T);
        c
    };
    let _k1 = spawn(0);
    let mut k2 = spawn(1);
    let rd = b.join("raid");
    let raid = start(&rd, Layout::Mirror, &["k1", "k2"], true);
    let _server = serve(&rd, "rk", raid.clone(), ServeOptions::default()).unwrap();
    let cd = b.join("client");
    let c = BlkClient::connect(&cd, "rk").unwrap();

    // Fill the whole device while both mirrors are up.
    let mut model = vec![0u8; SIZE as usize];
    let write = |c: &BlkClient, i: u64, offset: u64, model: &mut Vec<u8>, in_flight: &mut usize| {
        let data = pattern(LEN, i);
        model[offset as usize..offset as usize + LEN].copy_from_slice(&data);
        let mut buf = c.alloc(LEN).unwrap();
        buf.copy_from_slice(&data);
        if *in_flight == 8 {
            let done = c.complete(T).unwrap();
            assert!(done.result.is_ok(), "write {} failed: {:?}", done.id, done.result.err());
            *in_flight -= 1;
        }
        c.submit_write(i, offset, vec![buf], false).unwrap();
        *in_flight += 1;
    };
    let mut in_flight = 0;
    for i in 0..(SIZE / LEN as u64) {
        write(&c, i, i * LEN as u64, &mut model, &mut in_flight);
    }
    // A stream of writes over the first 2 MiB; the second mirror dies in it.
    let mut id = 10_000u64;
    for round in 0..3 {
        for k in 0..(2 << 20) / LEN as u64 {
            id += 1;
            write(&c, id, k * LEN as u64, &mut model, &mut in_flight);
            if round == 0 && k == 20 {
                k2.kill9();
            }
        }
    }
    for _ in 0..in_flight {
        let done = c.complete(T).unwrap();
        assert!(done.result.is_ok(), "write {} failed after the kill: {:?}", done.id, done.result.err());
    }
    c.flush().unwrap();
    wait_for("degraded", T, || raid.status().state == "degraded");
    let st = raid.status();
    assert_eq!(st.members[1].state, MemberState::Down);
    let dirty = st.members[1].dirty_regions;
    assert!(dirty > 0 && dirty <= (2 << 20) / st.region, "dirty regions {dirty}: only the first 2 MiB were written");
    // Reads are served by the survivor.
    assert!(read_all(&c, 0, SIZE as usize) == model, "degraded reads");

    // The mirror comes back (same file): its dirty regions are copied, no more.
    let resynced_before = st.resynced_regions;
    let _k2 = spawn(1);
    wait_for("the resync", T, || raid.status().state == "clean");
    let st = raid.status();
    assert_eq!(st.resynced_regions - resynced_before, dirty, "exactly the dirty regions were copied");
    assert!(st.members.iter().all(|m| m.state == MemberState::Up && m.dirty_regions == 0));
    c.flush().unwrap();
    let f1 = std::fs::read(&files[0]).unwrap();
    let f2 = std::fs::read(&files[1]).unwrap();
    assert!(f1 == model, "the surviving mirror holds every write");
    assert!(f2 == model, "the resynced mirror is identical");
    assert_eq!(rd.counters().bytes_copied, 0, "the resync copied through the RAID domain");
}

#[test]
fn raid0_and_concat_place_bytes_across_boundaries() {
    let b = TestBroker::start();
    let sd = b.join("stores");
    let _servers: Vec<Server> = [("s0", 1 << 20), ("s1", 1 << 20), ("s2", (1 << 20) + 4096), ("c0", 1 << 20), ("c1", 512 << 10), ("c2", 2 << 20)]
        .iter()
        .map(|(n, size)| ram(&sd, n, *size))
        .collect();
    let rd = b.join("raid");
    let cd = b.join("client");
    const CHUNK: u64 = 64 << 10;

    for (name, layout, members, size) in [
        ("stripe", Layout::Stripe { chunk: CHUNK }, ["s0", "s1", "s2"], 3u64 << 20),
        ("cat", Layout::Concat, ["c0", "c1", "c2"], (3 << 20) + (512 << 10)),
    ] {
        let raid = start(&rd, layout, &members, false);
        assert_eq!(raid.info().size, size, "{name}'s size");
        let _server = serve(&rd, name, raid.clone(), ServeOptions::default()).unwrap();
        let c = BlkClient::connect(&cd, name).unwrap();
        // Writes that straddle chunk and member boundaries, of odd lengths.
        let mut model = vec![0u8; size as usize];
        let mut at = 0u64;
        let mut i = 0;
        while at < size {
            let len = ((CHUNK + 512 * (i % 7 + 1)) * (i % 3 + 1)).min(size - at);
            let data = pattern(len as usize, i + 100);
            c.write_at(at, &data, i % 4 == 0).unwrap();
            model[at as usize..(at + len) as usize].copy_from_slice(&data);
            at += len;
            i += 1;
        }
        c.flush().unwrap();
        // Read back in other splits, each straddling boundaries again.
        let mut at = 0u64;
        while at < size {
            let len = (3 * CHUNK / 2 + 4096).min(size - at);
            let got = c.read_at(at, len as u32).unwrap();
            assert!(got.to_vec() == model[at as usize..(at + len) as usize], "{name}: {len} bytes at {at}");
            at += len;
        }
        // Each member holds what the layout puts there.
        for (k, m) in members.iter().enumerate() {
            let direct = BlkClient::connect(&cd, m).unwrap();
            let (used, place): (u64, Box<dyn Fn(u64) -> u64>) = match layout {
                Layout::Stripe { chunk } => (1 << 20, Box::new(move |o| (o / chunk * 3 + k as u64) * chunk + o % chunk)),
                _ => {
                    let starts = [0u64, 1 << 20, (1 << 20) + (512 << 10)];
                    let lens = [1u64 << 20, 512 << 10, 2 << 20];
                    (lens[k], Box::new(move |o| starts[k] + o))
                }
            };
            let bytes = read_all(&direct, 0, used as usize);
            for o in (0..used).step_by(4096) {
                let p = place(o) as usize;
                assert!(bytes[o as usize..o as usize + 4096] == model[p..p + 4096], "{name}: member {m} at {o}");
            }
        }
        // Zeroing across a boundary; a request past the end is refused.
        let zero_at = if name == "stripe" { CHUNK - 4096 } else { (1 << 20) - 4096 };
        c.write_zeroes(zero_at, 8192, false, false).unwrap();
        assert!(c.read_at(zero_at, 8192).unwrap().to_vec().iter().all(|&x| x == 0));
        match c.read_at(size, 512) {
            Err(BlkError::Status(s)) => assert_eq!(s, proto::EINVAL),
            other => panic!("a read past the end: {other:?}"),
        }
        assert_eq!(rd.counters().bytes_copied, 0, "{name}: the RAID domain copied");
        assert_eq!(raid.status().state, "clean");
    }
}

/// A member that answers READs with too few bytes, in-process, on raw channels.
struct Liar {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Liar {
    fn start(d: &Domain, name: &str, size: u64) -> Liar {
        let l = d.offer(&proto::service_name(name).unwrap()).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let (d, s) = (d.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let Ok(ch) = l.accept_timeout(Duration::from_millis(100)) else { continue };
                let info = Info { size, logical_block: 512, max_transfer: 1 << 20, flags: proto::INFO_FLUSH | proto::INFO_FUA, queue_depth: 64 };
                ch.send_inline(0, 0, bytemuck::bytes_of(&info)).unwrap();
                while !s.load(Ordering::Relaxed) {
                    let m = match ch.recv_timeout(Duration::from_millis(100)) {
                        Ok(m) => m,
                        Err(fido::Error::Timeout) => continue,
                        Err(_) => break,
                    };
                    let (tag, op) = (m.tag(), m.opcode());
                    drop(m);
                    let sent = if op == proto::OP_READ {
                        let buf = d.alloc(512).unwrap();
                        ch.send(Message::new(buf).tag(tag).opcode(0))
                    } else {
                        ch.send_inline(tag, 0, &[])
                    };
                    if sent.is_err() {
                        break;
                    }
                }
            }
        });
        Liar { stop, thread: Some(thread) }
    }
}

impl Drop for Liar {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn a_lying_member_costs_errors_or_nothing_never_a_crash() {
    let b = TestBroker::start();
    let sd = b.join("store");
    let _good0 = ram(&sd, "good0", 1 << 20);
    let _good1 = ram(&sd, "good1", 1 << 20);
    let ld = b.join("liars");
    let _liar0 = Liar::start(&ld, "liar0", 1 << 20);
    let _liar1 = Liar::start(&ld, "liar1", 1 << 20);
    let rd = b.join("raid");
    let cd = b.join("client");

    // A mirror: reads the liar answers short are retried on the good
    // mirror; the client sees the right bytes, the liar is marked down.
    let raid = start(&rd, Layout::Mirror, &["good0", "liar0"], true);
    let _s = serve(&rd, "m", raid.clone(), ServeOptions::default()).unwrap();
    let c = BlkClient::connect(&cd, "m").unwrap();
    let data = pattern(64 << 10, 1);
    c.write_at(0, &data, false).unwrap();
    for _ in 0..8 {
        assert!(c.read_at(0, 64 << 10).unwrap().to_vec() == data, "a retried read");
    }
    let st = raid.status();
    assert_eq!(st.members[1].state, MemberState::Down, "the liar is out");
    assert!(st.members[1].failures > 0);
    assert_eq!(st.members[0].state, MemberState::Up);

    // A stripe: the parts on the liar fail with EIO; the others work.
    let raid0 = start(&rd, Layout::Stripe { chunk: 64 << 10 }, &["good1", "liar1"], false);
    let _s0 = serve(&rd, "s", raid0.clone(), ServeOptions::default()).unwrap();
    let c0 = BlkClient::connect(&cd, "s").unwrap();
    c0.write_at(0, &pattern(64 << 10, 2), false).unwrap();
    match c0.read_at(64 << 10, 4096) {
        Err(BlkError::Status(s)) => assert_eq!(s, proto::EIO),
        other => panic!("a short read came through: {other:?}"),
    }
    match c0.read_at(0, 128 << 10) {
        Err(BlkError::Status(s)) => assert_eq!(s, proto::EIO),
        other => panic!("a read with a short part came through: {other:?}"),
    }
    // The good member's chunk still reads (the liar's connection was ended
    // and is tried again; nothing hangs).
    assert!(c0.read_at(0, 64 << 10).unwrap().to_vec() == pattern(64 << 10, 2));
    assert_eq!(rd.counters().bytes_copied, 0);
}

/// Writes that race with a resync (a RAM mirror restarted empty, copied
/// whole) land on both mirrors: the region being copied holds them back
/// and the copy waits for the writes in flight there, so no write is
/// overwritten by an older copy.
#[test]
fn writes_during_a_full_resync_end_up_on_both_mirrors() {
    const SIZE: u64 = 32 << 20;
    const LEN: usize = 16 << 10;
    let b = TestBroker::start();
    let (s1, s2) = (b.join("store-1"), b.join("store-2"));
    let _m1 = ram(&s1, "f1", SIZE);
    let m2 = ram(&s2, "f2", SIZE);
    let rd = b.join("raid");
    let mut o = RaidOptions::new(Layout::Mirror, vec!["f1".into(), "f2".into()]);
    o.assume_clean = true;
    o.full_resync = true;
    let raid = Raid::start(&rd, o).unwrap();
    let _server = serve(&rd, "rf", raid.clone(), ServeOptions::default()).unwrap();
    let cd = b.join("client");
    let c = BlkClient::connect(&cd, "rf").unwrap();
    let mut model = vec![0u8; SIZE as usize];
    for k in 0..SIZE / (1 << 20) {
        let data = pattern(1 << 20, k);
        c.write_at(k << 20, &data, false).unwrap();
        model[(k << 20) as usize..((k + 1) << 20) as usize].copy_from_slice(&data);
    }
    // The second mirror goes away and comes back empty.
    m2.stop();
    wait_for("degraded", T, || raid.status().state == "degraded");
    let _m2 = ram(&s2, "f2", SIZE);
    let mut during = 0;
    let mut after = 0;
    let mut x = 0x1234_5678_9abc_def1u64;
    let deadline = Instant::now() + T;
    while after < 64 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let offset = (x % (SIZE / LEN as u64)) * LEN as u64;
        let data = pattern(LEN, x);
        c.write_at(offset, &data, false).unwrap();
        model[offset as usize..offset as usize + LEN].copy_from_slice(&data);
        match raid.status().state {
            "resyncing" => during += 1,
            "clean" => after += 1,
            _ => {}
        }
        assert!(Instant::now() < deadline, "the resync never finished");
    }
    assert!(during > 0, "no write raced with the resync");
    c.flush().unwrap();
    for m in ["f1", "f2"] {
        let direct = BlkClient::connect(&cd, m).unwrap();
        assert!(read_all(&direct, 0, SIZE as usize) == model, "mirror {m} after {during} writes during the resync");
    }
    assert_eq!(raid.status().resynced_regions, SIZE / raid.status().region, "copied whole");
    assert_eq!(rd.counters().bytes_copied, 0);
}

/// A client that read through the RAID (its READ replies are the members'
/// buffers forwarded to it) and went away, then another that writes: every
/// write completes. (The forwarded replies' releases used to drop the last
/// reference to the closed connection inside a member thread's reap, which
/// took the channel lock that reap held: that thread hung, and every write
/// with it.)
#[test]
fn raid1_writes_complete_after_a_reading_client_went_away() {
    let b = TestBroker::start();
    let (s1, s2) = (b.join("store-1"), b.join("store-2"));
    let _m1 = ram(&s1, "m1", 8 << 20);
    let _m2 = ram(&s2, "m2", 8 << 20);
    let rd = b.join("raid");
    let raid = start(&rd, Layout::Mirror, &["m1", "m2"], true);
    let _server = serve(&rd, "r1", raid.clone(), ServeOptions::default()).unwrap();
    let blocks = (8u64 << 20) / 4096;
    let cd = b.join("reader");
    for round in 0..3u64 {
        let reader = BlkClient::connect(&cd, "r1").unwrap();
        for id in 0..32u64 {
            reader.submit_read(id, (id * 37 + round) % blocks * 4096, 4096).unwrap();
        }
        for _ in 0..32 {
            assert!(reader.complete(T).unwrap().result.unwrap().is_some());
        }
        // The connection closes with its replies released but not yet
        // collected by the RAID (nothing more is sent on it); its server
        // thread sees the close within its poll and lets the connection go.
        drop(reader);
        std::thread::sleep(Duration::from_millis(600));

        let wd = b.join(&format!("writer-{round}"));
        let writer = BlkClient::connect(&wd, "r1").unwrap();
        let mut in_flight = 0;
        for id in 0..512u64 {
            if in_flight == 32 {
                let c = writer.complete(Duration::from_secs(20)).expect("a write completes (no member thread hung)");
                assert!(c.result.unwrap().is_none());
                in_flight -= 1;
            }
            let mut buf = writer.alloc(4096).unwrap();
            buf.fill(id as u8);
            writer.submit_write(id, (id * 13 + round) % blocks * 4096, vec![buf], false).unwrap();
            in_flight += 1;
        }
        for _ in 0..in_flight {
            assert!(writer.complete(Duration::from_secs(20)).expect("a write completes").result.unwrap().is_none());
        }
    }
    assert_eq!(raid.status().state, "clean");
}
