//! The carrier boundary: what a [`crate::Session`] needs from whatever moves
//! its messages, so that a domain which cannot pass file descriptors (a VM
//! guest) speaks the same protocol over another carrier.

use crate::error::Result;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

/// What one [`Transport::recv`] found.
#[derive(Debug)]
pub enum Received {
    /// One whole frame of `len` bytes at the start of the buffer, with the
    /// descriptors that came with it (always empty where
    /// [`Transport::passes_fds`] is false). `truncated`: the frame or its
    /// descriptors did not fit, and what arrived must not be used.
    Frame {
        len: usize,
        fds: Vec<OwnedFd>,
        truncated: bool,
    },
    /// Nothing arrived within the timeout (or the wait was interrupted).
    Idle,
    /// The other side closed the connection.
    Closed,
}

/// A connection to the broker that carries whole frames, each an encoded
/// `fido_proto` message. One thread receives (the session's reader) while any
/// number send, so every method takes `&self`.
pub trait Transport: Send + Sync + 'static {
    /// Sends one frame with `fds`, waiting for room. A transport that cannot
    /// pass descriptors is never handed any (the session refuses first) and
    /// must fail rather than drop them if it is.
    fn send(&self, frame: &[u8], fds: &[OwnedFd]) -> io::Result<()>;

    /// Sends one frame only if it fits now, for callers that must not block
    /// (a `Drop`). The default waits like [`send`](Transport::send).
    fn try_send(&self, frame: &[u8], fds: &[OwnedFd]) -> io::Result<()> {
        self.send(frame, fds)
    }

    /// Waits up to `timeout` (forever with `None`) for the next frame and
    /// receives it into `buf`, which holds the largest frame the protocol
    /// allows. This is where the reader thread waits.
    fn recv(&self, buf: &mut [u8], timeout: Option<Duration>) -> io::Result<Received>;

    /// Whether descriptors travel with frames on this carrier.
    fn passes_fds(&self) -> bool;

    /// Ends the connection both ways, waking a thread blocked in
    /// [`recv`](Transport::recv) (it then sees [`Received::Closed`]).
    fn shutdown(&self);
}

/// Makes transports to one broker: the first, and a fresh one each time the
/// session reconnects after losing the broker.
pub trait Connect: Send + Sync + 'static {
    fn connect(&self) -> Result<Arc<dyn Transport>>;
    /// Where the broker is, for messages ("/run/fido/broker.sock").
    fn address(&self) -> String;
}
