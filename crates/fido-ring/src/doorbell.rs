//! Doorbells: one per thing a side can wait for. A doorbell is a Unix stream
//! socket pair: the waiter keeps the *wait end* and polls it; the peer is given
//! the *ring end* and sends one byte on it — only when the waiter said it is
//! about to sleep (see `protocol`). Socket ends work with poll, epoll and async
//! runtimes.
//!
//! Why not an eventfd (what QEMU's ivshmem doorbell uses)? An eventfd is one
//! open file description shared by both sides, so a hostile peer could clear
//! its `O_NONBLOCK` and saturate its counter: our next write would block
//! forever, or it could read the counter between our poll and our read and
//! block that. With a socket pair the peer never holds our wait end, and every
//! ring is `send(MSG_DONTWAIT | MSG_NOSIGNAL)`, non-blocking per call whatever
//! flags the shared ring end carries: a full queue already means "rung", a
//! vanished peer is reported by the liveness socket, not by the doorbell.
//!
//! A domain inside a virtual machine cannot hold a host socket: there a ring
//! end is a doorbell *register* of a device ([`RingEnd::Register`]; the
//! ivshmem doorbell turns the write into a byte on the host socket), and its
//! wait ends are the eventfds its device's interrupts are delivered to, which
//! [`drain`] and [`block_on`] handle like sockets.

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{
    recv, send, socketpair, AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType,
};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

/// A device register that rings a peer when written (inside a VM guest: the
/// ivshmem doorbell's BAR0 register, reached through VFIO). Implementations
/// must never block and never fail for a full or vanished peer, like [`ring`].
pub trait RingRegister: Send + Sync + 'static {
    /// Writes `value` (which names the peer and its vector) to the register.
    fn ring(&self, value: u32) -> std::io::Result<()>;
}

/// What we ring a peer's doorbell through.
#[derive(Clone)]
pub enum RingEnd {
    /// The ring end of the peer's doorbell socket pair (the host's doorbells).
    Socket(Arc<OwnedFd>),
    /// A doorbell register and the value that rings this peer (a VM guest).
    Register { register: Arc<dyn RingRegister>, value: u32 },
}

impl std::fmt::Debug for RingEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RingEnd::Socket(fd) => f.debug_tuple("Socket").field(fd).finish(),
            RingEnd::Register { value, .. } => f.debug_struct("Register").field("value", value).finish_non_exhaustive(),
        }
    }
}

impl RingEnd {
    /// A socket ring end.
    pub fn socket(fd: OwnedFd) -> RingEnd {
        RingEnd::Socket(Arc::new(fd))
    }

    /// Rings the peer. Never blocks; see [`ring`].
    #[inline]
    pub fn ring(&self) -> std::io::Result<()> {
        match self {
            RingEnd::Socket(fd) => ring(fd.as_fd()),
            RingEnd::Register { register, value } => register.ring(*value),
        }
    }

    /// The socket, where this ring end is one (tests and diagnostics).
    pub fn as_socket(&self) -> Option<BorrowedFd<'_>> {
        match self {
            RingEnd::Socket(fd) => Some(fd.as_fd()),
            RingEnd::Register { .. } => None,
        }
    }
}

/// The two ends of a fresh doorbell.
#[derive(Debug)]
pub struct Doorbell {
    /// Kept by the waiter: [`block_on`] polls it, [`drain`] empties it.
    pub wait: OwnedFd,
    /// Given to whoever may wake the waiter: [`ring`] sends on it.
    pub ring: OwnedFd,
}

/// Creates a doorbell: a close-on-exec, non-blocking Unix stream pair.
///
/// A stream rather than datagrams so one `recv` takes every pending ring (on
/// this class of virtual machine each system call costs about a microsecond).
/// The maker keeps a copy of the ring end (to wake its own waiters), so the
/// wait end never reads end-of-file while it is in use.
pub fn new_doorbell() -> std::io::Result<Doorbell> {
    let (wait, ring) = socketpair(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?;
    Ok(Doorbell { wait, ring })
}

/// Rings a doorbell through its ring end. Never blocks. A full queue already
/// means "rung"; a closed wait end means the waiter is gone, which its
/// liveness socket reports — neither is an error here. A send interrupted by
/// a signal queued nothing, so it is tried again: taking it for a ring would
/// leave a sleeper that asked to be woken asleep.
///
/// A ring end that is not a socket is one of our own eventfds (a VM guest
/// wakes its own waiter through the eventfd its interrupt is delivered to):
/// it is written, non-blocking as created, and a saturated counter already
/// means "rung".
pub fn ring(bell: BorrowedFd<'_>) -> std::io::Result<()> {
    ring_with(|| match send(bell, &[1u8], SendFlags::DONTWAIT | SendFlags::NOSIGNAL) {
        Err(Errno::NOTSOCK) => rustix::io::write(bell, &1u64.to_ne_bytes()),
        other => other,
    })
}

/// [`ring`]'s decision, over any `send` (tests inject interruptions here).
fn ring_with(mut send_one: impl FnMut() -> Result<usize, Errno>) -> std::io::Result<()> {
    loop {
        match send_one() {
            Err(Errno::INTR) => {}
            Ok(_) | Err(Errno::AGAIN) | Err(Errno::NOBUFS) | Err(Errno::CONNREFUSED) | Err(Errno::PIPE) => return Ok(()),
            Err(Errno::CONNRESET) | Err(Errno::NOTCONN) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
}

/// Consumes pending rings on a wait end (non-blocking, one system call). A
/// flood larger than the buffer leaves rings behind, which only cost the
/// waiter a spurious wake-up later. A wait end that is not a socket (a VM
/// guest's eventfd, which is non-blocking) is read instead.
pub fn drain(bell: BorrowedFd<'_>) {
    let mut buf = [0u8; 256];
    if let Err(Errno::NOTSOCK) = recv(bell, &mut buf, RecvFlags::DONTWAIT) {
        let _ = rustix::io::read(bell, &mut buf[..8]);
    }
}

/// What woke a blocked waiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wakeup {
    pub rung: bool,
    /// The liveness socket shows the peer has gone (EOF/hang-up).
    pub peer_hangup: bool,
}

/// Blocks until `bell` is rung, `liveness` hangs up, or `timeout` passes
/// (`None`: forever).
pub fn block_on(bell: BorrowedFd<'_>, liveness: Option<BorrowedFd<'_>>, timeout: Option<Duration>) -> std::io::Result<Wakeup> {
    let ts = timeout.map(|t| Timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: t.subsec_nanos() as i64,
    });
    let mut fds = [
        PollFd::new(&bell, PollFlags::IN),
        PollFd::from_borrowed_fd(liveness.unwrap_or(bell.as_fd()), PollFlags::IN | PollFlags::RDHUP),
    ];
    let n = if liveness.is_some() { 2 } else { 1 };
    match poll(&mut fds[..n], ts.as_ref()) {
        Ok(_) | Err(Errno::INTR) => {}
        Err(e) => return Err(e.into()),
    }
    let rung = !fds[0].revents().is_empty();
    let peer_hangup = n == 2 && !fds[1].revents().is_empty();
    if rung {
        drain(bell);
    }
    Ok(Wakeup { rung, peer_hangup })
}

/// True when the liveness socket shows the peer is gone (non-blocking check).
pub fn peer_hung_up(liveness: BorrowedFd<'_>) -> bool {
    let mut fds = [PollFd::new(&liveness, PollFlags::IN | PollFlags::RDHUP)];
    matches!(poll(&mut fds, Some(&Timespec { tv_sec: 0, tv_nsec: 0 })), Ok(n) if n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// The attack an eventfd doorbell could not survive: the peer, who shares
    /// the ring end's file description, clears `O_NONBLOCK` on it and lets the
    /// queue fill. Ringing must still return at once, every time.
    #[test]
    fn ringing_never_blocks_on_a_hostile_ring_end() {
        let bell = new_doorbell().unwrap();
        let peers_copy = rustix::io::fcntl_dupfd_cloexec(&bell.ring, 0).unwrap();
        rustix::fs::fcntl_setfl(&peers_copy, rustix::fs::OFlags::empty()).unwrap();
        assert!(!rustix::fs::fcntl_getfl(&bell.ring).unwrap().contains(rustix::fs::OFlags::NONBLOCK));
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let ring_end = bell.ring.try_clone().unwrap();
        std::thread::spawn(move || {
            let started = Instant::now();
            for _ in 0..10_000 {
                ring(ring_end.as_fd()).unwrap();
            }
            done_tx.send(started.elapsed()).unwrap();
        });
        let took = done_rx.recv_timeout(Duration::from_secs(30)).expect("a ring blocked on a full, blocking doorbell");
        // The queue really was full (so the flag change mattered).
        assert!(send(&peers_copy, &[1], SendFlags::DONTWAIT) == Err(Errno::AGAIN), "queue not full after {took:?}");
        // And the waiter still sees it rung, drains it, and sees it quiet.
        assert!(block_on(bell.wait.as_fd(), None, Some(Duration::from_secs(1))).unwrap().rung);
        while block_on(bell.wait.as_fd(), None, Some(Duration::ZERO)).unwrap().rung {}
    }

    /// A send interrupted by a signal sent nothing: the ring is retried, so
    /// the waiter is still woken (taking `EINTR` for "rung" left it asleep).
    #[test]
    fn a_ring_interrupted_by_a_signal_still_delivers() {
        let bell = new_doorbell().unwrap();
        let mut attempts = 0;
        ring_with(|| {
            attempts += 1;
            if attempts <= 2 {
                return Err(Errno::INTR);
            }
            send(&bell.ring, &[1u8], SendFlags::DONTWAIT | SendFlags::NOSIGNAL)
        })
        .unwrap();
        assert_eq!(attempts, 3, "each interrupted send is tried again, once it went through no more");
        let woke = block_on(bell.wait.as_fd(), None, Some(Duration::from_secs(1))).unwrap();
        assert!(woke.rung, "the interrupted ring never reached the waiter");
    }

    /// Retrying an interruption does not hide a real failure behind it.
    #[test]
    fn an_error_after_an_interruption_is_reported() {
        let mut results = [Err(Errno::INTR), Err(Errno::BADF)].into_iter();
        let err = ring_with(|| results.next().unwrap()).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(Errno::BADF.raw_os_error()));
    }

    /// A ring to a waiter that has gone is not an error (its liveness socket
    /// reports the departure).
    #[test]
    fn ringing_a_vanished_waiter_is_quiet() {
        let bell = new_doorbell().unwrap();
        drop(bell.wait);
        ring(bell.ring.as_fd()).unwrap();
    }
}
