//! Every operation through a real broker, a storage domain on a file and a
//! RAM disk, many requests in flight, bytes checked, zero copies on the
//! write path, read-only devices, and hostile clients speaking raw descriptors.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;

use fido::{Domain, Message};
use fido_blk::proto::{self, ReqHeader};
use fido_blk::{serve, BackingOptions, BlkClient, BlkError, FileBackend, ServeOptions};
use fido_test_support::domains::Patient;

mod common;
use common::pattern;

type TestBroker = fido_test_support::TestBroker<Patient>;

const T: Duration = Duration::from_secs(30);


fn file_backend(dir: &std::path::Path, size: u64, opts: &BackingOptions) -> (std::path::PathBuf, Arc<FileBackend>) {
    let path = dir.join("disk.img");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(size).unwrap();
    (path.clone(), Arc::new(FileBackend::open(&path, opts).unwrap()))
}

/// Writes 64 blocks of 8 KiB pipelined (QD 64) with payloads from `alloc`,
/// reads them back pipelined, checks every byte and the zero-copy counters.
fn pipelined_round_trip(server_domain: &Domain, client: &BlkClient, client_domain: &Domain) {
    const N: u64 = 64;
    const LEN: usize = 8192;
    let copied_before = (server_domain.counters().bytes_copied, client_domain.counters().bytes_copied);
    for i in 0..N {
        let mut b = client.alloc(LEN).unwrap();
        b.copy_from_slice(&pattern(LEN, i));
        client.submit_write(i, i * LEN as u64, vec![b], i % 7 == 0).unwrap();
    }
    let mut seen = HashMap::new();
    for _ in 0..N {
        let c = client.complete(T).unwrap();
        assert!(c.result.unwrap().is_none());
        assert!(seen.insert(c.id, ()).is_none(), "id {} completed twice", c.id);
    }
    assert_eq!(seen.len(), N as usize);
    client.flush().unwrap();
    // Reads in reverse order; they may complete in any order.
    for i in (0..N).rev() {
        client.submit_read(1000 + i, i * LEN as u64, LEN as u32).unwrap();
    }
    for _ in 0..N {
        let c = client.complete(T).unwrap();
        let i = c.id - 1000;
        let m = c.result.unwrap().expect("READ carries data");
        assert_eq!(m.len(), LEN);
        assert!(m.to_vec() == pattern(LEN, i), "block {i} read back wrong");
    }
    assert_eq!(client.in_flight(), 0);
    // Nothing copied on the write path (the reads' to_vec above is the client's
    // check, counted on the client: LEN per read).
    assert_eq!(server_domain.counters().bytes_copied, copied_before.0, "the storage domain copied bytes");
    assert_eq!(client_domain.counters().bytes_copied - copied_before.1, N * LEN as u64, "only the checks' copies");
}

#[test]
fn every_op_on_a_file_with_many_in_flight() {
    let b = TestBroker::start();
    let sd = b.join("storage");
    let cd = b.join("client");
    let (path, backend) = file_backend(b.dir.path(), 4 << 20, &BackingOptions::default());
    let server = serve(&sd, "disk0", backend, ServeOptions::default()).unwrap();
    let client = BlkClient::connect(&cd, "disk0").unwrap();
    let info = client.info();
    assert_eq!((info.size, info.logical_block, info.max_transfer), (4 << 20, 512, 4 << 20));
    assert!(info.flags & proto::INFO_FLUSH != 0 && info.flags & proto::INFO_READ_ONLY == 0);

    pipelined_round_trip(&sd, &client, &cd);

    // The bytes are in the file.
    let f = std::fs::File::open(&path).unwrap();
    let mut back = vec![0u8; 8192];
    f.read_exact_at(&mut back, 5 * 8192).unwrap();
    assert!(back == pattern(8192, 5));

    // A write from several buffers (scatter-gather).
    let parts: Vec<_> = (0..4u64)
        .map(|k| {
            let mut b = client.alloc(1024).unwrap();
            b.copy_from_slice(&pattern(1024, 50 + k));
            b
        })
        .collect();
    client.write_bufs(1 << 20, parts, true).unwrap();
    let m = client.read_at(1 << 20, 4096).unwrap();
    let want: Vec<u8> = (0..4u64).flat_map(|k| pattern(1024, 50 + k)).collect();
    assert!(m.to_vec() == want);

    // DISCARD and WRITE_ZEROES read back as zeros.
    client.discard(0, 16384, false).unwrap();
    assert!(client.read_at(0, 16384).unwrap().to_vec().iter().all(|&x| x == 0));
    assert!(client.read_at(16384, 512).unwrap().to_vec() == pattern(8192, 2)[..512]);
    client.write_zeroes(16384, 8192, true, false).unwrap();
    client.write_zeroes(24576, 8192, false, true).unwrap();
    assert!(client.read_at(16384, 16384).unwrap().to_vec().iter().all(|&x| x == 0));
    assert!(client.read_at(32768, 8192).unwrap().to_vec() == pattern(8192, 4));

    // Refusals: out of range, misaligned, too long.
    let st = |r: Result<_, BlkError>| match r {
        Err(BlkError::Status(s)) => s,
        other => panic!("expected a status, got {other:?}"),
    };
    assert_eq!(st(client.read_at(4 << 20, 512).map(drop)), proto::EINVAL);
    assert_eq!(st(client.read_at(100, 512).map(drop)), proto::EINVAL);
    assert_eq!(st(client.write_at(0, &[1u8; 100], false)), proto::EINVAL);
    assert_eq!(st(client.discard(u64::MAX - 511, 512, false)), proto::EINVAL);
    // Still serving.
    assert!(client.read_at(5 * 8192, 8192).unwrap().to_vec() == pattern(8192, 5));

    let stats = server.stats();
    assert_eq!(stats.bytes_copied, 0);
    assert!(stats.writes >= 65 && stats.reads >= 64 && stats.flushes >= 1, "{stats:?}");
    assert!(stats.discards == 1 && stats.write_zeroes == 2 && stats.errors == 4, "{stats:?}");
    assert_eq!(stats.bytes_written, 64 * 8192 + 4096);
}

#[test]
fn ram_disk_and_two_clients_and_4k_blocks() {
    let b = TestBroker::start();
    let sd = b.join("storage");
    let opts = BackingOptions { logical_block: 4096, max_transfer: 1 << 20, ..Default::default() };
    let backend = Arc::new(FileBackend::ram(8 << 20, &opts).unwrap());
    let _server = serve(&sd, "ram0", backend, ServeOptions::default()).unwrap();
    let c1d = b.join("c1");
    let c2d = b.join("c2");
    let c1 = BlkClient::connect(&c1d, "ram0").unwrap();
    let c2 = BlkClient::connect(&c2d, "ram0").unwrap();
    assert_eq!(c1.info().logical_block, 4096);
    let t = std::thread::spawn(move || {
        pipelined_round_trip_at(&c2, 4 << 20);
        c2
    });
    pipelined_round_trip_at(&c1, 0);
    let c2 = t.join().unwrap();
    // Each sees the other's writes.
    assert!(c1.read_at(4 << 20, 4096).unwrap().to_vec() == pattern(4096, 0));
    assert!(c2.read_at(4096, 4096).unwrap().to_vec() == pattern(4096, 1));
    // 512-byte requests are refused on a 4096-byte device.
    assert!(matches!(c1.read_at(512, 512), Err(BlkError::Status(proto::EINVAL))));
}

fn pipelined_round_trip_at(c: &BlkClient, base: u64) {
    for i in 0..128u64 {
        let mut b = c.alloc(4096).unwrap();
        b.copy_from_slice(&pattern(4096, i));
        c.submit_write(i, base + i * 4096, vec![b], false).unwrap();
    }
    for _ in 0..128 {
        c.complete(T).unwrap().result.unwrap();
    }
    for i in 0..128u64 {
        c.submit_read(i, base + i * 4096, 4096).unwrap();
    }
    for _ in 0..128 {
        let done = c.complete(T).unwrap();
        assert!(done.result.unwrap().unwrap().to_vec() == pattern(4096, done.id));
    }
}

#[test]
fn a_completing_thread_and_a_submitting_thread() {
    let b = TestBroker::start();
    let sd = b.join("storage");
    let backend = Arc::new(FileBackend::ram(16 << 20, &BackingOptions::default()).unwrap());
    let _server = serve(&sd, "ram1", backend, ServeOptions::default()).unwrap();
    let cd = b.join("client");
    let client = Arc::new(BlkClient::connect(&cd, "ram1").unwrap());
    const N: u64 = 2000;
    let c = client.clone();
    let completer = std::thread::spawn(move || {
        let mut ok = 0;
        while ok < N {
            let done = c.complete(T).unwrap();
            done.result.unwrap();
            ok += 1;
        }
        ok
    });
    for i in 0..N {
        let mut buf = client.alloc(4096).unwrap();
        buf.fill(i as u8);
        client.submit_write(i, (i % 4096) * 4096, vec![buf], false).unwrap();
    }
    assert_eq!(completer.join().unwrap(), N);
    assert_eq!(client.in_flight(), 0);
}

#[test]
fn read_only_refuses_changes() {
    let b = TestBroker::start();
    let sd = b.join("storage");
    let opts = BackingOptions { read_only: true, ..Default::default() };
    let (path, _) = file_backend(b.dir.path(), 1 << 20, &BackingOptions::default());
    std::fs::File::options().write(true).open(&path).unwrap().write_all_at(&pattern(512, 9), 512).unwrap();
    let backend = Arc::new(FileBackend::open(&path, &opts).unwrap());
    let _server = serve(&sd, "ro", backend, ServeOptions::default()).unwrap();
    let cd = b.join("client");
    let client = BlkClient::connect(&cd, "ro").unwrap();
    assert!(client.info().read_only());
    assert!(matches!(client.write_at(0, &[0u8; 512], false), Err(BlkError::Status(proto::EROFS))));
    assert!(matches!(client.discard(0, 512, false), Err(BlkError::Status(proto::EROFS))));
    assert!(matches!(client.write_zeroes(0, 512, false, false), Err(BlkError::Status(proto::EROFS))));
    client.flush().unwrap();
    assert!(client.read_at(512, 512).unwrap().to_vec() == pattern(512, 9));
}

fn raw_header(offset: u64, len: u32, flags: u32) -> [u8; 16] {
    bytemuck::cast(ReqHeader { offset, len, flags })
}

#[test]
fn hostile_client_gets_errors_and_others_keep_being_served() {
    let b = TestBroker::start();
    let sd = b.join("storage");
    let backend = Arc::new(FileBackend::ram(1 << 20, &BackingOptions::default()).unwrap());
    let server = serve(&sd, "target", backend, ServeOptions::default()).unwrap();
    let good_d = b.join("good");
    let good = BlkClient::connect(&good_d, "target").unwrap();
    good.write_at(0, &pattern(4096, 3), false).unwrap();

    let evil = b.join("evil");
    let ch = evil.connect("blk:target").unwrap();
    let info = ch.recv_timeout(T).unwrap();
    assert_eq!(info.len(), proto::INFO_LEN);
    let send = |m: Message| ch.send(m).unwrap();
    let inline = |tag: u64, op: u16, bytes: &[u8]| Message::inline(bytes).unwrap().tag(tag).opcode(op);
    let with_payload = |hdr: &[u8], payload: usize| {
        let mut h = evil.alloc(hdr.len()).unwrap();
        h.copy_from_slice(hdr);
        let mut bufs = vec![h];
        if payload > 0 {
            bufs.push(evil.alloc(payload).unwrap());
        }
        Message::gather(bufs)
    };
    let cases: Vec<(u64, Message, u16)> = vec![
        (1, inline(1, proto::OP_READ, &raw_header(0, 512, 0)[..15]), proto::EINVAL),
        (2, inline(2, proto::OP_READ, b"garbage garbage garbage"), proto::EINVAL),
        (3, inline(3, proto::OP_READ, &raw_header(1 << 20, 512, 0)), proto::EINVAL),
        (4, inline(4, proto::OP_READ, &raw_header(u64::MAX - 511, 512, 0)), proto::EINVAL),
        (5, inline(5, proto::OP_READ, &raw_header(7, 512, 0)), proto::EINVAL),
        (6, inline(6, proto::OP_READ, &raw_header(0, u32::MAX - 511, 0)), proto::EINVAL),
        (7, inline(7, 77, &raw_header(0, 512, 0)), proto::EOPNOTSUPP),
        (8, with_payload(&raw_header(0, 4096, 0), 512).tag(8).opcode(proto::OP_WRITE), proto::EINVAL),
        (9, with_payload(&raw_header(0, 512, 0), 4096).tag(9).opcode(proto::OP_WRITE), proto::EINVAL),
        (10, inline(10, proto::OP_WRITE, &raw_header(0, 512, 0)), proto::EINVAL),
        (11, with_payload(&[0u8; 24], 512).tag(11).opcode(proto::OP_WRITE), proto::EINVAL),
        (12, inline(12, proto::OP_FLUSH, b""), proto::EINVAL),
        (13, inline(13, proto::OP_READ, &raw_header(0, 512, 0x80)), proto::EINVAL),
        (14, inline(14, proto::OP_READ, &raw_header(0, 0, 0)), proto::EINVAL),
    ];
    let mut want = HashMap::new();
    for (tag, m, status) in cases {
        want.insert(tag, status);
        send(m);
    }
    // A well-formed request on the same connection still works.
    send(inline(100, proto::OP_READ, &raw_header(0, 4096, 0)));
    let mut got = HashMap::new();
    for _ in 0..want.len() + 1 {
        let m = ch.recv_timeout(T).unwrap();
        if m.tag() == 100 {
            assert_eq!(m.opcode(), 0);
            assert!(m.to_vec() == pattern(4096, 3));
        } else {
            got.insert(m.tag(), m.opcode());
        }
    }
    assert_eq!(got, want);
    // The good client never noticed.
    assert!(good.read_at(0, 4096).unwrap().to_vec() == pattern(4096, 3));
    assert!(server.stats().errors >= 14);
}

#[test]
fn one_thread_submits_more_than_the_window_before_completing() {
    let b = TestBroker::start();
    let sd = b.join("storage");
    let backend = Arc::new(FileBackend::ram(8 << 20, &BackingOptions::default()).unwrap());
    let _server = serve(&sd, "win", backend, ServeOptions::default()).unwrap();
    let cd = b.join_with(fido::JoinOptions::new("client").arena_len(64 << 20).ring_entries(32));
    let c = BlkClient::connect(&cd, "win").unwrap();
    const N: u64 = 500;
    for i in 0..N {
        let mut buf = c.alloc(4096).unwrap();
        buf.fill(i as u8);
        c.submit_write(i, (i % 2048) * 4096, vec![buf], false).unwrap();
    }
    for _ in 0..N {
        c.complete(T).unwrap().result.unwrap();
    }
    assert_eq!(c.in_flight(), 0);
    assert!(c.read_at(7 * 4096, 4096).unwrap().to_vec().iter().all(|&x| x == 7));
}

#[test]
fn direct_io_on_a_file() {
    let b = TestBroker::start();
    let opts = BackingOptions { direct: true, logical_block: 4096, ..Default::default() };
    let path = b.dir.path().join("direct.img");
    std::fs::File::create(&path).unwrap().set_len(4 << 20).unwrap();
    let backend = match FileBackend::open(&path, &opts) {
        Ok(x) => Arc::new(x),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            eprintln!("SKIPPED direct_io_on_a_file: the file system of {} refuses O_DIRECT", path.display());
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let sd = b.join("storage");
    let _server = serve(&sd, "direct", backend, ServeOptions::default()).unwrap();
    let cd = b.join("client");
    let c = BlkClient::connect(&cd, "direct").unwrap();
    for i in 0..16u64 {
        let mut buf = c.alloc(16384).unwrap();
        buf.copy_from_slice(&pattern(16384, i));
        c.submit_write(i, i * 16384, vec![buf], i == 3).unwrap();
    }
    for _ in 0..16 {
        c.complete(T).unwrap().result.unwrap();
    }
    c.flush().unwrap();
    for i in 0..16u64 {
        assert!(c.read_at(i * 16384, 16384).unwrap().to_vec() == pattern(16384, i));
    }
    // The data is in the file (O_DIRECT bypassed the page cache on the way).
    let mut back = vec![0u8; 16384];
    std::fs::File::open(&path).unwrap().read_exact_at(&mut back, 5 * 16384).unwrap();
    assert!(back == pattern(16384, 5));
    c.write_zeroes(0, 16384, false, true).unwrap();
    assert!(c.read_at(0, 16384).unwrap().to_vec().iter().all(|&x| x == 0));
}

#[test]
fn a_client_holding_its_read_budget_waits_until_it_releases() {
    let b = TestBroker::start();
    let sd = b.join("storage");
    let backend = Arc::new(FileBackend::ram(1 << 20, &BackingOptions::default()).unwrap());
    let opts = ServeOptions { max_read_bytes_held: 16 << 10, ..Default::default() };
    let _server = serve(&sd, "budget", backend, opts).unwrap();
    let cd = b.join("client");
    let c = BlkClient::connect(&cd, "budget").unwrap();
    let other_d = b.join("other");
    let other = BlkClient::connect(&other_d, "budget").unwrap();
    let mut held = Vec::new();
    let mut stalled = None;
    for i in 0..8u64 {
        c.submit_read(i, i * 4096, 4096).unwrap();
        match c.complete(Duration::from_millis(500)) {
            Ok(done) => held.push(done.result.unwrap().unwrap()),
            Err(BlkError::Timeout) => {
                stalled = Some(i);
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    let at = stalled.expect("the storage domain kept serving a client holding more than its budget");
    assert_eq!(at, 4, "16 KiB of 4 KiB reads are held when the fifth waits");
    // Another connection is not affected.
    other.write_at(0, &[5u8; 4096], false).unwrap();
    // Releasing lets the waiting read through.
    held.clear();
    let done = c.complete(T).unwrap();
    assert_eq!(done.id, at);
    assert!(done.result.unwrap().unwrap().to_vec().iter().all(|&x| x == 0));
    assert!(c.read_at(0, 4096).unwrap().to_vec().iter().all(|&x| x == 5));
}

/// A backend of our own (as a RAID domain would be): it holds every request
/// until `batch` have arrived, then completes them in reverse order from
/// another thread — READ with bytes naming the request, WRITE after checking
/// the payload in place.
struct Reversing {
    batch: usize,
    held: Arc<parking_lot::Mutex<Vec<fido_blk::Request>>>,
}

struct ReversingQueue {
    batch: usize,
    held: Arc<parking_lot::Mutex<Vec<fido_blk::Request>>>,
}

impl fido_blk::BlockBackend for Reversing {
    fn info(&self) -> proto::Info {
        proto::Info { size: 1 << 20, logical_block: 512, max_transfer: 1 << 16, flags: proto::INFO_FLUSH, queue_depth: 64 }
    }
    fn open_queue(&self, _: &Domain) -> std::io::Result<Box<dyn fido_blk::BackendQueue>> {
        Ok(Box::new(ReversingQueue { batch: self.batch, held: self.held.clone() }))
    }
}

impl fido_blk::BackendQueue for ReversingQueue {
    fn submit(&mut self, req: fido_blk::Request) {
        let mut held = self.held.lock();
        held.push(req);
        if held.len() == self.batch {
            let all: Vec<_> = held.drain(..).rev().collect();
            std::thread::spawn(move || {
                for req in all {
                    let c = req.checked;
                    match c.op {
                        proto::Op::Read => {
                            let mut buf = req.reply.alloc(c.len as usize).unwrap();
                            buf.fill((c.offset / 512) as u8);
                            req.reply.data(buf);
                        }
                        proto::Op::Write => {
                            let expect = (c.offset / 512) as u8;
                            let ok = req.payload().all(|s| s.iter().all(|b| b == expect));
                            let fido_blk::Request { msg, reply, .. } = req;
                            drop(msg);
                            if ok { reply.ok() } else { reply.error(proto::EIO) }
                        }
                        _ => drop(req), // dropped unanswered: the client must get EIO
                    }
                }
            });
        }
    }
}

#[test]
fn a_backend_of_our_own_completes_out_of_order() {
    let b = TestBroker::start();
    let sd = b.join("storage");
    let backend = Arc::new(Reversing { batch: 16, held: Arc::default() });
    let _server = serve(&sd, "rev", backend, ServeOptions::default()).unwrap();
    let cd = b.join("client");
    let c = BlkClient::connect(&cd, "rev").unwrap();
    for i in 0..8u64 {
        c.submit_read(i, i * 512, 512).unwrap();
        let mut buf = c.alloc(1024).unwrap();
        buf.fill((8 + 2 * i) as u8);
        c.submit_write(100 + i, (8 + 2 * i) * 512, vec![buf], false).unwrap();
    }
    let mut order = Vec::new();
    for _ in 0..16 {
        let done = c.complete(T).unwrap();
        match done.result.unwrap() {
            Some(m) => assert!(m.to_vec().iter().all(|&x| u64::from(x) == done.id), "READ {} got another's bytes", done.id),
            None => assert!(done.id >= 100),
        }
        order.push(done.id);
    }
    let want: Vec<u64> = (0..8u64).flat_map(|i| [i, 100 + i]).rev().collect();
    assert_eq!(order, want, "completions come in the backend's order");
    // A request the backend drops is answered EIO (never a hang).
    for i in 0..16u64 {
        c.submit_flush(1000 + i).unwrap();
    }
    for _ in 0..16 {
        assert!(matches!(c.complete(T).unwrap().result, Err(BlkError::Status(proto::EIO))));
    }
}

/// A stopped server closes its connections even while a client still holds
/// one of its READ replies (the reply's hold must not keep the connection
/// alive): the client's next request fails at once instead of waiting for
/// an answer that never comes.
#[test]
fn a_stopped_server_closes_connections_whose_client_holds_a_read() {
    let b = TestBroker::start();
    let sd = b.join("storage");
    let backend = Arc::new(FileBackend::ram(1 << 20, &BackingOptions::default()).unwrap());
    let server = serve(&sd, "stopping", backend, ServeOptions::default()).unwrap();
    let cd = b.join("client");
    let c = BlkClient::connect(&cd, "stopping").unwrap();
    let held = c.read_at(0, 4096).unwrap();
    server.stop();
    let t = std::time::Instant::now();
    let r = match c.submit_read(7, 0, 4096) {
        Err(e) => Err(e),
        Ok(()) => c.complete(Duration::from_secs(10)).and_then(|done| done.result.map(|_| ())),
    };
    assert!(r.is_err(), "a request to a stopped server succeeded");
    assert!(!matches!(r, Err(BlkError::Timeout)), "a request to a stopped server was never answered");
    assert!(t.elapsed() < Duration::from_secs(5), "the failure took {:?}", t.elapsed());
    drop(held);
}
