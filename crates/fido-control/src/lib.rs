//! The client side of Fido's broker control protocol, written once for every
//! kind of domain (a `fido` domain, a `fido-pipe` client, later a VM guest).
//!
//! Three layers, kept apart as rust-vmm's `vhost` keeps protocol, transport and
//! handler apart:
//!
//! - the protocol's messages come from `fido-proto` (this crate defines none);
//! - a [`Transport`] carries framed messages, with descriptors where the
//!   carrier can pass them ([`UnixSeqpacket`]: `SOCK_SEQPACKET` and
//!   `SCM_RIGHTS`); a [`Connect`] makes a fresh one after the broker restarts;
//! - a [`Session`] matches replies to requests by id, delivers events to the
//!   caller's [`Handler`], sends heartbeats, and when the broker goes away fails
//!   what was pending and — if asked to — reconnects with back-off and replays
//!   the registration the handler supplies.
//!
//! What this crate must never do: assume the carrier passes descriptors (a
//! request with descriptors on a transport that cannot pass them is refused
//! with [`ControlError::FdsNotSupported`] before anything is sent); block a
//! caller forever on a dead broker (losing the connection fails every pending
//! request, and the blocking calls have timeouts); deliver a reply to anyone
//! but the request with its id; keep the caller's state alive (the reader
//! thread holds its [`Handler`] weakly and ends when it is gone); or touch the
//! data path — no message payload ever passes through here.

#![forbid(unsafe_code)]

mod error;
mod pending;
mod session;
mod transport;
mod unix;

pub use error::{ControlError, ProtocolError, Result};
pub use pending::{Answer, Pending};
pub use session::{Backoff, Handler, Joined, Options, Session, Stats, REQUEST_TIMEOUT};
pub use transport::{Connect, Received, Transport};
pub use unix::{UnixConnector, UnixSeqpacket};
