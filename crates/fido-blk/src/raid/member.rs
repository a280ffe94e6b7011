//! One member of a composition: a connection to another block service,
//! requests tagged by us and completed by callbacks, and a thread that
//! receives the replies, notices the member's death (or lies) and connects
//! again when its service comes back.
//!
//! A member is a peer like any other: a reply with a tag we did not send, a
//! READ answered with the wrong number of bytes, an INFO that does not fit
//! the composition, or a request left unanswered for [`REQUEST_TIMEOUT`]
//! ends the connection (every request in flight on it fails), never the
//! composition.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fido::{Channel, Domain, Error as FidoError, Message, Msg};
use parking_lot::{Mutex, RwLock};

use crate::proto::{self, Info, HEADER_LEN, OP_READ};

/// How long a member may leave one request unanswered before it is
/// considered hung and its connection given up.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a member that is down is tried again.
pub(crate) const RECONNECT_EVERY: Duration = Duration::from_millis(500);
/// How long a member's server may take to send INFO.
const INFO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long stopping waits for a member's thread.
const STOP_WAIT: Duration = Duration::from_secs(3);
/// How often the receiving thread looks at the stop flag and the clock.
const POLL: Duration = Duration::from_millis(100);

/// How a request to a member ended.
pub(crate) enum Outcome {
    /// The member answered: a status (0 OK, else an errno) and, for a READ
    /// that succeeded, its data (exactly the length asked for: checked).
    Answered { status: u16, data: Option<Msg> },
    /// The connection ended before an answer (the member died, lied or
    /// hung), or the request could not be sent.
    Lost,
}

impl Outcome {
    /// The status to report: the member's, or EIO for a lost request.
    pub(crate) fn status(&self) -> u16 {
        match self {
            Outcome::Answered { status, .. } => *status,
            Outcome::Lost => proto::EIO,
        }
    }
}

pub(crate) type Completion = Box<dyn FnOnce(Outcome) + Send>;

/// What the composition is told about a member's connection.
pub(crate) trait MemberEvents: Send + Sync + 'static {
    /// Whether a member whose server says `info` can serve the composition
    /// (size, block size, transfer size); `Err` says why not.
    fn check_info(&self, index: usize, info: &Info) -> Result<(), String>;
    /// The member is connected (its INFO passed `check_info`).
    fn member_up(&self, index: usize);
    /// The member's connection ended (`why`); requests in flight on it were
    /// completed as [`Outcome::Lost`] before this is called.
    fn member_down(&self, index: usize, why: &str);
}

struct Pending {
    completion: Completion,
    opcode: u16,
    len: u32,
    sent: Instant,
}

/// One connection to the member's service.
struct Link {
    ch: Channel,
    info: Info,
    /// Requests sent and not answered, by our tag.
    pending: Mutex<LinkPending>,
    /// Set to end the connection from outside the receiving thread.
    fail: Mutex<Option<String>>,
}

#[derive(Default)]
struct LinkPending {
    map: HashMap<u64, Pending>,
    /// No request is accepted any more (the connection is ending).
    closed: bool,
}

/// A member of a composition.
pub(crate) struct Member {
    pub(crate) index: usize,
    /// The block device name (its service is `blk:NAME`).
    pub(crate) name: String,
    service: String,
    link: RwLock<Option<Arc<Link>>>,
    next_tag: AtomicU64,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Requests sent, requests that failed, connections made.
    pub(crate) requests: AtomicU64,
    pub(crate) failures: AtomicU64,
    pub(crate) connects: AtomicU64,
    /// Why the member is down, if it is (for the status report).
    pub(crate) last_error: Mutex<Option<String>>,
}

impl Member {
    pub(crate) fn new(index: usize, name: &str) -> Result<Arc<Member>, proto::ProtoError> {
        let service = proto::service_name(name)?;
        Ok(Arc::new(Member {
            index,
            name: name.to_string(),
            service,
            link: RwLock::new(None),
            next_tag: AtomicU64::new(1),
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
            requests: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            last_error: Mutex::new(Some("not connected yet".into())),
        }))
    }

    /// Starts the thread that connects (and reconnects) and receives.
    pub(crate) fn start(self: &Arc<Self>, domain: &Domain, events: Arc<dyn MemberEvents>) -> std::io::Result<()> {
        let me = self.clone();
        let domain = domain.clone();
        let t = std::thread::Builder::new()
            .name(format!("raid-member-{}", self.index))
            .spawn(move || me.run(domain, events))?;
        *self.thread.lock() = Some(t);
        Ok(())
    }

    /// Tells the thread to stop, without waiting.
    pub(crate) fn signal_stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Stops the thread (requests in flight fail) and waits for it, a
    /// while: a thread inside a connect that waits for a broker that is
    /// gone is left to end on its own (it looks at the stop flag when the
    /// connect returns), so that a composition can always be dropped.
    pub(crate) fn stop(&self) {
        self.signal_stop();
        let Some(t) = self.thread.lock().take() else { return };
        let deadline = Instant::now() + STOP_WAIT;
        while !t.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if t.is_finished() {
            let _ = t.join();
        } else {
            tracing::warn!(member = %self.name, "RAID member thread still busy (in a connect?); not waiting for it");
        }
    }

    /// The member's INFO while it is connected.
    pub(crate) fn info(&self) -> Option<Info> {
        self.link.read().as_ref().map(|l| l.info)
    }

    pub(crate) fn is_connected(&self) -> bool {
        self.link.read().is_some()
    }

    /// Requests in flight on the current connection.
    pub(crate) fn in_flight(&self) -> usize {
        self.link.read().as_ref().map_or(0, |l| l.pending.lock().map.len())
    }

    /// Ends the current connection (the member misbehaved: an error, a
    /// short read); it is tried again later like a member that died.
    pub(crate) fn fail(&self, why: String) {
        if let Some(link) = self.link.read().as_ref() {
            let mut f = link.fail.lock();
            if f.is_none() {
                *f = Some(why);
            }
        }
    }

    /// Sends `message` (tag and opcode are set here) as a request of
    /// `len` bytes; `done` is called exactly once, on some thread (maybe
    /// this one, if the member is down or the send fails).
    pub(crate) fn submit(&self, opcode: u16, len: u32, message: Message, done: Completion) {
        let Some(link) = self.link.read().clone() else {
            done(Outcome::Lost);
            return;
        };
        let tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
        {
            let mut p = link.pending.lock();
            if p.closed {
                drop(p);
                done(Outcome::Lost);
                return;
            }
            p.map.insert(tag, Pending { completion: done, opcode, len, sent: Instant::now() });
        }
        self.requests.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = link.ch.send(message.tag(tag).opcode(opcode)) {
            // Whoever takes the entry completes it: us, or the receiving
            // thread if it already failed everything in flight.
            let taken = link.pending.lock().map.remove(&tag);
            if let Some(p) = taken {
                (p.completion)(Outcome::Lost);
            }
            self.fail(format!("send failed: {}", e.error));
        }
    }

    /// A request with an inline header (READ, FLUSH, DISCARD, WRITE_ZEROES).
    pub(crate) fn submit_header(&self, opcode: u16, offset: u64, len: u32, flags: u32, done: Completion) {
        let header = proto::header_bytes(offset, len, flags);
        let message = Message::inline(&header).expect("a 16-byte header fits inline");
        self.submit(opcode, len, message, done);
    }

    fn run(self: Arc<Self>, domain: Domain, events: Arc<dyn MemberEvents>) {
        let mut first = true;
        while !self.stop.load(Ordering::Relaxed) {
            if !first {
                std::thread::sleep(RECONNECT_EVERY);
            }
            first = false;
            let link = match self.connect(&domain, events.as_ref()) {
                Ok(l) => Arc::new(l),
                Err(why) => {
                    *self.last_error.lock() = Some(why);
                    continue;
                }
            };
            *self.link.write() = Some(link.clone());
            *self.last_error.lock() = None;
            self.connects.fetch_add(1, Ordering::Relaxed);
            tracing::info!(member = %self.name, "RAID member connected");
            events.member_up(self.index);
            let why = self.receive(&link);
            // Nothing new goes out on this connection, and everything in
            // flight on it fails.
            *self.link.write() = None;
            let lost: Vec<Pending> = {
                let mut p = link.pending.lock();
                p.closed = true;
                p.map.drain().map(|(_, v)| v).collect()
            };
            self.failures.fetch_add(lost.len() as u64, Ordering::Relaxed);
            for p in lost {
                (p.completion)(Outcome::Lost);
            }
            // Our shared forwards of client writes that the member never
            // released come back here; dropping them gives up our
            // references (the clients' buffers go back once the other
            // mirrors are done with them).
            drop(link.ch.take_undelivered());
            drop(link);
            tracing::warn!(member = %self.name, why = %why, "RAID member down");
            *self.last_error.lock() = Some(why.clone());
            events.member_down(self.index, &why);
        }
    }

    fn connect(&self, domain: &Domain, events: &dyn MemberEvents) -> Result<Link, String> {
        let ch = domain.connect(&self.service).map_err(|e| format!("connect {}: {e}", self.service))?;
        let m = ch.recv_timeout(INFO_TIMEOUT).map_err(|e| format!("no INFO from {}: {e}", self.service))?;
        // INFO comes inline: read from the copy taken with the descriptor
        // (no copy of peer memory, nothing counted).
        let bytes = m.inline_bytes().ok_or_else(|| format!("{}: INFO not inline", self.service))?;
        let info = proto::parse_info(m.opcode(), m.tag(), bytes).map_err(|e| format!("{}: {e}", self.service))?;
        drop(m);
        events.check_info(self.index, &info).map_err(|e| format!("{}: {e}", self.service))?;
        Ok(Link { ch, info, pending: Mutex::new(LinkPending::default()), fail: Mutex::new(None) })
    }

    /// Receives replies until the connection ends; returns why it ended.
    fn receive(&self, link: &Link) -> String {
        let mut last_scan = Instant::now();
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return "composition stopping".into();
            }
            if let Some(why) = link.fail.lock().take() {
                return why;
            }
            if last_scan.elapsed() >= POLL {
                last_scan = Instant::now();
                let p = link.pending.lock();
                if let Some((tag, _)) = p.map.iter().find(|(_, v)| v.sent.elapsed() > REQUEST_TIMEOUT) {
                    return format!("request {tag} unanswered for {REQUEST_TIMEOUT:?}");
                }
            }
            let msg = match link.ch.recv_timeout(POLL) {
                Ok(m) => m,
                Err(FidoError::Timeout) => continue,
                Err(e) => return format!("connection ended: {e}"),
            };
            let Some(p) = link.pending.lock().map.remove(&msg.tag()) else {
                return format!("reply to request {} that was never sent", msg.tag());
            };
            let status = msg.opcode();
            let outcome = if status != proto::STATUS_OK {
                drop(msg);
                self.failures.fetch_add(1, Ordering::Relaxed);
                Outcome::Answered { status, data: None }
            } else if p.opcode == OP_READ {
                if msg.len() != p.len as usize || msg.inline_bytes().is_some() {
                    // A short, long or inline read: not the blocks asked for.
                    let why = format!("READ of {} bytes answered with {} bytes", p.len, msg.len());
                    drop(msg);
                    self.failures.fetch_add(1, Ordering::Relaxed);
                    (p.completion)(Outcome::Answered { status: proto::EIO, data: None });
                    return why;
                }
                Outcome::Answered { status, data: Some(msg) }
            } else if !msg.is_empty() {
                let why = format!("a {}-byte reply to a request that takes an empty one", msg.len());
                drop(msg);
                (p.completion)(Outcome::Answered { status: proto::EIO, data: None });
                return why;
            } else {
                Outcome::Answered { status, data: None }
            };
            (p.completion)(outcome);
            // A storage domain releases a write's payload before it answers:
            // collect that release now, so that the client's buffers go back
            // as soon as the last mirror is done with them (not at the next
            // send, or the next 200 µs reap of a waiting receiver).
            if link.ch.reap().is_err() {
                return "the member lied in its releases".into();
            }
        }
    }
}

/// The 16-byte header of a WRITE, in a buffer of our arena (the members read
/// the header we checked, not the client's, which it could still change).
pub(crate) fn write_header(domain: &Domain, offset: u64, len: u32, flags: u32) -> fido::Result<fido::Buf> {
    let mut buf = domain.alloc(HEADER_LEN)?;
    buf.truncate(HEADER_LEN);
    buf.copy_from_slice(&proto::header_bytes(offset, len, flags));
    Ok(buf)
}

/// Sends a request and waits for its outcome (for the resync, which does
/// one thing at a time).
pub(crate) fn call(member: &Member, opcode: u16, len: u32, message: Message) -> Outcome {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    member.submit(
        opcode,
        len,
        message,
        Box::new(move |o| {
            let _ = tx.send(o);
        }),
    );
    // The member thread completes every request (lost ones included) within
    // REQUEST_TIMEOUT and a poll.
    rx.recv().unwrap_or(Outcome::Lost)
}
