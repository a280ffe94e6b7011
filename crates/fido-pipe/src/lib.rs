//! vPipe for Fido: the application hands two descriptors to the broker and the
//! broker's pipe engine moves the bytes between them (file → socket, socket →
//! socket, socket → file, file → file) with splice through io_uring, sharing
//! its capacity among domains by weight.
//!
//! A [`Client`] is a domain of its own: it joins the broker (a tiny arena, so
//! the broker's policy and quotas apply to it as to any domain) with a
//! `fido-control` session, which keeps the heartbeat going and matches replies
//! to requests on its reader thread.
//! [`Client::create`] registers a [`Pipe`] (the descriptors are passed once,
//! with `SCM_RIGHTS`); its operations are blocking ([`Pipe::file_to_socket`] …)
//! or asynchronous ([`Pipe::start`] → [`Pending`], a `Future` that also offers a
//! pollable eventfd). One-shot operations without a handle are on the client
//! ([`Client::once`]). Results are exact: bytes written to the sink, bytes taken
//! from the source, end of input, or the error with the counts so far.
//!
//! What this crate must never do: move payload bytes itself (it only sends
//! control messages and descriptors), keep a descriptor it was lent beyond the
//! call (it passes duplicates; the broker keeps its own until the pipe is
//! destroyed), or block a caller forever on a dead broker (its death fails every
//! pending operation).

#![forbid(unsafe_code)]

use std::future::Future;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use fido_control::{ControlError, Handler, Options, Session, UnixConnector};
use fido_proto::{wire, Reply, Request};

pub use fido_proto::{
    DomainId, ErrorCode, PipeDomainStatus, PipeEnd, PipeEngineStatus, PipeFdKind, PipeId, PipeOp,
    PipeResult, RemoteError, Status,
};

/// A length meaning "until the source ends" (the largest length the protocol
/// takes, 2^62 bytes): `p.socket_to_socket(UNTIL_EOF)` returns at EOF with
/// `eof: true` and the exact count.
pub const UNTIL_EOF: u64 = fido_proto::MAX_PIPE_LEN;

/// How long a plain request (create, cancel, weight, status) waits for its reply.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// What went wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No broker, or it went away (every pending operation fails with this).
    #[error("broker unavailable: {0}")]
    BrokerUnavailable(String),
    /// The broker refused the request (nothing was moved): bad descriptor,
    /// quota, denied, no such pipe, busy …
    #[error("broker refused: {0}")]
    Refused(RemoteError),
    /// The transfer started and a system call failed; `moved` bytes reached the
    /// sink and `consumed` left the source before it did.
    #[error("pipe transfer failed after {moved} bytes: {message} (errno {errno})")]
    Transfer {
        moved: u64,
        consumed: u64,
        errno: i32,
        message: String,
    },
    /// The transfer was cancelled after moving `moved` bytes.
    #[error("pipe transfer cancelled after {moved} bytes")]
    Cancelled { moved: u64, consumed: u64 },
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("{0}")]
    Sys(#[from] rustix::io::Errno),
    #[error("arena: {0}")]
    Shm(#[from] fido_shm::ShmError),
}

impl Error {
    /// The broker's error code, for refusals.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Refused(e) => Some(e.code),
            _ => None,
        }
    }

    /// A negative errno-style code (for the C API).
    pub fn errno(&self) -> i32 {
        let e = match self {
            Error::BrokerUnavailable(_) => libc_consts::ENOTCONN,
            Error::Refused(r) => match r.code {
                ErrorCode::BadDescriptor => libc_consts::EBADF,
                ErrorCode::Denied => libc_consts::EPERM,
                ErrorCode::Quota => libc_consts::EDQUOT,
                ErrorCode::NoSuchPipe | ErrorCode::NoSuchDomain => libc_consts::ENOENT,
                ErrorCode::Busy => libc_consts::EBUSY,
                ErrorCode::Unavailable => libc_consts::ENOTCONN,
                _ => libc_consts::EINVAL,
            },
            Error::Transfer { errno, .. } => *errno,
            Error::Cancelled { .. } => libc_consts::ECANCELED,
            Error::Protocol(_) => libc_consts::EPROTO,
            Error::Sys(e) => e.raw_os_error(),
            Error::Shm(_) => libc_consts::ENOMEM,
        };
        -e.abs()
    }
}

mod libc_consts {
    use rustix::io::Errno;
    pub const ENOTCONN: i32 = Errno::NOTCONN.raw_os_error();
    pub const EBADF: i32 = Errno::BADF.raw_os_error();
    pub const EPERM: i32 = Errno::PERM.raw_os_error();
    pub const EDQUOT: i32 = Errno::DQUOT.raw_os_error();
    pub const ENOENT: i32 = Errno::NOENT.raw_os_error();
    pub const EBUSY: i32 = Errno::BUSY.raw_os_error();
    pub const EINVAL: i32 = Errno::INVAL.raw_os_error();
    pub const ECANCELED: i32 = Errno::CANCELED.raw_os_error();
    pub const EPROTO: i32 = Errno::PROTO.raw_os_error();
    pub const ENOMEM: i32 = Errno::NOMEM.raw_os_error();
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A finished transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transfer {
    /// Bytes written to the sink.
    pub moved: u64,
    /// Bytes taken from the source (equals `moved` for a finished transfer).
    pub consumed: u64,
    /// The source ended before the requested length.
    pub eof: bool,
}

impl Transfer {
    fn from_result(r: PipeResult) -> Result<Transfer> {
        match r.end {
            PipeEnd::Done => Ok(Transfer {
                moved: r.moved,
                consumed: r.consumed,
                eof: false,
            }),
            PipeEnd::Eof => Ok(Transfer {
                moved: r.moved,
                consumed: r.consumed,
                eof: true,
            }),
            PipeEnd::Cancelled => Err(Error::Cancelled {
                moved: r.moved,
                consumed: r.consumed,
            }),
            PipeEnd::Failed { errno, message } => Err(Error::Transfer {
                moved: r.moved,
                consumed: r.consumed,
                errno,
                message,
            }),
        }
    }
}

/// How a [`Client`] joins the broker.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Broker socket; default `$FIDO_BROKER`, `$XDG_RUNTIME_DIR/fido/broker.sock`, `/run/fido/broker.sock`.
    pub broker: Option<PathBuf>,
    /// Domain name (weights can be set by name).
    pub name: String,
    /// Optional label the policy can select on.
    pub label: Option<String>,
}

impl ClientOptions {
    pub fn new(name: impl Into<String>) -> ClientOptions {
        ClientOptions {
            broker: None,
            name: name.into(),
            label: None,
        }
    }
    pub fn broker(mut self, path: impl Into<PathBuf>) -> Self {
        self.broker = Some(path.into());
        self
    }
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }
}

/// The domain behind a [`Client`]: its session with the broker. The session's
/// reader thread holds it weakly, so it goes when the last clone and pipe do.
struct Inner {
    session: Session,
    domain: DomainId,
}

impl Handler for Inner {
    // A pipe-only domain offers nothing and watches nothing: events (e.g. a
    // PeerGone for a slot it never mapped) are of no interest.
    fn event(&self, _event: fido_proto::Event, _fds: Vec<OwnedFd>) {}
}

impl Inner {
    /// Sends a request with duplicates of `fds` (the caller keeps its own).
    fn start(&self, body: Request, fds: &[BorrowedFd<'_>]) -> Result<fido_control::Pending> {
        let dups = fds.iter().map(|f| wire::dup(*f)).collect::<Result<Vec<_>, _>>()?;
        Ok(self.session.start_request(body, &dups)?)
    }

    fn request(&self, body: Request, fds: &[BorrowedFd<'_>]) -> Result<(Reply, Vec<OwnedFd>)> {
        let dups = fds.iter().map(|f| wire::dup(*f)).collect::<Result<Vec<_>, _>>()?;
        Ok(self.session.request(body, &dups)?)
    }
}

impl From<ControlError> for Error {
    fn from(e: ControlError) -> Error {
        match e {
            // Without reconnection, a lost broker ends the client: requests in
            // flight and every later one fail alike.
            ControlError::Unavailable(why) | ControlError::Lost(why) => Error::BrokerUnavailable(why),
            e @ (ControlError::NoReply(_) | ControlError::BadAddress(_)) => {
                Error::BrokerUnavailable(e.to_string())
            }
            ControlError::Refused(remote) => Error::Refused(remote),
            ControlError::AlreadyTaken => Error::Protocol("the result was already taken".into()),
            ControlError::Io(io) => Error::Sys(rustix::io::Errno::from_io_error(&io).unwrap_or(rustix::io::Errno::IO)),
            e @ (ControlError::Protocol(_) | ControlError::Encode(_) | ControlError::FdsNotSupported { .. }) => {
                Error::Protocol(e.to_string())
            }
        }
    }
}

/// A connection to the broker's pipe engine (one domain). Cheap to clone;
/// the domain leaves when the last clone and every [`Pipe`] are dropped.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("domain", &self.inner.domain)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Joins the broker as a domain named `name` at the default socket.
    pub fn connect(name: &str) -> Result<Client> {
        Client::connect_with(ClientOptions::new(name))
    }

    /// Joins the broker with these options.
    pub fn connect_with(opts: ClientOptions) -> Result<Client> {
        let path = opts
            .broker
            .clone()
            .unwrap_or_else(fido_proto::default_broker_path);
        // The broker admits domains with an arena; ours is the smallest
        // (64 KiB, sparse) since pipe traffic never goes through it.
        let arena = fido_shm::UnplacedArena::create(64 << 10, false)?;
        let ro = arena.ro_fd()?;
        let join = Request::Join {
            name: opts.name.clone(),
            label: opts.label.clone(),
            arena_len: arena.len(),
            resume: None,
        };
        // No reconnection: losing the broker fails every pending operation and
        // ends the client (its pipes died with the broker's engine).
        let options = Options {
            request_timeout: REQUEST_TIMEOUT,
            link_wait: None,
            reconnect: None,
        };
        let (session, joined) =
            Session::join(Arc::new(UnixConnector::new(path)), join, vec![ro], options)?;
        let inner = Arc::new(Inner {
            session,
            domain: joined.domain,
        });
        let weak: Weak<dyn Handler> = Arc::downgrade(&inner) as Weak<dyn Handler>;
        inner.session.start(weak, "fido-pipe-client")?;
        Ok(Client { inner })
    }

    /// This client's domain id (what `fido status` and `fido pipe weight` show).
    pub fn domain(&self) -> DomainId {
        self.inner.domain
    }

    /// Registers a pipe from `source` to `sink`. The broker keeps duplicates of
    /// both descriptors until the pipe is destroyed; the caller keeps its own.
    /// Fails with a `BadDescriptor` refusal when a descriptor is closed, of the
    /// wrong type (not a regular file, stream socket or pipe), not readable
    /// (source) / writable (sink), or a sink file opened `O_APPEND`.
    pub fn create(&self, source: impl AsFd, sink: impl AsFd) -> Result<Pipe> {
        match self
            .inner
            .request(Request::PipeCreate, &[source.as_fd(), sink.as_fd()])?
        {
            (Reply::PipeCreated { pipe, source, sink }, _) => Ok(Pipe {
                client: self.clone(),
                id: pipe,
                source,
                sink,
                destroyed: false,
            }),
            (other, _) => Err(Error::Protocol(format!(
                "unexpected answer to PipeCreate: {other:?}"
            ))),
        }
    }

    /// Starts a one-shot operation on two descriptors, without a pipe handle.
    pub fn start_once(&self, source: impl AsFd, sink: impl AsFd, op: PipeOp) -> Result<Pending> {
        let pending = self
            .inner
            .start(Request::PipeOnce { op }, &[source.as_fd(), sink.as_fd()])?;
        Ok(Pending {
            client: self.clone(),
            pending,
        })
    }

    /// Runs a one-shot operation and waits for it.
    pub fn once(&self, source: impl AsFd, sink: impl AsFd, op: PipeOp) -> Result<Transfer> {
        self.start_once(source, sink, op)?.wait()
    }

    /// One-shot `len` bytes of `file` from `off` to `sock`.
    pub fn file_to_socket(
        &self,
        file: impl AsFd,
        sock: impl AsFd,
        off: u64,
        len: u64,
    ) -> Result<Transfer> {
        self.once(file, sock, PipeOp::FileToSocket { off, len })
    }

    /// One-shot `len` bytes from one stream to another.
    pub fn socket_to_socket(&self, from: impl AsFd, to: impl AsFd, len: u64) -> Result<Transfer> {
        self.once(from, to, PipeOp::SocketToSocket { len })
    }

    /// One-shot `len` bytes from `sock` into `file` at `off`.
    pub fn socket_to_file(
        &self,
        sock: impl AsFd,
        file: impl AsFd,
        off: u64,
        len: u64,
    ) -> Result<Transfer> {
        self.once(sock, file, PipeOp::SocketToFile { off, len })
    }

    /// One-shot `len` bytes of `src` from `in_off` into `dst` at `out_off`.
    pub fn file_to_file(
        &self,
        src: impl AsFd,
        dst: impl AsFd,
        in_off: u64,
        len: u64,
        out_off: u64,
    ) -> Result<Transfer> {
        self.once(
            src,
            dst,
            PipeOp::FileToFile {
                in_off,
                len,
                out_off,
            },
        )
    }

    /// Sets the pipe weight of the live domain(s) with this id or name
    /// (root or the broker's uid only).
    pub fn set_weight(&self, domain: &str, weight: u32) -> Result<()> {
        self.inner.request(
            Request::PipeWeight {
                domain: domain.to_string(),
                weight,
            },
            &[],
        )?;
        Ok(())
    }

    /// The broker's status, including the pipe engine's per-domain figures.
    pub fn status(&self) -> Result<Status> {
        Status::collect(|req| match self.inner.request(req, &[])? {
            (Reply::Status(s), _) => Ok(s),
            (other, _) => Err(Error::Protocol(format!(
                "unexpected answer to Status: {other:?}"
            ))),
        })
    }

    fn notify(&self, body: Request) {
        self.inner.session.notify(body);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.session.leave_now();
    }
}

/// A registered pipe: a source and a sink the broker holds. One operation
/// runs at a time; dropping the pipe destroys it (cancelling what runs).
pub struct Pipe {
    client: Client,
    id: PipeId,
    source: PipeFdKind,
    sink: PipeFdKind,
    destroyed: bool,
}

impl std::fmt::Debug for Pipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipe")
            .field("id", &self.id)
            .field("source", &self.source)
            .field("sink", &self.sink)
            .finish()
    }
}

impl Pipe {
    pub fn id(&self) -> PipeId {
        self.id
    }
    /// What the source and sink are.
    pub fn kinds(&self) -> (PipeFdKind, PipeFdKind) {
        (self.source, self.sink)
    }

    /// Starts an operation; the result comes through the returned [`Pending`].
    pub fn start(&self, op: PipeOp) -> Result<Pending> {
        let pending = self
            .client
            .inner
            .start(Request::PipeRun { pipe: self.id, op }, &[])?;
        Ok(Pending {
            client: self.client.clone(),
            pending,
        })
    }

    /// Runs an operation and waits for it.
    pub fn run(&self, op: PipeOp) -> Result<Transfer> {
        self.start(op)?.wait()
    }

    /// `len` bytes of the source file from `off` to the sink socket.
    pub fn file_to_socket(&self, off: u64, len: u64) -> Result<Transfer> {
        self.run(PipeOp::FileToSocket { off, len })
    }
    /// `len` bytes from the source stream to the sink stream.
    pub fn socket_to_socket(&self, len: u64) -> Result<Transfer> {
        self.run(PipeOp::SocketToSocket { len })
    }
    /// `len` bytes from the source stream into the sink file at `off`.
    pub fn socket_to_file(&self, off: u64, len: u64) -> Result<Transfer> {
        self.run(PipeOp::SocketToFile { off, len })
    }
    /// `len` bytes of the source file from `in_off` into the sink file at `out_off`.
    pub fn file_to_file(&self, in_off: u64, len: u64, out_off: u64) -> Result<Transfer> {
        self.run(PipeOp::FileToFile {
            in_off,
            len,
            out_off,
        })
    }

    /// Cancels the running operation (its result becomes [`Error::Cancelled`]
    /// with the counts so far); the pipe stays usable.
    pub fn cancel(&self) -> Result<()> {
        self.client
            .inner
            .request(Request::PipeCancel { pipe: self.id }, &[])?;
        Ok(())
    }

    /// Destroys the pipe: cancels what runs and releases the broker's descriptors.
    pub fn destroy(mut self) -> Result<()> {
        self.destroyed = true;
        self.client
            .inner
            .request(Request::PipeDestroy { pipe: self.id }, &[])?;
        Ok(())
    }
}

impl Drop for Pipe {
    fn drop(&mut self) {
        if !self.destroyed {
            self.client.notify(Request::PipeDestroy { pipe: self.id });
        }
    }
}

/// An operation under way. Wait for it ([`wait`](Pending::wait)), poll it
/// ([`try_result`](Pending::try_result), or [`bell_fd`](Pending::bell_fd): an
/// eventfd readable once it finished, for epoll loops), or `.await` it.
/// Dropping it does not cancel the transfer (use [`Pipe::cancel`]).
pub struct Pending {
    client: Client,
    pending: fido_control::Pending,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("request", &self.pending.id())
            .finish()
    }
}

fn to_transfer(a: fido_control::Answer) -> Result<Transfer> {
    match a? {
        (Reply::PipeDone(r), _) => Transfer::from_result(r),
        (other, _) => Err(Error::Protocol(format!(
            "unexpected answer to a pipe operation: {other:?}"
        ))),
    }
}

impl Pending {
    /// Blocks until the operation ends (however long that is; the broker
    /// going away ends it with `BrokerUnavailable`).
    pub fn wait(self) -> Result<Transfer> {
        to_transfer(self.pending.wait())
    }

    /// Waits up to `timeout`; `None` if it has not ended yet.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<Result<Transfer>> {
        self.pending.wait_timeout(timeout).map(to_transfer)
    }

    /// The result if the operation ended (only once; later calls say `Protocol`).
    pub fn try_result(&mut self) -> Option<Result<Transfer>> {
        self.pending.try_take().map(to_transfer)
    }

    /// An eventfd that becomes readable when the operation ends (for poll/epoll).
    /// It stays readable; it is closed with the `Pending`.
    pub fn bell_fd(&self) -> Result<RawFd> {
        Ok(self.pending.ready_fd()?)
    }

    /// The domain the operation belongs to.
    pub fn client(&self) -> &Client {
        &self.client
    }
}

impl Future for Pending {
    type Output = Result<Transfer>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.pending).poll(cx).map(to_transfer)
    }
}
