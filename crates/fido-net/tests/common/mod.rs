//! Shared by the fido-net tests: a private broker, the preload library,
//! helpers to run programs with and without it, and the statistics the
//! library publishes (the proof that a connection was accelerated).
#![allow(dead_code)]

use fido::{Domain, JoinOptions};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Broker {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    shutdown: Option<fido_broker::ShutdownHandle>,
    reload: Option<fido_broker::ReloadHandle>,
    thread: Option<std::thread::JoinHandle<Result<(), fido_broker::BrokerError>>>,
}

impl Broker {
    pub fn start() -> Broker {
        Broker::start_with_policy(None)
    }

    /// A broker with this access policy (TOML, see docs/SECURITY.md).
    pub fn start_with_policy(policy: Option<&str>) -> Broker {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("broker.sock");
        let mut cfg = fido_broker::Config::new(&socket, dir.path().join("state"));
        cfg.heartbeat = Duration::from_millis(200);
        if let Some(p) = policy {
            cfg.policy = std::sync::Arc::new(fido_broker::Policy::parse(p, "test policy").unwrap());
        }
        let b = fido_broker::Broker::bind(cfg).unwrap();
        let shutdown = b.shutdown_handle();
        let reload = b.reload_handle();
        let thread = std::thread::spawn(move || b.run());
        Broker {
            dir,
            socket,
            shutdown: Some(shutdown),
            reload: Some(reload),
            thread: Some(thread),
        }
    }

    /// Gives the running broker a new policy (what SIGHUP does in `fido broker`).
    pub fn reload(&self, policy: &str) {
        self.reload
            .as_ref()
            .unwrap()
            .reload(fido_broker::Policy::parse(policy, "reloaded test policy").unwrap());
    }

    /// A command that runs `prog` with MMNet preloaded against this broker.
    pub fn accel(&self, prog: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new(prog);
        c.env("LD_PRELOAD", library())
            .env("FIDO_BROKER", &self.socket)
            .env_remove("FIDO_NET")
            // A loaded CI machine may take long to accept: the tests assert
            // acceleration, so give the server time to attach.
            .env("FIDO_NET_ATTACH_MS", "10000");
        c
    }

    /// A short-lived domain for reading the registry.
    fn join(&self) -> Domain {
        Domain::join(
            JoinOptions::new("net-test")
                .broker(&self.socket)
                .arena_len(1 << 20)
                .ring_entries(2),
        )
        .unwrap()
    }

    /// Statistics published by every process that ran under the preload.
    pub fn stats(&self) -> Vec<serde_json::Value> {
        let d = self.join();
        let mut out = Vec::new();
        for id in d.list("/net/stats").unwrap() {
            if let Ok(Some(v)) = d.read(&format!("/net/stats/{id}")) {
                out.push(serde_json::from_slice(&v).unwrap());
            }
        }
        let _ = d.leave();
        out
    }

    /// The registry's children of `path`.
    pub fn list(&self, path: &str) -> Vec<String> {
        let d = self.join();
        let v = d.list(path).unwrap_or_default();
        let _ = d.leave();
        v
    }

    /// Waits (up to 20 s) until a listener on `port` is published (the
    /// library publishes right after the kernel's `listen` returns, so a
    /// client started as soon as the port listens may not see it yet).
    pub fn wait_listener(&self, port: u16) {
        self.wait_listeners(port, 1)
    }

    /// Waits until `n` listeners on `port` are published (several namespaces).
    pub fn wait_listeners(&self, port: u16, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.list(&format!("/net/listen/{port}")).len() < n {
            assert!(Instant::now() < deadline, "no listener published on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits (up to 10 s: statistics are published every 200 ms and at exit)
    /// until `name`'s accelerated connections reach `n`; returns the totals.
    pub fn wait_accelerated(&self, name: &str, n: u64) -> (u64, u64, u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let t = self.accelerated(name);
            if t.0 >= n || Instant::now() > deadline {
                return t;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Plain connections between processes under the preload on this host
    /// (`plain_local`) of processes named `name`.
    pub fn plain_local(&self, name: &str) -> u64 {
        self.stats()
            .iter()
            .filter(|v| v["name"] == name)
            .map(|v| v["plain_local"].as_u64().unwrap_or(0))
            .sum()
    }

    /// Total accelerated connections and bytes (sent, received) of processes
    /// whose name is `name`.
    pub fn accelerated(&self, name: &str) -> (u64, u64, u64) {
        let mut t = (0, 0, 0);
        for v in self.stats() {
            if v["name"] == name {
                t.0 += v["accelerated"].as_u64().unwrap_or(0);
                t.1 += v["bytes_sent"].as_u64().unwrap_or(0);
                t.2 += v["bytes_received"].as_u64().unwrap_or(0);
            }
        }
        t
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            s.shutdown();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The preload library built beside this test binary (target/<profile>/).
/// `cargo test` does not (re)build a cdylib, so the first call runs
/// `cargo build -p fido-net -p fido-cli` for this profile and target dir
/// (a no-op when up to date; `fido` is needed by the `fido run` test).
pub fn library() -> PathBuf {
    static BUILT: std::sync::Once = std::sync::Once::new();
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
    BUILT.call_once(|| {
        let target = dir.parent().unwrap();
        let mut c = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
        c.args([
            "build",
            "-q",
            "-p",
            "fido-net",
            "-p",
            "fido-cli",
            "--target-dir",
        ])
        .arg(target);
        if dir.file_name().is_some_and(|n| n == "release") {
            c.arg("--release");
        }
        let st = c.status().expect("running cargo build");
        assert!(st.success(), "cargo build -p fido-net -p fido-cli failed");
    });
    let lib = dir.join("libfido_net.so");
    assert!(
        lib.is_file(),
        "{} missing: build with `cargo build -p fido-net`",
        lib.display()
    );
    lib
}

/// Compiles a C source of tests/c into `out`.
pub fn compile_c(src: &str, out: &Path, extra: &[&str]) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/c")
        .join(src);
    let st = Command::new("cc")
        .args(["-O1", "-g", "-Wall", "-o"])
        .arg(out)
        .arg(&path)
        .args(extra)
        .args(["-lpthread"])
        .status()
        .expect("cc");
    assert!(st.success(), "compiling {src}");
}

/// Runs a command to completion with a deadline; returns stdout.
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

pub fn wait_timeout(mut child: Child, timeout: Duration) -> std::process::Output {
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

/// A free TCP port on 127.0.0.1 (bound then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits until something accepts on 127.0.0.1:port.
pub fn wait_port(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nothing listening on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until the process `pid` (in its network namespace) listens on
/// `port` — without connecting (a probe connection would be accepted).
pub fn wait_listening(pid: u32, port: u16) {
    let needle = format!(":{port:04X} 00000000:0000 0A");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let t = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
        if t.contains(&needle) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "nothing listens on {port} in {pid}'s namespace"
        );
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

/// A child process killed on drop.
pub struct Guard(pub Child);
impl Drop for Guard {
    fn drop(&mut self) {
        // SAFETY: sending SIGTERM to our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
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
