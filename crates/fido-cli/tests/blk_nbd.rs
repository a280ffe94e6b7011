//! `fido blk nbd` in front of a `fido blk serve` storage domain, driven by
//! the NBD clients people use: qemu-img, qemu-io, nbdinfo, nbdcopy and fio
//! (Debian's; each part skips with a message when its tool is missing), and
//! the storage domain killed and restarted under it.

use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use fido_test_support::ChildProc;
use std::time::{Duration, Instant};

const FIDO: &str = env!("CARGO_BIN_EXE_fido");
const MIB: usize = 1 << 20;

/// A `fido` subcommand against the test's broker, stdout piped (its ready
/// line), killed and reaped when dropped.
fn start(args: &[&str], broker: &Path) -> ChildProc {
    let mut cmd = Command::new(FIDO);
    cmd.args(args).arg("--socket").arg(broker).env_remove("RUST_LOG").stdin(Stdio::null());
    ChildProc::start(cmd)
}

const READY: Duration = Duration::from_secs(60);

struct Setup {
    dir: tempfile::TempDir,
    broker_sock: PathBuf,
    nbd_sock: PathBuf,
    _broker: ChildProc,
}

impl Setup {
    fn new() -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let broker_sock = dir.path().join("broker.sock");
        let broker = Command::new(FIDO)
            .args(["broker", "--heartbeat-ms", "100", "--pipe-disable", "--socket"])
            .arg(&broker_sock)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut broker = broker;
        let out = BufReader::new(broker.stdout.take().unwrap());
        let mut broker = ChildProc { child: broker, out };
        let t = Instant::now();
        while !broker_sock.exists() {
            assert!(t.elapsed() < Duration::from_secs(20), "broker never bound");
            assert!(broker.child.try_wait().unwrap().is_none(), "broker exited early");
            std::thread::sleep(Duration::from_millis(10));
        }
        let nbd_sock = dir.path().join("nbd.sock");
        Setup { dir, broker_sock, nbd_sock, _broker: broker }
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///disk?socket={}", self.nbd_sock.display())
    }

    fn serve(&self, args: &[&str]) -> ChildProc {
        let mut a = vec!["blk", "serve", "disk"];
        a.extend_from_slice(args);
        let mut p = start(&a, &self.broker_sock);
        p.expect_line("serving blk:disk", READY);
        p
    }

    fn nbd(&self) -> ChildProc {
        let sock = self.nbd_sock.to_str().unwrap();
        let mut p = start(&["blk", "nbd", "disk", "--unix", sock], &self.broker_sock);
        let line = p.expect_line("nbd: serving", READY);
        assert!(line.contains("export \"disk\""), "{line}");
        p
    }
}

fn have(tool: &str) -> bool {
    let ok = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIP: {tool} not installed (scripts/install-test-deps.sh installs it)");
    }
    ok
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(cmd: &mut Command) -> String {
    String::from_utf8(run(cmd).stdout).unwrap()
}

/// Pseudo-random bytes with zero stretches (every fourth 256 KiB).
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = vec![0u8; len];
    for (i, chunk) in v.chunks_mut(8).enumerate() {
        if (i * 8 / (256 << 10)) % 4 == 3 {
            continue;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    v
}

#[test]
fn real_nbd_clients_through_a_storage_domain() {
    let s = Setup::new();
    let _storage = s.serve(&["--ram", "64M"]);
    let mut nbd = s.nbd();
    let uri = s.uri();

    if have("qemu-img") {
        let info = stdout(Command::new("qemu-img").args(["info", "--output=json", &uri]));
        assert!(info.contains("\"virtual-size\": 67108864"), "{info}");
        let src = s.dir.path().join("src.raw");
        let back = s.dir.path().join("back.raw");
        let data = pattern(40 * MIB, 3);
        std::fs::write(&src, &data).unwrap();
        run(Command::new("qemu-img").args(["convert", "-n", "-f", "raw", "-O", "raw"]).arg(&src).arg(&uri));
        run(Command::new("qemu-img").args(["convert", "-f", "raw", "-O", "raw"]).arg(&uri).arg(&back));
        let got = std::fs::read(&back).unwrap();
        assert_eq!(got.len(), 64 * MIB);
        assert!(got[..data.len()] == data[..], "qemu-img convert round trip differs");
        assert!(got[data.len()..].iter().all(|&b| b == 0));
        std::fs::remove_file(&src).unwrap();
        std::fs::remove_file(&back).unwrap();
    }

    if have("qemu-io") {
        let out = stdout(Command::new("qemu-io").args([
            "-f", "raw",
            "-c", "write -P 0xab 0 1M",
            "-c", "read -P 0xab 0 1M",
            "-c", "write -P 0xcd -f 8M 5M",
            "-c", "read -P 0xcd 8M 5M",
            "-c", "flush",
            "-c", "discard 0 512k",
            "-c", "read -P 0 0 512k",
            "-c", "write -z 8M 1M",
            "-c", "read -P 0 8M 1M",
            "-c", "read -P 0xcd 9M 4M",
            &uri,
        ]));
        assert!(!out.contains("verification failed"), "{out}");
        assert!(!out.to_lowercase().contains("error"), "{out}");
    }

    if have("nbdinfo") {
        let list = stdout(Command::new("nbdinfo").args(["--list", "--json"]).arg(format!(
            "nbd+unix://?socket={}",
            s.nbd_sock.display()
        )));
        assert!(list.contains("\"export-name\": \"disk\""), "{list}");
        assert!(list.contains("base:allocation"), "{list}");
        assert!(list.contains("\"can_multi_conn\": true"), "{list}");
        let map = stdout(Command::new("nbdinfo").args(["--map"]).arg(&uri));
        // A storage domain does not report holes: one data extent.
        assert_eq!(map.split_whitespace().take(3).collect::<Vec<_>>(), ["0", "67108864", "0"], "{map}");
    }

    if have("nbdcopy") {
        let src = s.dir.path().join("copy-src.raw");
        let back = s.dir.path().join("copy-back.raw");
        let data = pattern(64 * MIB, 11);
        std::fs::write(&src, &data).unwrap();
        run(Command::new("nbdcopy").arg(&src).arg(&uri));
        run(Command::new("nbdcopy").args(["--connections=4", "--requests=16"]).arg(&uri).arg(&back));
        assert!(std::fs::read(&back).unwrap() == data, "nbdcopy round trip differs");
        std::fs::remove_file(&src).unwrap();
        std::fs::remove_file(&back).unwrap();
    }

    if have("fio") {
        let out = stdout(Command::new("fio").args([
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randrw",
            "--bs=4k,64k",
            "--iodepth=16",
            "--size=32M",
            "--verify=crc32c",
            "--verify_fatal=1",
        // No verify state file left in the working directory.
        "--verify_state_save=0",
            "--output-format=json",
        ]));
        assert!(out.contains("\"error\" : 0"), "{out}");
    }

    // Zero copies through our code: the NBD domain's counters (published on
    // every heartbeat) show the payload it moved and no byte it copied.
    let t = Instant::now();
    loop {
        let json = stdout(Command::new(FIDO).args(["status", "--json", "--socket"]).arg(&s.broker_sock));
        let status: serde_json::Value = serde_json::from_str(&json).unwrap();
        let nbd_domain = status["domains"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == "nbd:disk")
            .expect("the nbd:disk domain in fido status")
            .clone();
        let c = &nbd_domain["counters"];
        let (sent, copied) = (c["bytes_sent"].as_u64().unwrap(), c["bytes_copied"].as_u64().unwrap());
        assert_eq!(copied, 0, "fido blk nbd copied payload bytes: {c}");
        if sent >= 40 * MIB as u64 || !have("qemu-img") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "counters never showed the writes: {c}");
        std::thread::sleep(Duration::from_millis(100));
    }

    // SIGTERM: the server stops and takes its socket with it.
    nbd.signal(rustix::process::Signal::TERM);
    nbd.wait_success(Duration::from_secs(20));
    assert!(!s.nbd_sock.exists(), "the NBD socket outlived the server");
}

#[test]
fn the_storage_domain_dies_and_comes_back() {
    if !have("qemu-io") {
        return;
    }
    let s = Setup::new();
    let backing = s.dir.path().join("disk.img");
    std::fs::write(&backing, vec![0u8; 16 * MIB]).unwrap();
    let backing_arg = backing.to_str().unwrap();
    let mut storage = s.serve(&["--file", backing_arg]);
    let _nbd = s.nbd();
    let uri = s.uri();
    let qemu_io = |cmds: &[&str]| {
        let mut c = Command::new("qemu-io");
        c.args(["-f", "raw"]);
        for cmd in cmds {
            c.args(["-c", cmd]);
        }
        c.arg(&uri);
        c.output().unwrap()
    };
    let out = qemu_io(&["write -P 0x77 1M 1M", "flush"]);
    assert!(out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("error"), "{out:?}");

    // Killed in the middle of a busy fio job: the requests in flight fail,
    // fio stops on the error instead of hanging.
    let fio = have("fio").then(|| {
        Command::new("fio")
            .args(["--name=busy", "--ioengine=nbd", &format!("--uri={uri}"), "--rw=randrw", "--bs=4k"])
            .args(["--iodepth=32", "--size=8M", "--offset=4M", "--time_based", "--runtime=60"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    });
    std::thread::sleep(Duration::from_secs(1));
    storage.kill9();
    if let Some(mut fio) = fio {
        let t = Instant::now();
        let status = loop {
            if let Some(st) = fio.try_wait().unwrap() {
                break st;
            }
            if t.elapsed() > Duration::from_secs(30) {
                let _ = fio.kill();
                let _ = fio.wait();
                panic!("fio still running 30 s after the storage domain died");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(!status.success(), "fio reported no error although its storage domain died");
    }
    // Nothing serves the device: the client gets an error, not a hang.
    let t = Instant::now();
    let out = qemu_io(&["read -P 0x77 1M 1M"]);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success() || text.to_lowercase().contains("error") || text.contains("failed"), "{text}");
    assert!(t.elapsed() < Duration::from_secs(30));

    // Back on the same file: the same NBD server serves it again, with the data.
    let _storage = s.serve(&["--file", backing_arg]);
    let out = qemu_io(&["read -P 0x77 1M 1M"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && !text.contains("verification failed") && !text.contains("error"), "{out:?}");
}

#[test]
fn a_qemu_guest_boots_with_its_disk_on_fido_blk_nbd() {
    if !fido_test_support::vm::qemu_available() || !have("qemu-io") {
        eprintln!("SKIP: needs qemu-system-x86_64 and qemu-io");
        return;
    }
    let s = Setup::new();
    let _storage = s.serve(&["--ram", "64M"]);
    let _nbd = s.nbd();
    let uri = s.uri();
    // Something for the guest to find: 64 KiB of 0x5a at 1 MiB.
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x5a 1M 64k", &uri]));

    let image = fido_test_support::vm::image();
    let mut vm = fido_test_support::vm::boot_plain(
        &image,
        &["-drive".to_string(), format!("file={uri},format=raw,if=virtio,cache=none")],
    );
    let t = Duration::from_secs(60);
    let (rc, size) = vm.console.run("cat /sys/block/vda/size", t).unwrap();
    assert_eq!((rc, size.trim()), (0, "131072"), "the guest's virtio disk: {size}");
    // The guest reads what the host wrote ...
    let (rc, count) = vm
        .console
        .run("dd if=/dev/vda bs=65536 skip=16 count=1 2>/dev/null | wc -c; dd if=/dev/vda bs=65536 skip=16 count=1 2>/dev/null | tr -d Z | wc -c", t)
        .unwrap();
    let counts: Vec<&str> = count.split_whitespace().collect();
    assert_eq!((rc, counts), (0, vec!["65536", "0"]), "the guest's read: 64 KiB, all 0x5a ('Z')");
    // ... and writes, durably (O_DIRECT + fsync), what the host then reads.
    let (rc, out) = vm
        .console
        .run("echo fido-nbd-guest-write > /tmp/w && dd if=/tmp/w of=/dev/vda bs=512 seek=4096 conv=sync,fsync 2>&1", t)
        .unwrap();
    assert_eq!(rc, 0, "{out}");
    let back = s.dir.path().join("back");
    let mut c = Command::new(FIDO);
    c.args(["blk", "read", "disk", "2097152", "512", "--out"]).arg(&back).arg("--socket").arg(&s.broker_sock);
    run(&mut c);
    let got = std::fs::read(&back).unwrap();
    assert!(got.starts_with(b"fido-nbd-guest-write\n"), "{:?}", String::from_utf8_lossy(&got[..32]));
}
