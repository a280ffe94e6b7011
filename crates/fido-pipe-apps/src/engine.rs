//! The `fido` strategy of [`crate::mover::Mover`]: the broker's pipe engine
//! moves the bytes (crate `fido-pipe`). This process only passes the two
//! descriptors with each request and waits for the exact result; its CPU stays
//! free for the application.
//!
//! One [`fido_pipe::Client`] (a domain of its own, joined through
//! `$FIDO_BROKER` or the default socket) is shared by every thread; each
//! transfer is a one-shot operation, so concurrent connections never wait for
//! each other's pipe. A request the engine declines before moving anything
//! (quota, no engine) is moved in-process with `sendfile`/`splice` instead; a
//! dead broker is rejoined on the next call.

use std::io;
use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use fido_pipe::{Client, ClientOptions, PipeOp, Transfer};
use fido_proto::ErrorCode;

use crate::mover::{Mover, Sendfile};

/// The engine as a [`Mover`].
pub struct FidoPipe {
    /// The current client; replaced after the broker went away (see [`FidoPipe::client`]).
    client: Mutex<Session>,
    name: String,
    /// file→socket only: a piece of [`STALL_PIECE`] bytes that does not finish
    /// within this long means the client stopped reading; the socket is shut
    /// down (which fails the engine's write at once) and the call fails with
    /// `TimedOut` — what `SO_SNDTIMEO` does for the in-process strategies.
    stall: Option<Duration>,
}

struct Session {
    client: Option<Client>,
    /// When the last reconnection was tried (at most one try per second).
    tried: Option<Instant>,
}

/// Bytes per engine request when a stall timeout applies (a client slower than
/// STALL_PIECE per timeout — 70 KB/s with 4 MiB and 60 s — is dropped).
const STALL_PIECE: u64 = 4 << 20;

fn io_err(e: fido_pipe::Error) -> io::Error {
    match e {
        // The errno of the failed splice (peer reset, broken pipe, ...), so callers
        // see the same error kinds as with the in-process strategies.
        fido_pipe::Error::Transfer {
            errno,
            message,
            moved,
            ..
        } if errno != 0 => {
            let os = io::Error::from_raw_os_error(errno.abs());
            io::Error::new(
                os.kind(),
                format!("pipe engine: {message} after {moved} bytes ({os})"),
            )
        }
        e => io::Error::other(e),
    }
}

/// Longest single request the engine accepts; a stream of unknown length is
/// forwarded in requests of this size.
const MAX_REQUEST: u64 = fido_pipe::UNTIL_EOF;

/// The engine declined a request before moving anything (over the domain's
/// `pipes` quota, or the broker runs without an engine): the caller moves the
/// rest in-process instead of failing the transfer.
#[derive(Debug)]
struct Declined(String);

impl std::fmt::Display for Declined {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the pipe engine declined: {}", self.0)
    }
}

impl std::error::Error for Declined {}

fn declined(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|i| i.is::<Declined>())
}

/// Says once per process that transfers fall back to in-process moves.
fn note_fallback(e: &io::Error) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "{e}; moving such transfers in-process (sendfile/splice) instead (said once)"
        );
    } else {
        tracing::debug!("{e}; in-process fallback");
    }
}

/// Runs one-shot operations until `len` bytes moved or the source ended. If the
/// engine declines a request (nothing of it moved), `fallback(done)` moves the
/// rest in-process.
fn until(
    len: Option<u64>,
    mut op: impl FnMut(u64, u64) -> io::Result<Transfer>,
    fallback: impl FnOnce(u64) -> io::Result<u64>,
) -> io::Result<u64> {
    let mut done = 0u64;
    loop {
        let want = match len {
            Some(l) if done >= l => return Ok(done),
            Some(l) => (l - done).min(MAX_REQUEST),
            None => MAX_REQUEST,
        };
        let t = match op(done, want) {
            Ok(t) => t,
            Err(e) if declined(&e) => {
                note_fallback(&e);
                return Ok(done + fallback(done)?);
            }
            Err(e) => return Err(e),
        };
        done += t.moved;
        if t.eof || t.moved == 0 {
            return Ok(done);
        }
    }
}

impl FidoPipe {
    fn new(client: Client, name: String, stall: Option<Duration>) -> FidoPipe {
        FidoPipe {
            client: Mutex::new(Session {
                client: Some(client),
                tried: None,
            }),
            name,
            stall,
        }
    }

    /// The client to use. A broker restart leaves the old client dead (its
    /// requests fail with `BrokerUnavailable`, so the transfer under way fails and
    /// its connection is closed); the next call joins the new broker, so a long
    /// running server or proxy heals by itself. Tries at most once per second.
    fn client(&self) -> io::Result<Client> {
        let mut s = self.client.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = &s.client {
            return Ok(c.clone());
        }
        if s.tried
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "the broker's pipe engine is unavailable",
            ));
        }
        s.tried = Some(Instant::now());
        match connect(&self.name, None) {
            Ok(c) => {
                tracing::info!("rejoined the broker for its pipe engine");
                s.client = Some(c.clone());
                Ok(c)
            }
            Err(e) => Err(io::Error::new(io::ErrorKind::NotConnected, e.to_string())),
        }
    }
}

impl FidoPipe {
    /// Runs `f` on the current client; a `BrokerUnavailable` drops that client so
    /// the next call rejoins.
    fn call<T>(&self, f: impl FnOnce(&Client) -> fido_pipe::Result<T>) -> io::Result<T> {
        let c = self.client()?;
        self.check(f(&c))
    }

    /// Maps an engine result; a `BrokerUnavailable` drops the current client.
    fn check<T>(&self, r: fido_pipe::Result<T>) -> io::Result<T> {
        r.map_err(|e| {
            if matches!(e, fido_pipe::Error::BrokerUnavailable(_)) {
                let mut s = self.client.lock().unwrap_or_else(|p| p.into_inner());
                s.client = None;
            }
            if let fido_pipe::Error::Refused(r) = &e {
                if matches!(r.code, ErrorCode::Quota | ErrorCode::Unavailable) {
                    return io::Error::other(Declined(e.to_string()));
                }
            }
            io_err(e)
        })
    }
}

impl Mover for FidoPipe {
    fn file_to_socket(
        &self,
        file: BorrowedFd<'_>,
        off: u64,
        len: u64,
        sock: BorrowedFd<'_>,
    ) -> io::Result<u64> {
        let Some(stall) = self.stall else {
            return until(
                Some(len),
                |done, want| self.call(|c| c.file_to_socket(file, sock, off + done, want)),
                |done| Sendfile.file_to_socket(file, off + done, len - done, sock),
            );
        };
        let mut done = 0u64;
        while done < len {
            let want = (len - done).min(STALL_PIECE);
            let op = PipeOp::FileToSocket {
                off: off + done,
                len: want,
            };
            // Starting and finishing a piece can both be declined; either way the
            // rest goes through the in-process fallback.
            let r = self
                .call(|c| c.start_once(file, sock, op))
                .and_then(|mut p| {
                    match p.wait_timeout(stall) {
                        Some(r) => self.check(r),
                        None => {
                            let _ = rustix::net::shutdown(sock, rustix::net::Shutdown::Both);
                            // The engine's write now fails promptly; wait for it to let go.
                            let _ = p.wait_timeout(Duration::from_secs(10));
                            Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                format!("the client read nothing for {stall:?}"),
                            ))
                        }
                    }
                });
            let t = match r {
                Ok(t) => t,
                Err(e) if declined(&e) => {
                    note_fallback(&e);
                    // Not under the stall timer: the socket's SO_SNDTIMEO covers it.
                    return Ok(done + Sendfile.file_to_socket(file, off + done, len - done, sock)?);
                }
                Err(e) => return Err(e),
            };
            done += t.moved;
            if t.eof || t.moved == 0 {
                break;
            }
        }
        Ok(done)
    }

    fn socket_to_socket(
        &self,
        from: BorrowedFd<'_>,
        to: BorrowedFd<'_>,
        len: Option<u64>,
    ) -> io::Result<u64> {
        // The engine is asked only for bytes already waiting in `from` (this
        // thread sleeps in poll until there are some): a long-running request on
        // an idle connection would occupy one of the engine's lanes while it
        // waits, and a proxy has many idle connections (8 keep-alive clients
        // collapsed to ~200 req/s that way). The cost here is a poll and an
        // ioctl per burst, never a byte copied.
        let mut done = 0u64;
        loop {
            if len.is_some_and(|l| done >= l) {
                return Ok(done);
            }
            wait_readable(from)?;
            let avail = rustix::io::ioctl_fionread(from)?;
            if avail == 0 {
                // Readable with nothing buffered: end of stream, or an error.
                let mut b = [0u8; 1];
                match rustix::net::recv(from, &mut b[..], rustix::net::RecvFlags::PEEK) {
                    Ok((0, _)) => return Ok(done),
                    Ok(_) | Err(rustix::io::Errno::INTR) | Err(rustix::io::Errno::AGAIN) => {
                        continue
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            let want = len.map_or(avail, |l| avail.min(l - done)).min(MAX_REQUEST);
            let t = match self.call(|c| c.socket_to_socket(from, to, want)) {
                Ok(t) => t,
                Err(e) if declined(&e) => {
                    note_fallback(&e);
                    return Ok(done + Sendfile.socket_to_socket(from, to, len.map(|l| l - done))?);
                }
                Err(e) => return Err(e),
            };
            done += t.moved;
            if t.eof {
                return Ok(done);
            }
        }
    }

    fn socket_to_file(
        &self,
        sock: BorrowedFd<'_>,
        file: BorrowedFd<'_>,
        off: u64,
        len: u64,
    ) -> io::Result<u64> {
        until(
            Some(len),
            |done, want| self.call(|c| c.socket_to_file(sock, file, off + done, want)),
            |done| Sendfile.socket_to_file(sock, file, off + done, len - done),
        )
    }

    fn file_to_file(
        &self,
        src: BorrowedFd<'_>,
        src_off: u64,
        len: u64,
        dst: BorrowedFd<'_>,
        dst_off: u64,
    ) -> io::Result<u64> {
        until(
            Some(len),
            |done, want| {
                self.call(|c| c.file_to_file(src, dst, src_off + done, want, dst_off + done))
            },
            |done| Sendfile.file_to_file(src, src_off + done, len - done, dst, dst_off + done),
        )
    }
}

/// Sleeps until `fd` is readable, at end of stream, or in error.
fn wait_readable(fd: BorrowedFd<'_>) -> io::Result<()> {
    use rustix::event::{PollFd, PollFlags};
    loop {
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        match rustix::event::poll(&mut fds, None) {
            Ok(_) => return Ok(()),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

fn connect(name: &str, broker: Option<&Path>) -> io::Result<Client> {
    let path = match broker {
        Some(p) => p.to_path_buf(),
        None => fido_proto::default_broker_path(),
    };
    Client::connect_with(ClientOptions::new(name).broker(&path)).map_err(|e| {
        io::Error::new(
            io::ErrorKind::NotConnected,
            format!(
                "joining the broker at {} for its pipe engine: {e}",
                path.display()
            ),
        )
    })
}

/// Whether the broker at `broker` answers as a pipe engine.
pub fn available(broker: &Path) -> bool {
    match connect("fido-bench-probe", Some(broker)) {
        Ok(c) => c.status().map(|s| s.pipe_engine.is_some()).unwrap_or(false),
        Err(_) => false,
    }
}

/// A mover on the broker named by `$FIDO_BROKER` (or the default socket).
pub fn mover() -> io::Result<Arc<dyn Mover>> {
    let name = format!("fido-pipe-{}", std::process::id());
    Ok(Arc::new(FidoPipe::new(connect(&name, None)?, name, None)))
}

/// [`mover`] for a server: file→socket gives up on a client that reads
/// nothing for `stall`.
pub fn mover_with_stall(stall: Duration) -> io::Result<Arc<dyn Mover>> {
    let name = format!("fido-pipe-serve-{}", std::process::id());
    Ok(Arc::new(FidoPipe::new(
        connect(&name, None)?,
        name,
        Some(stall),
    )))
}

/// A mover whose domain has pipe weight `w` (set live: the caller must be root
/// or the broker's uid).
pub fn mover_weighted(w: u32) -> io::Result<Arc<dyn Mover>> {
    let name = format!("fido-pipe-{}", std::process::id());
    let client = connect(&name, None)?;
    client
        .set_weight(&client.domain().to_string(), w)
        .map_err(|e| io::Error::other(format!("setting pipe weight {w}: {e}")))?;
    Ok(Arc::new(FidoPipe::new(client, name, None)))
}
