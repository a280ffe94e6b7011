//! A memory-backed NBD server on a Unix socket in a temporary directory, and
//! what the tool tests share.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use fido_blk_nbd::{Listener, MemoryExport, MemoryOptions, NbdServer, ServerConfig};

pub struct TestServer {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub server: NbdServer<MemoryExport>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl TestServer {
    pub fn start(opts: MemoryOptions) -> TestServer {
        Self::start_with(opts, ServerConfig::new("mem"))
    }

    pub fn start_with(opts: MemoryOptions, cfg: ServerConfig) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("nbd.sock");
        let listener = Listener::bind_unix(&socket).unwrap();
        let server = NbdServer::new(MemoryExport::new(opts).unwrap(), cfg).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (server, stop) = (server.clone(), stop.clone());
            std::thread::spawn(move || server.serve(&listener, &stop).unwrap())
        };
        TestServer { dir, socket, server, stop, thread: Some(thread) }
    }

    pub fn export(&self) -> &MemoryExport {
        self.server.export()
    }

    /// `nbd+unix:///EXPORT?socket=PATH`
    pub fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Is `tool` on PATH? Tests that need it skip (with a message) when not.
pub fn have(tool: &str) -> bool {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false);
    if !found {
        eprintln!("SKIP: {tool} not installed (scripts/install-test-deps.sh installs it)");
    }
    found
}

/// Runs a command, panicking with its output when it fails.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    if !out.status.success() {
        panic!(
            "{cmd:?} failed ({}):\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

pub fn stdout(cmd: &mut Command) -> String {
    String::from_utf8(run(cmd).stdout).unwrap()
}

/// A file of `len` pseudo-random bytes with some all-zero stretches.
pub fn pattern_file(path: &Path, len: usize, seed: u64) {
    let mut x = seed | 1;
    let mut v = vec![0u8; len];
    for (i, chunk) in v.chunks_mut(8).enumerate() {
        // Every fourth 256 KiB stretch stays zero (a hole for qemu-img to find).
        if (i * 8 / (256 << 10)) % 4 == 3 {
            continue;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
    std::fs::write(path, v).unwrap();
}
