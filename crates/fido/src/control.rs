//! The domain's line to the broker: requests and replies, events, heartbeats,
//! and re-registration when the broker restarts.
//!
//! One background thread owns the receiving side of the socket. Callers send a
//! request and wait on a one-shot channel for the reply with the same id. When
//! the socket reaches EOF (the broker died or restarted) the thread fails the
//! pending requests, reconnects with back-off and re-registers the domain with
//! everything it had (id, slot, services, mappings, connections, watches), so
//! established connections — which never touch the broker — go on unharmed.

use crate::error::{Error, InvalidArgument, Result};
use fido_proto::{wire, BrokerMsg, ClientMsg, Event, Reply, Request, RemoteError, ErrorCode};
use parking_lot::Mutex;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// How long a request waits for its reply (a restarting broker included).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

type ReplySlot = mpsc::SyncSender<(Result<Reply, RemoteError>, Vec<OwnedFd>)>;

/// Connects a SEQPACKET socket to the broker.
pub(crate) fn connect_socket(path: &Path) -> Result<OwnedFd> {
    let sock = rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
    let addr = SocketAddrUnix::new(path).map_err(|e| InvalidArgument::BrokerPath { path: path.to_path_buf(), why: e.to_string() })?;
    rustix::net::connect(&sock, &addr)
        .map_err(|e| Error::BrokerUnavailable(format!("{}: {}", path.display(), std::io::Error::from(e))))?;
    Ok(sock)
}

/// Receives one message, blocking up to `timeout`.
/// `buf` is the caller's reusable receive buffer (grown to the largest
/// control message once).
pub(crate) fn recv_msg(sock: &OwnedFd, buf: &mut Vec<u8>, timeout: Option<Duration>) -> Result<Option<(BrokerMsg, Vec<OwnedFd>)>> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let ts = timeout.map(|t| Timespec { tv_sec: t.as_secs() as i64, tv_nsec: t.subsec_nanos() as i64 });
    let mut fds = [PollFd::new(sock, PollFlags::IN)];
    match poll(&mut fds, ts.as_ref()) {
        Ok(0) => return Ok(None),
        Ok(_) => {}
        Err(rustix::io::Errno::INTR) => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    buf.resize(fido_proto::MAX_MESSAGE, 0);
    match wire::recv(sock.as_fd(), buf)? {
        wire::Recv::Eof => Err(Error::BrokerUnavailable("broker closed the connection".into())),
        wire::Recv::WouldBlock => Ok(None),
        wire::Recv::Msg { len, fds, truncated } => {
            if truncated {
                return Err(Error::broker_protocol("truncated control message from broker"));
            }
            let msg = fido_proto::decode::<BrokerMsg>(&buf[..len]).map_err(Error::broker_protocol)?;
            Ok(Some((msg, fds)))
        }
    }
}

pub(crate) fn send_msg(sock: &OwnedFd, msg: &ClientMsg, fds: &[OwnedFd]) -> Result<()> {
    let bytes = fido_proto::encode(msg).map_err(|e| InvalidArgument::Request(e.to_string()))?;
    wire::send_blocking(sock.as_fd(), &bytes, fds)
        .map_err(|e| Error::BrokerUnavailable(std::io::Error::from(e).to_string()))
}

/// What the control thread needs from the domain.
pub(crate) trait EventSink: Send + Sync + 'static {
    fn event(&self, event: Event, fds: Vec<OwnedFd>);
    /// Builds the Join request used to re-register after a broker restart, and
    /// the arena descriptor that goes with it.
    fn resume_request(&self) -> Result<(Request, OwnedFd)>;
    /// Periodic housekeeping on the control thread (lingering connections,
    /// unmapping dead peers' arenas).
    fn tick(&self);
}

pub(crate) struct Control {
    path: PathBuf,
    sock: Mutex<Option<Arc<OwnedFd>>>,
    pending: Mutex<HashMap<u64, ReplySlot>>,
    next_id: AtomicU64,
    pub(crate) heartbeat: Duration,
    stop: AtomicBool,
    leaving: AtomicBool,
    reconnected: parking_lot::Condvar,
    reconnected_lock: Mutex<()>,
}

impl Control {
    pub(crate) fn new(path: PathBuf, sock: OwnedFd, heartbeat: Duration) -> Arc<Control> {
        Arc::new(Control {
            path,
            sock: Mutex::new(Some(Arc::new(sock))),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1 << 20),
            heartbeat,
            stop: AtomicBool::new(false),
            leaving: AtomicBool::new(false),
            reconnected: parking_lot::Condvar::new(),
            reconnected_lock: Mutex::new(()),
        })
    }

    fn current(&self, wait: Duration) -> Result<Arc<OwnedFd>> {
        let deadline = Instant::now() + wait;
        let mut guard = self.reconnected_lock.lock();
        loop {
            if let Some(s) = self.sock.lock().clone() {
                return Ok(s);
            }
            if self.stop.load(Ordering::Relaxed) {
                return Err(Error::BrokerUnavailable("domain is shutting down".into()));
            }
            if self.reconnected.wait_until(&mut guard, deadline).timed_out() {
                return Err(Error::BrokerUnavailable(format!("no broker at {}", self.path.display())));
            }
        }
    }

    /// Sends a request and waits for its reply.
    pub(crate) fn request(&self, body: Request, fds: &[OwnedFd]) -> Result<(Reply, Vec<OwnedFd>)> {
        self.request_timeout(body, fds, REQUEST_TIMEOUT)
    }

    pub(crate) fn request_timeout(&self, body: Request, fds: &[OwnedFd], timeout: Duration) -> Result<(Reply, Vec<OwnedFd>)> {
        let sock = self.current(timeout)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::sync_channel(1);
        self.pending.lock().insert(id, tx);
        if let Err(e) = send_msg(&sock, &ClientMsg::Request { id, body }, fds) {
            self.pending.lock().remove(&id);
            return Err(e);
        }
        match rx.recv_timeout(timeout) {
            Ok((Ok(reply), fds)) => Ok((reply, fds)),
            Ok((Err(e), _)) => Err(Error::Broker(e)),
            Err(_) => {
                self.pending.lock().remove(&id);
                Err(Error::BrokerUnavailable("no reply from broker".into()))
            }
        }
    }

    /// Sends a request without waiting for (or caring about) the reply.
    pub(crate) fn notify(&self, body: Request) {
        if let Some(sock) = self.sock.lock().clone() {
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let _ = send_msg(&sock, &ClientMsg::Request { id, body }, &[]);
        }
    }

    /// Sends a request with descriptors without waiting for the reply.
    pub(crate) fn notify_with(&self, body: Request, fds: &[OwnedFd]) -> Result<()> {
        let sock = self.sock.lock().clone().ok_or_else(|| Error::BrokerUnavailable("not connected".into()))?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        send_msg(&sock, &ClientMsg::Request { id, body }, fds)
    }

    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(s) = self.sock.lock().take() {
            let _ = rustix::net::shutdown(&*s, rustix::net::Shutdown::Both);
        }
        self.reconnected.notify_all();
    }

    fn fail_pending(&self, why: &str) {
        for (_, slot) in self.pending.lock().drain() {
            let _ = slot.try_send((Err(RemoteError::new(ErrorCode::Unavailable, why)), vec![]));
        }
    }

    /// The control thread's body. It holds the domain only while handling a
    /// message or a tick, so dropping the last handle stops it promptly.
    pub(crate) fn run(self: Arc<Self>, sink: std::sync::Weak<dyn EventSink>) {
        let mut last_beat = Instant::now();
        let mut buf = Vec::new();
        while !self.stop.load(Ordering::Relaxed) {
            let sock = match self.sock.lock().clone() {
                Some(s) => s,
                None => {
                    let Some(strong) = sink.upgrade() else { break };
                    self.reconnect_with(&*strong);
                    continue;
                }
            };
            if last_beat.elapsed() >= self.heartbeat {
                let _ = send_msg(&sock, &ClientMsg::Heartbeat, &[]);
                last_beat = Instant::now();
                let Some(strong) = sink.upgrade() else { break };
                strong.tick();
            }
            match recv_msg(&sock, &mut buf, Some(self.heartbeat / 2)) {
                Ok(None) => {
                    if sink.strong_count() == 0 {
                        break;
                    }
                }
                Ok(Some((BrokerMsg::Reply { id, body }, fds))) => {
                    if let Some(slot) = self.pending.lock().remove(&id) {
                        let _ = slot.try_send((body, fds));
                    }
                }
                Ok(Some((BrokerMsg::Event(ev), fds))) => {
                    let Some(strong) = sink.upgrade() else { break };
                    strong.event(ev, fds);
                }
                Err(e) => {
                    if self.stop.load(Ordering::Relaxed) || self.leaving.load(Ordering::Relaxed) {
                        break;
                    }
                    tracing::warn!("lost the broker ({e}); reconnecting");
                    *self.sock.lock() = None;
                    self.fail_pending("broker connection lost");
                    let Some(strong) = sink.upgrade() else { break };
                    self.reconnect_with(&*strong);
                }
            }
        }
        self.fail_pending("domain stopped");
    }

    /// Marks the domain as leaving: the broker closing the socket after our
    /// `Leave` is then the end, not a broker restart to recover from.
    pub(crate) fn set_leaving(&self) {
        self.leaving.store(true, Ordering::Relaxed);
    }

    /// Reconnects and re-registers, retrying with back-off until it works or
    /// the domain stops.
    fn reconnect_with(&self, sink: &dyn EventSink) {
        let mut delay = Duration::from_millis(20);
        while !self.stop.load(Ordering::Relaxed) {
            match self.try_resume(sink) {
                Ok(sock) => {
                    *self.sock.lock() = Some(Arc::new(sock));
                    let _g = self.reconnected_lock.lock();
                    self.reconnected.notify_all();
                    tracing::info!("re-registered with the broker");
                    return;
                }
                Err(Error::Broker(e)) if matches!(e.code, ErrorCode::Denied | ErrorCode::AlreadyJoined) => {
                    // The new broker knows this domain is dead (it missed its
                    // heartbeats) or someone holds its id: stop retrying.
                    // Established channels keep working peer to peer.
                    tracing::error!("broker refused to resume this domain: {e}");
                    self.stop.store(true, Ordering::Relaxed);
                    self.reconnected.notify_all();
                    return;
                }
                Err(e) => {
                    tracing::debug!("broker not back yet: {e}");
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(Duration::from_millis(500));
                }
            }
        }
    }

    fn try_resume(&self, sink: &dyn EventSink) -> Result<OwnedFd> {
        let sock = connect_socket(&self.path)?;
        let (join, arena_fd) = sink.resume_request()?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        send_msg(&sock, &ClientMsg::Request { id, body: join }, &[arena_fd])?;
        let deadline = Instant::now() + REQUEST_TIMEOUT;
        let mut buf = Vec::new();
        while Instant::now() < deadline {
            match recv_msg(&sock, &mut buf, Some(Duration::from_millis(200)))? {
                Some((BrokerMsg::Reply { id: rid, body }, _)) if rid == id => {
                    return match body {
                        Ok(Reply::Joined { .. }) => Ok(sock),
                        Ok(other) => Err(Error::broker_protocol(format!("unexpected resume reply {other:?}"))),
                        Err(e) => Err(Error::Broker(e)),
                    };
                }
                Some((BrokerMsg::Event(ev), fds)) => sink.event(ev, fds),
                _ => {}
            }
        }
        Err(Error::BrokerUnavailable("resume timed out".into()))
    }
}
