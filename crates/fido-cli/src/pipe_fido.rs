//! The `fido` strategy of [`crate::pipe_move::Mover`]: the broker's pipe engine
//! moves the bytes (crate `fido-pipe`). This process only passes the two
//! descriptors with each request and waits for the exact result; its CPU stays
//! free for the application.
//!
//! One [`fido_pipe::Client`] (a domain of its own, joined through
//! `$FIDO_BROKER` or the default socket) is shared by every thread; each
//! transfer is a one-shot operation, so concurrent connections never wait for
//! each other's pipe.

use std::io;
use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use fido_pipe::{Client, ClientOptions, PipeOp, Transfer};

use crate::pipe_move::Mover;

/// The engine as a [`Mover`].
pub struct FidoPipe {
    client: Client,
    /// file→socket only: a piece of [`STALL_PIECE`] bytes that does not finish
    /// within this long means the client stopped reading; the socket is shut
    /// down (which fails the engine's write at once) and the call fails with
    /// `TimedOut` — what `SO_SNDTIMEO` does for the in-process strategies.
    stall: Option<Duration>,
}

/// Bytes per engine request when a stall timeout applies (a client slower than
/// STALL_PIECE per timeout — 70 KB/s with 4 MiB and 60 s — is dropped).
const STALL_PIECE: u64 = 4 << 20;

fn io_err(e: fido_pipe::Error) -> io::Error {
    match e {
        // The errno of the failed splice (peer reset, broken pipe, ...), so callers
        // see the same error kinds as with the in-process strategies.
        fido_pipe::Error::Transfer { errno, message, moved, .. } if errno != 0 => {
            let os = io::Error::from_raw_os_error(errno.abs());
            io::Error::new(os.kind(), format!("pipe engine: {message} after {moved} bytes ({os})"))
        }
        e => io::Error::other(e),
    }
}

/// Longest single request the engine accepts (`fido_proto::MAX_PIPE_LEN`); a
/// stream of unknown length is forwarded in requests of this size.
const MAX_REQUEST: u64 = 1 << 62;

/// Runs one-shot operations until `len` bytes moved or the source ended.
fn until(len: Option<u64>, mut op: impl FnMut(u64, u64) -> fido_pipe::Result<Transfer>) -> io::Result<u64> {
    let mut done = 0u64;
    loop {
        let want = match len {
            Some(l) if done >= l => return Ok(done),
            Some(l) => (l - done).min(MAX_REQUEST),
            None => MAX_REQUEST,
        };
        let t = op(done, want).map_err(io_err)?;
        done += t.moved;
        if t.eof || t.moved == 0 {
            return Ok(done);
        }
    }
}

impl Mover for FidoPipe {
    fn file_to_socket(&self, file: BorrowedFd<'_>, off: u64, len: u64, sock: BorrowedFd<'_>) -> io::Result<u64> {
        let Some(stall) = self.stall else {
            return until(Some(len), |done, want| self.client.file_to_socket(file, sock, off + done, want));
        };
        let mut done = 0u64;
        while done < len {
            let want = (len - done).min(STALL_PIECE);
            let op = PipeOp::FileToSocket { off: off + done, len: want };
            let mut p = self.client.start_once(file, sock, op).map_err(io_err)?;
            let t = match p.wait_timeout(stall) {
                Some(r) => r.map_err(io_err)?,
                None => {
                    let _ = rustix::net::shutdown(sock, rustix::net::Shutdown::ReadWrite);
                    // The engine's write now fails promptly; wait for it to let go.
                    let _ = p.wait_timeout(Duration::from_secs(10));
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the client read nothing for {stall:?}"),
                    ));
                }
            };
            done += t.moved;
            if t.eof || t.moved == 0 {
                break;
            }
        }
        Ok(done)
    }

    fn socket_to_socket(&self, from: BorrowedFd<'_>, to: BorrowedFd<'_>, len: Option<u64>) -> io::Result<u64> {
        until(len, |_, want| self.client.socket_to_socket(from, to, want))
    }

    fn socket_to_file(&self, sock: BorrowedFd<'_>, file: BorrowedFd<'_>, off: u64, len: u64) -> io::Result<u64> {
        until(Some(len), |done, want| self.client.socket_to_file(sock, file, off + done, want))
    }

    fn file_to_file(
        &self,
        src: BorrowedFd<'_>,
        src_off: u64,
        len: u64,
        dst: BorrowedFd<'_>,
        dst_off: u64,
    ) -> io::Result<u64> {
        until(Some(len), |done, want| {
            self.client.file_to_file(src, dst, src_off + done, want, dst_off + done)
        })
    }
}

fn connect(name: &str, broker: Option<&Path>) -> anyhow::Result<Client> {
    let mut o = ClientOptions::new(name);
    let path = match broker {
        Some(p) => p.to_path_buf(),
        None => fido::default_broker_path(),
    };
    o = o.broker(&path);
    Client::connect_with(o).with_context(|| format!("joining the broker at {} for its pipe engine", path.display()))
}

/// Whether the broker at `broker` answers as a pipe engine.
pub fn available(broker: &Path) -> bool {
    match connect("fido-bench-probe", Some(broker)) {
        Ok(c) => c.status().map(|s| s.pipe_engine.is_some()).unwrap_or(false),
        Err(_) => false,
    }
}

/// A mover on the broker named by `$FIDO_BROKER` (or the default socket).
pub fn mover() -> anyhow::Result<Arc<dyn Mover>> {
    Ok(Arc::new(FidoPipe { client: connect(&format!("fido-pipe-{}", std::process::id()), None)?, stall: None }))
}

/// [`mover`] for a server: file→socket gives up on a client that reads
/// nothing for `stall`.
pub fn mover_with_stall(stall: Duration) -> anyhow::Result<Arc<dyn Mover>> {
    let client = connect(&format!("fido-pipe-serve-{}", std::process::id()), None)?;
    Ok(Arc::new(FidoPipe { client, stall: Some(stall) }))
}

/// A mover whose domain has pipe weight `w` (set live: the caller must be root
/// or the broker's uid).
pub fn mover_weighted(w: u32) -> anyhow::Result<Arc<dyn Mover>> {
    let client = connect(&format!("fido-pipe-{}", std::process::id()), None)?;
    client
        .set_weight(&client.domain().to_string(), w)
        .with_context(|| format!("setting pipe weight {w}"))?;
    Ok(Arc::new(FidoPipe { client, stall: None }))
}
