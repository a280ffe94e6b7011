//! Waiting with deadlines — for a condition, a process, a port — and the
//! other processes a test runs (installed programs, children stopped on drop).

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Polls `f` until it holds, panicking after `timeout`.
pub fn eventually(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs a command to completion with a deadline; returns its stdout, or
/// panics with both outputs if it failed.
pub fn run_ok(mut c: Command, timeout: Duration) -> String {
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = c.spawn().unwrap();
    let out = wait_timeout(child, timeout);
    assert!(
        out.status.success(),
        "{:?} failed: {:?}\nstdout:\n{}\nstderr:\n{}",
        c,
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Waits for `child` to exit and collects its output; kills it and panics
/// (with what it printed) after `timeout`.
pub fn wait_timeout(mut child: Child, timeout: Duration) -> Output {
    let deadline = Instant::now() + timeout;
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "timed out after {timeout:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `cmd` to completion with its output collected (stdin closed), and
/// returns the output and the process id it had. Kills it and panics after
/// `limit`. The output is read on a helper thread, so a child that prints
/// more than a pipe holds never blocks on it.
pub fn run_limited(cmd: &mut Command, limit: Duration) -> (Output, u32) {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"));
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => (out.expect("collecting the child's output"), pid),
        Err(_) => {
            if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
            panic!("{cmd:?} did not finish within {limit:?}");
        }
    }
}

/// A free TCP port on 127.0.0.1 (bound then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Waits (up to 20 s) until something accepts on 127.0.0.1:port.
pub fn wait_port(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nothing listening on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits (up to 20 s) until the process `pid` (in its network namespace)
/// listens on `port` — without connecting (a probe connection would be
/// accepted).
pub fn wait_listening(pid: u32, port: u16) {
    let needle = format!(":{port:04X} 00000000:0000 0A");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let t = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
        if t.contains(&needle) {
            return;
        }
        assert!(Instant::now() < deadline, "nothing listens on {port} in {pid}'s namespace");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Is a program installed?
pub fn have(prog: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {prog}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A child process asked to stop (SIGTERM, then SIGKILL after 5 s) on drop.
pub struct Guard(pub Child);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.0.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.0.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
