//! For the pipe tests: a broker whose pipe engine starts at once, a pipe
//! client per test broker, and data with known content (files, streams,
//! checksums).

use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fido_broker::Config;
use fido_pipe::{Client, ClientOptions};

use crate::broker::{Preset, TestBroker};

/// Heartbeats every 100 ms (10 may be missed), and no capacity calibration
/// (it costs startup time; tests that need a capacity set one).
pub struct Pipes;

impl Preset for Pipes {
    fn configure(c: &mut Config) {
        c.heartbeat = Duration::from_millis(100);
        c.heartbeat_misses = 10;
        c.pipe.capacity = fido_broker::Capacity::Unlimited;
    }
}

impl TestBroker<Pipes> {
    /// A pipe client `name` connected to this broker.
    pub fn client(&self, name: &str) -> Client {
        Client::connect_with(ClientOptions::new(name).broker(&self.socket)).unwrap()
    }
}

pub use crate::bytes::pattern;

/// FNV-1a 64: a checksum to compare what arrived with what was sent.
pub fn sum(b: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &c in b {
        h ^= c as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// A file `dir/name` holding `data`, opened for reading.
pub fn file_with(dir: &Path, name: &str, data: &[u8]) -> (PathBuf, std::fs::File) {
    let p = dir.join(name);
    std::fs::write(&p, data).unwrap();
    let f = std::fs::File::open(&p).unwrap();
    (p, f)
}

/// An empty file `dir/name`, opened for reading and writing.
pub fn rw_file(dir: &Path, name: &str) -> (PathBuf, std::fs::File) {
    let p = dir.join(name);
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&p).unwrap();
    (p, f)
}

pub fn stream_pair() -> (UnixStream, UnixStream) {
    UnixStream::pair().unwrap()
}

/// Reads everything from a stream until EOF on a thread.
pub fn drain(mut s: UnixStream) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        s.read_to_end(&mut v).unwrap();
        v
    })
}

/// Writes `data` then closes the stream, on a thread.
pub fn feed(mut s: UnixStream, data: Vec<u8>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let _ = s.write_all(&data);
    })
}

pub fn dup(fd: impl AsFd) -> OwnedFd {
    fd.as_fd().try_clone_to_owned().unwrap()
}
