//! Sending and receiving control messages with descriptors over a
//! `SOCK_SEQPACKET` socket, shared by the broker and the client library.
//! Everything here never panics on what the other side sends.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Outcome of one non-blocking receive.
pub enum Recv {
    /// The peer closed its end (or sent a zero-length datagram, which no valid
    /// client does).
    Eof,
    /// Nothing to read right now.
    WouldBlock,
    /// One datagram of `len` bytes with the descriptors that came with it.
    /// `truncated` is set when either the data or the descriptors did not fit.
    Msg {
        len: usize,
        fds: Vec<OwnedFd>,
        truncated: bool,
    },
}

/// Receives one datagram with up to [`crate::MAX_FDS`] descriptors.
/// Received descriptors are close-on-exec and owned by the caller.
pub fn recv(fd: BorrowedFd<'_>, buf: &mut [u8]) -> Result<Recv, Errno> {
    let mut space =
        [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(crate::MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [IoSliceMut::new(buf)];
    let res = rustix::net::recvmsg(
        fd,
        &mut iov,
        &mut control,
        RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC,
    );
    let msg = match res {
        Ok(m) => m,
        Err(Errno::AGAIN) => return Ok(Recv::WouldBlock),
        Err(Errno::INTR) => return Ok(Recv::WouldBlock),
        Err(e) => return Err(e),
    };
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    if msg.bytes == 0 && fds.is_empty() {
        return Ok(Recv::Eof);
    }
    let truncated = msg
        .flags
        .intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC);
    Ok(Recv::Msg {
        len: msg.bytes.min(buf.len()),
        fds,
        truncated,
    })
}

/// Sends one datagram with descriptors, never blocking and never raising SIGPIPE.
pub fn send(fd: BorrowedFd<'_>, bytes: &[u8], fds: &[OwnedFd]) -> Result<(), Errno> {
    send_with(fd, bytes, fds, SendFlags::DONTWAIT | SendFlags::NOSIGNAL)
}

/// Sends one datagram with descriptors, waiting for room; never raises SIGPIPE.
pub fn send_blocking(fd: BorrowedFd<'_>, bytes: &[u8], fds: &[OwnedFd]) -> Result<(), Errno> {
    send_with(fd, bytes, fds, SendFlags::NOSIGNAL)
}

fn send_with(fd: BorrowedFd<'_>, bytes: &[u8], fds: &[OwnedFd], flags: SendFlags) -> Result<(), Errno> {
    let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
    let mut space =
        [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(crate::MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !borrowed.is_empty() && !control.push(SendAncillaryMessage::ScmRights(&borrowed)) {
        return Err(Errno::INVAL);
    }
    let iov = [IoSlice::new(bytes)];
    loop {
        match rustix::net::sendmsg(
            fd,
            &iov,
            &mut control,
            flags,
        ) {
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e),
            Ok(_) => return Ok(()),
        }
    }
}

/// Duplicates a descriptor (close-on-exec) so it can be queued or handed on.
pub fn dup(fd: BorrowedFd<'_>) -> Result<OwnedFd, Errno> {
    rustix::io::fcntl_dupfd_cloexec(fd, 0)
}

/// What `/proc/self/fd/N` says the descriptor is (e.g. `anon_inode:[eventfd]`).
pub fn fd_kind(fd: BorrowedFd<'_>) -> Option<String> {
    let link = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let target = rustix::fs::readlinkat(rustix::fs::CWD, link.as_str(), Vec::new()).ok()?;
    Some(target.to_string_lossy().into_owned())
}

/// True when the descriptor is an eventfd.
pub fn is_eventfd(fd: BorrowedFd<'_>) -> bool {
    fd_kind(fd).as_deref() == Some("anon_inode:[eventfd]")
}

/// True when the descriptor can be the ring end of a doorbell: a Unix stream
/// socket (see `fido_ring::doorbell` for why doorbells are not eventfds).
pub fn is_doorbell(fd: BorrowedFd<'_>) -> bool {
    matches!(rustix::net::sockopt::socket_type(fd), Ok(rustix::net::SocketType::STREAM))
        && matches!(rustix::net::sockopt::socket_domain(fd), Ok(rustix::net::AddressFamily::UNIX))
}
