//! The Fido broker: the privileged control plane every domain talks to.
//!
//! It admits domains (join: a [`DomainId`](fido_proto::DomainId) that is never
//! reused and a PGVAS slot), hands out read-only arena grants, brokers
//! connections between a client and the domain offering a service (exchanging
//! arena grants, doorbell ring ends and a liveness socket pair), keeps the
//! registry (a tree of keys with watches and transactions, persisted in SQLite),
//! and detects deaths — socket EOF at once, hangs by missed heartbeats — telling
//! the peers and firing watches.
//!
//! What it must never do: touch payload data (only control messages and
//! descriptors pass through it); crash or block because a client misbehaves
//! (every socket is non-blocking, every input is validated, a client that cannot
//! keep up is dropped); hand a grant or doorbell to a domain that did not ask
//! for that connection or slot; reuse a `DomainId`, or a slot that is still
//! mapped somewhere.

mod account;
pub mod netdiag;
pub mod policy;
pub mod resume;
mod server;
mod sys;

/// In-process driving of the broker for its stateful fuzz target.
#[cfg(feature = "fuzz-hooks")]
pub use server::harness;

/// The pipe engine's settings, part of [`Config`] (the engine itself is the
/// `fido-pipe-engine` crate; the broker owns its requests, quotas and replies).
pub use fido_pipe_engine::{Capacity, PipeConfig};
pub use policy::{Glob, Policy, Quotas, Rule};

use std::fs::{DirBuilder, File, OpenOptions};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{
    DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use std::collections::BTreeMap;

use fido_proto::{DomainId, PgvasGeometry};
use rustix::io::Errno;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

/// How a broker is set up.
#[derive(Debug, Clone)]
pub struct Config {
    /// Path of the listening `SOCK_SEQPACKET` socket.
    pub socket: PathBuf,
    /// Directory for the lock file and the registry database.
    pub state_dir: PathBuf,
    /// Heartbeat interval told to domains (default 500 ms).
    pub heartbeat: Duration,
    /// A domain silent for `heartbeat * heartbeat_misses` is declared hung (default 6).
    pub heartbeat_misses: u32,
    /// A connection that has not joined within this time is closed, whether
    /// or not it sends heartbeats (default 10 s).
    pub join_timeout: Duration,
    /// PGVAS geometry handed to every domain.
    pub geometry: PgvasGeometry,
    /// Who may join and do what, with per-domain quotas, and the socket
    /// file's mode and group. Default: [`Policy::default_for_self`] (only
    /// the broker's own uid may join).
    pub policy: Arc<Policy>,
    /// The pipe engine's capacity, sharing mode, lanes and chunk size.
    pub pipe: PipeConfig,
}

impl Config {
    /// A configuration with the default heartbeat and geometry.
    pub fn new(socket: impl Into<PathBuf>, state_dir: impl Into<PathBuf>) -> Config {
        Config {
            socket: socket.into(),
            state_dir: state_dir.into(),
            heartbeat: Duration::from_millis(500),
            heartbeat_misses: 6,
            join_timeout: Duration::from_secs(10),
            geometry: PgvasGeometry::DEFAULT,
            policy: Arc::new(Policy::default_for_self()),
            pipe: PipeConfig::default(),
        }
    }

    /// `$FIDO_BROKER`, else `$XDG_RUNTIME_DIR/fido/broker.sock`, else
    /// `/run/fido/broker.sock`.
    pub fn default_socket() -> PathBuf {
        fido_proto::default_broker_path()
    }

    /// How long a domain may stay silent before it is declared hung.
    pub fn heartbeat_timeout(&self) -> Duration {
        self.heartbeat.saturating_mul(self.heartbeat_misses.max(1))
    }
}

/// Why the broker could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("another broker is already running on state directory {} (lock {} is held)", .0.display(), .0.join("broker.lock").display())]
    Locked(PathBuf),
    #[error("a broker is already listening on {}", .0.display())]
    AddrInUse(PathBuf),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Sys {
        what: &'static str,
        #[source]
        source: Errno,
    },
    #[error("registry: {0}")]
    Registry(String),
    #[error("invalid configuration: {0}")]
    Config(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> BrokerError + '_ {
    move |source| BrokerError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn sys_err(what: &'static str) -> impl FnOnce(Errno) -> BrokerError {
    move |source| BrokerError::Sys { what, source }
}

/// Wakes a running broker and makes [`Broker::run`] return.
#[derive(Debug, Clone)]
pub struct ShutdownHandle {
    event: Arc<OwnedFd>,
}

impl ShutdownHandle {
    /// Asks the broker to stop; returns at once. Idempotent.
    pub fn shutdown(&self) {
        let _ = rustix::io::write(self.event.as_fd(), &1u64.to_ne_bytes());
    }
}

/// Hands a running broker a new policy (what `fido broker` does on `SIGHUP`).
///
/// The broker applies it between two requests: every live domain is admitted
/// again under the new rules (a domain no rule admits any more is evicted, its
/// peers told `PeerGone { reason: Evicted }`), services the new rules do not
/// allow are withdrawn, and connections whose client may no longer connect are
/// revoked (both sides told `PeerGone { reason: Revoked }`).
#[derive(Debug, Clone)]
pub struct ReloadHandle {
    event: Arc<OwnedFd>,
    pending: Arc<std::sync::Mutex<Option<Policy>>>,
}

impl ReloadHandle {
    /// Queues `policy` for the broker and wakes it; returns at once. A later
    /// call before the broker woke replaces an earlier one.
    pub fn reload(&self, policy: Policy) {
        *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = Some(policy);
        let _ = rustix::io::write(self.event.as_fd(), &1u64.to_ne_bytes());
    }
}

/// The broker's end of [`ReloadHandle`].
pub(crate) struct ReloadSlot {
    pub(crate) event: Arc<OwnedFd>,
    pub(crate) pending: Arc<std::sync::Mutex<Option<Policy>>>,
}

/// A bound broker, ready to [`run`](Broker::run).
pub struct Broker {
    config: Config,
    listener: OwnedFd,
    /// Identity of the socket file we created, so we only ever remove our own.
    socket_id: (u64, u64),
    shutdown: Arc<OwnedFd>,
    reload: Arc<OwnedFd>,
    pending_policy: Arc<std::sync::Mutex<Option<Policy>>>,
    registry: fido_registry::Registry,
    reserved: BTreeMap<u32, DomainId>,
    /// What resuming domains are checked against (read before the live-state
    /// subtrees are cleared).
    recorded: resume::Recorded,
    _lock: File,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Broker {
    /// Creates the state directory, locks it, opens the registry (clearing the
    /// live-state subtrees `/domain`, `/service`, `/connection`) and binds the socket.
    pub fn bind(config: Config) -> Result<Broker, BrokerError> {
        config
            .geometry
            .validate()
            .map_err(|e| BrokerError::Config(e.to_string()))?;
        if config.heartbeat.is_zero() {
            return Err(BrokerError::Config(
                "heartbeat interval must be positive".into(),
            ));
        }

        let state = &config.state_dir;
        private_state_dir(state)?;
        let lock_path = state.join("broker.lock");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&lock_path)
            .map_err(io_err(&lock_path))?;
        // One made by an older broker may be 0644: anyone could flock it.
        lock.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(io_err(&lock_path))?;
        match rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(Errno::WOULDBLOCK) => return Err(BrokerError::Locked(state.clone())),
            Err(e) => return Err(sys_err("flock on broker.lock")(e)),
        }

        let db = state.join("registry.sqlite");
        let mut registry =
            fido_registry::Registry::open(&db).map_err(|e| BrokerError::Registry(e.to_string()))?;
        // Remember which slot each domain held before a restart, so resuming
        // domains get theirs back (fresh joins avoid them for a grace period).
        let reserved = previous_slots(&registry, config.geometry.slots);
        let recorded = server::load_recorded(&registry);
        for subtree in server::MANAGED {
            registry
                .delete(subtree)
                .map_err(|e| BrokerError::Registry(e.to_string()))?;
        }

        let (listener, socket_id) = bind_socket(&config.socket, &config.policy)?;
        let shutdown = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .map_err(sys_err("eventfd"))?;
        let reload = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .map_err(sys_err("eventfd"))?;

        tracing::info!(socket = %config.socket.display(), state = %state.display(), "broker bound");
        Ok(Broker {
            config,
            listener,
            socket_id,
            shutdown: Arc::new(shutdown),
            reload: Arc::new(reload),
            pending_policy: Arc::default(),
            registry,
            reserved,
            recorded,
            _lock: lock,
        })
    }

    /// The socket path this broker listens on.
    pub fn socket_path(&self) -> &Path {
        &self.config.socket
    }

    /// A handle that stops [`run`](Broker::run) from any thread.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            event: self.shutdown.clone(),
        }
    }

    /// A handle that gives the running broker a new policy from any thread.
    pub fn reload_handle(&self) -> ReloadHandle {
        ReloadHandle {
            event: self.reload.clone(),
            pending: self.pending_policy.clone(),
        }
    }

    /// Serves until the shutdown handle fires, then closes every client and
    /// removes the socket file.
    pub fn run(self) -> Result<(), BrokerError> {
        let Broker {
            config,
            listener,
            socket_id,
            shutdown,
            reload,
            pending_policy,
            registry,
            reserved,
            recorded,
            _lock,
        } = self;
        let socket = config.socket.clone();
        let reload = ReloadSlot {
            event: reload,
            pending: pending_policy,
        };
        let result = server::Server::new(
            config, listener, shutdown, reload, registry, reserved, recorded,
        )
            .and_then(|s| s.run());
        remove_socket_if_ours(&socket, socket_id);
        tracing::info!(socket = %socket.display(), "broker stopped");
        drop(_lock);
        result
    }

    /// Binds and runs the broker on its own thread.
    pub fn spawn(
        config: Config,
    ) -> Result<(JoinHandle<Result<(), BrokerError>>, ShutdownHandle), BrokerError> {
        let broker = Broker::bind(config)?;
        let handle = broker.shutdown_handle();
        let thread = std::thread::Builder::new()
            .name("fido-broker".into())
            .spawn(move || broker.run())
            .map_err(io_err(Path::new("<thread>")))?;
        Ok((thread, handle))
    }
}

/// A broker on a thread of this process that is stopped, and waited for, when
/// dropped: what tests, examples and `fido demo` embed instead of a separate
/// `fido broker` process.
pub struct Embedded {
    socket: PathBuf,
    shutdown: ShutdownHandle,
    thread: Option<JoinHandle<Result<(), BrokerError>>>,
}

impl Embedded {
    /// Binds a broker with `config` and runs it on its own thread.
    pub fn start(config: Config) -> Result<Embedded, BrokerError> {
        let socket = config.socket.clone();
        let (thread, shutdown) = Broker::spawn(config)?;
        Ok(Embedded {
            socket,
            shutdown,
            thread: Some(thread),
        })
    }

    /// The socket domains join through.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Stops the broker and waits for it; returns how its loop ended (a
    /// panic on the broker's thread is resumed here).
    pub fn stop(mut self) -> Result<(), BrokerError> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<(), BrokerError> {
        self.shutdown.shutdown();
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(panic)) => std::panic::resume_unwind(panic),
            None => Ok(()),
        }
    }
}

impl Drop for Embedded {
    fn drop(&mut self) {
        self.shutdown.shutdown();
        if let Some(t) = self.thread.take() {
            // How it ended is for `stop` to report; a drop only waits.
            let _ = t.join();
        }
    }
}

/// The state directory, created if missing, made the broker's alone: it
/// must belong to the broker's uid (another user's directory is refused: its
/// owner could swap or lock the files in it), and it is made `0700` (so no
/// other user can open, lock or list anything in it, whatever the files'
/// own modes).
fn private_state_dir(state: &Path) -> Result<(), BrokerError> {
    if let Some(parent) = state.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    }
    match DirBuilder::new().mode(0o700).create(state) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_err(state)(e)),
    }
    let dir = rustix::fs::open(
        state,
        rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| io_err(state)(e.into()))?;
    let st = rustix::fs::fstat(&dir).map_err(|e| io_err(state)(e.into()))?;
    let me = rustix::process::geteuid().as_raw();
    if st.st_uid != me {
        return Err(BrokerError::Io {
            path: state.to_path_buf(),
            source: std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "the state directory belongs to uid {}, not to the broker's uid {me}; \
                     refusing to keep the registry where another user controls it",
                    st.st_uid
                ),
            ),
        });
    }
    if st.st_mode & 0o7777 != 0o700 {
        tracing::warn!(state = %state.display(), mode = format_args!("{:o}", st.st_mode & 0o7777),
            "state directory was open to other users; made it 0700");
        rustix::fs::fchmod(&dir, rustix::fs::Mode::from_raw_mode(0o700))
            .map_err(|e| io_err(state)(e.into()))?;
    }
    Ok(())
}

/// The socket's directory: created `0755` if missing (others must reach
/// the socket; the socket's own mode says who may connect). An existing one
/// must not let other users replace the socket: one writable by group or
/// others without the sticky bit, or owned by another user than the broker's
/// or root, is refused.
fn socket_dir(parent: &Path) -> Result<(), BrokerError> {
    DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(parent)
        .map_err(io_err(parent))?;
    let meta = std::fs::metadata(parent).map_err(io_err(parent))?;
    let me = rustix::process::geteuid().as_raw();
    let open_to_others = meta.mode() & 0o022 != 0 && meta.mode() & 0o1000 == 0;
    if (meta.uid() != me && meta.uid() != 0) || open_to_others {
        return Err(BrokerError::Io {
            path: parent.to_path_buf(),
            source: std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "the socket's directory (owner uid {}, mode {:o}) lets another user replace \
                     the broker's socket; use a directory only the broker's user can write",
                    meta.uid(),
                    meta.mode() & 0o7777
                ),
            ),
        });
    }
    Ok(())
}

fn bind_socket(path: &Path, policy: &Policy) -> Result<(OwnedFd, (u64, u64)), BrokerError> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        socket_dir(parent)?;
    }
    let addr = SocketAddrUnix::new(path).map_err(sys_err("socket path"))?;
    let new_socket = || {
        rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )
        .map_err(sys_err("socket"))
    };

    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(BrokerError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "exists and is not a socket; refusing to replace it",
                ),
            });
        }
        // A socket file: is anyone listening behind it?
        let probe = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )
        .map_err(sys_err("socket"))?;
        match rustix::net::connect(&probe, &addr) {
            // Someone listens (AGAIN: a full backlog; PROTOTYPE: a listener of
            // another socket type, which is not ours to remove either).
            Ok(()) | Err(Errno::AGAIN) | Err(Errno::PROTOTYPE) => {
                return Err(BrokerError::AddrInUse(path.to_path_buf()))
            }
            Err(Errno::CONNREFUSED) | Err(Errno::NOENT) => {
                tracing::info!(socket = %path.display(), "replacing stale broker socket");
                std::fs::remove_file(path).map_err(io_err(path))?;
            }
            Err(e) => return Err(sys_err("probing existing socket")(e)),
        }
    }

    let listener = new_socket()?;
    match rustix::net::bind(&listener, &addr) {
        Ok(()) => {}
        Err(Errno::ADDRINUSE) => return Err(BrokerError::AddrInUse(path.to_path_buf())),
        Err(e) => return Err(sys_err("bind")(e)),
    }
    // The policy decides who joins; the file mode (default 0666) and group
    // decide who may talk to the broker at all. Set before listen(), so no
    // connection is accepted under the umask's mode.
    if let Some(gid) = policy.socket_gid {
        std::os::unix::fs::lchown(path, None, Some(gid)).map_err(io_err(path))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(policy.socket_mode))
        .map_err(io_err(path))?;
    rustix::net::listen(&listener, 128).map_err(sys_err("listen"))?;
    let meta = std::fs::symlink_metadata(path).map_err(io_err(path))?;
    Ok((listener, (meta.dev(), meta.ino())))
}

fn remove_socket_if_ours(path: &Path, id: (u64, u64)) {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if (meta.dev(), meta.ino()) == id {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Slots recorded under `/domain/<id>/slot` by the previous broker run.
fn previous_slots(registry: &fido_registry::Registry, slots: u32) -> BTreeMap<u32, DomainId> {
    let mut out = BTreeMap::new();
    let Ok(children) = registry.list("/domain") else {
        return out;
    };
    for child in children {
        let name = child.rsplit('/').next().unwrap_or(&child);
        let Ok(id) = name.parse::<DomainId>() else {
            continue;
        };
        let Ok(Some(v)) = registry.read(&format!("/domain/{id}/slot")) else {
            continue;
        };
        let slot = std::str::from_utf8(&v)
            .ok()
            .and_then(|s| s.parse::<u32>().ok());
        if let Some(slot) = slot.filter(|s| *s < slots) {
            out.insert(slot, id);
        }
    }
    out
}
