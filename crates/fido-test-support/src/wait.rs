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
///
/// The port comes from below the kernel's ephemeral range
/// (`ip_local_port_range`), and no two calls in one test process return the
/// same one. A port from `bind(0)` (what this did before) is exactly what the
/// kernel hands out next — to a test running alongside, or to any client's
/// `connect` — between our close and the program's `bind`: the program then
/// failed to bind, and a client waited forever on the other test's server
/// (nginx's first curl hung for 60 s on CI while iperf3's test started).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    // 12000 and up: clear of the well-known ports the tests' real servers use
    // by default (memcached 11211, redis 6379, MariaDB 3306, ...).
    let (low, high) = (12000u32, ephemeral_low.max(12000 + 1000));
    let span = high - low;
    // Test binaries run one after another, but a test may run fido CLI
    // processes that pick ports too: start each process somewhere else.
    let start = std::process::id().wrapping_mul(2654435761) % span;
    for _ in 0..span {
        let port = (low + (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span) as u16;
        // Free on every address (a wildcard listener or a connection's
        // source port would make the program's bind fail): the dual-stack
        // wildcard conflicts with both families.
        let free = std::net::TcpListener::bind(("::", port))
            .or_else(|_| std::net::TcpListener::bind(("0.0.0.0", port)).and_then(|l| {
                // No IPv6 here at all: the IPv4 wildcard is the whole check.
                if std::path::Path::new("/proc/net/if_inet6").exists() {
                    Err(std::io::ErrorKind::AddrInUse.into())
                } else {
                    Ok(l)
                }
            }))
            .is_ok();
        if free {
            return port;
        }
    }
    panic!("no free TCP port in {low}..{high}");
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
