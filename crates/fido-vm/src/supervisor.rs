//! The supervisor of one VM domain: starts QEMU with the VM's devices, owns
//! its QMP socket and doorbell server, and relays its guest's link to the
//! broker ([`crate::relay`]) until QEMU exits or it is told to stop.
//!
//! It runs as the user who launched the VM: the broker knows the VM by that
//! uid (`SO_PEERCRED` on the supervisor's socket) and by the VM's name (the
//! label of every domain the guest joins), and its policy applies to both.
//! Nothing here is privileged; what crosses domains — identity, policy,
//! grants, slots — stays the broker's.

use crate::doorbell_server::DoorbellServer;
use crate::hotplug::{self, PeerArena, Ports};
use crate::qemu::{self, QemuProcess, VmSpec};
use crate::qmp::Qmp;
use crate::relay::{BrokerLine, Devices, Identity, Limits, Relay, RelayStats};
use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::fs::OFlags;
use rustix::net::{AddressFamily, SocketFlags, SocketType};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long QEMU may take to come up (TCG on a loaded machine is slow).
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the guest may take to let go of an unplugged device.
const UNPLUG_TIMEOUT: Duration = Duration::from_secs(10);
/// QEMU's id of the control port device (qemu.rs gives it).
const CONTROL_PORT_ID: &str = "fido-ctlport";
/// How often the guard looks at the peers' doorbells.
const TICK: Duration = Duration::from_millis(100);
/// Bytes queued for the guest beyond which its port is not read until it
/// reads: a guest that writes and never reads cannot grow the supervisor.
const MAX_GUEST_BACKLOG: usize = 4 << 20;

/// What went wrong running a VM.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error("{0}")]
    Spec(#[from] crate::qemu::SpecError),
    #[error("starting QEMU: {0}")]
    Start(String),
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// A VM's devices as the relay sees them: QMP hot-plug and the doorbell server.
struct QemuDevices {
    qmp: Qmp,
    doorbells: DoorbellServer,
    ports: Ports,
}

impl Devices for QemuDevices {
    fn plug_arena(&mut self, fd: OwnedFd, len: u64) -> io::Result<u16> {
        // The relay passes the slot/owner bookkeeping itself; the port only
        // needs to be free.
        let port = self.ports.allocate(PeerArena { slot: u32::MAX, owner: u64::MAX, len }).map_err(io::Error::other)?;
        match hotplug::plug_arena(&mut self.qmp, port, fd.as_fd(), len, self.ports.max_peer_arena()) {
            Ok(()) => Ok(port),
            Err(e) => {
                self.ports.release(port);
                Err(io::Error::other(e))
            }
        }
    }

    fn unplug_arena(&mut self, port: u16) -> io::Result<()> {
        let r = hotplug::unplug(&mut self.qmp, port, UNPLUG_TIMEOUT).map_err(io::Error::other);
        if r.is_ok() {
            self.ports.release(port);
        }
        r
    }

    fn add_peer_bell(&mut self, fd: OwnedFd) -> io::Result<u16> {
        self.doorbells.add_peer(fd.as_fd()).map_err(io::Error::other)
    }

    fn remove_peer_bell(&mut self, id: u16) {
        if let Err(e) = self.doorbells.remove_peer(id) {
            tracing::debug!(id, "removing a peer doorbell: {e}");
        }
    }

    fn own_ring_end(&self, vector: u16) -> io::Result<OwnedFd> {
        let end = self.doorbells.own_ring_end(vector).ok_or_else(|| io::Error::other(format!("no vector {vector}")))?;
        Ok(rustix::io::fcntl_dupfd_cloexec(end, 0)?)
    }

    fn hostile_peer_bells(&mut self) -> Vec<u16> {
        self.doorbells.check_peers()
    }

    fn guest_port_closed(&mut self) -> bool {
        if let Err(e) = self.qmp.poll_events() {
            tracing::debug!("QMP: {e}");
        }
        let closed = |d: &serde_json::Value| d.get("id").and_then(|v| v.as_str()) == Some(CONTROL_PORT_ID) && d.get("open").and_then(|v| v.as_bool()) == Some(false);
        let mut any = false;
        while self.qmp.take_event_matching("VSERPORT_CHANGE", Duration::ZERO, closed).is_ok() {
            any = true;
        }
        // Other events (the open side of the same port) are not kept.
        self.qmp.drain_events().retain(|_| false);
        any
    }
}

/// Connects to the broker's Unix socket.
struct UnixLine(PathBuf);

impl BrokerLine for UnixLine {
    fn connect(&self) -> io::Result<OwnedFd> {
        let sock = rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK, None)?;
        let addr = rustix::net::SocketAddrUnix::new(&self.0)?;
        match rustix::net::connect(&sock, &addr) {
            Ok(()) | Err(rustix::io::Errno::INPROGRESS) => Ok(sock),
            Err(e) => Err(io::Error::new(io::Error::from(e).kind(), format!("broker at {}: {e}", self.0.display()))),
        }
    }
}

/// What [`Supervisor::set_reporter`] calls.
type Reporter = Box<dyn FnMut(&RelayStats)>;

/// A running VM domain.
pub struct Supervisor {
    spec: VmSpec,
    /// Called with the relay's counters when they changed, at most once a second.
    reporter: Option<Reporter>,
    reported: RelayStats,
    qemu: QemuProcess,
    link: OwnedFd,
    relay: Relay,
    stop: Arc<AtomicBool>,
}

/// Why [`Supervisor::run`] returned.
#[derive(Debug)]
pub enum Ended {
    /// QEMU exited (the guest powered off, or QEMU was killed).
    QemuExited(ExitStatus),
    /// We were asked to stop and shut QEMU down.
    Stopped(Option<ExitStatus>),
    /// The guest broke its link: the VM was stopped.
    LinkBroken(String),
}

impl Supervisor {
    /// Creates the VM's arena, sockets and doorbell server, starts QEMU,
    /// seals the arena once QEMU has mapped it, and completes the doorbell
    /// handshake. `stop` ends [`run`](Self::run) when set (a signal handler's flag).
    pub fn start(spec: VmSpec, broker: PathBuf, stop: Arc<AtomicBool>) -> Result<Supervisor, SupervisorError> {
        let launched = qemu::launch(&spec, None, START_TIMEOUT).map_err(|e| SupervisorError::Start(e.to_string()))?;
        let qemu::Launched { qemu, qmp, doorbell: doorbells, arena, control: link, welcome } = launched;
        // What the broker gets at every Join: a read-only re-open of the
        // sealed arena (a fresh file description, as every grant is).
        let arena_ro = rustix::fs::open(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&arena)), OFlags::RDONLY | OFlags::CLOEXEC, rustix::fs::Mode::empty()).map_err(io::Error::from)?;
        drop(arena);
        let identity = Identity { name: spec.name.clone(), arena_ro, arena_len: spec.arena_len };
        let limits = Limits { connections: usize::from(spec.vectors.saturating_sub(1) / 2) };
        let devices = QemuDevices { qmp, doorbells, ports: Ports::new(spec.ports, spec.max_peer_arena) };
        let relay = Relay::new(welcome, identity, limits, Box::new(devices), Box::new(UnixLine(broker)));
        Ok(Supervisor { spec, reporter: None, reported: RelayStats::default(), qemu, link, relay, stop })
    }

    pub fn qemu_pid(&self) -> u32 {
        self.qemu.pid
    }

    pub fn stats(&self) -> RelayStats {
        self.relay.stats
    }

    /// Has `report` called with the relay's counters whenever they changed
    /// (checked once a second): `fido vm run` keeps them in the VM's record.
    pub fn set_reporter(&mut self, report: impl FnMut(&RelayStats) + 'static) {
        self.reporter = Some(Box::new(report));
    }

    /// Serves the VM until QEMU exits, `stop` is set, or the guest breaks its link.
    pub fn run(&mut self) -> Result<Ended, SupervisorError> {
        let mut buf = vec![0u8; 64 << 10];
        let mut next_tick = Instant::now() + TICK;
        let mut next_report = Instant::now();
        loop {
            if let Some(status) = self.qemu.try_wait()? {
                return Ok(Ended::QemuExited(status));
            }
            if self.stop.load(Ordering::Relaxed) {
                return Ok(Ended::Stopped(self.shutdown()?));
            }
            if let Some(why) = self.relay.broken() {
                let why = why.to_string();
                tracing::warn!(vm = %self.spec.name, "{why}: stopping the VM");
                self.shutdown()?;
                return Ok(Ended::LinkBroken(why));
            }
            let (link_ready, broker_ready, hung) = self.wait(next_tick)?;
            if link_ready && self.relay.outbox().len() < MAX_GUEST_BACKLOG {
                loop {
                    match rustix::io::read(&self.link, &mut buf) {
                        Ok(0) => break, // QEMU keeps the port; a closed guest device reads nothing.
                        Ok(n) => self.relay.guest_bytes(&buf[..n]),
                        Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => break,
                        Err(e) => return self.link_failed(e.into()),
                    }
                    if self.relay.broken().is_some() || self.relay.outbox().len() >= MAX_GUEST_BACKLOG {
                        break;
                    }
                }
            }
            if broker_ready {
                self.relay.broker_readable();
            }
            for token in hung {
                self.relay.liveness_hangup(token);
            }
            if Instant::now() >= next_tick {
                self.relay.tick();
                next_tick = Instant::now() + TICK;
            }
            if let Err(e) = self.flush() {
                return self.link_failed(e);
            }
            if Instant::now() >= next_report {
                next_report = Instant::now() + Duration::from_secs(1);
                if self.relay.stats != self.reported {
                    self.reported = self.relay.stats;
                    if let Some(r) = self.reporter.as_mut() {
                        r(&self.reported);
                    }
                }
            }
        }
    }

    /// The control socket failed: when QEMU is exiting (a guest powering
    /// off resets the socket before QEMU is reaped) that is its exit, else
    /// the error.
    fn link_failed(&mut self, e: io::Error) -> Result<Ended, SupervisorError> {
        if let Some(status) = self.qemu.wait_timeout(Duration::from_secs(5))? {
            return Ok(Ended::QemuExited(status));
        }
        Err(e.into())
    }

    /// Writes what the relay queued for the guest, as far as the link takes it.
    fn flush(&mut self) -> io::Result<()> {
        while !self.relay.outbox().is_empty() {
            match rustix::io::write(&self.link, self.relay.outbox()) {
                Ok(n) => self.relay.consumed_outbox(n),
                Err(rustix::io::Errno::AGAIN) => return Ok(()),
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Waits for the link, the broker or a liveness socket, at most until `until`.
    fn wait(&self, until: Instant) -> io::Result<(bool, bool, Vec<u64>)> {
        let backlog = self.relay.outbox().len();
        let link_events = match backlog {
            0 => PollFlags::IN,
            n if n < MAX_GUEST_BACKLOG => PollFlags::IN | PollFlags::OUT,
            _ => PollFlags::OUT,
        };
        let mut fds = vec![PollFd::new(&self.link, link_events)];
        let broker = self.relay.broker_fd();
        let broker_at = broker.map(|b| {
            fds.push(PollFd::from_borrowed_fd(b, PollFlags::IN));
            fds.len() - 1
        });
        let live: Vec<(u64, BorrowedFd<'_>)> = self.relay.liveness_fds().collect();
        let live_at = fds.len();
        for (_, fd) in &live {
            fds.push(PollFd::from_borrowed_fd(*fd, PollFlags::RDHUP));
        }
        let left = until.saturating_duration_since(Instant::now()).min(TICK);
        let ts = Timespec { tv_sec: 0, tv_nsec: left.as_nanos() as i64 };
        match poll(&mut fds, Some(&ts)) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
        let link = fds[0].revents();
        let broker_ready = broker_at.is_some_and(|i| !fds[i].revents().is_empty());
        let hung = live.iter().enumerate().filter(|(i, _)| !fds[live_at + i].revents().is_empty()).map(|(_, (t, _))| *t).collect();
        Ok((link.intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR), broker_ready, hung))
    }

    /// Stops QEMU with SIGKILL: nobody keeps a VM domain's guest state, so a
    /// clean `quit` would buy nothing (its peers see it gone either way).
    fn shutdown(&mut self) -> io::Result<Option<ExitStatus>> {
        Ok(Some(self.qemu.kill()?))
    }
}
