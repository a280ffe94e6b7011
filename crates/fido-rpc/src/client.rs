//! The client side: a connection to a service, calls in flight by id, replies
//! as views that cannot outlive their release.

use crate::error::{CallError, Fault, RpcError};
use crate::frame::{Frame, View};
use crate::wire::*;
use bytemuck::Pod;
use fido::{Channel, Domain, Message, Msg, PeerSlice, PeerSliceOf, WaitStrategy};
use arc_swap::ArcSwapOption;
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Per-call options.
#[derive(Clone, Debug, Default)]
pub struct CallOpts {
    /// Give up after this long; the server sees the same deadline
    /// ([`crate::Ctx::is_cancelled`], [`crate::Ctx::deadline_ns`]).
    pub timeout: Option<Duration>,
    /// Set it (from any thread) to cancel the call; the server is told.
    pub cancel: Option<CancelToken>,
}

impl CallOpts {
    pub fn timeout(d: Duration) -> Self {
        CallOpts { timeout: Some(d), cancel: None }
    }
    pub fn cancel(mut self, t: &CancelToken) -> Self {
        self.cancel = Some(t.clone());
        self
    }
}

/// Cancels a call from another thread.
#[derive(Clone, Debug, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Release);
    }
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// A reply: the result value (copied out of the reply's root) and the reply
/// message itself, which keeps every view of the server's memory valid.
/// Dropping it releases the reply (the server frees what it built). Views
/// borrow the `Reply`, so none can outlive the release:
///
/// ```compile_fail
/// fn leak(r: fido_rpc::Reply<fido_rpc::ShmSlice<u8>>) -> fido::PeerSliceOf<'static, u8> {
///     r.slice(*r.get()).unwrap() // error: returns a value referencing data owned by `r`
/// }
/// ```
pub struct Reply<R> {
    msg: Msg,
    value: R,
}

impl<R: Pod> Reply<R> {
    /// The result (handles in it are resolved with [`Reply::view`]).
    pub fn get(&self) -> &R {
        &self.value
    }
    /// The server's memory this reply may point to, checked on use.
    pub fn view(&self) -> View<'_> {
        View::new(&self.msg)
    }
    /// Shorthand for `view().slice(h)`.
    pub fn slice<T: Pod>(&self, h: ShmSlice<T>) -> Result<PeerSliceOf<'_, T>, RpcError> {
        self.view().slice(h).map_err(|f| RpcError::BadReply(f.to_string()))
    }
    /// Shorthand for `view().str(s)`.
    pub fn str(&self, s: ShmStr) -> Result<crate::frame::ShmStrRef<'_>, RpcError> {
        self.view().str(s).map_err(|f| RpcError::BadReply(f.to_string()))
    }
    /// The reply message (tag = call id).
    pub fn message(&self) -> &Msg {
        &self.msg
    }
}

/// A reply's status, fault code and root, from either form: an inline reply's
/// bytes (copied with its descriptor), or a framed reply's header — copied
/// out once, then checked — and its root, resolved against the server's
/// grant. The root lives as long as `msg`.
pub fn reply_parts(msg: &Msg) -> Result<(u32, u32, PeerSlice<'_>), &'static str> {
    if let Some(b) = msg.inline_bytes() {
        let (status, fault, _, root) = split_inline(b).ok_or("short inline reply")?;
        return Ok((status, fault, PeerSlice::from_own(root)));
    }
    let first = msg.segments().next().ok_or("empty reply")?;
    let h: ReplyHeader = first.read_obj(0).ok_or("short header")?;
    if h.magic != MAGIC {
        return Err("bad magic");
    }
    let root = View::new(msg).bytes(h.root_addr, h.root_len).map_err(|_| "root outside the server's grant")?;
    Ok((h.status, h.fault, root))
}

/// Decodes a reply message (either form, [`reply_parts`]).
pub(crate) fn decode_reply<R: Pod, E: Pod + std::fmt::Debug>(msg: Msg) -> Result<Reply<R>, CallError<E>> {
    let bad = |s: &str| CallError::Rpc(RpcError::BadReply(s.into()));
    let (status, fault, root) = reply_parts(&msg).map_err(bad)?;
    match status {
        STATUS_OK => {
            let mut r = RootReader::new(root);
            let value: R = r.get().map_err(|_| bad("short result"))?;
            r.finish().map_err(|_| bad("long result"))?;
            Ok(Reply { msg, value })
        }
        STATUS_APP_ERROR => {
            let mut r = RootReader::new(root);
            let e: E = r.get().map_err(|_| bad("short error"))?;
            Err(CallError::App(e))
        }
        STATUS_FAULT => {
            // The fault's text, read in place (an error message, not payload:
            // not counted as copied).
            let mut text = Vec::new();
            root.subslice(0, root.len().min(1024)).expect("inside the root").read_chunks(|c| text.extend_from_slice(c));
            let text = String::from_utf8_lossy(&text).into_owned();
            let f = Fault::from_code(fault).ok_or_else(|| bad("unknown fault code"))?;
            if f == Fault::DeadlineExceeded {
                // The server noticed our deadline before we did.
                return Err(CallError::Rpc(RpcError::DeadlineExceeded));
            }
            Err(CallError::Rpc(RpcError::Fault(f, text)))
        }
        _ => Err(bad("unknown status")),
    }
}

/// Builds a call message: inline when nothing was built in the frame and
/// the root fits ([`INLINE_ROOT`]), else the frame with its header. (The
/// async client sends `Message`s; [`send_call`] is the synchronous path.)
pub(crate) fn call_message(frame: Frame, method: u32, sig: u32, id: u64, oneway: bool, deadline_ns: u64, root: &[u8]) -> Result<Message, RpcError> {
    let op = if oneway { OP_ONEWAY } else { OP_CALL };
    if let Some(bytes) = inline_call(&frame, method, sig, deadline_ns, root) {
        return Ok(Message::inline(bytes.as_bytes())?.tag(id).opcode(op));
    }
    framed_call(frame, method, sig, id, op, deadline_ns, root)
}

/// A call's inline bytes, if it travels inline: nothing was built in its
/// frame and its root fits ([`INLINE_ROOT`]). The one decision both the
/// synchronous and the async client make.
#[inline]
fn inline_call(frame: &Frame, method: u32, sig: u32, deadline_ns: u64, root: &[u8]) -> Option<InlineBytes> {
    if !frame.is_untouched() {
        return None;
    }
    InlineBytes::new(method, sig, deadline_ns, root)
}

fn framed_call(frame: Frame, method: u32, sig: u32, id: u64, op: u16, deadline_ns: u64, root: &[u8]) -> Result<Message, RpcError> {
    let bufs = frame.finish(root, |root_addr, root_len| {
        let h = CallHeader { magic: MAGIC, method, sig, _reserved: 0, deadline_ns, root_addr, root_len, _pad: [0; 3] };
        bytemuck::cast(h)
    })?;
    Ok(Message::gather(bufs).tag(id).opcode(op))
}

/// Why a call did not go out.
enum NotSent {
    /// Its frame could not be finished (e.g. the arena is full).
    Build(RpcError),
    /// The channel refused it (`Timeout`: the window stayed full until the
    /// deadline).
    Send(fido::Error),
}

/// Builds call `id` and sends it on `ch`, waiting while the window is full
/// until `deadline` (forever without one). An inline call goes out straight
/// from its bytes ([`Channel::send_inline`]): building a `Message` or any
/// other value holding them and returning it cost a copy of it through the
/// stack on every call.
#[allow(clippy::too_many_arguments)]
fn send_call(ch: &Channel, frame: Frame, method: u32, sig: u32, id: u64, oneway: bool, deadline_ns: u64, root: &[u8], deadline: Option<Instant>) -> Result<(), NotSent> {
    let op = if oneway { OP_ONEWAY } else { OP_CALL };
    let left = |d: Instant| d.saturating_duration_since(Instant::now());
    let sent = match (inline_call(&frame, method, sig, deadline_ns, root), deadline) {
        (Some(bytes), None) => ch.send_inline(id, op, bytes.as_bytes()),
        (Some(bytes), Some(d)) => match ch.try_send_inline(id, op, bytes.as_bytes()) {
            Err(fido::SendError { error: fido::Error::WouldBlock, message }) => ch.send_timeout(message, left(d)),
            other => other,
        },
        (None, _) => {
            let m = framed_call(frame, method, sig, id, op, deadline_ns, root).map_err(NotSent::Build)?;
            match deadline {
                None => ch.send(m),
                Some(d) => ch.send_timeout(m, left(d)),
            }
        }
    };
    sent.map_err(|e| NotSent::Send(e.error))
}

/// A cancel: an empty inline message (nothing to allocate, so it cannot fail
/// for lack of memory).
pub(crate) fn cancel_message(id: u64) -> Message {
    Message::inline(&[]).expect("an empty inline message fits").tag(id).opcode(OP_CANCEL)
}

/// One connection and the replies that arrived for callers not yet awake.
///
/// One caller at a time holds the **receiving turn** (`receiving`): it
/// receives for everybody, keeps its own reply and leaves the others' in
/// `done`. The turn is taken with a compare-and-swap and handed on with a
/// store, no lock: a lone caller (the common case) takes no lock at all on
/// its way through a call. Callers that find the turn taken wait on `cv`;
/// the holder takes the lock to wake them only when `parked` says some
/// are. (Both sides write their word, then read the other's, all `SeqCst`:
/// either the holder sees the parked caller, or the caller sees the turn
/// free and does not park.)
struct Conn {
    ch: Channel,
    st: Mutex<ConnState>,
    cv: Condvar,
    /// `st.failed.is_some()`, readable without the lock.
    failed: AtomicBool,
    receiving: AtomicBool,
    parked: AtomicUsize,
}

impl Conn {
    /// Takes the receiving turn if it is free.
    fn take_turn(&self) -> bool {
        self.receiving.compare_exchange(false, true, Ordering::SeqCst, Ordering::Relaxed).is_ok()
    }

    /// Hands the receiving turn on: frees it and wakes parked callers, one
    /// of which takes it.
    fn hand_off(&self) {
        self.receiving.store(false, Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) > 0 {
            let _st = self.st.lock();
            self.cv.notify_all();
        }
    }
}

#[derive(Default)]
struct ConnState {
    /// Calls whose caller still waits and does not hold the receiving turn.
    waiting: IdSet,
    /// Replies received for a waiting caller.
    done: IdMap<Msg>,
    /// Set once the connection failed: every waiter gets this.
    failed: Option<String>,
}

/// A client of one service. `Send + Sync`: share it between threads; each
/// call waits for its own reply (one caller at a time receives for all and
/// hands the others theirs, so replies may arrive in any order).
///
/// If the server dies, calls in flight fail with [`RpcError::ServerGone`];
/// the next call connects again (to a restarted server under the same name).
pub struct Client {
    domain: Domain,
    service: String,
    /// The current connection. Read on every call without a lock or a
    /// reference count (an `arc_swap` guard): a mutex and an `Arc` clone
    /// per call were two locked instructions on the round trip's path.
    conn: ArcSwapOption<Conn>,
    /// Held while connecting again (and while changing `wait`), so that
    /// callers who find the connection dead connect once.
    reconnecting: Mutex<()>,
    wait: Mutex<Option<WaitStrategy>>,
}

/// A new call id. Ids are unique in the process, so on every connection of
/// every client, and never reused (2^64 of them). A thread takes them from
/// its own block of [`ID_BLOCK`] ids, so a call costs no locked instruction
/// (a shared counter's `fetch_add` was one on every round trip's path); one
/// call in `ID_BLOCK` takes the next block.
#[inline]
pub(crate) fn next_call_id() -> u64 {
    /// Ids a thread takes at a time.
    const ID_BLOCK: u64 = 1 << 16;
    /// Start of the next free block (ids start at 1).
    static NEXT_BLOCK: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        /// This thread's block: the next id and the end of the block.
        static BLOCK: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
    }
    BLOCK.with(|b| {
        let (mut next, mut end) = b.get();
        if next == end {
            next = NEXT_BLOCK.fetch_add(ID_BLOCK, Ordering::Relaxed);
            end = next + ID_BLOCK;
        }
        b.set((next + 1, end));
        next
    })
}

/// The connection a call uses, kept alive for the call.
struct ConnGuard(arc_swap::Guard<Option<Arc<Conn>>>);

impl std::ops::Deref for ConnGuard {
    type Target = Conn;
    fn deref(&self) -> &Conn {
        self.0.as_deref().expect("a ConnGuard holds a connection")
    }
}

impl Conn {
    fn is_up(&self) -> bool {
        self.ch.is_open() && !self.failed.load(Ordering::Acquire)
    }
}

impl Client {
    /// Connects to `service`.
    pub fn connect(domain: &Domain, service: &str) -> Result<Client, RpcError> {
        let c = Client {
            domain: domain.clone(),
            service: service.into(),
            conn: ArcSwapOption::empty(),
            reconnecting: Mutex::new(()),
            wait: Mutex::new(None),
        };
        c.conn()?;
        Ok(c)
    }

    /// How callers wait for replies: `WaitStrategy::Block` (notified: sleep on
    /// the doorbell), `BusyPoll` (polled), `Adaptive` (spin, then sleep).
    pub fn set_wait(&self, w: WaitStrategy) {
        let _no_reconnect = self.reconnecting.lock();
        *self.wait.lock() = Some(w);
        if let Some(c) = &*self.conn.load() {
            c.ch.set_wait(w);
        }
    }

    pub fn domain(&self) -> &Domain {
        &self.domain
    }
    pub fn service(&self) -> &str {
        &self.service
    }

    /// A frame for a call's arguments, in our arena (nothing is allocated
    /// until something is built in it).
    ///
    /// The argument memory of finished calls is taken back when their reply
    /// arrives (the server releases a call's arguments before replying), not
    /// only when half the ring is in flight, which a synchronous caller
    /// never reaches: without that, up to half a ring of large argument
    /// frames stayed allocated (found by `fido-bench rpc`: 10 MB ByteSeq
    /// calls exhausted a 256 MiB arena).
    #[inline]
    pub fn frame(&self) -> Result<Frame, RpcError> {
        Frame::new(self.domain.arena())
    }

    /// Whether the current connection is up (false after the server died,
    /// until the next call reconnects).
    pub fn is_connected(&self) -> bool {
        self.conn.load().as_ref().is_some_and(|c| c.is_up())
    }

    /// The current connection, or a new one if it failed.
    #[inline(always)]
    fn conn(&self) -> Result<ConnGuard, RpcError> {
        let g = self.conn.load();
        if g.as_ref().is_some_and(|c| c.is_up()) {
            return Ok(ConnGuard(g));
        }
        drop(g);
        self.reconnect()
    }

    #[cold]
    fn reconnect(&self) -> Result<ConnGuard, RpcError> {
        let _one = self.reconnecting.lock();
        // Another caller may have connected while we waited.
        let g = self.conn.load();
        if g.as_ref().is_some_and(|c| c.is_up()) {
            return Ok(ConnGuard(g));
        }
        drop(g);
        let ch = self.domain.connect(&self.service)?;
        if let Some(w) = *self.wait.lock() {
            ch.set_wait(w);
        }
        let c = Arc::new(Conn {
            ch,
            st: Mutex::new(ConnState::default()),
            cv: Condvar::new(),
            failed: AtomicBool::new(false),
            receiving: AtomicBool::new(false),
            parked: AtomicUsize::new(0),
        });
        self.conn.store(Some(c));
        Ok(ConnGuard(self.conn.load()))
    }

    /// A call (generated stubs use this): `root` holds the packed arguments,
    /// `frame` the memory they point to.
    pub fn call<R: Pod, E: Pod + std::fmt::Debug>(
        &self,
        method: u32,
        sig: u32,
        frame: Frame,
        root: &[u8],
        opts: &CallOpts,
    ) -> Result<Reply<R>, CallError<E>> {
        let msg = self.call_raw(method, sig, frame, root, opts)?;
        decode_reply(msg)
    }

    /// A one-way call: sent, never answered. Returns once it is in the ring.
    pub fn call_oneway(&self, method: u32, sig: u32, frame: Frame, root: &[u8]) -> Result<(), RpcError> {
        let conn = self.conn()?;
        let id = next_call_id();
        match send_call(&conn.ch, frame, method, sig, id, true, 0, root, None) {
            Ok(()) => {}
            Err(NotSent::Build(e)) => return Err(e),
            Err(NotSent::Send(e)) => return Err(gone_or(e)),
        }
        // Take back what earlier one-way calls' arguments held.
        let _ = conn.ch.reap_if_holding(crate::REAP_ABOVE);
        Ok(())
    }

    /// A call returning the raw reply message (the C ABI decodes it itself).
    #[inline(always)]
    pub fn call_raw(&self, method: u32, sig: u32, frame: Frame, root: &[u8], opts: &CallOpts) -> Result<Msg, RpcError> {
        let conn = self.conn()?;
        let id = next_call_id();
        let deadline = opts.timeout.map(|t| Instant::now() + t);
        let deadline_ns = opts.timeout.map(|t| monotonic_ns() + t.as_nanos() as u64).unwrap_or(0);
        // Become the receiver for everybody if nobody is; else register the
        // call so that the receiver keeps its reply.
        let receiver = conn.take_turn();
        if !receiver {
            conn.st.lock().waiting.insert(id);
        }
        if let Err(e) = send_call(&conn.ch, frame, method, sig, id, false, deadline_ns, root, deadline) {
            if receiver {
                conn.hand_off();
            } else {
                conn.st.lock().waiting.remove(&id);
            }
            return Err(match e {
                NotSent::Build(e) => e,
                NotSent::Send(fido::Error::Timeout) => RpcError::DeadlineExceeded,
                NotSent::Send(other) => {
                    self.fail(&conn, &other);
                    gone_or(other)
                }
            });
        }
        // The server is running the call now: collect the releases of
        // earlier calls while it does, not in the next call's send.
        let _ = conn.ch.reap_ahead();
        let reply = self.wait_reply(&conn, id, deadline, opts.cancel.as_ref(), receiver);
        // The server released this call's arguments before replying: take
        // the memory back before the caller builds the next call (a cheap
        // check unless more than REAP_ABOVE is out).
        let _ = conn.ch.reap_if_holding(crate::REAP_ABOVE);
        reply
    }

    fn fail(&self, conn: &Conn, e: &fido::Error) {
        let mut st = conn.st.lock();
        if st.failed.is_none() {
            st.failed = Some(e.to_string());
            conn.failed.store(true, Ordering::Release);
        }
        conn.cv.notify_all();
    }

    fn give_up(&self, conn: &Conn, id: u64, why: RpcError) -> RpcError {
        {
            let mut st = conn.st.lock();
            st.waiting.remove(&id);
            st.done.remove(&id);
        }
        let _ = conn.ch.try_send(cancel_message(id));
        why
    }

    /// Waits for call `id`'s reply. `receiver`: the caller holds the
    /// receiving turn (and `id` is not in `waiting`).
    #[inline(always)]
    fn wait_reply(&self, conn: &Conn, id: u64, deadline: Option<Instant>, cancel: Option<&CancelToken>, mut receiver: bool) -> Result<Msg, RpcError> {
        // With a cancel token, wake up now and then to look at it.
        let slice = if cancel.is_some() { Some(Duration::from_millis(20)) } else { None };
        // How long the next wait may last; the clock is read only when there
        // is a deadline.
        let wait_for = || {
            let mut w = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if let Some(s) = slice {
                w = Some(w.map_or(s, |w| w.min(s)));
            }
            w
        };
        let gave_up = || {
            if cancel.is_some_and(|c| c.is_cancelled()) {
                Some(RpcError::Cancelled)
            } else if deadline.is_some_and(|d| Instant::now() >= d) {
                Some(RpcError::DeadlineExceeded)
            } else {
                None
            }
        };
        loop {
            if !receiver {
                let mut st = conn.st.lock();
                // Waits for the turn (or a reply left by its holder).
                loop {
                    if let Some(m) = st.done.remove(&id) {
                        st.waiting.remove(&id);
                        return Ok(m);
                    }
                    if let Some(why) = st.failed.clone() {
                        st.waiting.remove(&id);
                        return Err(RpcError::ServerGone(why));
                    }
                    if let Some(why) = gave_up() {
                        drop(st);
                        return Err(self.give_up(conn, id, why));
                    }
                    // Under the lock, so no holder can be leaving our reply
                    // in `done` meanwhile: none was, none will be.
                    if conn.take_turn() {
                        st.waiting.remove(&id);
                        break;
                    }
                    conn.parked.fetch_add(1, Ordering::SeqCst);
                    if conn.receiving.load(Ordering::SeqCst) {
                        match wait_for() {
                            Some(w) => {
                                conn.cv.wait_for(&mut st, w);
                            }
                            None => conn.cv.wait(&mut st),
                        }
                    }
                    conn.parked.fetch_sub(1, Ordering::SeqCst);
                }
                receiver = true;
            }
            // We hold the turn: receive for everybody until our reply comes.
            if let Some(why) = gave_up() {
                conn.hand_off();
                return Err(self.give_up(conn, id, why));
            }
            let r = match wait_for() {
                Some(w) => conn.ch.recv_timeout(w),
                None => conn.ch.recv(),
            };
            match r {
                Ok(mut m) if m.tag() == id => {
                    conn.hand_off();
                    // A reply that holds nothing of the server's but its
                    // ring slot is released after our next call is out (or
                    // when we next wait), not when the caller drops it, on
                    // the way to that call.
                    if m.inline_bytes().and_then(split_inline).is_some_and(|(_, _, flags, _)| flags & REPLY_HELD == 0) {
                        m.defer_release();
                    }
                    return Ok(m);
                }
                Ok(m) => {
                    let tag = m.tag();
                    let mut st = conn.st.lock();
                    if st.waiting.contains(&tag) {
                        st.done.insert(tag, m);
                        conn.cv.notify_all();
                    }
                    // else: a late reply to a call its caller gave up on;
                    // dropping it releases it.
                }
                Err(fido::Error::Timeout) => {}
                Err(e) => {
                    self.fail(conn, &e);
                    conn.hand_off();
                    return Err(RpcError::ServerGone(e.to_string()));
                }
            }
        }
    }
}

fn gone_or(e: fido::Error) -> RpcError {
    match e {
        fido::Error::PeerGone { .. } | fido::Error::Closed | fido::Error::Protocol(_) => RpcError::ServerGone(e.to_string()),
        other => RpcError::Fido(other),
    }
}
