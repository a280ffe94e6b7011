//! The guest end of the link (`fido_proto::guest`): framed messages on the
//! virtio-serial port, and the [`fido_control::Transport`] the guest's broker
//! session runs over.
//!
//! The transport *materialises* handles as descriptors so the `fido` library
//! above sees what a host process sees: a hot-plugged arena becomes its BAR
//! file opened read-only, a peer's doorbell a ring token ([`crate::Guest::ring_end`]
//! turns it into a register ring), a liveness token one end of a local socket
//! pair whose other end is closed when the supervisor reports the hang-up.
//!
//! Connections to the broker come and go under one link: each is an *epoch*.
//! The link's first broker connection is ready once the supervisor answered
//! `Hello`; after `BrokerClosed` (or for a second session in the same
//! process) a connect asks for a fresh one with `Reconnect`. A transport of an
//! ended epoch only reports `Closed`, so a stale session can never read or
//! write on its successor's connection.

use crate::{Guest, GuestError};
use fido_control::{ControlError, Received, Transport};
use fido_proto::guest::{self as link, GuestMsg, Handle, HostMsg, Welcome};
use parking_lot::Mutex;
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a write to the port may wait for room (the supervisor reads
/// continuously; a longer stall means it is gone).
const SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the `Hello` and `Reconnect` exchanges may take.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a hot-plugged peer arena may take to appear (0.03–0.23 s idle).
/// Bounded well below the broker's heartbeat window (6 × 500 ms): the wait
/// runs on the session's reader thread, and a longer one got the domain
/// declared hung; a device this late fails its one connection instead.
const ARENA_APPEAR_TIMEOUT: Duration = Duration::from_millis(2500);
/// Bytes read from the port per system call.
const READ_CHUNK: usize = 64 * 1024;

/// The port and the state shared by every transport over it.
pub(crate) struct Link {
    port: OwnedFd,
    /// Senders take turns: a link message is written whole.
    send_lock: Mutex<()>,
    /// The one reader (the session's reader thread, or a handshake).
    reader: Mutex<Vec<u8>>,
    /// Written by `shutdown` to wake a reader blocked in `poll`.
    wake: OwnedFd,
    state: Mutex<LinkState>,
    /// Our ends of the liveness pairs, by the supervisor's token.
    liveness: Mutex<HashMap<u64, OwnedFd>>,
}

struct LinkState {
    /// The current broker connection's number.
    epoch: u64,
    /// The current broker connection exists and no transport has claimed it.
    fresh: bool,
    /// The supervisor closed the port (read EOF): a `Hello` must come first.
    host_gone: bool,
    /// The host sent bytes that cannot be trusted: the stream is out of step
    /// for good.
    broken: Option<String>,
}

/// What one read of the port produced.
enum Incoming {
    Msg(HostMsg),
    /// Timeout, or woken by a `shutdown`.
    Idle,
    /// The host side closed the port.
    Eof,
}

impl Link {
    pub(crate) fn new(port: OwnedFd) -> io::Result<Link> {
        Ok(Link {
            port,
            send_lock: Mutex::new(()),
            reader: Mutex::new(Vec::new()),
            wake: crate::vfio::vector_eventfd()?,
            state: Mutex::new(LinkState {
                epoch: 0,
                fresh: false,
                host_gone: true,
                broken: None,
            }),
            liveness: Mutex::new(HashMap::new()),
        })
    }

    /// Writes one link message whole, waiting for room up to [`SEND_TIMEOUT`].
    fn write_msg(&self, msg: &GuestMsg) -> io::Result<()> {
        let bytes = link::encode_link(msg)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let _turn = self.send_lock.lock();
        let deadline = Instant::now() + SEND_TIMEOUT;
        let mut done = 0;
        while done < bytes.len() {
            match rustix::io::write(&self.port, &bytes[done..]) {
                Ok(n) => done += n,
                Err(Errno::INTR) => {}
                Err(Errno::AGAIN) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the supervisor does not read the link",
                        ));
                    }
                    let mut fds = [PollFd::new(&self.port, PollFlags::OUT)];
                    let _ = poll(
                        &mut fds,
                        Some(&timespec(left.min(Duration::from_millis(100)))),
                    );
                    if fds[0].revents().contains(PollFlags::HUP)
                        && !fds[0].revents().contains(PollFlags::OUT)
                    {
                        // Not connected on the host side (yet): no busy loop.
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Reads the next host message, waiting until `deadline` (forever with
    /// `None`) or a `shutdown`'s wake-up. `pending` is the reader's buffer
    /// (a partial message survives a timeout). A length or body that does not
    /// check breaks the link for good.
    fn read_msg(&self, pending: &mut Vec<u8>, deadline: Option<Instant>) -> io::Result<Incoming> {
        loop {
            if pending.len() >= 4 {
                let prefix: [u8; 4] = pending[..4].try_into().unwrap_or_default();
                let n = link::link_len(prefix)
                    .map_err(|e| self.break_link(format!("bad link length: {e}")))?;
                if pending.len() >= 4 + n {
                    let decoded = link::decode_host(&pending[4..4 + n]);
                    pending.drain(..4 + n);
                    let msg = decoded.map_err(|e| {
                        self.break_link(format!("bad message from the supervisor: {e}"))
                    })?;
                    return Ok(Incoming::Msg(msg));
                }
            }
            let timeout = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(Incoming::Idle);
                    }
                    Some(timespec(left))
                }
                None => None,
            };
            let mut fds = [
                PollFd::new(&self.port, PollFlags::IN),
                PollFd::new(&self.wake, PollFlags::IN),
            ];
            match poll(&mut fds, timeout.as_ref()) {
                Ok(_) | Err(Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
            if !fds[1].revents().is_empty() {
                fido_ring::doorbell::drain(self.wake.as_fd());
                return Ok(Incoming::Idle);
            }
            if fds[0].revents().is_empty() {
                continue;
            }
            let old = pending.len();
            pending.resize(old + READ_CHUNK, 0);
            match rustix::io::read(&self.port, &mut pending[old..]) {
                Ok(0) => {
                    pending.truncate(old);
                    return Ok(Incoming::Eof);
                }
                Ok(n) => pending.truncate(old + n),
                Err(Errno::AGAIN) | Err(Errno::INTR) => pending.truncate(old),
                Err(e) => {
                    pending.truncate(old);
                    return Err(e.into());
                }
            }
        }
    }

    fn break_link(&self, why: String) -> io::Error {
        tracing::error!("guest link broken: {why}");
        let mut st = self.state.lock();
        st.broken.get_or_insert(why.clone());
        st.epoch += 1;
        st.fresh = false;
        io::Error::new(io::ErrorKind::InvalidData, why)
    }

    /// The host closed the port: the current broker connection is gone too.
    fn host_closed(&self) {
        let mut st = self.state.lock();
        st.epoch += 1;
        st.fresh = false;
        st.host_gone = true;
    }

    /// Applies a message that does not belong to any transport's stream:
    /// hang-ups (liveness outlives broker connections) and stray answers.
    fn apply_side_message(&self, msg: HostMsg) {
        match msg {
            HostMsg::Hangup { token } => {
                if self.liveness.lock().remove(&token).is_none() {
                    tracing::debug!(token, "hang-up for a liveness token we do not hold");
                }
            }
            HostMsg::Frame { handles, .. } => {
                tracing::debug!(
                    handles = handles.len(),
                    "dropping a frame of an ended broker connection"
                );
            }
            other => tracing::debug!("ignoring {other:?} outside its exchange"),
        }
    }

    /// `Hello` → `Welcome`. Hang-ups that arrive meanwhile are applied.
    pub(crate) fn hello(&self) -> Result<Welcome, GuestError> {
        let mut pending = self.reader.lock();
        self.hello_locked(&mut pending)
    }

    fn hello_locked(&self, pending: &mut Vec<u8>) -> Result<Welcome, GuestError> {
        if let Some(why) = self.state.lock().broken.clone() {
            return Err(GuestError::Link(why));
        }
        self.write_msg(&GuestMsg::Hello {
            version: link::LINK_VERSION,
        })
        .map_err(|e| GuestError::Link(format!("sending Hello: {e}")))?;
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        loop {
            match self
                .read_msg(pending, Some(deadline))
                .map_err(|e| GuestError::Link(e.to_string()))?
            {
                Incoming::Msg(HostMsg::Welcome(w)) => {
                    if w.version != link::LINK_VERSION {
                        return Err(GuestError::Link(format!(
                            "the supervisor speaks link version {}, we speak {}",
                            w.version,
                            link::LINK_VERSION
                        )));
                    }
                    let mut st = self.state.lock();
                    st.epoch += 1;
                    st.fresh = true;
                    st.host_gone = false;
                    return Ok(w);
                }
                Incoming::Msg(other) => self.apply_side_message(other),
                Incoming::Idle if Instant::now() < deadline => {}
                Incoming::Idle => {
                    return Err(GuestError::Link(format!(
                        "no Welcome within {HANDSHAKE_TIMEOUT:?}"
                    )))
                }
                Incoming::Eof => {
                    return Err(GuestError::Link("the supervisor closed the link".into()))
                }
            }
        }
    }

    /// Makes a transport for a fresh broker connection: the link's unclaimed
    /// one, else one asked for with `Reconnect`.
    pub(crate) fn connect(&self, guest: &Arc<Guest>) -> fido_control::Result<Arc<dyn Transport>> {
        let mut pending = self.reader.lock();
        let (host_gone, broken) = {
            let st = self.state.lock();
            (st.host_gone, st.broken.clone())
        };
        if let Some(why) = broken {
            return Err(ControlError::Unavailable(format!(
                "guest link broken: {why}"
            )));
        }
        if host_gone {
            let welcome = self
                .hello_locked(&mut pending)
                .map_err(|e| ControlError::Unavailable(e.to_string()))?;
            if &welcome != guest.welcome() {
                let why = "the supervisor announced different devices after reopening the link"
                    .to_string();
                self.break_link(why.clone());
                return Err(ControlError::Unavailable(why));
            }
        }
        {
            let mut st = self.state.lock();
            if st.fresh {
                st.fresh = false;
                return Ok(Arc::new(LinkTransport {
                    guest: guest.clone(),
                    epoch: st.epoch,
                    closed: AtomicBool::new(false),
                }));
            }
        }
        self.write_msg(&GuestMsg::Reconnect).map_err(|e| {
            ControlError::Unavailable(format!("asking for a broker connection: {e}"))
        })?;
        let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
        loop {
            let got = self
                .read_msg(&mut pending, Some(deadline))
                .map_err(|e| ControlError::Unavailable(format!("guest link: {e}")))?;
            match got {
                Incoming::Msg(HostMsg::Reconnected) => {
                    let mut st = self.state.lock();
                    st.epoch += 1;
                    st.fresh = false;
                    return Ok(Arc::new(LinkTransport {
                        guest: guest.clone(),
                        epoch: st.epoch,
                        closed: AtomicBool::new(false),
                    }));
                }
                Incoming::Msg(HostMsg::BrokerDown { reason }) => {
                    return Err(ControlError::Unavailable(format!("no broker: {reason}")))
                }
                Incoming::Msg(other) => self.apply_side_message(other),
                Incoming::Idle if Instant::now() < deadline => {}
                Incoming::Idle => {
                    return Err(ControlError::Unavailable(format!(
                        "no answer to Reconnect within {HANDSHAKE_TIMEOUT:?}"
                    )))
                }
                Incoming::Eof => {
                    self.host_closed();
                    return Err(ControlError::Unavailable(
                        "the supervisor closed the link".into(),
                    ));
                }
            }
        }
    }

    fn current(&self, epoch: u64) -> bool {
        let st = self.state.lock();
        st.epoch == epoch && st.broken.is_none()
    }

    /// Registers our end of a fresh liveness pair under `token` and returns
    /// the end the library keeps. Ends whose partner was closed (the library
    /// dropped the connection) are pruned first, so a token the supervisor
    /// reuses while we still hold it is an error, and the table stays small.
    fn new_liveness(&self, token: u64) -> Result<OwnedFd, String> {
        let mut table = self.liveness.lock();
        table.retain(|_, ours| !fido_ring::doorbell::peer_hung_up(ours.as_fd()));
        if table.contains_key(&token) {
            return Err(format!("liveness token {token} is already in use"));
        }
        let (ours, theirs) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| format!("socketpair: {e}"))?;
        table.insert(token, ours);
        Ok(theirs)
    }

    /// How many liveness ends we hold (tests).
    pub(crate) fn liveness_count(&self) -> usize {
        self.liveness.lock().len()
    }
}

fn timespec(d: Duration) -> Timespec {
    Timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: d.subsec_nanos() as i64,
    }
}

/// One broker connection over the link.
pub struct LinkTransport {
    guest: Arc<Guest>,
    epoch: u64,
    closed: AtomicBool,
}

impl LinkTransport {
    fn live(&self) -> bool {
        !self.closed.load(Ordering::Acquire) && self.guest.link().current(self.epoch)
    }

    /// Turns the handles beside a frame into descriptors, in order, or says
    /// why one cannot be used.
    fn materialise(&self, handles: &[Handle]) -> Result<Vec<OwnedFd>, String> {
        let welcome = self.guest.welcome();
        let mut fds = Vec::with_capacity(handles.len());
        for handle in handles {
            let fd = match *handle {
                Handle::Arena { port, len } => {
                    let Some(root) = welcome.ports.get(usize::from(port)) else {
                        return Err(format!(
                            "arena handle names port {port}, the VM has {}",
                            welcome.ports.len()
                        ));
                    };
                    if len == 0 || len > welcome.max_peer_arena {
                        return Err(format!(
                            "arena handle of {len} bytes (ports hold up to {})",
                            welcome.max_peer_arena
                        ));
                    }
                    self.guest
                        .open_peer_arena(root, len, ARENA_APPEAR_TIMEOUT)
                        .map_err(|e| e.to_string())?
                }
                Handle::Ring { peer, vector } => {
                    if vector >= welcome.vectors {
                        return Err(format!(
                            "ring handle names vector {vector}, doorbells have {}",
                            welcome.vectors
                        ));
                    }
                    crate::ring_token::make(self.guest.ring_token_key(), peer, vector)
                        .map_err(|e| format!("ring token: {e}"))?
                }
                Handle::Liveness { token } => self.guest.link().new_liveness(token)?,
                Handle::Unsupported => {
                    return Err("the supervisor could not pass a descriptor into the VM".into())
                }
            };
            fds.push(fd);
        }
        Ok(fds)
    }
}

/// The frame a broker would send to refuse request `id`: what a request the
/// supervisor refused, or whose descriptors could not be brought into the
/// VM, answers with.
fn refusal_frame(id: u64, code: fido_proto::ErrorCode, reason: &str) -> Option<Vec<u8>> {
    let msg = fido_proto::BrokerMsg::Reply {
        id,
        body: Err(fido_proto::RemoteError::new(code, reason)),
    };
    fido_proto::encode(&msg).ok()
}

fn frame_into(buf: &mut [u8], frame: &[u8], fds: Vec<OwnedFd>) -> Received {
    if frame.len() > buf.len() {
        return Received::Frame {
            len: 0,
            fds: Vec::new(),
            truncated: true,
        };
    }
    buf[..frame.len()].copy_from_slice(frame);
    Received::Frame {
        len: frame.len(),
        fds,
        truncated: false,
    }
}

impl Transport for LinkTransport {
    fn send(&self, frame: &[u8], fds: &[OwnedFd]) -> io::Result<()> {
        if !self.live() {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "this broker connection has ended",
            ));
        }
        let mut bells = Vec::with_capacity(fds.len());
        for fd in fds {
            let vector = self.guest.bell_vector(fd.as_fd()).ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a guest can pass only its own doorbells (Guest::new_bell) to the broker",
                )
            })?;
            bells.push(vector);
        }
        self.guest.link().write_msg(&GuestMsg::Frame {
            frame: frame.to_vec(),
            bells,
        })
    }

    fn recv(&self, buf: &mut [u8], timeout: Option<Duration>) -> io::Result<Received> {
        let link = self.guest.link();
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut pending = link.reader.lock();
        loop {
            if !self.live() {
                return Ok(Received::Closed);
            }
            let msg = match link.read_msg(&mut pending, deadline)? {
                Incoming::Msg(m) => m,
                Incoming::Idle
                    if deadline.is_some_and(|d| Instant::now() >= d)
                        || self.closed.load(Ordering::Acquire) =>
                {
                    return Ok(if self.live() {
                        Received::Idle
                    } else {
                        Received::Closed
                    });
                }
                Incoming::Idle => continue,
                Incoming::Eof => {
                    link.host_closed();
                    return Ok(Received::Closed);
                }
            };
            match msg {
                HostMsg::Frame { frame, handles } => {
                    return Ok(match self.materialise(&handles) {
                        Ok(fds) => frame_into(buf, &frame, fds),
                        Err(why) => {
                            tracing::warn!("{why}");
                            match fido_proto::decode::<fido_proto::BrokerMsg>(&frame) {
                                // The request fails; the session lives on.
                                Ok(fido_proto::BrokerMsg::Reply { id, .. }) => match refusal_frame(
                                    id,
                                    fido_proto::ErrorCode::BadDescriptor,
                                    &why,
                                ) {
                                    Some(f) => frame_into(buf, &f, Vec::new()),
                                    None => Received::Frame {
                                        len: 0,
                                        fds: Vec::new(),
                                        truncated: true,
                                    },
                                },
                                // An event arrives without its descriptors: the
                                // library refuses it as it would a malformed one.
                                _ => frame_into(buf, &frame, Vec::new()),
                            }
                        }
                    });
                }
                HostMsg::Refused {
                    id: Some(id),
                    reason,
                } => {
                    if let Some(f) = refusal_frame(
                        id,
                        fido_proto::ErrorCode::Refused,
                        &format!("refused by the VM supervisor: {reason}"),
                    ) {
                        return Ok(frame_into(buf, &f, Vec::new()));
                    }
                }
                HostMsg::Refused { id: None, reason } => {
                    tracing::warn!("the VM supervisor refused a message: {reason}")
                }
                HostMsg::BrokerClosed => {
                    let mut st = link.state.lock();
                    if st.epoch == self.epoch {
                        st.epoch += 1;
                        st.fresh = false;
                    }
                    return Ok(Received::Closed);
                }
                other => link.apply_side_message(other),
            }
        }
    }

    fn passes_fds(&self) -> bool {
        true
    }

    fn shutdown(&self) {
        self.closed.store(true, Ordering::Release);
        let _ = rustix::io::write(&self.guest.link().wake, &1u64.to_ne_bytes());
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use fido_proto::{BrokerMsg, ErrorCode};
    use fido_ring::doorbell::{RingEnd, RingRegister};
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    #[test]
    fn refusals_decode_as_the_broker_would_send_them() {
        let f = refusal_frame(42, ErrorCode::Refused, "quota").unwrap();
        match fido_proto::decode::<BrokerMsg>(&f).unwrap() {
            BrokerMsg::Reply {
                id: 42,
                body: Err(e),
            } => assert_eq!(e.code, ErrorCode::Refused),
            other => panic!("{other:?}"),
        }
    }

    /// Records what was written to the doorbell register.
    #[derive(Default)]
    struct Recorder(parking_lot::Mutex<Vec<u32>>);
    impl RingRegister for Recorder {
        fn ring(&self, value: u32) -> io::Result<()> {
            self.0.lock().push(value);
            Ok(())
        }
    }

    /// The supervisor's end of the link, played by the test.
    struct Host(UnixStream);
    impl Host {
        fn send(&mut self, msg: &HostMsg) {
            self.0.write_all(&link::encode_link(msg).unwrap()).unwrap();
        }
        fn recv(&mut self) -> GuestMsg {
            let mut prefix = [0u8; 4];
            self.0.read_exact(&mut prefix).unwrap();
            let mut body = vec![0u8; link::link_len(prefix).unwrap()];
            self.0.read_exact(&mut body).unwrap();
            link::decode_guest(&body).unwrap()
        }
    }

    fn welcome() -> Welcome {
        Welcome {
            version: link::LINK_VERSION,
            arena: "0000:00:04.0".into(),
            arena_len: 1 << 20,
            doorbell: "0000:00:05.0".into(),
            vectors: 4,
            own_peer: 1,
            ports: vec!["0000:00:10.0".into()],
            max_peer_arena: 1 << 30,
        }
    }

    /// A guest over a socket pair whose other end the test holds.
    fn guest_and_host() -> (Arc<Guest>, Host, Arc<Recorder>) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        theirs
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut host = Host(theirs);
        let greeter = std::thread::spawn(move || {
            assert_eq!(
                host.recv(),
                GuestMsg::Hello {
                    version: link::LINK_VERSION
                }
            );
            host.send(&HostMsg::Welcome(welcome()));
            host
        });
        ours.set_nonblocking(true).unwrap();
        let recorder = Arc::new(Recorder::default());
        let guest = crate::guest_without_devices(OwnedFd::from(ours), 4, recorder.clone()).unwrap();
        (guest, greeter.join().unwrap(), recorder)
    }

    fn recv_frame(t: &dyn Transport, buf: &mut [u8]) -> (Vec<u8>, Vec<OwnedFd>) {
        match t.recv(buf, Some(Duration::from_secs(30))).unwrap() {
            Received::Frame {
                len,
                fds,
                truncated: false,
            } => (buf[..len].to_vec(), fds),
            other => panic!("expected a frame, got {other:?}"),
        }
    }

    fn reply_error(frame: &[u8]) -> (u64, ErrorCode) {
        match fido_proto::decode::<BrokerMsg>(frame).unwrap() {
            BrokerMsg::Reply { id, body: Err(e) } => (id, e.code),
            other => panic!("expected an error reply, got {other:?}"),
        }
    }

    #[test]
    fn frames_bells_and_handles_cross_the_link() {
        let (guest, mut host, recorder) = guest_and_host();
        let t = guest.connector().connect().unwrap();
        assert!(t.passes_fds());
        let mut buf = vec![0u8; fido_proto::MAX_MESSAGE];

        // Our doorbells go out as their vectors, in order; anything else is refused.
        let data = guest.new_bell().unwrap();
        let space = guest.new_bell().unwrap();
        assert_eq!(guest.bell_vector(data.ring.as_fd()), Some(1));
        assert_eq!(guest.bell_vector(space.wait.as_fd()), Some(2));
        t.send(
            b"connect",
            &[
                space.ring.try_clone().unwrap(),
                data.wait.try_clone().unwrap(),
            ],
        )
        .unwrap();
        assert_eq!(
            host.recv(),
            GuestMsg::Frame {
                frame: b"connect".to_vec(),
                bells: vec![2, 1]
            }
        );
        let (stranger, _) = UnixStream::pair().unwrap();
        let err = t.send(b"x", &[OwnedFd::from(stranger)]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        // A bell rung by our own thread wakes our waiter (one eventfd).
        fido_ring::doorbell::ring(data.ring.as_fd()).unwrap();
        assert!(
            fido_ring::doorbell::block_on(data.wait.as_fd(), None, Some(Duration::from_secs(5)))
                .unwrap()
                .rung
        );

        // A peer's doorbell and liveness come in as descriptors.
        host.send(&HostMsg::Frame {
            frame: b"event".to_vec(),
            handles: vec![
                Handle::Ring { peer: 3, vector: 2 },
                Handle::Liveness { token: 5 },
            ],
        });
        let (frame, mut fds) = recv_frame(&*t, &mut buf);
        assert_eq!(frame, b"event");
        assert_eq!(fds.len(), 2);
        let liveness = fds.pop().unwrap();
        let ring = guest.ring_end(fds.pop().unwrap()).unwrap();
        assert!(matches!(
            ring,
            RingEnd::Register {
                value: 0x0003_0002,
                ..
            }
        ));
        ring.ring().unwrap();
        assert_eq!(*recorder.0.lock(), vec![0x0003_0002]);
        assert!(
            guest.ring_end(data.wait.try_clone().unwrap()).is_err(),
            "a bell is not a ring token"
        );
        assert!(!fido_ring::doorbell::peer_hung_up(liveness.as_fd()));

        // A token reused while held fails that frame (an event: delivered bare).
        host.send(&HostMsg::Frame {
            frame: b"again".to_vec(),
            handles: vec![Handle::Liveness { token: 5 }],
        });
        let (frame, fds) = recv_frame(&*t, &mut buf);
        assert_eq!((frame.as_slice(), fds.len()), (&b"again"[..], 0));

        // The hang-up closes our end: the library sees EOF as on the host.
        host.send(&HostMsg::Hangup { token: 5 });
        host.send(&HostMsg::Hangup { token: 999 });
        assert!(matches!(
            t.recv(&mut buf, Some(Duration::from_millis(300))).unwrap(),
            Received::Idle
        ));
        assert!(fido_ring::doorbell::peer_hung_up(liveness.as_fd()));
        assert_eq!(guest.liveness_count(), 0);

        // A refused request and a reply whose descriptor cannot enter the VM
        // fail that request only.
        host.send(&HostMsg::Refused {
            id: Some(9),
            reason: "quota".into(),
        });
        assert_eq!(
            reply_error(&recv_frame(&*t, &mut buf).0),
            (9, ErrorCode::Refused)
        );
        let ok = fido_proto::encode(&BrokerMsg::Reply {
            id: 10,
            body: Ok(fido_proto::Reply::Ok),
        })
        .unwrap();
        for bad in [
            Handle::Unsupported,
            Handle::Arena { port: 1, len: 4096 },
            Handle::Arena {
                port: 0,
                len: 1 << 31,
            },
            Handle::Ring { peer: 1, vector: 4 },
        ] {
            host.send(&HostMsg::Frame {
                frame: ok.clone(),
                handles: vec![Handle::Liveness { token: 77 }, bad],
            });
            let (frame, fds) = recv_frame(&*t, &mut buf);
            assert_eq!(
                reply_error(&frame),
                (10, ErrorCode::BadDescriptor),
                "{bad:?}"
            );
            assert!(fds.is_empty());
        }
        // A frame larger than the caller's buffer is reported truncated.
        host.send(&HostMsg::Frame {
            frame: vec![7; 64],
            handles: vec![],
        });
        assert!(matches!(
            t.recv(&mut buf[..16], Some(Duration::from_secs(30)))
                .unwrap(),
            Received::Frame {
                truncated: true,
                ..
            }
        ));
    }

    #[test]
    fn broker_loss_and_reconnection() {
        let (guest, mut host, _) = guest_and_host();
        let connector = guest.connector();
        let first = connector.connect().unwrap();
        let mut buf = vec![0u8; fido_proto::MAX_MESSAGE];
        host.send(&HostMsg::BrokerClosed);
        assert!(matches!(
            first.recv(&mut buf, Some(Duration::from_secs(30))).unwrap(),
            Received::Closed
        ));
        assert_eq!(
            first.send(b"late", &[]).unwrap_err().kind(),
            io::ErrorKind::NotConnected
        );

        // No broker yet: the connect fails and the session will retry.
        let h = std::thread::spawn(move || {
            assert_eq!(host.recv(), GuestMsg::Reconnect);
            host.send(&HostMsg::BrokerDown {
                reason: "restarting".into(),
            });
            assert_eq!(host.recv(), GuestMsg::Reconnect);
            // Leftovers of the old connection before the answer: dropped; a
            // hang-up still applies.
            host.send(&HostMsg::Frame {
                frame: b"stale".to_vec(),
                handles: vec![],
            });
            host.send(&HostMsg::Reconnected);
            host
        });
        let err = connector
            .connect()
            .err()
            .expect("BrokerDown must fail the connect");
        assert!(err.to_string().contains("restarting"), "{err}");
        let second = connector.connect().unwrap();
        let mut host = h.join().unwrap();
        assert!(
            matches!(
                first.recv(&mut buf, Some(Duration::ZERO)).unwrap(),
                Received::Closed
            ),
            "the old transport stays ended"
        );
        host.send(&HostMsg::Frame {
            frame: b"fresh".to_vec(),
            handles: vec![],
        });
        assert_eq!(recv_frame(&*second, &mut buf).0, b"fresh");
        second.send(b"hi", &[]).unwrap();
        assert_eq!(
            host.recv(),
            GuestMsg::Frame {
                frame: b"hi".to_vec(),
                bells: vec![]
            }
        );

        // shutdown wakes a reader blocked with no timeout.
        let reader = {
            let second = second.clone();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64];
                matches!(second.recv(&mut buf, None).unwrap(), Received::Closed)
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        second.shutdown();
        assert!(
            reader.join().unwrap(),
            "shutdown did not end the blocked recv"
        );

        // A second session in the process asks for its own connection.
        let h = std::thread::spawn(move || {
            assert_eq!(host.recv(), GuestMsg::Reconnect);
            host.send(&HostMsg::Reconnected);
            host
        });
        let third = connector.connect().unwrap();
        let mut host = h.join().unwrap();

        // Bytes that cannot be trusted end the link for good.
        host.0.write_all(&u32::MAX.to_le_bytes()).unwrap();
        assert!(third.recv(&mut buf, Some(Duration::from_secs(30))).is_err());
        assert!(matches!(
            third.recv(&mut buf, Some(Duration::ZERO)).unwrap(),
            Received::Closed
        ));
        assert!(connector.connect().is_err());
    }

    /// The supervisor closing the port is a lost broker; the next connect
    /// says Hello again (and fails while nobody answers).
    #[test]
    fn a_closed_port_ends_the_connection_and_the_next_connect_says_hello() {
        let (guest, host, _) = guest_and_host();
        let t = guest.connector().connect().unwrap();
        let mut buf = vec![0u8; 256];
        // Half-close: the guest reads EOF but can still write its Hello.
        host.0.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(matches!(
            t.recv(&mut buf, Some(Duration::from_secs(30))).unwrap(),
            Received::Closed
        ));
        assert_eq!(
            t.send(b"late", &[]).unwrap_err().kind(),
            io::ErrorKind::NotConnected
        );
        let mut host = host;
        let h = std::thread::spawn(move || {
            assert_eq!(
                host.recv(),
                GuestMsg::Hello {
                    version: link::LINK_VERSION
                }
            );
            drop(host);
        });
        let err = guest
            .connector()
            .connect()
            .err()
            .expect("nobody answered the Hello");
        h.join().unwrap();
        assert!(err.to_string().contains("closed"), "{err}");
    }
}
