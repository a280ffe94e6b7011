//! The epoll loop and the sockets: accepting clients (with their
//! credentials), receiving messages with descriptors, sending replies and
//! events (queued, bounded, for a client whose socket is full), and dooming
//! and reaping clients that went away.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use fido_proto::{
    BrokerMsg, ClientMsg, DomainId, ErrorCode, Event, GoneReason, RemoteError, Reply, Request,
};
use fido_registry::WatchEvent;
use rustix::event::epoll;
use rustix::io::Errno;
use rustix::net::SocketFlags;

use crate::sys::Recv;
use crate::{sys, BrokerError};

use super::{
    err, internal, Client, Outgoing, Server, KEY_LISTENER, KEY_PIPE, KEY_RELOAD, KEY_SHUTDOWN,
    MAX_BATCH, MAX_QUEUED_BYTES, MAX_QUEUED_MSGS, MAX_REPLY,
};

/// Unjoined connections one uid may hold at once: enough for a program
/// starting many domains together, too few to fill the broker's descriptor
/// table. Over it, a new connection is closed at once.
const MAX_UNJOINED_PER_UID: usize = 64;
/// Connections accepted per wake-up of the listener.
const MAX_ACCEPT_BATCH: usize = 64;
/// How long the listener rests when accepting fails for want of descriptors
/// or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM), instead of failing again at
/// once in a loop.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// How long a connection of a uid no rule admits may stay without sending
/// its (refused) first request.
pub(super) const REFUSED_DEADLINE: Duration = Duration::from_secs(2);
/// At most one warning per this long about failing accepts (the rest are counted).
const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(5);

/// The broker's clock for judging silence. It follows real time while the
/// loop turns, but moves at most `max_step` per turn: time the broker spent
/// stopped (SIGSTOP), descheduled or busy in one long operation was time it
/// read nobody's heartbeats, and is not held against any client.
pub(super) struct AwakeClock {
    now: Duration,
    last: Instant,
    max_step: Duration,
}

impl AwakeClock {
    fn new(max_step: Duration) -> AwakeClock {
        AwakeClock {
            now: Duration::ZERO,
            last: Instant::now(),
            max_step,
        }
    }

    /// Moves the clock on by the real time since the last call, capped.
    fn advance(&mut self) {
        let real = Instant::now();
        let step = real.saturating_duration_since(self.last);
        if step > self.max_step {
            tracing::info!(
                stalled_ms = step.as_millis() as u64,
                "the broker did not run for a while; that time is not held against clients"
            );
        }
        self.now += step.min(self.max_step);
        self.last = real;
    }

    pub(super) fn now(&self) -> Duration {
        self.now
    }

    /// Moves the clock on by `d` of awake time at once: the fuzz harness's
    /// way of letting time pass without sleeping.
    #[cfg(feature = "fuzz-hooks")]
    pub(super) fn skip(&mut self, d: Duration) {
        self.now += d;
    }
}

/// Admission of connections: the awake clock, unjoined connections per uid,
/// and the listener's back-off after failed accepts.
pub(super) struct Intake {
    pub(super) clock: AwakeClock,
    /// Unjoined connections per uid. Counted up on accept and down when an
    /// unjoined client goes; a join does not count it down, so it may run
    /// high: at the cap it is recounted before anyone is turned away.
    unjoined: HashMap<u32, usize>,
    /// While set, the listener is out of the epoll set until then.
    paused_until: Option<Instant>,
    last_warning: Option<Instant>,
    unwarned_failures: u64,
}

impl Intake {
    pub(super) fn new() -> Intake {
        Intake {
            // Set for real by `run`, from the heartbeat.
            clock: AwakeClock::new(Duration::from_secs(1)),
            unjoined: HashMap::new(),
            paused_until: None,
            last_warning: None,
            unwarned_failures: 0,
        }
    }
}

impl Server {
    pub(crate) fn run(mut self) -> Result<(), BrokerError> {
        let tick = self.cfg.heartbeat.min(Duration::from_secs(1));
        // A turn of the loop waits at most `tick`; allow as much again for
        // the work of the turn before the awake clock stops following.
        self.intake.clock = AwakeClock::new(tick * 2);
        let mut next_tick = Instant::now() + tick;
        let mut events: Vec<epoll::Event> = Vec::with_capacity(64);
        loop {
            self.intake.clock.advance();
            let now = Instant::now();
            if now >= next_tick {
                self.tick(now);
                self.reap();
                next_tick = now + tick;
            }
            let mut wake = next_tick;
            if let Some(until) = self.intake.paused_until {
                if now >= until {
                    self.resume_listener();
                } else {
                    wake = wake.min(until);
                }
            }
            let wait = wake.saturating_duration_since(now);
            let timeout = rustix::event::Timespec {
                tv_sec: wait.as_secs() as _,
                tv_nsec: wait.subsec_nanos() as _,
            };
            events.clear();
            match epoll::wait(
                &self.epoll,
                rustix::buffer::spare_capacity(&mut events),
                Some(&timeout),
            ) {
                Ok(_) => {}
                Err(Errno::INTR) => continue,
                Err(source) => {
                    return Err(BrokerError::Sys {
                        what: "epoll_wait",
                        source,
                    })
                }
            }
            for ev in events.iter().copied() {
                let data = ev.data;
                let flags = ev.flags;
                match data.u64() {
                    KEY_LISTENER => self.accept_all(),
                    KEY_SHUTDOWN => {
                        let mut b = [0u8; 8];
                        let _ = rustix::io::read(self.shutdown.as_fd(), &mut b);
                        tracing::info!(domains = self.domains.len(), "broker shutting down");
                        return Ok(());
                    }
                    KEY_RELOAD => self.reload_requested(),
                    KEY_PIPE => self.pipe_completions(),
                    key => self.client_ready(key, flags),
                }
                self.reap();
            }
        }
    }

    fn accept_all(&mut self) {
        // Bounded, so a storm of connections cannot keep the loop from its
        // clients (the listener, level-triggered, reports the rest next turn).
        for _ in 0..MAX_ACCEPT_BATCH {
            if self.intake.paused_until.is_some() {
                return;
            }
            let sock = match rustix::net::accept_with(
                &self.listener,
                SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            ) {
                Ok(s) => s,
                Err(Errno::AGAIN) => return,
                Err(Errno::INTR) | Err(Errno::CONNABORTED) => continue,
                Err(e @ (Errno::MFILE | Errno::NFILE | Errno::NOBUFS | Errno::NOMEM)) => {
                    self.pause_listener(e);
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    return;
                }
            };
            let cred = match rustix::net::sockopt::socket_peercred(&sock) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "SO_PEERCRED failed; dropping connection");
                    continue;
                }
            };
            let (pid, uid, gid) = (
                cred.pid.as_raw_nonzero().get(),
                cred.uid.as_raw(),
                cred.gid.as_raw(),
            );
            // The socket's mode lets everyone connect; the policy decides who
            // may do anything. Someone no rule could ever admit is only told
            // so: its first request is answered `Denied` and it is closed (or
            // closed after REFUSED_DEADLINE if it sends none).
            let refused = !self.may_ever_join(uid, gid);
            if !self.unjoined_below_cap(uid) {
                tracing::debug!(
                    pid,
                    uid,
                    "too many unjoined connections of this uid; connection closed"
                );
                continue;
            }
            // Big enough for any control message as one datagram (the kernel caps it).
            let _ = rustix::net::sockopt::set_socket_send_buffer_size(&sock, 1 << 20);
            let key = self.next_key;
            self.next_key += 1;
            if let Err(e) = epoll::add(
                &self.epoll,
                &sock,
                epoll::EventData::new_u64(key),
                epoll::EventFlags::IN,
            ) {
                tracing::warn!(error = %e, "epoll_ctl failed; dropping connection");
                continue;
            }
            let now = self.intake.clock.now();
            let client = Client::accepted(sock, (pid, uid, gid), now, refused);
            *self.intake.unjoined.entry(uid).or_default() += 1;
            tracing::debug!(pid, uid, gid, refused, "client connected");
            self.clients.insert(key, client);
        }
    }

    /// Could any rule of the policy admit this uid (with some label)?
    pub(super) fn may_ever_join(&self, uid: u32, gid: u32) -> bool {
        self.rules.iter().any(|r| {
            r.join
                && (r.uids.is_empty() || r.uids.contains(&uid))
                && (r.gids.is_empty() || r.gids.contains(&gid))
        })
    }

    /// A message from a client no rule admits: a request is answered
    /// `Denied` (saying why, as a refused join is); then the client is closed.
    fn answer_refused(&mut self, key: u64, bytes: &[u8]) {
        let Some(c) = self.clients.get(&key) else {
            return;
        };
        let (pid, uid, gid) = (c.pid, c.uid, c.gid);
        if let Ok(ClientMsg::Request { id, body }) = fido_proto::decode::<ClientMsg>(bytes) {
            let label = match body {
                Request::Join { label, .. } => label,
                _ => None,
            };
            // The same words as a join the policy refuses.
            let reason = match self.cfg.policy.decide(uid, gid, label.as_deref()) {
                Err(crate::policy::JoinDenied::Forbidden(rule)) => {
                    format!("rule {rule} says join = false")
                }
                _ => "no rule matches".to_string(),
            };
            let msg = format!(
                "uid {uid} (gid {gid}, label {label:?}) may not join: {reason} (policy {})",
                self.cfg.policy.source
            );
            tracing::warn!(pid, uid, gid, "denied: {msg}");
            self.reply(key, id, Err(err(ErrorCode::Denied, msg)), Vec::new());
        }
        self.doom(key, GoneReason::Exited);
    }

    /// May `uid` hold one more unjoined connection?
    fn unjoined_below_cap(&mut self, uid: u32) -> bool {
        let counted = self.intake.unjoined.get(&uid).copied().unwrap_or(0);
        if counted < MAX_UNJOINED_PER_UID {
            return true;
        }
        let exact = self
            .clients
            .values()
            .filter(|c| c.uid == uid && c.domain.is_none() && !c.doomed)
            .count();
        self.intake.unjoined.insert(uid, exact);
        exact < MAX_UNJOINED_PER_UID
    }

    /// Accepting failed for want of descriptors or memory: take the listener
    /// out of the epoll set for [`ACCEPT_BACKOFF`] (connections wait in its
    /// backlog meanwhile) and warn, at most every [`ACCEPT_WARN_EVERY`].
    fn pause_listener(&mut self, e: Errno) {
        let now = Instant::now();
        let _ = epoll::delete(&self.epoll, &self.listener);
        self.intake.paused_until = Some(now + ACCEPT_BACKOFF);
        let intake = &mut self.intake;
        if intake
            .last_warning
            .is_none_or(|t| now.duration_since(t) >= ACCEPT_WARN_EVERY)
        {
            tracing::warn!(error = %e, clients = self.clients.len(),
                failures_since_last_warning = intake.unwarned_failures,
                "accept failed; not accepting for {} ms", ACCEPT_BACKOFF.as_millis());
            intake.last_warning = Some(now);
            intake.unwarned_failures = 0;
        } else {
            intake.unwarned_failures += 1;
        }
    }

    fn resume_listener(&mut self) {
        self.intake.paused_until = None;
        if let Err(e) = epoll::add(
            &self.epoll,
            &self.listener,
            epoll::EventData::new_u64(KEY_LISTENER),
            epoll::EventFlags::IN,
        ) {
            tracing::warn!(error = %e, "could not watch the listener again; retrying later");
            self.intake.paused_until = Some(Instant::now() + ACCEPT_BACKOFF);
        }
    }

    pub(super) fn client_ready(&mut self, key: u64, flags: epoll::EventFlags) {
        if flags.contains(epoll::EventFlags::OUT) {
            self.flush(key);
        }
        if !flags
            .intersects(epoll::EventFlags::IN | epoll::EventFlags::HUP | epoll::EventFlags::ERR)
        {
            return;
        }
        for _ in 0..MAX_BATCH {
            let Some(c) = self.clients.get_mut(&key) else {
                return;
            };
            if c.doomed {
                return;
            }
            match sys::recv(c.sock.as_fd(), &mut self.buf) {
                Ok(Recv::WouldBlock) => return,
                Ok(Recv::Eof) => {
                    self.doom(key, GoneReason::Exited);
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "client socket error");
                    self.doom(key, GoneReason::Exited);
                    return;
                }
                Ok(Recv::Msg {
                    len,
                    fds,
                    truncated,
                }) => {
                    if c.refused {
                        drop(fds);
                        let bytes = self.buf[..len].to_vec();
                        self.answer_refused(key, &bytes);
                        return;
                    }
                    c.last_seen = self.intake.clock.now();
                    let bytes = self.buf[..len].to_vec();
                    self.message(key, &bytes, fds, truncated);
                }
            }
        }
    }

    pub(super) fn doom(&mut self, key: u64, reason: GoneReason) {
        if let Some(c) = self.clients.get_mut(&key) {
            if !c.doomed {
                c.doomed = true;
                self.doomed.push((key, reason));
            }
        }
    }

    /// Tears down every doomed client (which may doom others: loop until none).
    pub(super) fn reap(&mut self) {
        while let Some((key, reason)) = self.doomed.pop() {
            let Some(c) = self.clients.remove(&key) else {
                continue;
            };
            let _ = epoll::delete(&self.epoll, &c.sock);
            match c.domain {
                Some(id) => self.domain_death(id, reason),
                None => {
                    if let Some(n) = self.intake.unjoined.get_mut(&c.uid) {
                        *n = n.saturating_sub(1);
                        if *n == 0 {
                            self.intake.unjoined.remove(&c.uid);
                        }
                    }
                    tracing::debug!(pid = c.pid, "unjoined client disconnected")
                }
            }
            // Dropping `c` closes the socket.
        }
    }

    pub(super) fn send(&mut self, key: u64, msg: &BrokerMsg, fds: Vec<OwnedFd>) {
        let bytes = match fido_proto::encode(msg) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "could not encode a broker message");
                return;
            }
        };
        let Some(c) = self.clients.get_mut(&key) else {
            return;
        };
        if c.doomed {
            return;
        }
        if c.queue.is_empty() {
            match sys::send(c.sock.as_fd(), &bytes, &fds) {
                Ok(()) => return,
                Err(Errno::AGAIN) => {}
                Err(e) => {
                    tracing::debug!(error = %e, pid = c.pid, "send to client failed");
                    c.doomed = true;
                    self.doomed.push((key, GoneReason::Exited));
                    return;
                }
            }
        }
        if c.queue.len() >= MAX_QUEUED_MSGS || c.queued_bytes + bytes.len() > MAX_QUEUED_BYTES {
            tracing::warn!(pid = c.pid, domain = ?c.domain, "client does not read its socket; dropping it");
            c.doomed = true;
            self.doomed.push((key, GoneReason::Exited));
            return;
        }
        c.queued_bytes += bytes.len();
        c.queue.push_back(Outgoing { bytes, fds });
        if !c.want_out {
            c.want_out = true;
            let _ = epoll::modify(
                &self.epoll,
                &c.sock,
                epoll::EventData::new_u64(key),
                epoll::EventFlags::IN | epoll::EventFlags::OUT,
            );
        }
    }

    fn flush(&mut self, key: u64) {
        let Some(c) = self.clients.get_mut(&key) else {
            return;
        };
        while let Some(front) = c.queue.front() {
            if c.doomed {
                return;
            }
            match sys::send(c.sock.as_fd(), &front.bytes, &front.fds) {
                Ok(()) => {
                    c.queued_bytes -= front.bytes.len();
                    c.queue.pop_front();
                }
                Err(Errno::AGAIN) => return,
                Err(_) => {
                    c.doomed = true;
                    self.doomed.push((key, GoneReason::Exited));
                    return;
                }
            }
        }
        if c.want_out {
            c.want_out = false;
            let _ = epoll::modify(
                &self.epoll,
                &c.sock,
                epoll::EventData::new_u64(key),
                epoll::EventFlags::IN,
            );
        }
    }

    pub(super) fn reply(
        &mut self,
        key: u64,
        id: u64,
        body: Result<Reply, RemoteError>,
        fds: Vec<OwnedFd>,
    ) {
        let msg = BrokerMsg::Reply { id, body };
        let size = fido_proto::encode(&msg).map(|b| b.len());
        match size {
            Ok(n) if n <= MAX_REPLY => self.send(key, &msg, fds),
            Ok(n) => {
                let e = internal("reply too large", format!("{n} bytes; narrow the request"));
                self.send(key, &BrokerMsg::Reply { id, body: Err(e) }, Vec::new())
            }
            Err(e) => {
                let e = internal("could not encode reply", e);
                self.send(key, &BrokerMsg::Reply { id, body: Err(e) }, Vec::new())
            }
        }
    }

    pub(super) fn send_event(&mut self, domain: DomainId, event: Event, fds: Vec<OwnedFd>) {
        if let Some(key) = self.domains.get(&domain).map(|d| d.client) {
            self.send(key, &BrokerMsg::Event(event), fds);
        }
    }

    pub(super) fn reply_to_domain(
        &mut self,
        dom: DomainId,
        id: u64,
        body: Result<Reply, RemoteError>,
        fds: Vec<OwnedFd>,
    ) {
        if let Some(key) = self.domains.get(&dom).map(|d| d.client) {
            self.reply(key, id, body, fds);
        }
    }

    pub(super) fn deliver(&mut self, events: Vec<WatchEvent>) {
        for e in events {
            self.send_event(
                e.owner,
                Event::Watch {
                    token: e.token,
                    path: e.path,
                    value: e.value,
                },
                Vec::new(),
            );
        }
    }

    /// Sends the events that had to wait for the reply under way.
    pub(super) fn send_after_reply(&mut self) {
        for (dom, event) in std::mem::take(&mut self.after_reply) {
            self.send_event(dom, event, Vec::new());
        }
    }
}
