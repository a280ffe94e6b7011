//! A domain: this process's membership in a Fido broker, its arena, its view of
//! the PGVAS window, and the registry.
//!
//! The parts its channels use are in [`crate::local_domain`] (arena, address
//! space, broker line) and [`crate::channel::Connections`] (the channels): the
//! channel never depends on this module.

use crate::channel::{Channel, ConnShared, Connections, Incoming};
use std::sync::OnceLock;
use crate::control::Control;
use crate::error::{Error, InvalidArgument, Result};
use fido_control::Handler;
use fido_proto::{ConnId, Counters, DomainId, Event, GoneReason, Reply, Request, Resume, ResumeSecret, Status, TxnOp};
use fido_ring::WaitStrategy;
use crate::local_domain::LocalDomain;
use crate::platform::Platform;
use fido_shm::{AddressMode, AddressSpace, Arena, Buf, ModeRequest, UnplacedArena};
use parking_lot::{Condvar, Mutex};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Weak};
use std::time::{Duration, Instant};

/// How to join.
#[derive(Debug, Clone)]
pub struct JoinOptions {
    /// A human-readable name (shown by `fido status`).
    pub name: String,
    /// Optional label the broker's policy may match.
    pub label: Option<String>,
    /// Size of the exportable arena (sparse; default 1 GiB).
    pub arena_len: u64,
    /// Touch every arena page at join so the data path never page-faults.
    pub prefault: bool,
    /// PGVAS (default) or forced pointer swizzling.
    pub address_mode: ModeRequest,
    /// Broker socket; default: `FIDO_BROKER`, `$XDG_RUNTIME_DIR/fido/broker.sock`, `/run/fido/broker.sock`.
    pub broker: Option<PathBuf>,
    /// Descriptors per ring direction (power of two; also the in-flight window).
    pub ring_entries: u32,
    /// Default wait strategy of new channels.
    pub wait: WaitStrategy,
    /// How long a request waits for the broker's reply (`None`: 15 s).
    pub request_timeout: Option<Duration>,
    /// How long a request waits for the link while the domain reconnects to
    /// a restarted broker (`None`: the request timeout; zero: fail at once).
    pub link_wait: Option<Duration>,
}

impl JoinOptions {
    pub fn new(name: impl Into<String>) -> JoinOptions {
        JoinOptions {
            name: name.into(),
            label: None,
            arena_len: 1 << 30,
            prefault: false,
            address_mode: ModeRequest::Auto,
            broker: None,
            ring_entries: 256,
            wait: WaitStrategy::default(),
            request_timeout: None,
            link_wait: None,
        }
    }
    pub fn request_timeout(mut self, t: Duration) -> Self {
        self.request_timeout = Some(t);
        self
    }
    pub fn link_wait(mut self, t: Duration) -> Self {
        self.link_wait = Some(t);
        self
    }
    pub fn arena_len(mut self, len: u64) -> Self {
        self.arena_len = len;
        self
    }
    pub fn prefault(mut self, on: bool) -> Self {
        self.prefault = on;
        self
    }
    pub fn swizzle(mut self, on: bool) -> Self {
        self.address_mode = if on { ModeRequest::ForceSwizzle } else { ModeRequest::Auto };
        self
    }
    pub fn broker(mut self, path: impl Into<PathBuf>) -> Self {
        self.broker = Some(path.into());
        self
    }
    pub fn ring_entries(mut self, n: u32) -> Self {
        self.ring_entries = n;
        self
    }
    pub fn wait(mut self, w: WaitStrategy) -> Self {
        self.wait = w;
        self
    }
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }
}

/// The state of a domain's link to the broker ([`Domain::broker_link`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerLink {
    /// Connected; `reconnects` counts the broker restarts the domain
    /// resumed after (a change means the new broker forgot what only the
    /// old one kept, e.g. MMNet's listeners).
    Up { reconnects: u64 },
    /// The broker went away; the control thread reconnects in the background
    /// (requests wait up to [`JoinOptions::link_wait`] for it).
    Reconnecting,
    /// For good: the broker refused to resume this domain, or it left.
    Ended,
}

/// A registry change seen by a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    pub path: String,
    /// `None`: the key was deleted.
    pub value: Option<Vec<u8>>,
}

/// A live prefix watch. Dropping it unregisters it.
pub struct Watch {
    token: u64,
    rx: mpsc::Receiver<WatchEvent>,
    domain: Weak<DomainInner>,
}

impl Watch {
    pub fn recv_timeout(&self, timeout: Duration) -> Option<WatchEvent> {
        self.rx.recv_timeout(timeout).ok()
    }
    pub fn try_recv(&self) -> Option<WatchEvent> {
        self.rx.try_recv().ok()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(d) = self.domain.upgrade() {
            d.watches.lock().remove(&self.token);
            d.control.notify(Request::Unwatch { token: self.token });
        }
    }
}

/// Connections to one service, already set up by the control thread and
/// waiting for the application to pick them up (a listen backlog: a client's
/// `connect` completes without waiting for the server to call `accept`).
pub(crate) struct Backlog {
    queue: Mutex<VecDeque<Channel>>,
    ready: Condvar,
}

/// Accepts connections to a service this domain offers. Dropping it withdraws
/// the service.
pub struct Listener {
    service: String,
    backlog: Arc<Backlog>,
    domain: Domain,
}

impl Listener {
    pub fn service(&self) -> &str {
        &self.service
    }

    /// Waits for the next connection and completes it.
    pub fn accept(&self) -> Result<Channel> {
        self.accept_until(None)
    }

    pub fn accept_timeout(&self, timeout: Duration) -> Result<Channel> {
        self.accept_until(Some(Instant::now() + timeout))
    }

    fn accept_until(&self, deadline: Option<Instant>) -> Result<Channel> {
        let channel = {
            let mut q = self.backlog.queue.lock();
            loop {
                if let Some(i) = q.pop_front() {
                    break i;
                }
                match deadline {
                    Some(d) => {
                        if self.backlog.ready.wait_until(&mut q, d).timed_out() && q.is_empty() {
                            return Err(Error::Timeout);
                        }
                    }
                    None => self.backlog.ready.wait(&mut q),
                }
            }
        };
        Ok(channel)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.domain.inner.services.lock().remove(&self.service);
        self.domain.inner.control.notify(Request::Withdraw { service: self.service.clone() });
    }
}

/// This process's membership in a broker. Cheap to clone; the domain leaves
/// when the last clone and the last channel are gone (or on [`Domain::leave`]).
#[derive(Clone)]
pub struct Domain {
    pub(crate) inner: Arc<DomainInner>,
}

struct Watcher {
    prefix: String,
    tx: mpsc::Sender<WatchEvent>,
}

/// A joined domain: what its channels use (`local`, `conns`) and what only
/// the domain itself does (services, watches, the broker's events).
pub(crate) struct DomainInner {
    pub(crate) id: DomainId,
    pub(crate) slot: u32,
    /// What proves this domain to a restarted broker (from its first Joined).
    resume_secret: ResumeSecret,
    /// The arena, address space and broker line, shared with the channels.
    pub(crate) local: Arc<LocalDomain>,
    pub(crate) control: Arc<Control>,
    pub(crate) opts: JoinOptions,
    services: Mutex<HashMap<String, Arc<Backlog>>>,
    /// This domain's channels.
    pub(crate) conns: Arc<Connections>,
    watches: Mutex<HashMap<u64, Watcher>>,
    next_token: AtomicU64,
    /// Counters as last sent to the broker.
    published: Mutex<Counters>,
    /// Ourselves, for the control thread (which sets up accepted channels).
    this: OnceLock<Weak<DomainInner>>,
}

/// A client's segment handed to the server of its connection ([`Domain::net_claim`]).
#[derive(Debug)]
pub struct NetClaim {
    /// The segment (memfd, read-write).
    pub segment: OwnedFd,
    /// Ring bytes per direction, as the client offered.
    pub ring_len: u64,
    /// The nonce the client wrote in the segment's header.
    pub nonce: u64,
    /// Set when the `net` policy refuses this server acceleration: abandon
    /// the segment at once (both ends then speak plain TCP).
    pub refusal: Option<String>,
}

impl Domain {
    /// Joins the broker: creates and seals the arena, registers, reserves the
    /// PGVAS window and places the arena in the slot the broker assigned.
    pub fn join(opts: JoinOptions) -> Result<Domain> {
        if !opts.ring_entries.is_power_of_two() || opts.ring_entries < 2 || opts.ring_entries > 1 << 16 {
            return Err(InvalidArgument::RingEntries(opts.ring_entries).into());
        }
        fido_proto::check_name(&opts.name).map_err(|e| InvalidArgument::Name(e.to_string()))?;
        let explicit = opts.broker.is_some() || std::env::var_os("FIDO_BROKER").is_some_and(|b| !b.is_empty());
        let guest_port = if explicit { None } else { fido_guest::Guest::detect() };
        let timeouts = crate::control::Timeouts { request: opts.request_timeout, link_wait: opts.link_wait };
        let (control, joined, arena, space, platform) = match guest_port {
            None => {
                let path = opts.broker.clone().unwrap_or_else(fido_proto::default_broker_path);
                let unplaced = UnplacedArena::create(opts.arena_len, opts.prefault)?;
                let join = Request::Join { name: opts.name.clone(), label: opts.label.clone(), arena_len: unplaced.len(), resume: None };
                let (control, joined) = Control::join(path, join, unplaced.ro_fd()?, timeouts)?;
                let space = Arc::new(AddressSpace::new(joined.geometry, opts.address_mode)?);
                let arena = unplaced.place(&space, joined.slot, joined.domain)?;
                (control, joined, arena, space, Platform::Host)
            }
            // Inside a VM: the broker is reached through the VM's supervisor,
            // and the arena is the VM's own (its size was fixed when the VM
            // started; `arena_len` does not apply).
            Some(port) => {
                let guest = fido_guest::Guest::open(&port).map_err(|e| Error::broker_protocol(format!("VM guest: {e}")))?;
                let (arena_fd, arena_len) = guest.own_arena().map_err(|e| Error::broker_protocol(format!("VM guest: {e}")))?;
                let join = Request::Join { name: opts.name.clone(), label: opts.label.clone(), arena_len, resume: None };
                let (control, joined) = Control::join_through(guest.connector(), join, Vec::new(), timeouts)?;
                let space = Arc::new(AddressSpace::new(joined.geometry, opts.address_mode)?);
                let arena = fido_shm::Arena::place_device(&space, joined.slot, joined.domain, arena_fd, arena_len)?;
                (control, joined, arena, space, Platform::Guest(guest))
            }
        };
        let (domain, slot) = (joined.domain, joined.slot);
        let control = Arc::new(control);
        let local = Arc::new(LocalDomain::new(space, arena, control.clone(), (opts.ring_entries, opts.wait), platform));
        let inner = Arc::new(DomainInner {
            id: domain,
            slot,
            resume_secret: joined.resume_secret,
            conns: Arc::new(Connections::new(local.clone())),
            local,
            control,
            opts,
            services: Mutex::new(HashMap::new()),
            watches: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(1),
            published: Mutex::new(Counters::default()),
            this: OnceLock::new(),
        });
        let _ = inner.this.set(Arc::downgrade(&inner));
        let weak: Weak<dyn Handler> = Arc::downgrade(&inner) as Weak<dyn Handler>;
        inner.control.start(weak, format!("fido-control-{domain}"))?;
        tracing::debug!(domain, slot, mode = ?inner.local.space.mode(), "joined");
        Ok(Domain { inner })
    }

    pub fn id(&self) -> DomainId {
        self.inner.id
    }
    pub fn slot(&self) -> u32 {
        self.inner.slot
    }
    pub fn name(&self) -> &str {
        &self.inner.opts.name
    }
    /// Whether global pointers are used as they are (PGVAS) or translated.
    pub fn address_mode(&self) -> AddressMode {
        self.inner.local.space.mode()
    }
    pub fn arena(&self) -> &Arc<Arena> {
        &self.inner.local.arena
    }
    pub fn address_space(&self) -> &Arc<AddressSpace> {
        &self.inner.local.space
    }

    /// Allocates a message buffer in this domain's arena.
    pub fn alloc(&self, len: usize) -> Result<Buf> {
        Ok(self.inner.local.arena.alloc(len)?)
    }

    /// Allocates a buffer holding a copy of `bytes` (counted as copied bytes).
    pub fn alloc_copy(&self, bytes: &[u8]) -> Result<Buf> {
        let mut buf = self.alloc(bytes.len().max(1))?;
        buf.truncate(bytes.len().max(1));
        buf[..bytes.len()].copy_from_slice(bytes);
        buf.truncate(bytes.len());
        self.inner.local.bytes_copied.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(buf)
    }

    /// Offers a service by name.
    pub fn offer(&self, service: &str) -> Result<Listener> {
        let backlog = Arc::new(Backlog { queue: Mutex::new(VecDeque::new()), ready: Condvar::new() });
        self.inner.services.lock().insert(service.to_string(), backlog.clone());
        if let Err(e) = self.inner.control.request(Request::Offer { service: service.into() }, &[]) {
            self.inner.services.lock().remove(service);
            return Err(e);
        }
        Ok(Listener { service: service.into(), backlog, domain: self.clone() })
    }

    /// Connects to a service offered by some domain.
    pub fn connect(&self, service: &str) -> Result<Channel> {
        Channel::connect(&self.inner.conns, self.inner.clone(), service)
    }

    /// Counters of this domain's data path (all channels, past and present).
    pub fn counters(&self) -> Counters {
        self.inner.conns.counters()
    }

    /// The state of this domain's link to the broker now.
    pub fn broker_link(&self) -> BrokerLink {
        let c = &self.inner.control;
        if c.ended() {
            BrokerLink::Ended
        } else if c.connected() {
            BrokerLink::Up { reconnects: c.reconnects() }
        } else {
            BrokerLink::Reconnecting
        }
    }

    /// Sends this domain's counters to the broker (shown by `fido status`).
    pub fn publish_counters(&self) -> Result<()> {
        self.inner.control.request(Request::Counters { counters: self.counters() }, &[])?;
        Ok(())
    }

    /// Broker-wide status, as far as this domain's uid may see it (every
    /// page of it).
    pub fn status(&self) -> Result<Status> {
        Status::collect(|req| match self.inner.control.request(req, &[])?.0 {
            Reply::Status(s) => Ok(s),
            other => Err(Error::broker_protocol(format!("unexpected reply {other:?}"))),
        })
    }

    // ---- registry ----

    pub fn read(&self, path: &str) -> Result<Option<Vec<u8>>> {
        match self.inner.control.request(Request::Read { path: path.into() }, &[])?.0 {
            Reply::Value(v) => Ok(v),
            other => Err(Error::broker_protocol(format!("unexpected reply {other:?}"))),
        }
    }
    pub fn write(&self, path: &str, value: &[u8]) -> Result<()> {
        self.inner.control.request(Request::Write { path: path.into(), value: value.to_vec() }, &[])?;
        Ok(())
    }
    /// Names of the children of `path`, sorted (every page of them: a
    /// directory others filled with keys never makes the answer too large).
    pub fn list(&self, path: &str) -> Result<Vec<String>> {
        fido_proto::ListCursor::walk(path, |req| match self.inner.control.request(req, &[])?.0 {
            Reply::KeysPage { keys, next } => Ok((keys, next)),
            other => Err(Error::broker_protocol(format!("unexpected reply {other:?}"))),
        })
    }
    /// Deletes a key and its subtree.
    pub fn delete(&self, path: &str) -> Result<()> {
        self.inner.control.request(Request::Delete { path: path.into() }, &[])?;
        Ok(())
    }
    /// Runs a multi-key transaction: all checks hold and every write applies, or
    /// nothing changes. Returns whether it committed and the values read.
    pub fn transact(&self, ops: Vec<TxnOp>) -> Result<(bool, Vec<Option<Vec<u8>>>)> {
        match self.inner.control.request(Request::Transaction { ops }, &[])?.0 {
            Reply::Txn { committed, reads } => Ok((committed, reads)),
            other => Err(Error::broker_protocol(format!("unexpected reply {other:?}"))),
        }
    }
    /// Watches a key prefix (component-wise): every write or delete at or under
    /// it arrives on the returned [`Watch`].
    pub fn watch(&self, prefix: &str) -> Result<Watch> {
        let token = self.inner.next_token.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        self.inner.watches.lock().insert(token, Watcher { prefix: prefix.into(), tx });
        if let Err(e) = self.inner.control.request(Request::Watch { token, prefix: prefix.into() }, &[]) {
            self.inner.watches.lock().remove(&token);
            return Err(e);
        }
        Ok(Watch { token, rx, domain: Arc::downgrade(&self.inner) })
    }

    // ---- MMNet (fido-net's co-location handshake, checked by the broker) ----

    /// Offers the segment `segment` (a memfd sealed against shrinking and
    /// growing, `ring_len` bytes per direction, header nonce `nonce`) for the
    /// connection TCP socket `socket` (bound, not yet connected) is about to
    /// open to `remote`. Returns the offer's id (for [`Domain::net_withdraw`]).
    pub fn net_offer(
        &self,
        socket: BorrowedFd<'_>,
        segment: BorrowedFd<'_>,
        remote: std::net::SocketAddr,
        ring_len: u64,
        nonce: u64,
    ) -> Result<u64> {
        let fds = [rustix::io::fcntl_dupfd_cloexec(socket, 0)?, rustix::io::fcntl_dupfd_cloexec(segment, 0)?];
        match self.inner.control.request(Request::NetOffer { remote, ring_len, nonce }, &fds)?.0 {
            Reply::NetOffered { offer } => Ok(offer),
            other => Err(Error::broker_protocol(format!("unexpected reply {other:?}"))),
        }
    }

    /// Withdraws an offer of this domain that nobody claimed.
    pub fn net_withdraw(&self, offer: u64) -> Result<()> {
        self.inner.control.request(Request::NetWithdraw { offer }, &[])?;
        Ok(())
    }

    /// Claims the offer of the client of accepted TCP socket `socket`: the
    /// broker hands over the segment only if the kernel shows the offering
    /// socket is the other end of this connection.
    pub fn net_claim(&self, socket: BorrowedFd<'_>) -> Result<NetClaim> {
        let fds = [rustix::io::fcntl_dupfd_cloexec(socket, 0)?];
        let (reply, mut got) = self.inner.control.request(Request::NetClaim, &fds)?;
        match reply {
            Reply::NetClaimed { ring_len, nonce, refusal } if got.len() == 1 => {
                Ok(NetClaim { segment: got.pop().expect("one descriptor"), ring_len, nonce, refusal })
            }
            other => Err(Error::broker_protocol(format!("unexpected reply {other:?} with {} descriptors", got.len()))),
        }
    }

    /// Publishes listening TCP socket `socket` (the broker writes the key
    /// under `/net/listen`, from what the kernel says about the socket).
    pub fn net_listen(&self, socket: BorrowedFd<'_>) -> Result<String> {
        let fds = [rustix::io::fcntl_dupfd_cloexec(socket, 0)?];
        match self.inner.control.request(Request::NetListen, &fds)?.0 {
            Reply::NetListening { key } => Ok(key),
            other => Err(Error::broker_protocol(format!("unexpected reply {other:?}"))),
        }
    }

    /// Withdraws a listener this domain published.
    pub fn net_unlisten(&self, key: &str) -> Result<()> {
        self.inner.control.request(Request::NetUnlisten { key: key.into() }, &[])?;
        Ok(())
    }

    /// Leaves the broker now. Open channels report `PeerGone` to their peers.
    pub fn leave(self) -> Result<()> {
        self.inner.control.leave(Duration::from_secs(2))
    }
}

impl DomainInner {
    fn peer_gone(&self, domain: DomainId, conn: Option<ConnId>, reason: GoneReason) {
        // A revoked connection ends only that connection: its peer lives on.
        if reason != GoneReason::Revoked {
            self.local.note_dead(domain);
        }
        for c in self.conns.live() {
            if conn.map_or(c.peer.domain == domain, |id| id == c.conn) {
                c.mark_gone(reason);
            }
        }
    }
}

impl Handler for DomainInner {
    fn event(&self, event: Event, fds: Vec<OwnedFd>) {
        match event {
            Event::Incoming { conn, service, peer, block } => {
                let backlog = self.services.lock().get(&service).cloned();
                let me = self.this.get().and_then(Weak::upgrade);
                match (backlog, me) {
                    (Some(b), Some(me)) => match Channel::accept(&self.conns, me, Incoming { conn, service, peer, block, fds }) {
                        Ok(ch) => {
                            b.queue.lock().push_back(ch);
                            b.ready.notify_one();
                        }
                        Err(e) => tracing::warn!(conn, "could not accept connection: {e}"),
                    },
                    _ => self.control.notify(Request::Refuse { conn, reason: "service withdrawn".into() }),
                }
            }
            Event::PeerGone { domain, conn, reason } => self.peer_gone(domain, conn, reason),
            Event::Closed { conn } => {
                if let Some(c) = self.conns.get(conn) {
                    c.wake_local();
                }
            }
            Event::Watch { token, path, value } => {
                if let Some(w) = self.watches.lock().get(&token) {
                    let _ = w.tx.send(WatchEvent { path, value });
                }
            }
        }
    }

    fn rejoin(&self) -> fido_control::Result<(Request, Vec<OwnedFd>)> {
        let conns: Vec<Arc<ConnShared>> = self.conns.live();
        let resume = Resume {
            domain: self.id,
            slot: self.slot,
            services: self.services.lock().keys().cloned().collect(),
            // Dead owners' arenas we still map too: the new broker must keep
            // those slots pinned until we unmap them.
            mapped: self.local.mapped.lock().iter().map(|(s, m)| (*s, m.owner)).collect(),
            connections: conns.iter().filter(|c| c.is_open()).map(|c| (c.conn, c.peer.domain, c.service.clone())).collect(),
            watches: self.watches.lock().iter().map(|(t, w)| (*t, w.prefix.clone())).collect(),
            secret: self.resume_secret,
        };
        let join = Request::Join {
            name: self.opts.name.clone(),
            label: self.opts.label.clone(),
            arena_len: self.local.arena.len(),
            resume: Some(resume),
        };
        // A guest's supervisor attaches the VM's arena itself.
        if self.local.platform.is_guest() {
            return Ok((join, Vec::new()));
        }
        let arena = self.local.arena.ro_fd().map_err(|e| fido_control::ControlError::Io(std::io::Error::other(e)))?;
        Ok((join, vec![arena]))
    }

    fn tick(&self) {
        self.conns.sweep_lingering();
        self.local.sweep_mappings();
        // Keep `fido status` current: publish the counters when they changed.
        let now = self.conns.counters();
        let mut last = self.published.lock();
        if *last != now {
            *last = now;
            self.control.notify(Request::Counters { counters: now });
        }
    }
}

impl Drop for DomainInner {
    fn drop(&mut self) {
        self.control.stop();
    }
}
