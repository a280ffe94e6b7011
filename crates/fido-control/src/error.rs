//! What can go wrong between a domain and its broker.

use fido_proto::{ErrorCode, ProtoError, RemoteError};
use std::time::Duration;

/// Everything a control request or the session can fail with. Callers map it
/// to their own error type at their boundary.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// No broker to talk to: connecting failed, the link is down and did not
    /// come back in time, or the session has ended (the reason says which).
    #[error("broker unavailable: {0}")]
    Unavailable(String),
    /// The connection went away while this request waited for its reply: the
    /// broker may or may not have carried it out.
    #[error("broker connection lost: {0}")]
    Lost(String),
    /// No reply came within the request's timeout.
    #[error("no reply from the broker within {0:?}")]
    NoReply(Duration),
    /// The broker answered with an error.
    #[error("broker refused: {0}")]
    Refused(RemoteError),
    /// The request carries descriptors and the transport cannot pass them.
    #[error("this transport cannot pass descriptors ({count} attached)")]
    FdsNotSupported { count: usize },
    /// The broker sent something this side cannot accept.
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),
    /// The request could not be encoded (too large, …).
    #[error("request cannot be encoded: {0}")]
    Encode(ProtoError),
    /// The broker's address is not usable (e.g. a socket path too long).
    #[error("bad broker address {0}")]
    BadAddress(String),
    /// The answer of this [`crate::Pending`] was already taken.
    #[error("the answer was already taken")]
    AlreadyTaken,
    /// A local system call failed (creating a socket, an eventfd, a thread).
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

impl ControlError {
    /// The broker's error code, for refusals.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ControlError::Refused(e) => Some(e.code),
            _ => None,
        }
    }
}

impl From<rustix::io::Errno> for ControlError {
    fn from(e: rustix::io::Errno) -> Self {
        ControlError::Io(e.into())
    }
}

/// Ways the broker's side of the conversation can be malformed.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// A message (or its descriptors) did not fit the receive buffer.
    #[error("truncated control message from the broker")]
    Truncated,
    /// A message that does not decode or validate.
    #[error("undecodable control message from the broker: {0}")]
    Undecodable(ProtoError),
    /// A well-formed reply of the wrong kind for the request.
    #[error("unexpected answer to {request}: {reply}")]
    UnexpectedReply { request: &'static str, reply: String },
}

pub type Result<T, E = ControlError> = std::result::Result<T, E>;
