//! The host side with a real guest (the test image of scripts/vm-image.sh,
//! booted once for the whole binary): a hot-plugged peer arena appears under
//! its root port, read-only, and unplugs quickly; the doorbell rings a host
//! peer; and the guard frees a VM whose peer made its doorbell blocking.

use fido_test_support::raw::{memfd, reopen, seal};
use fido_test_support::vm::{self, Console, BOOT_TIMEOUT};
use fido_vm::hotplug;
use fido_vm::qemu::{launch, Accel, VmSpec};
use fido_vm::qmp::{Qmp, QmpError};
use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
use serde_json::Value;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

const CMD: Duration = Duration::from_secs(60);
const QMP_TIMEOUT: Duration = Duration::from_secs(30);

fn pair() -> (OwnedFd, OwnedFd) {
    socketpair(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK, None).unwrap()
}

/// A guest shell snippet that waits (up to 20 s) for the device under root
/// port `port` and prints its sysfs directory.
fn child_of(port: &str) -> String {
    format!("i=0; while [ $i -lt 200 ]; do for d in /sys/bus/pci/devices/{port}/0000:*:00.0; do [ -e $d/device ] && echo $d && i=999; done; [ $i = 999 ] && break; i=$((i+1)); sleep 0.1; done")
}

/// The start address of BAR `bar` of a guest device, in hex.
fn bar(c: &mut Console, dev: &str, bar: usize) -> u64 {
    let lines = c.run_ok(&format!("cat {dev}/resource"), CMD);
    let start = lines.lines().nth(bar).unwrap().split_whitespace().next().unwrap().to_string();
    u64::from_str_radix(start.trim_start_matches("0x"), 16).unwrap()
}

/// Waits (up to a minute) until QEMU stops answering QMP within 2 s: its
/// vCPU is blocked holding the big lock. Leaves QMP's timeout at 2 s.
fn wait_frozen(qmp: &mut Qmp) -> bool {
    qmp.set_timeout(Duration::from_secs(2));
    let deadline = Instant::now() + CMD;
    while Instant::now() < deadline {
        if let Err(QmpError::Timeout { .. }) = qmp.execute("query-status", Value::Null) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

#[test]
fn hot_plug_doorbells_and_the_guard_with_a_guest() {
    if !vm::qemu_available() {
        eprintln!("SKIPPED: qemu-system-x86_64 is not installed");
        return;
    }
    let image = vm::image();
    let dir = tempfile::tempdir().unwrap();
    let mut spec = VmSpec::new("fido-vm-guest", Accel::Tcg);
    spec.kernel = Some(image.kernel.clone());
    spec.initrd = Some(image.initrd.clone());
    spec.append = image.cmdline.clone();
    spec.serial = Some(dir.path().join("console.sock"));
    spec.arena_len = 1 << 20;
    spec.ports = 2;
    spec.max_peer_arena = 2 << 20;
    spec.vectors = 8;
    let started = Instant::now();
    let launched = launch(&spec, None, QMP_TIMEOUT).unwrap_or_else(|e| panic!("{e}"));
    let (mut qemu, mut qmp, mut bell) = (launched.qemu, launched.qmp, launched.doorbell);
    let mut c = Console::connect(spec.serial.as_ref().unwrap(), Duration::from_secs(10)).unwrap();
    c.wait_for_shell(BOOT_TIMEOUT).unwrap_or_else(|e| panic!("{e}\n{}\n{}", c.transcript(), qemu.stderr_tail()));
    assert_eq!(launched.welcome.ports, ["0000:00:10.0", "0000:00:10.1"]);
    eprintln!("boot to shell: {:.1?}", started.elapsed());

    // The guest sees its own devices where the Welcome says.
    let ids = c.run_ok("cat /sys/bus/pci/devices/0000:00:04.0/vendor /sys/bus/pci/devices/0000:00:04.0/device /sys/bus/pci/devices/0000:00:05.0/device", CMD);
    assert_eq!(ids.split_whitespace().collect::<Vec<_>>(), ["0x1af4", "0x1110", "0x1110"]);

    // Hot-plug a sealed peer arena read-only under port 1.
    let peer = memfd(1 << 20);
    rustix::io::pwrite(&peer, &0x1234_5678u32.to_le_bytes(), 0).unwrap();
    seal(&peer);
    let ro = reopen(&peer, rustix::fs::OFlags::RDONLY);
    let t = Instant::now();
    hotplug::plug_arena(&mut qmp, 1, ro.as_fd(), 1 << 20, spec.max_peer_arena).unwrap();
    let dev = c.run_ok(&child_of("0000:00:10.1"), CMD).trim().to_string();
    eprintln!("plugged arena visible in the guest after {:.2?}: {dev}", t.elapsed());
    assert!(dev.starts_with("/sys/bus/pci/devices/0000:00:10.1/0000:"), "no device under port 1: {dev:?}\n{}", c.transcript());
    let ids = c.run_ok(&format!("cat {dev}/vendor {dev}/device"), CMD);
    assert_eq!(ids.split_whitespace().collect::<Vec<_>>(), ["0x1af4", "0x1110"]);
    let bar2 = bar(&mut c, &dev, 2);
    let size = c.run_ok(&format!("sed -n 3p {dev}/resource"), CMD);
    let f: Vec<u64> = size.split_whitespace().map(|x| u64::from_str_radix(x.trim_start_matches("0x"), 16).unwrap()).collect();
    assert_eq!(f[1] + 1 - f[0], 1 << 20, "BAR 2 is the arena's length");
    // The guest reads the peer's bytes and its writes are dropped.
    c.run_ok(&format!("echo 1 > {dev}/enable"), CMD);
    let word = c.run_ok(&format!("devmem {bar2:#x} 32"), CMD);
    assert_eq!(word.trim().to_lowercase(), "0x12345678");
    c.run_ok(&format!("devmem {bar2:#x} 32 0xdeadbeef"), CMD);
    let word = c.run_ok(&format!("devmem {bar2:#x} 32"), CMD);
    assert_eq!(word.trim().to_lowercase(), "0x12345678", "a guest write reached a read-only arena");
    let mut host = [0u8; 4];
    rustix::io::pread(&peer, &mut host, 0).unwrap();
    assert_eq!(u32::from_le_bytes(host), 0x1234_5678);

    // Unplug: fast, and the device is gone from the guest; the port takes a
    // new arena afterwards.
    c.run_ok(&format!("echo 0 > {dev}/enable"), CMD);
    let t = Instant::now();
    hotplug::unplug(&mut qmp, 1, Duration::from_secs(30)).unwrap();
    let took = t.elapsed();
    eprintln!("unplug took {took:.2?}");
    assert!(took < Duration::from_secs(10), "unplug took {took:?}");
    let gone = c.run_ok("ls -d /sys/bus/pci/devices/0000:00:10.1/0000:*:00.0 2>/dev/null; true", CMD);
    assert!(gone.trim().is_empty(), "still there: {gone}");
    // QEMU 7.2 was seen to exit when the port was plugged again 10 ms after
    // its unplug (once, in a fresh-clone CI run; cause not found): the
    // supervisor's port allocator reuses a port last, and this waits.
    std::thread::sleep(Duration::from_secs(1));
    hotplug::plug_arena(&mut qmp, 1, ro.as_fd(), 1 << 20, spec.max_peer_arena)
        .unwrap_or_else(|e| panic!("re-plug: {e}; QEMU said: {}", qemu.stderr_tail()));
    assert!(c.run_ok(&child_of("0000:00:10.1"), CMD).contains("0000:00:10.1/0000:"));

    // The doorbell: the guest rings host peer 1 (vector 0) through BAR0 + 12.
    let (wait, ring) = pair();
    let id = bell.add_peer(ring.as_fd()).unwrap();
    let doorbell = bar(&mut c, "/sys/bus/pci/devices/0000:00:05.0", 0) + 12;
    c.run_ok("echo 1 > /sys/bus/pci/devices/0000:00:05.0/enable", CMD);
    let value = (id as u32) << 16;
    c.run_ok(&format!("devmem {doorbell:#x} 32 {value:#x}"), CMD);
    let mut buf = [0u8; 64];
    let deadline = Instant::now() + CMD;
    let got = loop {
        match rustix::net::recv(&wait, &mut buf[..], rustix::net::RecvFlags::DONTWAIT) {
            Ok((n, _)) => break n,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("the host peer was never rung: {e}"),
        }
    };
    assert_eq!(got, 8, "QEMU writes an 8-byte eventfd value");
    assert!(bell.check_peers().is_empty(), "a well-behaved peer is left alone");

    // The other way: a host peer rings the VM's own vector 3 by sending a
    // byte on its ring end (a socket pair: QEMU polls and reads its end). With
    // MSI-X enabled and the function masked (no driver here), the vector's
    // pending bit shows it.
    let cfg = "/sys/bus/pci/devices/0000:00:05.0/config";
    let cap = c.run_ok(&format!("p=$(( $(od -An -tu1 -j52 -N1 {cfg}) )); while [ $p -ne 0 ]; do [ $(( $(od -An -tu1 -j$p -N1 {cfg}) )) -eq 17 ] && break; p=$(( $(od -An -tu1 -j$((p+1)) -N1 {cfg}) )); done; echo $p $(( $(od -An -tu4 -j$((p+8)) -N4 {cfg}) ))"), CMD);
    let nums: Vec<u64> = cap.split_whitespace().map(|x| x.parse().unwrap()).collect();
    let (msix, pba) = (nums[0], nums[1]);
    assert_ne!(msix, 0, "no MSI-X capability");
    c.run_ok(&format!("printf '\\300' | dd of={cfg} bs=1 seek={} count=1 conv=notrunc 2>/dev/null", msix + 3), CMD);
    let control = c.run_ok(&format!("od -An -tu1 -j{} -N1 {cfg}", msix + 3), CMD);
    assert_eq!(control.trim().parse::<u8>().unwrap() & 0xc0, 0xc0, "MSI-X enabled, function masked");
    let pba_addr = bar(&mut c, "/sys/bus/pci/devices/0000:00:05.0", (pba & 7) as usize) + (pba & !7);
    let pending = |c: &mut Console| u64::from_str_radix(c.run_ok(&format!("devmem {pba_addr:#x} 32"), CMD).trim().trim_start_matches("0x"), 16).unwrap();
    assert_eq!(pending(&mut c), 0, "no vector pending before the ring");
    rustix::net::send(bell.own_ring_end(3).unwrap(), &[1u8], rustix::net::SendFlags::DONTWAIT).unwrap();
    let deadline = Instant::now() + CMD;
    while pending(&mut c) != 1 << 3 {
        assert!(Instant::now() < deadline, "own vector 3 never became pending");
        std::thread::sleep(Duration::from_millis(50));
    }

    // The attack: the peer makes its ring end blocking, shrinks its buffer
    // and never reads. The guest's rings fill it and QEMU's vCPU blocks in
    // write() holding the big lock: the VM (and its QMP) freezes...
    rustix::net::sockopt::set_socket_send_buffer_size(&ring, 4096).unwrap();
    rustix::io::ioctl_fionbio(&ring, false).unwrap();
    c.run_ok(&format!("( (i=0; while [ $i -lt 200 ]; do devmem {doorbell:#x} 32 {value:#x}; i=$((i+1)); done; echo RINGS-DONE > /dev/ttyS0) >/dev/null 2>&1 &)"), CMD);
    assert!(wait_frozen(&mut qmp), "the attack did not block QEMU: the test proves nothing\n{}", c.transcript());
    // ... until the guard cuts the peer. Here a new peer arrives first: QEMU,
    // frozen, cannot take its descriptor, so add_peer cuts the blocking peer
    // while it waits, and succeeds; check_peers then reports the cut.
    let (_wait2, ring2) = pair();
    let t = Instant::now();
    let id2 = bell.add_peer(ring2.as_fd()).unwrap();
    eprintln!("add_peer during the freeze took {:.2?}", t.elapsed());
    assert_ne!(id2, id);
    assert_eq!(bell.check_peers(), vec![id]);
    assert_eq!(bell.peers().collect::<Vec<_>>(), vec![id2]);
    qmp.set_timeout(QMP_TIMEOUT);
    let status = qmp.execute("query-status", Value::Null).unwrap();
    assert_eq!(status["status"], "running");
    let deadline = Instant::now() + CMD;
    while !c.transcript().contains("RINGS-DONE") {
        assert!(Instant::now() < deadline, "the guest's ring loop never finished\n{}", c.transcript());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(c.run_ok("echo alive", CMD).trim(), "alive");
    drop(wait);

    // The cleverer attack: the peer clears O_NONBLOCK only until QEMU's write
    // has blocked, then sets it back. The flag looks right, but the queue
    // stays full: the guard cuts a peer whose queue is full at two checks in
    // a row.
    let (_wait3, ring3) = pair();
    rustix::net::sockopt::set_socket_send_buffer_size(&ring3, 4096).unwrap();
    let id3 = bell.add_peer(ring3.as_fd()).unwrap();
    rustix::io::ioctl_fionbio(&ring3, false).unwrap();
    let value3 = (id3 as u32) << 16;
    c.run_ok(&format!("( (i=0; while [ $i -lt 200 ]; do devmem {doorbell:#x} 32 {value3:#x}; i=$((i+1)); done; echo RINGS3-DONE > /dev/ttyS0) >/dev/null 2>&1 &)"), CMD);
    assert!(wait_frozen(&mut qmp), "the toggling attack did not block QEMU: the test proves nothing");
    rustix::io::ioctl_fionbio(&ring3, true).unwrap();
    assert!(matches!(qmp.execute("query-status", Value::Null), Err(QmpError::Timeout { .. })), "still frozen with the flag set back");
    assert!(bell.check_peers().is_empty(), "first sight of a full queue: not yet");
    assert_eq!(bell.check_peers(), vec![id3], "full twice: cut");
    qmp.set_timeout(QMP_TIMEOUT);
    assert_eq!(qmp.execute("query-status", Value::Null).unwrap()["status"], "running");
    let deadline = Instant::now() + CMD;
    while !c.transcript().contains("RINGS3-DONE") {
        assert!(Instant::now() < deadline, "the second ring loop never finished\n{}", c.transcript());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(bell.peers().collect::<Vec<_>>(), vec![id2]);
    assert!(qemu.try_wait().unwrap().is_none());
}
