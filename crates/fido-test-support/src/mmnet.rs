//! For the MMNet (LD_PRELOAD) tests: a broker that runs programs with the
//! preload library, the library and C programs built for them, and the
//! statistics the library publishes (the proof that a connection was
//! accelerated).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use fido::{Domain, JoinOptions};
use fido_broker::Config;

use crate::broker::{Preset, TestBroker};

/// Heartbeats every 200 ms.
pub struct Mmnet;

impl Preset for Mmnet {
    fn configure(c: &mut Config) {
        c.heartbeat = Duration::from_millis(200);
    }
}

/// The MMNet suites' test broker.
pub type Broker = TestBroker<Mmnet>;

impl TestBroker<Mmnet> {
    /// A broker with this access policy (TOML, see docs/SECURITY.md).
    pub fn start_with_policy(policy: Option<&str>) -> Broker {
        Broker::start_with(|c| {
            if let Some(p) = policy {
                c.policy = std::sync::Arc::new(fido_broker::Policy::parse(p, "test policy").unwrap());
            }
        })
    }

    /// Gives the running broker a new policy (what SIGHUP does in `fido broker`).
    pub fn reload(&self, policy: &str) {
        self.reload.reload(fido_broker::Policy::parse(policy, "reloaded test policy").unwrap());
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
    fn registry_reader(&self) -> Domain {
        Domain::join(JoinOptions::new("net-test").broker(&self.socket).arena_len(1 << 20).ring_entries(2)).unwrap()
    }

    /// Statistics published by every process that ran under the preload.
    pub fn stats(&self) -> Vec<serde_json::Value> {
        let d = self.registry_reader();
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
        let d = self.registry_reader();
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
        self.stats().iter().filter(|v| v["name"] == name).map(|v| v["plain_local"].as_u64().unwrap_or(0)).sum()
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
        c.args(["build", "-q", "--target-dir"]).arg(target);
        // The features the whole workspace was built with (scripts/test.sh
        // sets this): with other features cargo would rebuild much of it.
        match std::env::var("FIDO_TEST_CARGO_ARGS") {
            Ok(args) => c.args(args.split_whitespace()),
            Err(_) => c.args(["-p", "fido-net", "-p", "fido-cli"]),
        };
        if dir.file_name().is_some_and(|n| n == "release") {
            c.arg("--release");
        }
        let st = c.status().expect("running cargo build");
        assert!(st.success(), "cargo build of the preload library and the fido binary failed");
    });
    let lib = dir.join("libfido_net.so");
    assert!(lib.is_file(), "{} missing: build with `cargo build -p fido-net`", lib.display());
    lib
}

/// Compiles `src`, a C program of the tested crate's `tests/c`, into `out`.
/// The crate is the one whose tests run (`cargo test` gives its directory as
/// `CARGO_MANIFEST_DIR`).
pub fn compile_c(src: &str, out: &Path, extra: &[&str]) {
    let crate_dir = std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR (run the tests with cargo)");
    let path = Path::new(&crate_dir).join("tests/c").join(src);
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
