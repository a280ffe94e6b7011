//! A domain's session with the broker: the reader thread, requests matched to
//! replies by id, events, heartbeats, and what happens when the broker goes
//! away (fail what waits; reconnect and re-register, or end).

use crate::error::{ControlError, ProtocolError, Result};
use crate::pending::{Answer, Pending, Slot};
use crate::transport::{Connect, Received, Transport};
use fido_proto::{BrokerMsg, ClientMsg, DomainId, ErrorCode, Event, PgvasGeometry, Reply, Request, ResumeSecret};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How long a request waits for its reply by default (a restarting broker included).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// Id of the first Join; later requests count up from [`FIRST_REQUEST_ID`].
const JOIN_ID: u64 = 1;
const FIRST_REQUEST_ID: u64 = 1 << 20;
/// How often a Join exchange looks at the clock while it waits for the answer.
const JOIN_POLL: Duration = Duration::from_millis(200);

/// How a [`Session`] behaves.
#[derive(Debug, Clone)]
pub struct Options {
    /// How long [`Session::request`] waits for the reply (and, unless
    /// `link_wait` says otherwise, for the link first).
    pub request_timeout: Duration,
    /// How long a request waits for the link while the session reconnects;
    /// `None`: the request timeout. `Some(ZERO)` fails at once while the
    /// broker is away (for callers that must never wait on a lost broker).
    pub link_wait: Option<Duration>,
    /// What losing the broker does: `None` ends the session (every later
    /// request fails at once); `Some` reconnects with this back-off and
    /// re-registers with what [`Handler::rejoin`] supplies.
    pub reconnect: Option<Backoff>,
}

impl Default for Options {
    fn default() -> Options {
        Options { request_timeout: REQUEST_TIMEOUT, link_wait: None, reconnect: None }
    }
}

/// Delays between reconnection attempts: `first`, doubling up to `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff { first: Duration::from_millis(20), max: Duration::from_millis(500) }
    }
}

/// What the broker said to a successful Join.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Joined {
    pub domain: DomainId,
    pub slot: u32,
    pub geometry: PgvasGeometry,
    /// How often the session sends a heartbeat (the broker's figure, kept
    /// within 10 ms ..= 60 s).
    pub heartbeat: Duration,
    /// What proves this domain when it resumes after a broker restart
    /// ([`fido_proto::Resume::secret`]).
    pub resume_secret: ResumeSecret,
}

/// What the session needs from its owner. The reader thread calls it; it holds
/// the handler weakly, and ends once the handler is gone.
pub trait Handler: Send + Sync + 'static {
    /// An event from the broker, with its descriptors.
    fn event(&self, event: Event, fds: Vec<OwnedFd>);

    /// Called once per heartbeat period on the reader thread, for housekeeping.
    fn tick(&self) {}

    /// The Join to send to a restarted broker, with its descriptors, so that
    /// it takes up this domain where the old one left it (id, slot, services,
    /// mappings, connections, watches). Asked afresh for every attempt; only
    /// used when [`Options::reconnect`] is set.
    fn rejoin(&self) -> Result<(Request, Vec<OwnedFd>)> {
        Err(ControlError::Unavailable("this session does not re-register".into()))
    }
}

/// Counters of what the reader thread saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Replies handed to the request that waited for them.
    pub replies: u64,
    /// Replies no request waited for: answers to [`Session::notify`], to
    /// requests that timed out or were dropped, or to ids never sent. Ignored.
    pub unmatched_replies: u64,
    /// Events delivered to the handler.
    pub events: u64,
    /// Heartbeats sent.
    pub heartbeats: u64,
    /// Successful reconnections after losing the broker.
    pub reconnects: u64,
}

/// The state of the link to the broker.
struct Link {
    /// The live transport; `None` while the session reconnects or after it ended.
    transport: Option<Arc<dyn Transport>>,
    /// Counts losses of the link: a request sent on an older generation may
    /// have missed the failing of pending requests and must fail itself.
    generation: u64,
    /// Why the session ended; requests fail at once with it.
    ended: Option<String>,
}

#[derive(Default)]
struct Counters {
    replies: AtomicU64,
    unmatched_replies: AtomicU64,
    events: AtomicU64,
    heartbeats: AtomicU64,
    reconnects: AtomicU64,
}

pub(crate) struct Shared {
    connector: Arc<dyn Connect>,
    options: Options,
    heartbeat: Duration,
    link: Mutex<Link>,
    /// Signalled when the link comes back or the session ends.
    link_changed: Condvar,
    pending: Mutex<HashMap<u64, Arc<Slot>>>,
    next_id: AtomicU64,
    stop: AtomicBool,
    /// The domain sent Leave: the broker closing the link is the end, not a
    /// restart to recover from.
    leaving: AtomicBool,
    started: AtomicBool,
    counters: Counters,
}

/// A registered session with the broker. Dropping it stops the reader thread
/// and closes the link (without a Leave: see [`Session::leave`]).
pub struct Session {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("broker", &self.shared.connector.address())
            .field("heartbeat", &self.shared.heartbeat)
            .finish_non_exhaustive()
    }
}

impl Session {
    /// Connects through `connector` and registers: sends `join` (a
    /// `Request::Join`) with `fds` and waits up to the request timeout for the
    /// broker's answer. The session then sends and receives nothing until
    /// [`start`](Session::start) runs its reader thread.
    pub fn join(connector: Arc<dyn Connect>, join: Request, fds: Vec<OwnedFd>, options: Options) -> Result<(Session, Joined)> {
        let transport = connector.connect()?;
        let joined = exchange_join(&*transport, &*connector, JOIN_ID, join, &fds, options.request_timeout, None)?;
        let shared = Arc::new(Shared {
            connector,
            options,
            heartbeat: joined.heartbeat,
            link: Mutex::new(Link { transport: Some(transport), generation: 0, ended: None }),
            link_changed: Condvar::new(),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(FIRST_REQUEST_ID),
            stop: AtomicBool::new(false),
            leaving: AtomicBool::new(false),
            started: AtomicBool::new(false),
            counters: Counters::default(),
        });
        Ok((Session { shared }, joined))
    }

    /// Starts the reader thread (named `thread_name`), which serves `handler`
    /// until the session stops or the handler is dropped. Only the first call
    /// starts one.
    pub fn start(&self, handler: Weak<dyn Handler>, thread_name: impl Into<String>) -> Result<()> {
        if self.shared.started.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let shared = self.shared.clone();
        std::thread::Builder::new().name(thread_name.into()).spawn(move || shared.run(handler))?;
        Ok(())
    }

    /// The heartbeat period the broker asked for.
    pub fn heartbeat(&self) -> Duration {
        self.shared.heartbeat
    }

    /// What the reader thread has seen so far.
    pub fn stats(&self) -> Stats {
        let c = &self.shared.counters;
        Stats {
            replies: c.replies.load(Ordering::Relaxed),
            unmatched_replies: c.unmatched_replies.load(Ordering::Relaxed),
            events: c.events.load(Ordering::Relaxed),
            heartbeats: c.heartbeats.load(Ordering::Relaxed),
            reconnects: c.reconnects.load(Ordering::Relaxed),
        }
    }

    /// Sends a request and waits for its reply, up to the request timeout
    /// (and first for the link, up to the link wait).
    pub fn request(&self, body: Request, fds: &[OwnedFd]) -> Answer {
        let o = &self.shared.options;
        let mut pending = self.shared.start_request(body, fds, o.link_wait.unwrap_or(o.request_timeout))?;
        pending.wait_timeout(o.request_timeout).unwrap_or(Err(ControlError::NoReply(o.request_timeout)))
    }

    /// Whether the link to the broker is up now (false while the session
    /// reconnects and after it ended).
    pub fn connected(&self) -> bool {
        self.shared.link.lock().transport.is_some()
    }

    /// Whether the session ended for good (stopped, or the broker refused
    /// to resume this domain): every request fails at once.
    pub fn ended(&self) -> bool {
        self.shared.link.lock().ended.is_some()
    }

    /// Sends a request and waits for its reply: up to `timeout` for the link
    /// (while the session reconnects), then up to `timeout` for the reply.
    pub fn request_timeout(&self, body: Request, fds: &[OwnedFd], timeout: Duration) -> Answer {
        let mut pending = self.shared.start_request(body, fds, timeout)?;
        pending.wait_timeout(timeout).unwrap_or(Err(ControlError::NoReply(timeout)))
    }

    /// Sends a request and returns at once; the answer comes through the
    /// [`Pending`], which waits as long as the caller likes.
    pub fn start_request(&self, body: Request, fds: &[OwnedFd]) -> Result<Pending> {
        let o = &self.shared.options;
        self.shared.start_request(body, fds, o.link_wait.unwrap_or(o.request_timeout))
    }

    /// Sends a request whose reply nobody wants. Best effort: nothing is sent
    /// while the link is down.
    pub fn notify(&self, body: Request) {
        let _ = self.notify_with(body, &[]);
    }

    /// Sends a request with descriptors whose reply nobody wants.
    pub fn notify_with(&self, body: Request, fds: &[OwnedFd]) -> Result<()> {
        let transport = self.shared.link.lock().transport.clone().ok_or_else(|| ControlError::Unavailable("not connected".into()))?;
        self.shared.send_on(&*transport, body, fds, false)
    }

    /// Leaves the broker: sends Leave, waits up to `wait` for its answer, then
    /// stops the session.
    pub fn leave(&self, wait: Duration) -> Result<()> {
        self.shared.leaving.store(true, Ordering::Relaxed);
        let answer = self.request_timeout(Request::Leave, &[], wait);
        self.stop();
        answer.map(|_| ())
    }

    /// Leaves without waiting for anything (for a `Drop`): sends Leave if it
    /// fits in the link now, then stops the session.
    pub fn leave_now(&self) {
        self.shared.leaving.store(true, Ordering::Relaxed);
        let transport = self.shared.link.lock().transport.clone();
        if let Some(t) = transport {
            let _ = self.shared.send_on(&*t, Request::Leave, &[], true);
        }
        self.stop();
    }

    /// Stops the session: closes the link, ends the reader thread, fails what
    /// is pending; later requests fail at once.
    pub fn stop(&self) {
        self.shared.end("session stopped");
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Shared {
    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// The live transport and its generation, waiting up to `wait` while the
    /// session reconnects.
    fn current(&self, wait: Duration) -> Result<(Arc<dyn Transport>, u64)> {
        let deadline = Instant::now() + wait;
        let mut link = self.link.lock();
        loop {
            if let Some(why) = &link.ended {
                return Err(ControlError::Unavailable(why.clone()));
            }
            if let Some(t) = &link.transport {
                return Ok((t.clone(), link.generation));
            }
            if self.link_changed.wait_until(&mut link, deadline).timed_out() {
                return Err(ControlError::Unavailable(format!("no broker at {}", self.connector.address())));
            }
        }
    }

    /// Encodes and sends one request (a Leave from a `Drop` without waiting for room).
    fn send_on(&self, transport: &dyn Transport, body: Request, fds: &[OwnedFd], without_waiting: bool) -> Result<()> {
        let frame = encode_request(transport, self.next_id(), body, fds)?;
        let sent = if without_waiting { transport.try_send(&frame, fds) } else { transport.send(&frame, fds) };
        sent.map_err(|e| ControlError::Unavailable(format!("sending to the broker: {e}")))
    }

    pub(crate) fn start_request(self: &Arc<Self>, body: Request, fds: &[OwnedFd], link_wait: Duration) -> Result<Pending> {
        let (transport, generation) = self.current(link_wait)?;
        let id = self.next_id();
        let frame = encode_request(&*transport, id, body, fds)?;
        let slot = Arc::new(Slot::default());
        self.pending.lock().insert(id, slot.clone());
        // From here on, dropping `pending` forgets the request.
        let pending = Pending { shared: self.clone(), id, slot };
        transport.send(&frame, fds).map_err(|e| ControlError::Unavailable(format!("sending to the broker: {e}")))?;
        // The link was lost after `current`: the reader may have failed the
        // pending requests before this one was in the table.
        if self.link.lock().generation != generation {
            pending.slot.fill(Err(ControlError::Lost("the link went down as the request was sent".into())));
        }
        Ok(pending)
    }

    /// Drops the slot of a request nobody waits for any more.
    pub(crate) fn forget(&self, id: u64) {
        self.pending.lock().remove(&id);
    }

    fn answer(&self, id: u64, body: Result<Reply, fido_proto::RemoteError>, fds: Vec<OwnedFd>) {
        let slot = self.pending.lock().remove(&id);
        match slot {
            Some(slot) => {
                self.counters.replies.fetch_add(1, Ordering::Relaxed);
                slot.fill(body.map(|r| (r, fds)).map_err(ControlError::Refused));
            }
            None => {
                self.counters.unmatched_replies.fetch_add(1, Ordering::Relaxed);
                tracing::trace!(id, "reply nobody waits for");
            }
        }
    }

    fn fail_pending(&self, why: &str) {
        let slots: Vec<Arc<Slot>> = self.pending.lock().drain().map(|(_, s)| s).collect();
        for slot in slots {
            slot.fill(Err(ControlError::Lost(why.to_string())));
        }
    }

    /// The link broke: no transport until a reconnection, and every request
    /// sent on it fails.
    fn lose(&self, why: &str) {
        {
            let mut link = self.link.lock();
            link.transport = None;
            link.generation += 1;
        }
        self.fail_pending(why);
    }

    /// Ends the session for good: closes the link and wakes everyone waiting for it.
    fn end(&self, why: &str) {
        self.stop.store(true, Ordering::Relaxed);
        let mut link = self.link.lock();
        link.ended.get_or_insert_with(|| why.to_string());
        link.generation += 1;
        if let Some(t) = link.transport.take() {
            t.shutdown();
        }
        self.link_changed.notify_all();
    }

    /// The reader thread. It holds the handler only while calling it, so
    /// dropping the owner's last handle ends the thread promptly.
    fn run(self: Arc<Self>, handler: Weak<dyn Handler>) {
        let mut buf = vec![0u8; fido_proto::MAX_MESSAGE];
        let mut last_beat = Instant::now();
        while !self.stopped() {
            let transport = self.link.lock().transport.clone();
            let Some(transport) = transport else {
                // The link was lost and reconnection is on.
                let Some(h) = handler.upgrade() else { break };
                self.reconnect(&*h);
                continue;
            };
            if last_beat.elapsed() >= self.heartbeat {
                if let Ok(frame) = fido_proto::encode(&ClientMsg::Heartbeat) {
                    // A failure shows up as a broken link on the next receive.
                    if transport.send(&frame, &[]).is_ok() {
                        self.counters.heartbeats.fetch_add(1, Ordering::Relaxed);
                    }
                }
                last_beat = Instant::now();
                let Some(h) = handler.upgrade() else { break };
                h.tick();
            }
            match receive(&*transport, &mut buf, self.heartbeat / 2) {
                Ok(None) => {
                    if handler.strong_count() == 0 {
                        break;
                    }
                }
                Ok(Some((BrokerMsg::Reply { id, body }, fds))) => self.answer(id, body, fds),
                Ok(Some((BrokerMsg::Event(event), fds))) => {
                    let Some(h) = handler.upgrade() else { break };
                    self.counters.events.fetch_add(1, Ordering::Relaxed);
                    h.event(event, fds);
                }
                Err(e) => {
                    if self.stopped() || self.leaving.load(Ordering::Relaxed) {
                        break;
                    }
                    let why = e.to_string();
                    self.lose(&why);
                    if self.options.reconnect.is_none() {
                        tracing::warn!("lost the broker: {why}");
                        self.end(&why);
                        break;
                    }
                    tracing::warn!("lost the broker ({why}); reconnecting");
                    let Some(h) = handler.upgrade() else { break };
                    self.reconnect(&*h);
                }
            }
        }
        self.end("session stopped");
        self.fail_pending("session stopped");
    }

    /// Reconnects and re-registers, retrying with back-off until it works, the
    /// broker refuses this domain for good, or the session stops.
    fn reconnect(&self, handler: &dyn Handler) {
        let backoff = self.options.reconnect.unwrap_or_default();
        let mut delay = backoff.first;
        while !self.stopped() {
            match self.try_rejoin(handler) {
                Ok(transport) => {
                    let mut link = self.link.lock();
                    if link.ended.is_some() {
                        transport.shutdown();
                        return;
                    }
                    link.transport = Some(transport);
                    self.link_changed.notify_all();
                    self.counters.reconnects.fetch_add(1, Ordering::Relaxed);
                    tracing::info!("re-registered with the broker");
                    return;
                }
                Err(ControlError::Refused(e)) if matches!(e.code, ErrorCode::Denied | ErrorCode::AlreadyJoined) => {
                    // The new broker knows this domain is dead (it missed its
                    // heartbeats) or someone holds its id: stop retrying.
                    // Established channels keep working peer to peer.
                    tracing::error!("broker refused to resume this domain: {e}");
                    self.end(&format!("broker refused to resume this domain: {e}"));
                    return;
                }
                Err(e) => {
                    tracing::debug!("broker not back yet: {e}");
                    let mut link = self.link.lock();
                    if link.ended.is_none() {
                        self.link_changed.wait_for(&mut link, delay);
                    }
                    delay = (delay * 2).min(backoff.max);
                }
            }
        }
    }

    fn try_rejoin(&self, handler: &dyn Handler) -> Result<Arc<dyn Transport>> {
        let transport = self.connector.connect()?;
        let (join, fds) = handler.rejoin()?;
        exchange_join(&*transport, &*self.connector, self.next_id(), join, &fds, self.options.request_timeout, Some(handler))?;
        Ok(transport)
    }
}

/// Encodes a request, refusing descriptors the transport cannot carry.
fn encode_request(transport: &dyn Transport, id: u64, body: Request, fds: &[OwnedFd]) -> Result<Vec<u8>> {
    if !fds.is_empty() && !transport.passes_fds() {
        return Err(ControlError::FdsNotSupported { count: fds.len() });
    }
    fido_proto::encode(&ClientMsg::Request { id, body }).map_err(ControlError::Encode)
}

/// Waits up to `timeout` for one message. A closed link, a receive error or a
/// message that cannot be trusted are all a lost link (`Err`).
fn receive(transport: &dyn Transport, buf: &mut [u8], timeout: Duration) -> Result<Option<(BrokerMsg, Vec<OwnedFd>)>> {
    match transport.recv(buf, Some(timeout)) {
        Ok(Received::Idle) => Ok(None),
        Ok(Received::Closed) => Err(ControlError::Unavailable("broker closed the connection".into())),
        Ok(Received::Frame { truncated: true, .. }) => Err(ProtocolError::Truncated.into()),
        Ok(Received::Frame { len, fds, truncated: false }) => {
            let msg = fido_proto::decode::<BrokerMsg>(&buf[..len.min(buf.len())]).map_err(ProtocolError::Undecodable)?;
            Ok(Some((msg, fds)))
        }
        Err(e) => Err(ControlError::Unavailable(format!("receiving from the broker: {e}"))),
    }
}

/// Sends a Join as request `id` on a fresh transport and waits for its answer;
/// events that arrive meanwhile go to `handler` (when there is one).
fn exchange_join(
    transport: &dyn Transport,
    connector: &dyn Connect,
    id: u64,
    join: Request,
    fds: &[OwnedFd],
    timeout: Duration,
    handler: Option<&dyn Handler>,
) -> Result<Joined> {
    let frame = encode_request(transport, id, join, fds)?;
    transport.send(&frame, fds).map_err(|e| ControlError::Unavailable(format!("{}: {e}", connector.address())))?;
    let deadline = Instant::now() + timeout;
    let mut buf = vec![0u8; fido_proto::MAX_MESSAGE];
    while Instant::now() < deadline {
        match receive(transport, &mut buf, JOIN_POLL)? {
            Some((BrokerMsg::Reply { id: rid, body }, _)) if rid == id => {
                return match body {
                    Ok(Reply::Joined { domain, slot, geometry, heartbeat_ms, resume_secret }) => Ok(Joined {
                        domain,
                        slot,
                        geometry,
                        heartbeat: Duration::from_millis(heartbeat_ms.clamp(10, 60_000)),
                        resume_secret,
                    }),
                    Ok(other) => Err(ProtocolError::UnexpectedReply { request: "Join", reply: format!("{other:?}") }.into()),
                    Err(e) => Err(ControlError::Refused(e)),
                };
            }
            Some((BrokerMsg::Event(event), fds)) => {
                if let Some(h) = handler {
                    h.event(event, fds);
                }
            }
            _ => {}
        }
    }
    Err(ControlError::Unavailable(format!("no answer to Join from {} within {timeout:?}", connector.address())))
}
