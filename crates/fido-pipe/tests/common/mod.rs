//! A private broker per test and small helpers (files with known content,
//! checksums, socket pairs).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::time::Duration;

use fido_pipe::{Client, ClientOptions};

pub struct TestBroker {
    pub socket: PathBuf,
    // Dropped first: the broker stops before its directory goes.
    _broker: fido_broker::Embedded,
    pub dir: tempfile::TempDir,
}

impl TestBroker {
    pub fn start() -> TestBroker {
        TestBroker::with(|_| {})
    }

    pub fn with(f: impl FnOnce(&mut fido_broker::Config)) -> TestBroker {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("broker.sock");
        let mut c = fido_broker::Config::new(&socket, dir.path().join("state"));
        c.heartbeat = Duration::from_millis(100);
        c.heartbeat_misses = 10;
        // Calibration costs startup time; tests that need a capacity set one.
        c.pipe.capacity = fido_broker::Capacity::Unlimited;
        f(&mut c);
        let broker = fido_broker::Embedded::start(c).unwrap();
        TestBroker {
            socket,
            _broker: broker,
            dir,
        }
    }

    pub fn client(&self, name: &str) -> Client {
        Client::connect_with(ClientOptions::new(name).broker(&self.socket)).unwrap()
    }
}

/// Deterministic, position-dependent bytes (so a shifted copy is caught).
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// FNV-1a 64: a checksum to compare what arrived with what was sent.
pub fn sum(b: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &c in b {
        h ^= c as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

pub fn file_with(dir: &std::path::Path, name: &str, data: &[u8]) -> (PathBuf, std::fs::File) {
    let p = dir.join(name);
    std::fs::write(&p, data).unwrap();
    let f = std::fs::File::open(&p).unwrap();
    (p, f)
}

pub fn rw_file(dir: &std::path::Path, name: &str) -> (PathBuf, std::fs::File) {
    let p = dir.join(name);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&p)
        .unwrap();
    (p, f)
}

pub fn stream_pair() -> (
    std::os::unix::net::UnixStream,
    std::os::unix::net::UnixStream,
) {
    std::os::unix::net::UnixStream::pair().unwrap()
}

/// Reads everything from a stream until EOF on a thread.
pub fn drain(mut s: std::os::unix::net::UnixStream) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        s.read_to_end(&mut v).unwrap();
        v
    })
}

/// Writes `data` then closes the stream, on a thread.
pub fn feed(mut s: std::os::unix::net::UnixStream, data: Vec<u8>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let _ = s.write_all(&data);
    })
}

pub fn dup(fd: impl AsFd) -> OwnedFd {
    fd.as_fd().try_clone_to_owned().unwrap()
}
