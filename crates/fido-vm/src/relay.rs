//! The relay between a guest's link and the broker: the broker protocol
//! passes through unchanged, and every descriptor is translated.
//!
//! Guest → broker: a `Join` gets the VM's own arena (read-only, sealed) and
//! the VM's name as its label, whatever the guest asked; a `Connect` or
//! `Accept` gets, for each MSI-X vector the guest names, the host ring end of
//! that vector; requests that would carry a host descriptor (sockets, files)
//! are refused here. Broker → guest: a peer's arena is hot-plugged read-only
//! and becomes [`Handle::Arena`]; a peer's doorbell ring end is given to QEMU
//! as an ivshmem peer and becomes [`Handle::Ring`]; a liveness socket stays
//! here, watched, and becomes [`Handle::Liveness`].
//!
//! Everything the guest sends is hostile input: a bad link message ends the
//! link (the stream cannot be resynchronised), a bad request is answered
//! with the broker's own error shape, and no guest message makes the relay
//! block on anything but its own devices. The relay never touches the data
//! path: no payload byte and no doorbell passes through it.

use fido_proto::guest::{self as link, GuestMsg, Handle, HostMsg, Welcome};
use fido_proto::{wire, BrokerMsg, ClientMsg, ConnId, DomainId, ErrorCode, Event, RemoteError, Reply, Request};
use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// What the relay needs from the VM's devices: the QEMU side (hot-plug over
/// QMP, the ivshmem doorbell server). A fake stands in for tests and fuzzing.
pub trait Devices {
    /// Hot-plugs a peer's arena (a sealed, read-only memfd of `len` bytes)
    /// read-only into the VM; returns the port index it appears under.
    fn plug_arena(&mut self, fd: OwnedFd, len: u64) -> io::Result<u16>;
    /// Removes the arena under `port` (the guest has unmapped it).
    fn unplug_arena(&mut self, port: u16) -> io::Result<()>;
    /// Gives QEMU a peer's doorbell ring end as a new ivshmem peer; returns its id.
    fn add_peer_bell(&mut self, fd: OwnedFd) -> io::Result<u16>;
    /// Takes a peer's doorbell away from QEMU.
    fn remove_peer_bell(&mut self, id: u16);
    /// A duplicate of the host ring end of our own MSI-X `vector`.
    fn own_ring_end(&self, vector: u16) -> io::Result<OwnedFd>;
    /// Peer bells whose holders made them blocking (they could freeze QEMU):
    /// already shut down; the relay drops their connections.
    fn hostile_peer_bells(&mut self) -> Vec<u16>;
    /// True once since the last call if the guest closed its end of the
    /// control port (its Fido process ended).
    fn guest_port_closed(&mut self) -> bool;
}

/// Makes a fresh connection to the broker (a connected `SOCK_SEQPACKET`).
pub trait BrokerLine {
    fn connect(&self) -> io::Result<OwnedFd>;
}

/// Limits on what one guest may hold through the relay.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Live connections (each holds two vectors and two peer bells).
    pub connections: usize,
}

/// A connection the relay knows of: the vectors the guest gave it and the
/// peer bells and liveness socket it was given.
#[derive(Default)]
struct Conn {
    vectors: Vec<u16>,
    peer_bells: Vec<u16>,
    liveness: Option<u64>,
}

/// The VM's own arena and identity, fixed for the VM's life.
pub struct Identity {
    /// The VM's name: the label every domain of this VM joins with.
    pub name: String,
    /// A read-only, sealed re-open of the VM's own arena, duplicated for each `Join`.
    pub arena_ro: OwnedFd,
    pub arena_len: u64,
}

/// Counters for `fido vm list` and the "no control traffic while streaming" check.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RelayStats {
    /// Frames from the guest, heartbeats not included.
    pub guest_frames: u64,
    /// Heartbeats from the guest (forwarded).
    pub heartbeats: u64,
    /// Of `guest_frames`: the domain publishing its counters for `fido
    /// status` (periodic, not caused by traffic).
    pub counters: u64,
    pub broker_frames: u64,
    pub plugs: u64,
    pub unplugs: u64,
    pub refused: u64,
}

/// The relay's state. Its owner (the supervisor's loop) feeds it what
/// arrives and writes out what it queues for the guest.
pub struct Relay {
    welcome: Welcome,
    identity: Identity,
    limits: Limits,
    devices: Box<dyn Devices>,
    line: Box<dyn BrokerLine>,
    broker: Option<OwnedFd>,
    /// Link bytes read from the guest and not yet a whole message.
    inbox: Vec<u8>,
    /// Encoded link messages for the guest, in order.
    outbox: Vec<u8>,
    conns: HashMap<ConnId, Conn>,
    /// `Connect` requests in flight: request id → the vectors they carry.
    connecting: HashMap<u64, Vec<u16>>,
    /// Arenas plugged: (slot, owner) → port.
    plugged: HashMap<(u32, DomainId), u16>,
    /// Liveness sockets by token.
    liveness: HashMap<u64, OwnedFd>,
    /// Ids of requests the relay sent itself, whose answers it drops.
    own_requests: HashSet<u64>,
    next_own_request: u64,
    next_token: u64,
    /// The link is beyond repair (the guest broke the framing).
    broken: Option<String>,
    pub stats: RelayStats,
}

/// The relay's own request ids have the top bit set (a guest's session
/// counts up from 1; a guest that uses such ids only loses its own answers).
const OWN_REQUEST_IDS: u64 = 1 << 63;

/// Requests a guest cannot make: they carry host descriptors.
fn needs_host_fds(r: &Request) -> bool {
    matches!(r, Request::PipeCreate | Request::PipeOnce { .. } | Request::NetOffer { .. } | Request::NetClaim | Request::NetListen)
}

impl Relay {
    pub fn new(welcome: Welcome, identity: Identity, limits: Limits, devices: Box<dyn Devices>, line: Box<dyn BrokerLine>) -> Relay {
        Relay {
            welcome,
            identity,
            limits,
            devices,
            line,
            broker: None,
            inbox: Vec::new(),
            outbox: Vec::new(),
            conns: HashMap::new(),
            connecting: HashMap::new(),
            plugged: HashMap::new(),
            liveness: HashMap::new(),
            own_requests: HashSet::new(),
            next_own_request: 0,
            next_token: 1,
            broken: None,
            stats: RelayStats::default(),
        }
    }

    /// The broker socket, to poll (None while disconnected).
    pub fn broker_fd(&self) -> Option<BorrowedFd<'_>> {
        self.broker.as_ref().map(|b| b.as_fd())
    }

    /// Liveness sockets to poll for hang-up, with their tokens.
    pub fn liveness_fds(&self) -> impl Iterator<Item = (u64, BorrowedFd<'_>)> {
        self.liveness.iter().map(|(t, fd)| (*t, fd.as_fd()))
    }

    /// Bytes queued for the guest; the caller writes what it can and calls
    /// [`consumed_outbox`](Self::consumed_outbox).
    pub fn outbox(&self) -> &[u8] {
        &self.outbox
    }

    pub fn consumed_outbox(&mut self, n: usize) {
        self.outbox.drain(..n.min(self.outbox.len()));
    }

    /// Why the link must be closed, once the guest broke it.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// Live connections the relay tracks (for tests and `fido vm list`).
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Ports holding a peer arena.
    pub fn plugged_ports(&self) -> usize {
        self.plugged.len()
    }

    fn send_guest(&mut self, msg: &HostMsg) {
        match link::encode_link(msg) {
            Ok(bytes) => self.outbox.extend_from_slice(&bytes),
            Err(e) => tracing::warn!("dropping a link message that does not encode: {e}"),
        }
    }

    /// Answers request `id` with an error in the broker's own shape, so the
    /// guest's session fails exactly that request.
    fn refuse(&mut self, id: u64, code: ErrorCode, why: impl Into<String>) {
        self.stats.refused += 1;
        let reply = BrokerMsg::Reply { id, body: Err(RemoteError::new(code, why)) };
        match fido_proto::encode(&reply) {
            Ok(frame) => self.send_guest(&HostMsg::Frame { frame, handles: Vec::new() }),
            Err(e) => tracing::warn!("cannot encode a refusal: {e}"),
        }
    }

    /// Feeds bytes read from the guest's link.
    pub fn guest_bytes(&mut self, bytes: &[u8]) {
        if self.broken.is_some() {
            return;
        }
        self.inbox.extend_from_slice(bytes);
        loop {
            if self.inbox.len() < 4 {
                return;
            }
            let n = match link::link_len(self.inbox[..4].try_into().expect("4 bytes")) {
                Ok(n) => n,
                Err(e) => {
                    self.broken = Some(format!("guest link: {e}"));
                    return;
                }
            };
            if self.inbox.len() < 4 + n {
                return;
            }
            let body: Vec<u8> = self.inbox.drain(..4 + n).skip(4).collect();
            match link::decode_guest(&body) {
                Ok(msg) => self.guest_msg(msg),
                Err(e) => {
                    self.broken = Some(format!("guest link: {e}"));
                    return;
                }
            }
        }
    }

    fn guest_msg(&mut self, msg: GuestMsg) {
        match msg {
            GuestMsg::Hello { version } if version == link::LINK_VERSION => {
                // A Hello starts a new guest session: whatever the previous
                // one held (its broker connection, hence its domain) ends.
                self.reset();
                let w = HostMsg::Welcome(self.welcome.clone());
                self.send_guest(&w);
            }
            GuestMsg::Hello { version } => {
                self.broken = Some(format!("guest speaks link version {version}, we speak {}", link::LINK_VERSION));
            }
            GuestMsg::Reconnect => {
                self.drop_broker();
                match self.ensure_broker() {
                    Ok(()) => self.send_guest(&HostMsg::Reconnected),
                    Err(e) => self.send_guest(&HostMsg::BrokerDown { reason: e.to_string() }),
                }
            }
            GuestMsg::Frame { frame, bells } => self.guest_frame(&frame, bells),
        }
    }

    fn ensure_broker(&mut self) -> io::Result<()> {
        if self.broker.is_none() {
            self.broker = Some(self.line.connect()?);
        }
        Ok(())
    }

    fn drop_broker(&mut self) {
        self.broker = None;
        self.connecting.clear();
        self.own_requests.clear();
    }

    fn guest_frame(&mut self, frame: &[u8], bells: Vec<u16>) {
        let msg: ClientMsg = match fido_proto::decode(frame) {
            Ok(m) => m,
            Err(e) => {
                self.stats.refused += 1;
                self.send_guest(&HostMsg::Refused { id: None, reason: format!("undecodable frame: {e}") });
                return;
            }
        };
        let (id, body) = match msg {
            ClientMsg::Heartbeat => {
                self.stats.heartbeats += 1;
                if bells.is_empty() {
                    self.forward(frame.to_vec(), Vec::new());
                }
                return;
            }
            ClientMsg::Request { id, body } => (id, body),
        };
        self.stats.guest_frames += 1;
        if matches!(body, Request::Counters { .. }) {
            self.stats.counters += 1;
        }
        if needs_host_fds(&body) {
            return self.refuse(id, ErrorCode::BadRequest, "this request carries host descriptors: not available inside a VM");
        }
        let wants_bells = matches!(body, Request::Connect { .. } | Request::Accept { .. });
        if wants_bells != (bells.len() == 2) || (!wants_bells && !bells.is_empty()) {
            return self.refuse(id, ErrorCode::BadDescriptor, format!("{} doorbell vectors with this request", bells.len()));
        }
        let mut fds = Vec::new();
        let mut frame = frame.to_vec();
        match &body {
            Request::Join { name, arena_len, resume, .. } => {
                if *arena_len != self.identity.arena_len {
                    return self.refuse(id, ErrorCode::BadRequest, format!("the VM's arena is {} bytes, not {arena_len}", self.identity.arena_len));
                }
                // The VM's name is its label: the guest cannot choose another.
                let join = Request::Join { name: name.clone(), label: Some(self.identity.name.clone()), arena_len: *arena_len, resume: resume.clone() };
                frame = match fido_proto::encode(&ClientMsg::Request { id, body: join }) {
                    Ok(f) => f,
                    Err(e) => return self.refuse(id, ErrorCode::BadRequest, e.to_string()),
                };
                match self.identity.arena_ro.try_clone() {
                    Ok(fd) => fds.push(fd),
                    Err(e) => return self.refuse(id, ErrorCode::Internal, format!("arena: {e}")),
                }
            }
            Request::Connect { .. } | Request::Accept { .. } => {
                if let Err(why) = self.check_vectors(&bells) {
                    return self.refuse(id, ErrorCode::BadDescriptor, why);
                }
                if matches!(body, Request::Connect { .. }) && self.connecting.contains_key(&id) {
                    // Its vectors would be forgotten while the broker may
                    // still connect the first: two connections on one vector.
                    return self.refuse(id, ErrorCode::BadRequest, format!("a Connect with id {id} is already in flight"));
                }
                // An Accept's connection is already counted (since its Incoming).
                let accepting = matches!(&body, Request::Accept { conn, .. } if self.conns.contains_key(conn));
                if self.conns.len() - usize::from(accepting) + self.connecting.len() >= self.limits.connections {
                    return self.refuse(id, ErrorCode::Quota, format!("a VM holds at most {} connections", self.limits.connections));
                }
                for &v in &bells {
                    match self.devices.own_ring_end(v) {
                        Ok(fd) => fds.push(fd),
                        Err(e) => return self.refuse(id, ErrorCode::Internal, format!("vector {v}: {e}")),
                    }
                }
                match &body {
                    Request::Connect { .. } => {
                        self.connecting.insert(id, bells);
                    }
                    Request::Accept { conn, .. } => {
                        self.conns.entry(*conn).or_default().vectors = bells;
                    }
                    _ => unreachable!(),
                }
            }
            Request::Close { conn } | Request::Refuse { conn, .. } => {
                let conn = *conn;
                self.end_conn(conn);
            }
            Request::Unmapped { slot, owner } => {
                if let Some(port) = self.plugged.remove(&(*slot, *owner)) {
                    self.stats.unplugs += 1;
                    if let Err(e) = self.devices.unplug_arena(port) {
                        tracing::warn!(port, "unplugging an arena the guest let go of: {e}");
                    }
                }
            }
            _ => {}
        }
        self.forward(frame, fds);
    }

    /// The guest's vectors for a new connection: in range, distinct, not held
    /// by another live connection.
    fn check_vectors(&self, bells: &[u16]) -> Result<(), String> {
        let in_use: HashSet<u16> = self.conns.values().flat_map(|c| c.vectors.iter().copied()).chain(self.connecting.values().flatten().copied()).collect();
        for (i, &v) in bells.iter().enumerate() {
            if v == 0 || v >= self.welcome.vectors {
                return Err(format!("vector {v} is not one of 1..{}", self.welcome.vectors));
            }
            if in_use.contains(&v) || bells[..i].contains(&v) {
                return Err(format!("vector {v} is already in use"));
            }
        }
        Ok(())
    }

    fn forward(&mut self, frame: Vec<u8>, fds: Vec<OwnedFd>) {
        if let Err(e) = self.ensure_broker() {
            // The guest's session sees the broker as down and retries.
            self.send_guest(&HostMsg::BrokerDown { reason: e.to_string() });
            return;
        }
        let sock = self.broker.as_ref().expect("just ensured");
        if let Err(e) = wire::send_blocking(sock.as_fd(), &frame, &fds) {
            tracing::info!("broker connection lost while sending: {e}");
            self.drop_broker();
            self.send_guest(&HostMsg::BrokerClosed);
        }
    }

    /// The broker socket is readable: relays what arrived.
    pub fn broker_readable(&mut self) {
        let mut buf = vec![0u8; fido_proto::MAX_MESSAGE];
        loop {
            let Some(sock) = self.broker.as_ref() else { return };
            match wire::recv(sock.as_fd(), &mut buf) {
                Ok(wire::Recv::WouldBlock) => return,
                Ok(wire::Recv::Eof) | Err(_) => {
                    self.drop_broker();
                    self.send_guest(&HostMsg::BrokerClosed);
                    return;
                }
                Ok(wire::Recv::Msg { len, fds, truncated }) => {
                    self.stats.broker_frames += 1;
                    if truncated {
                        tracing::warn!("a truncated broker message: dropping the connection");
                        self.drop_broker();
                        self.send_guest(&HostMsg::BrokerClosed);
                        return;
                    }
                    let frame = buf[..len].to_vec();
                    self.broker_frame(frame, fds);
                }
            }
        }
    }

    fn broker_frame(&mut self, frame: Vec<u8>, fds: Vec<OwnedFd>) {
        let msg: Option<BrokerMsg> = fido_proto::decode(&frame).ok();
        if let Some(BrokerMsg::Reply { id, .. }) = &msg {
            // Answers to requests the relay made itself never reach the guest.
            if self.own_requests.remove(id) {
                return;
            }
        }
        let handles = match &msg {
            Some(BrokerMsg::Reply { id, body: Ok(Reply::Connected { conn, peer, .. }) }) if fds.len() == 4 => {
                let vectors = self.connecting.remove(id).unwrap_or_default();
                self.conns.entry(*conn).or_default().vectors = vectors;
                let was_plugged = self.plugged.contains_key(&(peer.slot, peer.domain));
                let handles = self.connection_handles(*conn, (peer.slot, peer.domain, peer.arena_len), fds);
                if handles.contains(&Handle::Unsupported) {
                    // The guest's connect fails on the unusable handle; the
                    // connection ends here too, so its vectors and the
                    // peer's side are freed.
                    self.end_conn(*conn);
                    self.own_request(Request::Close { conn: *conn });
                    if !was_plugged {
                        self.unplug_unused(peer.slot, peer.domain);
                    }
                }
                handles
            }
            Some(BrokerMsg::Event(Event::Incoming { conn, peer, .. })) if fds.len() == 4 => {
                if !self.conns.contains_key(conn) && self.conns.len() + self.connecting.len() >= self.limits.connections {
                    // No vectors left to accept it with: refused before any
                    // device is touched, the guest never sees it.
                    let reason = format!("VM {}: at its limit of {} connections", self.identity.name, self.limits.connections);
                    self.own_request(Request::Refuse { conn: *conn, reason });
                    return;
                }
                let was_plugged = self.plugged.contains_key(&(peer.slot, peer.domain));
                let handles = self.connection_handles(*conn, (peer.slot, peer.domain, peer.arena_len), fds);
                if handles.contains(&Handle::Unsupported) {
                    // The VM cannot take this connection (no port for the
                    // peer's arena, no doorbell): refused here, the guest
                    // never sees it.
                    self.end_conn(*conn);
                    let reason = format!("VM {}: cannot map the arena or doorbells of {} (see its supervisor's log)", self.identity.name, peer.name);
                    self.own_request(Request::Refuse { conn: *conn, reason });
                    if !was_plugged {
                        self.unplug_unused(peer.slot, peer.domain);
                    }
                    return;
                }
                handles
            }
            Some(BrokerMsg::Reply { body: Ok(Reply::Grant { owner, slot, arena_len }), .. }) if fds.len() == 1 => {
                let fd = fds.into_iter().next().expect("one");
                vec![self.arena_handle((*slot, *owner, *arena_len), fd)]
            }
            Some(BrokerMsg::Reply { id, .. }) => {
                // Any other answer to a Connect (refused, or malformed) ends
                // what the relay reserved for it.
                self.connecting.remove(id);
                unsupported(fds)
            }
            Some(BrokerMsg::Event(Event::PeerGone { conn: Some(conn), .. })) | Some(BrokerMsg::Event(Event::Closed { conn })) => {
                // The peer is gone: take its doorbells away from QEMU now.
                // The guest still holds the arena mapping (delivered messages
                // stay readable) until it unmaps and says so.
                let conn = *conn;
                if let Some(c) = self.conns.get_mut(&conn) {
                    for id in c.peer_bells.drain(..) {
                        self.devices.remove_peer_bell(id);
                    }
                }
                unsupported(fds)
            }
            _ => unsupported(fds),
        };
        self.send_guest(&HostMsg::Frame { frame, handles });
    }

    /// Sends a request of the relay's own (closing or refusing what the
    /// guest cannot use); its answer is dropped.
    fn own_request(&mut self, body: Request) {
        if self.broker.is_none() {
            // It was about the connection that just failed (sending on it):
            // a fresh one has no such domain, and only the guest opens one.
            return;
        }
        let id = OWN_REQUEST_IDS | self.next_own_request;
        self.next_own_request = (self.next_own_request + 1) & !OWN_REQUEST_IDS;
        match fido_proto::encode(&ClientMsg::Request { id, body }) {
            Ok(frame) => {
                self.own_requests.insert(id);
                self.forward(frame, Vec::new());
            }
            Err(e) => tracing::warn!("cannot encode a request of the relay's: {e}"),
        }
    }

    /// Handles for a connection's four descriptors: arena, data bell, space
    /// bell, liveness. A descriptor that cannot be translated becomes
    /// `Unsupported`, which fails the connection in the guest.
    fn connection_handles(&mut self, conn: ConnId, arena: (u32, DomainId, u64), fds: Vec<OwnedFd>) -> Vec<Handle> {
        let mut fds = fds.into_iter();
        let mut handles = Vec::with_capacity(4);
        handles.push(self.arena_handle(arena, fds.next().expect("four")));
        for _ in 0..2 {
            let fd = fds.next().expect("four");
            match self.devices.add_peer_bell(fd) {
                Ok(id) => {
                    self.conns.entry(conn).or_default().peer_bells.push(id);
                    handles.push(Handle::Ring { peer: id, vector: 0 });
                }
                Err(e) => {
                    tracing::warn!(conn, "cannot give QEMU a peer doorbell: {e}");
                    handles.push(Handle::Unsupported);
                }
            }
        }
        let token = self.next_token;
        self.next_token += 1;
        self.liveness.insert(token, fds.next().expect("four"));
        self.conns.entry(conn).or_default().liveness = Some(token);
        handles.push(Handle::Liveness { token });
        handles
    }

    fn arena_handle(&mut self, (slot, owner, len): (u32, DomainId, u64), fd: OwnedFd) -> Handle {
        if let Some(&port) = self.plugged.get(&(slot, owner)) {
            return Handle::Arena { port, len };
        }
        if !len.is_power_of_two() || len > self.welcome.max_peer_arena {
            tracing::warn!(slot, owner, len, "a peer arena that no port can hold (needs a power of two ≤ {})", self.welcome.max_peer_arena);
            return Handle::Unsupported;
        }
        match self.devices.plug_arena(fd, len) {
            Ok(port) => {
                self.stats.plugs += 1;
                self.plugged.insert((slot, owner), port);
                Handle::Arena { port, len }
            }
            Err(e) => {
                tracing::warn!(slot, owner, "hot-plugging a peer arena: {e}");
                Handle::Unsupported
            }
        }
    }

    /// Unplugs a peer arena plugged for a connection that failed at once:
    /// the guest never maps it, so it would never say `Unmapped` and the
    /// port would stay taken until its session ends. The broker is told, as
    /// the guest would have (its grant record goes).
    fn unplug_unused(&mut self, slot: u32, owner: DomainId) {
        if let Some(port) = self.plugged.remove(&(slot, owner)) {
            self.stats.unplugs += 1;
            if let Err(e) = self.devices.unplug_arena(port) {
                tracing::warn!(port, "unplugging the arena of a connection the VM could not take: {e}");
            }
            self.own_request(Request::Unmapped { slot, owner });
        }
    }

    /// Forgets a connection: its peer bells leave QEMU, its liveness socket closes.
    fn end_conn(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.remove(&conn) {
            for id in c.peer_bells {
                self.devices.remove_peer_bell(id);
            }
            if let Some(t) = c.liveness {
                self.liveness.remove(&t);
            }
        }
    }

    /// The guest's Fido process is gone (it closed the port, or a new one
    /// said Hello): its broker connection closes, so the broker sees its
    /// domain exit and tells its peers at once; its peers' doorbells leave
    /// QEMU; the arenas it mapped are unplugged (nothing in the guest maps
    /// them any more).
    pub fn reset(&mut self) {
        self.drop_broker();
        for (_, c) in self.conns.drain() {
            for id in c.peer_bells {
                self.devices.remove_peer_bell(id);
            }
        }
        self.liveness.clear();
        let ports: Vec<u16> = self.plugged.drain().map(|(_, p)| p).collect();
        for port in ports {
            self.stats.unplugs += 1;
            if let Err(e) = self.devices.unplug_arena(port) {
                tracing::warn!(port, "unplugging an arena of a guest session that ended: {e}");
            }
        }
    }

    /// A liveness socket hung up: the guest learns its peer is gone.
    pub fn liveness_hangup(&mut self, token: u64) {
        if self.liveness.remove(&token).is_some() {
            self.send_guest(&HostMsg::Hangup { token });
        }
    }

    /// Periodic work: connections whose peers made their doorbells blocking
    /// are cut (the guest sees the peer gone).
    pub fn tick(&mut self) {
        if self.devices.guest_port_closed() {
            tracing::info!("the guest closed its control port: its domain ends");
            self.reset();
        }
        let hostile = self.devices.hostile_peer_bells();
        if hostile.is_empty() {
            return;
        }
        let conns: Vec<(ConnId, Option<u64>)> =
            self.conns.iter().filter(|(_, c)| c.peer_bells.iter().any(|b| hostile.contains(b))).map(|(k, c)| (*k, c.liveness)).collect();
        for (conn, token) in conns {
            tracing::warn!(conn, "a peer made its doorbell blocking (it could freeze the VM): cutting the connection");
            if let Some(t) = token {
                self.liveness_hangup(t);
            }
            if let Some(c) = self.conns.get_mut(&conn) {
                for id in c.peer_bells.drain(..) {
                    self.devices.remove_peer_bell(id);
                }
            }
        }
    }
}

fn unsupported(fds: Vec<OwnedFd>) -> Vec<Handle> {
    fds.into_iter().map(|_| Handle::Unsupported).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use fido_proto::{PeerInfo, PgvasGeometry, RingBlock};
    use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
    use std::cell::RefCell;
    use std::rc::Rc;

    /// What the fake devices were asked to do.
    #[derive(Default)]
    struct Log {
        plugged: Vec<u16>,
        unplugged: Vec<u16>,
        bells: Vec<u16>,
        removed_bells: Vec<u16>,
        fail_plug: bool,
    }

    struct FakeDevices(Rc<RefCell<Log>>, Vec<OwnedFd>);

    impl Devices for FakeDevices {
        fn plug_arena(&mut self, _fd: OwnedFd, _len: u64) -> io::Result<u16> {
            let mut l = self.0.borrow_mut();
            if l.fail_plug {
                return Err(io::Error::other("no free port"));
            }
            let port = l.plugged.len() as u16;
            l.plugged.push(port);
            Ok(port)
        }
        fn unplug_arena(&mut self, port: u16) -> io::Result<()> {
            self.0.borrow_mut().unplugged.push(port);
            Ok(())
        }
        fn add_peer_bell(&mut self, _fd: OwnedFd) -> io::Result<u16> {
            let mut l = self.0.borrow_mut();
            let id = 1 + l.bells.len() as u16;
            l.bells.push(id);
            Ok(id)
        }
        fn remove_peer_bell(&mut self, id: u16) {
            self.0.borrow_mut().removed_bells.push(id);
        }
        fn own_ring_end(&self, vector: u16) -> io::Result<OwnedFd> {
            Ok(rustix::io::fcntl_dupfd_cloexec(&self.1[vector as usize % self.1.len()], 0)?)
        }
        fn hostile_peer_bells(&mut self) -> Vec<u16> {
            Vec::new()
        }
        fn guest_port_closed(&mut self) -> bool {
            false
        }
    }

    /// The broker's end of the relay's connection, as a test sees it.
    struct FakeLine(RefCell<Option<OwnedFd>>);

    impl BrokerLine for FakeLine {
        fn connect(&self) -> io::Result<OwnedFd> {
            self.0.borrow_mut().take().ok_or_else(|| io::Error::other("one connection only"))
        }
    }

    struct World {
        relay: Relay,
        log: Rc<RefCell<Log>>,
        broker: OwnedFd,
        arena: OwnedFd,
    }

    fn memfd(len: u64) -> OwnedFd {
        let fd = rustix::fs::memfd_create("relay-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, len).unwrap();
        fd
    }

    fn world() -> World {
        let (relay_end, broker) = socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK, None).unwrap();
        let log = Rc::new(RefCell::new(Log::default()));
        let ring_ends = (0..2).map(|_| memfd(1)).collect();
        let welcome = Welcome {
            version: link::LINK_VERSION,
            arena: "0000:00:04.0".into(),
            arena_len: 1 << 20,
            doorbell: "0000:00:05.0".into(),
            vectors: 8,
            own_peer: 0,
            ports: vec!["0000:00:10.0".into(), "0000:00:10.1".into()],
            max_peer_arena: 1 << 30,
        };
        let arena = memfd(1 << 20);
        let identity = Identity { name: "vm1".into(), arena_ro: rustix::io::fcntl_dupfd_cloexec(&arena, 0).unwrap(), arena_len: 1 << 20 };
        let relay = Relay::new(welcome, identity, Limits { connections: 3 }, Box::new(FakeDevices(log.clone(), ring_ends)), Box::new(FakeLine(RefCell::new(Some(relay_end)))));
        World { relay, log, broker, arena }
    }

    impl World {
        fn guest(&mut self, msg: &GuestMsg) {
            let bytes = link::encode_link(msg).unwrap();
            self.relay.guest_bytes(&bytes);
        }
        fn request(&mut self, id: u64, body: Request, bells: Vec<u16>) {
            let frame = fido_proto::encode(&ClientMsg::Request { id, body }).unwrap();
            self.guest(&GuestMsg::Frame { frame, bells });
        }
        /// What reached the broker: (request, number of descriptors).
        fn at_broker(&mut self) -> Vec<(ClientMsg, usize)> {
            let mut out = Vec::new();
            let mut buf = vec![0u8; fido_proto::MAX_MESSAGE];
            while let Ok(wire::Recv::Msg { len, fds, .. }) = wire::recv(self.broker.as_fd(), &mut buf) {
                out.push((fido_proto::decode::<ClientMsg>(&buf[..len]).unwrap(), fds.len()));
            }
            out
        }
        fn broker_sends(&mut self, msg: &BrokerMsg, fds: Vec<OwnedFd>) {
            wire::send(self.broker.as_fd(), &fido_proto::encode(msg).unwrap(), &fds).unwrap();
            self.relay.broker_readable();
        }
        /// What reached the guest, decoded.
        fn at_guest(&mut self) -> Vec<HostMsg> {
            let mut out = Vec::new();
            let bytes = self.relay.outbox().to_vec();
            self.relay.consumed_outbox(bytes.len());
            let mut rest = &bytes[..];
            while rest.len() >= 4 {
                let n = link::link_len(rest[..4].try_into().unwrap()).unwrap();
                out.push(link::decode_host(&rest[4..4 + n]).unwrap());
                rest = &rest[4 + n..];
            }
            out
        }
        fn four_fds(&self) -> Vec<OwnedFd> {
            let (a, b) = socketpair(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC, None).unwrap();
            vec![rustix::io::fcntl_dupfd_cloexec(&self.arena, 0).unwrap(), a, b, memfd(1)]
        }
    }

    fn peer() -> PeerInfo {
        PeerInfo { domain: 7, name: "host-peer".into(), slot: 3, arena_len: 1 << 20, uid: 0, pid: 1 }
    }

    const BLOCK: RingBlock = RingBlock { offset: 0, len: 4096, entries: 8 };

    #[test]
    fn join_carries_the_vms_arena_and_name_whatever_the_guest_says() {
        let mut w = world();
        w.guest(&GuestMsg::Hello { version: link::LINK_VERSION });
        assert!(matches!(w.at_guest()[..], [HostMsg::Welcome(_)]));
        w.request(1, Request::Join { name: "web".into(), label: Some("admin".into()), arena_len: 1 << 20, resume: None }, vec![]);
        let got = w.at_broker();
        assert_eq!(got.len(), 1);
        match &got[0] {
            (ClientMsg::Request { body: Request::Join { label, .. }, .. }, 1) => assert_eq!(label.as_deref(), Some("vm1")),
            other => panic!("{other:?}"),
        }
        // Another arena length is refused without reaching the broker.
        w.request(2, Request::Join { name: "web".into(), label: None, arena_len: 2 << 20, resume: None }, vec![]);
        assert!(w.at_broker().is_empty());
        assert!(matches!(&w.at_guest()[..], [HostMsg::Frame { .. }]));
    }

    #[test]
    fn host_descriptor_requests_and_bad_vectors_are_refused_here() {
        let mut w = world();
        w.request(1, Request::PipeCreate, vec![]);
        w.request(2, Request::Connect { service: "s".into(), block: BLOCK }, vec![0, 1]);
        w.request(3, Request::Connect { service: "s".into(), block: BLOCK }, vec![9, 1]);
        w.request(4, Request::Connect { service: "s".into(), block: BLOCK }, vec![2, 2]);
        w.request(5, Request::Connect { service: "s".into(), block: BLOCK }, vec![2]);
        w.request(6, Request::Status, vec![3]);
        assert!(w.at_broker().is_empty(), "nothing reached the broker");
        let replies = w.at_guest();
        assert_eq!(replies.len(), 6);
        for r in replies {
            let HostMsg::Frame { frame, handles } = r else { panic!("{r:?}") };
            assert!(handles.is_empty());
            assert!(matches!(fido_proto::decode::<BrokerMsg>(&frame).unwrap(), BrokerMsg::Reply { body: Err(_), .. }));
        }
        assert_eq!(w.relay.stats.refused, 6);
    }

    #[test]
    fn a_connection_becomes_handles_and_its_vectors_are_held_until_closed() {
        let mut w = world();
        w.request(1, Request::Connect { service: "s".into(), block: BLOCK }, vec![1, 2]);
        assert!(matches!(w.at_broker()[..], [(ClientMsg::Request { body: Request::Connect { .. }, .. }, 2)]));
        // The same vectors again, while the first connect is pending: refused.
        w.request(2, Request::Connect { service: "s".into(), block: BLOCK }, vec![2, 3]);
        assert!(w.at_broker().is_empty());
        w.at_guest();
        let fds = w.four_fds();
        w.broker_sends(&BrokerMsg::Reply { id: 1, body: Ok(Reply::Connected { conn: 11, peer: peer(), block: BLOCK }) }, fds);
        let got = w.at_guest();
        let [HostMsg::Frame { handles, .. }] = &got[..] else { panic!("{got:?}") };
        assert!(matches!(handles[..], [Handle::Arena { port: 0, .. }, Handle::Ring { .. }, Handle::Ring { .. }, Handle::Liveness { .. }]), "{handles:?}");
        assert_eq!(w.relay.connections(), 1);
        // The peer's arena is plugged once, however many connections use it.
        w.request(3, Request::Connect { service: "s".into(), block: BLOCK }, vec![3, 4]);
        w.at_broker();
        let fds = w.four_fds();
        w.broker_sends(&BrokerMsg::Reply { id: 3, body: Ok(Reply::Connected { conn: 12, peer: peer(), block: BLOCK }) }, fds);
        w.at_guest();
        assert_eq!(w.log.borrow().plugged.len(), 1);
        // Closing frees the vectors and takes the peer's bells from QEMU.
        w.request(4, Request::Close { conn: 11 }, vec![]);
        assert_eq!(w.log.borrow().removed_bells.len(), 2);
        w.request(5, Request::Connect { service: "s".into(), block: BLOCK }, vec![1, 2]);
        assert!(matches!(w.at_broker()[..], [_, (ClientMsg::Request { body: Request::Connect { .. }, .. }, 2)]));
        // Unmapped unplugs the arena.
        w.request(6, Request::Unmapped { slot: 3, owner: 7 }, vec![]);
        assert_eq!(w.log.borrow().unplugged, vec![0]);
    }

    #[test]
    fn a_connection_the_vm_cannot_map_is_ended_by_the_relay() {
        let mut w = world();
        w.log.borrow_mut().fail_plug = true;
        // Our connect: the guest gets Unsupported, the broker a Close, and
        // the vectors are free again.
        w.request(1, Request::Connect { service: "s".into(), block: BLOCK }, vec![1, 2]);
        w.at_broker();
        let fds = w.four_fds();
        w.broker_sends(&BrokerMsg::Reply { id: 1, body: Ok(Reply::Connected { conn: 21, peer: peer(), block: BLOCK }) }, fds);
        let got = w.at_guest();
        let [HostMsg::Frame { handles, .. }] = &got[..] else { panic!("{got:?}") };
        assert_eq!(handles[0], Handle::Unsupported);
        let sent = w.at_broker();
        assert!(matches!(sent[..], [(ClientMsg::Request { id, body: Request::Close { conn: 21 } }, 0)] if id & OWN_REQUEST_IDS != 0), "{sent:?}");
        assert_eq!(w.relay.connections(), 0);
        // Its answer stays with the relay.
        let own = match sent[0].0 { ClientMsg::Request { id, .. } => id, _ => unreachable!() };
        w.broker_sends(&BrokerMsg::Reply { id: own, body: Ok(Reply::Ok) }, vec![]);
        assert!(w.at_guest().is_empty());
        // Someone connecting to us: refused here, the guest never hears of it.
        let fds = w.four_fds();
        w.broker_sends(&BrokerMsg::Event(Event::Incoming { conn: 22, service: "mine".into(), peer: peer(), block: BLOCK }), fds);
        assert!(w.at_guest().is_empty());
        assert!(matches!(w.at_broker()[..], [(ClientMsg::Request { body: Request::Refuse { conn: 22, .. }, .. }, 0)]));
        // The vectors were freed: the guest can use them.
        w.request(2, Request::Connect { service: "s".into(), block: BLOCK }, vec![1, 2]);
        assert_eq!(w.at_broker().len(), 1);
        let _ = PgvasGeometry::DEFAULT;
    }

    #[test]
    fn a_new_guest_session_ends_the_old_one() {
        let mut w = world();
        w.request(1, Request::Connect { service: "s".into(), block: BLOCK }, vec![1, 2]);
        w.at_broker();
        let fds = w.four_fds();
        w.broker_sends(&BrokerMsg::Reply { id: 1, body: Ok(Reply::Connected { conn: 31, peer: peer(), block: BLOCK }) }, fds);
        w.at_guest();
        assert!(w.relay.broker_fd().is_some());
        w.guest(&GuestMsg::Hello { version: link::LINK_VERSION });
        assert!(w.relay.broker_fd().is_none(), "the old session's broker connection is closed");
        assert_eq!(w.relay.connections(), 0);
        assert_eq!(w.log.borrow().unplugged, vec![0]);
        assert_eq!(w.log.borrow().removed_bells.len(), 2);
    }

    #[test]
    fn garbage_on_the_link_breaks_it_and_nothing_after_is_processed() {
        let mut w = world();
        w.relay.guest_bytes(&[0xff, 0xff, 0xff, 0xff, 1, 2, 3]);
        assert!(w.relay.broken().is_some());
        w.request(1, Request::Status, vec![]);
        assert!(w.at_broker().is_empty());
        assert!(w.at_guest().is_empty());
    }
}
