//! This test binary re-executed as a child process in a role: the child runs
//! only the suite's `child_main` test, which reads `FIDO_TEST_ROLE` and does
//! that role's part (and is a no-op in a normal run). The parent reads the
//! lines the child prints to follow it. Cross-uid tests run it (or any
//! program) as another user through `setpriv` ([`as_user`], [`role_command`])
//! and follow it with a [`RoleChild`].

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use crate::users::User;

/// The arguments that make a test binary run its `child_main` test alone.
const CHILD_MAIN_ARGS: [&str; 5] = [
    "--exact",
    "child_main",
    "--nocapture",
    "--test-threads=1",
    "-q",
];

/// `prog args` as `user`: real and effective uid and gid through `setpriv`,
/// no supplementary groups (root's are not inherited). As ourselves with
/// `user` `None`.
pub fn as_user<I, S>(user: Option<User>, prog: &Path, args: I) -> Command
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = match user {
        None => Command::new(prog),
        Some(u) => {
            let mut c = Command::new("setpriv");
            c.arg(format!("--reuid={}", u.uid))
                .arg(format!("--regid={}", u.gid))
                .arg("--clear-groups")
                .arg(prog);
            c
        }
    };
    cmd.args(args);
    cmd
}

/// This test binary running only its `child_main` test, as `user` (or as
/// ourselves): the caller adds the environment that names the role.
pub fn role_command(user: Option<User>) -> Command {
    as_user(user, &std::env::current_exe().unwrap(), CHILD_MAIN_ARGS)
}

/// A child process followed through the lines it prints, with its stdin held
/// open (a role that holds on until its stdin closes ends at
/// [`RoleChild::close_stdin`]); killed and reaped when dropped.
pub struct RoleChild {
    pub child: Child,
    pub out: BufReader<ChildStdout>,
    pub stdin: Option<ChildStdin>,
}

impl RoleChild {
    /// Starts `cmd` with stdin and stdout piped, stderr inherited.
    pub fn spawn(mut cmd: Command) -> RoleChild {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {cmd:?} (setpriv comes with util-linux): {e}"));
        let out = BufReader::new(child.stdout.take().unwrap());
        let stdin = child.stdin.take();
        RoleChild { child, out, stdin }
    }

    /// The rest of the next line the child printed that starts with `prefix`
    /// (trimmed); panics if the child exits first.
    pub fn line(&mut self, prefix: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            if self.out.read_line(&mut line).unwrap() == 0 {
                let st = self.child.wait().unwrap();
                panic!(
                    "child exited ({st}) before printing {prefix:?}; if it could not run at all \
                     as another user, check that {} is readable and executable by others",
                    std::env::current_exe().unwrap().display()
                );
            }
            if let Some(rest) = line.trim_end().strip_prefix(prefix) {
                return rest.trim().to_string();
            }
        }
    }

    /// Closes the child's stdin: a role that holds on until then ends.
    pub fn close_stdin(&mut self) {
        self.stdin.take();
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
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("child did not finish within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for RoleChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A child process of this test binary in a role; killed when dropped.
pub struct ChildProc {
    pub child: Child,
    pub out: BufReader<ChildStdout>,
}

impl ChildProc {
    /// Runs `child_main` of this binary with `FIDO_TEST_ROLE=role`,
    /// `FIDO_BROKER=broker` and `env`; its stdout is piped to [`ChildProc::out`].
    pub fn spawn(role: &str, broker: &Path, env: &[(&str, &str)]) -> ChildProc {
        let mut cmd = role_command(None);
        cmd.env("FIDO_TEST_ROLE", role).env("FIDO_BROKER", broker);
        for (k, v) in env {
            cmd.env(k, v);
        }
        ChildProc::start(cmd)
    }

    /// Starts `cmd` with its stdout piped to [`ChildProc::out`] (stdin and
    /// stderr inherited).
    pub fn start(mut cmd: Command) -> ChildProc {
        cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
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
