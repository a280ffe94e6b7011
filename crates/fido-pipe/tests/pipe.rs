//! The pipe engine end to end: every operation checked by checksum, edges of
//! offsets and lengths, EOF, peer reset, stalls, a client killed mid-pipe,
//! bad descriptors, quotas and weights. Every wait has a generous deadline;
//! nothing asserts a duration.

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use fido_test_support::pipes::*;
use fido_pipe::{Error, ErrorCode, PipeOp};

type TestBroker = fido_test_support::TestBroker<Pipes>;

const LONG: Duration = Duration::from_secs(30);

fn ps(n: usize) -> usize {
    n * 4096
}

// ----- every operation, checked by checksum ------------------------------------

#[test]
fn file_to_socket_edges() {
    let b = TestBroker::start();
    let c = b.client("f2s");
    let size = ps(8) + 123;
    let data = pattern(size, 7);
    let (_, f) = file_with(b.dir.path(), "src", &data);
    let cases: &[(u64, u64)] = &[
        (0, 0),
        (0, 1),
        (4095, 1),
        (4095, 2),
        (4096, 4096),
        (4097, 4095),
        (0, size as u64),
        (ps(8) as u64, 123),
        (size as u64 - 1, 1),
    ];
    for &(off, len) in cases {
        let (tx, rx) = stream_pair();
        let got = drain(rx);
        let p = c.create(&f, &tx).unwrap();
        let t = p.file_to_socket(off, len).unwrap();
        assert_eq!(
            (t.moved, t.consumed, t.eof),
            (len, len, false),
            "off {off} len {len}"
        );
        p.destroy().unwrap();
        drop(tx);
        let got = got.join().unwrap();
        let want = &data[off as usize..(off + len) as usize];
        assert_eq!(
            (got.len(), sum(&got)),
            (want.len(), sum(want)),
            "off {off} len {len}"
        );
    }
    // Past the end: what is there, then EOF.
    for &(off, len) in &[
        (size as u64 - 10, 100u64),
        (size as u64, 5),
        (size as u64 + 4096, 1),
    ] {
        let (tx, rx) = stream_pair();
        let got = drain(rx);
        let t = c.file_to_socket(&f, &tx, off, len).unwrap();
        let avail = (size as u64).saturating_sub(off);
        assert_eq!((t.moved, t.eof), (avail, true), "off {off} len {len}");
        drop(tx);
        let got = got.join().unwrap();
        assert_eq!(sum(&got), sum(&data[(off.min(size as u64)) as usize..]));
    }
}

#[test]
fn file_to_file_edges_and_positions_untouched() {
    let b = TestBroker::start();
    let c = b.client("f2f");
    let size = (3 << 20) + 4097; // more than one engine chunk
    let data = pattern(size, 3);
    let (_, mut f) = file_with(b.dir.path(), "src", &data);
    f.seek(SeekFrom::Start(123)).unwrap();
    let (_, mut out) = rw_file(b.dir.path(), "dst");
    out.seek(SeekFrom::Start(77)).unwrap();
    let p = c.create(&f, &out).unwrap();
    for &(in_off, len, out_off) in &[
        (0u64, size as u64, 0u64),
        (1, 1, 0),
        (4095, 4098, 8191),
        (4096, 0, 4096),
        (size as u64 - 1, 1, (size + 5000) as u64), // beyond the sink's end: a hole before it
    ] {
        let t = p.file_to_file(in_off, len, out_off).unwrap();
        assert_eq!((t.moved, t.eof), (len, false));
        let mut back = vec![0u8; len as usize];
        out.read_exact_at(&mut back, out_off).unwrap();
        assert_eq!(
            sum(&back),
            sum(&data[in_off as usize..(in_off + len) as usize]),
            "{in_off} {len} {out_off}"
        );
    }
    // One file as both source and sink: fine without overlap, refused with
    // (a chunked copy is not a memmove).
    let (_, same) = rw_file(b.dir.path(), "same");
    same.write_all_at(&data[..8192], 0).unwrap();
    let t = c.file_to_file(&same, &same, 0, 4096, 4096).unwrap();
    assert_eq!(t.moved, 4096);
    let mut back = vec![0u8; 4096];
    same.read_exact_at(&mut back, 4096).unwrap();
    assert!(back == data[..4096], "same-file copy differs");
    match c.file_to_file(&same, &same, 0, 4096, 100) {
        Err(Error::Refused(e)) => assert!(
            e.code == ErrorCode::BadRequest && e.message.contains("overlap"),
            "{e}"
        ),
        other => panic!("{other:?}"),
    }
    // A sink on another filesystem (tmpfs), when there is one: copy_file_range
    // may refuse (EXDEV on older kernels) and the engine falls back to splice.
    if let Ok(shm) = tempfile::tempdir_in("/dev/shm") {
        let (_, x) = rw_file(shm.path(), "xdev");
        let t = c.file_to_file(&f, &x, 4096, 3 << 20, 1).unwrap();
        assert_eq!(t.moved, 3 << 20);
        let mut back = vec![0u8; 3 << 20];
        x.read_exact_at(&mut back, 1).unwrap();
        assert!(
            sum(&back) == sum(&data[4096..4096 + (3 << 20)]),
            "cross-filesystem copy differs"
        );
    }
    // Past EOF of the source.
    let t = p.file_to_file(size as u64 + 1, 10, 0).unwrap();
    assert_eq!((t.moved, t.eof), (0, true));
    // The shared file positions were never used nor moved.
    assert_eq!(f.stream_position().unwrap(), 123);
    assert_eq!(out.stream_position().unwrap(), 77);
    // Nor the descriptor flags.
    let fl = rustix::fs::fcntl_getfl(&f).unwrap();
    assert!(!fl.contains(rustix::fs::OFlags::NONBLOCK));
}

#[test]
fn socket_to_file_and_socket_to_socket() {
    let b = TestBroker::start();
    let c = b.client("s2x");
    let data = pattern((2 << 20) + 17, 9);

    // socket → file at an offset, exactly len of a longer stream.
    let (a, src) = stream_pair();
    let feeder = feed(a, data.clone());
    let (_, out) = rw_file(b.dir.path(), "dst");
    let p = c.create(&src, &out).unwrap();
    let t = p.socket_to_file(4095, (1 << 20) + 3).unwrap();
    assert_eq!((t.moved, t.eof), ((1 << 20) + 3, false));
    // The rest, asking for more than there is: EOF mid-transfer.
    let t = p.socket_to_file(4095 + (1 << 20) + 3, 10 << 20).unwrap();
    assert_eq!((t.moved, t.eof), (data.len() as u64 - (1 << 20) - 3, true));
    feeder.join().unwrap();
    let mut back = vec![0u8; data.len()];
    out.read_exact_at(&mut back, 4095).unwrap();
    assert_eq!(sum(&back), sum(&data));

    // socket → socket, one-shot.
    let (a, src) = stream_pair();
    let (dst, z) = stream_pair();
    let feeder = feed(a, data.clone());
    let got = drain(z);
    let t = c.socket_to_socket(&src, &dst, data.len() as u64).unwrap();
    assert_eq!((t.moved, t.eof), (data.len() as u64, false));
    drop(dst);
    feeder.join().unwrap();
    assert_eq!(sum(&got.join().unwrap()), sum(&data));

    // Until EOF: a stream of unknown length.
    let (a, src) = stream_pair();
    let (dst, z) = stream_pair();
    let feeder = feed(a, data.clone());
    let got = drain(z);
    let t = c
        .socket_to_socket(&src, &dst, fido_pipe::UNTIL_EOF)
        .unwrap();
    assert_eq!((t.moved, t.eof), (data.len() as u64, true));
    drop(dst);
    feeder.join().unwrap();
    assert_eq!(sum(&got.join().unwrap()), sum(&data));
    fn shared<T: Send + Sync>() {}
    shared::<fido_pipe::Client>();
    shared::<fido_pipe::Pipe>();

    // TCP on loopback too (a real socket type the server will use).
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let mut client = std::net::TcpStream::connect(addr).unwrap();
    let (server, _) = l.accept().unwrap();
    let (_, f) = file_with(b.dir.path(), "tcp-src", &data);
    let reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        client.read_to_end(&mut v).unwrap();
        v
    });
    let t = c.file_to_socket(&f, &server, 0, data.len() as u64).unwrap();
    assert_eq!(t.moved, data.len() as u64);
    drop(server);
    assert_eq!(sum(&reader.join().unwrap()), sum(&data));
}

// ----- asynchronous use ---------------------------------------------------------

struct Unpark(std::thread::Thread);
impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let deadline = Instant::now() + LONG;
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        assert!(Instant::now() < deadline, "future never finished");
        std::thread::park_timeout(Duration::from_millis(100));
    }
}

#[test]
fn asynchronous_future_and_pollable_fd() {
    let b = TestBroker::start();
    let c = b.client("async");
    let data = pattern(5 << 20, 11);
    let (_, f) = file_with(b.dir.path(), "src", &data);

    // A future.
    let (tx, rx) = stream_pair();
    let got = drain(rx);
    let p = c.create(&f, &tx).unwrap();
    let t = block_on(
        p.start(PipeOp::FileToSocket {
            off: 0,
            len: data.len() as u64,
        })
        .unwrap(),
    )
    .unwrap();
    assert_eq!(t.moved, data.len() as u64);
    drop(p);
    drop(tx);
    assert_eq!(sum(&got.join().unwrap()), sum(&data));

    // A pollable eventfd: the stream source has no data yet, so the operation
    // is still running; the fd becomes readable once it ends.
    let (mut a, src) = stream_pair();
    let (_, out) = rw_file(b.dir.path(), "dst");
    let mut op = c
        .start_once(&src, &out, PipeOp::SocketToFile { off: 0, len: 4096 })
        .unwrap();
    let bell = op.bell_fd().unwrap();
    // SAFETY: `bell` stays open while `op` lives, which is longer than this borrow.
    let bfd = unsafe { BorrowedFd::borrow_raw(bell) };
    let mut pfd = [rustix::event::PollFd::new(
        &bfd,
        rustix::event::PollFlags::IN,
    )];
    let zero = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 50_000_000,
    };
    assert_eq!(
        rustix::event::poll(&mut pfd, Some(&zero)).unwrap(),
        0,
        "ended before its data was written"
    );
    assert!(op.try_result().is_none());
    a.write_all(&data[..4096]).unwrap();
    let long = rustix::event::Timespec {
        tv_sec: 30,
        tv_nsec: 0,
    };
    assert_eq!(rustix::event::poll(&mut pfd, Some(&long)).unwrap(), 1);
    let t = op
        .try_result()
        .expect("ready once the fd is readable")
        .unwrap();
    assert_eq!((t.moved, t.eof), (4096, false));
    let mut back = vec![0u8; 4096];
    out.read_exact_at(&mut back, 0).unwrap();
    assert_eq!(back, data[..4096]);
}

#[test]
fn nonblocking_descriptors_are_polled_not_changed() {
    let b = TestBroker::start();
    let c = b.client("nonblock");
    let data = pattern(3 << 20, 5);
    let (mut a, src) = stream_pair();
    src.set_nonblocking(true).unwrap();
    let (dst, z) = stream_pair();
    dst.set_nonblocking(true).unwrap();
    let got = drain(z);
    let p = c.create(&src, &dst).unwrap();
    let op = p
        .start(PipeOp::SocketToSocket {
            len: data.len() as u64,
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    a.write_all(&data).unwrap();
    let t = op.wait().unwrap();
    assert_eq!(t.moved, data.len() as u64);
    // Still non-blocking: the broker never touched the flags.
    assert!(rustix::fs::fcntl_getfl(&src)
        .unwrap()
        .contains(rustix::fs::OFlags::NONBLOCK));
    assert!(rustix::fs::fcntl_getfl(&dst)
        .unwrap()
        .contains(rustix::fs::OFlags::NONBLOCK));
    drop(p);
    drop(dst);
    assert_eq!(sum(&got.join().unwrap()), sum(&data));
}

// ----- failures -----------------------------------------------------------------

#[test]
fn peer_reset_is_an_error_with_exact_counts() {
    let b = TestBroker::start();
    let c = b.client("reset");
    let data = pattern(8 << 20, 2);
    let (_, f) = file_with(b.dir.path(), "src", &data);
    let (tx, mut rx) = stream_pair();
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 100_000];
        rx.read_exact(&mut buf).unwrap();
        buf
        // rx dropped here: the peer goes away mid-transfer.
    });
    let r = c.file_to_socket(&f, &tx, 0, data.len() as u64);
    let first = reader.join().unwrap();
    assert_eq!(first, data[..100_000]);
    match r {
        Err(Error::Transfer {
            moved,
            consumed,
            errno,
            message,
        }) => {
            assert!(
                errno == libc::EPIPE || errno == libc::ECONNRESET,
                "errno {errno}: {message}"
            );
            assert!(message.starts_with("sink"), "{message}");
            assert!(
                moved >= 100_000 && moved < data.len() as u64,
                "moved {moved}"
            );
            assert!(consumed >= moved);
        }
        other => panic!("expected a transfer error, got {other:?}"),
    }

    // A TCP peer that resets (SO_LINGER 0) while we are sending.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let client = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (server, _) = l.accept().unwrap();
    let lingering = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        rustix::net::sockopt::set_socket_linger(&client, Some(Duration::ZERO)).unwrap();
        drop(client);
    });
    // A sparse 16 GiB source: far more than loopback buffers hold, so the
    // transfer is still running when the reset comes.
    let (_, big) = rw_file(b.dir.path(), "sparse");
    big.set_len(16 << 30).unwrap();
    let r = c.file_to_socket(&big, &server, 0, 16 << 30);
    lingering.join().unwrap();
    match r {
        Err(Error::Transfer { errno, .. }) => {
            assert!(
                errno == libc::EPIPE || errno == libc::ECONNRESET,
                "errno {errno}"
            )
        }
        other => panic!("expected a reset, got {other:?}"),
    }
}

#[test]
fn bad_descriptors_are_refused_clearly() {
    let b = TestBroker::start();
    let c = b.client("bad");
    let dir = b.dir.path();
    let (_, ro) = file_with(dir, "ro", b"hello");
    let (tx, _rx) = stream_pair();
    let refused = |r: fido_pipe::Result<fido_pipe::Pipe>, code: ErrorCode, needle: &str| match r {
        Err(Error::Refused(e)) => {
            assert_eq!(e.code, code, "{e}");
            assert!(e.message.contains(needle), "{e} lacks {needle:?}");
        }
        other => panic!("expected a refusal ({needle}), got {other:?}"),
    };
    // Read-only file as sink.
    refused(c.create(&tx, &ro), ErrorCode::BadDescriptor, "read-only");
    // Write-only file as source.
    let wo = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("ro"))
        .unwrap();
    refused(c.create(&wo, &tx), ErrorCode::BadDescriptor, "write-only");
    // O_APPEND sink.
    let ap = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join("ro"))
        .unwrap();
    refused(c.create(&ro, &ap), ErrorCode::BadDescriptor, "O_APPEND");
    // Wrong types: a directory, a character device, a datagram socket, an eventfd.
    let d = std::fs::File::open(dir).unwrap();
    refused(c.create(&d, &tx), ErrorCode::BadDescriptor, "Directory");
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .unwrap();
    refused(
        c.create(&ro, &null),
        ErrorCode::BadDescriptor,
        "CharacterDevice",
    );
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    refused(
        c.create(&ro, &udp),
        ErrorCode::BadDescriptor,
        "stream sockets only",
    );
    let ev = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
    refused(c.create(&ev, &tx), ErrorCode::BadDescriptor, "source");
    // An O_PATH descriptor.
    let opath = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH)
        .open(dir.join("ro"))
        .unwrap();
    refused(c.create(&opath, &tx), ErrorCode::BadDescriptor, "O_PATH");
    // A closed descriptor never leaves this process: a clear EBADF.
    let raw = {
        let f = std::fs::File::open(dir.join("ro")).unwrap();
        f.as_raw_fd()
    };
    // SAFETY: deliberately names a closed descriptor; only dup() is attempted on it.
    let closed = unsafe { BorrowedFd::borrow_raw(raw) };
    match c.create(closed, &tx) {
        Err(Error::Sys(e)) => assert_eq!(e, rustix::io::Errno::BADF),
        other => panic!("expected EBADF, got {other:?}"),
    }
    // An operation that does not fit the pipe's descriptors.
    let p = c.create(&ro, &tx).unwrap();
    match p.socket_to_socket(1) {
        Err(Error::Refused(e)) => {
            assert_eq!(e.code, ErrorCode::BadDescriptor);
            assert!(e.message.contains("needs a stream"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    // The client and the broker are fine afterwards.
    assert_eq!(p.file_to_socket(0, 5).unwrap().moved, 5);
    // Offsets beyond what the kernel takes are refused before anything moves.
    match p.file_to_socket(u64::MAX - 1, 5) {
        Err(Error::Refused(e)) => assert_eq!(e.code, ErrorCode::BadRequest, "{e}"),
        other => panic!("{other:?}"),
    }
    // A pipe of another domain is not ours.
    let other = b.client("bad-other");
    let theirs = other.create(&ro, &tx).unwrap();
    let mine_view = c.create(&ro, &tx).unwrap();
    assert_ne!(theirs.id(), mine_view.id());
    c.status().unwrap();
}

#[test]
fn busy_pipe_cancel_and_destroy() {
    let b = TestBroker::start();
    let c = b.client("busy");
    let (mut a, src) = stream_pair();
    let (dst, z) = stream_pair();
    let got = drain(z);
    let p = c.create(&src, &dst).unwrap();
    let op = p.start(PipeOp::SocketToSocket { len: 1 << 20 }).unwrap();
    a.write_all(&pattern(1000, 1)).unwrap();
    // One at a time.
    let deadline = Instant::now() + LONG;
    loop {
        match p.socket_to_socket(1) {
            Err(Error::Refused(e)) if e.code == ErrorCode::Busy => break,
            Err(Error::Refused(e)) if e.code == ErrorCode::NoSuchPipe => panic!("{e}"),
            other => {
                assert!(Instant::now() < deadline, "never busy: {other:?}");
            }
        }
    }
    // Cancelled with the exact count of what went through (the 1000 bytes).
    let deadline = Instant::now() + LONG;
    while c
        .status()
        .unwrap()
        .pipes
        .iter()
        .all(|d| d.bytes_total < 1000)
    {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(10));
    }
    p.cancel().unwrap();
    match op.wait() {
        Err(Error::Cancelled { moved, consumed }) => assert_eq!((moved, consumed), (1000, 1000)),
        other => panic!("{other:?}"),
    }
    // Still usable.
    a.write_all(&pattern(10, 2)).unwrap();
    assert_eq!(p.socket_to_socket(10).unwrap().moved, 10);
    // Destroy while running: cancelled.
    let op = p.start(PipeOp::SocketToSocket { len: 10 }).unwrap();
    p.destroy().unwrap();
    assert!(matches!(op.wait(), Err(Error::Cancelled { moved: 0, .. })));
    drop(dst);
    let mut want = pattern(1000, 1);
    want.extend(pattern(10, 2));
    assert_eq!(got.join().unwrap(), want);
}

// ----- stalls do not hold anyone up ----------------------------------------------

#[test]
fn a_stalled_descriptor_does_not_block_other_clients() {
    // One lane only: a stalled transfer must still not occupy it.
    let b = TestBroker::start_with(|c| c.pipe.lanes = 1);
    let staller = b.client("staller");
    let dir = b.dir.path();
    let data = pattern(16 << 20, 4);
    let (_, f) = file_with(dir, "src", &data);

    // A socket nobody writes (source) and a socket nobody reads (sink).
    let (_quiet, src) = stream_pair();
    let (_, out) = rw_file(dir, "never");
    let stuck_in = staller
        .start_once(
            &src,
            &out,
            PipeOp::SocketToFile {
                off: 0,
                len: 1 << 20,
            },
        )
        .unwrap();
    let (full, _nobody_reads) = stream_pair();
    let stuck_out = staller.create(&f, &full).unwrap();
    let out_op = stuck_out
        .start(PipeOp::FileToSocket {
            off: 0,
            len: data.len() as u64,
        })
        .unwrap();
    // A FIFO nobody writes.
    let (pr, _pw) = rustix::pipe::pipe().unwrap();
    let (_, out2) = rw_file(dir, "never2");
    let stuck_fifo = staller
        .start_once(&pr, &out2, PipeOp::SocketToFile { off: 0, len: 10 })
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));

    // Another client moves 16 MiB, twice, checked.
    let other = b.client("other");
    for round in 0..2 {
        let (_, dst) = rw_file(dir, &format!("copy{round}"));
        let t = other
            .file_to_file(&f, &dst, 0, data.len() as u64, 0)
            .unwrap();
        assert_eq!(t.moved, data.len() as u64);
        let mut back = vec![0u8; data.len()];
        dst.read_exact_at(&mut back, 0).unwrap();
        assert_eq!(sum(&back), sum(&data));
    }
    // The broker still answers.
    let st = other.status().unwrap();
    let s = st
        .pipes
        .iter()
        .find(|d| d.domain == staller.domain())
        .expect("staller listed");
    assert_eq!(s.running, 3);

    // The stalled ones are all cancellable, with exact counts.
    stuck_out.cancel().unwrap();
    match out_op.wait() {
        Err(Error::Cancelled { moved, consumed }) => {
            assert!(moved > 0 && moved < data.len() as u64, "moved {moved}");
            assert!(consumed >= moved);
        }
        other => panic!("{other:?}"),
    }
    drop(stuck_out);
    drop(stuck_in);
    drop(stuck_fifo);
    // One-shots have no handle: they end when the client leaves.
    drop(staller);
}

// ----- a client killed mid-pipe -----------------------------------------------------

/// Child role: joins, starts a transfer from the socket at $SOCK (which the
/// parent never writes) and one into it, says READY and waits to be killed.
#[test]
fn child_role() {
    let Ok(sock) = std::env::var("FIDO_PIPE_TEST_SOCK") else {
        return;
    };
    let broker = std::env::var("FIDO_PIPE_TEST_BROKER").unwrap();
    let c = fido_pipe::Client::connect_with(fido_pipe::ClientOptions::new("doomed").broker(broker))
        .unwrap();
    let s = UnixStream::connect(&sock).unwrap();
    let dir = std::env::var("FIDO_PIPE_TEST_DIR").unwrap();
    let (_, out) = rw_file(std::path::Path::new(&dir), "child-out");
    let _stuck = c
        .start_once(
            &s,
            &out,
            PipeOp::SocketToFile {
                off: 0,
                len: 1 << 30,
            },
        )
        .unwrap();
    let big = rw_file(std::path::Path::new(&dir), "child-src").1;
    big.set_len(64 << 20).unwrap();
    let p = c.create(&big, &s).unwrap();
    let _op = p
        .start(PipeOp::FileToSocket {
            off: 0,
            len: 64 << 20,
        })
        .unwrap();
    // Let the broker register both before saying ready.
    let deadline = Instant::now() + LONG;
    while c
        .status()
        .unwrap()
        .pipes
        .iter()
        .find(|d| d.domain == c.domain())
        .map_or(0, |d| d.running)
        < 2
    {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(10));
    }
    println!("READY {}", c.domain());
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn a_client_killed_mid_pipe_has_its_pipes_cancelled() {
    let b = TestBroker::start();
    let sock = b.dir.path().join("peer.sock");
    let l = UnixListener::bind(&sock).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_role", "--nocapture", "--test-threads=1"])
        .env("FIDO_PIPE_TEST_SOCK", &sock)
        .env("FIDO_PIPE_TEST_BROKER", &b.socket)
        .env("FIDO_PIPE_TEST_DIR", b.dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (mut peer, _) = l.accept().unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let dom: u64 = loop {
        line.clear();
        assert!(
            std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0,
            "child ended early"
        );
        // libtest may print "test child_role ... " on the same line first.
        if let Some(i) = line.find("READY ") {
            break line[i + 6..].trim().parse().unwrap();
        }
    };
    let watcher = b.client("watcher");
    assert!(watcher
        .status()
        .unwrap()
        .pipes
        .iter()
        .any(|d| d.domain == dom && d.running == 2));
    child.kill().unwrap();
    child.wait().unwrap();

    // The broker cancels both transfers and closes its copies of the socket:
    // our end then reads the bytes the engine had sent, then EOF.
    peer.set_read_timeout(Some(LONG)).unwrap();
    let mut sink = Vec::new();
    peer.read_to_end(&mut sink)
        .expect("EOF once the broker let go of the socket");
    let st = watcher.status().unwrap();
    assert!(
        st.pipes.iter().all(|d| d.domain != dom),
        "dead domain's pipes still listed"
    );
    assert!(st.domains.iter().all(|d| d.domain != dom));

    // Everyone else is fine.
    let data = pattern(1 << 20, 8);
    let (_, f) = file_with(b.dir.path(), "after", &data);
    let (tx, rx) = stream_pair();
    let got = drain(rx);
    assert_eq!(
        watcher
            .file_to_socket(&f, &tx, 0, data.len() as u64)
            .unwrap()
            .moved,
        data.len() as u64
    );
    drop(tx);
    assert_eq!(sum(&got.join().unwrap()), sum(&data));
}

// ----- quotas and weights --------------------------------------------------------------

#[test]
fn pipe_quota_is_enforced_per_domain() {
    let uid = rustix::process::geteuid().as_raw();
    let policy = format!(
        "[[rule]]\nname = \"small\"\nuids = [{uid}]\nlabels = [\"small\"]\noffer = [\"*\"]\nconnect = [\"*\"]\npipes = 2\npipe_weight = 3\n\n[[rule]]\nname = \"rest\"\nuids = [{uid}]\noffer = [\"*\"]\nconnect = [\"*\"]\n"
    );
    let policy = fido_broker::Policy::parse(&policy, "test").unwrap();
    let b = TestBroker::start_with(|c| c.policy = Arc::new(policy));
    let small = fido_pipe::Client::connect_with(
        fido_pipe::ClientOptions::new("small")
            .label("small")
            .broker(&b.socket),
    )
    .unwrap();
    let (_, f) = file_with(b.dir.path(), "src", b"x");
    let (tx, _rx) = stream_pair();
    let p1 = small.create(&f, &tx).unwrap();
    let _p2 = small.create(&f, &tx).unwrap();
    match small.create(&f, &tx) {
        Err(Error::Refused(e)) => {
            assert_eq!(e.code, ErrorCode::Quota);
            assert!(e.message.contains("limit 2"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    // One-shots count too.
    assert!(
        matches!(small.file_to_socket(&f, &tx, 0, 1), Err(Error::Refused(e)) if e.code == ErrorCode::Quota)
    );
    // Others are unaffected.
    let big = b.client("big");
    for _ in 0..5 {
        big.create(&f, &tx).unwrap();
    }
    // Releasing one makes room; the rule's weight is in force.
    p1.destroy().unwrap();
    let _p3 = small.create(&f, &tx).unwrap();
    let st = small.status().unwrap();
    let s = st
        .pipes
        .iter()
        .find(|d| d.domain == small.domain())
        .unwrap();
    assert_eq!((s.weight, s.pipes), (3, 2));
}

#[test]
fn weights_share_the_engine_one_one_two() {
    // A fixed capacity, strict shares: the split must follow the weights.
    let cap = 24u64 << 20;
    let b = TestBroker::start_with(|c| {
        c.pipe.capacity = fido_broker::Capacity::BytesPerSec(cap);
        c.pipe.work_conserving = false;
        c.pipe.chunk = 256 << 10;
    });
    let dir = b.dir.path();
    let (p, f) = rw_file(dir, "sparse");
    f.set_len(1 << 40).unwrap();
    drop(f);
    let f = std::fs::File::open(p).unwrap();
    let admin = b.client("admin");
    let mut ops = Vec::new();
    let mut drains = Vec::new();
    let mut clients = Vec::new();
    for (name, w) in [("w1", 1u32), ("w2", 1), ("w3", 2)] {
        let c = b.client(name);
        admin.set_weight(name, w).unwrap();
        let (tx, mut rx) = stream_pair();
        drains.push(std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 20];
            while matches!(rx.read(&mut buf), Ok(n) if n > 0) {}
        }));
        let pipe = c.create(&f, &tx).unwrap();
        ops.push(
            pipe.start(PipeOp::FileToSocket {
                off: 0,
                len: 1 << 40,
            })
            .unwrap(),
        );
        clients.push((c, pipe, tx));
    }
    let totals = |st: &fido_pipe::Status| -> Vec<u64> {
        clients
            .iter()
            .map(|(c, _, _)| {
                st.pipes
                    .iter()
                    .find(|d| d.domain == c.domain())
                    .map_or(0, |d| d.bytes_total)
            })
            .collect()
    };
    std::thread::sleep(Duration::from_millis(500));
    let t0 = totals(&admin.status().unwrap());
    let start = Instant::now();
    std::thread::sleep(Duration::from_millis(2000));
    let st = admin.status().unwrap();
    let secs = start.elapsed().as_secs_f64();
    let t1 = totals(&st);
    let moved: Vec<f64> = t0.iter().zip(&t1).map(|(a, b)| (b - a) as f64).collect();
    let all: f64 = moved.iter().sum();
    let shares: Vec<f64> = moved.iter().map(|m| m / all).collect();
    eprintln!(
        "moved {moved:?} in {secs:.2} s ({:.1} MiB/s of {} MiB/s), shares {shares:?}",
        all / secs / (1 << 20) as f64,
        cap >> 20
    );
    for (i, want) in [0.25, 0.25, 0.5].iter().enumerate() {
        assert!(
            (shares[i] - want).abs() < 0.08,
            "share {i}: {} (want {want}); all {shares:?}",
            shares[i]
        );
    }
    // Strict shares: the capacity is a cap (loose upper bound).
    assert!(
        all / secs < cap as f64 * 1.3,
        "{} B/s over a cap of {cap}",
        all / secs
    );
    let ws: Vec<u32> = clients
        .iter()
        .map(|(c, _, _)| {
            st.pipes
                .iter()
                .find(|d| d.domain == c.domain())
                .unwrap()
                .weight
        })
        .collect();
    assert_eq!(ws, vec![1, 1, 2]);
    for (_, pipe, _) in &clients {
        pipe.cancel().unwrap();
    }
    for op in ops {
        assert!(matches!(op.wait(), Err(Error::Cancelled { .. })));
    }
    drop(clients);
    for d in drains {
        d.join().unwrap();
    }
}

#[test]
fn setting_weights_needs_a_live_domain() {
    let b = TestBroker::start();
    let c = b.client("wt");
    match c.set_weight("nobody-here", 2) {
        Err(Error::Refused(e)) => assert_eq!(e.code, ErrorCode::NoSuchDomain),
        other => panic!("{other:?}"),
    }
    match c.set_weight("wt", 0) {
        Err(Error::Refused(e)) => assert_eq!(e.code, ErrorCode::BadRequest),
        other => panic!("{other:?}"),
    }
    c.set_weight(&c.domain().to_string(), 7).unwrap();
}

#[test]
fn work_conserving_engine_orders_by_weight_when_saturated() {
    // No capacity figure, one lane: the engine is the bottleneck and picks the
    // domain with the least bytes/weight for every chunk.
    let b = TestBroker::start_with(|c| {
        c.pipe.capacity = fido_broker::Capacity::Unlimited;
        c.pipe.lanes = 1;
        c.pipe.chunk = 128 << 10;
    });
    let (p, f) = rw_file(b.dir.path(), "sparse");
    f.set_len(1 << 40).unwrap();
    drop(f);
    let f = std::fs::File::open(p).unwrap();
    let admin = b.client("admin");
    let mut run = Vec::new();
    for (name, w) in [("light", 1u32), ("heavy", 3)] {
        let c = b.client(name);
        admin.set_weight(name, w).unwrap();
        let (tx, mut rx) = stream_pair();
        let d = std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 20];
            while matches!(rx.read(&mut buf), Ok(n) if n > 0) {}
        });
        let pipe = c.create(&f, &tx).unwrap();
        let op = pipe
            .start(PipeOp::FileToSocket {
                off: 0,
                len: 1 << 40,
            })
            .unwrap();
        run.push((c, pipe, tx, d, op));
    }
    let totals = |st: &fido_pipe::Status| -> Vec<u64> {
        run.iter()
            .map(|(c, ..)| {
                st.pipes
                    .iter()
                    .find(|d| d.domain == c.domain())
                    .map_or(0, |d| d.bytes_total)
            })
            .collect()
    };
    std::thread::sleep(Duration::from_millis(300));
    let t0 = totals(&admin.status().unwrap());
    std::thread::sleep(Duration::from_millis(1500));
    let t1 = totals(&admin.status().unwrap());
    let moved: Vec<f64> = t0.iter().zip(&t1).map(|(a, b)| (b - a) as f64).collect();
    let share = moved[1] / (moved[0] + moved[1]);
    eprintln!("moved {moved:?}, heavy share {share:.3}");
    assert!(
        (share - 0.75).abs() < 0.1,
        "heavy share {share} (want 0.75)"
    );
    for (c, pipe, tx, d, op) in run {
        pipe.cancel().unwrap();
        assert!(matches!(op.wait(), Err(Error::Cancelled { .. })));
        drop((pipe, tx, c));
        d.join().unwrap();
    }
}

#[test]
fn a_broker_without_the_engine_refuses_pipes_clearly() {
    let b = TestBroker::start_with(|c| c.pipe.enabled = false);
    let c = b.client("noengine");
    let (_, f) = file_with(b.dir.path(), "src", b"abc");
    let (tx, _rx) = stream_pair();
    match c.create(&f, &tx) {
        Err(Error::Refused(e)) => {
            assert_eq!(e.code, ErrorCode::Unavailable);
            assert!(e.message.contains("disabled"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        matches!(c.file_to_socket(&f, &tx, 0, 3), Err(Error::Refused(e)) if e.code == ErrorCode::Unavailable)
    );
    assert!(c.status().unwrap().pipe_engine.is_none());
}

#[test]
fn a_stalled_domain_does_not_keep_its_share_in_strict_mode() {
    let cap = 24u64 << 20;
    let b = TestBroker::start_with(|c| {
        c.pipe.capacity = fido_broker::Capacity::BytesPerSec(cap);
        c.pipe.work_conserving = false;
        c.pipe.chunk = 256 << 10;
    });
    // Domain "stalled" waits on a socket nobody writes.
    let stalled = b.client("stalled");
    let (_quiet, src) = stream_pair();
    let (_, out) = rw_file(b.dir.path(), "never");
    let _stuck = stalled
        .start_once(
            &src,
            &out,
            PipeOp::SocketToFile {
                off: 0,
                len: 1 << 30,
            },
        )
        .unwrap();
    // Domain "mover" sends a sparse file to a drained socket.
    let mover = b.client("mover");
    let (p, f) = rw_file(b.dir.path(), "sparse");
    f.set_len(1 << 40).unwrap();
    drop(f);
    let f = std::fs::File::open(p).unwrap();
    let (tx, mut rx) = stream_pair();
    let d = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 20];
        while matches!(rx.read(&mut buf), Ok(n) if n > 0) {}
    });
    let pipe = mover.create(&f, &tx).unwrap();
    let op = pipe
        .start(PipeOp::FileToSocket {
            off: 0,
            len: 1 << 40,
        })
        .unwrap();
    let total = |c: &fido_pipe::Client| {
        let st = c.status().unwrap();
        st.pipes
            .iter()
            .find(|d| d.domain == c.domain())
            .map_or(0, |d| d.bytes_total)
    };
    std::thread::sleep(Duration::from_millis(300));
    let t0 = total(&mover);
    let start = Instant::now();
    std::thread::sleep(Duration::from_millis(1500));
    let rate = (total(&mover) - t0) as f64 / start.elapsed().as_secs_f64();
    eprintln!(
        "mover: {:.1} MiB/s of {} MiB/s",
        rate / (1 << 20) as f64,
        cap >> 20
    );
    // Equal weights: a stalled peer that kept its share would hold the mover to ~50 %.
    assert!(rate > cap as f64 * 0.7, "mover got {rate} B/s of {cap}");
    assert!(
        rate < cap as f64 * 1.3,
        "mover got {rate} B/s over the cap {cap}"
    );
    pipe.cancel().unwrap();
    assert!(matches!(op.wait(), Err(Error::Cancelled { .. })));
    drop((pipe, tx));
    d.join().unwrap();
}

#[test]
fn a_policy_reload_changes_pipe_weights() {
    let uid = rustix::process::geteuid().as_raw();
    let rule = |w: u32| {
        format!("[[rule]]\nuids = [{uid}]\noffer = [\"*\"]\nconnect = [\"*\"]\npipe_weight = {w}\n")
    };
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("broker.sock");
    let mut cfg = fido_broker::Config::new(&socket, dir.path().join("state"));
    cfg.heartbeat = Duration::from_millis(100);
    cfg.pipe.capacity = fido_broker::Capacity::Unlimited;
    cfg.policy = Arc::new(fido_broker::Policy::parse(&rule(2), "first").unwrap());
    let broker = fido_broker::Broker::bind(cfg).unwrap();
    let (reload, stop) = (broker.reload_handle(), broker.shutdown_handle());
    let thread = std::thread::spawn(move || broker.run());

    let c = fido_pipe::Client::connect_with(
        fido_pipe::ClientOptions::new("reloaded").broker(&socket),
    )
    .unwrap();
    let (_, f) = file_with(dir.path(), "src", b"abc");
    let (tx, _rx) = stream_pair();
    assert_eq!(c.file_to_socket(&f, &tx, 0, 3).unwrap().moved, 3);
    let weight = || {
        let st = c.status().unwrap();
        st.pipes.iter().find(|d| d.domain == c.domain()).map(|d| d.weight)
    };
    let deadline = Instant::now() + LONG;
    while weight() != Some(2) {
        assert!(Instant::now() < deadline, "weight {:?}", weight());
        std::thread::sleep(Duration::from_millis(20));
    }
    reload.reload(fido_broker::Policy::parse(&rule(5), "second").unwrap());
    while weight() != Some(5) {
        assert!(Instant::now() < deadline, "weight after reload {:?}", weight());
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(c);
    stop.shutdown();
    thread.join().unwrap().unwrap();
}

// ----- the broker going away --------------------------------------------------

#[test]
fn a_dead_broker_fails_the_pending_operation_and_every_later_request() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("broker.sock");
    let mut config = fido_broker::Config::new(&socket, dir.path().join("state"));
    config.pipe.capacity = fido_broker::Capacity::Unlimited;
    let broker = fido_broker::Embedded::start(config).unwrap();
    let c = fido_pipe::Client::connect_with(fido_pipe::ClientOptions::new("orphan").broker(&socket)).unwrap();
    // A transfer that cannot finish: its source never sends.
    let (_quiet, from) = stream_pair();
    let (to, _sink) = stream_pair();
    let mut pending = c.start_once(&from, &to, PipeOp::SocketToSocket { len: 1 << 20 }).unwrap();
    assert!(pending.wait_timeout(Duration::from_millis(100)).is_none());
    broker.stop().unwrap();
    match pending.wait_timeout(LONG) {
        Some(Err(Error::BrokerUnavailable(_))) => {}
        other => panic!("the pending operation should fail with BrokerUnavailable: {other:?}"),
    }
    // No reconnection: the client is done, and says so at once.
    let t = Instant::now();
    assert!(matches!(c.status(), Err(Error::BrokerUnavailable(_))));
    assert!(t.elapsed() < Duration::from_secs(5), "a request on a dead client waited {:?}", t.elapsed());
}
