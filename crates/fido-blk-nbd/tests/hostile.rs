//! The server against a raw socket: options and requests a hostile (or just
//! odd) client sends. Each gets an error and the session goes on, or the
//! connection closes; the server and other connections never notice.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::TestServer;
use fido_blk_nbd::proto::*;
use fido_blk_nbd::{MemoryOptions, ServerConfig};

const MIB: u64 = 1 << 20;

struct Raw {
    s: UnixStream,
}

struct OptReply {
    option: u32,
    kind: u32,
    data: Vec<u8>,
}

enum Reply {
    Simple { error: u32, cookie: u64 },
    Chunk { flags: u16, kind: u16, cookie: u64, payload: Vec<u8> },
}

impl Raw {
    /// Connects and does the greeting (fixed newstyle, no zeroes).
    fn connect(t: &TestServer) -> Raw {
        let s = UnixStream::connect(&t.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut r = Raw { s };
        let mut hello = [0u8; 18];
        r.s.read_exact(&mut hello).unwrap();
        assert_eq!(be64(&hello[0..8]), NBD_MAGIC);
        assert_eq!(be64(&hello[8..16]), IHAVEOPT);
        assert_eq!(be16(&hello[16..18]), FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        r.s.write_all(&(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES).to_be_bytes()).unwrap();
        r
    }

    fn send_option(&mut self, option: u32, data: &[u8]) {
        self.send_option_len(option, data.len() as u32, data);
    }

    fn send_option_len(&mut self, option: u32, len: u32, data: &[u8]) {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        b.extend_from_slice(data);
        self.s.write_all(&b).unwrap();
    }

    fn opt_reply(&mut self) -> OptReply {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).unwrap();
        assert_eq!(be64(&h[0..8]), OPTION_REPLY_MAGIC);
        let mut data = vec![0u8; be32(&h[16..20]) as usize];
        self.s.read_exact(&mut data).unwrap();
        OptReply { option: be32(&h[8..12]), kind: be32(&h[12..16]), data }
    }

    /// GO on `name`; returns (size, transmission flags) after the ACK.
    fn go(&mut self, name: &str) -> Result<(u64, u16), u32> {
        self.send_option(OPT_GO, &info_request(name, &[INFO_BLOCK_SIZE]));
        let mut export = None;
        loop {
            let r = self.opt_reply();
            assert_eq!(r.option, OPT_GO);
            match r.kind {
                REP_INFO if be16(&r.data[0..2]) == INFO_EXPORT => {
                    export = Some((be64(&r.data[2..10]), be16(&r.data[10..12])))
                }
                REP_INFO => {}
                REP_ACK => return Ok(export.expect("NBD_INFO_EXPORT before the ACK")),
                e => return Err(e),
            }
        }
    }

    fn structured(&mut self) {
        self.send_option(OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(self.opt_reply().kind, REP_ACK);
    }

    fn set_base_allocation(&mut self) {
        let mut d = Vec::new();
        d.extend_from_slice(&0u32.to_be_bytes());
        d.extend_from_slice(&1u32.to_be_bytes());
        d.extend_from_slice(&(BASE_ALLOCATION.len() as u32).to_be_bytes());
        d.extend_from_slice(BASE_ALLOCATION.as_bytes());
        self.send_option(OPT_SET_META_CONTEXT, &d);
        let r = self.opt_reply();
        assert_eq!(r.kind, REP_META_CONTEXT);
        assert_eq!(be32(&r.data[0..4]), BASE_ALLOCATION_ID);
        assert_eq!(self.opt_reply().kind, REP_ACK);
    }

    fn request(&mut self, command: u16, flags: u16, cookie: u64, offset: u64, length: u32, payload: &[u8]) {
        let mut b = RequestHeader { flags, command, cookie, offset, length }.encode().to_vec();
        b.extend_from_slice(payload);
        self.s.write_all(&b).unwrap();
    }

    /// The next reply; a simple READ reply's data is read when `read_len` says.
    fn reply(&mut self, read_len: usize) -> (Reply, Vec<u8>) {
        let mut m = [0u8; 4];
        self.s.read_exact(&mut m).unwrap();
        match be32(&m) {
            SIMPLE_REPLY_MAGIC => {
                let mut h = [0u8; 12];
                self.s.read_exact(&mut h).unwrap();
                let error = be32(&h[0..4]);
                let mut data = vec![0u8; if error == 0 { read_len } else { 0 }];
                self.s.read_exact(&mut data).unwrap();
                (Reply::Simple { error, cookie: be64(&h[4..12]) }, data)
            }
            STRUCTURED_REPLY_MAGIC => {
                let mut h = [0u8; 16];
                self.s.read_exact(&mut h).unwrap();
                let mut payload = vec![0u8; be32(&h[12..16]) as usize];
                self.s.read_exact(&mut payload).unwrap();
                (
                    Reply::Chunk { flags: be16(&h[0..2]), kind: be16(&h[2..4]), cookie: be64(&h[4..12]), payload },
                    Vec::new(),
                )
            }
            other => panic!("bad reply magic {other:#x}"),
        }
    }

    fn simple(&mut self, read_len: usize) -> (u32, u64, Vec<u8>) {
        match self.reply(read_len) {
            (Reply::Simple { error, cookie }, d) => (error, cookie, d),
            _ => panic!("expected a simple reply"),
        }
    }

    /// The server closed the connection (EOF or reset) within the timeout.
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

fn info_request(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

/// A full session still works (another connection, after whatever the test did).
fn healthy(t: &TestServer) {
    let mut c = Raw::connect(t);
    c.go("mem").unwrap();
    c.request(CMD_WRITE, 0, 77, 4096, 512, &[0x5a; 512]);
    assert_eq!(c.simple(0), (0, 77, vec![]));
    c.request(CMD_READ, 0, 78, 4096, 512, &[]);
    assert_eq!(c.simple(512), (0, 78, vec![0x5a; 512]));
    c.request(CMD_DISC, 0, 0, 0, 0, &[]);
    assert!(c.closed());
}

#[test]
fn unknown_options_are_refused_and_the_session_goes_on() {
    let t = TestServer::start(MemoryOptions::new(8 * MIB));
    let mut c = Raw::connect(&t);
    for opt in [OPT_EXTENDED_HEADERS, OPT_STARTTLS, 4, 0xdead_beef] {
        c.send_option(opt, b"whatever");
        let r = c.opt_reply();
        assert_eq!((r.option, r.kind), (opt, REP_ERR_UNSUP));
    }
    // Malformed GO: the name length runs past the data.
    let mut bad = 1000u32.to_be_bytes().to_vec();
    bad.extend_from_slice(b"mem\0\0");
    c.send_option(OPT_GO, &bad);
    assert_eq!(c.opt_reply().kind, REP_ERR_INVALID);
    // A count of info requests that does not match the length.
    let mut bad = info_request("mem", &[INFO_NAME]);
    bad.truncate(bad.len() - 1);
    c.send_option(OPT_INFO, &bad);
    assert_eq!(c.opt_reply().kind, REP_ERR_INVALID);
    // LIST with data, STRUCTURED_REPLY with data.
    c.send_option(OPT_LIST, b"x");
    assert_eq!(c.opt_reply().kind, REP_ERR_INVALID);
    c.send_option(OPT_STRUCTURED_REPLY, b"x");
    assert_eq!(c.opt_reply().kind, REP_ERR_INVALID);
    // SET_META_CONTEXT before structured replies; a query count that lies.
    c.send_option(OPT_SET_META_CONTEXT, &[0, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(c.opt_reply().kind, REP_ERR_INVALID);
    c.send_option(OPT_LIST_META_CONTEXT, &[0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
    assert_eq!(c.opt_reply().kind, REP_ERR_INVALID);
    // An unknown export.
    assert_eq!(c.go("nope"), Err(REP_ERR_UNKNOWN));
    // An option too long to take is skipped whole.
    c.send_option(OPT_INFO, &vec![0u8; 100 << 10]);
    assert_eq!(c.opt_reply().kind, REP_ERR_TOO_BIG);
    // LIST works, INFO works, and then GO.
    c.send_option(OPT_LIST, &[]);
    let r = c.opt_reply();
    assert_eq!(r.kind, REP_SERVER);
    assert_eq!(&r.data[4..], b"mem");
    assert_eq!(c.opt_reply().kind, REP_ACK);
    c.send_option(OPT_INFO, &info_request("", &[INFO_NAME, INFO_BLOCK_SIZE]));
    let mut saw_block_size = false;
    loop {
        let r = c.opt_reply();
        if r.kind == REP_ACK {
            break;
        }
        assert_eq!(r.kind, REP_INFO);
        if be16(&r.data[0..2]) == INFO_BLOCK_SIZE {
            assert_eq!(be32(&r.data[2..6]), 512);
            assert_eq!(be32(&r.data[10..14]), 32 << 20);
            saw_block_size = true;
        }
    }
    assert!(saw_block_size);
    c.structured();
    // LIST_META_CONTEXT lists base:allocation.
    c.send_option(OPT_LIST_META_CONTEXT, &[0, 0, 0, 0, 0, 0, 0, 0]);
    let r = c.opt_reply();
    assert_eq!(r.kind, REP_META_CONTEXT);
    assert_eq!(&r.data[4..], BASE_ALLOCATION.as_bytes());
    assert_eq!(c.opt_reply().kind, REP_ACK);
    let (size, flags) = c.go("mem").unwrap();
    assert_eq!(size, 8 * MIB);
    for f in [TFLAG_HAS_FLAGS, TFLAG_SEND_FLUSH, TFLAG_SEND_FUA, TFLAG_SEND_TRIM, TFLAG_SEND_WRITE_ZEROES, TFLAG_CAN_MULTI_CONN] {
        assert!(flags & f != 0, "flag {f:#x} missing from {flags:#x}");
    }
    assert!(flags & TFLAG_READ_ONLY == 0);
}

#[test]
fn broken_handshakes_close_only_their_connection() {
    let t = TestServer::start(MemoryOptions::new(8 * MIB));
    // Unknown client flags.
    let mut c = UnixStream::connect(&t.socket).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut hello = [0u8; 18];
    c.read_exact(&mut hello).unwrap();
    c.write_all(&0x8000_0001u32.to_be_bytes()).unwrap();
    assert!(Raw { s: c }.closed());
    // Bad option magic.
    let mut c = Raw::connect(&t);
    c.s.write_all(&[0x55; 16]).unwrap();
    assert!(c.closed());
    // An option claiming 1 GiB.
    let mut c = Raw::connect(&t);
    c.send_option_len(OPT_GO, 1 << 30, b"");
    assert!(c.closed());
    // EXPORT_NAME of an unknown export: no error reply exists, so it closes.
    let mut c = Raw::connect(&t);
    c.send_option(OPT_EXPORT_NAME, b"nope");
    assert!(c.closed());
    // ABORT is acknowledged, then closed.
    let mut c = Raw::connect(&t);
    c.send_option(OPT_ABORT, &[]);
    assert_eq!(c.opt_reply().kind, REP_ACK);
    assert!(c.closed());
    // Half a header, then gone.
    let mut c = Raw::connect(&t);
    c.s.write_all(&IHAVEOPT.to_be_bytes()).unwrap();
    drop(c);
    healthy(&t);
}

#[test]
fn export_name_enters_transmission() {
    let t = TestServer::start(MemoryOptions::new(8 * MIB));
    let mut c = Raw::connect(&t);
    c.send_option(OPT_EXPORT_NAME, b"mem");
    let mut b = [0u8; 10];
    c.s.read_exact(&mut b).unwrap();
    assert_eq!(be64(&b[0..8]), 8 * MIB);
    c.request(CMD_FLUSH, 0, 5, 0, 0, &[]);
    assert_eq!(c.simple(0), (0, 5, vec![]));
}

#[test]
fn bad_requests_get_errors_and_the_session_goes_on() {
    let mut o = MemoryOptions::new(8 * MIB);
    o.max_transfer = 64 << 10;
    let t = TestServer::start(o);
    let mut c = Raw::connect(&t);
    c.go("mem").unwrap();
    // Unaligned, empty, past the end, overflowing.
    for (off, len, want) in [
        (1u64, 512u32, EINVAL),
        (0, 100, EINVAL),
        (0, 0, EINVAL),
        (8 * MIB, 512, EINVAL),
        (u64::MAX - 511, 512, EINVAL),
    ] {
        c.request(CMD_READ, 0, 1, off, len, &[]);
        assert_eq!(c.simple(0).0, want, "read {off}+{len}");
    }
    c.request(CMD_WRITE, 0, 2, 8 * MIB - 512, 1024, &[1; 1024]);
    assert_eq!(c.simple(0).0, ENOSPC);
    c.request(CMD_TRIM, 0, 3, 8 * MIB, 512, &[]);
    assert_eq!(c.simple(0).0, ENOSPC);
    // Unknown command, unknown flags, BLOCK_STATUS without a context, a flush
    // with flags, a read longer than the advertised maximum.
    c.request(42, 0, 4, 0, 512, &[]);
    assert_eq!(c.simple(0), (EINVAL, 4, vec![]));
    c.request(CMD_WRITE, 0x4000, 5, 0, 512, &[2; 512]);
    assert_eq!(c.simple(0), (EINVAL, 5, vec![]));
    c.request(CMD_BLOCK_STATUS, 0, 6, 0, 512, &[]);
    assert_eq!(c.simple(0), (EINVAL, 6, vec![]));
    c.request(CMD_FLUSH, CMD_FLAG_NO_HOLE, 7, 0, 0, &[]);
    assert_eq!(c.simple(0), (EINVAL, 7, vec![]));
    c.request(CMD_READ, 0, 8, 0, (8 * MIB) as u32, &[]);
    assert_eq!(c.simple(0), (EINVAL, 8, vec![]));
    // Nothing above was written.
    assert!(t.export().read_back(0, 4096).iter().all(|&b| b == 0));
    // And the session still works: a multi-piece write and read (64 KiB pieces),
    // simple replies, in order.
    let data: Vec<u8> = (0..(1 << 20)).map(|i| (i * 7 % 251) as u8).collect();
    c.request(CMD_WRITE, CMD_FLAG_FUA, 9, MIB, data.len() as u32, &data);
    assert_eq!(c.simple(0), (0, 9, vec![]));
    c.request(CMD_READ, 0, 10, MIB, data.len() as u32, &[]);
    let (e, cookie, got) = c.simple(data.len());
    assert_eq!((e, cookie), (0, 10));
    assert!(got == data);
    // A write too long to skip closes the connection.
    c.request(CMD_WRITE, 0, 11, 0, 1 << 30, &[]);
    assert!(c.closed());
    // So does a bad request magic.
    let mut c = Raw::connect(&t);
    c.go("mem").unwrap();
    c.s.write_all(&[0xee; REQUEST_HEADER_LEN]).unwrap();
    assert!(c.closed());
    healthy(&t);
}

#[test]
fn structured_reads_holes_and_block_status() {
    let mut o = MemoryOptions::new(4 * MIB);
    o.max_transfer = 128 << 10;
    let t = TestServer::start(o);
    let mut c = Raw::connect(&t);
    c.structured();
    c.set_base_allocation();
    c.go("mem").unwrap();
    // Data at [64K, 192K) (the memory export's pages are 64 KiB).
    c.request(CMD_WRITE, 0, 1, 64 << 10, 128 << 10, &[0x42; 128 << 10]);
    assert_eq!(c.simple(0), (0, 1, vec![]));
    // Read [0, 512K): two 128 KiB... four pieces; chunks in any order, DONE last.
    c.request(CMD_READ, 0, 2, 0, 512 << 10, &[]);
    let mut image = vec![0xffu8; 512 << 10];
    let mut covered = 0usize;
    loop {
        let (r, _) = c.reply(0);
        let Reply::Chunk { flags, kind, cookie, payload } = r else { panic!("simple reply to a structured read") };
        assert_eq!(cookie, 2);
        let off = be64(&payload[0..8]) as usize;
        match kind {
            REPLY_TYPE_OFFSET_DATA => {
                let d = &payload[8..];
                image[off..off + d.len()].copy_from_slice(d);
                covered += d.len();
            }
            REPLY_TYPE_OFFSET_HOLE => {
                let n = be32(&payload[8..12]) as usize;
                image[off..off + n].fill(0);
                covered += n;
            }
            k => panic!("chunk type {k}"),
        }
        if flags & REPLY_FLAG_DONE != 0 {
            break;
        }
    }
    assert_eq!(covered, 512 << 10);
    assert!(image[..64 << 10].iter().all(|&b| b == 0));
    assert!(image[64 << 10..192 << 10].iter().all(|&b| b == 0x42));
    assert!(image[192 << 10..].iter().all(|&b| b == 0));

    // BLOCK_STATUS: hole, data, hole.
    c.request(CMD_BLOCK_STATUS, 0, 3, 0, (4 * MIB) as u32, &[]);
    let (Reply::Chunk { flags, kind, cookie, payload }, _) = c.reply(0) else { panic!() };
    assert_eq!((flags, kind, cookie), (REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, 3));
    assert_eq!(be32(&payload[0..4]), BASE_ALLOCATION_ID);
    let ext: Vec<(u32, u32)> = payload[4..].chunks(8).map(|e| (be32(&e[0..4]), be32(&e[4..8]))).collect();
    assert_eq!(
        ext,
        vec![(64 << 10, STATE_HOLE | STATE_ZERO), (128 << 10, 0), ((4 << 20) - (192 << 10), STATE_HOLE | STATE_ZERO)]
    );
    c.request(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 4, 0, (4 * MIB) as u32, &[]);
    let (Reply::Chunk { payload, .. }, _) = c.reply(0) else { panic!() };
    assert_eq!(payload.len(), 12);
    // An invalid READ gets a structured error chunk.
    c.request(CMD_READ, 0, 5, 3, 512, &[]);
    let (Reply::Chunk { flags, kind, cookie, payload }, _) = c.reply(0) else { panic!() };
    assert_eq!((flags, kind, cookie, be32(&payload[0..4])), (REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 5, EINVAL));
    // Injected backend errors reach the client.
    t.export().inject_error(MIB, 4096, libc::EIO);
    c.request(CMD_READ, 0, 6, MIB, 4096, &[]);
    let (Reply::Chunk { flags, kind, payload, .. }, _) = c.reply(0) else { panic!() };
    assert_eq!((flags, kind, be32(&payload[0..4])), (REPLY_FLAG_DONE, REPLY_TYPE_ERROR_OFFSET, EIO));
    t.export().inject_error(2 * MIB, 4096, libc::ENOSPC);
    c.request(CMD_WRITE, 0, 7, 2 * MIB, 4096, &[1; 4096]);
    assert_eq!(c.simple(0), (ENOSPC, 7, vec![]));
    // WRITE_ZEROES with NO_HOLE allocates; TRIM punches.
    c.request(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 8, 3 * MIB, 64 << 10, &[]);
    assert_eq!(c.simple(0), (0, 8, vec![]));
    c.request(CMD_TRIM, 0, 9, 64 << 10, 64 << 10, &[]);
    assert_eq!(c.simple(0), (0, 9, vec![]));
    c.request(CMD_BLOCK_STATUS, 0, 10, 0, (4 * MIB) as u32, &[]);
    let (Reply::Chunk { payload, .. }, _) = c.reply(0) else { panic!() };
    let ext: Vec<(u32, u32)> = payload[4..].chunks(8).map(|e| (be32(&e[0..4]), be32(&e[4..8]))).collect();
    assert_eq!(
        ext,
        vec![
            (128 << 10, STATE_HOLE | STATE_ZERO),
            (64 << 10, 0),
            ((3 << 20) - (192 << 10), STATE_HOLE | STATE_ZERO),
            (64 << 10, 0),
            ((1 << 20) - (64 << 10), STATE_HOLE | STATE_ZERO)
        ]
    );
}

#[test]
fn many_requests_in_flight_complete_out_of_order() {
    let t = TestServer::start(MemoryOptions::new(8 * MIB));
    let mut c = Raw::connect(&t);
    c.go("mem").unwrap();
    // 200 writes without waiting, then their replies, in whatever order.
    let mut batch = Vec::new();
    for i in 0..200u64 {
        batch.extend_from_slice(&RequestHeader { flags: 0, command: CMD_WRITE, cookie: 1000 + i, offset: i * 4096, length: 4096 }.encode());
        batch.extend_from_slice(&[i as u8; 4096]);
    }
    c.s.write_all(&batch).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    let mut in_order = true;
    for n in 0..200u64 {
        let (e, cookie, _) = c.simple(0);
        assert_eq!(e, 0);
        in_order &= cookie == 1000 + n;
        assert!(seen.insert(cookie));
    }
    assert_eq!(seen.len(), 200);
    assert!(!in_order, "the reordering memory export should have reordered something");
    for i in 0..200u64 {
        assert!(t.export().read_back(i * 4096, 4096).iter().all(|&b| b == i as u8));
    }
}

#[test]
fn a_client_that_never_reads_replies_is_bounded() {
    let mut o = MemoryOptions::new(64 * MIB);
    o.queue_depth = 8;
    let t = TestServer::start(o);
    let mut c = Raw::connect(&t);
    c.go("mem").unwrap();
    // 1 MiB reads, never reading the replies: the server must stop taking
    // requests once its in-flight cap and the socket buffers are full.
    c.s.set_nonblocking(true).unwrap();
    let req = RequestHeader { flags: 0, command: CMD_READ, cookie: 1, offset: 0, length: 1 << 20 }.encode();
    let mut sent = 0usize;
    let mut stalled_since: Option<Instant> = None;
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        match c.s.write(&req[sent % REQUEST_HEADER_LEN..]) {
            Ok(n) => {
                sent += n;
                stalled_since = None;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                let since = *stalled_since.get_or_insert_with(Instant::now);
                if since.elapsed() > Duration::from_secs(2) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(stalled_since.is_some(), "the server kept taking requests for 30 s");
    let requests = sent / REQUEST_HEADER_LEN;
    // What the socket buffers hold (a few hundred KiB of 28-byte headers), plus
    // the cap: nowhere near what 30 s of a server that does not push back takes.
    assert!(requests < 100_000, "{requests} requests taken");
    eprintln!("{requests} requests taken before the server stopped reading");
    // Meanwhile other clients are served.
    healthy(&t);
    drop(c);
    // And the stuck connection's threads go away once it closes.
    let end = Instant::now() + Duration::from_secs(20);
    while t.server.connections() > 0 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(t.server.connections(), 0);
}

#[test]
fn a_dead_backend_fails_requests_until_it_returns() {
    let t = TestServer::start(MemoryOptions::new(8 * MIB));
    let mut c = Raw::connect(&t);
    c.go("mem").unwrap();
    c.request(CMD_WRITE, 0, 1, 0, 512, &[1; 512]);
    assert_eq!(c.simple(0), (0, 1, vec![]));
    t.export().kill();
    c.request(CMD_WRITE, 0, 2, 0, 512, &[1; 512]);
    assert_eq!(c.simple(0), (EIO, 2, vec![]));
    c.request(CMD_READ, 0, 3, 0, 3 << 20, &[]);
    assert_eq!(c.simple(0), (EIO, 3, vec![]));
    // New clients are told the export is unavailable.
    let mut c2 = Raw::connect(&t);
    assert_eq!(c2.go("mem"), Err(REP_ERR_UNKNOWN));
    // It comes back: the same connection works again.
    t.export().revive();
    c.request(CMD_READ, 0, 4, 0, 512, &[]);
    assert_eq!(c.simple(512), (0, 4, vec![1; 512]));
}

#[test]
fn read_only_exports_refuse_writes() {
    let mut o = MemoryOptions::new(MIB);
    o.read_only = true;
    let t = TestServer::start_with(o, ServerConfig::new("mem"));
    let mut c = Raw::connect(&t);
    let (_, flags) = c.go("").unwrap();
    assert!(flags & TFLAG_READ_ONLY != 0);
    assert!(flags & (TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FUA) == 0);
    c.request(CMD_WRITE, 0, 1, 0, 512, &[9; 512]);
    assert_eq!(c.simple(0), (EPERM, 1, vec![]));
    c.request(CMD_TRIM, 0, 2, 0, 512, &[]);
    assert_eq!(c.simple(0), (EPERM, 2, vec![]));
    c.request(CMD_READ, 0, 3, 0, 512, &[]);
    assert_eq!(c.simple(512), (0, 3, vec![0; 512]));
}

#[test]
fn silent_clients_time_out_and_connections_are_capped() {
    let mut cfg = ServerConfig::new("mem");
    cfg.handshake_timeout = Duration::from_secs(1);
    cfg.max_connections = 2;
    let t = TestServer::start_with(MemoryOptions::new(MIB), cfg);
    // Two clients that say nothing after the greeting hold both places ...
    let mut a = Raw::connect(&t);
    let mut b = Raw::connect(&t);
    // ... so a third is closed at once (before any greeting).
    let mut c = UnixStream::connect(&t.socket).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut byte = [0u8; 1];
    let n = c.read(&mut byte).unwrap_or(0);
    assert_eq!(n, 0, "a connection over the cap was greeted");
    // The silent ones are dropped after the handshake timeout.
    let start = Instant::now();
    assert!(a.closed() && b.closed());
    assert!(start.elapsed() < Duration::from_secs(15));
    // Then there is room again.
    let end = Instant::now() + Duration::from_secs(10);
    while t.server.connections() > 0 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    healthy(&t);
}

#[test]
fn many_long_simple_reads_in_flight_all_complete() {
    // Simple replies hold each READ's pieces until all are in; more than
    // 64 MiB of such READs wait to be admitted, and every one completes.
    let t = TestServer::start(MemoryOptions::new(32 * MIB));
    let mut c = Raw::connect(&t);
    c.go("mem").unwrap();
    let data: Vec<u8> = (0..(8 << 20)).map(|i: u32| (i % 253) as u8).collect();
    c.request(CMD_WRITE, 0, 1, 0, data.len() as u32, &data);
    assert_eq!(c.simple(0), (0, 1, vec![]));
    let mut batch = Vec::new();
    for i in 0..20u64 {
        batch.extend_from_slice(&RequestHeader { flags: 0, command: CMD_READ, cookie: 100 + i, offset: 0, length: 8 << 20 }.encode());
    }
    // Read replies on another thread while the requests go out.
    let mut reader = Raw { s: c.s.try_clone().unwrap() };
    let check = std::thread::spawn(move || {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..20 {
            let (e, cookie, got) = reader.simple(8 << 20);
            assert_eq!(e, 0);
            assert!(got == data, "read {cookie} differs");
            seen.insert(cookie);
        }
        seen.len()
    });
    c.s.write_all(&batch).unwrap();
    assert_eq!(check.join().unwrap(), 20);
}
