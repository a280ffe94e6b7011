//! Shared helpers for the multi-process tests: an in-process or child-process
//! broker, and child domains started by re-executing this test binary with
//! `FIDO_TEST_ROLE` set (the `child_main` test dispatches on it).
#![allow(dead_code)]

use fido::{Domain, JoinOptions};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

pub struct TestBroker {
    pub socket: PathBuf,
    // Dropped first: the broker stops before its directory goes.
    _broker: fido_broker::Embedded,
    pub dir: tempfile::TempDir,
}

pub fn config(socket: &Path, state: &Path) -> fido_broker::Config {
    let mut c = fido_broker::Config::new(socket, state);
    c.heartbeat = Duration::from_millis(100);
    c.heartbeat_misses = 5;
    c
}

impl TestBroker {
    /// A broker on a thread of this process.
    pub fn start() -> TestBroker {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("broker.sock");
        let broker = fido_broker::Embedded::start(config(&socket, &dir.path().join("state"))).unwrap();
        TestBroker { socket, _broker: broker, dir }
    }

    pub fn join(&self, name: &str) -> Domain {
        Domain::join(JoinOptions::new(name).broker(&self.socket).arena_len(64 << 20)).unwrap()
    }

    pub fn join_with(&self, opts: JoinOptions) -> Domain {
        Domain::join(opts.broker(&self.socket)).unwrap()
    }
}

/// A child process of this test binary in a role.
pub struct ChildProc {
    pub child: Child,
    pub out: BufReader<ChildStdout>,
}

impl ChildProc {
    pub fn spawn(role: &str, broker: &Path, env: &[(&str, &str)]) -> ChildProc {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "child_main", "--nocapture", "--test-threads=1", "-q"])
            .env("FIDO_TEST_ROLE", role)
            .env("FIDO_BROKER", broker)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        ChildProc { child, out }
    }

    /// Next line the child printed that starts with `prefix`, or panics after `timeout`.
    pub fn expect_line(&mut self, prefix: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        let mut line = String::new();
        while Instant::now() < deadline {
            line.clear();
            if self.out.read_line(&mut line).unwrap() == 0 {
                panic!("child exited before printing {prefix:?}");
            }
            if let Some(rest) = line.trim_end().strip_prefix(prefix) {
                return rest.trim().to_string();
            }
        }
        panic!("no {prefix:?} line within {timeout:?}");
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn signal(&self, sig: rustix::process::Signal) {
        rustix::process::kill_process(rustix::process::Pid::from_raw(self.pid()).unwrap(), sig).unwrap();
    }

    pub fn wait_success(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "child failed: {status}");
                return;
            }
            if Instant::now() > deadline {
                self.kill9();
                panic!("child did not finish within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Connects to `service`, retrying while it is not offered yet.
pub fn connect_retry(d: &Domain, service: &str, timeout: Duration) -> fido::Channel {
    let deadline = Instant::now() + timeout;
    loop {
        match d.connect(service) {
            Ok(c) => return c,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("connect {service}: {e}"),
        }
    }
}

/// Fills a message: seq (8 bytes), the buffer's own global pointer (8 bytes),
/// then a pattern derived from seq.
pub fn fill(buf: &mut [u8], seq: u64, gptr: u64) {
    buf[..8].copy_from_slice(&seq.to_le_bytes());
    buf[8..16].copy_from_slice(&gptr.to_le_bytes());
    for (i, b) in buf[16..].iter_mut().enumerate() {
        *b = (seq as u8).wrapping_add(i as u8).wrapping_mul(31);
    }
}

/// Checks a message made by `fill`; returns (seq, gptr in header).
pub fn check(bytes: fido::PeerSlice<'_>) -> (u64, u64) {
    let seq = u64::from_le_bytes(bytes.read_obj(0).unwrap());
    let gptr = u64::from_le_bytes(bytes.read_obj(8).unwrap());
    for (i, b) in bytes.iter().skip(16).enumerate() {
        assert_eq!(b, (seq as u8).wrapping_add(i as u8).wrapping_mul(31), "payload corrupted at {i} in seq {seq}");
    }
    (seq, gptr)
}
