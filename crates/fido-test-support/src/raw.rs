//! A raw client of the broker's control protocol, for the broker's own
//! tests: a SEQPACKET socket, `sendmsg` with descriptors, `recvmsg` with a
//! timeout, and the resources a join hands over (arenas, doorbells). It does
//! not use the `fido` library, so the broker is tested against the protocol,
//! not against its one client.

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use fido_proto::{BrokerMsg, ClientMsg, DomainId, ErrorCode, Event, RemoteError, Reply, Request, Resume, ResumeSecret, RingBlock};
use rustix::event::{PollFd, PollFlags};
use rustix::fs::{MemfdFlags, Mode, OFlags, SealFlags};
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
    SocketAddrUnix, SocketFlags, SocketType,
};

use crate::broker::{Defaults, TestBroker};

/// How long a raw client waits for a reply or an event.
pub const WAIT: Duration = Duration::from_secs(5);
pub const ARENA_LEN: u64 = 1 << 20;
pub const BLOCK: RingBlock = RingBlock { offset: 4096, len: 4096, entries: 64 };

impl TestBroker<Defaults> {
    /// A raw client connected to this broker (not joined yet).
    pub fn client(&self) -> Raw {
        Raw::connect(&self.config.socket)
    }
}

/// A sealed memfd arena: (the owner's rw descriptor, a read-only re-open).
pub fn arena(len: u64) -> (OwnedFd, OwnedFd) {
    arena_with(
        len,
        SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE,
        OFlags::RDONLY,
    )
}

pub fn arena_with(len: u64, seals: SealFlags, mode: OFlags) -> (OwnedFd, OwnedFd) {
    let fd = memfd(len);
    if !seals.is_empty() {
        rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
    }
    let ro = reopen(&fd, mode);
    (fd, ro)
}

/// An unsealed memfd of `len` bytes that allows sealing (fill it, then [`seal`]).
pub fn memfd(len: u64) -> OwnedFd {
    let fd = rustix::fs::memfd_create(
        "test-arena",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    fd
}

/// Seals a memfd as every arena is before it is granted
/// (SHRINK|GROW|FUTURE_WRITE, and SEAL so nothing more can change).
pub fn seal(fd: &OwnedFd) {
    rustix::fs::fcntl_add_seals(
        fd,
        SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE | SealFlags::SEAL,
    )
    .unwrap();
}

/// A fresh file description of `fd`'s file (a re-open through /proc), as a
/// grant is made: `mode` is `OFlags::RDONLY` for a read-only grant.
pub fn reopen(fd: &OwnedFd, mode: OFlags) -> OwnedFd {
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    rustix::fs::open(path.as_str(), mode | OFlags::CLOEXEC, Mode::empty()).unwrap()
}

pub fn eventfd() -> OwnedFd {
    rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    )
    .unwrap()
}

/// A doorbell as the library makes one: the broker is handed the ring end
/// (`as_fd`), the maker keeps the wait end.
pub struct Bell {
    pub wait: OwnedFd,
    pub ring: OwnedFd,
}

impl AsFd for Bell {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.ring.as_fd()
    }
}

pub fn bell() -> Bell {
    let (wait, ring) = rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK,
        None,
    )
    .unwrap();
    Bell { wait, ring }
}

pub fn is_doorbell(fd: &OwnedFd) -> bool {
    fido_proto::wire::is_doorbell(fd.as_fd())
}

/// Rings a doorbell `n` times through a ring end.
pub fn ring_bell(fd: &OwnedFd, n: usize) {
    for _ in 0..n {
        rustix::net::send(fd, &[1], rustix::net::SendFlags::DONTWAIT).unwrap();
    }
}

/// How many rings are pending on a wait end (consumes them).
pub fn rings(wait: &OwnedFd) -> usize {
    let mut n = 0;
    let mut b = [0u8; 64];
    while let Ok((got, _)) = rustix::net::recv(wait, &mut b, rustix::net::RecvFlags::DONTWAIT) {
        if got == 0 {
            break;
        }
        n += got;
    }
    n
}

pub fn fd_kind(fd: BorrowedFd<'_>) -> String {
    let link = format!("/proc/self/fd/{}", fd.as_raw_fd());
    rustix::fs::readlinkat(rustix::fs::CWD, link.as_str(), Vec::new())
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

pub fn is_eventfd(fd: &OwnedFd) -> bool {
    fd_kind(fd.as_fd()) == "anon_inode:[eventfd]"
}

pub fn is_memfd(fd: &OwnedFd) -> bool {
    fd_kind(fd.as_fd()).starts_with("/memfd:")
}

pub fn is_socket(fd: &OwnedFd) -> bool {
    fd_kind(fd.as_fd()).starts_with("socket:")
}

/// Waits until `fd` is readable (or hung up); false on timeout.
pub fn readable(fd: BorrowedFd<'_>, timeout: Duration) -> bool {
    let mut pfd = [PollFd::from_borrowed_fd(fd, PollFlags::IN)];
    let ts = rustix::event::Timespec {
        tv_sec: timeout.as_secs() as _,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    loop {
        match rustix::event::poll(&mut pfd, Some(&ts)) {
            Ok(n) => return n > 0,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => panic!("poll: {e}"),
        }
    }
}

pub type Received = (BrokerMsg, Vec<OwnedFd>);

pub struct Raw {
    pub sock: OwnedFd,
    next_id: u64,
    stash: VecDeque<Received>,
    pub domain: Option<DomainId>,
    pub slot: Option<u32>,
    /// The secret from the last `Joined`, for a later resume.
    pub resume_secret: Option<ResumeSecret>,
    /// The owner's rw arena descriptor, kept alive while joined.
    pub arena: Option<OwnedFd>,
}

impl Raw {
    pub fn connect(path: &Path) -> Raw {
        let sock = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        rustix::net::connect(&sock, &SocketAddrUnix::new(path).unwrap()).unwrap();
        Raw {
            sock,
            next_id: 1,
            stash: VecDeque::new(),
            domain: None,
            slot: None,
            resume_secret: None,
            arena: None,
        }
    }

    pub fn send_bytes(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(16))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() {
            assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
        }
        rustix::net::sendmsg(
            &self.sock,
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        )
        .unwrap();
    }

    pub fn send(&self, msg: &ClientMsg, fds: &[BorrowedFd<'_>]) {
        self.send_bytes(&fido_proto::encode(msg).unwrap(), fds);
    }

    pub fn heartbeat(&self) {
        self.send(&ClientMsg::Heartbeat, &[]);
    }

    /// Next message from the broker; `None` on timeout; panics on EOF.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Option<Received> {
        if let Some(m) = self.stash.pop_front() {
            return Some(m);
        }
        self.recv_raw(timeout)
            .map(|r| r.expect("broker closed the connection"))
    }

    /// `Some(None)` on EOF.
    pub fn recv_raw(&mut self, timeout: Duration) -> Option<Option<Received>> {
        if !readable(self.sock.as_fd(), timeout) {
            return None;
        }
        let mut buf = vec![0u8; fido_proto::MAX_MESSAGE];
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(16))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let msg = rustix::net::recvmsg(
            &self.sock,
            &mut [IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        );
        let msg = match msg {
            Ok(m) => m,
            Err(rustix::io::Errno::CONNRESET) => return Some(None),
            Err(e) => panic!("recvmsg: {e}"),
        };
        let mut fds = Vec::new();
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(r) = m {
                fds.extend(r);
            }
        }
        if msg.bytes == 0 {
            return Some(None);
        }
        let decoded =
            fido_proto::decode::<BrokerMsg>(&buf[..msg.bytes]).expect("broker sent garbage");
        Some(Some((decoded, fds)))
    }

    /// True if the broker closed this connection within `timeout` (messages
    /// received before the EOF are discarded).
    pub fn wait_eof(&mut self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.recv_raw(left) {
                None => return false,
                Some(None) => return true,
                Some(Some(_)) => continue,
            }
        }
    }

    /// Sends a request and waits for its reply; events received meanwhile are stashed.
    pub fn request_fds(
        &mut self,
        body: Request,
        fds: &[BorrowedFd<'_>],
    ) -> (Result<Reply, RemoteError>, Vec<OwnedFd>) {
        let id = self.next_id;
        self.next_id += 1;
        self.send(&ClientMsg::Request { id, body }, fds);
        self.wait_reply(id)
    }

    pub fn wait_reply(&mut self, id: u64) -> (Result<Reply, RemoteError>, Vec<OwnedFd>) {
        let end = Instant::now() + WAIT;
        let mut later = VecDeque::new();
        let out = loop {
            let left = end.saturating_duration_since(Instant::now());
            let Some(m) = self.recv_raw(left) else {
                panic!("no reply to request {id}")
            };
            let (msg, fds) = m.expect("broker closed the connection while a request was pending");
            match msg {
                BrokerMsg::Reply { id: got, body } if got == id => break (body, fds),
                other => later.push_back((other, fds)),
            }
        };
        self.stash.extend(later);
        out
    }

    /// Sends a request without waiting; returns its id.
    pub fn send_request(&mut self, body: Request, fds: &[BorrowedFd<'_>]) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.send(&ClientMsg::Request { id, body }, fds);
        id
    }

    pub fn request(&mut self, body: Request) -> Result<Reply, RemoteError> {
        let (r, fds) = self.request_fds(body, &[]);
        assert!(fds.is_empty(), "unexpected descriptors with reply {r:?}");
        r
    }

    pub fn ok(&mut self, body: Request) {
        let what = format!("{body:?}");
        assert_eq!(self.request(body), Ok(Reply::Ok), "{what}");
    }

    pub fn err_code(&mut self, body: Request) -> ErrorCode {
        match self.request(body) {
            Err(e) => e.code,
            Ok(r) => panic!("expected an error, got {r:?}"),
        }
    }

    pub fn join_with(&mut self, name: &str, resume: Option<Resume>) -> Result<Reply, RemoteError> {
        self.join_request(name, Some("test"), ARENA_LEN, resume).0
    }

    /// Joins as `name` with `label` and an arena of `arena_len` bytes; a
    /// join's answer carries no descriptors (asserted).
    pub fn join_labelled(
        &mut self,
        name: &str,
        label: Option<&str>,
        arena_len: u64,
    ) -> Result<Reply, RemoteError> {
        let (r, fds) = self.join_request(name, label, arena_len, None);
        assert!(fds.is_empty(), "a join answered with descriptors: {r:?}");
        r
    }

    /// Sends a `Join` with a fresh arena; on `Joined`, records the domain,
    /// slot and resume secret and keeps the arena.
    fn join_request(
        &mut self,
        name: &str,
        label: Option<&str>,
        arena_len: u64,
        resume: Option<Resume>,
    ) -> (Result<Reply, RemoteError>, Vec<OwnedFd>) {
        let (rw, ro) = arena(arena_len);
        let (r, fds) = self.request_fds(
            Request::Join {
                name: name.into(),
                label: label.map(Into::into),
                arena_len,
                resume,
            },
            &[ro.as_fd()],
        );
        if let Ok(Reply::Joined { domain, slot, resume_secret, .. }) = &r {
            self.domain = Some(*domain);
            self.slot = Some(*slot);
            self.resume_secret = Some(*resume_secret);
            self.arena = Some(rw);
        }
        (r, fds)
    }

    /// The resume secret this client's last join was given.
    pub fn secret(&self) -> ResumeSecret {
        self.resume_secret.expect("joined: the broker issued a resume secret")
    }

    pub fn join(&mut self, name: &str) -> (DomainId, u32) {
        match self.join_with(name, None) {
            Ok(Reply::Joined { domain, slot, .. }) => (domain, slot),
            other => panic!("join failed: {other:?}"),
        }
    }

    /// Next event (skipping nothing); panics on timeout.
    pub fn event(&mut self) -> (Event, Vec<OwnedFd>) {
        match self.recv_timeout(WAIT) {
            Some((BrokerMsg::Event(e), fds)) => (e, fds),
            Some((other, _)) => panic!("expected an event, got {other:?}"),
            None => panic!("no event within {WAIT:?}"),
        }
    }

    /// Next event matching `pred`, discarding others.
    pub fn event_where(&mut self, mut pred: impl FnMut(&Event) -> bool) -> (Event, Vec<OwnedFd>) {
        let end = Instant::now() + WAIT;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.recv_timeout(left) {
                Some((BrokerMsg::Event(e), fds)) if pred(&e) => return (e, fds),
                Some(_) => continue,
                None => panic!("no matching event within {WAIT:?}"),
            }
        }
    }

    /// No message arrives within `d`.
    pub fn quiet_for(&mut self, d: Duration) -> bool {
        self.stash.is_empty() && self.recv_raw(d).is_none()
    }
}

pub fn write_u64(fd: &OwnedFd, v: u64) {
    rustix::io::write(fd, &v.to_ne_bytes()).unwrap();
}

pub fn read_u64(fd: &OwnedFd) -> Option<u64> {
    let mut b = [0u8; 8];
    match rustix::io::read(fd, &mut b) {
        Ok(8) => Some(u64::from_ne_bytes(b)),
        _ => None,
    }
}
