//! The client's socket (Unix or TCP) and the one way replies reach it:
//! `sendmsg` over raw iovecs, so READ data goes from the backend's memory to
//! the kernel without passing through a Rust slice (it may be memory another
//! process can still write).

use std::io::{self, Read};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// A connected NBD client.
#[derive(Debug)]
pub enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
        })
    }

    pub fn shutdown(&self) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
        };
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Tcp(s) => s.set_read_timeout(t),
        }
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_write_timeout(t),
            Stream::Tcp(s) => s.set_write_timeout(t),
        }
    }

    pub fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.read_exact(buf),
            Stream::Tcp(s) => s.read_exact(buf),
        }
    }

    /// Reads and throws away `n` bytes (an option or payload we refuse),
    /// through a bounded buffer.
    pub fn discard(&mut self, mut n: u64) -> io::Result<()> {
        let mut sink = [0u8; 4096];
        while n > 0 {
            let k = n.min(sink.len() as u64) as usize;
            self.read_exact(&mut sink[..k])?;
            n -= k as u64;
        }
        Ok(())
    }

    pub fn write_all(&self, bytes: &[u8]) -> io::Result<()> {
        let mut iov = [RawIov { ptr: bytes.as_ptr(), len: bytes.len() }];
        send_all(self.as_raw_fd(), &mut iov)
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
        }
    }
}

/// One piece of a reply: `len` bytes at `ptr`, readable until the send returns.
#[derive(Clone, Copy, Debug)]
pub struct RawIov {
    pub ptr: *const u8,
    pub len: usize,
}

/// At most this many iovecs per sendmsg (Linux's UIO_MAXIOV).
const MAX_IOV: usize = 1024;

/// Sends every byte the iovecs describe (handles short sends; never raises
/// SIGPIPE). `iov` is consumed as it goes.
pub fn send_all(fd: RawFd, iov: &mut [RawIov]) -> io::Result<()> {
    let mut first = 0;
    while first < iov.len() {
        if iov[first].len == 0 {
            first += 1;
            continue;
        }
        let end = (first + MAX_IOV).min(iov.len());
        let batch = &iov[first..end];
        let mut vecs: Vec<libc::iovec> = Vec::with_capacity(batch.len());
        vecs.extend(batch.iter().map(|v| libc::iovec { iov_base: v.ptr as *mut libc::c_void, iov_len: v.len }));
        // SAFETY: msghdr is plain data; zeroed is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = vecs.as_mut_ptr();
        msg.msg_iovlen = vecs.len() as _;
        // SAFETY: every iovec points at `len` readable bytes (the callers' contract:
        // our buffers, or backend memory valid while its ReadData lives); the
        // kernel only reads them. `msg` and `vecs` outlive the call.
        let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "sendmsg sent nothing"));
        }
        // Advance past what was sent.
        let mut sent = n as usize;
        while sent > 0 {
            let v = &mut iov[first];
            if sent >= v.len {
                sent -= v.len;
                v.len = 0;
                first += 1;
            } else {
                // SAFETY: `sent < v.len`: the advanced pointer stays inside the run.
                v.ptr = unsafe { v.ptr.add(sent) };
                v.len -= sent;
                sent = 0;
            }
        }
    }
    Ok(())
}
