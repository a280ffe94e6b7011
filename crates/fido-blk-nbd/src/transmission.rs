//! The transmission phase of one connection: a reader thread parses and
//! validates requests and submits them to the backend (splitting those longer
//! than its transfer size), a writer thread takes completions in whatever
//! order they come and writes the replies.
//!
//! Bounded by construction: at most `cap` backend requests are in flight (the
//! reader waits for a slot before it reads a WRITE payload or submits), so a
//! client that sends without reading replies stalls itself, not our memory.

use std::collections::HashMap;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Condvar, Mutex};

use crate::export::{Completer, Completion, ExportInfo, Op, ReadData, Request, Run, Submitter};
use crate::handshake::{in_flight_cap, max_request, Negotiated};
use crate::proto::*;
use crate::server::ServerConfig;
use crate::sock::{send_all, RawIov, Stream};

/// Zeroes for the holes of a simple READ reply (sent by pointer, many times).
static ZERO_PAGE: [u8; 64 << 10] = [0u8; 64 << 10];

/// At most this many extents in one BLOCK_STATUS reply (the client asks again
/// for the rest).
const MAX_EXTENTS: usize = 4096;

/// READ bytes that simple-reply READs (held until every piece is in) may
/// have in flight at once. A backend may limit what a client holds unreleased
/// (fido-blk: 256 MiB per connection) and make it wait beyond that; held
/// pieces of requests still waiting for their other pieces must never reach
/// such a limit, or neither side moves.
const MAX_WHOLE_READ_BYTES: u64 = 64 << 20;

/// A WRITE longer than this cannot be skipped honestly: the connection closes.
const MAX_DISCARDED_PAYLOAD: u32 = 64 << 20;

/// What a request is, for its reply.
enum Kind {
    /// A READ answered chunk by chunk as pieces complete (structured replies).
    ReadChunks,
    /// A READ answered in one simple reply once every piece is in; each piece
    /// holds its slot until then.
    ReadWhole,
    /// Anything else: one simple reply with the first error.
    Other,
}

struct Pending<D> {
    cookie: u64,
    kind: Kind,
    /// Offset and length of the whole request; every piece is `piece_len`
    /// long but the last.
    offset: u64,
    length: u32,
    piece_len: u32,
    /// Pieces not yet completed (or failed before submission).
    left: u32,
    /// Slots held until the reply (ReadWhole).
    held_slots: usize,
    /// First error (NBD value).
    error: Option<u32>,
    /// ReadWhole: each piece's data and length, by index.
    parts: Vec<Option<(D, u32)>>,
}

struct Table<D> {
    next_tag: u64,
    next_key: u64,
    /// Backend tag → (request key, piece index).
    pieces: HashMap<u64, (u64, u32)>,
    requests: HashMap<u64, Pending<D>>,
    /// Slots in use: reserved by the reader, submitted, or held by a ReadWhole.
    outstanding: usize,
    /// Submitted and not yet completed: the writer calls `complete` only then.
    submitted: usize,
    /// Pieces that failed before reaching the backend (tag, NBD error), for
    /// the writer to reply to.
    local: Vec<(u64, u32)>,
    /// Bytes of ReadWhole requests admitted and not yet replied to.
    whole_read_bytes: u64,
    reader_done: bool,
    backend_failed: bool,
    reader_waiting: bool,
    writer_waiting: bool,
}

/// What to write for one event.
enum Reply<D> {
    Simple { cookie: u64, error: u32 },
    /// A structured READ piece: its data or error, DONE when it is the last.
    Chunk { cookie: u64, offset: u64, len: u32, result: Result<D, u32>, done: bool },
    /// A ReadWhole request complete without error: the parts in order, with
    /// their lengths.
    Whole { cookie: u64, parts: Vec<(D, u32)> },
    /// A structured error chunk ending a request (DONE).
    StructuredError { cookie: u64, error: u32 },
}

struct Shared<D> {
    table: Mutex<Table<D>>,
    /// The reader waits here for a slot.
    slot_free: Condvar,
    /// The writer waits here for something to complete.
    work: Condvar,
    /// Serialises replies. Every reply of a request submitted to the backend
    /// is written by the writer thread (in the order it decides them); the
    /// reader writes only replies to requests it answers itself.
    out: Mutex<Out<D>>,
}

/// Replies on their way out: appended one by one, sent together by `flush`
/// (one sendmsg for a batch of completions).
struct Out<D> {
    stream: Stream,
    /// Header bytes of the pending replies (`parts` index into it).
    headers: Vec<u8>,
    parts: Vec<Part>,
    /// The backend data `parts` point into, alive until it is sent.
    hold: Vec<D>,
    runs: Vec<Run>,
    iov: Vec<RawIov>,
    /// The client stopped reading (a send failed or timed out).
    broken: bool,
}

// SAFETY: the raw pointers in `parts`, `runs` and `iov` point into `headers`,
// ZERO_PAGE or the data in `hold`, which this value owns (moving it moves the
// Vecs' heap buffers, not their contents); they are read only by `flush`, under
// the `out` lock, and cleared after each send.
unsafe impl<D: Send> Send for Out<D> {}

enum Part {
    Header(usize, usize),
    Raw(*const u8, usize),
}

impl<D: ReadData> Out<D> {
    /// Appends and sends one reply.
    fn write(&mut self, reply: Reply<D>) {
        self.append(reply);
        self.flush();
    }

    /// Appends a reply to the batch.
    fn append(&mut self, reply: Reply<D>) {
        if self.broken {
            return;
        }
        let mut parts = std::mem::take(&mut self.parts);
        self.append_parts(reply, &mut parts);
        self.parts = parts;
    }

    fn append_parts(&mut self, reply: Reply<D>, parts: &mut Vec<Part>) {
        let push_header = |headers: &mut Vec<u8>, parts: &mut Vec<Part>, bytes: &[u8]| {
            let start = headers.len();
            headers.extend_from_slice(bytes);
            // Adjacent headers merge into one iovec.
            match parts.last_mut() {
                Some(Part::Header(_, end)) if *end == start => *end = headers.len(),
                _ => parts.push(Part::Header(start, headers.len())),
            }
        };
        match reply {
            Reply::Simple { cookie, error } => push_header(&mut self.headers, parts, &simple_reply(error, cookie)),
            Reply::StructuredError { cookie, error } => {
                push_header(&mut self.headers, parts, &chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, 6));
                let mut p = [0u8; 6];
                p[0..4].copy_from_slice(&error.to_be_bytes());
                push_header(&mut self.headers, parts, &p);
            }
            Reply::Chunk { cookie, offset, len, result, done } => {
                let flags_last = if done { REPLY_FLAG_DONE } else { 0 };
                match result {
                    Err(error) => {
                        push_header(
                            &mut self.headers,
                            parts,
                            &chunk_header(flags_last, REPLY_TYPE_ERROR_OFFSET, cookie, 14),
                        );
                        let mut p = [0u8; 14];
                        p[0..4].copy_from_slice(&error.to_be_bytes());
                        p[6..14].copy_from_slice(&offset.to_be_bytes());
                        push_header(&mut self.headers, parts, &p);
                    }
                    Ok(data) => {
                        self.runs.clear();
                        data.runs(&mut self.runs);
                        if !runs_cover(&self.runs, len as u64) {
                            tracing::error!("backend READ data does not match the request length; sending EIO");
                            return self.append_parts(Reply::Chunk { cookie, offset, len, result: Err(EIO), done }, parts);
                        }
                        // Consecutive data runs form one OFFSET_DATA chunk;
                        // zero runs an OFFSET_HOLE chunk each.
                        let runs = std::mem::take(&mut self.runs);
                        let mut pos = offset;
                        let mut i = 0;
                        while i < runs.len() {
                            let mut j = i;
                            let mut bytes = 0u64;
                            while j < runs.len() {
                                match runs[j] {
                                    Run::Data { len, .. } => bytes += len as u64,
                                    Run::Zeroes { .. } => break,
                                }
                                j += 1;
                            }
                            let last = j == runs.len();
                            if j > i {
                                let flags = if last { flags_last } else { 0 };
                                let h = chunk_header(flags, REPLY_TYPE_OFFSET_DATA, cookie, 8 + bytes as u32);
                                push_header(&mut self.headers, parts, &h);
                                push_header(&mut self.headers, parts, &pos.to_be_bytes());
                                for r in &runs[i..j] {
                                    if let Run::Data { ptr, len } = *r {
                                        parts.push(Part::Raw(ptr, len));
                                    }
                                }
                                pos += bytes;
                                i = j;
                            } else if let Run::Zeroes { len } = runs[i] {
                                let last = i + 1 == runs.len();
                                let flags = if last { flags_last } else { 0 };
                                push_header(
                                    &mut self.headers,
                                    parts,
                                    &chunk_header(flags, REPLY_TYPE_OFFSET_HOLE, cookie, 12),
                                );
                                let mut p = [0u8; 12];
                                p[0..8].copy_from_slice(&pos.to_be_bytes());
                                p[8..12].copy_from_slice(&(len as u32).to_be_bytes());
                                push_header(&mut self.headers, parts, &p);
                                pos += len as u64;
                                i += 1;
                            }
                        }
                        self.runs = runs;
                        self.hold.push(data);
                    }
                }
            }
            Reply::Whole { cookie, parts: datas } => {
                // Validate every part before the header goes out: a short
                // part would desynchronise the stream.
                let mut all_runs: Vec<Run> = Vec::new();
                for (d, len) in &datas {
                    let start = all_runs.len();
                    d.runs(&mut all_runs);
                    if !runs_cover(&all_runs[start..], *len as u64) {
                        tracing::error!("backend READ data does not match the request length; sending EIO");
                        return self.append_parts(Reply::Simple { cookie, error: EIO }, parts);
                    }
                }
                push_header(&mut self.headers, parts, &simple_reply(0, cookie));
                for r in &all_runs {
                    match *r {
                        Run::Data { ptr, len } => parts.push(Part::Raw(ptr, len)),
                        Run::Zeroes { mut len } => {
                            while len > 0 {
                                let k = len.min(ZERO_PAGE.len());
                                parts.push(Part::Raw(ZERO_PAGE.as_ptr(), k));
                                len -= k;
                            }
                        }
                    }
                }
                self.hold.extend(datas.into_iter().map(|(d, _)| d));
            }
        }
    }

    /// Sends everything appended, then lets the backend data go.
    fn flush(&mut self) {
        if !self.broken && !self.parts.is_empty() {
            self.iov.clear();
            for p in &self.parts {
                self.iov.push(match *p {
                    Part::Header(a, b) => RawIov { ptr: self.headers[a..b].as_ptr(), len: b - a },
                    Part::Raw(ptr, len) => RawIov { ptr, len },
                });
            }
            if let Err(e) = send_all(self.stream.as_raw_fd(), &mut self.iov) {
                tracing::debug!("client stopped taking replies: {e}");
                self.broken = true;
                self.stream.shutdown();
            }
        }
        self.parts.clear();
        self.headers.clear();
        self.iov.clear();
        self.hold.clear();
    }
}

/// Do the runs describe exactly `len` bytes?
fn runs_cover(runs: &[Run], len: u64) -> bool {
    let total: u64 = runs
        .iter()
        .map(|r| match *r {
            Run::Data { len, .. } | Run::Zeroes { len } => len as u64,
        })
        .sum();
    total == len
}

/// Records a piece's outcome; returns the reply it makes due, if any.
fn piece_done<D>(t: &mut Table<D>, key: u64, index: u32, result: Result<Option<D>, u32>, had_slot: bool) -> Option<Reply<D>> {
    let req = t.requests.get_mut(&key)?;
    req.left -= 1;
    let last = req.left == 0;
    let piece_start = index as u64 * req.piece_len as u64;
    let piece_len = (req.length as u64 - piece_start).min(req.piece_len as u64) as u32;
    match req.kind {
        Kind::ReadChunks => {
            if had_slot {
                t.outstanding -= 1;
            }
            let offset = req.offset + piece_start;
            let cookie = req.cookie;
            if last {
                t.requests.remove(&key);
            }
            let result = match result {
                Ok(Some(d)) => Ok(d),
                Ok(None) => Err(EIO),
                Err(e) => Err(e),
            };
            Some(Reply::Chunk { cookie, offset, len: piece_len, result, done: last })
        }
        Kind::ReadWhole => {
            match result {
                Ok(Some(d)) => req.parts[index as usize] = Some((d, piece_len)),
                Ok(None) => req.error = req.error.or(Some(EIO)),
                Err(e) => req.error = req.error.or(Some(e)),
            }
            if !last {
                return None;
            }
            let req = t.requests.remove(&key).expect("present");
            t.outstanding -= req.held_slots;
            t.whole_read_bytes -= req.length as u64;
            Some(match req.error {
                Some(error) => Reply::Simple { cookie: req.cookie, error },
                None => Reply::Whole {
                    cookie: req.cookie,
                    parts: req.parts.into_iter().map(|p| p.expect("every piece completed")).collect(),
                },
            })
        }
        Kind::Other => {
            if had_slot {
                t.outstanding -= 1;
            }
            if let Err(e) = result {
                req.error = req.error.or(Some(e));
            }
            if !last {
                return None;
            }
            let req = t.requests.remove(&key).expect("present");
            Some(Reply::Simple { cookie: req.cookie, error: req.error.unwrap_or(0) })
        }
    }
}

struct Conn<S: Submitter, D> {
    shared: Arc<Shared<D>>,
    stream: Stream,
    submitter: S,
    info: ExportInfo,
    structured: bool,
    base_allocation: bool,
    cap: usize,
    max_request: u32,
}

/// Why the reader stopped.
enum Stop {
    /// Orderly: DISC or EOF.
    Done,
    /// The client broke the protocol or the socket failed.
    Client,
    /// The backend failed.
    Backend,
}

/// Serves one negotiated connection until the client disconnects, breaks
/// the protocol, or the backend fails. Every reply due is written (or the
/// client is gone) before this returns.
pub(crate) fn serve<S: Submitter, C: Completer>(
    stream: Stream,
    neg: Negotiated<S, C>,
    cfg: &ServerConfig,
) -> io::Result<()> {
    let cap = in_flight_cap(&neg.info, cfg);
    let out_stream = stream.try_clone()?;
    out_stream.set_write_timeout(Some(cfg.reply_timeout))?;
    let shared: Arc<Shared<C::Data>> = Arc::new(Shared {
        table: Mutex::new(Table {
            next_tag: 1,
            next_key: 1,
            pieces: HashMap::new(),
            requests: HashMap::new(),
            outstanding: 0,
            submitted: 0,
            local: Vec::new(),
            whole_read_bytes: 0,
            reader_done: false,
            backend_failed: false,
            reader_waiting: false,
            writer_waiting: false,
        }),
        slot_free: Condvar::new(),
        work: Condvar::new(),
        out: Mutex::new(Out {
            stream: out_stream,
            headers: Vec::new(),
            parts: Vec::new(),
            hold: Vec::new(),
            runs: Vec::new(),
            iov: Vec::new(),
            broken: false,
        }),
    });
    let writer = {
        let shared = shared.clone();
        let completer = neg.completer;
        std::thread::Builder::new().name("nbd-writer".into()).spawn(move || writer_loop(shared, completer))?
    };
    let mut conn = Conn {
        shared: shared.clone(),
        stream,
        submitter: neg.submitter,
        info: neg.info,
        structured: neg.structured,
        base_allocation: neg.base_allocation,
        cap,
        max_request: max_request(&neg.info, cap),
    };
    let stop = conn.reader_loop();
    {
        let mut t = shared.table.lock().unwrap();
        t.reader_done = true;
        if t.writer_waiting {
            shared.work.notify_one();
        }
    }
    let _ = writer.join();
    conn.stream.shutdown();
    match stop {
        Stop::Done => Ok(()),
        Stop::Client => Err(io::Error::new(io::ErrorKind::InvalidData, "client broke the protocol or went away")),
        Stop::Backend => Err(io::Error::new(io::ErrorKind::BrokenPipe, "backend failed")),
    }
}

/// Most completions gathered into one sendmsg.
const REPLY_BATCH: usize = 64;
/// ... and at most about this many bytes of READ data (held until sent).
const REPLY_BATCH_BYTES: u64 = 8 << 20;

impl<D> Reply<D> {
    /// READ data bytes this reply carries.
    fn data_len(&self) -> u64 {
        match self {
            Reply::Chunk { len, result: Ok(_), .. } => *len as u64,
            Reply::Whole { parts, .. } => parts.iter().map(|(_, l)| *l as u64).sum(),
            _ => 0,
        }
    }
}

fn writer_loop<C: Completer>(shared: Arc<Shared<C::Data>>, mut completer: C) {
    loop {
        let mut replies: Vec<Reply<C::Data>> = Vec::new();
        let mut batch_bytes = 0u64;
        let backend_pending = {
            let mut t = shared.table.lock().unwrap();
            while t.submitted == 0 && t.local.is_empty() {
                if t.reader_done || t.backend_failed {
                    return;
                }
                t.writer_waiting = true;
                t = shared.work.wait(t).unwrap();
                t.writer_waiting = false;
            }
            // Pieces that failed before reaching the backend.
            while let Some((tag, error)) = t.local.pop() {
                if let Some(r) = take_completion(&mut t, tag, Err(error)) {
                    replies.push(r);
                }
            }
            if t.reader_waiting {
                shared.slot_free.notify_one();
            }
            t.submitted > 0
        };
        if backend_pending {
            // One completion (waiting for it), then whatever else is ready.
            let mut next = completer.complete().map(Some);
            loop {
                match next {
                    Ok(Some(Completion { tag, result })) => {
                        let mut t = shared.table.lock().unwrap();
                        t.submitted -= 1;
                        if let Some(r) = take_completion(&mut t, tag, result.map_err(nbd_error)) {
                            batch_bytes += r.data_len();
                            replies.push(r);
                        }
                        if t.reader_waiting {
                            shared.slot_free.notify_one();
                        }
                        if t.submitted == 0 || replies.len() >= REPLY_BATCH || batch_bytes >= REPLY_BATCH_BYTES {
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!("backend connection failed: {e}");
                        let mut out = shared.out.lock().unwrap();
                        for r in replies {
                            out.append(r);
                        }
                        out.flush();
                        drop(out);
                        fail_everything(&shared);
                        return;
                    }
                }
                next = completer.try_complete();
            }
        }
        if !replies.is_empty() {
            let mut out = shared.out.lock().unwrap();
            for r in replies {
                out.append(r);
            }
            out.flush();
        }
    }
}

/// The reply (if any) a piece's completion makes due.
fn take_completion<D>(t: &mut Table<D>, tag: u64, result: Result<Option<D>, u32>) -> Option<Reply<D>> {
    match t.pieces.remove(&tag) {
        Some((key, index)) => piece_done(t, key, index, result, true),
        None => {
            tracing::error!(tag, "backend completed a request we do not have in flight");
            None
        }
    }
}

/// The backend is gone: every request still open gets EIO, the reader is
/// told, and the socket closes (the client reconnects to a backend that may
/// be back).
fn fail_everything<D: ReadData>(shared: &Shared<D>) {
    let mut t = shared.table.lock().unwrap();
    t.backend_failed = true;
    t.submitted = 0;
    t.outstanding = 0;
    t.pieces.clear();
    t.local.clear();
    t.whole_read_bytes = 0;
    let mut replies: Vec<Reply<D>> = Vec::new();
    for (_, req) in t.requests.drain() {
        replies.push(match req.kind {
            Kind::ReadChunks => Reply::StructuredError { cookie: req.cookie, error: EIO },
            _ => Reply::Simple { cookie: req.cookie, error: EIO },
        });
    }
    shared.slot_free.notify_all();
    let mut out = shared.out.lock().unwrap();
    drop(t);
    for r in replies {
        out.write(r);
    }
    out.stream.shutdown();
}

impl<S: Submitter, D: ReadData> Conn<S, D> {
    fn reader_loop(&mut self) -> Stop {
        loop {
            let mut h = [0u8; REQUEST_HEADER_LEN];
            if let Err(e) = self.stream.read_exact(&mut h) {
                return if e.kind() == io::ErrorKind::UnexpectedEof { Stop::Done } else { Stop::Client };
            }
            if self.shared.table.lock().unwrap().backend_failed {
                return Stop::Backend;
            }
            let Some(req) = RequestHeader::parse(&h) else {
                tracing::debug!("bad request magic: closing");
                return Stop::Client;
            };
            match self.handle(req) {
                Ok(()) => {}
                Err(stop) => return stop,
            }
        }
    }

    fn reply_now(&self, r: Reply<D>) {
        self.shared.out.lock().unwrap().write(r);
    }

    /// An error reply to a request we refuse before it reaches the backend.
    fn refuse(&self, req: &RequestHeader, error: u32) {
        let structured_cmd = req.command == CMD_READ || req.command == CMD_BLOCK_STATUS;
        if self.structured && structured_cmd {
            self.reply_now(Reply::StructuredError { cookie: req.cookie, error });
        } else {
            self.reply_now(Reply::Simple { cookie: req.cookie, error });
        }
    }

    /// Validates the range of a data command; `Err(errno)` to refuse it.
    fn check_range(&self, req: &RequestHeader, write_like: bool) -> Result<(), u32> {
        let bs = self.info.block_size as u64;
        if req.length == 0 || req.offset % bs != 0 || req.length as u64 % bs != 0 {
            return Err(EINVAL);
        }
        match req.offset.checked_add(req.length as u64) {
            Some(end) if end <= self.info.size => Ok(()),
            _ => Err(if write_like { ENOSPC } else { EINVAL }),
        }
    }

    fn handle(&mut self, req: RequestHeader) -> Result<(), Stop> {
        let fua_ok = self.info.fua && !self.info.read_only;
        let flag_error = |allowed: u16| if req.flags & !allowed != 0 { Some(EINVAL) } else { None };
        match req.command {
            CMD_DISC => Err(Stop::Done),
            CMD_READ => {
                // FUA on a read is meaningless but harmless.
                let err = flag_error(CMD_FLAG_FUA)
                    .or_else(|| self.check_range(&req, false).err())
                    .or_else(|| (req.length > self.max_request).then_some(if self.structured { EOVERFLOW } else { EINVAL }));
                if let Some(e) = err {
                    self.refuse(&req, e);
                    return Ok(());
                }
                let kind = if self.structured { Kind::ReadChunks } else { Kind::ReadWhole };
                self.submit_split(&req, kind, false)
            }
            CMD_WRITE => {
                if req.length > self.max_request.max(MAX_DISCARDED_PAYLOAD) {
                    tracing::debug!(len = req.length, "WRITE payload too long to skip: closing");
                    return Err(Stop::Client);
                }
                let err = if self.info.read_only {
                    Some(EPERM)
                } else {
                    flag_error(if fua_ok { CMD_FLAG_FUA } else { 0 })
                        .or_else(|| self.check_range(&req, true).err())
                        .or_else(|| (req.length > self.max_request).then_some(EINVAL))
                };
                if let Some(e) = err {
                    self.stream.discard(req.length as u64).map_err(|_| Stop::Client)?;
                    self.refuse(&req, e);
                    return Ok(());
                }
                self.submit_split(&req, Kind::Other, req.flags & CMD_FLAG_FUA != 0)
            }
            CMD_FLUSH => {
                if !self.info.flush || req.flags != 0 {
                    self.refuse(&req, EINVAL);
                    return Ok(());
                }
                self.submit_split(&req, Kind::Other, false)
            }
            CMD_TRIM | CMD_WRITE_ZEROES => {
                let trim = req.command == CMD_TRIM;
                let supported = if trim { self.info.trim } else { self.info.write_zeroes };
                let fua = if fua_ok { CMD_FLAG_FUA } else { 0 };
                let allowed = if trim { fua } else { fua | CMD_FLAG_NO_HOLE };
                let err = if self.info.read_only {
                    Some(EPERM)
                } else if !supported {
                    Some(EINVAL)
                } else {
                    flag_error(allowed).or_else(|| self.check_range(&req, true).err())
                };
                if let Some(e) = err {
                    self.refuse(&req, e);
                    return Ok(());
                }
                self.submit_split(&req, Kind::Other, req.flags & CMD_FLAG_FUA != 0)
            }
            CMD_BLOCK_STATUS => {
                let in_range = req.offset.checked_add(req.length as u64).is_some_and(|end| end <= self.info.size);
                let err = if !self.base_allocation {
                    Some(EINVAL)
                } else {
                    flag_error(CMD_FLAG_REQ_ONE).or_else(|| (req.length == 0 || !in_range).then_some(EINVAL))
                };
                if let Some(e) = err {
                    self.refuse(&req, e);
                    return Ok(());
                }
                self.block_status(&req);
                Ok(())
            }
            _ => {
                // Unknown commands carry no payload (without extended
                // headers only WRITE does): refuse and go on.
                self.refuse(&req, EINVAL);
                Ok(())
            }
        }
    }

    fn block_status(&mut self, req: &RequestHeader) {
        let extents = match self.submitter.extents(req.offset, req.length) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!("backend extents failed: {e}");
                self.refuse(req, EIO);
                return;
            }
        };
        // Keep what is sane: positive lengths, not past the request, at most
        // MAX_EXTENTS (one with REQ_ONE).
        let limit = if req.flags & CMD_FLAG_REQ_ONE != 0 { 1 } else { MAX_EXTENTS };
        let mut left = req.length;
        let mut clean: Vec<(u32, u32)> = Vec::new();
        for (len, flags) in extents {
            if left == 0 || clean.len() == limit {
                break;
            }
            if len == 0 {
                continue;
            }
            let len = len.min(left);
            clean.push((len, flags & (STATE_HOLE | STATE_ZERO)));
            left -= len;
        }
        if clean.is_empty() {
            clean.push((req.length, 0));
        }
        let mut payload = Vec::with_capacity(4 + 8 * clean.len());
        payload.extend_from_slice(&BASE_ALLOCATION_ID.to_be_bytes());
        for (len, flags) in &clean {
            payload.extend_from_slice(&len.to_be_bytes());
            payload.extend_from_slice(&flags.to_be_bytes());
        }
        let mut b = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, req.cookie, payload.len() as u32).to_vec();
        b.extend_from_slice(&payload);
        let mut out = self.shared.out.lock().unwrap();
        if !out.broken {
            if let Err(e) = out.stream.write_all(&b) {
                tracing::debug!("client stopped taking replies: {e}");
                out.broken = true;
                out.stream.shutdown();
            }
        }
    }

    /// Submits a request as pieces of at most the backend's transfer size.
    fn submit_split(&mut self, req: &RequestHeader, kind: Kind, fua: bool) -> Result<(), Stop> {
        let is_flush = req.command == CMD_FLUSH;
        let piece_len = match req.command {
            CMD_TRIM | CMD_WRITE_ZEROES => self.info.max_discard,
            _ => self.info.max_transfer,
        };
        let pieces = if is_flush { 1 } else { req.length.div_ceil(piece_len) };
        let whole = matches!(kind, Kind::ReadWhole);
        let key = {
            let mut t = self.shared.table.lock().unwrap();
            if whole {
                // Admitted whole (see MAX_WHOLE_READ_BYTES); one request alone always is.
                while t.whole_read_bytes > 0
                    && t.whole_read_bytes + req.length as u64 > MAX_WHOLE_READ_BYTES
                    && !t.backend_failed
                {
                    t.reader_waiting = true;
                    t = self.shared.slot_free.wait(t).unwrap();
                    t.reader_waiting = false;
                }
                if t.backend_failed {
                    return Err(Stop::Backend);
                }
                t.whole_read_bytes += req.length as u64;
            }
            let key = t.next_key;
            t.next_key += 1;
            let parts = if whole { (0..pieces).map(|_| None).collect() } else { Vec::new() };
            t.requests.insert(
                key,
                Pending {
                    cookie: req.cookie,
                    kind,
                    offset: req.offset,
                    length: req.length,
                    piece_len,
                    left: pieces,
                    held_slots: 0,
                    error: None,
                    parts,
                },
            );
            key
        };
        for index in 0..pieces {
            let (offset, len) = if is_flush {
                (0, 0)
            } else {
                let off = index as u64 * piece_len as u64;
                (req.offset + off, (req.length as u64 - off).min(piece_len as u64) as u32)
            };
            // Wait for a slot (bounded in-flight), then take a tag.
            let tag = {
                let mut t = self.shared.table.lock().unwrap();
                while t.outstanding >= self.cap && !t.backend_failed {
                    t.reader_waiting = true;
                    t = self.shared.slot_free.wait(t).unwrap();
                    t.reader_waiting = false;
                }
                if t.backend_failed {
                    return Err(Stop::Backend);
                }
                t.outstanding += 1;
                if whole {
                    if let Some(p) = t.requests.get_mut(&key) {
                        p.held_slots += 1;
                    }
                }
                let tag = t.next_tag;
                t.next_tag += 1;
                t.pieces.insert(tag, (key, index));
                tag
            };
            let op = match req.command {
                CMD_READ => Op::Read,
                CMD_FLUSH => Op::Flush,
                CMD_TRIM => Op::Trim,
                CMD_WRITE_ZEROES => Op::WriteZeroes { may_unmap: req.flags & CMD_FLAG_NO_HOLE == 0 },
                CMD_WRITE => {
                    let mut buf = match self.submitter.write_buf(len as usize) {
                        Ok(b) => b,
                        Err(e) => {
                            tracing::warn!("no buffer for a {len}-byte write: {e}");
                            self.stream.discard(len as u64).map_err(|_| Stop::Client)?;
                            self.local_done(tag, ENOMEM);
                            continue;
                        }
                    };
                    if buf.len() != len as usize {
                        tracing::error!("backend gave a write buffer of the wrong length");
                        return Err(Stop::Backend);
                    }
                    // The one copy of the payload: the kernel's, from the
                    // socket into the backend's buffer.
                    if self.stream.read_exact(&mut buf[..]).is_err() {
                        self.local_done(tag, EIO);
                        return Err(Stop::Client);
                    }
                    Op::Write(buf)
                }
                _ => unreachable!("only data commands are split"),
            };
            match self.submitter.submit(Request { tag, op, offset, len, fua }) {
                Ok(()) => {
                    let mut t = self.shared.table.lock().unwrap();
                    t.submitted += 1;
                    if t.writer_waiting {
                        self.shared.work.notify_one();
                    }
                }
                Err(errno) => {
                    tracing::debug!(errno, "backend refused a request");
                    self.local_done(tag, nbd_error(errno));
                }
            }
        }
        Ok(())
    }

    /// A piece that holds a slot and a tag failed before reaching the backend.
    /// The writer replies for it, so that every reply of a split request
    /// comes from one thread, in order (a structured READ's DONE chunk last).
    fn local_done(&self, tag: u64, error: u32) {
        let mut t = self.shared.table.lock().unwrap();
        t.local.push((tag, error));
        if t.writer_waiting {
            self.shared.work.notify_one();
        }
    }
}
