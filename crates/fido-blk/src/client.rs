//! The client of a block service: pipelined requests with ids chosen by the
//! caller (one thread may submit while another completes), and blocking
//! helpers on top.
//!
//! The client tracks every request it sent until its reply arrives. When the
//! connection is lost (the storage domain died, closed or broke the
//! protocol), every request still tracked completes with
//! [`BlkError::Disconnected`] — never a hang — and the next submission (or
//! [`BlkClient::reconnect`]) connects again, so a client resumes after the
//! storage domain restarts.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fido::{Buf, Channel, Domain, Error as FidoError, Message, Msg};
use parking_lot::Mutex;

use crate::proto::{self, Info, Op};

/// How long `connect` waits for the server's INFO.
pub const INFO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the blocking helpers wait for their reply.
pub const SYNC_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a submission waits for window space before it takes in replies.
const WINDOW_POLL: Duration = Duration::from_millis(1);
/// Request ids at or above this are the blocking helpers' own.
pub const SYNC_ID_BASE: u64 = 1 << 63;

/// Why a request or call failed.
#[derive(Debug, thiserror::Error)]
pub enum BlkError {
    /// The server answered with this errno (EIO, ENOSPC, EINVAL, EROFS, ...).
    #[error("the storage domain answered {}", proto::status_name(*.0))]
    Status(u16),
    /// The connection was lost before the reply came (the request may or may
    /// not have been done).
    #[error("the connection to the storage domain was lost")]
    Disconnected,
    /// Nothing completed within the timeout.
    #[error("timed out")]
    Timeout,
    /// The server broke the protocol (a bad INFO, a reply of the wrong size).
    #[error("the storage domain broke the protocol: {0}")]
    Protocol(String),
    /// A bad argument (an id already in flight, a length of zero, ...).
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error(transparent)]
    Fido(#[from] FidoError),
}

impl BlkError {
    /// The errno this error stands for (Disconnected: EIO; Timeout: ETIMEDOUT).
    pub fn errno(&self) -> i32 {
        match self {
            BlkError::Status(s) => i32::from(*s),
            BlkError::Disconnected | BlkError::Protocol(_) | BlkError::Fido(_) => libc::EIO,
            BlkError::Timeout => libc::ETIMEDOUT,
            BlkError::Invalid(_) => libc::EINVAL,
        }
    }
}

pub type Result<T, E = BlkError> = std::result::Result<T, E>;

/// One finished request.
#[derive(Debug)]
pub struct Completion {
    pub id: u64,
    /// READ: `Some(data)` (a zero-copy view of the server's buffer, exactly
    /// the requested length); every other op: `None`.
    pub result: Result<Option<Msg>>,
}

struct Conn {
    ch: Channel,
    info: Info,
    generation: u64,
}

struct Pending {
    op: Op,
    len: u32,
    generation: u64,
}

/// A connection to block service `blk:NAME` that survives storage domain restarts.
pub struct BlkClient {
    domain: Domain,
    name: String,
    service: String,
    conn: Mutex<Arc<Conn>>,
    pending: Mutex<HashMap<u64, Pending>>,
    /// Completions already known (requests failed by a lost connection,
    /// replies a blocking helper received for someone else).
    ready: Mutex<VecDeque<Completion>>,
    generations: AtomicU64,
    sync_ids: AtomicU64,
}

fn open(domain: &Domain, service: &str, generation: u64) -> Result<Conn> {
    let ch = domain.connect(service)?;
    let m = match ch.recv_timeout(INFO_TIMEOUT) {
        Ok(m) => m,
        Err(FidoError::Timeout) => return Err(BlkError::Protocol("no INFO within 10 s".into())),
        Err(e) => return Err(e.into()),
    };
    let bytes = m.inline_bytes().map(<[u8]>::to_vec).unwrap_or_default();
    let info = proto::parse_info(m.opcode(), m.tag(), &bytes).map_err(|e| BlkError::Protocol(e.to_string()))?;
    Ok(Conn { ch, info, generation })
}

impl BlkClient {
    /// Connects to block device `name` (service `blk:<name>`) and reads its INFO.
    pub fn connect(domain: &Domain, name: &str) -> Result<BlkClient> {
        let service = proto::service_name(name).map_err(|e| BlkError::Invalid(e.to_string()))?;
        let conn = open(domain, &service, 1)?;
        Ok(BlkClient {
            domain: domain.clone(),
            name: name.to_string(),
            service,
            conn: Mutex::new(Arc::new(conn)),
            pending: Mutex::new(HashMap::new()),
            ready: Mutex::new(VecDeque::new()),
            generations: AtomicU64::new(1),
            sync_ids: AtomicU64::new(SYNC_ID_BASE),
        })
    }

    /// The device as the server described it at the last (re)connect.
    pub fn info(&self) -> Info {
        self.conn.lock().info
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn domain(&self) -> &Domain {
        &self.domain
    }

    /// Whether the current connection is usable.
    pub fn is_connected(&self) -> bool {
        self.conn.lock().ch.is_open()
    }

    /// Requests sent and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.pending.lock().len()
    }

    /// Connects again (after the storage domain restarted). Every request of
    /// the old connection that has not completed completes with
    /// `Disconnected`. The device must keep its size and block size.
    pub fn reconnect(&self) -> Result<()> {
        let generation = self.generations.fetch_add(1, Ordering::Relaxed) + 1;
        let new = open(&self.domain, &self.service, generation)?;
        let old = {
            let mut cur = self.conn.lock();
            if new.info.size != cur.info.size || new.info.logical_block != cur.info.logical_block {
                return Err(BlkError::Protocol(format!(
                    "the device changed shape across reconnect: {} bytes / {} B blocks, was {} / {}",
                    new.info.size, new.info.logical_block, cur.info.size, cur.info.logical_block
                )));
            }
            std::mem::replace(&mut *cur, Arc::new(new))
        };
        self.fail_generation(&old);
        Ok(())
    }

    /// Moves every pending request of `conn`'s generation to `ready` as
    /// Disconnected, and drops what the peer never released.
    fn fail_generation(&self, conn: &Conn) {
        drop(conn.ch.take_undelivered());
        let mut pending = self.pending.lock();
        let ids: Vec<u64> = pending.iter().filter(|(_, p)| p.generation == conn.generation).map(|(id, _)| *id).collect();
        let mut ready = self.ready.lock();
        for id in ids {
            pending.remove(&id);
            ready.push_back(Completion { id, result: Err(BlkError::Disconnected) });
        }
    }

    /// The connection to send on, connecting again first if it was lost.
    fn live_conn(&self) -> Result<Arc<Conn>> {
        let c = self.conn.lock().clone();
        if c.ch.is_open() {
            return Ok(c);
        }
        self.reconnect()?;
        Ok(self.conn.lock().clone())
    }

    fn send(&self, id: u64, op: Op, len: u32, msg: Message) -> Result<()> {
        let conn = self.live_conn()?;
        {
            let mut pending = self.pending.lock();
            if pending.contains_key(&id) {
                return Err(BlkError::Invalid(format!("request id {id} is already in flight")));
            }
            pending.insert(id, Pending { op, len, generation: conn.generation });
        }
        let mut msg = msg.tag(id).opcode(op.opcode());
        // While the window is full, take in the replies that are waiting
        // (their ids complete later through `complete`; non-READ replies are
        // released at once): a single thread that submits more than the
        // window before it completes must not wait for ever on a storage
        // domain that waits for it to release replies.
        let sent = loop {
            match conn.ch.send_timeout(msg, WINDOW_POLL) {
                Err(fido::SendError { error: FidoError::Timeout | FidoError::WouldBlock, message }) => {
                    msg = message;
                    self.take_waiting_replies(&conn);
                }
                other => break other,
            }
        };
        match sent {
            Ok(()) => Ok(()),
            Err(e) => {
                // Whoever took it out of `pending` (a lost connection) reports it.
                if self.pending.lock().remove(&id).is_some() {
                    Err(match e.error {
                        FidoError::PeerGone { .. } | FidoError::Closed => BlkError::Disconnected,
                        other => BlkError::Fido(other),
                    })
                } else {
                    Ok(())
                }
            }
        }
    }

    fn header_only(&self, id: u64, op: Op, offset: u64, len: u32, flags: u32) -> Result<()> {
        let msg = Message::inline(&proto::header_bytes(offset, len, flags))?;
        self.send(id, op, len, msg)
    }

    /// READ `len` bytes at `offset`; the completion carries the data.
    pub fn submit_read(&self, id: u64, offset: u64, len: u32) -> Result<()> {
        self.header_only(id, Op::Read, offset, len, 0)
    }

    /// WRITE `bufs` (buffers of this domain's arena, from `alloc`, whose
    /// lengths add up to the request length) at `offset`; the server reads
    /// them in place. `fua`: durable when acknowledged.
    pub fn submit_write(&self, id: u64, offset: u64, bufs: Vec<Buf>, fua: bool) -> Result<()> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let len = u32::try_from(total).map_err(|_| BlkError::Invalid(format!("a write of {total} bytes")))?;
        if bufs.is_empty() || bufs.len() >= fido::MAX_SEGMENTS {
            return Err(BlkError::Invalid(format!("a write of {} buffers", bufs.len())));
        }
        let mut header = self.domain.alloc(proto::HEADER_LEN)?;
        header.copy_from_slice(&proto::header_bytes(offset, len, if fua { proto::REQ_FUA } else { 0 }));
        let mut segs = Vec::with_capacity(bufs.len() + 1);
        segs.push(header);
        segs.extend(bufs);
        self.send(id, Op::Write, len, Message::gather(segs))
    }

    pub fn submit_flush(&self, id: u64) -> Result<()> {
        self.header_only(id, Op::Flush, 0, 0, 0)
    }

    pub fn submit_discard(&self, id: u64, offset: u64, len: u32, fua: bool) -> Result<()> {
        self.header_only(id, Op::Discard, offset, len, if fua { proto::REQ_FUA } else { 0 })
    }

    /// WRITE_ZEROES; `no_unmap`: keep the range allocated.
    pub fn submit_write_zeroes(&self, id: u64, offset: u64, len: u32, fua: bool, no_unmap: bool) -> Result<()> {
        let flags = if fua { proto::REQ_FUA } else { 0 } | if no_unmap { proto::REQ_NO_UNMAP } else { 0 };
        self.header_only(id, Op::WriteZeroes, offset, len, flags)
    }

    /// The next completed request, waiting up to `timeout`. `Err(Timeout)`
    /// when none completed; `Err(Disconnected)` when the connection is lost
    /// and nothing is in flight.
    pub fn complete(&self, timeout: Duration) -> Result<Completion> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(c) = self.ready.lock().pop_front() {
                return Ok(c);
            }
            let conn = self.conn.lock().clone();
            let left = deadline.saturating_duration_since(Instant::now());
            match conn.ch.recv_timeout(left) {
                Ok(m) => {
                    if let Some(c) = self.reply(&conn, m) {
                        return Ok(c);
                    }
                }
                Err(FidoError::Timeout) => return Err(BlkError::Timeout),
                Err(e) => {
                    tracing::debug!(error = %e, "fido-blk client: connection lost");
                    self.fail_generation(&conn);
                    if let Some(c) = self.ready.lock().pop_front() {
                        return Ok(c);
                    }
                    // A reconnect by another thread may have replaced the connection.
                    if Arc::ptr_eq(&conn, &self.conn.lock()) {
                        return Err(BlkError::Disconnected);
                    }
                }
            }
        }
    }

    /// Moves the replies already waiting on `conn` to `ready` (without
    /// waiting for a thread blocked in `complete`, which takes them anyway).
    fn take_waiting_replies(&self, conn: &Conn) {
        while let Ok(Some(m)) = conn.ch.try_recv_if_idle() {
            if let Some(c) = self.reply(conn, m) {
                self.ready.lock().push_back(c);
            }
        }
    }

    /// Matches a reply to its request; `None` for a reply to nothing we sent
    /// (ignored: a misbehaving server cannot complete someone else's id).
    fn reply(&self, conn: &Conn, m: Msg) -> Option<Completion> {
        let id = m.tag();
        let p = {
            let mut pending = self.pending.lock();
            match pending.get(&id) {
                Some(p) if p.generation == conn.generation => pending.remove(&id)?,
                _ => {
                    tracing::warn!(id, "fido-blk client: a reply to no request in flight; ignored");
                    return None;
                }
            }
        };
        let status = m.opcode();
        let result = if status != proto::STATUS_OK {
            Err(BlkError::Status(status))
        } else if p.op == Op::Read {
            if m.len() == p.len as usize {
                Ok(Some(m))
            } else {
                Err(BlkError::Protocol(format!("a READ of {} bytes answered with {}", p.len, m.len())))
            }
        } else {
            Ok(None)
        };
        Some(Completion { id, result })
    }

    /// Waits for request `id` (a blocking helper's), keeping any other
    /// completion for `complete`.
    fn wait_for(&self, id: u64) -> Result<Option<Msg>> {
        let deadline = Instant::now() + SYNC_TIMEOUT;
        let mut others = Vec::new();
        let out = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.complete(left) {
                Ok(c) if c.id == id => break c.result,
                Ok(c) => others.push(c),
                Err(e) => break Err(e),
            }
        };
        let mut ready = self.ready.lock();
        for c in others.into_iter().rev() {
            ready.push_front(c);
        }
        out
    }

    fn sync_id(&self) -> u64 {
        self.sync_ids.fetch_add(1, Ordering::Relaxed)
    }

    /// Reads `len` bytes at `offset` and waits: a zero-copy view of the
    /// server's buffer. The blocking helpers may be mixed with the pipelined
    /// calls on one thread, not used while another thread completes.
    pub fn read_at(&self, offset: u64, len: u32) -> Result<Msg> {
        let id = self.sync_id();
        self.submit_read(id, offset, len)?;
        self.wait_for(id)?.ok_or_else(|| BlkError::Protocol("a READ completed without data".into()))
    }

    /// Writes `data` at `offset` and waits. The bytes are copied once into
    /// an arena buffer (counted in the domain's `bytes_copied`); use
    /// `submit_write` with buffers from `alloc` to write without a copy.
    pub fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        if data.is_empty() {
            return Err(BlkError::Invalid("an empty write".into()));
        }
        let buf = self.domain.alloc_copy(data)?;
        self.write_bufs(offset, vec![buf], fua)
    }

    /// Writes `bufs` (this domain's arena) at `offset` and waits; no copy.
    pub fn write_bufs(&self, offset: u64, bufs: Vec<Buf>, fua: bool) -> Result<()> {
        let id = self.sync_id();
        self.submit_write(id, offset, bufs, fua)?;
        self.wait_for(id).map(drop)
    }

    pub fn flush(&self) -> Result<()> {
        let id = self.sync_id();
        self.submit_flush(id)?;
        self.wait_for(id).map(drop)
    }

    pub fn discard(&self, offset: u64, len: u32, fua: bool) -> Result<()> {
        let id = self.sync_id();
        self.submit_discard(id, offset, len, fua)?;
        self.wait_for(id).map(drop)
    }

    pub fn write_zeroes(&self, offset: u64, len: u32, fua: bool, no_unmap: bool) -> Result<()> {
        let id = self.sync_id();
        self.submit_write_zeroes(id, offset, len, fua, no_unmap)?;
        self.wait_for(id).map(drop)
    }

    /// A buffer in this domain's arena for a write payload (64-byte aligned;
    /// block-multiple sizes are block aligned, as `--direct` servers need).
    /// A full arena is retried once after collecting the releases the
    /// server already published: the library collects them in batches
    /// (when half the window is out), so a client writing large buffers
    /// one at a time would otherwise run out of arena with most of it free.
    pub fn alloc(&self, len: usize) -> Result<Buf> {
        match self.domain.alloc(len) {
            Err(FidoError::Shm(_)) => {
                let conn = self.conn.lock().clone();
                let _ = conn.ch.reap();
                Ok(self.domain.alloc(len)?)
            }
            other => Ok(other?),
        }
    }
}
