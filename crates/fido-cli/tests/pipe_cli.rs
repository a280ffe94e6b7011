//! `fido pipe cp` and `fido pipe weight` against a real `fido broker`, and the
//! pipe section of `fido status --json`.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const FIDO: &str = env!("CARGO_BIN_EXE_fido");

struct Kill(std::process::Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn pipe_cp_weight_and_status() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("broker.sock");
    let broker = Command::new(FIDO)
        .args([
            "broker",
            "--heartbeat-ms",
            "100",
            "--pipe-capacity",
            "200M",
            "--pipe-lanes",
            "2",
            "--socket",
        ])
        .arg(&sock)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut broker = Kill(broker);
    let t = Instant::now();
    while !sock.exists() {
        assert!(t.elapsed() < Duration::from_secs(20), "broker never bound");
        assert!(
            broker.0.try_wait().unwrap().is_none(),
            "broker exited early"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let fido = |args: &[&str]| {
        let mut c = Command::new(FIDO);
        c.args(args)
            .env("FIDO_BROKER", &sock)
            .env_remove("RUST_LOG");
        c
    };

    // File to file, and into a directory.
    let data: Vec<u8> = (0..(5u32 << 20) + 3)
        .map(|i| (i.wrapping_mul(2654435761) >> 11) as u8)
        .collect();
    let src = dir.path().join("src.bin");
    std::fs::write(&src, &data).unwrap();
    let dst = dir.path().join("dst.bin");
    let out = fido(&["pipe", "cp", src.to_str().unwrap(), dst.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(std::fs::read(&dst).unwrap() == data, "copy differs");
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    let out = fido(&["pipe", "cp", src.to_str().unwrap(), sub.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        std::fs::read(sub.join("src.bin")).unwrap() == data,
        "copy into a directory differs"
    );

    // stdin (a pipe) to a file, and a file to stdout (a pipe).
    let from_stdin = dir.path().join("stdin.bin");
    let mut child = fido(&["pipe", "cp", "-", from_stdin.to_str().unwrap()])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let mut w = child.stdin.take().unwrap();
    let d2 = data.clone();
    let feeder = std::thread::spawn(move || w.write_all(&d2).unwrap());
    feeder.join().unwrap();
    assert!(child.wait().unwrap().success());
    assert!(
        std::fs::read(&from_stdin).unwrap() == data,
        "stdin copy differs"
    );
    let out = fido(&["pipe", "cp", src.to_str().unwrap(), "-"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(out.stdout == data, "stdout copy differs");

    // Errors are clear and fail the command.
    let out = fido(&["pipe", "cp", "/nonexistent/x", dst.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/x"));
    let out = fido(&["pipe", "weight", "no-such-domain", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("NoSuchDomain"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The engine's settings are in the status.
    let out = fido(&["status", "--json"]).output().unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["pipe_engine"]["capacity_bytes_per_s"], 200u64 << 20);
    assert_eq!(v["pipe_engine"]["lanes"], 2);
    assert_eq!(v["pipe_engine"]["work_conserving"], true);
    let out = fido(&["status"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("pipe engine: capacity 200.0 MiB/s"));
}

/// A FIFO as the source is refused at once ("not a regular file"), not after
/// waiting in `open` for a writer that may never come (someone else's FIFO
/// where a file was expected would hang the copy).
#[test]
fn pipe_cp_refuses_a_fifo_without_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let mut cp = Kill(
        Command::new(FIDO)
            .args(["pipe", "cp"])
            .arg(&fifo)
            .arg(dir.path().join("out"))
            .env("FIDO_BROKER", dir.path().join("no-broker.sock"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let t = Instant::now();
    let status = loop {
        if let Some(st) = cp.0.try_wait().unwrap() {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "fido pipe cp waits in open() on a FIFO"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(cp.0.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(!status.success());
    assert!(err.contains("not a regular file"), "{err}");
}
