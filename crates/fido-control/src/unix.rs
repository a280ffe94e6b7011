//! The host's transport: a Unix `SOCK_SEQPACKET` socket to the broker, which
//! keeps frame boundaries and passes descriptors with `SCM_RIGHTS`.

use crate::error::{ControlError, Result};
use crate::transport::{Connect, Received, Transport};
use fido_proto::wire;
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// A connected `SOCK_SEQPACKET` socket (one datagram per frame).
#[derive(Debug)]
pub struct UnixSeqpacket {
    sock: OwnedFd,
}

impl UnixSeqpacket {
    /// Connects to the broker listening at `path`.
    pub fn connect(path: &Path) -> Result<UnixSeqpacket> {
        let sock = rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
        let addr = SocketAddrUnix::new(path).map_err(|e| ControlError::BadAddress(format!("{}: {e}", path.display())))?;
        rustix::net::connect(&sock, &addr)
            .map_err(|e| ControlError::Unavailable(format!("{}: {}", path.display(), io::Error::from(e))))?;
        Ok(UnixSeqpacket { sock })
    }

    /// Wraps an already connected socket (one end of a `socketpair`, a socket
    /// inherited from a parent).
    pub fn from_connected(sock: OwnedFd) -> UnixSeqpacket {
        UnixSeqpacket { sock }
    }

    /// The socket, for callers that multiplex it with other descriptors.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

impl Transport for UnixSeqpacket {
    fn send(&self, frame: &[u8], fds: &[OwnedFd]) -> io::Result<()> {
        Ok(wire::send_blocking(self.sock.as_fd(), frame, fds)?)
    }

    fn try_send(&self, frame: &[u8], fds: &[OwnedFd]) -> io::Result<()> {
        Ok(wire::send(self.sock.as_fd(), frame, fds)?)
    }

    fn recv(&self, buf: &mut [u8], timeout: Option<Duration>) -> io::Result<Received> {
        let ts = timeout.map(|t| Timespec { tv_sec: t.as_secs() as i64, tv_nsec: t.subsec_nanos() as i64 });
        let mut fds = [PollFd::new(&self.sock, PollFlags::IN)];
        match poll(&mut fds, ts.as_ref()) {
            Ok(0) | Err(rustix::io::Errno::INTR) => return Ok(Received::Idle),
            Ok(_) => {}
            Err(e) => return Err(e.into()),
        }
        Ok(match wire::recv(self.sock.as_fd(), buf)? {
            wire::Recv::Eof => Received::Closed,
            wire::Recv::WouldBlock => Received::Idle,
            wire::Recv::Msg { len, fds, truncated } => Received::Frame { len, fds, truncated },
        })
    }

    fn passes_fds(&self) -> bool {
        true
    }

    fn shutdown(&self) {
        let _ = rustix::net::shutdown(&self.sock, rustix::net::Shutdown::Both);
    }
}

/// Connects a [`UnixSeqpacket`] to the broker socket at a path.
#[derive(Debug, Clone)]
pub struct UnixConnector {
    path: PathBuf,
}

impl UnixConnector {
    pub fn new(path: impl Into<PathBuf>) -> UnixConnector {
        UnixConnector { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Connect for UnixConnector {
    fn connect(&self) -> Result<Arc<dyn Transport>> {
        Ok(Arc::new(UnixSeqpacket::connect(&self.path)?))
    }

    fn address(&self) -> String {
        self.path.display().to_string()
    }
}
