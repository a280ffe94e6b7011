//! For tests whose parties are `fido` domains: brokers that notice a hung
//! domain quickly or patiently, joining, connecting while a service is not
//! offered yet, and payloads that check themselves.

use std::path::Path;
use std::time::{Duration, Instant};

use fido::{Domain, JoinOptions};
use fido_broker::Config;

use crate::broker::{Preset, TestBroker};

/// Heartbeats every 100 ms, a domain silent for 5 of them is declared hung:
/// tests of hang detection see it within about half a second.
pub struct HangDetection;

impl Preset for HangDetection {
    fn configure(c: &mut Config) {
        c.heartbeat = Duration::from_millis(100);
        c.heartbeat_misses = 5;
    }
}

/// Heartbeats every 100 ms, but 50 may be missed: a loaded machine must not
/// get a busy test domain declared hung (crashes are seen at once through
/// the liveness socket anyway).
pub struct Patient;

impl Preset for Patient {
    fn configure(c: &mut Config) {
        c.heartbeat = Duration::from_millis(100);
        c.heartbeat_misses = 50;
    }
}

/// [`HangDetection`]'s configuration for a broker with `socket` and `state`
/// (one a test runs in a child process, to kill it).
pub fn config(socket: &Path, state: &Path) -> Config {
    HangDetection::config(socket, state)
}

impl<P: Preset> TestBroker<P> {
    /// Joins a domain `name` with a 64 MiB arena.
    pub fn join(&self, name: &str) -> Domain {
        Domain::join(JoinOptions::new(name).broker(&self.socket).arena_len(64 << 20)).unwrap()
    }

    /// Joins with `opts`, through this broker.
    pub fn join_with(&self, opts: JoinOptions) -> Domain {
        Domain::join(opts.broker(&self.socket)).unwrap()
    }
}

/// Connects to `service`, retrying while it is not offered yet; panics after
/// `timeout`.
pub fn connect_retry(d: &Domain, service: &str, timeout: Duration) -> fido::Channel {
    let deadline = Instant::now() + timeout;
    loop {
        match d.connect(service) {
            Ok(c) => return c,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("connect {service}: {e}"),
        }
    }
}

/// Fills a message: seq (8 bytes), the buffer's own global pointer (8 bytes),
/// then a pattern derived from seq.
pub fn fill(buf: &mut [u8], seq: u64, gptr: u64) {
    buf[..8].copy_from_slice(&seq.to_le_bytes());
    buf[8..16].copy_from_slice(&gptr.to_le_bytes());
    for (i, b) in buf[16..].iter_mut().enumerate() {
        *b = (seq as u8).wrapping_add(i as u8).wrapping_mul(31);
    }
}

/// Checks a message made by [`fill`] (panics on a corrupted byte); returns
/// (seq, gptr in header).
pub fn check(bytes: fido::PeerSlice<'_>) -> (u64, u64) {
    let seq = u64::from_le_bytes(bytes.read_obj(0).unwrap());
    let gptr = u64::from_le_bytes(bytes.read_obj(8).unwrap());
    for (i, b) in bytes.iter().skip(16).enumerate() {
        assert_eq!(b, (seq as u8).wrapping_add(i as u8).wrapping_mul(31), "payload corrupted at {i} in seq {seq}");
    }
    (seq, gptr)
}
