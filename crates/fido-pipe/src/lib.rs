//! vPipe for Fido: the application hands two descriptors to the broker and the
//! broker's pipe engine moves the bytes between them (file → socket, socket →
//! socket, socket → file, file → file) with splice through io_uring, sharing
//! its capacity among domains by weight.
//!
//! A [`Client`] is a domain of its own: it joins the broker (a tiny arena, so
//! the broker's policy and quotas apply to it as to any domain), keeps a
//! heartbeat going on a background thread and matches replies to requests.
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

use std::collections::HashMap;
use std::future::Future;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use fido_proto::{wire, BrokerMsg, ClientMsg, Reply, Request};
use parking_lot::{Condvar, Mutex};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

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

type Answer = Result<(Reply, Vec<OwnedFd>)>;

#[derive(Default)]
struct SlotState {
    answer: Option<Answer>,
    taken: bool,
    waker: Option<Waker>,
    bell: Option<Arc<OwnedFd>>,
}

/// Where the reader thread puts the answer to one request.
#[derive(Default)]
struct Slot {
    state: Mutex<SlotState>,
    cv: Condvar,
}

impl Slot {
    fn fill(&self, a: Answer) {
        let mut st = self.state.lock();
        if st.answer.is_some() || st.taken {
            return;
        }
        st.answer = Some(a);
        if let Some(b) = &st.bell {
            let _ = rustix::io::write(&**b, &1u64.to_ne_bytes());
        }
        if let Some(w) = st.waker.take() {
            w.wake();
        }
        self.cv.notify_all();
    }
}

struct Inner {
    sock: OwnedFd,
    path: PathBuf,
    domain: DomainId,
    pending: Mutex<HashMap<u64, Arc<Slot>>>,
    next_id: AtomicU64,
    dead: Mutex<Option<String>>,
    stop: AtomicBool,
}

impl Inner {
    fn send(&self, id: u64, body: Request, fds: &[BorrowedFd<'_>]) -> Result<Arc<Slot>> {
        if let Some(why) = self.dead.lock().clone() {
            return Err(Error::BrokerUnavailable(why));
        }
        let dups = fds
            .iter()
            .map(|f| wire::dup(*f))
            .collect::<Result<Vec<_>, _>>()?;
        let bytes = fido_proto::encode(&ClientMsg::Request { id, body })
            .map_err(|e| Error::Protocol(e.to_string()))?;
        let slot = Arc::new(Slot::default());
        self.pending.lock().insert(id, slot.clone());
        if let Err(e) = wire::send_blocking(self.sock.as_fd(), &bytes, &dups) {
            self.pending.lock().remove(&id);
            return Err(Error::BrokerUnavailable(format!(
                "sending to the broker: {e}"
            )));
        }
        // A reader that died between our check and the insert would have missed this slot.
        if let Some(why) = self.dead.lock().clone() {
            slot.fill(Err(Error::BrokerUnavailable(why)));
        }
        Ok(slot)
    }

    fn request(&self, body: Request, fds: &[BorrowedFd<'_>]) -> Answer {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let slot = self.send(id, body, fds)?;
        let deadline = Instant::now() + REQUEST_TIMEOUT;
        let mut st = slot.state.lock();
        while st.answer.is_none() {
            if slot.cv.wait_until(&mut st, deadline).timed_out() {
                drop(st);
                self.pending.lock().remove(&id);
                return Err(Error::BrokerUnavailable(format!(
                    "no reply from the broker at {} within {REQUEST_TIMEOUT:?}",
                    self.path.display()
                )));
            }
        }
        st.taken = true;
        st.answer.take().expect("checked")
    }

    fn fail_all(&self, why: &str) {
        *self.dead.lock() = Some(why.to_string());
        let slots: Vec<Arc<Slot>> = self.pending.lock().drain().map(|(_, s)| s).collect();
        for s in slots {
            s.fill(Err(Error::BrokerUnavailable(why.to_string())));
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

fn connect_socket(path: &Path) -> Result<OwnedFd> {
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let addr = SocketAddrUnix::new(path).map_err(|e| {
        Error::BrokerUnavailable(format!("broker socket path {}: {e}", path.display()))
    })?;
    rustix::net::connect(&sock, &addr).map_err(|e| {
        Error::BrokerUnavailable(format!("{}: {}", path.display(), std::io::Error::from(e)))
    })?;
    Ok(sock)
}

fn recv_one(
    sock: &OwnedFd,
    buf: &mut [u8],
    timeout: Duration,
) -> Result<Option<(BrokerMsg, Vec<OwnedFd>)>> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let ts = Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: timeout.subsec_nanos() as i64,
    };
    let mut fds = [PollFd::new(sock, PollFlags::IN)];
    match poll(&mut fds, Some(&ts)) {
        Ok(0) | Err(rustix::io::Errno::INTR) => return Ok(None),
        Ok(_) => {}
        Err(e) => return Err(e.into()),
    }
    match wire::recv(sock.as_fd(), buf)? {
        wire::Recv::Eof => Err(Error::BrokerUnavailable(
            "broker closed the connection".into(),
        )),
        wire::Recv::WouldBlock => Ok(None),
        wire::Recv::Msg {
            len,
            fds,
            truncated,
        } => {
            if truncated {
                return Err(Error::Protocol(
                    "truncated control message from the broker".into(),
                ));
            }
            let msg = fido_proto::decode::<BrokerMsg>(&buf[..len])
                .map_err(|e| Error::Protocol(e.to_string()))?;
            Ok(Some((msg, fds)))
        }
    }
}

fn reader(weak: Weak<Inner>, heartbeat: Duration) {
    let mut buf = vec![0u8; fido_proto::MAX_MESSAGE];
    let mut last_beat = Instant::now();
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.stop.load(Ordering::Relaxed) {
            return;
        }
        if last_beat.elapsed() >= heartbeat {
            if let Ok(b) = fido_proto::encode(&ClientMsg::Heartbeat) {
                let _ = wire::send(inner.sock.as_fd(), &b, &[]);
            }
            last_beat = Instant::now();
        }
        match recv_one(&inner.sock, &mut buf, heartbeat / 2) {
            Ok(None) => {}
            Ok(Some((BrokerMsg::Reply { id, body }, fds))) => {
                if let Some(slot) = inner.pending.lock().remove(&id) {
                    slot.fill(body.map(|r| (r, fds)).map_err(Error::Refused));
                }
            }
            // A pipe-only domain offers nothing and watches nothing: events
            // (e.g. a PeerGone for a slot it never mapped) are of no interest.
            Ok(Some((BrokerMsg::Event(_), _))) => {}
            Err(e) => {
                if !inner.stop.load(Ordering::Relaxed) {
                    tracing::warn!("pipe client lost the broker: {e}");
                }
                inner.fail_all(&e.to_string());
                return;
            }
        }
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
        let sock = connect_socket(&path)?;
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
        let bytes = fido_proto::encode(&ClientMsg::Request { id: 1, body: join })
            .map_err(|e| Error::Protocol(e.to_string()))?;
        wire::send_blocking(sock.as_fd(), &bytes, &[ro])
            .map_err(|e| Error::BrokerUnavailable(format!("{}: {e}", path.display())))?;
        let mut buf = vec![0u8; fido_proto::MAX_MESSAGE];
        let deadline = Instant::now() + REQUEST_TIMEOUT;
        let (domain, heartbeat_ms) = loop {
            if Instant::now() > deadline {
                return Err(Error::BrokerUnavailable("no answer to Join".into()));
            }
            match recv_one(&sock, &mut buf, Duration::from_millis(200))? {
                Some((BrokerMsg::Reply { id: 1, body }, _)) => match body {
                    Ok(Reply::Joined {
                        domain,
                        heartbeat_ms,
                        ..
                    }) => break (domain, heartbeat_ms),
                    Ok(other) => {
                        return Err(Error::Protocol(format!(
                            "unexpected answer to Join: {other:?}"
                        )))
                    }
                    Err(e) => return Err(Error::Refused(e)),
                },
                _ => continue,
            }
        };
        let heartbeat = Duration::from_millis(heartbeat_ms.clamp(10, 60_000));
        let inner = Arc::new(Inner {
            sock,
            path,
            domain,
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(2),
            dead: Mutex::new(None),
            stop: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("fido-pipe-client".into())
            .spawn(move || reader(weak, heartbeat))
            .map_err(|e| Error::BrokerUnavailable(format!("spawning the reader thread: {e}")))?;
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
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let slot = self.inner.send(
            id,
            Request::PipeOnce { op },
            &[source.as_fd(), sink.as_fd()],
        )?;
        Ok(Pending {
            client: self.clone(),
            id,
            slot,
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
        match self.inner.request(Request::Status, &[])? {
            (Reply::Status(s), _) => Ok(s),
            (other, _) => Err(Error::Protocol(format!(
                "unexpected answer to Status: {other:?}"
            ))),
        }
    }

    fn notify(&self, body: Request) {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        if let Ok(bytes) = fido_proto::encode(&ClientMsg::Request { id, body }) {
            let _ = wire::send_blocking(self.inner.sock.as_fd(), &bytes, &[]);
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Ok(b) = fido_proto::encode(&ClientMsg::Request {
            id: 0,
            body: Request::Leave,
        }) {
            let _ = wire::send(self.sock.as_fd(), &b, &[]);
        }
        let _ = rustix::net::shutdown(&self.sock, rustix::net::Shutdown::Both);
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
        let id = self.client.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let slot = self
            .client
            .inner
            .send(id, Request::PipeRun { pipe: self.id, op }, &[])?;
        Ok(Pending {
            client: self.client.clone(),
            id,
            slot,
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
/// ([`try_result`](Pending::try_result), or [`as_fd`](Pending::bell_fd): an
/// eventfd readable once it finished, for epoll loops), or `.await` it.
/// Dropping it does not cancel the transfer (use [`Pipe::cancel`]).
pub struct Pending {
    client: Client,
    id: u64,
    slot: Arc<Slot>,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("request", &self.id)
            .finish()
    }
}

fn to_transfer(a: Answer) -> Result<Transfer> {
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
        let mut st = self.slot.state.lock();
        while st.answer.is_none() && !st.taken {
            self.slot.cv.wait(&mut st);
        }
        take(&mut st)
    }

    /// Waits up to `timeout`; `None` if it has not ended yet.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<Result<Transfer>> {
        let deadline = Instant::now() + timeout;
        let mut st = self.slot.state.lock();
        while st.answer.is_none() && !st.taken {
            if self.slot.cv.wait_until(&mut st, deadline).timed_out() {
                break;
            }
        }
        if st.answer.is_none() && !st.taken {
            return None;
        }
        Some(take(&mut st))
    }

    /// The result if the operation ended (only once; later calls say `Protocol`).
    pub fn try_result(&mut self) -> Option<Result<Transfer>> {
        let mut st = self.slot.state.lock();
        if st.answer.is_none() && !st.taken {
            return None;
        }
        Some(take(&mut st))
    }

    /// An eventfd that becomes readable when the operation ends (for poll/epoll).
    /// It stays readable; it is closed with the `Pending`.
    pub fn bell_fd(&self) -> Result<RawFd> {
        let mut st = self.slot.state.lock();
        if st.bell.is_none() {
            let fd = rustix::event::eventfd(
                0,
                rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
            )?;
            if st.answer.is_some() || st.taken {
                let _ = rustix::io::write(&fd, &1u64.to_ne_bytes());
            }
            st.bell = Some(Arc::new(fd));
        }
        Ok(st.bell.as_ref().expect("set").as_raw_fd())
    }

    /// The domain the operation belongs to.
    pub fn client(&self) -> &Client {
        &self.client
    }
}

fn take(st: &mut SlotState) -> Result<Transfer> {
    if st.taken && st.answer.is_none() {
        return Err(Error::Protocol("the result was already taken".into()));
    }
    st.taken = true;
    to_transfer(st.answer.take().expect("present"))
}

impl Future for Pending {
    type Output = Result<Transfer>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut st = self.slot.state.lock();
        if st.answer.is_some() || st.taken {
            return Poll::Ready(take(&mut st));
        }
        st.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        // Nobody will read the answer: stop the reader from keeping the slot.
        self.client.inner.pending.lock().remove(&self.id);
    }
}
