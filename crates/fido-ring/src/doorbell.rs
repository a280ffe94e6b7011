//! Doorbells: one `eventfd` per thing a side can wait for. The waiter owns it and
//! polls it; the peer holds a copy and writes it — only when the waiter said it
//! is about to sleep (see `protocol`). eventfds work with epoll and async
//! runtimes, and are exactly what QEMU's ivshmem doorbell uses.

use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

/// Creates a doorbell: a non-blocking, close-on-exec eventfd.
pub fn new_doorbell() -> std::io::Result<OwnedFd> {
    Ok(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?)
}

/// Rings a doorbell. A full counter (`EAGAIN`) already means "rung".
pub fn ring(bell: BorrowedFd<'_>) -> std::io::Result<()> {
    match rustix::io::write(bell, &1u64.to_ne_bytes()) {
        Ok(_) | Err(Errno::AGAIN) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Consumes pending rings (non-blocking).
pub fn drain(bell: BorrowedFd<'_>) {
    let mut buf = [0u8; 8];
    let _ = rustix::io::read(bell, &mut buf);
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
