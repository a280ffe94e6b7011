//! A TCG guest's virtio-blk disk served by `fido blk vhost` over a RAM
//! storage domain (`fido blk serve --ram`): the guest writes, flushes and
//! reads back a pattern, the bytes are in the storage domain, data written
//! from the host reads back in the guest, a discard reads back as zeros; then
//! QEMU is killed and a second guest on the same socket still finds the data
//! (the back end serves again). SIGTERM stops the back end, which reports
//! the bytes it copied.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fido_test_support::vm::{self, Console};
use fido_test_support::{Defaults, TestBroker};

const T: Duration = Duration::from_secs(60);
const MIB: u64 = 1 << 20;

/// The workspace's `fido` (target/release/fido beside this test's deps/).
fn fido_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("fido")
}

/// A child process, SIGKILLed and reaped when dropped.
struct Proc(Child);

impl Proc {
    /// Starts `fido ARGS` and waits for its first stdout line, which must start with `ready`.
    fn start(args: &[&str], stderr: Stdio, ready: &str) -> Proc {
        let mut child = Command::new(fido_bin())
            .args(args)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", fido_bin().display()));
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let p = Proc(child);
        assert!(
            line.starts_with(ready),
            "`fido {}` printed {line:?}, expected {ready:?}",
            args.join(" ")
        );
        p
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `fido ARGS | md5sum` on the host.
fn host_md5(args: &[String]) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("\"$0\" {} | md5sum", args.join(" ")))
        .arg(fido_bin())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "fido {args:?} | md5sum: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    first_word(&String::from_utf8_lossy(&out.stdout))
}

fn first_word(s: &str) -> String {
    s.split_whitespace().next().unwrap_or_default().to_string()
}

/// The md5 of `cmd`'s output in the guest.
fn guest_md5(c: &mut Console, cmd: &str) -> String {
    let out = c.run_ok(&format!("{cmd} | md5sum"), T);
    let md5 = first_word(&out);
    assert_eq!(md5.len(), 32, "`{cmd} | md5sum` printed {out:?}");
    md5
}

fn qemu_args(socket: &Path) -> Vec<String> {
    [
        "-object",
        "memory-backend-memfd,id=mem,size=256M,share=on",
        "-numa",
        "node,memdev=mem",
        "-chardev",
        &format!("socket,id=vb,path={}", socket.display()),
        "-device",
        "vhost-user-blk-pci,chardev=vb",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[test]
fn guest_disk_round_trip_then_a_second_guest_on_the_same_socket() {
    if !vm::qemu_available() {
        eprintln!("skipping: qemu-system-x86_64 is not installed");
        return;
    }
    let started = Instant::now();
    let image = vm::image();
    let b = TestBroker::<Defaults>::start();
    let broker = b.socket.to_str().unwrap().to_string();
    let _storage = Proc::start(
        &["blk", "serve", "disk", "--ram", "64M", "--socket", &broker],
        Stdio::inherit(),
        "serving blk:disk ",
    );
    let vhost_sock = b.dir.path().join("vhost.sock");
    let vhost_log = b.dir.path().join("vhost.log");
    let mut vhost = Proc::start(
        &[
            "blk",
            "vhost",
            "disk",
            "--socket",
            vhost_sock.to_str().unwrap(),
            "--broker",
            &broker,
        ],
        Stdio::from(std::fs::File::create(&vhost_log).unwrap()),
        "vhost-user-blk: serving blk:disk ",
    );

    // A block the host writes, for the guest to read.
    let host_block = b.dir.path().join("host-block");
    let pattern: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::File::create(&host_block)
        .unwrap()
        .write_all(&pattern)
        .unwrap();
    let host_block_md5 = first_word(&String::from_utf8_lossy(
        &Command::new("md5sum")
            .arg(&host_block)
            .output()
            .unwrap()
            .stdout,
    ));
    let fido = |args: &[&str]| {
        let out = Command::new(fido_bin())
            .args(args)
            .args(["--socket", &broker])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "fido {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    fido(&[
        "blk",
        "write",
        "disk",
        "8M",
        "--in",
        host_block.to_str().unwrap(),
    ]);

    let args = qemu_args(&vhost_sock);
    let pattern_md5;
    {
        let mut g = vm::boot_plain(&image, &args);
        let c = &mut g.console;
        assert_eq!(
            c.run_ok("cat /sys/block/vda/size", T).trim(),
            "131072",
            "64 MiB in 512-byte sectors"
        );
        assert_eq!(
            c.run_ok("cat /sys/block/vda/serial", T).trim(),
            "fido:disk",
            "GET_ID"
        );
        // Host → storage domain → guest.
        assert_eq!(
            guest_md5(
                c,
                "dd if=/dev/vda bs=4096 skip=2048 count=1 iflag=direct 2>/dev/null"
            ),
            host_block_md5
        );
        // Guest → storage domain: 4 MiB at 1 MiB, flushed (conv=fsync), read back.
        c.run_ok(
            "dd if=/dev/urandom of=/tmp/pat bs=1M count=4 2>/dev/null",
            T,
        );
        pattern_md5 = guest_md5(c, "cat /tmp/pat");
        c.run_ok(
            "dd if=/tmp/pat of=/dev/vda bs=1M seek=1 oflag=direct conv=fsync 2>/dev/null && sync",
            T,
        );
        assert_eq!(
            guest_md5(
                c,
                "dd if=/dev/vda bs=1M skip=1 count=4 iflag=direct 2>/dev/null"
            ),
            pattern_md5
        );
        // Through the page cache too (large merged requests, then a flush).
        c.run_ok("dd if=/tmp/pat of=/dev/vda bs=1M seek=24 2>/dev/null && sync && echo 3 > /proc/sys/vm/drop_caches", T);
        assert_eq!(
            guest_md5(c, "dd if=/dev/vda bs=1M skip=24 count=4 2>/dev/null"),
            pattern_md5
        );
        // Discard reads back as zeros (the RAM backing punches it).
        let zeros = guest_md5(c, "head -c 1048576 /dev/zero");
        c.run_ok("blkdiscard -o 25165824 -l 1048576 /dev/vda", T);
        assert_eq!(
            guest_md5(
                c,
                "dd if=/dev/vda bs=1M skip=24 count=1 iflag=direct 2>/dev/null"
            ),
            zeros
        );
        // The bytes are in the storage domain.
        let read = |off: u64, len: u64| {
            host_md5(
                &[
                    "blk",
                    "read",
                    "disk",
                    &off.to_string(),
                    &len.to_string(),
                    "--socket",
                    &broker,
                ]
                .map(String::from),
            )
        };
        assert_eq!(
            read(MIB, 4 * MIB),
            pattern_md5,
            "the guest's write is in the storage domain"
        );
        assert_eq!(read(24 * MIB, MIB), zeros);
        // Dropping the VM SIGKILLs QEMU: the back end sees its front end vanish.
    }
    {
        let mut g = vm::boot_plain(&image, &args);
        let c = &mut g.console;
        assert_eq!(
            guest_md5(
                c,
                "dd if=/dev/vda bs=1M skip=1 count=4 iflag=direct 2>/dev/null"
            ),
            pattern_md5,
            "second guest, same socket"
        );
        c.run_ok("printf second-guest > /tmp/s && dd if=/tmp/s of=/dev/vda bs=512 seek=40000 conv=sync oflag=direct 2>/dev/null", T);
        let out = Command::new(fido_bin())
            .args([
                "blk",
                "read",
                "disk",
                &(40000 * 512).to_string(),
                "512",
                "--socket",
                &broker,
            ])
            .output()
            .unwrap();
        assert!(
            out.stdout.starts_with(b"second-guest"),
            "host read {:?}",
            String::from_utf8_lossy(&out.stdout[..16.min(out.stdout.len())])
        );
    }

    // SIGTERM: the back end stops and says what it copied.
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&vhost.0),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = vhost.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "fido blk vhost did not exit on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let log = std::fs::read_to_string(&vhost_log).unwrap();
    assert!(status.success(), "fido blk vhost exited {status}:\n{log}");
    assert!(!vhost_sock.exists(), "the socket is removed on exit");
    let line = log
        .lines()
        .find(|l| l.contains("stopped after"))
        .unwrap_or_else(|| panic!("no summary line:\n{log}"));
    let number_before = |what: &str| -> u64 {
        let head = &line[..line
            .find(what)
            .unwrap_or_else(|| panic!("{what:?} in {line:?}"))];
        head.split_whitespace().last().unwrap().parse().unwrap()
    };
    assert_eq!(number_before(" connections"), 2, "{line}");
    assert!(number_before(" bytes from guests") >= 8 * MIB, "{line}");
    assert!(number_before(" to guests") >= 12 * MIB, "{line}");
    eprintln!("{line}\n(test took {:.1?})", started.elapsed());
}
