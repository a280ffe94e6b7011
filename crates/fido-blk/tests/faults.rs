//! I/O errors of the backing reach the client as the status of that request,
//! and the storage domain keeps serving: a file on a 1 MiB tmpfs that fills
//! up (ENOSPC), and a file that returns EIO (an `nbdkit` memory disk behind
//! its `error` filter, exposed as a file by `nbdfuse`).
//!
//! Plus a loop device as a block-device backing (BLKGETSIZE64, fallocate on
//! a block device). All need root (mount, losetup); the EIO test needs nbdkit and nbdfuse (Debian:
//! nbdkit, libnbd-bin; scripts/install-test-deps.sh installs them). Without
//! them a test says so on stderr and passes without checking.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fido_blk::{proto, serve, BackingOptions, BlkClient, BlkError, FileBackend, ServeOptions};
use fido_test_support::domains::Patient;

type TestBroker = fido_test_support::TestBroker<Patient>;

/// A mount point that is unmounted (lazily, so it never fails) when dropped.
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        run_ok(Command::new("umount").arg("-l").arg(&self.0));
    }
}

fn run_ok(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null()).stderr(Stdio::null()).status().map(|s| s.success()).unwrap_or(false)
}

#[test]
fn a_full_backing_answers_enospc_and_keeps_serving() {
    let b = TestBroker::start();
    let mnt = b.dir.path().join("tiny");
    std::fs::create_dir(&mnt).unwrap();
    if !run_ok(Command::new("mount").args(["-t", "tmpfs", "-o", "size=1M", "fido-blk-test"]).arg(&mnt)) {
        eprintln!("SKIPPED a_full_backing_answers_enospc_and_keeps_serving: cannot mount a tmpfs (not root?)");
        return;
    }
    let _m = Mounted(mnt.clone());
    let img = mnt.join("disk.img");
    // 8 MiB of address space on 1 MiB of memory: sparse until written.
    std::fs::File::create(&img).unwrap().set_len(8 << 20).unwrap();
    let sd = b.join("storage");
    let server = serve(&sd, "tiny", Arc::new(FileBackend::open(&img, &BackingOptions::default()).unwrap()), ServeOptions::default()).unwrap();
    let cd = b.join("client");
    let c = BlkClient::connect(&cd, "tiny").unwrap();
    let mut enospc_at = None;
    for i in 0..32u64 {
        let mut buf = c.alloc(64 << 10).unwrap();
        buf.fill(i as u8 + 1);
        match c.write_bufs(i * (64 << 10), vec![buf], false) {
            Ok(()) => {}
            Err(BlkError::Status(s)) => {
                assert_eq!(s, proto::ENOSPC, "a full tmpfs answered {}", proto::status_name(s));
                enospc_at = Some(i);
                break;
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    let at = enospc_at.expect("2 MiB of writes fit on a 1 MiB tmpfs");
    assert!(at >= 4, "ENOSPC came after only {at} writes of 64 KiB");
    // Writes above 64 KiB go through io_uring rather than pwritev: the same answer.
    let mut big = c.alloc(256 << 10).unwrap();
    big.fill(7);
    assert!(matches!(c.write_bufs(4 << 20, vec![big], false), Err(BlkError::Status(proto::ENOSPC))));
    // Still serving: what was written reads back, and freeing space helps.
    let m = c.read_at(0, 4096).unwrap();
    assert!(m.to_vec().iter().all(|&x| x == 1));
    drop(m);
    c.discard(0, 512 << 10, false).unwrap();
    c.write_at(at * (64 << 10), &[9u8; 65536], true).unwrap();
    assert!(server.stats().errors >= 1);
    drop(c);
    drop(server);
}

/// `nbdfuse DIR/disk --command nbdkit -s --filter=error memory 1M error-rate=100%`
/// (unmounted first, then nbdfuse is killed).
struct ErrorDisk {
    child: Child,
    mnt: PathBuf,
    file: PathBuf,
}

impl Drop for ErrorDisk {
    fn drop(&mut self) {
        run_ok(Command::new("umount").arg("-l").arg(&self.mnt));
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn error_disk(dir: &Path) -> Option<ErrorDisk> {
    if !run_ok(Command::new("nbdkit").arg("--version")) || !run_ok(Command::new("nbdfuse").arg("--version")) {
        eprintln!("SKIPPED the EIO test: nbdkit and nbdfuse are not installed (Debian: nbdkit libnbd-bin)");
        return None;
    }
    let mnt = dir.join("eio");
    std::fs::create_dir(&mnt).unwrap();
    let child = Command::new("nbdfuse")
        .arg(mnt.join("disk"))
        .args(["--command", "nbdkit", "-s", "--filter=error", "memory", "1M", "error-rate=100%", "error=EIO"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let file = mnt.join("disk");
    let disk = ErrorDisk { child, mnt, file };
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::metadata(&disk.file).map(|m| m.len()).ok() != Some(1 << 20) {
        if Instant::now() > deadline {
            eprintln!("SKIPPED the EIO test: nbdfuse did not mount (no /dev/fuse?)");
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(disk)
}

#[test]
fn a_failing_backing_answers_eio_and_keeps_serving() {
    let b = TestBroker::start();
    let Some(disk) = error_disk(b.dir.path()) else { return };
    let sd = b.join("storage");
    let server = serve(&sd, "eio", Arc::new(FileBackend::open(&disk.file, &BackingOptions::default()).unwrap()), ServeOptions::default()).unwrap();
    let cd = b.join("client");
    let c = BlkClient::connect(&cd, "eio").unwrap();
    assert_eq!(c.info().size, 1 << 20);
    // Many in flight, each fails on its own.
    for i in 0..16u64 {
        c.submit_read(i, i * 4096, 4096).unwrap();
    }
    for _ in 0..16 {
        let done = c.complete(Duration::from_secs(30)).unwrap();
        assert!(matches!(done.result, Err(BlkError::Status(proto::EIO))), "READ {}: {:?}", done.id, done.result);
    }
    assert!(matches!(c.write_at(0, &[1u8; 4096], true), Err(BlkError::Status(proto::EIO))));
    assert!(matches!(c.read_at(8192, 512), Err(BlkError::Status(proto::EIO))));
    assert!(server.stats().errors >= 18);
    drop(c);
    drop(server);
    drop(disk);
}

/// A loop device over a file, detached when dropped.
struct Loop(String);

impl Drop for Loop {
    fn drop(&mut self) {
        run_ok(Command::new("losetup").arg("-d").arg(&self.0));
    }
}

#[test]
fn a_block_device_backing() {
    let b = TestBroker::start();
    let img = b.dir.path().join("loop.img");
    std::fs::File::create(&img).unwrap().set_len(8 << 20).unwrap();
    let out = Command::new("losetup").args(["-f", "--show"]).arg(&img).output();
    let dev = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        _ => {
            eprintln!("SKIPPED a_block_device_backing: losetup cannot attach a loop device here");
            return;
        }
    };
    let _loop = Loop(dev.clone());
    let sd = b.join("storage");
    let server = serve(&sd, "loop", Arc::new(FileBackend::open(Path::new(&dev), &BackingOptions::default()).unwrap()), ServeOptions::default()).unwrap();
    let cd = b.join("client");
    let c = BlkClient::connect(&cd, "loop").unwrap();
    assert_eq!(c.info().size, 8 << 20, "BLKGETSIZE64 of the loop device");
    let data: Vec<u8> = (0..65536u32).map(|i| (i * 7 + i / 512) as u8).collect();
    c.write_at(4096, &data, true).unwrap();
    assert!(c.read_at(4096, 65536).unwrap().to_vec() == data);
    c.write_zeroes(4096, 8192, false, true).unwrap();
    c.discard(12288, 4096, false).unwrap();
    let back = c.read_at(4096, 65536).unwrap().to_vec();
    assert!(back[..12288].iter().all(|&x| x == 0), "write-zeroes / discard on a block device");
    assert!(back[12288..] == data[12288..]);
    c.flush().unwrap();
    drop(c);
    drop(server);
}
