//! Listening, accepting, and one pair of threads per connection.

use std::io;
use std::net::{TcpListener, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::export::Export;
use crate::handshake::negotiate;
use crate::sock::Stream;
use crate::transmission;

/// How the server behaves towards clients.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The export's name (LIST shows it; GO/INFO/EXPORT_NAME take it or "").
    pub export_name: String,
    /// Sent for NBD_INFO_DESCRIPTION.
    pub description: Option<String>,
    /// Backend requests in flight per connection, at most (also bounded by
    /// the backend's queue depth).
    pub max_in_flight: usize,
    /// Connections served at once; more are closed at accept.
    pub max_connections: usize,
    /// A client must reach transmission within this time.
    pub handshake_timeout: Duration,
    /// A client that takes no reply bytes for this long is dropped.
    pub reply_timeout: Duration,
}

impl ServerConfig {
    pub fn new(export_name: impl Into<String>) -> Self {
        ServerConfig {
            export_name: export_name.into(),
            description: None,
            max_in_flight: 128,
            max_connections: 64,
            handshake_timeout: Duration::from_secs(30),
            reply_timeout: Duration::from_secs(300),
        }
    }

    /// Export names are at most 4096 bytes of UTF-8 (the NBD limit).
    pub fn validate(&self) -> Result<(), String> {
        if self.export_name.len() > 4096 {
            return Err("export name longer than 4096 bytes".into());
        }
        if self.max_in_flight == 0 || self.max_connections == 0 {
            return Err("max_in_flight and max_connections must be positive".into());
        }
        Ok(())
    }
}

/// A listening socket.
#[derive(Debug)]
pub enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Listener {
    /// Binds a Unix socket at `path` (a stale socket file there is replaced;
    /// any other file is an error).
    pub fn bind_unix(path: &Path) -> io::Result<Listener> {
        match std::fs::symlink_metadata(path) {
            Ok(m) => {
                use std::os::unix::fs::FileTypeExt;
                if !m.file_type().is_socket() {
                    return Err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        format!("{} exists and is not a socket", path.display()),
                    ));
                }
                std::fs::remove_file(path)?;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        Ok(Listener::Unix(UnixListener::bind(path)?))
    }

    pub fn bind_tcp(addr: impl ToSocketAddrs) -> io::Result<Listener> {
        Ok(Listener::Tcp(TcpListener::bind(addr)?))
    }

    /// Where clients connect: `unix:PATH` or `tcp:IP:PORT` (the port bound,
    /// also when port 0 was asked for).
    pub fn describe(&self) -> String {
        match self {
            Listener::Unix(l) => match l.local_addr().ok().and_then(|a| a.as_pathname().map(|p| p.display().to_string())) {
                Some(p) => format!("unix:{p}"),
                None => "unix:?".into(),
            },
            Listener::Tcp(l) => match l.local_addr() {
                Ok(a) => format!("tcp:{a}"),
                Err(_) => "tcp:?".into(),
            },
        }
    }

    fn accept(&self) -> io::Result<Stream> {
        Ok(match self {
            Listener::Unix(l) => Stream::Unix(l.accept()?.0),
            Listener::Tcp(l) => {
                let s = l.accept()?.0;
                s.set_nodelay(true)?;
                Stream::Tcp(s)
            }
        })
    }

    fn fd(&self) -> RawFd {
        match self {
            Listener::Unix(l) => l.as_raw_fd(),
            Listener::Tcp(l) => l.as_raw_fd(),
        }
    }
}

/// An NBD server for one export.
pub struct NbdServer<E: Export> {
    export: Arc<E>,
    cfg: Arc<ServerConfig>,
    connections: Arc<AtomicUsize>,
}

impl<E: Export> Clone for NbdServer<E> {
    fn clone(&self) -> Self {
        NbdServer { export: self.export.clone(), cfg: self.cfg.clone(), connections: self.connections.clone() }
    }
}

impl<E: Export> NbdServer<E> {
    pub fn new(export: E, cfg: ServerConfig) -> io::Result<Self> {
        cfg.validate().map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        Ok(NbdServer { export: Arc::new(export), cfg: Arc::new(cfg), connections: Arc::new(AtomicUsize::new(0)) })
    }

    pub fn export(&self) -> &E {
        &self.export
    }

    /// Connections being served now.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    /// Accepts clients until `stop` is set (checked every 200 ms), serving
    /// each on its own threads. Connections still open when this returns
    /// keep being served by their threads.
    pub fn serve(&self, listener: &Listener, stop: &AtomicBool) -> io::Result<()> {
        while !stop.load(Ordering::SeqCst) {
            let mut pfd = libc::pollfd { fd: listener.fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd, for the duration of the call.
            let n = unsafe { libc::poll(&mut pfd, 1, 200) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                continue;
            }
            let stream = match listener.accept() {
                Ok(s) => s,
                Err(e) => {
                    // EMFILE, ECONNABORTED …: this client is lost, the server goes on.
                    tracing::warn!("accept: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            if self.connections.fetch_add(1, Ordering::SeqCst) >= self.cfg.max_connections {
                self.connections.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!("{} connections already: refusing another", self.cfg.max_connections);
                drop(stream);
                continue;
            }
            let server = self.clone();
            let spawned = std::thread::Builder::new().name("nbd-reader".into()).spawn(move || {
                let _count = CountGuard(server.connections.clone());
                if let Err(e) = server.serve_counted(stream) {
                    tracing::info!("NBD connection ended: {e}");
                }
            });
            if let Err(e) = spawned {
                tracing::warn!("cannot start a connection thread: {e}");
            }
        }
        Ok(())
    }

    /// Serves one client on this thread (plus a writer thread) until it leaves.
    pub fn serve_connection(&self, stream: Stream) -> io::Result<()> {
        self.connections.fetch_add(1, Ordering::SeqCst);
        let _count = CountGuard(self.connections.clone());
        self.serve_counted(stream)
    }

    fn serve_counted(&self, mut stream: Stream) -> io::Result<()> {
        stream.set_read_timeout(Some(self.cfg.handshake_timeout))?;
        stream.set_write_timeout(Some(self.cfg.handshake_timeout))?;
        let Some(neg) = negotiate(&mut stream, &*self.export, &self.cfg)? else {
            stream.shutdown();
            return Ok(());
        };
        stream.set_read_timeout(None)?;
        transmission::serve(stream, neg, &self.cfg)
    }
}

struct CountGuard(Arc<AtomicUsize>);

impl Drop for CountGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
