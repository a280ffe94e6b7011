//! The storage domain's front half: offer `blk:NAME`, accept connections,
//! validate every request, hand the valid ones to a [`BlockBackend`] and send
//! the replies its [`Replier`]s produce.
//!
//! One thread per connection receives and validates; the backend completes
//! requests on whatever thread it likes (the file backend: one io_uring and
//! one completion thread per connection), in any order.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fido::{Buf, Channel, Domain, Error as FidoError, Message, Msg};

use crate::proto::{self, Checked, Info, Op, ReqHeader, HEADER_LEN};

/// How long a reply may wait for the client to release earlier ones before
/// the connection is given up (a client that never completes must not hold
/// a backend thread for ever).
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the threads look at the stop flag while idle.
const POLL: Duration = Duration::from_millis(200);
/// Requests taken off a connection before the backend is flushed.
const BATCH: usize = 64;
/// How often the statistics are published to the registry (when they changed).
const PUBLISH_EVERY: Duration = Duration::from_secs(1);

/// What serves the blocks: a file, a RAM disk, or a composition of other
/// block services (RAID). Shared by every connection.
pub trait BlockBackend: Send + Sync + 'static {
    /// The device as clients see it (sent as INFO; requests are validated
    /// against it before the backend sees them).
    fn info(&self) -> Info;

    /// A queue for one new connection, used by that connection's thread only.
    /// `domain` is the storage domain (READ data is allocated in its arena,
    /// see [`Replier::alloc`]).
    fn open_queue(&self, domain: &Domain) -> std::io::Result<Box<dyn BackendQueue>>;
}

/// One connection's way into a backend.
pub trait BackendQueue: Send {
    /// Starts a request. The backend must eventually complete `req.reply`
    /// exactly once (dropping it replies EIO), on any thread, in any order.
    /// For WRITE it must keep `req.msg` (the client's payload) alive until
    /// the data is written, then drop it: that releases the client's buffers.
    fn submit(&mut self, req: Request);

    /// Called after a batch of `submit`s (when no more requests are waiting
    /// on the connection): a backend may hold submissions back until then
    /// (one system call for the batch) and use the moment to complete what
    /// is already done on the connection's thread. The default does nothing.
    fn flush(&mut self) {}
}

/// A validated request, owned by the backend until it completes.
pub struct Request {
    /// The validated header (op, offset, len, FUA, NO_UNMAP).
    pub checked: Checked,
    /// The client's message. WRITE: segment 0 is the header, segments 1..
    /// the payload (read-only views of the client's arena: hand them to the
    /// kernel by pointer, or forward the whole message by pointer).
    pub msg: Msg,
    /// Completes the request.
    pub reply: Replier,
}

impl Request {
    /// The WRITE payload segments (empty for other ops).
    pub fn payload(&self) -> impl Iterator<Item = fido::PeerSlice<'_>> {
        let skip = if self.checked.op == Op::Write { 1 } else { usize::MAX };
        self.msg.segments().skip(skip)
    }
}

/// The storage domain's counters (a snapshot).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub connections: u64,
    pub requests: u64,
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub discards: u64,
    pub write_zeroes: u64,
    /// Requests answered with a non-zero status (refused or failed).
    pub errors: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Payload bytes the storage domain copied through its own code (the
    /// fido library's count for this domain: `Domain::counters().bytes_copied`).
    /// Zero on every path of this server: writes go from the client's buffer
    /// to the kernel, reads from the kernel into the reply buffer.
    pub bytes_copied: u64,
}

impl Stats {
    /// `key=value` lines (the registry value and `fido blk stats`).
    pub fn to_text(&self) -> String {
        format!(
            "connections={}\nrequests={}\nreads={}\nwrites={}\nflushes={}\ndiscards={}\nwrite_zeroes={}\nerrors={}\nbytes_read={}\nbytes_written={}\nbytes_copied={}\n",
            self.connections, self.requests, self.reads, self.writes, self.flushes, self.discards,
            self.write_zeroes, self.errors, self.bytes_read, self.bytes_written, self.bytes_copied
        )
    }

    /// Parses [`Stats::to_text`] (unknown keys are ignored).
    pub fn from_text(text: &str) -> Stats {
        let mut s = Stats::default();
        for line in text.lines() {
            let Some((k, v)) = line.split_once('=') else { continue };
            let Ok(v) = v.trim().parse::<u64>() else { continue };
            let field = match k.trim() {
                "connections" => &mut s.connections,
                "requests" => &mut s.requests,
                "reads" => &mut s.reads,
                "writes" => &mut s.writes,
                "flushes" => &mut s.flushes,
                "discards" => &mut s.discards,
                "write_zeroes" => &mut s.write_zeroes,
                "errors" => &mut s.errors,
                "bytes_read" => &mut s.bytes_read,
                "bytes_written" => &mut s.bytes_written,
                "bytes_copied" => &mut s.bytes_copied,
                _ => continue,
            };
            *field = v;
        }
        s
    }
}

#[derive(Default)]
struct Counters {
    connections: AtomicU64,
    requests: AtomicU64,
    reads: AtomicU64,
    writes: AtomicU64,
    flushes: AtomicU64,
    discards: AtomicU64,
    write_zeroes: AtomicU64,
    errors: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// What the threads of one connection share.
struct Conn {
    ch: Channel,
    domain: Domain,
    counters: Arc<Counters>,
    /// Set when a reply could not be sent: the connection is given up.
    broken: AtomicBool,
    /// Bytes of READ replies the client has not released yet (storage
    /// domain arena memory it holds). Shared with the replies' holds, which
    /// must not own the connection: see [`HeldRead`].
    read_bytes_held: Arc<AtomicU64>,
}

/// Completes one request: exactly one reply goes to the client. Dropping a
/// `Replier` without completing it replies EIO (a backend bug or a panic
/// never leaves a client waiting).
pub struct Replier {
    conn: Arc<Conn>,
    id: u64,
    op: Op,
    len: u32,
    done: bool,
}

impl Replier {
    /// The client's request id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// A buffer in the storage domain's arena for READ data (its pointer is
    /// 64-byte aligned; block-multiple sizes are block aligned).
    pub fn alloc(&self, len: usize) -> fido::Result<Buf> {
        self.conn.domain.alloc(len)
    }

    /// The storage domain.
    pub fn domain(&self) -> &Domain {
        &self.conn.domain
    }

    /// Success of anything but READ (an empty inline reply).
    pub fn ok(mut self) {
        self.done = true;
        self.count_ok();
        self.send(Message::inline(&[]).expect("an empty inline message").tag(self.id).opcode(proto::STATUS_OK));
    }

    /// Failure with `status` (a positive errno).
    pub fn error(mut self, status: u16) {
        self.done = true;
        self.fail(if status == 0 { proto::EIO } else { status });
    }

    /// READ success: `data` (exactly `len` bytes in one or more buffers of
    /// this domain's arena, or a forwarded message) goes to the client. The
    /// client checks the length and fails the request if it differs.
    /// The reply counts against the connection's budget of READ bytes held
    /// by the client until the client releases it (this uses the message's
    /// `hold`: a backend that needs one of its own uses [`Replier::data_holding`]).
    pub fn data(self, data: impl Into<Message>) {
        self.data_holding(data, ());
    }

    /// [`Replier::data`], keeping `value` alive until the client releases the reply.
    pub fn data_holding(mut self, data: impl Into<Message>, value: impl std::any::Any + Send + Sync) {
        self.done = true;
        self.count_ok();
        let n = u64::from(self.len);
        self.conn.read_bytes_held.fetch_add(n, Ordering::Relaxed);
        let held = HeldRead { read_bytes_held: self.conn.read_bytes_held.clone(), bytes: n };
        let m: Message = data.into();
        self.send(m.tag(self.id).opcode(proto::STATUS_OK).hold((held, value)));
    }

    fn count_ok(&self) {
        let c = &self.conn.counters;
        let n = u64::from(self.len);
        match self.op {
            Op::Read => {
                bump(&c.reads, 1);
                bump(&c.bytes_read, n)
            }
            Op::Write => {
                bump(&c.writes, 1);
                bump(&c.bytes_written, n)
            }
            Op::Flush => bump(&c.flushes, 1),
            Op::Discard => bump(&c.discards, 1),
            Op::WriteZeroes => bump(&c.write_zeroes, 1),
        }
    }

    fn fail(&self, status: u16) {
        bump(&self.conn.counters.errors, 1);
        self.send(Message::inline(&[]).expect("an empty inline message").tag(self.id).opcode(status));
    }

    fn send(&self, m: Message) {
        send_reply(&self.conn, m);
    }
}

impl Drop for Replier {
    fn drop(&mut self) {
        if !self.done {
            self.fail(proto::EIO);
        }
    }
}

/// Counts a READ reply's bytes as held by the client until it releases them.
///
/// It holds the counter, never the connection: a reply is released while
/// its channel collects releases (with the channel's send lock held), and a
/// hold that owned the last reference to the connection would drop the
/// channel there, which takes that same lock — a thread that deadlocked on
/// itself (seen: a RAID-1 member thread collecting a closed client
/// connection's forwarded READ replies hung every write after it).
struct HeldRead {
    read_bytes_held: Arc<AtomicU64>,
    bytes: u64,
}

impl Drop for HeldRead {
    fn drop(&mut self) {
        self.read_bytes_held.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

fn send_reply(conn: &Conn, m: Message) {
    if conn.broken.load(Ordering::Relaxed) {
        return;
    }
    if let Err(e) = conn.ch.send_timeout(m, REPLY_TIMEOUT) {
        // The client is gone, or kept every earlier reply for REPLY_TIMEOUT:
        // either way nobody waits for this one any more.
        tracing::debug!(error = %e.error, "fido-blk reply not sent; giving the connection up");
        conn.broken.store(true, Ordering::Relaxed);
    }
}

/// Options of [`serve`].
#[derive(Clone, Debug, Default)]
pub struct ServeOptions {
    /// Also publish the counters as `key=value` lines under
    /// `/blk/<name>/stats` in the registry (every second when they changed).
    pub publish_stats: bool,
    /// The most bytes of READ replies one connection may hold (not yet
    /// released) before the storage domain takes no more of its requests
    /// until it releases some: one client cannot exhaust the arena that
    /// every client's reads come from. 0: [`DEFAULT_READ_BYTES_HELD`].
    pub max_read_bytes_held: u64,
}

/// The default of [`ServeOptions::max_read_bytes_held`].
pub const DEFAULT_READ_BYTES_HELD: u64 = 256 << 20;

struct Shared {
    domain: Domain,
    name: String,
    backend: Arc<dyn BlockBackend>,
    counters: Arc<Counters>,
    stop: AtomicBool,
    max_read_bytes_held: u64,
}

impl Shared {
    fn stats(&self) -> Stats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Stats {
            connections: l(&c.connections),
            requests: l(&c.requests),
            reads: l(&c.reads),
            writes: l(&c.writes),
            flushes: l(&c.flushes),
            discards: l(&c.discards),
            write_zeroes: l(&c.write_zeroes),
            errors: l(&c.errors),
            bytes_read: l(&c.bytes_read),
            bytes_written: l(&c.bytes_written),
            bytes_copied: self.domain.counters().bytes_copied,
        }
    }
}

/// A running storage domain service; stops (withdraws the service, ends
/// every connection after its in-flight requests) when dropped.
pub struct Server {
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

/// The registry key of the counters of block device `name`.
pub fn stats_key(name: &str) -> String {
    format!("/blk/{name}/stats")
}

/// Offers `blk:<name>` in `domain` and serves it from `backend` on threads
/// of this process until the returned [`Server`] is dropped or stopped.
pub fn serve(domain: &Domain, name: &str, backend: Arc<dyn BlockBackend>, opts: ServeOptions) -> fido::Result<Server> {
    let service = proto::service_name(name).map_err(|e| FidoError::Io(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))?;
    let info = backend.info();
    info.validate().map_err(|e| FidoError::Io(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))?;
    let listener = domain.offer(&service)?;
    let shared = Arc::new(Shared {
        domain: domain.clone(),
        name: name.to_string(),
        backend,
        counters: Arc::default(),
        stop: AtomicBool::new(false),
        max_read_bytes_held: if opts.max_read_bytes_held == 0 { DEFAULT_READ_BYTES_HELD } else { opts.max_read_bytes_held },
    });
    let s = shared.clone();
    let acceptor = std::thread::Builder::new()
        .name(format!("blk-accept-{name}"))
        .spawn(move || accept_loop(s, listener, opts))
        .map_err(FidoError::Io)?;
    Ok(Server { shared, acceptor: Some(acceptor) })
}

impl Server {
    pub fn stats(&self) -> Stats {
        self.shared.stats()
    }

    pub fn name(&self) -> &str {
        &self.shared.name
    }

    pub fn info(&self) -> Info {
        self.shared.backend.info()
    }

    /// Withdraws the service and waits for every connection to finish its
    /// in-flight requests.
    pub fn stop(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_now();
    }
}

fn accept_loop(shared: Arc<Shared>, listener: fido::Listener, opts: ServeOptions) {
    let mut conns: Vec<JoinHandle<()>> = Vec::new();
    let mut published = None;
    let mut last_publish = Instant::now() - PUBLISH_EVERY;
    while !shared.stop.load(Ordering::Relaxed) {
        match listener.accept_timeout(POLL) {
            Ok(ch) => {
                bump(&shared.counters.connections, 1);
                let s = shared.clone();
                match std::thread::Builder::new().name(format!("blk-conn-{}", shared.name)).spawn(move || serve_connection(s, ch)) {
                    Ok(t) => conns.push(t),
                    Err(e) => tracing::warn!(error = %e, "fido-blk: no thread for a connection; refused"),
                }
            }
            Err(FidoError::Timeout) => {}
            Err(e) => {
                tracing::warn!(error = %e, "fido-blk: accept failed");
                std::thread::sleep(POLL);
            }
        }
        conns.retain(|t| !t.is_finished());
        if opts.publish_stats && last_publish.elapsed() >= PUBLISH_EVERY {
            last_publish = Instant::now();
            let st = shared.stats();
            if published != Some(st) {
                if let Err(e) = shared.domain.write(&stats_key(&shared.name), st.to_text().as_bytes()) {
                    tracing::debug!(error = %e, "fido-blk: publishing stats");
                }
                published = Some(st);
            }
        }
    }
    drop(listener);
    for t in conns {
        let _ = t.join();
    }
}

/// Reads the 16-byte header of a request and the payload length behind it,
/// trusting nothing: `None` when the framing is wrong (WRITE: at least two
/// segments, the first exactly 16 bytes; other ops: one 16-byte segment).
fn frame(msg: &Msg) -> (Option<ReqHeader>, u64) {
    let mut segs = msg.segments();
    let Some(first) = segs.next() else { return (None, 0) };
    if first.len() != HEADER_LEN {
        return (None, 0);
    }
    let header = first.read_obj::<ReqHeader>(0);
    let payload: u64 = segs.map(|s| s.len() as u64).sum();
    if msg.opcode() == proto::OP_WRITE && payload == 0 {
        return (None, 0);
    }
    (header, payload)
}

fn serve_connection(shared: Arc<Shared>, ch: Channel) {
    let info = shared.backend.info();
    if let Err(e) = ch.send_inline(proto::INFO_TAG, proto::INFO_OPCODE, bytemuck::bytes_of(&info)) {
        tracing::debug!(error = %e.error, "fido-blk: sending INFO");
        return;
    }
    let conn = Arc::new(Conn {
        ch,
        domain: shared.domain.clone(),
        counters: shared.counters.clone(),
        broken: AtomicBool::new(false),
        read_bytes_held: Arc::new(AtomicU64::new(0)),
    });
    let mut queue = match shared.backend.open_queue(&shared.domain) {
        Ok(q) => q,
        Err(e) => {
            tracing::warn!(error = %e, "fido-blk: the backend could not open a queue; connection closed");
            return;
        }
    };
    'serve: while !shared.stop.load(Ordering::Relaxed) && !conn.broken.load(Ordering::Relaxed) {
        let msg = match conn.ch.recv_timeout(POLL) {
            Ok(m) => m,
            Err(FidoError::Timeout) => continue,
            Err(e) => {
                tracing::debug!(error = %e, "fido-blk: connection ended");
                break;
            }
        };
        if !within_budget(&shared, &conn, &mut *queue) {
            break;
        }
        handle(&shared, &conn, &info, &mut *queue, msg);
        // Take what else is waiting as one batch, then let the backend go.
        for _ in 1..BATCH {
            match conn.ch.try_recv() {
                Ok(Some(m)) => {
                    if !within_budget(&shared, &conn, &mut *queue) {
                        break 'serve;
                    }
                    handle(&shared, &conn, &info, &mut *queue, m)
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "fido-blk: connection ended");
                    queue.flush();
                    break 'serve;
                }
            }
        }
        queue.flush();
    }
    // Dropping the queue waits for the requests still in the backend.
    drop(queue);
}

/// Waits while the client holds its budget of READ data: no request is
/// taken until it releases some (collecting releases drops the `HeldRead`s).
/// `false`: the connection ended (or the server stops) meanwhile.
fn within_budget(shared: &Shared, conn: &Conn, queue: &mut dyn BackendQueue) -> bool {
    while conn.read_bytes_held.load(Ordering::Relaxed) >= shared.max_read_bytes_held {
        queue.flush();
        if let Err(e) = conn.ch.reap() {
            tracing::debug!(error = %e, "fido-blk: connection ended");
            return false;
        }
        if !conn.ch.is_open() || shared.stop.load(Ordering::Relaxed) || conn.broken.load(Ordering::Relaxed) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// Validates one request and hands it to the backend, or refuses it.
fn handle(shared: &Shared, conn: &Arc<Conn>, info: &Info, queue: &mut dyn BackendQueue, msg: Msg) {
    bump(&shared.counters.requests, 1);
    let (header, payload_len) = frame(&msg);
    let (id, opcode) = (msg.tag(), msg.opcode());
    match proto::check_request(info, opcode, header, payload_len) {
        Ok(checked) => {
            let reply = Replier { conn: conn.clone(), id, op: checked.op, len: checked.len, done: false };
            queue.submit(Request { checked, msg, reply });
        }
        Err(status) => {
            drop(msg);
            bump(&shared.counters.errors, 1);
            send_reply(conn, Message::inline(&[]).expect("an empty inline message").tag(id).opcode(status));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_text_round_trip() {
        let s = Stats { connections: 1, requests: 2, reads: 3, writes: 4, flushes: 5, discards: 6, write_zeroes: 7, errors: 8, bytes_read: 9, bytes_written: 10, bytes_copied: 11 };
        assert_eq!(Stats::from_text(&s.to_text()), s);
        assert_eq!(Stats::from_text("reads=x\nnonsense\nunknown=3\nwrites=2"), Stats { writes: 2, ..Default::default() });
    }
}
