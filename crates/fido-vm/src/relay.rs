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
