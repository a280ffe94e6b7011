//! A private broker per test, and child processes re-executing this test
//! binary in a role (`FIDO_TEST_ROLE`, dispatched by the `child_main` test).
#![allow(dead_code)]

use fido::{Domain, JoinOptions};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

pub struct TestBroker {
    pub socket: PathBuf,
    // Dropped first: the broker stops before its directory goes.
    _broker: fido_broker::Embedded,
    pub dir: tempfile::TempDir,
}

impl TestBroker {
    pub fn start() -> TestBroker {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("broker.sock");
        let mut c = fido_broker::Config::new(&socket, dir.path().join("state"));
        c.heartbeat = Duration::from_millis(100);
        // Generous: a loaded CI machine must not declare a busy test domain hung
        // (crashes are detected at once through the liveness socket anyway).
        c.heartbeat_misses = 50;
        let broker = fido_broker::Embedded::start(c).unwrap();
        TestBroker { socket, _broker: broker, dir }
    }
    pub fn join(&self, name: &str) -> Domain {
        Domain::join(JoinOptions::new(name).broker(&self.socket).arena_len(64 << 20)).unwrap()
    }
}

pub struct ChildProc {
    pub child: Child,
    pub out: BufReader<ChildStdout>,
}

impl ChildProc {
    pub fn spawn(role: &str, broker: &std::path::Path) -> ChildProc {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "child_main", "--nocapture", "--test-threads=1", "-q"])
            .env("FIDO_TEST_ROLE", role)
            .env("FIDO_BROKER", broker)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        ChildProc { child, out }
    }
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
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `f` until it holds, panicking after `timeout`.
pub fn eventually(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}
