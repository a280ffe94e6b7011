//! The library's errors.

use fido_proto::{ErrorCode, RemoteError};
use fido_ring::{INLINE_BYTES, MAX_SEGMENTS};

/// Everything that can go wrong in a Fido call.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The peer of this connection died or hung (it missed heartbeats). Messages
    /// already received stay readable; messages it never released are in
    /// [`crate::Channel::take_undelivered`].
    #[error("peer domain {domain} is gone ({reason})")]
    PeerGone { domain: u64, reason: &'static str },
    /// The peer closed the connection.
    #[error("peer closed the connection")]
    Closed,
    /// The peer broke the ring protocol (forged descriptor, index, pointer). The
    /// connection is unusable; nothing else is affected.
    #[error("peer violated the protocol: {0}")]
    Protocol(#[from] ProtocolError),
    /// A deadline passed.
    #[error("timed out")]
    Timeout,
    /// Non-blocking call that would have to wait.
    #[error("operation would block")]
    WouldBlock,
    /// The broker refused or failed a request.
    #[error("broker: {0}")]
    Broker(#[from] RemoteError),
    /// No broker is reachable.
    #[error("broker unavailable: {0}")]
    BrokerUnavailable(String),
    /// Arena or mapping failure.
    #[error(transparent)]
    Shm(#[from] fido_shm::ShmError),
    /// Invalid argument from the caller.
    #[error("invalid argument: {0}")]
    Invalid(#[from] InvalidArgument),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// The broker's error code, if the broker refused the request.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Broker(e) => Some(e.code),
            _ => None,
        }
    }

    /// The broker answered outside the control protocol.
    pub(crate) fn broker_protocol(msg: impl std::fmt::Display) -> Error {
        Error::Protocol(ProtocolError::Broker(msg.to_string()))
    }
}

/// How the other side broke the protocol ([`Error::Protocol`]). A peer's
/// lie ends its connection and nothing else; the broker's ends the request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// A descriptor the peer published failed validation.
    #[error("invalid descriptor: {0}")]
    Descriptor(crate::validate::Invalid),
    /// The peer moved a ring index where no honest peer can, or stopped
    /// taking our releases (a `fido_ring::RingError`, as its message).
    #[error("ring: {0}")]
    Ring(String),
    /// The peer released a message we have not sent (or released it twice).
    #[error("released unknown message cookie {cookie:#x}")]
    UnknownRelease { cookie: u64 },
    /// The peer's ring block is unusable (too small, outside its arena, not
    /// initialised).
    #[error("peer ring block: {0}")]
    PeerBlock(String),
    /// The broker sent something the control protocol does not allow here
    /// (an unexpected reply, a malformed message, the wrong descriptors).
    #[error("broker: {0}")]
    Broker(String),
}

/// What was wrong with the caller's request ([`Error::Invalid`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidArgument {
    /// More bytes than fit in a descriptor ([`crate::Message::inline`]).
    #[error("inline message of {len} bytes (at most {INLINE_BYTES})")]
    InlineTooLong { len: usize },
    /// More buffers than one message may gather.
    #[error("{count} segments (max {MAX_SEGMENTS})")]
    TooManySegments { count: usize },
    /// A message with an empty buffer in it.
    #[error("empty buffer in message")]
    EmptyBuffer,
    /// `JoinOptions::ring_entries` is not a power of two in 2..=65536.
    #[error("ring_entries {0} must be a power of two in 2..=65536")]
    RingEntries(u32),
    /// A name the broker would refuse (empty, too long, or a byte outside
    /// its alphabet).
    #[error("domain name: {0}")]
    Name(String),
    /// The broker's socket path cannot be a Unix socket address.
    #[error("broker socket path {path}: {why}")]
    BrokerPath { path: std::path::PathBuf, why: String },
    /// A request too large or malformed to encode.
    #[error("request: {0}")]
    Request(String),
    /// A part of a received message that cannot be shared
    /// ([`crate::Message::shared_part`]).
    #[error("shared part: {0}")]
    SharedPart(String),
    /// Our own ring block could not be laid out in the arena.
    #[error("ring block: {0}")]
    RingBlock(String),
}

impl From<rustix::io::Errno> for Error {
    fn from(e: rustix::io::Errno) -> Self {
        Error::Io(e.into())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
