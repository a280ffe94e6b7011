//! The guest side of Fido's VM domains: what lets the ordinary `fido` library
//! run inside a Linux guest whose VM a Fido supervisor launched.
//!
//! A guest cannot receive file descriptors from the host, so three things
//! take their place, all set up by [`Guest::open`]:
//!
//! - **the link** ([`link`]): the broker protocol travels over the
//!   virtio-serial port named [`fido_proto::guest::PORT_NAME`], wrapped in the
//!   link protocol of `fido_proto::guest`; [`Guest::connector`] gives the
//!   `fido_control::Session` a transport over it that turns the supervisor's
//!   handles back into descriptors;
//! - **arenas as PCI BARs** ([`pci`]): the VM's own arena is BAR 2 of an
//!   `ivshmem-plain` device (read-write), each peer's arena BAR 2 of a device
//!   the supervisor hot-plugged read-only under a PCIe root port; the library
//!   maps them from sysfs at their PGVAS slot addresses like memfds;
//! - **doorbells through VFIO** ([`vfio`]): the `ivshmem-doorbell` device's
//!   MSI-X vectors are delivered to eventfds (our own doorbells,
//!   [`Guest::new_bell`]) and a peer is rung by writing `(peer << 16) | vector`
//!   to its BAR0 doorbell register ([`Guest::ring_end`]).
//!
//! What this crate must never do: trust the host (every message, length,
//! index, token and device it names is checked; bad input fails that frame or
//! ends the link, never the process); hand the supervisor a descriptor (a
//! guest can only name its own doorbell vectors); make a Rust reference to
//! device memory (registers are reached with volatile accesses only); or
//! touch the data path beyond ringing a register — messages never cross the
//! link.

pub mod link;
pub mod machine;
pub mod pci;
mod ring_token;
pub mod vfio;

use fido_proto::guest::{Welcome, PORT_NAME};
use fido_ring::doorbell::{Doorbell, RingEnd, RingRegister};
use parking_lot::Mutex;
use pci::{PciDevice, IVSHMEM_MEMORY_BAR};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Where the kernel lists virtio-serial ports with their names.
const VIRTIO_PORTS: &str = "/sys/class/virtio-ports";

/// What can go wrong on the guest side.
#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    /// The control port is missing, busy or unusable.
    #[error("guest control port: {0}")]
    Port(String),
    /// The link to the supervisor failed or carried something untrustworthy.
    #[error("guest link: {0}")]
    Link(String),
    /// A PCI device is missing, not what was announced, or VFIO refused it.
    #[error("guest device: {0}")]
    Device(String),
    /// The machine cannot share memory with the host safely ([`machine`]).
    #[error("unsound VM: {0}")]
    Machine(String),
    /// Every doorbell vector is taken by a live doorbell.
    #[error("all {0} doorbell vectors are in use")]
    NoFreeVector(u16),
    /// The descriptor given to [`Guest::ring_end`] is not a ring token.
    #[error("not a ring token of this guest")]
    NotARingToken,
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// One doorbell vector: the eventfd VFIO signals for it (our copy) and
/// whether a doorbell handed out by [`Guest::new_bell`] may still use it.
struct Vector {
    installed: OwnedFd,
    in_use: bool,
}

/// The guest's Fido devices and its link to the supervisor (one per process:
/// the port opens exclusively).
pub struct Guest {
    port_path: PathBuf,
    welcome: Welcome,
    link: link::Link,
    /// The doorbell device; `None` only in this crate's unit tests, which
    /// exercise the link without hardware.
    doorbell: Option<vfio::VfioDoorbell>,
    /// Its BAR0 doorbell register.
    register: Arc<dyn RingRegister>,
    /// Index = MSI-X vector; vector 0 is reserved.
    vectors: Mutex<Vec<Vector>>,
    /// Random per process: what makes a ring token ours.
    ring_key: u64,
    /// Where PCI devices are listed (`/sys/bus/pci/devices`; a fake tree in
    /// this crate's unit tests).
    sysfs: PathBuf,
}

impl std::fmt::Debug for Guest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guest")
            .field("port", &self.port_path)
            .field("welcome", &self.welcome)
            .finish_non_exhaustive()
    }
}

impl Guest {
    /// The control port's device (`/dev/vportNpM`) if this is a Fido guest:
    /// the virtio-serial port whose name is [`PORT_NAME`].
    pub fn detect() -> Option<PathBuf> {
        detect_in(Path::new(VIRTIO_PORTS), Path::new("/dev"))
    }

    /// Refuses a machine that cannot share memory soundly ([`machine`]), opens
    /// the port (exclusively), exchanges `Hello` → `Welcome` (checked),
    /// checks the announced devices, binds the doorbell device to vfio-pci if
    /// needed and sets up VFIO (MSI-X vectors → eventfds, bus mastering, the
    /// doorbell register). Needs root (sysfs writes, VFIO).
    pub fn open(port: &Path) -> Result<Arc<Guest>, GuestError> {
        use std::os::unix::fs::OpenOptionsExt;
        machine::check()?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(port)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::EBUSY) => GuestError::Port(format!(
                    "{} is open in another process (one Fido guest per VM)",
                    port.display()
                )),
                _ => GuestError::Port(format!("opening {}: {e}", port.display())),
            })?;
        let port_fd = OwnedFd::from(file);
        rustix::fs::flock(
            &port_fd,
            rustix::fs::FlockOperation::NonBlockingLockExclusive,
        )
        .map_err(|_| {
            GuestError::Port(format!("{} is locked by another process", port.display()))
        })?;
        let link = link::Link::new(port_fd)?;
        let welcome = link.hello()?;
        check_welcome(&welcome)?;

        let arena = PciDevice::open(&welcome.arena)?;
        arena.expect_ivshmem()?;
        let arena_bar = arena.bar_len(IVSHMEM_MEMORY_BAR)?;
        if arena_bar < welcome.arena_len {
            return Err(GuestError::Device(format!(
                "own arena BAR is {arena_bar} bytes, the supervisor announced {}",
                welcome.arena_len
            )));
        }
        let bell_device = PciDevice::open(&welcome.doorbell)?;
        bell_device.expect_ivshmem()?;
        let eventfds = (0..welcome.vectors)
            .map(|_| vfio::vector_eventfd())
            .collect::<std::io::Result<Vec<_>>>()?;
        let doorbell = vfio::VfioDoorbell::open(&bell_device, &eventfds)?;
        let own = doorbell.own_peer()?;
        if own != u32::from(welcome.own_peer) {
            return Err(GuestError::Device(format!(
                "the doorbell device says we are ivshmem peer {own}, the supervisor announced {}",
                welcome.own_peer
            )));
        }
        let vectors = eventfds
            .into_iter()
            .enumerate()
            .map(|(v, installed)| Vector {
                installed,
                in_use: v == 0,
            })
            .collect();
        let register: Arc<dyn RingRegister> = doorbell.register().clone();
        Ok(Arc::new(Guest {
            port_path: port.to_owned(),
            welcome,
            link,
            doorbell: Some(doorbell),
            register,
            vectors: Mutex::new(vectors),
            ring_key: random_key(),
            sysfs: PathBuf::from(pci::SYSFS_PCI_DEVICES),
        }))
    }

    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    /// The control port this guest opened.
    pub fn port_path(&self) -> &Path {
        &self.port_path
    }

    /// The VM's own arena BAR (`resource2` of `Welcome.arena`), opened
    /// read-write, and the arena's length (`Welcome.arena_len`).
    pub fn own_arena(&self) -> Result<(OwnedFd, u64), GuestError> {
        let device = PciDevice::open_in(&self.sysfs, &self.welcome.arena)?;
        device.expect_ivshmem()?;
        let (fd, bar_len) = device.open_bar(IVSHMEM_MEMORY_BAR, true)?;
        if bar_len < self.welcome.arena_len {
            return Err(GuestError::Device(format!(
                "own arena BAR is {bar_len} bytes, expected {}",
                self.welcome.arena_len
            )));
        }
        Ok((fd, self.welcome.arena_len))
    }

    /// A `Connect` for `fido_control::Session`. Each connect — the first of
    /// the process too — sends `Reconnect` and waits for `Reconnected` (a
    /// fresh broker connection) or `BrokerDown`: the supervisor's connection
    /// may have carried an earlier process of this VM. After the supervisor
    /// closed and reopened the port, a connect says `Hello` again first and
    /// insists on the same devices.
    pub fn connector(self: &Arc<Self>) -> Arc<dyn fido_control::Connect> {
        Arc::new(GuestConnector {
            guest: self.clone(),
        })
    }

    /// A fresh own doorbell on a free MSI-X vector (1..vectors). `wait` and
    /// `ring` are two descriptors of one fresh eventfd that VFIO now signals
    /// for that vector (non-blocking): peers ring it through the device, our
    /// own threads by writing `ring`.
    ///
    /// A vector is free again once every descriptor of its doorbell is closed:
    /// when no vector is free, this looks through `/proc/self/fd` for
    /// descriptors of each doorbell's eventfd (`kcmp`) and takes back the
    /// vectors nobody holds. A peer that still rings a vector given to a new
    /// doorbell only causes a spurious wake-up, which doorbells allow.
    pub fn new_bell(&self) -> Result<Doorbell, GuestError> {
        let mut vectors = self.vectors.lock();
        let free = match vectors.iter().position(|v| !v.in_use) {
            Some(v) => v,
            None => {
                reclaim_vectors(&mut vectors);
                vectors
                    .iter()
                    .position(|v| !v.in_use)
                    .ok_or(GuestError::NoFreeVector(self.welcome.vectors))?
            }
        };
        let fresh = vfio::vector_eventfd()?;
        if let Some(device) = &self.doorbell {
            device.set_vector_eventfds(free as u16, &[fresh.as_fd()])?;
        }
        let wait = rustix::io::fcntl_dupfd_cloexec(&fresh, 0).map_err(std::io::Error::from)?;
        let ring = rustix::io::fcntl_dupfd_cloexec(&fresh, 0).map_err(std::io::Error::from)?;
        vectors[free] = Vector {
            installed: fresh,
            in_use: true,
        };
        Ok(Doorbell { wait, ring })
    }

    /// The vector of one of our doorbells, given any descriptor of it (what
    /// the link transport sends for a descriptor), or `None` for anything else.
    pub fn bell_vector(&self, fd: BorrowedFd<'_>) -> Option<u16> {
        let vectors = self.vectors.lock();
        vectors
            .iter()
            .enumerate()
            .skip(1)
            .find(|(_, v)| v.in_use && same_file(v.installed.as_fd(), fd))
            .map(|(i, _)| i as u16)
    }

    /// Turns a ring-end descriptor the link transport produced for a peer's
    /// doorbell into a register ring (value `(peer << 16) | vector`).
    pub fn ring_end(&self, fd: OwnedFd) -> Result<RingEnd, GuestError> {
        let (peer, vector) =
            ring_token::read(self.ring_key, &fd).ok_or(GuestError::NotARingToken)?;
        Ok(RingEnd::Register {
            register: self.register(),
            value: (u32::from(peer) << 16) | u32::from(vector),
        })
    }

    /// The doorbell register: writing `(peer << 16) | vector` rings that peer.
    pub fn register(&self) -> Arc<dyn RingRegister> {
        self.register.clone()
    }

    /// Whether the doorbell register is mapped (one store per ring) rather
    /// than written with `pwrite` (a system call per ring).
    pub fn register_is_mapped(&self) -> bool {
        self.doorbell
            .as_ref()
            .is_some_and(|d| d.register().is_mapped())
    }

    /// Our ivshmem peer id as the device reports it.
    pub fn own_peer(&self) -> u16 {
        self.welcome.own_peer
    }

    /// A peer's arena hot-plugged under root port `root`: its BAR opened
    /// read-only, once the device is there (up to `timeout`).
    pub fn open_peer_arena(
        &self,
        root: &str,
        len: u64,
        timeout: Duration,
    ) -> Result<OwnedFd, GuestError> {
        self.open_peer_arena_ticking(root, len, timeout, Duration::MAX, &mut || {})
    }

    /// [`Guest::open_peer_arena`], calling `tick` every `every` while the
    /// device has not appeared (the link transport keeps the broker session
    /// alive with it).
    pub(crate) fn open_peer_arena_ticking(
        &self,
        root: &str,
        len: u64,
        timeout: Duration,
        every: Duration,
        tick: &mut dyn FnMut(),
    ) -> Result<OwnedFd, GuestError> {
        let port = PciDevice::open_in(&self.sysfs, root)?;
        let deadline = std::time::Instant::now() + timeout;
        let device = loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match port.wait_for_child(IVSHMEM_MEMORY_BAR, left.min(every)) {
                Ok(device) => break device,
                Err(e) if left <= every => return Err(e),
                Err(_) => tick(),
            }
        };
        device.expect_ivshmem()?;
        let (fd, bar_len) = device.open_bar(IVSHMEM_MEMORY_BAR, false)?;
        if bar_len < len {
            return Err(GuestError::Device(format!(
                "peer arena under {root} is {bar_len} bytes, the handle says {len}"
            )));
        }
        Ok(fd)
    }

    /// How many liveness sockets the link holds for peers (diagnostics).
    pub fn liveness_count(&self) -> usize {
        self.link.liveness_count()
    }

    pub(crate) fn link(&self) -> &link::Link {
        &self.link
    }

    pub(crate) fn ring_token_key(&self) -> u64 {
        self.ring_key
    }
}

/// A guest over `port` (any stream: tests use a socket pair) with no
/// devices: the link's tests, without hardware.
#[cfg(test)]
pub(crate) fn guest_without_devices(
    port: OwnedFd,
    vectors: u16,
    register: Arc<dyn RingRegister>,
    sysfs: &Path,
) -> Result<Arc<Guest>, GuestError> {
    let link = link::Link::new(port)?;
    let welcome = link.hello()?;
    check_welcome(&welcome)?;
    let vectors = (0..vectors)
        .map(|v| {
            Ok(Vector {
                installed: vfio::vector_eventfd()?,
                in_use: v == 0,
            })
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    Ok(Arc::new(Guest {
        port_path: "test-link".into(),
        welcome,
        link,
        doorbell: None,
        register,
        vectors: Mutex::new(vectors),
        ring_key: random_key(),
        sysfs: sysfs.to_owned(),
    }))
}

struct GuestConnector {
    guest: Arc<Guest>,
}

impl fido_control::Connect for GuestConnector {
    fn connect(&self) -> fido_control::Result<Arc<dyn fido_control::Transport>> {
        self.guest.link.connect(&self.guest)
    }

    fn address(&self) -> String {
        format!("VM supervisor via {}", self.guest.port_path.display())
    }
}

/// Checks what `decode_host` cannot: that every address is a full PCI address
/// (they are joined to sysfs paths).
fn check_welcome(w: &Welcome) -> Result<(), GuestError> {
    for addr in std::iter::once(&w.arena)
        .chain(std::iter::once(&w.doorbell))
        .chain(w.ports.iter())
    {
        if !pci::is_pci_address(addr) {
            return Err(GuestError::Link(format!(
                "the Welcome names {addr:?}, not a PCI address"
            )));
        }
    }
    if w.arena == w.doorbell {
        return Err(GuestError::Link(
            "the Welcome names one device as both arena and doorbell".into(),
        ));
    }
    Ok(())
}

/// The port named [`PORT_NAME`] among `ports` (`/sys/class/virtio-ports`),
/// as its device node under `dev`.
pub(crate) fn detect_in(ports: &Path, dev: &Path) -> Option<PathBuf> {
    for entry in std::fs::read_dir(ports).ok()?.flatten() {
        let Ok(name) = std::fs::read_to_string(entry.path().join("name")) else {
            continue;
        };
        if name.trim_end_matches('\n') == PORT_NAME {
            let node = entry.file_name();
            let node = node.to_str()?;
            if node.is_empty() || node.contains('/') || node.starts_with('.') {
                continue;
            }
            return Some(dev.join(node));
        }
    }
    None
}

/// Whether two descriptors are the same open file (`kcmp(KCMP_FILE)`).
fn same_file(a: BorrowedFd<'_>, b: BorrowedFd<'_>) -> bool {
    const KCMP_FILE: libc::c_long = 0;
    let pid = libc::c_long::from(std::process::id() as i32);
    // SAFETY: kcmp compares two descriptor numbers of this process and
    // touches no memory; both descriptors are borrowed, so open.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            pid,
            pid,
            KCMP_FILE,
            a.as_raw_fd() as libc::c_long,
            b.as_raw_fd() as libc::c_long,
        )
    };
    r == 0
}

/// Frees the vectors whose doorbells nobody holds any more: no descriptor
/// of this process but our own copy refers to their eventfd.
fn reclaim_vectors(vectors: &mut [Vector]) {
    let ours: Vec<i32> = vectors.iter().map(|v| v.installed.as_raw_fd()).collect();
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let mut eventfds = Vec::new();
    for entry in dir.flatten() {
        let Some(n) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if ours.contains(&n) {
            continue;
        }
        if std::fs::read_link(entry.path()).is_ok_and(|t| t.as_os_str() == "anon_inode:[eventfd]") {
            eventfds.push(n);
        }
    }
    for v in vectors.iter_mut().skip(1).filter(|v| v.in_use) {
        let held = eventfds.iter().any(|&n| {
            // SAFETY: `n` was listed in /proc/self/fd a moment ago; the borrow
            // is used for one kcmp only, which fails harmlessly (EBADF) if the
            // descriptor was closed meanwhile.
            let other = unsafe { BorrowedFd::borrow_raw(n) };
            same_file(v.installed.as_fd(), other)
        });
        if !held {
            v.in_use = false;
        }
    }
}

/// A per-process random key from the standard library's hash seeds (drawn
/// from the OS's random source).
fn random_key() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id().into());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_port_is_found_by_name() {
        let sys = tempfile::tempdir().unwrap();
        for (node, name) in [
            ("vport0p1", "org.other\n"),
            ("vport0p2", "org.fido.broker\n"),
        ] {
            std::fs::create_dir(sys.path().join(node)).unwrap();
            std::fs::write(sys.path().join(node).join("name"), name).unwrap();
        }
        assert_eq!(
            detect_in(sys.path(), Path::new("/dev")),
            Some(PathBuf::from("/dev/vport0p2"))
        );
        std::fs::write(
            sys.path().join("vport0p2").join("name"),
            "org.fido.broker.not\n",
        )
        .unwrap();
        assert_eq!(detect_in(sys.path(), Path::new("/dev")), None);
        assert_eq!(
            detect_in(Path::new("/nonexistent"), Path::new("/dev")),
            None
        );
    }

    #[test]
    fn kcmp_tells_dups_from_strangers() {
        let a = vfio::vector_eventfd().unwrap();
        let dup = rustix::io::fcntl_dupfd_cloexec(&a, 0).unwrap();
        let other = vfio::vector_eventfd().unwrap();
        assert!(same_file(a.as_fd(), dup.as_fd()));
        assert!(!same_file(a.as_fd(), other.as_fd()));
    }

    /// Vectors come back once every descriptor of their doorbell is closed,
    /// and not before.
    #[test]
    fn vectors_are_reclaimed_only_when_unheld() {
        let held = vfio::vector_eventfd().unwrap();
        let held_dup = rustix::io::fcntl_dupfd_cloexec(&held, 0).unwrap();
        let dropped = vfio::vector_eventfd().unwrap();
        let mut vectors = vec![
            Vector {
                installed: vfio::vector_eventfd().unwrap(),
                in_use: true,
            },
            Vector {
                installed: held,
                in_use: true,
            },
            Vector {
                installed: dropped,
                in_use: true,
            },
        ];
        reclaim_vectors(&mut vectors);
        assert!(vectors[0].in_use, "vector 0 stays reserved");
        assert!(vectors[1].in_use, "a dup is still open");
        assert!(!vectors[2].in_use, "nobody holds it");
        drop(held_dup);
        reclaim_vectors(&mut vectors);
        assert!(!vectors[1].in_use);
    }

    #[test]
    fn welcome_addresses_must_be_pci_addresses() {
        let mut w = Welcome {
            version: 1,
            arena: "0000:00:04.0".into(),
            arena_len: 1 << 20,
            doorbell: "0000:00:05.0".into(),
            vectors: 8,
            own_peer: 1,
            ports: vec!["0000:00:10.0".into()],
            max_peer_arena: 1 << 30,
        };
        check_welcome(&w).unwrap();
        w.ports.push("..".into());
        assert!(check_welcome(&w).is_err());
        w.ports.pop();
        w.doorbell = w.arena.clone();
        assert!(check_welcome(&w).is_err());
    }
}
