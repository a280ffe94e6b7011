//! The epoll loop and the sockets: accepting clients (with their
//! credentials), receiving messages with descriptors, sending replies and
//! events (queued, bounded, for a client whose socket is full), and dooming
//! and reaping clients that went away.

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use fido_proto::{BrokerMsg, DomainId, Event, GoneReason, RemoteError, Reply};
use fido_registry::WatchEvent;
use rustix::event::epoll;
use rustix::io::Errno;
use rustix::net::SocketFlags;

use crate::sys::Recv;
use crate::{sys, BrokerError};

use super::{
    internal, Client, Outgoing, Server, KEY_LISTENER, KEY_PIPE, KEY_RELOAD, KEY_SHUTDOWN,
    MAX_BATCH, MAX_QUEUED_BYTES, MAX_QUEUED_MSGS, MAX_REPLY,
};

impl Server {
    pub(crate) fn run(mut self) -> Result<(), BrokerError> {
        let tick = self.cfg.heartbeat.min(Duration::from_secs(1));
        let mut next_tick = Instant::now() + tick;
        let mut events: Vec<epoll::Event> = Vec::with_capacity(64);
        loop {
            let now = Instant::now();
            if now >= next_tick {
                self.tick(now);
                self.reap();
                next_tick = now + tick;
            }
            let wait = next_tick.saturating_duration_since(now);
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
        loop {
            let sock = match rustix::net::accept_with(
                &self.listener,
                SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            ) {
                Ok(s) => s,
                Err(Errno::AGAIN) => return,
                Err(Errno::INTR) | Err(Errno::CONNABORTED) => continue,
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
            let client = Client {
                sock,
                pid: cred.pid.as_raw_nonzero().get(),
                uid: cred.uid.as_raw(),
                gid: cred.gid.as_raw(),
                domain: None,
                last_seen: Instant::now(),
                queue: VecDeque::new(),
                queued_bytes: 0,
                want_out: false,
                doomed: false,
            };
            tracing::debug!(
                pid = client.pid,
                uid = client.uid,
                gid = client.gid,
                "client connected"
            );
            self.clients.insert(key, client);
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
                    c.last_seen = Instant::now();
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
                None => tracing::debug!(pid = c.pid, "unjoined client disconnected"),
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
