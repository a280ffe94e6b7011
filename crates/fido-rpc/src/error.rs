//! Errors of calls: transport failures, faults the server reports, and the
//! application's own errors.

/// Why the server did not run a call (or could not finish it), as carried in
/// a reply. Stable numbers: they cross the C ABI too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[repr(u32)]
pub enum Fault {
    #[error("no such method")]
    UnknownMethod = 1,
    #[error("method signature differs between client and server")]
    BadSignature = 2,
    #[error("malformed call header")]
    BadHeader = 3,
    #[error("malformed arguments")]
    BadArguments = 4,
    #[error("a pointer outside the sender's grant, or misaligned")]
    BadPointer = 5,
    #[error("cancelled")]
    Cancelled = 6,
    #[error("deadline exceeded")]
    DeadlineExceeded = 7,
    #[error("the handler panicked")]
    Panicked = 8,
    #[error("the server could not allocate the reply")]
    ServerMemory = 9,
    #[error("the service refused the call")]
    Refused = 10,
}

impl Fault {
    pub fn from_code(c: u32) -> Option<Fault> {
        use Fault::*;
        Some(match c {
            1 => UnknownMethod,
            2 => BadSignature,
            3 => BadHeader,
            4 => BadArguments,
            5 => BadPointer,
            6 => Cancelled,
            7 => DeadlineExceeded,
            8 => Panicked,
            9 => ServerMemory,
            10 => Refused,
            _ => return None,
        })
    }
}

/// A failed call (not the application's error: see [`CallError`]).
#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    /// The server reported a fault; `String` is its message.
    #[error("server fault: {0}: {1}")]
    Fault(Fault, String),
    /// The server's process died, left or closed the connection while the
    /// call was in flight (or before it was sent). The next call reconnects.
    #[error("server gone: {0}")]
    ServerGone(String),
    /// The caller's deadline passed; the server was told to cancel.
    #[error("deadline exceeded")]
    DeadlineExceeded,
    /// The caller cancelled; the server was told.
    #[error("cancelled")]
    Cancelled,
    /// The reply was malformed (a bad header or a pointer outside the
    /// server's grant).
    #[error("bad reply: {0}")]
    BadReply(String),
    /// Our arena could not hold the arguments.
    #[error("out of arena memory: {0}")]
    Memory(String),
    #[error("invalid: {0}")]
    Invalid(String),
    /// A fido error (connecting, sending).
    #[error(transparent)]
    Fido(#[from] fido::Error),
}

/// The outcome of a call that failed: either the RPC layer, or the method's
/// own error `E` (copied out of the reply).
#[derive(Debug, thiserror::Error)]
pub enum CallError<E: std::fmt::Debug> {
    #[error("application error: {0:?}")]
    App(E),
    #[error(transparent)]
    Rpc(#[from] RpcError),
}

impl<E: std::fmt::Debug> CallError<E> {
    /// The application error, if that is what this is.
    pub fn app(&self) -> Option<&E> {
        match self {
            CallError::App(e) => Some(e),
            _ => None,
        }
    }
    pub fn rpc(&self) -> Option<&RpcError> {
        match self {
            CallError::Rpc(e) => Some(e),
            _ => None,
        }
    }
}

impl From<Fault> for RpcError {
    fn from(f: Fault) -> RpcError {
        RpcError::Fault(f, f.to_string())
    }
}

/// What a handler returning `Result<R, Failure<E>>` can fail with: its
/// application error `E` (delivered to the caller as `CallError::App`) or a
/// fault (`CallError::Rpc(RpcError::Fault)`). `?` converts a [`Fault`], e.g.
/// from [`crate::View::slice`].
#[derive(Debug)]
pub enum Failure<E> {
    App(E),
    Fault(Fault),
}

impl<E> From<Fault> for Failure<E> {
    fn from(f: Fault) -> Self {
        Failure::Fault(f)
    }
}
