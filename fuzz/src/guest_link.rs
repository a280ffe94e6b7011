//! The `guest_link` property: a VM supervisor's relay
//! (`fido_vm::relay::Relay`) between a hostile guest's control port and the
//! broker, driven in-process with a fake `Devices` (records hot-plugs, peer
//! doorbells and unplugs; can be told to fail) and a fake `BrokerLine` (real
//! `SOCK_SEQPACKET` socket pairs whose other ends this harness reads, and
//! into which it injects broker frames with real descriptors: sealed
//! memfds, Unix stream socket pairs). Shared by the fuzz target and by
//! crates/fido-vm/tests/guest_link_corpus.rs (which includes this file with
//! `#[path]`: it uses only `std`, `rustix`, `fido_proto` and `fido_vm`).
//!
//! The input is a program: a stream of steps, each an opcode byte and its
//! arguments, read with a reader that yields zeros once the input runs out.
//! Steps: guest link bytes (raw, or a well-formed `GuestMsg` built from the
//! input — Hello, Reconnect, a frame carrying any request with any bells —
//! split at an input-chosen point); a broker frame (`Connected`/`Incoming`
//! with four descriptors or a wrong number, `Grant` with one, `PeerGone`,
//! `Closed`, an error or other reply, an answer to one of the relay's own
//! requests, garbage with descriptors), also as the broker's last before it
//! dies; the broker hanging up; a liveness
//! hang-up; a tick (the guest closing its port, peers' doorbells found
//! hostile); devices or the broker line starting or stopping to fail; the
//! supervisor taking only part of the outbox.
//!
//! The oracle, after every step ([`World::step`] panics on a violation):
//! - no panic in the relay;
//! - the outbox holds only whole, well-formed `HostMsg`s (`decode_host`, and
//!   re-encoding gives the same bytes); a broker frame reaches the guest
//!   unchanged, with one handle per descriptor, and an answer to one of the
//!   relay's own requests never does;
//! - in a frame the guest can use (no `Unsupported`), every `Handle::Arena`
//!   names a port the fake plugged and has not unplugged, with its length;
//!   every `Handle::Ring` a peer doorbell added and not removed (vector 0);
//!   every `Handle::Liveness` a token the relay watches; and every port
//!   the relay keeps plugged was named in such a frame (else nothing would
//!   ever unplug it);
//! - the devices get only what the broker sent: `plug_arena` a peer arena
//!   the harness injected, `add_peer_bell` a doorbell it injected; the relay
//!   never unplugs a port or removes a doorbell it does not hold;
//! - what reaches the broker is what the guest could have caused: every
//!   frame decodes; a `Join` carries exactly the VM's own arena (the same
//!   file, read-only), labelled with the VM's name and its arena length,
//!   whatever the guest asked; a `Connect`/`Accept` exactly two of the VM's
//!   own ring ends, for the vectors the guest named, in `1..vectors`,
//!   distinct and not held by another live connection; requests that would
//!   carry host descriptors never pass; nothing else carries a descriptor;
//!   the relay's own requests are `Close`/`Refuse` (top-bit ids) of a
//!   connection the VM cannot take, and `Unmapped` for its arena; only the
//!   guest's bytes make the relay open a broker connection;
//! - the relay tracks at most `LIMIT` connections;
//! - once `broken()` is set it stays set and guest bytes change nothing.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::rc::Rc;

use fido_proto::guest::{self as link, GuestMsg, Handle, HostMsg, Welcome};
use fido_proto::{
    wire, BrokerMsg, ClientMsg, ConnId, DomainId, ErrorCode, Event, GoneReason, PeerInfo,
    RemoteError, Reply, Request, RingBlock,
};
use fido_vm::relay::{BrokerLine, Devices, Identity, Limits, Relay};
use rustix::fs::{MemfdFlags, OFlags, SealFlags};
use rustix::net::{AddressFamily, SocketFlags, SocketType};

/// MSI-X vectors of the fake doorbell device (vector 0 reserved).
pub const VECTORS: u16 = 9;
/// Connections the VM may hold: as the supervisor computes it.
pub const LIMIT: usize = ((VECTORS - 1) / 2) as usize;
/// Hot-plug ports of the fake VM.
pub const PORTS: u16 = 4;
/// Largest peer arena a port holds.
pub const MAX_PEER_ARENA: u64 = 1 << 20;
/// Most peer doorbells the fake doorbell server registers at once.
const MAX_BELLS: usize = 2 * LIMIT + 2;
pub const VM_NAME: &str = "vm-fuzz";
pub const ARENA_LEN: u64 = 1 << 16;
/// The relay's own request ids have this bit set.
const OWN: u64 = 1 << 63;

/// The peer domains the fake broker knows: (owner, slot, arena length).
/// Lengths that no port can hold (not a power of two, over
/// `MAX_PEER_ARENA`) are among them. A (slot, owner) pair always has the
/// same length, as with a real broker (domain ids are never reused).
const PEERS: [(DomainId, u32, u64); 6] = [
    (1, 1, 4096),
    (2, 2, 1 << 16),
    (3, 3, 3000),
    (4, 4, 1 << 22),
    (5, 5, 1 << 20),
    (1, 7, 8192),
];

/// Reads the program; zeros once it runs out.
pub struct Input<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Input { data, pos: 0 }
    }
    fn done(&self) -> bool {
        self.pos >= self.data.len()
    }
    fn byte(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.byte()).collect()
    }
    /// One of `items`, by the next byte.
    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.byte() as usize % items.len()].clone()
    }
}

/// A file's identity, to recognise descriptors across duplicates and SCM_RIGHTS.
type FileId = (u64, u64);

fn file_id(fd: BorrowedFd<'_>) -> FileId {
    let st = rustix::fs::fstat(fd).expect("fstat");
    (st.st_dev, st.st_ino)
}

fn stream_pair() -> (OwnedFd, OwnedFd) {
    rustix::net::socketpair(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK, None).expect("socketpair")
}

fn memfd(len: u64) -> OwnedFd {
    let fd = rustix::fs::memfd_create("guest-link-fuzz", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).expect("memfd");
    rustix::fs::ftruncate(&fd, len).expect("ftruncate");
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL).expect("seal");
    fd
}

/// What the fake devices hold and were told; shared with the harness.
#[derive(Default)]
struct DevState {
    /// Plugged ports: port → (length, the arena's file).
    ports: BTreeMap<u16, (u64, FileId)>,
    /// Ports named in a frame the guest can use (it may map them and will
    /// say `Unmapped`), and ports whose unplug failed (the relay let go).
    announced: HashSet<u16>,
    stuck: HashSet<u16>,
    /// Registered peer doorbells: id → the doorbell's file.
    bells: BTreeMap<u16, FileId>,
    next_bell: u16,
    /// Ids the fake server cut itself in this tick (as `check_peers` does):
    /// the relay may remove them once more.
    cut: HashSet<u16>,
    /// Own vectors: host ring end (what the broker gets) and the end QEMU reads.
    own_rings: Vec<(OwnedFd, OwnedFd)>,
    own_ring_files: HashMap<FileId, u16>,
    /// Descriptors the harness sent as peer arenas (file → length) and doorbells.
    sent_arenas: HashMap<FileId, u64>,
    sent_bells: HashSet<FileId>,
    fail_plug: bool,
    fail_unplug: bool,
    fail_bell: bool,
    fail_own_ring: bool,
    port_closed_next: bool,
    port_closed_fired: bool,
    hostile_next: Vec<u16>,
}

struct FakeDevices(Rc<RefCell<DevState>>);

impl Devices for FakeDevices {
    fn plug_arena(&mut self, fd: OwnedFd, len: u64) -> io::Result<u16> {
        let mut d = self.0.borrow_mut();
        let id = file_id(fd.as_fd());
        assert!(d.sent_arenas.contains_key(&id), "plug_arena was given a descriptor that is no peer arena the broker sent");
        assert!(len.is_power_of_two() && len <= MAX_PEER_ARENA, "plug_arena asked for {len} bytes: no port holds that");
        if d.fail_plug {
            return Err(io::Error::other("fake: hot-plug fails"));
        }
        let port = (0..PORTS).find(|p| !d.ports.contains_key(p)).ok_or_else(|| io::Error::other("fake: every port is in use"))?;
        d.ports.insert(port, (len, id));
        Ok(port)
    }

    fn unplug_arena(&mut self, port: u16) -> io::Result<()> {
        let mut d = self.0.borrow_mut();
        assert!(d.ports.contains_key(&port), "unplug_arena({port}): the relay does not hold that port");
        if d.fail_unplug {
            // Like the real one: a port whose unplug failed stays taken.
            d.stuck.insert(port);
            return Err(io::Error::other("fake: unplug fails"));
        }
        d.ports.remove(&port);
        d.announced.remove(&port);
        Ok(())
    }

    fn add_peer_bell(&mut self, fd: OwnedFd) -> io::Result<u16> {
        let mut d = self.0.borrow_mut();
        assert!(d.sent_bells.contains(&file_id(fd.as_fd())), "add_peer_bell was given a descriptor that is no doorbell the broker sent");
        if d.fail_bell || d.bells.len() >= MAX_BELLS {
            return Err(io::Error::other("fake: no doorbell peer"));
        }
        // Ids are never reused here, so a stale removal is always seen.
        d.next_bell += 1;
        let id = d.next_bell;
        d.bells.insert(id, file_id(fd.as_fd()));
        Ok(id)
    }

    fn remove_peer_bell(&mut self, id: u16) {
        let mut d = self.0.borrow_mut();
        if d.bells.remove(&id).is_none() {
            assert!(d.cut.remove(&id), "remove_peer_bell({id}): the relay does not hold that doorbell");
        }
    }

    fn own_ring_end(&self, vector: u16) -> io::Result<OwnedFd> {
        let d = self.0.borrow();
        if d.fail_own_ring {
            return Err(io::Error::other("fake: own ring end fails"));
        }
        let (ring, _) = d.own_rings.get(vector as usize).ok_or_else(|| io::Error::other("fake: no such vector"))?;
        Ok(wire::dup(ring.as_fd())?)
    }

    fn hostile_peer_bells(&mut self) -> Vec<u16> {
        let mut d = self.0.borrow_mut();
        let ids: Vec<u16> = std::mem::take(&mut d.hostile_next).into_iter().filter(|id| d.bells.contains_key(id)).collect();
        for id in &ids {
            d.bells.remove(id);
            d.cut.insert(*id);
        }
        ids
    }

    fn guest_port_closed(&mut self) -> bool {
        let mut d = self.0.borrow_mut();
        let closed = std::mem::take(&mut d.port_closed_next);
        d.port_closed_fired |= closed;
        closed
    }
}

/// The fake broker line: every connect is a fresh socket pair; the harness
/// keeps the other ends, by epoch.
#[derive(Default)]
struct LineState {
    ends: Vec<(u64, OwnedFd)>,
    epoch: u64,
    fail: bool,
    /// Guest bytes are being fed: only they may make the relay connect
    /// (a frame to forward, a Reconnect).
    guest_step: bool,
}

struct FakeLine(Rc<RefCell<LineState>>);

impl BrokerLine for FakeLine {
    fn connect(&self) -> io::Result<OwnedFd> {
        let mut l = self.0.borrow_mut();
        if l.fail {
            return Err(io::Error::new(io::ErrorKind::ConnectionRefused, "fake: no broker"));
        }
        // Non-blocking like the supervisor's real line.
        let (relay_end, ours) =
            rustix::net::socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK, None)?;
        assert!(l.guest_step, "the relay opened a broker connection the guest did not ask for");
        l.epoch += 1;
        let epoch = l.epoch;
        l.ends.push((epoch, ours));
        Ok(relay_end)
    }
}

/// What the current step did, for the checks of what came out of it.
enum Cause {
    /// One whole guest message was fed (None: raw bytes that completed one
    /// message the harness could not decode itself, or none).
    Guest(Option<GuestMsg>),
    /// A broker frame was injected (its bytes, how many descriptors).
    Broker { frame: Vec<u8>, nfds: usize },
    Other,
}

/// The harness's own account of which vectors the relay has handed to the
/// broker and not got back (a connection the relay still tracks).
#[derive(Default)]
struct Model {
    /// Connect requests in flight: id → (epoch, vectors).
    pending: HashMap<u64, (u64, Vec<u16>)>,
    /// Connections the relay tracks: conn → vectors (empty for an Incoming not yet accepted).
    conns: HashMap<ConnId, Vec<u16>>,
    /// The relay's own requests in flight: id → epoch.
    own: HashMap<u64, u64>,
    /// Conn ids seen, to aim the guest's and broker's messages at.
    known_conns: Vec<ConnId>,
    next_conn: ConnId,
}

impl Model {
    fn in_use(&self) -> BTreeSet<u16> {
        self.pending.values().flat_map(|(_, v)| v.iter().copied()).chain(self.conns.values().flatten().copied()).collect()
    }
    fn reset(&mut self) {
        self.pending.clear();
        self.conns.clear();
    }
    fn epoch_ended(&mut self, epoch: u64) {
        self.pending.retain(|_, (e, _)| *e != epoch);
        self.own.retain(|_, e| *e != epoch);
    }
}

/// Result of a run, for the replay test.
#[derive(Debug, Default)]
pub struct Outcome {
    pub steps: usize,
    pub forwarded: usize,
    pub host_msgs: usize,
    pub handles: usize,
    pub broken: bool,
}

pub struct World {
    relay: Relay,
    dev: Rc<RefCell<DevState>>,
    line: Rc<RefCell<LineState>>,
    arena_file: FileId,
    model: Model,
    /// Guest link bytes fed and not yet a whole message (the harness's mirror).
    guest_partial: Vec<u8>,
    /// Bytes taken from the outbox and not yet a whole message.
    to_guest: Vec<u8>,
    /// Liveness ends the harness sent.
    sent_liveness: HashSet<FileId>,
    was_broken: bool,
    /// The next broker frame is the broker's last.
    pub die_after_send: bool,
    trace: bool,
    pub outcome: Outcome,
    /// What the last step sent the broker and the guest.
    pub last_forwarded: Vec<ClientMsg>,
    pub last_host: Vec<HostMsg>,
}

fn welcome() -> Welcome {
    Welcome {
        version: link::LINK_VERSION,
        arena: "0000:00:04.0".into(),
        arena_len: ARENA_LEN,
        doorbell: "0000:00:05.0".into(),
        vectors: VECTORS,
        own_peer: 0,
        ports: (0..PORTS).map(|p| format!("0000:{:02x}:00.0", p + 0x10)).collect(),
        max_peer_arena: MAX_PEER_ARENA,
    }
}

impl Default for World {
    fn default() -> Self {
        Self::new()
    }
}

impl World {
    pub fn new() -> World {
        let arena = memfd(ARENA_LEN);
        let arena_ro = rustix::fs::open(format!("/proc/self/fd/{}", arena.as_raw_fd()), OFlags::RDONLY | OFlags::CLOEXEC, rustix::fs::Mode::empty()).expect("reopen arena");
        let arena_file = file_id(arena_ro.as_fd());
        let mut dev = DevState::default();
        for v in 0..VECTORS {
            let (ring, qemu) = stream_pair();
            dev.own_ring_files.insert(file_id(ring.as_fd()), v);
            dev.own_rings.push((ring, qemu));
        }
        let dev = Rc::new(RefCell::new(dev));
        let line = Rc::new(RefCell::new(LineState::default()));
        let identity = Identity { name: VM_NAME.into(), arena_ro, arena_len: ARENA_LEN };
        let relay = Relay::new(welcome(), identity, Limits { connections: LIMIT }, Box::new(FakeDevices(dev.clone())), Box::new(FakeLine(line.clone())));
        World {
            relay,
            dev,
            line,
            arena_file,
            model: Model { next_conn: 100, ..Model::default() },
            guest_partial: Vec::new(),
            to_guest: Vec::new(),
            sent_liveness: HashSet::new(),
            was_broken: false,
            die_after_send: false,
            trace: std::env::var_os("FIDO_FUZZ_TRACE").is_some(),
            outcome: Outcome::default(),
            last_forwarded: Vec::new(),
            last_host: Vec::new(),
        }
    }

    pub fn relay(&self) -> &Relay {
        &self.relay
    }

    /// Makes the fake devices' peer doorbells fail (or work again).
    pub fn fail_peer_bells(&mut self, fail: bool) {
        self.dev.borrow_mut().fail_bell = fail;
    }

    /// Ports and peer doorbells the fake devices hold.
    pub fn devices_held(&self) -> (usize, usize) {
        let d = self.dev.borrow();
        (d.ports.len(), d.bells.len())
    }

    /// The broker answers Connect `id` with a connection to `PEERS[peer]`
    /// (four descriptors); returns the connection's id.
    pub fn inject_connected(&mut self, id: u64, peer: usize) -> ConnId {
        let (domain, slot, arena_len) = PEERS[peer];
        let peer = PeerInfo { domain, name: format!("peer{domain}"), slot, arena_len, uid: 1000, pid: 1 };
        let conn = self.fresh_conn();
        let fds = self.connection_fds(arena_len);
        let msg = BrokerMsg::Reply { id, body: Ok(Reply::Connected { conn, peer, block: RingBlock { offset: 0, len: 4096, entries: 64 } }) };
        self.broker_frame(fido_proto::encode(&msg).unwrap(), fds);
        conn
    }

    /// `PEERS[peer]` connects to a service of the guest (four descriptors).
    pub fn inject_incoming(&mut self, peer: usize) -> ConnId {
        let (domain, slot, arena_len) = PEERS[peer];
        let peer = PeerInfo { domain, name: format!("peer{domain}"), slot, arena_len, uid: 1000, pid: 1 };
        let conn = self.fresh_conn();
        let fds = self.connection_fds(arena_len);
        let msg = BrokerMsg::Event(Event::Incoming { conn, service: "s".into(), peer, block: RingBlock { offset: 0, len: 4096, entries: 64 } });
        self.broker_frame(fido_proto::encode(&msg).unwrap(), fds);
        conn
    }

    /// The guest sends request `id` with `bells`, whole.
    pub fn guest_request(&mut self, id: u64, body: Request, bells: Vec<u16>) {
        let frame = fido_proto::encode(&ClientMsg::Request { id, body }).unwrap();
        self.guest_msg(&GuestMsg::Frame { frame, bells }, 0);
    }

    fn log(&self, what: impl FnOnce() -> String) {
        if self.trace {
            eprintln!("[guest_link] {}", what());
        }
    }

    // ---- guest side ----------------------------------------------------

    /// Feeds guest link bytes so that each relay call completes at most one
    /// message (chunks are otherwise as the input says), checking after each.
    pub fn guest_bytes(&mut self, bytes: &[u8], chunk: usize) {
        let chunk = chunk.max(1);
        let mut rest = bytes;
        while !rest.is_empty() {
            let need = self.bytes_to_next_boundary();
            let n = rest.len().min(chunk).min(need.map_or(usize::MAX, |(n, _)| n));
            let (now, later) = rest.split_at(n);
            rest = later;
            self.guest_partial.extend_from_slice(now);
            let completed = need == Some((n, true));
            let msg = if completed {
                let body = std::mem::take(&mut self.guest_partial);
                link::decode_guest(&body[4..]).ok()
            } else {
                None
            };
            self.feed(now, Cause::Guest(msg));
        }
    }

    /// How many bytes the message being received still needs: `(n, true)`
    /// when `n` more make it whole, `(n, false)` when they complete only its
    /// length prefix; None when the prefix is bad (the relay breaks the
    /// link: feed everything).
    fn bytes_to_next_boundary(&self) -> Option<(usize, bool)> {
        let have = self.guest_partial.len();
        if have < 4 {
            return Some((4 - have, false));
        }
        let n = link::link_len(self.guest_partial[..4].try_into().unwrap()).ok()?;
        Some((4 + n - have, true))
    }

    fn feed(&mut self, bytes: &[u8], cause: Cause) {
        let before_out = self.relay.outbox().len();
        let before_dev = (self.dev.borrow().ports.clone(), self.dev.borrow().bells.clone());
        let broken_before = self.relay.broken().is_some();
        self.line.borrow_mut().guest_step = true;
        self.relay.guest_bytes(bytes);
        self.line.borrow_mut().guest_step = false;
        // A Close or Refuse ends the connection in the relay even when it
        // cannot be forwarded (no broker): so in the model.
        if let (false, Cause::Guest(Some(GuestMsg::Frame { frame, bells }))) = (broken_before, &cause) {
            if let (true, Ok(ClientMsg::Request { body: Request::Close { conn } | Request::Refuse { conn, .. }, .. })) = (bells.is_empty(), fido_proto::decode::<ClientMsg>(frame)) {
                self.model.conns.remove(&conn);
            }
        }
        if broken_before {
            assert_eq!(self.relay.outbox().len(), before_out, "guest bytes were processed after the link broke");
            let d = self.dev.borrow();
            assert!(d.ports == before_dev.0 && d.bells == before_dev.1, "guest bytes changed devices after the link broke");
        }
        self.observe(cause);
    }

    /// A message the guest sends, whole, split at `split`.
    pub fn guest_msg(&mut self, msg: &GuestMsg, split: usize) {
        let bytes = link::encode_link(msg).expect("a guest message the harness built encodes");
        let split = split.min(bytes.len());
        self.log(|| format!("guest: {msg:?} (split at {split})"));
        if split > 0 && split < bytes.len() {
            self.guest_bytes(&bytes[..split], usize::MAX);
            self.guest_bytes(&bytes[split..], usize::MAX);
        } else {
            self.guest_bytes(&bytes, usize::MAX);
        }
    }

    // ---- broker side ---------------------------------------------------

    /// Sends one broker frame with descriptors on the current broker
    /// connection, then lets the relay read it.
    pub fn broker_frame(&mut self, frame: Vec<u8>, fds: Vec<OwnedFd>) {
        self.log(|| format!("broker: {:?} with {} fds (then dies: {})", fido_proto::decode::<BrokerMsg>(&frame), fds.len(), self.die_after_send));
        let live = self.relay.broker_fd().is_some();
        let sent = live && {
            let l = self.line.borrow();
            let (_, end) = l.ends.last().expect("the relay is connected, so a line was made");
            wire::send(end.as_fd(), &frame, &fds).is_ok()
        };
        // The broker dies before the relay reads the frame: the relay reads
        // it, then finds its connection gone (the model forgets the epoch
        // once the frame's effects are checked).
        let died = if sent && std::mem::take(&mut self.die_after_send) { self.line.borrow_mut().ends.pop().map(|(e, _)| e) } else { None };
        let nfds = fds.len();
        drop(fds);
        self.relay.broker_readable();
        if sent {
            self.observe(Cause::Broker { frame, nfds });
        } else {
            self.observe(Cause::Other);
        }
        if let Some(epoch) = died {
            self.model.epoch_ended(epoch);
        }
    }

    /// The current broker connection's epoch, while the relay has one.
    fn epoch(&self) -> Option<u64> {
        self.relay.broker_fd()?;
        self.line.borrow().ends.last().map(|(e, _)| *e)
    }

    /// Four descriptors of a connection: the peer's arena, two doorbells, a
    /// liveness end (recorded, so the devices can tell them).
    fn connection_fds(&mut self, arena_len: u64) -> Vec<OwnedFd> {
        let mut fds = vec![self.arena_fd(arena_len)];
        for _ in 0..2 {
            // The peer's end is dropped: the fake never rings.
            let (bell, _peer) = stream_pair();
            self.dev.borrow_mut().sent_bells.insert(file_id(bell.as_fd()));
            fds.push(bell);
        }
        // Hang-ups are the harness's own steps (the supervisor polls for them).
        let (live, _peer) = stream_pair();
        self.sent_liveness.insert(file_id(live.as_fd()));
        fds.push(live);
        fds
    }

    fn arena_fd(&mut self, len: u64) -> OwnedFd {
        let fd = memfd(len);
        self.dev.borrow_mut().sent_arenas.insert(file_id(fd.as_fd()), len);
        fd
    }

    /// Descriptors of the wrong kind or number: memfds, sockets, a pipe.
    fn junk_fds(&mut self, n: usize, input: &mut Input<'_>) -> Vec<OwnedFd> {
        (0..n)
            .map(|_| match input.byte() % 3 {
                0 => self.arena_fd(4096),
                1 => stream_pair().0,
                _ => rustix::pipe::pipe().expect("pipe").0,
            })
            .collect()
    }

    // ---- observing -----------------------------------------------------

    /// Everything that came out of one step: the frames the relay sent the
    /// broker, the messages it queued for the guest; then the invariants.
    fn observe(&mut self, cause: Cause) {
        let forwarded = self.drain_broker_ends();
        let host_msgs = self.drain_outbox();
        self.last_forwarded = forwarded.iter().filter_map(|(_, f, _)| fido_proto::decode(f).ok()).collect();
        self.last_host = host_msgs.clone();
        // Whether the injected frame answers one of the relay's own requests
        // (decided before this step's own requests are recorded).
        let own_answer = match &cause {
            Cause::Broker { frame, .. } => matches!(fido_proto::decode::<BrokerMsg>(frame), Ok(BrokerMsg::Reply { id, .. }) if self.model.own.remove(&id).is_some()),
            _ => false,
        };
        self.check_forwarded(&cause, forwarded);
        self.check_host_msgs(&cause, &host_msgs, own_answer);
        if std::mem::take(&mut self.dev.borrow_mut().port_closed_fired) {
            self.model.reset();
        }
        self.dev.borrow_mut().cut.clear();
        self.check_invariants();
    }

    /// Reads every frame the relay wrote to any broker connection; an
    /// ended connection (the relay dropped it) ends its epoch.
    fn drain_broker_ends(&mut self) -> Vec<(u64, Vec<u8>, Vec<OwnedFd>)> {
        let mut out = Vec::new();
        let mut ended = Vec::new();
        let mut buf = vec![0u8; fido_proto::MAX_MESSAGE];
        {
            let l = self.line.borrow();
            for (epoch, end) in &l.ends {
                loop {
                    match wire::recv(end.as_fd(), &mut buf) {
                        Ok(wire::Recv::Msg { len, fds, truncated }) => {
                            assert!(!truncated, "the relay sent the broker a frame over MAX_MESSAGE");
                            out.push((*epoch, buf[..len].to_vec(), fds));
                        }
                        Ok(wire::Recv::WouldBlock) => break,
                        Ok(wire::Recv::Eof) | Err(_) => {
                            ended.push(*epoch);
                            break;
                        }
                    }
                }
            }
        }
        if !ended.is_empty() {
            self.line.borrow_mut().ends.retain(|(e, _)| !ended.contains(e));
            for e in ended {
                self.model.epoch_ended(e);
            }
        }
        out
    }

    fn drain_outbox(&mut self) -> Vec<HostMsg> {
        let n = self.relay.outbox().len();
        self.to_guest.extend_from_slice(self.relay.outbox());
        self.relay.consumed_outbox(n);
        self.parse_to_guest()
    }

    fn parse_to_guest(&mut self) -> Vec<HostMsg> {
        let mut msgs = Vec::new();
        loop {
            if self.to_guest.len() < 4 {
                break;
            }
            let n = link::link_len(self.to_guest[..4].try_into().unwrap()).unwrap_or_else(|e| panic!("the relay queued a bad link length: {e}"));
            if self.to_guest.len() < 4 + n {
                break;
            }
            let whole: Vec<u8> = self.to_guest.drain(..4 + n).collect();
            let msg = link::decode_host(&whole[4..]).unwrap_or_else(|e| panic!("the relay queued a message the guest cannot decode: {e}"));
            assert_eq!(link::encode_link(&msg).unwrap(), whole, "a host message that does not re-encode to its bytes");
            self.log(|| format!("  → guest: {msg:?}"));
            msgs.push(msg);
        }
        self.outcome.host_msgs += msgs.len();
        msgs
    }

    fn check_forwarded(&mut self, cause: &Cause, forwarded: Vec<(u64, Vec<u8>, Vec<OwnedFd>)>) {
        self.outcome.forwarded += forwarded.len();
        if matches!(cause, Cause::Guest(_)) {
            assert!(forwarded.len() <= 1, "one guest message caused {} frames to the broker", forwarded.len());
        }
        for (epoch, frame, fds) in forwarded {
            let msg: ClientMsg = fido_proto::decode(&frame).unwrap_or_else(|e| panic!("the relay sent the broker an undecodable frame: {e}"));
            self.log(|| format!("  → broker (epoch {epoch}): {msg:?} with {} fds", fds.len()));
            let (id, body) = match msg {
                ClientMsg::Heartbeat => {
                    assert!(fds.is_empty(), "a heartbeat with descriptors");
                    match cause {
                        Cause::Guest(Some(GuestMsg::Frame { bells, .. })) => assert!(bells.is_empty(), "a heartbeat with bells was forwarded"),
                        Cause::Guest(None) => {}
                        _ => panic!("the relay sent a heartbeat of its own"),
                    }
                    continue;
                }
                ClientMsg::Request { id, body } => (id, body),
            };
            let from_guest = match cause {
                Cause::Guest(_) => true,
                Cause::Broker { .. } | Cause::Other => false,
            };
            if !from_guest {
                // The relay's own requests: closing or refusing a connection
                // the VM cannot take (or is over its limit for).
                assert!(id & OWN != 0, "the relay sent a request with a guest-range id on its own: {body:?}");
                assert!(fds.is_empty(), "the relay's own request carries descriptors");
                match body {
                    Request::Close { conn } | Request::Refuse { conn, .. } => {
                        self.model.conns.remove(&conn);
                    }
                    // For the arena of a connection that failed at once,
                    // which it just unplugged (checked below: no port holds
                    // an arena the guest was not given).
                    Request::Unmapped { .. } => {}
                    other => panic!("the relay sent a request of its own that is not Close/Refuse/Unmapped: {other:?}"),
                }
                self.model.own.insert(id, epoch);
                continue;
            }
            let bells: Vec<u16> = match cause {
                Cause::Guest(Some(GuestMsg::Frame { bells, .. })) => bells.clone(),
                _ => Vec::new(),
            };
            assert!(
                !matches!(body, Request::PipeCreate | Request::PipeOnce { .. } | Request::NetOffer { .. } | Request::NetClaim | Request::NetListen),
                "a request that carries host descriptors reached the broker: {body:?}"
            );
            match &body {
                Request::Join { label, arena_len, .. } => {
                    assert_eq!(label.as_deref(), Some(VM_NAME), "a Join labelled other than the VM's name");
                    assert_eq!(*arena_len, ARENA_LEN, "a Join with another arena length");
                    assert_eq!(fds.len(), 1, "a Join with {} descriptors", fds.len());
                    assert_eq!(file_id(fds[0].as_fd()), self.arena_file, "a Join carries a file that is not the VM's arena");
                    let fl = rustix::fs::fcntl_getfl(&fds[0]).unwrap();
                    assert!(!fl.intersects(OFlags::WRONLY | OFlags::RDWR), "the VM's arena reached the broker writable");
                }
                Request::Connect { .. } | Request::Accept { .. } => {
                    assert_eq!(fds.len(), 2, "a {body:?} with {} descriptors", fds.len());
                    let vectors: Vec<u16> = fds
                        .iter()
                        .map(|fd| *self.dev.borrow().own_ring_files.get(&file_id(fd.as_fd())).unwrap_or_else(|| panic!("a {body:?} carries a descriptor that is no own ring end")))
                        .collect();
                    if let Cause::Guest(Some(_)) = cause {
                        assert_eq!(vectors, bells, "a {body:?} carries other vectors than the guest named");
                    }
                    assert!(vectors.iter().all(|v| (1..VECTORS).contains(v)), "vectors {vectors:?} outside 1..{VECTORS}");
                    assert!(vectors[0] != vectors[1], "the same vector twice: {vectors:?}");
                    let in_use = self.model.in_use();
                    if let Request::Connect { .. } = body {
                        if let Some((_, old)) = self.model.pending.get(&id) {
                            // The relay refuses a second Connect with an id in flight.
                            panic!("a second Connect with id {id} in flight (first with {old:?}) reached the broker");
                        }
                    }
                    // An Accept replaces its connection's vectors, but not
                    // with ones that connection holds (those count as in
                    // use here as in the relay).
                    let clash: Vec<u16> = vectors.iter().copied().filter(|v| in_use.contains(v)).collect();
                    assert!(clash.is_empty(), "vectors {clash:?} of a {body:?} are held by another live connection");
                    match body {
                        Request::Connect { .. } => {
                            self.model.pending.insert(id, (epoch, vectors));
                        }
                        Request::Accept { conn, .. } => {
                            self.model.conns.insert(conn, vectors);
                            self.model.known_conns.push(conn);
                        }
                        _ => unreachable!(),
                    }
                }
                other => {
                    assert!(fds.is_empty(), "a {other:?} reached the broker with {} descriptors", fds.len());
                    if let Request::Close { conn } | Request::Refuse { conn, .. } = other {
                        self.model.conns.remove(conn);
                    }
                }
            }
        }
    }

    fn check_host_msgs(&mut self, cause: &Cause, msgs: &[HostMsg], own_answer: bool) {
        let frames: Vec<&HostMsg> = msgs.iter().filter(|m| matches!(m, HostMsg::Frame { .. })).collect();
        for m in msgs {
            match m {
                HostMsg::Welcome(w) => {
                    assert_eq!(*w, welcome(), "a Welcome that is not the VM's");
                    // A Hello starts a new guest session: the relay forgot
                    // the old one's connections.
                    self.model.reset();
                }
                HostMsg::Frame { handles, .. } => {
                    self.check_handles(handles);
                    if !handles.contains(&Handle::Unsupported) {
                        let mut d = self.dev.borrow_mut();
                        for h in handles {
                            if let Handle::Arena { port, .. } = h {
                                d.announced.insert(*port);
                            }
                        }
                    }
                }
                HostMsg::Hangup { token } => assert!(*token != 0, "a hang-up of token 0"),
                _ => {}
            }
        }
        match cause {
            Cause::Broker { frame, nfds } => {
                let decoded = fido_proto::decode::<BrokerMsg>(frame).ok();
                let incoming = matches!(&decoded, Some(BrokerMsg::Event(Event::Incoming { .. })) if *nfds == 4);
                if own_answer {
                    assert!(frames.is_empty(), "an answer to the relay's own request reached the guest");
                } else if incoming && frames.is_empty() {
                    // Refused by the relay itself (cannot map it, or over the limit).
                    if let Some(BrokerMsg::Event(Event::Incoming { conn, .. })) = &decoded {
                        self.model.conns.remove(conn);
                    }
                } else {
                    assert_eq!(frames.len(), 1, "one broker frame became {} frames for the guest", frames.len());
                    let HostMsg::Frame { frame: got, handles } = frames[0] else { unreachable!() };
                    assert_eq!(got, frame, "a broker frame reached the guest changed");
                    assert_eq!(handles.len(), *nfds, "{} handles for {nfds} descriptors", handles.len());
                    self.outcome.handles += handles.len();
                    // What the relay recorded about the answer.
                    match &decoded {
                        Some(BrokerMsg::Reply { id, body: Ok(Reply::Connected { conn, .. }) }) if *nfds == 4 => {
                            let vectors = self.model.pending.remove(id).map(|(_, v)| v).unwrap_or_default();
                            self.model.conns.insert(*conn, vectors);
                            if handles.contains(&Handle::Unsupported) {
                                self.model.conns.remove(conn);
                            }
                        }
                        Some(BrokerMsg::Reply { id, .. }) => {
                            self.model.pending.remove(id);
                        }
                        _ => {}
                    }
                    if let Some(BrokerMsg::Event(Event::Incoming { conn, .. })) = &decoded {
                        self.model.conns.entry(*conn).or_default();
                    }
                }
            }
            Cause::Guest(_) | Cause::Other => {
                assert!(frames.is_empty() || matches!(cause, Cause::Guest(_)), "a broker frame reached the guest out of nowhere");
                for f in &frames {
                    // Refusals the relay answers itself carry no handles.
                    let HostMsg::Frame { handles, .. } = f else { unreachable!() };
                    assert!(handles.is_empty(), "the relay's own answer carries handles");
                }
            }
        }
    }

    fn check_handles(&self, handles: &[Handle]) {
        let usable = !handles.contains(&Handle::Unsupported);
        let d = self.dev.borrow();
        let tokens: HashSet<u64> = self.relay.liveness_fds().map(|(t, _)| t).collect();
        for h in handles {
            match *h {
                Handle::Arena { port, len } => {
                    assert!(port < PORTS, "an arena handle for port {port} of {PORTS}");
                    if usable {
                        let (plen, _) = d.ports.get(&port).unwrap_or_else(|| panic!("an arena handle for port {port}, which holds nothing"));
                        assert_eq!(*plen, len, "an arena handle says {len} bytes, port {port} holds {plen}");
                    }
                }
                Handle::Ring { peer, vector } => {
                    assert_eq!(vector, 0, "a peer doorbell handle with vector {vector}");
                    if usable {
                        assert!(d.bells.contains_key(&peer), "a doorbell handle for peer {peer}, which is not registered");
                    }
                }
                Handle::Liveness { token } => {
                    if usable {
                        assert!(tokens.contains(&token), "a liveness handle with token {token} the relay does not watch");
                    }
                }
                Handle::Unsupported => {}
            }
        }
    }

    fn check_invariants(&mut self) {
        let broken = self.relay.broken().is_some();
        assert!(broken || !self.was_broken, "the link was broken and is no longer");
        self.was_broken = broken;
        assert!(self.relay.connections() <= LIMIT, "the relay tracks {} connections, over the limit {LIMIT}", self.relay.connections());
        let d = self.dev.borrow();
        assert!(self.relay.plugged_ports() <= d.ports.len(), "the relay counts {} plugged ports, the devices hold {}", self.relay.plugged_ports(), d.ports.len());
        for port in d.ports.keys() {
            assert!(d.announced.contains(port) || d.stuck.contains(port), "port {port} holds a peer arena the guest was never given in a usable frame: nothing will unplug it");
        }
        for (_, fd) in self.relay.liveness_fds() {
            assert!(self.sent_liveness.contains(&file_id(fd)), "the relay watches a liveness socket the broker never sent");
        }
    }

    // ---- the program ---------------------------------------------------

    fn pick_conn(&mut self, input: &mut Input<'_>) -> ConnId {
        let b = input.byte();
        if b < 200 && !self.model.known_conns.is_empty() {
            self.model.known_conns[b as usize % self.model.known_conns.len()]
        } else {
            u64::from(b % 8)
        }
    }

    fn fresh_conn(&mut self) -> ConnId {
        self.model.next_conn += 1;
        self.model.known_conns.push(self.model.next_conn);
        self.model.next_conn
    }

    fn bells(input: &mut Input<'_>) -> Vec<u16> {
        let n = match input.byte() % 8 {
            0 => 0,
            1 => 1,
            2 => 3,
            3 => 9,
            _ => 2,
        };
        (0..n)
            .map(|_| {
                let b = input.byte();
                if b < 240 {
                    u16::from(b) % (VECTORS + 1)
                } else {
                    u16::from(b) << 4
                }
            })
            .collect()
    }

    fn request(&mut self, input: &mut Input<'_>) -> (Request, Vec<u16>) {
        let block = RingBlock { offset: 4096, len: 8192, entries: 64 };
        let r = match input.byte() % 16 {
            0 => Request::Join {
                name: input.pick(&["app", VM_NAME, "", "x/y"]).to_string(),
                label: input.pick(&[None, Some("root".to_string()), Some(VM_NAME.to_string()), Some(String::new())]),
                arena_len: input.pick(&[ARENA_LEN, ARENA_LEN * 2, 0, u64::MAX]),
                resume: None,
            },
            1 | 2 => Request::Connect { service: input.pick(&["s", "t"]).into(), block },
            3 | 4 => Request::Accept { conn: self.pick_conn(input), block },
            5 => Request::Close { conn: self.pick_conn(input) },
            6 => Request::Refuse { conn: self.pick_conn(input), reason: "no".into() },
            7 => {
                let (owner, slot, _) = input.pick(&PEERS);
                Request::Unmapped { slot, owner }
            }
            8 => Request::GrantSlot { slot: u32::from(input.byte() % 8) },
            9 => input.pick(&[Request::PipeCreate, Request::NetClaim, Request::NetListen, Request::NetOffer { remote: "127.0.0.1:1".parse().unwrap(), ring_len: 4096, nonce: 1 }]),
            10 => Request::Offer { service: "s".into() },
            11 => Request::Counters { counters: Default::default() },
            12 => Request::Status,
            13 => Request::Leave,
            14 => Request::Read { path: "/app/x".into() },
            _ => Request::Withdraw { service: "s".into() },
        };
        let bells = if input.byte() < 200 {
            // Mostly what the request needs.
            match r {
                Request::Connect { .. } | Request::Accept { .. } => {
                    let a = u16::from(input.byte()) % (VECTORS + 1);
                    let b = u16::from(input.byte()) % (VECTORS + 1);
                    vec![a, b]
                }
                _ => Vec::new(),
            }
        } else {
            Self::bells(input)
        };
        (r, bells)
    }

    fn guest_step(&mut self, input: &mut Input<'_>) {
        let split = usize::from(input.byte());
        let msg = match input.byte() % 12 {
            0 => GuestMsg::Hello { version: link::LINK_VERSION },
            1 => GuestMsg::Hello { version: u32::from(input.byte()) },
            2 => GuestMsg::Reconnect,
            3 => GuestMsg::Frame { frame: fido_proto::encode(&ClientMsg::Heartbeat).unwrap(), bells: Self::bells(input) },
            4 => {
                let n = usize::from(input.byte() % 32);
                GuestMsg::Frame { frame: input.bytes(n), bells: Self::bells(input) }
            }
            _ => {
                let id = match input.byte() {
                    b @ 0..=239 => u64::from(b % 16),
                    b => OWN | u64::from(b % 4),
                };
                let (body, bells) = self.request(input);
                GuestMsg::Frame { frame: fido_proto::encode(&ClientMsg::Request { id, body }).unwrap(), bells }
            }
        };
        self.guest_msg(&msg, split);
    }

    fn peer_info(&self, input: &mut Input<'_>) -> PeerInfo {
        let (domain, slot, arena_len) = input.pick(&PEERS);
        PeerInfo { domain, name: format!("peer{domain}"), slot, arena_len, uid: 1000, pid: 1 }
    }

    fn nfds(input: &mut Input<'_>, right: usize) -> usize {
        match input.byte() % 8 {
            0 => 0,
            1 => right + 1,
            2 => right.saturating_sub(1),
            _ => right,
        }
    }

    fn broker_step(&mut self, input: &mut Input<'_>) {
        let Some(_epoch) = self.epoch() else {
            // No broker connection: a guest frame makes one; the relay
            // reading a closed line is a no-op.
            self.relay.broker_readable();
            self.observe(Cause::Other);
            return;
        };
        let pending: Vec<u64> = {
            let mut p: Vec<u64> = self.model.pending.keys().copied().collect();
            p.sort();
            p
        };
        let pick_id = |input: &mut Input<'_>| -> u64 {
            let b = input.byte();
            if !pending.is_empty() && b < 220 {
                pending[b as usize % pending.len()]
            } else {
                u64::from(b % 16)
            }
        };
        let kind = input.byte() % 12;
        let (msg, fds): (BrokerMsg, Vec<OwnedFd>) = match kind {
            0..=2 => {
                let id = pick_id(input);
                let peer = self.peer_info(input);
                let n = Self::nfds(input, 4);
                // A well-behaved broker answers a Connect in flight, once.
                if n == 4 && !self.model.pending.contains_key(&id) {
                    return self.observe_nothing();
                }
                let conn = self.fresh_conn();
                let fds = if n == 4 { self.connection_fds(peer.arena_len) } else { self.junk_fds(n, input) };
                (BrokerMsg::Reply { id, body: Ok(Reply::Connected { conn, peer, block: RingBlock { offset: 0, len: 4096, entries: 64 } }) }, fds)
            }
            3 | 4 => {
                let conn = self.fresh_conn();
                let peer = self.peer_info(input);
                let n = Self::nfds(input, 4);
                let fds = if n == 4 { self.connection_fds(peer.arena_len) } else { self.junk_fds(n, input) };
                (BrokerMsg::Event(Event::Incoming { conn, service: "s".into(), peer, block: RingBlock { offset: 0, len: 4096, entries: 64 } }), fds)
            }
            5 => {
                let id = u64::from(input.byte() % 16);
                let (owner, slot, arena_len) = input.pick(&PEERS);
                let n = Self::nfds(input, 1);
                let fds = if n == 1 { vec![self.arena_fd(arena_len)] } else { self.junk_fds(n, input) };
                (BrokerMsg::Reply { id, body: Ok(Reply::Grant { owner, slot, arena_len }) }, fds)
            }
            6 => {
                let conn = if input.byte() < 30 { None } else { Some(self.pick_conn(input)) };
                (BrokerMsg::Event(Event::PeerGone { domain: 1, conn, reason: GoneReason::Exited }), Vec::new())
            }
            7 => (BrokerMsg::Event(Event::Closed { conn: self.pick_conn(input) }), Vec::new()),
            8 => {
                let id = pick_id(input);
                let code = input.pick(&[ErrorCode::Refused, ErrorCode::NoSuchService, ErrorCode::Quota]);
                (BrokerMsg::Reply { id, body: Err(RemoteError::new(code, "no")) }, Vec::new())
            }
            9 => {
                // An answer to one of the relay's own requests.
                let mut own: Vec<u64> = self.model.own.keys().copied().collect();
                own.sort();
                let id = if own.is_empty() { OWN } else { own[input.byte() as usize % own.len()] };
                let n = usize::from(input.byte() % 2);
                (BrokerMsg::Reply { id, body: Ok(Reply::Ok) }, self.junk_fds(n, input))
            }
            10 => {
                let n = usize::from(input.byte() % 3);
                let fds = self.junk_fds(n, input);
                (BrokerMsg::Event(Event::Watch { token: 1, path: "/app/x".into(), value: None }), fds)
            }
            _ => {
                // Garbage with descriptors.
                // (An empty datagram without descriptors reads as a hang-up.)
                let len = 1 + usize::from(input.byte() % 24);
                let frame = input.bytes(len);
                let n = usize::from(input.byte() % 5);
                let fds = self.junk_fds(n, input);
                return self.broker_frame(frame, fds);
            }
        };
        let frame = fido_proto::encode(&msg).unwrap();
        self.broker_frame(frame, fds);
    }

    fn observe_nothing(&mut self) {
        self.observe(Cause::Other);
    }

    pub fn step(&mut self, input: &mut Input<'_>) {
        self.outcome.steps += 1;
        match input.byte() % 16 {
            0..=4 => self.guest_step(input),
            5..=9 => self.broker_step(input),
            10 => {
                // Raw guest bytes, in chunks.
                let n = usize::from(input.byte() % 48);
                let chunk = usize::from(input.byte() % 16) + 1;
                let bytes = input.bytes(n);
                self.log(|| format!("guest raw: {bytes:?}"));
                self.guest_bytes(&bytes, chunk);
            }
            11 => {
                // The broker hangs up.
                self.log(|| "broker hangs up".into());
                if self.relay.broker_fd().is_some() {
                    if let Some((epoch, _)) = self.line.borrow_mut().ends.pop() {
                        self.model.epoch_ended(epoch);
                    }
                }
                self.relay.broker_readable();
                self.observe(Cause::Other);
            }
            12 => {
                // A liveness socket hung up (one the relay watches, or any token).
                let mut tokens: Vec<u64> = self.relay.liveness_fds().map(|(t, _)| t).collect();
                tokens.sort();
                let b = input.byte();
                let token = if !tokens.is_empty() && b < 200 { tokens[b as usize % tokens.len()] } else { u64::from(b % 8) };
                let watched = tokens.contains(&token);
                self.log(|| format!("liveness {token} hangs up (watched: {watched})"));
                self.relay.liveness_hangup(token);
                let n = self.relay.outbox().len();
                let msgs = {
                    self.to_guest.extend_from_slice(self.relay.outbox());
                    self.relay.consumed_outbox(n);
                    self.parse_to_guest()
                };
                assert_eq!(msgs, if watched { vec![HostMsg::Hangup { token }] } else { vec![] }, "a liveness hang-up");
                assert!(!self.relay.liveness_fds().any(|(t, _)| t == token), "a hung-up liveness socket is still watched");
                self.observe(Cause::Other);
            }
            13 => {
                // A tick: the guest may have closed its port; peers' doorbells may be hostile.
                let b = input.byte();
                {
                    let mut d = self.dev.borrow_mut();
                    d.port_closed_next = b & 1 != 0;
                    let ids: Vec<u16> = d.bells.keys().copied().collect();
                    d.hostile_next = ids.into_iter().enumerate().filter(|(i, _)| b >> (1 + i % 7) & 1 != 0).map(|(_, id)| id).collect();
                }
                self.log(|| format!("tick (port closed: {}, hostile: {:?})", b & 1 != 0, self.dev.borrow().hostile_next));
                self.relay.tick();
                self.observe(Cause::Other);
            }
            14 => {
                let b = input.byte();
                {
                    let mut d = self.dev.borrow_mut();
                    d.fail_plug = b & 1 != 0;
                    d.fail_unplug = b & 2 != 0;
                    d.fail_bell = b & 4 != 0;
                    d.fail_own_ring = b & 8 != 0;
                }
                self.line.borrow_mut().fail = b & 16 != 0;
                self.log(|| format!("failures: {b:#x}"));
            }
            _ => {
                self.die_after_send = true;
                self.broker_step(input);
                self.die_after_send = false;
            }
        }
    }
}

/// Runs a program. Panics on a violation of the property.
pub fn run(data: &[u8]) -> Outcome {
    let mut world = World::new();
    let mut input = Input::new(data);
    while !input.done() && world.outcome.steps < 256 {
        world.step(&mut input);
    }
    world.outcome.broken = world.relay.broken().is_some();
    world.outcome
}
