//! The library's errors.

use fido_proto::{ErrorCode, RemoteError};

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
    Protocol(String),
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
    Invalid(String),
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

    pub(crate) fn protocol(msg: impl std::fmt::Display) -> Error {
        Error::Protocol(msg.to_string())
    }
}

impl From<rustix::io::Errno> for Error {
    fn from(e: rustix::io::Errno) -> Self {
        Error::Io(e.into())
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
