//! QEMU's command line and process for one VM domain.
//!
//! The supervisor creates every descriptor QEMU needs (its own arena, the
//! control, QMP and doorbell-server sockets) and QEMU inherits exactly those,
//! at fixed numbers, so no socket path exists that another local user could
//! race for. The guest finds its devices at fixed PCI addresses
//! ([`welcome_devices`]), which the supervisor announces in the link's
//! `Welcome`.

use crate::doorbell_server::{DoorbellServer, VectorKind};
use crate::qmp::Qmp;
use fido_proto::guest::{Welcome, LINK_VERSION};
use rustix::fs::SealFlags;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The accelerator QEMU runs the guest with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualisation through `/dev/kvm` (kvm_intel / kvm_amd).
    Kvm,
    /// QEMU's binary translator: slow, but runs anywhere.
    Tcg,
}

impl std::str::FromStr for Accel {
    type Err = String;
    fn from_str(s: &str) -> Result<Accel, String> {
        match s {
            "kvm" => Ok(Accel::Kvm),
            "tcg" => Ok(Accel::Tcg),
            other => Err(format!("unknown accelerator {other:?} (kvm or tcg)")),
        }
    }
}

impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        })
    }
}

/// The CPU model of a TCG guest: QEMU's `max` without the fast-string
/// features (ERMS, FSRM). With them, glibc's `memset`/`memcpy` and the guest
/// kernel's user copies use `rep stosb`/`rep movsb` for anything over a few
/// KiB, and TCG emulates those one byte at a time: under QEMU 7.2, `memset`
/// of 64 KiB ran at 261 MB/s with ERMS and 3.6 GB/s without it, `memcpy` at
/// 209 MB/s and 2.0 GB/s (docs/VM.md §4.1). Without them the guest moves
/// memory with vector and `rep movsq` code, which TCG runs at its speed.
/// Every QEMU of this project that runs under TCG (the bench's and the
/// demo's baselines too) uses this model, so their figures stay comparable.
pub const TCG_CPU: &str = "max,erms=off,fsrm=off";

/// The `-smp` of a TCG guest with `cpus` vCPUs: never fewer than two
/// *possible* CPUs (`maxcpus`), however few run. QEMU's multi-threaded TCG
/// translates a machine whose `maxcpus` is 1 as not parallel: QEMU 7.2 then
/// drops the guest's memory barriers (`mfence`, `lock`ed instructions), and
/// every version makes its `lock`ed read-modify-writes plain loads and
/// stores. Alone, a one-CPU guest cannot tell; with memory shared with
/// another process (a peer's arena, a ring) it breaks every protocol that
/// needs a fence: a store-buffering litmus test between host and guest sees
/// the forbidden outcome hundreds to thousands of times in 10^6 rounds with
/// `-smp 1`, never with `-smp 1,maxcpus=2` (docs/VM.md §3,
/// `scripts/tcg-litmus.c`, `tests/tcg_memory_model.rs`). The guest side
/// refuses a TCG guest with one possible CPU (`fido_guest::machine`). Every
/// QEMU of this project under TCG uses this, the bench's and the demo's
/// baselines too (whose virtio rings need the same barriers).
pub fn tcg_smp(cpus: u32) -> String {
    format!("{cpus},maxcpus={}", cpus.max(2))
}

/// `KVM_GET_API_VERSION` = `_IO(KVMIO, 0x00)`.
const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;
/// The only KVM API version there has ever been.
const KVM_API_VERSION: libc::c_int = 12;

/// Chooses KVM when `/dev/kvm` opens, speaks API 12 and is served by a
/// vendor module that boots stock guests (kvm_intel or kvm_amd); TCG
/// otherwise. The string says why, for the user.
pub fn detect_accel() -> (Accel, String) {
    detect_accel_in(std::path::Path::new("/dev/kvm"), std::path::Path::new("/sys/module"))
}

/// [`detect_accel`], unless `FIDO_VM_ACCEL` (`kvm` or `tcg`) or `requested`
/// (which wins) says otherwise.
pub fn choose_accel(requested: Option<Accel>) -> (Accel, String) {
    if let Some(a) = requested {
        return (a, format!("{}: requested", a.to_string().to_uppercase()));
    }
    if let Ok(v) = std::env::var("FIDO_VM_ACCEL") {
        if let Ok(a) = v.parse::<Accel>() {
            return (a, format!("{}: FIDO_VM_ACCEL={v}", a.to_string().to_uppercase()));
        }
    }
    detect_accel()
}

fn detect_accel_in(dev: &std::path::Path, modules: &std::path::Path) -> (Accel, String) {
    let file = match std::fs::OpenOptions::new().read(true).write(true).open(dev) {
        Ok(f) => f,
        Err(e) => return (Accel::Tcg, format!("TCG: {} cannot be opened ({e})", dev.display())),
    };
    // SAFETY: KVM_GET_API_VERSION takes no argument and only returns an int;
    // the descriptor is open for the duration of the call.
    let version = unsafe { libc::ioctl(file.as_raw_fd(), KVM_GET_API_VERSION as _, 0) };
    if version != KVM_API_VERSION {
        return (Accel::Tcg, format!("TCG: {} answers KVM API version {version}, not {KVM_API_VERSION}", dev.display()));
    }
    let loaded = |m: &str| modules.join(m).exists();
    if loaded("kvm_pvm") {
        return (Accel::Tcg, format!("TCG: {} is kvm_pvm, which cannot boot a stock guest", dev.display()));
    }
    for m in ["kvm_intel", "kvm_amd"] {
        if loaded(m) {
            return (Accel::Kvm, format!("KVM: {} ({m}, API {version})", dev.display()));
        }
    }
    (Accel::Tcg, format!("TCG: {} is served by neither kvm_intel nor kvm_amd", dev.display()))
}

/// The guest's network card (for the virtio-net baselines).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NicSpec {
    /// QEMU's user-mode network; each `(host_port, guest_port)` forwards TCP
    /// from `127.0.0.1:host_port` to the guest.
    User { hostfwd: Vec<(u16, u16)> },
    /// A tap device whose descriptor is [`VmFds::tap`].
    Tap,
}

/// Most hot-plug root ports a VM gets (8 functions in each of slots 0x10–0x13).
pub const MAX_PORTS: u16 = 32;
/// Most doorbell vectors (MSI-X entries) a VM gets.
pub const MAX_VECTORS: u16 = 256;
/// Largest arena (the VM's own or a peer's): a PGVAS slot.
pub const MAX_ARENA: u64 = 64 << 30;
/// Most guest-physical space the arenas may take together (the guest's
/// physical address width is 40 bits under TCG: 1 TiB, RAM and the 32-bit
/// hole included).
pub const MAX_PCI_WINDOW: u64 = 512 << 30;
/// Smallest own arena.
pub const MIN_ARENA: u64 = 1 << 20;

/// Guest PCI slot of the own arena, the doorbell device, the control port's
/// virtio-serial controller, the disk and the NIC.
const SLOT_ARENA: u8 = 0x4;
const SLOT_DOORBELL: u8 = 0x5;
const SLOT_SERIAL: u8 = 0x6;
const SLOT_NIC: u8 = 0x7;
const SLOT_DISK: u8 = 0x3;
/// First slot of the root ports (8 per slot; 0x1f is the ICH9 chipset's).
const SLOT_PORTS: u8 = 0x10;

/// Descriptor numbers QEMU inherits them at.
const FD_ARENA: RawFd = 3;
const FD_CONTROL: RawFd = 4;
const FD_QMP: RawFd = 5;
const FD_DOORBELL: RawFd = 6;
const FD_TAP: RawFd = 7;

/// What a VM is made of.
#[derive(Debug, Clone)]
pub struct VmSpec {
    /// The VM's name (its identity; letters, digits, `-`, `_`, `.`).
    pub name: String,
    /// The QEMU binary (`FIDO_QEMU`, else `qemu-system-x86_64` on `PATH`).
    pub binary: PathBuf,
    /// Kernel to boot directly (`-kernel`); none boots the disk (or nothing).
    pub kernel: Option<PathBuf>,
    pub initrd: Option<PathBuf>,
    /// A raw (or `.qcow2`) disk image, as a virtio-blk device.
    pub disk: Option<PathBuf>,
    /// Kernel command line (needs `intel_iommu=on` for the guest's VFIO).
    pub append: String,
    pub mem_mib: u32,
    pub cpus: u16,
    /// The VM's own arena: a power of two, ≥ 1 MiB.
    pub arena_len: u64,
    /// Hot-plug root ports for peer arenas (≤ [`MAX_PORTS`]).
    pub ports: u16,
    /// Largest peer arena a port takes (a power of two: its `pref64-reserve`).
    pub max_peer_arena: u64,
    /// MSI-X vectors of the doorbell device (≥ 2; vector 0 is reserved).
    pub vectors: u16,
    /// Serial console on a Unix socket server at this path.
    pub serial: Option<PathBuf>,
    pub nic: Option<NicSpec>,
    pub accel: Accel,
    /// Start with the CPUs stopped (`-S`): QMP and hot-plug still work.
    pub paused: bool,
    /// Further QEMU arguments, appended as given.
    pub extra: Vec<String>,
}

/// Why a [`VmSpec`] cannot be run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("VM spec: {0}")]
pub struct SpecError(pub String);

impl VmSpec {
    /// A spec with small defaults: 256 MiB of memory, 1 CPU, a 64 MiB arena,
    /// 8 ports of 1 GiB, 64 vectors, no kernel, no disk.
    pub fn new(name: &str, accel: Accel) -> VmSpec {
        VmSpec {
            name: name.to_string(),
            binary: std::env::var_os("FIDO_QEMU").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("qemu-system-x86_64")),
            kernel: None,
            initrd: None,
            disk: None,
            append: String::new(),
            mem_mib: 256,
            cpus: 1,
            arena_len: 64 << 20,
            ports: 8,
            max_peer_arena: 1 << 30,
            vectors: 64,
            serial: None,
            nic: None,
            accel,
            paused: false,
            extra: Vec::new(),
        }
    }

    /// A port's prefetchable window: twice the largest arena it takes. The
    /// firmware aligns bridge windows to far less than their size, and a
    /// BAR must be naturally aligned: a window of twice its size always
    /// holds an aligned one (seen here: a 1 GiB window at 0x2c4000000 could
    /// not take a 1 GiB BAR).
    pub fn port_window(&self) -> u64 {
        self.max_peer_arena.saturating_mul(2)
    }

    /// Guest-physical space the arenas need: the own arena (aligned) and every port's window.
    pub fn pci_hole64(&self) -> u64 {
        (self.arena_len.saturating_mul(2)).saturating_add((self.ports as u64).saturating_mul(self.port_window()))
    }

    /// Checks every field QEMU would otherwise abort on (a BAR that is not a
    /// power of two is an assertion failure in QEMU, not an error).
    pub fn check(&self) -> Result<(), SpecError> {
        let bad = |m: String| Err(SpecError(m));
        if self.name.is_empty() || self.name.len() > 64 || !self.name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) {
            return bad(format!("name {:?}: 1 to 64 letters, digits, '-', '_' or '.'", self.name));
        }
        if !self.arena_len.is_power_of_two() || !(MIN_ARENA..=MAX_ARENA).contains(&self.arena_len) {
            return bad(format!("arena of {} bytes: a power of two from 1 MiB to 64 GiB", self.arena_len));
        }
        if !self.max_peer_arena.is_power_of_two() || !(MIN_ARENA..=MAX_ARENA).contains(&self.max_peer_arena) {
            return bad(format!("largest peer arena {} bytes: a power of two from 1 MiB to 64 GiB", self.max_peer_arena));
        }
        if self.ports > MAX_PORTS {
            return bad(format!("{} ports: at most {MAX_PORTS}", self.ports));
        }
        if self.pci_hole64() > MAX_PCI_WINDOW {
            return bad(format!("{} ports of {} bytes and an arena of {}: over the {MAX_PCI_WINDOW}-byte PCI window", self.ports, self.max_peer_arena, self.arena_len));
        }
        if !(2..=MAX_VECTORS).contains(&self.vectors) {
            return bad(format!("{} vectors: 2 to {MAX_VECTORS}", self.vectors));
        }
        if self.mem_mib < 64 || self.cpus == 0 || self.cpus > 64 {
            return bad(format!("{} MiB / {} CPUs: at least 64 MiB, 1 to 64 CPUs", self.mem_mib, self.cpus));
        }
        if self.initrd.is_some() && self.kernel.is_none() {
            return bad("an initrd needs a kernel".into());
        }
        // QEMU takes the last -smp: one among the extra arguments would undo
        // the two possible CPUs a TCG guest needs ([`tcg_smp`]).
        if let Some(a) = self.extra.iter().find(|a| a.starts_with('-') && a.trim_start_matches('-').split('=').next() == Some("smp")) {
            return bad(format!("{a} among the extra QEMU arguments: give the CPUs with --cpus (the supervisor sets -smp)"));
        }
        for p in [&self.kernel, &self.initrd, &self.disk, &self.serial].into_iter().flatten() {
            if p.to_str().is_none() {
                return bad(format!("path {} is not UTF-8", p.display()));
            }
        }
        Ok(())
    }

    /// The guest-physical 64-bit PCI window the arenas need; q35's default
    /// (32 GiB) is raised when the ports' reserves do not fit in it.
    fn hole64(&self) -> Option<u64> {
        let need = self.arena_len + self.ports as u64 * self.max_peer_arena;
        let default = 32u64 << 30;
        // Room for the firmware's alignment and the doorbell's BARs.
        let want = need.checked_mul(2)?;
        (want > default).then_some(want)
    }

    /// The QEMU arguments (without the binary), for the descriptor numbers
    /// [`spawn`] gives QEMU.
    pub fn args(&self) -> Result<Vec<String>, SpecError> {
        self.check()?;
        let mut a: Vec<String> = Vec::new();
        let mut push = |xs: &[&str]| a.extend(xs.iter().map(|s| s.to_string()));
        push(&["-name", &format!("guest={},debug-threads=on", self.name)]);
        match self.accel {
            // The IOMMU's interrupt remapping needs the split irqchip with KVM.
            Accel::Kvm => push(&["-machine", "q35,kernel-irqchip=split", "-accel", "kvm", "-cpu", "host"]),
            Accel::Tcg => push(&["-machine", "q35", "-accel", "tcg,thread=multi", "-cpu", TCG_CPU]),
        }
        if let Some(size) = self.hole64() {
            push(&["-global", &format!("q35-pcihost.pci-hole64-size={size}")]);
        }
        let smp = match self.accel {
            Accel::Kvm => self.cpus.to_string(),
            Accel::Tcg => tcg_smp(self.cpus.into()),
        };
        push(&["-m", &self.mem_mib.to_string(), "-smp", &smp]);
        // -no-reboot: a guest that reboots (or panics, with panic=-1) ends
        // QEMU, so the domain dies visibly instead of coming back with stale
        // hot-plugged devices and no Fido state.
        push(&["-nodefaults", "-nographic", "-no-user-config", "-no-reboot"]);
        // The guest's VFIO (doorbell MSI-X to eventfds) needs an IOMMU.
        push(&["-device", "intel-iommu,intremap=on"]);
        push(&[
            "-object",
            &format!("memory-backend-file,id=fido-own,mem-path=/proc/self/fd/{FD_ARENA},size={},share=on", self.arena_len),
            "-device",
            &format!("ivshmem-plain,id=fido-arena,memdev=fido-own,addr={SLOT_ARENA:#x}"),
        ]);
        // ioeventfd=off: a guest's ring is then written by QEMU with write()
        // to the peer's descriptor, which may be a socket (Fido's host
        // doorbells). With KVM, ioeventfd=on would hand it to the kernel,
        // which takes only eventfds (and QEMU aborts on anything else); under
        // TCG the two are the same path.
        push(&[
            "-chardev",
            &format!("socket,id=fido-bell,fd={FD_DOORBELL}"),
            "-device",
            &format!("ivshmem-doorbell,id=fido-doorbell,chardev=fido-bell,vectors={},ioeventfd=off,addr={SLOT_DOORBELL:#x}", self.vectors),
        ]);
        push(&[
            "-device",
            &format!("virtio-serial-pci,id=fido-vser,addr={SLOT_SERIAL:#x}"),
            "-chardev",
            &format!("socket,id=fido-ctl,fd={FD_CONTROL}"),
            "-device",
            &format!("virtserialport,id=fido-ctlport,chardev=fido-ctl,name={}", fido_proto::guest::PORT_NAME),
        ]);
        push(&["-chardev", &format!("socket,id=fido-qmp,fd={FD_QMP}"), "-mon", "chardev=fido-qmp,mode=control"]);
        // Room for the own arena and every port's window in the 64-bit hole
        // (q35's default of 32 GiB is too small for many large ports).
        push(&["-global", &format!("q35-pcihost.pci-hole64-size={}", self.pci_hole64().max(32 << 30))]);
        for i in 0..self.ports {
            let (slot, func) = port_slot(i);
            let multi = if func == 0 { ",multifunction=on" } else { "" };
            push(&[
                "-device",
                &format!(
                    "pcie-root-port,id={},bus=pcie.0,addr={slot:#x}.{func}{multi},chassis={},pref64-reserve={}",
                    crate::hotplug::port_id(i),
                    i + 1,
                    self.port_window()
                ),
            ]);
        }
        let path = |p: &PathBuf| p.to_str().expect("checked UTF-8").to_string();
        if let Some(k) = &self.kernel {
            push(&["-kernel", &path(k), "-append", &self.append]);
        }
        if let Some(i) = &self.initrd {
            push(&["-initrd", &path(i)]);
        }
        if let Some(d) = &self.disk {
            let format = if path(d).ends_with(".qcow2") { "qcow2" } else { "raw" };
            push(&[
                "-drive",
                &format!("if=none,id=fido-disk,format={format},file={}", opt_escape(&path(d))),
                "-device",
                &format!("virtio-blk-pci,drive=fido-disk,addr={SLOT_DISK:#x}"),
            ]);
        }
        if let Some(s) = &self.serial {
            push(&["-chardev", &format!("socket,id=fido-con,path={},server=on,wait=off", opt_escape(&path(s))), "-serial", "chardev:fido-con"]);
        }
        if let Some(nic) = &self.nic {
            let netdev = match nic {
                NicSpec::User { hostfwd } => {
                    let mut s = "user,id=fido-net".to_string();
                    for (h, g) in hostfwd {
                        s.push_str(&format!(",hostfwd=tcp:127.0.0.1:{h}-:{g}"));
                    }
                    s
                }
                NicSpec::Tap => format!("tap,id=fido-net,fd={FD_TAP}"),
            };
            push(&["-netdev", &netdev, "-device", &format!("virtio-net-pci,netdev=fido-net,mac={},addr={SLOT_NIC:#x}", mac_for(&self.name))]);
        }
        if self.paused {
            push(&["-S"]);
        }
        a.extend(self.extra.iter().cloned());
        Ok(a)
    }
}

/// Root port `i`'s slot and function on the root bus.
fn port_slot(i: u16) -> (u8, u8) {
    (SLOT_PORTS + (i / 8) as u8, (i % 8) as u8)
}

/// A QEMU option value: commas are doubled.
fn opt_escape(s: &str) -> String {
    s.replace(',', ",,")
}

/// A locally administered MAC derived from the VM's name, so that VMs on one
/// bridge differ (QEMU gives every NIC the same default).
fn mac_for(name: &str) -> String {
    // FNV-1a: stable across runs and Rust versions.
    let mut h: u32 = 0x811c_9dc5;
    for b in name.bytes() {
        h = (h ^ b as u32).wrapping_mul(0x0100_0193);
    }
    format!("52:54:00:{:02x}:{:02x}:{:02x}", (h >> 16) as u8, (h >> 8) as u8, h as u8)
}

/// The guest PCI addresses of the own arena, the doorbell device and each
/// hot-plug root port, as the command line of `spec` places them.
pub fn welcome_devices(spec: &VmSpec) -> (String, String, Vec<String>) {
    let addr = |slot: u8, func: u8| format!("0000:00:{slot:02x}.{func}");
    let ports = (0..spec.ports).map(|i| {
        let (s, f) = port_slot(i);
        addr(s, f)
    });
    (addr(SLOT_ARENA, 0), addr(SLOT_DOORBELL, 0), ports.collect())
}

/// The link's `Welcome` for a VM started from `spec` whose ivshmem peer id
/// is `own_peer`.
pub fn welcome(spec: &VmSpec, own_peer: u16) -> Welcome {
    let (arena, doorbell, ports) = welcome_devices(spec);
    Welcome {
        version: LINK_VERSION,
        arena,
        arena_len: spec.arena_len,
        doorbell,
        vectors: spec.vectors,
        own_peer,
        ports,
        max_peer_arena: spec.max_peer_arena,
    }
}

/// The descriptors QEMU inherits. `spawn` closes the supervisor's copies
/// (QEMU keeps its own), so pass a duplicate of the arena memfd: the
/// supervisor keeps the original to seal it once QEMU has mapped it, and to
/// give it to the broker.
#[derive(Debug)]
pub struct VmFds {
    /// The VM's own arena: a memfd, read-write, not yet sealed against writes
    /// (QEMU maps it shared read-write; seal after QMP greets).
    pub arena: OwnedFd,
    /// QEMU's end of the control socket pair (the virtio-serial port).
    pub control: OwnedFd,
    /// QEMU's end of the QMP socket pair.
    pub qmp: OwnedFd,
    /// QEMU's end of the doorbell-server socket pair (the handshake must be
    /// in it already: QEMU reads it while creating the device).
    pub doorbell: OwnedFd,
    /// A tap device, for [`NicSpec::Tap`].
    pub tap: Option<OwnedFd>,
}

/// Bytes of QEMU's standard error kept for error messages.
const STDERR_TAIL: usize = 16 << 10;

/// A running QEMU. Dropping it kills QEMU.
#[derive(Debug)]
pub struct QemuProcess {
    pub pid: u32,
    pub child: Child,
    stderr: Arc<Mutex<Vec<u8>>>,
    exited: Option<ExitStatus>,
}

/// Starts QEMU for `spec` with exactly the descriptors in `fds` (at numbers
/// 3–7) and no others. QEMU gets `PR_SET_PDEATHSIG(SIGKILL)`: it dies when
/// the *thread* that called `spawn` exits, so call it from the supervisor's
/// main thread. It runs in its own process group (a terminal's Ctrl-C reaches
/// the supervisor, which shuts the VM down in order).
pub fn spawn(spec: &VmSpec, fds: VmFds) -> io::Result<QemuProcess> {
    let args = spec.args().map_err(io::Error::other)?;
    if matches!(spec.nic, Some(NicSpec::Tap)) != fds.tap.is_some() {
        return Err(io::Error::other("a tap NIC needs exactly one tap descriptor"));
    }
    // Move each descriptor above the numbers it is dup2'ed to, so no dup2 in
    // the child overwrites a source it still needs.
    let mut sources: Vec<OwnedFd> = Vec::new();
    for fd in [Some(fds.arena), Some(fds.control), Some(fds.qmp), Some(fds.doorbell), fds.tap].into_iter().flatten() {
        sources.push(rustix::io::fcntl_dupfd_cloexec(&fd, 64)?);
    }
    let raw: Vec<RawFd> = sources.iter().map(|f| f.as_raw_fd()).collect();
    let targets = [FD_ARENA, FD_CONTROL, FD_QMP, FD_DOORBELL, FD_TAP];
    let parent = std::process::id() as libc::pid_t;
    let mut cmd = Command::new(&spec.binary);
    cmd.args(&args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).process_group(0);
    // SAFETY: the closure only makes async-signal-safe system calls (dup2,
    // close_range, fcntl, prctl, getppid) on integers captured by value.
    unsafe {
        cmd.pre_exec(move || {
            for (i, &src) in raw.iter().enumerate() {
                // dup2 leaves the new number without FD_CLOEXEC: inherited.
                if libc::dup2(src, targets[i]) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            let first_other = FD_ARENA as libc::c_uint + raw.len() as libc::c_uint;
            // Everything else closes on exec (CLOEXEC rather than close, so
            // std's exec-error pipe still works).
            let r = libc::syscall(libc::SYS_close_range, first_other, libc::c_uint::MAX, libc::CLOSE_RANGE_CLOEXEC);
            if r != 0 {
                for fd in first_other as RawFd..4096 {
                    libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
                }
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The supervisor may have died before the prctl took effect.
            if libc::getppid() != parent {
                return Err(io::Error::other("supervisor gone"));
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    drop(sources);
    let stderr = Arc::new(Mutex::new(Vec::new()));
    if let Some(mut pipe) = child.stderr.take() {
        let tail = stderr.clone();
        std::thread::Builder::new().name(format!("qemu-stderr-{}", spec.name)).spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
                t.extend_from_slice(&buf[..n]);
                if t.len() > STDERR_TAIL {
                    let cut = t.len() - STDERR_TAIL;
                    t.drain(..cut);
                }
            }
        })?;
    }
    Ok(QemuProcess { pid: child.id(), child, stderr, exited: None })
}

impl QemuProcess {
    /// The last bytes QEMU wrote to its standard error (its reason when it
    /// refuses to start or aborts).
    pub fn stderr_tail(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }

    /// QEMU's exit status if it has exited (reaps it).
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait()?;
        }
        Ok(self.exited)
    }

    /// Waits up to `timeout` for QEMU to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> io::Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(Some(s));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Kills QEMU (SIGKILL) and reaps it.
    pub fn kill(&mut self) -> io::Result<ExitStatus> {
        if let Some(s) = self.try_wait()? {
            return Ok(s);
        }
        self.child.kill()?;
        let s = self.child.wait()?;
        self.exited = Some(s);
        Ok(s)
    }
}

impl Drop for QemuProcess {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// A started VM: what its supervisor holds.
#[derive(Debug)]
pub struct Launched {
    pub qemu: QemuProcess,
    /// QMP, in command mode.
    pub qmp: Qmp,
    /// The ivshmem server, handshake complete: every own vector is live.
    pub doorbell: DoorbellServer,
    /// The VM's own arena: the memfd (open read-write), sealed
    /// SHRINK|GROW|FUTURE_WRITE|SEAL once QEMU had mapped it.
    pub arena: OwnedFd,
    /// The supervisor's end of the control link (the guest's
    /// `org.fido.broker` port), non-blocking.
    pub control: OwnedFd,
    /// What to tell the guest in the link's `Welcome`.
    pub welcome: Welcome,
}

impl Launched {
    /// A fresh read-only description of the own arena (a grant, for the broker).
    pub fn arena_read_only(&self) -> io::Result<OwnedFd> {
        let path = format!("/proc/self/fd/{}", self.arena.as_raw_fd());
        Ok(rustix::fs::open(path.as_str(), rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC, rustix::fs::Mode::empty())?)
    }
}

/// Why a VM did not start.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error("starting the VM: {0}")]
    Io(#[from] io::Error),
    /// QEMU started but did not come up; `stderr` is what it said.
    #[error("QEMU did not come up ({what}): {err}; QEMU said: {stderr}")]
    Qemu { what: &'static str, err: String, stderr: String },
}

/// Starts the VM of `spec` in the one safe order: the own arena (a memfd)
/// and the sockets, the doorbell handshake written, QEMU spawned with them,
/// QMP greeted, the handshake read by QEMU, and only then the arena sealed.
/// `tap` is the tap descriptor of a [`NicSpec::Tap`]. `timeout` bounds each
/// wait (and each later QMP command). On error QEMU is killed.
pub fn launch(spec: &VmSpec, tap: Option<OwnedFd>, timeout: Duration) -> Result<Launched, LaunchError> {
    spec.check()?;
    let arena = rustix::fs::memfd_create("fido-vm-arena", rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING).map_err(io::Error::from)?;
    rustix::fs::ftruncate(&arena, spec.arena_len).map_err(io::Error::from)?;
    let pair = || rustix::net::socketpair(rustix::net::AddressFamily::UNIX, rustix::net::SocketType::STREAM, rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK, None).map_err(io::Error::from);
    let (control, qemu_control) = pair()?;
    let (qmp_end, qemu_qmp) = pair()?;
    let (mut doorbell, qemu_doorbell) = DoorbellServer::new(spec.vectors, VectorKind::for_accel(spec.accel)).map_err(|e| io::Error::other(e.to_string()))?;
    let fds = VmFds { arena: arena.try_clone()?, control: qemu_control, qmp: qemu_qmp, doorbell: qemu_doorbell, tap };
    let mut qemu = spawn(spec, fds)?;
    let failed = |qemu: &mut QemuProcess, what, err: String| {
        // Give QEMU a moment to finish saying why before it is killed.
        let _ = qemu.wait_timeout(Duration::from_millis(500));
        std::thread::sleep(Duration::from_millis(50));
        LaunchError::Qemu { what, err, stderr: qemu.stderr_tail().trim().to_string() }
    };
    let qmp = match Qmp::connect(qmp_end, timeout) {
        Ok(q) => q,
        Err(e) => return Err(failed(&mut qemu, "QMP greeting", e.to_string())),
    };
    if let Err(e) = doorbell.complete_handshake(timeout) {
        return Err(failed(&mut qemu, "doorbell handshake", e.to_string()));
    }
    // QEMU has mapped the arena (it greets only after creating every device).
    rustix::fs::fcntl_add_seals(&arena, SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE | SealFlags::SEAL).map_err(io::Error::from)?;
    let welcome = welcome(spec, doorbell.own_peer());
    Ok(Launched { qemu, qmp, doorbell, arena, control, welcome })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accel_detection_reports_why() {
        let dir = tempfile::tempdir().unwrap();
        let (a, why) = detect_accel_in(&dir.path().join("nokvm"), dir.path());
        assert_eq!(a, Accel::Tcg);
        assert!(why.contains("cannot be opened"), "{why}");
        let (a, why) = detect_accel();
        eprintln!("this machine: {a} ({why})");
    }

    #[test]
    fn spec_checks() {
        let mut s = VmSpec::new("vm-1", Accel::Tcg);
        s.check().unwrap();
        s.arena_len = 3 << 20;
        assert!(s.check().is_err());
        s.arena_len = 1 << 20;
        s.max_peer_arena = (1 << 30) + 4096;
        assert!(s.check().is_err());
        s.max_peer_arena = 1 << 30;
        s.ports = MAX_PORTS + 1;
        assert!(s.check().is_err());
        s.ports = 16;
        s.vectors = 1;
        assert!(s.check().is_err());
        s.vectors = 8;
        s.name = "a,b".into();
        assert!(s.check().is_err());
        s.name = "ok".into();
        for smp in ["-smp", "--smp", "-smp=1"] {
            s.extra = vec![smp.into(), "1".into()];
            assert!(s.check().unwrap_err().0.contains("--cpus"), "{smp}");
        }
        s.extra = vec!["-name".into(), "smp".into(), "-device".into(), "virtio-rng-pci".into()];
        let args = s.args().unwrap().join(" ");
        assert!(args.contains("addr=0x10.0,multifunction=on,chassis=1,pref64-reserve=2147483648"), "{args}");
        assert!(args.contains("id=fido-port15,bus=pcie.0,addr=0x11.7,chassis=16"), "{args}");
        let (arena, bell, ports) = welcome_devices(&s);
        assert_eq!((arena.as_str(), bell.as_str()), ("0000:00:04.0", "0000:00:05.0"));
        assert_eq!(ports[9], "0000:00:11.1");
        assert_ne!(mac_for("a"), mac_for("b"));
    }
}
