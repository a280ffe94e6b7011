//! The host side against the real QEMU, with no guest kernel: QEMU starts
//! paused (`-S`), which still creates every device and serves QMP and
//! hot-plug. Each test starts its own small QEMU (a fraction of a second).

use fido_test_support::raw::{memfd, reopen, seal};
use fido_vm::doorbell_server::{DoorbellServer, VectorKind};
use fido_vm::hotplug::{self, HotplugError, Ports};
use fido_vm::qemu::{launch, spawn, welcome, Accel, LaunchError, QemuProcess, VmFds, VmSpec};
use fido_vm::qmp::{Qmp, QmpError};
use rustix::fs::SealFlags;
use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
use serde_json::{json, Value};
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

/// Whether QEMU is installed; each test here skips, saying so, when not
/// (scripts/install-test-deps.sh installs it).
fn no_qemu() -> bool {
    let missing = !fido_test_support::vm::qemu_available();
    if missing {
        eprintln!("SKIPPED: qemu-system-x86_64 is not installed");
    }
    missing
}

/// Generous: the machine is shared and loaded.
const QMP_TIMEOUT: Duration = Duration::from_secs(30);

struct Vm {
    spec: VmSpec,
    qemu: QemuProcess,
    qmp: Qmp,
    bell: DoorbellServer,
    arena: OwnedFd,
    _control: OwnedFd,
}

fn pair() -> (OwnedFd, OwnedFd) {
    socketpair(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK, None).unwrap()
}

fn start(tweak: impl FnOnce(&mut VmSpec)) -> Vm {
    let mut spec = VmSpec::new("fido-vm-test", Accel::Tcg);
    spec.paused = true;
    spec.mem_mib = 128;
    spec.arena_len = 1 << 20;
    spec.ports = 4;
    spec.max_peer_arena = 2 << 20;
    spec.vectors = 8;
    tweak(&mut spec);
    let l = launch(&spec, None, QMP_TIMEOUT).unwrap_or_else(|e| panic!("{e}"));
    Vm { spec, qemu: l.qemu, qmp: l.qmp, bell: l.doorbell, arena: l.arena, _control: l.control }
}

impl Vm {
    fn alive(&mut self) {
        assert!(self.qemu.try_wait().unwrap().is_none(), "QEMU exited: {}", self.qemu.stderr_tail());
        let status = self.qmp.execute("query-status", Value::Null).unwrap();
        let expected = if self.spec.paused { "prelaunch" } else { "running" };
        assert_eq!(status["status"], expected, "{status}");
    }
}

/// Every device of the root bus as (slot, function, vendor, device, qdev id),
/// and the devices behind each bridge by the bridge's qdev id.
/// (slot, function, vendor, device, qdev id) of a root-bus device.
type RootDevice = (u64, u64, u64, u64, String);
/// A bridge's qdev id and its children's (vendor, device, qdev id).
type Bridge = (String, Vec<(u64, u64, String)>);

fn pci(qmp: &mut Qmp) -> (Vec<RootDevice>, Vec<Bridge>) {
    let buses = qmp.execute("query-pci", Value::Null).unwrap();
    let mut root = Vec::new();
    let mut bridges = Vec::new();
    for d in buses[0]["devices"].as_array().unwrap() {
        let id = d["qdev_id"].as_str().unwrap_or("").to_string();
        root.push((d["slot"].as_u64().unwrap(), d["function"].as_u64().unwrap(), d["id"]["vendor"].as_u64().unwrap(), d["id"]["device"].as_u64().unwrap(), id.clone()));
        if let Some(b) = d.get("pci_bridge") {
            let children = b["devices"].as_array().map(|v| v.as_slice()).unwrap_or(&[]);
            let kids = children.iter().map(|c| (c["id"]["vendor"].as_u64().unwrap(), c["id"]["device"].as_u64().unwrap(), c["qdev_id"].as_str().unwrap_or("").to_string())).collect();
            bridges.push((id, kids));
        }
    }
    (root, bridges)
}

#[test]
fn qemu_starts_with_every_device_and_the_arena_seals_after_the_greeting() {
    if no_qemu() {
        return;
    }
    let host_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut vm = start(|s| s.nic = Some(fido_vm::NicSpec::User { hostfwd: vec![(host_port, 5201)] }));
    assert_eq!(vm.qmp.version().0, 7, "QEMU 7.x expected here");
    // launch sealed the arena once QEMU had mapped it; QEMU's shared
    // writable mapping keeps working.
    let seals = rustix::fs::fcntl_get_seals(&vm.arena).unwrap();
    assert!(seals.contains(SealFlags::FUTURE_WRITE | SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL), "{seals:?}");
    vm.alive();
    let (root, bridges) = pci(&mut vm.qmp);
    let at = |slot, func| root.iter().find(|d| d.0 == slot && d.1 == func).cloned();
    let arena = at(4, 0).expect("own arena at 00:04.0");
    assert_eq!((arena.2, arena.3, arena.4.as_str()), (0x1af4, 0x1110, "fido-arena"));
    let bell = at(5, 0).expect("doorbell at 00:05.0");
    assert_eq!((bell.2, bell.3, bell.4.as_str()), (0x1af4, 0x1110, "fido-doorbell"));
    assert_eq!(at(6, 0).expect("virtio-serial at 00:06.0").3, 0x1003);
    for i in 0..4u64 {
        let port = at(0x10, i).unwrap_or_else(|| panic!("root port {i}"));
        assert_eq!((port.3, port.4.clone()), (0x000c, format!("fido-port{i}")));
    }
    assert_eq!(bridges.len(), 4);
    assert_eq!(at(7, 0).expect("virtio-net at 00:07.0").3, 0x1000);
    // User-mode networking listens for the forwarded port.
    std::net::TcpStream::connect(("127.0.0.1", host_port)).expect("hostfwd port");
    // The welcome names exactly those addresses.
    let w = welcome(&vm.spec, vm.bell.own_peer());
    assert_eq!((w.arena.as_str(), w.doorbell.as_str()), ("0000:00:04.0", "0000:00:05.0"));
    assert_eq!(w.ports, ["0000:00:10.0", "0000:00:10.1", "0000:00:10.2", "0000:00:10.3"]);
    // The doorbell device's own size: the server's shared memory page. The
    // own arena BAR is the arena.
    let bars = vm.qmp.execute("query-pci", Value::Null).unwrap();
    let dev = bars[0]["devices"].as_array().unwrap().iter().find(|d| d["slot"] == 4).unwrap().clone();
    let bar2 = dev["regions"].as_array().unwrap().iter().find(|r| r["bar"] == 2).unwrap().clone();
    assert_eq!(bar2["size"].as_u64(), Some(1 << 20), "{bar2}");
    // A write through a sealed fd fails: the arena is the host's to write
    // only through QEMU's mapping.
    assert!(rustix::io::pwrite(&vm.arena, b"x", 0).is_err());
}

/// Waits until the firmware has given every root port a bus number and a
/// prefetchable window of `window` bytes (a largest peer arena) or more;
/// panics, saying which, after `QMP_TIMEOUT`.
fn wait_for_bridges(qmp: &mut Qmp, window: u64) {
    let deadline = std::time::Instant::now() + QMP_TIMEOUT;
    loop {
        let buses = qmp.execute("query-pci", Value::Null).unwrap();
        let bridges: Vec<Value> = buses[0]["devices"].as_array().unwrap().iter().filter_map(|d| d.get("pci_bridge").cloned()).collect();
        // The firmware numbers the buses before it programs the windows: a
        // loaded machine shows the state in between, so wait for both.
        let window_len = |b: &Value| {
            let w = &b["bus"]["prefetchable_range"];
            match (w["base"].as_u64(), w["limit"].as_u64()) {
                (Some(base), Some(limit)) => (limit + 1).saturating_sub(base),
                _ => 0,
            }
        };
        let numbered = bridges.iter().all(|b| b["bus"]["secondary"].as_u64() > Some(0));
        if numbered && bridges.iter().all(|b| window_len(b) >= window) {
            return;
        }
        if std::time::Instant::now() >= deadline {
            assert!(numbered, "the firmware never numbered the root ports' buses: {bridges:?}");
            let small: Vec<_> = bridges.iter().filter(|b| window_len(b) < window).collect();
            panic!("prefetchable windows under {window} bytes: {small:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_sealed_read_only_arena_plugs_under_its_root_port() {
    if no_qemu() {
        return;
    }
    // Running (no kernel: the firmware configures the bridges, then waits
    // for a boot device), so query-pci shows what is behind each port.
    let mut vm = start(|s| s.paused = false);
    wait_for_bridges(&mut vm.qmp, 2 << 20);
    let peer = memfd(2 << 20);
    rustix::io::pwrite(&peer, b"peer data", 0).unwrap();
    seal(&peer);
    let ro = reopen(&peer, rustix::fs::OFlags::RDONLY);
    let mut ports = Ports::new(vm.spec.ports, vm.spec.max_peer_arena);
    let port = ports.allocate(hotplug::PeerArena { slot: 5, owner: 42, len: 2 << 20 }).unwrap();
    ports.allocate(hotplug::PeerArena { slot: 6, owner: 42, len: 1 << 20 }).unwrap();
    hotplug::plug_arena(&mut vm.qmp, port, ro.as_fd(), 2 << 20, vm.spec.max_peer_arena).unwrap();
    let other = memfd(1 << 20);
    seal(&other);
    let other = reopen(&other, rustix::fs::OFlags::RDONLY);
    hotplug::plug_arena(&mut vm.qmp, 1, other.as_fd(), 1 << 20, vm.spec.max_peer_arena).unwrap();
    vm.alive();
    let (_, bridges) = pci(&mut vm.qmp);
    let under = |p: &str| bridges.iter().find(|b| b.0 == p).unwrap().1.clone();
    assert_eq!(under("fido-port0"), [(0x1af4, 0x1110, "fido-dev0".to_string())]);
    assert_eq!(under("fido-port1"), [(0x1af4, 0x1110, "fido-dev1".to_string())]);
    assert!(under("fido-port2").is_empty());
    // QEMU kept no descriptor in an fdset, and the backend is read-only.
    assert_eq!(vm.qmp.execute("query-fdsets", Value::Null).unwrap(), json!([]));
    let ro_prop = vm.qmp.execute("qom-get", json!({"path": "/objects/fido-peer0", "property": "readonly"})).unwrap();
    assert_eq!(ro_prop, json!(true));

    // Refused before QEMU sees them: not a power of two, larger than a port,
    // a writable descriptor, a descriptor shorter than the length.
    let sealed = |len| {
        let fd = memfd(len);
        seal(&fd);
        reopen(&fd, rustix::fs::OFlags::RDONLY)
    };
    let odd = sealed(3 << 20);
    let e = hotplug::plug_arena(&mut vm.qmp, 2, odd.as_fd(), 3 << 20, vm.spec.max_peer_arena).unwrap_err();
    assert!(matches!(e, HotplugError::BadLength { .. }), "{e}");
    let big = sealed(4 << 20);
    let e = hotplug::plug_arena(&mut vm.qmp, 2, big.as_fd(), 4 << 20, vm.spec.max_peer_arena).unwrap_err();
    assert!(e.to_string().contains("larger than a port's window"), "{e}");
    let writable = memfd(1 << 20);
    seal(&writable);
    let e = hotplug::plug_arena(&mut vm.qmp, 2, writable.as_fd(), 1 << 20, vm.spec.max_peer_arena).unwrap_err();
    assert!(matches!(e, HotplugError::BadFd(_)), "{e}");
    let unsealed = reopen(&memfd(1 << 20), rustix::fs::OFlags::RDONLY);
    let e = hotplug::plug_arena(&mut vm.qmp, 2, unsealed.as_fd(), 1 << 20, vm.spec.max_peer_arena).unwrap_err();
    assert!(e.to_string().contains("not sealed"), "{e}");
    let short = sealed(4096);
    let e = hotplug::plug_arena(&mut vm.qmp, 2, short.as_fd(), 1 << 20, vm.spec.max_peer_arena).unwrap_err();
    assert!(matches!(e, HotplugError::BadFd(_)), "{e}");
    // A port that does not exist: QEMU refuses, and everything is undone
    // (the object id is free again).
    let e = hotplug::plug_arena(&mut vm.qmp, 9, other.as_fd(), 1 << 20, vm.spec.max_peer_arena).unwrap_err();
    assert!(matches!(e, HotplugError::Qmp(QmpError::Command { .. })), "{e}");
    let objects = vm.qmp.execute("qom-list", json!({"path": "/objects"})).unwrap();
    assert!(!objects.to_string().contains("fido-peer9"), "{objects}");
    // A port already holding a device: refused by QEMU, the port keeps its device.
    let e = hotplug::plug_arena(&mut vm.qmp, 0, other.as_fd(), 1 << 20, vm.spec.max_peer_arena).unwrap_err();
    assert!(matches!(e, HotplugError::Qmp(_)), "{e}");
    assert_eq!(pci(&mut vm.qmp).1.iter().find(|b| b.0 == "fido-port0").unwrap().1.len(), 1);
    vm.alive();

    // With no guest to acknowledge the ACPI eject, an unplug times out
    // (clearly), and the device stays.
    let e = hotplug::unplug(&mut vm.qmp, 1, Duration::from_millis(500)).unwrap_err();
    assert!(matches!(e, HotplugError::UnplugTimeout { port: 1, .. }), "{e}");
    vm.alive();
}

#[test]
fn doorbell_peers_register_and_stay_non_blocking() {
    if no_qemu() {
        return;
    }
    let mut vm = start(|s| s.vectors = 64);
    assert_eq!(vm.bell.vectors(), 64);
    assert!(vm.bell.own_ring_end(63).is_some() && vm.bell.own_ring_end(64).is_none());
    // A peer's doorbell: QEMU makes the received description blocking and
    // non-blocking again; add_peer returns once it is non-blocking.
    let (wait, ring) = pair();
    let id = vm.bell.add_peer(ring.as_fd()).unwrap();
    assert_eq!(id, 1);
    assert!(rustix::fs::fcntl_getfl(&ring).unwrap().contains(rustix::fs::OFlags::NONBLOCK));
    assert!(vm.bell.check_peers().is_empty());
    let (_wait2, ring2) = pair();
    assert_eq!(vm.bell.add_peer(ring2.as_fd()).unwrap(), 2);
    vm.bell.remove_peer(1).unwrap();
    assert!(vm.bell.remove_peer(1).is_err());
    // Ids are not reused at once.
    let (_wait3, ring3) = pair();
    assert_eq!(vm.bell.add_peer(ring3.as_fd()).unwrap(), 3);
    // The hostile peer: it clears O_NONBLOCK on its ring end; the guard cuts it.
    rustix::io::ioctl_fionbio(&ring2, false).unwrap();
    assert_eq!(vm.bell.check_peers(), vec![2]);
    assert_eq!(vm.bell.peers().collect::<Vec<_>>(), vec![3]);
    drop(wait);
    // Ringing our own vectors with the VM paused (nothing to deliver to):
    // QEMU reads and stays healthy, even with a flood.
    for v in 1..64 {
        let end = vm.bell.own_ring_end(v).unwrap();
        for _ in 0..64 {
            let _ = rustix::net::send(end, &[1u8; 8], rustix::net::SendFlags::DONTWAIT);
        }
    }
    std::thread::sleep(Duration::from_millis(200));
    vm.alive();
    let (_, bridges) = pci(&mut vm.qmp);
    assert_eq!(bridges.len(), 4);
}

#[test]
fn a_qemu_that_refuses_the_spec_reports_why() {
    if no_qemu() {
        return;
    }
    // QEMU rejects an unknown device; its reason comes back from stderr.
    let mut spec = VmSpec::new("refused", Accel::Tcg);
    spec.paused = true;
    spec.extra = vec!["-device".into(), "no-such-device-fido".into()];
    let (_bell, qemu_bell) = DoorbellServer::new(spec.vectors, VectorKind::SocketPair).unwrap();
    let (qmp_end, qemu_qmp) = pair();
    let (_c, qemu_control) = pair();
    let mut qemu = spawn(&spec, VmFds { arena: memfd(spec.arena_len), control: qemu_control, qmp: qemu_qmp, doorbell: qemu_bell, tap: None }).unwrap();
    let status = qemu.wait_timeout(QMP_TIMEOUT).unwrap().expect("QEMU exits");
    assert!(!status.success());
    std::thread::sleep(Duration::from_millis(100));
    assert!(qemu.stderr_tail().contains("no-such-device-fido"), "{}", qemu.stderr_tail());
    // Its QMP socket closes without a greeting: an error, not a hang.
    assert!(matches!(Qmp::connect(qmp_end, QMP_TIMEOUT), Err(QmpError::Closed)));
}

#[test]
fn launch_reports_why_qemu_did_not_come_up() {
    if no_qemu() {
        return;
    }
    let mut spec = VmSpec::new("refused", Accel::Tcg);
    spec.paused = true;
    spec.extra = vec!["-device".into(), "no-such-device-fido".into()];
    match launch(&spec, None, QMP_TIMEOUT) {
        Err(LaunchError::Qemu { stderr, .. }) => assert!(stderr.contains("no-such-device-fido"), "{stderr}"),
        other => panic!("{other:?}"),
    }
    spec.extra.clear();
    spec.arena_len = 3 << 20;
    assert!(matches!(launch(&spec, None, QMP_TIMEOUT), Err(LaunchError::Spec(_))));
}

#[test]
fn qemu_inherits_only_its_descriptors_and_dies_with_the_spawning_thread() {
    if no_qemu() {
        return;
    }
    let (qmp_end, qemu_qmp) = pair();
    let (_c, qemu_control) = pair();
    let (_bell, qemu_bell) = DoorbellServer::new(8, VectorKind::SocketPair).unwrap();
    let pid = std::thread::spawn(move || {
        let mut spec = VmSpec::new("orphan", Accel::Tcg);
        spec.paused = true;
        spec.mem_mib = 128;
        spec.arena_len = 1 << 20;
        spec.vectors = 8;
        let q = spawn(&spec, VmFds { arena: memfd(1 << 20), control: qemu_control, qmp: qemu_qmp, doorbell: qemu_bell, tap: None }).unwrap();
        let pid = q.pid;
        // Keep QEMU running past this thread (Drop would kill it).
        std::mem::forget(q);
        pid
    });
    let pid = pid.join().unwrap();
    // The thread that spawned QEMU is gone: PR_SET_PDEATHSIG kills QEMU.
    let mut status = 0;
    let deadline = std::time::Instant::now() + QMP_TIMEOUT;
    loop {
        // SAFETY: waitpid on our own child with a valid status pointer.
        let r = unsafe { libc::waitpid(pid as i32, &mut status, libc::WNOHANG) };
        if r == pid as i32 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "QEMU outlived the thread that spawned it");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL, "status {status:#x}");
    drop(qmp_end);
}

#[test]
fn qemu_holds_only_the_listed_descriptors() {
    if no_qemu() {
        return;
    }
    // std's descriptors are close-on-exec already; make one that is not.
    let (leak_r, _leak_w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::empty()).unwrap();
    let leak = format!("pipe:[{}]", rustix::fs::fstat(&leak_r).unwrap().st_ino);
    let mut vm = start(|_| {});
    let mut seen = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{}/fd", vm.qemu.pid)).unwrap() {
        let target = std::fs::read_link(e.unwrap().path()).unwrap();
        seen.push(target.to_string_lossy().into_owned());
    }
    assert!(!seen.contains(&leak), "QEMU inherited an unlisted descriptor: {seen:?}");
    assert!(seen.iter().any(|t| t.starts_with("/memfd:fido-vm-arena")), "{seen:?}");
    vm.alive();
}

#[test]
fn the_default_ports_get_their_windows_and_take_a_largest_arena() {
    if no_qemu() {
        return;
    }
    // VmSpec::new's sizes: 8 ports of 1 GiB beside a 64 MiB arena.
    let defaults = VmSpec::new("x", Accel::Tcg);
    let mut vm = start(|s| {
        s.paused = false;
        s.ports = defaults.ports;
        s.max_peer_arena = defaults.max_peer_arena;
        s.arena_len = defaults.arena_len;
    });
    wait_for_bridges(&mut vm.qmp, 1 << 30);
    let big = memfd(1 << 30);
    seal(&big);
    let big = reopen(&big, rustix::fs::OFlags::RDONLY);
    hotplug::plug_arena(&mut vm.qmp, 7, big.as_fd(), 1 << 30, vm.spec.max_peer_arena).unwrap();
    let (_, bridges) = pci(&mut vm.qmp);
    assert_eq!(bridges.iter().find(|b| b.0 == "fido-port7").unwrap().1.len(), 1);
    vm.alive();
}

#[test]
fn large_windows_fit_the_raised_64_bit_hole() {
    if no_qemu() {
        return;
    }
    // 16 ports of 8 GiB: over q35's default 32 GiB hole, which VmSpec raises.
    let mut vm = start(|s| {
        s.paused = false;
        s.ports = 16;
        s.max_peer_arena = 8 << 30;
    });
    assert!(vm.spec.args().unwrap().iter().any(|a| a.starts_with("q35-pcihost.pci-hole64-size=")));
    wait_for_bridges(&mut vm.qmp, 8 << 30);
    vm.alive();
}

/// The tests' plain guests (fido-test-support, which cannot depend on this
/// crate) run the CPU model `fido vm run` gives a TCG guest, and the spec
/// passes it to QEMU.
#[test]
fn every_tcg_guest_gets_the_same_cpu_model() {
    assert_eq!(fido_test_support::vm::TCG_CPU, fido_vm::qemu::TCG_CPU);
    let spec = VmSpec::new("cpu-model", Accel::Tcg);
    let args = spec.args().unwrap();
    assert!(args.windows(2).any(|w| w[0] == "-cpu" && w[1] == fido_vm::qemu::TCG_CPU), "{args:?}");
}

/// A TCG guest always has two possible CPUs or more (else QEMU drops its
/// memory barriers), in `fido vm run` and in the tests' plain guests alike;
/// a KVM guest gets the CPUs asked for.
#[test]
fn every_tcg_guest_has_two_possible_cpus() {
    for cpus in [1, 2, 3] {
        assert_eq!(fido_test_support::vm::tcg_smp(cpus), fido_vm::qemu::tcg_smp(cpus));
    }
    assert_eq!(fido_vm::qemu::tcg_smp(1), "1,maxcpus=2");
    assert_eq!(fido_vm::qemu::tcg_smp(4), "4,maxcpus=4");
    let smp = |accel| {
        let args = VmSpec::new("smp", accel).args().unwrap();
        let i = args.iter().position(|a| a == "-smp").expect("-smp");
        args[i + 1].clone()
    };
    assert_eq!(smp(Accel::Tcg), "1,maxcpus=2");
    assert_eq!(smp(Accel::Kvm), "1");
}
