//! The control protocol between a domain and the Fido broker.
//!
//! Every message that crosses the broker's `SOCK_SEQPACKET` socket is one of the
//! types in this crate, encoded with `postcard` behind a small fixed header
//! (magic, protocol version, body length). Descriptors (arena memfds, doorbell
//! doorbell ring ends, liveness sockets) travel beside a message as `SCM_RIGHTS`; the
//! message says how many it carries and what each one is, so a receiver can
//! check that it got exactly what it expected.
//!
//! This crate must never trust its input: [`decode`] accepts any byte string and
//! returns either a well-formed message whose strings and paths have been checked
//! or a [`ProtoError`]. It never panics and never allocates more than the input
//! length allows. It carries control traffic only: no payload byte of a Fido
//! message ever goes through it.

#![forbid(unsafe_code)]

use serde::{de::DeserializeOwned, Deserialize, Serialize};

pub mod guest;
pub mod wire;

/// Version of the control protocol. A peer speaking another version is refused
/// with [`ErrorCode::Version`].
pub const PROTOCOL_VERSION: u16 = 1;
/// Largest encoded control message (header included). Registry values are
/// bounded well below this.
pub const MAX_MESSAGE: usize = 256 * 1024;
/// Largest registry value in bytes.
pub const MAX_VALUE: usize = 64 * 1024;
/// Longest registry path, service name or label in bytes.
pub const MAX_PATH: usize = 1024;
/// Most operations in one registry transaction.
pub const MAX_TXN_OPS: usize = 256;
/// Most descriptors that may accompany one control message.
pub const MAX_FDS: usize = 8;

const MAGIC: [u8; 2] = *b"FD";
const HEADER_LEN: usize = 8;

/// A domain's identity, handed out by the broker; monotonically increasing and
/// never reused (the paper's vmid).
pub type DomainId = u64;
/// A connection's identity, unique for the lifetime of the broker's state.
pub type ConnId = u64;

/// Geometry of the Pseudo Global Virtual Address Space, chosen by the broker
/// and identical in every domain it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PgvasGeometry {
    /// Address of slot 0.
    pub base: u64,
    /// Bytes per slot; an arena is never larger than a slot.
    pub slot_size: u64,
    /// Number of slots in the window.
    pub slots: u32,
}

impl PgvasGeometry {
    /// Default geometry: base 16 TiB, 64 GiB slots, 1024 slots (a 64 TiB window).
    pub const DEFAULT: PgvasGeometry =
        PgvasGeometry { base: 16 << 40, slot_size: 64 << 30, slots: 1024 };

    /// Checks that the window is non-empty, page aligned and fits below 2^47.
    pub fn validate(&self) -> Result<(), ProtoError> {
        let page = 4096u64;
        let total = self.slot_size.checked_mul(self.slots as u64);
        let end = total.and_then(|t| t.checked_add(self.base));
        match end {
            Some(end)
                if self.slots > 0
                    && self.slot_size >= page
                    && self.base % page == 0
                    && self.slot_size % page == 0
                    && end <= 1u64 << 47 =>
            {
                Ok(())
            }
            _ => Err(ProtoError::Invalid("PGVAS geometry")),
        }
    }
}

/// Where one side of a connection keeps its half of the ring state: an offset
/// and length inside that side's own arena, plus the ring size. The peer maps the
/// arena read-only and reads this block; only its owner ever writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingBlock {
    pub offset: u64,
    pub len: u64,
    pub entries: u32,
}

/// What a domain that is resuming after a broker restart tells the new broker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resume {
    pub domain: DomainId,
    pub slot: u32,
    /// Services this domain offers.
    pub services: Vec<String>,
    /// Slots of other domains this domain has mapped, with their owners.
    pub mapped: Vec<(u32, DomainId)>,
    /// Live connections: (connection, peer domain, service name).
    pub connections: Vec<(ConnId, DomainId, String)>,
    /// Registry watches: (token, prefix).
    pub watches: Vec<(u64, String)>,
    /// The secret the broker handed this domain in its first [`Reply::Joined`]:
    /// what proves that the resuming process is the domain it names.
    pub secret: ResumeSecret,
}

/// A broker-issued secret (256 random bits) that a domain presents to resume
/// after a broker restart. The broker keeps only its hash. Its `Debug` never
/// shows the bytes, so logging a request does not leak it.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumeSecret(pub [u8; 32]);

impl std::fmt::Debug for ResumeSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResumeSecret(..)")
    }
}

/// A message from a domain to the broker.
// A message is built, encoded and dropped one at a time, never stored in
// bulk: boxing `Join`'s resume state to shrink the rare heartbeat buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientMsg {
    /// A request; the broker answers with [`BrokerMsg::Reply`] carrying the same id.
    Request { id: u64, body: Request },
    /// Liveness beacon; no answer.
    Heartbeat,
}

/// Requests a domain can make.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Join with one descriptor: the domain's arena, re-opened read-only and
    /// sealed. `resume` is set when re-registering after a broker restart.
    Join { name: String, label: Option<String>, arena_len: u64, resume: Option<Resume> },
    /// Leave cleanly: the broker tears down services and tells peers.
    Leave,
    /// Offer a service under a name.
    Offer { service: String },
    /// Stop offering a service.
    Withdraw { service: String },
    /// Connect to a service. Carries two descriptors: the caller's data doorbell
    /// and space doorbell (ring ends of socket pairs the peer rings to wake it).
    Connect { service: String, block: RingBlock },
    /// Answer to [`Event::Incoming`]: accept with the acceptor's ring block and two
    /// doorbell descriptors, or refuse.
    Accept { conn: ConnId, block: RingBlock },
    Refuse { conn: ConnId, reason: String },
    /// The domain closed a connection.
    Close { conn: ConnId },
    /// Ask for a read-only grant of the arena in `slot` (to follow a forwarded
    /// pointer). Answered with [`Reply::Grant`] and one descriptor.
    GrantSlot { slot: u32 },
    /// The domain no longer maps the arena of `owner` in `slot`.
    Unmapped { slot: u32, owner: DomainId },
    /// Registry operations.
    Read { path: String },
    Write { path: String, value: Vec<u8> },
    List { path: String },
    Delete { path: String },
    Watch { token: u64, prefix: String },
    Unwatch { token: u64 },
    Transaction { ops: Vec<TxnOp> },
    /// Broker-wide status (domains, services, connections, counters).
    Status,
    /// Publish this domain's counters (shown by `fido status`).
    Counters { counters: Counters },
    /// vPipe: register a pipe between two descriptors carried with the request
    /// (source first, then sink). Answered with [`Reply::PipeCreated`].
    PipeCreate,
    /// vPipe: run one operation on a pipe. Answered with [`Reply::PipeDone`]
    /// once the transfer ends (which may take arbitrarily long), or an error
    /// at once when the operation is refused (nothing moved).
    PipeRun { pipe: PipeId, op: PipeOp },
    /// vPipe: one operation on two descriptors carried with the request
    /// (source, sink), without a pipe handle. Answered like `PipeRun`.
    PipeOnce { op: PipeOp },
    /// vPipe: cancel the operation running on a pipe (its `PipeRun` is then
    /// answered with [`PipeEnd::Cancelled`]); the pipe stays usable.
    PipeCancel { pipe: PipeId },
    /// vPipe: cancel whatever runs on the pipe and release its descriptors.
    PipeDestroy { pipe: PipeId },
    /// vPipe: set the pipe weight of live domains, named by id or by name
    /// (every live domain of that name). Administrators only (the broker's
    /// uid or root).
    PipeWeight { domain: String, weight: u32 },
    /// One page of `Status`, from `cursor` on (`Status` alone asks for the
    /// first). Answered with [`Reply::Status`]; its `next` says where the
    /// following page starts. Like `Status`, allowed before `Join`.
    StatusPage { cursor: StatusCursor },
    /// One page of `List`: the children of `path` from `cursor` on (`None`:
    /// the start). Answered with [`Reply::KeysPage`]. However many keys
    /// others create under `path`, each page fits a message. Allowed before
    /// `Join`, like `List`.
    ListPage { path: String, cursor: Option<ListCursor> },
    /// MMNet: the client of a TCP connection offers its segment before its
    /// SYN leaves. Descriptors: the client's TCP socket (bound, so its local
    /// address is known; the broker records its identity and drops it) and
    /// the segment (a memfd sealed against shrinking and growing). `remote`
    /// is the address it is about to connect to. Answered with
    /// [`Reply::NetOffered`].
    NetOffer { remote: std::net::SocketAddr, ring_len: u64, nonce: u64 },
    /// MMNet: the client withdraws an offer nobody claimed (it gave up waiting).
    NetWithdraw { offer: u64 },
    /// MMNet: the server of an accepted TCP connection asks for its client's
    /// offer. Descriptor: the accepted socket. Answered with
    /// [`Reply::NetClaimed`] and the segment, when the kernel shows the
    /// offer's socket is the other end of this very connection.
    NetClaim,
    /// MMNet: publish a listening TCP socket (descriptor: the socket) under
    /// `/net/listen`, which only the broker writes. Answered with
    /// [`Reply::NetListening`].
    NetListen,
    /// MMNet: withdraw a listener this domain published.
    NetUnlisten { key: String },
}

impl ListCursor {
    /// Every child of `path`, sorted: the pages of [`Request::ListPage`],
    /// each asked through `ask` (which returns its names and next cursor),
    /// gathered. A broker answering with the cursor it was asked for ends
    /// the walk instead of looping.
    pub fn walk<E>(
        path: &str,
        mut ask: impl FnMut(Request) -> Result<(Vec<String>, Option<ListCursor>), E>,
    ) -> Result<Vec<String>, E> {
        let mut names = std::collections::BTreeSet::new();
        let mut cursor: Option<ListCursor> = None;
        loop {
            let page = Request::ListPage { path: path.to_string(), cursor: cursor.clone() };
            let (keys, next) = ask(page)?;
            names.extend(keys);
            match next {
                Some(c) if cursor.as_ref() != Some(&c) => cursor = Some(c),
                _ => return Ok(names.into_iter().collect()),
            }
        }
    }
}

/// Where a page of a listing continues: the registry key its scan reached
/// and whether that key itself is still to be looked at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListCursor {
    pub key: String,
    pub inclusive: bool,
}

/// Where a page of [`Status`] starts: the section, and the last entry of it
/// the previous page carried (`None`: the section's start). Pages are not a
/// snapshot: what changes between them may be seen twice or not at all.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StatusCursor {
    Domains { after: Option<DomainId> },
    Services { after: Option<String> },
    Connections { after: Option<ConnId> },
    Pipes { after: Option<DomainId> },
}

impl StatusCursor {
    /// The first page.
    pub const START: StatusCursor = StatusCursor::Domains { after: None };
}

/// A pipe's identity, unique for the lifetime of the broker.
pub type PipeId = u64;

/// Most bytes one pipe operation may ask for (the engine moves them in chunks).
pub const MAX_PIPE_LEN: u64 = 1 << 62;
/// Largest pipe weight.
pub const MAX_PIPE_WEIGHT: u32 = 10_000;

/// One vPipe operation. File offsets are explicit: the broker never uses or
/// moves the file position shared with the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PipeOp {
    /// `len` bytes of the source file from `off` to the sink stream.
    FileToSocket { off: u64, len: u64 },
    /// `len` bytes from the source stream to the sink stream.
    SocketToSocket { len: u64 },
    /// `len` bytes from the source stream into the sink file at `off`.
    SocketToFile { off: u64, len: u64 },
    /// `len` bytes of the source file from `in_off` into the sink file at `out_off`.
    FileToFile { in_off: u64, len: u64, out_off: u64 },
}

impl PipeOp {
    /// Bytes asked for.
    pub fn len(&self) -> u64 {
        match *self {
            PipeOp::FileToSocket { len, .. }
            | PipeOp::SocketToSocket { len }
            | PipeOp::SocketToFile { len, .. }
            | PipeOp::FileToFile { len, .. } => len,
        }
    }

    /// True when no byte is asked for.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Does the operation read a file (`true`) or a stream (`false`)?
    pub fn source_is_file(&self) -> bool {
        matches!(self, PipeOp::FileToSocket { .. } | PipeOp::FileToFile { .. })
    }

    /// Does the operation write a file (`true`) or a stream (`false`)?
    pub fn sink_is_file(&self) -> bool {
        matches!(self, PipeOp::SocketToFile { .. } | PipeOp::FileToFile { .. })
    }

    fn validate(&self) -> Result<(), ProtoError> {
        let (a, b) = match *self {
            PipeOp::FileToSocket { off, len } | PipeOp::SocketToFile { off, len } => (off, len),
            PipeOp::SocketToSocket { len } => (0, len),
            PipeOp::FileToFile { in_off, len, out_off } => {
                if out_off.checked_add(len).is_none_or(|e| e > i64::MAX as u64) {
                    return Err(ProtoError::Invalid("pipe offset + length (sink)"));
                }
                (in_off, len)
            }
        };
        if b > MAX_PIPE_LEN || a.checked_add(b).is_none_or(|e| e > i64::MAX as u64) {
            return Err(ProtoError::Invalid("pipe offset + length"));
        }
        Ok(())
    }
}

/// What a descriptor handed to the pipe engine turned out to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PipeFdKind {
    /// A regular file (read or written at explicit offsets).
    File,
    /// A stream socket (TCP, Unix stream) or a pipe/FIFO.
    Stream,
}

/// How a pipe operation ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum PipeEnd {
    /// All `len` bytes were moved.
    Done,
    /// The source ended (end of file, or the stream's writer closed) first.
    Eof,
    /// Cancelled (`PipeCancel`, `PipeDestroy`, or the broker stopping).
    Cancelled,
    /// A system call failed: `errno` and which side (`source`/`sink`) in `message`.
    Failed { errno: i32, message: String },
}

/// The exact outcome of a pipe operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipeResult {
    /// Bytes written to the sink.
    pub moved: u64,
    /// Bytes taken from the source. Equal to `moved` unless the operation was
    /// cancelled or failed while a chunk was between the two (at most one chunk);
    /// for a stream source those bytes are gone from it.
    pub consumed: u64,
    pub end: PipeEnd,
}

/// Per-domain pipe figures in [`Status`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipeDomainStatus {
    pub domain: DomainId,
    pub weight: u32,
    /// Credit balance in bytes (negative: it used more than its share lately).
    pub credits: i64,
    /// Bytes moved per second, averaged over about the last second.
    pub bytes_per_s: u64,
    /// Bytes moved since the domain joined.
    pub bytes_total: u64,
    /// Pipes the domain holds, and operations running.
    pub pipes: u32,
    pub running: u32,
}

/// The pipe engine's settings in [`Status`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipeEngineStatus {
    /// Bytes per second shared among domains by weight (`None`: unlimited).
    pub capacity: Option<u64>,
    /// Whether the capacity was measured at startup (calibrated).
    pub calibrated: bool,
    pub work_conserving: bool,
    /// Chunks moved at once.
    pub lanes: u32,
}

/// One operation in a registry transaction. All `Check`s are evaluated first; if
/// any fails nothing is written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TxnOp {
    /// Compare: the key must currently hold `expected` (`None`: must be absent).
    Check { path: String, expected: Option<Vec<u8>> },
    Put { path: String, value: Vec<u8> },
    Delete { path: String },
    Read { path: String },
}

/// A message from the broker to a domain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum BrokerMsg {
    Reply { id: u64, body: Result<Reply, RemoteError> },
    Event(Event),
}

/// Successful answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    Ok,
    Joined {
        domain: DomainId,
        slot: u32,
        geometry: PgvasGeometry,
        /// How often the domain must send a heartbeat, in milliseconds.
        heartbeat_ms: u64,
        /// What the domain presents in [`Resume::secret`] to take up its
        /// identity again after a broker restart. Keep it private.
        resume_secret: ResumeSecret,
    },
    /// Connection established. Descriptors: the peer's arena (read-only), the
    /// peer's data doorbell, the peer's space doorbell, one end of a liveness
    /// socket pair shared with the peer.
    Connected { conn: ConnId, peer: PeerInfo, block: RingBlock },
    /// Arena grant: one descriptor, the owner's arena (read-only).
    Grant { owner: DomainId, slot: u32, arena_len: u64 },
    Value(Option<Vec<u8>>),
    Keys(Vec<String>),
    Txn { committed: bool, reads: Vec<Option<Vec<u8>>> },
    Status(Status),
    /// A pipe was registered; what its two descriptors are.
    PipeCreated { pipe: PipeId, source: PipeFdKind, sink: PipeFdKind },
    /// A pipe operation ended.
    PipeDone(PipeResult),
    /// A page of children names (key order; a name may come again on the
    /// next page, so gather them in a set), and where the next page starts
    /// (`None`: this was the last).
    KeysPage { keys: Vec<String>, next: Option<ListCursor> },
    /// MMNet: the offer was recorded under this id (for `NetWithdraw`).
    NetOffered { offer: u64 },
    /// MMNet: the client's offer for the claimed connection; one descriptor,
    /// its segment. `refusal`: the `net` policy refuses this server
    /// acceleration — it must abandon the segment at once (plain TCP).
    NetClaimed { ring_len: u64, nonce: u64, refusal: Option<String> },
    /// MMNet: the listener was published under this registry key.
    NetListening { key: String },
}

/// The other end of a connection, as the broker vouches for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerInfo {
    pub domain: DomainId,
    pub name: String,
    pub slot: u32,
    pub arena_len: u64,
    pub uid: u32,
    pub pid: i32,
}

/// Unsolicited notifications.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// Someone connects to a service this domain offers. Descriptors as for
    /// [`Reply::Connected`]. Answer with [`Request::Accept`] or [`Request::Refuse`].
    Incoming { conn: ConnId, service: String, peer: PeerInfo, block: RingBlock },
    /// A peer domain died, hung (missed heartbeats) or left.
    PeerGone { domain: DomainId, conn: Option<ConnId>, reason: GoneReason },
    /// The peer closed a connection.
    Closed { conn: ConnId },
    /// A watched key changed (`value: None` means deleted).
    Watch { token: u64, path: String, value: Option<Vec<u8>> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GoneReason {
    Exited,
    MissedHeartbeat,
    Left,
    /// The broker removed the domain: a reloaded policy no longer admits it.
    Evicted,
    /// Only this connection ended: the policy no longer allows its client to
    /// connect to the service. Both domains live on.
    Revoked,
}

/// Per-domain data-path counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub messages_sent: u64,
    pub messages_received: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Payload bytes this domain copied: into its arena (`alloc_copy`) and
    /// out of received messages into memory it keeps (`Msg::to_vec`,
    /// `PeerSlice::copy_to` / `to_vec` / `append_to` and their typed forms,
    /// fido-rpc's `ShmStrRef::to_string`). Reads in place through a
    /// `PeerSlice` (`read_obj`, `iter`, `fold_u64`, `read_chunks`,
    /// comparisons) and protocol metadata (descriptors, SG lists, inline
    /// messages, rpc headers) are not counted; docs/ARCHITECTURE.md §3.5
    /// says what `0` proves.
    pub bytes_copied: u64,
    pub doorbells_rung: u64,
    pub doorbells_suppressed: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub broker_pid: i32,
    pub domains: Vec<DomainStatus>,
    pub services: Vec<(String, DomainId)>,
    pub connections: Vec<ConnStatus>,
    /// Pipe engine settings and per-domain pipe figures.
    pub pipe_engine: Option<PipeEngineStatus>,
    pub pipes: Vec<PipeDomainStatus>,
    /// Where the next page starts (ask with [`Request::StatusPage`]);
    /// `None`: this was the last.
    pub next: Option<StatusCursor>,
}

impl Status {
    /// Appends the entries of the page that follows this one and takes its `next`.
    pub fn absorb(&mut self, page: Status) {
        self.domains.extend(page.domains);
        self.services.extend(page.services);
        self.connections.extend(page.connections);
        self.pipes.extend(page.pipes);
        self.pipe_engine = page.pipe_engine.or(self.pipe_engine.take());
        self.next = page.next;
    }

    /// The whole status: the first page (`Request::Status`) and every page
    /// after it (`Request::StatusPage`), each asked through `ask`. A broker
    /// answering a page with the cursor it was asked for ends the walk
    /// instead of looping.
    pub fn collect<E>(mut ask: impl FnMut(Request) -> Result<Status, E>) -> Result<Status, E> {
        let mut st = ask(Request::Status)?;
        while let Some(cursor) = st.next.take() {
            let page = ask(Request::StatusPage { cursor: cursor.clone() })?;
            if page.next.as_ref() == Some(&cursor) {
                break;
            }
            st.absorb(page);
        }
        Ok(st)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainStatus {
    pub domain: DomainId,
    pub name: String,
    pub slot: u32,
    pub pid: i32,
    pub uid: u32,
    pub arena_len: u64,
    pub counters: Counters,
    /// The label it joined with (a VM domain's: the VM's name).
    pub label: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnStatus {
    pub conn: ConnId,
    pub service: String,
    pub client: DomainId,
    pub server: DomainId,
}

/// An error the broker reports for a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct RemoteError {
    pub code: ErrorCode,
    pub message: String,
}

impl RemoteError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        RemoteError { code, message: message.into() }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    Version,
    BadRequest,
    NotJoined,
    AlreadyJoined,
    NoSuchService,
    ServiceTaken,
    NoSuchConnection,
    NoSuchDomain,
    NoSuchKey,
    Denied,
    Quota,
    Refused,
    BadDescriptor,
    Unavailable,
    Internal,
    /// vPipe: no such pipe (or not this domain's).
    NoSuchPipe,
    /// vPipe: the pipe already runs an operation.
    Busy,
}

/// Why a control message could not be decoded or encoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtoError {
    #[error("control message truncated")]
    Truncated,
    #[error("control message too large ({0} bytes)")]
    TooLarge(usize),
    #[error("bad magic in control message header")]
    Magic,
    #[error("protocol version {0} not supported (this side speaks {PROTOCOL_VERSION})")]
    Version(u16),
    #[error("control message length field disagrees with datagram length")]
    Length,
    #[error("malformed control message body: {0}")]
    Body(String),
    #[error("invalid {0}")]
    Invalid(&'static str),
}

/// Where domains and tools look for the broker: `$FIDO_BROKER`, else
/// `$XDG_RUNTIME_DIR/fido/broker.sock`, else `/run/fido/broker.sock`.
pub fn default_broker_path() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("FIDO_BROKER").filter(|p| !p.is_empty()) {
        return p.into();
    }
    if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR").filter(|p| !p.is_empty()) {
        return std::path::PathBuf::from(dir).join("fido/broker.sock");
    }
    "/run/fido/broker.sock".into()
}

/// Encodes a message with its header.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, ProtoError> {
    let mut out = vec![0u8; HEADER_LEN];
    let body = postcard::to_stdvec(msg).map_err(|e| ProtoError::Body(e.to_string()))?;
    if body.len() + HEADER_LEN > MAX_MESSAGE {
        return Err(ProtoError::TooLarge(body.len() + HEADER_LEN));
    }
    out[0..2].copy_from_slice(&MAGIC);
    out[2..4].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out[4..8].copy_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decodes and validates a message. Any byte string is acceptable input.
pub fn decode<T: DeserializeOwned + Validate>(bytes: &[u8]) -> Result<T, ProtoError> {
    if bytes.len() > MAX_MESSAGE {
        return Err(ProtoError::TooLarge(bytes.len()));
    }
    if bytes.len() < HEADER_LEN {
        return Err(ProtoError::Truncated);
    }
    if bytes[0..2] != MAGIC {
        return Err(ProtoError::Magic);
    }
    let version = u16::from_le_bytes([bytes[2], bytes[3]]);
    if version != PROTOCOL_VERSION {
        return Err(ProtoError::Version(version));
    }
    let len = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]) as usize;
    if len != bytes.len() - HEADER_LEN {
        return Err(ProtoError::Length);
    }
    let (msg, rest): (T, &[u8]) = postcard::take_from_bytes(&bytes[HEADER_LEN..])
        .map_err(|e| ProtoError::Body(e.to_string()))?;
    if !rest.is_empty() {
        return Err(ProtoError::Length);
    }
    msg.validate()?;
    Ok(msg)
}

/// Semantic checks applied after decoding.
pub trait Validate {
    fn validate(&self) -> Result<(), ProtoError>;
}

/// Checks a registry path: absolute, `/`-separated, no empty, `.` or `..`
/// component, characters from `[A-Za-z0-9_.:@+=-]`, at most [`MAX_PATH`] bytes.
/// `/` alone is the root.
pub fn check_path(path: &str) -> Result<(), ProtoError> {
    if path.len() > MAX_PATH || !path.starts_with('/') {
        return Err(ProtoError::Invalid("registry path"));
    }
    if path == "/" {
        return Ok(());
    }
    for part in path[1..].split('/') {
        if part.is_empty() || part == "." || part == ".." || !part.bytes().all(path_byte_ok) {
            return Err(ProtoError::Invalid("registry path"));
        }
    }
    Ok(())
}

fn path_byte_ok(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'@' | b'+' | b'=' | b'-')
}

/// Checks a service name or domain name: 1..=128 bytes of `[A-Za-z0-9_.:@+=-]`.
pub fn check_name(name: &str) -> Result<(), ProtoError> {
    if name.is_empty() || name.len() > 128 || !name.bytes().all(path_byte_ok) {
        return Err(ProtoError::Invalid("name"));
    }
    Ok(())
}

fn check_value(value: &[u8]) -> Result<(), ProtoError> {
    if value.len() > MAX_VALUE {
        return Err(ProtoError::Invalid("registry value (too large)"));
    }
    Ok(())
}

fn check_block(block: &RingBlock) -> Result<(), ProtoError> {
    if block.entries == 0 || !block.entries.is_power_of_two() || block.entries > 1 << 16 {
        return Err(ProtoError::Invalid("ring size"));
    }
    if block.offset.checked_add(block.len).is_none() {
        return Err(ProtoError::Invalid("ring block"));
    }
    Ok(())
}

impl Validate for ClientMsg {
    fn validate(&self) -> Result<(), ProtoError> {
        match self {
            ClientMsg::Heartbeat => Ok(()),
            ClientMsg::Request { body, .. } => body.validate(),
        }
    }
}

impl Validate for Request {
    fn validate(&self) -> Result<(), ProtoError> {
        match self {
            Request::Join { name, label, resume, .. } => {
                check_name(name)?;
                if let Some(label) = label {
                    check_name(label)?;
                }
                if let Some(r) = resume {
                    r.services.iter().try_for_each(|s| check_name(s))?;
                    r.connections.iter().try_for_each(|(_, _, s)| check_name(s))?;
                    r.watches.iter().try_for_each(|(_, p)| check_path(p))?;
                    if r.services.len() > 4096
                        || r.mapped.len() > 1 << 16
                        || r.connections.len() > 1 << 16
                        || r.watches.len() > 1 << 16
                    {
                        return Err(ProtoError::Invalid("resume state"));
                    }
                }
                Ok(())
            }
            Request::Offer { service } | Request::Withdraw { service } => check_name(service),
            Request::Connect { service, block } => {
                check_name(service)?;
                check_block(block)
            }
            Request::Accept { block, .. } => check_block(block),
            Request::Refuse { reason, .. } => {
                if reason.len() > MAX_PATH {
                    return Err(ProtoError::Invalid("refusal reason"));
                }
                Ok(())
            }
            Request::Read { path }
            | Request::List { path }
            | Request::Delete { path }
            | Request::Watch { prefix: path, .. } => check_path(path),
            Request::Write { path, value } => {
                check_path(path)?;
                check_value(value)
            }
            Request::Transaction { ops } => {
                if ops.is_empty() || ops.len() > MAX_TXN_OPS {
                    return Err(ProtoError::Invalid("transaction size"));
                }
                ops.iter().try_for_each(|op| op.validate())
            }
            Request::Leave
            | Request::Close { .. }
            | Request::GrantSlot { .. }
            | Request::Unmapped { .. }
            | Request::Unwatch { .. }
            | Request::Status
            | Request::Counters { .. }
            | Request::PipeCreate
            | Request::PipeCancel { .. }
            | Request::PipeDestroy { .. } => Ok(()),
            Request::PipeRun { op, .. } | Request::PipeOnce { op } => op.validate(),
            Request::StatusPage { cursor: StatusCursor::Services { after: Some(s) } } => {
                check_name(s)
            }
            Request::StatusPage { .. } => Ok(()),
            Request::ListPage { path, cursor } => {
                check_path(path)?;
                cursor.as_ref().map_or(Ok(()), |c| check_path(&c.key))
            }
            Request::NetOffer { remote, .. } => {
                if remote.port() == 0 {
                    return Err(ProtoError::Invalid("MMNet offer: remote port 0"));
                }
                Ok(())
            }
            Request::NetUnlisten { key } => check_path(key),
            Request::NetWithdraw { .. } | Request::NetClaim | Request::NetListen => Ok(()),
            Request::PipeWeight { domain, weight } => {
                check_name(domain)?;
                if *weight == 0 || *weight > MAX_PIPE_WEIGHT {
                    return Err(ProtoError::Invalid("pipe weight (1..=10000)"));
                }
                Ok(())
            }
        }
    }
}

impl Validate for TxnOp {
    fn validate(&self) -> Result<(), ProtoError> {
        match self {
            TxnOp::Check { path, expected } => {
                check_path(path)?;
                expected.as_deref().map_or(Ok(()), check_value)
            }
            TxnOp::Put { path, value } => {
                check_path(path)?;
                check_value(value)
            }
            TxnOp::Delete { path } | TxnOp::Read { path } => check_path(path),
        }
    }
}

impl Validate for BrokerMsg {
    fn validate(&self) -> Result<(), ProtoError> {
        match self {
            BrokerMsg::Reply { body: Ok(Reply::Joined { geometry, .. }), .. } => {
                geometry.validate()
            }
            BrokerMsg::Reply { body: Ok(Reply::Connected { block, peer, .. }), .. }
            | BrokerMsg::Event(Event::Incoming { block, peer, .. }) => {
                check_name(&peer.name)?;
                check_block(block)
            }
            BrokerMsg::Reply { body: Ok(Reply::NetListening { key }), .. } => check_path(key),
            BrokerMsg::Reply { body: Ok(Reply::NetClaimed { refusal: Some(r), .. }), .. }
                if r.len() > MAX_PATH =>
            {
                Err(ProtoError::Invalid("MMNet refusal (too long)"))
            }
            BrokerMsg::Event(Event::Watch { path, value, .. }) => {
                check_path(path)?;
                value.as_deref().map_or(Ok(()), check_value)
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let msg = ClientMsg::Request {
            id: 7,
            body: Request::Write { path: "/app/x".into(), value: b"hello".to_vec() },
        };
        let bytes = encode(&msg).unwrap();
        assert_eq!(decode::<ClientMsg>(&bytes).unwrap(), msg);
    }

    #[test]
    fn rejects_bad_headers_and_trailing_bytes() {
        let mut bytes = encode(&ClientMsg::Heartbeat).unwrap();
        assert_eq!(decode::<ClientMsg>(&bytes[..4]), Err(ProtoError::Truncated));
        bytes.push(0);
        assert_eq!(decode::<ClientMsg>(&bytes), Err(ProtoError::Length));
        let mut v = encode(&ClientMsg::Heartbeat).unwrap();
        v[2] = 99;
        assert!(matches!(decode::<ClientMsg>(&v), Err(ProtoError::Version(_))));
        v = encode(&ClientMsg::Heartbeat).unwrap();
        v[0] = b'X';
        assert_eq!(decode::<ClientMsg>(&v), Err(ProtoError::Magic));
    }

    #[test]
    fn rejects_bad_paths() {
        for p in ["", "a", "/a//b", "/a/../b", "/a/.", "/a b", "/a/"] {
            assert!(check_path(p).is_err(), "{p:?} accepted");
        }
        for p in ["/", "/a", "/domain/3/name", "/service/echo-1/x.y"] {
            check_path(p).unwrap();
        }
        let msg = ClientMsg::Request { id: 1, body: Request::Read { path: "/x/../y".into() } };
        let bytes = encode(&msg).unwrap();
        assert!(matches!(decode::<ClientMsg>(&bytes), Err(ProtoError::Invalid(_))));
    }

    #[test]
    fn geometry_checks() {
        PgvasGeometry::DEFAULT.validate().unwrap();
        let bad = PgvasGeometry { base: 1 << 46, slot_size: 1 << 40, slots: 1024 };
        assert!(bad.validate().is_err());
    }
}
