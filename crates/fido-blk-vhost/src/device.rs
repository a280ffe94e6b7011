//! The back end: the vhost-user device (one per front-end connection), the
//! requests in flight, the completion thread and the serving loop.
//!
//! Threads: `vhost-user-backend` runs one thread per connection for the
//! vhost-user messages and one vring worker that calls
//! [`ConnBackend::handle_event`] on a kick; that worker pops chains, checks
//! them and submits fido-blk requests, never holding a vring lock while it
//! submits. One completion thread, shared by every connection, takes the
//! replies in any order, copies read data into the guest, writes the status,
//! puts the chain on the used ring and notifies the guest once per batch.

use std::collections::HashMap;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fido::Msg;
use fido_blk::{BlkClient, BlkError, Completion};
use parking_lot::{Condvar, Mutex};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::vhost_user::Listener;
use vhost_user_backend::{VhostUserBackend, VhostUserDaemon, VringRwLock, VringT};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK};
use virtio_queue::{DescriptorChain, QueueT};
use vm_memory::{
    Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap,
    VolatileSlice,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::virtio::{self, Desc, Kind, Limits, Seg, ID_BYTES};

type Memory = GuestMemoryAtomic<GuestMemoryMmap>;
type Vring = VringRwLock<Memory>;

/// How long a vring stop (the front end's GET_VRING_BASE) waits for the
/// queue's requests in flight before it gives up on them.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a write waits for arena space before the request fails.
const ALLOC_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the serving loop looks at its stop flag.
const POLL: Duration = Duration::from_millis(100);
const STATUS_OK: u8 = VIRTIO_BLK_S_OK as u8;
const STATUS_IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;

/// How the device is presented to the guest.
#[derive(Clone, Debug)]
pub struct VhostBlkOptions {
    /// Virtqueues (the guest may use fewer; QEMU's `num-queues` must not exceed it).
    pub num_queues: u16,
    /// The largest virtqueue the front end may set up (QEMU's `queue-size`).
    pub queue_size: u16,
    /// Present the disk read-only even if the storage domain allows writes.
    pub read_only: bool,
    /// GET_ID's answer (at most 20 bytes are used); default `fido:NAME`.
    pub serial: Option<String>,
}

impl Default for VhostBlkOptions {
    fn default() -> Self {
        VhostBlkOptions {
            num_queues: 1,
            queue_size: 256,
            read_only: false,
            serial: None,
        }
    }
}

/// Why the back end could not start or serve.
#[derive(Debug, thiserror::Error)]
pub enum VhostError {
    #[error("invalid option: {0}")]
    Invalid(String),
    #[error("socket {path}: {error}")]
    Socket { path: PathBuf, error: io::Error },
    #[error("vhost-user: {0}")]
    Vhost(String),
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Counters since the back end started (every connection together).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Front ends (QEMU) that connected.
    pub connections: u64,
    /// Descriptor chains taken from the virtqueues.
    pub requests: u64,
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub discards: u64,
    pub write_zeroes: u64,
    pub get_ids: u64,
    /// Chains answered with an error status (refused by validation or failed).
    pub errors: u64,
    /// Chains with no device-writable status byte: returned unanswered.
    pub unanswerable: u64,
    /// Write payload bytes copied from guest memory into arena buffers (one copy).
    pub bytes_copied_from_guest: u64,
    /// Read data bytes copied from the storage domain's buffers into guest memory (one copy).
    pub bytes_copied_to_guest: u64,
    /// fido-blk requests sent to the storage domain.
    pub fido_requests: u64,
}

#[derive(Default)]
struct Counters {
    connections: AtomicU64,
    requests: AtomicU64,
    reads: AtomicU64,
    writes: AtomicU64,
    flushes: AtomicU64,
    discards: AtomicU64,
    write_zeroes: AtomicU64,
    get_ids: AtomicU64,
    errors: AtomicU64,
    unanswerable: AtomicU64,
    bytes_copied_from_guest: AtomicU64,
    bytes_copied_to_guest: AtomicU64,
    fido_requests: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A virtqueue of one connection, with its requests in flight (a vring
/// stop waits for them).
struct QueueTrack {
    vring: Vring,
    in_flight: Mutex<usize>,
    idle: Condvar,
}

impl QueueTrack {
    /// Returns a finished chain to the guest (without notifying it).
    fn put_used(&self, head: u16, len: u32) {
        if let Err(e) = self.vring.add_used(head, len) {
            tracing::warn!(error = %e, head, "vhost-user-blk: returning a chain to the used ring");
        }
    }

    /// Tells the guest about the chains returned, if it wants to hear.
    fn notify(&self) {
        match self.vring.needs_notification() {
            Ok(true) => {
                if let Err(e) = self.vring.signal_used_queue() {
                    tracing::debug!(error = %e, "vhost-user-blk: signalling the guest");
                }
            }
            Ok(false) => {}
            Err(e) => tracing::debug!(error = %e, "vhost-user-blk: reading the used event index"),
        }
    }

    fn done(&self) {
        let mut n = self.in_flight.lock();
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.idle.notify_all();
        }
    }
}

/// A guest request split into fido-blk requests.
struct Pending {
    track: Arc<QueueTrack>,
    mem: Arc<GuestMemoryMmap>,
    head: u16,
    status: GuestAddress,
    /// READ: where the data goes (the chain's device-writable buffers, status excluded).
    data: Vec<Seg>,
    /// Bytes written into the chain on success (data and status).
    used_ok: u32,
    /// (fido-blk requests not yet completed, status so far).
    state: Mutex<(usize, u8)>,
}

/// One fido-blk request of a [`Pending`]: its bytes `at..at+len` of the guest request.
struct Sub {
    req: Arc<Pending>,
    at: u64,
    len: u64,
}

/// State shared by every connection and the completion thread.
struct Inner {
    client: BlkClient,
    limits: Limits,
    id: [u8; ID_BYTES],
    id_len: usize,
    next_id: AtomicU64,
    in_flight: Mutex<HashMap<u64, Sub>>,
    counters: Counters,
    stopping: AtomicBool,
}

/// A vhost-user-blk back end for one block service: [`VhostBlk::serve`]
/// listens on a Unix socket and serves one front end at a time, again and
/// again.
pub struct VhostBlk {
    inner: Arc<Inner>,
    completer: Option<JoinHandle<()>>,
}

impl VhostBlk {
    /// A back end that sends the guest's requests through `client`.
    pub fn new(client: BlkClient, opts: &VhostBlkOptions) -> Result<VhostBlk, VhostError> {
        if opts.num_queues == 0 || opts.num_queues > 64 {
            return Err(VhostError::Invalid(format!(
                "{} queues (1..=64)",
                opts.num_queues
            )));
        }
        if !opts.queue_size.is_power_of_two() || !(2..=1024).contains(&opts.queue_size) {
            return Err(VhostError::Invalid(format!(
                "queue size {} (a power of two, 2..=1024)",
                opts.queue_size
            )));
        }
        let info = client.info();
        let limits = Limits {
            capacity: info.size,
            logical_block: info.logical_block,
            max_transfer: info.max_transfer,
            read_only: opts.read_only || info.read_only(),
            flush: info.flags & fido_blk::proto::INFO_FLUSH != 0,
            discard: info.flags & fido_blk::proto::INFO_DISCARD != 0,
            write_zeroes: info.flags & fido_blk::proto::INFO_WRITE_ZEROES != 0,
            num_queues: opts.num_queues,
            queue_size: opts.queue_size,
        };
        let serial = opts
            .serial
            .clone()
            .unwrap_or_else(|| format!("fido:{}", client.name()));
        let mut id = [0u8; ID_BYTES];
        let id_len = serial.len().min(ID_BYTES);
        id[..id_len].copy_from_slice(&serial.as_bytes()[..id_len]);
        let inner = Arc::new(Inner {
            client,
            limits,
            id,
            id_len,
            next_id: AtomicU64::new(1),
            in_flight: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            stopping: AtomicBool::new(false),
        });
        let worker = inner.clone();
        let completer = std::thread::Builder::new()
            .name("vhost-blk-complete".into())
            .spawn(move || worker.complete_loop())?;
        Ok(VhostBlk {
            inner,
            completer: Some(completer),
        })
    }

    /// The device as the guest sees it.
    pub fn limits(&self) -> Limits {
        self.inner.limits
    }

    pub fn stats(&self) -> Stats {
        let c = &self.inner.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Stats {
            connections: g(&c.connections),
            requests: g(&c.requests),
            reads: g(&c.reads),
            writes: g(&c.writes),
            flushes: g(&c.flushes),
            discards: g(&c.discards),
            write_zeroes: g(&c.write_zeroes),
            get_ids: g(&c.get_ids),
            errors: g(&c.errors),
            unanswerable: g(&c.unanswerable),
            bytes_copied_from_guest: g(&c.bytes_copied_from_guest),
            bytes_copied_to_guest: g(&c.bytes_copied_to_guest),
            fido_requests: g(&c.fido_requests),
        }
    }

    /// Listens on `socket` (a stale socket file there is replaced; anything
    /// else is an error) and serves one front end at a time until `stop`
    /// is set; a front end that disconnects (QEMU quit or was killed) is
    /// followed by the next on the same socket. The socket file is removed
    /// on return. `on_listening` runs once the socket accepts connections.
    pub fn serve(
        &self,
        socket: &Path,
        stop: &AtomicBool,
        on_listening: impl FnOnce(),
    ) -> Result<(), VhostError> {
        let sock_err = |error: io::Error| VhostError::Socket {
            path: socket.to_path_buf(),
            error,
        };
        match std::fs::symlink_metadata(socket) {
            Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
                std::fs::remove_file(socket).map_err(sock_err)?
            }
            Ok(_) => {
                return Err(sock_err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "exists and is not a socket",
                )))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(sock_err(e)),
        }
        let listener = UnixListener::bind(socket).map_err(sock_err)?;
        let _remove = RemoveOnDrop(socket.to_path_buf());
        on_listening();
        loop {
            if !wait_readable(&listener, stop)? {
                return Ok(());
            }
            self.serve_one(&listener, stop)?;
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
        }
    }

    /// Accepts the front end waiting on `listener` and serves it until it
    /// disconnects or `stop` is set.
    fn serve_one(&self, listener: &UnixListener, stop: &AtomicBool) -> Result<(), VhostError> {
        let backend = Arc::new(ConnBackend {
            inner: self.inner.clone(),
            mem: Mutex::new(None),
            tracks: Mutex::new(vec![None; usize::from(self.inner.limits.num_queues)]),
            event_idx: AtomicBool::new(false),
        });
        let vhost_err = |e: vhost_user_backend::Error| VhostError::Vhost(e.to_string());
        let mut daemon = VhostUserDaemon::new(
            "vhost-blk-conn".into(),
            backend,
            GuestMemoryAtomic::new(GuestMemoryMmap::new()),
        )
        .map_err(vhost_err)?;
        // A Listener made from a clone of our socket has no path: dropping
        // it does not remove the socket the next front end connects to.
        let mut accept = Listener::from(listener.try_clone()?);
        daemon.start(&mut accept).map_err(vhost_err)?;
        bump(&self.inner.counters.connections, 1);
        tracing::info!("vhost-user-blk: a front end connected");
        // `stop` ends the connection too: a scoped watcher shuts its socket
        // down, which ends `wait`.
        let handle = daemon.shutdown_handle();
        let finished = AtomicBool::new(false);
        let result = std::thread::scope(|s| {
            s.spawn(|| {
                while !finished.load(Ordering::Relaxed) {
                    if stop.load(Ordering::Relaxed) {
                        if let Some(h) = &handle {
                            h.shutdown();
                        }
                        return;
                    }
                    std::thread::sleep(POLL / 4);
                }
            });
            let r = daemon.wait();
            finished.store(true, Ordering::Relaxed);
            r
        });
        match result {
            Ok(()) => tracing::info!("vhost-user-blk: the front end disconnected"),
            Err(e) => {
                tracing::info!(error = %e, "vhost-user-blk: the front end's connection ended")
            }
        }
        // Dropping the daemon stops its vring worker (the exit event) and
        // joins it. Requests still in flight complete into the memory of
        // the gone front end, which stays mapped until they do.
        drop(daemon);
        Ok(())
    }
}

impl Drop for VhostBlk {
    fn drop(&mut self) {
        self.inner.stopping.store(true, Ordering::Relaxed);
        if let Some(t) = self.completer.take() {
            let _ = t.join();
        }
    }
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Waits until `listener` has a connection (true) or `stop` is set (false).
fn wait_readable(listener: &UnixListener, stop: &AtomicBool) -> io::Result<bool> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let timeout = Timespec {
        tv_sec: 0,
        tv_nsec: POLL.as_nanos() as i64,
    };
    loop {
        if stop.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let fd = listener.as_fd();
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        match poll(&mut fds, Some(&timeout)) {
            Ok(0) => {}
            Ok(_) => return Ok(true),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

impl Inner {
    fn complete_loop(&self) {
        let mut touched: Vec<Arc<QueueTrack>> = Vec::new();
        while !self.stopping.load(Ordering::Relaxed) {
            match self.client.complete(POLL) {
                Ok(c) => {
                    self.completed(c, &mut touched);
                    // Take whatever else is ready, then notify once per queue.
                    while let Ok(c) = self.client.complete(Duration::ZERO) {
                        self.completed(c, &mut touched);
                    }
                    for t in touched.drain(..) {
                        t.notify();
                    }
                }
                Err(BlkError::Timeout) => {}
                Err(e) => {
                    // Connection lost with nothing in flight: the next
                    // submission reconnects.
                    tracing::debug!(error = %e, "vhost-user-blk: no completions");
                    std::thread::sleep(POLL / 2);
                }
            }
        }
    }

    fn completed(&self, c: Completion, touched: &mut Vec<Arc<QueueTrack>>) {
        let Some(sub) = self.in_flight.lock().remove(&c.id) else {
            tracing::warn!(id = c.id, "vhost-user-blk: a completion for no request");
            return;
        };
        let ok = match c.result {
            Ok(Some(data)) => self.copy_to_guest(&sub, &data),
            Ok(None) => true,
            Err(e) => {
                tracing::debug!(error = %e, "vhost-user-blk: a request failed");
                false
            }
        };
        if let Some(track) = self.sub_done(&sub.req, ok) {
            if !touched.iter().any(|t| Arc::ptr_eq(t, &track)) {
                touched.push(track);
            }
        }
    }

    /// One fido-blk request of `req` finished; when it was the last, the
    /// chain is answered and its queue returned (to be notified).
    fn sub_done(&self, req: &Arc<Pending>, ok: bool) -> Option<Arc<QueueTrack>> {
        let status = {
            let mut st = req.state.lock();
            st.0 -= 1;
            if !ok {
                st.1 = STATUS_IOERR;
            }
            if st.0 > 0 {
                return None;
            }
            st.1
        };
        self.answer(
            &req.track,
            &req.mem,
            req.head,
            req.status,
            status,
            if status == STATUS_OK { req.used_ok } else { 1 },
        );
        Some(req.track.clone())
    }

    /// Writes `status` into the chain's status byte and returns the chain.
    fn answer(
        &self,
        track: &QueueTrack,
        mem: &GuestMemoryMmap,
        head: u16,
        at: GuestAddress,
        status: u8,
        used: u32,
    ) {
        if status != STATUS_OK {
            bump(&self.counters.errors, 1);
        }
        if let Err(e) = mem.write_obj(status, at) {
            tracing::debug!(error = %e, "vhost-user-blk: the status byte is not guest memory");
        }
        track.put_used(head, used);
        track.done();
    }

    /// Copies a READ reply into the guest's buffers (the one copy of the read path).
    fn copy_to_guest(&self, sub: &Sub, data: &Msg) -> bool {
        if data.len() as u64 != sub.len {
            return false;
        }
        let mut src = data.segments();
        let mut cur = src.next();
        let mut cur_at = 0usize;
        let mut copied = 0u64;
        let ok = for_each_guest_slice(&sub.req.mem, &sub.req.data, sub.at, sub.len, |dst| {
            let mut done = 0usize;
            while done < dst.len() {
                let Some(seg) = cur else { return false };
                if cur_at == seg.len() {
                    cur = src.next();
                    cur_at = 0;
                    continue;
                }
                let n = (seg.len() - cur_at).min(dst.len() - done);
                // SAFETY: `seg` is a view of the storage domain's reply,
                // mapped readable while `data` lives, and `cur_at + n <=
                // seg.len()`; `dst` is a bounds-checked slice of guest
                // memory mapped here, and `done + n <= dst.len()`. The two
                // mappings are distinct (the peer arena is mapped read-only
                // at its PGVAS slot, guest RAM is QEMU's memfd mapped by
                // vm-memory), so they do not overlap. Either side may be
                // written by its owner meanwhile; we neither read the
                // destination back nor decide anything from the bytes, so
                // the worst is a torn copy in the guest's own buffer.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        seg.as_ptr().add(cur_at),
                        dst.ptr_guard_mut().as_ptr().add(done),
                        n,
                    )
                };
                cur_at += n;
                done += n;
                copied += n as u64;
            }
            true
        });
        bump(&self.counters.bytes_copied_to_guest, copied);
        ok
    }

    /// Copies bytes `at..at+buf.len()` of the guest request's `data` into
    /// `buf` (the one copy of the write path).
    fn copy_from_guest(
        &self,
        mem: &GuestMemoryMmap,
        data: &[Seg],
        at: u64,
        buf: &mut [u8],
    ) -> bool {
        let mut done = 0usize;
        let ok = for_each_guest_slice(mem, data, at, buf.len() as u64, |src| {
            done += src.copy_to(&mut buf[done..]);
            true
        });
        bump(&self.counters.bytes_copied_from_guest, done as u64);
        ok && done == buf.len()
    }

    /// A buffer of this domain's arena for a write payload, waiting a while
    /// for space (buffers come back as the storage domain releases writes).
    fn alloc(&self, len: usize) -> Option<fido::Buf> {
        let deadline = Instant::now() + ALLOC_TIMEOUT;
        loop {
            match self.client.alloc(len) {
                Ok(b) => return Some(b),
                Err(e) if Instant::now() >= deadline => {
                    tracing::warn!(error = %e, len, "vhost-user-blk: no arena space for a write");
                    return None;
                }
                Err(_) => std::thread::sleep(Duration::from_micros(200)),
            }
        }
    }
}

/// Calls `f` with the guest memory of bytes `at..at+len` of `data`, in
/// order, one slice at a time. False if the range is not all guest memory or
/// `f` said so.
fn for_each_guest_slice(
    mem: &GuestMemoryMmap,
    data: &[Seg],
    mut at: u64,
    mut len: u64,
    mut f: impl FnMut(VolatileSlice<'_>) -> bool,
) -> bool {
    for seg in data {
        if len == 0 {
            break;
        }
        let seg_len = u64::from(seg.len);
        if at >= seg_len {
            at -= seg_len;
            continue;
        }
        let n = (seg_len - at).min(len);
        let Some(start) = seg.addr.0.checked_add(at) else {
            return false;
        };
        for slice in GuestMemoryBackend::get_slices(mem, GuestAddress(start), n as usize) {
            match slice {
                Ok(s) => {
                    if !f(s) {
                        return false;
                    }
                }
                Err(_) => return false,
            }
        }
        at = 0;
        len -= n;
    }
    len == 0
}

/// What one fido-blk request of a guest request does.
enum SubOp {
    Read { offset: u64, len: u32 },
    Write { offset: u64, len: u32 },
    Flush,
    Discard { offset: u64, len: u32 },
    WriteZeroes { offset: u64, len: u32, unmap: bool },
}

/// Splits `offset..offset+len` into pieces of at most `max` bytes: (byte within the request, length).
fn pieces(len: u64, max: u64) -> impl Iterator<Item = (u64, u32)> {
    (0..len.div_ceil(max)).map(move |i| (i * max, (len - i * max).min(max) as u32))
}

/// The vhost-user device of one front-end connection.
struct ConnBackend {
    inner: Arc<Inner>,
    mem: Mutex<Option<Memory>>,
    tracks: Mutex<Vec<Option<Arc<QueueTrack>>>>,
    event_idx: AtomicBool,
}

impl ConnBackend {
    fn track(&self, q: usize, vring: &Vring) -> Option<Arc<QueueTrack>> {
        let mut tracks = self.tracks.lock();
        let slot = tracks.get_mut(q)?;
        Some(
            slot.get_or_insert_with(|| {
                Arc::new(QueueTrack {
                    vring: vring.clone(),
                    in_flight: Mutex::new(0),
                    idle: Condvar::new(),
                })
            })
            .clone(),
        )
    }

    /// Takes one chain: answers it at once (refused, GET_ID) or sends its
    /// fido-blk requests. True if the guest should be notified now.
    fn start(
        &self,
        chain: DescriptorChain<Arc<GuestMemoryMmap>>,
        track: &Arc<QueueTrack>,
        mem: &Arc<GuestMemoryMmap>,
    ) -> bool {
        let inner = &*self.inner;
        let c = &inner.counters;
        bump(&c.requests, 1);
        let head = chain.head_index();
        // One more than the limit, so that parse sees a chain that is too long.
        let descs: Vec<Desc> = chain
            .take(1025)
            .map(|d| Desc {
                addr: d.addr().0,
                len: d.len(),
                writable: d.is_write_only(),
            })
            .collect();
        let req = virtio::parse(&descs, &**mem, &inner.limits);
        *track.in_flight.lock() += 1;
        let Some(status) = req.status else {
            bump(&c.unanswerable, 1);
            track.put_used(head, 0);
            track.done();
            return true;
        };
        let kind = match req.outcome {
            Ok(k) => k,
            Err(s) => {
                inner.answer(track, mem, head, status, s, 1);
                return true;
            }
        };
        let lb = inner.limits.max_ranged();
        let mt = u64::from(inner.limits.max_transfer);
        let (plan, data, used_ok): (Vec<(u64, SubOp)>, Vec<Seg>, u32) = match kind {
            Kind::GetId { data } => {
                bump(&c.get_ids, 1);
                let mut done = 0usize;
                let id = &inner.id[..inner.id_len];
                let len = (data.iter().map(|s| u64::from(s.len)).sum::<u64>()).min(id.len() as u64);
                let ok = for_each_guest_slice(mem, &data, 0, len, |dst| {
                    dst.copy_from(&id[done..]);
                    done += dst.len().min(id.len() - done);
                    true
                });
                let st = if ok { STATUS_OK } else { STATUS_IOERR };
                inner.answer(track, mem, head, status, st, len as u32 + 1);
                return true;
            }
            Kind::Read { offset, len, data } => {
                bump(&c.reads, 1);
                let plan = pieces(len, mt)
                    .map(|(at, n)| {
                        (
                            at,
                            SubOp::Read {
                                offset: offset + at,
                                len: n,
                            },
                        )
                    })
                    .collect();
                let used = u32::try_from(len + 1).unwrap_or(u32::MAX);
                (plan, data, used)
            }
            Kind::Write { offset, len, data } => {
                bump(&c.writes, 1);
                let plan = pieces(len, mt)
                    .map(|(at, n)| {
                        (
                            at,
                            SubOp::Write {
                                offset: offset + at,
                                len: n,
                            },
                        )
                    })
                    .collect();
                (plan, data, 1)
            }
            Kind::Flush => {
                bump(&c.flushes, 1);
                (vec![(0, SubOp::Flush)], Vec::new(), 1)
            }
            Kind::Discard(ranges) => {
                bump(&c.discards, 1);
                let plan = ranges
                    .iter()
                    .flat_map(|r| {
                        pieces(r.len, lb).map(move |(at, n)| {
                            (
                                0,
                                SubOp::Discard {
                                    offset: r.offset + at,
                                    len: n,
                                },
                            )
                        })
                    })
                    .collect();
                (plan, Vec::new(), 1)
            }
            Kind::WriteZeroes(ranges) => {
                bump(&c.write_zeroes, 1);
                let plan = ranges
                    .iter()
                    .flat_map(|r| {
                        pieces(r.len, lb).map(move |(at, n)| {
                            (
                                0,
                                SubOp::WriteZeroes {
                                    offset: r.offset + at,
                                    len: n,
                                    unmap: r.unmap,
                                },
                            )
                        })
                    })
                    .collect();
                (plan, Vec::new(), 1)
            }
        };
        if plan.is_empty() {
            // A zero-length READ or WRITE: nothing to move.
            inner.answer(track, mem, head, status, STATUS_OK, 1);
            return true;
        }
        let is_write = matches!(plan[0].1, SubOp::Write { .. });
        let pending = Arc::new(Pending {
            track: track.clone(),
            mem: mem.clone(),
            head,
            status,
            data: if is_write { Vec::new() } else { data.clone() },
            used_ok,
            state: Mutex::new((plan.len(), STATUS_OK)),
        });
        let mut notify_now = false;
        for (at, op) in plan {
            let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
            let len = match op {
                SubOp::Read { len, .. } | SubOp::Write { len, .. } => u64::from(len),
                _ => 0,
            };
            // A write's payload goes into an arena buffer before the request
            // is registered: a failure here is this piece's error.
            let payload = match op {
                SubOp::Write { len, .. } => {
                    let filled = inner.alloc(len as usize).and_then(|mut buf| {
                        inner
                            .copy_from_guest(mem, &data, at, &mut buf)
                            .then_some(buf)
                    });
                    if filled.is_none() {
                        notify_now |= inner.sub_done(&pending, false).is_some();
                        continue;
                    }
                    filled
                }
                _ => None,
            };
            // Registered before it is sent: the reply may come at once.
            inner.in_flight.lock().insert(
                id,
                Sub {
                    req: pending.clone(),
                    at,
                    len,
                },
            );
            bump(&c.fido_requests, 1);
            let sent = match op {
                SubOp::Read { offset, len } => inner.client.submit_read(id, offset, len),
                SubOp::Write { offset, .. } => {
                    inner
                        .client
                        .submit_write(id, offset, payload.into_iter().collect(), false)
                }
                SubOp::Flush => inner.client.submit_flush(id),
                SubOp::Discard { offset, len } => {
                    inner.client.submit_discard(id, offset, len, false)
                }
                SubOp::WriteZeroes { offset, len, unmap } => inner
                    .client
                    .submit_write_zeroes(id, offset, len, false, !unmap),
            };
            if let Err(e) = sent {
                tracing::debug!(error = %e, "vhost-user-blk: sending a request");
                if inner.in_flight.lock().remove(&id).is_some() {
                    notify_now |= inner.sub_done(&pending, false).is_some();
                }
            }
        }
        notify_now
    }
}

impl VhostUserBackend for ConnBackend {
    type Bitmap = ();
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        usize::from(self.inner.limits.num_queues)
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.inner.limits.queue_size)
    }

    fn features(&self) -> u64 {
        virtio::device_features(&self.inner.limits)
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::REPLY_ACK
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        // Exactly `size` bytes: ours where they exist, zeros past them.
        let config = virtio::config_space(&self.inner.limits);
        let mut out = vec![0u8; size as usize];
        let start = (offset as usize).min(config.len());
        let n = (config.len() - start).min(out.len());
        out[..n].copy_from_slice(&config[start..start + n]);
        out
    }

    fn set_config(&self, _offset: u32, _buf: &[u8]) -> io::Result<()> {
        // Nothing in virtio-blk's configuration is writable without CONFIG_WCE.
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "the configuration space is read-only",
        ))
    }

    fn update_memory(&self, mem: Memory) -> io::Result<()> {
        *self.mem.lock() = Some(mem);
        Ok(())
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        match new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC) {
            Ok(pair) => Some(pair),
            Err(e) => {
                tracing::error!(error = %e, "vhost-user-blk: an exit event for the vring worker");
                None
            }
        }
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        // The front end takes the ring back: answer what it gave us first.
        let track = self
            .tracks
            .lock()
            .get(queue_index as usize)
            .cloned()
            .flatten();
        if let Some(t) = track {
            let deadline = Instant::now() + STOP_TIMEOUT;
            let mut n = t.in_flight.lock();
            while *n > 0 {
                if t.idle.wait_until(&mut n, deadline).timed_out() {
                    tracing::warn!(
                        queue = queue_index,
                        in_flight = *n,
                        "vhost-user-blk: stopping a queue with requests in flight"
                    );
                    break;
                }
            }
        }
        Ok(())
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Vring],
        _thread_id: usize,
    ) -> io::Result<()> {
        // Errors returned here end the vring worker: whatever the guest did,
        // it is answered or logged, never returned.
        if evset != EventSet::IN {
            tracing::warn!(?evset, "vhost-user-blk: an unexpected event set");
            return Ok(());
        }
        let q = usize::from(device_event);
        let Some(vring) = vrings.get(q) else {
            return Ok(());
        };
        let Some(atomic) = self.mem.lock().clone() else {
            return Ok(());
        };
        let Some(track) = self.track(q, vring) else {
            return Ok(());
        };
        let mut notify = false;
        loop {
            let event_idx = self.event_idx.load(Ordering::Relaxed);
            if event_idx {
                let _ = vring.disable_notification();
            }
            let mem = atomic.memory().into_inner();
            loop {
                // The vring's lock is held only to pop.
                let chain = vring
                    .get_mut()
                    .get_queue_mut()
                    .pop_descriptor_chain(mem.clone());
                let Some(chain) = chain else { break };
                notify |= self.start(chain, &track, &mem);
            }
            if !event_idx {
                break;
            }
            match vring.enable_notification() {
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "vhost-user-blk: re-enabling notifications");
                    break;
                }
            }
        }
        if notify {
            track.notify();
        }
        Ok(())
    }
}
