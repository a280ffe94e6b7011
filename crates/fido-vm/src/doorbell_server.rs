//! The ivshmem server of one VM's `ivshmem-doorbell` device.
//!
//! QEMU's protocol (docs/specs/ivshmem-spec.rst): the server sends
//! little-endian `i64` messages on a Unix stream socket, some with one
//! descriptor attached (SCM_RIGHTS, one per message):
//!
//! | message                  | meaning                                           |
//! |--------------------------|---------------------------------------------------|
//! | `0`, no descriptor       | protocol version 0                                |
//! | `id`, no descriptor      | the VM's own peer id (read at `IVPOSITION`)       |
//! | `-1` + memfd             | the device's shared memory (BAR 2; unused by Fido)|
//! | `peer` + descriptor      | the next vector of `peer`: for our own id, the descriptor QEMU turns into that MSI-X vector; for another id, what a guest write of `(peer << 16) \| vector` to BAR0 + 12 writes 8 bytes to |
//! | `peer`, no descriptor    | `peer` is gone: QEMU closes its descriptors       |
//!
//! QEMU reads the first three while it creates the device, synchronously, so
//! they must be in the socket before QEMU starts ([`DoorbellServer::new`]
//! writes them); the rest it reads from its main loop.
//!
//! Fido's host doorbells are socket pairs ([`fido_ring::doorbell`]-style):
//! under TCG QEMU polls and `read()`s its vector descriptors and `write()`s
//! peer descriptors, so sockets work as they are ([`VectorKind::SocketPair`]).
//! Each of the VM's own vectors is a fresh socket pair: QEMU gets one end, the
//! **ring end** ([`DoorbellServer::own_ring_end`]) is what host peers send a
//! byte on. Each host peer is given one peer id, whose vector 0 is its ring
//! end. With KVM, QEMU hands vector descriptors to the kernel (irqfd,
//! ioeventfd), which accept only eventfds ([`VectorKind::EventFd`]); the
//! supervisor then bridges host sockets to them.
//!
//! The guard. QEMU writes to a peer's ring end with a plain `write()` from the
//! vCPU thread: if the description lost `O_NONBLOCK` and the peer never
//! reads, that write blocks and freezes the VM. The descriptor QEMU holds
//! shares its file description with the peer, which can clear the flag at any
//! time; QEMU itself clears it while receiving the descriptor (its socket
//! chardev makes every received descriptor blocking) and sets it again just
//! after (for vector descriptors). So [`DoorbellServer::add_peer`] waits until
//! QEMU has taken the descriptor and the flag is back, and from then on
//! [`DoorbellServer::check_peers`] cuts any peer whose description is blocking
//! or whose doorbell stays full (a peer that toggles the flag around a blocked
//! write): `shutdown(SHUT_RDWR)` wakes a blocked writer with `EPIPE` (QEMU
//! ignores SIGPIPE) and later writes fail at once.

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::fs::OFlags;
use rustix::io::Errno;
use rustix::net::{sendmsg, socketpair, AddressFamily, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags, SocketType};
use std::collections::BTreeMap;
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

/// The VM's own peer id.
pub const OWN_PEER: u16 = 0;
/// Highest peer id handed out (QEMU keeps an array up to the highest id).
pub const MAX_PEER_ID: u16 = 4095;
/// The device's shared memory (BAR 2): unused by Fido, but the protocol
/// requires one; a page (BARs are powers of two).
const SHM_LEN: u64 = 4096;
/// How long `add_peer` waits for QEMU to take a descriptor.
const TAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// What the VM's own vectors (and the peers' descriptors) are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VectorKind {
    /// Unix stream socket pairs, like Fido's host doorbells (TCG).
    SocketPair,
    /// eventfds, which KVM's irqfd and ioeventfd require.
    EventFd,
}

impl VectorKind {
    /// The kind QEMU can use under `accel`.
    pub fn for_accel(accel: crate::qemu::Accel) -> VectorKind {
        match accel {
            crate::qemu::Accel::Kvm => VectorKind::EventFd,
            crate::qemu::Accel::Tcg => VectorKind::SocketPair,
        }
    }
}

/// What went wrong serving the doorbell device.
#[derive(Debug, thiserror::Error)]
pub enum DoorbellError {
    #[error("doorbell server socket: {0}")]
    Io(#[from] io::Error),
    #[error("QEMU did not take the doorbell server's messages within {0:?}")]
    NotTaken(Duration),
    #[error("every doorbell peer id is in use")]
    NoFreeId,
    #[error("doorbell peer {0} is not registered")]
    NoSuchPeer(u16),
    #[error("a doorbell vector {0} does not exist")]
    NoSuchVector(u16),
    #[error("a peer's doorbell must be a Unix stream socket (QEMU writes guest rings to it)")]
    NotASocket,
}

/// A peer's descriptor as QEMU holds it: our duplicate of the same file
/// description, to watch its flags and queue.
#[derive(Debug)]
struct PeerBell {
    fd: OwnedFd,
    /// Its queue was (nearly) full at the last check.
    full_once: bool,
}

/// The doorbell server of one VM. Keep it as long as QEMU runs: dropping it
/// closes the own vectors' ring ends, and once no host peer holds one either,
/// QEMU would see end-of-file on its ends and spin on them.
#[derive(Debug)]
pub struct DoorbellServer {
    sock: OwnedFd,
    kind: VectorKind,
    /// The ring end of each of our vectors, by vector.
    own_ring: Vec<OwnedFd>,
    /// Handshake messages not yet written (the socket was full).
    unsent: Vec<(i64, Option<OwnedFd>)>,
    peers: BTreeMap<u16, PeerBell>,
    next_peer: u16,
    /// Peers shut down while `add_peer` waited for QEMU (a frozen QEMU
    /// cannot take a descriptor), reported by the next `check_peers`.
    cut_while_waiting: Vec<u16>,
}

impl DoorbellServer {
    /// Creates the server socket pair and the VM's `vectors` own vectors, and
    /// writes the handshake into the socket. Returns the server and QEMU's end
    /// of the socket (for [`crate::VmFds::doorbell`]). Call
    /// [`DoorbellServer::complete_handshake`] once QEMU runs.
    pub fn new(vectors: u16, kind: VectorKind) -> Result<(DoorbellServer, OwnedFd), DoorbellError> {
        if !(2..=crate::qemu::MAX_VECTORS).contains(&vectors) {
            return Err(DoorbellError::NoSuchVector(vectors));
        }
        let flags = SocketFlags::CLOEXEC | SocketFlags::NONBLOCK;
        let (sock, qemu_end) = socketpair(AddressFamily::UNIX, SocketType::STREAM, flags, None).map_err(io::Error::from)?;
        let shm = rustix::fs::memfd_create("fido-doorbell-shm", rustix::fs::MemfdFlags::CLOEXEC).map_err(io::Error::from)?;
        rustix::fs::ftruncate(&shm, SHM_LEN).map_err(io::Error::from)?;
        let mut messages: Vec<(i64, Option<OwnedFd>)> = vec![(0, None), (OWN_PEER as i64, None), (-1, Some(shm))];
        let mut own_ring = Vec::with_capacity(vectors as usize);
        for _ in 0..vectors {
            let (ring, qemu_side) = match kind {
                VectorKind::SocketPair => socketpair(AddressFamily::UNIX, SocketType::STREAM, flags, None).map_err(io::Error::from)?,
                VectorKind::EventFd => {
                    let e = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK).map_err(io::Error::from)?;
                    let dup = rustix::io::fcntl_dupfd_cloexec(&e, 0).map_err(io::Error::from)?;
                    (e, dup)
                }
            };
            own_ring.push(ring);
            messages.push((OWN_PEER as i64, Some(qemu_side)));
        }
        let mut server = DoorbellServer { sock, kind, own_ring, unsent: Vec::new(), peers: BTreeMap::new(), next_peer: OWN_PEER + 1, cut_while_waiting: Vec::new() };
        let mut rest = messages.into_iter();
        let mut sent = 0;
        for (value, fd) in rest.by_ref() {
            if !server.try_send(value, fd.as_ref().map(|f| f.as_fd()))? {
                server.unsent.push((value, fd));
                break;
            }
            sent += 1;
        }
        server.unsent.extend(rest);
        if sent < 3 {
            // QEMU reads the first three while creating the device, before
            // anyone could write more: they must fit.
            return Err(DoorbellError::Io(io::Error::other("the doorbell handshake does not fit the socket")));
        }
        Ok((server, qemu_end))
    }

    /// Writes what of the handshake did not fit before QEMU started and waits
    /// (up to `timeout`) until QEMU has read all of it, so that every own
    /// vector is live and non-blocking in QEMU. An error means QEMU is not
    /// serving the device (it exited, or is stuck).
    pub fn complete_handshake(&mut self, timeout: Duration) -> Result<(), DoorbellError> {
        let deadline = Instant::now() + timeout;
        let pending = std::mem::take(&mut self.unsent);
        for (value, fd) in pending {
            loop {
                if self.try_send(value, fd.as_ref().map(|f| f.as_fd()))? {
                    break;
                }
                if Instant::now() >= deadline {
                    return Err(DoorbellError::NotTaken(timeout));
                }
                wait_writable(&self.sock, deadline);
            }
        }
        self.wait_taken(deadline, timeout, None)
    }

    /// The VM's own peer id.
    pub fn own_peer(&self) -> u16 {
        OWN_PEER
    }

    /// How many vectors the VM has.
    pub fn vectors(&self) -> u16 {
        self.own_ring.len() as u16
    }

    pub fn kind(&self) -> VectorKind {
        self.kind
    }

    /// The ring end of our vector `vector`: a host peer that sends a byte on
    /// it (a socket pair) raises that MSI-X vector in the guest. The broker
    /// gives duplicates of it to peers as this VM's doorbells.
    pub fn own_ring_end(&self, vector: u16) -> Option<BorrowedFd<'_>> {
        self.own_ring.get(vector as usize).map(|f| f.as_fd())
    }

    /// Registers a host peer's ring end (its doorbell) and returns the peer
    /// id the guest rings it with (vector 0). Waits until QEMU has taken the
    /// descriptor (see the guard in the module docs).
    pub fn add_peer(&mut self, ring: BorrowedFd<'_>) -> Result<u16, DoorbellError> {
        // Only a socket: QEMU would append to a file, and a pipe has no send
        // queue the guard can watch.
        let stream = rustix::net::sockopt::socket_type(ring) == Ok(SocketType::STREAM);
        if !stream || rustix::net::sockopt::socket_domain(ring) != Ok(AddressFamily::UNIX) {
            return Err(DoorbellError::NotASocket);
        }
        let id = self.free_id().ok_or(DoorbellError::NoFreeId)?;
        let dup = rustix::io::fcntl_dupfd_cloexec(ring, 0).map_err(io::Error::from)?;
        set_nonblocking(&dup)?;
        let deadline = Instant::now() + TAKE_TIMEOUT;
        while !self.try_send(id as i64, Some(dup.as_fd()))? {
            if Instant::now() >= deadline {
                return Err(DoorbellError::NotTaken(TAKE_TIMEOUT));
            }
            wait_writable(&self.sock, deadline);
        }
        self.next_peer = if id >= MAX_PEER_ID { OWN_PEER + 1 } else { id + 1 };
        // Registered before waiting: if QEMU takes it late, remove_peer and
        // check_peers still know the id.
        self.peers.insert(id, PeerBell { fd: dup, full_once: false });
        if let Err(e) = self.wait_taken(deadline, TAKE_TIMEOUT, Some(id)) {
            // QEMU is not reading: forget the peer (QEMU drops it again when
            // it reads on), so the caller is not left with an id it never got.
            let _ = self.remove_peer(id);
            return Err(e);
        }
        // QEMU made the description blocking while receiving it and sets
        // O_NONBLOCK again right after, in the same main-loop callback. Give
        // it that moment, then make sure.
        let fd = &self.peers[&id].fd;
        let settle = Instant::now() + Duration::from_millis(200);
        while !is_nonblocking(fd)? && Instant::now() < settle {
            std::thread::sleep(Duration::from_millis(1));
        }
        set_nonblocking(fd)?;
        Ok(id)
    }

    /// Unregisters peer `id`: QEMU closes its descriptor (a guest ringing the
    /// id afterwards rings nothing).
    pub fn remove_peer(&mut self, id: u16) -> Result<(), DoorbellError> {
        if self.peers.remove(&id).is_none() {
            return Err(DoorbellError::NoSuchPeer(id));
        }
        let deadline = Instant::now() + TAKE_TIMEOUT;
        while !self.try_send(id as i64, None)? {
            if Instant::now() >= deadline {
                return Err(DoorbellError::NotTaken(TAKE_TIMEOUT));
            }
            wait_writable(&self.sock, deadline);
        }
        Ok(())
    }

    /// The registered peer ids.
    pub fn peers(&self) -> impl Iterator<Item = u16> + '_ {
        self.peers.keys().copied()
    }

    /// The guard: cuts every peer whose ring end lost `O_NONBLOCK`, or whose
    /// queue was nearly full at this check and the one before (a peer that
    /// does not read its doorbell, which may hold a QEMU write blocked). A
    /// cut peer's description is shut down (a blocked writer gets `EPIPE`)
    /// and unregistered; its ids are returned so the caller drops those
    /// connections. Call it periodically (say every 100 ms to 1 s).
    pub fn check_peers(&mut self) -> Vec<u16> {
        let mut cut = std::mem::take(&mut self.cut_while_waiting);
        for (&id, bell) in self.peers.iter_mut() {
            if cut.contains(&id) {
                continue;
            }
            let blocking = !is_nonblocking(&bell.fd).unwrap_or(false);
            let full = queue_nearly_full(&bell.fd);
            if blocking || (full && bell.full_once) {
                let _ = rustix::net::shutdown(&bell.fd, rustix::net::Shutdown::Both);
                cut.push(id);
            }
            bell.full_once = full;
        }
        for id in &cut {
            // QEMU closes its copy; a full server socket only delays that.
            let _ = self.remove_peer(*id);
        }
        cut
    }

    /// Sends one message; `Ok(false)` when the socket is full.
    fn try_send(&self, value: i64, fd: Option<BorrowedFd<'_>>) -> Result<bool, DoorbellError> {
        let bytes = value.to_le_bytes();
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let fds;
        if let Some(f) = fd {
            fds = [f];
            if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
                return Err(io::Error::other("control buffer too small").into());
            }
        }
        loop {
            // One message per sendmsg: QEMU attaches the descriptors of one
            // read to one message, and a stream never splits an 8-byte write
            // that carries descriptors across reads.
            return match sendmsg(&self.sock, &[IoSlice::new(&bytes)], &mut control, SendFlags::NOSIGNAL | SendFlags::DONTWAIT) {
                Ok(8) => Ok(true),
                Ok(n) => Err(io::Error::other(format!("short write of {n} bytes to the doorbell server socket")).into()),
                Err(Errno::INTR) => continue,
                Err(Errno::AGAIN) => Ok(false),
                Err(e) => Err(io::Error::from(e).into()),
            };
        }
    }

    /// Waits until QEMU has read everything written to the server socket.
    /// Meanwhile it cuts peers whose description is blocking (but not
    /// `adding`, which QEMU may be holding blocking for a moment): one of them
    /// may be why QEMU does not read.
    fn wait_taken(&mut self, deadline: Instant, timeout: Duration, adding: Option<u16>) -> Result<(), DoorbellError> {
        loop {
            if outq(&self.sock)? == 0 {
                return Ok(());
            }
            for (&id, bell) in &self.peers {
                if Some(id) != adding && !self.cut_while_waiting.contains(&id) && !is_nonblocking(&bell.fd).unwrap_or(false) {
                    let _ = rustix::net::shutdown(&bell.fd, rustix::net::Shutdown::Both);
                    self.cut_while_waiting.push(id);
                }
            }
            if Instant::now() >= deadline {
                return Err(DoorbellError::NotTaken(timeout));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The next free peer id after the last one given (ids are not reused at
    /// once, so a guest still ringing a removed peer's id rings nobody).
    fn free_id(&self) -> Option<u16> {
        let span = MAX_PEER_ID - OWN_PEER;
        (0..span).map(|k| OWN_PEER + 1 + (self.next_peer - OWN_PEER - 1 + k) % span).find(|id| !self.peers.contains_key(id))
    }
}

fn wait_writable(sock: &OwnedFd, deadline: Instant) {
    let left = deadline.saturating_duration_since(Instant::now()).min(Duration::from_millis(50));
    let ts = Timespec { tv_sec: 0, tv_nsec: left.subsec_nanos() as i64 };
    let mut fds = [PollFd::new(sock, PollFlags::OUT)];
    let _ = poll(&mut fds, Some(&ts));
}

fn is_nonblocking(fd: &OwnedFd) -> io::Result<bool> {
    Ok(rustix::fs::fcntl_getfl(fd)?.contains(OFlags::NONBLOCK))
}

fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    // FIONBIO sets only O_NONBLOCK, whatever else the description carries.
    rustix::io::ioctl_fionbio(fd, true)?;
    Ok(())
}

/// Bytes a socket has sent that its peer has not read yet (`SIOCOUTQ`).
fn outq(fd: &OwnedFd) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCOUTQ writes one int through the pointer, which points to a
    // live c_int; the descriptor is open.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n.max(0) as usize)
}

/// Whether a socket's unread output is over three quarters of its send
/// buffer (the point where writes start failing or blocking). Not a socket:
/// never full (an eventfd saturates instead).
fn queue_nearly_full(fd: &OwnedFd) -> bool {
    let Ok(sndbuf) = rustix::net::sockopt::socket_send_buffer_size(fd) else {
        return false;
    };
    matches!(outq(fd), Ok(q) if q >= sndbuf / 4 * 3)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (OwnedFd, OwnedFd) {
        socketpair(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK, None).unwrap()
    }

    #[test]
    fn free_ids_cycle_without_immediate_reuse() {
        let (mut s, _q) = DoorbellServer::new(4, VectorKind::SocketPair).unwrap();
        assert_eq!(s.free_id(), Some(1));
        let (_w, r) = pair();
        s.peers.insert(1, PeerBell { fd: r, full_once: false });
        s.next_peer = 2;
        assert_eq!(s.free_id(), Some(2));
        s.next_peer = MAX_PEER_ID;
        assert_eq!(s.free_id(), Some(MAX_PEER_ID));
        s.next_peer = 1;
        assert_eq!(s.free_id(), Some(2), "1 is taken");
    }

    #[test]
    fn only_unix_stream_sockets_are_peers() {
        let (mut s, _q) = DoorbellServer::new(2, VectorKind::SocketPair).unwrap();
        let (_r, w) = rustix::pipe::pipe().unwrap();
        assert!(matches!(s.add_peer(w.as_fd()), Err(DoorbellError::NotASocket)));
        let (a, _b) = socketpair(AddressFamily::UNIX, SocketType::DGRAM, SocketFlags::CLOEXEC, None).unwrap();
        assert!(matches!(s.add_peer(a.as_fd()), Err(DoorbellError::NotASocket)));
        let file = rustix::fs::memfd_create("x", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        assert!(matches!(s.add_peer(file.as_fd()), Err(DoorbellError::NotASocket)));
    }

    #[test]
    fn guard_detects_blocking_and_full_peers() {
        let (mut s, _qemu) = DoorbellServer::new(2, VectorKind::SocketPair).unwrap();
        let (wait_a, ring_a) = pair();
        let (_wait_b, ring_b) = pair();
        let (_wait_c, ring_c) = pair();
        for (id, r) in [(1, &ring_a), (2, &ring_b), (3, &ring_c)] {
            s.peers.insert(id, PeerBell { fd: rustix::io::fcntl_dupfd_cloexec(r, 0).unwrap(), full_once: false });
        }
        assert!(s.check_peers().is_empty());
        // Peer 2 clears O_NONBLOCK on its ring end's description.
        rustix::io::ioctl_fionbio(&ring_b, false).unwrap();
        // Peer 3 never reads its doorbell: fill it.
        while rustix::net::send(&ring_c, &[1u8; 8], SendFlags::DONTWAIT).is_ok() {}
        assert_eq!(s.check_peers(), vec![2], "blocking is cut at once; a full queue needs two checks");
        assert_eq!(s.check_peers(), vec![3]);
        // Cut means shut down: a write fails at once instead of blocking.
        assert_eq!(rustix::net::send(&ring_b, &[1u8], SendFlags::NOSIGNAL), Err(Errno::PIPE));
        // Peer 1 reads: never cut.
        let mut buf = [0u8; 64];
        let _ = rustix::net::recv(&wait_a, &mut buf[..], rustix::net::RecvFlags::DONTWAIT);
        assert!(s.check_peers().is_empty());
        assert_eq!(s.peers().collect::<Vec<_>>(), vec![1]);
    }
}
