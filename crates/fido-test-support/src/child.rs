//! This test binary re-executed as a child process in a role: the child runs
//! only the suite's `child_main` test, which reads `FIDO_TEST_ROLE` and does
//! that role's part (and is a no-op in a normal run). The parent reads the
//! lines the child prints to follow it.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process of this test binary in a role; killed when dropped.
pub struct ChildProc {
    pub child: Child,
    pub out: BufReader<ChildStdout>,
}

impl ChildProc {
    /// Runs `child_main` of this binary with `FIDO_TEST_ROLE=role`,
    /// `FIDO_BROKER=broker` and `env`; its stdout is piped to [`ChildProc::out`].
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

    /// The rest of the next line the child printed that starts with `prefix`
    /// (trimmed); panics if the child exits first or after `timeout`.
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

    /// Kills the child (SIGKILL) and reaps it.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn signal(&self, sig: rustix::process::Signal) {
        rustix::process::kill_process(rustix::process::Pid::from_raw(self.pid()).unwrap(), sig).unwrap();
    }

    /// Waits for the child to exit successfully; panics if it fails, or
    /// kills it and panics after `timeout`.
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
