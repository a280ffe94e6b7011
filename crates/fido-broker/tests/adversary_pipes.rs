//! The pipe engine attacked by an ordinary local user (issue #16, findings 3
//! and 12): the engine runs as root inside the broker, so whatever it does
//! for a caller must cost the caller, not the system, and must not exceed
//! what the caller could do itself.
//!
//! These tests need root: they create two system users (`fido-adv-alice`,
//! `fido-adv-bob`) if missing and run this test binary again under those
//! uids with `setpriv` (the child's role is in `FIDO_ADV_ROLE`, see
//! [`child_main`]). Without root they print why and pass vacuously. The
//! broker runs on a thread of this process, so its threads (the engine's
//! io_uring workers included) are this process's.

use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use fido_broker::Policy;
use fido_proto::{PipeEnd, PipeOp, PipeResult, Reply, Request};
use fido_test_support::child::{role_command, RoleChild};
use fido_test_support::raw::*;
use fido_test_support::users::{test_user, User};
use fido_test_support::Defaults;

type TestBroker = fido_test_support::TestBroker<Defaults>;

const ALICE: &str = "fido-adv-alice";
const BOB: &str = "fido-adv-bob";

/// Stalled operations alice starts, of each of five kinds.
const STALLED_PER_KIND: usize = 40;

/// The issue's policy, for pipes: each user on its own, 256 pipes a domain.
fn broker_for(alice: User, bob: User) -> TestBroker {
    let text = format!(
        r#"
        [[rule]]
        name = "alice"
        uids = [{a}]
        offer = ["alice-*"]
        connect = ["alice-*"]
        registry_write = ["/app/alice/**", "/net/**"]
        pipes = 256

        [[rule]]
        name = "bob"
        uids = [{b}]
        offer = ["bob-*"]
        connect = ["bob-*"]
        registry_write = ["/app/bob/**", "/net/**"]
        pipes = 256
        "#,
        a = alice.uid,
        b = bob.uid
    );
    let policy = Arc::new(Policy::parse(&text, "adversary-pipes").unwrap());
    TestBroker::start_with(|c| {
        c.policy = policy;
        c.heartbeat = Duration::from_millis(1000);
        c.heartbeat_misses = 60;
        c.pipe.capacity = fido_broker::Capacity::Unlimited;
        let top = c.socket.parent().unwrap().parent().unwrap();
        std::fs::set_permissions(top, std::fs::Permissions::from_mode(0o755)).unwrap();
    })
}

/// This process's threads: all of them, and the io_uring workers among them.
fn threads() -> (usize, usize) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let all = status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let workers = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with("iou-wrk"))
        })
        .count();
    (all, workers)
}

/// A directory only `user` may write, for its files.
fn dir_for(user: User) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    rustix::fs::chown(
        d.path(),
        Some(rustix::process::Uid::from_raw(user.uid)),
        Some(rustix::process::Gid::from_raw(user.gid)),
    )
    .unwrap();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    d
}

// ----- finding 3: stalled operations and the broker's threads -------------------

/// Alice starts 200 one-shot operations on descriptors that never become
/// ready (sockets and a FIFO nobody writes, sockets nobody reads). On d54ab9b
/// each parked one kernel io_uring worker in the broker (200 more threads,
/// root's, without limit). Now they cost no thread, and bob's transfers, made
/// meanwhile, go through.
#[test]
fn stalled_operations_cost_the_broker_no_threads() {
    let (Some(alice), Some(bob)) = (test_user(ALICE), test_user(BOB)) else {
        return;
    };
    let b = broker_for(alice, bob);
    let (threads_before, workers_before) = threads();
    let work = dir_for(alice);
    let mut staller = kid(alice, "stall", &b.socket, &[("FIDO_ADV_DIR", work.path())]);
    let started: usize = staller.line("@@ stalled").parse().unwrap();
    assert_eq!(started, 5 * STALLED_PER_KIND);
    // Give the kernel time to start workers for them, if it would.
    std::thread::sleep(Duration::from_millis(1500));
    let (threads_stalled, workers_stalled) = threads();
    eprintln!(
        "threads: {threads_before} before, {threads_stalled} with {started} stalled operations \
         (io_uring workers {workers_before} -> {workers_stalled})"
    );

    // Bob's transfers are not held up by alice's.
    let bob_dir = dir_for(bob);
    let mut mover = kid(bob, "mover", &b.socket, &[("FIDO_ADV_DIR", bob_dir.path())]);
    let moved = mover.line("@@ moved");
    assert_eq!(
        moved,
        "file-to-socket=8388608 socket-to-socket=4194304 socket-to-file=4194304"
    );
    mover.wait_success(KID_TIMEOUT);
    let (threads_after, workers_after) = threads();
    eprintln!("threads after bob's transfers: {threads_after} (io_uring workers {workers_after})");

    // A small constant, not one per stalled operation: a stalled operation
    // holds no worker, and the engine caps them (fido_pipe_engine::IOWQ_MAX_WORKERS,
    // 16 a ring; the other tests of this binary may run brokers meanwhile).
    assert!(
        workers_stalled <= 40 && workers_after <= 40,
        "io_uring workers: {workers_stalled} while {started} operations stall, {workers_after} after bob's"
    );
    assert!(
        threads_stalled <= threads_before + 48 && threads_after <= threads_before + 48,
        "threads: {threads_before} before, {threads_stalled} with {started} stalled operations, {threads_after} after"
    );

    // Alice's operations are still pending, not failed; they end when she leaves.
    staller.close_stdin();
    assert_eq!(staller.line("@@ replies"), "0");
    staller.wait_success(KID_TIMEOUT);
}

// ----- finding 12: the caller's limits ------------------------------------------

/// Alice, with RLIMIT_FSIZE = 4096, pipes 1 MiB into files: the engine stops
/// at 4096 bytes with EFBIG, as her own write would (on d54ab9b it wrote 1 MiB).
#[test]
fn the_engine_keeps_to_the_callers_file_size_limit() {
    let (Some(alice), Some(bob)) = (test_user(ALICE), test_user(BOB)) else {
        return;
    };
    let b = broker_for(alice, bob);
    let work = dir_for(alice);
    let mut kid = kid(alice, "fsize", &b.socket, &[("FIDO_ADV_DIR", work.path())]);
    assert_eq!(kid.line("@@ fsize"), "ok");
    kid.wait_success(KID_TIMEOUT);
    for name in ["from-socket", "from-file"] {
        let len = std::fs::metadata(work.path().join(name)).unwrap().len();
        assert_eq!(len, 4096, "{name}: {len} bytes, past alice's RLIMIT_FSIZE");
    }
}

/// The engine writes with the caller's credentials: a write that would
/// remove the setuid bit when alice makes it does so through the engine, and
/// blocks reserved for root on an ext4 filesystem are not hers to fill
/// (d54ab9b kept the bit and filled them: the root engine has CAP_FSETID and
/// CAP_SYS_RESOURCE, which alice has not).
#[test]
fn the_engine_writes_with_the_callers_credentials() {
    let (Some(alice), Some(bob)) = (test_user(ALICE), test_user(BOB)) else {
        return;
    };
    let b = broker_for(alice, bob);
    let work = dir_for(alice);
    let reserved = ReservedFs::mount(alice);
    let mut env: Vec<(&str, &Path)> = vec![("FIDO_ADV_DIR", work.path())];
    if let Some(fs) = &reserved {
        env.push(("FIDO_ADV_RESERVED", &fs.dir));
    }
    let mut kid = kid(alice, "creds", &b.socket, &env);
    assert_eq!(kid.line("@@ setuid"), "ok");
    if reserved.is_some() {
        assert_eq!(kid.line("@@ reserved"), "ok");
    }
    kid.wait_success(KID_TIMEOUT);
    for name in ["suid-splice", "suid-copy"] {
        let mode = std::fs::metadata(work.path().join(name)).unwrap().mode();
        assert_eq!(
            mode & 0o6000,
            0,
            "{name}: mode {mode:o} kept its set-id bits"
        );
    }
}

/// A small ext4 filesystem, half of it reserved for root, whose top
/// directory belongs to `user`; unmounted when dropped.
struct ReservedFs {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
}

impl ReservedFs {
    fn mount(user: User) -> Option<ReservedFs> {
        let tmp = tempfile::tempdir().unwrap();
        let img = tmp.path().join("fs.img");
        let dir = tmp.path().join("mnt");
        std::fs::create_dir(&dir).unwrap();
        std::fs::File::create(&img)
            .unwrap()
            .set_len(16 << 20)
            .unwrap();
        let ok = |c: &mut Command| c.stderr(Stdio::null()).status().is_ok_and(|s| s.success());
        if !ok(Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "50"])
            .arg(&img))
            || !ok(Command::new("mount")
                .args(["-o", "loop"])
                .arg(&img)
                .arg(&dir))
        {
            eprintln!("SKIPPED (reserved blocks): cannot make and loop-mount an ext4 image here");
            return None;
        }
        let fs = ReservedFs { _tmp: tmp, dir };
        rustix::fs::chown(
            &fs.dir,
            Some(rustix::process::Uid::from_raw(user.uid)),
            Some(rustix::process::Gid::from_raw(user.gid)),
        )
        .unwrap();
        Some(fs)
    }
}

impl Drop for ReservedFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

// ----- children under other uids ------------------------------------------------

/// How long a child gets to finish its role.
const KID_TIMEOUT: Duration = Duration::from_secs(60);

/// This test binary again, in `role`, as `user`, through setpriv.
fn kid(user: User, role: &str, socket: &Path, env: &[(&str, &Path)]) -> RoleChild {
    let mut cmd = role_command(Some(user));
    cmd.env("FIDO_ADV_ROLE", role)
        .env("FIDO_ADV_SOCKET", socket);
    for (k, v) in env {
        cmd.env(k, v);
    }
    RoleChild::spawn(cmd)
}

/// The children's side: what each role does as its user.
#[test]
fn child_main() {
    let Ok(role) = std::env::var("FIDO_ADV_ROLE") else {
        return;
    };
    let socket = std::env::var("FIDO_ADV_SOCKET").unwrap();
    let dir = PathBuf::from(std::env::var("FIDO_ADV_DIR").unwrap());
    let mut raw = Raw::connect(Path::new(&socket));
    match role.as_str() {
        "stall" => stall(&mut raw, &dir),
        "mover" => mover(&mut raw, &dir),
        "fsize" => fsize(&mut raw, &dir),
        "creds" => creds(&mut raw, &dir),
        other => panic!("unknown role {other}"),
    }
}

fn once(raw: &mut Raw, op: PipeOp, src: BorrowedFd<'_>, dst: BorrowedFd<'_>) -> PipeResult {
    match raw.request_fds(Request::PipeOnce { op }, &[src, dst]) {
        (Ok(Reply::PipeDone(r)), _) => r,
        other => panic!("{op:?}: {other:?}"),
    }
}

fn stall(raw: &mut Raw, dir: &Path) {
    raw.join_with("stall", None).unwrap();
    // Sources nobody writes: a Unix socket, a TCP connection, a FIFO (opened
    // read-write, so it has a writer and never ends).
    let (unix_src, _unix_writer) = UnixStream::pair().unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let _tcp_writer = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (tcp_src, _) = listener.accept().unwrap();
    let fifo = dir.join("fifo");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let fifo_src = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&fifo)
        .unwrap();
    let (idle_sink, _idle_reader) = UnixStream::pair().unwrap();
    // Sinks nobody reads, fed from a file: a Unix socket, a TCP connection.
    let data = dir.join("data");
    std::fs::write(&data, vec![7u8; 8 << 20]).unwrap();
    let file = std::fs::File::open(&data).unwrap();
    let (unix_sink, _unix_reader) = UnixStream::pair().unwrap();
    let _tcp_reader = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (tcp_sink, _) = listener.accept().unwrap();

    let streams: [(BorrowedFd<'_>, BorrowedFd<'_>); 3] = [
        (unix_src.as_fd(), idle_sink.as_fd()),
        (tcp_src.as_fd(), idle_sink.as_fd()),
        (fifo_src.as_fd(), idle_sink.as_fd()),
    ];
    let mut sent = 0;
    for _ in 0..STALLED_PER_KIND {
        for (src, dst) in streams {
            let op = PipeOp::SocketToSocket { len: 1 << 20 };
            raw.send_request(Request::PipeOnce { op }, &[src, dst]);
            sent += 1;
        }
        for dst in [unix_sink.as_fd(), tcp_sink.as_fd()] {
            let op = PipeOp::FileToSocket {
                off: 0,
                len: 8 << 20,
            };
            raw.send_request(Request::PipeOnce { op }, &[file.as_fd(), dst]);
            sent += 1;
        }
    }
    // None is refused or ends.
    let mut replies = 0;
    while let Some(m) = raw.recv_timeout(Duration::from_millis(500)) {
        eprintln!("stall: unexpected {:?}", m.0);
        replies += 1;
    }
    assert_eq!(replies, 0);
    println!("@@ stalled {sent}");
    // Hold them until the parent has looked (it closes our stdin).
    let mut buf = [0u8; 1];
    while std::io::stdin().read(&mut buf).unwrap_or(0) > 0 {}
    while let Some(m) = raw.recv_timeout(Duration::from_millis(100)) {
        eprintln!("stall: unexpected {:?}", m.0);
        replies += 1;
    }
    println!("@@ replies {replies}");
}

fn mover(raw: &mut Raw, dir: &Path) {
    raw.join_with("mover", None).unwrap();
    let data = fido_test_support::bytes::pattern(8 << 20, 1);
    std::fs::write(dir.join("src"), &data).unwrap();
    let src = std::fs::File::open(dir.join("src")).unwrap();

    let (sink, reader) = UnixStream::pair().unwrap();
    let got = std::thread::spawn(move || read_all(reader));
    let r = once(
        raw,
        PipeOp::FileToSocket {
            off: 0,
            len: 8 << 20,
        },
        src.as_fd(),
        sink.as_fd(),
    );
    drop(sink);
    assert_eq!(r.end, PipeEnd::Done, "{r:?}");
    assert!(got.join().unwrap() == data, "file to socket: wrong bytes");
    let f2s = r.moved;

    let (feed, source) = UnixStream::pair().unwrap();
    let (sink, reader) = UnixStream::pair().unwrap();
    let part = data[..4 << 20].to_vec();
    let feeder = std::thread::spawn(move || write_all(feed, part));
    let got = std::thread::spawn(move || read_all(reader));
    let r = once(
        raw,
        PipeOp::SocketToSocket { len: 4 << 20 },
        source.as_fd(),
        sink.as_fd(),
    );
    drop(sink);
    feeder.join().unwrap();
    assert_eq!(r.end, PipeEnd::Done, "{r:?}");
    assert!(
        got.join().unwrap() == data[..4 << 20],
        "socket to socket: wrong bytes"
    );
    let s2s = r.moved;

    let (feed, source) = UnixStream::pair().unwrap();
    let part = data[4 << 20..].to_vec();
    let feeder = std::thread::spawn(move || write_all(feed, part));
    let out = rw(&dir.join("out"));
    let r = once(
        raw,
        PipeOp::SocketToFile {
            off: 0,
            len: 4 << 20,
        },
        source.as_fd(),
        out.as_fd(),
    );
    feeder.join().unwrap();
    assert_eq!(r.end, PipeEnd::Done, "{r:?}");
    assert!(
        std::fs::read(dir.join("out")).unwrap() == data[4 << 20..],
        "socket to file: wrong bytes"
    );
    let s2f = r.moved;

    // More transfers at once than one uid may have splices in the kernel
    // (fido_pipe_engine::MAX_SPLICES_PER_CALLER): the others wait their turn.
    let mut pending = Vec::new();
    for i in 0..16u64 {
        let (sink, reader) = UnixStream::pair().unwrap();
        let got = std::thread::spawn(move || read_all(reader));
        let op = PipeOp::FileToSocket {
            off: i << 16,
            len: 1 << 20,
        };
        let id = raw.send_request(Request::PipeOnce { op }, &[src.as_fd(), sink.as_fd()]);
        pending.push((id, i, sink, got));
    }
    // Their replies come in any order.
    let mut replies = std::collections::HashMap::new();
    while replies.len() < pending.len() {
        match raw.recv_timeout(Duration::from_secs(30)) {
            Some((fido_proto::BrokerMsg::Reply { id, body }, _)) => {
                replies.insert(id, body);
            }
            Some(_) => {}
            None => panic!(
                "{} of {} transfers unanswered after 30 s",
                pending.len() - replies.len(),
                pending.len()
            ),
        }
    }
    for (id, i, sink, got) in pending {
        let r = replies.remove(&id).unwrap();
        let Ok(Reply::PipeDone(r)) = r else {
            panic!("transfer {i}: {r:?}")
        };
        assert_eq!(
            (r.moved, &r.end),
            (1 << 20, &PipeEnd::Done),
            "transfer {i}: {r:?}"
        );
        drop(sink);
        let off = (i << 16) as usize;
        assert!(
            got.join().unwrap() == data[off..off + (1 << 20)],
            "transfer {i}: wrong bytes"
        );
    }
    println!("@@ moved file-to-socket={f2s} socket-to-socket={s2s} socket-to-file={s2f}");
}

fn fsize(raw: &mut Raw, dir: &Path) {
    raw.join_with("fsize", None).unwrap();
    let data = fido_test_support::bytes::pattern(1 << 20, 1);
    std::fs::write(dir.join("src"), &data).unwrap();
    let src = std::fs::File::open(dir.join("src")).unwrap();
    let old = rustix::process::getrlimit(rustix::process::Resource::Fsize);
    rustix::process::setrlimit(
        rustix::process::Resource::Fsize,
        rustix::process::Rlimit {
            current: Some(4096),
            maximum: old.maximum,
        },
    )
    .unwrap();

    let efbig = |r: &PipeResult, moved: u64, what: &str| {
        assert_eq!(r.moved, moved, "{what}: {r:?}");
        match &r.end {
            PipeEnd::Failed { errno, message } => {
                assert_eq!(*errno, libc_efbig(), "{what}: {r:?}");
                assert!(message.starts_with("sink:"), "{what}: {message}");
            }
            other => panic!("{what}: ended {other:?}, not EFBIG"),
        }
    };

    // socket → file: the splice path.
    let (feed, source) = UnixStream::pair().unwrap();
    let feeder = std::thread::spawn(move || write_all(feed, vec![1u8; 1 << 20]));
    let out = rw(&dir.join("from-socket"));
    let r = once(
        raw,
        PipeOp::SocketToFile {
            off: 0,
            len: 1 << 20,
        },
        source.as_fd(),
        out.as_fd(),
    );
    efbig(&r, 4096, "socket to file");
    assert_eq!(
        r.consumed, 4096,
        "took more from the socket than it could write: {r:?}"
    );
    drop(source);
    feeder.join().unwrap();

    // file → file: copy_file_range.
    let out = rw(&dir.join("from-file"));
    let r = once(
        raw,
        PipeOp::FileToFile {
            in_off: 0,
            len: 1 << 20,
            out_off: 0,
        },
        src.as_fd(),
        out.as_fd(),
    );
    efbig(&r, 4096, "file to file");

    // Starting at the limit: nothing moves.
    let r = once(
        raw,
        PipeOp::FileToFile {
            in_off: 0,
            len: 10,
            out_off: 4096,
        },
        src.as_fd(),
        out.as_fd(),
    );
    efbig(&r, 0, "file to file at the limit");

    // Streams have no size limit.
    let (sink, reader) = UnixStream::pair().unwrap();
    let got = std::thread::spawn(move || read_all(reader));
    let r = once(
        raw,
        PipeOp::FileToSocket {
            off: 0,
            len: 1 << 20,
        },
        src.as_fd(),
        sink.as_fd(),
    );
    drop(sink);
    assert_eq!((r.moved, &r.end), (1 << 20, &PipeEnd::Done), "{r:?}");
    assert_eq!(got.join().unwrap().len(), 1 << 20);
    println!("@@ fsize ok");
}

fn creds(raw: &mut Raw, dir: &Path) {
    raw.join_with("creds", None).unwrap();
    let data = fido_test_support::bytes::pattern(64 << 10, 1);
    std::fs::write(dir.join("src"), &data).unwrap();
    let src = std::fs::File::open(dir.join("src")).unwrap();

    // Alice's own setuid file: writing it drops the bit when she writes.
    for (name, file_source) in [("suid-splice", false), ("suid-copy", true)] {
        let path = dir.join(name);
        let out = rw(&path);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o4755)).unwrap();
        let r = if file_source {
            once(
                raw,
                PipeOp::FileToFile {
                    in_off: 0,
                    len: 4096,
                    out_off: 0,
                },
                src.as_fd(),
                out.as_fd(),
            )
        } else {
            let (feed, source) = UnixStream::pair().unwrap();
            let feeder = std::thread::spawn(move || write_all(feed, vec![2u8; 4096]));
            let r = once(
                raw,
                PipeOp::SocketToFile { off: 0, len: 4096 },
                source.as_fd(),
                out.as_fd(),
            );
            feeder.join().unwrap();
            r
        };
        assert_eq!((r.moved, &r.end), (4096, &PipeEnd::Done), "{name}: {r:?}");
        let mode = std::fs::metadata(&path).unwrap().mode();
        assert_eq!(
            mode & 0o4000,
            0,
            "{name}: the engine's write kept the setuid bit (mode {mode:o})"
        );
    }
    println!("@@ setuid ok");

    let Ok(fs) = std::env::var("FIDO_ADV_RESERVED") else {
        return;
    };
    // Fill the filesystem as far as alice may, then ask the engine for more.
    let fill = Path::new(&fs).join("fill");
    let mut f = rw(&fill);
    let block = vec![3u8; 64 << 10];
    let mut size = 0u64;
    loop {
        match f.write(&block) {
            Ok(n) => size += n as u64,
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc_enospc()), "filling: {e}");
                break;
            }
        }
    }
    assert!(size > 0);
    for file_source in [false, true] {
        let r = if file_source {
            once(
                raw,
                PipeOp::FileToFile {
                    in_off: 0,
                    len: 64 << 10,
                    out_off: size,
                },
                src.as_fd(),
                f.as_fd(),
            )
        } else {
            let (feed, source) = UnixStream::pair().unwrap();
            let feeder = std::thread::spawn(move || write_all(feed, vec![4u8; 1 << 20]));
            let r = once(
                raw,
                PipeOp::SocketToFile {
                    off: size,
                    len: 1 << 20,
                },
                source.as_fd(),
                f.as_fd(),
            );
            drop(source);
            feeder.join().unwrap();
            r
        };
        let what = if file_source {
            "file to file"
        } else {
            "socket to file"
        };
        match &r.end {
            PipeEnd::Failed { errno, .. } if *errno == libc_enospc() => {}
            other => panic!(
                "{what} into root's reserved blocks: ended {other:?}, moved {}",
                r.moved
            ),
        }
        assert!(
            r.moved < 64 << 10,
            "{what}: {} bytes went into root's reserved blocks",
            r.moved
        );
        size += r.moved;
    }
    f.flush().unwrap();
    println!("@@ reserved ok");
}


fn rw(path: &Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .unwrap()
}

fn read_all(mut s: UnixStream) -> Vec<u8> {
    let mut v = Vec::new();
    s.read_to_end(&mut v).unwrap();
    v
}

fn write_all(mut s: UnixStream, data: Vec<u8>) {
    // The reader may stop early (a write that fails on purpose).
    let _ = s.write_all(&data);
}

fn libc_efbig() -> i32 {
    rustix::io::Errno::FBIG.raw_os_error()
}

fn libc_enospc() -> i32 {
    rustix::io::Errno::NOSPC.raw_os_error()
}
